"""The deterministic global sample order of training rows.

For epoch ``e`` the order is a permutation of all rows drawn from ``(seed, e)``.
Each optimizer step takes the next ``micro_batch × grad_accum × world_size`` rows
of that order; micro-batch ``i`` of rank ``r`` is block ``i·world + r`` of them.
So no rank sees another rank's rows, the rows of a step do not depend on how they
are spread over ranks (2 ranks × 1 micro-batch = 1 rank × 2 micro-batches), and
the loader's whole state is ``(epoch, consumed, seed)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from pipeline.data.shards import DataError


@dataclass
class LoaderState:
    epoch: int = 0
    consumed: int = 0  # rows of this epoch's order already used
    seed: int = 0


def check_global_batch(rows_per_rank: int, world_size: int, n_rows: int) -> None:
    """One optimizer step's rows (``rows_per_rank`` = micro-batch × accumulation
    steps, on each of ``world_size`` ranks) fit a split of ``n_rows``; DataError
    (one line) otherwise."""
    if rows_per_rank * world_size > n_rows:
        raise DataError(f"one step needs {rows_per_rank * world_size} rows (batch.micro_batch_size × "
                        f"batch.grad_accum_steps = {rows_per_rank} per rank × {world_size} rank(s)) but the train "
                        f"split has only {n_rows}; lower them or add data")


class GlobalOrder:
    """Which rows each rank uses at each step. See the module docstring."""

    def __init__(self, n_rows: int, seed: int, micro_batch: int, grad_accum: int, world_size: int, rank: int):
        self.n_rows, self.micro, self.accum = n_rows, micro_batch, grad_accum
        self.world, self.rank = world_size, rank
        self.global_batch = micro_batch * grad_accum * world_size
        check_global_batch(micro_batch * grad_accum, world_size, n_rows)
        self.state = LoaderState(seed=seed)
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.state.seed, epoch]).permutation(self.n_rows)
            self._perm_epoch = epoch
        return self._perm

    def next_step(self) -> list[np.ndarray]:
        """This rank's micro-batches (``grad_accum`` arrays of row indices) for the next step.
        The tail of an epoch smaller than one global batch is skipped."""
        if self.state.consumed + self.global_batch > self.n_rows:
            self.state.epoch += 1
            self.state.consumed = 0
        order = self._order(self.state.epoch)
        rows = order[self.state.consumed:self.state.consumed + self.global_batch]
        self.state.consumed += self.global_batch
        blocks = rows.reshape(self.accum, self.world, self.micro)
        return [blocks[i, self.rank] for i in range(self.accum)]

    def state_dict(self) -> dict[str, int]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.state.seed:
            raise DataError(f"checkpoint data seed {state['seed']} != configured seed {self.state.seed}")
        self.state = LoaderState(**state)


def eval_rows(n_rows: int, max_rows: int | None, world_size: int, rank: int) -> np.ndarray:
    """A fixed slice of the val split for this rank (same rows whatever the world size)."""
    rows = np.arange(n_rows if max_rows is None else min(n_rows, max_rows))
    return rows[rank::world_size]
