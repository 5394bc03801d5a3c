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
complete. Nothing here unpickles arbitrary objects.

Every load is verified first (:func:`verify`: each file's size and sha256
against ``meta.json``), so weights from a damaged file are never used. Which
checkpoint a reader gets depends on what it asks for:

- resuming a run (:meth:`CheckpointManager.resume_point`) falls back past
  damaged checkpoints to the newest intact one, with a warning naming each
  damaged file: losing a few steps is better than losing the run;
- evaluate, export, generate and sft's init-from (:func:`resolve`) ask for *the*
  result of a run, its newest checkpoint; if that one is damaged they fail and
  name it, rather than quietly report on or ship an older model.

A ``step-*`` folder without ``meta.json`` cannot be verified and counts as
damaged, never as absent.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from pipeline.errors import StageError
from pipeline.files import atomic_dir, fsync_path, sha256_file

log = logging.getLogger("pipeline.training.checkpoint")

STEP_RE = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "optimizer.pt", "trainer.pt", "meta.json")
SUPERSEDED = "superseded"  # <folder>/superseded/<fingerprint>/step-N: checkpoints of earlier runs


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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    return [c for c in step_folders(folder) if all((c.path / f).exists() for f in FILES)]


def latest(folder: Path) -> Checkpoint | None:
    """The newest of :func:`complete_checkpoints` (unverified)."""
    cps = complete_checkpoints(folder)
    return cps[-1] if cps else None


def resolve(path: Path) -> Checkpoint | None:
    """The checkpoint ``path`` names, verified: ``path`` itself when it is one
    checkpoint (a ``step-*`` folder, or any folder with a ``meta.json``), else
    the newest ``step-*`` folder in the run folder ``path``.

    This is for readers that want the result of a run (evaluate, export,
    generate, sft's init-from): if the newest checkpoint is damaged they get a
    CheckpointError naming the file, never an older checkpoint in its place, so
    that no metric, export or fine-tune silently comes from a model other than
    the one training ended with. Returns None when ``path`` holds no checkpoint.
    """
    path = Path(path)
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
        files = _read_meta(path)["files"]
        records = {name: (int(info["bytes"]), str(info["sha256"])) for name, info in files.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise damaged("meta.json", f"unreadable ({type(err).__name__}: {err})".replace("\n", " ")) from err
    for name in FILES[:-1]:
        if name not in records:
            raise damaged("meta.json", f"records no size and sha256 for {name}")
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
    if signature is not None:
        _verified[key] = signature


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
    """Remove leftovers of interrupted saves and deletions."""
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True)


def save(
    folder: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
) -> Checkpoint:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep`` up
    to ``step`` (a newer one, left by a run that resumed from before it, is
    replaced when the run reaches its step; the new checkpoint is never removed).

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
    discard([c for c in complete_checkpoints(folder) if c.step <= step][:-keep])
    return Checkpoint(final, step)


def discard(checkpoints: list[Checkpoint]) -> None:
    """Delete ``checkpoints`` (renamed to ``.trash-*`` first, so that a
    half-deleted folder never looks like a checkpoint)."""
    for c in checkpoints:
        trash = c.path.parent / f".trash-{c.path.name}-{os.getpid()}"
        os.replace(c.path, trash)
        shutil.rmtree(trash, ignore_errors=True)


# --- loading ---------------------------------------------------------------------------------------


def load_model_weights(ckpt: Checkpoint | Path, model: torch.nn.Module) -> None:
    """Verify the checkpoint, then load its weights into ``model`` (strict).
    Raises CheckpointError, leaving ``model`` untouched, if it is damaged."""
    path = ckpt.path if isinstance(ckpt, Checkpoint) else Path(ckpt)
    verify(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if missing or unexpected:  # strict=True raises already; keep the contract explicit
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing}, unexpected {unexpected})")


def load_state(ckpt: Checkpoint, name: str) -> Any:
    """Verify the checkpoint, then read its ``name`` (``optimizer.pt`` or
    ``trainer.pt``) with ``weights_only=True``, on the CPU."""
    verify(ckpt)
    return torch.load(ckpt.path / name, map_location="cpu", weights_only=True)


# --- one run's checkpoint folder -------------------------------------------------------------------


class CheckpointManager:
    """The checkpoints of one training run in ``folder``: those whose meta
    ``fingerprint`` is ``fingerprint``. Built on every rank; only the main rank
    (``is_main``) changes the folder."""

    def __init__(self, folder: Path, *, fingerprint: str, keep: int, is_main: bool):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.folder, self.fingerprint, self.keep, self.is_main = Path(folder), fingerprint, keep, is_main

    def prepare(self) -> None:
        """Main rank only (no-op elsewhere); call it before the other ranks look,
        e.g. before a barrier. Sweeps the leftovers of interrupted saves and
        moves the checkpoints of other runs (another fingerprint: params, model
        or data changed) to ``<folder>/superseded/<their fingerprint>/step-N``,
        with one warning saying where they went. Nothing is deleted. A
        checkpoint whose meta cannot be read stays: :meth:`resume_point`
        reports it as damaged."""
        if not self.is_main:
            return
        sweep(self.folder)
        moved: dict[Path, int] = {}
        for c in step_folders(self.folder):
            try:
                theirs = _read_meta(c.path).get("fingerprint")
            except (OSError, ValueError, TypeError):
                continue
            if theirs == self.fingerprint:
                continue
            name = str(theirs) if re.fullmatch(r"[0-9A-Za-z_.-]{1,64}", str(theirs)) else "unknown"
            dest_dir = self.folder / SUPERSEDED / name
            dest_dir.mkdir(parents=True, exist_ok=True)
            dest, n = dest_dir / c.path.name, 1
            while dest.exists():  # the same run superseded twice: keep both
                n += 1
                dest = dest_dir / f"{c.path.name}-{n}"
            os.replace(c.path, dest)
            fsync_path(dest_dir)
            moved[dest_dir] = moved.get(dest_dir, 0) + 1
        if moved:
            fsync_path(self.folder)
            where = ", ".join(f"{n} to {d}" for d, n in moved.items())
            log.warning("params, model or data changed since the checkpoints in %s were written: starting a fresh "
                        "run; moved %d checkpoint(s) of the earlier run(s) aside (%s); delete them if you do not "
                        "need them", self.folder, sum(moved.values()), where)

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

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], meta: dict[str, Any]) -> Checkpoint:
        """Main rank only: write checkpoint ``step`` atomically with this run's
        fingerprint in its meta, then keep the newest ``keep`` (see :func:`save`)."""
        if not self.is_main:
            raise RuntimeError("CheckpointManager.save runs on the main rank only")
        return save(self.folder, step, model, optimizer, trainer_state,
                    {**meta, "fingerprint": self.fingerprint}, self.keep)

    def load(self, ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Verify ``ckpt``, load its weights into ``model`` and its state into
        ``optimizer``, and return its trainer_state dict. A damaged checkpoint
        raises CheckpointError before anything is loaded."""
        verify(ckpt)
        load_model_weights(ckpt, model)
        optimizer.load_state_dict(load_state(ckpt, "optimizer.pt"))
        return load_state(ckpt, "trainer.pt")
