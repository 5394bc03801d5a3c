"""pack: tokenize the clean documents and pack them into fixed-length training rows.

Input: a Parquet table with columns ``id`` and ``text`` (``data/clean/docs.parquet``)
and the trained ``tokenizer.json``. Output, under ``out_dir`` (``data/packed``)::

    train/shard-00000.arrow, train/shard-00001.arrow, ...
    val/shard-00000.arrow, ...
    manifest.json

On-disk contract (format ``pipeline.pack/1``)
---------------------------------------------
*Split.* A document is in ``val`` iff ``h(seed, id) < val_fraction · 2**64``, where
``h`` is the 64-bit big-endian BLAKE2b digest of ``f"{seed}\\0{id}"`` (person
``pack-spl``). A document therefore always lands in the same split, whatever the
worker count, batch size or row order. Tiny corpora: when no document hashes into
``val``, the one with the smallest ``h`` is moved there; when every document does,
the one with the largest ``h`` goes to ``train``. A corpus needs at least two
distinct ids; the moved ids are recorded in the manifest under ``forced``.

*Token stream.* Per split, documents in table order, each encoded with special-token
parsing off (a literal ``"<|endoftext|>"`` in the text is ordinary bytes) and
followed by one EOT id. A document that encodes to no tokens contributes nothing,
not even EOT, and is counted as ``empty_docs``.

*Rows.* The stream is cut into consecutive rows of ``row_len = seq_len + 1`` tokens;
training uses ``inputs = row[:-1]`` and ``targets = row[1:]``. The last
``tokens mod row_len`` tokens of each split do not fill a row and are dropped;
their count is ``dropped_tail_tokens``.

*Shards.* Arrow IPC **file** format (``pyarrow.ipc.open_file`` on a
``pyarrow.memory_map`` reads them without copying), uncompressed, one record batch
per shard, at most ``max(1, shard_tokens // row_len)`` rows; shards in name order
are in stream order. Columns:

- ``input_ids``: ``fixed_size_list<int32>[row_len]``, never null.
- ``doc_starts``: ``list<int32>``, never null: the sorted offsets ``p`` in the row
  at which a document segment starts. Always contains 0 (a row that begins in the
  middle of a document still begins a segment); every other ``p`` has
  ``row[p - 1] == eot_id``. The tokens from one start up to the next start (or the
  row end) belong to one document. :func:`segment_ids_from_starts` turns this into
  per-position segment ids for a block-diagonal causal mask.

The schema metadata repeats ``format``, ``row_len`` and ``eot_id``.

*Manifest* (``manifest.json``, written last and atomically; a directory without it
is incomplete): ``format``, ``seq_len``, ``row_len``, ``dtype`` ("int32"),
``vocab_size``, ``eot_id``, ``pad_id``, ``special_ids`` (role -> id),
``tokenizer_sha256``, ``seed``, ``val_fraction``, ``docs``, ``forced``
(id -> split), ``tokens`` (both splits), and ``splits.{train,val}`` with ``docs``,
``empty_docs``, ``tokens`` (incl. EOTs; ``= rows · row_len + dropped_tail_tokens``),
``rows``, ``dropped_tail_tokens`` and ``shards: [{path (relative to out_dir), rows,
sha256}]``.

*Reading.* :func:`open_split` returns a :class:`PackedSplit`: ``len()``, ``split[i]
-> (row, doc_starts)``, ``rows(idx)`` and ``segment_ids(idx, length)`` for batches,
and ``shards``, each with a zero-copy ``input_ids`` view ``(rows, row_len)`` int32.

Speed: tokenization runs in ``num_workers`` processes, each with its own
single-threaded tokenizer (the library's own threads scale poorly on some
machines; processes scale everywhere), fed runs of about ``task_bytes`` of text in
order. The main process only reads Parquet (``batch_docs`` rows at a time) and
packs with numpy. At most ``2 · workers + 2`` tasks are in flight, so memory does
not grow with the corpus.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field

from pipeline.config import StageConfig
from pipeline.files import atomic_path, available_cores, read_json, sha256_file, write_json
from pipeline.progress import progress
from pipeline.data.tokenizer import (
    EOT_ID,
    PAD_ID,
    TokenizerError,
    load_tokenizer,
    open_docs,
    special_ids,
)
from pipeline.errors import StageError

log = logging.getLogger("pipeline.data.pack")

FORMAT = "pipeline.pack/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
SHARD_GLOB = "shard-*.arrow"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# pack holds one shard per split in memory: 256 MiB of int32 each at most.
MAX_SHARD_TOKENS = 1 << 26


class PackConfig(StageConfig):
    seq_len: int = Field(256, ge=8, le=1_048_576, description="tokens a model sees per row; rows hold seq_len + 1")
    val_fraction: float = Field(0.05, gt=0.0, le=0.5, description="share of documents in the val split")
    seed: int = Field(0, ge=0, description="chooses the train/val split")
    num_workers: int = Field(0, ge=0, le=512, description="tokenizer processes; 0 = one per available core")
    shard_tokens: int = Field(1 << 23, ge=1, le=MAX_SHARD_TOKENS,
                              description="tokens per Arrow shard file, rounded down to whole rows (at least one)")
    batch_docs: int = Field(1024, ge=1, le=1_000_000, description="documents read from Parquet at a time")
    task_bytes: int = Field(1_000_000, ge=1_000, le=1_000_000_000,
                            description="text bytes per tokenizer task (a larger document is one task)")


class PackError(StageError):
    """Packing cannot proceed: missing input, too little data, or a bad packed directory."""


# --- split assignment -----------------------------------------------------------------------


def split_hash(seed: int, doc_id: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{doc_id}".encode(), digest_size=8, person=b"pack-spl").digest()
    return int.from_bytes(digest, "big")


def val_threshold(val_fraction: float) -> int:
    return int(val_fraction * 2**64)


@dataclass(frozen=True)
class SplitPlan:
    docs: int
    seed: int
    threshold: int
    forced: dict[str, str] = field(default_factory=dict)

    def split_of(self, doc_id: str) -> str:
        if doc_id in self.forced:
            return self.forced[doc_id]
        return "val" if split_hash(self.seed, doc_id) < self.threshold else "train"


def plan_splits(pf: pq.ParquetFile, seed: int, val_fraction: float, where: str = "documents") -> SplitPlan:
    """Read the ``id`` column once to apply the tiny-corpus rules (see the module
    docstring). Raises PackError on an empty corpus, null ids, or fewer than two ids."""
    threshold = val_threshold(val_fraction)
    n = n_val = 0
    lo: tuple[int, str] | None = None
    hi: tuple[int, str] | None = None
    for batch in pf.iter_batches(batch_size=65_536, columns=["id"]):
        col = batch.column(0)
        if col.null_count:
            raise PackError(f"{where}: {col.null_count} document(s) have a null id")
        for doc_id in col.to_pylist():
            h = split_hash(seed, doc_id)
            n += 1
            n_val += h < threshold
            if lo is None or h < lo[0]:
                lo = (h, doc_id)
            if hi is None or h > hi[0]:
                hi = (h, doc_id)
    if n == 0:
        raise PackError(f"{where}: the corpus is empty; nothing to pack")
    if lo is None or hi is None or lo[1] == hi[1]:
        raise PackError(f"{where}: {n} document(s) with one distinct id; train and val need at least two documents")
    forced: dict[str, str] = {}
    if n_val == 0:
        forced[lo[1]] = "val"
    elif n_val == n:
        forced[hi[1]] = "train"
    return SplitPlan(n, seed, threshold, forced)


# --- workers ----------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _die_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel end this worker when pack dies, even by SIGKILL
    (an interrupted ``dvc repro``); elsewhere workers exit at their next task."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _init_worker(tokenizer_path: str, plan: SplitPlan, schema: pa.Schema, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # Before the first encode: rayon sizes its pool once, on first use.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tok=load_tokenizer(tokenizer_path), plan=plan, schema=schema)


def encode_docs(tok: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Encode ``texts``; return (flat ids with EOT after each non-empty doc, per-doc
    lengths including that EOT, number of docs that gave no tokens)."""
    encs = tok.encode_batch(texts)
    lens = np.fromiter(map(len, encs), np.int64, count=len(encs))
    flat = np.fromiter(chain.from_iterable(e.ids for e in encs), np.int32, count=int(lens.sum()))
    kept = lens[lens > 0]
    flat = np.insert(flat, np.cumsum(kept), np.int32(EOT_ID))
    return flat, (kept + 1).astype(np.int32), len(lens) - len(kept)


@dataclass
class Encoded:
    docs: int
    text_bytes: int
    # split -> (flat ids, doc lengths incl. EOT, docs routed there, docs with no tokens)
    parts: dict[str, tuple[np.ndarray, np.ndarray, int, int]]


def _encode_task(message: bytes) -> Encoded:
    batch = pa.ipc.read_record_batch(pa.py_buffer(message), _WORKER["schema"])
    plan: SplitPlan = _WORKER["plan"]
    texts_col = batch.column(1)
    nbytes = pc.sum(pc.binary_length(texts_col)).as_py() or 0
    routed: dict[str, list[str]] = {s: [] for s in SPLITS}
    for doc_id, text in zip(batch.column(0).to_pylist(), texts_col.to_pylist()):
        routed[plan.split_of(doc_id)].append(text or "")
    parts = {}
    for split, texts in routed.items():
        flat, lens, empty = encode_docs(_WORKER["tok"], texts)
        parts[split] = (flat, lens, len(texts), empty)
    return Encoded(batch.num_rows, nbytes, parts)


def resolve_workers(num_workers: int) -> int:
    return num_workers or available_cores()


def _tasks(pf: pq.ParquetFile, batch_docs: int, task_bytes: int) -> Iterator[bytes]:
    """Cut the table into runs of about ``task_bytes`` of text, as IPC messages: a
    sliced batch pickles its whole parent buffers, IPC writes only the slice."""
    for batch in pf.iter_batches(batch_size=batch_docs, columns=["id", "text"]):
        if batch.num_rows == 0:
            continue
        ends = np.cumsum(pc.fill_null(pc.binary_length(batch.column(1)), 0).to_numpy(), dtype=np.int64)
        cuts = np.searchsorted(ends, np.arange(task_bytes, int(ends[-1]), task_bytes), side="right")
        bounds = np.unique(np.concatenate(([0], cuts, [batch.num_rows])))
        for a, b in pairwise(bounds):
            yield batch.slice(a, b - a).serialize().to_pybytes()


def _encoded_batches(pf: pq.ParquetFile, tokenizer_path: Path, plan: SplitPlan, workers: int,
                     batch_docs: int, task_bytes: int) -> Iterator[Encoded]:
    """Encoded tasks in table order. A bounded window of futures, not Pool.imap,
    so that a slow consumer or a slow worker cannot make the queue hold the corpus."""
    # spawn, not fork: the parent holds Arrow and tokenizers thread pools that a
    # forked child would inherit in an unknown state.
    ctx = mp.get_context("spawn")
    window: deque[Future] = deque()
    max_in_flight = 2 * workers + 2
    schema = pa.schema([pf.schema_arrow.field("id"), pf.schema_arrow.field("text")])
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(str(tokenizer_path), plan, schema, os.getpid())) as ex:
        try:
            for task in _tasks(pf, batch_docs, task_bytes):
                window.append(ex.submit(_encode_task, task))
                if len(window) >= max_in_flight:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        except BaseException:
            for fut in window:
                fut.cancel()
            raise


# --- packing and writing ----------------------------------------------------------------------


def packed_schema(row_len: int) -> pa.Schema:
    return pa.schema(
        [pa.field("input_ids", pa.list_(pa.int32(), row_len), nullable=False),
         pa.field("doc_starts", pa.list_(pa.int32()), nullable=False)],
        metadata={"format": FORMAT, "row_len": str(row_len), "eot_id": str(EOT_ID)},
    )


def cut_rows(stream: np.ndarray, starts: np.ndarray, row_len: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut a token stream into full rows.

    ``starts`` are the sorted stream positions where documents begin. Returns
    ``(rows (n, row_len), starts_per_row (n,), start_offsets_in_row, rest, rest_starts)``
    where the offsets of row ``i`` are the next ``starts_per_row[i]`` values, always
    beginning with 0, and ``rest`` is the unfilled tail (with its own starts).
    """
    n = len(stream) // row_len
    cut = n * row_len
    row_begins = np.arange(n, dtype=np.int64) * row_len
    pos = np.union1d(row_begins, starts[starts < cut])
    counts = np.diff(np.searchsorted(pos, np.append(row_begins, cut)))
    tail = starts[starts >= cut]
    return (stream[:cut].reshape(n, row_len), counts, (pos % row_len).astype(np.int32),
            stream[cut:].copy(), tail - cut)


class SplitWriter:
    """Accumulates one split's token stream into shards of ``shard_rows`` rows."""

    def __init__(self, out_dir: Path, split: str, row_len: int, shard_rows: int):
        self.out_dir, self.split, self.row_len, self.shard_rows = out_dir, split, row_len, shard_rows
        self.schema = packed_schema(row_len)
        self.carry = np.empty(0, np.int32)
        self.carry_starts = np.empty(0, np.int64)
        self.buf = np.empty((0, row_len), np.int32)  # allocated on first row, so a tiny split stays tiny
        self.buf_rows = 0
        self.counts: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        self.shards: list[dict] = []
        self.docs = self.empty_docs = self.tokens = self.rows = 0

    def add(self, flat: np.ndarray, lens: np.ndarray, docs: int, empty: int) -> None:
        self.docs += docs
        self.empty_docs += empty
        if not len(flat):
            return
        self.tokens += len(flat)
        doc_starts = np.cumsum(lens, dtype=np.int64) - lens + len(self.carry)
        stream = np.concatenate((self.carry, flat))
        starts = np.concatenate((self.carry_starts, doc_starts))
        rows, counts, offsets, self.carry, self.carry_starts = cut_rows(stream, starts, self.row_len)
        done = 0
        while done < len(rows):
            if self.buf_rows == 0 and len(self.buf) == 0:
                self.buf = np.empty((self.shard_rows, self.row_len), np.int32)
            take = min(self.shard_rows - self.buf_rows, len(rows) - done)
            self.buf[self.buf_rows:self.buf_rows + take] = rows[done:done + take]
            c = counts[done:done + take]
            first = int(counts[:done].sum())
            self.counts.append(c)
            self.offsets.append(offsets[first:first + int(c.sum())])
            self.buf_rows += take
            done += take
            if self.buf_rows == self.shard_rows:
                self._flush()

    def _flush(self) -> None:
        if self.buf_rows == 0:
            return
        n = self.buf_rows
        ids = pa.FixedSizeListArray.from_arrays(pa.array(self.buf[:n].reshape(-1)), self.row_len)
        list_offsets = np.zeros(n + 1, np.int32)
        np.cumsum(np.concatenate(self.counts), out=list_offsets[1:])
        starts = pa.ListArray.from_arrays(pa.array(list_offsets), pa.array(np.concatenate(self.offsets)))
        batch = pa.record_batch([ids, starts], schema=self.schema)
        rel = f"{self.split}/shard-{len(self.shards):05d}.arrow"
        path = self.out_dir / rel
        with atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, \
                pa.ipc.new_file(sink, self.schema) as writer:
            writer.write_batch(batch)
        self.shards.append({"path": rel, "rows": n, "sha256": sha256_file(path)})
        self.rows += n
        self.buf_rows = 0
        self.counts, self.offsets = [], []

    def finish(self) -> dict:
        self._flush()
        self.buf = np.empty((0, self.row_len), np.int32)
        dropped = len(self.carry)
        if self.tokens != self.rows * self.row_len + dropped:
            raise AssertionError(f"{self.split}: token accounting is off")
        return {"docs": self.docs, "empty_docs": self.empty_docs, "tokens": self.tokens, "rows": self.rows,
                "dropped_tail_tokens": dropped, "shards": self.shards}


def _clear_outputs(out_dir: Path) -> None:
    # The manifest goes first: a directory without one is incomplete by contract.
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for split in SPLITS:
        d = out_dir / split
        if d.is_dir():
            for p in [*d.glob(SHARD_GLOB), *d.glob(".shard-*.tmp")]:
                p.unlink()


def run_pack(cfg: PackConfig, docs_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> dict:
    """Tokenize ``docs_path`` with ``tokenizer_path`` and write shards and manifest
    under ``out_dir`` (format in the module docstring). Stale shards of an earlier
    run are removed first; on failure no manifest is left behind.

    Returns metrics: docs, text_bytes, tokens, per split {docs, empty_docs, tokens,
    rows, dropped_tail_tokens, shards (count)}, tokens_per_s, mb_per_s (text MB), workers.
    Raises PackError on missing input or tokenizer, an empty or single-document
    corpus, or a split too small to fill one row.

    Workers are spawned processes, so a script that calls this must keep its own
    top-level code under ``if __name__ == "__main__":``.
    """
    t0 = time.perf_counter()
    docs_path, tokenizer_path, out_dir = Path(docs_path), Path(tokenizer_path), Path(out_dir)
    try:
        tok = load_tokenizer(tokenizer_path)
        specials = special_ids(tok)
    except TokenizerError as e:
        raise PackError(str(e)) from e
    pf = open_docs(docs_path, PackError)
    plan = plan_splits(pf, cfg.seed, cfg.val_fraction, where=str(docs_path))
    workers = resolve_workers(cfg.num_workers)
    row_len = cfg.seq_len + 1
    _clear_outputs(out_dir)
    shard_rows = max(1, cfg.shard_tokens // row_len)
    writers = {s: SplitWriter(out_dir, s, row_len, shard_rows) for s in SPLITS}
    docs = text_bytes = 0
    try:
        with progress(total=plan.docs, unit="doc", desc="pack") as bar:
            for enc in _encoded_batches(pf, tokenizer_path, plan, workers, cfg.batch_docs, cfg.task_bytes):
                for split, part in enc.parts.items():
                    writers[split].add(*part)
                docs += enc.docs
                text_bytes += enc.text_bytes
                bar.update(enc.docs)
        splits = {s: w.finish() for s, w in writers.items()}
        if docs != splits["train"]["docs"] + splits["val"]["docs"]:
            raise AssertionError(
                f"{docs} documents read but {splits['train']['docs']} + {splits['val']['docs']} packed")
        for s, info in splits.items():
            if info["rows"] == 0:
                raise PackError(
                    f"the {s} split has {info['tokens']} tokens from {info['docs']} document(s), fewer than one "
                    f"row of {row_len}; lower pack.seq_len, raise pack.val_fraction, or add data"
                )
    except BaseException:
        _clear_outputs(out_dir)
        raise
    total_tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    write_json(out_dir / MANIFEST, {
        "format": FORMAT,
        "seq_len": cfg.seq_len,
        "row_len": row_len,
        "dtype": "int32",
        "vocab_size": tok.get_vocab_size(),
        "eot_id": EOT_ID,
        "pad_id": PAD_ID,
        "special_ids": specials,
        "tokenizer_sha256": sha256_file(tokenizer_path),
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "docs": docs,
        "forced": plan.forced,
        "tokens": total_tokens,
        "splits": splits,
    })
    seconds = time.perf_counter() - t0
    return {
        "docs": docs,
        "text_bytes": text_bytes,
        "tokens": total_tokens,
        **{s: {**{k: v for k, v in info.items() if k != "shards"}, "shards": len(info["shards"])}
           for s, info in splits.items()},
        "tokens_per_s": round(total_tokens / seconds),
        "mb_per_s": round(text_bytes / seconds / 1e6, 3),
        "workers": workers,
        "pack_seconds": round(seconds, 3),
    }


# --- reading ----------------------------------------------------------------------------------


def segment_ids_from_starts(starts: np.ndarray, length: int) -> np.ndarray:
    """``(length,)`` int32: the index of the document segment each position belongs
    to, 0 for the first. ``starts`` is one row's ``doc_starts``; starts at or beyond
    ``length`` are ignored, so ``length=seq_len`` gives the ids for ``row[:-1]``."""
    seg = np.zeros(length, np.int32)
    starts = np.asarray(starts)
    seg[starts[(starts > 0) & (starts < length)]] = 1
    return np.cumsum(seg, dtype=np.int32)


@dataclass
class Shard:
    """One record batch of a shard file, backed by its memory map (no copies)."""

    path: Path
    input_ids: np.ndarray  # (rows, row_len) int32, read-only
    start_offsets: np.ndarray  # (rows + 1,) int32: row i's starts are start_values[o[i]:o[i+1]]
    start_values: np.ndarray  # int32

    def doc_starts(self, i: int) -> np.ndarray:
        return self.start_values[self.start_offsets[i]:self.start_offsets[i + 1]]


class PackedSplit:
    """All rows of one split, in stream order, across shards."""

    def __init__(self, manifest: dict, split: str, shards: list[Shard]):
        self.manifest, self.split, self.shards = manifest, split, shards
        self.row_len: int = manifest["row_len"]
        self.seq_len: int = manifest["seq_len"]
        self.eot_id: int = manifest["eot_id"]
        self.pad_id: int = manifest["pad_id"]
        self.vocab_size: int = manifest["vocab_size"]
        self._first_row = np.cumsum([0] + [len(s.input_ids) for s in shards])

    def __len__(self) -> int:
        return int(self._first_row[-1])

    def _locate(self, i: int) -> tuple[Shard, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        i %= len(self)
        k = int(np.searchsorted(self._first_row, i, side="right")) - 1
        return self.shards[k], i - int(self._first_row[k])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(row (row_len,) int32 view, doc_starts (k,) int32)``."""
        shard, j = self._locate(i)
        return shard.input_ids[j], shard.doc_starts(j)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """``(len(idx), row_len)`` int32, gathered (a copy)."""
        return np.stack([self[int(i)][0] for i in idx]) if len(idx) else np.empty((0, self.row_len), np.int32)

    def segment_ids(self, idx: np.ndarray, length: int | None = None) -> np.ndarray:
        """``(len(idx), length)`` int32 segment ids; ``length`` defaults to ``seq_len``
        (the input positions)."""
        length = self.seq_len if length is None else length
        out = np.empty((len(idx), length), np.int32)
        for r, i in enumerate(idx):
            out[r] = segment_ids_from_starts(self[int(i)][1], length)
        return out


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise PackError(f"{path} not found; the pack stage has not completed in {out_dir}")
    manifest = read_json(path)
    if manifest.get("format") != FORMAT:
        raise PackError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def open_split(out_dir: str | Path, split: str, verify: bool = False) -> PackedSplit:
    """Memory-map every shard of ``split`` listed in the manifest and check its
    schema and row count (and, with ``verify``, its sha256). Raises PackError on a
    missing manifest or shard, or a shard that disagrees with the manifest."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    if split not in manifest["splits"]:
        raise PackError(f"no split {split!r} in {out_dir / MANIFEST}; splits are {list(manifest['splits'])}")
    row_len = manifest["row_len"]
    expected = packed_schema(row_len)
    shards: list[Shard] = []
    for entry in manifest["splits"][split]["shards"]:
        path = out_dir / entry["path"]
        if not path.is_file():
            raise PackError(f"{path}: listed in the manifest but missing")
        if verify and sha256_file(path) != entry["sha256"]:
            raise PackError(f"{path}: sha256 does not match the manifest")
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        if not reader.schema.equals(expected):
            raise PackError(f"{path}: schema {reader.schema} is not the packed schema for row_len {row_len}")
        rows = 0
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            ids = batch.column(0)
            starts = batch.column(1)
            shards.append(Shard(
                path,
                ids.flatten().to_numpy(zero_copy_only=True).reshape(-1, row_len),
                starts.offsets.to_numpy(zero_copy_only=True),
                starts.values.to_numpy(zero_copy_only=True),
            ))
            rows += batch.num_rows
        if rows != entry["rows"]:
            raise PackError(f"{path}: {rows} rows, manifest says {entry['rows']}")
    return PackedSplit(manifest, split, shards)


def baseline_encode(texts: list[str], tokenizer_path: str | Path, batch_docs: int = 1024) -> dict:
    """Time the library's own ``encode_batch`` over in-memory ``texts`` in this
    process, with the tokenizer settings pack uses, as a yardstick for pack's
    throughput. Its threads follow RAYON_NUM_THREADS / TOKENIZERS_PARALLELISM as set
    before the first encode in this process. Returns seconds, tokens, bytes,
    tokens_per_s, mb_per_s."""
    tok = load_tokenizer(tokenizer_path)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_docs):
        tokens += sum(len(e) for e in tok.encode_batch(texts[i:i + batch_docs]))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "bytes": nbytes,
            "tokens_per_s": tokens / seconds, "mb_per_s": nbytes / seconds / 1e6}
