"""What the flows need around Prefect, kept importable without Prefect (which
reconfigures the root logger on import), so that tests can reach it.

* The process: :func:`exit_on_sigterm` (the temporary Prefect server goes down
  with a killed ``python -m flows.pipeline``) and :func:`start_temporary_server`
  (it outlives a Ctrl-C to the terminal's process group, so the flow can finish
  its clean-up).
* Running a stage: :func:`stream_command` runs ``dvc repro --single-item`` in its
  own process group and streams its lines; :func:`stop_group` takes the group
  down; :func:`parse_status` reads what DVC did; :func:`changed_stages` asks
  ``dvc status`` what is stale.
* Prefect: :func:`parse_timeouts`, :func:`resolve_root` and :func:`check_stage_args`
  (the flows' command-line input, checked before a Prefect server starts),
  :func:`task_options` (retries and timeouts per stage) and
  :func:`summary_markdown` (the ``pipeline-summary`` artifact).
* MLflow: :func:`parent_run` opens the ``pipeline`` parent run of one flow run.
  Its id goes to every stage process as ``MLFLOW_PARENT_RUN_ID``
  (:meth:`ParentRun.child_env`), and ``pipeline.tracking.tracker.Tracker`` in each
  stage nests its run under it. The parent carries the project's git tags,
  ``dvc.exp_name`` when ``DVC_EXP_NAME`` is set, and, from :meth:`ParentRun.record`
  after the stages, ``dvc.stage_hash.<stage>`` (its ``dvc.lock`` entry) for each stage whose outputs are
  current (ran, restored or skipped), ``pipeline.status.<stage>``
  (ran, restored, skipped, failed, not_run), every selected stage's params section
  flattened (``pack.seq_len``), its scalar metrics as ``<stage>.<key>`` (the same
  names whether the stage ran, was restored or was skipped as up to date: they
  describe its current outputs; none for a failed or not-run stage, whose
  metrics files are an earlier run's), ``pipeline.stages_ran`` and
  ``pipeline.stages_restored``, and ``pipeline_summary.json``.

The stage graph itself comes from DVC: ``pipeline.tracking.lineage``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from pipeline.config import load_yaml, metric_values
from pipeline.tracking import tracker as tracking
from pipeline.tracking.lineage import (
    LineageError,
    StageInfo,
    dvc_stage_hashes,
    load_stages,
    project_root,
    read_metrics,
    select,
)

log = logging.getLogger(__name__)

PARENT_RUN_NAME = tracking.EXPERIMENT_PARENT_NAME

DEFAULT_RETRIES = 2
DEFAULT_RETRY_DELAY_S = 30.0
DATA_TIMEOUT_S = 4 * 3600.0
# Shorter than the 30 s that Prefect's runner gives a cancelled flow process
# before its SIGKILL, so that stop_group's own SIGKILL comes first.
KILL_GRACE_S = 10.0
# What a stage's status can be in one flow run; in these, its metrics files
# describe its current outputs (after a failure they are an earlier run's).
CURRENT_STATUSES = ("ran", "restored", "skipped")

# How `dvc repro --single-item` reports what it did (dvc 3.x: dvc/stage/__init__.py,
# dvc/stage/run.py). tests/flows/test_pipeline_flow.py fails if they drift.
_RAN = re.compile(r"^Running stage '(?P<stage>[^']+)'")
_RESTORED = re.compile(r"^Stage '(?P<stage>[^']+)' is cached - skipping run")

WATCHDOG = Path(__file__).with_name("watchdog.py")


def dvc_bin() -> str:
    """The ``dvc`` next to this interpreter (the project's venv), else the one on PATH."""
    exe = Path(sys.executable).with_name("dvc")
    return str(exe) if exe.exists() else "dvc"


def base_env() -> dict[str, str]:
    """The environment for DVC subprocesses: ours, with this interpreter's bin folder
    first on PATH. DVC runs each stage's ``cmd`` (``python -m stages.x``) through a
    shell; without this, ``.venv/bin/python -m flows.pipeline`` from an unactivated
    shell would run stages with whatever ``python`` comes first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")  # stage logs reach the flow's logger as they happen
    return env


def changed_stages(root: str | Path = ".", targets: Sequence[str] = ()) -> dict[str, Any]:
    """DVC's own verdict on what is stale: ``dvc status --json`` at ``root``, as
    ``{stage name: [what changed, ...]}``; empty when everything is up to date.
    ``.dvc`` files that changed appear under their path. Raises LineageError when
    DVC fails."""
    proc = subprocess.run(
        [dvc_bin(), "status", "--json", *targets], cwd=root, env=base_env(),
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise LineageError(f"dvc status failed in {root}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    out = proc.stdout.strip()
    # DVC prints its JSON on the last line; anything before it is a notice.
    return json.loads(out.splitlines()[-1]) if out else {}


def parse_status(lines: Sequence[str]) -> str:
    """What ``dvc repro --single-item`` did, from its output: ``ran``,
    ``restored`` (outputs checked out from DVC's run cache) or ``skipped``
    (unchanged; also frozen stages)."""
    status = "skipped"
    for line in lines:
        if _RAN.match(line):
            return "ran"
        if _RESTORED.match(line):
            status = "restored"
    return status


def stream_command(cmd: Sequence[str], cwd: str | Path, env: Mapping[str, str], emit: Callable[[str], None],
                   kill_grace_s: float = KILL_GRACE_S) -> tuple[int, list[str]]:
    """Run ``cmd`` in a new process group, passing each output line (stdout and
    stderr merged, in order) to ``emit``; return the exit code and all lines.
    A URI's password in a line is replaced by ``***`` (``tracking.redacted``)
    first: the lines go to Prefect's log database, and a failed stage's error
    line to the summary artifact and an MLflow tag.

    The wait is a loop of short waits, so an exception raised into this thread
    (Prefect's timeout: an alarm signal on the main thread, an injected exception
    on a worker thread; or Ctrl-C) lands within half a second. Whatever ends the
    wait early, the whole group (dvc, the stage; a training stage's torchrun
    agent stops its ranks) gets SIGTERM, then SIGKILL if anything is
    still alive after ``kill_grace_s``; then the exception propagates. Should
    this process be killed outright instead, ``flows/watchdog.py`` stops the
    group the same way."""
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1, start_new_session=True,
    )
    watchdog = subprocess.Popen([sys.executable, str(WATCHDOG), str(os.getpid()), str(proc.pid), str(kill_grace_s)],
                                stdin=subprocess.DEVNULL, start_new_session=True)
    lines: list[str] = []
    q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            q.put(tracking.redacted(raw.rstrip("\n")))
        q.put(None)

    reader = threading.Thread(target=pump, name=f"pump-{proc.pid}", daemon=True)
    reader.start()
    try:
        while True:
            try:
                line = q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            lines.append(line)
            emit(line)
        return proc.wait(), lines
    except BaseException:
        stop_group(proc, kill_grace_s)
        raise
    finally:
        watchdog.kill()
        watchdog.wait()
        reader.join(timeout=5)


def stop_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM ``proc``'s process group; SIGKILL it if any member outlives
    ``grace_s``. Returns once the group is gone (or after a last 10 s wait).

    A Ctrl-C or SIGTERM arriving meanwhile (a second Ctrl-C, a runner's SIGTERM)
    is held until then and delivered after: acting on it at once would skip the
    SIGKILL and leave a stage that ignores SIGTERM running."""
    with _signals_held(signal.SIGINT, signal.SIGTERM):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or its zombie keeps the group "alive"
            if not _group_alive(proc.pid):
                return
            time.sleep(0.1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(timeout=10)


@contextmanager
def _signals_held(*signums: int) -> Iterator[None]:
    """Hold ``signums`` for the block, then restore their handlers and raise the
    ones that came. Python runs signal handlers in the main thread only; on
    another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {n: signal.signal(n, lambda signum, _frame: held.append(signum)) for n in signums}
    try:
        yield
    finally:
        for n, handler in previous.items():
            signal.signal(n, signal.SIG_DFL if handler is None else handler)
        for n in dict.fromkeys(held):
            signal.raise_signal(n)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


FLOW_LOCK = Path(".dvc") / "tmp" / "pipeline-flow.lock"
_held = threading.local()  # .paths: the flow locks this thread holds (a subflow's is its parent flow's)


@contextmanager
def project_lock(root: str | Path, emit: Callable[[str], None], who: str) -> Iterator[None]:
    """Hold the project's flow lock (an exclusive ``flock`` on ``<root>/.dvc/tmp/
    pipeline-flow.lock``) for the block, so that flow runs of one project run
    one after another however they were started: a served deployment (whose
    concurrency limit covers only its own runs), ``--once`` or ``make flow``.
    Without it a second run's stages failed on DVC's repository lock. A run that
    finds the lock held says whose it is (``who`` of the holder, its pid and
    start) through ``emit`` and waits; Ctrl-C or SIGTERM ends the wait. The
    kernel drops the lock of a process that dies, so none is left stale. A
    nested call in the same thread (the ``pipeline`` subflow of ``retrain``)
    holds it already and goes straight in."""
    import fcntl

    path = (Path(root) / FLOW_LOCK).resolve()
    held: set[Path] = _held.__dict__.setdefault("paths", set())
    if path in held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another flow run"
            emit(f"waiting for {holder} to finish: flow runs of one project run one at a time")
            t0 = time.monotonic()
            fcntl.flock(f, fcntl.LOCK_EX)
            emit(f"the project's flow lock is free after {time.monotonic() - t0:.0f} s; starting")
        f.seek(0)
        f.truncate()
        f.write(f"{who} (pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')})\n")
        f.flush()
        held.add(path)
        try:
            yield
        finally:
            held.discard(path)
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


# The longest wait Prefect can arm: a task's timeout is a timer (setitimer, or a
# thread's Event.wait) and a retry's delay a datetime, and past this the timer
# raises OverflowError as the task starts, which failed the flow with a traceback
# instead of running the stage. About 292 years: "never" for any real run.
MAX_SECONDS = float(int(threading.TIMEOUT_MAX))


def non_negative_number(text: str, kind: type = float, maximum: float | None = None) -> Any:
    """``text`` read as ``kind`` (int or float) when that is a finite number >= 0
    (and at most ``maximum`` when given), else None."""
    try:
        value = kind(text)
    except ValueError:
        return None
    ok = math.isfinite(value) and value >= 0 and (maximum is None or value <= maximum)
    return value if ok else None


def parse_timeouts(items: Sequence[str]) -> dict[str, float]:
    """``["pretrain=3600", "*=600"]`` -> ``{"pretrain": 3600.0, "*": 600.0}``; 0
    means no timeout, as in :func:`task_options`. Raises ValueError naming the
    item unless it is ``STAGE=SECONDS`` with SECONDS a number from 0 to
    ``MAX_SECONDS``."""
    out = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        seconds = non_negative_number(value, maximum=MAX_SECONDS)
        if not sep or not name or seconds is None:
            raise ValueError(f"--timeout takes STAGE=SECONDS with SECONDS a number from 0 (none) to "
                             f"{MAX_SECONDS:.0f} (292 years), got {item!r}")
        out[name] = seconds
    return out


def resolve_root(root: str | Path | None) -> Path:
    """The project root of ``--root`` (default: the current directory), which may
    be any folder inside the project. Raises ValueError with one line naming the
    option when it is not a folder or not inside a DVC project. Before, a flow
    started in a sub-folder ran ``dvc repro`` there (every stage failed, after
    its retries, with "'dvc.yaml' does not exist") and left a ``.dvc`` folder,
    ``mlflow.db`` and ``mlartifacts`` in it."""
    path = Path(root if root is not None else os.getcwd())
    if not path.is_dir():
        raise ValueError(f"--root {path}: no such directory")
    try:
        return project_root(path)
    except LineageError as err:
        raise ValueError(f"--root: {err}") from None


def check_stage_args(root: str | Path, targets: Sequence[str] | None = None,
                     timeouts: Mapping[str, float] | None = None,
                     retry_stages: Sequence[str] | None = None) -> list[StageInfo]:
    """The stages a run of the project at ``root`` would run (``targets`` and
    their upstream), after checking every stage name it was given: ``targets``,
    the keys of ``timeouts`` other than ``"*"``, and ``retry_stages``. Raises
    ValueError with one line naming the option when ``root`` is not a DVC project
    or a name is not a stage of it; the flows call this before Prefect starts."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--root {root}: no such directory")
    try:
        stages = load_stages(root)
    except LineageError as err:
        raise ValueError(f"--root: {err}") from None
    names = [s.name for s in stages]
    given = {"--targets": targets or [], "--timeout": [n for n in timeouts or {} if n != "*"],
             "--retry-stages": retry_stages or []}
    for option, items in given.items():
        unknown = [n for n in items if n not in names]
        if unknown:
            raise ValueError(f"{option}: unknown stage(s) {', '.join(unknown)}; {root / 'dvc.yaml'} has "
                             f"{', '.join(names) or 'no stages'}")
    return select(stages, targets)


def start_temporary_server() -> None:
    """Start Prefect's temporary local server now, unless ``PREFECT_API_URL``
    names a real one, with SIGINT blocked in it (a blocked signal stays pending;
    the server process never unblocks it).

    A Ctrl-C at a terminal goes to the whole foreground process group: the flow,
    and the server that Prefect would otherwise start later as a plain child. It
    killed the server while the flow was stopping its stage; the flow's clean-up
    then spent minutes retrying the dead API, and the summary was never printed.
    Started here, the server is the one the flow uses (Prefect keeps one per
    process) and Prefect still stops it at exit, with SIGTERM."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    # The mask is the calling thread's, and a child inherits it: this runs on
    # the main thread before any flow, so no other thread starts the server.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        SubprocessASGIServer().start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def exit_on_sigterm() -> None:
    """Make SIGTERM end this process as ``SystemExit(143)`` (128 + 15), the way
    Ctrl-C ends it as KeyboardInterrupt, so that ``finally`` blocks and exit
    handlers run: Prefect stops its temporary server from one. During a flow run
    Prefect's own handler takes SIGTERM, ends the run, and then sends the signal
    again to the handler it found: by default the one that exits at once, which
    left the server running with the port and database held."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def task_options(stage: StageInfo, retries: int = DEFAULT_RETRIES, retry_delay_s: float = DEFAULT_RETRY_DELAY_S,
                 retry_stages: Sequence[str] | None = None,
                 timeouts: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Prefect task options for ``stage``: ``retries`` for data stages (or for
    exactly ``retry_stages`` when given), none for the others; the timeout from
    ``timeouts`` (stage name -> seconds, ``"*"`` for every stage not named; 0
    means none), else ``DATA_TIMEOUT_S`` for data stages and none for the rest,
    since a pretraining run may rightly take days."""
    retried = stage.name in retry_stages if retry_stages is not None else stage.is_data_stage
    timeouts = timeouts or {}
    timeout = timeouts.get(stage.name, timeouts.get("*", DATA_TIMEOUT_S if stage.is_data_stage else None))
    return {
        "name": f"stage-{stage.name}",
        "task_run_name": stage.name,
        "retries": retries if retried else 0,
        "retry_delay_seconds": retry_delay_s,
        "timeout_seconds": timeout if timeout else None,
    }


def failure_line(err: BaseException) -> str:
    """Why a stage's task failed, in one line: the stage's own ``error:`` line from the
    end of its output (pipeline.runner prints one), else DVC's ``ERROR:`` line, else
    the exception's first line (a timeout), or how the flow was stopped."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(err, SystemExit):  # exit_on_sigterm's
        return f"stopped (exit code {err.code})"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for prefix in ("error: ", "ERROR: "):
        found = [line for line in lines if line.startswith(prefix)]
        if found:
            return found[-1]
    return lines[0] if lines else type(err).__name__


def summary_markdown(stages: Sequence[StageInfo], results: Sequence[Mapping[str, Any]], max_metrics: int = 8) -> str:
    """A markdown report: a headline naming the stage that failed, if one did, and
    which stages ran and which DVC restored from its run cache; a failed stage's
    ``error`` (its one line, as a quote) below it; then one table row
    per stage with its status (``not run`` when it has no result), seconds and up
    to ``max_metrics`` scalar metrics. Metrics are shown for the stages in
    ``CURRENT_STATUSES`` only: a failed or not-run stage's metrics files, if any,
    are from an earlier run."""
    by_name = {r["stage"]: r for r in results}
    rows = ["| stage | status | seconds | metrics |", "|---|---|---:|---|"]
    for s in stages:
        r = by_name.get(s.name, {"status": "not run"})
        flat = metric_values(r.get("metrics") or {}) if r["status"] in CURRENT_STATUSES else {}
        flat.pop("seconds", None)
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in list(flat.items())[:max_metrics])
        if len(flat) > max_metrics:
            shown += f", … (+{len(flat) - max_metrics})"
        secs = f"{r['seconds']:.1f}" if r.get("seconds") is not None else ""
        rows.append(f"| {s.name} | {r['status']} | {secs} | {shown or '-'} |")
    named = {status: [r["stage"] for r in results if r["status"] == status] for status in ("ran", "restored", "failed")}
    head = f"**{len(named['ran'])} of {len(stages)} stages ran**"
    head += f" ({', '.join(named['ran'])})" if named["ran"] else ""
    if named["restored"]:
        head += f"; {len(named['restored'])} restored from DVC's run cache ({', '.join(named['restored'])})"
    if named["failed"]:
        not_run = len(stages) - len(results)
        after = f" ({not_run} not run after it)" if not_run else ""
        head = f"**Failed: stage {', '.join(named['failed'])}**{after}; {head}"
    elif not named["ran"] and not named["restored"]:
        head += ": everything was up to date"
    why = "".join(f"> {r['stage']}: {r['error']}\n\n" for r in results if r["status"] == "failed" and r.get("error"))
    return head + "\n\n" + why + "\n".join(rows) + "\n"


def _fmt(v: float) -> str:
    return f"{int(v)}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:.4g}"


@dataclass
class ParentRun:
    """The MLflow parent of one pipeline run. ``run_id`` is None when tracking is
    off (``PIPELINE_TRACKING=0``) or MLflow is unreachable; stages then log
    top-level runs (or nothing), and the pipeline still runs."""

    root: Path
    uri: str
    run_id: str | None = None
    tracker: Any = field(default=None, repr=False)

    def describe(self) -> str:
        """The run and where it is, for the log: the URI's password, if any, as ``***``."""
        return f"MLflow parent run {self.run_id} at {tracking.redacted(self.uri)}"

    def child_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env`` (default :func:`base_env`) plus what makes a stage's run a child
        of this one: ``MLFLOW_PARENT_RUN_ID`` and the same ``MLFLOW_TRACKING_URI``.
        The URI is pinned because a stage resolves its default database from
        ``DVC_ROOT``, which need not be where the flow was started."""
        env = dict(base_env() if env is None else env)
        if self.run_id:
            env["MLFLOW_PARENT_RUN_ID"] = self.run_id
            env["MLFLOW_TRACKING_URI"] = self.uri
        else:
            env.pop("MLFLOW_PARENT_RUN_ID", None)
        return env

    def record(self, stages: Sequence[StageInfo], results: Sequence[Mapping[str, Any]]) -> None:
        """Log params, metrics, lineage tags and the summary of a finished (or
        failed) pipeline run. Never raises because of MLflow (the Tracker doesn't)."""
        t = self.tracker
        if t is None:
            return
        by_name = {r["stage"]: r for r in results}
        try:
            path = self.root / "params.yaml"
            params = (load_yaml(path) or {}) if path.exists() else {}
        except Exception as err:  # the run already happened; a bad params file only costs the params
            log.warning("params not logged: %s", err)
            params = {}
        sections = {s.name: params[s.name] for s in stages if isinstance(params.get(s.name), (dict, list))}
        t.log_params(sections)
        status = {s.name: by_name.get(s.name, {}).get("status", "not_run") for s in stages}
        metrics: dict[str, float] = {}
        for s in stages:
            if status[s.name] in CURRENT_STATUSES:
                metrics.update(metric_values(read_metrics(self.root, s), s.name))
        ran = [name for name, st in status.items() if st == "ran"]
        restored = [name for name, st in status.items() if st == "restored"]
        metrics["pipeline.stages_ran"] = float(len(ran))
        metrics["pipeline.stages_restored"] = float(len(restored))
        metrics["pipeline.seconds"] = float(sum(r.get("seconds") or 0.0 for r in results))
        t.log_metrics(metrics)
        tags = {f"pipeline.status.{name}": st for name, st in status.items()}
        tags["pipeline.stages_ran"] = ",".join(ran) or "-"
        tags["pipeline.stages_restored"] = ",".join(restored) or "-"
        tags.update({f"pipeline.error.{r['stage']}": r["error"] for r in results if r.get("error")})
        try:
            # a failed or not-run stage's lock entry is an earlier run's
            tags.update({f"dvc.stage_hash.{k}": v for k, v in dvc_stage_hashes(self.root).items()
                         if status.get(k) in CURRENT_STATUSES})
        except Exception as err:  # an unreadable lock file must not fail a finished run
            log.warning("dvc.lock hashes not logged: %s", err)
        t.set_tags(tags)
        t.log_dict({"stages": list(results)}, "pipeline_summary.json")


@contextmanager
def parent_run(root: str | Path, tags: Mapping[str, Any] | None = None) -> Iterator[ParentRun]:
    """Open the ``pipeline`` parent run for the project at ``root`` and end it
    FINISHED, or FAILED (KILLED on KeyboardInterrupt) if the block raises.

    Runs go to ``$MLFLOW_TRACKING_URI``, else ``<root>/mlflow.db`` (the stages'
    own default), in ``$MLFLOW_EXPERIMENT_NAME`` or ``llm-pipeline``. Git tags are
    read from ``root``, not from the current directory."""
    root = Path(root).resolve()
    uri = tracking.tracking_uri(root)
    extra = {**tracking.git_tags(root), **(tags or {})}
    tracker = tracking.Tracker(PARENT_RUN_NAME, rank=0, system_metrics=False, tags=extra, uri=uri).start()
    run = ParentRun(root=root, uri=uri, run_id=tracker.run_id, tracker=tracker if tracker.active else None)
    with tracker:
        yield run
