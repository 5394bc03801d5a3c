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

*Shards and manifest.* In the packed-row format of :mod:`pipeline.data.shards`
(format ``pipeline.pack/1``; no ``labels`` column), at most
``max(1, shard_tokens // row_len)`` rows per shard. Every ``doc_starts`` offset
``p > 0`` has ``row[p - 1] == eot_id``; the schema metadata adds ``eot_id``. The
manifest's own fields are ``seed``, ``val_fraction``, ``docs``, ``forced`` (id ->
split) and ``tokens`` (both splits), and each split lists ``docs``,
``empty_docs``, ``tokens`` (incl. EOTs; ``= rows · row_len + dropped_tail_tokens``),
``rows`` and ``dropped_tail_tokens``. Read it with
:class:`pipeline.data.shards.PackedRows`.

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
from pipeline.data.shards import SPLITS, ShardWriter, clear_outputs, row_schema, write_manifest
from pipeline.data.tokenizer import (
    EOT_ID,
    load_specials,
    load_tokenizer,
    open_docs,
    open_tokenizer,
)
from pipeline.errors import StageError
from pipeline.files import available_cores
from pipeline.progress import progress

log = logging.getLogger("pipeline.data.pack")

FORMAT = "pipeline.pack/1"
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
    _WORKER.update(tok=load_tokenizer(tokenizer_path), eot=load_specials(tokenizer_path).eot_id, plan=plan,
                   schema=schema)


def encode_docs(tok: Any, texts: list[str], eot_id: int = EOT_ID) -> tuple[np.ndarray, np.ndarray, int]:
    """Encode ``texts``; return (flat ids with ``eot_id`` after each non-empty doc,
    per-doc lengths including that EOT, number of docs that gave no tokens). The
    end-of-text id is the tokenizer's own (``Specials.eot_id``)."""
    encs = tok.encode_batch(texts)
    lens = np.fromiter(map(len, encs), np.int64, count=len(encs))
    flat = np.fromiter(chain.from_iterable(e.ids for e in encs), np.int32, count=int(lens.sum()))
    kept = lens[lens > 0]
    flat = np.insert(flat, np.cumsum(kept), np.int32(eot_id))
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
        flat, lens, empty = encode_docs(_WORKER["tok"], texts, _WORKER["eot"])
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


def packed_schema(row_len: int, eot_id: int = EOT_ID) -> pa.Schema:
    return row_schema(FORMAT, row_len, metadata={"eot_id": str(eot_id)})


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

    def __init__(self, out_dir: Path, split: str, row_len: int, shard_rows: int, eot_id: int = EOT_ID):
        self.split, self.row_len, self.shard_rows = split, row_len, shard_rows
        self.writer = ShardWriter(out_dir, split, packed_schema(row_len, eot_id))
        self.carry = np.empty(0, np.int32)
        self.carry_starts = np.empty(0, np.int64)
        self.buf = np.empty((0, row_len), np.int32)  # allocated on first row, so a tiny split stays tiny
        self.buf_rows = 0
        self.counts: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
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
        list_offsets = np.zeros(n + 1, np.int32)
        np.cumsum(np.concatenate(self.counts), out=list_offsets[1:])
        self.writer.write(self.buf[:n], list_offsets, np.concatenate(self.offsets))
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
                "dropped_tail_tokens": dropped, "shards": self.writer.shards}


def run_pack(cfg: PackConfig, docs_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> dict:
    """Tokenize ``docs_path`` with ``tokenizer_path`` and write shards and manifest
    under ``out_dir`` (format in the module docstring). Stale shards of an earlier
    run are removed first; on failure no manifest is left behind.

    Returns metrics: docs, bytes (of text), tokens, train_rows, val_rows, tokens_per_s,
    mb_per_s (text MB), workers, pack_seconds. The manifest is the report: per
    split docs, empty_docs, tokens, dropped_tail_tokens and the shards.
    Raises PackError on missing input or tokenizer, an empty or single-document
    corpus, or a split too small to fill one row.

    Workers are spawned processes, so a script that calls this must keep its own
    top-level code under ``if __name__ == "__main__":``.
    """
    t0 = time.perf_counter()
    docs_path, tokenizer_path, out_dir = Path(docs_path), Path(tokenizer_path), Path(out_dir)
    tok, specials = open_tokenizer(tokenizer_path, PackError)
    pf = open_docs(docs_path, PackError)
    plan = plan_splits(pf, cfg.seed, cfg.val_fraction, where=str(docs_path))
    workers = resolve_workers(cfg.num_workers)
    row_len = cfg.seq_len + 1
    clear_outputs(out_dir)
    shard_rows = max(1, cfg.shard_tokens // row_len)
    writers = {s: SplitWriter(out_dir, s, row_len, shard_rows, specials["eot"]) for s in SPLITS}
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
        clear_outputs(out_dir)
        raise
    total_tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    write_manifest(out_dir, fmt=FORMAT, seq_len=cfg.seq_len, vocab_size=tok.get_vocab_size(),
                   special_ids=specials, tokenizer_path=tokenizer_path, labels=False, splits=splits, fields={
                       "seed": cfg.seed, "val_fraction": cfg.val_fraction, "docs": docs, "forced": plan.forced,
                       "tokens": total_tokens})
    seconds = time.perf_counter() - t0
    return {
        "docs": docs,
        "bytes": text_bytes,
        "tokens": total_tokens,
        **{f"{s}_rows": info["rows"] for s, info in splits.items()},
        "tokens_per_s": round(total_tokens / seconds),
        "mb_per_s": round(text_bytes / seconds / 1e6, 3),
        "workers": workers,
        "pack_seconds": round(seconds, 3),
    }


# --- yardstick --------------------------------------------------------------------------------


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
