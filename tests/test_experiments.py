"""`dvc exp run` experiments in MLflow: each experiment (in the workspace, with
--temp, or queued) is its own parent run, with the stages it ran as children,
carrying the same lineage a flow's parent run carries, comparable side by side."""

import os
import subprocess

import pytest

from pipeline.tracking.tracker import dvc_stage_hashes
from tests.conftest import BIN, project_copy

pytestmark = pytest.mark.slow

# name: (how DVC runs it, ingest.max_bytes)
EXPERIMENTS = {"exp-a": ([], 20_000), "exp-b": (["--temp"], 60_000), "exp-c": (["--queue"], 120_000)}


def test_each_dvc_experiment_is_its_own_parent_run(tmp_path):
    root = project_copy(tmp_path / "proj", {"ingest.max_bytes": 20_000})
    uri = f"sqlite:///{root}/mlflow.db"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PIPELINE_TRACKING": "1",
           "MLFLOW_TRACKING_URI": uri, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}

    def dvc(*args):
        out = subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    for name, (mode, max_bytes) in EXPERIMENTS.items():
        dvc("exp", "run", *mode, "-n", name, "-S", f"ingest.max_bytes={max_bytes}", "clean")
    workspace_hashes = dvc_stage_hashes(root)  # exp-a ran in the workspace; the others in copies
    dvc("exp", "run", "--run-all")  # the queued one, through DVC's task queue
    # each experiment's commit carries its metrics, so dvc exp show can compare them
    import csv
    import io

    table = list(csv.DictReader(io.StringIO(dvc("exp", "show", "--no-pager", "--csv"))))
    shown = {row["Experiment"]: row for row in table if row["Experiment"]}
    assert set(shown) == set(EXPERIMENTS)

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    runs = client.search_runs([exp.experiment_id])
    parents = {r.data.tags["dvc.exp_name"]: r for r in runs if r.data.tags.get("pipeline.parent") == "true"}
    assert set(parents) == set(EXPERIMENTS)
    for name, (_, max_bytes) in EXPERIMENTS.items():
        parent = parents[name]
        children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
        assert sorted(children) == ["clean", "ingest"], name
        assert parent.data.params["ingest.max_bytes"] == str(max_bytes)  # params compare at the top level
        for stage, child in children.items():
            assert child.data.tags["dvc.exp_name"] == name
            # the parent carries each stage's metrics as <stage>.<metric> and its dvc.lock hash
            assert parent.data.tags[f"dvc.stage_hash.{stage}"] == child.data.tags["dvc.stage_hash"]
            for key in ("docs", "bytes") if stage == "ingest" else ("docs", "dropped"):
                assert parent.data.metrics[f"{stage}.{key}"] == child.data.metrics[key], (name, stage, key)
        # dvc exp show names a file's first column "metrics/<stage>.json:<key>", the rest "<key>"
        kept = next(v for k, v in shown[name].items() if k.split(":")[-1] == "kept_frac")
        assert float(kept) == parent.data.metrics["clean.kept_frac"]
    assert {f"dvc.stage_hash.{s}": h for s, h in workspace_hashes.items()} == {
        k: v for k, v in parents["exp-a"].data.tags.items() if k.startswith("dvc.stage_hash.")}
    sizes = [parents[n].data.metrics["ingest.bytes"] for n in EXPERIMENTS]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
