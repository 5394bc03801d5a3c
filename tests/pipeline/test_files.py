import os

import pytest

from pipeline import files
from pipeline.files import atomic_dir, available_cores


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


def test_available_cores_honours_the_affinity_mask(monkeypatch):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    monkeypatch.setattr(files.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(files.os, "cpu_count", lambda: 64)
    assert available_cores() == 1
