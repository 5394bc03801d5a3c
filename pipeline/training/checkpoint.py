"""Training checkpoints that survive a kill at any moment.

Layout of one checkpoint (``<folder>/step-00000120/``)::

    model.safetensors   weights (safetensors; tied weights stored once)
    optimizer.pt        optimizer state      } torch.save of tensors and plain
    trainer.pt          scheduler, scaler,   } containers only, read back with
                        data position, RNG   } torch.load(weights_only=True)
                        states of every rank
    meta.json           step, model config, metrics, file sizes and sha256

It is written into a hidden temporary folder, every file fsynced, then renamed
into place and the parent fsynced. A kill before the rename leaves a
``.tmp-*`` folder that is ignored and swept later; a kill after it leaves a
complete checkpoint. Old checkpoints are removed only after the new one is in
place, first renamed to ``.trash-*`` so that a half-deleted folder never looks
complete, and only the run's own (its meta ``fingerprint``): a checkpoint put in
the folder by hand is never deleted. Nothing here unpickles arbitrary objects.

A run folder (``models/pretrain``) holds one run: the checkpoints whose meta
``fingerprint`` is the current run identity. Beside them::

    best.json                       the run's best checkpoint (checkpoint.keep_best)
    previous/<fingerprint>/step-N   earlier runs, moved aside when the identity
    previous/<fingerprint>/run.json changed: why, when, which keys; never deleted
                                    unless checkpoint.keep_previous says so
    damaged/step-N                  this run's damaged checkpoints newer than the one
                                    it resumes from, set aside before it saves those
                                    steps again; never deleted

A run is never deleted because params changed; any previous run can seed a new
one (``init_from``).

Every load is verified first (:func:`verify`: each file's size and sha256
against ``meta.json``), so weights from a damaged file are never used. Which
checkpoint a reader gets depends on what it asks for:

- resuming a run (:meth:`CheckpointManager.resume_point`) falls back past
  damaged checkpoints to the newest intact one, with a warning naming each
  damaged file: losing a few steps is better than losing the run;
- evaluate, export, generate and sft's init-from (:func:`resolve`) ask for *the*
  result of a run, its newest checkpoint (or its recorded best one); if that one
  is damaged they fail and name it, rather than quietly report on or ship an
  older model.

A ``step-*`` folder without ``meta.json`` cannot be verified and counts as
damaged, never as absent.

**Sharded checkpoints** (``compute.parallelism: fsdp``) hold the weights and
AdamW state as torch.distributed.checkpoint (DCP) files instead::

    .metadata            DCP's index of the shards (meta ``format: dcp``)
    __<rank>_0.distcp    each rank's shards of ``{"model": ..., "optim": ...}``
    trainer.pt, meta.json   as above

Every rank writes its shard into the same hidden temporary folder (rank 0 makes
it and names it to the others); after a barrier rank 0 writes ``trainer.pt``
and ``meta.json``, whose ``files`` records the size and sha256 of every file
(each rank hashes its own shard), fsyncs them all and renames the folder into
place. So a kill at any moment still leaves the previous checkpoint whole, and
every load is verified first, as for the single-file layout; every rank needs
the folder on a filesystem all ranks share (as DCP does). A sharded checkpoint
loads into any world size and into either parallelism (DCP reshards), and
:func:`load_model_weights` reads one into a plain model in a single process
without a process group, so evaluate, export, generate and init-from need not
know which layout a run wrote; a single-file checkpoint loads into a sharded
model too (:meth:`CheckpointManager.load`).

DCP reads ``.metadata`` with ``pickle`` and the non-tensor values (the optimizer's
hyperparameters) with ``torch.load(weights_only=False)``; its tensors with
``weights_only=True``. We read both ourselves instead, ``.metadata`` with an
unpickler that admits only DCP's own metadata classes, ``torch.Size``, dtypes
and paths, and the values with ``weights_only=True``: a checkpoint folder from
elsewhere cannot run code when loaded (the sha256 in meta.json proves the
files are the ones written, not that their writer was honest).
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model

from pipeline.config import changed_keys, flatten
from pipeline.errors import StageError
from pipeline.files import (SWAPPED_OUT, DiskFullError, atomic_dir, free_bytes, fsync_path, mount_point,
                            restore_swapped_out, sha256_file, size_text, write_json)
from pipeline.model.transformer import ModelConfig
from pipeline.training import distributed

log = logging.getLogger("pipeline.training.checkpoint")

STEP_RE = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "optimizer.pt", "trainer.pt", "meta.json")
DCP_METADATA = ".metadata"  # DCP's index of a sharded checkpoint's files
SHARDED_FILES = (DCP_METADATA, "trainer.pt", "meta.json")  # plus one __<rank>_0.distcp per rank
SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
PREVIOUS = "previous"  # <folder>/previous/<fingerprint>/step-N: checkpoints of earlier runs
CURVE = "curve.csv"  # <folder>/curve.csv: the run's plots CSV rows, kept beside the checkpoints (a copy moves aside too)
DAMAGED = "damaged"  # <folder>/damaged/step-N: this run's damaged checkpoints that it resumes before
RUN_INFO = "run.json"  # <folder>/previous/<id>/run.json: why and when that run was moved aside
BEST = "best.json"  # <folder>/best.json: {"step", "path", "val_loss", "fingerprint"} of the run's best checkpoint
WHICH = ("last", "best")


class CheckpointError(StageError):
    """A checkpoint is damaged or none can be used; the message is one line that
    names the file and the checkpoint (a StageError: stages print it as is)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / "meta.json").read_text())


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    """This process's RNG states as weights_only-loadable values."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():  # this rank's own GPU (torch.cuda.set_device), not every GPU it can see
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, list):  # written by every rank for every GPU it saw: this rank's is its device's
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
        cuda = cuda[index] if 0 <= index < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# --- finding checkpoints -------------------------------------------------------------------------


def step_folders(folder: Path) -> list[Checkpoint]:
    """Every ``step-*`` folder in ``folder``, oldest first, whole or damaged
    (unverified). Interrupted saves (``.tmp-*``) are not among them."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def complete_checkpoints(folder: Path) -> list[Checkpoint]:
    """``step-*`` folders that hold all four files, oldest first. A cheap listing:
    nothing is verified, so use :func:`resolve` or :meth:`CheckpointManager.resume_point`
    to pick a checkpoint to load."""
    return [c for c in step_folders(folder) if all((c.path / f).exists() for f in required_files(c.path))]


def is_sharded(path: Checkpoint | Path) -> bool:
    """True for a sharded (DCP) checkpoint folder, written by an FSDP run."""
    path = path.path if isinstance(path, Checkpoint) else Path(path)
    return (path / DCP_METADATA).is_file()


def required_files(path: Path) -> tuple[str, ...]:
    """The files a complete checkpoint in ``path`` has, by its layout."""
    return SHARDED_FILES if is_sharded(path) else FILES


def weights_id(checkpoint: Checkpoint) -> str:
    """A digest of a verified checkpoint's weights as its meta records them: the
    sha256 of ``model.safetensors``, or for a sharded checkpoint the sha256 over
    its DCP files' sha256 (those hold the AdamW state too)."""
    files = checkpoint.meta["files"]
    if "model.safetensors" in files:
        return str(files["model.safetensors"]["sha256"])
    shards = sorted((name, info["sha256"]) for name, info in files.items()
                    if name == DCP_METADATA or SHARD_RE.match(name))
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()


def latest(folder: Path) -> Checkpoint | None:
    """The newest of :func:`complete_checkpoints` (unverified)."""
    cps = complete_checkpoints(folder)
    return cps[-1] if cps else None


def resolve(path: Path, which: str = "last") -> Checkpoint | None:
    """The checkpoint ``path`` names, verified.

    ``which="last"``: ``path`` itself when it is one checkpoint (a ``step-*``
    folder, or any folder with a ``meta.json``), else the newest ``step-*``
    folder in the run folder ``path`` (``models/pretrain``, or an earlier run
    in ``models/pretrain/previous/<id>``). ``which="best"``: the checkpoint the
    run folder's ``best.json`` records (``checkpoint.keep_best``).

    This is for readers that want the result of a run (evaluate, export,
    generate, init-from): if the checkpoint asked for is damaged they get a
    CheckpointError naming the file, never an older checkpoint in its place, so
    that no metric, export or fine-tune silently comes from a model other than
    the one asked for. Returns None when ``path`` holds no checkpoint; a run
    folder with checkpoints but no best recorded is a CheckpointError for
    ``which="best"``. Raises ValueError for another ``which``.
    """
    path = Path(path)
    if which not in WHICH:
        raise ValueError(f"which checkpoint: {which!r} is not one of {', '.join(WHICH)}")
    one = is_checkpoint(path)
    if which == "best":
        if one:
            raise CheckpointError(f"{path} is a single checkpoint; the best one is chosen in a run folder "
                                  "(give the folder that holds the step-* folders)")
        return _best_checkpoint(path)
    if STEP_RE.match(path.name) and path.is_dir():
        found: Checkpoint | None = Checkpoint(path, int(path.name[len("step-"):]))
    elif (path / "meta.json").is_file():
        verify(path)
        return Checkpoint(path, int(_read_meta(path).get("step", -1)))
    else:
        folders = step_folders(path)
        found = folders[-1] if folders else None
    if found is not None:
        verify(found)
    return found


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (a ``step-*`` folder, or any folder with a
    ``meta.json``) rather than a run folder that holds them."""
    path = Path(path)
    return bool((STEP_RE.match(path.name) and path.is_dir()) or (path / "meta.json").is_file())


def read_best(folder: Path) -> dict[str, Any] | None:
    """The run folder's ``best.json`` record, or None when there is none.
    Raises CheckpointError (one line naming the file) when it is unreadable."""
    record_path = Path(folder) / BEST
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
        step, name = int(record["step"]), str(record["path"])
        float(record["val_loss"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{record_path}: unreadable ({type(err).__name__}: {err})".replace("\n", " ")) from err
    if not STEP_RE.match(name) or int(name[len("step-"):]) != step:
        raise CheckpointError(f"{record_path}: records {name!r} for step {step}, which is not a checkpoint folder name")
    return record


def _best_checkpoint(folder: Path) -> Checkpoint | None:
    record = read_best(folder)
    if record is None:
        if not step_folders(folder):
            return None
        raise CheckpointError(f"{folder / BEST}: missing, so no best checkpoint is recorded for this run: "
                              "checkpoint.keep_best was off while it saved its checkpoints, and turning it on later "
                              "does not revisit a finished run; set it before the run starts (move "
                              f"{folder} aside and rerun the stage, or raise schedule.max_steps to record the best "
                              "of the steps to come), or take the last checkpoint")
    best = Checkpoint(Path(folder) / record["path"], int(record["step"]))
    if not best.path.is_dir():
        raise CheckpointError(f"{best.path}: missing, though {folder / BEST} records it as the best checkpoint")
    verify(best)
    return best


# --- verification ----------------------------------------------------------------------------------

# resolved path -> stat signature of its files when they last verified; a changed,
# replaced or re-saved file changes the signature and is hashed again
_verified: dict[Path, tuple] = {}


def verify(ckpt: Checkpoint | Path) -> None:
    """Check that ``meta.json`` exists and parses, and that every file it records
    has the recorded size and sha256. Raises CheckpointError naming the first
    damaged file and its checkpoint, in one line. Each checkpoint is hashed once
    per process while its files stay unchanged."""
    path = ckpt.path if isinstance(ckpt, Checkpoint) else Path(ckpt)
    key = path.resolve()
    signature = _signature(path)
    if signature is not None and _verified.get(key) == signature:
        return

    def damaged(file: str, what: str) -> CheckpointError:
        return CheckpointError(f"{path / file}: {what} (checkpoint {path.name} is damaged)")

    if not (path / "meta.json").is_file():
        raise damaged("meta.json", "missing, so the checkpoint cannot be verified")
    try:
        meta = _read_meta(path)
        records = {name: (int(info["bytes"]), str(info["sha256"])) for name, info in meta["files"].items()}
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise damaged("meta.json", f"unreadable ({type(err).__name__}: {err})".replace("\n", " ")) from err
    if "model" in meta:  # the model the weights are for, which every reader builds
        try:
            ModelConfig(**meta["model"])
        except (ValueError, TypeError) as err:
            raise damaged("meta.json", f"records an invalid model ({err})".replace("\n", " ")) from None
    step, named = meta.get("step"), STEP_RE.match(path.name)
    if step is not None and (type(step) is not int or step < 0):
        raise damaged("meta.json", f"records the step {step!r}, which is not a whole number")
    if named and step is not None and step != int(named.group(1)):  # the folder name is the step resume and keep-last-K use
        raise damaged("meta.json", f"records step {step}, but the folder is named {path.name} (renamed by hand?); "
                                   f"name it step-{step:08d}")
    sharded = meta.get("format") == "dcp"
    for name in (SHARDED_FILES if sharded else FILES)[:-1]:
        if name not in records:
            raise damaged("meta.json", f"records no size and sha256 for {name}")
    if sharded and not any(SHARD_RE.match(name) for name in records):
        raise damaged("meta.json", "records no shard file (__<rank>_0.distcp)")
    # a folder with a .metadata loads as a sharded one (is_sharded), and DCP reads whichever shard files
    # .metadata names: every DCP file in the folder must be verified, whatever layout meta.json records
    for p in sorted(path.iterdir()):
        if (p.name == DCP_METADATA or SHARD_RE.match(p.name)) and p.name not in records:
            raise damaged(p.name, "not recorded in meta.json, so it cannot be verified")
    for name, (size, sha256) in records.items():
        if Path(name).name != name or name == "meta.json":
            raise damaged("meta.json", f"records the file name {name!r}, which is not a file of a checkpoint")
        file = path / name
        if not file.is_file():
            raise damaged(name, "missing, though meta.json records it")
        actual = file.stat().st_size
        if actual != size:
            raise damaged(name, f"size {actual} bytes differs from the {size} recorded in meta.json")
        if sha256_file(file) != sha256:
            raise damaged(name, "sha256 differs from the one recorded in meta.json")
    if sharded:  # (its sha256 checked above) the shard files it names are ones meta.json records
        index = read_dcp_metadata(path)
        named = {getattr(info, "relative_path", None) for info in (getattr(index, "storage_data", None) or {}).values()}
        unrecorded = sorted(str(name) for name in named if name not in records)
        if unrecorded:
            raise damaged(DCP_METADATA, f"names the shard file(s) {', '.join(unrecorded)}, which meta.json does not "
                                        "record (a rank's shard is missing)")
    if signature is not None:
        _verified[key] = signature


def model_config(checkpoint: Checkpoint) -> ModelConfig:
    """The model a (verified) checkpoint's weights are for. Raises CheckpointError
    when its meta.json records none (verify has checked one it records)."""
    if "model" not in checkpoint.meta:
        raise CheckpointError(f"{checkpoint.path / 'meta.json'}: records no model configuration, so its weights "
                              "cannot be loaded (a checkpoint saved by another tool?)")
    return ModelConfig(**checkpoint.meta["model"])


def unfinished(checkpoint: Checkpoint, stage: str | None = None) -> str | None:
    """None when ``checkpoint`` ends its run (meta ``final``: saved at the run's
    ``schedule.max_steps``); otherwise one line naming it, its step, the run's
    max_steps when meta records it, and how to finish the run (``dvc repro
    <stage>``, ``stage`` defaulting to the one meta records). The one check of
    every reader of a run's result: sft refuses an unfinished pretrain, export an
    unfinished run, and evaluate warns."""
    meta = checkpoint.meta
    if meta.get("final"):
        return None
    stage = stage or meta.get("stage") or "its training stage"
    max_steps = (meta.get("schedule") or {}).get("max_steps")
    of = f" of {max_steps}" if max_steps is not None else ""
    return (f"{checkpoint.path} is not {stage}'s final checkpoint (step {checkpoint.step}{of}); "
            f"{stage} was interrupted: run `dvc repro {stage}` to finish it")


def run_end(path: Path, resolved: Checkpoint) -> Checkpoint | None:
    """The checkpoint that says whether the run :func:`resolve` took ``resolved``
    from has finished: the newest of the run folder ``path`` (``resolved`` itself
    when it is the last one); None when ``path`` is one checkpoint, asked for by name."""
    path = Path(path)
    if is_checkpoint(path):
        return None
    newest = latest(path)
    return resolved if newest is None or newest.path == resolved.path else newest


def _read_meta(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "meta.json").read_text())
    if not isinstance(meta, dict):
        raise TypeError("meta.json is not a JSON object")
    return meta


def _signature(path: Path) -> tuple | None:
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        return tuple((e.name, s.st_ino, s.st_size, s.st_mtime_ns) for e in entries for s in [e.stat()])
    except OSError:
        return None


# --- saving and removing ---------------------------------------------------------------------------


def sweep(folder: Path) -> None:
    """Remove leftovers of interrupted saves and deletions; first move back a
    checkpoint whose replacement was cut between the swap's two renames (it is
    then missing, and whole under its swapped-out name: restore_swapped_out)."""
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            swapped = re.fullmatch(rf"{re.escape(SWAPPED_OUT)}(.+)-\d+", p.name)
            if swapped:
                restore_swapped_out(folder / swapped.group(1))
        for p in folder.iterdir():
            if p.name.startswith((".tmp-", ".trash-", SWAPPED_OUT)):
                shutil.rmtree(p, ignore_errors=True)


def save(
    folder: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
    protect: frozenset[int] = frozenset(),
) -> Checkpoint:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep`` up
    to ``step`` (a newer one, left by a run that resumed from before it, is
    replaced when the run reaches its step; the new checkpoint is never removed),
    plus the steps in ``protect`` (the best checkpoint).

    ``trainer_state`` holds the scheduler, scaler, data position and the list of
    every rank's RNG state; it must contain only tensors and plain containers.
    Call on one rank only.
    """
    folder.mkdir(parents=True, exist_ok=True)
    sweep(folder)
    final = step_dir(folder, step)
    with atomic_dir(final) as tmp:  # re-saving a step (after a resume) replaces it atomically
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(trainer_state, tmp / "trainer.pt")
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
                 for name in FILES[:-1]}
        meta = {**meta, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    trim(folder, step, keep, protect, meta.get("fingerprint"))
    return Checkpoint(final, step)


def save_sharded(
    folder: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any] | None,
    meta: dict[str, Any] | None,
    keep: int,
    d: distributed.Dist,
    protect: frozenset[int] = frozenset(),
) -> Checkpoint:
    """Write sharded checkpoint ``step`` (see the module docstring) and keep the
    newest ``keep`` as :func:`save` does. A collective: every rank calls it with
    its own shards; ``trainer_state`` and ``meta`` are used on the main rank only
    (they may be None elsewhere). Works for a sharded model and a plain one alike."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = step_dir(folder, step)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if not d.is_main:
        tmp = Path(distributed.broadcast_object(None, d))
        distributed.gather_objects(_write_shards(tmp, state, d), d)
        distributed.barrier(d)
        return Checkpoint(final, step)
    folder.mkdir(parents=True, exist_ok=True)
    sweep(folder)
    with atomic_dir(final) as tmp:
        distributed.broadcast_object(str(tmp), d)
        files: dict[str, dict[str, Any]] = {}
        for part in distributed.gather_objects(_write_shards(tmp, state, d), d):
            files.update(part)
        distributed.barrier(d)  # DCP's .metadata is written by rank 0 inside dcp.save; the shards by all
        torch.save(trainer_state, tmp / "trainer.pt")
        for name in (DCP_METADATA, "trainer.pt"):
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        listed = sorted(p.name for p in tmp.iterdir())
        if listed != sorted(files):  # every file a load reads must be verifiable
            raise CheckpointError(f"{tmp}: holds {listed}, but the ranks recorded {sorted(files)}")
        meta = {**(meta or {}), "step": step, "format": "dcp", "world_size": d.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": dict(sorted(files.items()))}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    trim(folder, step, keep, protect, meta.get("fingerprint"))
    return Checkpoint(final, step)


def _write_shards(tmp: Path, state: dict[str, Any], d: distributed.Dist) -> dict[str, dict[str, Any]]:
    """Every rank: DCP-save ``state`` into ``tmp``; return the size and sha256 of
    the shard files this rank wrote."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # alone (no process group) is what we asked for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                 no_dist=not d.enabled)
    mine = [name for name in os.listdir(tmp) if (m := SHARD_RE.match(name)) and int(m.group(1)) == d.rank]
    return {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in mine}


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the tensors a checkpoint of ``model`` and ``optimizer`` holds
    (weights once each, and the optimizer's state): a lower bound of its size."""
    tensors = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    once = {(t.data_ptr(), t.numel(), t.dtype): t for t in tensors}  # tied weights share their memory
    return sum(t.numel() * t.element_size() for t in once.values())


def trim(folder: Path, step: int, keep: int, protect: frozenset[int] = frozenset(),
         fingerprint: str | None = None) -> None:
    """Delete the complete checkpoints up to ``step`` but the newest ``keep`` and those in ``protect``.
    ``fingerprint``: only that run's checkpoints count and go; one of another run, or whose
    meta.json cannot be read, is never deleted (put there by hand while the run trained)."""
    older = [c for c in complete_checkpoints(folder) if c.step <= step and _owned_by(c, fingerprint)][:-keep]
    discard([c for c in older if c.step not in protect])


def _owned_by(c: Checkpoint, fingerprint: str | None) -> bool:
    if fingerprint is None:
        return True
    try:
        return _read_meta(c.path).get("fingerprint") == fingerprint
    except (OSError, ValueError, TypeError):
        return False


def discard(checkpoints: list[Checkpoint]) -> None:
    """Delete ``checkpoints`` (renamed to ``.trash-*`` first, so that a
    half-deleted folder never looks like a checkpoint)."""
    for c in checkpoints:
        trash = c.path.parent / f".trash-{c.path.name}-{os.getpid()}"
        os.replace(c.path, trash)
        shutil.rmtree(trash, ignore_errors=True)


# --- loading ---------------------------------------------------------------------------------------


def load_model_weights(ckpt: Checkpoint | Path, model: torch.nn.Module) -> None:
    """Verify the checkpoint, then load its weights into ``model`` (strict), a
    plain (unsharded) model, in this process alone: no process group is needed
    or used, whichever layout the checkpoint has. Raises CheckpointError,
    leaving ``model`` untouched, if it is damaged; and, in one line, if its
    weights do not fit ``model`` (a meta.json edited by hand, or the wrong
    model built), after which ``model`` is not to be used."""
    path = ckpt.path if isinstance(ckpt, Checkpoint) else Path(ckpt)
    verify(path)
    try:
        if is_sharded(path):
            model.load_state_dict(full_model_state(path, model), strict=True)
        else:
            load_model(model, str(path / "model.safetensors"), strict=True)
    except CheckpointError:  # a RuntimeError too, that names the checkpoint and its cause already
        raise
    except RuntimeError as err:  # torch's and safetensors' mismatch report, one line per kind of problem
        detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise CheckpointError(f"{path}: the weights do not fit the model its meta.json describes: "
                              f"{detail[:400]}{'...' if len(detail) > 400 else ''}") from None


def full_model_state(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A verified sharded checkpoint's weights as one full state dict shaped like
    ``model.state_dict()`` (a plain model), read in this process without a
    process group. Raises CheckpointError when the names differ from the model's."""
    wanted = {k: torch.empty_like(v, device="cpu") for k, v in model.state_dict().items()}
    saved = {k[len("model."):] for k in read_dcp_metadata(path).state_dict_metadata if k.startswith("model.")}
    if saved != set(wanted):
        missing, unexpected = sorted(set(wanted) - saved), sorted(saved - set(wanted))
        raise CheckpointError(f"{path}: the weights do not fit the model its meta.json describes (missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]})")
    state = {"model": wanted}
    dcp_load(state, path, no_dist=True)
    return state["model"]


def load_state(ckpt: Checkpoint, name: str) -> Any:
    """Verify the checkpoint, then read its ``name`` (``optimizer.pt`` or
    ``trainer.pt``) with ``weights_only=True``, on the CPU."""
    verify(ckpt)
    return torch.load(ckpt.path / name, map_location="cpu", weights_only=True)


def load_training_state(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        d: distributed.Dist) -> None:
    """Verify ``ckpt`` and load its weights and AdamW state into ``model`` and
    ``optimizer``, whatever the layouts: a sharded checkpoint into a sharded or
    a plain model (DCP reshards to this world size), a single-file checkpoint
    into a sharded model (full tensors, sharded as they load). Call on every
    rank. The plain-into-plain case is :meth:`CheckpointManager.load`'s own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    verify(ckpt)
    if is_sharded(ckpt):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp_load(state, ckpt.path, no_dist=not (d.enabled and model_is_sharded(model)))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return
    full = load_file(str(ckpt.path / "model.safetensors"))
    for names in _tied_names(model):  # safetensors stores a tied weight once, under one of its names
        present = [n for n in names if n in full]
        for n in names:
            if present and n not in full:
                full[n] = full[present[0]]
    saved = torch.load(ckpt.path / "optimizer.pt", map_location="cpu", weights_only=True)
    set_state_dict(model, optimizer, model_state_dict=full, optim_state_dict=optimizer_state_by_name(saved, model, optimizer),
                   options=StateDictOptions(full_state_dict=True))


def model_is_sharded(model: torch.nn.Module) -> bool:
    """True for a model sharded by FSDP2 (pipeline/training/parallelize.py)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False  # nothing in this process sharded a model (and a DDP run need not load FSDP)
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def optimizer_state_by_name(saved: dict[str, Any], model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` of a single-file checkpoint (parameters by
    position) keyed by parameter name instead, as torch.distributed's state-dict
    API takes it. Positions follow ``optimizer``'s param groups, which the
    trainer builds in the same order for a plain and a sharded model."""
    names = {id(p): n for n, p in model.named_parameters()}
    by_index = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    try:
        state = {by_index[int(i)]: v for i, v in saved["state"].items()}
        groups = [{**g, "params": [by_index[int(i)] for i in g["params"]]} for g in saved["param_groups"]]
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"optimizer state does not fit this model's parameters ({err})") from None
    return {"state": state, "param_groups": groups}


# DCP's metadata classes, the only globals a sharded checkpoint's .metadata may name
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_DCP_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr`` as early Python 3.11 releases (Debian 12's 3.11.2 among them;
    3.11.7 no longer does) pickle an enum member: ``getattr(cls, name)``, where
    other Pythons pickle ``cls(value)``. DCP's .metadata holds one (its memory-format
    enum). Only a member of an enum class the unpickler admitted is given; any
    other attribute (a method of an admitted class) is refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not "
                                 f"allowed in a checkpoint's {DCP_METADATA}: only an enum's member is")


def _defined_class(module: str, name: str) -> bool:
    """Whether ``module.name`` is a class ``module`` defines itself. Not a name it
    imports (DCP's metadata module imports ``os`` and ``torch``), nor a dotted
    path through one, which protocol 4 resolves attribute by attribute
    (``os.system``)."""
    if "." in name or name.startswith("__"):
        return False
    obj = getattr(sys.modules.get(module), name, None)
    return isinstance(obj, type) and obj.__module__ == module


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch.distributed.checkpoint.metadata  # noqa: F401  (the module the names below come from)

        if name == "getattr" and module in ("builtins", "__builtin__"):  # __builtin__: pickle protocols 0 to 2
            return _enum_member
        allowed = (module in _DCP_MODULES and _defined_class(module, name)) or (module, name) in _DCP_GLOBALS
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint's {DCP_METADATA}")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` of a sharded checkpoint, unpickled with only DCP's
    own classes allowed. Raises CheckpointError naming the file otherwise."""
    file = Path(path) / DCP_METADATA
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: unreadable ({type(err).__name__}: {err})".replace("\n", " ")) from None


def dcp_load(state: dict[str, Any], path: Path, *, no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state`` in place,
    reading .metadata with :func:`read_dcp_metadata` and non-tensor values with
    ``weights_only=True``. ``no_dist``: this process reads alone (no collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)  # then handed on re-serialised: nothing else is unpickled
            clean = io.BytesIO()
            torch.save(obj, clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    try:
        with warnings.catch_warnings():  # no_dist is what we asked for, not a surprise to warn about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=Reader(path), planner=Planner(), no_dist=no_dist)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, pickle.UnpicklingError, CheckpointException) as err:
        if isinstance(err, CheckpointException) and err.failures:  # its str is a traceback per rank: say the cause
            err = next(iter(err.failures.values()))[0]
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot load the sharded checkpoint ({type(err).__name__}: {first})") from None


# --- one run's checkpoint folder -------------------------------------------------------------------



@dataclass(frozen=True)
class MovedRun:
    """A run moved aside by :meth:`CheckpointManager.prepare`."""

    path: Path  # <folder>/previous/<id>
    fingerprint: str
    reason: str
    steps: tuple[int, ...]


class CheckpointManager:
    """The checkpoints of one training run in ``folder``: those whose meta
    ``fingerprint`` is ``fingerprint``. Built on every rank; only the main rank
    (``is_main``) changes the folder (a sharded save has every rank write its
    shard into the main rank's temporary folder, which only the main rank renames).

    ``identity`` is the record the fingerprint was computed from
    (:func:`pipeline.training.config.identity_record`); it is written into every
    checkpoint's meta so that a later run can name the keys that changed.
    ``keep_best`` keeps the checkpoint with the lowest val loss besides the
    newest ``keep`` and records it in ``best.json``. ``keep_previous`` bounds
    the earlier runs kept under ``previous/`` (None: all).
    """

    def __init__(self, folder: Path, *, fingerprint: str, keep: int, is_main: bool,
                 identity: dict[str, Any] | None = None, keep_best: bool = False, keep_previous: int | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if keep_previous is not None and keep_previous < 0:
            raise ValueError(f"keep_previous must be null or at least 0, got {keep_previous}")
        self.folder, self.fingerprint, self.keep, self.is_main = Path(folder), fingerprint, keep, is_main
        self.identity, self.keep_best, self.keep_previous = identity, keep_best, keep_previous

    # -- the folder holds this run only --

    def prepare(self, max_steps: int | None = None, in_use: Path | None = None,
                branch: Callable[[int, dict[str, Any]], tuple[int, str] | None] | None = None) -> list[MovedRun]:
        """Main rank only (no-op elsewhere); call it before the other ranks look,
        e.g. before a barrier. Sweeps the leftovers of interrupted saves and moves
        the checkpoints of other runs (another fingerprint: params, model or data
        changed) to ``<folder>/previous/<their fingerprint>/step-N``, one folder
        per run with a ``run.json`` saying why (the identity keys that changed,
        when the old meta records them), and a warning each. Nothing is deleted,
        except previous runs beyond ``keep_previous``, each named in a warning.

        ``max_steps``: this run's length. When this run's newest checkpoint lies
        beyond it (``schedule.max_steps`` lowered below a step already trained),
        the run cannot continue: it is moved aside too and a fresh run starts.

        ``in_use``: a checkpoint this run starts from (``init_from``); the
        previous run that holds it is never deleted by ``keep_previous``.

        A run with no checkpoint here whose identity equals a run kept under
        ``previous/`` (params changed and then changed back) takes that run's
        checkpoints back and goes on from them, with a warning, instead of
        training again from nothing; not a branch, nor one that ran past
        ``max_steps`` or holds ``in_use``.

        ``branch``: given the step and meta of this run's newest checkpoint, the step at
        or before which a checkpoint continues this run exactly, with the
        reason, or None when the newest does. When this run has an intact
        checkpoint at or before that step, its newer checkpoints are moved
        aside (to ``previous/``, as a run of their own, named in a warning) and
        the run resumes from it. A wsd run lengthened after its decay started
        is the case: its decayed checkpoints are a branch of the run.

        A checkpoint whose meta cannot be read stays: :meth:`resume_point`
        reports it as damaged. Returns the runs moved aside."""
        if not self.is_main:
            return []
        sweep(self.folder)
        runs: dict[str, list[tuple[Checkpoint, dict[str, Any]]]] = {}
        for c in step_folders(self.folder):
            try:
                meta = _read_meta(c.path)
            except (OSError, ValueError, TypeError):
                continue
            runs.setdefault(str(meta.get("fingerprint")), []).append((c, meta))
        mine = runs.pop(self.fingerprint, [])
        reasons = {fp: self._reason(cps[-1][1]) for fp, cps in runs.items()}
        if max_steps is not None and mine and mine[-1][0].step > max_steps:
            runs[self.fingerprint] = mine
            reasons[self.fingerprint] = (f"schedule.max_steps was lowered to {max_steps}, below this run's newest "
                                         f"checkpoint (step {mine[-1][0].step}); a run cannot be shortened past steps "
                                         "it has trained, so a fresh run starts")
        moved = [self._move_aside(fp, [c for c, _ in cps], reasons[fp]) for fp, cps in runs.items()]
        if branch is not None and mine and self.fingerprint not in runs:  # (moved aside whole when shortened)
            moved += self._branch_aside([c for c, _ in mine], branch(mine[-1][0].step, mine[-1][1]))
        if not mine:
            self._restore_previous(max_steps, in_use)
        best = self._best_record(warn=True)
        if best is not None and best.get("fingerprint") != self.fingerprint:
            (self.folder / BEST).unlink()  # its run was moved aside with its own copy, or has no checkpoint left
        elif best is not None and not self.keep_best:
            (self.folder / BEST).unlink()
            log.info("checkpoint.keep_best is off: %s no longer records or protects %s", self.folder / BEST,
                     best["path"])
        if moved:
            fsync_path(self.folder)
        self._set_aside_damaged()
        self._prune_previous(in_use)
        return moved

    def _restore_previous(self, max_steps: int | None, in_use: Path | None) -> None:
        """The newest run under previous/ with this run's fingerprint, moved back (see :meth:`prepare`)."""
        used = Path(in_use).resolve() if in_use is not None else None
        for run in self.previous_runs():
            try:
                info = json.loads((run / RUN_INFO).read_text())
            except (OSError, ValueError):
                continue
            steps = [c.step for c in step_folders(run)]
            if (not isinstance(info, dict) or info.get("fingerprint") != self.fingerprint or info.get("branch")
                    or not steps or (max_steps is not None and steps[-1] > max_steps)
                    or not (run / CURVE).is_file()  # moved aside without its curve: the plots would be another run's
                    or (used is not None and used.is_relative_to(run.resolve()))):
                continue
            for c in step_folders(run):
                os.replace(c.path, self.folder / c.path.name)
            os.replace(run / CURVE, self.folder / CURVE)  # the folder's was the run just moved aside, which has a copy
            if (run / BEST).is_file() and not (self.folder / BEST).exists():
                os.replace(run / BEST, self.folder / BEST)
            (run / RUN_INFO).unlink()
            if not any(run.iterdir()):
                run.rmdir()
            fsync_path(self.folder)
            log.warning("this run's identity equals that of the run kept in %s (moved aside because: %s): its "
                        "checkpoints (steps %s) are moved back and the run goes on from step %d instead of training "
                        "again", run, info.get("reason", "unknown"), ", ".join(map(str, steps)), steps[-1])
            return

    def _branch_aside(self, mine: list[Checkpoint], branch: tuple[int, str] | None) -> list[MovedRun]:
        """This run's checkpoints after the newest intact one at or before
        ``branch[0]``, moved to ``previous/`` (see :meth:`prepare`)."""
        if branch is None:
            return []
        step, why = branch
        base = next((c for c in reversed(mine) if c.step <= step and self._intact(c)), None)
        if base is None:
            return []
        later = [c for c in mine if c.step > base.step]
        name = f"{self.fingerprint}-after-step-{base.step}"
        return [self._move_aside(name, later, f"{why}; the run goes on exactly from its checkpoint at step "
                                 f"{base.step}, and these checkpoints are kept here as their own branch",
                                 fingerprint=self.fingerprint, branch=True)]

    @staticmethod
    def _intact(c: Checkpoint) -> bool:
        try:
            verify(c)
        except CheckpointError:
            return False
        return True

    def _set_aside_damaged(self) -> None:
        """Move this run's checkpoints newer than its newest intact one (damaged,
        or with a meta.json that cannot be read) to ``<folder>/damaged/step-N``,
        each with a warning: the run resumes from the intact one and saves those
        steps again, which would replace them, and their weights may be whole.
        Where no checkpoint is intact nothing moves (resume_point stops the run)."""
        damaged: list[tuple[Checkpoint, CheckpointError]] = []
        for c in reversed(step_folders(self.folder)):  # other runs' are moved aside already
            try:
                verify(c)
            except CheckpointError as err:
                damaged.append((c, err))
                continue
            break
        else:
            return
        if not damaged:
            return
        root = self.folder / DAMAGED
        root.mkdir(exist_ok=True)
        for c, err in damaged:
            dest, n = root / c.path.name, 1
            while dest.exists():
                n += 1
                dest = root / f"{c.path.name}-{n}"
            os.replace(c.path, dest)
            log.warning("%s; moved aside to %s, as this run resumes from an older checkpoint and will save step %d "
                        "again (nothing under %s is deleted: remove it yourself once you no longer need it)",
                        err, dest, c.step, root)
        fsync_path(root)
        fsync_path(self.folder)

    def _reason(self, meta: dict[str, Any]) -> str:
        old = meta.get("identity")
        if not isinstance(old, dict) or self.identity is None:
            return "params, model, data or the starting weights changed (its checkpoints record no identity to compare)"
        keys = changed_keys(old, self.identity)
        if not keys:
            return "the run identity changed (no recorded key differs: the code that computes it changed)"
        a, b = flatten(old), flatten(self.identity)
        shown = [f"{k} {a.get(k, '(none)')} -> {b.get(k, '(none)')}" for k in keys[:6]]
        more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
        return "changed: " + ", ".join(shown) + more

    def _move_aside(self, name: str, checkpoints: list[Checkpoint], reason: str,
                    fingerprint: str | None = None, branch: bool = False) -> MovedRun:
        """Move ``checkpoints`` to ``previous/<name>`` (``name``: their run's
        fingerprint, unless given with ``fingerprint``) with a run.json."""
        fingerprint = name if fingerprint is None else fingerprint
        name = name if re.fullmatch(r"[0-9A-Za-z_.-]{1,80}", name) else "unknown"
        root = self.folder / PREVIOUS
        dest, n = root / name, 1
        while dest.exists() and (dest / RUN_INFO).exists():  # taken by an earlier move (without run.json: interrupted, go on)
            n += 1
            dest = root / f"{name}-{n}"
        dest.mkdir(parents=True, exist_ok=True)
        for c in checkpoints:
            os.replace(c.path, dest / c.path.name)
        if (self.folder / CURVE).is_file():  # the run's curve so far, for a run restored or continued from here
            shutil.copyfile(self.folder / CURVE, dest / CURVE)
        best = self._best_record(warn=False)
        if (best is not None and best.get("fingerprint") == fingerprint  # a branch of this run: with its checkpoint
                and (fingerprint != self.fingerprint or best.get("step") in {c.step for c in checkpoints})):
            os.replace(self.folder / BEST, dest / BEST)
        steps = tuple(int(p.name[len("step-"):]) for p in sorted(dest.iterdir()) if STEP_RE.match(p.name))
        write_json(dest / RUN_INFO, {"fingerprint": fingerprint, "reason": reason, "moved_at": time.time(),
                                     "moved_at_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": list(steps),
                                     "from": str(self.folder), **({"branch": True} if branch else {})})
        fsync_path(dest)
        fsync_path(root)
        log.warning("run %s moved aside to %s (%d checkpoint(s), steps %s): %s. Start a new run from it with "
                    "init_from: %s", fingerprint, dest, len(steps), ", ".join(map(str, steps)) or "none", reason, dest)
        return MovedRun(dest, fingerprint, reason, steps)

    def previous_runs(self) -> list[Path]:
        """The earlier runs kept under ``previous/``, newest first (by when they were moved aside)."""
        root = self.folder / PREVIOUS
        if not root.is_dir():
            return []

        def moved_at(run: Path) -> float:
            try:
                return float(json.loads((run / RUN_INFO).read_text())["moved_at"])
            except (OSError, ValueError, TypeError, KeyError):
                return run.stat().st_mtime

        runs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".tmp-", ".trash-", SWAPPED_OUT))]
        return sorted(runs, key=lambda p: (moved_at(p), p.name), reverse=True)

    def _prune_previous(self, in_use: Path | None) -> None:
        root = self.folder / PREVIOUS
        sweep(root)
        if self.keep_previous is None:
            return
        used = Path(in_use).resolve() if in_use is not None else None
        for run in self.previous_runs()[self.keep_previous:]:
            if used is not None and used.is_relative_to(run.resolve()):
                log.warning("checkpoint.keep_previous is %d, but %s is kept: this run starts from %s",
                            self.keep_previous, run, in_use)
                continue
            log.warning("checkpoint.keep_previous is %d: deleting the earlier run %s", self.keep_previous, run)
            trash = root / f".trash-{run.name}-{os.getpid()}"
            os.replace(run, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # -- this run's checkpoints --

    def resume_point(self) -> Checkpoint | None:
        """The newest intact checkpoint of this run, verified. Damaged ones newer
        than it are skipped with a warning each (on the main rank) naming the
        file and checkpoint; a ``step-*`` folder whose meta cannot be read counts
        as this run's and damaged. Returns None when the run has no checkpoint;
        raises CheckpointError (one line naming the damage) when it has some
        but none is intact."""
        errors: list[CheckpointError] = []
        for c in reversed(step_folders(self.folder)):
            try:
                if _read_meta(c.path).get("fingerprint") != self.fingerprint:
                    continue  # another run's: prepare() moves it aside
            except (OSError, ValueError, TypeError):
                pass  # unreadable meta: verify() names it below
            try:
                verify(c)
            except CheckpointError as err:
                errors.append(err)
                continue
            if self.is_main:
                for err in errors:
                    log.warning("%s; skipping it and resuming from the older %s", err, c.path.name)
            return c
        if errors:
            damage = "; ".join(map(str, errors))
            raise CheckpointError(f"{self.folder}: no intact checkpoint to resume from ({damage}); "
                                  f"move the damaged step-* folders out of {self.folder} to start a fresh run")
        return None

    def best(self) -> dict[str, Any] | None:
        """This run's ``best.json`` record (``step``, ``path``, ``val_loss``), or None."""
        record = self._best_record(warn=False)
        return record if record is not None and record.get("fingerprint") == self.fingerprint else None

    def _best_record(self, warn: bool) -> dict[str, Any] | None:
        try:
            return read_best(self.folder)
        except CheckpointError as err:
            if warn and self.is_main:
                log.warning("%s; ignoring it", err)
            return None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], meta: dict[str, Any], *, val_loss: float | None = None,
             sharded: distributed.Dist | None = None, protect: frozenset[int] = frozenset()) -> Checkpoint:
        """Main rank only: write checkpoint ``step`` atomically with this run's
        fingerprint and identity in its meta, then keep the newest ``keep`` (see
        :func:`save`). With ``keep_best``, ``val_loss`` is the val loss of these
        very weights: when it is the lowest so far, ``best.json`` is rewritten
        (atomically, after the checkpoint is in place) to record this one, and
        the best checkpoint is never removed by keep-last-K.

        ``sharded``: write the sharded layout (:func:`save_sharded`) instead; a
        collective then, called on every rank of ``sharded`` (``trainer_state``,
        ``meta`` and ``val_loss`` count on the main rank only).

        ``protect``: more steps keep-last-K never removes (a wsd run's last
        checkpoint before its decay, from which a lengthened run goes on exactly)."""
        if sharded is not None and not self.is_main:
            return save_sharded(self.folder, step, model, optimizer, None, None, self.keep, sharded)
        if not self.is_main:
            raise RuntimeError("CheckpointManager.save runs on the main rank only")
        best = self.best() if self.keep_best else None
        protect = protect | {best["step"]} if best else protect
        meta = {**meta, "fingerprint": self.fingerprint, "identity": self.identity}
        need = None if sharded is not None else state_bytes(model, optimizer)
        if need is not None and (free := free_bytes(self.folder)) is not None and free < need:
            raise self._no_room(step, need)  # before a write that would fill the device
        try:
            if sharded is not None:
                c = save_sharded(self.folder, step, model, optimizer, trainer_state, meta, self.keep, sharded,
                                 protect)
            else:
                c = save(self.folder, step, model, optimizer, trainer_state, meta, self.keep, protect)
        except DiskFullError as err:
            raise self._no_room(step, need) from err
        if (self.keep_best and val_loss is not None and math.isfinite(val_loss)
                and (best is None or val_loss < best["val_loss"] or best["step"] == step)):
            write_json(self.folder / BEST, {"step": step, "path": c.path.name, "val_loss": val_loss,
                                            "fingerprint": self.fingerprint})
            if best is not None and best["step"] != step:
                trim(self.folder, step, self.keep, protect - {best["step"]} | {step}, self.fingerprint)
        return c

    def _no_room(self, step: int, need: int | None) -> DiskFullError:
        """Checkpoint ``step`` did not fit: what it needs, what is free (the failed
        save's files are gone again), and what running the stage again does."""
        free = free_bytes(self.folder)
        have = f"{size_text(free)} free on {mount_point(self.folder)}" if free is not None else "the device is full"
        size = f"; a checkpoint takes at least {size_text(need)}, and checkpoint.keep = {self.keep} are kept" \
            if need is not None else ""
        last = latest(self.folder)
        then = (f"it resumes from step {last.step} ({last.path}), which is intact" if last is not None
                else "no checkpoint was saved yet, so it starts over")
        return DiskFullError(f"no space left on the device for checkpoint step {step} in {self.folder} ({have}"
                             f"{size}); free some space, or lower checkpoint.keep, and run the stage again: {then}")

    def load(self, ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             d: distributed.Dist | None = None) -> dict[str, Any]:
        """Verify ``ckpt``, load its weights into ``model`` and its state into
        ``optimizer``, and return its trainer_state dict. A damaged checkpoint
        raises CheckpointError before anything is loaded. A sharded checkpoint,
        or any checkpoint into a sharded model, goes through
        :func:`load_training_state` (``d``: this process's ranks; every rank calls)."""
        verify(ckpt)
        if is_sharded(ckpt) or model_is_sharded(model):
            load_training_state(ckpt, model, optimizer, d or distributed.Dist(0, 0, 1, torch.device("cpu"), None))
            return load_state(ckpt, "trainer.pt")
        load_model_weights(ckpt, model)
        optimizer.load_state_dict(load_state(ckpt, "optimizer.pt"))
        return load_state(ckpt, "trainer.pt")
