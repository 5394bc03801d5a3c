"""Deduplication in bounded memory, as steps an executor runs in parallel.

The clean stage's in-memory dedup (:class:`pipeline.data.clean.ExactDedup` and
:class:`~pipeline.data.clean.NearDedup`) decides each document in input order
against everything kept before it, so its index grows with the corpus. This
module reaches the same decisions in steps, in the spirit of datatrove's
four-step MinHash, with every step's memory bounded by a partition, a bucket or
a range of documents rather than by the corpus:

1. **signatures** (in the workers, with normalisation and filters): each
   document's blake2b-128 digest and MinHash signature, and from them the
   work files' records (:func:`spill`): a per-document state byte, the
   signatures (``num_perm`` x 4 B per document, on disk), and ``(digest, doc)``
   and, per LSH band, ``(band hash, doc)`` records split into partitions of
   about ``partition_docs`` documents by hash. The driver appends each batch's
   bytes to the work folder in document order (:class:`SignatureWriter`).
2. **exact groups** (:func:`exact_partition`, one task per partition): sorted by
   digest, every document after the first of its digest is an exact duplicate.
   **band buckets** (:func:`band_pairs`, one task per band and partition):
   sorted by band hash, each bucket of documents whose band is equal gives its
   candidate pairs with their count of equal signature slots. A pair that also
   shares an earlier band is left to that band, so each pair is written once.
   A bucket of more than :data:`LARGE_BUCKET` documents gives no pairs but
   its members (:data:`MEMBER` records, one per document), which the
   decision pass checks against the bucket's kept members only (below).
   Each task checks its partition file against the bytes the driver wrote to
   it, so a worker that does not see the work folder (a Ray node without its
   storage) stops the stage in one line instead of finding no duplicates.
   **merge** (:func:`merge`, only where a kind of run has more than
   :data:`MERGE_RUNS`): runs merged MERGE_RUNS at a time into one, sorted the
   same way, level by level, so that the next step maps few files (each holds
   a file descriptor) however many partitions and spills there were.
3. **decisions** (:func:`resolve`, one pass in document order over the pairs
   and members, read a range of documents at a time): a document is a near
   duplicate when a candidate pair, or a large bucket it shares, links it to
   an earlier document still kept with estimated Jaccard at or above the
   threshold. This is exactly the greedy rule of
   NearDedup, not a cluster rule: with A~B and B~C but not A~C, B is dropped and
   C kept, as the in-memory index does. The kept document named in a drop's
   detail is the best match, the earliest on a tie, as there.
4. **the filter**: the clean stage reads the state bytes while it writes the
   output (:func:`pipeline.data.clean.run_clean`).

Candidates here are documents with an equal band; rensa's index, which the
in-memory path uses, buckets by a 64-bit hash of the band, so the two differ
only when two different bands collide in 64 bits.

Memory per task: an exact task holds its partition (24 B per document), a band
task its partition (16 B per document) plus the signatures of one bucket (read
with pread, nothing mapped) and up to :data:`PAIRS_PER_RUN` pairs (18 B each),
plus one document's pairs with the earlier ones of its bucket, before it writes
a sorted run, within a bucket too (a bucket of more than LARGE_BUCKET
documents: its band only, ``4 x num_perm / bands`` B per document, and 26 B
per member record; about 145 B per member in all, with sorting copies);
a merge task maps its MERGE_RUNS runs and holds a range of their records as
resolve does; :func:`resolve` maps the state bytes (1 B per document,
file-backed) and at most MERGE_RUNS runs of each kind, and holds
the pairs and member records of at most :data:`RESOLVE_DOCS` documents and
:data:`RESOLVE_PAIRS` records at a time (or one document's, fewer than the
documents), plus the kept members of the open large buckets
(:class:`_LargeBuckets`: each with its signature once, ``4 x num_perm`` B, and
listed in each of its buckets; 4.2 KB per kept document in 15 buckets); the
driver buffers at most :data:`FLUSH_BYTES` of step 1's records. The work
folder on disk takes about ``4 x num_perm + 16 x (bands + 2)`` bytes per
document, plus a bucket's pairs: up to ``18 x (LARGE_BUCKET - 1) / 2`` B per
document in buckets of at most LARGE_BUCKET documents, and 26 B per member
and band in larger ones.

Large buckets. A bucket of m near-identical documents (boilerplate pages,
templated files) would give m(m-1)/2 pairs, nearly all of them with a document
that is dropped anyway: 18 M for m = 6,000 (324 MB on disk and 80 s in
``python -m bench.dedup_bucket``), 450 M (8 GB) for 30,000.
Greedy needs only the pairs with *kept* documents, and which ones are kept is
known only in document order, so such a bucket is left to the decision pass:
each member is compared with the members kept before it in its large buckets,
each once, as the in-memory index does (m - 1 comparisons for a cluster of copies; m(m-1)/2 only where every
member is kept, which the in-memory index pays too). A pair that is also in a
small bucket of another band is found both ways and counted once.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np

from pipeline.errors import StageError

# A document's state byte.
KEEP = 0        # passed the filters; no near-dedup signature (none made, or near dedup off)
CANDIDATE = 1   # passed the filters, has a signature; kept unless found a duplicate
EXACT = 2       # exact duplicate of an earlier document
NEAR = 3        # near duplicate of an earlier kept document
FILTERED = 16   # FILTERED + k: dropped by the k-th enabled filter

EXACT_RECORD = np.dtype([("d0", "<u8"), ("d1", "<u8"), ("doc", "<i8")])
BAND_RECORD = np.dtype([("key", "<u8"), ("doc", "<i8")])
PAIR = np.dtype([("j", "<i8"), ("i", "<i8"), ("equal", "<u2")])  # doc j > doc i, equal signature slots
# doc is in the bucket of band `band` whose members run from doc `first` to doc `last`
MEMBER = np.dtype([("doc", "<i8"), ("first", "<i8"), ("last", "<i8"), ("band", "<u2")])

PAIRS_PER_RUN = 1 << 20
RESOLVE_DOCS = 1 << 20
RESOLVE_PAIRS = 1 << 20
FLUSH_BYTES = 16 << 20
# A bucket of more documents than this gives its members, not its pairs (see "Large buckets").
LARGE_BUCKET = 256
READ_DOCS = 4096  # signatures read with one join of preads
# The decision pass maps at most this many runs of each kind (pairs, members);
# more are merged first, this many into one (each mapped run holds a memory map
# and a file descriptor: 16 bands x 64 partitions would pass a common limit of
# 1024 open files).
MERGE_RUNS = 64
# the file in a work folder that says when the process that made it started (see _started)
OWNER = "owner"



# what a dedup step that does not find the work folder's files says to do
SHARED_STORAGE = ("dedup.method: sharded on a Ray cluster needs the output folder on storage that every node mounts "
                  "at the same path (or use method: memory)")


class DedupError(StageError):
    """A step's work files are not those the stage wrote (a Ray node without the work folder's storage)."""


_MIX = np.uint64(0x9E3779B97F4A7C15)
_PRIME = np.uint64(0x100000001B3)


def band_keys(sigs: np.ndarray, bands: int) -> np.ndarray:
    """(n, bands) uint64 hashes of each band of the (n, num_perm) uint32 signatures.
    Equal bands have equal keys; unequal ones rarely do, and band_pairs checks."""
    n, num_perm = sigs.shape
    rows = num_perm // bands
    cols = sigs.reshape(n, bands, rows).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = np.full((n, bands), _MIX, dtype=np.uint64) * (np.arange(bands, dtype=np.uint64) + np.uint64(1))
        for r in range(rows):
            key = (key ^ cols[:, :, r]) * _PRIME
        key ^= key >> np.uint64(29)
        key *= _MIX
        key ^= key >> np.uint64(32)
    return key


class WorkDir:
    """The files of one sharded dedup run under ``root``."""

    def __init__(self, root: str | Path, num_docs: int, num_perm: int, bands: int, partition_docs: int):
        self.root = Path(root)
        self.num_docs, self.num_perm, self.bands = num_docs, num_perm, bands
        self.partitions = max(1, -(-num_docs // partition_docs))

    @property
    def state_path(self) -> Path:
        return self.root / "state.u8"

    @property
    def sig_path(self) -> Path:
        return self.root / "signatures.u32"

    def exact_path(self, p: int) -> Path:
        return self.root / f"exact-{p:05d}.bin"

    def band_path(self, b: int, p: int) -> Path:
        return self.root / f"band-{b:04d}-{p:05d}.bin"

    def pairs_path(self, b: int, p: int, run: int) -> Path:
        return self.root / f"pairs-{b:04d}-{p:05d}-{run:04d}.npy"

    def members_path(self, b: int, p: int) -> Path:
        return self.root / f"members-{b:04d}-{p:05d}.npy"

    def merged_path(self, kind: str, level: int, k: int) -> Path:
        """A run merged from others (:func:`merge`): ``kind`` is ``pairs`` or ``members``."""
        return self.root / f"{kind}-merged-{level:02d}-{k:05d}.npy"

    def state(self, mode: str = "r") -> np.ndarray:
        _check_size(self.state_path, self.num_docs)
        return np.memmap(self.state_path, dtype=np.uint8, mode=mode, shape=(self.num_docs,))

    def open_signatures(self) -> int:
        """The signature file, open for :meth:`signatures`."""
        _check_size(self.sig_path, self.num_docs * 4 * self.num_perm)
        return os.open(self.sig_path, os.O_RDONLY)

    def signatures(self, fd: int, docs: np.ndarray | list[int], band: int | None = None) -> np.ndarray:
        """The (len(docs), num_perm) signatures of ``docs``, read with pread from
        ``fd`` (the signature file, open): a task reads its buckets' rows only,
        and maps nothing, so its memory does not grow with the file. With
        ``band``, only that band's slots: (len(docs), num_perm / bands)."""
        row = 4 * self.num_perm
        width, at = (row, 0) if band is None else (row // self.bands, band * (row // self.bands))
        out = np.empty((len(docs), width // 4), np.uint32)
        for a in range(0, len(docs), READ_DOCS):  # a bounded piece at a time: no bytes object per document held
            piece = docs[a:a + READ_DOCS]
            out[a:a + len(piece)] = np.frombuffer(b"".join(os.pread(fd, width, int(d) * row + at) for d in piece),
                                                  np.uint32).reshape(len(piece), width // 4)
        return out


class Spill(NamedTuple):
    """One batch's step-1 records, as :func:`spill` makes them where the batch is
    sketched (a worker): the bytes the driver appends to each work file."""

    docs: int  # documents in the batch
    states: bytes  # a state byte per document
    sigs: bytes  # the (docs, num_perm) uint32 signatures; b"" with near dedup off
    parts: dict[str, bytes]  # partition file name (in the work folder) -> its records from this batch


def spill(work: WorkDir, start: int, states: np.ndarray, digests: np.ndarray, sigs: np.ndarray | None,
          exact: bool, near: bool) -> Spill:
    """Step 1's records of one batch whose first document is document ``start``:
    ``states`` (uint8: KEEP, CANDIDATE or FILTERED + k), the (n, 2) little-endian
    uint64 blake2b-128 digests (rows of filtered documents are ignored), and the
    (n, num_perm) uint32 signatures (rows of non-candidates are ignored). Pure,
    so it runs in the worker that sketched the batch and the driver only
    appends bytes (:class:`SignatureWriter`)."""
    n = len(states)
    states = np.ascontiguousarray(states, np.uint8)
    parts: dict[str, list[bytes]] = {}
    if exact:
        have = np.flatnonzero(states <= CANDIDATE)  # passed the filters
        if len(have):
            out = np.empty(len(have), EXACT_RECORD)
            out["d0"], out["d1"], out["doc"] = digests[have, 0], digests[have, 1], have.astype(np.int64) + start
            part = out["d0"] % np.uint64(work.partitions)
            for p in np.unique(part):
                parts.setdefault(work.exact_path(int(p)).name, []).append(out[part == p].tobytes())
    sig_bytes = b""
    if near:
        if sigs is None:
            sigs = np.zeros((n, work.num_perm), np.uint32)
        sig_bytes = np.ascontiguousarray(sigs, np.uint32).tobytes()
        cand = np.flatnonzero(states == CANDIDATE)
        if len(cand):
            keys = band_keys(sigs[cand], work.bands)
            docs = cand.astype(np.int64) + start
            for b in range(work.bands):
                out = np.empty(len(cand), BAND_RECORD)
                out["key"], out["doc"] = keys[:, b], docs
                part = out["key"] % np.uint64(work.partitions)
                for p in np.unique(part):
                    parts.setdefault(work.band_path(b, int(p)).name, []).append(out[part == p].tobytes())
    return Spill(n, states.tobytes(), sig_bytes, {name: b"".join(chunks) for name, chunks in parts.items()})


class SignatureWriter:
    """Step 1, driver side: appends each batch's :class:`Spill`, in document
    order, to the work folder, buffering at most FLUSH_BYTES. It starts from an
    empty folder: one of this process's name can hold a killed run's files (a
    restarted container gives the stage the pid it had), not to be appended to.
    Its process is the one whose pid names the folder (:func:`remove_stale`)."""

    def __init__(self, work: WorkDir, exact: bool, near: bool):
        self.work, self.exact, self.near = work, exact, near
        remove(work.root)
        work.root.mkdir(parents=True, exist_ok=True)
        (work.root / OWNER).write_text(_started(os.getpid()) or "")
        self.state_f = open(work.state_path, "wb")
        self.sig_f = open(work.sig_path, "wb") if near else None
        self.buffers: dict[str, list[bytes]] = {}
        self.buffered = 0
        self.docs = 0
        self.sizes: dict[str, int] = {}  # bytes written to each partition file, by name

    def size(self, path: Path) -> int:
        """The bytes written to the partition file ``path`` (0: no file): a step checks what it reads against it."""
        return self.sizes.get(path.name, 0)

    def flush(self) -> None:
        for name, parts in self.buffers.items():
            with open(self.work.root / name, "ab") as f:
                f.write(b"".join(parts))
        self.buffers.clear()
        self.buffered = 0

    def append(self, batch: Spill) -> None:
        """The next batch's records (its first document is document ``self.docs``)."""
        self.docs += batch.docs
        self.state_f.write(batch.states)
        if self.sig_f is not None:
            self.sig_f.write(batch.sigs)
        for name, data in batch.parts.items():
            self.buffers.setdefault(name, []).append(data)
            self.buffered += len(data)
            self.sizes[name] = self.sizes.get(name, 0) + len(data)
        if self.buffered >= FLUSH_BYTES:
            self.flush()

    def add(self, states: np.ndarray, digests: np.ndarray, sigs: np.ndarray | None) -> None:
        """:meth:`append` the :func:`spill` of one batch made here."""
        self.append(spill(self.work, self.docs, states, digests, sigs, self.exact, self.near))

    def close(self) -> None:
        self.flush()
        self.state_f.close()
        if self.sig_f is not None:
            self.sig_f.close()


def _read(path: Path, dtype: np.dtype, size: int) -> np.ndarray:
    """The records of a partition file that the stage wrote ``size`` bytes to (0:
    no file). Raises DedupError when the file here is missing or of another
    size: on a Ray node that does not mount the work folder, a step would
    otherwise find no records, and so no duplicates."""
    if size == 0:
        return np.empty(0, dtype)
    _check_size(path, size)
    return np.fromfile(path, dtype=dtype)


def _check_size(path: Path, size: int) -> None:
    """Raise DedupError unless the work file ``path`` holds the ``size`` bytes the stage wrote to it."""
    try:
        got = path.stat().st_size
    except FileNotFoundError:
        got = None
    if got != size:
        what = "missing" if got is None else f"{got} bytes, not the {size} the stage wrote,"
        raise DedupError(f"the dedup work file {path} is {what} on {socket.gethostname()}, where a dedup task ran; "
                         + SHARED_STORAGE)


def exact_partition(work: WorkDir, p: int, size: int) -> np.ndarray:
    """Step 2 (exact): the documents of partition ``p`` (whose file the stage
    wrote ``size`` bytes to) whose digest an earlier document has, sorted."""
    rec = _read(work.exact_path(p), EXACT_RECORD, size)
    if len(rec) < 2:
        return np.empty(0, np.int64)
    rec = rec[np.lexsort((rec["doc"], rec["d1"], rec["d0"]))]
    same = (rec["d0"][1:] == rec["d0"][:-1]) & (rec["d1"][1:] == rec["d1"][:-1])
    return np.sort(rec["doc"][1:][same])


def band_pairs(work: WorkDir, b: int, p: int, size: int) -> list[str]:
    """Step 2 (near): the candidate pairs first found in band ``b``, among the
    documents of partition ``p`` (whose file the stage wrote ``size`` bytes to)
    still CANDIDATE (exact duplicates are out). Writes them in runs sorted by
    (j, i), and the members of its buckets of more than LARGE_BUCKET documents
    in one file sorted by document, and returns their paths."""
    rec = _read(work.band_path(b, p), BAND_RECORD, size)
    if len(rec) < 2:
        return []
    state = work.state()
    rec = rec[state[rec["doc"]] == CANDIDATE]
    rec = rec[np.lexsort((rec["doc"], rec["key"]))]
    starts = np.flatnonzero(np.r_[True, rec["key"][1:] != rec["key"][:-1]])
    sizes = np.diff(np.r_[starts, len(rec)])
    fd = work.open_signatures()
    runs: list[str] = []
    buf: list[np.ndarray] = []
    buffered = 0

    def spill() -> None:
        nonlocal buffered
        if not buf:
            return
        pairs = np.concatenate(buf)
        pairs = pairs[np.lexsort((pairs["i"], pairs["j"]))]
        path = work.pairs_path(b, p, len(runs))
        np.save(path, pairs)
        runs.append(str(path))
        buf.clear()
        buffered = 0

    members: list[np.ndarray] = []
    rows = work.num_perm // work.bands
    try:
        for s, m in zip(starts[sizes > 1], sizes[sizes > 1]):
            docs = rec["doc"][s:s + m]
            # a bucket that may give pairs: all its signatures at once; a larger one: its band first
            group = work.signatures(fd, docs) if m <= LARGE_BUCKET else None
            band = group[:, b * rows:(b + 1) * rows] if group is not None else work.signatures(fd, docs, band=b)
            for idx in _true_buckets(band):
                if len(idx) > LARGE_BUCKET:
                    out = np.empty(len(idx), MEMBER)
                    out["doc"], out["first"], out["last"], out["band"] = docs[idx], docs[idx[0]], docs[idx[-1]], b
                    members.append(out)
                    continue
                sigs = group[idx] if group is not None else work.signatures(fd, docs[idx])
                for pairs in _bucket_pairs(work, b, docs[idx], sigs):
                    buf.append(pairs)
                    buffered += len(pairs)
                    if buffered >= PAIRS_PER_RUN:  # within a bucket too: a large one spills as it goes
                        spill()
    finally:
        os.close(fd)
    spill()
    if members:
        everyone = np.concatenate(members)
        np.save(work.members_path(b, p), everyone[np.argsort(everyone["doc"], kind="stable")])
        runs.append(str(work.members_path(b, p)))
    return runs


def _true_buckets(band: np.ndarray) -> Iterator[np.ndarray]:
    """The rows of ``band`` (one band's slots of documents whose band key is
    equal) grouped by value, each group's row numbers ascending: a hash
    collision puts unequal bands under one key."""
    if all(bool((band[:, c] == band[0, c]).all()) for c in range(band.shape[1])):
        yield np.arange(len(band))
        return
    _, bucket = np.unique(band, axis=0, return_inverse=True)
    bucket = bucket.ravel()
    for k in np.unique(bucket):
        yield np.flatnonzero(bucket == k)


def _bucket_pairs(work: WorkDir, b: int, docs: np.ndarray, group: np.ndarray) -> Iterator[np.ndarray]:
    """The pairs of one bucket (``docs`` ascending with band ``b`` equal,
    ``group`` their signatures) first found in band ``b``: for each document,
    its pairs with the earlier ones (fewer than the bucket's size at a time)."""
    rows = work.num_perm // work.bands
    lo = b * rows
    for t in range(1, len(docs)):
        eq = group[:t] == group[t]
        earlier = eq[:, :lo].reshape(t, b, rows).all(axis=2).any(axis=1) if b else np.zeros(t, bool)
        new = ~earlier
        if not new.any():
            continue
        out = np.empty(int(new.sum()), PAIR)
        out["j"], out["i"], out["equal"] = docs[t], docs[:t][new], eq[new].sum(axis=1)
        yield out


def _docs(run: np.ndarray) -> np.ndarray:
    """The document each record of a run is about, ascending: a pair's later one, a member."""
    return run["doc"] if run.dtype == MEMBER else run["j"]


def resolve_ranges(runs: list[np.ndarray], num_docs: int) -> Iterator[tuple[int, int]]:
    """The ranges of documents ``[lo, hi)`` that :func:`resolve` takes one at a
    time, in order, covering them all: at most RESOLVE_DOCS documents whose
    records in ``runs`` (pairs and members, each run sorted by document)
    number at most RESOLVE_PAIRS, or one document with all its records (fewer
    than ``num_docs`` pairs and ``bands`` members): a large bucket under
    LARGE_BUCKET gives many pairs to few documents."""
    def count(lo: int, hi: int) -> int:
        return sum(int(np.searchsorted(_docs(r), hi) - np.searchsorted(_docs(r), lo)) for r in runs)

    lo = 0
    while lo < num_docs:
        hi = min(lo + RESOLVE_DOCS, num_docs)
        while hi - lo > 1 and count(lo, hi) > RESOLVE_PAIRS:
            hi = lo + (hi - lo) // 2
        yield lo, hi
        lo = hi


def _open_run(path: str) -> np.ndarray:
    """A run that a step wrote, mapped. A run missing here (written on a Ray node
    whose storage this process does not see) or cut short is one line, not a traceback."""
    try:
        return np.load(path, mmap_mode="r")
    except FileNotFoundError:
        what = "missing"
    except (ValueError, EOFError) as err:  # numpy's words for a cut header or fewer records than it names
        what = f"unreadable ({err})"
    raise DedupError(f"the dedup work file {path} is {what} on {socket.gethostname()}, where a dedup step ran; "
                     + SHARED_STORAGE)


def _kind(path: str) -> str:
    """``pairs`` or ``members``: the kind of a run, from its name."""
    return Path(path).name.split("-", 1)[0]


def merge_runs(work: WorkDir, paths: list[str], out: str) -> str:
    """Step 2b: write to ``out`` the records of the runs ``paths`` (of one kind,
    each sorted by document) as one run, sorted as :func:`resolve` reads them:
    a range of documents at a time, the ranges of :func:`resolve_ranges`. Returns ``out``."""
    opened = [_open_run(p) for p in paths]
    total = sum(len(r) for r in opened)
    keys = ("band", "doc") if opened[0].dtype == MEMBER else ("i", "j")
    dst = np.lib.format.open_memmap(out, mode="w+", dtype=opened[0].dtype, shape=(total,))
    at = 0
    for lo, hi in resolve_ranges(opened, work.num_docs):
        part = _in_order([r[np.searchsorted(_docs(r), lo):np.searchsorted(_docs(r), hi)] for r in opened], keys)
        if part is not None:
            dst[at:at + len(part)] = part
            at += len(part)
    if at != total:
        raise RuntimeError(f"dedup: merging {len(paths)} runs wrote {at} of their {total} records")
    dst.flush()
    del dst, opened
    return out


def merge(work: WorkDir, runs: list[str], map_tasks: Callable[..., Iterable[str]]) -> list[str]:
    """The runs the decision pass reads: ``runs`` if there are at most
    MERGE_RUNS of each kind, else those of a kind with more merged
    (:func:`merge_runs`, run by ``map_tasks(fn, tasks)``, the executor's map)
    into fewer runs of at most MERGE_RUNS each, level by level, each task's
    inputs deleted once its run is written."""
    assert MERGE_RUNS >= 2, "a merge of one run into one would never end"
    by_kind: dict[str, list[str]] = {}
    for r in runs:
        by_kind.setdefault(_kind(r), []).append(r)
    level = 0
    while any(len(rs) > MERGE_RUNS for rs in by_kind.values()):
        tasks, merged = [], set()
        for kind, rs in by_kind.items():
            if len(rs) <= MERGE_RUNS:
                continue
            groups = -(-len(rs) // MERGE_RUNS)
            step = -(-len(rs) // groups)  # groups of nearly equal size
            for k in range(groups):
                tasks.append((work, rs[k * step:(k + 1) * step], str(work.merged_path(kind, level, k))))
            merged.add(kind)
        outs = []
        for (_, paths, _), out in zip(tasks, map_tasks(merge_runs, tasks)):
            outs.append(out)
            for path in paths:  # once merged: the disk holds a level's records about once
                os.unlink(path)
        for kind in merged:
            by_kind[kind] = [o for o in outs if _kind(o) == kind]
        level += 1
    return [r for rs in by_kind.values() for r in rs]


class _LargeBuckets:
    """The open large buckets of the decision pass: each one's kept members so
    far, and their signatures, each held once however many of those buckets it
    is in (a copy is in the buckets of every band where it equals the
    others) and dropped when the last bucket that lists it closes."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, int], list[int]] = {}  # (band, first member) -> kept members so far
        self.sig: dict[int, np.ndarray] = {}  # kept member -> its signature
        self.listed: dict[int, int] = {}  # kept member -> open buckets that list it

    def candidates(self, keys: list[tuple[int, int]], skip: dict[int, int]) -> list[int]:
        """The kept members of the buckets ``keys``, once each, less those in ``skip``."""
        out: set[int] = set()
        for key in keys:
            out.update(self.kept.get(key, ()))
        return [i for i in out if i not in skip]

    def equal(self, ids: list[int], sig: np.ndarray) -> list[int]:
        """Equal slots of ``sig`` with the signature of each of ``ids``."""
        if not ids:
            return []
        return (np.stack([self.sig[i] for i in ids]) == sig).sum(axis=1).tolist()

    def keep(self, doc: int, sig: np.ndarray, keys: list[tuple[int, int]]) -> None:
        """``doc`` is kept: a member of the open buckets ``keys`` (none: nothing to hold)."""
        if not keys:
            return
        for key in keys:
            self.kept.setdefault(key, []).append(doc)
        self.sig[doc] = sig
        self.listed[doc] = self.listed.get(doc, 0) + len(keys)

    def close(self, key: tuple[int, int]) -> None:
        for i in self.kept.pop(key, ()):
            self.listed[i] -= 1
            if not self.listed[i]:
                del self.listed[i], self.sig[i]


def _in_order(parts: list[np.ndarray], keys: tuple[str, ...]) -> np.ndarray | None:
    """The records of ``parts`` (copied out of their mapped runs) sorted by ``keys``, the last the primary."""
    parts = [np.asarray(x) for x in parts if len(x)]
    if not parts:
        return None
    out = np.concatenate(parts)
    return out[np.lexsort(tuple(out[k] for k in keys))]


def resolve(work: WorkDir, runs: list[str], threshold: float, ids_wanted: int) -> dict[str, Any]:
    """Step 3: mark near duplicates NEAR in the state file, in document order.

    A document's candidates are the earlier documents still kept that a pair
    names, and the kept members so far of each large bucket it is a member
    of (their equal slots counted here); each candidate once.
    Returns ``candidates_checked`` and ``candidates_below_threshold`` (counted as
    the in-memory index counts them: pairs whose earlier document is kept),
    ``near`` (documents dropped) and ``detail``: for the first ``ids_wanted``
    drops, doc -> (estimated Jaccard, the kept doc it matches)."""
    state = work.state("r+")
    opened = [_open_run(r) for r in runs]
    num_perm = work.num_perm
    checked = rejected = near = 0
    detail: dict[int, tuple[float, int]] = {}
    large = _LargeBuckets()
    fd = work.open_signatures() if any(r.dtype == MEMBER for r in opened) else None
    end = work.num_docs  # past every document
    try:
        for lo, hi in resolve_ranges(opened, work.num_docs):
            parts = [r[np.searchsorted(_docs(r), lo):np.searchsorted(_docs(r), hi)] for r in opened]
            pairs = _in_order([x for x in parts if x.dtype == PAIR], ("i", "j"))
            members = _in_order([x for x in parts if x.dtype == MEMBER], ("band", "doc"))
            if pairs is None and members is None:
                continue
            js, is_, equal = ([], [], []) if pairs is None else \
                (pairs["j"].tolist(), pairs["i"].tolist(), pairs["equal"].tolist())
            ms, mkeys, mlast = ([], [], []) if members is None else (
                members["doc"].tolist(), list(zip(members["band"].tolist(), members["first"].tolist())),
                members["last"].tolist())
            k = q = 0
            n, nm = len(js), len(ms)
            while k < n or q < nm:
                j = min(js[k] if k < n else end, ms[q] if q < nm else end)
                candidates: dict[int, int] = {}  # earlier kept document -> equal slots
                while k < n and js[k] == j:
                    if state[is_[k]] == CANDIDATE:
                        candidates[is_[k]] = equal[k]
                    k += 1
                buckets: list[tuple[tuple[int, int], int]] = []  # j's large buckets: key, last member
                while q < nm and ms[q] == j:
                    buckets.append((mkeys[q], mlast[q]))
                    q += 1
                sig = None
                if buckets:
                    sig = work.signatures(fd, [j])[0]
                    ids = large.candidates([key for key, _ in buckets], candidates)
                    candidates.update(zip(ids, large.equal(ids, sig)))
                best, best_i = -1.0, -1
                for i in sorted(candidates):
                    checked += 1
                    jac = candidates[i] / num_perm
                    if jac < threshold:
                        rejected += 1
                    elif jac > best:  # ascending i: the earliest of equal matches wins
                        best, best_i = jac, i
                if best_i >= 0:
                    state[j] = NEAR
                    near += 1
                    if len(detail) < ids_wanted:
                        detail[j] = (best, best_i)
                if best_i < 0 and sig is not None:
                    large.keep(j, sig, [key for key, last in buckets if j != last])
                for key, last in buckets:
                    if j == last:
                        large.close(key)
    finally:
        if fd is not None:
            os.close(fd)
    state.flush()
    del state
    return {"candidates_checked": checked, "candidates_below_threshold": rejected, "near": near, "detail": detail}


def mark(work: WorkDir, docs: np.ndarray, value: int) -> None:
    """Set the state of ``docs`` to ``value``."""
    if len(docs):
        state = work.state("r+")
        state[docs] = value
        state.flush()
        del state


def remove(root: str | Path) -> None:
    """Delete a work folder: the files this module names, then the folder (left
    in place if anything else is in it)."""
    root = Path(root)
    if not root.is_dir():
        return
    for f in root.iterdir():
        if f.is_dir():  # no step makes a folder: a user's
            continue
        if f.name in ("state.u8", "signatures.u32", OWNER) or f.name.startswith(("exact-", "band-", "pairs-", "members-")):
            os.unlink(f)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def remove_stale(parent: str | Path, prefix: str) -> list[Path]:
    """Remove the work folders ``<parent>/<prefix><pid>`` whose process is gone
    (a stage killed mid-run; also when the pid now names another process, one
    that started after the folder's maker did); return them. A link, or a
    ``<pid>`` of other characters than 0-9, is no folder a stage makes: left alone."""
    gone = []
    for d in Path(parent).glob(f"{prefix}*"):
        pid = d.name[len(prefix):]
        if d.is_dir() and not d.is_symlink() and pid.isascii() and pid.isdigit() and not _alive(int(pid), d):
            remove(d)
            gone.append(d)
    return gone


def _alive(pid: int, folder: Path) -> bool:
    """Whether the process that made the work folder ``folder`` runs: process
    ``pid``, and started when the folder's OWNER file says, where both are known."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: past any pid the kernel gives
        return False
    except PermissionError:  # another user's process
        pass
    try:
        made_by = (folder / OWNER).read_text()
    except OSError:  # none yet (a folder being made)
        return True
    started = _started(pid)
    return not made_by or started is None or started == made_by


def _started(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks after boot (Linux's /proc;
    None elsewhere or when it is gone): with the pid, a process's identity,
    as a pid is given again once its process is gone (sooner after a reboot)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
