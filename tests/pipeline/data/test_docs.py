"""pipeline.data.docs: a documents folder reads as one table, however it is sharded."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.docs import DocTable, ShardedParquetWriter
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
