"""pipeline/data/executor.py: the private Ray instance a stage starts when
``executor.address`` is null. Each test runs a fresh Python process, because
the instance belongs to one process (and this suite's Ray tests share another
one). Marked slow: each starts Ray."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.data import executor as executor_module
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

pytest.importorskip("ray")

PRELUDE = """
import json, os, sys, psutil, ray
import pipeline.data.executor as E
from pipeline.data.executor import ExecutorConfig, ExecutorError, open_executor
from tests.pipeline.data.test_executor import fails, init, inits, tagged
SEEN = set()
_stop = E._stop_private_instance
def stop_watched(node):  # every process of the instance, seen just before it is stopped
    SEEN.update(psutil.Process().children(recursive=True))
    _stop(node)
E._stop_private_instance = stop_watched
def leftover():
    # processes of the instance still alive: this process's children, and those
    # seen before the stop (a raylet's children outlive it, no longer ours)
    alive = []
    for p in SEEN | set(psutil.Process().children(recursive=True)):
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.name())
        except psutil.Error:
            pass
    return sorted(alive)
"""


def run_proc(code: str, home, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """Run ``code`` after PRELUDE in a fresh process, which must succeed."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_IGNORE_UNHANDLED_ERRORS")}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, cwd=ROOT,
                          env={**base, "PYTHONPATH": str(ROOT), "HOME": str(home), **env}, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run(code: str, home, timeout: float = 300, **env) -> list:
    """Run ``code`` after PRELUDE in a fresh process; its stdout lines as JSON values."""
    return [json.loads(line) for line in run_proc(code, home, timeout, **env).stdout.splitlines()]


def test_a_private_instance_listens_on_loopback_only_writes_no_token_and_is_stopped(tmp_path):
    """...and the variables it sets for Ray are this process's for the stage only, so
    that a later stage in the same process can join a cluster by the machine's address.
    Its raylet tries its object store every 10 ms as it starts (Ray's default: a
    second's wait whenever the store is not listening yet, often on a loaded machine)."""
    (nodes, ips, during, after, state_after, left, mapped, retry), = run(
        "import ray._private.ray_constants as C\n"
        "from tests.pipeline.data.test_executor import mapped_after_free\n"
        "def state():\n"
        "    return [os.environ.get(k) for k in ('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', 'RAY_AUTH_MODE')] + \\\n"
        "        [C.ENABLE_RAY_CLUSTER]\n"
        "with open_executor(ExecutorConfig(kind='ray', num_workers=1)) as ex:\n"
        "    ex.ready()\n"
        "    mapped = [mapped_after_free()] + list(ex.map(mapped_after_free, [(0,), (1,)]))\n"
        "    during = state()\n"
        "    nodes = sorted({n['NodeManagerAddress'] for n in ray.nodes()})\n"
        "    ips = sorted({c.laddr.ip for p in psutil.Process().children(recursive=True)\n"
        "                  for c in p.net_connections('tcp') if c.status == 'LISTEN'})\n"
        "    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == 'raylet')\n"
        "    retry = {k: v for k, v in raylet.environ().items() if k.startswith('RAY_raylet_client_')}\n"
        "print(json.dumps([nodes, ips, during, ray.is_initialized(), state(), leftover(), mapped, retry]))\n", tmp_path)
    assert nodes == ["127.0.0.1"]
    assert ips and set(ips) <= {"127.0.0.1", "::ffff:127.0.0.1"}
    assert after is False and left == []  # disconnected, and every process of the instance is gone
    assert not (tmp_path / ".ray").exists()  # no ~/.ray/auth_token for a private instance
    assert during == ["0", "disabled", False] and state_after == [None, None, True]
    assert mapped == [True, True, True]  # the stage's process and the Ray worker hand freed buffers back
    assert retry == {"RAY_raylet_client_connect_timeout_milliseconds": "10",
                     "RAY_raylet_client_num_connect_attempts": "1000"}


MAP = """
cfg = ExecutorConfig(kind='ray', num_workers=2)
with open_executor(cfg, init, ('cfg',)) as ex:
    def tasks():  # tasks while the instance starts, then 6 more
        x = 0
        while ex.starting():
            yield (x, 0.01); x += 1
        for x in range(x, x + 6):
            yield (x, 0.0)
    out = list(ex.map(tagged, tasks()))
    runs = sorted(set(ex.map(inits, [(x,) for x in range(8)])))
print(json.dumps([[tag, sq, pid == os.getpid()] for tag, sq, pid in out]))
print(json.dumps([[n, pid == os.getpid()] for n, pid in runs] + [[inits()[0], True]]))
print(json.dumps(leftover()))
"""


@pytest.mark.parametrize("internals", ["lean", "ray.init"])
def test_tasks_run_here_while_the_instance_starts_then_on_ray_in_order(tmp_path, internals):
    """The first tasks run in the stage's process while the instance starts, the
    rest on Ray's workers; results in task order, the initializer run in both.
    "ray.init": where Ray's internals differ, ray.init starts the instance, in
    the stage's thread, so every task runs on Ray."""
    patch = "E._start_private_instance = lambda workers, preload=(): None\n" if internals == "ray.init" else ""
    out, runs, left = run(patch + MAP, tmp_path)
    assert [sq for _, sq, _ in out] == [x * x for x in range(len(out))]
    assert {tag for tag, _, _ in out} == {"cfg"}
    here = [h for _, _, h in out]
    if internals == "lean":
        assert here[0] is True and not any(here[-6:])
        assert here == sorted(here, reverse=True)  # here first, then Ray only
    else:
        assert len(here) == 6 and not any(here)
    # once in each Ray worker (by the last map, on Ray only), and once here where tasks ran here
    assert runs[:-1] and all(run == [1, False] for run in runs[:-1]), runs
    assert runs[-1] == [1 if internals == "lean" else 0, True]
    assert left == []


@pytest.mark.parametrize("internals", ["lean", "ray.init"])
def test_a_private_instance_runs_the_checkout_the_stage_runs_in(tmp_path, internals):
    """``python -m stages.<name>`` imports the ``pipeline`` of the checkout it
    runs in; a private instance's workers run that same code, not the
    ``pipeline`` the environment has installed (here this suite's checkout,
    beside a second one with an edit of its own, as git worktrees sharing one
    virtual environment are), also where the workers import the module of the
    executor's initializer as they start. No PYTHONPATH, as under ``dvc repro``."""
    checkout = tmp_path / "worktree"
    shutil.copytree(ROOT / "pipeline", checkout / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "pipeline" / "edited_here.py").write_text("# a change only this checkout has\n")
    patch = "E._start_private_instance = lambda workers, preload=(): None\n" if internals == "ray.init" else ""
    code = ("import json, os\n"
            "import pipeline.data.executor as E\n" + patch +
            "with E.open_executor(E.ExecutorConfig(kind='ray', num_workers=1), E.return_freed_memory) as ex:\n"
            "    ex.ready()\n"
            "    pids = list(ex.map(os.getpid, [(), ()]))\n"
            "    roots = [str(r) for r in ex.map(E._package_root, [(), ()])]\n"
            "print(json.dumps([os.getpid() in pids, str(E._package_root()), roots]))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=checkout,
                          env={**env, "HOME": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    here, root, roots = json.loads(proc.stdout.splitlines()[-1])
    assert here is False  # the tasks ran on Ray's workers
    assert root == str(checkout / "pipeline") and roots == [root, root]


def test_the_workers_start_with_the_instance_and_import_the_stage_code_before_it_connects(tmp_path):
    """Ray's own default starts the workers when the first driver connects, and
    that connect waits for them; then each imports the stage's code on its first
    task. A private instance starts its workers with the raylet, and each imports
    the module of the executor's initializer before it takes work: here, with
    the instance up and no connection made, two worker processes have imported
    it (each leaves a file named after its pid)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (pids, here), = run(
        "import time\n"
        "from tests.pipeline.data.preload_probe import init as probe_init\n"
        "with open_executor(ExecutorConfig(kind='ray', num_workers=2), probe_init, ('cfg',)) as ex:\n"
        "    ex.up.wait()\n"
        "    deadline = time.monotonic() + 60\n"
        "    while len(os.listdir(os.environ['PRELOAD_PROBE_DIR'])) < 3 and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    connected = ray.is_initialized()\n"
        "pids = sorted(int(p) for p in os.listdir(os.environ['PRELOAD_PROBE_DIR']))\n"
        "print(json.dumps([[p for p in pids if p != os.getpid()], [os.getpid() in pids, connected]]))\n",
        tmp_path, PRELOAD_PROBE_DIR=str(probe))
    assert here == [True, False]  # the stage's own import, and no connection yet
    assert len(pids) == 2


@pytest.mark.parametrize("user_setting", [None, "1000"])
def test_a_private_instance_reports_no_task_events(tmp_path, user_setting):
    """Nothing shows a private instance's task events (it has no dashboard and no
    state API), so its processes report none, and the stage's ray.shutdown does
    not wait to flush the last ones. With Ray's default the timeline holds 100
    events here. The variable is set in the stage's process for the connect only.
    A user who sets it gets their setting (1000 ms is Ray's default)."""
    env_in = {} if user_setting is None else {"RAY_task_events_report_interval_ms": user_setting}
    (events, env), = run(
        "import time\n"
        "with open_executor(ExecutorConfig(kind='ray', num_workers=2), init, ('cfg',)) as ex:\n"
        "    ex.ready()\n"
        "    list(ex.map(tagged, [(x,) for x in range(20)]))\n"
        "    time.sleep(2)  # past Ray's default report interval, 1 s\n"
        "    events = len(ray.timeline())\n"
        "print(json.dumps([events, os.environ.get('RAY_task_events_report_interval_ms')]))\n", tmp_path, **env_in)
    assert (events == 0) if user_setting is None else (events > 0)
    assert env == user_setting


def test_a_stage_that_ends_before_the_instance_is_up_stops_it(tmp_path):
    (out, after, left), = run(
        "with open_executor(ExecutorConfig(kind='ray', num_workers=2), init, ('cfg',)) as ex:\n"
        "    out = list(ex.map(tagged, [(1,), (2,)]))\n"
        "print(json.dumps([[[t, s, p == os.getpid()] for t, s, p in out], ray.is_initialized(), leftover()]))\n",
        tmp_path)
    assert out == [["cfg", 1, True], ["cfg", 4, True]]
    assert after is False and left == []


def test_errors_while_the_instance_starts_are_one_line(tmp_path):
    """A task failing in the stage's process reads as one on Ray would; a
    StageError reaches the caller unchanged; an instance that cannot start is
    one line."""
    lines = run(
        "for tasks in ([(3,)], [(2,)]):\n"
        "    try:\n"
        "        with open_executor(ExecutorConfig(kind='ray', num_workers=2)) as ex:\n"
        "            list(ex.map(fails, tasks))\n"
        "    except Exception as e:\n"
        "        print(json.dumps([type(e).__name__, str(e)]))\n"
        "def boom(workers, preload=()):\n"
        "    raise RuntimeError('no shared memory\\nsecond line')\n"
        "E._start_private_instance = boom\n"
        "try:\n"
        "    with open_executor(ExecutorConfig(kind='ray', num_workers=2)) as ex:\n"
        "        list(ex.map(tagged, [(x, 0.01) for x in range(500)]))\n"
        "except ExecutorError as e:\n"
        "    print(json.dumps(['ExecutorError', str(e)]))\n"
        "print(json.dumps(leftover()))\n", tmp_path)
    assert lines[0][0] == "ExecutorError"
    assert lines[0][1].startswith("stage: task 0 failed in a worker: ValueError: a bug (at test_executor.py:")
    assert lines[1] == ["BadInput", "document 2 is unreadable"]
    assert lines[2] == ["ExecutorError", "stage: could not start or join a local Ray instance: RuntimeError: "
                        "no shared memory"]
    assert lines[3] == []


def test_a_task_that_fails_on_ray_is_one_line_and_tasks_left_in_flight_print_nothing(tmp_path):
    """On Ray's workers: a StageError reaches the caller unchanged, any other
    exception is one line naming the task and place, and a task that raises
    runs once. The tasks still in flight when a map stops (here failing too)
    are left; their errors, which Ray would print at the stage's disconnect as
    "Unhandled error" with each worker's traceback, are not printed. A Ray
    worker running other code than the stage's refuses its tasks in one line."""
    runs = tmp_path / "runs"
    runs.mkdir()
    proc = run_proc(
        "import time\n"
        "from tests.pipeline.data.ray_tasks import fails_after\n"
        f"runs = {str(runs)!r}\n"
        "with open_executor(ExecutorConfig(kind='ray', num_workers=2), desc='clean') as ex:\n"
        "    ex.ready()\n"
        "    for first in (0, 1):\n"
        "        try:\n"
        "            list(ex.map(fails_after, [(first, 0.0, runs)] + [(x, 0.5, runs) for x in range(2, 5)]))\n"
        "        except Exception as e:\n"
        "            print(json.dumps([type(e).__name__, str(e)]))\n"
        "    deadline = time.monotonic() + 60\n"
        "    while len(os.listdir(runs)) < 8 and time.monotonic() < deadline:  # every task has raised\n"
        "        time.sleep(0.05)\n"
        "    time.sleep(1)  # their errors reach this process, as Ray would print them at the disconnect\n"
        "print(json.dumps(sorted(name.split('-')[0] for name in os.listdir(runs))))\n"
        "identity = E.code_identity()\n"
        "E.code_identity = lambda: {**identity, 'numpy': '0.0.1'}\n"
        "try:\n"
        "    with open_executor(ExecutorConfig(kind='ray', num_workers=1), desc='clean') as ex:\n"
        "        ex.ready()\n"
        "        list(ex.map(abs, [(-1,)]))\n"
        "except Exception as e:\n"
        "    print(json.dumps([type(e).__name__, str(e)]))\n"
        "print(json.dumps(leftover()))\n", tmp_path)
    bad, bug, ran, other, left = [json.loads(line) for line in proc.stdout.splitlines()]
    assert bad == ["BadInput", "document 0 is unreadable"]
    assert bug == ["ExecutorError", "clean: task 0 failed in a worker: ValueError: a bug in task 1 "
                   "(at ray_tasks.py:37 in fails_after)"]
    assert ran == ["0", "1", "2", "2", "3", "3", "4", "4"]  # each task once
    assert other[0] == "ExecutorError" and other[1].startswith("clean: the Ray worker on ")
    assert "(numpy " in other[1] and " there, 0.0.1 here;" in other[1]
    assert left == []
    assert "Unhandled error" not in proc.stderr and "a bug in task" not in proc.stderr, proc.stderr[-3000:]
    assert "of fails_after raises" not in proc.stdout + proc.stderr  # a worker's output stays in Ray's logs


def test_a_task_whose_worker_dies_every_time_is_lost_in_one_line(tmp_path):
    """Its worker process dies (a crash, an OOM kill): the task runs again, up to
    TASK_RETRIES times, then the stage stops in one line. Ray's notices of each
    death and retry go to the stage's log, one line each, not to its stdout."""
    proc = run_proc(
        "from tests.pipeline.data.test_executor import dies\n"
        "with open_executor(ExecutorConfig(kind='ray', num_workers=2), desc='clean') as ex:\n"
        "    ex.ready()\n"
        "    try:\n"
        "        list(ex.map(dies, [(x,) for x in range(3)]))\n"
        "    except ExecutorError as e:\n"
        "        print(json.dumps(str(e)))\n"
        "import ray._private.worker as W\n"
        "print(json.dumps([leftover(), W.print_to_stdstream.__qualname__]))\n", tmp_path)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout[-3000:]  # nothing else on stdout
    lost, (left, printer) = [json.loads(line) for line in lines]
    assert printer == "print_to_stdstream"  # Ray's own again, after the stage
    assert lost.startswith("clean: task 1 was lost: WorkerCrashedError: The worker died unexpectedly") and \
        "\n" not in lost
    notices = [line for line in proc.stderr.splitlines() if line.startswith("clean: Ray: ")]
    # one per death (the last may come after the stage has left)
    assert 1 <= sum("A worker died" in line for line in notices) <= 1 + executor_module.TASK_RETRIES, \
        proc.stderr[-3000:]
    assert "(raylet)" not in proc.stderr and "Traceback" not in proc.stderr
    assert left == []


def test_a_ctrl_c_mid_map_stops_the_stage_and_its_instance_without_worker_tracebacks(tmp_path):
    """The terminal sends SIGINT to the whole process group, Ray's processes
    included: the stage stops with its own KeyboardInterrupt alone, and every
    process of its instance ends with it."""
    code = PRELUDE + (
        "with open_executor(ExecutorConfig(kind='ray', num_workers=2), init, ('cfg',)) as ex:\n"
        "    ex.ready()\n"
        "    for i, _ in enumerate(ex.map(tagged, [(x, 0.5) for x in range(100)])):\n"
        "        if i == 2:\n"
        "            print(json.dumps(sorted(p.pid for p in psutil.Process().children(recursive=True))), flush=True)\n")
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
                            start_new_session=True)
    try:
        pids = json.loads(proc.stdout.readline())
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0 and err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert pids and not [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("form", ["127.0.0.1:PORT", "auto"])
def test_a_loopback_address_joins_a_head_that_listens_on_loopback_only(tmp_path, form):
    """`ray start --head --node-ip-address=127.0.0.1` (with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    as the README's recipe for many short runs says), joined by a stage whose own
    environment lacks the variable: the stage sets it, or its driver would look
    for the head at the machine's address and retry for minutes. "auto" names
    the head through the file `ray start` writes, which the stage reads first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ray's temp root for the head and the stage (short: it holds Unix sockets), so that
    # /tmp/ray/ray_current_cluster is not left naming this head: a later ray.init() with no
    # address on this machine would try to join it
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path),
           "RAY_TMPDIR": temp}
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                if Path(temp, "ray", "ray_current_cluster").is_file():
                    break
            except OSError:
                pass
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(0.5)
        address = form.replace("PORT", str(port))
        proc = run_proc(
            "import time\n"
            "from tests.pipeline.data.ray_tasks import noisy_square\n"
            f"with open_executor(ExecutorConfig(kind='ray', address={address!r})) as ex:\n"
            "    print(json.dumps([ex.workers, list(ex.map(noisy_square, [(x,) for x in range(4)]))]))\n"
            "    time.sleep(1)  # past the head's log monitor's rounds, which would forward the tasks' output\n",
            tmp_path, timeout=60, RAY_TMPDIR=temp)
        assert json.loads(proc.stdout) == [2, [0, 1, 4, 9]]
        assert "noisy_square" not in proc.stderr  # the workers' output stays in the cluster's logs
    finally:
        head.terminate()  # --block: ray start stops the head's processes
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
