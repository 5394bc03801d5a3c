"""MLflow tracking for pipeline stages: rank-0 only, batched, and outage-proof.

Usage, in a stage or a trainer::

    from pipeline.tracking.tracker import Tracker

    with Tracker("pretrain") as t:              # run name = stage name
        t.log_params(cfg)                       # config (model or dict), flattened to dotted names
        t.log_params({"world_size": 2, "precision": "bf16"})
        for step in ...:
            t.log_metrics({"loss": loss, "lr": lr}, step=step)   # buffered
        t.log_artifact("models/pretrain/meta.json")
        t.log_dict(summary, "summary.json")
    # t.run_id is None and t.offline is True when MLflow could not be reached.

Where things go
    * Project root (``project_root()``): ``$PIPELINE_ROOT``, else ``$DVC_ROOT``, else
      the current directory. DVC sets ``DVC_ROOT`` for every stage command and, under
      ``dvc exp run --temp`` / ``--queue``, points it at the *original* repository
      rather than the temporary copy the stage runs in. So ``mlflow.db``,
      ``mlartifacts/`` and ``.tracking-offline/`` land in the real repository and
      survive DVC deleting that copy.
    * Tracking URI (``tracking_uri()``): ``$MLFLOW_TRACKING_URI`` when set, else
      ``sqlite:///<root>/mlflow.db``, the same database ``make mlflow`` serves.
    * Experiment (``ensure_experiment()``): ``$MLFLOW_EXPERIMENT_NAME`` or
      ``llm-pipeline``. When we create it, its artifact location is an absolute
      ``file://`` URI (``artifact_location()``): ``<root>/mlartifacts`` for the
      default database and for a server on this machine, the ``mlartifacts`` folder
      beside the database for another SQLite URI, and the server's own default for
      a remote server. ``make mlflow`` serves that same folder
      (``--artifacts-destination``), so runs logged directly to ``mlflow.db`` show
      up in its UI with their artifacts. Runs land in ``mlartifacts/<run id>/``;
      experiments the server itself created use ``mlartifacts/<exp id>/<run id>/``.
    * DVC files (``dvc.yaml``, ``dvc.lock``, ``params.yaml``) and git state are read
      from the current directory: that is the copy whose code and params are running.

Behaviour
    * Only rank 0 logs (``rank`` argument, else ``$RANK``). Other ranks, and
      ``enabled=False`` or ``PIPELINE_TRACKING=0``, get a no-op tracker that never
      imports mlflow.
    * Metrics are buffered and sent with ``MlflowClient.log_batch`` every
      ``flush_every_s`` seconds or ``flush_every_n`` records, and at the end. Params
      and tags are sent in batches as soon as they are logged.
    * Runs are children of ``$MLFLOW_PARENT_RUN_ID`` when set, in the parent's
      experiment so that the UI nests them.
    * Outage: an http(s) server is probed at ``<uri>/health`` with a 3 s timeout
      before mlflow is imported. If it is unreachable, or any MLflow call fails
      later (start, a flush, an artifact, ending the run), the tracker emits one
      ``TrackingOfflineWarning`` and from then on writes every record it would have
      sent to ``<root>/.tracking-offline/<stage>-<utc time>-<pid>.jsonl``. Nothing is
      raised. ``replay_offline()`` loads such a file into MLflow later. For http(s)
      URIs the tracker also sets short MLflow HTTP retry and timeout defaults (see
      ``HTTP_DEFAULTS``) unless the user already set them, so a server that dies
      mid-run costs seconds, not MLflow's default minutes of retries.

Environment read: MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, MLFLOW_PARENT_RUN_ID,
PIPELINE_ROOT, PIPELINE_TRACKING, RANK, MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING, and the
variables DVC sets for stage commands: DVC_ROOT, DVC_STAGE, DVC_EXP_NAME and
DVC_EXP_BASELINE_REV (the last two only under ``dvc exp run``; see
``dvc/repo/experiments/queue/base.py`` and ``dvc/stage/run.py`` in dvc 3.67).

Importing this module is cheap: mlflow, pydantic and the YAML parsers are imported
inside the functions that need them.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "llm-pipeline"
DB_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
OFFLINE_DIR = ".tracking-offline"
PROBE_TIMEOUT_S = 3.0

# MLflow's limits from mlflow.utils.validation, copied so that this module imports
# without mlflow; tests/pipeline/tracking/test_tracker.py checks that they still agree.
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000
TRUNCATED = "...[truncated]"

# MLflow's own defaults retry for about four minutes with a 120 s timeout per try,
# which would freeze a training loop whose server went away. These bound one failing
# call to about 2 x 10 s + 1 s; after that the tracker is offline and stops calling.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

# Names MLflow accepts for params, metrics and tags (it also allows ':' off Windows;
# we don't, so the same names work everywhere).
_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


class TrackingOfflineWarning(UserWarning):
    """MLflow could not be reached or failed; records go to a local JSONL file."""


class TrackingWarning(UserWarning):
    """A caller-side problem the tracker skipped (e.g. a conflicting param value)."""


# --------------------------------------------------------------------------- where


def project_root() -> Path:
    """The directory that holds mlflow.db, mlartifacts/ and .tracking-offline/.

    ``$PIPELINE_ROOT``, else ``$DVC_ROOT`` (the original repo even inside a
    ``dvc exp run --temp`` copy), else the current directory; always absolute."""
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
    """The absolute artifact root to give a new experiment for ``uri``.

    ``file://<root>/mlartifacts`` for a server on this machine too, so that an
    experiment first created through ``make mlflow`` still takes artifacts when a
    later run writes to ``mlflow.db`` directly (a proxied ``mlflow-artifacts:``
    location needs the server). None for remote servers and databricks: the
    server decides."""
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
    """Return the id of experiment ``name``, creating it with an absolute artifact
    location if needed, and restoring it if it was deleted. Raises MLflow's errors."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = uri or tracking_uri()
    client = client or MlflowClient(uri)
    name = name or experiment_name()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location(uri))
        except MlflowException:
            # Another rank-0 process (a parallel queued experiment) created it first.
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def server_command(port: int = 5000, host: str = "127.0.0.1", root: str | Path | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for a local MLflow UI over the default database;
    the same command as ``make mlflow``. One worker and no job runner: healthy in
    about 9 s, and no consumer processes left behind (see ENVIRONMENT.md)."""
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
    probed (one GET of ``<uri>/health``, no retries); others are tried for real."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered: reachable, even if /health is not served there
    except Exception as err:  # refused, timed out, DNS, or not speaking HTTP at all
        import ssl

        reason = getattr(err, "reason", None) or err
        if isinstance(reason, ssl.SSLError):
            return None  # it answered; MLflow's own TLS settings may accept it
        return f"{uri} is unreachable ({reason})"


# --------------------------------------------------------------------------- DVC


def _load_yaml(path: Path) -> Any:
    # DVC parses its files with ruamel (YAML 1.2); PyYAML (YAML 1.1) reads e.g. 1e-3
    # as a string, which would change the hash. Fall back only if ruamel is missing.
    text = path.read_text(encoding="utf-8")
    try:
        from ruamel.yaml import YAML
    except ImportError:
        import yaml

        return yaml.safe_load(text)
    return YAML(typ="safe").load(text)


def _drop_keys(node: Any, names: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_drop_keys(x, names) for x in node]
    if isinstance(node, dict):
        return {k: _drop_keys(v, names) for k, v in node.items() if k not in names}
    return node


def lock_entry_hash(entry: Mapping[str, Any]) -> str:
    """DVC's run-cache key for one stage's ``dvc.lock`` entry.

    sha256 of the sorted JSON of cmd, deps (path and md5), params values and the
    out *paths*, with ``size``/``nfiles`` removed at every level: what DVC 3
    computes in ``dvc/stage/cache.py`` to name ``.dvc/cache/runs/<k[:2]>/<k>``. It
    changes exactly when the stage's command, inputs or params change, and outputs
    don't affect it."""
    entry = dict(entry)
    entry["outs"] = [out["path"] for out in entry.get("outs", [])]
    data = _drop_keys(entry, ("size", "nfiles"))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()


def dvc_stage_hashes(root: str | Path = ".") -> dict[str, str]:
    """``{stage: lock_entry_hash}`` for every stage recorded in ``root/dvc.lock``;
    empty if there is no lock file. Raises on an unreadable lock file."""
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (_load_yaml(lock) or {}).get("stages") or {}
    return {name: lock_entry_hash(entry) for name, entry in stages.items()}


def _md5_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _md5_dir(path: Path) -> str:
    # DVC 3's directory hash: md5 of the sorted JSON list of {md5, relpath}, plus
    # ".dir". .dvcignore patterns are not applied; DVC's own folders are skipped.
    entries = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".dvc", ".hg")]
        for name in filenames:
            full = Path(dirpath, name)
            entries.append({"md5": _md5_file(full), "relpath": full.relative_to(path).as_posix()})
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def _path_of(item: Any) -> str:
    return next(iter(item)) if isinstance(item, dict) else str(item)


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def current_stage_fingerprint(stage: str, root: str | Path = ".") -> str | None:
    """The :func:`lock_entry_hash` that ``dvc.lock`` will record for ``stage`` once
    it finishes with the current inputs, computed from ``dvc.yaml``, ``params.yaml``
    and the files on disk. Call it while the stage runs: the lock still holds the
    previous run's entry then.

    Deps that are an upstream stage's output path take their hash from that
    stage's (already current) lock entry; other deps are hashed here, which costs
    a read of those files. Returns None where this cannot mirror DVC: a stage not
    in ``dvc.yaml``, ``foreach``/``matrix``/``${}`` templating, a ``wdir``, a
    missing dep or param, or a non-YAML params file. Assumes DVC 3 (md5) hashing."""
    root = Path(root)
    try:
        spec = ((_load_yaml(root / "dvc.yaml") or {}).get("stages") or {}).get(stage)
        if not isinstance(spec, dict) or "cmd" not in spec:
            return None
        if {"foreach", "matrix", "wdir"} & spec.keys() or "${" in json.dumps(spec):
            return None
        lock_path = root / "dvc.lock"
        lock_stages = ((_load_yaml(lock_path) or {}).get("stages") or {}) if lock_path.exists() else {}
        upstream = {
            out["path"]: out
            for name, entry in lock_stages.items() if name != stage
            for out in entry.get("outs", [])
        }

        deps = []
        for path in sorted(_path_of(d) for d in spec.get("deps") or []):
            if path in upstream:
                deps.append({**upstream[path], "path": path})
            elif (root / path).is_dir():
                deps.append({"path": path, "hash": "md5", "md5": _md5_dir(root / path)})
            elif (root / path).is_file():
                deps.append({"path": path, "hash": "md5", "md5": _md5_file(root / path)})
            else:
                return None

        params: dict[str, dict[str, Any]] = {}
        for item in spec.get("params") or []:
            files = item if isinstance(item, dict) else {"params.yaml": [item]}
            for fname, keys in files.items():
                if not fname.endswith((".yaml", ".yml")):
                    return None
                tree = _load_yaml(root / fname) or {}
                values = params.setdefault(fname, {})
                for key in keys or list(tree):
                    values[key] = _lookup(tree, key)

        entry: dict[str, Any] = {"cmd": spec["cmd"]}
        if deps:
            entry["deps"] = deps
        if params:
            entry["params"] = params
        outs = [_path_of(o) for field in ("outs", "metrics", "plots") for o in spec.get(field) or []]
        entry["outs"] = [{"path": p} for p in sorted(outs)]
        return lock_entry_hash(entry)
    except Exception as err:  # a missing key or a YAML syntax error must not stop a training run
        log.debug("no DVC fingerprint for stage %r: %s", stage, err)
        return None


# --------------------------------------------------------------------------- git


EXPERIMENT_PARENT_NAME = "pipeline"


def experiment_parent(client: Any, experiment_id: str, exp_name: str) -> str:
    """The run that groups every stage of one ``dvc exp run`` experiment: found by
    its ``dvc.exp_name`` tag, or created (named ``pipeline``, like a flow's parent
    run, with the whole params.yaml flattened as params) and marked finished at
    once, since MLflow nests children under a finished parent just as well.
    Stages of an experiment run one after another, so find-or-create is enough."""
    from mlflow.entities import Param

    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`dvc.exp_name` = '{exp_name}' and tags.`pipeline.parent` = 'true'",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    tags = {"dvc.exp_name": exp_name, "pipeline.parent": "true", **git_tags()}
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.exp_baseline_rev"] = os.environ["DVC_EXP_BASELINE_REV"]
    run = client.create_run(experiment_id, run_name=EXPERIMENT_PARENT_NAME, tags=tags)
    params_file = Path("params.yaml")
    if params_file.exists():
        from pipeline.config import flatten

        flat = flatten(_load_yaml(params_file) or {})
        params = [Param(_key(k), _value(v, MAX_PARAM_VAL_LENGTH)) for k, v in flat.items()]
        for i in range(0, len(params), 100):
            client.log_batch(run.info.run_id, params=params[i:i + 100])
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def git_tags(cwd: str | Path = ".") -> dict[str, str]:
    """``mlflow.source.git.commit`` (HEAD, shown by the MLflow UI) and ``git.dirty``
    ("true" if tracked files differ from HEAD); empty outside a git checkout."""

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


# --------------------------------------------------------------------------- values


def _key(name: Any) -> str:
    key = _BAD_KEY_CHARS.sub("_", str(name)).strip("/") or "_"
    return key[:MAX_ENTITY_KEY_LENGTH]


def _value(value: Any, limit: int) -> str:
    if isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    return raw not in ("0", "false", "no", "off")


# --------------------------------------------------------------------------- tracker


class Tracker:
    """One MLflow run for one stage, logged from rank 0 only. See the module doc.

    Use as a context manager (or call :meth:`start` and :meth:`end`). Leaving the
    block with an exception ends the run as FAILED (KILLED for KeyboardInterrupt)
    and lets the exception propagate. No method raises because of MLflow; caller
    errors (a metric that is not a number) do raise.

    Attributes: ``run_id`` (None on other ranks and when offline from the start),
    ``offline`` (True once records go to ``offline_path``), ``active`` (rank 0 and
    enabled)."""

    def __init__(
        self,
        stage: str,
        *,
        rank: int | None = None,
        enabled: bool | None = None,
        system_metrics: bool | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        flush_every_s: float = 10.0,
        flush_every_n: int = 1000,
    ) -> None:
        self.stage = stage
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if enabled is None:
            enabled = _env_flag("PIPELINE_TRACKING", True)
        self.active = bool(enabled) and self.rank == 0
        if system_metrics is None:
            system_metrics = _env_flag("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", True)
        self.system_metrics = system_metrics
        self.parent_run_id = parent_run_id or os.environ.get("MLFLOW_PARENT_RUN_ID") or None
        self.flush_every_s = flush_every_s
        self.flush_every_n = flush_every_n
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.offline = False
        self.offline_path: Path | None = None
        self.uri: str | None = None

        self._extra_tags = dict(tags or {})
        self._client: Any = None
        self._monitor: Any = None
        self._started = self._ended = False
        self._params: dict[str, str] = {}  # everything logged, for conflicts and the offline header
        self._tags: dict[str, str] = {}
        self._pending_params: dict[str, str] = {}
        self._pending_tags: dict[str, str] = {}
        self._pending_metrics: list[tuple[str, float, int, int]] = []  # key, value, ms, step
        self._last_flush = time.monotonic()
        self._offline_file: IO[str] | None = None
        self._keys: dict[str, str] = {}

    # -- lifecycle

    def __enter__(self) -> Tracker:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        self.end(status)
        return False

    def start(self) -> Tracker:
        """Create the run (or go offline). Idempotent; a no-op on inactive trackers."""
        if not self.active or self._started:
            return self
        self._started = True
        self.uri = tracking_uri()
        self._tags.update(self._run_tags())
        reason = probe(self.uri)
        if reason is None:
            try:
                self._create_run()
            except Exception as err:
                reason = f"could not start a run at {self.uri}: {_short(err)}"
        if reason is not None:
            self._go_offline(reason)
        return self

    def _run_tags(self) -> dict[str, str]:
        tags = {
            "pipeline.stage": self.stage,
            "dvc.stage": os.environ.get("DVC_STAGE") or self.stage,
            "mlflow.user": _user(),
            "mlflow.source.name": " ".join(sys.argv)[:MAX_TAG_VAL_LENGTH] or self.stage,
            "mlflow.source.type": "LOCAL",
        }
        tags.update(git_tags())
        for var, tag in (("DVC_EXP_NAME", "dvc.exp_name"), ("DVC_EXP_BASELINE_REV", "dvc.exp_baseline_rev")):
            if os.environ.get(var):
                tags[tag] = os.environ[var]
        fingerprint = current_stage_fingerprint(self.stage)
        if fingerprint:
            tags["dvc.stage_hash"] = fingerprint
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        tags.update({str(k): v for k, v in self._extra_tags.items()})
        return {_key(k): _value(v, MAX_TAG_VAL_LENGTH) for k, v in tags.items()}

    def _create_run(self) -> None:
        if self.uri.startswith(("http://", "https://")):
            for var, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(var, value)
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
            self.parent_run_id = experiment_parent(client, exp_id, exp_name)
            self._tags["mlflow.parentRunId"] = self.parent_run_id
        run = client.create_run(exp_id, run_name=self.stage, tags=self._tags)
        self._client, self.experiment_id, self.run_id = client, exp_id, run.info.run_id
        log.info("MLflow run %s (%s) in experiment %s at %s", self.run_id, self.stage, exp_id, self.uri)
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
        if not self.offline:
            if self._monitor is not None:
                self._monitor.finish()  # catches its own errors
            try:
                self._client.set_terminated(self.run_id, status)
            except Exception as err:
                self._go_offline(f"ending run {self.run_id} failed: {_short(err)}")
        if self.offline:
            self._write({"type": "end", "status": status, "time": time.time()})
            self._close_offline()

    # -- logging

    def log_params(self, params: Any, prefix: str = "") -> None:
        """Log a config (pydantic model or nested dict, flattened to dotted names)
        plus any flat extras. Values are stringified and cut to MLflow's 6000-char
        limit. Re-logging a key with a different value is skipped with a
        TrackingWarning, since MLflow params are immutable."""
        if not self.active:
            return
        from pipeline.config import flatten

        for key, value in flatten(params, prefix).items():
            key, text = _key(key), _value(value, MAX_PARAM_VAL_LENGTH)
            old = self._params.get(key)
            if old is not None and old != text:
                warnings.warn(f"param {key!r} already logged as {old!r}; ignoring {text!r}", TrackingWarning, stacklevel=2)
                continue
            if old is None:
                self._params[key] = self._pending_params[key] = text
        self.flush()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values cut to 8000 chars); sent at once in one batch."""
        if not self.active:
            return
        for key, value in tags.items():
            key = _key(key)
            self._tags[key] = self._pending_tags[key] = _value(value, MAX_TAG_VAL_LENGTH)
        self.flush()

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Buffer ``metrics`` at ``step`` (default 0). Raises TypeError/ValueError for
        a value that is not a number, before anything is buffered."""
        if not self.active:
            return
        now = int(time.time() * 1000)
        step = int(step or 0)
        rows = []
        for name, value in metrics.items():
            key = self._keys.get(name)
            if key is None:
                key = self._keys[name] = _key(name)
            rows.append((key, float(value), now, step))
        self._pending_metrics.extend(rows)
        if len(self._pending_metrics) >= self.flush_every_n or time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_metric(self, key: str, value: Any, step: int | None = None) -> None:
        self.log_metrics({key: value}, step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory under its own name, into the run's
        artifacts. A missing path is skipped with a TrackingWarning."""
        if not self.active or not self._started:
            return
        path = Path(path)
        if not path.exists():
            warnings.warn(f"artifact {path} does not exist; skipped", TrackingWarning, stacklevel=2)
            return
        if not self.offline:
            try:
                if path.is_dir():
                    dest = f"{artifact_path}/{path.name}" if artifact_path else path.name
                    self._client.log_artifacts(self.run_id, str(path), dest)
                else:
                    self._client.log_artifact(self.run_id, str(path), artifact_path)
                return
            except Exception as err:
                self._go_offline(f"uploading {path} failed: {_short(err)}")
        # The file stays where it is; the record says where to find it for replay.
        self._write({"type": "artifact", "local_path": str(path.resolve()), "artifact_path": artifact_path})

    def log_dict(self, data: Any, artifact_file: str) -> None:
        """Store ``data`` as a JSON/YAML artifact named ``artifact_file``."""
        if not self.active or not self._started:
            return
        if not self.offline:
            try:
                self._client.log_dict(self.run_id, data, artifact_file)
                return
            except Exception as err:
                self._go_offline(f"logging {artifact_file} failed: {_short(err)}")
        self._write({"type": "dict", "artifact_file": artifact_file, "data": data})

    def flush(self) -> None:
        """Send (or, offline, write) everything buffered. Never raises for MLflow."""
        self._last_flush = time.monotonic()
        if not self.active or not self._started or self._ended:
            return
        params, tags, metrics = self._pending_params, self._pending_tags, self._pending_metrics
        if not (params or tags or metrics):
            return
        self._pending_params, self._pending_tags, self._pending_metrics = {}, {}, []
        if not self.offline:
            chunks = list(_chunks(list(params.items()), list(tags.items()), metrics))
            for i, (p, t, m) in enumerate(chunks):
                try:
                    self._send(p, t, m)
                except Exception as err:
                    # Unknown how much of this chunk landed; keep it and the rest locally.
                    self._go_offline(f"log_batch to {self.uri} failed: {_short(err)}")
                    for p, t, m in chunks[i:]:
                        self._write_records(dict(p), dict(t), m)
                    return
            return
        self._write_records(params, tags, metrics)

    def _send(self, params: list, tags: list, metrics: list) -> None:
        from mlflow.entities import Metric, Param, RunTag

        self._client.log_batch(
            self.run_id,
            metrics=[Metric(k, v, ts, s) for k, v, ts, s in metrics],
            params=[Param(k, v) for k, v in params],
            tags=[RunTag(k, v) for k, v in tags],
            synchronous=True,
        )

    # -- offline

    def _go_offline(self, reason: str) -> None:
        if self.offline:
            return
        self.offline = True
        if self._monitor is not None:
            # Don't join it: its thread may be stuck in a request to the dead server.
            event = getattr(self._monitor, "_shutdown_event", None)
            if event is not None:
                event.set()
            self._monitor = None
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = project_root() / OFFLINE_DIR / f"{self.stage}-{stamp}-{os.getpid()}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._offline_file = open(path, "a", encoding="utf-8", buffering=1)
            self.offline_path = path
        except OSError as err:
            reason += f"; and {path} is not writable ({err}), so records are dropped"
        warnings.warn(
            f"MLflow tracking is offline for stage {self.stage!r}: {reason}. "
            f"Training continues; records go to {self.offline_path}.",
            TrackingOfflineWarning,
            stacklevel=3,
        )
        self._write({
            "type": "run", "stage": self.stage, "experiment": experiment_name(), "tracking_uri": self.uri,
            "run_id": self.run_id, "parent_run_id": self.parent_run_id, "reason": reason, "time": time.time(),
        })
        # The header repeats what was already sent, so the file alone can rebuild the run.
        self._write({"type": "tags", "tags": self._tags})
        if self._params:
            self._write({"type": "params", "params": self._params})

    def _write_records(self, params: Mapping[str, str], tags: Mapping[str, str], metrics: list) -> None:
        if params:
            self._write({"type": "params", "params": dict(params)})
        if tags:
            self._write({"type": "tags", "tags": dict(tags)})
        for key, value, ts, step in metrics:
            self._write({"type": "metric", "key": key, "value": value, "timestamp": ts, "step": step})

    def _write(self, record: dict) -> None:
        if self._offline_file is None:
            return
        try:
            self._offline_file.write(json.dumps(record, default=str) + "\n")
        except (OSError, ValueError) as err:
            log.error("cannot write %s: %s", self.offline_path, err)

    def _close_offline(self) -> None:
        if self._offline_file is None:
            return
        try:
            self._offline_file.flush()
            os.fsync(self._offline_file.fileno())
            self._offline_file.close()
        except (OSError, ValueError) as err:
            log.error("cannot close %s: %s", self.offline_path, err)
        self._offline_file = None


def _chunks(params: list, tags: list, metrics: list) -> Iterator[tuple[list, list, list]]:
    """Split into log_batch calls within MLflow's per-request limits."""
    while params or tags or metrics:
        p, params = params[:MAX_PARAMS_TAGS_PER_BATCH], params[MAX_PARAMS_TAGS_PER_BATCH:]
        t, tags = tags[:MAX_PARAMS_TAGS_PER_BATCH], tags[MAX_PARAMS_TAGS_PER_BATCH:]
        room = MAX_ENTITIES_PER_BATCH - len(p) - len(t)
        m, metrics = metrics[:room], metrics[room:]
        yield p, t, m


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    return text if len(text) <= 300 else text[:299] + "…"


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return "unknown"


# --------------------------------------------------------------------------- replay


def read_offline(path: str | Path) -> list[dict]:
    """The records of an offline file; a torn last line (a crash mid-write) is dropped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: skipped a malformed line", path)
    return records


def replay_offline(path: str | Path, *, uri: str | None = None) -> str:
    """Load an offline JSONL file into MLflow and return the run id.

    The records go into the run named in the file if it still exists (the server
    died mid-run), else into a new run named after the stage (under its parent, if
    it had one). The run is marked with the recorded end status, or FAILED if the
    file has none. Raises MLflow's errors: this is an offline tool, not a trainer."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException

    records = read_offline(path)
    header = next((r for r in records if r["type"] == "run"), {})
    uri = uri or tracking_uri()
    client = MlflowClient(uri)
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    metrics = []
    for r in records:
        if r["type"] == "params":
            params.update(r["params"])
        elif r["type"] == "tags":
            tags.update(r["tags"])
        elif r["type"] == "metric":
            metrics.append(Metric(r["key"], float(r["value"]), r["timestamp"], r["step"]))

    run_id = header.get("run_id")
    if run_id:
        try:
            client.get_run(run_id)
        except MlflowException:
            run_id = None
    if run_id is None:
        exp_id = ensure_experiment(header.get("experiment"), uri=uri, client=client)
        parent = tags.get("mlflow.parentRunId")
        if parent:
            try:
                exp_id = client.get_run(parent).info.experiment_id
            except MlflowException:
                tags.pop("mlflow.parentRunId")
        run_id = client.create_run(exp_id, run_name=header.get("stage"), tags=tags).info.run_id
    for p, t, m in _chunks([Param(k, v) for k, v in params.items()], [RunTag(k, v) for k, v in tags.items()], metrics):
        client.log_batch(run_id, metrics=m, params=p, tags=t, synchronous=True)
    for r in records:
        if r["type"] == "artifact" and Path(r["local_path"]).exists():
            local = Path(r["local_path"])
            if local.is_dir():
                dest = f"{r['artifact_path']}/{local.name}" if r["artifact_path"] else local.name
                client.log_artifacts(run_id, str(local), dest)
            else:
                client.log_artifact(run_id, str(local), r["artifact_path"])
        elif r["type"] == "dict":
            client.log_dict(run_id, r["data"], r["artifact_file"])
    end = next((r for r in reversed(records) if r["type"] == "end"), None)
    client.set_terminated(run_id, end["status"] if end else "FAILED")
    return run_id


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.tracking.tracker ui [--port N]`` runs the local MLflow UI;
    ``python -m pipeline.tracking.tracker replay FILE...`` loads offline files."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.tracking.tracker")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ui = sub.add_parser("ui", help="serve the project's mlflow.db and mlartifacts/")
    ui.add_argument("--port", type=int, default=5000)
    rp = sub.add_parser("replay", help="load .tracking-offline/*.jsonl files into MLflow")
    rp.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "ui":
        cmd, env = server_command(args.port)
        os.execvpe(cmd[0], cmd, {**os.environ, **env})
    for f in args.files:
        print(f"{f} -> run {replay_offline(f)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
