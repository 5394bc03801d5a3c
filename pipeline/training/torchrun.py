"""Self-launch under torchrun, and the one-trainer-per-folder guard.

``python -m stages.pretrain`` (what DVC runs) is not yet inside torchrun. It
takes the folder lock, then runs ``torchrun ... -m stages.pretrain`` with the
launch settings from params, and waits. Inside torchrun the same module sees
``LOCAL_RANK`` and trains.

Why a lock: killing ``dvc repro`` with SIGKILL orphans the stage's children, so
the next ``dvc repro`` could start a second trainer on the same checkpoint
folder and the two would overwrite each other's checkpoints. Every process
(launcher and each rank) holds a *shared* flock on ``<folder>/.lock-<host>``; a new
launcher needs an *exclusive* lock first, which it cannot get while any process
of an earlier run is alive. The kernel drops flocks when a process dies, so a
crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Literal

from pydantic import Field

from pipeline.config import StageConfig
from pipeline.errors import StageError
from pipeline.files import die_with_parent


def lock_name() -> str:
    """One lock per host: on a shared filesystem the launchers of a multi-node run
    must not refuse each other, while a second trainer on the same host must be
    refused. (flock over NFS is cluster-wide on Linux, hence the host name.)"""
    return f".lock-{socket.gethostname()}"


class LaunchConfig(StageConfig):
    """How to start the ranks. ``nnodes: 1`` uses torchrun's ``--standalone``;
    ``nnodes > 1`` rendezvous at ``rdzv_endpoint`` (see README, "Scaling out")."""

    nproc_per_node: int = Field(1, ge=1, description="processes per node (GPUs per node on CUDA)")
    nnodes: int = Field(1, ge=1, description="nodes; each runs the same command, node 0 hosts the rendezvous")
    node_rank: int = Field(0, ge=0, description="with rdzv_backend static: this node's rank")
    rdzv_backend: Literal["c10d", "static"] = Field("c10d", description="torchrun rendezvous: c10d (elastic) or static")
    rdzv_endpoint: str = Field("127.0.0.1:29500", description="host:port of the rendezvous (node 0)")
    rdzv_id: str = Field("llm-pipeline", description="job id shared by all nodes of one run")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts on worker failure")


class TrainerBusyError(StageError):
    """Another trainer is alive on the same checkpoint folder."""


def inside_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _holders(lock_path: Path) -> str:
    try:
        return lock_path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def acquire_exclusive(folder: Path) -> int:
    """Take the folder lock for a new run; raise TrainerBusyError naming the
    live holder otherwise. Returns the fd, now holding a shared lock that child
    processes' shared locks coexist with."""
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = folder / lock_name()
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TrainerBusyError(
            f"another trainer is still running on {folder} (launched by {_holders(lock_path)}). "
            "This happens when `dvc repro` was killed but its training processes were not. "
            f"Stop them (e.g. `pkill -f stages.`) or wait for them, then run again."
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}: {shlex.join(sys.argv)}\n".encode())
    # Downgrade so the ranks we start can take shared locks too.
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def hold_shared(folder: Path) -> int:
    """Called by every rank: keep a shared lock for the life of the process."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / lock_name(), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def torchrun_command(module: str, cfg: LaunchConfig) -> list[str]:
    """torchrun's command line, run through :func:`main` (torchrun's own arguments)."""
    cmd = [sys.executable, "-m", "pipeline.training.torchrun", f"--nproc_per_node={cfg.nproc_per_node}"]
    if cfg.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={cfg.nnodes}",
            f"--rdzv_backend={cfg.rdzv_backend}",
            f"--rdzv_endpoint={cfg.rdzv_endpoint}",
            f"--rdzv_id={cfg.rdzv_id}",
        ]
        if cfg.rdzv_backend == "static":
            cmd.append(f"--node_rank={cfg.node_rank}")
    cmd += [f"--max_restarts={cfg.max_restarts}", "-m", module]
    return cmd


def launch(module: str, cfg: LaunchConfig, lock_folder: Path, before: Callable[[], None] | None = None) -> int:
    """Run ``module`` under torchrun while holding the folder lock; return its exit code.

    ``before`` runs once, under the lock, before any rank starts (e.g. building
    the SFT shards, which every rank then reads).

    SIGINT/SIGTERM are forwarded so that Ctrl-C or a Prefect timeout stops the
    ranks cleanly instead of orphaning them.
    """
    fd = acquire_exclusive(lock_folder)
    try:
        if before is not None:
            before()
    except BaseException:
        os.close(fd)
        raise
    cmd = torchrun_command(module, cfg)
    env = {**os.environ, "PIPELINE_LAUNCHED": "1"}
    # One thread per rank by default on CPU: ranks share the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)))
    print(f"launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)

    def forward(signum, _frame):
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        os.close(fd)


class _NoFailureLine(logging.Filter):
    """Drops torchrun's own "failed (exitcode: N) local_rank: ..." record: a rank
    that failed said why in its own line, and :func:`main` names a rank that a
    signal killed; torchrun's other records (a rank sent SIGTERM because another
    failed, rendezvous trouble) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def main(argv: list[str] | None = None) -> int:
    """torchrun (``torch.distributed.run``, the same arguments), exiting with the
    code of the first rank that failed. A rank reports its own failure (a
    StageError is one line and exit code 2); torchrun would add a traceback of
    its own ``ChildFailedError`` and exit 1 whatever the rank's code, and a log
    line of its own. A rank killed by a signal (the kernel's OOM killer, a
    SIGKILL) could say nothing: that is one line here, and exit code 128 + the
    signal's number, as a shell reports it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureLine())
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            print(f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}", file=sys.stderr,
                  flush=True)
            return 128 - failure.exitcode
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
