"""ingest's per-shard resume: a run stopped at any shard and rerun writes the
bytes of an uninterrupted run, without rewriting the shards it kept."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.data.docs import DocTable
from pipeline.data.ingest import IngestError, inputs_digest, resolve_sources, run_ingest
from pipeline.data.resume import MANIFEST, ShardLog
from tests.pipeline.data.test_ingest import cfg, folder_bytes, read_docs

ROOT = Path(__file__).resolve().parents[3]

# Small shards, so that a tiny corpus makes several, cut inside files as well as between them.
SHARDED = {"shard_bytes": 150, "row_group_docs": 3, "quarantine_per_reason": 1}


def corpus(root: Path) -> list[dict]:
    """Text files of several paragraphs, bad files spread among them (each
    reason more than once, in different shards), records with bad lines, and
    one file larger than the workers take (streamed by the stage)."""
    d = root / "corpus"
    d.mkdir(parents=True)
    for i in range(10):
        (d / f"t{i:02d}.txt").write_text("".join(f"file {i} paragraph {j} of some text\n\n" for j in range(4)))
    for i in (2, 6):
        (d / f"t{i:02d}-empty.txt").write_bytes(b"")
        (d / f"t{i:02d}-latin1.txt").write_bytes(f"caf\xe9 {i}".encode("latin-1"))
    (d / "t05-big.txt").write_text("".join(f"big paragraph {j}\n\n" for j in range(60)))
    (d / "rows.jsonl").write_text('{"text": "r1"}\n{"oops\n{"text": 3}\n{"text": "r2"}\n{"text": "r3"}\n')
    return [{"path": str(d / "*.txt"), "split_by": "paragraph"}, {"path": str(d / "rows.jsonl")}]


def run(out: Path, sources, **kw) -> dict:
    params = {**SHARDED, "sources": sources, **kw}
    params.setdefault("executor", {"num_workers": 1})
    return run_ingest(cfg(**params), out / "docs", out / "q.jsonl", out / "report.json")


def everything(out: Path) -> dict[str, bytes]:
    """Every file the stage wrote: shards, records, manifest, quarantine, report."""
    return {**folder_bytes(out / "docs"), **{f: (out / f).read_bytes() for f in ("q.jsonl", "report.json")}}


def stamps(out: Path) -> dict[str, tuple[int, int]]:
    """Each shard file's inode and modification time: a rewritten file changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / "docs").glob("shard-*"))}


def same_but_resumed(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "shards_resumed"} == {k: v for k, v in b.items() if k != "shards_resumed"}


def stop_at_shard(monkeypatch, k: int) -> None:
    """Make the run fail while committing shard ``k`` (shards 0..k-1 are committed)."""
    seal = ShardLog.seal

    def failing(self, i, fields):
        if i == k:
            raise KeyboardInterrupt(f"stopped at shard {k}")
        return seal(self, i, fields)

    monkeypatch.setattr(ShardLog, "seal", failing)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run, uncapped and capped, of one corpus."""
    root = tmp_path_factory.mktemp("resume")
    sources = corpus(root)
    runs = {}
    for name, kw in {"all": {}, "capped": {"max_bytes": 700}}.items():
        metrics = run(root / f"ref-{name}", sources, **kw)
        runs[name] = (metrics, everything(root / f"ref-{name}"))
    metrics, _ = runs["all"]
    assert metrics["shards"] >= 6 and metrics["skipped"] >= 6  # several shards, skips among them
    capped, _ = runs["capped"]
    assert 3 < capped["shards"] < metrics["shards"]  # the cap falls after the shards stopped at below
    assert json.loads(runs["capped"][1]["report.json"])["capped"] is True
    return root, sources, runs


@pytest.mark.parametrize("name", ["all", "capped"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_run_stopped_after_k_shards_resumes_to_the_same_bytes(reference, tmp_path, monkeypatch, caplog, name, k):
    root, sources, runs = reference
    kw = {"max_bytes": 700} if name == "capped" else {}
    with monkeypatch.context() as m:
        stop_at_shard(m, k)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, sources, **kw)
    assert not (tmp_path / "docs" / MANIFEST).exists()
    kept = {n: v for n, v in stamps(tmp_path).items() if int(n[6:11]) < k}
    assert len(kept) == 2 * k  # k shards and their records; shard k's file was left without one
    assert (tmp_path / "docs" / f"shard-{k:05d}.parquet").exists()
    assert not (tmp_path / "docs" / f"shard-{k:05d}.json").exists()
    caplog.set_level(logging.INFO, "pipeline.data")
    metrics = run(tmp_path, sources, **kw)
    assert everything(tmp_path) == runs[name][1]
    assert same_but_resumed(metrics, runs[name][0]) and metrics["shards_resumed"] == k
    after = stamps(tmp_path)
    assert {n: after[n] for n in kept} == kept  # the committed shards were not rewritten
    assert f"resumed: {k} of {metrics['shards']} shards kept from an earlier run" in caplog.text


def test_the_executor_is_not_part_of_the_fingerprint(reference, tmp_path, monkeypatch):
    """Stopped under one process, resumed under two workers that take only small
    files whole: the shards are kept, and the bytes are those of one process."""
    root, sources, runs = reference
    with monkeypatch.context() as m:
        stop_at_shard(m, 2)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, sources)
    metrics = run(tmp_path, sources, executor={"num_workers": 2}, worker_file_bytes=200)
    assert metrics["shards_resumed"] == 2
    assert everything(tmp_path) == runs["all"][1]


@pytest.mark.parametrize("change", ["param", "input"])
def test_other_params_or_input_make_the_shards_stale(tmp_path, caplog, change):
    sources = corpus(tmp_path / "in")
    run(tmp_path / "out", sources)
    old = stamps(tmp_path / "out")
    if change == "param":
        kw = {"shard_bytes": 400}
    else:
        kw = {}
        (tmp_path / "in" / "corpus" / "t01.txt").write_text("rewritten paragraph\n\nand another\n")
    caplog.set_level(logging.WARNING, "pipeline.data.resume")
    metrics = run(tmp_path / "out", sources, **kw)
    assert metrics["shards_resumed"] == 0
    removed = [r.getMessage() for r in caplog.records if "another fingerprint" in r.getMessage()]
    assert len(removed) == 1 and f"removed {len(old)} file(s)" in removed[0]  # each shard and record, one line
    fresh = run(tmp_path / "fresh", sources, **kw)
    assert everything(tmp_path / "out") == everything(tmp_path / "fresh") and metrics == fresh
    assert read_docs(tmp_path / "out" / "docs").num_rows == fresh["docs"]


def test_a_change_inside_a_saved_dataset_folder_changes_the_inputs(tmp_path):
    """A save_to_disk folder is read whole, so each of its files is part of what a rerun compares."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "state.json").write_text("{}")
    (ds / "data-00000-of-00001.arrow").write_bytes(b"rows")
    files = resolve_sources(cfg(sources=[{"path": str(ds)}]))
    assert [f.format for f in files] == ["hf"]
    before = inputs_digest(files)
    (ds / "data-00000-of-00001.arrow").write_bytes(b"other rows")
    assert inputs_digest(files) != before


def test_a_shard_ends_before_the_document_that_finds_it_holding_shard_bytes(tmp_path):
    (tmp_path / "p.txt").write_text("".join(f"paragraph{i}\n\n" for i in range(6)))  # 10 bytes each
    metrics = run_ingest(cfg(sources=[{"path": str(tmp_path / "p.txt"), "split_by": "paragraph"}], shard_bytes=20),
                         tmp_path / "docs", tmp_path / "q.jsonl")
    assert (metrics["docs"], metrics["shards"]) == (6, 3)
    assert [t.num_rows for t in map(pq.read_table, DocTable(tmp_path / "docs", IngestError).files)] == [2, 2, 2]


def test_a_damaged_shard_and_an_uncommitted_one_are_redone_alone(reference, tmp_path, caplog):
    root, sources, runs = reference
    run(tmp_path, sources)
    n = runs["all"][0]["shards"]
    before = stamps(tmp_path)
    damaged, uncommitted = tmp_path / "docs" / "shard-00001.parquet", tmp_path / "docs" / "shard-00003.json"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    uncommitted.unlink()
    caplog.set_level(logging.WARNING, "pipeline.data.resume")
    metrics = run(tmp_path, sources)
    assert everything(tmp_path) == runs["all"][1]
    assert same_but_resumed(metrics, runs["all"][0]) and metrics["shards_resumed"] == n - 2
    after = stamps(tmp_path)
    redone = sorted(name for name in before if after[name] != before[name])
    assert redone == ["shard-00001.json", "shard-00001.parquet", "shard-00003.json", "shard-00003.parquet"]
    assert "sha256 does not match its record: shard-00001.parquet, shard-00001.json" in caplog.text
    assert "as `dvc exp run --temp` and `dvc checkout` make; it is written again): shard-00003.parquet" in caplog.text


def test_workers_and_shards_give_the_bytes_of_one_process(reference, tmp_path):
    root, sources, runs = reference
    for name, kw in {"all": {}, "capped": {"max_bytes": 700}}.items():
        run(tmp_path / name, sources, executor={"num_workers": 2}, worker_file_bytes=200, **kw)
        assert everything(tmp_path / name) == runs[name][1]


# --- SIGKILL on the stage's process group, then a rerun --------------------------------------------

# The stage, paced: a pause after each shard's commit so that a kill lands mid-stage
# on a tiny corpus. The stage's code is untouched.
PACED_STAGE = """
import runpy, time
from pipeline.data import resume
seal = resume.ShardLog.seal
def paced(self, k, fields):
    rec = seal(self, k, fields)
    time.sleep(0.3)
    return rec
resume.ShardLog.seal = paced
runpy.run_module("stages.ingest", run_name="__main__")
"""


def stage_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_PROGRESS": "0", "PIPELINE_TRACKING": "0",
            "RAY_AUTH_MODE": "disabled"}


def group_alive(pgid: int) -> list[str]:
    """The live (not zombie) processes of a process group."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(stat.parent.name)
    return alive


def kill_and_rerun(tmp_path: Path, executor: dict, timeout: float = 120) -> None:
    """Run the stage in its own process group, SIGKILL the group once a shard is
    committed and before the manifest is written, check that nothing of it is
    left, rerun it: the output is the bytes of an uninterrupted run."""
    sources = corpus(tmp_path)
    params = {**SHARDED, "sources": sources, "worker_file_bytes": 200, "executor": executor}
    ref = run(tmp_path / "ref", sources)
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text(yaml.safe_dump({"ingest": params}))
    docs = project / "data" / "ingest" / "docs"
    proc = subprocess.Popen([sys.executable, "-c", PACED_STAGE], cwd=project, env=stage_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        t0 = time.time()
        while not list(docs.glob("shard-*.json")) and proc.poll() is None and time.time() - t0 < timeout:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the stage and its workers
    proc.wait()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, f"the stage ended before the kill: {err[-2000:]}"
    committed = list(docs.glob("shard-*.json"))
    assert committed and not (docs / MANIFEST).exists(), "the kill did not land mid-stage"
    t0 = time.time()
    while group_alive(proc.pid) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert group_alive(proc.pid) == [], "a process of the killed stage is still running"
    r = subprocess.run([sys.executable, "-m", "stages.ingest"], cwd=project, env=stage_env(),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((project / "metrics" / "ingest.json").read_text())
    assert metrics["shards_resumed"] >= len(committed) and f"resumed: {metrics['shards_resumed']} of" in r.stderr
    metrics.pop("seconds")
    assert same_but_resumed(metrics, ref)
    out = project / "data" / "ingest"
    (out / "quarantine.jsonl").rename(out / "q.jsonl")  # the in-process reference's name
    assert {**folder_bytes(docs), **{f: (out / f).read_bytes() for f in ("q.jsonl", "report.json")}} == \
        everything(tmp_path / "ref")


def test_sigkill_of_the_stage_mid_way_then_rerun_gives_the_same_bytes(tmp_path):
    kill_and_rerun(tmp_path, {"num_workers": 2})


def test_a_record_edited_by_hand_is_redone_not_built_on(reference, tmp_path, caplog):
    """Shard 1's record made to end later in the input, shard 2's to hold more documents (with the record's
    digest put right): neither is replayed, and the rerun writes the bytes of an uninterrupted run."""
    from pipeline.data import resume

    root, sources, runs = reference
    run(tmp_path, sources)
    for k, edit in ((1, lambda r: {**r, "end": [r["end"][0] + 1, 0]}), (2, lambda r: {**r, "rows": r["rows"] + 1})):
        path = tmp_path / "docs" / f"shard-{k:05d}.json"
        rec = edit(json.loads(path.read_text()))
        if k == 2:
            rec["record_sha256"] = resume.record_digest(rec)
        path.write_text(json.dumps(rec))
    caplog.set_level(logging.WARNING, "pipeline.data.resume")
    metrics = run(tmp_path, sources)
    assert everything(tmp_path) == runs["all"][1]
    assert metrics["shards_resumed"] == runs["all"][0]["shards"] - 2
    assert "its record was edited or written by an older version (its fields do not match its digest): " \
           "shard-00001.parquet, shard-00001.json" in caplog.text
    assert "its row count does not match its record: shard-00002.parquet, shard-00002.json" in caplog.text
