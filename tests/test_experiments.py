"""`dvc exp run` experiments in MLflow: each experiment is its own parent run,
with the stages it ran as children, comparable side by side."""

import os
import subprocess

import pytest

from tests.conftest import BIN, project_copy

pytestmark = pytest.mark.slow


def test_each_dvc_experiment_is_its_own_parent_run(tmp_path):
    root = project_copy(tmp_path / "proj", {"ingest.max_bytes": 20_000})
    uri = f"sqlite:///{root}/mlflow.db"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PIPELINE_TRACKING": "1",
           "MLFLOW_TRACKING_URI": uri, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    for args in (["-n", "exp-a", "-S", "ingest.max_bytes=20000"],
                 ["--temp", "-n", "exp-b", "-S", "ingest.max_bytes=60000"]):
        out = subprocess.run([str(BIN / "dvc"), "exp", "run", *args, "ingest"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    runs = client.search_runs([exp.experiment_id])
    parents = {r.data.tags["dvc.exp_name"]: r for r in runs if r.data.tags.get("pipeline.parent") == "true"}
    assert set(parents) == {"exp-a", "exp-b"}
    for name, max_bytes in (("exp-a", "20000"), ("exp-b", "60000")):
        parent = parents[name]
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert [c.info.run_name for c in children] == ["ingest"]
        assert children[0].data.tags["dvc.exp_name"] == name
        assert parent.data.params["ingest.max_bytes"] == max_bytes  # params compare at the top level
        assert parent.data.metrics["ingest.docs"] == children[0].data.metrics["docs"]
    assert parents["exp-a"].data.metrics["ingest.bytes"] < parents["exp-b"].data.metrics["ingest.bytes"]
