import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.data.shards import (
    MANIFEST,
    DataError,
    PackedRows,
    ShardWriter,
    clear_outputs,
    read_manifest,
    row_schema,
    split_counts,
    verify,
    write_manifest,
)
from pipeline.files import sha256_file


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


def test_missing_split_names_the_stage_that_writes_it(tmp_path, monkeypatch):
    """data/packed is pack's, data/sft sft's (evaluate reads both); any other folder names no stage."""
    monkeypatch.chdir(tmp_path)
    for split, stage in (("data/packed/val", "pack"), ("data/sft/val", "sft"), (tmp_path / "data/sft/train", "sft")):
        with pytest.raises(DataError, match=rf"^no \*.arrow shards in {split}; run `dvc repro {stage}` first$"):
            PackedRows(split)
    with pytest.raises(DataError, match=r"shards in elsewhere/val; the stage that writes it has not completed$"):
        PackedRows("elsewhere/val")


def test_a_shard_cut_short_is_one_line_naming_it_and_its_stage(tmp_path, monkeypatch):
    """A truncated or overwritten shard stopped evaluate (and training) in pyarrow's traceback."""
    monkeypatch.chdir(tmp_path)
    write_split(tmp_path / "data/sft/val", [np.arange(5), np.arange(5)], [[0], [0]])
    shard = tmp_path / "data/sft/val/shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:300])
    with pytest.raises(DataError, match=r"^\S*data/sft/val/shard-00000.arrow: not a readable Arrow shard \(.+\); "
                                        r"run `dvc repro sft` to write it again$"):
        PackedRows("data/sft/val")


def offsets_of(starts):
    return np.cumsum([0] + [len(s) for s in starts]), np.array([p for s in starts for p in s], np.int32)


def write_format(out, tok_path, rows, starts, labels=None, shard_rows=2):
    """One split ``train`` written with ShardWriter, and its manifest."""
    schema = row_schema("test/1", rows.shape[1], labels=labels is not None, metadata={"x": "1"})
    writer = ShardWriter(out, "train", schema)
    offsets, values = offsets_of(starts)
    for lo in range(0, len(rows), shard_rows):
        hi = min(lo + shard_rows, len(rows))
        writer.write(rows[lo:hi], offsets[lo:hi + 1], values, None if labels is None else labels[lo:hi])
    splits = {"train": {"rows": writer.rows, "shards": writer.shards}}
    write_manifest(out, fmt="test/1", seq_len=rows.shape[1] - 1, vocab_size=9, special_ids={"eot": 0, "pad": 1},
                   tokenizer_path=tok_path, labels=labels is not None, fields={"seed": 1}, splits=splits)
    return writer


def test_writer_round_trip_through_the_reader(tmp_path, tok_path):
    rows = np.arange(5 * 6, dtype=np.int32).reshape(5, 6)
    starts = [[0], [0, 2], [0, 1, 5], [0], [0, 3]]
    labels = np.where(rows % 3 == 0, -100, rows).astype(np.int32)
    writer = write_format(tmp_path, tok_path, rows, starts, labels)
    assert [s["path"] for s in writer.shards] == [f"train/shard-0000{i}.arrow" for i in range(3)]
    data = PackedRows(tmp_path / "train")
    assert len(data) == 5 and data.row_len == 6 and data.seq_len == 5 and data.has_labels
    every = np.arange(5)
    np.testing.assert_array_equal(data.input_ids(every), rows)
    np.testing.assert_array_equal(data.labels(every), labels)
    want = [np.cumsum(np.isin(np.arange(6), s)) - 1 for s in starts]
    np.testing.assert_array_equal(data.segment_ids(every), want)
    b = data.batch(np.array([2]), torch.device("cpu"))
    assert b["targets"].tolist() == [labels[2, 1:].tolist()] and b["segment_ids"].tolist() == [[0, 1, 1, 1, 1]]
    schema = pa.ipc.open_file(str(tmp_path / writer.shards[0]["path"])).schema
    assert schema.names == ["input_ids", "labels", "doc_starts"]
    assert schema.metadata == {b"format": b"test/1", b"row_len": b"6", b"x": b"1"}


def test_manifest_lists_shards_with_their_sha256(tmp_path, tok_path):
    rows = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    write_format(tmp_path, tok_path, rows, [[0]] * 3)
    m = read_manifest(tmp_path, "test/1")
    assert list(m)[:4] == ["format", "seq_len", "row_len", "dtype"] and list(m)[-1] == "splits"
    assert "ignore_index" not in m and m["seed"] == 1 and m["tokenizer_sha256"] == sha256_file(tok_path)
    for entry in m["splits"]["train"]["shards"]:
        assert sha256_file(tmp_path / entry["path"]) == entry["sha256"]
    assert [e["rows"] for e in m["splits"]["train"]["shards"]] == [2, 1]
    assert verify(tmp_path, "test/1") == m
    assert split_counts(m["splits"]) == {"train": {"rows": 3, "shards": 2}}
    with pytest.raises(DataError, match="expected 'other/1'"):
        read_manifest(tmp_path, "other/1")
    m["splits"]["train"]["shards"][1]["rows"] = 2
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="1 rows of 4 tokens, manifest says 2 rows of 4"):
        verify(tmp_path, sha256=False)
    (tmp_path / "train" / "shard-00009.arrow").write_bytes(b"stray")
    with pytest.raises(DataError, match="does not list"):
        verify(tmp_path)
    clear_outputs(tmp_path, ["train"])
    assert not (tmp_path / MANIFEST).exists() and not list(tmp_path.rglob("*.arrow"))


def test_a_failed_write_leaves_no_shard_under_its_final_name(tmp_path, monkeypatch):
    writer = ShardWriter(tmp_path, "train", row_schema("test/1", 4))
    one = np.zeros((1, 4), np.int32)
    writer.write(one, np.array([0, 1]), np.array([0]))
    seen = {}
    real = pa.ipc.new_file

    def failing(sink, schema):
        w = real(sink, schema)
        w.write_batch(pa.record_batch([pa.array([[1, 2, 3, 4]], pa.list_(pa.int32(), 4)),
                                       pa.array([[0]], pa.list_(pa.int32()))], schema=schema))
        seen["final"] = (tmp_path / "train" / "shard-00001.arrow").exists()
        seen["tmp"] = [p.name for p in (tmp_path / "train").glob(".shard-00001.arrow.*.tmp")]
        raise OSError("disk full")

    monkeypatch.setattr(pa.ipc, "new_file", failing)
    with pytest.raises(OSError, match="disk full"):
        writer.write(one, np.array([0, 1]), np.array([0]))
    assert seen == {"final": False, "tmp": [seen["tmp"][0]]}  # written under a temporary name only
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["shard-00000.arrow"]
    assert len(writer.shards) == 1


@pytest.mark.parametrize("ids, offsets, values, labels, msg", [
    (np.zeros((2, 4), np.int64), [0, 1, 2], [0, 0], None, "int32"),
    (np.zeros((2, 5), np.int32), [0, 1, 2], [0, 0], None, r"\(rows, 4\)"),
    (np.zeros((0, 4), np.int32), [0], [], None, "non-empty"),
    (np.zeros((2, 4), np.int32), [0, 1], [0], None, "needs 3 entries"),
    (np.zeros((2, 4), np.int32), [0, 1, 1], [0], None, "begin with 0"),
    (np.zeros((2, 4), np.int32), [0, 1, 2], [0, 2], None, "begin with 0"),
    (np.zeros((2, 4), np.int32), [0, 1, 2], [0, 0], np.zeros((2, 4), np.int32), "labels must be given"),
])
def test_writer_rejects_bad_input(tmp_path, ids, offsets, values, labels, msg):
    writer = ShardWriter(tmp_path, "train", row_schema("test/1", 4))
    with pytest.raises(ValueError, match=msg):
        writer.write(ids, np.array(offsets), np.array(values, np.int32), labels)
    assert not (tmp_path / "train").exists() or not list((tmp_path / "train").iterdir())


def add_unlabelled_shard(path, row_len):
    """A shard of one row of ``row_len`` tokens, no labels, written by hand beside a split's own."""
    table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(row_len), pa.int32()),
                                                                     row_len),
                      "doc_starts": pa.array([[0]], pa.list_(pa.int32()))})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)


def test_reader_rejects_bad_shards(tmp_path):
    write_split(tmp_path / "a", [np.arange(5), np.arange(5)], [[0], [0]], shards=2)
    add_unlabelled_shard(tmp_path / "a" / "shard-00002.arrow", row_len=6)
    with pytest.raises(DataError, match="different row lengths"):
        PackedRows(tmp_path / "a")
    wide = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(5), pa.int64()), 5)
    for name, cols, msg in [("b", {"input_ids": wide}, "no column 'doc_starts'"),
                            ("c", {"input_ids": wide, "doc_starts": pa.array([[0]], pa.list_(pa.int32()))},
                             "must be int32")]:
        (tmp_path / name).mkdir()
        table = pa.table(cols)
        with pa.ipc.new_file(str(tmp_path / name / "shard-00000.arrow"), table.schema) as w:
            w.write_table(table)
        with pytest.raises(DataError, match=msg):
            PackedRows(tmp_path / name)


def test_a_writer_with_a_shard_log_writes_the_same_shards_and_commits_each(tmp_path):
    from pipeline.data.resume import ShardLog

    schema = row_schema("test/1", 4)
    rows = np.arange(24, dtype=np.int32).reshape(6, 4)
    offsets, starts = np.arange(7, dtype=np.int32), np.zeros(6, np.int32)
    plain = ShardWriter(tmp_path / "a", "train", schema)
    log = ShardLog(tmp_path / "b" / "train", "fp", ext=".arrow")
    logged = ShardWriter(tmp_path / "b", "train", schema, log)
    for w in (plain, logged):
        w.write(rows[:4], offsets[:5], starts)
        w.write(rows[4:], offsets[4:], starts)
    assert plain.shards == logged.shards
    for e in logged.shards:
        assert (tmp_path / "a" / e["path"]).read_bytes() == (tmp_path / "b" / e["path"]).read_bytes()
    assert ShardLog(tmp_path / "b" / "train", "fp", ext=".arrow").open().keys() == {0, 1}
    assert [log.committed(k)["rows"] for k in (0, 1)] == [4, 2]
    # the records beside the shards are no shards: the reader and verify pass them over
    for d in ("a", "b"):
        write_manifest(tmp_path / d, fmt="test/1", seq_len=3, vocab_size=50, special_ids={"eot": 0, "pad": 1},
                       tokenizer_path=tmp_path / "a" / "train" / "shard-00000.arrow", labels=False, fields={},
                       splits={"train": {"rows": 6, "shards": plain.shards}})
        verify(tmp_path / d, "test/1")
        assert len(PackedRows(tmp_path / d / "train")) == 6
    clear_outputs(tmp_path / "b", ["train"])
    assert not list((tmp_path / "b" / "train").iterdir())


def test_verify_catches_a_shard_of_the_right_shape_with_other_tokens(tmp_path, tok_path):
    """Same rows, same row length, other bytes: only the digest tells, and only when asked to check it."""
    rows = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    write_format(tmp_path, tok_path, rows, [[0]] * 3)
    manifest = (tmp_path / MANIFEST).read_bytes()
    other = rows.copy()
    other[0, 1] = 7
    write_format(tmp_path / "other", tok_path, other, [[0]] * 3)
    (tmp_path / "train" / "shard-00000.arrow").write_bytes((tmp_path / "other/train/shard-00000.arrow").read_bytes())
    assert (tmp_path / MANIFEST).read_bytes() == manifest
    assert verify(tmp_path, sha256=False)["splits"]["train"]["rows"] == 3
    with pytest.raises(DataError, match=r"train/shard-00000.arrow: sha256 does not match the manifest$"):
        verify(tmp_path)


def test_a_negative_row_index_is_refused_not_read_from_the_end(tmp_path):
    data = PackedRows(write_split(tmp_path / "s", [np.arange(i * 5, i * 5 + 5) for i in range(4)], [[0]] * 4))
    for rows in ([-1], [0, -4], [4]):
        with pytest.raises(IndexError, match="out of range for 4 rows"):
            data.input_ids(np.array(rows))


def test_a_split_whose_shards_disagree_on_labels_is_refused(tmp_path):
    write_split(tmp_path / "a", [np.arange(5)], [[0]], labels=[np.arange(5)], shards=1)
    add_unlabelled_shard(tmp_path / "a" / "shard-00001.arrow", row_len=5)
    with pytest.raises(DataError, match="some shards have a labels column and some do not"):
        PackedRows(tmp_path / "a")


def test_writer_rejects_labels_that_do_not_match_the_rows(tmp_path):
    writer = ShardWriter(tmp_path, "train", row_schema("test/1", 4, labels=True))
    ids = np.zeros((2, 4), np.int32)
    for labels in (np.zeros((2, 3), np.int32), np.zeros((2, 4), np.int64)):
        with pytest.raises(ValueError, match="labels must match input_ids"):
            writer.write(ids, np.array([0, 1, 2]), np.array([0, 0], np.int32), labels)


def test_the_manifest_names_the_eot_and_pad_ids_and_the_ignore_index_with_labels(tmp_path, tok_path):
    rows = np.arange(2 * 4, dtype=np.int32).reshape(2, 4)
    write_format(tmp_path, tok_path, rows, [[0]] * 2, labels=rows.copy())
    m = read_manifest(tmp_path)
    assert (m["eot_id"], m["pad_id"], m["special_ids"], m["ignore_index"]) == (0, 1, {"eot": 0, "pad": 1}, -100)


def test_clear_outputs_keeps_a_users_directory_named_like_a_shard_and_says_so(tmp_path, tok_path):
    """A directory is no shard the stage wrote: unlink's IsADirectoryError was a traceback, and removing it
    would lose what the user keeps there."""
    rows = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    write_format(tmp_path, tok_path, rows, [[0]] * 3)
    (tmp_path / "train" / "notes.txt").write_text("mine")
    clear_outputs(tmp_path, ["train"])
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["notes.txt"]  # a user's file stays
    (tmp_path / "train" / "shard-00000.arrow").mkdir()
    (tmp_path / "train" / "shard-00000.arrow" / "keep").write_text("mine")
    with pytest.raises(DataError, match=r"train/shard-00000.arrow is a directory where a shard belongs; it is not "
                                        r"removed"):
        clear_outputs(tmp_path, ["train"])
    assert (tmp_path / "train" / "shard-00000.arrow" / "keep").read_text() == "mine"


def test_clear_outputs_removes_a_link_named_like_a_shard_but_not_its_target(tmp_path):
    (tmp_path / "train").mkdir()
    target = tmp_path / "elsewhere.arrow"
    target.write_bytes(b"a user's file")
    (tmp_path / "train" / "shard-00000.arrow").symlink_to(target)
    (tmp_path / "train" / "shard-00001.arrow").symlink_to(tmp_path / "train")  # a link to a directory: a link
    clear_outputs(tmp_path, ["train"])
    assert list((tmp_path / "train").iterdir()) == [] and target.read_bytes() == b"a user's file"


def test_a_directory_named_like_a_shard_is_one_line_for_the_reader(tmp_path):
    d = write_split(tmp_path / "s", [np.arange(5)] * 2, [[0]] * 2)
    (d / "shard-00002.arrow").mkdir()
    with pytest.raises(DataError, match=r"shard-00002.arrow: not a file, where a shard belongs$"):
        PackedRows(d)


@pytest.mark.parametrize("edit", [lambda m: [m], lambda m: {k: v for k, v in m.items() if k != "splits"},
                                  lambda m: {**m, "splits": {"train": {"rows": 3}}},
                                  lambda m: {**m, "splits": {"train": {"shards": [{"rows": 2}]}}},
                                  lambda m: {**m, "splits": {"train": {"shards": 5}}},
                                  lambda m: {**m, "splits": ["train"]}])
def test_verify_names_a_manifest_edited_out_of_its_format_in_one_line(tmp_path, tok_path, edit):
    rows = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    write_format(tmp_path, tok_path, rows, [[0]] * 3)
    (tmp_path / MANIFEST).write_text(json.dumps(edit(read_manifest(tmp_path))))
    with pytest.raises(DataError, match=r"manifest.json: not (in this format|a manifest)"):
        verify(tmp_path)


def test_read_manifest_refuses_json_that_is_no_object_in_one_line(tmp_path):
    (tmp_path / MANIFEST).write_text("[1, 2]")
    with pytest.raises(DataError, match=r"manifest.json: not a manifest \(a JSON object\)"):
        read_manifest(tmp_path, "test/1")


def test_verify_catches_a_manifest_that_lists_fewer_rows_than_the_shard_holds(tmp_path, tok_path):
    rows = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    write_format(tmp_path, tok_path, rows, [[0]] * 3)
    m = read_manifest(tmp_path)
    m["splits"]["train"]["shards"][0]["rows"] = 1
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="2 rows of 4 tokens, manifest says 1 rows of 4"):
        verify(tmp_path)


def test_a_writer_refuses_a_shard_log_of_another_folder(tmp_path):
    from pipeline.data.resume import ShardLog

    log = ShardLog(tmp_path / "elsewhere", "fp", ext=".arrow")
    writer = ShardWriter(tmp_path, "train", row_schema("test/1", 4), log)
    with pytest.raises(ValueError, match="does not name"):
        writer.write(np.zeros((1, 4), np.int32), np.array([0, 1]), np.array([0]))
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "train").exists()


def test_a_row_whose_doc_starts_lack_0_still_begins_segment_0(tmp_path):
    """A shard not written by ShardWriter (which refuses it) may list no start at 0: the row's first
    tokens still belong to a segment, numbered 0, not -1."""
    data = PackedRows(write_split(tmp_path / "s", [np.arange(5)] * 2, [[2], [0, 3]], shards=1))
    assert data.segment_ids(np.array([0, 1])).tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_clear_outputs_clears_only_the_split_folders_it_is_given_and_warns_of_a_users_copy(tmp_path, caplog):
    """A user's backup inside the output folder (``data/sft/my-backup/shard-00000.arrow``) lost its files:
    every subfolder's shard-named files were removed. Now only the named split folders are cleared."""
    for d in ("train", "val", "my-backup", "notes"):
        (tmp_path / d).mkdir()
    for d in ("train", "val", "my-backup"):
        for name in ("shard-00000.arrow", "shard-00000.json", ".shard-00001.tmp"):
            (tmp_path / d / name).write_bytes(b"x")
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / MANIFEST).write_text("{}")
    with caplog.at_level("WARNING", logger="pipeline.data.shards"):
        clear_outputs(tmp_path, ["train", "val", "val-source-00"])
        assert not (tmp_path / MANIFEST).exists()
        assert not list((tmp_path / "train").iterdir()) and not list((tmp_path / "val").iterdir())
        assert sorted(p.name for p in (tmp_path / "my-backup").iterdir()) == [
            ".shard-00001.tmp", "shard-00000.arrow", "shard-00000.json"]
        assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
        (tmp_path / "train" / "shard-00003.arrow").write_bytes(b"stale")
        clear_outputs(tmp_path, ["train", "val"])  # a second clear of the same folder: no second warning
    assert not (tmp_path / "train" / "shard-00003.arrow").exists()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "left alone my-backup/, which holds files named like shards but is no split this " \
                                "stage writes (train, val, val-source-00)" in warned[0]
    with pytest.raises(TypeError, match="not a string"):
        clear_outputs(tmp_path, "train")
