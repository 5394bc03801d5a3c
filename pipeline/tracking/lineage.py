"""What the orchestration layer needs to know about the DVC pipeline, and the
MLflow parent run that ties one pipeline run together.

DVC stays the source of truth: the stage list, their order and what is stale all
come from DVC (its index for the graph, ``dvc status --json`` for staleness), never
from a list kept here. Adding a stage to ``dvc.yaml`` is enough for the flows in
``flows/`` to run it.

Lineage model (MLflow)
    One run named ``pipeline`` per pipeline run (:class:`ParentRun`). Its id is
    handed to every stage process as ``MLFLOW_PARENT_RUN_ID`` (:meth:`ParentRun.child_env`),
    and ``pipeline.tracking.tracker.Tracker`` in each stage turns its own run into a child of
    it. The parent carries:

    * tags ``mlflow.source.git.commit``/``git.dirty`` of the project, one
      ``dvc.stage_hash.<stage>`` per ``dvc.lock`` entry after the run (the same hash a
      child run tags itself with as ``dvc.stage_hash``), ``dvc.exp_name`` when the
      flow runs with ``DVC_EXP_NAME`` set, ``pipeline.status.<stage>`` (ran,
      restored, skipped, failed, not_run) and the Prefect flow run id;
    * params: every selected stage's ``params.yaml`` section, flattened to dotted
      names (``pack.seq_len``), so two pipeline runs can be compared key by key;
    * metrics: every selected stage's scalar metrics as ``<stage>.<key>``
      (``pack.train_rows``), from the metrics files declared in ``dvc.yaml``; the
      names stay the same across runs whether the stage ran or was skipped;
    * ``pipeline_summary.json``: the per-stage results.

Running a stage (:func:`stream_command`, :func:`parse_status`) and the task
options and summary of the Prefect flow live here too, so that they can be
tested without importing Prefect, which reconfigures the root logger on import.

Importing this module is cheap; DVC and MLflow are imported where needed.
"""

from __future__ import annotations

import json
import logging
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

from pipeline.errors import StageError

log = logging.getLogger(__name__)

PARENT_RUN_NAME = "pipeline"
# Stages that read or write anything under this folder train, evaluate or export
# a model; every other stage with outputs is a data stage.
MODELS_PREFIX = "models/"

DEFAULT_RETRIES = 2
DEFAULT_RETRY_DELAY_S = 30.0
DATA_TIMEOUT_S = 4 * 3600.0
KILL_GRACE_S = 30.0

# How `dvc repro --single-item` reports what it did (dvc 3.x: dvc/stage/__init__.py,
# dvc/stage/run.py). tests/flows/test_pipeline_flow.py fails if they drift.
_RAN = re.compile(r"^Running stage '(?P<stage>[^']+)'")
_RESTORED = re.compile(r"^Stage '(?P<stage>[^']+)' is cached - skipping run")


class LineageError(StageError):
    """DVC could not describe the pipeline (no dvc.yaml, a broken graph, a bad target)."""


@dataclass(frozen=True)
class StageInfo:
    """One runnable DVC stage, as DVC's index describes it.

    ``name`` is what ``dvc repro`` accepts from the project root (``pack``, or
    ``sub/dvc.yaml:train`` for a nested dvc.yaml). ``upstream`` lists the stages
    whose outputs it depends on; ``deps`` and ``outs`` are paths (``outs``
    without metrics and plots), ``metrics`` its declared metrics files; all
    relative to the project root."""

    name: str
    cmd: str
    upstream: tuple[str, ...] = ()
    deps: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()

    @property
    def is_data_stage(self) -> bool:
        """True when it has outputs and neither reads nor writes a model (nothing
        under ``models/``): ingest, clean, tokenizer, pack. Such a stage is a pure
        function of its inputs on CPU, so a retry is cheap and often cures a
        transient failure. Stages that touch models hold accelerators; the
        training ones resume from their own checkpoints on the next run, and a
        failure of any of them (non-finite loss, a bad export) would most likely
        repeat."""
        paths = self.deps + self.outs
        return bool(self.outs) and not any(p.startswith(MODELS_PREFIX) for p in paths)


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


# --------------------------------------------------------------------------- the DAG


def load_stages(root: str | Path = ".") -> list[StageInfo]:
    """Every command stage of the DVC project at ``root``, upstream first.

    The order is a topological sort of DVC's own stage graph; stages that could go
    either way keep their ``dvc.yaml`` order, so the result is deterministic.
    ``.dvc`` files (data tracked with ``dvc add``) are inputs, not stages, and are
    left out. Raises LineageError if DVC cannot load the project."""
    import networkx as nx
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    root = Path(root).resolve()
    try:
        repo = Repo(str(root))
    except DvcException as err:
        raise LineageError(f"{root} is not a DVC project: {err}") from None
    try:
        index = repo.index
        graph = index.graph  # edges point from a stage to the stages it depends on
        declared = {stage: i for i, stage in enumerate(index.stages)}
        order = list(nx.lexicographical_topological_sort(graph.reverse(copy=True), key=lambda s: declared.get(s, 0)))
        names = {stage: _address(stage) for stage in order}
        stages = []
        for stage in order:
            if not getattr(stage, "cmd", None):
                continue
            outs = tuple(_rel(stage, o.def_path) for o in stage.outs if not o.metric and not o.plot)
            deps = tuple(_rel(stage, d.def_path) for d in stage.deps if not _is_params(d))
            stages.append(StageInfo(
                name=names[stage],
                cmd=stage.cmd if isinstance(stage.cmd, str) else " && ".join(stage.cmd),
                upstream=tuple(names[u] for u in graph.successors(stage) if getattr(u, "cmd", None)),
                deps=deps,
                outs=outs,
                metrics=tuple(_rel(stage, o.def_path) for o in stage.outs if o.metric),
            ))
    except DvcException as err:
        raise LineageError(f"DVC cannot load the pipeline in {root}: {err}") from None
    finally:
        repo.close()
    return stages


def _address(stage: Any) -> str:
    # Relative to the project root, which is where the flows run DVC from.
    dvcfile = Path(stage.path_in_repo).as_posix()
    return stage.name if dvcfile == "dvc.yaml" else f"{dvcfile}:{stage.name}"


def _rel(stage: Any, path: Any) -> str:
    # DVC paths are relative to the stage's dvc.yaml; ours to the project root.
    wdir = Path(stage.path_in_repo).parent
    return (wdir / str(path)).as_posix() if str(wdir) not in ("", ".") else Path(str(path)).as_posix()


def _is_params(dep: Any) -> bool:
    from dvc.dependency.param import ParamsDependency

    return isinstance(dep, ParamsDependency)


def select(stages: Sequence[StageInfo], targets: Sequence[str] | None) -> list[StageInfo]:
    """``targets`` plus everything upstream of them, in ``stages`` order (all of
    ``stages`` when ``targets`` is empty). Raises LineageError for an unknown name."""
    if not targets:
        return list(stages)
    by_name = {s.name: s for s in stages}
    unknown = [t for t in targets if t not in by_name]
    if unknown:
        raise LineageError(f"unknown stage(s) {', '.join(unknown)}; dvc.yaml has {', '.join(by_name)}")
    wanted: set[str] = set()
    todo = list(targets)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(by_name[name].upstream)
    return [s for s in stages if s.name in wanted]


def descendants(stages: Sequence[StageInfo], name: str) -> set[str]:
    """Names of every stage that depends, directly or not, on ``name``."""
    below: dict[str, list[str]] = {}
    for s in stages:
        for u in s.upstream:
            below.setdefault(u, []).append(s.name)
    found: set[str] = set()
    todo = list(below.get(name, []))
    while todo:
        n = todo.pop()
        if n not in found:
            found.add(n)
            todo.extend(below.get(n, []))
    return found


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


# --------------------------------------------------------------------------- running


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

    The wait is a loop of short waits, so an exception raised into this thread
    (Prefect's timeout: an alarm signal on the main thread, an injected exception
    on a worker thread; or Ctrl-C) lands within half a second. Whatever ends the
    wait early, the whole group (dvc, the stage, a torchrun launcher, which
    forwards the signal to its ranks) gets SIGTERM, then SIGKILL if anything is
    still alive after ``kill_grace_s``; then the exception propagates."""
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1, start_new_session=True,
    )
    lines: list[str] = []
    q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            q.put(raw.rstrip("\n"))
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
        reader.join(timeout=5)


def stop_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM ``proc``'s process group; SIGKILL it if any member outlives
    ``grace_s``. Returns once the group is gone (or after a last 10 s wait)."""
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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


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


def summary_markdown(stages: Sequence[StageInfo], results: Sequence[Mapping[str, Any]], max_metrics: int = 8) -> str:
    """A markdown report: how many stages ran, then one table row per stage with
    its status (``not run`` when it has no result), seconds and up to
    ``max_metrics`` scalar metrics (the current values, whether or not it ran)."""
    by_name = {r["stage"]: r for r in results}
    rows = ["| stage | status | seconds | metrics |", "|---|---|---:|---|"]
    for s in stages:
        r = by_name.get(s.name, {"status": "not run"})
        flat = scalar_metrics(r.get("metrics") or {})
        flat.pop("seconds", None)
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in list(flat.items())[:max_metrics])
        if len(flat) > max_metrics:
            shown += f", … (+{len(flat) - max_metrics})"
        secs = f"{r['seconds']:.1f}" if r.get("seconds") is not None else ""
        rows.append(f"| {s.name} | {r['status']} | {secs} | {shown or '-'} |")
    ran = [r["stage"] for r in results if r["status"] in ("ran", "restored")]
    head = f"**{len(ran)} of {len(stages)} stages ran** ({', '.join(ran) or 'none: everything was up to date'})"
    return head + "\n\n" + "\n".join(rows) + "\n"


def _fmt(v: float) -> str:
    return f"{int(v)}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:.4g}"


# --------------------------------------------------------------------------- metrics


def read_metrics(root: str | Path, stage: StageInfo) -> dict[str, Any]:
    """The stage's metrics files merged into one dict (the stage's own keys, as
    written); files that are missing or unreadable are skipped."""
    return read_metric_files(root, stage.metrics)


def read_metric_files(root: str | Path, paths: Sequence[str]) -> dict[str, Any]:
    """Metrics files (JSON or YAML) under ``root`` merged into one dict; files that
    are missing or unreadable are skipped."""
    merged: dict[str, Any] = {}
    for rel in paths:
        path = Path(root) / rel
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else _yaml(path)
        except (OSError, ValueError) as err:
            log.debug("no metrics from %s: %s", path, err)
            continue
        if isinstance(data, dict):
            merged.update(data)
    return merged


def _yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8"))


def scalar_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a (nested) metrics dict under dotted names; strings,
    lists and nulls are dropped because MLflow metrics are numbers."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(scalar_metrics(value, name))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


# --------------------------------------------------------------------------- MLflow


@dataclass
class ParentRun:
    """The MLflow parent of one pipeline run. ``run_id`` is None when tracking is
    off (``PIPELINE_TRACKING=0``) or MLflow is unreachable; stages then log
    top-level runs (or nothing), and the pipeline still runs."""

    root: Path
    uri: str
    run_id: str | None = None
    tracker: Any = field(default=None, repr=False)

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
        from pipeline.tracking.tracker import dvc_stage_hashes

        by_name = {r["stage"]: r for r in results}
        try:
            params = _read_params(self.root)
        except Exception as err:  # the run already happened; a bad params file only costs the params
            log.warning("params not logged: %s", err)
            params = {}
        sections = {s.name: params[s.name] for s in stages if isinstance(params.get(s.name), (dict, list))}
        t.log_params(sections)
        metrics: dict[str, float] = {}
        for s in stages:
            metrics.update(scalar_metrics(read_metrics(self.root, s), s.name))
        ran = [r["stage"] for r in results if r.get("status") in ("ran", "restored")]
        metrics["pipeline.stages_ran"] = float(len(ran))
        metrics["pipeline.seconds"] = float(sum(r.get("seconds") or 0.0 for r in results))
        t.log_metrics(metrics)
        tags = {f"pipeline.status.{s.name}": by_name.get(s.name, {}).get("status", "not_run") for s in stages}
        tags["pipeline.stages_ran"] = ",".join(ran) or "-"
        try:
            tags.update({f"dvc.stage_hash.{k}": v for k, v in dvc_stage_hashes(self.root).items()})
        except Exception as err:  # an unreadable lock file must not fail a finished run
            log.warning("dvc.lock hashes not logged: %s", err)
        t.set_tags(tags)
        t.log_dict({"stages": list(results)}, "pipeline_summary.json")


def _read_params(root: Path) -> dict[str, Any]:
    path = root / "params.yaml"
    return (_yaml(path) or {}) if path.exists() else {}


@contextmanager
def parent_run(root: str | Path, tags: Mapping[str, Any] | None = None) -> Iterator[ParentRun]:
    """Open the ``pipeline`` parent run for the project at ``root`` and end it
    FINISHED, or FAILED (KILLED on KeyboardInterrupt) if the block raises.

    Runs go to ``$MLFLOW_TRACKING_URI``, else ``<root>/mlflow.db`` (the stages'
    own default), in ``$MLFLOW_EXPERIMENT_NAME`` or ``llm-pipeline``. Git tags are
    read from ``root``, not from the current directory."""
    from pipeline.tracking import tracker as tracking

    root = Path(root).resolve()
    uri = tracking.tracking_uri(root)
    extra = {**tracking.git_tags(root), **(tags or {})}
    tracker = tracking.Tracker(PARENT_RUN_NAME, rank=0, system_metrics=False, tags=extra)
    # Tracker resolves its URI from the environment; pin it to root's database for
    # the moment it starts, then restore what the caller had.
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        tracker.start()
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved
    run = ParentRun(root=root, uri=uri, run_id=tracker.run_id, tracker=tracker if tracker.active else None)
    with tracker:
        yield run


# --------------------------------------------------------------------------- dvc exp run


def upstream_closure(stage: str, root: str | Path = ".") -> list[str]:
    """``stage`` and every stage it depends on, directly or not, in ``dvc.yaml``
    order, read from ``root/dvc.yaml`` alone (a dep at or under another stage's
    output is an edge). Runs inside a stage, where DVC holds the repo lock, so it
    does not open DVC's index. Unknown stage: ``[stage]``."""
    from pipeline.tracking.tracker import _load_yaml, _path_of

    specs = {n: s for n, s in ((_load_yaml(Path(root) / "dvc.yaml") or {}).get("stages") or {}).items()
             if isinstance(s, dict)}
    outs = {n: [_path_of(o) for f in ("outs", "metrics", "plots") for o in s.get(f) or []] for n, s in specs.items()}

    def within(dep: str, out: str) -> bool:
        return dep == out or dep.startswith(out.rstrip("/") + "/")

    seen, todo = {stage}, [stage]
    while todo:
        deps = [_path_of(d) for d in (specs.get(todo.pop()) or {}).get("deps") or []]
        for other, paths in outs.items():
            if other not in seen and any(within(d, o) for d in deps for o in paths):
                seen.add(other)
                todo.append(other)
    return [n for n in specs if n in seen] or [stage]


def record_experiment(stage: str, root: str | Path = ".", enabled: bool = True) -> None:
    """Under ``dvc exp run``: bring the experiment's parent run (see
    ``pipeline.tracking.tracker.experiment_parent``) up to date once ``stage`` has written
    its metrics, so that it carries what a flow's parent carries (:meth:`ParentRun.record`):

    * metrics ``<stage>.<key>`` from the metrics files that ``dvc.yaml`` declares,
      for ``stage`` and everything upstream of it, whether they ran in this
      experiment or were restored from DVC's run cache (same names as a flow run);
    * tags ``dvc.stage_hash.<stage>``: upstream stages from ``dvc.lock`` (already
      current), ``stage`` itself as DVC will record it.

    ``root`` is the workspace the stage runs in (the temporary copy under
    ``--temp``/``--queue``), not ``DVC_ROOT``. A no-op outside an experiment, off
    rank 0, with tracking off, or when MLflow is unreachable; never raises."""
    from pipeline.tracking import tracker as tracking

    exp_name = os.environ.get("DVC_EXP_NAME")
    if not (enabled and exp_name and tracking._env_flag("PIPELINE_TRACKING", True)):
        return
    if int(os.environ.get("RANK", "0")) != 0:
        return
    uri = tracking.tracking_uri()
    reason = tracking.probe(uri)
    if reason:
        log.warning("experiment %s: parent run not updated: %s", exp_name, reason)
        return
    try:
        from mlflow import MlflowClient
        from mlflow.entities import Metric, RunTag

        root = Path(root)
        names = upstream_closure(stage, root)
        specs = (tracking._load_yaml(root / "dvc.yaml") or {}).get("stages") or {}
        metrics: dict[str, float] = {}
        for name in names:
            paths = [tracking._path_of(m) for m in (specs.get(name) or {}).get("metrics") or []]
            metrics.update(scalar_metrics(read_metric_files(root, paths), name))
        tags = {f"dvc.stage_hash.{k}": v for k, v in tracking.dvc_stage_hashes(root).items() if k in names}
        own = tracking.current_stage_fingerprint(stage, root)
        if own:
            tags[f"dvc.stage_hash.{stage}"] = own
        client = MlflowClient(uri)
        parent = tracking.experiment_parent(client, tracking.ensure_experiment(uri=uri, client=client), exp_name)
        now = int(time.time() * 1000)
        rows = [Metric(tracking._key(k), v, now, 0) for k, v in metrics.items()]
        run_tags = [RunTag(tracking._key(k), v) for k, v in tags.items()]
        for i in range(0, max(len(rows), 1), 1000):
            client.log_batch(parent, metrics=rows[i:i + 1000], tags=run_tags if i == 0 else [])
    except Exception as err:  # the stage already succeeded; lineage must not fail it
        log.warning("experiment %s: parent run not updated: %s", exp_name, err)
