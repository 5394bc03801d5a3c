"""clean: normalise, filter and deduplicate the ingested documents.

Input: a Parquet file of documents ``(id, text, source, location, chunk,
offset, source_name, split)`` (the ingest output; the last four may be absent,
which reads as null; other columns are not carried over). Output: the same schema
with normalised text, written in row groups; a quarantine JSONL of dropped
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
  and :class:`NearDedup` for their per-document cost). On a synthetic 200 MB
  corpus (47k documents, 2 workers) the peak RSS was 324 MB for the main
  process and about 130 MB per worker.
- ``sharded``: as steps on disk run by the executor, each within a bounded
  memory (:mod:`pipeline.data.dedup`), then a second pass over the input that
  normalises the kept documents again in the workers. The same documents are
  kept, with the same quarantine and report.

Every document that enters leaves as kept or as dropped with a reason:
``docs_in == docs_out + sum(dropped.values())`` is checked before the metrics
are returned.
"""

from __future__ import annotations

import gc
import logging
import hashlib
import os
import re
import time
import unicodedata
from array import array
from collections import deque
from contextlib import closing
from functools import lru_cache
from operator import eq
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from rensa import RMinHash, RMinHashLSH

from pipeline.data import dedup
from pipeline.data.accounting import Ledger
from pipeline.data.docs import DocTable
from pipeline.data.executor import Executor, ParallelStageConfig, open_executor
from pipeline.data.filters import FiltersSection, first_failure, ngrams
from pipeline.errors import StageError
from pipeline.files import atomic_path, write_json
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


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    bands: int = Field(16, ge=1, le=1024, description="LSH bands; must divide num_perm")
    ngram: int = Field(5, ge=1, le=64, description="shingle size in words")
    threshold: float = Field(
        0.8, gt=0, le=1, description="estimated Jaccard at or above which a candidate is a duplicate")
    seed: int = Field(42, ge=0, le=2**63 - 1, description="MinHash permutation seed")

    @field_validator("bands")
    @classmethod
    def _bands_divide_num_perm(cls, bands: int, info: ValidationInfo) -> int:
        num_perm = info.data.get("num_perm")
        if num_perm is not None and num_perm % bands:
            raise ValueError(f"must divide num_perm={num_perm} (rensa's LSH splits the signature into equal bands)")
        return bands


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
    batch_docs: int = Field(64, ge=1, description="documents per task sent to a worker")
    row_group_docs: int = Field(2000, ge=1, description="documents per output Parquet row group")
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
    """Return ``text`` normalised as ``cfg`` says, steps in field order. Leading
    whitespace of a line (indentation) is never changed. Trailing-whitespace
    stripping uses ``str.rstrip``, so it also removes a stray \r at a line end
    even with ``newlines`` off. With ``strip_blank_edges`` the result neither
    starts nor ends with a blank line; the newline ending the last line stays."""
    if cfg.unicode != "none" and not unicodedata.is_normalized(cfg.unicode, text):
        text = unicodedata.normalize(cfg.unicode, text)
    if cfg.newlines and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.remove_control_chars:
        text = _CONTROL.sub("", text)
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


def _init_worker(cfg: CleanConfig) -> None:
    _worker["cfg"] = cfg
    _worker["filters"] = cfg.filters.enabled()
    _worker["chunk_normalise"] = cfg.normalise.model_copy(update={"strip_blank_edges": False})


def process_batch(texts: list[str | None], chunks: list[bool] | None = None) -> list[Result]:
    """Normalise, filter, hash and sketch one batch; ``chunks`` marks the texts that
    are chunks of a longer text (their blank edges are kept). Pure given the config
    set by :func:`_init_worker`, so batches can run in any process in any order."""
    # The filters build many short-lived tuples (n-grams) and no reference cycles;
    # pausing the cyclic GC for the batch saves ~25% of the time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _process_batch(texts, chunks or [False] * len(texts))
    finally:
        if gc_was_enabled:
            gc.enable()


def _process_batch(texts: list[str | None], chunks: list[bool]) -> list[Result]:
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
    if shingle_sets:
        # One call for the whole batch: rensa does the hashing loop in Rust.
        for i, mh in zip(sketched, RMinHash.from_token_sets(shingle_sets, near.num_perm, near.seed)):
            text, _, _, changed, digest, _, nbytes = out[i]
            out[i] = (text, None, "", changed, digest, mh, nbytes)
    return out


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
        key = len(self.signatures)
        self.lsh.insert(key, minhash)
        self.signatures.append(sig)
        self.ids.append(doc_id)
        return None


# --- the stage ---------------------------------------------------------------------------------


def _open_input(in_path: Path) -> DocTable:
    pf = DocTable(in_path, CleanError, "run the ingest stage first")
    missing = [n for n in REQUIRED if n not in pf.schema_arrow.names]
    if missing:
        raise CleanError(f"{in_path} lacks column(s) {missing}; has {pf.schema_arrow.names}")
    return pf


def _batches(pf: pq.ParquetFile, batch_docs: int) -> Iterator[pa.RecordBatch]:
    """Input batches in SCHEMA; absent optional columns read as null."""
    names = [n for n in SCHEMA.names if n in pf.schema_arrow.names]
    for b in pf.iter_batches(batch_size=batch_docs, columns=names):
        columns = [b.column(n) if n in names else pa.nulls(b.num_rows, f.type) for n, f in zip(SCHEMA.names, SCHEMA)]
        yield pa.RecordBatch.from_arrays([c.cast(f.type) for c, f in zip(columns, SCHEMA)], schema=SCHEMA)


def _task(b: pa.RecordBatch) -> tuple[list[str | None], list[bool] | None]:
    chunk = b.column(4)
    return b.column(1).to_pylist(), (chunk.is_valid().to_pylist() if chunk.null_count < len(chunk) else None)


class _Counts:
    """What the decision passes count besides the per-document outcomes."""

    def __init__(self) -> None:
        self.changed = 0
        self.near: dict[str, int] = {}


# Per document, as the writer needs it: (normalised text if kept, drop reason, detail, UTF-8 bytes if kept)
Outcome = tuple[str | None, str | None, str, int]


def _mapped(ex: Executor, fn: Any, pf: pq.ParquetFile, cfg: CleanConfig, task: Any = None, **kw: Any
            ) -> Iterator[tuple[pa.RecordBatch, Any]]:
    """(input batch, ``fn(*task(batch))``) in input order. Reading runs at most the
    executor's window ahead of the results (Pool.imap or Executor.map would
    consume the whole input eagerly)."""
    task = task or _task
    batches: deque[pa.RecordBatch] = deque()

    def tasks() -> Iterator[tuple]:
        for b in _batches(pf, cfg.batch_docs):
            batches.append(b)
            yield task(b)

    for result in ex.map(fn, tasks(), **kw):
        yield batches.popleft(), result


def _decide_in_memory(pf: pq.ParquetFile, cfg: CleanConfig, ex: Executor, counts: _Counts
                      ) -> Iterator[tuple[pa.RecordBatch, list[Outcome]]]:
    """``dedup.method: memory``: one pass; the dedup decisions are made here, in
    input order, against in-memory indexes (:class:`ExactDedup`, :class:`NearDedup`)."""
    exact = ExactDedup() if cfg.exact_dedup.enabled else None
    near = NearDedup(cfg.near_dedup) if cfg.near_dedup.enabled else None
    for batch, results in _mapped(ex, process_batch, pf, cfg):
        ids = batch.column(0).to_pylist()
        outcomes: list[Outcome] = []
        for i, (text, reason, detail, was_changed, digest, mh, nbytes) in enumerate(results):
            counts.changed += was_changed
            if reason is None and exact is not None:
                detail = exact.check(digest) or ""
                reason = EXACT_DUPLICATE if detail else None
            if reason is None and near is not None and mh is not None:
                detail = near.check(ids[i], mh) or ""
                reason = NEAR_DUPLICATE if detail else None
            outcomes.append((text, None, "", nbytes) if reason is None else (None, reason, detail, 0))
        yield batch, outcomes
    if near is not None:
        counts.near = {"candidates_checked": near.candidates_checked,
                       "candidates_below_threshold": near.candidates_rejected, "kept_in_index": len(near.ids)}


def normalise_kept(texts: list[str | None], chunks: list[bool]) -> list[tuple[str, int]]:
    """The normalised text and its UTF-8 size for each kept document (``dedup.method:
    sharded``, second pass); the same :func:`normalise` call as :func:`process_batch`."""
    cfg: CleanConfig = _worker["cfg"]
    out = []
    for raw, is_chunk in zip(texts, chunks):
        text = normalise(raw or "", _worker["chunk_normalise"] if is_chunk else cfg.normalise)
        out.append((text, len(text.encode("utf-8", "surrogatepass"))))
    return out


def _decide_sharded(pf: pq.ParquetFile, cfg: CleanConfig, ex: Executor, counts: _Counts, work_root: Path,
                    bar: Any) -> Iterator[tuple[pa.RecordBatch, list[Outcome]]]:
    """``dedup.method: sharded``: the steps of :mod:`pipeline.data.dedup`. Pass 1
    maps :func:`process_batch` and spills states, digests and signatures to
    ``work_root``; the exact and band steps run as executor tasks; the decisions
    are made in one ordered pass over the pairs; pass 2 re-reads the input and
    normalises the kept documents in the workers. Same outcomes, in the same
    order, as :func:`_decide_in_memory`. ``work_root`` is removed at the end."""
    near_cfg, per_reason = cfg.near_dedup, cfg.quarantine_per_reason
    use_exact, use_near = cfg.exact_dedup.enabled, near_cfg.enabled
    names = [name for name, _, _ in cfg.filters.enabled()]
    code = {name: dedup.FILTERED + k for k, name in enumerate(names)}
    work = dedup.WorkDir(work_root, pf.metadata.num_rows, near_cfg.num_perm, near_cfg.bands, cfg.dedup.partition_docs)
    writer = dedup.SignatureWriter(work, use_exact, use_near)
    sampled: dict[str, int] = {}
    filter_detail: dict[int, str] = {}  # the drops the quarantine will show
    try:
        start = 0
        for _, results in _mapped(ex, process_batch, pf, cfg, bar=bar, units=len):
            n = len(results)
            states = np.full(n, dedup.KEEP, np.uint8)
            digests: list[bytes | None] = [None] * n
            sigs = np.zeros((n, near_cfg.num_perm), np.uint32) if use_near else None
            for k, (_, reason, detail, was_changed, digest, mh, _) in enumerate(results):
                counts.changed += was_changed
                if reason is not None:
                    states[k] = code[reason]
                    if sampled.get(reason, 0) < per_reason:
                        sampled[reason] = sampled.get(reason, 0) + 1
                        filter_detail[start + k] = detail
                    continue
                if use_exact:
                    digests[k] = digest
                if sigs is not None and mh is not None:
                    states[k] = dedup.CANDIDATE
                    sigs[k] = mh.digest()
            writer.add(states, digests, sigs)
            start += n
        writer.close()

        parts = range(work.partitions)
        if use_exact:
            for dups in ex.map(dedup.exact_partition, [(work, p) for p in parts]):
                dedup.mark(work, dups, dedup.EXACT)
        near_detail: dict[int, tuple[float, int]] = {}
        if use_near:
            runs = [r for rs in ex.map(dedup.band_pairs, [(work, b, p) for b in range(work.bands) for p in parts])
                    for r in rs]
            res = dedup.resolve(work, runs, near_cfg.threshold, per_reason)
            near_detail = res["detail"]
            counts.near = {"candidates_checked": res["candidates_checked"],
                           "candidates_below_threshold": res["candidates_below_threshold"],
                           "kept_in_index": int(np.count_nonzero(work.state() == dedup.CANDIDATE))}

        state = work.state()
        wanted = {i for _, i in near_detail.values()}
        id_of: dict[int, str] = {}
        at = 0

        def kept_task(b: pa.RecordBatch) -> tuple[list[str | None], list[bool]]:
            nonlocal at
            keep = state[at:at + b.num_rows] < dedup.EXACT
            at += b.num_rows
            texts, chunks = _task(b)
            idx = np.flatnonzero(keep).tolist()
            return [texts[i] for i in idx], [bool(chunks[i]) for i in idx] if chunks else [False] * len(idx)

        start = 0
        for batch, normalised in _mapped(ex, normalise_kept, pf, cfg, task=kept_task):
            ids = batch.column(0).to_pylist()
            for k, doc_id in enumerate(ids):
                if start + k in wanted:
                    id_of[start + k] = doc_id
            it = iter(normalised)
            outcomes: list[Outcome] = []
            for k, st in enumerate(state[start:start + len(ids)].tolist()):
                doc = start + k
                if st < dedup.EXACT:
                    text, nbytes = next(it)
                    outcomes.append((text, None, "", nbytes))
                elif st == dedup.EXACT:
                    outcomes.append((None, EXACT_DUPLICATE, ExactDedup.DETAIL, 0))
                elif st == dedup.NEAR:
                    best = near_detail.get(doc)
                    detail = NearDedup.detail(best[0], id_of[best[1]]) if best else ""
                    outcomes.append((None, NEAR_DUPLICATE, detail, 0))
                else:
                    outcomes.append((None, names[st - dedup.FILTERED], filter_detail.get(doc, ""), 0))
            start += len(ids)
            yield batch, outcomes
    finally:
        writer.close()
        dedup.remove(work.root)


def run_clean(cfg: CleanConfig, in_path: str | Path, out_path: str | Path, quarantine_path: str | Path,
              report_path: str | Path | None = None) -> dict:
    """Clean ``in_path`` (Parquet, ingest schema) into ``out_path`` (same schema)
    and write the quarantine sample to ``quarantine_path``.

    Returns the metrics: docs and bytes written, dropped (documents), kept_frac,
    workers, mb_per_s. The report, written to ``report_path`` when given, holds
    docs_in and bytes_in, ``dropped`` by reason (every enabled filter and dedup
    pass, fired or not, so reports diff cleanly; ``docs_in == docs +
    sum(dropped)``), ``docs_changed_by_normalise``, ``near_dedup`` (candidates
    checked and rejected, ids kept in the index) and ``filters_enabled``. All of
    it but workers and mb_per_s is the same for any executor, worker count and
    dedup method.

    Raises CleanError when the input is missing, unreadable or lacks a column,
    and when no document survives (the quarantine is still written then, and
    ``out_path`` is left untouched); ExecutorError (one line) when a worker fails.
    Local worker processes are spawned, so a script that calls this with more
    than one worker needs the usual ``if __name__ == "__main__":`` guard."""
    t0 = time.perf_counter()
    in_path = Path(in_path)
    pf = _open_input(in_path)
    # No more workers than batches: a tiny input runs in-process, without spawning.
    batches = -(-pf.metadata.num_rows // cfg.batch_docs)
    sharded = cfg.dedup.method == "sharded"
    ledger = Ledger(per_reason=cfg.quarantine_per_reason)
    counts = _Counts()
    docs_in = docs_out = bytes_in = bytes_out = 0
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    work_root = Path(out_path).parent / f"{WORK_PREFIX}{os.getpid()}"
    if sharded:
        for stale in dedup.remove_stale(work_root.parent, WORK_PREFIX):
            log.warning("removed %s, the dedup work folder of a clean run that did not finish", stale)

    with open_executor(cfg.executor, _init_worker, (cfg,), max_workers=batches, desc="clean") as ex, \
            atomic_path(out_path) as tmp, pq.ParquetWriter(tmp, SCHEMA, compression="zstd") as writer, \
            progress(total=pf.metadata.num_rows * (2 if sharded else 1), unit="doc", desc="clean") as bar:
        decided = _decide_sharded(pf, cfg, ex, counts, work_root, bar) if sharded else \
            _decide_in_memory(pf, cfg, ex, counts)

        def flush() -> None:
            nonlocal pending_rows
            if pending_rows:
                writer.write_table(pa.Table.from_batches(pending, schema=SCHEMA), row_group_size=pending_rows)
                pending.clear()
                pending_rows = 0

        with closing(decided):
            for batch, outcomes in decided:
                ids = batch.column(0).to_pylist()
                docs_in += len(ids)
                bytes_in += pc.sum(pc.binary_length(batch.column(1))).as_py() or 0
                keep: list[bool] = []
                kept_texts: list[str] = []
                for i, (text, reason, detail, nbytes) in enumerate(outcomes):
                    keep.append(reason is None)
                    if reason is None:
                        kept_texts.append(text)
                        bytes_out += nbytes
                    else:
                        ledger.record(reason, batch.column(2)[i].as_py(), batch.column(3)[i].as_py(),
                                      batch.column(1)[i].as_py(), detail=f"id {ids[i]}: {detail}")
                if kept_texts:
                    kept = batch.filter(pa.array(keep))
                    pending.append(pa.RecordBatch.from_arrays(
                        [kept.column(0), pa.array(kept_texts, pa.string()), *kept.columns[2:]], schema=SCHEMA))
                    pending_rows += len(kept_texts)
                    docs_out += len(kept_texts)
                    if pending_rows >= cfg.row_group_docs:
                        flush()
                bar.update(len(ids))
        flush()
        workers = ex.workers

        ledger.write(quarantine_path)
        if docs_out == 0:
            raise CleanError(
                f"no documents left after cleaning {docs_in} document(s) from {in_path}; "
                f"dropped: {ledger.as_dict()} (see {quarantine_path}; loosen the clean: filters in params.yaml)"
            )

    dropped = {name: 0 for name, _, _ in cfg.filters.enabled()}
    if cfg.exact_dedup.enabled:
        dropped[EXACT_DUPLICATE] = 0
    if cfg.near_dedup.enabled:
        dropped[NEAR_DUPLICATE] = 0
    dropped.update(ledger.counts)
    if docs_in != docs_out + sum(dropped.values()) or docs_in != pf.metadata.num_rows:
        raise RuntimeError(
            f"clean accounting is broken: rows={pf.metadata.num_rows} docs_in={docs_in} "
            f"docs_out={docs_out} dropped={dropped}"
        )
    seconds = time.perf_counter() - t0
    if report_path is not None:
        write_json(report_path, {
            "docs_in": docs_in,
            "bytes_in": bytes_in,
            "dropped": dropped,
            "docs_changed_by_normalise": counts.changed,
            "near_dedup": counts.near if cfg.near_dedup.enabled else {},
            "filters_enabled": [name for name, _, _ in cfg.filters.enabled()],
        })
    return {
        "docs": docs_out,
        "bytes": bytes_out,
        "dropped": sum(dropped.values()),
        "kept_frac": round(docs_out / docs_in, 4),
        "workers": workers,
        "mb_per_s": round(bytes_in / 1e6 / seconds, 3) if seconds > 0 else None,
    }
