"""Self-launch under torchrun, and the one-trainer-per-folder guard.

``python -m stages.pretrain`` (what DVC runs) is not yet inside torchrun. It
takes the folder lock, then runs torchrun's agent in its own process with the
launch settings from params (``torchrun ... -m stages.pretrain``), and waits.
Inside torchrun the same module sees ``LOCAL_RANK`` and trains.

Why a lock: killing ``dvc repro`` with SIGKILL orphans the stage's children, so
the next ``dvc repro`` could start a second trainer on the same checkpoint
folder and the two would overwrite each other's checkpoints. Every process
(launcher and each rank) holds a *shared* flock on ``<folder>/.lock-<host>``; a new
launcher needs an *exclusive* lock first, which it cannot get while any process
of an earlier run is alive. The kernel drops flocks when a process dies, so a
crash never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shlex
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config import StageConfig
from pipeline.errors import StageError, Stopped, raise_stopped


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
    rdzv_id: str = Field("llm-pipeline", min_length=1, description="job id shared by all nodes of one run")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts on worker failure")
    timeout_s: float | None = Field(
        None, gt=0, description="seconds a rank's collective waits for the others (rank 0 writing a checkpoint alone, "
        "a first compile) before the run stops in one line; null = torch's default (NCCL 600, gloo 1800)")

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, v: str) -> str:
        # torchrun would take "abc" as abc:29400 and a port out of range as a C++ error,
        # each after a minute-long wait or a traceback, on every node.
        host, sep, port = v.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):  # [IPv6]:port
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError("must be host:port with a port from 1 to 65535, e.g. node0.example:29500")
        return v.strip()

    @model_validator(mode="after")
    def _rank_in_range(self) -> "LaunchConfig":
        if self.rdzv_backend == "static" and self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes}): "
                             f"nodes are numbered 0 to {self.nnodes - 1}")
        return self

    def check_endpoint(self) -> None:
        """Raise StageError if a multi-node launch's rendezvous host has no address
        (a typo, a name this node cannot resolve), rather than let torchrun retry it."""
        if self.nnodes == 1:
            return
        host = self.rdzv_endpoint.rpartition(":")[0].strip("[]")
        try:
            socket.getaddrinfo(host, None)
        except OSError as err:
            raise StageError(f"launch.rdzv_endpoint {self.rdzv_endpoint!r}: this node cannot resolve the host "
                             f"{host!r} ({err.strerror or err}); give node 0's name or address") from None


class TrainerBusyError(StageError):
    """Another trainer is alive on the same checkpoint folder."""


def inside_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _holders(lock_path: Path) -> str:
    try:
        return lock_path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def lock_holders(lock_path: Path) -> list[int]:
    """The processes holding a lock on ``lock_path`` now (Linux's /proc/locks;
    empty where it cannot be read), this one left out."""
    try:
        st = os.stat(lock_path)
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = {int(r[-4]) for r in rows if len(r) >= 8 and r[-3] == where and r[-4].isdigit()}
    return sorted(pids - {os.getpid()})


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
        pids = lock_holders(lock_path)
        stop = f"`kill {' '.join(map(str, pids))}`" if pids else "the processes named"
        raise TrainerBusyError(
            f"another trainer is still running on {folder} (launched by {_holders(lock_path)}). "
            "This happens when `dvc repro` was killed but its training processes were not. "
            f"Stop them ({stop}) or wait for them, then run again."
        ) from None
    if os.fstat(fd).st_nlink == 1 and not lock_path.is_symlink():  # not linked to DVC's cache: a write would spoil it
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


def torchrun_args(module: str, cfg: LaunchConfig) -> list[str]:
    """torchrun's own arguments for ``cfg`` (``torchrun <these>`` runs the same ranks)."""
    args = [f"--nproc_per_node={cfg.nproc_per_node}"]
    if cfg.nnodes == 1:
        args.append("--standalone")
    else:
        args += [
            f"--nnodes={cfg.nnodes}",
            f"--rdzv_backend={cfg.rdzv_backend}",
            f"--rdzv_endpoint={cfg.rdzv_endpoint}",
            f"--rdzv_id={cfg.rdzv_id}",
        ]
        if cfg.rdzv_backend == "static":
            args.append(f"--node_rank={cfg.node_rank}")
    return args + [f"--max_restarts={cfg.max_restarts}", "-m", module]


def torchrun_command(module: str, cfg: LaunchConfig) -> list[str]:
    """The same agent as a command of its own: :func:`main` in a new process."""
    return [sys.executable, "-m", "pipeline.training.torchrun", *torchrun_args(module, cfg)]


@contextlib.contextmanager
def _rank_environment(cfg: LaunchConfig):
    """The variables the ranks inherit (torchrun copies this process's
    environment into theirs), set for the launch and restored after it."""
    saved = dict(os.environ)
    os.environ["PIPELINE_LAUNCHED"] = "1"
    # One thread per rank by default on CPU: ranks share the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch(module: str, cfg: LaunchConfig, lock_folder: Path,
           before: Callable[[], None] | None = None) -> tuple[int, str | None]:
    """Run ``module`` under torchrun while holding the folder lock; return the
    exit code and why, as :func:`run_agent` does.

    ``before`` runs once, under the lock, before any rank starts (e.g. building
    the SFT shards, which every rank then reads).

    torchrun's agent runs in this process (:func:`run_agent`), not in one of its own:
    that saves a Python start and a torch import per launch, and a Ctrl-C or a
    SIGTERM (a Prefect timeout) reaches the agent once, which stops the ranks and
    returns 128 + the signal's number.
    """
    cfg.check_endpoint()
    fd = acquire_exclusive(lock_folder)
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    # Until the agent takes the signals as it starts the ranks, a SIGTERM stops the
    # launch as a Ctrl-C does (the default would end this process without a word).
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        try:
            if before is not None:
                before()
        except (KeyboardInterrupt, Stopped) as stop:
            return _before_ranks(stop)
        args = torchrun_args(module, cfg)
        print(f"launch: torchrun {shlex.join(args)}", file=sys.stderr, flush=True)
        with _rank_environment(cfg):
            return run_agent(args)
    finally:
        for s, h in handlers.items():  # the agent leaves its own handlers installed
            signal.signal(s, h)
        os.close(fd)


def _before_ranks(stop: BaseException) -> tuple[int, str]:
    """The exit code and reason of a launch stopped (a Ctrl-C, or ``Stopped``)
    before any rank started."""
    signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
    return 128 + signum, f"stopped by {signal.Signals(signum).name} before any rank started"

# The signals torchrun's agent turns into SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _NoFailureLine(logging.Filter):
    """Drops torchrun's own "failed (exitcode: N) local_rank: ..." record: a rank
    that failed said why in its own line, and :func:`main` names a rank that a
    signal killed; torchrun's other records (a rank sent SIGTERM because another
    failed, rendezvous trouble) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def run_agent(argv: list[str]) -> tuple[int, str | None]:
    """torchrun's agent (``torch.distributed.run``, the same arguments) in this
    process: the exit code of the first rank that failed, and why in one line
    where the rank could not say it itself.

    A rank reports its own failure (a StageError is one line and exit code 2);
    torchrun would add a traceback of its own ``ChildFailedError``, exit 1
    whatever the rank's code, and log a line of its own. A rank killed by a
    signal (the kernel's OOM killer, a SIGKILL) could say nothing: it is named
    here, with exit code 128 + the signal's number, as a shell reports it. So is
    a signal that stopped the agent (Ctrl-C, a SIGTERM), after which the agent
    has stopped the ranks."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoFailureLine) for f in agent_log.filters):
        agent_log.addFilter(_NoFailureLine())
    # torchrun keeps a log folder per launch (the ranks' error files; their output
    # with --redirects). Without --log-dir it makes a torchelastic_* folder in the
    # temp dir and leaves it there, one per launch: here it ends with the launch.
    named = any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv)
    with tempfile.TemporaryDirectory(prefix="torchelastic_") as logs:
        try:
            run(parse_args(argv if named else ["--log-dir", logs, *argv]))
        except SignalException as e:
            return 128 + e.sigval, f"stopped by {e.sigval.name}; the ranks were stopped"
        except (KeyboardInterrupt, Stopped) as stop:  # the agent takes the signals as it starts the ranks
            return _before_ranks(stop)
        except (RendezvousError, DistError) as e:  # DistError: the static backend's TCPStore, unwrapped
            return 1, _rendezvous_failed(e)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.exitcode < 0:
                return 128 - failure.exitcode, f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}"
            return (failure.exitcode if failure.exitcode > 0 else 1), None
    return 0, None


def _rendezvous_failed(e: BaseException) -> str:
    """Why a multi-node launch's rendezvous failed, in one line."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    text = str(e.__cause__ or e).strip()
    what = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    if isinstance(e, (RendezvousTimeoutError, DistStoreError)):  # static: node 0's store waited for the others
        return (f"the rendezvous timed out ({what}): not every node joined in time; start the stage on every node "
                "(launch.nnodes) and check that each reaches launch.rdzv_endpoint")
    if "while trying to connect" in text:  # never reached it: no rank of this node has started
        return (f"could not reach the rendezvous at launch.rdzv_endpoint ({what}): start the stage on node 0 first "
                "(it hosts the rendezvous), and check that this node reaches that host and port (address, firewall)")
    # The agent that hosted the rendezvous (the c10d store) has stopped, as a node's
    # agent does when one of its ranks fails; or the endpoint cannot be reached.
    return (f"lost the rendezvous ({what}): another node's agent stopped, or the network failed; this node's ranks "
            "were stopped, and the node where the failure began says why")


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.training.torchrun ARGS``: :func:`run_agent` as a
    command, its reason printed as one ``error:`` line."""
    code, why = run_agent(sys.argv[1:] if argv is None else argv)
    if why:
        print(f"error: {why}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
