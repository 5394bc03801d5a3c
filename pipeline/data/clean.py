"""clean: normalise, filter and deduplicate the ingested documents.

Input: a documents folder or one Parquet file (:class:`pipeline.data.docs.DocTable`)
of documents ``(id, text, source, location, chunk, offset, source_name, split)``
(the ingest output; the last four may be absent, which reads as null; other
columns are not carried over). Output: a documents folder in the same schema
with normalised text, in shards of consecutive input rows that a rerun keeps
(:func:`run_clean`), written in row groups; a quarantine JSONL of dropped
documents (a bounded sample per reason, via
:class:`pipeline.data.accounting.Ledger`, with their source and location:
``byte:<offset>`` for a chunk); and a metrics dict.

Chunks of a long text (``chunk`` not null) are filtered and deduplicated like
any document. Their normalisation skips ``strip_blank_edges``: a chunk's blank
lines are the text's paragraph breaks, and pack joins consecutive chunks back
into one stream.

Each document goes through, in order:

1. **normalisation** (:func:`normalise`): Unicode form, newlines, control
   characters, trailing whitespace, blank-line runs. Indentation is never
   touched, because the default corpus is Python source.
2. **quality filters** (:mod:`pipeline.data.filters`): the first enabled filter that
   fires drops the document; its registry name is the reason.
3. **exact dedup**: a blake2b-128 digest of the normalised text; the first
   occurrence is kept, later ones are dropped as ``exact_duplicate``.
4. **near dedup**: MinHash over word n-gram shingles with an LSH index
   (:class:`NearDedup`); candidates whose estimated Jaccard similarity with a
   kept document reaches the threshold are dropped as ``near_duplicate``.

Steps 1-2 and the MinHash signatures are per document and run on the stage's
executor (:mod:`pipeline.data.executor`: a local process pool, or Ray) in
batches, at most twice the worker count in flight, results in input order. The
dedup decisions (3-4) are made in input order, so the output is the same for any
executor and worker count. Where they are made is ``dedup.method``:

- ``memory`` (the default): in the main process, as results arrive, against
  in-memory indexes whose size grows with the corpus (see :class:`ExactDedup`
  and :class:`NearDedup` for their per-document cost). The workers read the
  input rows themselves (:func:`clean_rows`) and return them with their
  outcomes as arrays, so the main process reads no text; it decides, and
  writes. On 221 MB of long documents (11k documents, Ray with 2 workers:
  ``python -m bench.ray_data``, 2026-11-24) the peak RSS was 300 MB for the
  main process and 253 MB per worker.
- ``sharded``: as steps on disk run by the executor, each within a bounded
  memory (:mod:`pipeline.data.dedup`), then a second pass over the input that
  normalises the kept documents again in the workers. The workers read the
  input rows themselves (:func:`spill_rows`, :func:`cut_rows`), so the main
  process handles no text but what it writes. The same documents are kept,
  with the same quarantine and report.

Every document that enters leaves as kept or as dropped with a reason:
``docs_in == docs_out + sum(dropped.values())`` is checked before the metrics
are returned.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import re
import socket
import sys
import time
import unicodedata
from array import array
from collections import deque
from contextlib import closing
from functools import lru_cache, wraps
from operator import eq
from pathlib import Path
from typing import Any, Iterator, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, ValidationInfo, field_validator
from rensa import RMinHash, RMinHashLSH

from pipeline.config import ParamsModel
from pipeline.data import accounting, dedup, resume
from pipeline.data import docs as docs_module
from pipeline.data import filters as filters_module
from pipeline.data.accounting import Ledger, counts_text
from pipeline.data.docs import (
    FORMAT,
    DocTable,
    RunCutter,
    ShardedParquetWriter,
    identity,
    read_units,
    row_spans,
    string_array,
    table_as_seen,
    text_lengths,
    unit_tasks,
)
from pipeline.data.executor import Executor, ParallelStageConfig, open_executor
from pipeline.data.filters import FiltersSection, first_failure, ngrams
from pipeline.data.resume import ShardLog
from pipeline.errors import StageError
from pipeline.files import write_json
from pipeline.progress import progress

SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("location", pa.string()),
    ("chunk", pa.int64()), ("offset", pa.int64()), ("source_name", pa.string()), ("split", pa.string()),
])
REQUIRED = SCHEMA.names[:4]  # the rest are optional in the input (null: not a chunk, unnamed, unmarked)

log = logging.getLogger("pipeline.data.clean")

WORK_PREFIX = ".dedup-"  # dedup.method sharded: <output folder>/.dedup-<pid>, removed at the end
EXACT_DUPLICATE = "exact_duplicate"
NEAR_DUPLICATE = "near_duplicate"


class CleanError(StageError):
    """The clean stage cannot produce a corpus: missing or unreadable input, or
    nothing left after cleaning."""


class _Section(ParamsModel):
    """A sub-section of clean's params."""


class NormaliseConfig(_Section):
    unicode: Literal["NFC", "NFKC", "none"] = Field(
        "NFC", description="Unicode normal form; NFKC also folds compatibility characters")
    newlines: bool = Field(True, description="\\r\\n and \\r become \\n")
    remove_control_chars: bool = Field(
        True, description="drop C0/C1 control characters except \\n, \\t (and \\r), and a BOM")
    strip_trailing_whitespace: bool = Field(True, description="strip whitespace at the end of every line")
    max_blank_lines: int | None = Field(
        2, ge=0, description="longer runs of blank lines are shortened to this; null = keep")
    strip_blank_edges: bool = Field(
        True, description="drop blank lines at the start and end of the document (not of a chunk of a text)")


class ExactDedupConfig(_Section):
    enabled: bool = Field(True, description="drop documents whose normalised text hash (blake2b-128) was seen before")


class NearDedupConfig(_Section):
    enabled: bool = Field(True, description="drop near duplicates of earlier documents (MinHash LSH)")
    num_perm: int = Field(128, ge=8, le=1024, description="MinHash permutations (signature length)")
    # validate_default: a num_perm that the default bands do not divide is an error too
    bands: int = Field(16, ge=1, le=1024, validate_default=True, description="LSH bands; must divide num_perm")
    ngram: int = Field(5, ge=1, le=64, description="shingle size in words")
    threshold: float = Field(
        0.8, gt=0, le=1, description="estimated Jaccard at or above which a candidate is a duplicate; only "
        "LSH candidates are compared, found with chance 1 - (1 - t^(num_perm/bands))^bands (95% at 0.8 with the "
        "defaults, 6% at 0.5), and a threshold where that is under 50% is a warning: for a lower one use more bands "
        "(0.5: bands 32 finds 87%)")
    seed: int = Field(42, ge=0, le=2**63 - 1, description="MinHash permutation seed")

    @field_validator("bands")
    @classmethod
    def _bands_divide_num_perm(cls, bands: int, info: ValidationInfo) -> int:
        num_perm = info.data.get("num_perm")
        if num_perm is not None and num_perm % bands:
            raise ValueError(f"must divide num_perm={num_perm} (rensa's LSH splits the signature into equal bands)")
        return bands

    def found_at_threshold(self) -> float:
        """The chance that the LSH makes a candidate of a pair whose Jaccard is
        ``threshold``: ``1 - (1 - t^rows)^bands``. Only candidates are compared, so
        below the LSH's own threshold most such pairs stay unfound."""
        rows = self.num_perm // self.bands
        return 1 - (1 - self.threshold ** rows) ** self.bands


class DedupConfig(_Section):
    method: Literal["memory", "sharded"] = Field(
        "memory", description="memory: in-memory indexes in the main process (~1.5 KB per kept document); sharded: "
        "steps on disk run by the executor, memory bounded per worker (README 'Data stages on a Ray cluster'); "
        "the same documents are kept")
    partition_docs: int = Field(
        1_000_000, ge=1, description="sharded: documents per exact/band partition task (bounds a task's memory)")


class CleanConfig(ParallelStageConfig):
    """The ``clean:`` section of params.yaml. Sub-sections are typed models that
    reject unknown keys; ``filters`` has one entry per :data:`pipeline.data.filters.FILTERS`."""

    normalise: NormaliseConfig = Field(default_factory=NormaliseConfig)
    filters: FiltersSection = Field(default_factory=FiltersSection)  # type: ignore[valid-type]
    exact_dedup: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    batch_docs: int = Field(1024, ge=1, description="documents per run at most: output row groups and shards end "
                            "after runs; a worker's task is whole input row groups of at least one run (a row "
                            "group of more than 4 runs the stage reads and sends run by run)")
    task_bytes: int = Field(1_000_000, ge=1, description="text bytes per run at most: a run ends at the document "
                            "that brings its text to this (a larger document is a run of its own)")
    row_group_docs: int = Field(2000, ge=1, description="documents per output Parquet row group")
    row_group_bytes: int = Field(1_000_000, ge=1, description="an output row group also ends after the run at which "
                                 "the input text since it began reaches this many bytes: where a reader (pack's "
                                 "workers) can start")
    shard_bytes: int = Field(
        64 * 1024 * 1024, ge=1, description="an output shard ends after the run at which the input text "
        "since it began reaches this many bytes; a rerun redoes only the shards not committed")
    quarantine_per_reason: int = Field(100, ge=0, description="dropped documents kept verbatim per reason")


# --- normalisation -----------------------------------------------------------------------------

# C0 and C1 controls except \t \n \r, plus DEL and the byte-order mark. \r is left
# to the newline option so that the two options stay independent.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff]")


@lru_cache(maxsize=8)
def _blank_run(k: int) -> re.Pattern[str]:
    # More than k blank lines, after a line break or at the very start.
    return re.compile(rf"(\A|\n)(?:[^\S\n]*\n){{{k + 1},}}")


def _strip_blank_edges(text: str) -> str:
    # str.lstrip/rstrip run in C; the cuts are moved to line boundaries so the
    # first line keeps its indentation and the last line its trailing characters
    # and the newline that ends it.
    head = len(text) - len(text.lstrip())
    if head == len(text):
        return ""
    start = text.rfind("\n", 0, head) + 1
    end = text.find("\n", len(text.rstrip()))
    return text[start:] if end < 0 else text[start:end + 1]


def normalise(text: str, cfg: NormaliseConfig) -> str:
    """Return ``text`` normalised as ``cfg`` says: newlines, control characters,
    the Unicode form, then whitespace. The form comes after the control
    characters go, since removing one can bring a letter and its combining
    accent together, which the form then composes; so the result is in the form
    and normalising it again changes nothing. Leading whitespace of a line
    (indentation) is never changed. Trailing-whitespace stripping uses
    ``str.rstrip``, so it also removes a stray \r at a line end even with
    ``newlines`` off. With ``strip_blank_edges`` the result neither starts nor
    ends with a blank line; the newline ending the last line stays."""
    if cfg.newlines and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.remove_control_chars:
        text = _CONTROL.sub("", text)
    if cfg.unicode != "none" and not unicodedata.is_normalized(cfg.unicode, text):
        text = unicodedata.normalize(cfg.unicode, text)
    if cfg.strip_trailing_whitespace:
        # split/rstrip/join is ~7x faster here than a multiline regex.
        text = "\n".join(map(str.rstrip, text.split("\n")))
    if cfg.max_blank_lines is not None:
        text = _blank_run(cfg.max_blank_lines).sub(r"\1" + "\n" * cfg.max_blank_lines, text)
    if cfg.strip_blank_edges:
        text = _strip_blank_edges(text)
    return text


# --- per-document work (runs in the worker processes) -------------------------------------------


def shingles(text: str, n: int) -> list[str]:
    """Word n-grams joined by one space; a document shorter than n words is one
    shingle, an empty one has none."""
    words = text.split()
    if len(words) < n:
        return [" ".join(words)] if words else []
    return list(map(" ".join, ngrams(words, n)))


# One result per input document:
# (normalised text or None if filtered, reason, detail, changed, digest, minhash, utf-8 bytes out)
Result = tuple[str | None, str | None, str, bool, bytes | None, RMinHash | None, int]

_worker: dict[str, Any] = {}


def _init_worker(cfg: CleanConfig, inputs: tuple[str, list] | None = None) -> None:
    """``inputs``: the input's path and its files' identity
    (:func:`pipeline.data.docs.identity`), which a worker checks before it reads
    the input rows itself (:func:`pipeline.data.docs.table_as_seen`)."""
    _worker["cfg"] = cfg
    _worker["inputs"] = inputs
    _worker.pop("table", None)
    _worker["filters"] = cfg.filters.enabled()
    # sketch_batch's state byte per filter: the k-th enabled one is dedup.FILTERED + k
    _worker["codes"] = {name: dedup.FILTERED + k for k, (name, _, _) in enumerate(_worker["filters"])}
    _worker["chunk_normalise"] = cfg.normalise.model_copy(update={"strip_blank_edges": False})


def _gc_paused(fn: Any) -> Any:
    """``fn`` with the cyclic GC paused while it runs. The filters build many
    short-lived tuples (n-grams) and no reference cycles; pausing the GC for a
    batch saves ~25% of the time."""
    @wraps(fn)
    def paused(*args: Any) -> Any:
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args)
        finally:
            if gc_was_enabled:
                gc.enable()
    return paused


@_gc_paused
def process_batch(texts: list[str | None], chunks: list[bool] | None = None) -> list[Result]:
    """Normalise, filter, hash and sketch one batch; ``chunks`` marks the texts that
    are chunks of a longer text (their blank edges are kept). Pure given the config
    set by :func:`_init_worker`, so batches can run in any process in any order."""
    near = _worker["cfg"].near_dedup
    out, sketched, shingle_sets = _prepare(texts, chunks or [False] * len(texts))
    if shingle_sets:
        # One call for the whole batch: rensa does the hashing loop in Rust.
        for i, mh in zip(sketched, RMinHash.from_token_sets(shingle_sets, near.num_perm, near.seed)):
            text, _, _, changed, digest, _, nbytes = out[i]
            out[i] = (text, None, "", changed, digest, mh, nbytes)
    return out


class Sketches(NamedTuple):
    """One batch as :func:`sketch_batch` returns it: arrays, no object per document."""

    states: np.ndarray  # uint8 per document: dedup.KEEP, dedup.CANDIDATE (has a signature) or FILTERED + k
    digests: np.ndarray  # (n, 2) little-endian uint64: the blake2b-128 digests (0 for a filtered document)
    sigs: np.ndarray | None  # (n, num_perm) uint32 MinHash signatures (0 but for candidates); None: near dedup off
    changed: int  # documents that normalisation changed
    filtered: list[tuple[int, str, str]]  # (row, filter, detail) of each filtered document


@_gc_paused
def sketch_batch(texts: list[str | None], chunks: list[bool] | None = None) -> Sketches:
    """:func:`process_batch` for ``dedup.method: sharded``: the same normalisation,
    filters, digests and MinHash signatures, as the arrays from which
    :func:`spill_rows` makes the dedup steps' records, with no object per
    document. The k-th enabled
    filter's state byte is ``dedup.FILTERED + k``."""
    near = _worker["cfg"].near_dedup
    out, sketched, shingle_sets = _prepare(texts, chunks or [False] * len(texts))
    n = len(out)
    states = np.full(n, dedup.KEEP, np.uint8)
    codes = _worker["codes"]
    filtered = [(k, reason, detail) for k, (_, reason, detail, *_) in enumerate(out) if reason is not None]
    for k, reason, _ in filtered:
        states[k] = codes[reason]
    digests = np.zeros((n, 2), "<u8")
    passed = [k for k, r in enumerate(out) if r[1] is None]
    if passed:
        digests[passed] = np.frombuffer(b"".join(out[k][4] for k in passed), "<u8").reshape(-1, 2)
    sigs = np.zeros((n, near.num_perm), np.uint32) if near.enabled else None
    if sigs is not None and shingle_sets:
        rows = RMinHash.digest_matrix_from_token_sets(shingle_sets, near.num_perm, near.seed).to_rows()
        sigs[sketched] = np.array(rows, np.uint32)
        states[sketched] = dedup.CANDIDATE
    return Sketches(states, digests, sigs, sum(r[3] for r in out), filtered)


class Spilled(NamedTuple):
    """Rows ``[start, start + len(lengths))`` after pass 1, as :func:`spill_rows` returns them."""

    start: int  # the first row
    spill: dedup.Spill  # the work files' records
    changed: int  # documents that normalisation changed
    filtered: list[tuple[int, str, str]]  # (row - start, filter, detail) of each filtered document
    lengths: np.ndarray  # each row's text bytes (where the stage's runs end: RunCutter)


def _input() -> DocTable:
    """The stage's input for ``dedup.method: sharded``, as this worker sees it
    (:func:`pipeline.data.docs.table_as_seen`).
    Raises DedupError (one line) where this worker does not see it as the stage
    did: sharded dedup has no way round that."""
    table = table_as_seen(_worker, _open_input)
    if isinstance(table, str):
        path, _ = _worker["inputs"]
        raise dedup.DedupError(
            f"the clean input {path} is not readable as the stage read it on {socket.gethostname()}, where a "
            f"dedup task ran ({table}); dedup.method: sharded on a Ray cluster needs the input and output "
            "folders on storage that every node mounts at the same path (or use method: memory)")
    return table


def spill_rows(work: dedup.WorkDir, start: int, stop: int) -> Spilled:
    """Pass 1 of ``dedup.method: sharded`` for input rows ``[start, stop)``, read
    here (:func:`_input`): :func:`sketch_batch` on each run of them, and the dedup
    work files' records (:func:`pipeline.data.dedup.spill`), so that the stage's
    own process neither reads the input nor does a step per document."""
    cfg: CleanConfig = _worker["cfg"]
    states, digests, sigs, lengths = [], [], [], []
    filtered: list[tuple[int, str, str]] = []
    changed = 0
    at = 0
    for b in _batches(_input(), cfg, start, stop):
        sk = sketch_batch(*_task(b))
        states.append(sk.states)
        digests.append(sk.digests)
        if sk.sigs is not None:
            sigs.append(sk.sigs)
        filtered += [(at + k, reason, detail) for k, reason, detail in sk.filtered]
        changed += sk.changed
        lengths.append(text_lengths(b.column(1)))
        at += b.num_rows
    records = dedup.spill(work, start, np.concatenate(states), np.concatenate(digests),
                          np.concatenate(sigs) if sigs else None, cfg.exact_dedup.enabled, cfg.near_dedup.enabled)
    return Spilled(start, records, changed, filtered, np.concatenate(lengths))


def _prepare(texts: list[str | None], chunks: list[bool]) -> tuple[list[Result], list[int], list[list[str]]]:
    """Normalise, filter and hash a batch: its results with no MinHash yet, the
    rows to sketch (passed the filters and have shingles) and their shingles."""
    cfg: CleanConfig = _worker["cfg"]
    enabled = _worker["filters"]
    near = cfg.near_dedup
    out: list[Result] = []
    shingle_sets: list[list[str]] = []
    sketched: list[int] = []
    for raw, is_chunk in zip(texts, chunks):
        raw = raw or ""
        text = normalise(raw, _worker["chunk_normalise"] if is_chunk else cfg.normalise)
        changed = text != raw
        fail = first_failure(text, enabled)
        if fail is not None:
            out.append((None, fail[0], fail[1], changed, None, None, 0))
            continue
        data = text.encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if near.enabled:
            sh = shingles(text, near.ngram)
            if sh:
                sketched.append(len(out))
                shingle_sets.append(sh)
        out.append((text, None, "", changed, digest, None, len(data)))
    return out, sketched, shingle_sets


# --- sequential dedup decisions (main process) -------------------------------------------------


class ExactDedup:
    """Set of blake2b-128 digests of every distinct normalised text that passed
    the filters. Memory: 16 B of digest per distinct document, about 140 B with
    Python's bytes object and set slot (measured)."""

    DETAIL = "same normalised text as an earlier document"

    def __init__(self) -> None:
        self.seen: set[bytes] = set()

    def check(self, digest: bytes) -> str | None:
        if digest in self.seen:
            return self.DETAIL
        self.seen.add(digest)
        return None


class NearDedup:
    """MinHash LSH near-duplicate detection with rensa.

    Why rensa: its R-MinHash and LSH are implemented in Rust. Measured here on a
    61 MB corpus of ~290k short documents (128 permutations, word 5-grams, LSH
    insert and query included, one process): rensa ~12-13 MB/s, datasketch
    ~0.77 MB/s (17x slower), datatrove's MinHash stage ~0.34 MB/s. rensa's LSH
    requires ``bands`` to divide ``num_perm``; 16 bands x 8 rows puts the LSH
    candidate threshold near (1/16)^(1/8) ~ 0.71, below the default confirm
    threshold 0.8, so true duplicates are rarely missed and false candidates are
    rejected by the Jaccard check.

    Each document is queried against the kept documents only; a candidate whose
    estimated Jaccard (fraction of equal signature slots) is at least
    ``threshold`` makes the document a duplicate of the best-matching kept one.
    Otherwise the document is kept and inserted.

    Memory, per kept document (measured with 128 permutations, 16 bands): the
    rensa LSH index ~900 B, the stored signature 4 B x num_perm + ~33 B (545 B),
    and the kept id (~90 B for a 16-character id): about 1.5 KB, i.e. ~1.5 GB
    per million kept documents. For larger corpora, ``dedup.method: sharded``
    (:mod:`pipeline.data.dedup`) reaches the same decisions in bounded memory.
    """

    def __init__(self, cfg: NearDedupConfig) -> None:
        self.cfg = cfg
        self.lsh = RMinHashLSH(cfg.threshold, cfg.num_perm, cfg.bands)
        self.signatures: list[bytes] = []
        self.ids: list[str] = []
        self.candidates_checked = 0
        self.candidates_rejected = 0

    @staticmethod
    def detail(jaccard: float, kept_id: str) -> str:
        return f"jaccard~{jaccard:.3f} with kept id {kept_id}"

    def check(self, doc_id: str, minhash: RMinHash) -> str | None:
        sig = array("I", minhash.digest()).tobytes()
        mine = memoryview(sig).cast("I")
        best, best_key = -1.0, -1
        for key in self.lsh.query(minhash):
            self.candidates_checked += 1
            other = memoryview(self.signatures[key]).cast("I")
            j = sum(map(eq, mine, other)) / self.cfg.num_perm
            if j < self.cfg.threshold:
                self.candidates_rejected += 1
            elif j > best or (j == best and key < best_key):
                best, best_key = j, key
        if best_key >= 0:
            return self.detail(best, self.ids[best_key])
        self.add(doc_id, minhash, sig)
        return None

    def add(self, doc_id: str, minhash: RMinHash, sig: bytes | None = None) -> None:
        """Insert a kept document under the next key (keys are insertion order,
        which the tie-break in :meth:`check` relies on)."""
        key = len(self.signatures)
        self.lsh.insert(key, minhash)
        self.signatures.append(sig if sig is not None else array("I", minhash.digest()).tobytes())
        self.ids.append(doc_id)


# --- reading the input ---------------------------------------------------------------------------


def _open_input(in_path: Path) -> DocTable:
    table = DocTable(in_path, CleanError, "run the ingest stage first")
    missing = [n for n in REQUIRED if n not in table.schema_arrow.names]
    if missing:
        raise CleanError(f"{in_path} lacks column(s) {missing}; has {table.schema_arrow.names}")
    wrong = [f"{f.name}: {f.type}" for f in table.schema_arrow if f.name in SCHEMA.names and not _readable(f)]
    if wrong:
        raise CleanError(f"{in_path}: column(s) of a type clean does not read: {', '.join(wrong)} (text is a "
                         "string; chunk and offset are integers; the others strings or integers)")
    return table


def _readable(field: pa.Field) -> bool:
    """Whether an input column casts to SCHEMA's type whatever its values: checked
    up front, so that a text of bytes (which need not be UTF-8) or a chunk of
    strings is one line before any work, not a failed cast in a worker."""
    t = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
    if pa.types.is_null(t):
        return True
    if pa.types.is_integer(t):
        return field.name != "text"
    return SCHEMA.field(field.name).type == pa.string() and \
        (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _batches(table: DocTable, cfg: CleanConfig, start: int = 0, stop: int | None = None
             ) -> Iterator[pa.RecordBatch]:
    """The tasks of rows ``[start, stop)`` in SCHEMA (:meth:`DocTable.runs`: up to
    ``task_bytes`` of text and ``batch_docs`` documents each); absent optional
    columns read as null."""
    names = [n for n in SCHEMA.names if n in table.schema_arrow.names]
    for b in table.runs(cfg.batch_docs, cfg.task_bytes, names, start, stop, max_docs=cfg.batch_docs):
        yield _conformed(b, names)


def _rows(table: DocTable, start: int, stop: int) -> pa.RecordBatch:
    """Rows ``[start, stop)`` in SCHEMA, as one batch (absent optional columns null)."""
    names = [n for n in SCHEMA.names if n in table.schema_arrow.names]
    return _conformed(next(table.iter_batches(stop - start, names, start, stop)), names)


def _conformed(b: pa.RecordBatch, names: list[str]) -> pa.RecordBatch:
    columns = [b.column(n) if n in names else pa.nulls(b.num_rows, f.type) for n, f in zip(SCHEMA.names, SCHEMA)]
    return pa.RecordBatch.from_arrays([c.cast(f.type) for c, f in zip(columns, SCHEMA)], schema=SCHEMA)


def _task(b: pa.RecordBatch) -> tuple[list[str | None], list[bool] | None]:
    chunk = b.column(4)
    return b.column(1).to_pylist(), (chunk.is_valid().to_pylist() if chunk.null_count < len(chunk) else None)


class Piece(NamedTuple):
    """A run of input rows after the dedup decisions, as the shard writer needs it."""

    n: int  # rows in
    bytes_in: int  # their text's UTF-8 bytes
    bytes_out: int  # the kept rows' normalised text's UTF-8 bytes
    kept: pa.RecordBatch | None  # the kept rows in SCHEMA, their text normalised (None: none kept)
    dropped: pa.RecordBatch | None  # id, text, source, location, source_name of the dropped rows (None: none)


def _piece(batch: pa.RecordBatch, keep: np.ndarray | list[bool], texts: pa.Array, bytes_out: int) -> Piece:
    """``batch`` (SCHEMA) cut into its kept rows, with ``texts`` (their
    normalised text, a string array) in place of theirs, and its dropped rows."""
    mask = pa.array(np.asarray(keep, dtype=bool))
    kept = dropped = None
    if len(texts):
        k = batch.filter(mask)
        kept = pa.RecordBatch.from_arrays([k.column(0), texts, *k.columns[2:]], schema=SCHEMA)
    if len(texts) < batch.num_rows:
        dropped = batch.select(["id", "text", "source", "location", "source_name"]).filter(pc.invert(mask))
    return Piece(batch.num_rows, pc.sum(pc.binary_length(batch.column(1))).as_py() or 0, bytes_out, kept, dropped)


def _joined(pieces: list[Piece]) -> Piece:
    """Consecutive pieces as one."""
    if len(pieces) == 1:
        return pieces[0]
    kept = [p.kept for p in pieces if p.kept is not None]
    dropped = [p.dropped for p in pieces if p.dropped is not None]
    return Piece(sum(p.n for p in pieces), sum(p.bytes_in for p in pieces), sum(p.bytes_out for p in pieces),
                 pa.concat_batches(kept) if kept else None, pa.concat_batches(dropped) if dropped else None)


def _mapped(ex: Executor, fn: Any, batches: Iterator[pa.RecordBatch], task: Any = None, **kw: Any
            ) -> Iterator[tuple[pa.RecordBatch, Any]]:
    """(input batch, ``fn(*task(batch))``) in input order. Reading runs at most the
    executor's window ahead of the results (Pool.imap or Executor.map would
    consume the whole input eagerly)."""
    task = task or _task
    pending: deque[pa.RecordBatch] = deque()

    def tasks() -> Iterator[tuple]:
        for b in batches:
            pending.append(b)
            yield task(b)

    for result in ex.map(fn, tasks(), **kw):
        yield pending.popleft(), result


# --- dedup.method memory ------------------------------------------------------------------------


def sketch_kept(texts: list[str]) -> list[tuple[bytes, RMinHash | None]]:
    """The blake2b-128 digest and MinHash of kept (already normalised) texts, as
    :func:`process_batch` made them: to rebuild the dedup indexes on a resume."""
    near = _worker["cfg"].near_dedup
    datas = [t.encode("utf-8", "surrogatepass") for t in texts]
    out: list[tuple[bytes, RMinHash | None]] = [(hashlib.blake2b(d, digest_size=16).digest(), None) for d in datas]
    if near.enabled:
        sets = [(i, sh) for i, t in enumerate(texts) if (sh := shingles(t, near.ngram))]
        if sets:
            for (i, _), mh in zip(sets, RMinHash.from_token_sets([sh for _, sh in sets], near.num_perm, near.seed)):
                out[i] = (out[i][0], mh)
    return out


class Cleaned(NamedTuple):
    """Input rows ``[start, stop)`` after :func:`process_batch`, as
    :func:`clean_rows` returns them: the rows themselves and arrays, no object
    per document but the MinHashes."""

    rows: pa.RecordBatch  # the rows as read, in SCHEMA (their text unchanged: the quarantine's)
    normalised: pa.Array  # string: a row's normalised text where it is not its text (null elsewhere, and if filtered)
    lengths: np.ndarray  # each row's text bytes (where the stage's runs end: RunCutter)
    out_bytes: np.ndarray  # each row's normalised text bytes (0 if filtered)
    changed: np.ndarray  # bool: normalisation changed the row's text
    filtered: dict[int, tuple[str, str]]  # row - start: (filter, detail) of each filtered document
    digests: bytes  # 16 bytes per row: the blake2b-128 digest of its normalised text (zeros if filtered)
    sketches: list[RMinHash | None]  # per row, its MinHash (None: filtered, no shingles, or near dedup off)


def clean_rows(start: int, stop: int, message: bytes | None) -> Cleaned | str:
    """``dedup.method: memory``: normalise, filter, hash and sketch input rows
    ``[start, stop)`` (:func:`process_batch`). The worker reads the rows itself
    (:func:`pipeline.data.docs.table_as_seen`), unless the stage sends them (``message``: the rows
    in SCHEMA as an Arrow IPC message); a worker that does not see the input
    returns why, in one line."""
    if message is not None:
        rows = pa.ipc.read_record_batch(pa.py_buffer(message), SCHEMA)
    else:
        table = table_as_seen(_worker, _open_input)
        if isinstance(table, str):
            return f"on {socket.gethostname()}: {table}"
        rows = _rows(table, start, stop)
    texts, chunks = _task(rows)
    n = len(texts)
    normalised: list[str | None] = [None] * n
    out_bytes = np.zeros(n, np.int64)
    filtered: dict[int, tuple[str, str]] = {}
    digests = bytearray(16 * n)
    sketches: list[RMinHash | None] = [None] * n
    changed = []
    for i, (text, reason, detail, was_changed, digest, mh, nbytes) in enumerate(process_batch(texts, chunks)):
        changed.append(was_changed)
        if reason is not None:
            filtered[i] = (reason, detail)
            continue
        if was_changed or texts[i] is None:  # a null text passes as "", which is what is kept
            normalised[i] = text
        out_bytes[i] = nbytes
        digests[16 * i:16 * i + 16] = digest
        sketches[i] = mh
    return Cleaned(rows, string_array(normalised), text_lengths(rows.column(1)), out_bytes,
                   np.array(changed, bool), filtered, bytes(digests), sketches)


class _InMemory:
    """``dedup.method: memory``: one pass; the workers read and clean the rows
    (:func:`clean_rows`), and the dedup decisions are made here, in input
    order, against in-memory indexes (:class:`ExactDedup`, :class:`NearDedup`).

    Per shard it adds to the record the documents changed by normalisation, the
    near-dedup counters, and the digests of the shard's near duplicates (the
    exact index holds them too: a later copy of a near duplicate is an exact
    duplicate). On a resume, :meth:`prepare` rebuilds both indexes from the
    committed shards before the first one to process: each kept text of those
    shards is hashed and sketched again on the executor and inserted in order
    (the output text is the normalised text that was hashed and sketched, and
    the index keys are insertion order, so the index is the one the
    uninterrupted run had), and the near duplicates' digests are added from
    the records. Its cost: one read of those shards and the digest and MinHash
    of their kept documents, no normalisation or filters. Measured on
    2026-11-23 (2-core CPU machine, 2 local workers, the default corpus with
    ``shard_bytes`` 1 MiB, 6 shards): rebuilding from the first 5 took 0.6 s,
    the whole run 2.8 s."""

    def __init__(self, cfg: CleanConfig, table: DocTable, ex: Executor, slog: ShardLog, inputs: tuple[str, list]):
        self.cfg, self.table, self.ex, self.slog, self.inputs = cfg, table, ex, slog, inputs
        self.exact = ExactDedup() if cfg.exact_dedup.enabled else None
        self.near = NearDedup(cfg.near_dedup) if cfg.near_dedup.enabled else None
        self.changed = 0
        self.near_dropped: list[str] = []

    def _counters(self) -> dict[str, int]:
        n = self.near
        return {} if n is None else {"candidates_checked": n.candidates_checked,
                                     "candidates_below_threshold": n.candidates_rejected, "kept_in_index": len(n.ids)}

    def prepare(self, shards: list[int]) -> None:
        """Add the committed ``shards`` (in order, each continuing the indexes) to the indexes."""
        if not shards or (self.exact is None and self.near is None):
            return
        log.info("rebuilding the dedup indexes from %d committed shard(s)", len(shards))
        for k in shards:
            if self.exact is not None:
                self.exact.seen.update(bytes.fromhex(h) for h in self.slog.committed(k)["near_dropped_digests"])
            batches = DocTable(self.slog.path(k), CleanError).runs(
                self.cfg.batch_docs, self.cfg.task_bytes, ["id", "text"], max_docs=self.cfg.batch_docs)
            for batch, sketches in _mapped(self.ex, sketch_kept, batches, task=lambda b: (b.column(1).to_pylist(),)):
                for doc_id, (digest, mh) in zip(batch.column(0).to_pylist(), sketches):
                    if self.exact is not None:
                        self.exact.seen.add(digest)
                    if self.near is not None and mh is not None:
                        self.near.add(doc_id, mh)

    def begin(self) -> None:
        """A shard starts: its counts start here."""
        self.changed, self.near_dropped, self._at = 0, [], self._counters()

    def end(self) -> dict[str, Any]:
        """A shard ends: its fields for the record."""
        now = self._counters()
        return {"changed": self.changed, "near": {k: v - self._at[k] for k, v in now.items()},
                "near_dropped_digests": self.near_dropped}

    def decide(self, start: int, stop: int) -> Iterator[tuple[Piece, list[tuple[str, str]]]]:
        """The runs of rows ``[start, stop)``, each with the (reason, detail) of its
        dropped rows. The runs end where :meth:`DocTable.runs` ends them
        (:class:`RunCutter` on the rows' lengths), wherever the tasks end."""
        cutter = RunCutter(self.cfg.task_bytes, self.cfg.batch_docs)
        parts: list[tuple[Cleaned, int, int]] = []  # the open run: rows [a, b) of a task's result
        for res in self._cleaned(start, stop):
            for a, b, ends in cutter.feed(res.lengths):
                parts.append((res, a, b))
                if ends:
                    yield self._run(parts)
                    parts = []
        if parts:
            yield self._run(parts)

    def _cleaned(self, start: int, stop: int) -> Iterator[Cleaned]:
        """:func:`clean_rows` over rows ``[start, stop)``, in order, in tasks of
        whole row groups that the workers read (:func:`pipeline.data.docs.row_spans`);
        a row group too large for one task the stage reads and sends in runs.
        A worker that does not see the input as the stage does (a Ray node
        without its storage) hands its task back: the stage cleans that one
        itself and sends the rows of every later task, and says so in one
        warning at the end."""
        unseen: list[str] = []  # per task a worker handed back, why
        fed: deque[tuple[int, int]] = deque()  # the rows of each task fed and not yet back

        def feed() -> Iterator[tuple[int, int, bytes | None]]:
            for span in row_spans(self.table, self.cfg.task_bytes, start, stop, self.cfg.batch_docs):
                at = span.start
                for run in [None] if span.by_worker else _batches(self.table, self.cfg, span.start, span.stop):
                    end = span.stop if run is None else at + run.num_rows
                    if run is None and unseen:
                        run = _rows(self.table, at, end)
                    fed.append((at, end))
                    # IPC writes only the rows' own bytes, where pickling a slice would copy its parent buffers
                    yield at, end, None if run is None else run.serialize().to_pybytes()
                    at = end

        for res in self.ex.map(clean_rows, feed()):
            a, b = fed.popleft()
            if isinstance(res, str):
                unseen.append(res)
                if _worker.get("cfg") is not self.cfg:
                    _init_worker(self.cfg, self.inputs)
                res = clean_rows(a, b, _rows(self.table, a, b).serialize().to_pybytes())
            yield res
        if unseen:
            log.warning("%d task(s) went to a worker that does not see the input as the stage does (%s); the stage "
                        "cleaned them itself and sent the rows of the tasks after them: put %s on storage that every "
                        "node mounts at the same path to spread the reading", len(unseen), unseen[0], self.table.path)

    def _run(self, parts: list[tuple[Cleaned, int, int]]) -> tuple[Piece, list[tuple[str, str]]]:
        """One run (rows ``[a, b)`` of each part) decided in order: its piece and drops."""
        exact, near = self.exact, self.near
        drops: list[tuple[str, str]] = []
        pieces: list[Piece] = []
        for res, a, b in parts:
            keep = np.ones(b - a, bool)
            ids = res.rows.column(0).slice(a, b - a).to_pylist() if near is not None else None
            self.changed += int(np.count_nonzero(res.changed[a:b]))
            for i in range(a, b):
                drop = res.filtered.get(i)
                if drop is None and exact is not None:
                    digest = res.digests[16 * i:16 * i + 16]
                    detail = exact.check(digest)
                    drop = (EXACT_DUPLICATE, detail) if detail else None
                if drop is None and near is not None and (sk := res.sketches[i]) is not None:
                    detail = near.check(ids[i - a], sk)
                    if detail:
                        drop = (NEAR_DUPLICATE, detail)
                        if exact is not None:
                            self.near_dropped.append(digest.hex())
                if drop is not None:
                    keep[i - a] = False
                    drops.append(drop)
            rows = res.rows.slice(a, b - a)
            texts = pc.coalesce(res.normalised.slice(a, b - a), rows.column(1)).filter(pa.array(keep))
            pieces.append(_piece(rows, keep, texts, int(res.out_bytes[a:b][keep].sum())))
        return _joined(pieces), drops


# --- dedup.method sharded -----------------------------------------------------------------------


def cut_rows(start: int, stop: int, states: np.ndarray) -> list[Piece]:
    """Pass 2 of ``dedup.method: sharded`` for input rows ``[start, stop)`` (whole
    runs), read here (:func:`_input`), given their state bytes: each run as a
    :class:`Piece`, its kept rows normalised with the same :func:`normalise`
    call as :func:`process_batch`."""
    cfg: CleanConfig = _worker["cfg"]
    out: list[Piece] = []
    at = 0
    for b in _batches(_input(), cfg, start, stop):
        keep = states[at:at + b.num_rows] < dedup.EXACT
        at += b.num_rows
        texts, chunks = _task(b)
        kept = [normalise(texts[i] or "", _worker["chunk_normalise"] if chunks and chunks[i] else cfg.normalise)
                for i in np.flatnonzero(keep).tolist()]
        out.append(_piece(b, keep, pa.array(kept, pa.string()),
                          sum(len(t.encode("utf-8", "surrogatepass")) for t in kept)))
    return out


# dedup.method sharded: runs per pass-2 task at most (64 MB of text with the default task_bytes).
TASK_RUNS = 64


def _pass2_tasks(bounds: np.ndarray, ends: np.ndarray, start: int, stop: int) -> Iterator[tuple[int, int]]:
    """Pass 2's tasks over rows ``[start, stop)`` (each a run's end; ``ends``, each
    run's end row): whole runs, from a task's first row to the first run end at
    or past the end of the read unit that holds it (``bounds``, see
    :func:`pipeline.data.docs.read_units`), so that a worker decodes few rows it does not use,
    but at most :data:`TASK_RUNS` runs, which bounds what a worker holds."""
    a = start
    while a < stop:
        unit_end = int(bounds[np.searchsorted(bounds, a, side="right")])
        first = int(np.searchsorted(ends, a, side="right"))  # the task's first run
        k = min(int(np.searchsorted(ends, min(unit_end, stop), side="left")), first + TASK_RUNS - 1)
        b = min(int(ends[k]), stop)
        yield a, b
        a = b


class _Sharded:
    """``dedup.method: sharded``: the steps of :mod:`pipeline.data.dedup`. The
    workers read the input rows themselves (:func:`_input`), so the stage's own
    process reads no text. Pass 1 maps :func:`spill_rows` over row ranges that
    start where a reader can (:func:`pipeline.data.docs.read_units`) and appends the records it
    makes (states, digests, signatures, band keys) to a work folder; the stage
    learns where the runs end from the rows' lengths. The exact and band steps
    run as executor tasks; the decisions are made in one ordered pass over the
    pairs. Pass 2 maps :func:`cut_rows` over whole runs (:func:`_pass2_tasks`),
    and the stage writes the pieces it returns into shards. Same outcomes, in
    the same order, as :class:`_InMemory`.

    What resumes: the decisions (each document's state byte, the quarantine's
    details, the documents changed and the near-dedup counters of the whole
    input) are committed as ``decisions-00000.u8`` with its record in the output
    folder under the run's fingerprint, so a rerun skips pass 1 and the steps,
    and pass 2 redoes only the shards that are not committed. What does not:
    pass 1 and the steps themselves; a run killed before the decisions are
    committed starts them again (its work folder is removed by the next run).
    A rerun whose shards are all committed reads neither."""

    def __init__(self, cfg: CleanConfig, table: DocTable, ex: Executor, folder: Path, fp: str, work_root: Path,
                 bar: Any):
        self.cfg, self.table, self.ex, self.work_root, self.bar = cfg, table, ex, work_root, bar
        self.units = read_units(*table.row_groups(), cfg.task_bytes, ex.workers)
        self.names = [name for name, _, _ in cfg.filters.enabled()]
        self.log = ShardLog(folder, fp, stem="decisions", ext=".u8")
        self.log.open()
        self.state: np.ndarray | None = None

    def prepare(self, shards: list[int]) -> None:
        """Load the committed decisions, or make and commit them."""
        if self.state is not None:
            return
        if self.log.committed(0) is None:
            with self.log.writing(0) as tmp:
                self._decide(tmp)
            self.log.seal(0, self._fields)
        else:
            self.bar.update(self.table.num_rows)
        rec = self.log.committed(0)
        self.run_ends = np.array(rec["run_ends"], np.int64)
        self.whole = {"changed": rec["changed"], "near": rec["near"]}
        self.filter_detail = {int(doc): detail for doc, detail in rec["filter_detail"]}
        self.near_detail = {int(doc): NearDedup.detail(jac, kept_id) for doc, jac, kept_id in rec["near_detail"]}
        # mapped, not read: one byte per document, paged in as pass 2 reaches it
        path = self.log.path(0)
        self.state = np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)

    def _decide(self, out: Path) -> None:
        """Pass 1 and the steps; the state bytes go to ``out``, the rest to ``self._fields``."""
        cfg, ex, table = self.cfg, self.ex, self.table
        near_cfg, per_reason = cfg.near_dedup, cfg.quarantine_per_reason
        use_exact, use_near = cfg.exact_dedup.enabled, near_cfg.enabled
        work = dedup.WorkDir(self.work_root, table.num_rows, near_cfg.num_perm, near_cfg.bands,
                             cfg.dedup.partition_docs)
        writer = dedup.SignatureWriter(work, use_exact, use_near)
        sampled: dict[str, int] = {}
        filter_detail: list[tuple[int, str]] = []  # the drops the quarantine will show
        changed = 0
        near_counts: dict[str, int] = {}
        cutter, run_ends = RunCutter(cfg.task_bytes, cfg.batch_docs), []
        try:
            tasks = [(work, a, b) for a, b in unit_tasks(*self.units, cfg.task_bytes)]
            for sp in ex.map(spill_rows, tasks, bar=self.bar, units=lambda sp: sp.spill.docs):
                changed += sp.changed
                for k, reason, detail in sp.filtered:
                    if sampled.get(reason, 0) < per_reason:
                        sampled[reason] = sampled.get(reason, 0) + 1
                        filter_detail.append((sp.start + k, detail))
                writer.append(sp.spill)
                run_ends += [sp.start + b for _, b, full in cutter.feed(sp.lengths) if full]
            writer.close()
            if writer.docs != table.num_rows:
                raise RuntimeError(f"clean: pass 1 covered {writer.docs} of {table.num_rows} rows")
            if table.num_rows and run_ends[-1:] != [table.num_rows]:
                run_ends.append(table.num_rows)

            parts = range(work.partitions)
            if use_exact:
                tasks = [(work, p, writer.size(work.exact_path(p))) for p in parts]
                for dups in ex.map(dedup.exact_partition, tasks):
                    dedup.mark(work, dups, dedup.EXACT)
            near_detail: dict[int, tuple[float, int]] = {}
            if use_near:
                tasks = [(work, b, p, writer.size(work.band_path(b, p))) for b in range(work.bands) for p in parts]
                runs = dedup.merge(work, [r for rs in ex.map(dedup.band_pairs, tasks) for r in rs], ex.map)
                res = dedup.resolve(work, runs, near_cfg.threshold, per_reason)
                near_detail = res["detail"]
                near_counts = {"candidates_checked": res["candidates_checked"],
                               "candidates_below_threshold": res["candidates_below_threshold"],
                               "kept_in_index": int(np.count_nonzero(work.state() == dedup.CANDIDATE))}
            # the ids of the kept documents the near duplicates' details name
            id_of = table.take([i for _, i in near_detail.values()], "id")
            with open(work.state_path, "rb") as src, open(out, "wb") as dst:
                dst.write(src.read())
        finally:
            writer.close()
            dedup.remove(work.root)
        self._fields = {
            "changed": changed, "near": near_counts, "filter_detail": filter_detail, "run_ends": run_ends,
            "near_detail": [(doc, jac, id_of[i]) for doc, (jac, i) in sorted(near_detail.items())]}

    def begin(self) -> None:
        pass

    def end(self) -> dict[str, Any]:
        # The counts of pass 1 are of the whole input; every shard's record holds
        # them so that a rerun with every shard committed needs no decisions file.
        return {"whole_input": self.whole}

    def decide(self, start: int, stop: int) -> Iterator[tuple[Piece, list[tuple[str, str]]]]:
        """The runs of rows ``[start, stop)``, each with the (reason, detail) of its dropped rows."""
        assert self.state is not None, "prepare() first"
        state, names, ends = self.state, self.names, self.run_ends
        tasks = list(_pass2_tasks(self.units[0], ends, start, stop))
        for (a, b), pieces in zip(tasks, self.ex.map(cut_rows, ((a, b, np.asarray(state[a:b])) for a, b in tasks))):
            row = a
            for piece in pieces:
                states = state[row:row + piece.n]
                drops: list[tuple[str, str]] = []
                for k in np.flatnonzero(states >= dedup.EXACT).tolist():
                    st, doc = int(states[k]), row + k
                    if st == dedup.EXACT:
                        drops.append((EXACT_DUPLICATE, ExactDedup.DETAIL))
                    elif st == dedup.NEAR:
                        drops.append((NEAR_DUPLICATE, self.near_detail.get(doc, "")))
                    else:
                        drops.append((names[st - dedup.FILTERED], self.filter_detail.get(doc, "")))
                row += piece.n
                if row not in (b, ends[np.searchsorted(ends, row)]):
                    raise RuntimeError(f"clean: a worker's run ended at row {row}, not where the stage's runs end")
                yield piece, drops
            if row != b:
                raise RuntimeError(f"clean: a worker returned rows {a} to {row}, not {a} to {b}")


# --- the stage ---------------------------------------------------------------------------------

# Each write to a shard is one row group: clean cuts its row groups itself (at
# row_group_docs or more, after the run that brings its input text to
# row_group_bytes, and at the end of a shard), as it did with one file.
_WHOLE_TABLE = 64 * 1024 * 1024


class _Totals:
    """The stage's counts and ledger, summed from the shards' records in order
    (the same sums whether a shard was made now or kept from an earlier run)."""

    def __init__(self, per_reason: int):
        self.ledger = Ledger(per_reason=per_reason)
        self.docs_in = self.docs_out = self.bytes_in = self.bytes_out = self.changed = 0
        self.near: dict[str, int] = {}
        self.whole: dict[str, Any] | None = None
        self.per_source: dict[str, dict[str, Any]] = {}

    def add(self, rec: dict[str, Any]) -> None:
        _add_per_source(self.per_source, rec["per_source"])
        self.docs_in += rec["docs_in"]
        self.docs_out += rec["rows"]
        self.bytes_in += rec["bytes_in"]
        self.bytes_out += rec["bytes_out"]
        self.ledger.merge(Ledger.from_dict(rec["ledger"], self.ledger.per_reason))
        if "whole_input" in rec:  # dedup.method sharded
            self.whole = rec["whole_input"]
        else:
            self.changed += rec["changed"]
            for key, v in rec["near"].items():
                self.near[key] = self.near.get(key, 0) + v


UNNAMED = "(no source_name)"  # documents of an input without ingest's source names


def _add_per_source(into: dict[str, dict[str, Any]], more: dict[str, dict[str, Any]]) -> None:
    """Add one count of documents by source name (docs_in, docs and bytes kept,
    the dropped documents' bytes as they came in, dropped by reason) to another."""
    for name, c in more.items():
        mine = into.setdefault(name, _no_docs())
        for key in ("docs_in", "docs", "bytes", "bytes_dropped"):
            mine[key] += c[key]
        for reason, n in c["dropped"].items():
            mine["dropped"][reason] = mine["dropped"].get(reason, 0) + n


def _no_docs() -> dict[str, Any]:
    return {"docs_in": 0, "docs": 0, "bytes": 0, "bytes_dropped": 0, "dropped": {}}


def _piece_per_source(piece: Piece, drops: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """A piece's documents by source name: those kept (with their normalised
    text's bytes) and those dropped, by reason."""
    out: dict[str, dict[str, Any]] = {}
    if piece.kept is not None:
        kept = pa.table({"name": piece.kept.column("source_name").fill_null(UNNAMED),
                         "bytes": pc.binary_length(piece.kept.column("text"))})
        for row in kept.group_by("name", use_threads=False).aggregate([("bytes", "count"), ("bytes", "sum")]
                                                                      ).to_pylist():
            out[row["name"]] = {**_no_docs(), "docs_in": row["bytes_count"], "docs": row["bytes_count"],
                                "bytes": row["bytes_sum"]}
    if drops:
        names = piece.dropped.column("source_name").fill_null(UNNAMED).to_pylist()
        sizes = pc.binary_length(piece.dropped.column("text")).fill_null(0).to_pylist()
        for (reason, _), name, size in zip(drops, names, sizes):
            c = out.setdefault(name, _no_docs())
            c["docs_in"] += 1
            c["bytes_dropped"] += size
            c["dropped"][reason] = c["dropped"].get(reason, 0) + 1
    return out


def _write_shards(cfg: CleanConfig, decider: Any, writer: ShardedParquetWriter, k: int, pos: int, stop: int,
                  end: int, next_k: int | None, totals: _Totals, bar: Any) -> int:
    """Process input rows ``[pos, stop)`` into shards ``k, k+1, ...``: a shard is
    sealed after the batch at which its input text reaches ``cfg.shard_bytes``,
    and at the end of the input (row ``end``). ``stop`` is the end of the input
    or the start of the committed shard ``next_k``, which the shards written
    here must reach exactly. Returns the next shard index."""
    shard: dict[str, Any] | None = None
    pending: list[pa.RecordBatch] = []
    pending_rows = group_bytes = 0  # the open row group's kept rows, and its input's text bytes

    def flush() -> None:
        nonlocal pending_rows, group_bytes
        if pending_rows:
            writer.write(pa.Table.from_batches(pending, schema=SCHEMA))
            pending.clear()
            pending_rows = group_bytes = 0

    decider.begin()
    try:
        with closing(decider.decide(pos, stop)) as decided:
            for piece, drops in decided:
                if shard is None:
                    writer.start(k)
                    shard = {"start": pos, "docs_in": 0, "bytes_in": 0, "bytes_out": 0, "per_source": {},
                             "ledger": Ledger(per_reason=cfg.quarantine_per_reason)}
                n = piece.n
                _add_per_source(shard["per_source"], _piece_per_source(piece, drops))
                shard["docs_in"] += n
                shard["bytes_in"] += piece.bytes_in
                shard["bytes_out"] += piece.bytes_out
                if drops:
                    dropped = piece.dropped.to_pydict()
                    for (reason, detail), doc_id, text, source, location in zip(
                            drops, dropped["id"], dropped["text"], dropped["source"], dropped["location"]):
                        shard["ledger"].record(reason, source, location, text, detail=f"id {doc_id}: {detail}")
                group_bytes += piece.bytes_in
                if piece.kept is not None:
                    pending.append(piece.kept)
                    pending_rows += piece.kept.num_rows
                    if pending_rows >= cfg.row_group_docs or group_bytes >= cfg.row_group_bytes:
                        flush()
                pos += n
                bar.update(n)
                if shard["bytes_in"] >= cfg.shard_bytes or pos == end:
                    flush()
                    rec = writer.seal({**shard, "end": pos, "ledger": shard["ledger"].to_dict(), **decider.end()})
                    totals.add(rec)
                    shard, k = None, k + 1
                    decider.begin()
    finally:
        writer.abort()
    if shard is not None or pos != stop or (next_k is not None and k != next_k):
        raise RuntimeError(f"clean resume: the shards do not end at row {stop}, where the next committed shard "
                           f"starts ({writer.log.folder}); its records disagree with this run")
    return k


def _check_apart(in_path: Path, out_path: Path, quarantine_path: str | Path, report_path: str | Path | None) -> None:
    """Raise CleanError, before anything is removed or written, where an output
    would clear or replace the input or another output: the output folder is
    the input or holds it (its stale shards are removed first), the quarantine
    or report is the input, inside it, the output folder, or the other one."""
    src, out = in_path.resolve(), out_path.resolve()
    if out == src or src.is_relative_to(out):
        raise CleanError(f"the output folder {out_path} {'is' if out == src else 'holds'} the input {in_path}: "
                         "clean clears its output folder's shards first; give it a folder of its own")
    files = [("quarantine", Path(quarantine_path))] + ([("report", Path(report_path))] if report_path else [])
    for name, path in files:
        dst = path.resolve()
        if dst == src:
            what = f"the input {in_path}"
        elif dst.is_relative_to(src):
            what = f"inside the input {in_path}"
        elif dst == out:
            what = f"the output folder {out_path}"
        else:
            continue
        raise CleanError(f"the {name} path {path} is {what}: writing it would replace that; give it a path of its own")
    if len(files) == 2 and files[0][1].resolve() == files[1][1].resolve():
        raise CleanError(f"the quarantine and the report are both {quarantine_path}: one would replace the other")


def run_clean(cfg: CleanConfig, in_path: str | Path, out_path: str | Path, quarantine_path: str | Path,
              report_path: str | Path | None = None) -> dict:
    """Clean ``in_path`` (a documents folder or one Parquet file, ingest schema)
    into the documents folder ``out_path`` (same schema; :mod:`pipeline.data.docs`)
    and write the quarantine sample to ``quarantine_path``.

    *Shards.* Output shard k holds the outcome of consecutive input rows: it
    is sealed after the run (up to ``task_bytes`` of text and ``batch_docs``
    documents: :meth:`DocTable.runs`) at which the input text since it began
    reaches ``shard_bytes``, so it may hold no rows
    (all dropped). Its record (:mod:`pipeline.data.resume`) holds the input rows
    it covers, its counts and its own Ledger. A rerun under the same
    fingerprint (params but the executor and worker count, the input's digest,
    the code of this module, filters, dedup, docs and accounting) keeps the committed shards,
    replays their records, and processes the others from the state at the end
    of the shard before (see :class:`_InMemory` and :class:`_Sharded` for what
    that takes); shards of another fingerprint, damaged or uncommitted ones are
    removed first. The manifest is written last.

    Returns the metrics: docs and bytes written, dropped (documents), kept_frac,
    shards, shards_resumed (kept from an earlier run), workers, mb_per_s. The
    report, written to ``report_path`` when given, holds docs_in and bytes_in,
    ``dropped`` by reason (every enabled filter and dedup pass, fired or not, so
    reports diff cleanly; ``docs_in == docs + sum(dropped)``),
    ``docs_changed_by_normalise``, ``near_dedup`` (candidates checked and
    rejected, ids kept in the index), ``filters_enabled`` and ``per_source``
    (by ingest's source name: docs_in, docs and bytes kept, bytes_dropped (as
    they came in), dropped by reason;
    the same identity holds in each). All of it but
    shards_resumed, workers and mb_per_s is the same for any executor, worker
    count, dedup method and interruption.

    Raises CleanError when an output path would clear or replace the input or
    another output (:func:`_check_apart`), when the input is missing,
    unreadable, lacks a column, has one of a type it does not read or holds no
    document, and when no document survives (the quarantine is still written
    then, and no manifest);
    ExecutorError (one line) when a worker fails.
    Local worker processes are spawned, so a script that calls this with more
    than one worker needs the usual ``if __name__ == "__main__":`` guard."""
    t0 = time.perf_counter()
    in_path, out_path = Path(in_path), Path(out_path)
    _check_apart(in_path, out_path, quarantine_path, report_path)
    near = cfg.near_dedup
    if near.enabled and (found := near.found_at_threshold()) < 0.5:
        log.warning("clean.near_dedup.threshold %s: the LSH (%d bands of %d rows) makes a candidate of %.0f%% of the "
                    "pairs that similar, so most near duplicates at the threshold are kept; more bands of fewer rows "
                    "find more", near.threshold, near.bands, near.num_perm // near.bands, 100 * found)
    table = _open_input(in_path)
    num_rows = table.num_rows
    if num_rows == 0:
        raise CleanError(f"{in_path} holds no documents: nothing to clean")
    fp = resume.fingerprint(
        "clean", params=cfg.model_dump(mode="json", exclude={"executor", "num_workers"}),
        inputs={"docs": resume.input_digest(in_path)},
        code=resume.code_digest(sys.modules[__name__], filters_module, dedup, docs_module, accounting))
    slog = ShardLog(out_path, fp)
    slog.open()
    # No more workers than tasks (estimated: the text's size from the Parquet
    # metadata): a tiny input runs in-process, without spawning.
    batches = max(-(-num_rows // cfg.batch_docs), -(-table.column_bytes("text") // cfg.task_bytes))
    sharded = cfg.dedup.method == "sharded"
    totals = _Totals(cfg.quarantine_per_reason)
    work_root = out_path.parent / f"{WORK_PREFIX}{os.getpid()}"
    if sharded:
        for stale in dedup.remove_stale(work_root.parent, WORK_PREFIX):
            log.warning("removed %s, the dedup work folder of a clean run that did not finish", stale)

    inputs = (str(in_path), identity(table))  # the workers read the input
    with open_executor(cfg.executor, _init_worker, (cfg, inputs), max_workers=batches, desc="clean") as ex, \
            progress(total=num_rows * (2 if sharded else 1), unit="doc", desc="clean") as bar:
        if sharded:
            decider: _Sharded | _InMemory = _Sharded(cfg, table, ex, out_path, fp, work_root, bar)
        else:
            ShardLog(out_path, fp, stem="decisions", ext=".u8").open()  # removes a sharded run's decisions
            decider = _InMemory(cfg, table, ex, slog, inputs)
        writer = ShardedParquetWriter(slog, SCHEMA, row_group_docs=_WHOLE_TABLE)
        k = pos = resumed = 0
        replayed: list[int] = []  # committed shards not yet in the decider's state
        while pos < num_rows:
            rec = slog.committed(k)
            if rec is not None and rec.get("start") == pos:
                totals.add(rec)
                replayed.append(k)
                pos, k, resumed = rec["end"], k + 1, resumed + 1
                bar.update(rec["docs_in"])
                continue
            next_k = min((j for j in slog.records if j > k), default=None)
            stop = num_rows if next_k is None else slog.records[next_k]["start"]
            decider.prepare(replayed)
            replayed = []
            k = _write_shards(cfg, decider, writer, k, pos, stop, num_rows, next_k, totals, bar)
            pos = stop
        workers = ex.workers
    if resumed:
        log.info("resumed: %d of %d shards kept from an earlier run", resumed, k)

    totals.ledger.write(quarantine_path)
    ledger = totals.ledger
    if totals.docs_out == 0:
        raise CleanError(
            f"no documents left after cleaning {totals.docs_in} document(s) from {in_path}; "
            f"dropped: {ledger.as_dict()} (see {quarantine_path}; loosen the clean: filters in params.yaml)"
        )
    dropped = {name: 0 for name, _, _ in cfg.filters.enabled()}
    if cfg.exact_dedup.enabled:
        dropped[EXACT_DUPLICATE] = 0
    if cfg.near_dedup.enabled:
        dropped[NEAR_DUPLICATE] = 0
    dropped.update(ledger.counts)
    docs_in, docs_out = totals.docs_in, totals.docs_out
    by_source = list(totals.per_source.values())
    if docs_in != docs_out + sum(dropped.values()) or docs_in != num_rows or \
            sum(c["docs_in"] for c in by_source) != docs_in or sum(c["docs"] for c in by_source) != docs_out or \
            sum(c["bytes"] for c in by_source) != totals.bytes_out or \
            any(c["docs_in"] != c["docs"] + sum(c["dropped"].values()) for c in by_source):
        raise RuntimeError(f"clean accounting is broken: rows={num_rows} docs_in={docs_in} docs_out={docs_out} "
                           f"dropped={dropped} per_source={totals.per_source}")
    for name in sorted(totals.per_source):  # its documents are missing downstream (a mixture naming it fails)
        c = totals.per_source[name]
        if c["docs"] == 0:
            log.warning("source %r: clean dropped all %s of its documents (%s); see %s", name, f"{c['docs_in']:,}",
                        counts_text(c["dropped"]), quarantine_path)
    slog.finish(k, {"format": FORMAT, "rows": docs_out})
    changed, near = (totals.whole["changed"], totals.whole["near"]) if totals.whole is not None else \
        (totals.changed, totals.near)
    seconds = time.perf_counter() - t0
    if report_path is not None:
        write_json(report_path, {
            "docs_in": docs_in,
            "bytes_in": totals.bytes_in,
            "dropped": dropped,
            "docs_changed_by_normalise": changed,
            "near_dedup": near if cfg.near_dedup.enabled else {},
            "filters_enabled": [name for name, _, _ in cfg.filters.enabled()],
            "per_source": {name: totals.per_source[name] for name in sorted(totals.per_source)},
        })
    return {
        "docs": docs_out,
        "bytes": totals.bytes_out,
        "dropped": sum(dropped.values()),
        "kept_frac": round(docs_out / docs_in, 4),
        "shards": k,
        "shards_resumed": resumed,
        "workers": workers,
        "mb_per_s": round(totals.bytes_in / 1e6 / seconds, 3) if seconds > 0 else None,
    }
