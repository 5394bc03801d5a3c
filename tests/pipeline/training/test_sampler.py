"""pipeline/training/sampler.py: the global sample order is the same however a
step is split over ranks and micro-batches, and resumes from its state."""

import numpy as np
import pytest

from pipeline.data.shards import DataError
from pipeline.training.sampler import GlobalOrder, eval_rows


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


def test_a_split_of_whole_global_batches_is_used_to_its_last_row():
    # a split of exactly one global batch is enough to train on
    exact = GlobalOrder(8, seed=0, micro_batch=4, grad_accum=1, world_size=2, rank=0)
    assert len(np.concatenate(exact.next_step())) == 4
    # 12 rows in global batches of 3: four steps per epoch, every row once, then the next epoch
    o = GlobalOrder(12, seed=5, micro_batch=3, grad_accum=1, world_size=1, rank=0)
    epoch = collect(o, 4)
    assert sorted(np.concatenate(epoch).tolist()) == list(range(12))
    assert o.state_dict() == {"epoch": 0, "consumed": 12, "seed": 5}
    collect(o, 1)
    assert o.state_dict() == {"epoch": 1, "consumed": 3, "seed": 5}


def test_the_seed_chooses_the_order():
    def first_steps(seed):
        order = GlobalOrder(50, seed=seed, micro_batch=5, grad_accum=1, world_size=1, rank=0)
        return [x.tolist() for x in collect(order, 12)]

    assert first_steps(1) == first_steps(1)
    assert first_steps(1)[:10] != first_steps(2)[:10]  # epoch 0
    assert first_steps(1)[10:] != first_steps(2)[10:]  # epoch 1


def test_micro_batch_i_of_rank_r_is_block_i_times_world_plus_r_of_the_step():
    """The module's contract, against the order one rank with one micro-batch of
    the whole global batch sees (the same permutation of the same rows)."""
    m, accum, world = 2, 3, 2
    whole = collect(GlobalOrder(40, seed=4, micro_batch=m * accum * world, grad_accum=1, world_size=1, rank=0), 5)
    for r in range(world):
        split = GlobalOrder(40, seed=4, micro_batch=m, grad_accum=accum, world_size=world, rank=r)
        for rows in whole:
            micro = split.next_step()
            assert [b.tolist() for b in micro] == [rows[(i * world + r) * m:(i * world + r + 1) * m].tolist()
                                                   for i in range(accum)]


def test_rank_0_has_the_most_eval_rows():
    """A sharded evaluation pads every rank to rank 0's forward count (the
    trainer's evaluate), so no rank may have more val rows than rank 0."""
    for n_rows, max_rows, world in ((11, None, 3), (10, 7, 4), (5, None, 8), (64, 33, 2)):
        sizes = [len(eval_rows(n_rows, max_rows, world, r)) for r in range(world)]
        assert sizes[0] == max(sizes) and sum(sizes) == min(n_rows, max_rows or n_rows), (n_rows, max_rows, world)
