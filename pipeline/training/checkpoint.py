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
"""

from __future__ import annotations

import json
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

from pipeline.files import fsync_path, sha256_file
from pipeline.errors import StageError

STEP_RE = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "optimizer.pt", "trainer.pt", "meta.json")


class CheckpointError(StageError):
    pass


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


def complete_checkpoints(folder: Path) -> list[Checkpoint]:
    """Complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and all((p / f).exists() for f in FILES):
            out.append(Checkpoint(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def latest(folder: Path) -> Checkpoint | None:
    cps = complete_checkpoints(folder)
    return cps[-1] if cps else None


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
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``.

    ``trainer_state`` holds the scheduler, scaler, data position and the list of
    every rank's RNG state; it must contain only tensors and plain containers.
    Call on one rank only.
    """
    folder.mkdir(parents=True, exist_ok=True)
    sweep(folder)
    final = step_dir(folder, step)
    tmp = folder / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(trainer_state, tmp / "trainer.pt")
    files = {}
    for name in FILES[:-1]:
        fsync_path(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
    meta = {**meta, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it atomically
        trash = folder / f".trash-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(folder)
    discard(complete_checkpoints(folder)[:-keep])
    return Checkpoint(final, step)


def discard(checkpoints: list[Checkpoint]) -> None:
    for c in checkpoints:
        trash = c.path.parent / f".trash-{c.path.name}-{os.getpid()}"
        os.replace(c.path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def load_model_weights(ckpt: Checkpoint | Path, model: torch.nn.Module) -> None:
    path = ckpt.path if isinstance(ckpt, Checkpoint) else Path(ckpt)
    _check_sizes(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if missing or unexpected:  # strict=True raises already; keep the contract explicit
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing}, unexpected {unexpected})")


def load_state(ckpt: Checkpoint, name: str) -> Any:
    _check_sizes(ckpt.path)
    return torch.load(ckpt.path / name, map_location="cpu", weights_only=True)


def _check_sizes(path: Path) -> None:
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path}: not a complete checkpoint (no meta.json)")
    for name, info in json.loads(meta_path.read_text()).get("files", {}).items():
        size = (path / name).stat().st_size if (path / name).exists() else -1
        if size != info["bytes"]:
            raise CheckpointError(f"{path / name}: size {size} != recorded {info['bytes']}; checkpoint is damaged")
