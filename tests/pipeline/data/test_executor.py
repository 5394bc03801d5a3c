"""pipeline/data/executor.py with the local kinds (in-process and a spawn pool);
the Ray kind's bookkeeping with a stand-in for Ray (FakeRay), and with a real
local instance in test_clean_ray.py and test_executor_ray.py (a stage's private
instance, joining a loopback head)."""

import ctypes
import errno
import os
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from pipeline.config import ConfigError, parse_section
from pipeline.data import executor as executor_module
from pipeline.data.clean import CleanConfig
from pipeline.data.executor import (ExecutorConfig, ExecutorError, InProcess, LocalPool, _check_reachable, on_loopback,
                                    open_executor)
from pipeline.errors import StageError
from pipeline.files import DiskFullError
from tests.conftest import ROOT

_STATE: dict = {}


def init(tag: str) -> None:
    _STATE["tag"] = tag
    _STATE["inits"] = _STATE.get("inits", 0) + 1


def inits(_: int = 0) -> tuple[int, int]:
    """How many times the initializer has run in this process, and its pid."""
    return _STATE.get("inits", 0), os.getpid()


def tagged(x: int, delay: float = 0.0) -> tuple[str, int, int]:
    time.sleep(delay)
    return _STATE.get("tag", "none"), x * x, os.getpid()


def met(x: int, folder: str, workers: int) -> int:
    """Wait (up to 60 s) until ``workers`` different processes have run a task of
    this kind: however slow a worker is to start, each of them gets one."""
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < workers and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def timed(x: int, delay: float) -> tuple[float, float]:
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    time.sleep(delay)
    return start, time.monotonic()


class BadInput(StageError):
    pass


def fails(x: int) -> int:
    if x == 2:
        raise BadInput(f"document {x} is unreadable")
    if x == 3:
        raise ValueError("a bug\nwith a second line")
    return x


def dies(x: int) -> int:
    if x == 1:
        os._exit(3)
    return x


def dies_once(x: int, marks: str) -> int:
    """Task 1's process dies the first time it runs (a crash, a preempted node),
    leaving a mark in the folder ``marks``; it succeeds after that."""
    mark = os.path.join(marks, f"died-{x}")
    if x == 1 and not os.path.exists(mark):
        open(mark, "w").close()
        os._exit(3)
    return x


def local(workers: int) -> ExecutorConfig:
    return ExecutorConfig(kind="local", num_workers=workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_results_come_in_task_order_with_the_initializer_run_in_every_worker(workers):
    # Early tasks are the slow ones, so a pool finishes them last.
    tasks = [(x, 0.2 if x < 2 else 0.0) for x in range(8)]
    with open_executor(local(workers), init, ("cfg",)) as ex:
        assert isinstance(ex, InProcess if workers == 1 else LocalPool) and ex.workers == workers
        out = list(ex.map(tagged, tasks))
    assert [(tag, sq) for tag, sq, _ in out] == [("cfg", x * x) for x in range(8)]
    pids = {pid for _, _, pid in out}
    assert (pids == {os.getpid()}) if workers == 1 else (os.getpid() not in pids)


@pytest.mark.parametrize("workers", [1, 2])
def test_tasks_are_read_lazily_within_the_window(workers):
    pulled = []

    def tasks():
        for x in range(20):
            pulled.append(x)
            yield (x,)

    with open_executor(local(workers)) as ex:
        it = ex.map(tagged, tasks(), window=3)
        next(it)
        assert len(pulled) <= 3
        assert [sq for _, sq, _ in it] == [x * x for x in range(1, 20)]


def test_the_window_is_twice_the_workers_by_default():
    pulled = []

    def tasks():
        for x in range(20):
            pulled.append(x)
            yield (x,)

    with open_executor(local(2)) as ex:
        it = ex.map(tagged, tasks())
        next(it)
        assert len(pulled) == 4  # submitted in the caller's thread: 4 taken before the first result is awaited
        assert [sq for _, sq, _ in it] == [x * x for x in range(1, 20)]


def marked(x: int, folder: str) -> int:
    time.sleep(0.5 if x else 0.0)  # task 0 ends first, while the others run or wait
    Path(folder, str(x)).touch()
    return x


def test_tasks_not_yet_started_are_cancelled_when_the_caller_stops_reading(tmp_path):
    """A stage that stops early (ingest's max_bytes) leaves no queued task to run: a
    later map's task waits behind none of them."""
    with open_executor(local(2)) as ex:
        it = ex.map(marked, [(x, str(tmp_path)) for x in range(12)], window=12)
        next(it)
        it.close()
        assert list(ex.map(marked, [(99, str(tmp_path))])) == [99]
        ran = len(os.listdir(tmp_path)) - 1
    # the first, two running and the pool's three in its call queue (6), not all 12; 2 to spare
    assert ran <= 8


def test_max_workers_caps_the_pool_and_one_worker_runs_in_process():
    with open_executor(local(4), max_workers=1) as ex:
        assert isinstance(ex, InProcess)


def test_zero_workers_means_one_per_available_core(monkeypatch):
    monkeypatch.setattr("pipeline.data.executor.available_cores", lambda: 3)
    with open_executor(local(0)) as ex:
        assert isinstance(ex, LocalPool) and ex.workers == 3
    with open_executor(local(0), max_workers=2) as ex:
        assert ex.workers == 2


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def test_the_bar_advances_by_the_units_of_each_result():
    bar = Bar()
    with open_executor(local(1)) as ex:
        list(ex.map(tagged, [(x,) for x in range(5)], bar=bar, units=lambda r: r[1]))
    assert bar.n == sum(x * x for x in range(5))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stage_error_in_a_worker_reaches_the_caller_unchanged(workers):
    with open_executor(local(workers)) as ex, pytest.raises(BadInput, match="^document 2 is unreadable$"):
        list(ex.map(fails, [(x,) for x in range(5)]))


def test_any_other_worker_exception_is_one_line_naming_the_task_and_place():
    with open_executor(local(2)) as ex, pytest.raises(ExecutorError) as err:
        list(ex.map(fails, [(x,) for x in (0, 1, 3, 4)]))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("stage: task 2 failed in a worker: ValueError: a bug")
    assert "test_executor.py:" in msg and "in fails" in msg


def fails_without_a_message(x: int) -> int:
    raise RuntimeError()


def test_an_exception_without_a_message_is_named_alone():
    with open_executor(local(2)) as ex, pytest.raises(ExecutorError) as err:
        list(ex.map(fails_without_a_message, [(0,)]))
    assert str(err.value).startswith("stage: task 0 failed in a worker: RuntimeError (at test_executor.py:")


def writes_on_a_full_disk(x: int) -> int:
    if x == 1:
        raise OSError(errno.ENOSPC, "No space left on device", "data/clean/quarantine.jsonl")
    return x


def test_a_worker_write_the_disk_cannot_hold_is_a_disk_full_error_naming_the_file():
    """Not a worker's failure of its own (in-process, the stage's runner reads the OSError alike)."""
    with open_executor(local(2)) as ex, pytest.raises(DiskFullError) as err:
        list(ex.map(writes_on_a_full_disk, [(x,) for x in range(3)]))
    assert str(err.value).startswith("no space left on the device writing data/clean/quarantine.jsonl (")


def test_a_dying_worker_is_a_clear_error():
    with open_executor(local(2), desc="clean") as ex, pytest.raises(ExecutorError, match="^clean: a worker process died"):
        list(ex.map(dies, [(x,) for x in range(4)]))


def sigint_blocked(_: int) -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_ctrl_c_stops_the_stage_through_its_main_process_alone():
    """Workers start with SIGINT blocked (the terminal sends it to the whole
    process group), so they print no KeyboardInterrupt tracebacks; the caller's
    own mask is as it was."""
    with open_executor(local(2)) as ex:
        assert list(ex.map(sigint_blocked, [(x,) for x in range(4)])) == [True] * 4
    assert not sigint_blocked(0)


def test_workers_die_with_the_stage(tmp_path):
    # A stage killed by SIGKILL leaves no worker behind.
    script = (
        "import os, sys, time\n"
        "from pipeline.data.executor import ExecutorConfig, open_executor\n"
        "from tests.pipeline.data.test_executor import met\n"
        "if __name__ == '__main__':\n"
        "    with open_executor(ExecutorConfig(num_workers=2)) as ex:\n"
        "        pids = set(ex.map(met, [(x, sys.argv[1], 2) for x in range(4)]))\n"
        "        print(' '.join(map(str, pids)), flush=True)\n"
        "        time.sleep(60)\n"
    )
    (tmp_path / "stage.py").write_text(script)
    (tmp_path / "met").mkdir()
    proc = subprocess.Popen([sys.executable, str(tmp_path / "stage.py"), str(tmp_path / "met")],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_address_that_answers_nothing_is_one_line():
    pytest.importorskip("ray")
    import socket

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ExecutorError, match=rf"^clean: no Ray cluster answers at {address} \(Connection"):
            with open_executor(ExecutorConfig(kind="ray", address=address), desc="clean"):
                pass


@pytest.mark.parametrize("address", ["auto", "head.example", "head.example:port", "[::1]"])
def test_an_address_without_a_port_number_is_left_to_ray(address, monkeypatch):
    """Only a host:port is tried first (ray.init retries for minutes); other forms Ray resolves or refuses itself."""
    monkeypatch.setattr("socket.create_connection", lambda *a, **k: pytest.fail(f"tried to connect for {address}"))
    assert _check_reachable("stage", address) is None


def test_ray_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ExecutorError, match=r"pip install '\.\[ray\]'"):
        with open_executor(ExecutorConfig(kind="ray")):
            pass


@pytest.mark.parametrize("data,key,message", [
    ({"executor": {"kind": "dask"}}, "clean.executor.kind", "'local' or 'ray'"),
    ({"executor": {"address": "auto"}}, "clean.executor", "address is for kind: ray"),
    ({"executor": {"kind": "ray", "address": " "}}, "clean.executor", "address must be null"),
    ({"executor": {"kind": "ray", "address": "head:99999"}}, "clean.executor", "99999 is not a port number"),
    ({"executor": {"kind": "ray", "address": "ray://head:0"}}, "clean.executor", "0 is not a port number"),
    ({"executor": {"kind": "ray", "address": "head:65536"}}, "clean.executor", "65536 is not a port number"),
    ({"executor": {"kind": "ray", "address": "local"}}, "clean.executor", "null starts the stage's private one"),
    ({"executor": {"num_workers": -1}}, "clean.executor.num_workers", "greater than or equal to 0"),
    ({"executor": {"workers": 2}}, "clean.executor.workers", "unknown key"),
])
def test_executor_config_errors_name_the_dotted_key(data, key, message):
    with pytest.raises(ConfigError) as err:
        parse_section(CleanConfig, data, "clean")
    assert key in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("data, workers", [
    ({"num_workers": 3}, 3), ({"num_workers": 3, "executor": {"num_workers": 3}}, 3),
    ({"executor": {"num_workers": 3}}, 3), ({"num_workers": 0}, 0),
])
def test_the_older_num_workers_key_is_read_as_executor_num_workers(data, workers):
    assert parse_section(CleanConfig, data, "clean").executor.num_workers == workers


@pytest.mark.parametrize("legacy", [0, 2])
def test_an_older_num_workers_that_disagrees_with_executor_num_workers_is_one_line(legacy):
    with pytest.raises(ConfigError, match=f"num_workers={legacy} and executor.num_workers=3 disagree"):
        parse_section(CleanConfig, {"num_workers": legacy, "executor": {"num_workers": 3}}, "clean")


def test_importing_the_data_stages_does_not_import_ray():
    code = ("import sys, stages.clean, stages.tokenizer, pipeline.data.clean, pipeline.data.tokenizer, "
            "pipeline.data.executor, pipeline.data.dedup\n"
            "from pipeline.data.executor import open_executor, ExecutorConfig\n"
            "with open_executor(ExecutorConfig(num_workers=1)) as ex: list(ex.map(abs, [(-1,)]))\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:6379", True), ("ray://127.0.0.1:10001", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("127.0.1.1:6379", True), ("10.0.0.5:6379", False), ("ray://head.example:10001", False), ("auto", False),
])
def test_on_loopback(address, loopback):
    assert on_loopback(address) is loopback


def test_address_auto_with_no_instance_running_is_one_line_naming_the_param(monkeypatch):
    """Ray's own error names its command-line flag; the stage's names its param.
    No instance is found: none in RAY_ADDRESS, no GCS process, no address that
    ``ray start`` left."""
    pytest.importorskip("ray")
    import ray._private.services as services

    from pipeline.data.executor import _resolve_auto

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(ExecutorError, match=r"^clean: executor.address is auto, but no Ray instance runs on this "
                                            r"machine and RAY_ADDRESS is not set: start one with `ray start --head`"):
        _resolve_auto("clean")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")  # Ray's order: the variable first
    assert _resolve_auto("clean") == "127.0.0.1:6390"


def test_ray_variables_are_set_where_the_user_set_none_and_only_for_the_block(monkeypatch):
    monkeypatch.setenv("PIPELINE_TEST_A", "the user's")
    monkeypatch.delenv("PIPELINE_TEST_B", raising=False)
    monkeypatch.delenv("PIPELINE_TEST_C", raising=False)
    with executor_module._environ({"PIPELINE_TEST_A": "ours", "PIPELINE_TEST_B": "ours", "PIPELINE_TEST_C": ""}):
        assert os.environ["PIPELINE_TEST_A"] == "the user's" and os.environ["PIPELINE_TEST_B"] == "ours"
        assert "PIPELINE_TEST_C" not in os.environ  # an empty value: nothing to set
    assert os.environ["PIPELINE_TEST_A"] == "the user's" and "PIPELINE_TEST_B" not in os.environ


def test_loopback_only_for_the_block_unless_the_user_set_the_variable(monkeypatch):
    """Ray's constant is set where Ray is imported already (here a stand-in), and restored."""
    constants = types.SimpleNamespace(ENABLE_RAY_CLUSTER=True)
    monkeypatch.setitem(sys.modules, "ray._private.ray_constants", constants)
    name = executor_module.RAY_CLUSTER_ENV
    monkeypatch.delenv(name, raising=False)
    with executor_module.loopback_only():
        assert os.environ[name] == "0" and constants.ENABLE_RAY_CLUSTER is False
    assert name not in os.environ and constants.ENABLE_RAY_CLUSTER is True
    monkeypatch.setenv(name, "1")
    with executor_module.loopback_only():
        assert os.environ[name] == "1" and constants.ENABLE_RAY_CLUSTER is True


def test_a_ray_worker_with_other_code_or_libraries_refuses_in_one_line():
    here = executor_module.code_identity()
    executor_module.check_same_code("clean", dict(here))  # the same: no error
    with pytest.raises(ExecutorError) as err:
        executor_module.check_same_code("clean", {**here, "numpy": "0.0.1"})
    msg = str(err.value)
    assert msg.startswith("clean: the Ray worker on ") and f"(numpy {here['numpy']} there, 0.0.1 here;" in msg
    assert "pipeline source" not in msg and "\n" not in msg


def test_private_instance_processes_import_this_checkout_first(monkeypatch):
    folder = str(executor_module._package_root().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", folder, ""]))
    monkeypatch.setattr(executor_module.site, "getsitepackages", lambda: ["/venv/site-packages"])
    assert executor_module._this_code_first() == {"PYTHONPATH": os.pathsep.join([folder, "/elsewhere"])}
    monkeypatch.setattr(executor_module.site, "getsitepackages", lambda: [folder])  # the installed package
    assert executor_module._this_code_first() == {}


@pytest.mark.parametrize("num_workers, workers", [(0, 2), (1, 1), (8, 2)])
def test_joining_a_cluster_runs_at_most_its_cpus_at_once(monkeypatch, num_workers, workers):
    """A stand-in for a connected Ray with 2 CPUs: executor.num_workers is capped by them (0: all)."""
    fake = types.SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {"CPU": 2.0},
                                 put=lambda x: x, remote=lambda **kw: (lambda fn: fn), shutdown=lambda: None)
    monkeypatch.setitem(sys.modules, "ray", fake)
    ex = executor_module.RayExecutor("stage", ExecutorConfig(kind="ray", num_workers=num_workers), None, None, ())
    try:
        assert (ex.workers, ex.cpus) == (workers, 2)
    finally:
        ex.close()


class _Ref:
    def __init__(self, value: Any):
        self.value = value


class FakeRay:
    """A stand-in for Ray, connected to a cluster of ``cpus`` CPUs: a task runs
    when submitted, and is seen finished when the stage waits for it (the oldest
    first); ``cpus_seen``: what cluster_resources says, call by call, while no
    task finishes (then ``cpus``). Counts the most tasks submitted and not yet seen finished."""

    def __init__(self, cpus: float = 2.0, cpus_seen: Sequence[float] = (), connected: bool = True):
        self.cpus, self.cpus_seen, self.connected = cpus, list(cpus_seen), connected
        self.unfinished: list[_Ref] = []
        self.most = 0

    def is_initialized(self) -> bool:
        return self.connected

    def init(self, **kwargs: Any) -> None:
        self.connected = True

    def shutdown(self) -> None:
        self.connected = False

    def cluster_resources(self) -> dict:
        return {"CPU": self.cpus_seen.pop(0) if self.cpus_seen else self.cpus}

    def put(self, value: Any) -> Any:
        return value

    def remote(self, **options: Any) -> Callable:
        return lambda _ray_task: types.SimpleNamespace(remote=self._submit)

    def _submit(self, key: str, init: list, fn: Callable, task: tuple) -> _Ref:
        ref = _Ref(fn(*task))
        self.unfinished.append(ref)
        self.most = max(self.most, len(self.unfinished))
        return ref

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        if self.cpus_seen:
            return [], refs
        done = [ref for ref in self.unfinished if ref in refs][:1]
        self.unfinished = [ref for ref in self.unfinished if ref not in done]
        return done, [ref for ref in refs if ref not in done]

    def get(self, ref: _Ref) -> Any:
        return ref.value


@pytest.fixture
def fake_ray(monkeypatch):
    """Install a FakeRay (made by the returned function) as the ``ray`` module."""
    pytest.importorskip("ray")
    import ray.exceptions  # noqa: F401  (the real one, which RayExecutor imports)

    def install(**kwargs: Any) -> FakeRay:
        fake = FakeRay(**kwargs)
        monkeypatch.setitem(sys.modules, "ray", fake)
        return fake
    return install


@pytest.mark.parametrize("num_workers, most", [(1, 1), (3, 3), (0, 8)])
def test_a_joined_cluster_runs_no_more_tasks_at_once_than_num_workers(fake_ray, num_workers, most):
    """Fewer workers than the cluster's CPUs: at most that many tasks submitted and
    not finished, results in task order; all of its CPUs (0): Ray queues the window."""
    fake = fake_ray(cpus=4.0)
    with open_executor(ExecutorConfig(kind="ray", address="10.0.0.5:6379", num_workers=num_workers)) as ex:
        assert list(ex.map(abs, [(-x,) for x in range(20)], window=8)) == list(range(20))
    assert fake.most == most


@pytest.mark.parametrize("max_workers, workers", [(1, 1), (3, 3), (9, 4)])
def test_max_workers_caps_the_tasks_run_at_once_on_a_cluster(fake_ray, max_workers, workers):
    fake_ray(cpus=4.0)
    with open_executor(ExecutorConfig(kind="ray", address="10.0.0.5:6379"), max_workers=max_workers) as ex:
        assert ex.workers == workers


def test_a_cluster_without_cpus_warns_at_once_and_stops_after_no_cpu_s_without_any(fake_ray, monkeypatch, caplog):
    """CPUs that come back restart the count: the stage stops after NO_CPU_S of
    none in a row, not of none in all; it warns as soon as it sees none."""
    now = [0.0]

    def clock() -> float:
        now[0] += 250.0
        return now[0]

    monkeypatch.setattr(executor_module, "time", types.SimpleNamespace(monotonic=clock))
    fake = fake_ray(cpus=4.0, cpus_seen=[4, 0, 0, 1, 0, 0, 0, 0])  # 4: as the stage joins
    with open_executor(ExecutorConfig(kind="ray", address="10.0.0.5:6379"), desc="clean") as ex:
        with pytest.raises(ExecutorError, match=r"^clean: the Ray cluster has had no CPUs for 750 s \(its nodes "
                                                r"died or left\), so task 0 cannot run"):
            list(ex.map(abs, [(-1,)]))
    warned = [r.getMessage() for r in caplog.records if "has no CPUs" in r.getMessage()]
    assert len(warned) == 5 and warned[0].endswith("task 0 waits, at most 600 s more")
    assert fake.cpus_seen == []


def test_a_cluster_that_fails_after_joining_is_left_and_the_ray_variables_restored(fake_ray, monkeypatch):
    """Joined, then an error (here the initializer's arguments cannot be sent):
    the stage's process leaves the cluster, so that a later stage in it does not
    find itself joined to this one, and restores the variables it set."""
    def put(value: Any) -> None:
        raise TypeError("cannot pickle '_thread.lock' object")

    fake = fake_ray(connected=False)
    monkeypatch.setattr(fake, "put", put)
    monkeypatch.setattr(executor_module, "_check_reachable", lambda desc, address: None)
    names = (executor_module.RAY_CLUSTER_ENV, "RAY_IGNORE_UNHANDLED_ERRORS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TypeError, match="cannot pickle"):
        with open_executor(ExecutorConfig(kind="ray", address="127.0.0.1:6379"), init, ("cfg",)):
            pass
    assert fake.connected is False and not any(name in os.environ for name in names)


def test_a_private_instance_has_as_many_cpus_as_the_stage_has_workers(fake_ray, monkeypatch):
    """max_workers (a stage's task count) caps its private instance too, whose
    raylet starts a worker process per CPU, each importing the stage's code."""
    started = []

    def start(workers: int, preload: Sequence[str] = ()) -> None:
        started.append(workers)
        raise RuntimeError("not started here")

    fake_ray(connected=False)
    monkeypatch.setattr(executor_module, "_start_private_instance", start)
    with open_executor(ExecutorConfig(kind="ray", num_workers=4), max_workers=2) as ex:
        ex.up.wait()
        assert ex.workers == 2
    assert started == [2]

def test_a_private_instance_is_stopped_even_when_leaving_it_fails(fake_ray, monkeypatch):
    """ray.shutdown raising (or a Ctrl-C during it) must not leave the stage's
    private instance running for as long as its process lives."""
    def shutdown() -> None:
        raise RuntimeError("the GCS went away")

    stopped = []
    fake = fake_ray(connected=False)
    monkeypatch.setattr(fake, "shutdown", shutdown)
    monkeypatch.setattr(executor_module, "_start_private_instance",
                        lambda workers, preload=(): types.SimpleNamespace(address="127.0.0.1:6379"))
    monkeypatch.setattr(executor_module, "_stop_private_instance", stopped.append)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(RuntimeError, match="the GCS went away"):
        with open_executor(ExecutorConfig(kind="ray", num_workers=1)) as ex:
            ex.ready()
    assert len(stopped) == 1 and not ex.starter.is_alive() and "RAY_AUTH_MODE" not in os.environ



def test_a_ray_client_that_cannot_connect_is_one_line_naming_its_port(fake_ray, monkeypatch, recwarn):
    """Ray Client gives up after 30 s (here at once), warning in two lines first;
    a common cause is a ray:// address with the GCS port, which answers."""
    def init(**kwargs: Any) -> None:
        warnings.warn("Ray Client connection timed out. Ensure that the Ray Client port on the head node is "
                      "reachable from your local machine.", UserWarning)
        raise ConnectionError("ray client connection timeout")

    fake = fake_ray(connected=False)
    monkeypatch.setattr(fake, "init", init)
    monkeypatch.setattr(executor_module, "_check_reachable", lambda desc, address: None)
    with pytest.raises(ExecutorError) as err:
        with open_executor(ExecutorConfig(kind="ray", address="ray://10.0.0.5:6379"), desc="clean"):
            pass
    assert str(err.value) == ("clean: could not start or join the Ray cluster at ray://10.0.0.5:6379: "
                              "ConnectionError: ray client connection timeout (a ray:// address names the head's "
                              "Ray Client server, port 10001 by default, not its GCS port)")
    assert not [w for w in recwarn if "Ray Client" in str(w.message)]



class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def mapped_after_free(_: int = 0) -> bool:
    """Whether a 3 MB block malloc'ed after a 4 MB one was freed is mapped on its
    own (handed back to the system when freed) rather than cut from the heap,
    whose free pieces a process keeps: glibc's default raises its mmap
    threshold to 4 MB at that free (so: heap); a worker's fixed thresholds keep
    it at 2 MiB (so: mapped). Read from ``mallinfo2``'s bytes in mapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    libc.free(libc.malloc(4 << 20))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(3 << 20)
    mapped = libc.mallinfo2().hblkhd - before >= 3 << 20
    libc.free(block)
    return mapped


def kept_at_heap_top_after_free(_: int = 0) -> bool:
    """Whether 12 MiB freed at the top of the heap (1 MiB blocks, below the mmap
    threshold) are kept there for the next blocks rather than handed back at
    once: a worker's trim threshold of 16 MiB keeps them, glibc's default
    (128 KiB while the mmap threshold is fixed or not yet raised) trims them."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    blocks = [libc.malloc(1 << 20) for _ in range(12)]
    for block in reversed(blocks):
        libc.free(block)
    return libc.mallinfo2().keepcost >= 8 << 20


def test_workers_hand_freed_buffers_back_to_the_system():
    """Every process that runs tasks calls return_freed_memory, so that a
    worker's memory is that of its task, not of all the tasks it ran (a pack
    worker's peak grew with the corpus before it)."""
    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc 2.33 or later")
    out = subprocess.run([sys.executable, "-c", "from tests.pipeline.data.test_executor import mapped_after_free as m; "
                          "print(m())"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]  # glibc's default, in a process that runs no task
    out = subprocess.run([sys.executable, "-c", "from tests.pipeline.data.test_executor import "
                          "kept_at_heap_top_after_free as k; print(k())"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
    with open_executor(ExecutorConfig(kind="local", num_workers=2)) as ex:
        assert isinstance(ex, LocalPool)
        assert list(ex.map(mapped_after_free, [(i,) for i in range(2)])) == [True, True]
        assert list(ex.map(kept_at_heap_top_after_free, [(i,) for i in range(2)])) == [True, True]
