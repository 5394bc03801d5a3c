"""The clean stage and the executor under a real local Ray instance (2 CPUs,
one for this module, shut down at the end). Marked slow: Ray takes seconds to start."""

import json
import os
import socket
import subprocess
import sys

import pytest

from pipeline.data import dedup
from pipeline.data import executor as executor_module
from pipeline.data.executor import ExecutorConfig, ExecutorError, open_executor
from tests.conftest import ROOT
from tests.pipeline.data.test_clean import MIXED, code, files, prose, report, run, write_docs
from tests.pipeline.data.test_dedup import PLANTED
from tests.pipeline.data.test_executor import BadInput, dies, dies_once, fails, init, tagged, timed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_instance")]

ray = pytest.importorskip("ray")


def outputs(d, texts, **kw):
    d.mkdir()
    metrics, docs, quarantine = run(d, texts, **kw)
    workers = metrics.pop("workers")
    metrics.pop("mb_per_s")
    return workers, (metrics, files(d / "out"))


def content(result):
    """(metrics, files) without the docs folder's records and manifest, which name the fingerprint."""
    metrics, files_ = result
    return metrics, {f: b for f, b in files_.items() if not f.startswith("docs/") or f.endswith(".parquet")}


def test_ray_map_keeps_order_and_runs_the_initializer_in_ray_workers():
    with open_executor(ExecutorConfig(kind="ray", num_workers=2), init, ("cfg",)) as ex:
        assert ex.kind == "ray" and ex.workers == 2
        out = list(ex.map(tagged, [(x, 0.2 if x < 2 else 0.0) for x in range(8)]))
    assert [(tag, sq) for tag, sq, _ in out] == [("cfg", x * x) for x in range(8)]
    assert os.getpid() not in {pid for _, _, pid in out}
    assert ray.is_initialized()  # an instance the executor did not start is left running


@pytest.mark.parametrize("workers", [1, 2])
def test_a_cluster_with_more_cpus_runs_no_more_tasks_at_once_than_num_workers(workers):
    """The module's instance has 2 CPUs; num_workers bounds the tasks running at
    once, whatever the window of tasks taken ahead."""
    with open_executor(ExecutorConfig(kind="ray", num_workers=workers)) as ex:
        spans = list(ex.map(timed, [(x, 0.3) for x in range(6)], window=6))
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most == workers


def test_clean_under_ray_equals_local_for_any_worker_count_and_dedup_method(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "MERGE_RUNS", 2)  # sharded: Ray tasks merge the runs too
    merged, merge = [], dedup.merge
    monkeypatch.setattr(dedup, "merge", lambda work, runs, m: merged.append(len(runs)) or merge(work, runs, m))
    texts = MIXED * 2 + PLANTED + [prose(150, seed=s) for s in range(30, 36)] + [code(s) for s in range(40, 44)]
    small = {"batch_docs": 3, "shard_bytes": 4000, "num_workers": None}  # several shards
    _, local = outputs(tmp_path / "local", texts, executor={"kind": "local", "num_workers": 1}, **small)
    assert local[0]["shards"] > 2
    for name, kw in {
        "ray1": {"executor": {"kind": "ray", "num_workers": 1}},
        "ray2": {"executor": {"kind": "ray", "num_workers": 2}},
        "ray2-sharded": {"executor": {"kind": "ray", "num_workers": 2},
                         "dedup": {"method": "sharded", "partition_docs": 4}},
    }.items():
        workers, got = outputs(tmp_path / name, texts, **small, **kw)
        assert workers == kw["executor"]["num_workers"]
        if "dedup" in kw:  # another fingerprint, so other records: the shards' bytes and the rest are the same
            assert content(got) == content(local), name
            assert merged and merged[-1] > 2, merged
        else:
            assert got == local, name
    metrics, files_ = local
    quarantine, rep = files_["quarantine.jsonl"], json.loads(files_["report.json"])
    # The accounting identity, and every reason's quarantine samples, as locally.
    assert rep["docs_in"] == len(texts) == metrics["docs"] + sum(rep["dropped"].values())
    reasons = {json.loads(line)["reason"] for line in quarantine.decode().splitlines()}
    assert reasons == {k for k, v in rep["dropped"].items() if v} >= {"exact_duplicate", "near_duplicate",
                                                                      "too_short", "c4_lorem_ipsum"}


def test_bad_documents_under_ray_are_counted_skips(tmp_path):
    texts = [code(1), None, "", "\x00\x01", "lorem ipsum", code(2)]
    inp = write_docs(tmp_path / "in.parquet", texts)
    assert inp.exists()
    metrics, docs, quarantine = run(tmp_path, texts, batch_docs=2, num_workers=None,
                                     executor={"kind": "ray", "num_workers": 2})
    assert [d["id"] for d in docs] == ["id000", "id005"]
    assert report(tmp_path)["dropped"]["too_short"] == 3 and len(quarantine) == 4


def test_worker_errors_under_ray_are_one_line(capfd):
    cfg = ExecutorConfig(kind="ray", num_workers=2)
    with open_executor(cfg) as ex, pytest.raises(BadInput, match="^document 2 is unreadable$"):
        list(ex.map(fails, [(x,) for x in range(5)]))
    with open_executor(cfg, desc="clean") as ex, pytest.raises(ExecutorError) as err:
        list(ex.map(fails, [(x,) for x in (0, 1, 3)]))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("clean: task 2 failed in a worker: ValueError: a bug")
    assert "in fails" in msg
    out, errs = capfd.readouterr()
    assert "Traceback" not in out + errs


def test_a_ray_worker_with_other_code_than_the_stage_stops_it_in_one_line(monkeypatch, capfd):
    """A node with another version of the project, or of a library that a
    task's result depends on, installed: one line that names what differs,
    before the initializer or any task runs there (the driver's identity is
    altered here; the workers compute their own)."""
    real = executor_module.code_identity()
    assert set(real) == {"pipeline source", *executor_module.RESULT_LIBRARIES}
    monkeypatch.setattr(executor_module, "code_identity",
                        lambda: {**real, "pipeline source": "0" * 16, "tokenizers": "0.0.1"})
    with open_executor(ExecutorConfig(kind="ray", num_workers=2), init, ("cfg",), desc="clean") as ex, \
            pytest.raises(ExecutorError) as err:
        list(ex.map(tagged, [(x,) for x in range(4)]))
    assert str(err.value) == (
        f"clean: the Ray worker on {socket.gethostname()} runs other code than this stage (pipeline source "
        f"{real['pipeline source']} there, {'0' * 16} here; tokenizers {real['tokenizers']} there, 0.0.1 here; "
        f"its pipeline package is {ROOT / 'pipeline'}): install this checkout and its dependencies on every node "
        "(pip install '.[ray]') and restart its Ray")
    out, errs = capfd.readouterr()
    assert "Traceback" not in out + errs
    monkeypatch.undo()
    with open_executor(ExecutorConfig(kind="ray", num_workers=2), init, ("cfg",)) as ex:
        assert [sq for _, sq, _ in ex.map(tagged, [(x,) for x in range(4)])] == [0, 1, 4, 9]


def test_a_task_whose_ray_worker_died_runs_again(tmp_path):
    """Tasks are pure, so one lost with its worker process (or node) runs again."""
    with open_executor(ExecutorConfig(kind="ray", num_workers=2)) as ex:
        assert list(ex.map(dies_once, [(x, str(tmp_path)) for x in range(4)])) == [0, 1, 2, 3]
    assert os.listdir(tmp_path) == ["died-1"]


def test_a_ray_worker_that_dies_is_one_line(capfd):
    """Ray's worker process exits mid-task every time (a crash on this input, the
    OOM killer): after TASK_RETRIES more tries the stage stops in one line."""
    with open_executor(ExecutorConfig(kind="ray", num_workers=2), desc="clean") as ex, \
            pytest.raises(ExecutorError) as err:
        list(ex.map(dies, [(x,) for x in range(4)]))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("clean: task 1 was lost: WorkerCrashedError: "), msg
    out, errs = capfd.readouterr()
    assert "Traceback" not in out + errs


def test_the_stage_under_ray_runs_quietly_with_bad_documents(tmp_path):
    (tmp_path / "params.yaml").write_text("clean:\n  executor: {kind: ray, num_workers: 1}\n")
    (tmp_path / "data" / "ingest").mkdir(parents=True)
    # one Parquet file where ingest writes its documents folder: the stage reads either
    write_docs(tmp_path / "data" / "ingest" / "docs", [code(1), None, "lorem ipsum", code(1), code(2)])
    # The stage as DVC runs it, its one task on Ray (not in the stage's process while the instance starts).
    script = ("import runpy\nfrom tests.pipeline.data.ray_tasks import ray_only\n"
              f"ray_only({str(tmp_path / 'connected')!r})\n"
              "runpy.run_module('stages.clean', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_PROGRESS": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "connected").exists()
    assert "Traceback" not in proc.stderr and "ray" not in proc.stdout.lower()
    metrics = json.loads((tmp_path / "metrics" / "clean.json").read_text())
    assert (metrics["docs"], metrics["dropped"], metrics["workers"]) == (2, 3, 1)


def test_an_address_joins_that_cluster_and_uses_its_cpus():
    address = ray.get_runtime_context().gcs_address  # this module's instance, as a cluster to join
    code = ("import ray\n"
            "from pipeline.data.executor import ExecutorConfig, open_executor\n"
            "from tests.pipeline.data.test_executor import tagged\n"
            f"with open_executor(ExecutorConfig(kind='ray', address={address!r})) as ex:\n"
            "    print(ex.workers, [sq for _, sq, _ in ex.map(tagged, [(x,) for x in range(4)])])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[0] == "2 [0, 1, 4, 9]"
    assert ray.cluster_resources().get("CPU") == 2  # the cluster outlives the stage that joined it

