import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.data.shards import DataError, PackedRows
from pipeline.training.sampler import GlobalOrder, eval_rows


def write_split(d, rows, starts, labels=None, shards=2):
    d.mkdir(parents=True)
    width = len(rows[0])
    per = -(-len(rows) // shards)
    for s in range(shards):
        chunk = rows[s * per:(s + 1) * per]
        cols = {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(chunk), pa.int32()), width),
            "doc_starts": pa.array(starts[s * per:(s + 1) * per], pa.list_(pa.int32())),
        }
        if labels is not None:
            cols["labels"] = pa.FixedSizeListArray.from_arrays(
                pa.array(np.concatenate(labels[s * per:(s + 1) * per]), pa.int32()), width)
        table = pa.table(cols)
        with pa.ipc.new_file(str(d / f"shard-{s:05d}.arrow"), table.schema) as w:
            w.write_table(table)
    return d


def test_rows_batch_and_segments(tmp_path):
    rows = [np.arange(i * 9, i * 9 + 9) for i in range(5)]
    starts = [[0], [0, 3], [0, 2, 7], [0], [0, 8]]
    data = PackedRows(write_split(tmp_path / "train", rows, starts))
    assert len(data) == 5 and data.seq_len == 8
    b = data.batch(np.array([2, 1]), torch.device("cpu"))
    assert b["input_ids"].tolist()[0] == list(range(18, 26))
    assert b["targets"].tolist()[0] == list(range(19, 27))
    assert b["segment_ids"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1, 1, 1]]
    assert "segment_ids" not in data.batch(np.array([0]), torch.device("cpu"), doc_mask=False)


def test_labels_column_is_used_for_targets(tmp_path):
    rows = [np.arange(5), np.arange(5, 10)]
    labels = [np.array([-100, -100, 2, 3, 4]), np.array([-100, 6, 7, -100, -100])]
    data = PackedRows(write_split(tmp_path / "sft", rows, [[0], [0]], labels=labels, shards=1))
    b = data.batch(np.array([0, 1]), torch.device("cpu"))
    assert b["targets"].tolist() == [[-100, 2, 3, 4], [6, 7, -100, -100]]


def test_rows_span_shards_without_copying_them(tmp_path):
    rows = [np.arange(i * 5, i * 5 + 5) for i in range(7)]
    data = PackedRows(write_split(tmp_path / "s", rows, [[0]] * 7, shards=3))
    assert len(data.shards) == 3 and len(data) == 7
    assert data.input_ids(np.array([6, 0, 3])).tolist() == [rows[6].tolist(), rows[0].tolist(), rows[3].tolist()]
    assert all(not sh.input_ids.flags.owndata for sh in data.shards)  # views of the memory map
    assert sum(len(b) for b in data.iter_input_ids(chunk=2)) == 7
    with pytest.raises(IndexError):
        data.input_ids(np.array([7]))


def test_missing_split_is_clear(tmp_path):
    with pytest.raises(DataError, match="run the pack stage"):
        PackedRows(tmp_path)


def collect(order, steps):
    return [np.concatenate(order.next_step()) for _ in range(steps)]


def test_global_order_same_rows_for_any_split_over_ranks():
    one = GlobalOrder(100, seed=3, micro_batch=4, grad_accum=2, world_size=1, rank=0)
    r0 = GlobalOrder(100, seed=3, micro_batch=4, grad_accum=1, world_size=2, rank=0)
    r1 = GlobalOrder(100, seed=3, micro_batch=4, grad_accum=1, world_size=2, rank=1)
    for a, b, c in zip(collect(one, 30), collect(r0, 30), collect(r1, 30)):
        assert set(a) == set(b) | set(c)  # same rows in each step
        assert not set(b) & set(c)  # no rank sees another rank's rows


def test_global_order_epochs_and_state_roundtrip():
    o = GlobalOrder(10, seed=1, micro_batch=3, grad_accum=1, world_size=1, rank=0)
    first_epoch = collect(o, 3)
    assert len(set(np.concatenate(first_epoch))) == 9  # tail of 1 row skipped
    state = o.state_dict()
    ahead = collect(o, 5)
    o2 = GlobalOrder(10, seed=1, micro_batch=3, grad_accum=1, world_size=1, rank=0)
    o2.load_state_dict(state)
    assert [x.tolist() for x in collect(o2, 5)] == [x.tolist() for x in ahead]
    assert state == {"epoch": 0, "consumed": 9, "seed": 1}
    # epochs reshuffle
    assert collect(GlobalOrder(10, 1, 9, 1, 1, 0), 2)[1].tolist() != collect(GlobalOrder(10, 1, 9, 1, 1, 0), 1)[0].tolist()


def test_global_batch_larger_than_split_and_seed_mismatch():
    with pytest.raises(DataError, match="needs 16 rows"):
        GlobalOrder(10, seed=0, micro_batch=8, grad_accum=1, world_size=2, rank=0)
    o = GlobalOrder(10, seed=0, micro_batch=2, grad_accum=1, world_size=1, rank=0)
    with pytest.raises(DataError, match="seed"):
        o.load_state_dict({"epoch": 0, "consumed": 0, "seed": 9})


def test_eval_rows_partition():
    parts = [eval_rows(11, None, 3, r) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(11))
    assert eval_rows(11, 4, 1, 0).tolist() == [0, 1, 2, 3]
