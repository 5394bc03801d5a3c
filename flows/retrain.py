"""Scheduled retraining: ``python -m flows.retrain --cron "0 3 * * *"``.

Serves a deployment named ``retrain`` whose runs ask DVC what is stale and, if
anything is, run the ``pipeline`` flow (``flows/pipeline.py``) as a subflow. New
or changed files under ``data/raw`` (a dependency of ``ingest`` in ``dvc.yaml``)
make ingest stale, and DVC reruns it and then whatever its changed outputs feed;
stages whose inputs did not change are skipped. (For their text to be read, the
files must also match an entry of ``ingest.sources``; sources outside the
project, like the default ``{stdlib}`` corpus, are invisible to DVC.) A tick with
nothing stale finishes at once and opens no MLflow run.

Where the schedule comes from: ``--cron`` on the command line, else
``$PIPELINE_RETRAIN_CRON``, else ``DEFAULT_CRON`` (03:00 every day, in
``--timezone``, default UTC). It is deliberately not in ``params.yaml``: that
file holds one section per DVC stage, and *when* to retrain is a property of the
deployment, not an input of any stage; putting it there would make DVC treat a
schedule change as a change to the experiment.

Overlap: the deployment has a concurrency limit of 1 enforced by the Prefect
server, with the ``CANCEL_NEW`` strategy: a run that comes due while the
previous one is still going is cancelled instead of queued. Nothing is lost by
skipping a tick, since the next run sees every change DVC sees; a queue would
grow without bound whenever training takes longer than the schedule period.
The limit lives on the server, so it also holds across several ``serve``
processes and runs started by hand from the UI.

Schedules need a real Prefect server (the temporary one started for single
runs never schedules): ``make prefect-server`` and
``PREFECT_API_URL=http://127.0.0.1:4200/api``. Stopping ``serve`` with Ctrl-C or
SIGTERM leaves the schedule active (``pause_on_shutdown=False``), so a restart
picks it up again.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.states import Failed, State

from flows.pipeline import pipeline
from flows.runtime import (
    DEFAULT_RETRIES,
    DEFAULT_RETRY_DELAY_S,
    changed_stages,
    check_stage_args,
    exit_on_sigterm,
    project_lock,
    resolve_root,
    start_temporary_server,
)
from pipeline.tracking.lineage import LineageError, load_stages, project_root, select
from pipeline.tracking.tracker import redacted

DEPLOYMENT = "retrain"
DEFAULT_CRON = "0 3 * * *"
CRON_ENV = "PIPELINE_RETRAIN_CRON"


@flow(name="retrain")
def retrain(
    root: str | None = None,
    targets: list[str] | None = None,
    retries: int = DEFAULT_RETRIES,
    retry_delay_s: float = DEFAULT_RETRY_DELAY_S,
    timeouts: dict[str, float] | None = None,
) -> dict[str, Any] | State:
    """Bring the project at ``root`` (default: the current directory) up to date
    with its inputs. Returns ``{"stale": {stage: reasons}, "stages": [...]}``,
    where ``stages`` is the pipeline flow's result, empty when nothing was stale;
    a Failed state with the pipeline's one-line message when that failed, or
    with DVC's when ``dvc status`` failed (another ``dvc repro`` holds its lock)."""
    logger = get_run_logger()
    root_path = project_root(root or os.getcwd())
    names = [s.name for s in select(load_stages(root_path), targets)]
    # Asked under the flow lock: while another flow run's stage runs, `dvc status`
    # fails on DVC's lock of that stage's outputs ("... is busy").
    with project_lock(root_path, logger.info, f"retrain run {get_run_context().flow_run.name!r}"):
        try:
            stale = {k: v for k, v in changed_stages(root_path).items() if k in names}
        except LineageError as err:
            # A `dvc repro` started by hand holds DVC's lock ("... is busy, it is being blocked
            # by: (PID n): dvc repro"): one line, as a state, not a traceback of a page of stderr.
            return Failed(message=" ".join(str(err).split()))
        if not stale:
            logger.info("DVC reports every stage up to date (%s); nothing to retrain", ", ".join(names))
            return {"stale": {}, "stages": []}
        logger.info("DVC reports stale: %s; running the pipeline", ", ".join(stale))
        state = pipeline(root=str(root_path), targets=targets, retries=retries,
                         retry_delay_s=retry_delay_s, timeouts=timeouts, return_state=True)
    if not state.is_completed():  # as a state: raised, it would be logged with a traceback
        return Failed(message=state.message or "the pipeline flow failed")
    return {"stale": stale, "stages": state.result()}


def resolve_schedule(cli_value: str | None, timezone: str = "UTC") -> tuple[str, str]:
    """``(cron, timezone)`` from ``--cron``, else ``$PIPELINE_RETRAIN_CRON``, else
    ``DEFAULT_CRON``, checked with Prefect's own schedule validator; raises
    ValueError naming the source when the expression or the time zone is empty
    (an empty ``$PIPELINE_RETRAIN_CRON`` counts as unset) or invalid,
    when it has other than the 5 standard fields (an ``@daily``-style alias is
    one; Prefect reads a 6th field as seconds, so ``"0 3 * * * *"`` would run
    every second from 03:00 to 03:01), or when it never fires (``"0 3 31 2 *"``)."""
    from prefect._vendor.croniter import CroniterBadDateError, croniter  # what Prefect's scheduler uses
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    if cli_value is not None and not cli_value.strip():  # `--cron "$UNSET"`: not a wish for the default
        raise ValueError(f"--cron {cli_value!r}: empty; give a cron expression such as {DEFAULT_CRON!r}")
    if not timezone.strip():
        raise ValueError(f"--timezone {timezone!r}: empty; give an IANA time zone such as 'UTC' or 'Europe/Paris'")
    value, source = cli_value, "--cron"
    if not value:
        value, source = os.environ.get(CRON_ENV), f"${CRON_ENV}"
    if not value:
        value, source = DEFAULT_CRON, "the default schedule"
    where = f"{source} {value!r} (time zone {timezone!r})"
    try:
        schedule = CronSchedule(cron=value, timezone=timezone)
    except ValidationError as err:
        reason = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        raise ValueError(f"{where}: {reason}") from None
    fields = value.split()
    if len(fields) != 5 and not (len(fields) == 1 and value.startswith("@")):
        raise ValueError(f"{where}: a cron expression has 5 fields (minute hour day month weekday), "
                         f"this one has {len(fields)}")
    try:
        croniter(value, datetime.now(ZoneInfo(schedule.timezone)), day_or=schedule.day_or).get_next(datetime)
    except CroniterBadDateError:
        raise ValueError(f"{where}: never fires (no date matches it)") from None
    return value, timezone


def serve(cron: str, *, timezone: str = "UTC", name: str = DEPLOYMENT, parameters: dict | None = None) -> None:
    """Register the deployment on the Prefect server at ``$PREFECT_API_URL`` and
    run its scheduled runs in subprocesses until interrupted. Raises RuntimeError
    when no server is configured, none answers there, or what answers is not a
    Prefect API; the message shows the URL with its password, if any, as ``***``."""
    import httpx
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.schedules import Cron
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise RuntimeError(
            "scheduling needs a running Prefect server: start one with `make prefect-server` and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api (the temporary server never fires schedules)"
        )
    # Else serve() fails deep in its client with a page of httpx.ConnectError, or,
    # where something else answers (another service on the port, a URL without
    # /api), of HTTP errors.
    shown = redacted(url)
    try:
        r = httpx.get(f"{url.rstrip('/')}/health", timeout=10)
    except httpx.TransportError:
        raise RuntimeError(f"no Prefect server at {shown}: start one with `make prefect-server`") from None
    try:
        healthy = r.json() is True if r.status_code == 200 else r.status_code in (401, 403)  # 40x: an API key's job
    except ValueError:  # not JSON
        healthy = False
    if not healthy:
        raise RuntimeError(f"{shown} is not a Prefect API: GET /health answered HTTP {r.status_code}; expected "
                           f"a Prefect server's URL ending in /api, e.g. http://127.0.0.1:4200/api")
    retrain.serve(
        name=name,
        schedules=[Cron(cron, timezone=timezone)],
        global_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        parameters=parameters or {},
        pause_on_shutdown=False,
        description=f"Retrain on '{cron}' ({timezone}) with whatever DVC sees as changed",
        tags=["retrain"],
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.retrain [--cron EXPR] [--timezone TZ] [--root DIR] [--targets ...] [--once]``."""
    parser = argparse.ArgumentParser(prog="python -m flows.retrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cron", default=None,
                        help=f"cron expression (default: ${CRON_ENV}, else '{DEFAULT_CRON}')")
    parser.add_argument("--timezone", default="UTC", help="time zone of the cron expression")
    parser.add_argument("--name", default=DEPLOYMENT, help="deployment name")
    parser.add_argument("--root", default=None, help="project root the runs work in (default: here)")
    parser.add_argument("--targets", nargs="*", default=None, metavar="STAGE",
                        help="retrain only up to these stages (default: all)")
    parser.add_argument("--once", action="store_true", help="run once now instead of serving the schedule")
    args = parser.parse_args(argv)
    # Pin the deployment to a directory now: a run starts wherever its runner does.
    try:  # before any run or deployment exists: each would fail the same way
        root = resolve_root(args.root)
        check_stage_args(root, args.targets)
        if not args.once:
            cron, timezone = resolve_schedule(args.cron, args.timezone)
    except ValueError as err:
        parser.error(str(err))
    params: dict[str, Any] = {"root": str(root)}
    if args.targets:
        params["targets"] = args.targets
    if args.once:
        exit_on_sigterm()  # serve() has the runner's own handling
        start_temporary_server()
        state = retrain(**params, return_state=True)
        return 0 if state.is_completed() else 1
    try:
        serve(cron, timezone=timezone, name=args.name, parameters=params)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
