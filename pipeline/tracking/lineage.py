"""The DVC side of lineage, read through DVC's own API: the one stage graph, the
stage hashes, and the metrics files each stage declares.

* :func:`load_stages`: every command stage, upstream first, from DVC's index graph.
  The flows in ``flows/`` run it; :func:`upstream_closure` and
  ``pipeline.tracking.tracker.record_experiment`` walk the same graph. Adding a
  stage to ``dvc.yaml`` is enough for all of them.
* :func:`dvc_stage_hashes`: DVC's run-cache key of every ``dvc.lock`` entry.
* :func:`current_stage_fingerprint`: the key ``dvc.lock`` will hold for a stage
  that is running now, from DVC's own view of its deps and params.
* :func:`read_metrics`: a stage's declared metrics files, merged.

Nothing here knows MLflow or Prefect. Importing this module is cheap: DVC is
imported inside the functions that need it. DVC is opened read-only, so these
functions also work inside a running stage, while ``dvc repro`` holds its lock.
"""

from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from pipeline import layout
from pipeline.errors import StageError

log = logging.getLogger(__name__)

# Stages that read or write anything under this folder train, evaluate or export
# a model; every other stage with outputs is a data stage.
BASE_PREFIX = layout.BASE_MODELS.as_posix()
MODELS_PREFIX = "models/"


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
        """True when it has outputs and neither reads nor writes a trained model
        under ``models/`` (ingest, clean, tokenizer, pack): a CPU function of its
        inputs, which the flows retry (see ``flows/pipeline.py``). ``models/base``
        holds published models given as inputs (the tokenizer reads their tokenizer
        files), so reading it does not count."""
        paths = self.outs + tuple(d for d in self.deps if d != BASE_PREFIX and not d.startswith(f"{BASE_PREFIX}/"))
        return bool(self.outs) and not any(p.startswith(MODELS_PREFIX) for p in paths)


def _open(root: str | Path) -> Any:
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        return Repo(str(Path(root).resolve()))
    except DvcException as err:
        raise LineageError(f"{root} is not a DVC project: {err}") from None


def project_root(path: str | Path = ".") -> Path:
    """The root of the DVC project that ``path`` is in: ``path`` itself or the
    nearest folder above it with a ``.dvc`` folder, as DVC finds it. The flows run
    ``dvc repro`` and keep their lock and MLflow store there, so a flow started
    in a sub-folder runs the project. Raises LineageError if there is none."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        return Path(Repo.find_root(str(Path(path).resolve())))
    except DvcException as err:
        raise LineageError(f"{path} is not a DVC project: {err}") from None


def load_stages(root: str | Path = ".") -> list[StageInfo]:
    """Every command stage of the DVC project at ``root``, upstream first.

    The order is a topological sort of DVC's own stage graph; stages that could go
    either way keep their ``dvc.yaml`` order, so the result is deterministic.
    ``.dvc`` files (data tracked with ``dvc add``) are inputs, not stages, and are
    left out. Raises LineageError if DVC cannot load the project."""
    import networkx as nx
    from dvc.dependency.param import ParamsDependency
    from dvc.exceptions import DvcException

    repo = _open(root)
    try:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        declared = {stage: i for i, stage in enumerate(repo.index.stages)}
        order = list(nx.lexicographical_topological_sort(graph.reverse(copy=True), key=lambda s: declared.get(s, 0)))
        stages = []
        for stage in order:
            if not getattr(stage, "cmd", None):
                continue
            stages.append(StageInfo(
                name=_address(stage),
                cmd=stage.cmd if isinstance(stage.cmd, str) else " && ".join(stage.cmd),
                upstream=tuple(_address(u) for u in graph.successors(stage) if getattr(u, "cmd", None)),
                deps=tuple(_rel(stage, d.def_path) for d in stage.deps if not isinstance(d, ParamsDependency)),
                outs=tuple(_rel(stage, o.def_path) for o in stage.outs if not o.metric and not o.plot),
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
    # DVC paths are relative to the stage's dvc.yaml; ours to the project root, normalised
    # (sub/../models/a is models/a: is_data_stage and the flows compare these as text).
    wdir = Path(stage.path_in_repo).parent
    if str(wdir) in ("", "."):
        return Path(str(path)).as_posix()
    return posixpath.normpath((wdir / str(path)).as_posix())


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
    found: set[str] = set()
    grew = True
    while grew:
        grew = False
        for s in stages:
            if s.name not in found and (name in s.upstream or found & set(s.upstream)):
                found.add(s.name)
                grew = True
    return found


def upstream_closure(stage: str, root: str | Path = ".") -> list[str]:
    """``stage`` and every stage it depends on, in :func:`load_stages` order;
    ``[stage]`` when DVC does not know it."""
    try:
        return [s.name for s in select(load_stages(root), [stage])]
    except LineageError:
        return [stage]


# --------------------------------------------------------------------------- hashes


def _run_cache_key(entry: Mapping[str, Any]) -> str:
    # DVC's own function, the one that names .dvc/cache/runs/<k[:2]>/<k>: sha256 of
    # cmd, deps, params and the out paths, without sizes. It changes exactly when
    # the stage's command, inputs or params change.
    from dvc.stage.cache import _get_cache_hash

    return _get_cache_hash(dict(entry), key=True)


def dvc_stage_hashes(root: str | Path = ".") -> dict[str, str]:
    """``{stage: run-cache key}`` for every stage recorded in ``root/dvc.lock``, as
    DVC loads it; empty if there is no lock file. Raises LineageError (not a DVC
    project) and DVC's errors (an invalid lock file)."""
    from dvc.dvcfile import Lockfile

    if not (Path(root) / "dvc.lock").exists():
        return {}
    with _open(root) as repo:
        data = Lockfile(repo, str(Path(repo.root_dir) / "dvc.lock")).load() or {}
    return {name: _run_cache_key(entry) for name, entry in (data.get("stages") or {}).items()}


def current_stage_fingerprint(stage: str, root: str | Path = ".") -> str | None:
    """The key :func:`dvc_stage_hashes` will report for ``stage`` once it finishes
    with the current inputs. Call it while the stage runs: the lock still holds
    the previous run's entry then. DVC hashes the deps (from its state cache when
    it already knows a file) and reads the params; the entry is DVC's own lock
    entry. None where DVC cannot say: an unknown stage, a missing dep or param."""
    try:
        from dvc.stage.serialize import to_single_stage_lockfile

        with _open(root) as repo:
            found = [s for s in repo.index.stages if _address(s) == stage and getattr(s, "cmd", None)]
            if not found:
                return None
            found[0].save_deps()
            return _run_cache_key(to_single_stage_lockfile(found[0]))
    except Exception as err:  # lineage must not stop a training run
        log.debug("no DVC fingerprint for stage %r: %s", stage, err)
        return None


# --------------------------------------------------------------------------- metrics


def read_metrics(root: str | Path, stage: StageInfo) -> dict[str, Any]:
    """The stage's metrics files (JSON or YAML) merged into one dict, with the
    stage's own keys as written; missing or unreadable files are skipped."""
    from pipeline.config import load_yaml

    merged: dict[str, Any] = {}
    for rel in stage.metrics:
        path = Path(root) / rel
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else load_yaml(path)
        except Exception as err:  # missing, or not JSON/YAML
            log.debug("no metrics from %s: %s", path, err)
            continue
        if isinstance(data, dict):
            merged.update(data)
    return merged
