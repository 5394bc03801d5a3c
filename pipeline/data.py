"""Training data: memory-mapped packed rows and a deterministic global sample order.

A split folder holds Arrow IPC files (``*.arrow``) with a fixed-size list column
``input_ids`` (one row = ``seq_len + 1`` tokens), a list column ``doc_starts``
(offsets in the row where a document segment begins) and, for SFT, an optional
``labels`` column of the same shape with -100 where no loss is taken.

The sample order is global: for epoch ``e`` it is a permutation of all rows
drawn from ``(seed, e)``. Each optimizer step takes the next
``micro_batch × grad_accum × world_size`` rows of that order; micro-batch ``i``
of rank ``r`` is block ``i·world + r`` of them. So no rank sees another rank's
rows, the rows of a step do not depend on how they are spread over ranks (2
ranks × 1 micro-batch = 1 rank × 2 micro-batches), and the loader's whole state
is ``(epoch, consumed, seed)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch


class DataError(RuntimeError):
    pass


class PackedRows:
    """All rows of one split, memory-mapped (no copy of the token data)."""

    def __init__(self, split_dir: str | Path):
        self.dir = Path(split_dir)
        shards = sorted(self.dir.glob("*.arrow"))
        if not shards:
            raise DataError(f"no *.arrow shards in {self.dir}; run the pack stage first")
        ids, labels, starts_off, starts_val = [], [], [], []
        base = 0
        self.row_len = None
        for path in shards:
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
            col = table.column("input_ids").combine_chunks()
            width = col.type.list_size
            if self.row_len is None:
                self.row_len = width
            elif width != self.row_len:
                raise DataError(f"{path}: row length {width} != {self.row_len} of earlier shards")
            ids.append(col.values.to_numpy(zero_copy_only=False).reshape(-1, width))
            if "labels" in table.column_names:
                lab = table.column("labels").combine_chunks()
                labels.append(lab.values.to_numpy(zero_copy_only=False).reshape(-1, width))
            ds = table.column("doc_starts").combine_chunks()
            off = ds.offsets.to_numpy()
            starts_off.append(off[1:] - off[0] + base)
            starts_val.append(ds.values.to_numpy(zero_copy_only=False)[off[0]:off[-1]])
            base += off[-1] - off[0]
        self.input_ids = np.concatenate(ids) if len(ids) > 1 else ids[0]
        self.labels = None
        if labels:
            if len(labels) != len(ids):
                raise DataError(f"{self.dir}: some shards have a labels column and some do not")
            self.labels = np.concatenate(labels) if len(labels) > 1 else labels[0]
        self._starts_off = np.concatenate([[0], *starts_off])
        self._starts_val = np.concatenate(starts_val)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.row_len - 1

    def segment_ids(self, rows: np.ndarray) -> np.ndarray:
        """(b, row_len) int32 document index of each position within its row."""
        marks = np.zeros((len(rows), self.row_len), dtype=np.int32)
        for i, r in enumerate(rows):
            marks[i, self._starts_val[self._starts_off[r]:self._starts_off[r + 1]]] = 1
        marks[:, 0] = 1  # a row always starts a segment
        return np.cumsum(marks, axis=1, dtype=np.int32) - 1

    def batch(self, rows: np.ndarray, device: torch.device, doc_mask: bool = True) -> dict[str, torch.Tensor]:
        """Inputs, targets (-100 = no loss) and segment ids for ``rows``."""
        ids = torch.from_numpy(self.input_ids[rows].astype(np.int64))
        tgt = torch.from_numpy(self.labels[rows].astype(np.int64)) if self.labels is not None else ids
        out = {"input_ids": ids[:, :-1], "targets": tgt[:, 1:].clone()}
        if doc_mask:
            out["segment_ids"] = torch.from_numpy(self.segment_ids(rows)[:, :-1].astype(np.int64))
        return {k: v.to(device, non_blocking=True) for k, v in out.items()}


@dataclass
class LoaderState:
    epoch: int = 0
    consumed: int = 0  # rows of this epoch's order already used
    seed: int = 0


class GlobalOrder:
    """Which rows each rank uses at each step. See the module docstring."""

    def __init__(self, n_rows: int, seed: int, micro_batch: int, grad_accum: int, world_size: int, rank: int):
        self.n_rows, self.micro, self.accum = n_rows, micro_batch, grad_accum
        self.world, self.rank = world_size, rank
        self.global_batch = micro_batch * grad_accum * world_size
        if self.global_batch > n_rows:
            raise DataError(
                f"one step needs {self.global_batch} rows (micro_batch {micro_batch} × grad_accum "
                f"{grad_accum} × world {world_size}) but the split has only {n_rows}; lower them or add data"
            )
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
