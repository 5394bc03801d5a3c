"""What every stage's ``main()`` shares: load its params section, run, write its
metrics, and turn expected failures (:class:`pipeline.errors.StageError`, and
what the OS refused for a reason the user fixes: a full disk, a permission, a
read-only filesystem, :func:`pipeline.files.expected_failure`) into one line,
``error: stage <name> failed: <message>``, and exit code 2 (``PIPELINE_DEBUG=1``
prints the traceback before it)."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import time
import traceback
from typing import Callable, NoReturn

from pipeline import layout
from pipeline.config import StageConfig, load_params, metric_values
from pipeline.errors import StageError, Stopped, raise_stopped
from pipeline.files import expected_failure, write_json
from pipeline.tracking.tracker import LAUNCH_ENV, end_launch_runs, env_flag, record_experiment

log = logging.getLogger("pipeline")


def exit_without_a_last_collection() -> None:
    """At exit, freeze the objects still alive (torch's are many) out of the
    interpreter's last garbage collections, which take most of a second per
    process; the process's end frees them. Handlers registered later (atexit
    runs them last in, first out) still run before."""
    atexit.register(gc.freeze)


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )


DEBUG_ENV = "PIPELINE_DEBUG"


def debugging() -> bool:
    """Whether ``PIPELINE_DEBUG`` is set on (1, true, yes, on)."""
    return env_flag(DEBUG_ENV, False)


def fail(stage: str, err: StageError, rank: int | None = None) -> NoReturn:
    """Print an expected failure as one line on stderr and exit 2. A message of
    several lines (a ConfigError lists one bad key a line) is joined with "; ".
    With ``PIPELINE_DEBUG=1`` the traceback of the exception being handled (the
    one ``err`` was made from) comes first, for a report of a wrong message."""
    who = f"stage {stage}" if rank is None else f"stage {stage} (rank {rank})"
    if debugging() and sys.exc_info()[1] is not None:
        traceback.print_exc()
    print(f"error: {who} failed: {one_line(str(err))}", file=sys.stderr)
    sys.exit(2)


def one_line(message: str) -> str:
    out = ""
    for line in filter(None, (part.strip() for part in message.splitlines())):
        out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def run_stage(stage: str, body: Callable[..., dict], *, artifacts: tuple = (), pass_tracker: bool = False) -> None:
    """Load ``params.yaml[stage]``, call ``body(cfg) -> metrics`` (or
    ``body(cfg, tracker)`` with ``pass_tracker``), write ``metrics/<stage>.json``
    and log the run to MLflow (a child of ``$MLFLOW_PARENT_RUN_ID`` when a flow
    set one) with ``artifacts`` attached. A StageError (config errors included)
    exits 2 with its message rather than a traceback."""
    from pipeline.tracking.tracker import Tracker

    setup_logging()
    exit_without_a_last_collection()
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        try:
            cfg = load_params(stage)
        except StageError as err:
            fail(stage, err)
        with Tracker(stage) as tracker:
            tracker.log_params(cfg, prefix=stage)
            try:
                metrics = body(cfg, tracker) if pass_tracker else body(cfg)
                metrics = {**metrics, "seconds": round(time.perf_counter() - t0, 3)}
                write_json(layout.metrics_path(stage), metrics)
            except Exception as err:
                expected = expected_failure(err)
                if expected is None:
                    raise
                tracker.set_tags({"error": str(expected)[:1000]})
                tracker.end("FAILED")
                fail(stage, expected)
            tracker.log_metrics(metric_values(metrics))
            for path in artifacts:
                tracker.log_artifact(path)
        record_experiment(stage, enabled=tracker.active and not tracker.offline)
    except (KeyboardInterrupt, Stopped) as stop:  # the Tracker ended its run KILLED on the way out
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        print(f"error: stage {stage} stopped by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("%s done: %s", stage, {k: v for k, v in metrics.items() if not isinstance(v, dict)})


PEER_FAILURE_GRACE_S = 3.0

# What a collective's transport says when the rank at the other end has gone
# (gloo raises a RuntimeError with one of these; NCCL a DistBackendError).
PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
             "remote process exited", "NCCL communicator was aborted")


def peer_lost(err: BaseException) -> bool:
    """Whether a rank's exception is a collective that lost the rank at its other end."""
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in PEER_LOST)


# What a collective says when the other ranks did not come in time: gloo raises a
# RuntimeError; NCCL's watchdog names the timeout (where it does not abort the rank).
TIMED_OUT = ("Timed out waiting", "collective operation timeout")


def timed_out(err: BaseException) -> bool:
    """Whether a rank's exception is a collective that waited past the group's timeout."""
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in TIMED_OUT)


def resume_hint(folder) -> str:
    """What running a stopped training stage again does: resume from the newest
    complete checkpoint in ``folder`` (the trainer still checks that it belongs
    to this run), or start over."""
    from pipeline.training import checkpoint

    last = checkpoint.latest(folder)
    if last is None:
        return "no checkpoint was written yet, so running the stage again starts over"
    return f"running the stage again resumes from its newest checkpoint, step {last.step} ({last.path})"


def run_training_stage(stage: str, module: str, lock_folder, body: Callable[[StageConfig], dict],
                       prepare: Callable[[StageConfig], object] | None = None) -> None:
    """Entry point of a torchrun stage.

    Outside torchrun (as DVC runs it): validate params, take the trainer lock on
    ``lock_folder``, run ``prepare(cfg)`` once if given, run torchrun's agent
    on ``-m <module>`` with the launch settings from params, and exit with its
    code; a signal that stopped it or killed a rank is one line, and the MLflow
    run that rank 0 left RUNNING is ended. Inside torchrun: run ``body`` on
    every rank; rank 0 writes ``metrics/<stage>.json``. A StageError prints one
    line, no traceback.
    """
    import uuid

    from pipeline.files import die_with_parent
    from pipeline.training.torchrun import inside_torchrun, launch
    from pipeline.training.trainer import NonFiniteError

    setup_logging()
    exit_without_a_last_collection()
    try:
        cfg = load_params(stage)
    except StageError as err:
        fail(stage, err)
    if not inside_torchrun():
        launch_id = os.environ[LAUNCH_ENV] = uuid.uuid4().hex  # rank 0 tags its MLflow run with it
        try:
            code, why = launch(module, cfg.launch, lock_folder, before=(lambda: prepare(cfg)) if prepare else None)
        except Exception as err:  # TrainerBusyError included
            if (expected := expected_failure(err)) is None:
                raise
            fail(stage, expected)
        stopped = bool(why and why.startswith("stopped"))
        if why:  # a signal stopped the run or killed a rank: nothing else said so
            print(f"error: stage {stage} {'' if stopped else 'failed: '}{why}; {resume_hint(lock_folder)}",
                  file=sys.stderr, flush=True)
        elif code not in (0, 2):  # 2: a rank's StageError, which printed its one line
            print(f"error: stage {stage} failed (exit code {code}); see the rank's message above", file=sys.stderr,
                  flush=True)
        if code != 0 and cfg.logging.track:  # rank 0, stopped by a signal, left its run RUNNING
            end_launch_runs(launch_id, "KILLED" if stopped else "FAILED")
        sys.exit(code)
    if os.environ.get("PIPELINE_LAUNCHED"):
        die_with_parent()  # a rank never outlives its torchrun agent
        # The agent passes a Ctrl-C on as SIGINT: stop at once, as on SIGTERM (checkpoints
        # are written atomically), not with a KeyboardInterrupt that a collective may never
        # see while it waits for a rank that has already gone.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    try:
        metrics = body(cfg)
        if rank == 0:
            metrics = {**metrics, "seconds": round(time.perf_counter() - t0, 3)}
            write_json(layout.metrics_path(stage), metrics)
    except NonFiniteError as err:
        print(f"error: stage {stage} (rank {rank}) stopped: {err}", file=sys.stderr)
        sys.exit(3)
    except Exception as err:
        if (expected := expected_failure(err)) is not None:
            fail(stage, expected, rank)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # A rank whose peer died (the OOM killer, a crash) fails in its next collective
            # with the transport's own traceback ("Connection reset by peer"). The agent stops
            # the other ranks within a tenth of a second of a death it sees: wait a moment
            # before the traceback, so that only the rank that failed first speaks.
            time.sleep(PEER_FAILURE_GRACE_S)
            if timed_out(err):  # another rank stalled (or its node was cut off) past the timeout
                limit = cfg.launch.timeout_s
                waited = f"{limit:g} s" if limit is not None else "torch's default (NCCL 600 s, gloo 1800 s)"
                print(f"error: stage {stage} (rank {rank}) failed: a collective waited more than {waited} "
                      f"(launch.timeout_s) for another rank, which stalled or was cut off: {type(err).__name__}: "
                      f"{one_line(str(err))[:300]}; if a rank was only busy (writing a checkpoint alone, compiling), "
                      "raise launch.timeout_s", file=sys.stderr, flush=True)
                sys.exit(2)
            if peer_lost(err):  # a peer on another node, whose agent this one does not watch
                print(f"error: stage {stage} (rank {rank}) failed: a collective lost a peer rank (it stopped, or "
                      f"its node failed or left; its own node's line says why): {type(err).__name__}: "
                      f"{one_line(str(err))[:300]}", file=sys.stderr, flush=True)
                sys.exit(2)  # as a StageError's: the launcher adds no line of its own
        raise
    if rank == 0:
        record_experiment(stage, enabled=cfg.logging.track)
        log.info("%s done: %s", stage, {k: v for k, v in metrics.items() if not isinstance(v, dict)})
