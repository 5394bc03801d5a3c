"""What every stage's ``main()`` shares: load its params section, run, write its
metrics, and turn expected failures into one clear line and exit code 2."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from pipeline import layout
from pipeline.config import ConfigError, StageConfig, load_params
from pipeline.files import write_json
from pipeline.tracking.tracker import metric_values, record_experiment

log = logging.getLogger("pipeline")


class StageError(RuntimeError):
    """An expected failure with a message meant for the user (no traceback)."""


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )


def run_stage(stage: str, body: Callable[..., dict], *, expected: tuple[type[BaseException], ...] = (),
              artifacts: tuple = (), pass_tracker: bool = False) -> None:
    """Load ``params.yaml[stage]``, call ``body(cfg) -> metrics`` (or
    ``body(cfg, tracker)`` with ``pass_tracker``), write ``metrics/<stage>.json``
    and log the run to MLflow (a child of ``$MLFLOW_PARENT_RUN_ID`` when a flow
    set one) with ``artifacts`` attached. Config errors and ``expected`` errors
    exit 2 with their message rather than a traceback."""
    from pipeline.tracking.tracker import Tracker

    setup_logging()
    t0 = time.perf_counter()
    try:
        cfg = load_params(stage)
    except ConfigError as err:
        print(f"error: stage {stage} failed: {err}", file=sys.stderr)
        sys.exit(2)
    with Tracker(stage) as tracker:
        tracker.log_params(cfg, prefix=stage)
        try:
            metrics = body(cfg, tracker) if pass_tracker else body(cfg)
        except (StageError, *expected) as err:
            tracker.set_tags({"error": str(err)[:1000]})
            tracker.end("FAILED")
            print(f"error: stage {stage} failed: {err}", file=sys.stderr)
            sys.exit(2)
        metrics = {**metrics, "seconds": round(time.perf_counter() - t0, 3)}
        write_json(layout.metrics_path(stage), metrics)
        tracker.log_metrics(metric_values(metrics))
        for path in artifacts:
            tracker.log_artifact(path)
    record_experiment(stage, enabled=tracker.active and not tracker.offline)
    log.info("%s done: %s", stage, {k: v for k, v in metrics.items() if not isinstance(v, dict)})


def run_training_stage(stage: str, module: str, lock_folder, body: Callable[[StageConfig], dict],
                       prepare: Callable[[StageConfig], object] | None = None,
                       expected: tuple[type[BaseException], ...] = ()) -> None:
    """Entry point of a torchrun stage.

    Outside torchrun (as DVC runs it): validate params, take the trainer lock on
    ``lock_folder``, run ``prepare(cfg)`` once if given, start ``torchrun -m
    <module>`` with the launch settings from params, and exit with its code.
    Inside torchrun: run ``body`` on every rank; rank 0 writes
    ``metrics/<stage>.json``. ``expected`` errors print one line, no traceback.
    """
    import os

    from pipeline.training.torchrun import LaunchConfig, TrainerBusyError, die_with_parent, inside_torchrun, launch
    from pipeline.training.trainer import NonFiniteError

    setup_logging()
    try:
        cfg = load_params(stage)
    except ConfigError as err:
        print(f"error: stage {stage} failed: {err}", file=sys.stderr)
        sys.exit(2)
    if not inside_torchrun():
        launch_cfg = LaunchConfig(**{k: getattr(cfg, k) for k in LaunchConfig.model_fields})  # the launch subset
        try:
            code = launch(module, launch_cfg, lock_folder, before=(lambda: prepare(cfg)) if prepare else None)
        except TrainerBusyError as err:
            print(f"error: stage {stage} refused to start: {err}", file=sys.stderr)
            sys.exit(2)
        except (StageError, *expected) as err:
            print(f"error: stage {stage} failed: {err}", file=sys.stderr)
            sys.exit(2)
        if code != 0:
            print(f"error: stage {stage} failed (torchrun exit code {code}); see the rank's message above",
                  file=sys.stderr)
        sys.exit(code)
    if os.environ.get("PIPELINE_LAUNCHED"):
        die_with_parent()  # a rank never outlives its torchrun agent
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    try:
        metrics = body(cfg)
    except NonFiniteError as err:
        print(f"error: stage {stage} (rank {rank}) stopped: {err}", file=sys.stderr)
        sys.exit(3)
    except (StageError, *expected) as err:
        print(f"error: stage {stage} (rank {rank}) failed: {err}", file=sys.stderr)
        sys.exit(2)
    if rank == 0:
        metrics = {**metrics, "seconds": round(time.perf_counter() - t0, 3)}
        write_json(layout.metrics_path(stage), metrics)
        record_experiment(stage, enabled=getattr(cfg, "track", True))
        log.info("%s done: %s", stage, {k: v for k, v in metrics.items() if not isinstance(v, dict)})
