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


class Clock:
    """A perf_counter that moves only when the test moves it."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def perf_counter(self) -> float:
        return self.now


def logger_on(tmp_path, device="cpu", world_size=1, nnodes=1, every=10):
    return MetricsLogger("pretrain", LoggingSection(every=every, peak_flops=1e9, track=False),
                         Dist(0, 0, world_size, torch.device(device), None), tmp_path / "curve.csv",
                         tmp_path / "history.csv", precision_dtype=torch.float32, nnodes=nnodes,
                         tokens_per_step=64, flops_per_token=1000.0, max_steps=4)


def test_throughput_and_mfu_count_the_steps_of_each_report_window_less_paused_time(tmp_path, monkeypatch):
    from pipeline.training import metrics

    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)
    logger = logger_on(tmp_path, nnodes=2, every=2)
    with logger.start(0):
        clock.now = 101.0
        logger.log(1, {"loss": 3.0, "lr": 0.1})
        clock.now = 104.0
        logger.log(2, {"loss": 2.0, "lr": 0.1})  # 2 steps × 64 tokens in 4 s
        first = (logger.tokens_per_s, logger.mfu)
        with logger.paused():
            clock.now = 110.0  # 6 s of evaluation or checkpointing: not training time
        clock.now = 111.0
        logger.log(3, {"loss": 1.5, "lr": 0.1})
        clock.now = 112.0
        logger.log(4, {"loss": 1.0, "lr": 0.1})  # 2 steps × 64 tokens in 8 s less 6 paused
    # MFU: tokens/s × FLOPs per token over the peak of 2 CPU nodes × 1e9
    assert first == (32.0, pytest.approx(32.0 * 1000.0 / 2e9))
    assert (logger.tokens_per_s, logger.mfu) == (64.0, pytest.approx(64.0 * 1000.0 / 2e9))
    rows = [line.split(",") for line in (tmp_path / "curve.csv").read_text().splitlines()[1:]]
    assert [(r[0], r[1], r[4]) for r in rows] == [("2", "2.0", "32.0"), ("4", "1.0", "64.0")]
    assert [r[-1] for r in rows] == ["4.0", "12.0"]  # elapsed_s: since the start, paused time included
    assert logger.last_logged_loss == 1.0  # the summary's final_loss


@pytest.mark.parametrize("device, world_size, nnodes, peak",
                         [("cpu", 4, 1, 1e9), ("cpu", 4, 2, 2e9), ("cuda", 4, 1, 4e9)])
def test_the_peak_is_per_gpu_or_per_cpu_node(tmp_path, device, world_size, nnodes, peak):
    """CPU ranks of one node share its processor; each GPU rank has its own device."""
    assert logger_on(tmp_path, device, world_size, nnodes).peak_flops_total == peak


def test_the_measured_peak_is_two_flops_per_multiply_add(monkeypatch):
    """With every F.linear taking 1 s, the peak is the FLOPs of one (m×k)·(k×n) matmul, 2mkn, per second."""
    from types import SimpleNamespace

    from pipeline.training import metrics

    clock, shapes = Clock(), []

    def linear(x, w):
        shapes.append((*x.shape, w.shape[0]))
        clock.now += 1.0

    monkeypatch.setattr(metrics, "time", clock)
    monkeypatch.setattr(metrics, "F", SimpleNamespace(linear=linear))
    peak = metrics.measure_peak_flops(torch.device("cpu"), torch.float32, seconds=3.5)
    (m, k, n), = set(shapes)
    assert len(shapes) == 2 + 4 and peak == 2 * m * k * n


def test_a_resumed_curve_gives_its_last_loss_and_last_measured_speed(tmp_path):
    from pipeline.training.metrics import CsvLog

    history = tmp_path / "models" / "curve.csv"
    history.parent.mkdir()
    history.write_text("step,loss,lr,grad_norm,tokens_per_s,mfu\n1,5.0,0.1,1.0,100,0.01\n2,4.0,0.1,1.0,200,0.02\n"
                       "3,3.0,0.1,1.0,,\n4,2.0,0.1,1.0,400,0.04\n")
    log = CsvLog(tmp_path / "plots.csv", resume_step=3, history=history)
    log.close()
    assert log.last_loss == 3.0 and log.last_speed == (200.0, 0.02)



def test_elapsed_s_of_a_resumed_run_goes_on_from_its_curve(tmp_path, monkeypatch):
    """A resumed run's rows carry on the clock of the curve it keeps (up to the
    checkpoint's step), so that elapsed_s keeps rising: a plot against it does not
    fold the resumed part back over the start."""
    from pipeline.training import metrics

    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)
    (tmp_path / "history.csv").write_text("step,loss,lr,grad_norm,tokens_per_s,mfu,peak_mem_mb,val_loss,elapsed_s\n"
                                          "2,4.0,0.1,1.0,200,0.02,1.0,,30.5\n3,3.5,0.1,1.0,200,0.02,1.0,,45.0\n")
    logger = logger_on(tmp_path, every=1)
    with logger.start(2):
        clock.now = 103.0
        logger.log(3, {"loss": 3.0, "lr": 0.1})
    rows = [line.split(",") for line in (tmp_path / "curve.csv").read_text().splitlines()[1:]]
    assert [(r[0], r[-1]) for r in rows] == [("2", "30.5"), ("3", "33.5")]


def test_a_resumed_runs_first_report_counts_only_the_steps_it_trained(tmp_path, monkeypatch):
    """Resumed at step 6 with a report every 4 steps: the report at step 8 covers 2
    steps, not 4 (throughput), and MLflow gets each row and the summary at its own
    step of the whole run, not of this process."""
    from pipeline.training import metrics

    clock, logged = Clock(), []

    class Tracker:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def log_metrics(self, values, step):
            logged.append((step, sorted(values)[:2]))

    import pipeline.tracking.tracker as tracker

    monkeypatch.setattr(tracker, "Tracker", Tracker)
    monkeypatch.setattr(metrics, "time", clock)
    logger = MetricsLogger("pretrain", LoggingSection(every=4, peak_flops=1e9, track=True, system_metrics=False),
                           Dist(0, 0, 1, torch.device("cpu"), None), tmp_path / "curve.csv", tmp_path / "history.csv",
                           precision_dtype=torch.float32, nnodes=1, tokens_per_step=64, flops_per_token=1000.0,
                           max_steps=8)
    with logger.start(6):
        clock.now = 101.0
        logger.log(7, {"loss": 3.0, "lr": 0.1})
        clock.now = 104.0
        logger.log(8, {"loss": 2.0, "lr": 0.1})  # 2 steps x 64 tokens in 4 s
        logger.log_summary({"final_loss": 2.0}, 8, None)
    assert logger.tokens_per_s == 32.0
    assert [step for step, _ in logged] == [8, 8]
