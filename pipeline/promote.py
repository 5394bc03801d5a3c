"""MLflow model registry for exports: every export a version, aliases for the best.

::

    from pipeline.promote import register_export

    result = register_export("models/export", model_name="llm-pipeline", run_id=tracker.run_id,
                             metrics={"sft": {"bits_per_byte": 1.31}, "pretrain": {...}})
    # {"registered": True, "version": 4, "candidate": 4, "champion": 2, "promoted": False, "reason": ...}

What one call does
    1. Logs the export folder as artifacts of run ``run_id`` (under ``model/``), or
       of a new run named ``register`` when no run is given. Stages should pass
       their own Tracker's ``run_id`` so the model sits beside the run's metrics.
    2. Creates the registered model if it is missing, then a model version whose
       ``source`` is the artifact URI of that folder. (``mlflow.register_model``
       cannot be used: MLflow 3 expects a "logged model" there, and
       ``mlflow.pytorch.log_model`` would export a torch.export program with a
       fixed sequence length; the Hugging Face folder is the model.)
    3. Stores the evaluation metrics as version tags ``metric.<dotted name>`` (a
       character MLflow refuses in a name, as in a source's default name
       ``data/raw/*.txt``, becomes ``_``), with
       ``primary_metric`` and ``lower_is_better``, so later comparisons read the
       registry alone and do not depend on runs that may be deleted.
    4. Points alias ``candidate`` at the new version, always.
    5. Moves alias ``champion`` to it only if :func:`should_promote` says its
       primary metric beats the champion's (read from the champion's tags): a tie
       keeps the champion, and a missing, NaN or infinite metric is never
       promoted. A champion without a valid (finite) value of the primary metric
       (e.g. registered under another primary metric) is beaten by any valid value.

Outages follow the project's policy: tracking disabled (``PIPELINE_TRACKING=0``),
an unreachable server or any MLflow error gives a ``RegistryWarning`` and a
result with ``registered: False`` and the reason, never an exception. The
tracking URI is ``pipeline.tracking.tracker.tracking_uri()``. mlflow is imported only
when a registration is attempted.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

from pipeline.config import metric_values
from pipeline.tracking.tracker import (
    HTTP_DEFAULTS,
    MAX_TAG_VAL_LENGTH,
    ensure_experiment,
    git_tags,
    mlflow_key,
    probe,
    project_root,
    redacted,
    tracking_enabled,
    tracking_uri,
)

CANDIDATE = "candidate"
CHAMPION = "champion"
METRIC_TAG = "metric."  # prefix of the version tags that hold metrics
ARTIFACT_PATH = "model"
DEFAULT_PRIMARY_METRIC = "sft.chat.bits_per_byte"  # the chat model on its own val split


class RegistryWarning(UserWarning):
    """The export could not be registered; the pipeline goes on without it."""


def should_promote(new: float | None, current: float | None, lower_is_better: bool = True) -> bool:
    """Whether a version whose primary metric is ``new`` should replace a champion
    whose metric is ``current``. ``None``, NaN or infinite as ``new``: never.
    ``None``, NaN or infinite as ``current`` (no champion, or one without a valid
    value): yes. Else only a strict improvement; a tie keeps the champion."""
    if not _is_number(new):
        return False
    if not _is_number(current):
        return True
    return new < current if lower_is_better else new > current


def check_primary_metric(metrics: Mapping[str, Any], primary_metric: str) -> None:
    """Raise ValueError, in one line that names the closest metrics, unless
    ``primary_metric`` is a dotted numeric leaf of ``metrics`` (NaN counts: that
    is a result). The export stage calls this before any work: a name that is
    not there would register every version as a candidate and none ever as the
    champion, without an error."""
    import difflib

    names = sorted(metric_values(metrics))
    if primary_metric in names:
        return
    close = difflib.get_close_matches(primary_metric, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(f"{primary_metric!r} is not a metric of the evaluation, so no export would ever be champion; "
                     f"{hint}it has {len(names)}: {', '.join(names)}")


def register_export(export_dir: str | Path, *, model_name: str, metrics: Mapping[str, Any],
                    run_id: str | None = None, primary_metric: str = DEFAULT_PRIMARY_METRIC,
                    lower_is_better: bool = True, tags: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Register ``export_dir`` as a new version of ``model_name`` (see the module doc).

    ``metrics`` may be nested; ``primary_metric`` names a dotted leaf. ``tags``
    (e.g. lineage: git commit, checkpoint fingerprint) are added to the version.
    Returns ``{registered: True, model_name, version, candidate, champion,
    previous_champion, promoted, reason, source, run_id}`` (versions as ints;
    champion None if there is none), or ``{registered: False, reason}`` plus
    what was done before the failure. Raises FileNotFoundError only for a missing
    ``export_dir`` or one without a model (``config.json`` and ``*.safetensors``).
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"{export_dir}: no export folder to register")
    if not (export_dir / "config.json").is_file() or not any(export_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{export_dir} is not a Hugging Face export (no config.json and *.safetensors); "
                                "register the folder the export stage wrote")
    if not tracking_enabled():
        return {"registered": False, "reason": "tracking is disabled (PIPELINE_TRACKING=0)"}
    uri = tracking_uri()
    reason = probe(uri)
    if reason is not None:
        return _not_registered(f"MLflow is unreachable: {reason}", {})
    if uri.startswith(("http://", "https://")):
        for var, value in HTTP_DEFAULTS.items():  # seconds, not minutes, if the server dies now
            os.environ.setdefault(var, value)
    flat = metric_values(metrics)
    done: dict[str, Any] = {}
    try:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        own_run = run_id is None
        if own_run:
            run_id = client.create_run(ensure_experiment(uri=uri, client=client), run_name="register",
                                       tags=git_tags()).info.run_id
        done["run_id"] = run_id
        client.log_artifacts(run_id, str(export_dir), ARTIFACT_PATH)
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}"
        done["source"] = source

        _ensure_registered_model(client, model_name)
        version_tags = {mlflow_key(f"{METRIC_TAG}{k}"): repr(v) for k, v in flat.items()}
        version_tags.update({"primary_metric": primary_metric, "lower_is_better": str(lower_is_better).lower()})
        version_tags.update({mlflow_key(k): redacted(str(v))[:MAX_TAG_VAL_LENGTH] for k, v in (tags or {}).items()})
        mv = client.create_model_version(model_name, source=source, run_id=run_id, tags=version_tags,
                                         description=f"export of {export_dir}; {primary_metric}="
                                                     f"{flat.get(primary_metric)}")
        version = int(mv.version)
        done["version"] = version
        client.set_registered_model_alias(model_name, CANDIDATE, str(version))
        done["candidate"] = version

        with _promoting(project_root()):
            previous, current = _champion(client, model_name, primary_metric)
            new = flat.get(primary_metric)
            promoted = should_promote(new, current, lower_is_better)
            if promoted:
                client.set_registered_model_alias(model_name, CHAMPION, str(version))
        if own_run:
            client.set_terminated(run_id)
    except Exception as err:  # outage policy: warn and carry on without the registry
        if "run_id" in done and own_run:  # the run made for this registration ends, as FAILED, not RUNNING
            with contextlib.suppress(Exception):  # the server may be what failed
                client.set_terminated(run_id, "FAILED")
        return _not_registered(redacted(f"registering {export_dir} as {model_name!r} failed: "
                                        f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"), done)
    return {
        "registered": True,
        "model_name": model_name,
        **done,
        "champion": version if promoted else previous,
        "previous_champion": previous,
        "promoted": promoted,
        "reason": _reason(primary_metric, new, previous, current, promoted, lower_is_better),
    }


# --------------------------------------------------------------------------- helpers


PROMOTE_LOCK = ".promote.lock"


@contextlib.contextmanager
def _promoting(root: Path) -> Iterator[None]:
    """An exclusive lock on ``root/.promote.lock`` (flock) for as long as the
    champion is read, compared and moved. Where none can be taken (no flock, a
    read-only project folder) the registration goes on without it, with a
    warning, as for any other registry trouble."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        f = open(Path(root) / PROMOTE_LOCK, "a")
    except OSError as err:
        warnings.warn(f"moving the champion without a lock ({root / PROMOTE_LOCK}: {err.strerror}): an export "
                      "registering meanwhile could move it too", RegistryWarning, stacklevel=3)
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_number(x: Any) -> bool:
    # finite: an infinite bits-per-byte is a diverged evaluation, as NaN is, and an
    # infinite champion (-inf where lower is better) could never be beaten
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _not_registered(reason: str, done: dict[str, Any]) -> dict[str, Any]:
    warnings.warn(f"model not registered: {reason}", RegistryWarning, stacklevel=3)
    return {"registered": False, "reason": reason, **done}


def _ensure_registered_model(client: Any, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            client.create_registered_model(name, description="Exports of the llm-pipeline, one version each.")
        except MlflowException as err2:  # created meanwhile by a parallel run
            if err2.error_code != "RESOURCE_ALREADY_EXISTS":
                raise


def _champion(client: Any, name: str, primary_metric: str) -> tuple[int | None, float | None]:
    """(version, primary metric value) of the current champion; (None, None) if none."""
    from mlflow.exceptions import MlflowException

    try:
        mv = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None, None
        raise
    raw = (mv.tags or {}).get(mlflow_key(f"{METRIC_TAG}{primary_metric}"))
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        value = None
    return int(mv.version), value


def _reason(metric: str, new: float | None, previous: int | None, current: float | None, promoted: bool,
            lower_is_better: bool) -> str:
    better = "lower" if lower_is_better else "higher"
    if not _is_number(new):
        return f"{metric} is missing, NaN or infinite: never champion" + (f"; v{previous} stays" if previous else "")
    if previous is None:
        return f"first version with {metric}={new:.6g}: champion"
    if not _is_number(current):
        return f"champion v{previous} has no valid {metric}; {new:.6g} replaces it"
    if promoted:
        return f"{metric} {new:.6g} beats champion v{previous} ({current:.6g}; {better} is better)"
    return f"{metric} {new:.6g} does not beat champion v{previous} ({current:.6g}; {better} is better, ties keep it)"
