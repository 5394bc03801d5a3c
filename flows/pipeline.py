"""The DVC pipeline as a Prefect flow: ``python -m flows.pipeline``.

Each DVC stage becomes one Prefect task that runs ``dvc repro --single-item
<stage>``, in the order of DVC's own stage graph (read from DVC, never listed
here, so a stage added to ``dvc.yaml`` is picked up). DVC decides what is stale:
a stage whose inputs did not change is a no-op, and a second run of the flow does
no work. What Prefect adds on top:

* retries for data stages (those that neither read nor write ``models/``:
  ingest, clean, tokenizer, pack). They are pure CPU functions of their inputs,
  so a transient failure (a flaky source, a worker killed for memory) is worth
  one more try. Training stages get none: they resume from their own checkpoints
  on the next run, and an automatic retry of a run that failed for a real reason
  (non-finite loss, a bad config) would burn accelerator hours repeating it.
  Evaluate and export read models and are treated the same way;
* a timeout per stage (``--timeout STAGE=S``; data stages default to 4 h, the
  others to none, since pretraining may take days). On a timeout or a
  cancellation the stage's whole process group gets SIGTERM, then SIGKILL, so no
  trainer is left running behind the flow;
* the output of DVC and of the stage streamed line by line into the task's log;
* a markdown artifact ``pipeline-summary``: the stage that failed, if one did,
  then each stage's status (ran, restored from DVC's run cache, skipped as
  unchanged, failed, not run), time and metrics (of the stages that did not
  fail or go unrun: their metrics files are an earlier run's);
* one MLflow parent run per flow run (``flows.runtime.parent_run``); each
  stage process gets ``MLFLOW_PARENT_RUN_ID``, so its own run nests under it.

Stages run one at a time: ``dvc repro`` holds a repository-wide lock, so two
stages of one project cannot run at once anyway. Flow runs of one project run
one at a time too (``flows.runtime.project_lock``): a second one, however it
was started, waits for the first and says so. Prefect's task cache is off
(``NO_CACHE``): DVC is the cache.

``python -m flows.pipeline`` runs on Prefect's temporary local server, offline.
Schedules need a real server: see ``flows/retrain.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.states import Failed, State

from flows.runtime import (
    DEFAULT_RETRIES,
    DEFAULT_RETRY_DELAY_S,
    MAX_SECONDS,
    base_env,
    check_stage_args,
    dvc_bin,
    exit_on_sigterm,
    failure_line,
    non_negative_number,
    parent_run,
    parse_status,
    parse_timeouts,
    project_lock,
    resolve_root,
    start_temporary_server,
    stream_command,
    summary_markdown,
    task_options,
)
from pipeline.tracking.lineage import StageInfo, load_stages, project_root, read_metrics, select

TAIL_LINES = 40  # lines at the end of a failed stage's output searched for its error line


class StageFailed(RuntimeError):
    """A stage failed: ``dvc repro`` exited non-zero, or its task timed out. The
    message is one line, ``stage <name>: <why>``."""


@task(cache_policy=NO_CACHE, persist_result=False)
def run_stage(stage: StageInfo, root: str, env: dict[str, str]) -> dict[str, Any] | State:
    """``dvc repro --single-item <stage>`` in ``root``; returns ``{"stage",
    "status", "seconds", "metrics"}``, or on a non-zero exit a Failed state
    whose message is the stage's one-line error (:func:`failure_line` of its
    last lines of output). Returned, not raised: Prefect logs a raised exception
    with its traceback, the task's and then the flow's, each repeating the
    output already streamed line by line above them."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    code, lines = stream_command([dvc_bin(), "repro", "--single-item", stage.name], root, env, logger.info)
    seconds = round(time.perf_counter() - t0, 3)
    if code != 0:
        tail = "\n".join(lines[-TAIL_LINES:])
        return Failed(message=failure_line(StageFailed(f"dvc repro exited with {code} after {seconds} s:\n{tail}")))
    status = parse_status(lines)
    logger.info("stage %s: %s in %.1f s", stage.name, status, seconds)
    return {"stage": stage.name, "status": status, "seconds": seconds, "metrics": read_metrics(root, stage)}


@flow(name="pipeline")
def pipeline(
    root: str | None = None,
    targets: list[str] | None = None,
    retries: int = DEFAULT_RETRIES,
    retry_delay_s: float = DEFAULT_RETRY_DELAY_S,
    retry_stages: list[str] | None = None,
    timeouts: dict[str, float] | None = None,
) -> list[dict[str, Any]] | State:
    """Run the DVC stages of the project at ``root`` (default: the current
    directory; a folder inside a project means that project) in DAG order; with ``targets``, only those and what they depend on.

    ``retries`` apply to data stages, or to exactly ``retry_stages`` when given;
    ``timeouts`` maps stage names (``"*"`` for the rest) to seconds. Returns one
    ``{"stage", "status", "seconds", "metrics"}`` per stage. A stage that still
    fails after its retries fails the flow: it returns a Failed state whose
    message is ``stage <name>: <its one-line error>``; the summary then shows it
    as failed and the stages after it as not run, and the MLflow parent run ends FAILED."""
    logger = get_run_logger()
    root_path = project_root(root or os.getcwd())
    stages = select(load_stages(root_path), targets)
    logger.info("stages in DAG order: %s", ", ".join(s.name for s in stages))
    ctx = get_run_context()
    tags = {"prefect.flow_run_id": str(ctx.flow_run.id), "prefect.flow_run_name": ctx.flow_run.name,
            "pipeline.targets": ",".join(targets or []) or "all"}
    results: list[dict[str, Any]] = []
    try:
        with project_lock(root_path, logger.info, f"flow run {ctx.flow_run.name!r}"), \
                parent_run(root_path, tags=tags) as parent:
            if parent.run_id:
                logger.info(parent.describe())
            env = parent.child_env(base_env())
            try:
                for stage in stages:
                    opts = task_options(stage, retries, retry_delay_s, retry_stages, timeouts)
                    try:
                        state = run_stage.with_options(**opts)(stage, str(root_path), env, return_state=True)
                        if state.is_completed():
                            results.append(state.result())
                            continue
                        err = state.result(raise_on_failure=False)
                        line = failure_line(err) if isinstance(err, BaseException) else (state.message or state.name)
                    except BaseException as err:  # Ctrl-C, SIGTERM
                        results.append({"stage": stage.name, "status": "failed", "seconds": None, "metrics": {},
                                        "error": failure_line(err)})
                        raise
                    results.append({"stage": stage.name, "status": "failed", "seconds": None, "metrics": {},
                                    "error": line})
                    raise StageFailed(f"stage {stage.name}: {line}")  # ends the MLflow parent run FAILED
            finally:
                # The console and MLflow first: the artifact needs Prefect's API, which may be gone.
                markdown = summary_markdown(stages, results)
                print(markdown, flush=True)
                parent.record(stages, results)
                try:
                    create_markdown_artifact(markdown=markdown, key="pipeline-summary",
                                             description=f"DVC stages of {root_path}")
                except Exception as err:
                    logger.warning("the pipeline-summary artifact was not saved: %s: %s", type(err).__name__, err)
    except StageFailed as err:
        # A state, not the exception: Prefect would log the exception's traceback.
        return Failed(message=str(err))
    return results


def non_negative(kind: type, maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` that reads a finite ``kind`` (int or float) >= 0, and
    at most ``maximum`` when given."""
    def parse(text: str) -> Any:
        value = non_negative_number(text, kind, maximum)
        if value is None:
            bound = f" and at most {maximum:.0f}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(f"expected a number >= 0{bound}, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.pipeline [--root DIR] [--targets STAGE ...] [--timeout STAGE=S ...]``;
    exit code 0 when the flow completed, 1 when it failed."""
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=None, help="project root (default: current directory)")
    parser.add_argument("--targets", nargs="*", default=None, metavar="STAGE",
                        help="run only these stages and their upstream (default: all)")
    parser.add_argument("--retries", type=non_negative(int), default=DEFAULT_RETRIES, help="retries for data stages")
    parser.add_argument("--retry-delay", type=non_negative(float, MAX_SECONDS), default=DEFAULT_RETRY_DELAY_S,
                        metavar="S")
    parser.add_argument("--retry-stages", nargs="*", default=None, metavar="STAGE",
                        help="retry exactly these stages instead of the data stages")
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=S",
                        help="per-stage timeout in seconds, '*=S' for the others, 0 for none (repeatable)")
    args = parser.parse_args(argv)
    try:  # before the flow starts Prefect's temporary server
        timeouts = parse_timeouts(args.timeout)
        root = resolve_root(args.root)
        check_stage_args(root, args.targets, timeouts, args.retry_stages)
    except ValueError as err:
        parser.error(str(err))
    exit_on_sigterm()
    start_temporary_server()
    state = pipeline(root=str(root), targets=args.targets, retries=args.retries, retry_delay_s=args.retry_delay,
                     retry_stages=args.retry_stages, timeouts=timeouts or None, return_state=True)
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
