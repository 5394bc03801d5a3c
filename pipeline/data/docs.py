"""The documents format: what ingest and clean write, and clean, the tokenizer
and pack read.

A documents folder (``data/ingest/docs``, ``data/clean/docs``) holds::

    shard-00000.parquet, shard-00000.json, shard-00001.parquet, ...
    manifest.json

Each shard is a zstd Parquet file in the stage's schema (ingest's: ``id``,
``text``, ``source``, ``location``, ``chunk``, ``offset``, ``source_name``,
``split``), its rows continuing the previous shard's; the shards in index order
are the table. Each has the commit record of :mod:`pipeline.data.resume`. The
manifest (format ``pipeline.docs/1``, written last) lists the shards with their
rows and sha256, and the total ``rows``; a folder without one is incomplete.

:class:`DocTable` reads a folder, or one Parquet file (a user's own table),
through one interface, the part of ``pyarrow.parquet.ParquetFile`` the readers
use. :class:`ShardedParquetWriter` writes the shards for a stage that cuts them
where it chooses.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.data.resume import MANIFEST, ShardLog
from pipeline.errors import StageError
from pipeline.files import no_space, out_of_space, read_json

FORMAT = "pipeline.docs/1"


class DocTable:
    """A documents folder's shards (from its manifest), or one Parquet file, read
    as one table. ``iter_batches`` gives batches of exactly ``batch_size`` rows
    (the last one shorter) across shard boundaries, as ``ParquetFile`` does
    across row groups, so a reader cuts its work the same way however the
    table is sharded.

    Raises ``error`` (a StageError class) with one line when the path is
    missing, a folder has no manifest or lacks a listed shard, a file is not
    Parquet, the shards' schemas differ, or, as it is read, a file's data is
    damaged (Parquet pages carry no checksum: the codec or the decoder finds it)."""

    def __init__(self, path: str | Path, error: type[Exception], missing_hint: str = ""):
        path = Path(path)
        self.path, self.error = path, error
        if path.is_dir():
            manifest_path = path / MANIFEST
            if not manifest_path.is_file():
                raise error(f"{path}: no {MANIFEST}, so the stage that writes it has not completed"
                            f"{'; ' + missing_hint if missing_hint else ''}")
            try:
                manifest = read_json(manifest_path)
                self.files = [path / s["path"] for s in manifest["shards"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise error(f"{manifest_path}: not a documents manifest ({e})") from None
            gone = [f.name for f in self.files if not f.is_file()]
            if gone:
                raise error(f"{path}: shard(s) {gone} listed in {MANIFEST} are missing")
        elif path.is_file():
            self.files = [path]
        else:
            raise error(f"documents not found: {path}{'; ' + missing_hint if missing_hint else ''}")
        self._parts: list[pq.ParquetFile] = []
        try:
            for f in self.files:
                # pre_buffer=False: with pre-buffering, the reader's cached ranges grow with the file
                self._parts.append(pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20))
        except (pa.ArrowInvalid, OSError) as e:
            raise error(f"{f}: not a readable Parquet file: {e}") from None
        if not self._parts:
            raise error(f"{path}: the manifest lists no shards")
        self.schema_arrow: pa.Schema = self._parts[0].schema_arrow
        for f, part in zip(self.files[1:], self._parts[1:]):
            if not part.schema_arrow.equals(self.schema_arrow):
                raise error(f"{f}: schema differs from {self.files[0].name}'s")
        self.num_rows = sum(p.metadata.num_rows for p in self._parts)
        self.metadata = SimpleNamespace(num_rows=self.num_rows)  # as ParquetFile.metadata, for the row count

    def iter_batches(self, batch_size: int, columns: list[str] | None = None, start: int = 0,
                     stop: int | None = None) -> Iterator[pa.RecordBatch]:
        """Batches of exactly ``batch_size`` rows (the last one shorter) of rows
        ``[start, stop)`` (default: to the end); the shards and row groups wholly
        before ``start`` or from ``stop`` on are not read (a stage resuming
        mid-table, a worker reading its part)."""
        if start == 0 and stop is None and len(self._parts) == 1:
            yield from self._decoded(self.files[0], self._parts[0].iter_batches(batch_size=batch_size,
                                                                                 columns=columns))
            return
        pending: list[pa.RecordBatch] = []
        have = 0
        for b in self._pieces(batch_size, columns, start, self.num_rows if stop is None else stop):
            while b.num_rows:
                take = min(batch_size - have, b.num_rows)
                pending.append(b.slice(0, take))
                have += take
                b = b.slice(take)
                if have == batch_size:
                    yield _concat(pending)
                    pending, have = [], 0
        if have:
            yield _concat(pending)

    def runs(self, batch_docs: int, task_bytes: int, columns: list[str], start: int = 0, stop: int | None = None,
             max_docs: int | None = None) -> Iterator[pa.RecordBatch]:
        """Runs of consecutive rows of ``columns`` (``text`` among them), from row
        ``start`` to row ``stop`` (default: the end), read ``batch_docs`` rows at a
        time: the work a stage hands a worker as one task. A run ends at the first
        row that brings its text to ``task_bytes`` (UTF-8 bytes; a larger document
        is a run of its own) or its rows to ``max_docs``, and at ``stop``; only the
        last run may end short of both (:class:`RunCutter`). So a corpus of short
        documents gives tasks as large as one of long documents, and per-task
        costs do not count.

        A run ends where it does wherever the read batches end, so the runs from a
        run's first row on are those of the whole table from there: a stage that
        resumes at a run's start cuts the rest as an uninterrupted run did."""
        left = (self.num_rows if stop is None else stop) - start
        pending: list[pa.RecordBatch] = []
        cutter = RunCutter(task_bytes, max_docs)
        if left <= 0:
            return
        for batch in self.iter_batches(batch_size=batch_docs, columns=columns, start=start, stop=start + left):
            batch = batch.slice(0, left)
            left -= batch.num_rows
            for a, b, ends in cutter.feed(text_lengths(batch.column("text"))):
                pending.append(batch.slice(a, b - a))
                if ends:
                    yield _concat(pending)
                    pending = []
            if left == 0:
                break
        if pending:
            yield _concat(pending)

    def row_groups(self, column: str = "text") -> tuple[np.ndarray, np.ndarray]:
        """The first row of each row group, in table order, with the table's row
        count appended (``len`` = groups + 1), and each group's bytes of
        ``column`` (its uncompressed size in the Parquet metadata, an estimate
        that reads no data; 0 where the column is absent): where a reader can
        start without decoding rows it does not use."""
        starts, sizes = [0], []
        for part in self._parts:
            md = part.metadata
            paths = [md.schema.column(j).path for j in range(md.num_columns)]
            j = paths.index(column) if column in paths else None
            for g in range(md.num_row_groups):
                group = md.row_group(g)
                starts.append(starts[-1] + group.num_rows)
                sizes.append(group.column(j).total_uncompressed_size if j is not None else 0)
        return np.array(starts, np.int64), np.array(sizes, np.int64)

    def take(self, rows: list[int], column: str) -> dict[int, Any]:
        """``column``'s value at each of ``rows``, reading only the row groups that
        hold them."""
        starts, _ = self.row_groups()
        out: dict[int, Any] = {}
        wanted = sorted(set(rows))
        groups = sorted({int(np.searchsorted(starts, r, side="right")) - 1 for r in wanted})
        g0 = 0  # the first group of the current part, in table order
        for f, part in zip(self.files, self._parts):
            n = part.metadata.num_row_groups
            for g in [g for g in groups if g0 <= g < g0 + n]:
                try:
                    values = part.read_row_group(g - g0, columns=[column]).column(0)
                except (OSError, pa.ArrowException) as e:
                    raise self._damaged(f, e) from None
                lo, hi = int(starts[g]), int(starts[g + 1])
                for r in wanted:
                    if lo <= r < hi:
                        out[r] = values[r - lo].as_py()
            g0 += n
        return out

    def column_bytes(self, name: str) -> int:
        """The uncompressed size of column ``name`` in the Parquet metadata, summed
        over the shards (:meth:`row_groups`): an estimate of its bytes that reads no data."""
        return int(self.row_groups(name)[1].sum())

    def _damaged(self, f: Path, e: BaseException) -> Exception:
        why = " ".join(str(e).split())  # pyarrow's messages run over lines
        return self.error(f"{f}: damaged Parquet data ({type(e).__name__}: {why}); run the stage that wrote it "
                          "again, which replaces a damaged shard")

    def _decoded(self, f: Path, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """``batches`` of file ``f``, a decoding error raised as one line that names the file."""
        try:
            yield from batches
        except (OSError, pa.ArrowException) as e:
            raise self._damaged(f, e) from None

    def _pieces(self, batch_size: int, columns: list[str] | None, skip: int, stop: int
                ) -> Iterator[pa.RecordBatch]:
        """Every shard's batches in order, rows ``[skip, stop)`` of the table: only
        the row groups that hold them are read."""
        left = stop - skip  # rows still to give
        for f, part in zip(self.files, self._parts):
            if left <= 0:
                return
            md = part.metadata
            if skip >= md.num_rows:
                skip -= md.num_rows
                continue
            groups: list[int] = []
            need = skip + left  # rows of this part up to the last one wanted
            for g in range(md.num_row_groups):
                rows = md.row_group(g).num_rows
                if not groups and skip >= rows:
                    skip -= rows
                    need -= rows
                    continue
                if need <= 0:
                    break
                groups.append(g)
                need -= rows
            for b in self._decoded(f, part.iter_batches(batch_size=batch_size, row_groups=groups, columns=columns)):
                cut = min(skip, b.num_rows)
                skip -= cut
                b = b.slice(cut, left)
                if b.num_rows:
                    left -= b.num_rows
                    yield b
                if left <= 0:
                    return


# --- a worker reading its own rows ----------------------------------------------------------------

# The parts a large row group is read in at most: a part's reader decodes the
# group from its start, so a group read in k parts is decoded (k + 1) / 2 times.
# Only a table of fewer row groups than TASKS_PER_WORKER tasks for each worker
# is read in parts (ingest and clean write row groups of about 1 MB of text).
SPLIT = 8
TASKS_PER_WORKER = 4


def read_units(starts: np.ndarray, sizes: np.ndarray, task_bytes: int, workers: int = 1
               ) -> tuple[np.ndarray, np.ndarray]:
    """The table cut into the row ranges a worker reads by itself (``starts``
    and ``sizes`` as :meth:`DocTable.row_groups` gives them): each row group
    whole, or, where the table has fewer row groups than :data:`TASKS_PER_WORKER`
    tasks for each of ``workers``, a group of more than ``task_bytes`` of text
    in up to :data:`SPLIT` parts of equal rows, so that the workers still get
    enough tasks. Returns the units' bounds (first rows, then the row count)
    and their estimated text bytes."""
    bounds, unit_bytes = [0], []
    groups = int(np.count_nonzero(np.diff(starts)))
    parts = -(-TASKS_PER_WORKER * workers // max(groups, 1))
    for g in range(len(sizes)):
        first, rows = int(starts[g]), int(starts[g + 1] - starts[g])
        if rows == 0:
            continue
        k = int(min(SPLIT, parts, max(1, sizes[g] // task_bytes), rows))
        for i in range(1, k + 1):
            bounds.append(first + rows * i // k)
            unit_bytes.append(int(sizes[g]) // k)
    return np.array(bounds, np.int64), np.array(unit_bytes, np.int64)


def unit_tasks(bounds: np.ndarray, unit_bytes: np.ndarray, task_bytes: int) -> list[tuple[int, int]]:
    """Tasks of consecutive read units (see :func:`read_units`) as row ranges,
    each at least ``task_bytes`` of text by the metadata but the last."""
    out: list[tuple[int, int]] = []
    first, size = 0, 0
    for u in range(len(unit_bytes)):
        size += int(unit_bytes[u])
        if size >= task_bytes or u == len(unit_bytes) - 1:
            out.append((int(bounds[first]), int(bounds[u + 1])))
            first, size = u + 1, 0
    return out


# A worker reads row groups of up to BIG_GROUP tasks (BIG_GROUP * task_bytes of
# text, and BIG_GROUP * task_docs rows) itself; a larger one the stage reads and
# sends in tasks, since a worker could read a part of one only by decoding the
# group from its start.
BIG_GROUP = 4


class Span(NamedTuple):
    """Rows ``[start, stop)``: one task that a worker reads itself (``by_worker``),
    or a large row group that the stage reads and sends as tasks of ``task_bytes``."""

    start: int
    stop: int
    by_worker: bool


def row_spans(pf: DocTable, task_bytes: int, start: int = 0, stop: int | None = None,
              task_docs: int | None = None) -> list[Span]:
    """The table's rows from ``start`` in spans (:class:`Span`), by the Parquet
    metadata: consecutive row groups of at least ``task_bytes`` of text (or
    ``task_docs`` rows) together, the last one maybe less, each a task its
    worker reads; a group of more than :data:`BIG_GROUP` such tasks, a span of
    its own that the stage reads. The first span is cut at ``start``, the last
    at ``stop`` (default: the end). The same for any executor and worker count
    (pack's checkpoints are taken after tasks); what pack and clean write does
    not depend on where tasks end."""
    starts, sizes = pf.row_groups()
    most_docs = BIG_GROUP * task_docs if task_docs else None
    spans, first, size = [], 0, 0
    for g in range(len(sizes)):
        a, b = int(starts[g]), int(starts[g + 1])
        if sizes[g] > BIG_GROUP * task_bytes or (most_docs and b - a > most_docs):
            spans += [Span(first, a, True)] if first < a else []
            spans.append(Span(a, b, False))
            first, size = b, 0
            continue
        size += int(sizes[g])
        if size >= task_bytes or (task_docs and b - first >= task_docs):
            spans.append(Span(first, b, True))
            first, size = b, 0
    if first < pf.num_rows:
        spans.append(Span(first, pf.num_rows, True))
    stop = pf.num_rows if stop is None else stop
    return [s._replace(start=max(s.start, start), stop=min(s.stop, stop)) for s in spans
            if s.stop > start and s.start < stop]


def identity(table: DocTable) -> list[list]:
    """Each file of ``table`` as ``[path, size, mtime_ns]``: what a worker checks
    before it reads the rows of a table the stage opened (:func:`open_as_seen`)."""
    return [[str(f), (st := os.stat(f)).st_size, st.st_mtime_ns] for f in table.files]


class NotAsSeen(Exception):
    """A worker does not see the table the stage opened: why, in one line."""


def open_as_seen(path: str | Path, seen: list[list], opener: Any) -> DocTable:
    """``opener(path)`` (a DocTable), if its files are those the stage saw
    (``seen``: :func:`identity` in the stage's process): the same paths, sizes
    and modification times. Raises :class:`NotAsSeen` otherwise: on a Ray node
    without the stage's storage, or with a stale view of it."""
    try:
        table = opener(Path(path))
        here = identity(table)
    except (StageError, OSError) as e:  # the opener's one-line error, or the OS's
        raise NotAsSeen(f"{type(e).__name__}: {e}") from None
    if here != seen:
        differ = [a for a, b in zip(here, seen) if a != b]
        raise NotAsSeen(f"{differ[0][0]} is {differ[0][1]} bytes, modified at {differ[0][2]} ns here, not as the "
                        "stage saw it" if differ else f"{len(here)} file(s) here, {len(seen)} for the stage")
    return table


def table_as_seen(state: dict[str, Any], opener: Any) -> DocTable | str:
    """A worker's view of the table its stage opened (``state["inputs"]``: its
    path and :func:`identity`): opened once and kept in ``state["table"]``,
    and only if it is the table the stage opened (:func:`open_as_seen`); else
    why not, in one line, kept too (a Ray node without the stage's storage, or
    with a stale view of it)."""
    if "table" not in state:
        path, seen = state["inputs"]
        try:
            state["table"] = open_as_seen(path, seen, opener)
        except NotAsSeen as e:
            state["table"] = str(e)
    return state["table"]


def text_lengths(texts: pa.Array) -> np.ndarray:
    """Each text's UTF-8 bytes (a null text: 0), as int64: the differences of a
    string or binary column's offsets, read with numpy. (pyarrow's compute
    functions and ``to_numpy`` import pandas on first use: 0.17 s in each
    fresh worker process, which pack's workers need not pay.)"""
    wide = pa.types.is_large_string(texts.type) or pa.types.is_large_binary(texts.type)
    if not isinstance(texts, pa.Array) or not (wide or pa.types.is_string(texts.type)
                                                or pa.types.is_binary(texts.type)):
        lengths = pc.binary_length(texts)
        return pc.fill_null(lengths, 0).to_numpy().astype(np.int64, copy=False)
    n = len(texts)
    validity, offsets = texts.buffers()[:2]
    if n == 0 or offsets is None:
        return np.zeros(n, np.int64)
    dtype = np.dtype(np.int64 if wide else np.int32)
    lengths = np.diff(np.frombuffer(offsets, dtype, count=n + 1, offset=texts.offset * dtype.itemsize)).astype(np.int64)
    if texts.null_count:
        valid = np.unpackbits(np.frombuffer(validity, np.uint8), count=texts.offset + n, bitorder="little")
        lengths[valid[texts.offset:] == 0] = 0
    return lengths


def string_array(texts: list[str | None]) -> pa.Array:
    """``texts`` (None: null) as an Arrow string array, built from its buffers
    with numpy: ``pa.array`` on a list imports pandas on first use, as
    :func:`text_lengths` says. Strict UTF-8, as ``pa.array``: a lone surrogate
    raises UnicodeEncodeError; and less than 2 GiB of text in all (one task's)."""
    datas = [b"" if t is None else t.encode("utf-8") for t in texts]
    offsets = np.zeros(len(datas) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, datas), np.int64, len(datas)), out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"{offsets[-1]} bytes of text do not fit one Arrow string array")
    valid = np.fromiter((t is not None for t in texts), bool, len(texts))
    nulls = len(texts) - int(np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little").tobytes()) if nulls else None
    return pa.Array.from_buffers(pa.string(), len(texts), [
        bitmap, pa.py_buffer(offsets.astype(np.int32).tobytes()), pa.py_buffer(b"".join(datas))], null_count=nulls)


class RunCutter:
    """Where :meth:`DocTable.runs` ends its runs, fed the rows' text lengths in
    order, in chunks of any size: a run ends at the first row that brings its
    text to ``task_bytes`` or its rows to ``max_docs``. The one rule for a stage
    that reads the rows itself and one that learns their lengths from its
    workers (clean's sharded dedup)."""

    def __init__(self, task_bytes: int, max_docs: int | None = None):
        self.task_bytes, self.max_docs = task_bytes, max_docs
        self.size = self.rows = 0  # the open run's bytes and rows

    def feed(self, lengths: np.ndarray) -> list[tuple[int, int, bool]]:
        """The next chunk's rows as pieces ``(a, b, ends)``: rows ``[a, b)`` of the
        chunk belong to the open run, and ``ends`` says that it ends at ``b``."""
        ends = np.cumsum(lengths, dtype=np.int64)
        n, a, out = len(lengths), 0, []
        while a < n:
            base = int(ends[a - 1]) if a else 0
            b = int(np.searchsorted(ends, base + self.task_bytes - self.size, side="left")) + 1  # the row that fills it
            b = min(b, n, a + self.max_docs - self.rows if self.max_docs else n)
            self.size += int(ends[b - 1]) - base
            self.rows += b - a
            full = self.size >= self.task_bytes or self.rows == self.max_docs
            out.append((a, b, full))
            if full:
                self.size = self.rows = 0
            a = b
        return out


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


class ShardedParquetWriter:
    """Writes a documents folder shard by shard through a :class:`ShardLog`:
    :meth:`start` a shard, :meth:`write` tables into it (row groups of at most
    ``row_group_docs``), :meth:`seal` it with its record's fields. A shard that
    is never sealed leaves no file under its name."""

    def __init__(self, shard_log: ShardLog, schema: pa.Schema, row_group_docs: int):
        self.log, self.schema, self.row_group_docs = shard_log, schema, row_group_docs
        self._stack: contextlib.ExitStack | None = None
        self._writer: pq.ParquetWriter | None = None
        self._k = -1
        self.rows = 0

    def start(self, k: int) -> None:
        if self._stack is not None:
            raise RuntimeError("the previous shard is not sealed")
        self._stack = contextlib.ExitStack()
        tmp = self._stack.enter_context(self.log.writing(k))
        self._writer = self._stack.enter_context(pq.ParquetWriter(tmp, self.schema, compression="zstd"))
        self._k, self.rows = k, 0

    def write(self, table: pa.Table) -> None:
        assert self._writer is not None, "start a shard first"
        if table.num_rows:
            try:
                self._writer.write_table(table, row_group_size=self.row_group_docs)
            except Exception as err:
                path = self.log.path(self._k)
                if not out_of_space(err, path):
                    raise
                self.abort()  # its file's space is free again for the message to count
                raise no_space(path) from err
            self.rows += table.num_rows

    def seal(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Close the shard (fsync, rename) and write its record with ``rows`` and ``fields``."""
        assert self._stack is not None, "start a shard first"
        stack, self._stack, self._writer = self._stack, None, None
        stack.close()
        return self.log.seal(self._k, {"rows": self.rows, **fields})

    def abort(self) -> None:
        """Drop the open shard, if any (its temporary file is removed)."""
        if self._stack is not None:
            stack, self._stack, self._writer = self._stack, None, None
            with contextlib.suppress(Exception):
                stack.__exit__(RuntimeError, RuntimeError("aborted"), None)
