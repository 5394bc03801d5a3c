"""pipeline.data.docs: a documents folder reads as one table, however it is sharded."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.data.docs import DocTable, RunCutter, ShardedParquetWriter, Span, row_spans, string_array, text_lengths
from pipeline.data.resume import ShardLog
from pipeline.errors import StageError

SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string())])


def _table(a: int, b: int) -> pa.Table:
    return pa.table({"id": [f"d{i}" for i in range(a, b)], "text": ["x" * i for i in range(a, b)]}, schema=SCHEMA)


def _folder(path, cuts) -> None:
    sl = ShardLog(path, "fp")
    sl.open()
    w = ShardedParquetWriter(sl, SCHEMA, row_group_docs=4)
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        w.start(k)
        w.write(_table(a, b))
        w.seal({"ends_at": b})
    sl.finish(len(cuts) - 1, {"format": "pipeline.docs/1"})


@pytest.mark.parametrize("cuts", [[0, 50], [0, 7, 8, 30, 50], [0, 0, 20, 20, 50]])
def test_batches_are_the_same_however_the_table_is_sharded(tmp_path, cuts):
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=9)
    _folder(tmp_path / "docs", cuts)
    one, many = DocTable(tmp_path / "one.parquet", StageError), DocTable(tmp_path / "docs", StageError)
    assert one.num_rows == many.num_rows == many.metadata.num_rows == 50
    for size in (1, 6, 64):
        a = list(one.iter_batches(batch_size=size, columns=["id"]))
        b = list(many.iter_batches(batch_size=size, columns=["id"]))
        assert [x.num_rows for x in a] == [x.num_rows for x in b]
        assert pa.Table.from_batches(a).equals(pa.Table.from_batches(b))
        assert b[0].schema.names == ["id"]


def test_incomplete_or_broken_folders_are_one_line_errors(tmp_path):
    with pytest.raises(StageError, match="documents not found.*run ingest"):
        DocTable(tmp_path / "nope", StageError, "run ingest")
    _folder(tmp_path / "docs", [0, 10, 20])
    (tmp_path / "docs" / "shard-00001.parquet").unlink()
    with pytest.raises(StageError, match=r"\['shard-00001.parquet'\] listed in manifest.json are missing"):
        DocTable(tmp_path / "docs", StageError)
    (tmp_path / "docs" / "manifest.json").unlink()
    with pytest.raises(StageError, match="no manifest.json, so the stage that writes it has not completed"):
        DocTable(tmp_path / "docs", StageError)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(StageError, match="not a readable Parquet file"):
        DocTable(tmp_path / "bad.parquet", StageError)


def _damage(path) -> None:
    """Overwrite the middle of the first row group's text data, as bit rot or a
    bad copy would: the file still opens (its footer is intact)."""
    col = pq.ParquetFile(path).metadata.row_group(0).column(1)
    data = bytearray(path.read_bytes())
    middle = col.data_page_offset + col.total_compressed_size // 2
    data[middle - 8:middle + 8] = b"\xff" * 16
    path.write_bytes(bytes(data))


def test_damaged_data_is_a_one_line_error_that_names_the_file(tmp_path):
    """Parquet pages carry no checksum: the codec finds the damage as the rows
    are read, in a stage's own process or a worker, and pyarrow's OSError would
    be a traceback (a worker's task on Ray was one line, in-process it was not)."""
    _folder(tmp_path / "docs", [0, 20, 50])
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=9, compression="zstd")
    shard = tmp_path / "docs" / "shard-00001.parquet"
    for path in (shard, tmp_path / "one.parquet"):
        _damage(path)
    message = r"damaged Parquet data \(OSError: .*\); run the stage that wrote it again, which replaces a damaged shard"
    for path, read in [(tmp_path / "one.parquet", lambda t: list(t.iter_batches(batch_size=64))),
                       (tmp_path / "docs", lambda t: list(t.iter_batches(batch_size=64))),
                       (tmp_path / "docs", lambda t: list(t.iter_batches(batch_size=8, start=21))),
                       (tmp_path / "docs", lambda t: t.take([3, 21], "text"))]:
        table = DocTable(path, StageError)
        with pytest.raises(StageError, match=f"^{shard if path.is_dir() else path}: {message}$"):
            read(table)


def test_an_aborted_shard_leaves_no_file(tmp_path):
    sl = ShardLog(tmp_path, "fp")
    sl.open()
    w = ShardedParquetWriter(sl, SCHEMA, row_group_docs=4)
    w.start(0)
    w.write(_table(0, 5))
    w.abort()
    assert list(tmp_path.iterdir()) == []
    w.start(0)
    w.write(_table(0, 5))
    assert w.seal({})["rows"] == 5


@pytest.mark.parametrize("start", [0, 5, 7, 8, 20, 36, 49, 50])
def test_reading_from_a_row_gives_the_rest_of_the_table_in_whole_batches(tmp_path, start):
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=9)
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])
    whole = _table(0, 50).slice(start)
    for table in (DocTable(tmp_path / "one.parquet", StageError), DocTable(tmp_path / "docs", StageError)):
        got = list(table.iter_batches(batch_size=6, start=start))
        assert [b.num_rows for b in got[:-1]] == [6] * (len(got) - 1)
        assert pa.Table.from_batches(got, schema=SCHEMA).equals(whole)


def _runs(table, **kw):
    return list(table.runs(columns=["id", "text"], **kw))


@pytest.mark.parametrize("task_bytes,max_docs", [(1, None), (40, None), (100, None), (100, 3), (10_000, 4), (10_000, None)])
def test_runs_end_at_the_row_that_fills_them_wherever_the_reads_end(tmp_path, task_bytes, max_docs):
    """Text of row i is i bytes; a run ends at the row that brings its text to
    task_bytes or its rows to max_docs, the same for any read size or sharding."""
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=9)
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])
    want = None
    for table in (DocTable(tmp_path / "one.parquet", StageError), DocTable(tmp_path / "docs", StageError)):
        for read in (1, 6, 64):
            got = _runs(table, batch_docs=read, task_bytes=task_bytes, max_docs=max_docs)
            assert pa.Table.from_batches(got).equals(_table(0, 50))
            sizes = [[len(t) for t in r.column("text").to_pylist()] for r in got]
            for s in sizes[:-1]:  # each but the last is full, and no more than full
                assert sum(s) >= task_bytes or len(s) == max_docs
                assert sum(s[:-1]) < task_bytes and (max_docs is None or len(s) <= max_docs)
            want = want or sizes
            assert sizes == want
    if task_bytes == 10_000 and max_docs is None:
        assert len(want) == 1  # 1,225 bytes in all: one run


@pytest.mark.parametrize("task_bytes,max_docs", [(60, None), (100, 4)])
def test_runs_from_a_runs_start_are_the_rest_and_stop_where_asked(tmp_path, task_bytes, max_docs):
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])
    table = DocTable(tmp_path / "docs", StageError)
    whole = _runs(table, batch_docs=5, task_bytes=task_bytes, max_docs=max_docs)
    assert len(whole) > 4
    starts = [0]
    for r in whole:
        starts.append(starts[-1] + r.num_rows)
    for k, start in enumerate(starts[:-1]):
        rest = _runs(table, batch_docs=5, task_bytes=task_bytes, max_docs=max_docs, start=start)
        assert [r.to_pylist() for r in rest] == [r.to_pylist() for r in whole[k:]]
        # stopping at a later run's start gives exactly the runs before it
        stop = starts[min(k + 2, len(starts) - 1)]
        part = _runs(table, batch_docs=5, task_bytes=task_bytes, max_docs=max_docs, start=start, stop=stop)
        assert [r.to_pylist() for r in part] == [r.to_pylist() for r in whole[k:k + 2]]
    # a stop inside a run ends that run there
    cut = _runs(table, batch_docs=5, task_bytes=task_bytes, max_docs=max_docs, stop=starts[1] - 1)
    assert len(cut) == 1 and cut[0].num_rows == whole[0].num_rows - 1
    assert _runs(table, batch_docs=5, task_bytes=task_bytes, start=50) == []


@pytest.mark.parametrize("task_bytes,max_docs", [(1, None), (60, None), (100, 4), (10_000, None)])
def test_a_run_cutter_fed_lengths_in_any_chunks_ends_the_runs_where_runs_does(tmp_path, task_bytes, max_docs):
    """What a stage whose workers read the rows learns from their lengths alone."""
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])
    table = DocTable(tmp_path / "docs", StageError)
    want, row = [], 0
    for r in _runs(table, batch_docs=5, task_bytes=task_bytes, max_docs=max_docs):
        row += r.num_rows
        want.append(row)
    lengths = np.arange(50, dtype=np.int64)  # row i's text is i bytes
    for chunk in (1, 3, 7, 50):
        cutter, ends = RunCutter(task_bytes, max_docs), []
        for at in range(0, 50, chunk):
            ends += [at + b for _, b, full in cutter.feed(lengths[at:at + chunk]) if full]
        assert ends + ([50] if ends[-1:] != [50] else []) == want


def test_row_groups_and_take_read_the_metadata_and_only_the_groups_asked(tmp_path):
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])  # row groups of 4 rows at most, per shard
    table = DocTable(tmp_path / "docs", StageError)
    starts, sizes = table.row_groups()
    assert starts.tolist() == [0, 4, 7, 8, 12, 16, 20, 24, 28, 30, 34, 38, 42, 46, 50]
    assert len(sizes) == len(starts) - 1 and sizes[-1] >= sum(range(46, 50))
    assert table.take([49, 0, 7, 7, 31], "id") == {0: "d0", 7: "d7", 31: "d31", 49: "d49"}
    read = []
    real = pq.ParquetFile.read_row_group
    try:
        pq.ParquetFile.read_row_group = lambda self, g, **kw: read.append(g) or real(self, g, **kw)
        table.take([5, 6, 31], "text")
    finally:
        pq.ParquetFile.read_row_group = real
    assert read == [1, 0]  # shard 0's second group, shard 3's first


def test_reading_rows_to_a_stop_reads_only_the_row_groups_that_hold_them(tmp_path, monkeypatch):
    """A worker reading its part of the input must not read (or have pyarrow read
    ahead) the rest of the file."""
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])  # row groups of 4 rows at most, per shard
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=4)
    asked = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, **kw: asked.append(kw["row_groups"]) or real(self, **kw))
    for path, want in [("docs", [[1], [0], [0, 1, 2]]), ("one.parquet", [[1, 2, 3, 4]])]:
        asked.clear()
        table = DocTable(tmp_path / path, StageError)
        got = pa.Table.from_batches(list(table.iter_batches(batch_size=3, columns=["id", "text"], start=5, stop=17)))
        assert got.equals(_table(5, 17))
        assert asked == want  # docs: shard 0's second group (rows 4-6), shard 1's, shard 2's first three (8-19)
        assert [len(r) for r in _runs(table, batch_docs=3, task_bytes=30, start=5, stop=17)] == [5, 3, 3, 1]


def test_column_bytes_estimates_a_columns_size_from_the_metadata(tmp_path):
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=9)
    text = sum(range(50))  # 1,225 bytes of text
    for table in (DocTable(tmp_path / "docs", StageError), DocTable(tmp_path / "one.parquet", StageError)):
        # never less than the text; small row groups carry page headers and statistics besides
        assert text <= table.column_bytes("text") <= 3 * text
        assert table.column_bytes("absent") == 0
    big = pa.table({"id": [str(i) for i in range(4000)], "text": [f"{i:0500d}" for i in range(4000)]}, schema=SCHEMA)
    pq.write_table(big, tmp_path / "big.parquet", row_group_size=1000)
    assert 2_000_000 <= DocTable(tmp_path / "big.parquet", StageError).column_bytes("text") <= 2_100_000


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_text_lengths_are_the_utf8_bytes_of_each_text_and_zero_for_a_null(typ):
    """Read from the offsets (and the validity bits) of slices at any offset,
    as pyarrow's own binary_length gives them."""
    rng = np.random.default_rng(0)
    texts = [None if rng.random() < 0.2 else "é" * int(rng.integers(0, 9)) for _ in range(200)]
    column = pa.array([t if t is None or "string" in str(typ) else t.encode() for t in texts], typ)
    for start, n in ((0, 200), (3, 50), (17, 100), (199, 1), (5, 0)):
        part = column.slice(start, n)
        got = text_lengths(part)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, pc.fill_null(pc.binary_length(part), 0).to_numpy())
        np.testing.assert_array_equal(got, [len((t or "").encode()) for t in texts[start:start + n]])
    np.testing.assert_array_equal(text_lengths(pa.nulls(3, typ)), [0, 0, 0])


def test_spans_are_row_groups_a_worker_reads_or_a_large_one_the_stage_reads(tmp_path):
    rng = np.random.default_rng(1)

    def texts(n, size):
        return ["".join(rng.choice(list("abcdefgh"), size)) for _ in range(n)]

    path = tmp_path / "t.parquet"
    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("text", pa.string())])) as w:
        for g in (texts(10, 30), texts(10, 30), texts(10, 30), texts(4, 2000), texts(10, 30), texts(10, 30)):
            w.write_table(pa.table({"id": [f"d{i}" for i in range(len(g))], "text": g}))
    table = DocTable(path, StageError)
    sizes = table.row_groups()[1]
    small = sizes[[0, 1, 2, 4, 5]]
    assert (400 < small).all() and (small < 480).all() and 8000 < sizes[3] < 16_000
    assert row_spans(table, 800) == [Span(0, 20, True), Span(20, 30, True), Span(30, 34, False), Span(34, 54, True)]
    # a resumed run: the same spans, the first cut at its row
    assert row_spans(table, 800, 25) == [Span(25, 30, True), Span(30, 34, False), Span(34, 54, True)]
    assert row_spans(table, 800, 31) == [Span(31, 34, False), Span(34, 54, True)]
    assert row_spans(table, 800, 54) == []
    # and the last cut at a stop (a clean that resumes before a committed shard)
    assert row_spans(table, 800, 5, 32) == [Span(5, 20, True), Span(20, 30, True), Span(30, 32, False)]
    assert row_spans(table, 800, 0, 20) == [Span(0, 20, True)]
    # tasks of task_docs rows too (clean's batch_docs): groups of 10, 10, 10, 4, 10 and 10 rows
    assert row_spans(table, 10**9, task_docs=15) == [Span(0, 20, True), Span(20, 44, True), Span(44, 54, True)]
    assert row_spans(table, 10**9, task_docs=2) == [Span(a, b, b - a < 8) for a, b in [
        (0, 10), (10, 20), (20, 30), (30, 34), (34, 44), (44, 54)]]
    # 4 x 4000 bytes: the large group is read by a worker too; the last span may be short
    assert row_spans(table, 4000) == [Span(0, 34, True), Span(34, 54, True)]
    assert row_spans(table, 120) == [Span(a, b, g != 3) for g, (a, b) in enumerate(
        [(0, 10), (10, 20), (20, 30), (30, 34), (34, 44), (44, 54)])]


@pytest.mark.parametrize("texts", [[], [None], ["a", None, "", "héllo wörld ✓", None], [None] * 9 + ["x"] * 9])
def test_string_array_is_pa_array_of_the_list(texts):
    got = string_array(texts)
    got.validate(full=True)
    assert got.type == pa.string() and got.equals(pa.array(texts, pa.string()))
    np.testing.assert_array_equal(text_lengths(got), [len((t or "").encode()) for t in texts])


def test_string_array_refuses_a_lone_surrogate_as_pa_array_does():
    with pytest.raises(UnicodeEncodeError):
        string_array(["a", "\udc80"])
    with pytest.raises(UnicodeEncodeError):
        pa.array(["a", "\udc80"], pa.string())


def test_a_manifest_without_shards_or_with_shards_of_two_schemas_is_a_one_line_error(tmp_path):
    import json

    _folder(tmp_path / "docs", [0, 10, 20])
    manifest = tmp_path / "docs" / "manifest.json"
    listed = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**listed, "shards": []}))
    with pytest.raises(StageError, match="the manifest lists no shards"):
        DocTable(tmp_path / "docs", StageError)
    manifest.write_text(json.dumps(listed))
    pq.write_table(pa.table({"id": ["a"], "body": ["b"]}), tmp_path / "docs" / "shard-00001.parquet")
    with pytest.raises(StageError, match=r"shard-00001.parquet: schema differs from shard-00000.parquet's"):
        DocTable(tmp_path / "docs", StageError)


def test_a_parquet_file_the_os_refuses_is_a_one_line_error(tmp_path, monkeypatch):
    """A permission (simulated: the tests may run as root) is one line, as a file that is not Parquet is."""
    from pipeline.data import docs

    pq.write_table(_table(0, 5), tmp_path / "one.parquet")

    def refused(path, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(docs.pq, "ParquetFile", refused)
    with pytest.raises(StageError, match=r"one.parquet: not a readable Parquet file: .*Permission denied"):
        DocTable(tmp_path / "one.parquet", StageError)


@pytest.mark.parametrize("stop", [0, 5, 9, 23, 50])
def test_reading_one_file_to_a_stop_gives_the_rows_before_it(tmp_path, stop):
    pq.write_table(_table(0, 50), tmp_path / "one.parquet", row_group_size=9)
    got = list(DocTable(tmp_path / "one.parquet", StageError).iter_batches(batch_size=6, stop=stop))
    assert pa.Table.from_batches(got, schema=SCHEMA).equals(_table(0, stop))


def test_a_null_text_is_zero_bytes_whatever_its_offsets_span():
    """Arrow lets a null slot span bytes of the data buffer (a compute kernel's
    output may): its length is still 0."""
    offsets = np.array([0, 2, 5, 6], np.int32)
    texts = pa.Array.from_buffers(pa.string(), 3, [pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes()),
                                                   pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"abcdef")],
                                  null_count=1)
    assert texts.to_pylist() == ["ab", None, "f"]
    np.testing.assert_array_equal(text_lengths(texts), [2, 0, 1])


def test_a_worker_opens_the_table_only_as_the_stage_saw_it(tmp_path):
    from pipeline.data.docs import NotAsSeen, identity, open_as_seen

    _folder(tmp_path / "docs", [0, 10, 20])
    opener = lambda path: DocTable(path, StageError)
    seen = identity(opener(tmp_path / "docs"))
    assert open_as_seen(tmp_path / "docs", seen, opener).num_rows == 20
    with pytest.raises(NotAsSeen, match=r"shard-00001.parquet is \d+ bytes, modified at \d+ ns here, not as the stage"):
        open_as_seen(tmp_path / "docs", [seen[0], [seen[1][0], seen[1][1] + 1, seen[1][2]]], opener)
    with pytest.raises(NotAsSeen, match=r"2 file\(s\) here, 3 for the stage"):
        open_as_seen(tmp_path / "docs", seen + [seen[0]], opener)
    with pytest.raises(NotAsSeen, match=r"StageError: documents not found"):
        open_as_seen(tmp_path / "nothing", seen, opener)


@pytest.mark.parametrize("start, want", [(4, [[1], [0], [0, 1, 2]]), (7, [[0], [0, 1, 2]]), (8, [[0, 1, 2]])])
def test_reading_from_a_row_group_s_or_a_shard_s_end_reads_none_of_it(tmp_path, monkeypatch, start, want):
    """A start at the end of a row group (row 4) or of a shard (rows 7 and 8:
    shards of 7, 1 and 22 rows) reads none of what lies before it."""
    _folder(tmp_path / "docs", [0, 7, 8, 30, 50])  # row groups of 4 rows at most, per shard
    asked = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, **kw: asked.append(kw["row_groups"]) or real(self, **kw))
    table = DocTable(tmp_path / "docs", StageError)
    got = pa.Table.from_batches(list(table.iter_batches(batch_size=3, start=start, stop=17)))
    assert got.equals(_table(start, 17)) and asked == want


def test_a_task_ends_at_the_unit_that_brings_it_to_task_bytes():
    from pipeline.data.docs import unit_tasks

    bounds = np.array([0, 10, 20, 30, 40])
    assert unit_tasks(bounds, np.array([500, 500, 500, 500]), 500) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert unit_tasks(bounds, np.array([300, 200, 100, 100]), 500) == [(0, 20), (20, 40)]
