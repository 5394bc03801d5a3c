"""pipeline/training/torchrun.py: torchrun as the launcher runs it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import StageError
from pipeline.training.torchrun import (
    LaunchConfig,
    TrainerBusyError,
    _rank_environment,
    acquire_exclusive,
    inside_torchrun,
    launch,
    lock_name,
    run_agent,
    torchrun_args,
)
from tests.conftest import ROOT


def torchrun(tmp_path, code: str, ranks: int, *args: str) -> subprocess.CompletedProcess:
    """``code`` as the rank's script, under pipeline.training.torchrun with ``ranks``
    ranks (and torchrun's ``args``), its temp dir ``tmp_path/"tmp"``."""
    rank = tmp_path / "rank.py"
    rank.write_text(code)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pipeline.training.torchrun", "--standalone",
                           f"--nproc_per_node={ranks}", "--max_restarts=0", *args, str(rank)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})


def test_a_rank_that_fails_in_one_line_gives_its_exit_code_and_no_torchrun_traceback(tmp_path):
    proc = torchrun(tmp_path, "import sys\nprint('error: stage x (rank 0) failed: a bad param', file=sys.stderr)\n"
                              "sys.exit(2)\n", ranks=1)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: stage x (rank 0) failed: a bad param" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "failed (exitcode" not in proc.stderr  # torchrun's own line: the rank said why


def test_a_rank_killed_by_a_signal_is_named_in_one_line(tmp_path):
    """A rank the kernel kills (OOM, SIGKILL) prints nothing: the launcher names it."""
    proc = torchrun(tmp_path, "import os, signal\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), "
                              "signal.SIGKILL)\nimport time\ntime.sleep(60)\n", ranks=2)
    assert proc.returncode == 128 + 9, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "failed" in line]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (pid "), proc.stderr[-2000:]
    assert errors[0].endswith("was killed by SIGKILL")


def test_ranks_that_succeed_exit_zero(tmp_path):
    # one write per line: print's pieces from two unbuffered ranks can interleave ("rankrank 1\n 0")
    proc = torchrun(tmp_path, "import os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n", ranks=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_a_lock_file_dvc_linked_from_its_cache_is_locked_but_never_written(tmp_path, link):
    """Runs before .dvcignore left out the lock recorded it in DVC's cache, and
    cache.type hardlink or symlink links it back into the folder."""
    cached = tmp_path / "cache-object"
    cached.write_text("pid 1 on a-host: python -m stages.pretrain\n")
    folder = tmp_path / "models"
    folder.mkdir()
    lock = folder / lock_name()
    lock.hardlink_to(cached) if link == "hardlink" else lock.symlink_to(cached)
    fd = acquire_exclusive(folder)
    try:
        assert cached.read_text() == "pid 1 on a-host: python -m stages.pretrain\n"
        with pytest.raises(TrainerBusyError):  # and it still locks
            acquire_exclusive(folder)
    finally:
        os.close(fd)


def test_the_lock_file_is_no_data_of_the_run_for_dvc(tmp_path):
    out = subprocess.run([str(Path(sys.executable).parent / "dvc"), "check-ignore", f"models/pretrain/{lock_name()}",
                          f"models/sft/{lock_name()}", "models/pretrain/step-00000100"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.stdout.split() == [f"models/pretrain/{lock_name()}", f"models/sft/{lock_name()}"], out.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_while_the_launcher_prepares_is_one_line_and_frees_the_folder(tmp_path, sig):
    """A Ctrl-C or a SIGTERM during ``before`` (SFT builds its shards there) stops
    the launch before any rank starts, with the same kind of line as later on."""
    def interrupted():
        os.kill(os.getpid(), sig)
        time.sleep(10)
        pytest.fail("the signal did not stop the launch")

    before = signal.getsignal(signal.SIGTERM)
    # Python's own Ctrl-C handler, as in a terminal (`make test &` starts pytest with SIGINT ignored).
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert launch("stages.pretrain", LaunchConfig(), tmp_path, before=interrupted) == (
            128 + sig, f"stopped by {sig.name} before any rank started")
    finally:
        signal.signal(signal.SIGINT, sigint)
    os.close(acquire_exclusive(tmp_path))  # the folder lock was let go
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("outcome", ["succeeds", "fails", "killed"])
def test_a_launch_leaves_no_log_folder_in_the_temp_dir(tmp_path, outcome):
    """torchrun alone leaves an empty torchelastic_* folder tree in the temp dir
    per launch, whatever the outcome: thousands over a season of retraining."""
    code = {"succeeds": "", "fails": "import sys\nsys.exit(2)\n",
            "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"}[outcome]
    proc = torchrun(tmp_path, code, 1)
    assert proc.returncode == {"succeeds": 0, "fails": 2, "killed": 137}[outcome], proc.stderr[-2000:]
    assert os.listdir(tmp_path / "tmp") == []


def test_a_log_dir_the_user_names_is_kept(tmp_path):
    proc = torchrun(tmp_path, "print('hello from the rank')\n", 1, f"--log-dir={tmp_path / 'logs'}", "--redirects=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = [p.read_text() for p in (tmp_path / "logs").rglob("stdout.log")]
    assert logs == ["hello from the rank\n"]


def test_an_agent_that_lost_the_rendezvous_says_so_in_one_line(monkeypatch):
    """On several nodes the c10d store lives in one node's agent, which stops when
    one of its ranks fails: every other agent loses the rendezvous."""
    import torch.distributed.run
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def lost(args):
        try:
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        except DistNetworkError as e:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from e

    monkeypatch.setattr(torch.distributed.run, "run", lost)
    assert run_agent(["--nnodes=2", "--nproc_per_node=1", "-m", "stages.pretrain"]) == (
        1, "lost the rendezvous (RendezvousConnectionError: Failed to recv, got 0 bytes. Connection was likely "
           "closed.): another node's agent stopped, or the network failed; this node's ranks were stopped, and the "
           "node where the failure began says why")


def test_a_rendezvous_that_times_out_names_what_to_check(monkeypatch):
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    def alone(args):
        raise RendezvousTimeoutError("The node 'a_1_0' has timed out waiting for the other nodes.")

    monkeypatch.setattr(torch.distributed.run, "run", alone)
    assert run_agent(["--nnodes=2", "--nproc_per_node=1", "-m", "stages.pretrain"]) == (
        1, "the rendezvous timed out (RendezvousTimeoutError: The node 'a_1_0' has timed out waiting for the other "
           "nodes.): not every node joined in time; start the stage on every node (launch.nnodes) and check that "
           "each reaches launch.rdzv_endpoint")


def test_a_busy_folder_names_the_processes_that_hold_it_to_stop(tmp_path):
    """Not a `pkill` that would stop every project's stages on a shared machine:
    the pids that hold the folder's lock (Linux's /proc/locks)."""
    folder = tmp_path / "models"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from pipeline.training.torchrun import acquire_exclusive; "
                               f"acquire_exclusive(Path({str(folder)!r})); print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainerBusyError, match=rf"Stop them \(`kill {holder.pid}`\) or wait for them"):
            acquire_exclusive(folder)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("endpoint", ["abc", "abc:", ":29500", "[]:29500", "node0:port", "node0:0", "node0:70000"])
def test_an_endpoint_without_host_and_port_is_refused_naming_the_key(endpoint):
    """torchrun would take "abc" as abc:29400 and retry it for minutes, then print a C++ traceback."""
    from pipeline.config import ConfigError, parse_section

    with pytest.raises(ConfigError, match=r"pretrain\.launch\.rdzv_endpoint: .*must be host:port"):
        parse_section(LaunchConfig, {"nnodes": 2, "rdzv_endpoint": endpoint}, "pretrain.launch")
    assert LaunchConfig(rdzv_endpoint="[::1]:29500").rdzv_endpoint == "[::1]:29500"


def test_a_static_node_rank_outside_nnodes_is_refused():
    from pipeline.config import ConfigError, parse_section

    with pytest.raises(ConfigError, match=r"node_rank \(2\) must be below nnodes \(2\)"):
        parse_section(LaunchConfig, {"nnodes": 2, "node_rank": 2, "rdzv_backend": "static"}, "pretrain.launch")


def test_torchrun_arguments_for_one_node_and_for_several():
    from torch.distributed.run import parse_args

    one = torchrun_args("stages.pretrain", LaunchConfig(nproc_per_node=2))
    assert one == ["--nproc_per_node=2", "--standalone", "--max_restarts=0", "-m", "stages.pretrain"]
    static = LaunchConfig(nproc_per_node=8, nnodes=2, rdzv_backend="static", node_rank=1,
                          rdzv_endpoint="node0:29400", rdzv_id="job7", max_restarts=3)
    args = parse_args(torchrun_args("stages.pretrain", static))  # torchrun reads them as meant
    assert (args.nnodes, args.node_rank, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.max_restarts,
            args.standalone, args.module, args.training_script) == ("2", 1, "static", "node0:29400", "job7", 3, False,
                                                                    True, "stages.pretrain")
    elastic = torchrun_args("m", LaunchConfig(nnodes=2, rdzv_endpoint="node0:29400"))
    assert "--nnodes=2" in elastic and "--standalone" not in elastic
    assert not any(a.startswith("--node_rank") for a in elastic)  # c10d numbers the nodes itself


def test_the_ranks_inherit_the_launch_marker_and_a_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PIPELINE_LAUNCHED", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    with _rank_environment(LaunchConfig(nproc_per_node=2)):
        assert (os.environ["OMP_NUM_THREADS"], os.environ["PIPELINE_LAUNCHED"]) == ("4", "1")
    assert "OMP_NUM_THREADS" not in os.environ and "PIPELINE_LAUNCHED" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting wins
    with _rank_environment(LaunchConfig(nproc_per_node=2)):
        assert os.environ["OMP_NUM_THREADS"] == "3"


def test_only_torchruns_own_variables_say_a_process_is_a_rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not inside_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert inside_torchrun()


def test_an_ipv6_rendezvous_host_is_resolved_without_its_brackets():
    LaunchConfig(nnodes=2, rdzv_endpoint="[::1]:29500").check_endpoint()


def test_a_rendezvous_host_that_does_not_resolve_stops_the_launch_in_one_line(tmp_path):
    cfg = LaunchConfig(nnodes=2, rdzv_endpoint="node0.invalid:29500")  # .invalid never resolves (RFC 6761)
    with pytest.raises(StageError, match=r"launch.rdzv_endpoint 'node0.invalid:29500': this node cannot resolve "
                                         r"the host 'node0.invalid'"):
        launch("stages.pretrain", cfg, tmp_path)
    assert not (tmp_path / lock_name()).exists()  # refused before the lock, and before torchrun


def test_a_rendezvous_never_reached_is_not_called_lost():
    """An endpoint this node cannot reach (node 0 not started yet, a wrong address or port) was reported as
    `lost the rendezvous …: another node's agent stopped …; this node's ranks were stopped`, though none had started."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from pipeline.training.torchrun import _rendezvous_failed

    err = RendezvousConnectionError("The client socket has timed out after 60000ms while trying to connect to "
                                    "(192.0.2.1, 29555).")
    assert _rendezvous_failed(err).startswith(
        "could not reach the rendezvous at launch.rdzv_endpoint (RendezvousConnectionError: The client socket has "
        "timed out after 60000ms while trying to connect to (192.0.2.1, 29555).): start the stage on node 0 first")


def test_a_rank_can_share_the_lock_the_launcher_took_and_a_second_launcher_cannot(tmp_path):
    """The launcher downgrades its exclusive lock, else every rank's hold_shared would wait forever."""
    import fcntl

    from pipeline.training.torchrun import lock_holders

    fd = acquire_exclusive(tmp_path)
    rank, other = (os.open(tmp_path / lock_name(), os.O_RDWR) for _ in range(2))
    try:
        fcntl.flock(rank, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a rank's shared lock, granted at once
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lock_holders(tmp_path / lock_name()) == []  # this process is not named as one to kill
    finally:
        for f in (fd, rank, other):
            os.close(f)


def test_a_single_node_launch_ignores_the_rendezvous_settings():
    """--standalone needs no endpoint, and c10d numbers the nodes itself: neither setting can stop one node."""
    LaunchConfig(rdzv_endpoint="node0.invalid:29500").check_endpoint()
    assert LaunchConfig(nnodes=2, node_rank=5).node_rank == 5


@pytest.mark.parametrize("node_rank, said", [(1, "could not reach the rendezvous"), (0, "the rendezvous timed out")])
def test_a_static_rendezvous_that_fails_is_one_line(tmp_path, node_rank, said):
    """rdzv_backend static: torchrun's TCPStore raises DistNetworkError (node 0 not reached) or DistStoreError
    (node 0 waited for the others in vain), not a RendezvousError; both were a Python traceback. (c10d's own
    log lines of its retries, with their C++ frames, still show.)"""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "rank.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "pipeline.training.torchrun", "--nnodes=2", "--nproc_per_node=1",
                           "--rdzv_backend=static", f"--rdzv_endpoint=127.0.0.1:{port}", f"--node_rank={node_rank}",
                           "--rdzv_conf=timeout=1", "--max_restarts=0", str(tmp_path / "rank.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {said}"), proc.stderr[-2000:]


def test_an_empty_rendezvous_id_is_refused_naming_the_key():
    """torchrun's c10d rendezvous raised a ValueError traceback ("The run id must be a non-empty string.")
    on every node, after the launcher had taken the folder lock."""
    from pipeline.config import ConfigError, parse_section

    with pytest.raises(ConfigError, match=r"pretrain\.launch\.rdzv_id: "):
        parse_section(LaunchConfig, {"nnodes": 2, "rdzv_endpoint": "node0:29500", "rdzv_id": ""}, "pretrain.launch")
