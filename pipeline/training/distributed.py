"""Process-group set-up shared by every training stage.

The same code runs as one process on a laptop and as 8 processes on each of N
nodes: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR, and we pick
NCCL when the process owns a CUDA device and gloo otherwise.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.config import changed_keys
from pipeline.errors import StageError


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None when running without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.backend is not None


class DeviceError(StageError):
    """The device asked for is not on this machine."""


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """The device of ``requested``: auto (CUDA where there is one, else the CPU),
    cpu, cuda (the GPU of ``local_rank``), cuda:N or mps. Raises DeviceError,
    one line, for a device this machine does not have or a name torch does not know."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {requested!r} is not a device name; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {requested!r} was asked for, but torch {torch.__version__} sees no CUDA GPU "
                              "here; set the device to auto or cpu, or install a CUDA build of torch")
        if device.index is None:
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {requested!r} was asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"device {requested!r} was asked for, but this machine has no MPS (Apple GPU); "
                              "set the device to auto or cpu")
        return torch.device("mps")
    if device.type != "cpu":
        raise DeviceError(f"device {requested!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    return torch.device("cpu")


def init(requested_device: str = "auto", need_group: bool = False, timeout_s: float | None = None) -> Dist:
    """Join the process group torchrun describes (or run alone without one).

    ``need_group``: outside torchrun, still make a process group of this one
    process (an in-memory store, no network), for code that needs one even alone:
    FSDP's device mesh and sharded checkpoints. ``timeout_s``: how long a
    collective waits for the other ranks (None: torch's default for the backend,
    600 s for NCCL and 1800 s for gloo). Raises LaunchEnvError, one line, when
    WORLD_SIZE, RANK or LOCAL_RANK is not a whole number in range, or WORLD_SIZE
    names other ranks that no MASTER_ADDR lets this process join (it would
    otherwise train its share of the data alone, never synchronised), or
    MASTER_ADDR is set without the RANK, WORLD_SIZE and MASTER_PORT a process
    group is joined with (a variable left in a shell, not torchrun)."""
    world = _env_int("WORLD_SIZE", 1, low=1)
    rank = _env_int("RANK", 0, low=0)
    local_rank = _env_int("LOCAL_RANK", 0, low=0)
    if rank >= world:
        raise LaunchEnvError(f"RANK={rank} in the environment is not below WORLD_SIZE={world}; the ranks of a run "
                             "are numbered from 0 to WORLD_SIZE - 1 (start them with torchrun, which sets both)")
    lacking = [name for name in ("RANK", "WORLD_SIZE", "MASTER_PORT") if name not in os.environ]
    if "MASTER_ADDR" in os.environ and lacking and not dist.is_initialized():  # torch's env:// needs them all
        raise LaunchEnvError(f"MASTER_ADDR is set in the environment, but {' and '.join(lacking)} "
                             f"{'is' if len(lacking) == 1 else 'are'} not, so this process cannot join a process "
                             "group; start the ranks with torchrun, or unset MASTER_ADDR to train in one process")
    if world > 1 and "MASTER_ADDR" not in os.environ and not dist.is_initialized():
        raise LaunchEnvError(f"WORLD_SIZE={world} in the environment, but MASTER_ADDR is not set, so this process "
                             "cannot join the other ranks; start the ranks with torchrun, or unset WORLD_SIZE and "
                             "RANK to train in one process")
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = None
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None,
                                timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    elif dist.is_initialized():
        backend = dist.get_backend()
    elif need_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        world, rank, local_rank = 1, 0, 0
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if backend == "nccl" else None)
    return Dist(rank, local_rank, world, device, backend)


class LaunchEnvError(StageError):
    """RANK, WORLD_SIZE or LOCAL_RANK in the environment cannot describe this process."""


def _env_int(name: str, default: int, low: int) -> int:
    """The whole number ``name`` in the environment (``default`` when unset), at
    least ``low``; else a one-line LaunchEnvError naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < low:
        raise LaunchEnvError(f"{name}={raw!r} in the environment is not a whole number of at least {low}; torchrun "
                             f"sets it for each rank (unset it to train in one process)")
    return value


def shutdown(model: torch.nn.Module | None = None) -> None:
    """Destroy the process group, freeing ``model``'s DDP Reducer first when it
    is a DDP module. The Reducer holds the group, and pybind frees a Reducer with
    the GIL held. A Reducer freed after the group was destroyed is the group's
    last holder, so ProcessGroupGloo's destructor joins its worker threads holding
    the GIL; a worker that is still dropping a finished collective (a barrier holds
    the works before it, all_gather_object's tensors among them) needs the GIL to
    free that work's tensors, which have Python objects: both wait forever, after
    the rank's work is done. Freed before, the Reducer drops one reference, and the
    group goes here, through its Python object, whose destructor releases the GIL
    first. The Reducer is taken from the module rather than the module dropped: a
    traceback can keep the module alive past its owner (an exception raised in its
    forward holds the frame), and it is unusable after this anyway."""
    if isinstance(model, DDP):
        model.logger = None  # the Logger holds the Reducer too
        model.reducer = None
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def all_reduce_mean(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled and d.world_size > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= d.world_size
    return t


def all_reduce_max(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled and d.world_size > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_reduce_min(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Elementwise minimum over ranks (``t`` itself on one rank)."""
    if d.enabled and d.world_size > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t


def gather_objects(obj: object, d: Dist) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank (small objects only)."""
    if not d.enabled or d.world_size == 1:
        return [obj]
    out: list[object] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, d: Dist, src: int = 0) -> object:
    if not d.enabled or d.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class JobMismatchError(StageError):
    """The ranks of one run were started on different jobs, or do not share its folder."""


def check_one_job(d: Dist, job: dict[str, Any], folder: Path, *, wait: float = 5.0) -> None:
    """Every rank runs the job rank 0 runs, and sees the folder rank 0 writes.

    The nodes of a run are started by hand, each from its own copy of the
    project. A node with another ``params.yaml``, ``data/packed`` or commit would
    train another job inside the same run (another learning rate on some ranks:
    their replicas drift apart without a word; another ``eval.every``: the ranks
    wait on different collectives), and a node whose ``folder`` is not the
    storage rank 0 writes would resume from other checkpoints than rank 0's, or
    none. ``job``: flat keys and the values that must agree (params, data,
    starting weights, code). Rank 0 writes a file of a random name in
    ``folder`` and every rank looks for it (``wait`` seconds at most, for a
    network filesystem's caches). A collective, the first of the run: every
    rank raises the same one-line JobMismatchError."""
    if not d.enabled or d.world_size == 1:
        return
    host = socket.gethostname()
    seen = gather_objects((host, job), d)
    hosts, first = [h for h, _ in seen], seen[0][1]
    for rank, (_, other) in enumerate(seen):
        differ = changed_keys(first, other)
        if differ:
            shown = "; ".join(f"{k} is {_value(other, k)} there, {_value(first, k)} on rank 0" for k in differ[:4])
            more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
            raise JobMismatchError(
                f"rank {rank} (on {hosts[rank]}) was not started on the job rank 0 (on {hosts[0]}) runs: "
                f"{shown}{more}; every node needs the same commit, params.yaml and data")
    probe = None
    if d.is_main:
        try:
            probe = folder / f"{PROBE}{secrets.token_hex(8)}"
            probe.write_text(f"{host} {os.getpid()}\n")
        except OSError:
            probe = None
    name = broadcast_object(probe.name if probe else None, d)
    if name is None:
        raise JobMismatchError(f"rank 0 (on {hosts[0]}) cannot write in {folder}")
    deadline = time.monotonic() + wait
    while not (found := (folder / name).exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    found_by = gather_objects(found, d)
    if d.is_main:
        probe.unlink(missing_ok=True)
    blind = [rank for rank, ok in enumerate(found_by) if not ok]
    if blind:
        ranks = ", ".join(f"{rank} (on {hosts[rank]})" for rank in blind)
        raise JobMismatchError(
            f"rank{'s' if len(blind) > 1 else ''} {ranks} cannot see the file rank 0 (on {hosts[0]}) wrote in "
            f"{folder}: every node needs that folder on storage all nodes share, at the same path")


PROBE = ".probe-"  # <folder>/.probe-<random>: check_one_job's file, there for a moment


def _value(job: dict[str, Any], key: str) -> str:
    return "absent" if key not in job else repr(job[key])
