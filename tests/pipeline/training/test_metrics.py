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


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_the_curve_beside_the_checkpoints_is_a_new_file_never_one_dvc_linked_from_its_cache(tmp_path, link):
    """With DVC's cache.type hardlink or symlink, the run folder's files are links
    to DVC's cache; a run resumed outside `dvc repro` (which copies them first)
    must not write through a link and spoil the cached version."""
    from pipeline.training.metrics import CsvLog

    cached = tmp_path / "cache-object"
    cached.write_text("step,loss\n1,5.0\n2,4.0\n3,3.0\n")
    history = tmp_path / "models" / "curve.csv"
    history.parent.mkdir()
    history.hardlink_to(cached) if link == "hardlink" else history.symlink_to(cached)
    log = CsvLog(tmp_path / "plots.csv", resume_step=2, history=history)
    log.write({"step": 3, "loss": 2.5})
    log.close()
    assert cached.read_text() == "step,loss\n1,5.0\n2,4.0\n3,3.0\n"
    assert not history.is_symlink() and history.stat().st_nlink == 1
    assert [line.split(",")[:2] for line in history.read_text().splitlines()] == [
        ["step", "loss"], ["1", "5.0"], ["2", "4.0"], ["3", "2.5"]]


def test_damaged_rows_of_the_curve_are_left_out_with_a_warning(tmp_path, caplog):
    """A curve.csv cut mid-row or edited by hand: a resumed run's plots get its
    whole rows only, and the log names the steps left out."""
    from pipeline.training.metrics import CsvLog

    history = tmp_path / "models" / "curve.csv"
    history.parent.mkdir()
    history.write_text("step,loss,lr\n1,5.0,0.1\n2,4.0,0.1\n3,3.5\n4,oops,0.1\n5,3.0,0.1\n")
    with caplog.at_level("WARNING", logger="pipeline.training"):
        log = CsvLog(tmp_path / "plots.csv", resume_step=5, history=history)
    log.close()
    assert [line.split(",")[:2] for line in (tmp_path / "plots.csv").read_text().splitlines()] == [
        ["step", "loss"], ["1", "5.0"], ["2", "4.0"], ["5", "3.0"]]
    assert "2 damaged row(s) left out of the curve (steps 3, 4)" in caplog.text


def test_peak_memory_is_reduced_over_ranks_on_the_ranks_device(tmp_path, monkeypatch):
    """NCCL reduces CUDA tensors only ("No backend type associated with device type
    cpu"): the peak-memory all-reduce of every report step must be on the rank's
    device. "meta" stands in for the GPU here."""
    from pipeline.training import distributed

    d = Dist(1, 1, 2, torch.device("meta"), "nccl")
    seen = []

    def nccl_max(t, group):
        seen.append(t.device)
        if t.device != group.device:
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        return torch.tensor(123.0)

    monkeypatch.setattr(distributed, "all_reduce_max", nccl_max)
    logger = MetricsLogger("pretrain", LoggingSection(peak_flops=1e9, every=1, track=False), d,
                           tmp_path / "curve.csv", tmp_path / "history.csv", precision_dtype=torch.bfloat16,
                           nnodes=1, tokens_per_step=64, flops_per_token=1.0, max_steps=2)
    with logger.start(0):
        logger.log(1, {"loss": 5.0, "lr": 1e-3})
    assert seen == [torch.device("meta")]
