"""pack: tokenize the clean documents and pack them into fixed-length training rows.

Input: a Parquet table with columns ``id`` and ``text`` (``data/clean/docs.parquet``),
and ``source`` and ``chunk`` where ingest cut long texts into chunks, and the
trained ``tokenizer.json``. Output, under ``out_dir`` (``data/packed``)::

    train/shard-00000.arrow, train/shard-00001.arrow, ...
    val/shard-00000.arrow, ...
    manifest.json

and beside them, outside the format (its readers never look at them), each
shard's commit record ``shard-NNNNN.json`` and the checkpoints
``checkpoint-NNNNN.{json,npz}`` from which a killed run resumes (see
:func:`run_pack`).

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
manifest counts the joins per split as ``joined``. With a tokenizer that adds
to every text it encodes, a BOS (Llama 3's) or a dummy prefix
(SentencePiece-style, as Llama 2's and Mistral's: "Hello" is "▁Hello"), a
chunk that is not its file's first is encoded without the BOS, and as its text
follows a newline, without that prefix (:func:`encode_continued`), whether it
joins or starts a document after a gap.

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

*Sources.* Where the documents carry ingest's ``source_name`` and ``split``
columns: a document marked ``split`` ``val`` or ``train`` goes there whatever
its hash (the tiny-corpus rules move only unmarked documents); with more than
one source, each source's val documents are also packed alone into
``val-source-NN/`` (listed under ``splits``, named in ``val_sources``), and the
manifest adds ``marked`` and per source ``sources.<name>`` (documents and
document tokens per split, EOTs not counted, and the share of the train
tokens). With ``mixture`` the train split is the mixture's (see
:class:`Mixture`): its ``docs`` counts copies, and ``sources`` adds the
available, target and realised tokens, the copies and the documents dropped.
One unmarked source without a mixture writes the manifest as before.

Speed: tokenization runs on ``executor`` (:mod:`pipeline.data.executor`: a
local process pool or Ray tasks, the same output either way), each worker with
its own single-threaded tokenizer (the library's own threads scale poorly on
some machines; processes scale everywhere). A task is a range of rows, whole
Parquet row groups of at least ``task_bytes`` of text (:func:`row_spans`),
which the worker reads itself, ``batch_docs`` rows at a time, and encodes
(:func:`encode_texts`: token ids and counts out, as numpy arrays), in calls
of about ``task_bytes``. The main process reads no text (but that of a row
group too large for one task, which it sends in runs of ``task_bytes``),
only the small columns it routes by, and does everything else with array
operations: the split (one bit per row, planned while the workers start),
routing, chunk joins, document starts and rows. The
one per-document Python step left is the split hash's ``hashlib`` call (about
0.3 µs a document; with ``val_by: position``, a chunk's score too). At most
``2 · workers + 2`` tasks are in flight, so memory does not grow with the
corpus (the plan's bits aside: 1 MB per 8 million documents).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field

from pipeline.data import docs as docs_module
from pipeline.data import mixture as mixture_module
from pipeline.data import resume
from pipeline.data import shards as shards_module
from pipeline.data import shares as shares_module
from pipeline.data import tokenizer as tokenizer_module
from pipeline.data.docs import (
    DocTable,
    RunCutter,
    identity,
    row_spans,
    table_as_seen,
    text_lengths,
)
from pipeline.data.executor import Executor, ExecutorConfig, ParallelStageConfig, open_executor
from pipeline.data.mixture import (
    MixtureError,
    Share,
    check_names,
    empty_warnings,
    order_keys,
    repeat_warnings,
    targets,
)
from pipeline.data.resume import ShardLog
from pipeline.data.shares import multiplicities
from pipeline.data.shards import MANIFEST, SPLITS, ShardWriter, clear_outputs, row_schema, write_manifest
from pipeline.data.tokenizer import (
    EOT_ID,
    SPECIALS_FILE,
    id_space,
    load_tokenizer,
    open_docs,
    open_tokenizer,
    parse_tokenizer,
    tokenizer_dir,
)
from pipeline.errors import StageError
from pipeline.files import read_json, sha256_file, write_json
from pipeline.progress import progress

log = logging.getLogger("pipeline.data.pack")

FORMAT = "pipeline.pack/1"
# pack holds one shard per split in memory: 256 MiB of int32 each at most.
MAX_SHARD_TOKENS = 1 << 26


class PackConfig(ParallelStageConfig):
    seq_len: int = Field(256, ge=8, le=1_048_576, description="tokens a model sees per row; rows hold seq_len + 1")
    val_fraction: float = Field(0.05, gt=0.0, le=0.5,
                                description="share of documents (val_by: position: of each chunked text) in val")
    seed: int = Field(0, ge=0, description="chooses the train/val split")
    shard_tokens: int = Field(1 << 23, ge=1, le=MAX_SHARD_TOKENS,
                              description="tokens per Arrow shard file, rounded down to whole rows (at least one)")
    batch_docs: int = Field(1024, ge=1, le=1_000_000,
                            description="documents a worker reads from Parquet and encodes at a time")
    task_bytes: int = Field(1_000_000, ge=1_000, le=1_000_000_000,
                            description="text bytes per tokenizer task at least: whole Parquet row groups, which "
                                        "the worker reads itself")
    val_by: Literal["hash", "position"] = Field(
        "hash", description="hash: each document or chunk goes to val by hash(seed, id); position: the last "
                            "val_fraction of each text cut with ingest split_by: chunk (other documents by hash)")
    mixture: dict[str, Share] = Field(
        default_factory=dict, description="source name -> {weight: w} or {tokens: n}: each source's part of the "
                                          "train tokens (empty: every document once); see 'Mixtures' above")
    max_repeats: float = Field(4.0, gt=0, description="a mixture that repeats a source's documents more often "
                                                      "than this on average is a warning with the figures")


class PackError(StageError):
    """Packing cannot proceed: missing input, too little data, or a bad packed directory."""


# --- split assignment -----------------------------------------------------------------------

SPLIT_PERSON = b"pack-spl"


def split_hash(seed: int, doc_id: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{doc_id}".encode(), digest_size=8, person=SPLIT_PERSON).digest()
    return int.from_bytes(digest, "big")


def split_hashes(seed: int, ids: list[str]) -> np.ndarray:
    """:func:`split_hash` of each id, as uint64: the seed prefix is hashed once and
    each id continues a copy of that state, the same digest at a third of the cost."""
    prefix = hashlib.blake2b(f"{seed}\x00".encode(), digest_size=8, person=SPLIT_PERSON)
    digests = []
    for doc_id in ids:
        h = prefix.copy()
        h.update(doc_id.encode())
        digests.append(h.digest())
    return np.frombuffer(b"".join(digests), ">u8").astype(np.uint64)


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
    # one bit per row of the table (np.packbits, little bit order): the row is in val; what
    # run_pack routes by. split_of is the rule it encodes, one document at a time.
    val_bits: np.ndarray | None = field(default=None, compare=False, repr=False)
    # source names (ingest's source_name column), in order of first appearance; empty without the column
    sources: tuple[str, ...] = ()
    marked: dict[str, int] = field(default_factory=dict)  # documents marked split: train / val
    # the sources with documents not marked split: val, which can give train tokens: what pack.mixture must list
    trainable: tuple[str, ...] = ()

    def split_of(self, doc_id: str, source: str | None = None, chunk: int | None = None,
                 mark: str | None = None) -> str:
        if mark is not None:
            return mark
        if doc_id in self.forced:
            return self.forced[doc_id]
        if self.first_val_chunk is not None and chunk is not None:
            first = self.first_val_chunk.get(source)  # type: ignore[arg-type]
            return "val" if first is not None and chunk >= first else "train"
        return "val" if split_hash(self.seed, doc_id) < self.threshold else "train"

    def val_mask(self, start: int, stop: int) -> np.ndarray:
        """bool per row in ``[start, stop)``: the row is in val."""
        if self.val_bits is None:
            raise ValueError("this plan has no per-row bits; build it with plan_splits")
        if not 0 <= start <= stop <= self.docs:
            raise IndexError(f"rows [{start}, {stop}) outside the plan's {self.docs}")
        lo = start - start % 8
        bits = np.unpackbits(self.val_bits[lo // 8:(stop + 7) // 8], bitorder="little")
        return bits[start - lo:stop - lo].astype(bool)


def position_score(before: int, nbytes: int, total: int) -> int:
    """``u`` of a chunk for ``val_by: position``: ``(1 - middle / total) · 2**64``,
    rounded down, in integers; below ``val_threshold(f)`` iff the chunk's middle
    byte lies in the last ``f`` of its file's text."""
    if total <= 0:
        return 2**64 - 1
    return ((2 * total - 2 * before - nbytes) << 64) // (2 * total)


class _Scores:
    """The running count of val scores and the first of the smallest and of the
    largest score (for the tiny-corpus rules), over documents scored in any order."""

    def __init__(self, threshold: int):
        self.threshold, self.n_val = threshold, 0
        self.lo: tuple[int, int, str] | None = None  # (u, row, id)
        self.hi: tuple[int, int, str] | None = None  # (u, -row, id)

    def one(self, u: int, row: int, doc_id: str) -> None:
        self.n_val += u < self.threshold
        self._extremes(u, row, doc_id)

    def many(self, u: np.ndarray, rows: np.ndarray, ids: list[str]) -> None:
        """Score a batch; ``rows`` ascending, so np.argmin/argmax find its earliest extreme."""
        if not len(u):
            return
        self.n_val += int(np.count_nonzero(u < np.uint64(self.threshold)))
        for i in (int(np.argmin(u)), int(np.argmax(u))):
            self._extremes(int(u[i]), int(rows[i]), ids[i])

    def _extremes(self, u: int, row: int, doc_id: str) -> None:
        if self.lo is None or (u, row) < self.lo[:2]:
            self.lo = (u, row, doc_id)
        if self.hi is None or (u, -row) > self.hi[:2]:
            self.hi = (u, -row, doc_id)


class _Bits:
    """Appends bools and packs them eight to a byte as they come."""

    def __init__(self) -> None:
        self.packed: list[np.ndarray] = []
        self.pending = np.empty(0, bool)

    def extend(self, mask: np.ndarray) -> None:
        mask = np.concatenate((self.pending, mask))
        whole = len(mask) - len(mask) % 8
        self.packed.append(np.packbits(mask[:whole], bitorder="little"))
        self.pending = mask[whole:]

    def finish(self) -> np.ndarray:
        return np.concatenate([*self.packed, np.packbits(self.pending, bitorder="little")])


def _set_bit(bits: np.ndarray, row: int, value: bool) -> None:
    if value:
        bits[row // 8] |= np.uint8(1 << row % 8)
    else:
        bits[row // 8] &= np.uint8(~(1 << row % 8) & 0xFF)


def plan_splits(pf: pq.ParquetFile, seed: int, val_fraction: float, where: str = "documents",
                val_by: str = "hash") -> SplitPlan:
    """Read the ``id`` column once (and, with ``val_by: position``, ``source``,
    ``chunk`` and the text's length) to score every document and apply the
    tiny-corpus rules (see the module docstring); the plan holds each row's split
    as a bit. Raises PackError on an empty corpus, null ids, fewer than two ids,
    or ``position`` without chunks."""
    threshold = val_threshold(val_fraction)
    position = val_by == "position"
    if position and not {"source", "chunk"} <= set(pf.schema_arrow.names):
        raise PackError(f"{where}: pack.val_by: position holds out the end of each chunked text, but the "
                        "documents have no chunk column; use ingest split_by: chunk, or pack.val_by: hash")
    n = 0
    scores = _Scores(threshold)
    bits = _Bits()
    files: dict[str | None, list[tuple[int, int, int, str]]] = {}  # source -> [(chunk, bytes, row, id)]
    columns = ["id", "source", "chunk", "text"] if position else ["id"]
    extra = [c for c in ("split", "source_name") if c in pf.schema_arrow.names]
    names: dict[str, None] = {}
    trainable: dict[str, None] = {}
    marked = {"train": 0, "val": 0}
    marked_chunks = 0  # chunks that ingest marked split: train or val, which position leaves where they are
    first_id: str | None = None
    distinct = False  # two different ids seen: scores can tie (position), so lo and hi may be one document
    for batch in pf.iter_batches(batch_size=65_536, columns=columns + extra):
        col = batch.column(0)
        if col.null_count:
            raise PackError(f"{where}: {col.null_count} document(s) have a null id")
        ids = col.to_pylist()
        if not distinct and ids:
            first_id = ids[0] if first_id is None else first_id
            distinct = any(i != first_id for i in ids)
        rows = np.arange(n, n + len(ids))
        hashed = np.ones(len(ids), bool)  # scored by hash; chunks under position are scored below
        mark_val = mark_train = None
        if "split" in extra and batch.column("split").null_count < batch.num_rows:
            mark = batch.column("split")
            mark_val = pc.fill_null(pc.equal(mark, "val"), False).to_numpy(zero_copy_only=False)
            mark_train = pc.fill_null(pc.equal(mark, "train"), False).to_numpy(zero_copy_only=False)
            if mark.null_count + int(mark_val.sum()) + int(mark_train.sum()) != len(mark):
                bad = pc.unique(pc.filter(mark, pc.invert(pc.is_in(mark, pa.array(["val", "train"]))))).to_pylist()
                raise PackError(f"{where}: split marks {bad} are not train or val (ingest writes only those)")
            hashed &= ~(mark_val | mark_train)
            marked["val"] += int(mark_val.sum())
            marked["train"] += int(mark_train.sum())
        if "source_name" in extra:
            if batch.column("source_name").null_count:
                raise PackError(f"{where}: {batch.column('source_name').null_count} document(s) in rows "
                                f"{n}-{n + len(ids) - 1} have no source_name (ingest names every document)")
            unique = pc.unique(batch.column("source_name")).to_pylist()
            names.update(dict.fromkeys(unique))
            if mark_val is not None and mark_val.any():
                unique = pc.unique(batch.column("source_name").filter(pa.array(~mark_val))).to_pylist()
            trainable.update(dict.fromkeys(unique))
        if position and batch.column(2).null_count < batch.num_rows:
            chunks = batch.column(2).to_pylist()
            sources = batch.column(1).to_pylist()
            sizes = pc.fill_null(pc.binary_length(batch.column(3)), 0).to_pylist()
            for i, c in enumerate(chunks):
                if c is not None and hashed[i]:
                    files.setdefault(sources[i], []).append((c, sizes[i], n + i, ids[i]))
                    hashed[i] = False
                elif c is not None:
                    marked_chunks += 1
        hashed_ids = ids if hashed.all() else [d for d, h in zip(ids, hashed) if h]
        u = split_hashes(seed, hashed_ids)
        scores.many(u, rows[hashed], hashed_ids)
        val = np.zeros(len(ids), bool) if mark_val is None else mark_val.copy()
        val[hashed] = u < np.uint64(threshold)  # val_fraction <= 0.5: the threshold fits in 64 bits
        bits.extend(val)
        n += len(ids)
    if position and not files and marked_chunks:
        raise PackError(f"{where}: pack.val_by: position holds out the end of each chunked text, but every chunk "
                        f"({marked_chunks:,}) is marked split: train or val in ingest.sources, which goes before "
                        "it; set split: auto on the chunked source, or pack.val_by: hash")
    if position and not files:
        raise PackError(f"{where}: pack.val_by: position holds out the end of each chunked text, but no "
                        "document is a chunk; use ingest split_by: chunk, or pack.val_by: hash")
    val_bits = bits.finish()
    first_val: dict[str, int] | None = {} if position else None
    for source, chunks_of in files.items():
        chunks_of.sort(key=lambda c: c[0])
        total = sum(c[1] for c in chunks_of)
        before = 0
        for chunk, nbytes, row, doc_id in chunks_of:
            u = position_score(before, nbytes, total)
            scores.one(u, row, doc_id)
            if u < threshold and source not in first_val:  # type: ignore[operator]
                first_val[source] = chunk  # type: ignore[index]
            before += nbytes
        first = first_val.get(source)  # type: ignore[union-attr]
        for chunk, _, row, _ in chunks_of:
            _set_bit(val_bits, row, first is not None and chunk >= first)
    if n == 0:
        raise PackError(f"{where}: the corpus is empty; nothing to pack")
    lo, hi = scores.lo, scores.hi
    n_val = scores.n_val + marked["val"]
    forced: dict[str, str] = {}
    if marked["val"] + marked["train"]:  # the tiny-corpus rules move only unmarked documents
        if n_val == 0 and lo is None:
            raise PackError(f"{where}: every document is marked split: train, so val would be empty; mark a "
                            "validation source split: val (or leave sources at split: auto)")
        if n_val == n and hi is None:
            raise PackError(f"{where}: every document is marked split: val, so train would be empty; add a "
                            "source for training (split: auto or train)")
    elif lo is None or hi is None or not distinct:
        raise PackError(f"{where}: {n} document(s) with one distinct id; train and val need at least two "
                        "documents (for one text cut with ingest split_by: chunk, lower chunk_bytes; a chunk "
                        "ends only at a line end, so a text with no line break stays one chunk: break it into "
                        "lines, or add documents)")
    if n_val == 0:
        forced[lo[2]] = "val"  # type: ignore[index]
    elif n_val == n:
        forced[hi[2]] = "train"  # type: ignore[index]
    single = sum(len({c[0] for c in chunks_of}) == 1 for chunks_of in files.values())
    if single:  # their text is in train whatever val_fraction says: many short files leave val nearly empty
        log.warning("pack.val_by: position: %s of %s chunked file(s) are one chunk each, which stays in train (a "
                    "chunk goes to val when its middle byte lies in the last val_fraction of its file)%s; to hold "
                    "out part of such files, lower ingest chunk_bytes below their size, or use pack.val_by: hash",
                    f"{single:,}", f"{len(files):,}",
                    "; val holds only the document the tiny-corpus rule moved there"
                    if lo is not None and forced.get(lo[2]) == "val" and single == len(files) else "")
    for doc_id, split in forced.items():  # every unmarked row with that id, as split_of decides by id
        row0 = 0
        for batch in pf.iter_batches(batch_size=65_536, columns=["id", *extra[:1]]):
            hit = pc.equal(batch.column(0), doc_id)
            if extra[:1] == ["split"]:
                hit = pc.and_(hit, batch.column(1).is_null())
            for i in np.flatnonzero(hit.to_numpy(zero_copy_only=False)):
                _set_bit(val_bits, row0 + int(i), split == "val")
            row0 += batch.num_rows
    return SplitPlan(n, seed, threshold, forced, first_val, val_bits, tuple(names),
                     {k: v for k, v in marked.items() if v}, tuple(trainable))


# --- encoding: a pure function of a task's rows, run in worker processes ---------------------------


def encode_texts(tok: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts``; return their token ids back to back (int32) and each
    text's token count (int64). No EOT: :meth:`SplitWriter.add` separates documents.
    ``encode_batch_fast`` gives the ids of ``encode_batch`` without computing the
    character offsets, which pack never reads."""
    return flatten_ids([e.ids for e in tok.encode_batch_fast(texts)])


def flatten_ids(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-text id lists as :func:`encode_texts` returns them: back to back (int32), and each one's count (int64)."""
    lens = np.fromiter(map(len, ids), np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), np.int32, count=int(lens.sum()))
    return flat, lens


def continuation_context(tok: Any) -> list[int] | None:
    """How pack encodes a chunk that continues its file's text (see
    :func:`encode_continued`): None when as any other text, because ``tok``
    adds nothing to a text (our own tokenizer, a byte-level BPE such as Qwen's);
    ``[]`` when only without the special tokens it adds around every text (a
    BOS: Llama 3's); else, for a tokenizer that puts a dummy prefix before every
    text (:func:`pipeline.data.tokenizer.adds_dummy_prefix`), the ids
    :func:`encode_texts` gives ``"\\n"``."""
    if tokenizer_module.adds_dummy_prefix(tok):
        return tok.encode_batch_fast(["\n"])[0].ids
    plain, added = (tok.encode_batch_fast(["a"], add_special_tokens=flag)[0].ids for flag in (False, True))
    return None if plain == added else []


def encode_continued(tok: Any, texts: list[str], continues: np.ndarray, context: list[int]
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`encode_texts` where ``continues`` (bool per text) marks the chunks
    that continue their file's text (not its first chunk), for a tokenizer that
    adds to every text (``context``: :func:`continuation_context`, not None).
    Returns the ids, the counts, and how many marked texts kept a dummy prefix.

    Why: pack joins a file's consecutive chunks into one document, but encoded
    on its own each chunk would start with what the tokenizer puts before a
    text: a BOS in mid-document, or a dummy prefix, a space after the newline
    at every chunk boundary, which the file does not have. A marked chunk is
    encoded without the added special tokens. With a dummy prefix, since the
    chunk before it ends at a line end, it is encoded after a newline and the
    newline's ids (``context``) are taken off its start: the ids the file's
    text gives there, as far as the tokenizer allows. A text whose ids do not
    begin with ``context`` (a merge across the newline) keeps the prefix;
    those are the ones counted."""
    ids: list[list[int]] = [[] for _ in texts]
    first = np.flatnonzero(~continues)
    for i, enc in zip(first, tok.encode_batch_fast([texts[i] for i in first])):
        ids[i] = enc.ids
    kept = marked = np.flatnonzero(continues)
    if context:
        kept = []
        for i, enc in zip(marked, tok.encode_batch_fast(["\n" + texts[i] for i in marked])):
            if enc.ids[:len(context)] == context:
                ids[i] = enc.ids[len(context):]
            else:
                kept.append(i)
    for i, enc in zip(kept, tok.encode_batch_fast([texts[i] for i in kept], add_special_tokens=False)):
        ids[i] = enc.ids
    return (*flatten_ids(ids), len(kept) if context else 0)


class Encoded(NamedTuple):
    """A task's documents encoded: :func:`encode_texts`'s arrays, their text's
    UTF-8 bytes, and the continuing chunks that kept a dummy prefix
    (:func:`encode_continued`)."""

    flat: np.ndarray
    lens: np.ndarray
    text_bytes: int
    kept_prefix: int = 0


def encode_columns(tok: Any, columns: Iterable[pa.Array], task_bytes: int, batch_docs: int,
                   continues: np.ndarray | None = None, context: list[int] | None = None) -> Encoded:
    """:func:`encode_texts` of text columns (null = ""), joined, in calls of at
    most ``batch_docs`` documents and about ``task_bytes`` of text
    (:class:`pipeline.data.docs.RunCutter`): the library holds a call's
    encodings at once, so a call's size bounds a worker's memory. With
    ``continues`` (bool per document of the columns, joined) and ``context``,
    a call with continuing chunks goes to :func:`encode_continued` instead."""
    flats, lens, nbytes, kept, row = [], [], 0, 0, 0
    cutter = RunCutter(task_bytes, batch_docs)
    for texts in columns:
        lengths = text_lengths(texts)
        nbytes += int(lengths.sum())
        for a, b, _ in cutter.feed(lengths):
            part = texts.slice(a, b - a).to_pylist()
            part = [t or "" for t in part] if texts.null_count else part
            marks = continues[row + a:row + b] if continues is not None else None
            if marks is not None and marks.any():
                flat, n, missed = encode_continued(tok, part, marks, context)  # type: ignore[arg-type]
                kept += missed
            else:
                flat, n = encode_texts(tok, part)
            flats.append(flat)
            lens.append(n)
        row += len(texts)
    if len(flats) == 1:
        return Encoded(flats[0], lens[0], nbytes, kept)
    return Encoded(np.concatenate(flats or [np.zeros(0, np.int32)]), np.concatenate(lens or [np.zeros(0, np.int64)]),
                   nbytes, kept)


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, schema: pa.Schema, inputs: tuple[str, list[list]], batch_docs: int,
                 task_bytes: int) -> None:
    """``tokenizer_json``: the text of the tokenizer file the stage loaded, not its
    path, so that a Ray node need not see the stage's files. ``inputs``: the
    documents' path and their files' identity (:func:`pipeline.data.docs.identity`),
    which a worker checks before it reads rows itself."""
    # Before the first encode: rayon sizes its pool once, on first use.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.clear()
    tok = parse_tokenizer(tokenizer_json)
    _WORKER.update(tok=tok, context=continuation_context(tok), schema=schema, inputs=inputs, batch_docs=batch_docs,
                   task_bytes=task_bytes)


def _encode_task(start: int, stop: int, message: bytes | None, continues: np.ndarray | None = None
                 ) -> Encoded | str:
    """Rows ``[start, stop)`` of the documents, encoded (:func:`encode_columns`).
    The worker reads their text itself, ``batch_docs`` rows at a time, unless
    the stage sends it (``message``: the text column as an Arrow IPC message);
    a worker that does not see the documents returns why
    (:func:`pipeline.data.docs.table_as_seen`). ``continues``: the rows that
    are continuing chunks, for a tokenizer that adds to every text
    (:func:`encode_continued`)."""
    if message is not None:
        columns: Iterable[pa.Array] = [pa.ipc.read_record_batch(pa.py_buffer(message), _WORKER["schema"]).column(0)]
    else:
        table = table_as_seen(_WORKER, lambda p: DocTable(p, PackError))
        if isinstance(table, str):
            return f"on {socket.gethostname()}: {table}"
        columns = (b.column(0) for b in table.iter_batches(_WORKER["batch_docs"], ["text"], start, stop))
    return encode_columns(_WORKER["tok"], columns, _WORKER["task_bytes"], _WORKER["batch_docs"], continues,
                          _WORKER["context"])


# --- tasks and routing (main process, array operations only) ------------------------------------

Key = tuple[str, int]  # (source, chunk) of a chunk of a long text


def follows(prev: Key | None, key: Key | None) -> bool:
    """Whether ``key`` is the chunk right after ``prev`` in the same file."""
    return prev is not None and key is not None and key[0] == prev[0] and key[1] == prev[1] + 1


@dataclass
class Keys:
    """(source, chunk) of a task's documents, as arrays; a document without a chunk has no key."""

    source: pa.Array
    chunk: np.ndarray  # int64, 0 where there is no key
    has: np.ndarray  # bool: the document is a chunk

    @classmethod
    def of(cls, source: pa.Array, chunk: pa.Array) -> Keys | None:
        if chunk.null_count == len(chunk):
            return None
        return cls(source, pc.fill_null(chunk, 0).to_numpy().astype(np.int64), chunk.is_valid().to_numpy(
            zero_copy_only=False))

    def continuing(self) -> np.ndarray:
        """bool per document: a chunk that is not the first of its file, whose text continues the chunk before."""
        return self.has & (self.chunk > 0)

    def key(self, i: int) -> Key | None:
        return (self.source[i].as_py(), int(self.chunk[i])) if self.has[i] else None

    def follows(self, idx: np.ndarray) -> np.ndarray:
        """bool per consecutive pair of the documents at ``idx``: :func:`follows`."""
        a, b = idx[:-1], idx[1:]
        out = self.has[a] & self.has[b] & (self.chunk[b] == self.chunk[a] + 1)
        if out.any():
            src = self.source.take(pa.array(idx))
            prev, nxt = src.slice(0, len(idx) - 1), src.slice(1)
            same = pc.fill_null(pc.equal(prev, nxt), False).to_numpy(zero_copy_only=False)
            same |= (prev.is_null().to_numpy(zero_copy_only=False) & nxt.is_null().to_numpy(zero_copy_only=False))
            out &= same
        return out


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


def split_parts(flat: np.ndarray, lens: np.ndarray, val: np.ndarray, keys: Keys | None) -> dict[str, Part]:
    """Route one task's encoded documents (``flat``, ``lens`` from :func:`encode_texts`)
    to the splits by ``val`` (bool per document), in table order, with the joins
    between consecutive chunks of a file that land in the same split."""
    parts = {}
    token_val = np.repeat(val, lens) if val.any() and not val.all() else None
    for split in SPLITS:
        want = split == "val"
        mine = val == want
        idx = np.flatnonzero(mine & (lens > 0))
        if token_val is None:
            part_flat = flat if (len(val) and val[0] == want) else flat[:0]
        else:
            part_flat = flat[token_val == want]
        joins = np.zeros(len(idx), bool)
        head = tail = None
        if keys is not None and len(idx):
            joins[1:] = keys.follows(idx)
            head, tail = keys.key(int(idx[0])), keys.key(int(idx[-1]))
        docs = int(np.count_nonzero(mine))
        parts[split] = Part(part_flat, lens[idx], joins, docs, docs - len(idx), head, tail)
    return parts


def key_columns(pf: DocTable) -> list[str]:
    """``source`` and ``chunk``, where the documents have both: a task's :class:`Keys`."""
    return ["source", "chunk"] if {"source", "chunk"} <= set(pf.schema_arrow.names) else []


@dataclass
class Task:
    """A run of consecutive documents: ``rows`` from row ``start`` of the table."""

    start: int
    rows: int
    keys: Keys | None
    columns: dict[str, pa.Array] = field(default_factory=dict)  # the ``extra`` columns asked of _encoded
    text_bytes: int = 0  # known once encoded
    continues: np.ndarray | None = None  # a tokenizer that adds to a text: Keys.continuing (encode_continued)


def _encoded(pf: DocTable, tokenizer_path: Path, executor: ExecutorConfig, batch_docs: int,
             task_bytes: int, plan_first: Callable[[], None], extra: tuple[str, ...] = (),
             on_open: Callable[[Executor], None] | None = None,
             start: int = 0) -> Iterator[tuple[Task, np.ndarray, np.ndarray]]:
    """(task, flat, lens) in table order from row ``start``, encoded on the
    executor (a local process pool or Ray: :mod:`pipeline.data.executor`). The
    workers read the rows' text themselves (:func:`row_spans`,
    :func:`_encode_task`), so the stage's own process reads only the small
    columns it routes by: the keys and ``extra`` (and the text of a row group
    too large for one task). A worker that does not see the documents as the
    stage does (a Ray node without its storage) hands its task back: the stage
    encodes that one itself and sends the text of every later task, and says
    so in one warning at the end. The first ``window`` tasks go out before
    ``plan_first()`` runs, so that the split plan is computed while the
    workers start (``plan_first`` must tolerate being called again: with one
    in-process worker, the first result comes before that). A bounded window, so
    that a slow consumer or a slow worker cannot make the queue hold the corpus."""
    schema = pa.schema([pf.schema_arrow.field("text")])
    keys = key_columns(pf)
    columns = keys + [c for c in extra if c not in keys]
    sent: deque[Task] = deque()
    unseen: list[str] = []  # per task a worker handed back, why
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    context = continuation_context(parse_tokenizer(tokenizer_json)) if keys else None
    kept_prefix = 0
    init = (tokenizer_json, schema, (str(pf.path), identity(pf)), batch_docs, task_bytes)
    with open_executor(executor, _init_worker, init, desc="pack") as ex:
        if on_open is not None:
            on_open(ex)
        window = 2 * ex.workers + 2

        def tasks() -> Iterator[tuple[int, int, pa.RecordBatch | None]]:
            """(first row, end row, the rows read here or None) per task."""
            for span in row_spans(pf, task_bytes, start):
                if span.by_worker:
                    yield span.start, span.stop, None
                    continue
                at = span.start  # runs from a run's first row on are those of the whole span: resumable
                for run in pf.runs(batch_docs, task_bytes, columns + ["text"], span.start, span.stop):
                    yield at, at + run.num_rows, run
                    at += run.num_rows

        def feed() -> Iterator[tuple[int, int, bytes | None]]:
            for i, (a, b, run) in enumerate(tasks()):
                if i == window - 1:
                    plan_first()
                send = run is not None or bool(unseen)
                if run is None and (columns or send):
                    run = next(pf.iter_batches(b - a, columns + (["text"] if send else []), a, b))
                task = Task(a, b - a, Keys.of(run.column("source"), run.column("chunk")) if keys else None,
                            {name: run.column(name) for name in extra})
                if context is not None and task.keys is not None:
                    continues = task.keys.continuing()
                    task.continues = continues if continues.any() else None
                sent.append(task)
                # IPC writes only the column's own bytes, where pickling a slice would copy its parent buffers
                message = (pa.record_batch([run.column("text")], schema=schema).serialize().to_pybytes()
                           if send else None)
                yield (a, b, message) if task.continues is None else (a, b, message, task.continues)
            plan_first()

        tok = None
        for result in ex.map(_encode_task, feed(), window=window):
            task = sent.popleft()
            if isinstance(result, str):
                unseen.append(result)
                if tok is None:
                    tok = parse_tokenizer(tokenizer_json)
                result = encode_columns(tok, (b.column(0) for b in pf.iter_batches(
                    batch_docs, ["text"], task.start, task.start + task.rows)), task_bytes, batch_docs,
                    task.continues, context)
            task.text_bytes = result.text_bytes
            kept_prefix += result.kept_prefix
            yield task, result.flat, result.lens
        plan_first()  # an empty table: no task at all
    if kept_prefix:
        log.warning("%d chunk(s) that continue their file kept the tokenizer's dummy prefix (a space the file does "
                    "not have at their start): encoded after a newline, their ids did not begin with the newline's "
                    "own", kept_prefix)
    if unseen:
        log.warning("%d task(s) went to a worker that does not see the documents as the stage does (%s); the stage "
                    "encoded them itself and sent the text of the tasks after them: put %s on storage that every "
                    "node mounts at the same path to spread the reading", len(unseen), unseen[0], pf.path)


# --- packing and writing ----------------------------------------------------------------------


def packed_schema(row_len: int, eot_id: int = EOT_ID) -> pa.Schema:
    return row_schema(FORMAT, row_len, metadata={"eot_id": str(eot_id)})


def row_starts(starts: np.ndarray, n: int, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``n`` rows of ``row_len`` and the sorted, distinct document starts below
    ``n · row_len``: each row's number of segment starts, and all of them as offsets
    in their row, row by row, each row's beginning with 0 (a row always starts a
    segment). No sort: row ``r``'s offsets are 0, then its starts that are not on
    its first token."""
    row, off = np.divmod(starts, row_len)
    inner = off != 0
    row, off = row[inner], off[inner]
    counts = 1 + np.bincount(row, minlength=n)
    offsets = np.zeros(n + len(off), np.int32)
    offsets[np.arange(len(off)) + row + 1] = off  # after the r + 1 zeros of rows 0..r and the starts before
    return counts, offsets


class SplitWriter:
    """Accumulates one split's token stream into shards of ``shard_rows`` rows.
    :meth:`add` is where documents are separated by ``eot_id``, the tokenizer's
    own end-of-text id (``run_pack`` passes it from the tokenizer folder)."""

    def __init__(self, out_dir: Path, split: str, row_len: int, shard_rows: int, eot_id: int = EOT_ID,
                 log: ShardLog | None = None):
        self.split, self.row_len, self.shard_rows, self.eot_id = split, row_len, shard_rows, eot_id
        self.writer = ShardWriter(out_dir, split, packed_schema(row_len, eot_id), log)
        # the current shard's tokens, rows back to back; allocated on first use, so a tiny split stays tiny
        self.buf = np.empty(0, np.int32)
        self.fill = 0
        self.starts: list[np.ndarray] = []  # document starts in buf
        self.docs = self.empty_docs = self.joined = self.tokens = self.rows = 0
        self.last: Key | None = None  # key of the last document added, if a chunk
        self.open = False  # a document has been added and awaits its EOT
        # resume: buf[:saved] is in the sidecars of checkpoints base, base + 1, ... (see Checkpoints)
        self.saved = 0
        self.base: int | None = None

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
        """Copy ``flat`` into the shard buffer, writing each shard as it fills."""
        self.tokens += len(flat)
        capacity = self.shard_rows * self.row_len
        done = 0
        while done < len(flat):
            if len(self.buf) == 0:
                self.buf = np.empty(capacity, np.int32)
            take = min(capacity - self.fill, len(flat) - done)
            self.buf[self.fill:self.fill + take] = flat[done:done + take]
            a, b = np.searchsorted(doc_starts, (done, done + take))
            self.starts.append(doc_starts[a:b] - done + self.fill)
            self.fill += take
            done += take
            if self.fill == capacity:
                self._flush()

    def _flush(self) -> None:
        """Write the full rows in the buffer as the next shard; the tokens of a
        last, unfilled row are dropped (only at :meth:`finish`: a shard that fills
        holds whole rows)."""
        n = self.fill // self.row_len
        if n:
            starts = np.concatenate(self.starts) if self.starts else np.empty(0, np.int64)
            counts, offsets = row_starts(starts[starts < n * self.row_len], n, self.row_len)
            list_offsets = np.zeros(n + 1, np.int32)
            np.cumsum(counts, out=list_offsets[1:])
            self.writer.write(self.buf[:n * self.row_len].reshape(n, self.row_len), list_offsets, offsets)
            self.rows += n
        self.fill = 0
        self.starts = []
        self.saved, self.base = 0, None

    def checkpoint(self, k: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """This writer's state for checkpoint ``k``: its counters, keys and shard
        count (JSON), and the part of its buffer, tokens and document starts, that
        no earlier checkpoint's sidecar holds. Each buffered token thus goes into
        one sidecar at most; :meth:`restore` joins the pieces from ``base`` to ``k``."""
        starts = np.concatenate(self.starts) if self.starts else np.empty(0, np.int64)
        self.starts = [starts] if len(starts) else []
        new = {"tokens": self.buf[self.saved:self.fill].copy(), "starts": starts[starts >= self.saved]}
        if self.base is None:
            self.base = k
        self.saved = self.fill
        state = {"docs": self.docs, "empty_docs": self.empty_docs, "joined": self.joined, "tokens": self.tokens,
                 "rows": self.rows, "fill": self.fill, "last": list(self.last) if self.last else None,
                 "open": self.open, "shards": len(self.writer.shards), "base": self.base}
        return state, new

    def restore(self, state: dict[str, Any], pieces: list[dict[str, np.ndarray]],
                shards: list[dict[str, Any]]) -> None:
        """Continue from a checkpoint: ``state`` from :meth:`checkpoint`, the sidecar
        pieces of checkpoints ``state["base"]`` to the one restored, and the
        manifest entries of the shards already committed."""
        tokens = np.concatenate([p["tokens"] for p in pieces]) if pieces else np.empty(0, np.int32)
        starts = np.concatenate([p["starts"] for p in pieces]) if pieces else np.empty(0, np.int64)
        if len(tokens) != state["fill"] or len(shards) != state["shards"] or tokens.dtype != np.int32:
            raise ValueError(f"{self.split}: the checkpoint's buffer has {len(tokens)} tokens, not {state['fill']}")
        for name in ("docs", "empty_docs", "joined", "tokens", "rows", "open"):
            setattr(self, name, state[name])
        self.last = tuple(state["last"]) if state["last"] is not None else None  # type: ignore[assignment]
        self.fill = state["fill"]
        if self.fill:
            self.buf = np.empty(self.shard_rows * self.row_len, np.int32)
            self.buf[:self.fill] = tokens
        self.starts = [starts.astype(np.int64)] if len(starts) else []
        self.saved, self.base = self.fill, state["base"]
        self.writer.shards = list(shards)

    def finish(self) -> dict:
        if self.open:
            self._append(np.array([self.eot_id], np.int32), np.empty(0, np.int64))
            self.open = False
        dropped = self.fill % self.row_len
        self._flush()
        self.buf = np.empty(0, np.int32)
        if self.tokens != self.rows * self.row_len + dropped:
            raise AssertionError(f"{self.split}: token accounting is off")
        return {"docs": self.docs, "empty_docs": self.empty_docs, "joined": self.joined, "tokens": self.tokens,
                "rows": self.rows, "dropped_tail_tokens": dropped, "shards": self.writer.shards}


# --- sources: per-source counts, val splits and mixtures ------------------------------------------


class Sources:
    """Per source (ingest's ``source_name``): documents and document tokens (EOTs
    not counted) in each split and, with more than one source, the source's own
    val split ``val-source-NN/``, its val documents packed alone, so that
    evaluate can score each source."""

    def __init__(self, names: tuple[str, ...], out_dir: Path, row_len: int, shard_rows: int, eot_id: int,
                 logs: dict[str, ShardLog] | None = None):
        self.names, self.code = names, {n: i for i, n in enumerate(names)}
        self.docs = {s: np.zeros(len(names), np.int64) for s in SPLITS}
        self.tokens = {s: np.zeros(len(names), np.int64) for s in SPLITS}
        self.val = {i: SplitWriter(out_dir, val_source_dir(i), row_len, shard_rows, eot_id,
                                   (logs or {}).get(val_source_dir(i)))
                    for i in range(len(names))} if len(names) > 1 else {}

    @staticmethod
    def dirs(names: tuple[str, ...]) -> list[str]:
        """The folders of the sources' own val splits."""
        return [val_source_dir(i) for i in range(len(names))] if len(names) > 1 else []

    def state(self) -> dict[str, Any]:
        return {"docs": {s: v.tolist() for s, v in self.docs.items()},
                "tokens": {s: v.tolist() for s, v in self.tokens.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        for s in SPLITS:
            self.docs[s] = np.array(state["docs"][s], np.int64).reshape(len(self.names))
            self.tokens[s] = np.array(state["tokens"][s], np.int64).reshape(len(self.names))

    def codes(self, column: pa.Array) -> np.ndarray:
        """Each document's source as an index into ``names``."""
        enc = pc.dictionary_encode(column)
        lookup = np.array([self.code[n] for n in enc.dictionary.to_pylist()], np.int64)
        return lookup[enc.indices.to_numpy(zero_copy_only=False)]

    def add(self, codes: np.ndarray, flat: np.ndarray, lens: np.ndarray, val: np.ndarray, keys: Keys | None) -> None:
        n = len(self.names)
        for split, mine in (("train", ~val), ("val", val)):
            self.docs[split] += np.bincount(codes[mine], minlength=n)
            self.tokens[split] += np.bincount(codes[mine], weights=lens[mine], minlength=n).astype(np.int64)
        if self.val:
            for code in np.unique(codes[val]):
                self.val[int(code)].add(split_parts(flat, lens, val & (codes == code), keys)["val"])

    def finish_val(self) -> tuple[dict[str, str], dict[str, dict]]:
        """Each source's own val split that fills at least one row, and every one's counts."""
        dirs, counts = {}, {}
        for i, w in self.val.items():
            info = w.finish()
            counts[val_source_dir(i)] = info
            if info["rows"]:
                dirs[self.names[i]] = val_source_dir(i)
            elif info["docs"]:
                log.warning("source %r: its %d val document(s) give %d tokens, less than one row; it gets no "
                            "score of its own", self.names[i], info["docs"], info["tokens"])
        return dirs, counts


SOURCE_METRICS = ("train_tokens", "val_tokens", "share", "requested_share")


def source_figures(sources: Sources, mixture: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Per source: documents and document tokens per split, the realised share of
    the train tokens and, with a mixture, what was asked and how it was met."""
    train = sources.tokens["train"]
    if mixture is not None:
        train = np.array([mixture.get(n, {}).get("tokens", 0) for n in sources.names], np.int64)
    total = int(train.sum()) or 1
    out = {}
    for i, name in enumerate(sources.names):
        out[name] = {"train_docs": int(sources.docs["train"][i]), "train_tokens": int(train[i]),
                     "val_docs": int(sources.docs["val"][i]), "val_tokens": int(sources.tokens["val"][i]),
                     "share": round(int(train[i]) / total, 6)}
        if mixture is not None and name in mixture:
            out[name].update({k: v for k, v in mixture[name].items() if k not in ("tokens", "docs")})
    return out


def val_source_dir(i: int) -> str:
    return f"val-source-{i:02d}"


VAL_SOURCE_DIR = re.compile(r"val-source-\d{2,}")  # the names val_source_dir gives


MIX_FILE = ".mixture.arrow"  # where an earlier version kept the mixture's train documents; removed if found
MIX_DIR = ".mixture"  # the train documents of a mixture run, encoded, in pieces, until the mixture is written
MIX_SCHEMA = pa.schema([("tokens", pa.list_(pa.int32())), ("code", pa.int64()), ("order", pa.uint64()),
                        ("source", pa.string()), ("chunk", pa.int64())])


class Mixture:
    """Realises ``pack.mixture`` (see :mod:`pipeline.data.mixture`). Train documents
    are encoded once and kept in temporary Arrow files beside the output
    (``.mixture/piece-NNNNN.arrow``, each committed with its record when a
    checkpoint is taken, so that a killed run keeps them); once every source's
    train tokens are known, each document's copies are decided and the pieces
    are read again, once per round: round ``r`` writes, in table order, the
    documents with at least ``r`` copies. Memory: about 32 bytes per train
    document (its token count, source, order key and copies), the pieces being
    memory-mapped, and the documents added since the last piece."""

    def __init__(self, cfg: PackConfig, sources: Sources, log: ShardLog, pieces: int = 0, docs: int = 0):
        self.cfg, self.sources, self.log = cfg, sources, log
        self.pieces, self.docs = pieces, docs  # committed pieces; train documents added
        self.pending: list[pa.RecordBatch] = []
        self.pending_tokens = 0

    def add(self, task: Task, codes: np.ndarray, flat: np.ndarray, lens: np.ndarray, train: np.ndarray) -> None:
        if not train.any():
            return
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat)).cast(pa.list_(pa.int32()))
        keys = task.keys
        source = keys.source if keys is not None else pa.nulls(len(lens), pa.string())
        chunk = pa.array(keys.chunk, mask=~keys.has) if keys is not None else pa.nulls(len(lens), pa.int64())
        order = order_keys(self.cfg.seed, task.columns["id"].to_pylist())
        batch = pa.record_batch([tokens, pa.array(codes), pa.array(order), source.cast(pa.string()), chunk],
                                schema=MIX_SCHEMA)
        self.pending.append(batch.filter(pa.array(train)))
        self.pending_tokens += int(lens[train].sum())
        self.docs += int(train.sum())

    def commit(self) -> None:
        """Write the documents added since the last piece as the next piece, and commit it."""
        if not self.pending:
            return
        batches = self.pending

        def write(path: Path) -> None:
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, MIX_SCHEMA) as file:
                for b in batches:
                    file.write_batch(b)

        self.log.commit(self.pieces, write, {"rows": sum(b.num_rows for b in batches)})
        self.pieces += 1
        self.pending, self.pending_tokens = [], 0

    def state(self) -> dict[str, Any]:
        return {"pieces": self.pieces, "docs": self.docs}

    def realise(self, writer: SplitWriter, start: tuple[int, int] = (1, 0),
                checkpoint: Callable[[tuple[int, int]], None] | None = None) -> dict[str, dict[str, Any]]:
        """Write the train split, from round ``start[0]``'s batch ``start[1]`` on (a
        resumed run), calling ``checkpoint((round, next batch))`` after each batch;
        return per source its figures for the manifest."""
        self.commit()
        names = self.sources.names
        with contextlib.ExitStack() as stack:
            batches = []
            for k in range(self.pieces):
                reader = pa.ipc.open_file(stack.enter_context(pa.memory_map(str(self.log.path(k)))))
                batches += [reader.get_batch(i) for i in range(reader.num_record_batches)]
            lens = np.concatenate([pc.list_value_length(b.column(0)).to_numpy() for b in batches] or [[]])
            lens = lens.astype(np.int64)
            codes = np.concatenate([b.column(1).to_numpy() for b in batches] or [[]]).astype(np.int64)
            order = np.concatenate([b.column(2).to_numpy() for b in batches] or [[]]).astype(np.uint64)
            available = {names[c]: int(lens[codes == c].sum()) for c in np.unique(codes)}
            self.check_some_in_train(available)
            wanted = targets(available, self.cfg.mixture)
            for line in repeat_warnings(available, wanted, self.cfg.max_repeats):
                log.warning("%s", line)
            rows_of = {n: codes == self.sources.code[n] for n in wanted}  # each source's rows, as a mask
            copies = np.zeros(len(lens), np.int64)
            for name, target in wanted.items():
                mine = rows_of[name]
                copies[mine] = multiplicities(order[mine], lens[mine], target)
            realised = {n: int((lens * copies)[mine].sum()) for n, mine in rows_of.items()}
            shortest = {n: int(np.min(lens[mine], initial=np.iinfo(np.int64).max)) for n, mine in rows_of.items()}
            for line in empty_warnings(wanted, realised, shortest):
                log.warning("%s", line)
            bar = stack.enter_context(progress(total=int((lens * copies).sum()), unit="tok", unit_scale=True,
                                               desc="pack mixture"))
            for r in range(1, int(copies.max(initial=0)) + 1):
                row = 0
                for i, b in enumerate(batches):
                    take = copies[row:row + b.num_rows] >= r
                    if take.any():
                        if (r, i) >= start:
                            flat = b.column(0).values.to_numpy(zero_copy_only=False)
                            keys = Keys.of(b.column(3), b.column(4))
                            writer.add(split_parts(flat, lens[row:row + b.num_rows], take, keys)["val"])
                            if checkpoint is not None:
                                checkpoint((r, i + 1))
                        bar.update(int(lens[row:row + b.num_rows][take].sum()))
                    row += b.num_rows
        total, total_wanted = sum(realised.values()) or 1, sum(wanted.values()) or 1
        return {n: {"available_tokens": available[n], "target_tokens": wanted[n], "tokens": realised[n],
                    "requested_share": round(wanted[n] / total_wanted, 6), "share": round(realised[n] / total, 6),
                    "docs": int(rows_of[n].sum()),
                    "copies": int(copies[rows_of[n]].sum()),
                    "dropped_docs": int(((copies == 0) & rows_of[n]).sum())}
                for n in wanted}

    def check_some_in_train(self, available: Mapping[str, int]) -> None:
        """Raise MixtureError for a listed source that has documents not marked
        split: val (run_pack checked that before it began) but none in train: the
        hash split sent them all to val (a source of a few documents), which no
        entry of the mixture can mend, listed or not."""
        gone = sorted(n for n in self.cfg.mixture if n not in available and n in self.sources.code)
        if gone:
            val = {n: int(self.sources.docs["val"][self.sources.code[n]]) for n in gone}
            raise MixtureError(
                f"pack.mixture lists source(s) {gone}, but none of their documents went to train: the split sent "
                f"all of them to val ({', '.join(f'{n}: {k:,}' for n, k in val.items())} document(s); "
                f"pack.val_fraction={self.cfg.val_fraction:g}, pack.seed={self.cfg.seed}); mark such a source "
                "split: train in ingest.sources (it then has no val score), or give it more documents")

    def discard(self) -> None:
        """Remove the pieces (the mixture is written, or the run failed on its data)."""
        shutil.rmtree(self.log.folder, ignore_errors=True)


# --- resume -----------------------------------------------------------------------------------

CHECKPOINT = "checkpoint"  # out_dir/checkpoint-NNNNN.npz + .json: a point the stream can continue from
COMPLETE = "complete.json"  # out_dir/complete.json: the fingerprint and metrics of a finished output (run_pack)
RUN_FIGURES = ("tokens_per_s", "mb_per_s", "workers", "pack_seconds", "shards_resumed")  # a run's, not its output's


# Params that only cut each split's token stream into rows and shards: the streams are the same under any value.
CUTS_ONLY = frozenset({"seq_len", "shard_tokens"})


def pack_fingerprint(cfg: PackConfig, docs_path: Path, tokenizer_path: Path) -> str:
    """What the packed output depends on (:func:`pipeline.data.resume.fingerprint`):
    the params but the executor's, the documents (a docs folder's manifest, or
    the file), the tokenizer and its roles, and the code of pack, mixture, shares, shards,
    and of the readers of the documents and the tokenizer (docs, tokenizer)."""
    return _fingerprint("pack", cfg, docs_path, tokenizer_path, exclude=frozenset())


def streams_key(cfg: PackConfig, docs_path: Path, tokenizer_path: Path) -> str:
    """As :func:`pack_fingerprint` less the params in :data:`CUTS_ONLY`: equal for
    two outputs whose splits hold the same token streams, so the same tokens."""
    return _fingerprint("pack-streams", cfg, docs_path, tokenizer_path, exclude=CUTS_ONLY)


def _fingerprint(stage: str, cfg: PackConfig, docs_path: Path, tokenizer_path: Path, exclude: frozenset[str]
                 ) -> str:
    specials = tokenizer_dir(tokenizer_path) / SPECIALS_FILE
    inputs = {"docs": resume.input_digest(docs_path), "tokenizer": sha256_file(tokenizer_path),
              "specials": sha256_file(specials) if specials.is_file() else ""}
    return resume.fingerprint(stage, params=cfg.model_dump(mode="json", exclude={"executor", "num_workers", *exclude}),
                              inputs=inputs, code=resume.code_digest(sys.modules[__name__], mixture_module,
                                                                     shares_module, shards_module, docs_module,
                                                                     tokenizer_module))


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez``'s format (read with ``np.load(allow_pickle=False)``), with a fixed
    date on each member, so that the same state gives the same bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            with zf.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w",
                         force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)


class Checkpoints:
    """The points a killed run continues from (see "Resume" in :func:`run_pack`):
    ``checkpoint-NNNNN.json`` (a :class:`ShardLog` record: the input row, the
    counts, each split writer's state and shard count) and its sidecar
    ``checkpoint-NNNNN.npz`` (each writer's buffered tokens and document starts
    not in an earlier sidecar), in ``out_dir`` beside the manifest."""

    def __init__(self, out_dir: Path, fp: str):
        self.out_dir, self.fp = out_dir, fp
        self.log = ShardLog(out_dir, fp, stem=CHECKPOINT, ext=".npz")
        self.next = 0  # the next checkpoint's index
        self.shards = 0  # shards written when the last one was taken

    @staticmethod
    def exist(out_dir: Path, fp: str) -> bool:
        """Whether a checkpoint record names ``fp``; reads only the records (what
        is kept is decided, and the rest removed, by :meth:`open`)."""
        for path in sorted(out_dir.glob(f"{CHECKPOINT}-*.json")) if out_dir.is_dir() else ():
            try:
                if read_json(path).get("fingerprint") == fp:
                    return True
            except (OSError, ValueError, AttributeError):
                continue
        return False

    def open(self, names: list[str], resumable: bool, mixture: bool = False
             ) -> tuple[dict[str, ShardLog], dict[str, Any] | None, dict[str, list[dict[str, np.ndarray]]]]:
        """Scan the output (the manifest is removed first): keep the latest
        checkpoint whose sidecars, listed shards (and mixture pieces) are all
        committed under this fingerprint (with ``resumable``), and every shard and
        piece it lists; remove every other shard, piece, record and checkpoint,
        logging each. Returns the logs of the split folders by name (and of the
        mixture's pieces, :data:`MIX_DIR`, with ``mixture``), the checkpoint's
        record (None: start afresh) and each writer's sidecar pieces."""
        kept = self.log.open()
        logs = {n: ShardLog(self.out_dir / n, self.fp, ext=".arrow") for n in names}
        committed = {n: lg.open() for n, lg in logs.items()}
        mix = ShardLog(self.out_dir / MIX_DIR, self.fp, stem="piece", ext=".arrow")
        pieces_kept = mix.open() if mixture else {}
        if not mixture:
            shutil.rmtree(mix.folder, ignore_errors=True)  # left by a killed mixture run
        # A per-source val split of a run with more sources is ours to remove; any other folder is
        # not (a user's backup of the shards, say): left, and named in one warning.
        val_dirs = sorted(p for p in self.out_dir.iterdir() if p.is_dir() and VAL_SOURCE_DIR.fullmatch(p.name))
        for d in val_dirs:
            if d.name not in logs:
                other = ShardLog(d, self.fp, ext=".arrow")
                other.open()
                other.keep_below(0, "not a split of this run")
        shards_module.warn_other_dirs(self.out_dir, [*logs, MIX_DIR, *(d.name for d in val_dirs)])
        chosen = next((k for k in sorted(kept, reverse=True) if self._usable(kept, k, committed, pieces_kept)),
                      None) if resumable else None
        rec = kept[chosen] if chosen is not None else None
        self.log.keep_below(0 if chosen is None else chosen + 1, "later than the checkpoint this run continues from")
        for n, lg in logs.items():
            lg.keep_below(rec["writers"][n]["shards"] if rec else 0, "not listed by the checkpoint this run "
                                                                     "continues from")
        if mixture:
            mix.keep_below(rec["mixture"]["pieces"] if rec else 0, "not listed by the checkpoint this run "
                                                                  "continues from")
            logs[MIX_DIR] = mix
        pieces: dict[str, list[dict[str, np.ndarray]]] = {n: [] for n in names}
        if rec is not None:
            for j in range(min(w["base"] for w in rec["writers"].values()), chosen + 1):  # type: ignore[operator]
                with np.load(self.log.path(j), allow_pickle=False) as z:
                    for n, w in rec["writers"].items():
                        if w["base"] <= j:
                            pieces[n].append({"tokens": z[f"{n}/tokens"], "starts": z[f"{n}/starts"]})
            self.next = chosen + 1  # type: ignore[operator]
            self.shards = sum(w["shards"] for w in rec["writers"].values())
        return logs, rec, pieces

    @staticmethod
    def _usable(kept: dict[int, dict[str, Any]], k: int, committed: dict[str, dict[int, Any]],
                pieces: dict[int, Any]) -> bool:
        """Checkpoint ``k`` can be restored: the same splits, the sidecars of its
        chain kept, and every shard (and mixture piece) it lists committed."""
        writers = kept[k].get("writers")
        if not isinstance(writers, dict) or set(writers) != set(committed):
            return False
        if "mixture" in kept[k] and any(i not in pieces for i in range(kept[k]["mixture"]["pieces"])):
            return False
        if any(j not in kept for j in range(min(w["base"] for w in writers.values()), k)):
            return False
        return all(i in committed[n] for n, w in writers.items() for i in range(w["shards"]))

    def save(self, fields: dict[str, Any], writers: dict[str, SplitWriter]) -> None:
        """Commit the next checkpoint: ``fields`` and each writer's state."""
        k, states, arrays = self.next, {}, {}
        for n, w in writers.items():
            states[n], new = w.checkpoint(k)
            arrays.update({f"{n}/{a}": v for a, v in new.items()})
        self.log.commit(k, lambda tmp: _save_npz(tmp, arrays), {**fields, "writers": states})
        self.next += 1
        self.shards = sum(st["shards"] for st in states.values())

    def clear(self) -> None:
        """Remove every checkpoint (a run that failed on its data: a rerun fails the same way)."""
        for p in self.out_dir.glob(f"{CHECKPOINT}-*") if self.out_dir.is_dir() else ():
            p.unlink()


def finished(out_dir: Path, fp: str) -> dict[str, Any] | None:
    """The metrics of the run that finished the output in ``out_dir`` under
    fingerprint ``fp``, if its manifest is as that run wrote it and the folder
    agrees with it (:func:`pipeline.data.shards.verify`: every listed shard's
    sha256 and rows, none unlisted); else None (the rerun then resumes as after
    a kill)."""
    try:
        done = read_json(out_dir / COMPLETE)
        if done.get("fingerprint") != fp or sha256_file(out_dir / MANIFEST) != done.get("manifest_sha256"):
            return None
        shards_module.verify(out_dir, FORMAT)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, shards_module.DataError):
        return None
    return done["metrics"] if isinstance(done.get("metrics"), dict) else None


def too_short(out_dir: Path, streams: str, row_len: int) -> PackError | None:
    """Before anything in ``out_dir`` is touched: the error this run would end
    with, when the finished output there (its manifest as its run wrote it) holds
    the same token streams (:func:`streams_key`) and a split of them has fewer
    than ``row_len`` tokens. Else None: only tokenizing can tell."""
    try:
        done = read_json(out_dir / COMPLETE)
        if done.get("streams") != streams or sha256_file(out_dir / MANIFEST) != done.get("manifest_sha256"):
            return None
        splits = read_json(out_dir / MANIFEST)["splits"]
        short = [(s, int(splits[s]["tokens"]), int(splits[s]["docs"])) for s in SPLITS
                 if int(splits[s]["tokens"]) < row_len]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not short:
        return None
    return PackError(f"{short_splits(short, row_len)} (the count of the output in {out_dir}, packed from the same "
                     "documents, tokenizer and split, which is left as it was)")


def short_splits(short: list[tuple[str, int, int]], row_len: int) -> str:
    """The message for splits (``(name, tokens, documents)``) too short to fill one
    row, with the fix that helps them: a larger val_fraction grows val at train's
    cost, so it is offered only for val alone, and the other way for train."""
    said = " and ".join(f"the {s} split has {tokens} tokens from {docs} document(s)" for s, tokens, docs in short)
    if all(tokens == 0 for _, tokens, _ in short):  # not one token, not even an EOT: no row length helps
        return f"{said}: every one of those documents is empty (no text, or text that encodes to no tokens); " \
               "check the text column of the documents (did clean empty them?), or add data"
    shift = {("val",): "raise pack.val_fraction, ", ("train",): "lower pack.val_fraction, "}.get(
        tuple(s for s, _, _ in short), "")
    return f"{said}, fewer than one row of {row_len}{' each' if len(short) > 1 else ''}; lower pack.seq_len, " \
           f"{shift}or add data"


def shard_entry(split: str, k: int, record: dict[str, Any]) -> dict[str, Any]:
    """A committed shard's entry in the manifest, from its record."""
    return {"path": f"{split}/shard-{k:05d}.arrow", "rows": record["rows"], "sha256": record["sha256"]}


def run_pack(cfg: PackConfig, docs_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> dict:
    """Tokenize ``docs_path`` with ``tokenizer_path`` and write shards and manifest
    under ``out_dir`` (format in the module docstring), continuing a killed run
    of the same fingerprint (below); on failure no manifest is left behind.

    Returns metrics: docs, bytes (of text), tokens, train_rows, val_rows, shards,
    shards_resumed, tokens_per_s, mb_per_s (text MB), workers, pack_seconds. The
    manifest is the report: per split docs, empty_docs, joined, tokens,
    dropped_tail_tokens and the shards. Raises PackError on missing input or
    tokenizer, an empty or single-document corpus, or a split too small to fill
    one row (and then removes the shards written; but when the finished output
    in ``out_dir`` holds the same token streams, :func:`too_short` tells before
    anything is read or removed).

    *Resume.* Each shard is committed with a record ``shard-NNNNN.json`` beside
    it (:class:`pipeline.data.resume.ShardLog`: the run's fingerprint,
    :func:`pack_fingerprint`, and the shard's sha256). After each task in which
    any split wrote a shard, the run commits a checkpoint (:class:`Checkpoints`):
    the next input row (tasks are cut the same from any task's first row), the
    counts, and each split writer's state: counters, ``last`` key, ``open``
    flag, shard count and its buffered tokens and document starts. A sidecar
    holds only what was buffered since the previous checkpoint, so each token
    goes into one sidecar at most: the extra writes are at most the output's own
    size, in practice the val tokens once and each checkpoint's train tail (under
    one task's tokens), plus the records and fsyncs, one of each per shard and
    per checkpoint. A rerun of the same fingerprint restores the latest
    checkpoint whose own and earlier sidecars it needs and whose listed shards
    are all committed and intact, keeps those shards untouched, removes the
    shards it does not list, and continues from its row. A damaged shard (or
    sidecar) thus makes the rerun fall back to the latest checkpoint that does
    not depend on it, or start afresh. Shards, records and checkpoints of
    another fingerprint are removed first, with a warning per file, in the
    split folders pack writes (``train``, ``val``, ``val-source-NN``) only: any
    other folder of ``out_dir`` (a user's copy of some shards) is left as it is
    and named in one warning. The manifest
    and every shard are byte-identical to an uninterrupted run's. A mixture run
    also commits its train documents in pieces (:class:`Mixture`), one per
    checkpoint, and a checkpoint is also taken when the documents added since
    the last piece reach ``shard_tokens`` tokens; the train split, written at
    the end, takes a checkpoint (round and batch) after each batch that wrote a
    shard, so the realisation resumes too. The pieces go when the manifest is
    written. Last, the run writes ``complete.json``: its fingerprint, the
    manifest's sha256, its :func:`streams_key` and its metrics. A rerun of the same fingerprint on a
    finished output (``dvc repro --force``, or a kill after the manifest was
    written) checks the manifest and every shard it lists against their sha256
    (:func:`finished`) and, if all match, keeps everything and returns those
    metrics (with this run's ``workers`` (0), seconds and rates, which count the
    kept output as after any resume, and every shard in ``shards_resumed``); otherwise it
    removes ``complete.json`` and resumes as after a kill.

    Workers are spawned processes, so a script that calls this must keep its own
    top-level code under ``if __name__ == "__main__":``.
    """
    t0 = time.perf_counter()
    docs_path, tokenizer_path, out_dir = Path(docs_path), Path(tokenizer_path), Path(out_dir)
    tok, specials = open_tokenizer(tokenizer_path, PackError)
    pf = open_docs(docs_path, PackError)
    row_len = cfg.seq_len + 1
    shard_rows = max(1, cfg.shard_tokens // row_len)
    named = "source_name" in pf.schema_arrow.names
    if cfg.mixture and not named:
        raise PackError(f"{docs_path}: pack.mixture weighs sources by name, but the documents have no "
                        "source_name column; rerun ingest and clean")
    extra = (("source_name",) if named else ()) + (("id",) if cfg.mixture else ())
    checkpoints = Checkpoints(out_dir, pack_fingerprint(cfg, docs_path, tokenizer_path))
    done = finished(out_dir, checkpoints.fp)
    if done is not None:
        log.info("%s is the finished output of these params, input and code: all %d shards kept", out_dir,
                 done["shards"])
        seconds = time.perf_counter() - t0  # the rates count the kept output, as after any resume
        return {**done, "shards_resumed": done["shards"], "tokens_per_s": round(done["tokens"] / seconds),
                "mb_per_s": round(done["bytes"] / seconds / 1e6, 3), "workers": 0, "pack_seconds": round(seconds, 3)}
    streams = streams_key(cfg, docs_path, tokenizer_path)
    short = too_short(out_dir, streams, row_len)
    if short is not None:  # as the end of this run would say, after removing that output and tokenizing
        raise short
    resuming = Checkpoints.exist(out_dir, checkpoints.fp)
    state: dict[str, Any] = {"row": 0, "docs": 0, "text_bytes": 0, "resumed": 0}

    def plan_first() -> None:
        if "plan" in state:
            return
        # Its own reader: the task reader is paused mid-file.
        plan = state["plan"] = plan_splits(open_docs(docs_path, PackError), cfg.seed, cfg.val_fraction,
                                           where=str(docs_path), val_by=cfg.val_by)
        if cfg.mixture:  # before any encoding, or any file of the output is touched: a typo costs nothing
            check_names(plan.trainable, cfg.mixture)
        names = [*SPLITS, *Sources.dirs(plan.sources)]
        (out_dir / COMPLETE).unlink(missing_ok=True)  # the output changes from here: no longer finished
        logs, rec, pieces = checkpoints.open(names, resuming, mixture=bool(cfg.mixture))
        (out_dir / MIX_FILE).unlink(missing_ok=True)  # left by a mixture run that was killed
        writers = state["writers"] = {s: SplitWriter(out_dir, s, row_len, shard_rows, specials["eot"], logs[s])
                                      for s in SPLITS}
        sources = state["sources"] = Sources(plan.sources, out_dir, row_len, shard_rows, specials["eot"], logs)
        state["all"] = {**writers, **{val_source_dir(i): w for i, w in sources.val.items()}}
        if rec is not None:
            for n, w in state["all"].items():
                w.restore(rec["writers"][n], pieces[n],
                          [shard_entry(n, k, logs[n].records[k]) for k in range(rec["writers"][n]["shards"])])
            sources.restore(rec["sources"])
            state.update(row=rec["row"], docs=rec["docs"], text_bytes=rec["text_bytes"], resumed=checkpoints.shards)
        if cfg.mixture:
            mix = rec["mixture"] if rec is not None else {}
            state["mixture"] = Mixture(cfg, sources, logs[MIX_DIR], mix.get("pieces", 0), mix.get("docs", 0))
            state["realise_at"] = (mix.get("round", 1), mix.get("batch", 0))

    def checkpoint(realising: dict[str, int] | None = None, force: bool = False) -> None:
        """Commit a checkpoint if a shard was written since the last one (or ``force``)."""
        if not force and sum(len(w.writer.shards) for w in state["all"].values()) == checkpoints.shards:
            return
        fields = {"row": state["row"], "docs": state["docs"], "text_bytes": state["text_bytes"],
                  "sources": state["sources"].state()}
        if "mixture" in state:
            state["mixture"].commit()
            fields["mixture"] = {**state["mixture"].state(), **(realising or {})}
        checkpoints.save(fields, state["all"])

    try:
        if resuming:
            plan_first()  # the checkpoint says where the tasks start
        with progress(total=pf.metadata.num_rows, unit="doc", desc="pack") as bar:
            bar.update(state["row"])
            for task, flat, lens in _encoded(pf, tokenizer_path, cfg.executor, cfg.batch_docs, cfg.task_bytes,
                                              plan_first, extra, on_open=lambda ex: state.update(workers=ex.workers),
                                              start=state["row"]):
                plan_first()  # one in-process worker gives its first result before the feed plans
                val = state["plan"].val_mask(task.start, task.start + task.rows)
                parts = split_parts(flat, lens, val, task.keys)
                state["writers"]["val"].add(parts["val"])
                if named:
                    codes = state["sources"].codes(task.columns["source_name"])
                    state["sources"].add(codes, flat, lens, val, task.keys)
                if "mixture" in state:
                    state["mixture"].add(task, codes, flat, lens, ~val)
                else:
                    state["writers"]["train"].add(parts["train"])
                state["docs"] += task.rows
                state["text_bytes"] += task.text_bytes
                state["row"] = task.start + task.rows
                bar.update(task.rows)
                checkpoint(force="mixture" in state and state["mixture"].pending_tokens >= cfg.shard_tokens)
        docs = state["docs"]
        plan: SplitPlan = state["plan"]  # _encoded plans even when the table has no rows
        sources: Sources = state["sources"]
        mixture = state["mixture"].realise(state["writers"]["train"], state["realise_at"], lambda at: checkpoint(
            {"round": at[0], "batch": at[1]})) if "mixture" in state else None
        splits = {s: w.finish() for s, w in state["writers"].items()}
        train_docs = state["mixture"].docs if mixture is not None else splits["train"]["docs"]
        if docs != plan.docs or docs != train_docs + splits["val"]["docs"]:
            raise AssertionError(f"{docs} documents read but {train_docs} + {splits['val']['docs']} packed")
        short = [(s, info["tokens"], info["docs"]) for s, info in splits.items() if info["rows"] == 0]
        if short:
            raise PackError(short_splits(short, row_len))
        val_sources, source_splits = sources.finish_val()
    except StageError:
        if "writers" in state:  # a plan error leaves an earlier run's output as it was
            clear_outputs(out_dir, state["all"])  # the data's own error: a rerun would end the same way
            checkpoints.clear()
            if "mixture" in state:
                state["mixture"].discard()
        raise  # an interruption keeps the committed shards, pieces and checkpoints for the rerun
    total_tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    fields: dict[str, Any] = {"seed": cfg.seed, "val_fraction": cfg.val_fraction, "val_by": cfg.val_by,
                              "docs": docs, "forced": plan.forced, "tokens": total_tokens}
    per_source = source_figures(sources, mixture)
    if len(sources.names) > 1 or mixture is not None or plan.marked:  # one source, unmarked: as before
        fields.update({"marked": plan.marked, "sources": per_source, "val_sources": val_sources})
    write_manifest(out_dir, fmt=FORMAT, seq_len=cfg.seq_len, vocab_size=id_space(tok),
                   special_ids=specials, tokenizer_path=tokenizer_path, labels=False,
                   splits={**splits, **{d: source_splits[d] for d in val_sources.values()}}, fields=fields)
    if "mixture" in state:
        state["mixture"].discard()  # so the checkpoints that need its pieces go too, when a rerun opens them
    shards = sum(len(w.writer.shards) for w in state["all"].values())
    if state["resumed"]:
        log.info("resumed: %d of %d shards kept from an earlier run", state["resumed"], shards)
    seconds = time.perf_counter() - t0
    metrics = {
        "docs": docs,
        "bytes": state["text_bytes"],
        "tokens": total_tokens,
        **{f"{s}_rows": info["rows"] for s, info in splits.items()},
        **({"sources": {n: {k: v for k, v in f.items() if k in SOURCE_METRICS} for n, f in per_source.items()}}
           if per_source else {}),
        "shards": shards,
        "shards_resumed": state["resumed"],
        "tokens_per_s": round(total_tokens / seconds),
        "mb_per_s": round(state["text_bytes"] / seconds / 1e6, 3),
        "workers": state["workers"],
        "pack_seconds": round(seconds, 3),
    }
    write_json(out_dir / COMPLETE, {"fingerprint": checkpoints.fp, "manifest_sha256": sha256_file(out_dir / MANIFEST),
                                    "streams": streams,
                                    "metrics": {k: v for k, v in metrics.items() if k not in RUN_FIGURES}})
    return metrics


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
