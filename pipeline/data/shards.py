"""The packed-row shard format: memory-mapped reading of packed training rows.

A split folder holds Arrow IPC files (``*.arrow``) with a fixed-size list column
``input_ids`` (one row = ``seq_len + 1`` tokens), a list column ``doc_starts``
(offsets in the row where a document segment begins) and, for SFT, an optional
``labels`` column of the same shape with -100 where no loss is taken.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from pipeline.errors import StageError


class DataError(StageError):
    pass


class PackedRows:
    """All rows of one split, memory-mapped shard by shard: nothing is copied, so
    memory does not grow with the corpus; a batch gathers its rows from the shards
    that hold them."""

    def __init__(self, split_dir: str | Path):
        self.dir = Path(split_dir)
        paths = sorted(self.dir.glob("*.arrow"))
        if not paths:
            raise DataError(f"no *.arrow shards in {self.dir}; run the pack stage first")
        self.shards = [_Shard(p) for p in paths]
        widths = {sh.input_ids.shape[1] for sh in self.shards}
        if len(widths) != 1:
            raise DataError(f"{self.dir}: shards have different row lengths {sorted(widths)}")
        self.row_len = widths.pop()
        has_labels = {sh.labels is not None for sh in self.shards}
        if len(has_labels) != 1:
            raise DataError(f"{self.dir}: some shards have a labels column and some do not")
        self.has_labels = has_labels.pop()
        self._first = np.cumsum([0] + [len(sh) for sh in self.shards])  # global index of each shard's row 0

    def __len__(self) -> int:
        return int(self._first[-1])

    @property
    def seq_len(self) -> int:
        return self.row_len - 1

    def _locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        shard = np.searchsorted(self._first, rows, side="right") - 1
        return shard, rows - self._first[shard]

    def _gather(self, rows: np.ndarray, column: str) -> np.ndarray:
        shard, local = self._locate(rows)
        out = np.empty((len(rows), self.row_len), dtype=np.int32)
        for k in np.unique(shard):
            sel = shard == k
            out[sel] = getattr(self.shards[k], column)[local[sel]]
        return out

    def input_ids(self, rows: np.ndarray) -> np.ndarray:
        """(b, row_len) int32 token ids of ``rows`` (a copy of just those rows)."""
        return self._gather(rows, "input_ids")

    def labels(self, rows: np.ndarray) -> np.ndarray | None:
        return self._gather(rows, "labels") if self.has_labels else None

    def segment_ids(self, rows: np.ndarray) -> np.ndarray:
        """(b, row_len) int32 document index of each position within its row."""
        shard, local = self._locate(rows)
        marks = np.zeros((len(rows), self.row_len), dtype=np.int32)
        for i, (k, r) in enumerate(zip(shard, local)):
            marks[i, self.shards[k].doc_starts(r)] = 1
        marks[:, 0] = 1  # a row always starts a segment
        return np.cumsum(marks, axis=1, dtype=np.int32) - 1

    def batch(self, rows: np.ndarray, device: torch.device, doc_mask: bool = True) -> dict[str, torch.Tensor]:
        """Inputs, targets (-100 = no loss) and segment ids for ``rows``."""
        ids = torch.from_numpy(self.input_ids(rows).astype(np.int64))
        labels = self.labels(rows)
        tgt = torch.from_numpy(labels.astype(np.int64)) if labels is not None else ids
        out = {"input_ids": ids[:, :-1], "targets": tgt[:, 1:].clone()}
        if doc_mask:
            out["segment_ids"] = torch.from_numpy(self.segment_ids(rows)[:, :-1].astype(np.int64))
        return {k: v.to(device, non_blocking=True) for k, v in out.items()}

    def iter_input_ids(self, chunk: int = 4096):
        """Zero-copy (rows, row_len) views of all rows, shard by shard, in chunks."""
        for sh in self.shards:
            for i in range(0, len(sh), chunk):
                yield sh.input_ids[i:i + chunk]


class _Shard:
    """One memory-mapped Arrow IPC shard: zero-copy numpy views of its columns."""

    def __init__(self, path: Path):
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        for name in ("input_ids", "doc_starts"):
            if name not in table.column_names:
                raise DataError(f"{path}: no column {name!r}; columns are {table.column_names}")
        self.input_ids = self._matrix(table, "input_ids", path)
        self.labels = self._matrix(table, "labels", path) if "labels" in table.column_names else None
        ds = table.column("doc_starts").combine_chunks()  # offsets + values: small next to the tokens
        self._off = ds.offsets.to_numpy()
        self._starts = ds.values.to_numpy(zero_copy_only=False)

    @staticmethod
    def _matrix(table: pa.Table, name: str, path: Path) -> np.ndarray:
        col = table.column(name)
        if col.num_chunks != 1:  # one record batch per shard keeps the column contiguous
            col = pa.chunked_array([col.combine_chunks()])
        arr = col.chunk(0)
        width = arr.type.list_size
        values = arr.values.to_numpy(zero_copy_only=True)[arr.offset * width:(arr.offset + len(arr)) * width]
        if values.dtype != np.int32:
            raise DataError(f"{path}: {name} must be int32, got {values.dtype}")
        return values.reshape(-1, width)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def doc_starts(self, row: int) -> np.ndarray:
        return self._starts[self._off[row]:self._off[row + 1]]
