"""Where a data stage's per-task work runs: a local process pool or Ray.

A stage describes its parallel work as a pure function applied to a stream of
tasks, plus a per-worker initializer (its config, a tokenizer path). Then::

    with open_executor(cfg.executor, _init_worker, (cfg,), max_workers=n_tasks) as ex:
        for result in ex.map(process_batch, tasks):   # results in task order
            ...

:meth:`Executor.map` keeps a bounded window of tasks in flight (twice the
worker count by default) and yields results in task order, so a stage reads its
input no faster than the workers consume it and its output does not depend on
which worker ran what. The same tasks give the same results under every kind
and worker count.

Kinds (``executor.kind`` in a stage's params):

- ``local`` (the default): one process per worker, spawned (not forked: the
  parent runs Arrow and tqdm threads), each ended by the kernel when the stage
  dies, even by SIGKILL. One worker runs in-process, spawning nothing.
- ``ray``: Ray tasks. With no ``address`` a private Ray instance is started
  for the stage and stopped after it: ``num_cpus`` = the worker count, its
  servers bound to 127.0.0.1, only the GCS and the raylet (no dashboard, API
  server, autoscaler monitor or log monitor), no token file written, no task
  events reported, quiet logs. It starts in a background thread while the
  first tasks run in the stage's own process, so its start-up is spent on
  work; its workers start with it and import the stage's code (the
  initializer's module) before the stage connects. With an ``address``
  (``auto``, ``host:6379``, ``ray://host:10001``) the stage joins that
  cluster and uses its CPUs. Ray worker processes are reused across tasks,
  and each runs the initializer once and keeps its state. Before that, each
  checks that it runs the stage's code (:func:`check_same_code`): a worker
  imports the ``pipeline`` installed on its own node. The variables it
  sets in the stage's environment for Ray (loopback only, no token file, no
  "Unhandled error" printed for a task left in flight) are restored when it
  closes. Ray is imported only here, only for this kind.

Errors: a :class:`~pipeline.errors.StageError` raised by a task reaches the
caller unchanged (the runner prints it as one line). Any other exception in a
task, a worker that dies (on Ray: a task lost with its worker or node runs
again, up to :data:`TASK_RETRIES` times), or a Ray cluster that cannot be
reached becomes an :class:`ExecutorError`, one line that names the task and
the exception and where it was raised (the worker's traceback goes to the debug
log, not the terminal).
A Ray cluster left with no CPUs at all (its nodes died) is one line too, after
:data:`NO_CPU_S` of warnings (Ray itself would keep the tasks queued for good).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import ipaddress
import logging
import multiprocessing
import os
import re
import signal
import site
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

from pydantic import Field, model_validator

from pipeline.config import ParamsModel, StageConfig
from pipeline.errors import StageError
from pipeline.files import available_cores, die_with_parent, expected_failure, source_digest

log = logging.getLogger("pipeline.data.executor")


class ExecutorConfig(ParamsModel):
    """The ``executor:`` sub-section of a data stage's params."""

    kind: Literal["local", "ray"] = Field(
        "local", description="local: a process pool on this machine; ray: Ray tasks (pip install .[ray])")
    address: str | None = Field(
        None, description="ray only: null starts a local Ray instance for the stage; 'auto', 'host:6379' or "
        "'ray://host:10001' joins that cluster")
    num_workers: int = Field(
        0, ge=0, le=4096, description="tasks run at once; 0 = one per available core (ray with an address: the "
        "cluster's CPUs)")

    @model_validator(mode="after")
    def _address_needs_ray(self) -> "ExecutorConfig":
        if self.address is not None and self.kind != "ray":
            raise ValueError("address is for kind: ray (a local pool has no cluster to join)")
        if self.address is not None and not self.address.strip():
            raise ValueError("address must be null, 'auto' or a Ray address such as ray://host:10001")
        if self.address is not None and self.address.strip().lower() == "local":
            raise ValueError("address local is Ray's own start of a full instance on this machine's address; "
                             "null starts the stage's private one, on 127.0.0.1")
        port = (self.address or "").rpartition(":")[2]
        if port.isdigit() and not 0 < int(port) < 65536:  # the socket library would take it modulo 65536
            raise ValueError(f"address {self.address}: {port} is not a port number (1 to 65535)")
        return self


class ParallelStageConfig(StageConfig):
    """Base of a data stage whose work runs on an executor: its ``executor``
    section, and ``num_workers``, the older name of ``executor.num_workers``,
    still read (null: use that)."""

    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    num_workers: int | None = Field(
        None, ge=0, le=4096, description="older name of executor.num_workers, still read; null = use that")

    @model_validator(mode="after")
    def _legacy_num_workers(self) -> "ParallelStageConfig":
        if self.num_workers is None:
            return self
        if self.executor.num_workers not in (0, self.num_workers):
            raise ValueError(f"num_workers={self.num_workers} and executor.num_workers={self.executor.num_workers} "
                             "disagree; give executor.num_workers only")
        object.__setattr__(self, "executor", self.executor.model_copy(update={"num_workers": self.num_workers}))
        return self


class ExecutorError(StageError):
    """A task failed in a worker, a worker died, or the cluster could not be used."""


# --- worker side ---------------------------------------------------------------------------------

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _where(traceback_text: str) -> str:
    """' (at file.py:12 in fn)' for the innermost frame of a traceback text, or ''."""
    frames = _FRAME.findall(traceback_text or "")
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f" (at {os.path.basename(path)}:{line} in {fn})"


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or ''."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _task_failed(desc: str, index: int, exc: BaseException, traceback_text: str) -> BaseException:
    """The exception the caller sees for task ``index`` that raised ``exc``."""
    if (expected := expected_failure(exc)) is not None:
        return expected
    log.debug("%s: task %d failed in a worker:\n%s", desc, index, traceback_text)
    msg = _first_line(exc)
    return ExecutorError(f"{desc}: task {index} failed in a worker: {type(exc).__name__}"
                         f"{': ' + msg if msg else ''}{_where(traceback_text)}")


# glibc malloc's thresholds for the processes that run tasks (see return_freed_memory).
MMAP_THRESHOLD = 2 << 20
TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.lru_cache(maxsize=1)
def return_freed_memory() -> bool:
    """Fix this process's glibc malloc thresholds, so that a worker's memory is
    that of its task, not of all the tasks it ran: a block of 2 MiB or more is
    mapped on its own and handed back to the system when freed, and the heap
    gives back free space above 16 MiB at its top. By default glibc raises its
    mmap threshold to the size of each such block freed (up to 32 MiB), after
    which a task's large buffers (a batch's texts, a long document's tokens)
    are cut from the heap, whose free pieces the process keeps: a pack worker
    encoding 1 MB tasks one after another peaked at 219 MB, against 196 MB with
    these thresholds, for about 1% more CPU (the system's, faulting in fresh
    mappings; a trim threshold of 2 MiB as well gave 190 MB for 3%). Once per process;
    returns whether it applied (False where the C library has no
    ``mallopt``: macOS, Windows)."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block. A worker process started
    meanwhile inherits the blocked signal for its life, so a Ctrl-C, which the
    terminal sends to the whole process group, stops the stage through its main
    process alone (which shuts the pool down), not with a KeyboardInterrupt
    traceback from each worker. A SIGINT that comes meanwhile is not lost: it is
    delivered when the block ends (or to another thread, which Python passes on)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _local_worker_init(parent_pid: int, initializer: Callable[..., None] | None, initargs: tuple) -> None:
    die_with_parent(signal.SIGTERM, parent_pid)
    return_freed_memory()
    if initializer is not None:
        initializer(*initargs)


# The libraries whose version can change a task's result: Unicode tables
# (normalisation) are Python's, checked by Ray itself; MinHash (rensa) and BPE
# (tokenizers) are not, nor are the arrays the tasks build and return.
RESULT_LIBRARIES = ("tokenizers", "rensa", "numpy", "pyarrow")


def _package_root() -> Path:
    """The folder of the ``pipeline`` package this process imported."""
    return Path(sys.modules["pipeline"].__file__).parent


@functools.lru_cache(maxsize=1)
def code_identity() -> dict[str, str]:
    """What a task's result depends on besides its arguments, in this process:
    a sha256 of the ``pipeline`` package's source files, and the versions of
    :data:`RESULT_LIBRARIES`. Ray pickles a task's function by reference, so a
    worker runs the code installed on its own node; computed once, when first
    asked (the stage's code was imported by then)."""
    out = {"pipeline source": source_digest()}
    for name in RESULT_LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def check_same_code(desc: str, stage: dict[str, str]) -> None:
    """In a Ray worker: raise ExecutorError (one line) when its code or result
    libraries differ from the stage's (``stage``: the stage's
    :func:`code_identity`): a node with another version of the project
    installed would otherwise give other outputs under the stage's fingerprint."""
    here = code_identity()
    differ = [f"{k} {here.get(k)} there, {v} here" for k, v in stage.items() if here.get(k) != v]
    if differ:
        raise ExecutorError(
            f"{desc}: the Ray worker on {socket.gethostname()} runs other code than this stage "
            f"({'; '.join(differ)}; its pipeline package is {_package_root()}): "
            "install this checkout and its dependencies on every node (pip install '.[ray]') and restart its Ray")


# Ray worker processes run tasks of many maps; each remembers which initializer
# (by a key unique to one executor) it has run.
_RAY_INITIALIZED: dict[str, bool] = {}


def _ray_task(key: str, init: list, fn: Callable[..., Any], args: tuple) -> Any:
    """Run ``fn(*args)`` in a Ray worker after checking its code against the
    stage's (:func:`check_same_code`) and running the executor's initializer.
    ``init`` is ``[desc, the stage's code_identity, initializer, ObjectRef of
    initargs]``, wrapped in a list so that Ray does not fetch the initargs for
    every task."""
    if key not in _RAY_INITIALIZED:
        desc, identity, initializer, ref = init
        check_same_code(desc, identity)
        return_freed_memory()
        if initializer is not None:
            import ray

            initializer(*ray.get(ref))
        _RAY_INITIALIZED.clear()
        _RAY_INITIALIZED[key] = True
    return fn(*args)


# --- the executors -------------------------------------------------------------------------------


class Executor:
    """Runs ``fn(*task)`` for each task; see :meth:`map`. ``workers`` is the
    number of tasks run at once."""

    kind = "local"
    workers = 1

    def __init__(self, desc: str):
        self.desc = desc

    def map(self, fn: Callable[..., Any], tasks: Iterable[Sequence[Any]], window: int | None = None,
            bar: Any = None, units: Callable[[Any], int] | None = None) -> Iterator[Any]:
        """Yield ``fn(*task)`` for each task, in task order, with at most ``window``
        tasks (default ``2 * workers``) submitted and not yet yielded; ``tasks`` is
        consumed lazily. With a progress ``bar``, each result advances it by
        ``units(result)`` (default 1) as it arrives. Raises as the module docstring says."""
        window = max(1, window or 2 * self.workers)
        for result in self._map(fn, tasks, window):
            if bar is not None:
                bar.update(units(result) if units is not None else 1)
            yield result

    def _map(self, fn: Callable[..., Any], tasks: Iterable[Sequence[Any]], window: int) -> Iterator[Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcess(Executor):
    """One worker: the tasks run in the calling process (no spawn start-up)."""

    def __init__(self, desc: str, initializer: Callable[..., None] | None, initargs: tuple):
        super().__init__(desc)
        if initializer is not None:
            initializer(*initargs)

    def _map(self, fn, tasks, window):
        for task in tasks:
            yield fn(*task)


class LocalPool(Executor):
    """A spawn ProcessPoolExecutor. Not multiprocessing.Pool: when a worker dies
    (an OOM kill, or a caller script without the ``__main__`` guard that spawn
    needs) the pool breaks with BrokenProcessPool instead of waiting forever."""

    def __init__(self, desc: str, workers: int, initializer: Callable[..., None] | None, initargs: tuple):
        super().__init__(desc)
        self.workers = workers
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_local_worker_init,
                                        initargs=(os.getpid(), initializer, initargs))

    def _broken(self) -> ExecutorError:
        return ExecutorError(
            f"{self.desc}: a worker process died (killed for memory, or a script that starts the stage lacks "
            "the `if __name__ == \"__main__\":` guard that spawned workers need); rerun, or lower num_workers")

    def _result(self, index: int, fut: Future) -> Any:
        try:
            return fut.result()
        except BrokenProcessPool:
            raise self._broken() from None
        except Exception as e:
            cause = e.__cause__
            raise _task_failed(self.desc, index, e, str(cause) if cause is not None else "") from None

    def _map(self, fn, tasks, window):
        pending: deque[tuple[int, Future]] = deque()
        try:
            for i, task in enumerate(tasks):
                try:
                    with _sigint_blocked():  # a submit may start a worker, which inherits the mask
                        pending.append((i, self.pool.submit(fn, *task)))
                except BrokenProcessPool:
                    raise self._broken() from None
                if len(pending) >= window:
                    yield self._result(*pending.popleft())
            while pending:
                yield self._result(*pending.popleft())
        finally:
            for _, fut in pending:
                fut.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# Ray's switch between a single-machine node and a cluster node. ray.init turns a
# node address of 127.0.0.1 into the machine's reachable address and binds its
# servers there; with this set to 0 (the name is Ray's: it is the default on
# Windows and macOS) a new node takes the loopback address and binds to it.
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """For the block: the Ray instance this process starts binds to 127.0.0.1
    only, and one it joins is looked for there, unless the user set
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER. Ray reads the variable when it is
    imported, so where it already is, its constant is set too. Both are
    restored after the block, so that a later stage in the same process can
    join a cluster by the machine's own address."""
    if RAY_CLUSTER_ENV in os.environ:
        yield
        return
    constants = sys.modules.get("ray._private.ray_constants")
    saved = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if saved is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        with _environ({RAY_CLUSTER_ENV: "0"}):
            yield
    finally:
        if saved is not None:
            constants.ENABLE_RAY_CLUSTER = saved


def on_loopback(address: str) -> bool:
    """Whether a ``host:port`` or ``ray://host:port`` address names this machine's
    loopback interface (127.0.0.1, ::1, localhost)."""
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve_auto(desc: str) -> str:
    """The ``host:port`` that ``address: auto`` names, found as Ray finds it
    (RAY_ADDRESS, else the instance ``ray start`` last started on this machine),
    so that a loopback one is known as such; "auto" itself where this Ray's
    internals differ."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return "auto"
    try:  # as written (Ray's canonical form would turn 127.0.0.1 into the machine's address)
        return get_ray_address_from_environment("auto", None)
    except ConnectionError:  # Ray's own words name its command-line flag, not this param
        raise ExecutorError(f"{desc}: executor.address is auto, but no Ray instance runs on this machine and "
                            "RAY_ADDRESS is not set: start one with `ray start --head`, or set executor.address "
                            "to a cluster's address (null: a private instance for the stage)") from None
    except Exception as e:
        raise ExecutorError(f"{desc}: could not start or join the Ray cluster at auto: {type(e).__name__}: "
                            f"{_first_line(e)}") from None


def _check_reachable(desc: str, address: str, timeout: float = 10.0) -> None:
    """Fail in one line when nothing answers at a ``host:port`` or
    ``ray://host:port`` address: ray.init would retry for minutes, logging."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ExecutorError(f"{desc}: no Ray cluster answers at {address} ({type(e).__name__}: {e.strerror or e}); "
                            "check executor.address, or start one with `ray start --head`") from None


# A private instance has no dashboard or state API to show its task events
# (``ray list tasks``, timelines), so its processes do not report them: the
# stage's ray.shutdown otherwise waits to flush the last ones (up to 0.25 s here).
_NO_TASK_EVENTS = {"RAY_task_events_report_interval_ms": "0"}

_NO_UNHANDLED_ERRORS = {"RAY_IGNORE_UNHANDLED_ERRORS": "1"}  # read by Ray as it would print one

# A task waits as long as the cluster has CPUs, however busy. With none at all
# (its nodes died or left) Ray keeps the task queued for good, so the stage
# warns at once and each minute, and stops after NO_CPU_S: time enough for an
# autoscaler to bring nodes, not a silent wait for ever. CHECK_S: how often.
CHECK_S = 5.0
NO_CPU_S = 600.0

# A task whose worker process or node died is run again (Ray's own retry, up to
# this many times; tasks are pure, so a rerun gives the same result): a
# preempted node does not stop a long stage. A task that raises is not retried.
TASK_RETRIES = 3


# As it starts, the raylet connects to its object store, which one of its own
# threads is starting. Where the store is not listening yet, Ray tries again a
# second later (10 tries, 1000 ms apart), and the whole start waits that second:
# a quarter of the Ray instances started on a 2-core machine during
# bench.ray_data's runs did. The same 10 s in all, in 10 ms steps, lets the
# start go on as soon as the store listens.
_QUICK_RETRY = {"RAY_raylet_client_connect_timeout_milliseconds": "10",
                "RAY_raylet_client_num_connect_attempts": "1000"}


def _unset(values: dict[str, str]) -> dict[str, str]:
    """The environment variables of ``values`` that the user has not set (their own
    setting wins), less those with an empty value (nothing to set)."""
    return {k: v for k, v in values.items() if v and k not in os.environ}


def _this_code_first() -> dict[str, str]:
    """PYTHONPATH for a private instance's processes, with the folder of the
    ``pipeline`` package this process imported first. Its workers import the
    stage's code as they start (:func:`_start_private_instance`), before the
    driver's ``sys.path`` reaches them as Ray passes it on; without this they
    would import whichever ``pipeline`` the environment has installed (another
    checkout's, as with git worktrees sharing one virtual environment, or an
    install older than this checkout's edits), which :func:`check_same_code`
    then refuses. Empty where the package is the environment's installed one."""
    folder = str(_package_root().parent)
    if folder in {*site.getsitepackages(), site.getusersitepackages()}:
        return {}
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != folder]
    return {"PYTHONPATH": os.pathsep.join([folder, *rest])}


@contextlib.contextmanager
def _ray_notices_logged(desc: str) -> Iterator[None]:
    """For the block: the notices a Ray cluster sends the stage's process (a
    worker died, a task will be retried, a task cannot be scheduled), which Ray
    prints to the stage's stdout, each a long line of ids, go to this module's
    log instead, as one warning line each. Where this Ray prints them some other
    way, as it does."""
    worker = sys.modules.get("ray._private.worker")
    printed = getattr(worker, "print_to_stdstream", None)
    if printed is None:
        yield
        return

    def logged(data: dict, *args: Any, **kwargs: Any) -> None:
        if data.get("pid") != "raylet":  # a worker's own output (with log_to_driver)
            printed(data, *args, **kwargs)
            return
        for notice in data.get("lines", ()):
            log.warning("%s: Ray: %s", desc, str(notice).strip().split("\n")[0])
            log.debug("%s: Ray: %s", desc, notice)

    worker.print_to_stdstream = logged
    try:
        yield
    finally:
        worker.print_to_stdstream = printed


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables the user has not set, for the block only."""
    added = _unset(values)
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _start_private_instance(workers: int, preload: Sequence[str] = ()) -> Any | None:
    """Start a single-machine Ray instance with ``workers`` CPUs and only the
    processes that tasks need: the GCS and the raylet (with its agents and
    workers). ``ray.init`` also starts the autoscaler's monitor, the log monitor
    and the API server (jobs, the state API), which a stage's private instance
    has no use for: on a 2-core machine leaving them out cut a start from 2.0 to
    1.35 s, and from 2.3 to 1.7 CPU-seconds.

    The raylet starts its ``workers`` worker processes as it starts, and each
    imports the modules ``preload`` names before it takes work. By default Ray
    starts them only when the first driver connects, and that driver's connect
    waits for them (0.3 s here); then each worker imports the stage's code on
    its first task (0.2 s more). Here both happen while the stage runs its
    first tasks itself (see :class:`RayExecutor`).

    Returns the node (stop it with :func:`_stop_private_instance`), or None
    where this Ray's internals differ from the ones this was written for (then
    the caller uses ``ray.init`` as it is)."""
    try:
        from ray._private.node import Node
        from ray._private.parameter import RayParams
    except ImportError:
        return None

    class TaskNode(Node):
        def start_api_server(self, **kwargs: Any) -> None:
            pass

    # As ray.init does for the instance it starts: no usage statistics.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The raylet's settings for the workers, as environment variables: a name a
    # later Ray no longer knows is ignored (in _system_config it stops the GCS).
    raylet_env = {**_unset({"RAY_enable_worker_prestart": "1", "RAY_preload_python_modules": ",".join(preload),
                            **_NO_TASK_EVENTS, **_QUICK_RETRY}), **_this_code_first()}
    try:
        params = RayParams(num_cpus=workers, node_ip_address="127.0.0.1", include_dashboard=False,
                           no_monitor=True, include_log_monitor=False, env_vars=raylet_env)
    except TypeError:
        log.debug("Ray's RayParams changed; starting the instance with ray.init")
        return None
    # spawn_reaper: Ray's processes end with the thread that starts them, even when it is killed.
    return TaskNode(params, head=True, shutdown_at_exit=False, spawn_reaper=True)


def _stop_private_instance(node: Any) -> None:
    """Stop a node from :func:`_start_private_instance`. Its processes are
    killed, not asked to exit: the stage's outputs are written and nothing of
    the instance outlives it, and Ray's graceful stop waits a second per
    process that takes its time."""
    import psutil

    # The raylet's own children (its agents, the workers) outlive a killed raylet
    # for up to a minute: they are found first and killed after it.
    children: list[psutil.Process] = []
    with contextlib.suppress(Exception):
        for infos in node.all_processes.values():
            for info in infos:
                children += psutil.Process(info.process.pid).children(recursive=True)
    with contextlib.suppress(Exception):
        node.destroy_external_storage()
    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()

    def ended(p: psutil.Process) -> bool:  # a zombie has ended; reaping it is its new parent's work
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    deadline = time.monotonic() + 10
    while not all(ended(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.01)


class RayExecutor(Executor):
    """Ray tasks, one CPU each; see the module docstring.

    A stage's private instance (no ``address``) starts in a background thread.
    Until it is up, :meth:`map` runs the tasks here, in order, one at a time, so
    that the stage's work starts at once and the instance's start-up (about 2 s
    on a 2-core machine) is spent on work instead of waiting. The tasks are pure
    functions of their arguments, so where a task runs does not change its
    result: outputs are the same as when every task runs on Ray."""

    kind = "ray"

    def __init__(self, desc: str, cfg: ExecutorConfig, max_workers: int | None,
                 initializer: Callable[..., None] | None, initargs: tuple):
        super().__init__(desc)
        try:
            import ray
        except ImportError:
            raise ExecutorError("executor.kind is ray but Ray is not installed: pip install '.[ray]'") from None
        self.ray = ray
        self.cfg = cfg
        # The Ray variables this executor sets, for its life only (close() restores them).
        self.scope = contextlib.ExitStack()
        self.started = False  # this executor called ray.init (and so calls ray.shutdown)
        self.starter: threading.Thread | None = None
        try:
            self._open(desc, cfg, max_workers, initializer, initargs)
        except BaseException:  # joined, then failed: leave, so that a later stage here does not find itself joined
            self.close()
            raise

    def _open(self, desc: str, cfg: ExecutorConfig, max_workers: int | None,
              initializer: Callable[..., None] | None, initargs: tuple) -> None:
        ray = self.ray
        # The tasks a map leaves in flight when it stops (a task's error, a stage that stops
        # reading) are not waited for (see _map); Ray would print the error of each that fails
        # meanwhile as an "Unhandled error" with its worker's traceback.
        self.scope.enter_context(_environ(_NO_UNHANDLED_ERRORS))
        self.scope.enter_context(_ray_notices_logged(desc))
        address = _resolve_auto(desc) if cfg.address == "auto" and not ray.is_initialized() else cfg.address
        if address is None or on_loopback(address):
            # A driver that joins by a loopback address takes that address as its own
            # too; without this it would look for the instance at the machine's address.
            self.scope.enter_context(loopback_only())
        self.initializer, self.initargs = initializer, initargs
        self.node: Any = None  # the private instance this executor started
        self.remote: Any = None  # the task, once connected
        self.here_ready = False  # the initializer has run in this process
        self.key = uuid.uuid4().hex
        self.up, self.stop = threading.Event(), threading.Event()
        self.start_error: BaseException | None = None
        if ray.is_initialized() or address is not None:
            if not ray.is_initialized():
                _check_reachable(desc, address)
                self._connect(address, dict(include_dashboard=False))
            cpus = int(ray.cluster_resources().get("CPU", 1))
            self.workers = max(1, min(cfg.num_workers or cpus, cpus))
            self._make_task()
        else:
            # A private instance for this stage, reachable from this machine only.
            # Token authentication would write ~/.ray/auth_token for an instance
            # that lives as long as the stage; the user's own setting wins.
            self.scope.enter_context(_environ({"RAY_AUTH_MODE": "disabled"}))
            cpus = cfg.num_workers or available_cores()
            if max_workers is not None:  # its raylet starts a worker per CPU, each importing the stage's code
                cpus = max(1, min(cpus, max_workers))
            self.workers = cpus
            self.starter = threading.Thread(target=self._start, args=(cpus,), name="ray-start", daemon=True)
            self.starter.start()
        if max_workers is not None:
            self.workers = max(1, min(self.workers, max_workers))
        self.cpus = cpus

    def _start(self, cpus: int) -> None:
        """The starter thread: start the instance, then stay alive until close()
        and stop it. Ray ties its processes' lives to the thread that started
        them (the kernel's parent-death signal), not to the process."""
        # The workers import the stage's code as they start (not __main__: a worker cannot).
        module = getattr(self.initializer, "__module__", None)
        try:
            self.node = _start_private_instance(cpus, (module,) if module not in (None, "__main__") else ())
        except BaseException as e:  # raised in the stage's thread, by ready()
            self.start_error = e
        self.up.set()
        self.stop.wait()
        if self.node is not None:
            try:
                _stop_private_instance(self.node)
            except Exception as e:  # the stage's work is done: say so in one line, not a thread traceback
                log.warning("%s: stopping the private Ray instance failed: %s: %s", self.desc, type(e).__name__, e)

    def _connect(self, address: str, kwargs: dict) -> None:
        try:
            with warnings.catch_warnings():  # Ray Client warns in two lines before it raises the same
                warnings.filterwarnings("ignore", message="Ray Client connection timed out")
                self.ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                              configure_logging=True, **kwargs)
        except Exception as e:  # ConnectionError, ValueError, RuntimeError depending on the failure
            self._failed(e)
        self.started = True

    def _failed(self, e: BaseException) -> None:
        where = f"the Ray cluster at {self.cfg.address}" if self.cfg.address else "a local Ray instance"
        hint = ""
        if (self.cfg.address or "").startswith("ray://") and isinstance(e, ConnectionError):
            hint = " (a ray:// address names the head's Ray Client server, port 10001 by default, not its GCS port)"
        raise ExecutorError(f"{self.desc}: could not start or join {where}: {type(e).__name__}: "
                            f"{_first_line(e)}{hint}") from None

    def _make_task(self) -> None:
        self.init = [self.desc, code_identity(), self.initializer, self.ray.put(self.initargs)]
        self.remote = self.ray.remote(num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=False)(_ray_task)

    def starting(self) -> bool:
        """Whether the private instance is still starting (tasks then run here)."""
        return self.remote is None and self.starter is not None and not self.up.is_set()

    def ready(self) -> None:
        """Wait for the private instance and connect to it (at once when joined
        or already connected). Raises ExecutorError when it could not start."""
        if self.remote is not None:
            return
        assert self.starter is not None
        self.up.wait()
        if self.start_error is not None:
            self._failed(self.start_error)
        if self.node is not None:
            with _environ(_NO_TASK_EVENTS):  # read as this process's core worker starts
                self._connect(self.node.address, {})
        else:  # Ray's internals changed: ray.init starts the instance ("local": a new one)
            self._connect("local", dict(num_cpus=self.cpus, include_dashboard=False))
        self._make_task()

    def _run_here(self, fn: Callable[..., Any], index: int, task: Sequence[Any]) -> Any:
        if not self.here_ready:
            if self.initializer is not None:
                self.initializer(*self.initargs)
            self.here_ready = True
        try:
            return fn(*task)
        except StageError:
            raise
        except Exception as e:
            raise _task_failed(self.desc, index, e, traceback.format_exc()) from None

    def _result(self, index: int, ref: Any) -> Any:
        from ray.exceptions import RayError, RayTaskError

        try:
            return self.ray.get(ref)
        except RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            raise _task_failed(self.desc, index, cause, str(e)) from None
        except RayError as e:  # a worker or node died, an object was lost
            raise ExecutorError(f"{self.desc}: task {index} was lost: {type(e).__name__}: {_first_line(e)}") from None

    def _wait(self, refs: list, index: int) -> list:
        """``ray.wait(refs, num_returns=1)``, watching that the cluster still has
        CPUs (see NO_CPU_S); ``index``: the task waited for, for the messages."""
        since: float | None = None  # when the cluster was first seen without CPUs
        warnings = 0
        while True:
            done, _ = self.ray.wait(refs, num_returns=1, timeout=CHECK_S)
            if done:
                return done
            if self.ray.cluster_resources().get("CPU", 0) > 0:
                since, warnings = None, 0
                continue
            now = time.monotonic()
            since = now if since is None else since
            waited = now - since
            if waited >= NO_CPU_S:
                raise ExecutorError(f"{self.desc}: the Ray cluster has had no CPUs for {waited:.0f} s (its nodes "
                                    f"died or left), so task {index} cannot run; bring nodes back and rerun the "
                                    "stage (it keeps its committed shards)")
            if waited >= 60 * warnings:
                log.warning("%s: the Ray cluster has no CPUs (its nodes died or left, or an autoscaler has not "
                            "added them yet); task %d waits, at most %.0f s more", self.desc, index, NO_CPU_S - waited)
                warnings += 1

    def _map(self, fn, tasks, window):
        tasks = iter(tasks)
        index = 0
        while self.starting():
            task = next(tasks, None)
            if task is None:
                return
            yield self._run_here(fn, index, task)
            index += 1
        self.ready()
        # At most `window` tasks taken and not yet yielded. Where the cluster has
        # more CPUs than `workers` (a joined cluster), at most `workers` of them are
        # submitted and not finished, so that no more run at once than
        # executor.num_workers says; otherwise all are submitted, and Ray queues
        # them (a worker that finishes a task finds the next one waiting).
        bounded = self.workers < self.cpus
        numbered = enumerate(tasks, start=index)
        todo: deque[tuple[int, Sequence[Any]]] = deque()  # taken, not yet submitted
        refs: deque[tuple[int, Any]] = deque()  # submitted, in task order
        running: set = set()  # bounded: submitted and not seen finished
        exhausted = False

        def submit() -> None:
            while todo and (not bounded or len(running) < self.workers):
                i, task = todo.popleft()
                ref = self.remote.remote(self.key, self.init, fn, tuple(task))
                refs.append((i, ref))
                if bounded:
                    running.add(ref)

        # Tasks left in flight when the caller stops reading (a task's error, a stage
        # that stops early) are left: they end with the stage's connection (a private
        # instance is stopped, and a cluster ends a driver's tasks when it disconnects,
        # at once, measured), and their errors are not printed (_NO_UNHANDLED_ERRORS).
        # Not ``ray.cancel``: in Ray 2.60 a cancel that races with the reply of a task
        # on another node aborts the stage's process ("Check failed: it !=
        # submissible_tasks_.end()", ray-project/ray#54846; reproduced here on a
        # two-node cluster).
        while True:
            while not exhausted and len(todo) + len(refs) < window:
                nxt = next(numbered, None)
                if nxt is None:
                    exhausted = True
                else:
                    todo.append(nxt)
            submit()
            if not refs:
                return
            i, ref = refs[0]
            if bounded:
                while ref in running:  # wait for the next result, submitting as other tasks finish
                    running.difference_update(self._wait(list(running), i))
                    submit()
            else:
                self._wait([ref], i)
            refs.popleft()
            yield self._result(i, ref)

    def close(self) -> None:
        try:
            if self.starter is not None:
                self.up.wait()
            if self.started:
                self.ray.shutdown()
        finally:  # a shutdown that fails (or a Ctrl-C) still stops the private instance
            try:
                if self.starter is not None:
                    self.stop.set()
                    self.starter.join()
            finally:
                self.scope.close()


@contextlib.contextmanager
def open_executor(cfg: ExecutorConfig, initializer: Callable[..., None] | None = None, initargs: tuple = (),
                  max_workers: int | None = None, desc: str = "stage") -> Iterator[Executor]:
    """An executor for ``cfg``, closed (its pool shut down, a Ray instance it
    started stopped) on exit. ``initializer(*initargs)`` runs once in every
    worker before its first task; ``max_workers`` caps the worker count (a stage
    passes its task count, so a tiny input runs in-process under ``local``).
    ``initializer``, the mapped functions and their arguments must be picklable
    (module-level functions)."""
    ex: Executor
    return_freed_memory()  # this process runs tasks too: in-process, and while a private Ray instance starts
    if cfg.kind == "ray":
        ex = RayExecutor(desc, cfg, max_workers, initializer, initargs)
    else:
        workers = cfg.num_workers or available_cores()
        if max_workers is not None:
            workers = min(workers, max_workers)
        workers = max(1, workers)
        ex = InProcess(desc, initializer, initargs) if workers == 1 else \
            LocalPool(desc, workers, initializer, initargs)
    try:
        yield ex
    finally:
        ex.close()
