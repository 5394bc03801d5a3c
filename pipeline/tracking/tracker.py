"""The project's thin layer over MLflow: one run per stage, logged from rank 0,
nested under its pipeline run, tagged with its lineage, and never lost.

Usage, in a stage or a trainer::

    from pipeline.tracking.tracker import Tracker

    with Tracker("pretrain") as t:              # run name = stage name
        t.log_params(cfg)                       # config (model or dict), flattened to dotted names
        for step in ...:
            t.log_metrics({"loss": loss, "lr": lr}, step=step)   # buffered
        t.log_artifact("models/pretrain/meta.json")
        t.log_dict(summary, "summary.json")

What this module owns; the rest is MLflow's (batch splitting, value limits, the
user and source tags from its context providers) or DVC's (``lineage.py``):

* Where: the project root is ``$PIPELINE_ROOT``, else ``$DVC_ROOT`` (under ``dvc
  exp run --temp``/``--queue`` DVC points it at the real repository, not the
  throw-away copy), else the current directory. The tracking URI is
  ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<root>/mlflow.db``, which ``make
  mlflow`` serves. A new experiment (``$MLFLOW_EXPERIMENT_NAME`` or
  ``llm-pipeline``) gets an absolute artifact root, ``<root>/mlartifacts``
  (:func:`artifact_location`), so its artifacts outlive DVC's copies.
* Who logs: rank 0 (``rank``, else ``$RANK``). Other ranks, ``enabled=False`` and
  ``PIPELINE_TRACKING=0`` get a no-op tracker that never imports mlflow.
* Naming and nesting: the run is named after the stage, and is a child of
  ``$MLFLOW_PARENT_RUN_ID`` (a flow's parent run) in that run's experiment. Under
  ``dvc exp run`` without one, each experiment gets its own parent run
  (:func:`experiment_parent`), which :func:`record_experiment` keeps up to date.
* Lineage tags: :func:`git_tags` of the current directory, ``dvc.stage``,
  ``dvc.stage_hash`` (what ``dvc.lock`` will record for the stage),
  ``dvc.exp_name`` and ``dvc.exp_baseline_rev``.
* Runs killed outright: each run records the process that logs it (host, pid
  namespace, pid and start time). A stage killed by SIGKILL or the OOM killer
  cannot end its run; the stage's next run on that host (and in that pid
  namespace) finds it RUNNING with its process gone and ends it KILLED, with a
  ``pipeline.ended_by`` tag (:func:`end_orphaned_runs`).
* Batching: metrics are buffered and sent with one ``log_batch`` every
  ``flush_every_s`` seconds or ``flush_every_n`` records, and at the end.
* Outage: an http(s) server is probed at ``<uri>/health`` (3 s) first, and MLflow's
  HTTP retries are cut to seconds (``HTTP_DEFAULTS``). When the server is
  unreachable, or any MLflow call fails later, the tracker emits one
  ``TrackingOfflineWarning`` and goes on logging, through MLflow, into a local
  store ``<root>/.tracking-offline/<stage>-<utc time>-<pid>/`` (``mlflow.db`` and
  ``mlartifacts/``; the run's tags, params and end status included). Nothing is
  raised. ``python -m pipeline.tracking.tracker replay DIR`` loads it into the real
  server later, into the same run when that still exists, once (``replayed.json``).

Importing this module is cheap: mlflow, DVC, pydantic and YAML are imported inside
the functions that need them.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from pipeline.errors import Stopped

# current_stage_fingerprint and dvc_stage_hashes are re-exported: the trainer and stages import them from here.
from pipeline.tracking.lineage import current_stage_fingerprint, dvc_stage_hashes, load_stages, read_metrics, select

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "llm-pipeline"
DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
OFFLINE_DIR = ".tracking-offline"
PROBE_TIMEOUT_S = 3.0
EXPERIMENT_PARENT_NAME = "pipeline"
EXP_KEY_TAG = "pipeline.exp_key"  # experiment_parent: which params.yaml and baseline its parent run describes
LAUNCH_ENV, LAUNCH_TAG = "PIPELINE_LAUNCH_ID", "pipeline.launch_id"  # one training launch's runs (end_launch_runs)
MAX_TAG_VAL_LENGTH = 8000  # mlflow.utils.validation's; pipeline/promote.py cuts version tags to it

# MLflow's own defaults retry for about four minutes with a 120 s timeout per try,
# which would freeze a training loop whose server went away. These bound one failing
# call to about 2 x 10 s + 1 s; after that the tracker is offline and stops calling.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

# Names MLflow accepts everywhere (it raises on others, which would cost the batch).
_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")
MAX_KEY_LENGTH = 250
# The password of a URI's user part (https://user:token@host, which requests sends as basic auth;
# s3://key:secret@bucket, which pyarrow reads), up to the last @ before the path, as urllib splits it.
_URI_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/\s]*@")


class TrackingOfflineWarning(UserWarning):
    """MLflow could not be reached or failed; records go to a local store."""


class TrackingWarning(UserWarning):
    """A caller-side problem the tracker skipped (a conflicting param value, a missing artifact)."""


# --------------------------------------------------------------------------- where


def project_root() -> Path:
    """``$PIPELINE_ROOT``, else ``$DVC_ROOT``, else the current directory; absolute."""
    for var in ("PIPELINE_ROOT", "DVC_ROOT"):
        if os.environ.get(var):
            return Path(os.environ[var]).resolve()
    return Path.cwd().resolve()


def tracking_uri(root: str | Path | None = None) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else the project's SQLite database."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = Path(root).resolve() if root is not None else project_root()
    return f"sqlite:///{root / DB_FILE}"


def artifact_location(uri: str | None = None, root: str | Path | None = None) -> str | None:
    """The absolute artifact root for a new experiment at ``uri``: ``mlartifacts``
    beside a SQLite database, ``<root>/mlartifacts`` for a server on this machine
    (so runs logged to ``mlflow.db`` directly share it), None for a remote server."""
    uri = uri or tracking_uri(root)
    if uri.startswith("databricks"):
        return None
    if uri.startswith(("http://", "https://")):
        from urllib.parse import urlsplit

        if urlsplit(uri).hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
    if uri.startswith("sqlite:///"):
        db = uri[len("sqlite:///"):].split("?", 1)[0]
        if db and db != ":memory:":
            return Path(db).resolve().parent.joinpath(ARTIFACTS_DIR).as_uri()
    root = Path(root).resolve() if root is not None else project_root()
    return (root / ARTIFACTS_DIR).as_uri()


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def ensure_experiment(name: str | None = None, *, uri: str | None = None, client: Any = None) -> str:
    """The id of experiment ``name``, created with :func:`artifact_location` or
    restored if deleted. Raises MLflow's errors."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = uri or tracking_uri()
    client = client or MlflowClient(uri)
    name = name or experiment_name()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(uri))
        except MlflowException:  # another rank-0 process (a parallel queued experiment) won the race
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def server_command(port: int = 5000, host: str = "127.0.0.1", root: str | Path | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for ``make mlflow``'s UI over the default database.
    One worker and no job runner: healthy in about 9 s, and nothing left behind."""
    root = Path(root).resolve() if root is not None else project_root()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    argv = [
        str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / DB_FILE}",
        "--artifacts-destination", str(root / ARTIFACTS_DIR),
        "--host", host, "--port", str(port), "--workers", "1",
    ]
    return argv, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def probe(uri: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None if ``uri`` looks reachable, else a short reason. Only http(s) URIs are
    probed (one GET of ``<uri>/health`` without the URI's user and password, no
    retries); others are tried for real. The reason shows no password."""
    if not uri.startswith(("http://", "https://")):
        return None
    import ssl
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    # urllib would take "user:token@host" for the host name: /health asks for no login anyway.
    parts = urlsplit(uri)
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    try:
        with urllib.request.urlopen(bare.rstrip("/") + "/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered: reachable, even if /health is not served there
    except Exception as err:  # refused, timed out, DNS, or not speaking HTTP at all
        reason = getattr(err, "reason", None) or err
        if isinstance(reason, ssl.SSLError):
            return None  # it answered; MLflow's own TLS settings may accept it
        return redacted(f"{uri} is unreachable ({reason})")


# --------------------------------------------------------------------------- values


def git_tags(cwd: str | Path = ".") -> dict[str, str]:
    """``mlflow.source.git.commit`` of the checkout at ``cwd`` (MLflow's own tag
    names the checkout of the main script, which need not be the project) and
    ``git.dirty`` ("true" if tracked files differ from HEAD); empty outside git."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    status = git("status", "--porcelain", "--untracked-files=no")
    tags = {"mlflow.source.git.commit": commit}
    if status is not None:
        tags["git.dirty"] = "true" if status else "false"
    return tags


def mlflow_key(name: Any) -> str:
    """``name`` as a key MLflow accepts for a param, metric or tag: characters it
    refuses (``[``, ``*``, ``{`` of a source's default name) become ``_``."""
    return (_BAD_KEY_CHARS.sub("_", str(name)).strip("/") or "_")[:MAX_KEY_LENGTH]


def _text(value: Any) -> str:
    # A param or tag value, without the password of any URI in it (a source path
    # s3://key:secret@bucket/...); MLflow cuts values that are too long itself.
    return redacted(json.dumps(value, default=str) if isinstance(value, (list, tuple, dict)) else str(value))


def env_flag(name: str, default: bool) -> bool:
    """The switch ``$name``: ``default`` when unset or empty; off for 0, false,
    no or off (any case); on for anything else."""
    raw = os.environ.get(name, "").strip().lower()
    return default if not raw else raw not in ("0", "false", "no", "off")


def tracking_enabled() -> bool:
    """Whether ``PIPELINE_TRACKING`` leaves tracking on (unset: on; 0/false/no/off: off)."""
    return env_flag("PIPELINE_TRACKING", True)


def _quoted(value: str) -> str:
    """``value`` as a string literal of an MLflow search filter, which has no
    escapes: in single quotes, or in double quotes when it holds a single quote
    (``dvc exp run -n "bob's-lr"`` is a valid name). Raises ValueError when it
    holds both."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"{value!r} holds both kinds of quote, which an MLflow search filter cannot match")


def redacted(text: str) -> str:
    """``text`` with the password of any URI in it (``https://user:token@host``) as ``***``:
    for messages, tags and files, which must not hold a secret."""
    return _URI_PASSWORD.sub(r"\1***@", text)


def _short(err: BaseException) -> str:
    text = redacted(f"{type(err).__name__}: {err}".splitlines()[0])
    return text if len(text) <= 300 else text[:299] + "…"


# --------------------------------------------------------------------------- tracker


class Tracker:
    """One MLflow run for one stage, logged from rank 0 only. See the module doc.

    Use as a context manager (or call :meth:`start` and :meth:`end`). Leaving the
    block with an exception ends the run as FAILED (KILLED for a Ctrl-C, or a
    SIGTERM raised as :class:`pipeline.errors.Stopped`) and lets the exception
    propagate. No method raises because of MLflow; caller errors (a metric that
    is not a number) do raise.

    Attributes: ``run_id`` (the server's run; None on other ranks and when offline
    from the start), ``offline`` (True once records go to ``offline_path``),
    ``active`` (rank 0 and enabled)."""

    def __init__(
        self,
        stage: str,
        *,
        rank: int | None = None,
        enabled: bool | None = None,
        system_metrics: bool | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        uri: str | None = None,
        flush_every_s: float = 10.0,
        flush_every_n: int = 1000,
    ) -> None:
        self.stage = stage
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.active = bool(tracking_enabled() if enabled is None else enabled) and self.rank == 0
        if system_metrics is None:
            system_metrics = env_flag("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", True)
        self.system_metrics = system_metrics
        self.parent_run_id = parent_run_id or os.environ.get("MLFLOW_PARENT_RUN_ID") or None
        self.uri = uri
        self.flush_every_s = flush_every_s
        self.flush_every_n = flush_every_n
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.offline = False
        self.offline_path: Path | None = None

        self._extra_tags = dict(tags or {})
        self._client: Any = None  # the server's client, or the offline store's; None: records are dropped
        self._run: str | None = None  # the run id in that store
        self._monitor: Any = None
        self._started = self._ended = False
        self._experiment_parent = False  # parent_run_id is a `dvc exp run` experiment's (experiment_parent)
        self._params: dict[str, str] = {}  # everything logged: conflicts, and the offline run's header
        self._tags: dict[str, str] = {}
        self._pending_params: dict[str, str] = {}
        self._pending_tags: dict[str, str] = {}
        self._pending_metrics: list[tuple[str, float, int, int]] = []  # key, value, ms, step
        self._last_flush = time.monotonic()
        self._keys: dict[str, str] = {}
        self._key_names: dict[str, str] = {}  # MLflow key -> the first metric name logged as it

    # -- lifecycle

    def __enter__(self) -> Tracker:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        stopped = exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, Stopped))
        self.end("FINISHED" if exc_type is None else "KILLED" if stopped else "FAILED")
        return False

    def start(self) -> Tracker:
        """Create the run (or go offline). Idempotent; a no-op on inactive trackers."""
        if not self.active or self._started:
            return self
        self._started = True
        self.uri = self.uri or tracking_uri()
        reason = probe(self.uri)
        if self.uri.startswith(("http://", "https://")):
            for var, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(var, value)
        self._tags.update(self._run_tags())
        if reason is None:
            try:
                self._create_run()
            except Exception as err:
                reason = f"could not start a run at {redacted(self.uri)}: {_short(err)}"
        if reason is not None:
            self._go_offline(reason)
        return self

    def _run_tags(self) -> dict[str, str]:
        from mlflow.tracking.context.registry import resolve_tags  # user, source name and type

        tags = {"pipeline.stage": self.stage, "dvc.stage": os.environ.get("DVC_STAGE") or self.stage, **git_tags()}
        for var, tag in (("DVC_EXP_NAME", "dvc.exp_name"), ("DVC_EXP_BASELINE_REV", "dvc.exp_baseline_rev")):
            if os.environ.get(var):
                tags[tag] = os.environ[var]
        fingerprint = current_stage_fingerprint(self.stage)
        if fingerprint:
            tags["dvc.stage_hash"] = fingerprint
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        if os.environ.get(LAUNCH_ENV):
            tags[LAUNCH_TAG] = os.environ[LAUNCH_ENV]
        tags.update(_process_tags())
        tags.update(self._extra_tags)
        return {mlflow_key(k): _text(v) for k, v in resolve_tags(tags).items()}

    def _create_run(self) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(self.uri)
        exp_id = None
        if self.parent_run_id:
            try:
                exp_id = client.get_run(self.parent_run_id).info.experiment_id
            except MlflowException as err:
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("parent run %s not found; %s is logged as a top-level run", self.parent_run_id, self.stage)
                self._tags.pop("mlflow.parentRunId", None)
                self.parent_run_id = None
        if exp_id is None:
            exp_id = ensure_experiment(uri=self.uri, client=client)
        exp_name = os.environ.get("DVC_EXP_NAME")
        if not self.parent_run_id and exp_name and self.stage != EXPERIMENT_PARENT_NAME:
            self.parent_run_id = self._tags["mlflow.parentRunId"] = experiment_parent(client, exp_id, exp_name)
            self._experiment_parent = True
        run = client.create_run(exp_id, run_name=self.stage, tags=self._tags)
        self._client, self.experiment_id, self.run_id = client, exp_id, run.info.run_id
        self._run = self.run_id
        log.info("MLflow run %s (%s) in experiment %s at %s", self.run_id, self.stage, exp_id, redacted(self.uri))
        end_orphaned_runs(client, exp_id, self.stage, found_by=self.run_id)
        if self.system_metrics:
            try:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                self._monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.uri)
                self._monitor.start()
            except Exception as err:  # e.g. psutil missing: lose system metrics, not the run
                log.warning("system metrics are off: %s", err)
                self._monitor = None

    def end(self, status: str = "FINISHED") -> None:
        """Flush, stop system metrics and mark the run ``status``. Idempotent."""
        if not self.active or not self._started or self._ended:
            return
        self.flush()
        self._ended = True
        if self._monitor is not None:
            self._monitor.finish()  # catches its own errors
        self._call(f"ending run {self.run_id}", lambda c, run: c.set_terminated(run, status))
        if status != "FINISHED" and self._experiment_parent and not self.offline:
            # DVC stops the experiment at this stage: its parent run ends as this
            # stage did, as a flow's parent does, not FINISHED (experiment_parent)
            try:
                self._client.set_terminated(self.parent_run_id, status)
            except Exception as err:
                log.warning("experiment parent run %s not marked %s: %s", self.parent_run_id, status, _short(err))

    # -- logging

    def log_params(self, params: Any, prefix: str = "") -> None:
        """Log a config (pydantic model or nested dict, flattened to dotted names).
        Values are stringified (MLflow cuts long ones). Re-logging a key with a
        different value is skipped with a TrackingWarning: MLflow params are immutable."""
        if not self.active:
            return
        from pipeline.config import flatten

        for key, value in flatten(params, prefix).items():
            key, text = mlflow_key(key), _text(value)
            old = self._params.get(key)
            if old is not None and old != text:
                warnings.warn(f"param {key!r} already logged as {old!r}; ignoring {text!r}", TrackingWarning, stacklevel=2)
            elif old is None:
                self._params[key] = self._pending_params[key] = text
        self.flush()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags; sent at once in one batch."""
        if not self.active:
            return
        for key, value in tags.items():
            self._tags[mlflow_key(key)] = self._pending_tags[mlflow_key(key)] = _text(value)
        self.flush()

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Buffer ``metrics`` at ``step`` (default 0). Raises TypeError/ValueError for
        a value that is not a number, before anything is buffered."""
        if not self.active:
            return
        now, step = int(time.time() * 1000), int(step or 0)
        rows = []
        for name, value in metrics.items():
            key = self._keys.get(name)
            if key is None:
                key = self._keys[name] = mlflow_key(name)
                first = self._key_names.setdefault(key, name)
                if first != name:
                    warnings.warn(f"metrics {first!r} and {name!r} are both logged as {key!r} (MLflow refuses "
                                  "some characters in a key); their values share one series",
                                  TrackingWarning, stacklevel=2)
            rows.append((key, float(value), now, step))
        self._pending_metrics.extend(rows)
        if len(self._pending_metrics) >= self.flush_every_n or time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory under its own name, into the run's
        artifacts. A missing path is skipped with a TrackingWarning."""
        if not self.active or not self._started:
            return
        path = Path(path)
        if not path.exists():
            warnings.warn(f"artifact {path} does not exist; skipped", TrackingWarning, stacklevel=2)
        elif path.is_dir():
            dest = f"{artifact_path}/{path.name}" if artifact_path else path.name
            self._call(f"uploading {path}", lambda c, run: c.log_artifacts(run, str(path), dest))
        else:
            self._call(f"uploading {path}", lambda c, run: c.log_artifact(run, str(path), artifact_path))

    def log_dict(self, data: Any, artifact_file: str) -> None:
        """Store ``data`` as a JSON/YAML artifact named ``artifact_file``."""
        if self.active and self._started:
            self._call(f"logging {artifact_file}", lambda c, run: c.log_dict(run, data, artifact_file))

    def flush(self) -> None:
        """Send everything buffered in one ``log_batch`` (MLflow splits it to its
        request limits). Never raises for MLflow."""
        self._last_flush = time.monotonic()
        if not self.active or not self._started or self._ended:
            return
        params, tags, metrics = self._pending_params, self._pending_tags, self._pending_metrics
        if not (params or tags or metrics):
            return
        self._pending_params, self._pending_tags, self._pending_metrics = {}, {}, []
        from mlflow.entities import Metric, Param, RunTag

        batch = {
            "metrics": [Metric(*row) for row in metrics],
            "params": [Param(k, v) for k, v in params.items()],
            "tags": [RunTag(k, v) for k, v in tags.items()],
        }
        self._call(f"log_batch to {redacted(self.uri)}", lambda c, run: c.log_batch(run, **batch, synchronous=True))

    # -- outage

    def _call(self, what: str, fn: Callable[[Any, str], Any]) -> None:
        """``fn(client, run_id)``; if it fails on the server, go offline and do it
        again in the offline store (unknown how much landed: it is all kept)."""
        while self._client is not None:
            try:
                fn(self._client, self._run)
                return
            except Exception as err:
                if self.offline:
                    log.error("%s failed in the offline store %s: %s", what, self.offline_path, _short(err))
                    return
                self._go_offline(f"{what} failed: {_short(err)}")

    def _go_offline(self, reason: str) -> None:
        """Switch to a fresh local MLflow store holding this run's tags and params so far."""
        if self.offline:
            return
        self.offline = True
        self._client = None
        if self._monitor is not None:
            # Don't join it: its thread may be stuck in a request to the dead server.
            event = getattr(self._monitor, "_shutdown_event", None)
            if event is not None:
                event.set()
            self._monitor = None
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = project_root() / OFFLINE_DIR / f"{self.stage}-{stamp}-{os.getpid()}"
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Param

            path.mkdir(parents=True, exist_ok=True)
            uri = offline_uri(path)
            client = MlflowClient(uri)
            offline_tags = {"pipeline.offline.reason": reason[:1000], "pipeline.offline.tracking_uri": redacted(self.uri)}
            if self.run_id:
                offline_tags["pipeline.offline.run_id"] = self.run_id
            run = client.create_run(ensure_experiment(uri=uri, client=client), run_name=self.stage,
                                    tags={**self._tags, **offline_tags})
            client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in self._params.items()])
            self._client, self._run, self.offline_path = client, run.info.run_id, path
        except Exception as err:
            reason += f"; and the offline store {path} failed ({_short(err)})"
        where = (f"records go to {self.offline_path} (load them later with `python -m pipeline.tracking.tracker "
                 "replay DIR`)" if self.offline_path is not None else "its records are dropped")
        warnings.warn(f"MLflow tracking is offline for stage {self.stage!r}: {reason}. Training continues; {where}.",
                      TrackingOfflineWarning, stacklevel=3)


# --------------------------------------------------------------------------- dvc exp run


def experiment_parent(client: Any, experiment_id: str, exp_name: str) -> str:
    """The run that groups every stage of one ``dvc exp run`` experiment: found by
    its ``dvc.exp_name`` tag, or created (named ``pipeline``, like a flow's parent
    run, with the whole params.yaml flattened as params) and marked finished at
    once, since MLflow nests children under a finished parent just as well.
    Stages of an experiment run one after another, so find-or-create is enough.

    A stage that fails ends this run FAILED (KILLED on Ctrl-C) with it
    (:meth:`Tracker.end`), as a flow's parent ends. DVC commits no experiment
    then, so the name may be run again: the newest parent of that name is reused
    only if it did not fail, else the new attempt gets a parent of its own. A
    parent is also reused only for the same params.yaml and baseline commit
    (tag ``pipeline.exp_key``): ``dvc exp run -f -n NAME -S ...`` overwrites an
    experiment with other params, which the old parent's (immutable) params
    would misstate."""
    from mlflow.entities import Param

    from pipeline.config import flatten, load_yaml

    key = _experiment_key()
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`dvc.exp_name` = {_quoted(exp_name)} and tags.`pipeline.parent` = 'true' "
                      f"and tags.`{EXP_KEY_TAG}` = '{key}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if found and found[0].info.status not in ("FAILED", "KILLED"):
        return found[0].info.run_id
    tags = {"dvc.exp_name": exp_name, "pipeline.parent": "true", EXP_KEY_TAG: key, **git_tags()}
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.exp_baseline_rev"] = os.environ["DVC_EXP_BASELINE_REV"]
    run_id = client.create_run(experiment_id, run_name=EXPERIMENT_PARENT_NAME, tags=tags).info.run_id
    if Path("params.yaml").exists():
        flat = flatten(load_yaml("params.yaml") or {})
        client.log_batch(run_id, params=[Param(mlflow_key(k), _text(v)) for k, v in flat.items()])
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _experiment_key() -> str:
    """What one run of a dvc experiment is: its baseline commit and params.yaml (DVC
    writes the ``-S`` values into the workspace copy the stages run in)."""
    import hashlib

    digest = hashlib.sha256(os.environ.get("DVC_EXP_BASELINE_REV", "").encode() + b"\0")
    params = Path("params.yaml")
    digest.update(params.read_bytes() if params.is_file() else b"")
    return digest.hexdigest()[:16]


# The process that logs a run, so that a later run can tell it was killed outright.
HOST_TAG, PID_TAG, PID_STARTED_TAG = "pipeline.host", "pipeline.pid", "pipeline.pid_started"
# Its pid namespace: containers with host networking share the host name, not the pids.
PID_NS_TAG = "pipeline.pid_ns"
ENDED_BY_TAG = "pipeline.ended_by"


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``); None where the OS does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_tags() -> dict[str, str]:
    import psutil

    tags = {HOST_TAG: _hostname(), PID_TAG: str(os.getpid()), PID_STARTED_TAG: f"{psutil.Process().create_time():.2f}"}
    ns = _pid_namespace()
    if ns:
        tags[PID_NS_TAG] = ns
    return tags


def _process_alive(pid: int, started: float) -> bool:
    """Whether process ``pid``, started at ``started`` (not a later process that
    was given the same pid), is still alive; True when the OS will not say."""
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def end_orphaned_runs(client: Any, experiment_id: str, stage: str, found_by: str | None = None) -> list[str]:
    """End KILLED the runs of ``stage`` in the experiment that MLflow shows
    RUNNING though the process that logged them, on this host, has ended: a
    stage killed outright (SIGKILL, the kernel's OOM killer, a lost machine)
    could not end its own run, which would otherwise show as running for ever.
    Each gets a ``pipeline.ended_by`` tag that says so. A run logged from
    another pid namespace (another container with this host name) is left
    alone: its pid says nothing here. Called as a stage starts its run
    (``found_by``); returns the runs' ids and never raises."""
    import socket

    host, own_ns = socket.gethostname(), _pid_namespace()
    try:
        runs = client.search_runs([experiment_id], filter_string=(
            f"attributes.status = 'RUNNING' and tags.`pipeline.stage` = {_quoted(stage)} and "
            f"tags.`{HOST_TAG}` = {_quoted(host)}"),
            max_results=1000)
        ended = []
        for run in runs:
            tags = run.data.tags
            if run.info.run_id == found_by or PID_TAG not in tags or PID_STARTED_TAG not in tags:
                continue
            if PID_NS_TAG in tags and tags[PID_NS_TAG] != own_ns:
                continue
            pid = int(tags[PID_TAG])
            if _process_alive(pid, float(tags[PID_STARTED_TAG])):
                continue
            when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            client.set_tag(run.info.run_id, ENDED_BY_TAG,
                           f"found at {when} by run {found_by} of stage {stage}: its process (pid {pid} on {host}) "
                           "had ended without ending the run, so it was killed outright")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    except Exception as err:
        log.warning("could not check MLflow for runs of stage %s left RUNNING: %s", stage, _short(err))
        return []
    if ended:
        log.warning("ended KILLED %d MLflow run(s) of stage %s that a process killed outright left RUNNING: %s",
                    len(ended), stage, ", ".join(ended))
    return ended


def end_launch_runs(launch_id: str, status: str, uri: str | None = None) -> list[str]:
    """End as ``status`` the runs of one training launch (tagged with its id by
    rank 0's Tracker) that are still RUNNING: a rank that a signal stopped or
    killed could not end its own run, which MLflow would show as running for
    ever. Called by the launcher after its agent stopped the ranks. Returns the
    runs' ids; never raises (a warning says what failed)."""
    if not tracking_enabled():
        return []
    uri = uri or tracking_uri()
    if probe(uri) is not None:
        return []
    try:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids, filter_string=f"tags.`{LAUNCH_TAG}` = '{launch_id}' and "
                                                     "attributes.status = 'RUNNING'") if ids else []
        for run in runs:
            client.set_terminated(run.info.run_id, status)
            log.info("MLflow run %s (%s) ended %s", run.info.run_id, run.info.run_name, status)
        return [run.info.run_id for run in runs]
    except Exception as err:
        log.warning("could not end the stopped run in MLflow at %s: %s", redacted(uri), _short(err))
        return []


def record_experiment(stage: str, root: str | Path = ".", enabled: bool = True) -> None:
    """Under ``dvc exp run``: bring the experiment's parent run (:func:`experiment_parent`)
    up to date once ``stage`` has written its metrics, so that it carries what a
    flow's parent carries: metrics ``<stage>.<key>`` of ``stage`` and every stage
    upstream of it in DVC's graph (whether they ran here or were restored from the
    run cache), and tags ``dvc.stage_hash.<stage>`` (``stage`` itself as DVC will
    record it).

    ``root`` is the workspace the stage runs in (the temporary copy under
    ``--temp``/``--queue``), not ``DVC_ROOT``. A no-op outside an experiment, off
    rank 0, with tracking off, or when MLflow is unreachable; never raises."""
    exp_name = os.environ.get("DVC_EXP_NAME")
    if not (enabled and exp_name and tracking_enabled()) or int(os.environ.get("RANK", "0")) != 0:
        return
    uri = tracking_uri()
    reason = probe(uri)
    if reason:
        log.warning("experiment %s: parent run not updated: %s", exp_name, reason)
        return
    try:
        from mlflow import MlflowClient
        from mlflow.entities import Metric, RunTag

        from pipeline.config import metric_values

        stages = select(load_stages(root), [stage])
        metrics: dict[str, float] = {}
        for s in stages:
            metrics.update(metric_values(read_metrics(root, s), s.name))
        names = {s.name for s in stages}
        tags = {f"dvc.stage_hash.{k}": v for k, v in dvc_stage_hashes(root).items() if k in names}
        own = current_stage_fingerprint(stage, root)
        if own:
            tags[f"dvc.stage_hash.{stage}"] = own
        client = MlflowClient(uri)
        parent = experiment_parent(client, ensure_experiment(uri=uri, client=client), exp_name)
        now = int(time.time() * 1000)
        client.log_batch(parent, metrics=[Metric(mlflow_key(k), v, now, 0) for k, v in metrics.items()],
                         tags=[RunTag(mlflow_key(k), v) for k, v in tags.items()])
    except Exception as err:  # the stage already succeeded; lineage must not fail it
        log.warning("experiment %s: parent run not updated: %s", exp_name, _short(err))


# --------------------------------------------------------------------------- replay


def offline_uri(path: str | Path) -> str:
    """The MLflow URI of an offline store: its folder, or the ``mlflow.db`` in it."""
    path = Path(path).resolve()
    return f"sqlite:///{path / DB_FILE if path.is_dir() or not path.suffix else path}"


REPLAYED_FILE = "replayed.json"  # in an offline store, once replay_offline loaded it: where to


class ReplayError(RuntimeError):
    """An offline store cannot be replayed (not a store, still being written,
    already replayed to that server); the message is one line."""


class AlreadyReplayed(ReplayError):
    """The store was replayed to this tracking URI before; the CLI skips it."""


def _offline_store(path: str | Path) -> Path:
    """The folder of the offline store at ``path`` (the folder or its mlflow.db).
    Raises ReplayError, creating nothing, when there is no store there."""
    path = Path(path)
    folder = path.parent if path.name == DB_FILE else path
    if (folder / DB_FILE).is_file():
        return folder
    if not folder.is_dir():
        raise ReplayError(f"{path}: no such folder")
    inner = sorted(p.name for p in folder.iterdir() if (p / DB_FILE).is_file())
    hint = (f"; it holds {len(inner)} store(s), e.g. {inner[0]}: replay them with `replay {path}/*/`" if inner else
            f"; the stores are the folders under {OFFLINE_DIR}/")
    raise ReplayError(f"{path} is not an offline store (no {DB_FILE} in it){hint}")


def replay_offline(path: str | Path, *, uri: str | None = None) -> str:
    """Load the run of an offline store into MLflow (``uri``, default
    :func:`tracking_uri`) and return its run id there.

    The records go into the run the tracker had started on the server if it still
    exists (the server died mid-run), else into a new run named after the stage
    (under its parent, if that exists). The run ends with the status the tracker
    gave it, or FAILED if the process died first. The store then records where it
    went (``replayed.json``), so that replaying it again to the same tracking URI
    does not log its records twice.

    Raises ReplayError (one line, nothing created or logged) when ``path`` is not
    an offline store, when the process that writes it is still running, or when
    it was replayed to ``uri`` already; else MLflow's errors: this is an offline
    tool, not a trainer."""
    folder = _offline_store(path)
    uri = uri or tracking_uri()
    marker = folder / REPLAYED_FILE
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("uri") == redacted(uri):
            raise AlreadyReplayed(f"{path} was replayed into run {done.get('run_id')} at {done['uri']} on {done.get('at')} "
                              f"already; delete {marker} to replay it again")

    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.utils.file_utils import local_file_uri_to_path

    src = MlflowClient(offline_uri(folder))
    runs = src.search_runs([e.experiment_id for e in src.search_experiments()])
    if len(runs) != 1:  # the tracker could not start its run there (a full disk): nothing was logged into it
        raise ReplayError(f"{path}: the store holds {len(runs)} runs, not one; nothing to replay")
    run = runs[0]
    own = run.data.tags
    if run.info.status == "RUNNING" and PID_TAG in own and PID_STARTED_TAG in own \
            and own.get(HOST_TAG) == _hostname() and _process_alive(int(own[PID_TAG]), float(own[PID_STARTED_TAG])):
        raise ReplayError(f"{path}: its run is still being logged by process {own[PID_TAG]}; "
                          "replay it once that process has ended")
    tags = {k: v for k, v in own.items() if not k.startswith("pipeline.offline.")}
    if uri.startswith(("http://", "https://")):
        for var, value in HTTP_DEFAULTS.items():  # seconds, not minutes, if the server is down
            os.environ.setdefault(var, value)
        reason = probe(uri)
        if reason is not None:
            raise ReplayError(reason)
    client = MlflowClient(uri)
    run_id = run.data.tags.get("pipeline.offline.run_id")
    if run_id:
        try:
            client.get_run(run_id)
        except MlflowException:
            run_id = None
    if run_id is None:
        exp_name = src.get_experiment(run.info.experiment_id).name
        exp_id = ensure_experiment(exp_name, uri=client.tracking_uri, client=client)
        if "mlflow.parentRunId" in tags:
            try:
                exp_id = client.get_run(tags["mlflow.parentRunId"]).info.experiment_id
            except MlflowException:
                tags.pop("mlflow.parentRunId")
        run_id = client.create_run(exp_id, run_name=run.info.run_name, tags=tags).info.run_id
    metrics = [Metric(m.key, m.value, m.timestamp, m.step)
               for key in run.data.metrics for m in src.get_metric_history(run.info.run_id, key)]
    client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in run.data.params.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    artifacts = Path(local_file_uri_to_path(run.info.artifact_uri))
    if artifacts.is_dir() and any(artifacts.iterdir()):
        client.log_artifacts(run_id, str(artifacts))
    client.set_terminated(run_id, run.info.status if run.info.status in ("FINISHED", "FAILED", "KILLED") else "FAILED")
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    marker.write_text(json.dumps({"uri": redacted(uri), "run_id": run_id, "at": when}) + "\n")
    return run_id


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.tracking.tracker ui [--port N]`` runs the local MLflow UI;
    ``python -m pipeline.tracking.tracker replay DIR...`` loads offline stores."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.tracking.tracker")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ui = sub.add_parser("ui", help="serve the project's mlflow.db and mlartifacts/")
    ui.add_argument("--port", type=int, default=5000)
    rp = sub.add_parser("replay", help="load .tracking-offline/<run>/ stores into MLflow")
    rp.add_argument("dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "ui":
        cmd, env = server_command(args.port)
        os.execvpe(cmd[0], cmd, {**os.environ, **env})
    failed = 0
    for d in args.dirs:
        try:
            print(f"{d} -> run {replay_offline(d)}", flush=True)
        except AlreadyReplayed as err:  # `replay .tracking-offline/*/` again: the new stores only
            print(f"skipped: {err}", flush=True)
        except Exception as err:  # ReplayError, or MLflow's: one line each, and the other stores still go
            failed += 1
            print(f"error: {err if isinstance(err, ReplayError) else _short(err)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
