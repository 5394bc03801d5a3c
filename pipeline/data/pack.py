"""pack: tokenize the clean documents and pack them into fixed-length training rows.

Input: a Parquet table with columns ``id`` and ``text`` (``data/clean/docs.parquet``),
and ``source`` and ``chunk`` where ingest cut long texts into chunks, and the
trained ``tokenizer.json``. Output, under ``out_dir`` (``data/packed``)::

    train/shard-00000.arrow, train/shard-00001.arrow, ...
    val/shard-00000.arrow, ...
    manifest.json

On-disk contract (format ``pipeline.pack/1``)
---------------------------------------------
*Split* (``val_by: hash``, the default). A document is in ``val`` iff
``h(seed, id) < val_fraction · 2**64``, where ``h`` is the 64-bit big-endian
BLAKE2b digest of ``f"{seed}\\0{id}"`` (person ``pack-spl``). A document, or a
chunk, therefore always lands wholly in the same split, whatever the worker
count, batch size or row order.

*Split by position* (``val_by: position``), for long texts cut into chunks: the
end of each file goes to ``val``, as nanoGPT holds out the end of its text. A
chunk goes to val iff its middle byte lies in the last ``val_fraction`` of its
file's text (the text of the file's chunks in the table, in chunk order), so a
file of one chunk stays in train. Documents that are not chunks are split by
hash. Either way each document gets a score ``u`` (the hash, or
``(1 - middle / file bytes) · 2**64``) and goes to val iff ``u`` is below the
threshold.

*Tiny corpora.* When no document scores into ``val``, the one with the smallest
``u`` is moved there; when every document does, the one with the largest goes to
``train``. A corpus needs at least two distinct ids; the moved ids are recorded
in the manifest under ``forced``.

*Token stream.* Per split, documents in table order, each encoded with
special-token parsing off (a literal ``"<|endoftext|>"`` in the text is ordinary
bytes) and followed by one EOT id, except that a chunk joins the document before
it in its split, with no EOT and no document start between them, when that
document is the previous chunk of the same file (same ``source``, ``chunk`` one
less). Consecutive chunks that both survived cleaning and landed in the same
split are thus one document, the text of the file as one stream; a chunk dropped
by clean (or sent to the other split, or empty) leaves a gap in the indices and
so a document boundary. The decision uses the recorded ``source`` and ``chunk``,
never the rows' position alone. A document that encodes to no tokens
contributes nothing, not even EOT, and is counted as ``empty_docs``; the
manifest counts the joins per split as ``joined``.

*Rows.* The stream is cut into consecutive rows of ``row_len = seq_len + 1`` tokens;
training uses ``inputs = row[:-1]`` and ``targets = row[1:]``. The last
``tokens mod row_len`` tokens of each split do not fill a row and are dropped;
their count is ``dropped_tail_tokens``.

*Shards and manifest.* In the packed-row format of :mod:`pipeline.data.shards`
(format ``pipeline.pack/1``; no ``labels`` column), at most
``max(1, shard_tokens // row_len)`` rows per shard. Every ``doc_starts`` offset
``p > 0`` has ``row[p - 1] == eot_id``; the schema metadata adds ``eot_id``. The
manifest's own fields are ``seed``, ``val_fraction``, ``docs``, ``forced`` (id ->
split), ``tokens`` (both splits) and ``val_by``, and each split lists ``docs``,
``empty_docs``, ``joined`` (chunks packed onto the chunk before), ``tokens``
(incl. EOTs; ``= rows · row_len + dropped_tail_tokens``), ``rows`` and
``dropped_tail_tokens``. Read it with
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
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field

from pipeline.config import StageConfig
from pipeline.data.shards import SPLITS, ShardWriter, clear_outputs, row_schema, write_manifest
from pipeline.data.tokenizer import (
    EOT_ID,
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
    val_fraction: float = Field(0.05, gt=0.0, le=0.5,
                                description="share of documents (val_by: position: of each chunked text) in val")
    seed: int = Field(0, ge=0, description="chooses the train/val split")
    num_workers: int = Field(0, ge=0, le=512, description="tokenizer processes; 0 = one per available core")
    shard_tokens: int = Field(1 << 23, ge=1, le=MAX_SHARD_TOKENS,
                              description="tokens per Arrow shard file, rounded down to whole rows (at least one)")
    batch_docs: int = Field(1024, ge=1, le=1_000_000, description="documents read from Parquet at a time")
    task_bytes: int = Field(1_000_000, ge=1_000, le=1_000_000_000,
                            description="text bytes per tokenizer task (a larger document is one task)")
    val_by: Literal["hash", "position"] = Field(
        "hash", description="hash: each document or chunk goes to val by hash(seed, id); position: the last "
                            "val_fraction of each text cut with ingest split_by: chunk (other documents by hash)")


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
    # val_by: position: source -> index of its first val chunk (a file's val chunks are its last ones)
    first_val_chunk: dict[str, int] | None = None

    def split_of(self, doc_id: str, source: str | None = None, chunk: int | None = None) -> str:
        if doc_id in self.forced:
            return self.forced[doc_id]
        if self.first_val_chunk is not None and chunk is not None:
            first = self.first_val_chunk.get(source)  # type: ignore[arg-type]
            return "val" if first is not None and chunk >= first else "train"
        return "val" if split_hash(self.seed, doc_id) < self.threshold else "train"


def position_score(before: int, nbytes: int, total: int) -> int:
    """``u`` of a chunk for ``val_by: position``: ``(1 - middle / total) · 2**64``,
    rounded down, in integers; below ``val_threshold(f)`` iff the chunk's middle
    byte lies in the last ``f`` of its file's text."""
    if total <= 0:
        return 2**64 - 1
    return ((2 * total - 2 * before - nbytes) << 64) // (2 * total)


def plan_splits(pf: pq.ParquetFile, seed: int, val_fraction: float, where: str = "documents",
                val_by: str = "hash") -> SplitPlan:
    """Read the ``id`` column once (and, with ``val_by: position``, ``source``,
    ``chunk`` and the text's length) to score every document and apply the
    tiny-corpus rules (see the module docstring). Raises PackError on an empty
    corpus, null ids, fewer than two ids, or ``position`` without chunks."""
    threshold = val_threshold(val_fraction)
    position = val_by == "position"
    if position and not {"source", "chunk"} <= set(pf.schema_arrow.names):
        raise PackError(f"{where}: pack.val_by: position holds out the end of each chunked text, but the "
                        "documents have no chunk column; use ingest split_by: chunk, or pack.val_by: hash")
    n = n_val = 0
    lo: tuple[int, int, str] | None = None  # (u, row, id): the first of the smallest scores
    hi: tuple[int, int, str] | None = None  # (u, -row, id): the first of the largest

    def score(u: int, row: int, doc_id: str) -> None:
        nonlocal n_val, lo, hi
        n_val += u < threshold
        if lo is None or (u, row) < lo[:2]:
            lo = (u, row, doc_id)
        if hi is None or (u, -row) > hi[:2]:
            hi = (u, -row, doc_id)

    files: dict[str | None, list[tuple[int, int, int, str]]] = {}  # source -> [(chunk, bytes, row, id)]
    columns = ["id", "source", "chunk", "text"] if position else ["id"]
    for batch in pf.iter_batches(batch_size=65_536, columns=columns):
        col = batch.column(0)
        if col.null_count:
            raise PackError(f"{where}: {col.null_count} document(s) have a null id")
        if position:
            chunks = batch.column(2).to_pylist()
            sources = batch.column(1).to_pylist()
            sizes = pc.fill_null(pc.binary_length(batch.column(3)), 0).to_pylist()
        for i, doc_id in enumerate(col.to_pylist()):
            if position and chunks[i] is not None:
                files.setdefault(sources[i], []).append((chunks[i], sizes[i], n, doc_id))
            else:
                score(split_hash(seed, doc_id), n, doc_id)
            n += 1
    if position and not files:
        raise PackError(f"{where}: pack.val_by: position holds out the end of each chunked text, but no "
                        "document is a chunk; use ingest split_by: chunk, or pack.val_by: hash")
    first_val: dict[str, int] | None = {} if position else None
    for source, chunks_of in files.items():
        chunks_of.sort(key=lambda c: c[0])
        total = sum(c[1] for c in chunks_of)
        before = 0
        for chunk, nbytes, row, doc_id in chunks_of:
            u = position_score(before, nbytes, total)
            score(u, row, doc_id)
            if u < threshold and source not in first_val:  # type: ignore[operator]
                first_val[source] = chunk  # type: ignore[index]
            before += nbytes
    if n == 0:
        raise PackError(f"{where}: the corpus is empty; nothing to pack")
    if lo is None or hi is None or lo[2] == hi[2]:
        raise PackError(f"{where}: {n} document(s) with one distinct id; train and val need at least two "
                        "documents (for one text cut with ingest split_by: chunk, lower chunk_bytes)")
    forced: dict[str, str] = {}
    if n_val == 0:
        forced[lo[2]] = "val"
    elif n_val == n:
        forced[hi[2]] = "train"
    return SplitPlan(n, seed, threshold, forced, first_val)


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


def encode_docs(tok: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode ``texts``; return (flat ids of the docs that gave tokens, their token
    counts, a mask over ``texts`` of those docs). No EOT: :meth:`SplitWriter.add`
    separates documents."""
    encs = tok.encode_batch(texts)
    lens = np.fromiter(map(len, encs), np.int64, count=len(encs))
    flat = np.fromiter(chain.from_iterable(e.ids for e in encs), np.int32, count=int(lens.sum()))
    return flat, lens[lens > 0], lens > 0


Key = tuple[str, int]  # (source, chunk) of a chunk of a long text


def follows(prev: Key | None, key: Key | None) -> bool:
    """Whether ``key`` is the chunk right after ``prev`` in the same file."""
    return prev is not None and key is not None and key[0] == prev[0] and key[1] == prev[1] + 1


@dataclass
class Part:
    """One task's documents routed to one split, encoded."""

    flat: np.ndarray  # token ids of the docs that gave tokens, back to back
    lens: np.ndarray  # their token counts
    joins: np.ndarray  # bool per such doc: it continues the doc before it (joins[0] is decided by the writer)
    docs: int  # docs routed here, including empty ones
    empty: int  # docs that gave no tokens
    head: Key | None  # key of the first and last doc that gave tokens (None: not a chunk)
    tail: Key | None


def encode_part(tok: Any, texts: list[str], keys: list[Key | None]) -> Part:
    flat, lens, nonempty = encode_docs(tok, texts)
    kept = [k for k, ok in zip(keys, nonempty) if ok]
    joins = np.zeros(len(kept), bool)
    joins[1:] = [follows(a, b) for a, b in pairwise(kept)]
    return Part(flat, lens, joins, len(texts), len(texts) - len(kept),
                kept[0] if kept else None, kept[-1] if kept else None)


@dataclass
class Encoded:
    docs: int
    text_bytes: int
    parts: dict[str, Part]


def _encode_task(message: bytes) -> Encoded:
    batch = pa.ipc.read_record_batch(pa.py_buffer(message), _WORKER["schema"])
    plan: SplitPlan = _WORKER["plan"]
    texts_col = batch.column(1)
    nbytes = pc.sum(pc.binary_length(texts_col)).as_py() or 0
    keys: list[Key | None] = [None] * batch.num_rows
    if batch.num_columns == 4 and batch.column(3).null_count < batch.num_rows:
        keys = [None if c is None else (s, c) for s, c in zip(batch.column(2).to_pylist(), batch.column(3).to_pylist())]
    routed: dict[str, tuple[list[str], list[Key | None]]] = {s: ([], []) for s in SPLITS}
    for doc_id, text, key in zip(batch.column(0).to_pylist(), texts_col.to_pylist(), keys):
        texts, split_keys = routed[plan.split_of(doc_id, *(key or (None, None)))]
        texts.append(text or "")
        split_keys.append(key)
    return Encoded(batch.num_rows, nbytes, {s: encode_part(_WORKER["tok"], *r) for s, r in routed.items()})


def resolve_workers(num_workers: int) -> int:
    return num_workers or available_cores()


def task_columns(pf: pq.ParquetFile) -> list[str]:
    """What a worker reads: ``id`` and ``text``, and ``source`` and ``chunk`` where present."""
    return ["id", "text", *(["source", "chunk"] if {"source", "chunk"} <= set(pf.schema_arrow.names) else [])]


def _tasks(pf: pq.ParquetFile, batch_docs: int, task_bytes: int) -> Iterator[bytes]:
    """Cut the table into runs of about ``task_bytes`` of text, as IPC messages: a
    sliced batch pickles its whole parent buffers, IPC writes only the slice."""
    for batch in pf.iter_batches(batch_size=batch_docs, columns=task_columns(pf)):
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
    schema = pa.schema([pf.schema_arrow.field(name) for name in task_columns(pf)])
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
    """Accumulates one split's token stream into shards of ``shard_rows`` rows.
    :meth:`add` is where documents are separated by ``eot_id``, the tokenizer's
    own end-of-text id (``run_pack`` passes it from the tokenizer folder)."""

    def __init__(self, out_dir: Path, split: str, row_len: int, shard_rows: int, eot_id: int = EOT_ID):
        self.split, self.row_len, self.shard_rows, self.eot_id = split, row_len, shard_rows, eot_id
        self.writer = ShardWriter(out_dir, split, packed_schema(row_len, eot_id))
        self.carry = np.empty(0, np.int32)
        self.carry_starts = np.empty(0, np.int64)
        self.buf = np.empty((0, row_len), np.int32)  # allocated on first row, so a tiny split stays tiny
        self.buf_rows = 0
        self.counts: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        self.docs = self.empty_docs = self.joined = self.tokens = self.rows = 0
        self.last: Key | None = None  # key of the last document added, if a chunk
        self.open = False  # a document has been added and awaits its EOT

    def add(self, part: Part) -> None:
        """Append ``part``'s documents to the stream. A document is separated from
        the one before by one EOT and starts a new segment, unless it is the next
        chunk of the same file, which continues the previous document's segment
        with no EOT. Each EOT is written before the document that it separates,
        so that a chunk in the next task can still join; :meth:`finish` ends the
        last document with its EOT."""
        self.docs += part.docs
        self.empty_docs += part.empty
        if not len(part.lens):
            return
        joins = part.joins.copy()
        joins[0] = follows(self.last, part.head)
        self.last = part.tail
        self.joined += int(joins.sum())
        begins = np.cumsum(part.lens) - part.lens  # each document's first token in part.flat
        eot_before = ~joins
        eot_before[0] &= self.open
        self.open = True
        flat = np.insert(part.flat, begins[eot_before], np.int32(self.eot_id))
        begins += np.cumsum(eot_before)  # ... in flat, after the EOTs inserted
        self._append(flat, begins[~joins])

    def _append(self, flat: np.ndarray, doc_starts: np.ndarray) -> None:
        self.tokens += len(flat)
        stream = np.concatenate((self.carry, flat))
        starts = np.concatenate((self.carry_starts, doc_starts + len(self.carry)))
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
        if self.open:
            self._append(np.array([self.eot_id], np.int32), np.empty(0, np.int64))
            self.open = False
        self._flush()
        self.buf = np.empty((0, self.row_len), np.int32)
        dropped = len(self.carry)
        if self.tokens != self.rows * self.row_len + dropped:
            raise AssertionError(f"{self.split}: token accounting is off")
        return {"docs": self.docs, "empty_docs": self.empty_docs, "joined": self.joined, "tokens": self.tokens,
                "rows": self.rows, "dropped_tail_tokens": dropped, "shards": self.writer.shards}


def run_pack(cfg: PackConfig, docs_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> dict:
    """Tokenize ``docs_path`` with ``tokenizer_path`` and write shards and manifest
    under ``out_dir`` (format in the module docstring). Stale shards of an earlier
    run are removed first; on failure no manifest is left behind.

    Returns metrics: docs, bytes (of text), tokens, train_rows, val_rows, tokens_per_s,
    mb_per_s (text MB), workers, pack_seconds. The manifest is the report: per
    split docs, empty_docs, joined, tokens, dropped_tail_tokens and the shards.
    Raises PackError on missing input or tokenizer, an empty or single-document
    corpus, or a split too small to fill one row.

    Workers are spawned processes, so a script that calls this must keep its own
    top-level code under ``if __name__ == "__main__":``.
    """
    t0 = time.perf_counter()
    docs_path, tokenizer_path, out_dir = Path(docs_path), Path(tokenizer_path), Path(out_dir)
    tok, specials = open_tokenizer(tokenizer_path, PackError)
    pf = open_docs(docs_path, PackError)
    plan = plan_splits(pf, cfg.seed, cfg.val_fraction, where=str(docs_path), val_by=cfg.val_by)
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
                    writers[split].add(part)
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
                       "seed": cfg.seed, "val_fraction": cfg.val_fraction, "val_by": cfg.val_by, "docs": docs,
                       "forced": plan.forced, "tokens": total_tokens})
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
