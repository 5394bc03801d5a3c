"""What a training run reports, and where: throughput, MFU and peak memory,
written by rank 0 to the console (a progress bar), to ``plots/<stage>.csv``
(appended live, so ``tail -f`` shows progress) and to MLflow.

Every rank calls :meth:`MetricsLogger.log` each step (peak memory is reduced
over ranks at report steps); only rank 0 writes. Time spent evaluating or
checkpointing is excluded from throughput with :meth:`MetricsLogger.paused`.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from pipeline.progress import progress
from pipeline.training import distributed
from pipeline.training.config import LoggingSection
from pipeline.training.distributed import Dist

log = logging.getLogger("pipeline.training")


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Achievable dense matmul FLOP/s of this device in ``dtype`` (all CPU threads),
    measured with ``F.linear``, the op behind every weight matmul of the model: on
    CPUs without native bf16 the plain ``a @ b`` path in bf16 is ~20x slower than
    the oneDNN path ``F.linear`` takes, and would understate the peak."""
    n = 8192 if device.type == "cuda" else 1024
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        x = torch.randn(n, n, device=device, dtype=dtype)
        w = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            F.linear(x, w)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            F.linear(x, w)
            iters += 1
        sync()
        return 2 * n**3 * iters / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _whole(row: dict[str, Any]) -> bool:
    """A curve row as CsvLog writes it: a step, a loss, every cell a number or empty."""
    if not (row.get("step") or "").isdigit() or not row.get("loss") or None in row or None in row.values():
        return False
    try:
        [float(v) for k, v in row.items() if k != "step" and v != ""]
    except ValueError:
        return False
    return True


class CsvLog:
    """``plots/<stage>.csv``, appended and flushed per row, and the same rows in
    ``history`` beside the checkpoints.

    DVC deletes a stage's plain outputs (the plots CSV) before it reruns the
    stage, but keeps its ``persist`` checkpoint folder; so on resume the curve up
    to the checkpoint's step is read back from ``history``, and rows after that
    step are cut, so that the file matches the run."""

    COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb", "val_loss", "elapsed_s"]

    def __init__(self, path: Path, resume_step: int, history: Path):
        kept: list[dict[str, str]] = []
        source = history if history.exists() else path
        if resume_step > 0 and source.exists():
            with open(source, newline="") as f:
                rows = [r for r in csv.DictReader(f) if not (r.get("step") or "").isdigit() or int(r["step"]) <= resume_step]
            kept = [r for r in rows if _whole(r)]
            if len(kept) < len(rows):
                bad = [r.get("step") or "?" for r in rows if not _whole(r)]
                log.warning("%s: %d damaged row(s) left out of the curve (steps %s): a row needs a step, a loss and "
                            "numbers in every column", source, len(bad), ", ".join(bad[:10]))
        self.last_loss = float(kept[-1]["loss"]) if kept and kept[-1].get("loss") else None
        timed = [r for r in kept if r.get("tokens_per_s") and r.get("mfu")]
        # the run's last measured speed, for a rerun that has nothing left to train
        self.last_speed = (float(timed[-1]["tokens_per_s"]), float(timed[-1]["mfu"])) if timed else None
        # where the resumed run's clock goes on from, so that elapsed_s keeps rising across a resume
        self.last_elapsed = float(kept[-1]["elapsed_s"]) if kept and kept[-1].get("elapsed_s") else 0.0
        self._files, self._writers = [], []
        for target in (path, history):
            target.parent.mkdir(parents=True, exist_ok=True)
            # A new file, not the old one truncated: DVC may have linked the old one to
            # its cache (cache.type hardlink or symlink), which a write through would spoil.
            target.unlink(missing_ok=True)
            f = open(target, "w", newline="")
            w = csv.DictWriter(f, self.COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(kept)
            f.flush()
            self._files.append(f)
            self._writers.append(w)

    def write(self, row: dict[str, Any]) -> None:
        cells = {k: ("" if row.get(k) is None else row[k]) for k in self.COLUMNS}
        for f, w in zip(self._files, self._writers):
            w.writerow(cells)
            f.flush()
        if row.get("loss") is not None:
            self.last_loss = float(row["loss"])

    def close(self) -> None:
        for f in self._files:
            f.close()


class MetricsLogger:
    """Throughput, MFU and memory for one run, reported every ``cfg.every`` steps.

    ``peak_flops_total`` is the peak of all devices together: from
    ``cfg.peak_flops`` × devices when given, else measured once on rank 0 (CPU
    ranks on one node share one processor; GPUs are one device per rank).
    """

    def __init__(self, stage: str, cfg: LoggingSection, d: Dist, csv_path: Path, history: Path, *,
                 precision_dtype: torch.dtype, nnodes: int, tokens_per_step: int, flops_per_token: float,
                 max_steps: int):
        self.stage, self.cfg, self.d = stage, cfg, d
        self.csv_path, self.history = Path(csv_path), Path(history)
        self.tokens_per_step, self.flops_per_token, self.max_steps = tokens_per_step, flops_per_token, max_steps
        devices = d.world_size if d.device.type == "cuda" else max(1, nnodes)
        if cfg.peak_flops:
            self.peak_flops_total, self.peak_source = cfg.peak_flops * devices, "params"
        else:
            peak = measure_peak_flops(d.device, precision_dtype) if d.is_main else None
            self.peak_flops_total = float(distributed.broadcast_object(peak, d)) * devices
            self.peak_source = "measured"
        self.tokens_per_s: float | None = None  # None until a step is timed, or read back from the curve (rank 0)
        self.mfu: float | None = None
        self._csv: CsvLog | None = None
        self._bar = None
        self._tracker: Any = None
        self._stack = contextlib.ExitStack()

    # -- lifetime --

    def start(self, start_step: int) -> "MetricsLogger":
        """Open the CSV (cut back to ``start_step``), the progress bar and the MLflow run (rank 0)."""
        self._t_start = self._window_t = time.perf_counter()
        self._window_steps = 0
        if self.d.is_main:
            self._csv = CsvLog(self.csv_path, start_step, self.history)
            self._stack.callback(self._csv.close)
            if self._csv.last_speed is not None:  # replaced at the first step this process times
                self.tokens_per_s, self.mfu = self._csv.last_speed
            self._t_start -= self._csv.last_elapsed  # elapsed_s of a resumed run goes on from its curve's
            if self.cfg.track:
                from pipeline.tracking.tracker import Tracker

                self._tracker = self._stack.enter_context(
                    Tracker(self.stage, rank=self.d.rank, system_metrics=self.cfg.system_metrics))
            self._bar = progress(total=self.max_steps, initial=start_step, desc=self.stage, unit="step")
            self._stack.callback(self._bar.close)
        return self

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)  # with the exception, if any: the MLflow run ends FAILED (KILLED), not FINISHED

    # -- reporting --

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is not training time (evaluation, checkpointing)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._window_t += time.perf_counter() - t0

    def log_params(self, params: dict[str, Any]) -> None:
        if self._tracker is not None:
            self._tracker.log_params(params)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self._tracker is not None:
            self._tracker.set_tags(tags)

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (rank 0, tracked, the server reached), else None."""
        return self._tracker.run_id if self._tracker is not None else None

    def log(self, step: int, metrics: dict[str, Any], force: bool = False) -> None:
        """Count a finished step; at report steps (every ``cfg.every``, or ``force``)
        compute throughput, MFU and peak memory and write the row. Call on every rank."""
        self._window_steps += 1
        if step % self.cfg.every == 0 or force:
            if self.d.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - self._window_t
            self.tokens_per_s = self._window_steps * self.tokens_per_step / dt
            self.mfu = self.tokens_per_s * self.flops_per_token / self.peak_flops_total
            self._window_t, self._window_steps = time.perf_counter(), 0
            # on the rank's device: NCCL reduces CUDA tensors only
            peak = torch.tensor(peak_memory_mb(self.d.device), device=self.d.device)
            peak_mem = float(distributed.all_reduce_max(peak, self.d))
            row = {"step": step, **metrics, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                   "peak_mem_mb": peak_mem, "elapsed_s": time.perf_counter() - self._t_start}
            if self.d.is_main:
                self._csv.write(row)
                if self._tracker is not None:
                    self._tracker.log_metrics({k: v for k, v in row.items() if k != "step" and v is not None}, step=step)
                self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                      tok_s=f"{self.tokens_per_s:,.0f}")
        if self._bar is not None:
            self._bar.update(1)

    def flush(self) -> None:
        """Send the MLflow metrics buffered so far (rank 0; elsewhere a no-op).
        Called before a checkpoint is committed: a run stopped after it resumes
        after that step, so its steps up to there must be in MLflow already."""
        if self._tracker is not None:
            self._tracker.flush()

    def log_summary(self, summary: dict[str, Any], step: int, artifact: Path | None) -> None:
        if self._tracker is not None:
            self._tracker.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None},
                                      step=step)
            if artifact is not None:
                self._tracker.log_artifact(artifact)

    @property
    def last_logged_loss(self) -> float | None:
        """The last training loss written to the CSV (rank 0; None elsewhere)."""
        return self._csv.last_loss if self._csv is not None else None
