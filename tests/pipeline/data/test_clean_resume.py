"""Per-shard resume of the clean stage: a run interrupted after shard k and rerun
gives the bytes of an uninterrupted run, without rewriting the committed shards."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from pipeline.data import clean
from pipeline.data.clean import run_clean
from tests.conftest import ROOT
from tests.pipeline.data.test_clean import cfg, files, write_docs
from tests.pipeline.data.test_dedup import PLANTED

# batch_docs 2 and a 1-byte shard size: one shard per batch, 7 shards. Across
# shard boundaries: 3 is an exact duplicate of 1, 2 a near duplicate of 0, 8 an
# exact duplicate of 2 (a near duplicate, so in no output shard), 9 and 12 near
# duplicates of kept documents of earlier shards; shard 4 (8, 9) keeps nothing.
SMALL = {"batch_docs": 2, "shard_bytes": 1}


def run(d, inp, **kw):
    out = d / "out"
    metrics = run_clean(cfg(**{**SMALL, **kw}), inp, out / "docs", out / "quarantine.jsonl", out / "report.json")
    metrics.pop("mb_per_s")
    return metrics


def stamps(folder):
    """(inode, mtime_ns) of each committed shard file and record."""
    return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in sorted(folder.glob("shard-*"))}


@pytest.fixture
def inp(tmp_path):
    return write_docs(tmp_path / "in.parquet", PLANTED)


@pytest.fixture
def fresh(tmp_path, inp):
    """An uninterrupted run: (metrics, every output file's bytes)."""
    metrics = run(tmp_path / "fresh", inp)
    return metrics, files(tmp_path / "fresh" / "out")


def fail_at_shard(monkeypatch, k_fail):
    """Make the run raise when it starts writing shard ``k_fail``."""
    start = clean.ShardedParquetWriter.start

    def start_or_fail(self, k):
        if k == k_fail:
            raise KeyboardInterrupt(f"interrupted at shard {k}")
        start(self, k)

    monkeypatch.setattr(clean.ShardedParquetWriter, "start", start_or_fail)


def same_metrics(metrics, fresh_metrics, resumed):
    assert metrics["shards_resumed"] == resumed
    assert {**metrics, "shards_resumed": 0} == fresh_metrics


@pytest.mark.parametrize("k", [1, 3, 5])
def test_interrupted_after_shard_k_resumes_to_the_same_bytes(tmp_path, inp, fresh, monkeypatch, k):
    fresh_metrics, fresh_files = fresh
    assert fresh_metrics["shards"] == 7
    dropped = json.loads(fresh_files["report.json"])["dropped"]
    assert (dropped["exact_duplicate"], dropped["near_duplicate"]) == (2, 4)
    d = tmp_path / "resumed"
    with monkeypatch.context() as m:
        fail_at_shard(m, k)
        with pytest.raises(KeyboardInterrupt):
            run(d, inp)
    docs = d / "out" / "docs"
    before = stamps(docs)
    assert len(before) == 2 * k and not (docs / "manifest.json").exists()
    metrics = run(d, inp)
    same_metrics(metrics, fresh_metrics, resumed=k)
    assert files(d / "out") == fresh_files
    after = stamps(docs)
    assert {n: after[n] for n in before} == before  # the committed shards were not rewritten


def test_sharded_dedup_keeps_its_decisions_and_resumes_pass_2(tmp_path, inp, monkeypatch):
    sharded = {"dedup": {"method": "sharded", "partition_docs": 3}}
    fresh_metrics = run(tmp_path / "fresh", inp, **sharded)
    d = tmp_path / "resumed"
    with monkeypatch.context() as m:
        fail_at_shard(m, 3)
        with pytest.raises(KeyboardInterrupt):
            run(d, inp, **sharded)
    before = stamps(d / "out" / "docs")

    def no_pass_1(self, out):
        raise AssertionError("pass 1 ran again although its decisions were committed")

    monkeypatch.setattr(clean._Sharded, "_decide", no_pass_1)
    same_metrics(run(d, inp, **sharded), fresh_metrics, resumed=3)
    assert files(d / "out") == files(tmp_path / "fresh" / "out")
    after = stamps(d / "out" / "docs")
    assert {n: after[n] for n in before} == before


@pytest.mark.parametrize("first,changed", [
    ({}, {"near_dedup": {"threshold": 0.85}}),
    ({"quarantine_per_reason": 0}, {}),  # the old shards' records hold no samples for the quarantine
])
def test_a_param_change_removes_the_old_shards(tmp_path, inp, caplog, first, changed):
    d = tmp_path / "changed"
    run(d, inp, **first)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.resume"):
        metrics = run(d, inp, **changed)
    stale = [r.getMessage() for r in caplog.records if "made under another fingerprint" in r.getMessage()]
    assert len(stale) == 1 and "removed 14 file(s)" in stale[0]  # 7 shards and their records, in one line
    assert metrics["shards_resumed"] == 0
    assert metrics == run(tmp_path / "fresh", inp, **changed)
    assert files(d / "out") == files(tmp_path / "fresh" / "out")


def test_a_damaged_and_an_uncommitted_shard_are_redone_and_only_they(tmp_path, inp, fresh):
    fresh_metrics, fresh_files = fresh
    d = tmp_path / "damaged"
    run(d, inp)
    docs = d / "out" / "docs"
    # shard 1's documents are duplicates of shard 0's, shard 6's of shard 2's
    shard1 = docs / "shard-00001.parquet"
    data = bytearray(shard1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard1.write_bytes(bytes(data))
    (docs / "shard-00006.json").unlink()
    before = stamps(docs)
    metrics = run(d, inp)
    same_metrics(metrics, fresh_metrics, resumed=5)
    assert files(d / "out") == fresh_files
    after = stamps(docs)
    redone = {n for n in before if after.get(n) != before[n]}
    assert redone == {"shard-00001.parquet", "shard-00001.json", "shard-00006.parquet"}


KILLED_RUN = textwrap.dedent("""
    import sys, time
    from tests.pipeline.data.ray_tasks import ray_only
    from pipeline.data import resume
    from pipeline.data.clean import CleanConfig, run_clean

    seal = resume.ShardLog.seal

    def slow_seal(self, k, fields):  # time for the test to kill the run between two shards
        rec = seal(self, k, fields)
        time.sleep(0.3)
        return rec

    if __name__ == "__main__":
        if sys.argv[2] == "slow":
            resume.ShardLog.seal = slow_seal
        cfg = CleanConfig.model_validate({"batch_docs": 2, "shard_bytes": 1,
                                          "executor": {"kind": sys.argv[3], "num_workers": 2}})
        out = sys.argv[1]
        if sys.argv[3] == "ray":
            ray_only(out + "/ray-connected")
        run_clean(cfg, out + "/in.parquet", out + "/out/docs", out + "/out/quarantine.jsonl", out + "/out/report.json")
""")


def killed_and_resumed(tmp_path, executor):
    """Run the stage in its own process group, SIGKILL the group once a shard is
    committed and before the manifest exists, check that nothing of it is left,
    rerun, and compare with an uninterrupted run."""
    script = tmp_path / "run_clean.py"
    script.write_text(KILLED_RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_PROGRESS": "0"}
    for name in ("fresh", "killed"):
        (tmp_path / name).mkdir()
        write_docs(tmp_path / name / "in.parquet", PLANTED * 3)
    subprocess.run([sys.executable, str(script), str(tmp_path / "fresh"), "fast", executor], env=env, check=True)
    docs = tmp_path / "killed" / "out" / "docs"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "killed"), "slow", executor], env=env,
                            start_new_session=True)
    family: set[psutil.Process] = set()
    deadline = time.monotonic() + 120
    while not (docs / "shard-00001.json").exists():
        family |= set(psutil.Process(proc.pid).children(recursive=True))
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run ended or stalled before it committed a shard; nothing was killed")
        time.sleep(0.02)
    family |= set(psutil.Process(proc.pid).children(recursive=True))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (docs / "manifest.json").exists(), "the run finished before the kill: not killed mid-stage"
    if executor == "ray":  # the committed shards came from Ray tasks
        assert (tmp_path / "killed" / "ray-connected").exists()
    committed = sorted(docs.glob("shard-*.json"))
    assert 2 <= len(committed) < 21, committed
    assert len(family) >= (2 if executor == "local" else 1), family  # its workers were running
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, f"processes of the killed stage left running: {[p.pid for p in alive]}"
    subprocess.run([sys.executable, str(script), str(tmp_path / "killed"), "fast", executor], env=env, check=True)
    assert files(tmp_path / "killed" / "out") == files(tmp_path / "fresh" / "out")


def test_sigkill_of_the_process_group_mid_stage_then_rerun_gives_the_same_bytes(tmp_path):
    killed_and_resumed(tmp_path, "local")


@pytest.mark.slow
def test_sigkill_under_ray_then_rerun_gives_the_same_bytes(tmp_path):
    pytest.importorskip("ray")
    killed_and_resumed(tmp_path, "ray")


def test_switching_the_dedup_method_leaves_no_file_of_the_other(tmp_path, inp, fresh):
    d = tmp_path / "switched"
    run(d, inp, dedup={"method": "sharded"})
    assert (d / "out" / "docs" / "decisions-00000.u8").exists()
    run(d, inp)
    assert files(d / "out") == fresh[1]


def test_tasks_cut_by_text_size_resume_to_the_same_bytes(tmp_path, inp, monkeypatch):
    """With a 1-byte shard size each task is a shard: tasks of up to ``task_bytes``
    of text (a run of short documents is one task) give 6 shards here, and a
    run interrupted at any of them resumes to the bytes of an uninterrupted run."""
    by_size = {"batch_docs": 1000, "task_bytes": 3000}
    sizes = [len(t.encode()) for t in PLANTED]
    expected, filled = 0, 0
    for i, size in enumerate(sizes):  # a task ends at the document that brings it to task_bytes
        filled += size
        if filled >= 3000 or i == len(sizes) - 1:
            expected, filled = expected + 1, 0
    assert expected == 6
    fresh_metrics = run(tmp_path / "fresh", inp, **by_size)
    assert fresh_metrics["shards"] == expected
    for k in (1, 4):
        d = tmp_path / f"resumed-{k}"
        with monkeypatch.context() as m:
            fail_at_shard(m, k)
            with pytest.raises(KeyboardInterrupt):
                run(d, inp, **by_size)
        before = stamps(d / "out" / "docs")
        assert len(before) == 2 * k
        same_metrics(run(d, inp, **by_size), fresh_metrics, resumed=k)
        assert files(d / "out") == files(tmp_path / "fresh" / "out")
        after = stamps(d / "out" / "docs")
        assert {n: after[n] for n in before} == before


@pytest.mark.parametrize("module", ["clean", "filters", "dedup", "docs", "accounting"])
def test_an_edit_to_the_code_that_decides_makes_the_old_shards_stale(tmp_path, inp, monkeypatch, caplog, module):
    """A filter rule or a dedup step changed keeps no shard it would have decided otherwise; nor does a change
    to the ledger, whose samples each shard's record holds for the quarantine."""
    d = tmp_path / "edited"
    run(d, inp)
    mod = {"clean": clean, "filters": clean.filters_module, "dedup": clean.dedup, "docs": clean.docs_module,
           "accounting": sys.modules[clean.Ledger.__module__]}[module]
    edited = tmp_path / os.path.basename(mod.__file__)
    with open(mod.__file__) as f:
        edited.write_text(f.read() + "\n# edited\n")
    monkeypatch.setattr(mod, "__file__", str(edited))
    with caplog.at_level(logging.WARNING, logger="pipeline.data.resume"):
        metrics = run(d, inp)
    assert metrics["shards_resumed"] == 0
    assert any("made under another fingerprint" in r.getMessage() for r in caplog.records)
