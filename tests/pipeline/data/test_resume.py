"""pipeline.data.resume: which shards a rerun keeps, and which it removes."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.data import resume
from pipeline.data.resume import MANIFEST, ShardLog
from pipeline.files import read_json


def _write(text: str):
    return lambda tmp: tmp.write_text(text)


def _three(folder, fp="a") -> ShardLog:
    sl = ShardLog(folder, fp, ext=".txt")
    assert sl.open() == {}
    for k in range(3):
        sl.commit(k, _write(f"shard {k}"), {"rows": k + 1, "ends_at": 10 * (k + 1)})
    sl.finish(3, {"format": "test"})
    return sl


def test_rerun_keeps_committed_shards_with_their_records(tmp_path):
    _three(tmp_path)
    again = ShardLog(tmp_path, "a", ext=".txt")
    kept = again.open()
    assert sorted(kept) == [0, 1, 2]
    assert kept[1]["ends_at"] == 20 and kept[1]["rows"] == 2
    assert not (tmp_path / MANIFEST).exists()  # incomplete until the stage finishes again
    assert again.removed == []  # nothing of value was removed, so nothing to warn of


def test_other_fingerprint_is_stale_and_removed(tmp_path):
    _three(tmp_path, "a")
    other = ShardLog(tmp_path, "b", ext=".txt")
    assert other.open() == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert sum("another fingerprint" in r for r in other.removed) == 6  # three shards, three records


def test_damaged_missing_and_uncommitted_shards_are_removed(tmp_path):
    _three(tmp_path)
    (tmp_path / "shard-00001.txt").write_text("shard X")  # bytes no longer match the record
    (tmp_path / "shard-00002.txt").unlink()  # record without shard
    (tmp_path / "shard-00003.txt").write_text("killed before its record")
    (tmp_path / ".shard-00004.txt.abc.tmp").write_text("killed mid-write")
    sl = ShardLog(tmp_path, "a", ext=".txt")
    assert sorted(sl.open()) == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.json", "shard-00000.txt"]
    text = " ".join(sl.removed)
    for why in ("sha256 does not match", "shard missing", "no commit record", "unfinished write"):
        assert why in text


def test_shards_restored_without_records_are_not_blamed_on_an_interrupted_run(tmp_path, caplog):
    """DVC caches a persisted output without its .dvcignore'd records, so `dvc exp
    run --temp` and `dvc checkout` restore shards with no record beside them: the
    warning names that cause too, not only an interrupted run."""
    _three(tmp_path)
    for k in range(3):  # what a copy restored from DVC's cache holds
        (tmp_path / f"shard-{k:05d}.json").unlink()
    with caplog.at_level("WARNING", logger="pipeline.data.resume"):
        assert ShardLog(tmp_path, "a", ext=".txt").open() == {}
    assert f"{tmp_path}: removed 3 file(s), no commit record (a run interrupted while writing it, or a copy of the " \
           "output restored without its records, as `dvc exp run --temp` and `dvc checkout` make; it is written " \
           "again): shard-00000.txt, shard-00001.txt, shard-00002.txt" in caplog.text


def test_unreadable_record_is_not_trusted(tmp_path):
    _three(tmp_path)
    (tmp_path / "shard-00000.json").write_text("{not json")
    sl = ShardLog(tmp_path, "a", ext=".txt")
    assert sorted(sl.open()) == [1, 2]


def test_finish_lists_shards_and_refuses_gaps(tmp_path):
    _three(tmp_path)
    manifest = read_json(tmp_path / MANIFEST)
    assert [s["rows"] for s in manifest["shards"]] == [1, 2, 3]
    assert manifest["format"] == "test" and "fingerprint" not in manifest
    sl2 = ShardLog(tmp_path, "a", ext=".txt")
    sl2.open()
    (tmp_path / "shard-00001.txt").write_text("x")
    sl3 = ShardLog(tmp_path, "a", ext=".txt")
    sl3.open()
    with pytest.raises(RuntimeError, match=r"\[1\] are not committed"):
        sl3.finish(3, {})
    sl3.finish(1, {})  # shards beyond the end are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard-00000.json", "shard-00000.txt"]


def test_a_failed_write_leaves_nothing_under_the_shard_name(tmp_path):
    sl = ShardLog(tmp_path, "a", ext=".txt")
    sl.open()

    def boom(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        sl.commit(0, boom, {})
    assert list(tmp_path.iterdir()) == []


def test_fingerprint_moves_with_params_inputs_and_code(tmp_path):
    base = resume.fingerprint("clean", {"a": 1}, {"docs": "x"}, "c")
    assert base == resume.fingerprint("clean", {"a": 1}, {"docs": "x"}, "c")
    assert len({base, resume.fingerprint("clean", {"a": 2}, {"docs": "x"}, "c"),
                resume.fingerprint("clean", {"a": 1}, {"docs": "y"}, "c"),
                resume.fingerprint("clean", {"a": 1}, {"docs": "x"}, "d"),
                resume.fingerprint("pack", {"a": 1}, {"docs": "x"}, "c")}) == 5
    f = tmp_path / "raw.txt"
    f.write_text("abc")
    before = resume.files_digest([f])
    os.utime(f, ns=(1, 1))
    assert resume.files_digest([f]) != before
    assert resume.code_digest(resume) != resume.code_digest(resume, pytest)


def test_keep_below_removes_the_later_shards_and_their_records(tmp_path, caplog):
    log = ShardLog(tmp_path, "fp")
    log.open()
    for k in range(4):
        log.commit(k, lambda p: p.write_bytes(b"x"), {"rows": 1})
    (tmp_path / "shard-00007.parquet").write_bytes(b"left over")
    log.keep_below(2, "after the point resumed")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard-00000.json", "shard-00000.parquet", "shard-00001.json", "shard-00001.parquet"]
    assert sorted(log.records) == [0, 1]
    assert caplog.text.count("after the point resumed") == 1  # one line for the five files
    assert "removed 5 file(s), after the point resumed: shard-00002.parquet, shard-00002.json, ... shard-00007.parquet" \
        in caplog.text


def test_code_digest_moves_with_the_source_text_not_only_the_file_name(tmp_path):
    """An edit to a module's code makes its old shards stale, though the file name stays."""
    src = tmp_path / "mod.py"
    src.write_text("x = 1\n")
    module = type("M", (), {"__file__": str(src)})
    before = resume.code_digest(module)
    src.write_text("x = 2\n")
    assert resume.code_digest(module) != before


def test_files_digest_moves_with_the_size_when_the_mtime_is_kept(tmp_path):
    f = tmp_path / "raw.txt"
    f.write_text("abc")
    os.utime(f, ns=(5, 5))
    before = resume.files_digest([f])
    f.write_text("abcdef")  # appended in place, and the mtime put back (as a copy with `cp -p` does)
    os.utime(f, ns=(5, 5))
    assert resume.files_digest([f]) != before


def test_digest_json_does_not_depend_on_key_order():
    assert resume.digest_json({"a": 1, "b": {"c": 2, "d": 3}}) == resume.digest_json({"b": {"d": 3, "c": 2}, "a": 1})


def test_input_digest_of_a_folder_is_its_manifest_and_of_a_file_its_bytes(tmp_path):
    import hashlib

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / MANIFEST).write_bytes(b'{"shards": []}')
    (tmp_path / "docs.parquet").write_bytes(b"rows")
    assert resume.input_digest(tmp_path / "out") == hashlib.sha256(b'{"shards": []}').hexdigest()
    assert resume.input_digest(tmp_path / "docs.parquet") == hashlib.sha256(b"rows").hexdigest()


def test_finish_refuses_a_missing_last_shard_and_removes_the_shard_just_past_the_end(tmp_path):
    _three(tmp_path)
    (tmp_path / "shard-00002.txt").write_text("damaged")
    sl = ShardLog(tmp_path, "a", ext=".txt")
    assert sorted(sl.open()) == [0, 1]
    with pytest.raises(RuntimeError, match=r"shard\(s\) \[2\] are not committed"):
        sl.finish(3, {})
    whole = tmp_path / "whole"
    _three(whole)
    sl = ShardLog(whole, "a", ext=".txt")
    sl.open()
    manifest = sl.finish(2, {})
    assert [s["path"] for s in manifest["shards"]] == ["shard-00000.txt", "shard-00001.txt"]
    assert sorted(p.name for p in whole.iterdir()) == [
        "manifest.json", "shard-00000.json", "shard-00000.txt", "shard-00001.json", "shard-00001.txt"]


def test_a_record_that_is_json_but_not_an_object_is_not_trusted(tmp_path):
    _three(tmp_path)
    (tmp_path / "shard-00001.json").write_text("[1, 2]")
    sl = ShardLog(tmp_path, "a", ext=".txt")
    assert sorted(sl.open()) == [0, 2]
    assert not (tmp_path / "shard-00001.txt").exists()


def test_files_digest_moves_with_the_name_when_size_and_mtime_are_kept(tmp_path):
    """Another input file of the same size and time (a file renamed, or another picked) is another input."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    for f in (a, b):
        f.write_text("abc")
        os.utime(f, ns=(5, 5))
    assert resume.files_digest([a]) != resume.files_digest([b])


def test_a_shard_index_past_five_digits_is_kept_and_made_stale_like_the_others(tmp_path):
    sl = ShardLog(tmp_path, "a", ext=".txt")
    sl.open()
    sl.commit(100000, _write("late"), {"rows": 1})
    assert sorted(ShardLog(tmp_path, "a", ext=".txt").open()) == [100000]
    other = ShardLog(tmp_path, "b", ext=".txt")
    assert other.open() == {} and list(tmp_path.iterdir()) == []


def test_a_shard_being_written_again_is_not_committed_until_sealed(tmp_path):
    """A rewrite of shard k that fails leaves k uncommitted, in memory and on disk: a rerun redoes it."""
    sl = _three(tmp_path)
    with pytest.raises(OSError):
        with sl.writing(1) as tmp:
            assert sl.committed(1) is None and not sl.record_path(1).exists()
            raise OSError("disk full")
    with pytest.raises(RuntimeError, match=r"\[1\] are not committed"):
        sl.finish(3, {})
    assert sorted(ShardLog(tmp_path, "a", ext=".txt").open()) == [0, 2]


def test_four_removed_files_are_all_named(tmp_path, caplog):
    _three(tmp_path)
    (tmp_path / "shard-00003.txt").write_text("killed before its record")
    for k in range(3):
        (tmp_path / f"shard-{k:05d}.json").unlink()
    with caplog.at_level("WARNING", logger="pipeline.data.resume"):
        ShardLog(tmp_path, "a", ext=".txt").open()
    assert "removed 4 file(s)" in caplog.text
    assert "shard-00000.txt, shard-00001.txt, shard-00002.txt, shard-00003.txt" in caplog.text


def test_open_removes_only_its_own_temporary_files(tmp_path):
    """Another stem's unfinished write (clean's decisions beside its shards) and a user's hidden file stay."""
    for name in (".shard-00000.txt.x1.tmp", ".decisions-00000.u8.x2.tmp", ".notes.tmp"):
        (tmp_path / name).write_text("x")
    ShardLog(tmp_path, "a", ext=".txt").open()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".decisions-00000.u8.x2.tmp", ".notes.tmp"]


def test_keep_below_warns_of_its_own_removals_only(tmp_path, caplog):
    (tmp_path / ".shard-00000.txt.x1.tmp").write_text("x")
    sl = ShardLog(tmp_path, "a", ext=".txt")
    sl.open()
    sl.commit(0, _write("a"), {})
    caplog.clear()  # open's own warning
    with caplog.at_level("WARNING", logger="pipeline.data.resume"):
        sl.keep_below(0, "after the point resumed")
    assert "unfinished write" not in caplog.text and "removed 2 file(s), after the point resumed" in caplog.text


def test_finish_forgets_the_shards_it_removes(tmp_path):
    sl = _three(tmp_path)
    sl.finish(2, {})
    assert sl.committed(2) is None and sorted(sl.records) == [0, 1]


def test_a_shard_renamed_with_its_record_is_not_trusted_at_its_new_place(tmp_path, caplog):
    """Shards 1 and 2 swapped by hand, each with its record: their bytes match the records, but the records
    (and what they say of where the shard ends) are of the other place."""
    _three(tmp_path)
    for ext in (".txt", ".json"):
        (tmp_path / f"shard-00001{ext}").rename(tmp_path / "swap")
        (tmp_path / f"shard-00002{ext}").rename(tmp_path / f"shard-00001{ext}")
        (tmp_path / "swap").rename(tmp_path / f"shard-00002{ext}")
    with caplog.at_level("WARNING", logger="pipeline.data.resume"):
        assert sorted(ShardLog(tmp_path, "a", ext=".txt").open()) == [0]
    assert "removed 4 file(s), its record names another shard" in caplog.text


def _arrow_log(folder, rows=(3, 2)) -> ShardLog:
    import pyarrow as pa

    sl = ShardLog(folder, "a", ext=".arrow")
    sl.open()
    for k, n in enumerate(rows):
        def write(tmp, n=n):
            batch = pa.record_batch([pa.array(range(n), pa.int32())], names=["x"])
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as w:
                w.write_batch(batch)
        sl.commit(k, write, {"rows": n, "ends_at": 10 * (k + 1)})
    return sl


def _edit(record, **fields):
    """Edit a record by hand; ``digest=True`` also puts its own digest right (a careful hand)."""
    rec = read_json(record)
    fix = fields.pop("digest", False)
    rec.update(fields)
    if fix:
        rec["record_sha256"] = resume.record_digest(rec)
    record.write_text(json.dumps(rec))


@pytest.mark.parametrize("fix_digest", [False, True])
def test_a_record_whose_rows_were_edited_is_checked_against_the_shard_and_redone(tmp_path, caplog, fix_digest):
    """The shard's own metadata says how many rows it holds: a record that says otherwise
    (even with its digest put right) is not built on, and the shard is redone with a reason."""
    _arrow_log(tmp_path)
    _edit(tmp_path / "shard-00001.json", rows=5, digest=fix_digest)
    with caplog.at_level("WARNING", logger="pipeline.data.resume"):
        sl = ShardLog(tmp_path, "a", ext=".arrow")
        assert sorted(sl.open()) == [0]
    why = "its row count does not match" if fix_digest else "its record was edited"
    assert f"removed 2 file(s), {why}" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.arrow", "shard-00000.json"]


def test_a_record_whose_end_point_was_edited_is_not_built_on(tmp_path):
    """Where the shard ends in the input is not in the shard: the record's digest of its own fields catches it."""
    _three(tmp_path)
    _edit(tmp_path / "shard-00002.json", ends_at=25)
    sl = ShardLog(tmp_path, "a", ext=".txt")
    assert sorted(sl.open()) == [0, 1]
    assert sl.removed == [f"shard-00002.{e} (its record was edited or written by an older version (its fields do "
                          "not match its digest))" for e in ("txt", "json")]


def test_the_rows_of_a_parquet_shard_are_checked_from_its_footer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sl = ShardLog(tmp_path, "a")
    sl.open()
    for k in range(2):
        sl.commit(k, lambda tmp: pq.write_table(pa.table({"x": [1, 2, 3]}), tmp), {"rows": 3})
    _edit(tmp_path / "shard-00000.json", rows=4, digest=True)
    assert sorted(ShardLog(tmp_path, "a").open()) == [1]


def test_a_committed_arrow_shard_that_is_no_arrow_file_is_redone(tmp_path):
    """A truncated shard whose record was made to match its bytes: its rows cannot be read."""
    _arrow_log(tmp_path)
    shard = tmp_path / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:40])
    _edit(tmp_path / "shard-00000.json", sha256=resume.sha256_file(shard), digest=True)
    sl = ShardLog(tmp_path, "a", ext=".arrow")
    assert sorted(sl.open()) == [1]
    assert "shard-00000.arrow (not a readable shard)" in sl.removed


def test_a_truncated_arrow_shard_is_redone(tmp_path):
    _arrow_log(tmp_path)
    shard = tmp_path / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-10])
    sl = ShardLog(tmp_path, "a", ext=".arrow")
    assert sorted(sl.open()) == [0]
    assert "shard-00001.arrow (sha256 does not match its record)" in sl.removed


def test_a_directory_where_a_shard_belongs_is_a_one_line_error_and_is_kept(tmp_path):
    from pipeline.errors import StageError

    _three(tmp_path)
    (tmp_path / "shard-00001.txt").unlink()
    (tmp_path / "shard-00001.txt").mkdir()
    (tmp_path / "shard-00001.txt" / "mine").write_text("a user's file")
    (tmp_path / "shard-00000.txt").write_text("damaged")  # checked before shard 1
    with pytest.raises(StageError, match=r"shard-00001.txt is a directory where a shard or its record belongs; "
                                         r"it is not removed: move it out"):
        ShardLog(tmp_path, "a", ext=".txt").open()
    assert (tmp_path / "shard-00001.txt" / "mine").read_text() == "a user's file"
    assert (tmp_path / "shard-00000.txt").exists()  # the run stopped before removing anything, unreported


def test_a_directory_among_the_shards_a_resumed_run_drops_is_a_one_line_error(tmp_path):
    from pipeline.errors import StageError

    sl = _three(tmp_path)
    (tmp_path / "shard-00002.txt").unlink()
    (tmp_path / "shard-00002.txt").mkdir()
    with pytest.raises(StageError, match="shard-00002.txt is a directory"):
        sl.keep_below(1, "after the point resumed")
    assert (tmp_path / "shard-00002.txt").is_dir()


def test_a_directory_where_a_record_belongs_is_a_one_line_error_and_is_kept(tmp_path):
    from pipeline.errors import StageError

    _three(tmp_path)
    (tmp_path / "shard-00000.json").unlink()
    (tmp_path / "shard-00000.json").mkdir()
    with pytest.raises(StageError, match="shard-00000.json is a directory"):
        ShardLog(tmp_path, "a", ext=".txt").open()
    assert (tmp_path / "shard-00000.json").is_dir()


def test_a_shard_replaced_by_a_symlink_is_redone_and_its_target_kept(tmp_path):
    """A link to a file of the same bytes is still not what the stage wrote: the link goes, its target stays."""
    _three(tmp_path / "out")
    target = tmp_path / "users-copy.txt"
    target.write_bytes((tmp_path / "out" / "shard-00001.txt").read_bytes())
    (tmp_path / "out" / "shard-00001.txt").unlink()
    (tmp_path / "out" / "shard-00001.txt").symlink_to(target)
    (tmp_path / "out" / "shard-00005.txt").symlink_to(tmp_path / "nowhere")  # dangling, no record
    sl = ShardLog(tmp_path / "out", "a", ext=".txt")
    assert sorted(sl.open()) == [0, 2]
    assert "shard-00001.txt (the shard is a symbolic link)" in sl.removed
    assert "shard-00005.txt (no commit record" in " ".join(sl.removed)
    assert target.read_bytes() == b"shard 1"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "shard-00000.json", "shard-00000.txt", "shard-00002.json", "shard-00002.txt"]


def test_an_output_folder_that_is_a_file_is_a_one_line_error(tmp_path):
    from pipeline.errors import StageError

    (tmp_path / "docs").write_text("a user's file")
    with pytest.raises(StageError, match="is a file, where the stage writes its output folder"):
        ShardLog(tmp_path / "docs", "a").open()
    assert (tmp_path / "docs").read_text() == "a user's file"


def test_a_record_holds_the_digest_of_its_own_fields(tmp_path):
    _three(tmp_path)
    rec = read_json(tmp_path / "shard-00001.json")
    assert rec["record_sha256"] == resume.record_digest(rec)
    assert resume.record_digest({**rec, "rows": 7}) != rec["record_sha256"]
