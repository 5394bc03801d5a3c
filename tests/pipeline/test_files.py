import errno
import os

import pytest

from pipeline import files
from pipeline.errors import StageError
from pipeline.files import DiskFullError, atomic_dir, atomic_path, available_cores, disk_full


def test_atomic_dir_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".tmp-out-999").mkdir()  # left by an interrupted run
    for version in ("old", "new"):
        with atomic_dir(out) as tmp:
            assert tmp.parent == tmp_path and not any(tmp.iterdir())
            (tmp / "a.txt").write_text(version)
            (tmp / "sub").mkdir()
            (tmp / "sub" / "b.txt").write_text(version)
        assert (out / "a.txt").read_text() == version and (out / "sub" / "b.txt").read_text() == version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_atomic_dir_leaves_the_previous_folder(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("killed")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_swap_cut_between_its_two_renames_loses_nothing(tmp_path, monkeypatch, caplog):
    """A kill after the old folder was moved out of the way and before the new one
    took its place: the next writer puts the old one back, even when it fails too."""
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
    replace = os.replace

    def killed_before_the_second_rename(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(files.os, "replace", killed_before_the_second_rename)
    with pytest.raises(KeyboardInterrupt), atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
    monkeypatch.setattr(files.os, "replace", replace)
    assert [p.name for p in tmp_path.iterdir()] == [f".old-out-{os.getpid()}"]
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError), atomic_dir(out):
        raise RuntimeError("the next writer fails too")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert f"{out} was missing: an earlier replacement of it was interrupted" in caplog.text


def test_a_swapped_out_copy_is_dropped_once_the_swap_completed(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
    (tmp_path / ".old-out-123").mkdir()  # killed after the second rename, before the copy was removed
    assert files.restore_swapped_out(out) is None
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "a.txt").read_text() == "newer"


def test_available_cores_honours_the_affinity_mask(monkeypatch):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    monkeypatch.setattr(files.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(files.os, "cpu_count", lambda: 64)
    assert available_cores() == 1


def write_dir(path, fail, text="half"):
    with atomic_dir(path) as tmp:
        (tmp / "a.txt").write_text(text)
        fail()


def write_file(path, fail, text="half"):
    with atomic_path(path) as tmp:
        tmp.write_text(text)
        fail()


def enospc():
    raise OSError(errno.ENOSPC, "No space left on device")


def torch_save_on_a_full_disk():  # torch.save passes no errno on
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 433472 vs 433360")


@pytest.mark.parametrize("write", [write_dir, write_file])
@pytest.mark.parametrize("fail, free", [(enospc, 10**9), (torch_save_on_a_full_disk, 4096)])
def test_a_write_that_does_not_fit_is_one_line_naming_the_path_and_leaves_the_old_one(
        tmp_path, monkeypatch, write, fail, free):
    out = tmp_path / "out"
    write(out, lambda: None, "old")
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(files, "free_bytes", lambda path: free)
    with pytest.raises(DiskFullError) as err:
        write(out, fail)
    size = "1.0 GB" if free == 10**9 else "4 kB"
    assert str(err.value) == (f"no space left on the device writing {out} ({size} free on "
                              f"{files.mount_point(out)}); free some space and run the stage again")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary left
    assert ((out / "a.txt") if out.is_dir() else out).read_text() == "old"


@pytest.mark.parametrize("write", [write_dir, write_file])
def test_other_failures_of_a_write_keep_their_own_exception(tmp_path, monkeypatch, write):
    monkeypatch.setattr(files, "free_bytes", lambda path: 10**9)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # with room to spare, not a full disk
        write(tmp_path / "out", torch_save_on_a_full_disk)

    class BadInput(StageError):
        pass

    def bad_input():
        raise BadInput("document 3 is unreadable")

    monkeypatch.setattr(files, "free_bytes", lambda path: 0)
    with pytest.raises(BadInput):  # a stage's own error says what went wrong, even on a full disk
        write(tmp_path / "out", bad_input)


def test_disk_full_finds_enospc_among_the_causes_and_names_the_file(monkeypatch):
    monkeypatch.setattr(files, "free_bytes", lambda path: 2_500_000)
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "data/x.jsonl")
        except OSError as e:
            raise RuntimeError("writing the quarantine failed") from e
    except RuntimeError as e:
        err = disk_full(e)
    assert isinstance(err, DiskFullError) and str(err).startswith(
        "no space left on the device writing data/x.jsonl (2.5 MB free on ")
    assert disk_full(OSError(errno.ENOSPC, "No space left on device")).args == (
        "no space left on the device; free some space and run the stage again",)
    assert disk_full(OSError(errno.EACCES, "Permission denied", "data/x.jsonl")) is None
    assert disk_full(ValueError("a bug")) is None


def test_atomic_dir_over_a_link_to_a_folder_replaces_the_link_and_leaves_its_target(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "kept.txt").write_text("kept")
    (tmp_path / "out").symlink_to(tmp_path / "target")
    with atomic_dir(tmp_path / "out") as d:
        (d / "new.txt").write_text("new")
    assert not (tmp_path / "out").is_symlink() and [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]
    assert (tmp_path / "target" / "kept.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "target"]


def test_an_upper_case_scheme_of_a_readable_store_is_read():
    assert files.refuse_url("S3://bucket/x.jsonl", readable=("s3",)) == "S3://bucket/x.jsonl"
    with pytest.raises(ValueError, match=r"a URL \(HTTPS://\)"):
        files.refuse_url("HTTPS://example.org/x.jsonl", readable=("s3",))


def test_a_refusal_is_one_line_only_where_the_os_names_the_path():
    assert str(files.expected_failure(PermissionError(errno.EACCES, "Permission denied", "/data/x"))) == (
        "permission denied: /data/x (EACCES)")
    assert files.expected_failure(PermissionError(errno.EACCES, "Permission denied")) is None


def test_a_full_disk_is_found_where_it_was_being_handled_too():
    """An ENOSPC that another error was raised while handling (a writer's
    cleanup failing after the write did) is still a full disk."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/data/shard")
        except OSError:
            raise RuntimeError("the writer's cleanup failed")
    except RuntimeError as e:
        err = e
    assert str(disk_full(err)).startswith("no space left on the device writing /data/shard")
    assert files.out_of_space(DiskFullError("already said"))


def test_write_json_writes_numpy_scalars_and_paths_as_plain_values(tmp_path):
    import numpy as np
    from pathlib import Path

    files.write_json(tmp_path / "m.json", {"loss": np.float32(1.5), "n": np.int64(3), "dir": Path("data/x")})
    assert files.read_json(tmp_path / "m.json") == {"loss": 1.5, "n": 3, "dir": "data/x"}


def test_source_digest_changes_when_a_file_is_renamed(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    monkeypatch.setitem(sys.modules, "pipeline", SimpleNamespace(__file__=str(tmp_path / "pkg" / "__init__.py")))
    before = files.source_digest()
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert files.source_digest() != before


@pytest.mark.parametrize("data", [b"{bad", b'{"a": 1', b"\xff\xfe{}"], ids=["syntax", "cut-short", "not-utf-8"])
def test_a_json_file_that_does_not_parse_is_one_line_naming_it(tmp_path, data):
    """A damaged manifest, report or metrics file ended the stage reading it in json's traceback."""
    (tmp_path / "report.json").write_bytes(data)
    with pytest.raises(files.DamagedFileError, match=r"^\S*report.json is damaged: not valid JSON \(.+\); run the "
                                                    r"stage that writes it again$") as err:
        files.read_stage_json(tmp_path / "report.json")
    assert isinstance(err.value, StageError) and isinstance(err.value, ValueError)  # callers that skip one still do


def test_broken_links_names_only_the_links_to_nothing(tmp_path):
    (tmp_path / "real.bin").write_bytes(b"x")
    (tmp_path / "good.bin").symlink_to(tmp_path / "real.bin")
    (tmp_path / "gone.bin").symlink_to(tmp_path / "missing.bin")
    said = files.broken_links(tmp_path)
    assert said.startswith(f"gone.bin is a link to nothing (gone.bin -> {tmp_path}/missing.bin)"), said
    assert files.broken_links(tmp_path / "real.bin") is None


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_writes_give_the_mode_open_would_by_the_umask(tmp_path, umask):
    """mkstemp makes its file owner-only, and safetensors writes its own anew the
    same way: the stages' outputs (shards, manifests, checkpoints) take the mode
    every other file does, so a team that shares a folder can read them."""
    import stat

    import torch
    from safetensors.torch import save_file

    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    old = os.umask(umask)
    try:
        files.write_json(tmp_path / "a.json", {"a": 1})
        with atomic_path(tmp_path / "b.safetensors") as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp))
        with atomic_dir(tmp_path / "ckpt") as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "meta.json").write_text("{}")
        opened = tmp_path / "plain.txt"
        opened.write_text("x")
    finally:
        os.umask(old)
    assert mode(opened) == 0o666 & ~umask
    assert {mode(p) for p in (tmp_path / "a.json", tmp_path / "b.safetensors", tmp_path / "ckpt" / "model.safetensors",
                              tmp_path / "ckpt" / "meta.json")} == {mode(opened)}
