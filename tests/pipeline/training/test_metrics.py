"""pipeline/training/metrics.py: the run's reporting."""

import mlflow
import pytest
import torch

from pipeline.training.config import LoggingSection
from pipeline.training.distributed import Dist
from pipeline.training.metrics import MetricsLogger


@pytest.mark.parametrize("raised, status", [(None, "FINISHED"), (RuntimeError, "FAILED"),
                                            (KeyboardInterrupt, "KILLED")])
def test_the_mlflow_run_ends_as_the_training_loop_did(tmp_path, monkeypatch, raised, status):
    """A loop that raises (a crash, a peer that died, a Ctrl-C) must not leave
    its run FINISHED in MLflow."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("PIPELINE_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "0")
    logger = MetricsLogger("pretrain", LoggingSection(peak_flops=1e9), Dist(0, 0, 1, torch.device("cpu"), None),
                           tmp_path / "curve.csv", tmp_path / "history.csv", precision_dtype=torch.float32, nnodes=1,
                           tokens_per_step=64, flops_per_token=1.0, max_steps=2)
    try:
        with logger.start(0):
            if raised is not None:
                raise raised("the loop stopped")
    except (RuntimeError, KeyboardInterrupt):
        pass
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in runs] == [("pretrain", status)]
