"""The data stages joining a real multi-node Ray cluster, started on this
machine with `ray start`.

The head node has no CPUs, so every task runs on the other node; that node is
started in its own mount namespace with an empty tmpfs over the folder that
holds the test's inputs and outputs, as a node without shared storage is.
ingest, clean (``dedup.method: memory``) and pack must give the bytes of the
local pool there; clean's sharded dedup, whose workers read the input and a
work folder beside the output themselves, must stop with one line that says
which of them they do not see, not find no duplicates. Then
what a cluster does to a stage: a worker node killed mid-stage (its tasks run
again on another node; with no node left the stage stops in one line), and
tasks left in flight when a stage stops (never cancelled: Ray 2.60 can abort
the driver on that race). Marked slow: Ray nodes take seconds to start.
Skipped where Ray finds no address but loopback (a second node needs one) or
this machine cannot make a mount namespace (``unshare -m``)."""

import contextlib
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pyarrow.parquet as pq
import pytest

from pipeline.data import executor as executor_module
from pipeline.data.clean import run_clean
from pipeline.data.dedup import DedupError
from pipeline.data.docs import DocTable, row_spans
from pipeline.data.executor import ExecutorConfig, ExecutorError, open_executor
from pipeline.data.pack import PackConfig, PackError, run_pack
from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer
from tests.conftest import ROOT
from tests.pipeline.data.test_clean import MIXED, code, prose, write_docs
from tests.pipeline.data.test_clean import cfg as clean_cfg
from tests.pipeline.data.test_clean import run as run_clean_on
from tests.pipeline.data.test_dedup import PLANTED
from tests.pipeline.data.test_executor import BadInput, timed
from tests.pipeline.data.test_ingest import mixed_corpus
from tests.pipeline.data.test_ingest import outputs as ingest_outputs
from tests.pipeline.data.test_pack_ray import files
from tests.pipeline.data.test_pack_sources import CFG, write_sourced
from tests.pipeline.data.test_tokenizer import make_docs

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")


def _free_ports(n: int) -> list[int]:
    """Ports free on every address: Ray's client server listens on loopback, where
    another test process's server may hold a port that is free on the node's address."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


def _kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node's `ray start` and every process under it (raylet, agents,
    workers mid-task), as a machine that dies takes them all at once."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert any(p.name().startswith("ray::") or "default_worker" in " ".join(p.cmdline()) for p in procs), \
        [p.name() for p in procs]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # --block: `ray start` stops its node's processes
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def two_nodes(blind: Path, logs: Path, **head_env: str):
    """A head with 0 CPUs and a node with 2 that sees an empty ``blind`` folder: its
    GCS ``address``, its Ray Client address (``client``), ``blind``, and the
    node's ``ray start`` process (``node``, its process group's leader), and
    ``join(cpus, name)``, which starts one more node that sees every file.
    ``head_env``: more environment for the head (Ray's settings)."""
    ip = ray.util.get_node_ip_address()  # what `ray start` would take
    if ip.startswith("127."):
        pytest.skip("Ray finds no address but loopback here (or RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set); "
                    "a second Ray node needs one")
    if not _can_unshare():
        pytest.skip("no mount namespace here (unshare -m), so no node can be made blind to a folder")
    blind.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: it holds Unix sockets
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": temp, "HOME": str(logs)}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    ray_cli = str(Path(sys.executable).parent / "ray")
    common = ["--block", f"--node-ip-address={ip}", "--disable-usage-stats"]
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + 90

    def wait(ok, proc, log):
        while not ok():
            assert proc.poll() is None and time.monotonic() < deadline, (logs / log).read_text()
            time.sleep(0.5)

    def answers(*ports: int) -> bool:
        for p in ports:
            try:
                socket.create_connection((ip, p), timeout=1).close()
            except OSError:
                try:
                    socket.create_connection(("127.0.0.1", p), timeout=1).close()
                except OSError:
                    return False
        return True

    def start_head(stack: contextlib.ExitStack) -> tuple[int, int]:
        """The head, up with its client server. `ray start --block` stops the whole
        head when one of its processes fails, as its client server does when
        another test process took its port in the meantime: then again, on
        other ports (a head that died under a driver would end the driver's
        process a minute later)."""
        for attempt in range(3):
            port, client_port = _free_ports(2)
            head = [ray_cli, "start", "--head", f"--port={port}", f"--ray-client-server-port={client_port}",
                    "--num-cpus=0", "--include-dashboard=false", *common]
            out = stack.enter_context(open(logs / f"head-{attempt}.log", "w"))
            proc = subprocess.Popen(head, env={**env, **head_env}, stdout=out, stderr=out, start_new_session=True)
            stack.callback(_stop, proc)
            while proc.poll() is None and not answers(port, client_port) and time.monotonic() < deadline:
                time.sleep(0.5)
            # A client server that cannot bind fails a second or two after the GCS answers; a port that
            # another process holds answers too. So the head must stay up a while before a driver joins it.
            settled = time.monotonic() + 5
            while proc.poll() is None and time.monotonic() < settled:
                time.sleep(0.25)
            failed = "exited unexpectedly" in (logs / f"head-{attempt}.log").read_text()  # `ray start` stopping
            if proc.poll() is None and not failed and answers(port, client_port):
                procs.append(proc)
                return port, client_port
            _stop(proc)
        pytest.fail(f"the Ray head did not start in 3 tries: {(logs / 'head-2.log').read_text()[-3000:]}")

    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        stack.callback(shutil.rmtree, temp, ignore_errors=True)
        port, client_port = start_head(stack)
        node = [ray_cli, "start", f"--address={ip}:{port}", "--num-cpus=2", *common]
        blinded = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f"mount -t tmpfs tmpfs {shlex.quote(str(blind))} && exec {shlex.join(node)}"]
        out = stack.enter_context(open(logs / "node.log", "w"))
        procs.append(subprocess.Popen(blinded, env=env, stdout=out, stderr=out, start_new_session=True))
        stack.callback(_stop, procs[-1])
        ray.init(address=f"{ip}:{port}", logging_level="warning", log_to_driver=False)
        try:
            wait(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, procs[1], "node.log")
            assert ray.cluster_resources().get("CPU") == 2
        finally:
            ray.shutdown()

        def join(cpus: int, name: str) -> subprocess.Popen:
            """Start one more node (it sees every file) and wait for its CPUs."""
            out = stack.enter_context(open(logs / f"{name}.log", "w"))
            proc = subprocess.Popen([ray_cli, "start", f"--address={ip}:{port}", f"--num-cpus={cpus}", *common],
                                    env=env, stdout=out, stderr=out, start_new_session=True)
            stack.callback(_stop, proc)
            ray.init(address=f"{ip}:{port}", logging_level="warning", log_to_driver=False)
            try:
                want = ray.cluster_resources().get("CPU", 0) + cpus
                wait(lambda: ray.cluster_resources().get("CPU", 0) == want, proc, f"{name}.log")
            finally:
                ray.shutdown()
            return proc

        yield SimpleNamespace(address=f"{ip}:{port}", client=f"ray://{ip}:{client_port}", blind=blind,
                              node=procs[1], join=join)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """:func:`two_nodes`, for the module."""
    with two_nodes(tmp_path_factory.mktemp("cluster-data"), tmp_path_factory.mktemp("cluster-logs")) as c:
        yield c


def on_cluster(cluster, client=False):
    return {"kind": "ray", "address": cluster.client if client else cluster.address, "num_workers": 2}


def test_the_worker_node_cannot_see_the_folder(cluster):
    @ray.remote(num_cpus=1)
    def listing(path):
        return os.listdir(path)

    address, blind = cluster.address, cluster.blind
    (blind / "here.txt").write_text("only on the head's side")
    ray.init(address=address, logging_level="warning", log_to_driver=False)
    try:
        assert ray.get(listing.remote(str(blind))) == []
    finally:
        ray.shutdown()
    assert os.listdir(blind) == ["here.txt"]


def test_ingest_on_a_cluster_without_shared_storage_gives_the_local_bytes(cluster, caplog):
    """Every file a worker was to read comes back to the stage: 16 .txt, a .jsonl
    and a .jsonl.zst (the file listed twice and the dataset are read by the stage anyway)."""
    root = cluster.blind / "ingest"
    sources = mixed_corpus(root)
    local = ingest_outputs(root, "local", sources, executor={"num_workers": 2})
    assert "read by the stage itself" not in caplog.text
    assert ingest_outputs(root, "cluster", sources, executor=on_cluster(cluster)) == local
    assert re.search(r"18 input file\(s\) were read by the stage itself, not by the workers, which do not see "
                     r"them as it does \(for example .*/corpus/\w+\.txt is not readable on .* "
                     r"\(FileNotFoundError\)\)", caplog.text)


CLEAN_TEXTS = MIXED * 2 + PLANTED + [prose(150, seed=s) for s in range(30, 36)] + [code(s) for s in range(40, 44)]
CLEAN_SMALL = {"batch_docs": 3, "shard_bytes": 4000, "num_workers": None}


def test_clean_on_a_cluster_without_shared_storage(cluster, tmp_path, caplog):
    """memory dedup: the node's workers hand back the tasks they got first, the
    stage sends the rows of the rest, and the bytes are the local ones; sharded
    dedup: one line naming what it needs (not a run that finds no duplicates).
    Joined by the GCS address (as a Ray Client: the test below)."""
    root = cluster.blind / "clean"
    texts, small = CLEAN_TEXTS, CLEAN_SMALL
    got = {}
    for name, executor in {"local": {"num_workers": 2}, "cluster": on_cluster(cluster)}.items():
        (root / name).mkdir(parents=True)
        with caplog.at_level(logging.WARNING, logger="pipeline.data.clean"):
            metrics, docs, quarantine = run_clean_on(root / name, texts, executor=executor, task_bytes=4000, **small)
        metrics.pop("mb_per_s")
        got[name] = metrics, docs, quarantine
    assert got["cluster"] == got["local"]
    [line] = [r.getMessage() for r in caplog.records if "does not see the input" in r.getMessage()]
    assert re.match(r"\d+ task\(s\) went to a worker that does not see the input as the stage does \(on \S+: "
                    rf"CleanError: documents not found: {re.escape(str(root / 'cluster' / 'in.parquet'))}; run the "
                    r"ingest stage first\); the stage cleaned them itself and sent the rows of the tasks after them",
                    line), line
    (root / "sharded").mkdir()
    with pytest.raises(DedupError, match=r"^the clean input .*/in.parquet is not readable as the stage read it on "
                                         r"\S+, where a dedup task ran \(CleanError: documents not found: "
                                         r".*/in.parquet; run the ingest stage first\); dedup.method: sharded on a "
                                         r"Ray cluster needs the input and output folders on storage that every node "
                                         r"mounts at the same path \(or use method: memory\)$"):
        run_clean_on(root / "sharded", texts, executor=on_cluster(cluster),
                     dedup={"method": "sharded", "partition_docs": 4}, **small)
    # the input where every node sees it, the output (and so the work folder) where the workers do not
    seen = write_docs(tmp_path / "in.parquet", texts)
    with pytest.raises(DedupError, match=r"^the dedup work file .*/exact-00000.bin is missing on .*, where a dedup "
                                         r"task ran; dedup.method: sharded on a Ray cluster needs the output folder "
                                         r"on storage that every node mounts at the same path \(or use method: "
                                         r"memory\)$"):
        run_clean(clean_cfg(executor=on_cluster(cluster), dedup={"method": "sharded", "partition_docs": 4}, **small),
                  seen, root / "sharded-out" / "docs", root / "sharded-out" / "quarantine.jsonl")


# Runs clean as a Ray Client in its own process; prints the outcome as JSON.
_AS_CLIENT = """
import json, sys
from pathlib import Path
from tests.pipeline.data.test_clean import run
from tests.pipeline.data.test_ray_cluster import CLEAN_SMALL, CLEAN_TEXTS
metrics, docs, quarantine = run(Path(sys.argv[1]), CLEAN_TEXTS, executor=json.loads(sys.argv[2]), **CLEAN_SMALL)
metrics.pop("mb_per_s")
print(json.dumps([metrics, docs, quarantine]))
"""


def test_clean_as_a_ray_client_gives_the_local_bytes(cluster, tmp_path):
    """Joined as a Ray Client (``ray://``), where the stage's process is no node
    of the cluster and sends its work over the client connection: the local
    pool's outcome. In a process of its own: a client connection that fails
    leaves its process's Ray state unusable for the tests after it. The
    head's client server once failed to start on this loaded 2-core machine,
    so a failed connection (that one line, nothing else) is tried again once."""
    (tmp_path / "local").mkdir()
    metrics, docs, quarantine = run_clean_on(tmp_path / "local", CLEAN_TEXTS, executor={"num_workers": 2},
                                             **CLEAN_SMALL)
    metrics.pop("mb_per_s")
    local = json.loads(json.dumps([metrics, docs, quarantine]))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for attempt in range(2):
        out = cluster.blind / f"client-{attempt}"
        out.mkdir()
        proc = subprocess.run([sys.executable, "-c", _AS_CLIENT, str(out), json.dumps(on_cluster(cluster, True))],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        if proc.returncode == 0 or "could not start or join the Ray cluster at ray://" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == local


def test_pack_on_a_cluster_without_shared_storage_gives_the_local_bytes(cluster, caplog):
    """The node cannot read the documents: its workers hand back the tasks they
    got first, and the stage sends the text of the rest."""
    root = cluster.blind / "pack"
    root.mkdir()
    rows = [(f"w{i}", t, "web", None) for i, (_, t) in enumerate(make_docs(150, seed=1))]
    path = write_sourced(root / "docs.parquet", rows)
    pq.write_table(pq.read_table(path), path, row_group_size=5)  # row groups a worker reads as one task
    assert all(s.by_worker for s in row_spans(DocTable(path, PackError), CFG["task_bytes"]))
    tok = root / "tokenizer.json"
    train_tokenizer(TokenizerConfig(vocab_size=300, sample_bytes=20_000, eval_bytes=2_000), path, tok)
    out = {}
    for name, executor in {"local": {"num_workers": 2}, "cluster": on_cluster(cluster)}.items():
        with caplog.at_level(logging.WARNING, logger="pipeline.data.pack"):
            run_pack(PackConfig(**{**CFG, "num_workers": None}, executor=executor), path, tok, root / name)
        out[name] = files(root / name)
    assert len(out["local"]) > 3 and out["cluster"] == out["local"]
    [line] = [r.getMessage() for r in caplog.records if "does not see the documents" in r.getMessage()]
    assert re.match(r"\d+ task\(s\) went to a worker that does not see the documents as the stage does \(on \S+: "
                    rf"PackError: documents not found: {re.escape(str(path))}\); the stage encoded them itself", line), line


@pytest.mark.timeout(90, method="thread")  # a regression here would wait for ever inside ray.get
def test_a_node_that_dies_mid_stage_stops_it_in_one_line(tmp_path, capfd, caplog, monkeypatch):
    """The only node with CPUs is killed (SIGKILL: its raylet and workers) while
    tasks run on it. Ray keeps tasks queued for good on a cluster without CPUs;
    the stage warns, then stops in one line after NO_CPU_S (here 4 s; the head
    notices the dead node within about 3 s) rather than wait for ever. Its
    committed shards would stay for a rerun."""
    monkeypatch.setattr(executor_module, "NO_CPU_S", 4.0)
    monkeypatch.setattr(executor_module, "CHECK_S", 0.5)
    with two_nodes(tmp_path / "blind", tmp_path / "logs", **FAST_HEALTH_CHECKS) as c:
        cfg = ExecutorConfig(kind="ray", address=c.address, num_workers=2)
        killed = None
        with open_executor(cfg, desc="clean") as ex, pytest.raises(ExecutorError) as err:
            for i, _ in enumerate(ex.map(timed, [(x, 0.5) for x in range(40)])):
                if i == 1:
                    _kill_node(c.node)
                    killed = time.monotonic()
        assert killed is not None, f"the stage stopped before the node was killed: {err.value}"
        stopped = time.monotonic() - killed
    msg = str(err.value)
    assert "\n" not in msg and i < 10 and stopped < 60, (msg, i, stopped)
    assert re.match(r"^clean: the Ray cluster has had no CPUs for [4-9] s \(its nodes died or left\), so task "
                    r"\d+ cannot run; bring nodes back and rerun the stage \(it keeps its committed shards\)$", msg), msg
    assert "clean: the Ray cluster has no CPUs (its nodes died or left, or an autoscaler has not added them " \
           "yet); task" in caplog.text
    out, errs = capfd.readouterr()
    assert "Traceback" not in out + errs


def square_after(x: int, delay: float) -> int:
    time.sleep(delay)
    return x * x


FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                      "RAY_health_check_failure_threshold": "3"}


@pytest.mark.timeout(120, method="thread")
def test_the_tasks_of_a_node_that_dies_run_again_on_another(tmp_path):
    """A worker node is killed (SIGKILL) with tasks running on it while another
    node has a CPU: those tasks run again there, and the stage ends with every
    result, in order, as if nothing had happened."""
    with two_nodes(tmp_path / "blind", tmp_path / "logs", **FAST_HEALTH_CHECKS) as c:
        c.join(1, "spare")
        cfg = ExecutorConfig(kind="ray", address=c.address, num_workers=3)
        out = []
        with open_executor(cfg, desc="clean") as ex:
            assert ex.workers == 3
            for i, sq in enumerate(ex.map(square_after, [(x, 0.3) for x in range(24)])):
                out.append(sq)
                if i == 3:
                    _kill_node(c.node)
        assert c.node.poll() is not None
    assert out == [x * x for x in range(24)]


def jittery(x: int) -> int:
    """A task of a few milliseconds; task 2 raises a StageError (bad input)."""
    time.sleep(random.random() * 0.005)
    if x == 2:
        raise BadInput(f"document {x} is unreadable")
    return x


STOPS = """
import sys
from pipeline.data.executor import ExecutorConfig, open_executor
from tests.pipeline.data.test_executor import BadInput
from tests.pipeline.data.test_ray_cluster import jittery
with open_executor(ExecutorConfig(kind="ray", address=sys.argv[1], num_workers=2)) as ex:
    for n in range(int(sys.argv[2])):
        try:
            list(ex.map(jittery, [(x,) for x in range(8)]))
        except BadInput:
            pass
        first = next(iter(ex.map(jittery, [(x,) for x in (0, 1, 3, 4)])))  # a stage that stops reading early
print("survived", n + 1)
"""


def test_a_stage_that_stops_with_tasks_in_flight_survives(cluster):
    """A task's error, or a stage that stops reading, leaves tasks in flight on
    the other node. Cancelling them races with their replies, and in Ray 2.60
    that aborts the process now and then (seen within a few hundred such stops);
    the stage must not cancel. Run in its own process, which such a crash ends."""
    proc = subprocess.run([sys.executable, "-c", STOPS, cluster.address, "300"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "survived 300", proc.stderr[-2000:]
