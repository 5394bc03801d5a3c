"""The packed-row format: one module that writes, lists and reads training rows.

pack (pretraining text) and the SFT data builder (chat examples) both write
their output with this module, and the trainer and evaluate read it back with
:class:`PackedRows`. An output folder (``data/packed``, ``data/sft``) holds::

    train/shard-00000.arrow, train/shard-00001.arrow, ...
    val/shard-00000.arrow, ...
    manifest.json

*Shards.* Arrow IPC **file** format (``pyarrow.ipc.open_file`` on a
``pyarrow.memory_map`` reads them without copying), uncompressed, one record
batch per shard; shards in name order are in row order. Columns, never null:

- ``input_ids``: ``fixed_size_list<int32>[row_len]``, one row of
  ``row_len = seq_len + 1`` tokens; training uses ``row[:-1]`` as inputs and
  ``row[1:]`` as targets.
- ``labels`` (SFT only): the same shape, the token id where the loss is taken and
  -100 elsewhere, aligned with ``input_ids``.
- ``doc_starts``: ``list<int32>``, the sorted offsets in the row where a document
  segment begins; always contains 0 (a row that begins mid-document still
  begins a segment). :meth:`PackedRows.segment_ids` turns them into per-position
  segment ids for a block-diagonal causal mask.

The schema metadata holds ``format`` and ``row_len`` and what the writer adds.
A shard is written under a temporary name, fsynced and renamed, so a reader
never sees part of one under its final name. A writer may keep its own files
beside the shards (pack: each shard's commit record ``shard-NNNNN.json`` and
its checkpoints); readers list only the ``*.arrow`` files and the manifest.

*Manifest* (``manifest.json``, written last and atomically; a folder without it
is incomplete): ``format``, ``seq_len``, ``row_len``, ``dtype`` ("int32"),
``ignore_index`` (with labels), ``vocab_size``, ``eot_id``, ``pad_id``,
``special_ids``, ``tokenizer_sha256``, the writer's own fields, and last
``splits.{train,val}``: the writer's counts and ``shards: [{path (relative to the
folder), rows, sha256}]``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pipeline import layout
from pipeline.errors import StageError
from pipeline.files import atomic_path, read_stage_json, sha256_file, write_json

if TYPE_CHECKING:  # torch is needed only to hand batches to the trainer
    import torch

    from pipeline.data.resume import ShardLog

log = logging.getLogger("pipeline.data.shards")

MANIFEST = "manifest.json"
IGNORE_INDEX = -100  # a label that takes no part in the loss: SFT prompt tokens, padding
SPLITS = ("train", "val")


class DataError(StageError):
    """A packed-row folder or shard is missing, incomplete or not in this format."""


# --- writing ----------------------------------------------------------------------------------


def row_schema(fmt: str, row_len: int, *, labels: bool = False, metadata: Mapping[str, str] | None = None
               ) -> pa.Schema:
    """The shard schema: ``input_ids``, ``labels`` if asked, ``doc_starts``."""
    row = pa.list_(pa.int32(), row_len)
    fields = [pa.field("input_ids", row, nullable=False)]
    if labels:
        fields.append(pa.field("labels", row, nullable=False))
    fields.append(pa.field("doc_starts", pa.list_(pa.int32()), nullable=False))
    return pa.schema(fields, metadata={"format": fmt, "row_len": str(row_len), **(metadata or {})})


class ShardWriter:
    """Writes one split's shards ``<split>/shard-00000.arrow``, ... under ``out_dir``
    in order, each atomically, and lists them (``shards``) for the manifest.

    With ``log`` (a :class:`pipeline.data.resume.ShardLog` of the split's folder,
    stem ``shard``, ext ``.arrow``) each shard is also committed with a record
    ``shard-NNNNN.json`` beside it (its sha256 and ``rows``), which readers
    ignore; the shard's bytes are the same either way. A resumed writer starts
    with ``shards`` holding the entries of the shards already committed."""

    def __init__(self, out_dir: str | Path, split: str, schema: pa.Schema, log: ShardLog | None = None):
        self.out_dir, self.split, self.schema, self.log = Path(out_dir), split, schema, log
        self.row_len: int = schema.field("input_ids").type.list_size
        self.has_labels = "labels" in schema.names
        self.shards: list[dict[str, Any]] = []

    @property
    def rows(self) -> int:
        return sum(s["rows"] for s in self.shards)

    def write(self, input_ids: np.ndarray, start_offsets: np.ndarray, start_values: np.ndarray,
              labels: np.ndarray | None = None) -> dict[str, Any]:
        """Write the next shard: ``input_ids`` (and ``labels``) ``(n, row_len)`` int32;
        row ``i`` starts segments at ``start_values[start_offsets[i]:start_offsets[i + 1]]``
        (``start_offsets`` has ``n + 1`` entries). Returns its manifest entry.
        Raises ValueError when the arrays do not fit the schema."""
        n = len(input_ids)
        if n == 0 or input_ids.shape != (n, self.row_len) or input_ids.dtype != np.int32:
            raise ValueError(f"input_ids must be a non-empty (rows, {self.row_len}) int32 array, "
                             f"got {input_ids.shape} {input_ids.dtype}")
        if (labels is not None) != self.has_labels:
            raise ValueError("labels must be given exactly when the schema has a labels column")
        if labels is not None and (labels.shape != input_ids.shape or labels.dtype != np.int32):
            raise ValueError(f"labels must match input_ids: got {labels.shape} {labels.dtype}")
        if len(start_offsets) != n + 1:
            raise ValueError(f"start_offsets needs {n + 1} entries for {n} rows, got {len(start_offsets)}")
        lo, hi = int(start_offsets[0]), int(start_offsets[-1])
        offsets = np.asarray(start_offsets, np.int32) - lo
        values = np.asarray(start_values[lo:hi], np.int32)
        if np.any(np.diff(offsets) < 1) or np.any(values[offsets[:-1]] != 0):
            raise ValueError("every row's doc_starts must begin with 0")
        columns = [pa.FixedSizeListArray.from_arrays(pa.array(input_ids.reshape(-1)), self.row_len)]
        if labels is not None:
            columns.append(pa.FixedSizeListArray.from_arrays(pa.array(labels.reshape(-1)), self.row_len))
        columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))
        batch = pa.record_batch(columns, schema=self.schema)
        k = len(self.shards)
        rel = f"{self.split}/shard-{k:05d}.arrow"
        path = self.out_dir / rel
        if self.log is None:
            with atomic_path(path) as tmp:
                self._write_file(tmp, batch)
            sha = sha256_file(path)
        else:
            if self.log.path(k) != path:
                raise ValueError(f"the shard log of {self.log.folder} does not name {path}")
            with self.log.writing(k) as tmp:
                self._write_file(tmp, batch)
            sha = self.log.seal(k, {"rows": n})["sha256"]
        entry = {"path": rel, "rows": n, "sha256": sha}
        self.shards.append(entry)
        return entry

    def _write_file(self, path: Path, batch: pa.RecordBatch) -> None:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:
            writer.write_batch(batch)


def clear_outputs(out_dir: str | Path, splits: Iterable[str]) -> None:
    """Remove the manifest and, in each of ``splits`` (the split folders the
    caller writes: ``train``, ``val``, and pack's per-source val splits), every
    shard, temporary shard and commit record. Any other subfolder is not the
    stage's (a user's backup, say ``my-backup/shard-00000.arrow``): it is left as
    it is, and those that hold files named like shards get one warning
    (:func:`warn_other_dirs`). Raises DataError for a directory named like a
    shard in a split folder (kept: it is no shard the stage wrote)."""
    if isinstance(splits, str):  # one name, not its letters
        raise TypeError("splits must be a collection of split folder names, not a string")
    out_dir = Path(out_dir)
    splits = list(splits)
    # The manifest goes first: a folder without one is incomplete by contract.
    (out_dir / MANIFEST).unlink(missing_ok=True)
    if not out_dir.is_dir():
        return
    for d in (out_dir / s for s in sorted(set(splits))):
        if not d.is_dir():
            continue
        for p in shard_like(d):
            if p.is_dir() and not p.is_symlink():  # no shard the stage wrote: maybe the user's, never removed
                raise DataError(f"{p} is a directory where a shard belongs; it is not removed: move it out of "
                                f"{out_dir} and run again")
            p.unlink()
    warn_other_dirs(out_dir, splits)


def shard_like(folder: Path) -> list[Path]:
    """The entries of ``folder`` named as a writer names its shards, their
    commit records and their temporary files."""
    return [*folder.glob("shard-*.arrow"), *folder.glob("shard-*.json"), *folder.glob(".shard-*.tmp")]


_WARNED: set[Path] = set()  # the folders warn_other_dirs named already


def warn_other_dirs(out_dir: Path, splits: Iterable[str]) -> None:
    """The subfolders of ``out_dir`` other than ``splits`` that hold files named
    like shards, named in one warning: they are left alone (a stage removes
    shards only in the folders it writes). A folder is warned of once a process
    (a stage that clears its output twice says it once)."""
    splits = set(splits)
    others = [d for d in sorted(out_dir.iterdir()) if d.is_dir() and d.name not in splits and shard_like(d)] \
        if out_dir.is_dir() else []
    new = [d for d in others if d.resolve() not in _WARNED]
    if new:
        _WARNED.update(d.resolve() for d in new)
        log.warning("%s: left alone %s, which hold%s files named like shards but %s no split this stage writes "
                    "(%s)", out_dir, ", ".join(f"{d.name}/" for d in new), "s" if len(new) == 1 else "",
                    "is" if len(new) == 1 else "are", ", ".join(sorted(s for s in splits if not s.startswith("."))))


def write_manifest(out_dir: str | Path, *, fmt: str, seq_len: int, vocab_size: int, special_ids: dict[str, int],
                   tokenizer_path: str | Path, labels: bool, fields: Mapping[str, Any],
                   splits: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Write ``manifest.json`` (see the module docstring) atomically and return it.
    ``fields`` are the writer's own keys; each split's entry holds its counts and
    ``shards``."""
    manifest: dict[str, Any] = {"format": fmt, "seq_len": seq_len, "row_len": seq_len + 1, "dtype": "int32"}
    if labels:
        manifest["ignore_index"] = IGNORE_INDEX
    manifest.update({
        "vocab_size": vocab_size,
        "eot_id": special_ids["eot"],
        "pad_id": special_ids["pad"],
        "special_ids": special_ids,
        "tokenizer_sha256": sha256_file(tokenizer_path),
        **fields,
        "splits": splits,
    })
    write_json(Path(out_dir) / MANIFEST, manifest)
    return manifest


def split_counts(splits: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each split's counts, with its shard list replaced by the number of shards."""
    return {s: {**{k: v for k, v in info.items() if k != "shards"}, "shards": len(info["shards"])}
            for s, info in splits.items()}


# --- reading ----------------------------------------------------------------------------------


def read_manifest(out_dir: str | Path, fmt: str | None = None) -> dict[str, Any]:
    """The manifest of a complete folder. Raises DataError when it is missing or
    (with ``fmt``) of another format."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found; the stage that writes {out_dir} has not completed")
    manifest = read_stage_json(path)
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a manifest (a JSON object); run the stage that writes {out_dir} again")
    if fmt is not None and manifest.get("format") != fmt:
        raise DataError(f"{path}: format {manifest.get('format')!r}, expected {fmt!r}")
    return manifest


def val_sources(out_dir: str | Path) -> dict[str, Path]:
    """Source name -> that source's own val split, for a packed folder made from
    several sources (pack's ``val_sources``); empty otherwise, and for a folder
    without a manifest (whose readers fail on their own, naming what is missing)."""
    if not (Path(out_dir) / MANIFEST).is_file():
        return {}
    manifest = read_manifest(out_dir)
    return {name: Path(out_dir) / rel for name, rel in manifest.get("val_sources", {}).items()}


def verify(out_dir: str | Path, fmt: str | None = None, *, sha256: bool = True) -> dict[str, Any]:
    """Check a folder against its manifest: every listed shard exists, has the
    listed rows, the manifest's row length and (with ``sha256``) the listed
    digest, and no unlisted shard lies beside them. Returns the manifest; raises
    DataError on the first disagreement."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir, fmt)
    try:
        _verify(out_dir, manifest, sha256)
    except (KeyError, TypeError, AttributeError) as e:  # a manifest edited by hand, or of another writer
        raise DataError(f"{out_dir / MANIFEST}: not in this format ({type(e).__name__}: {e}); run the stage that "
                        "writes it again") from None
    return manifest


def _verify(out_dir: Path, manifest: dict[str, Any], sha256: bool) -> None:
    for split, info in manifest["splits"].items():
        listed = {e["path"] for e in info["shards"]}
        extra = sorted(p.relative_to(out_dir).as_posix() for p in (out_dir / split).glob("*.arrow")
                       if p.relative_to(out_dir).as_posix() not in listed)
        if extra:
            raise DataError(f"{out_dir / extra[0]}: a shard the manifest does not list")
        for entry in info["shards"]:
            path = out_dir / entry["path"]
            if not path.is_file():
                raise DataError(f"{path}: listed in the manifest but missing")
            if sha256 and sha256_file(path) != entry["sha256"]:
                raise DataError(f"{path}: sha256 does not match the manifest")
            shard = _Shard(path)
            if shard.input_ids.shape[1] != manifest["row_len"] or len(shard) != entry["rows"]:
                raise DataError(f"{path}: {len(shard)} rows of {shard.input_ids.shape[1]} tokens, manifest says "
                                f"{entry['rows']} rows of {manifest['row_len']}")


class PackedRows:
    """All rows of one split, memory-mapped shard by shard: nothing is copied, so
    memory does not grow with the corpus; a batch gathers its rows from the shards
    that hold them."""

    def __init__(self, split_dir: str | Path):
        self.dir = Path(split_dir)
        paths = sorted(self.dir.glob("*.arrow"))
        if not paths:
            stage = layout.packed_rows_writer(self.dir)
            raise DataError(f"no *.arrow shards in {self.dir}; " + (f"run `dvc repro {stage}` first" if stage else
                                                                     "the stage that writes it has not completed"))
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
        import torch

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
        if not path.is_file():  # a directory named like a shard: memory_map's error would be a traceback
            raise DataError(f"{path}: not a file, where a shard belongs")
        try:
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        except pa.ArrowInvalid as e:  # cut short or overwritten: one line, not Arrow's traceback
            stage = layout.packed_rows_writer(path)
            raise DataError(f"{path}: not a readable Arrow shard ({e}); " + (
                f"run `dvc repro {stage}` to write it again" if stage else "write it again")) from None
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
