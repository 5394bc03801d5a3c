"""Multi-node training, proven on one machine: two torchrun agents (the "nodes",
one rank each) meet at a c10d rendezvous on 127.0.0.1 and train with gloo, for
DDP and for FSDP. Their per-step losses and final weights must equal those of the
same global batch on one node (two ranks there), exactly: both runs have two
ranks that read the same rows, and a sum over two ranks is the same float in
either order, so nothing but the transport differs.

Each agent is started with the command the stage's own launcher builds for
``launch.nnodes: 2`` (pipeline/training/torchrun.py ``torchrun_command``). The
launcher itself is not run twice: on one host its trainer lock rightly refuses
a second launcher on the same folder, while real nodes each hold their own."""

import json
import re
import socket
import subprocess
import time

import psutil
import pytest
import torch
import yaml

from pipeline.training.torchrun import LaunchConfig, torchrun_command
from tests.stages.test_pretrain import BASE, env, losses, stage, weights
from tests.helpers import train_params, write_packed

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def project(path, **params):
    path.mkdir(parents=True)
    write_packed(path / "data" / "packed", n_docs=600)
    (path / "params.yaml").write_text(yaml.safe_dump({"pretrain": train_params(BASE, **params)}))
    return path


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path, parallelism):
    common = dict(parallelism=parallelism, micro_batch_size=4, grad_accum_steps=2, max_steps=3, checkpoint_every=2)
    one = project(tmp_path / "one", nproc_per_node=2, **common)
    r = stage(one)
    assert r.returncode == 0, r.stderr[-3000:]

    port = free_port()
    launch = {"nproc_per_node": 1, "nnodes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": f"127.0.0.1:{port}",
              "rdzv_id": f"test-{port}"}
    two = project(tmp_path / "two", **{f"launch.{k}": v for k, v in launch.items()}, **common)
    cmd = torchrun_command("stages.pretrain", LaunchConfig(**launch))
    assert "--nnodes=2" in cmd and "--standalone" not in cmd
    agents = [subprocess.Popen(cmd, cwd=two, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outs)

    assert json.loads((two / "metrics" / "pretrain.json").read_text())["world_size"] == 2
    assert not list((two / "models" / "pretrain").glob(".probe-*")), "the check that both nodes share it left nothing"
    assert [s for s, _ in losses(two)] == ["1", "2", "3"]
    assert losses(two) == losses(one)  # string-exact
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k


@pytest.mark.parametrize("node", [0, 1])
def test_a_rank_killed_on_one_node_is_one_line_on_every_node(tmp_path, node):
    """The OOM killer takes the rank of one node: that node names it; the other
    node's rank (its collective lost its peer) or agent (the rendezvous went
    with the failed node's agent, whichever hosted it) says so in one line, no
    traceback, and both stop."""
    port = free_port()
    launch = {"nproc_per_node": 1, "nnodes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": f"127.0.0.1:{port}",
              "rdzv_id": f"test-{port}"}
    p = project(tmp_path / "p", **{f"launch.{k}": v for k, v in launch.items()}, max_steps=100000, log_every=1)
    cmd = torchrun_command("stages.pretrain", LaunchConfig(**launch))
    agents = [subprocess.Popen(cmd, cwd=p, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        curve = p / "plots" / "pretrain.csv"
        while not (curve.exists() and len(curve.read_text().splitlines()) > 3):  # both ranks are training
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "training never began"
            time.sleep(0.2)
        [rank] = psutil.Process(agents[node].pid).children()
        rank.kill()
        outs = [a.communicate(timeout=120)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    errors = [[line for line in out.splitlines() if line.startswith("error:") or "Traceback" in line] for out in outs]
    assert agents[node].returncode == 128 + 9
    [line] = errors[node]
    killed = re.fullmatch(rf"error: rank ([01]) \(pid {rank.pid}\) was killed by SIGKILL", line)
    assert killed, outs[node][-3000:]
    other = 1 - node  # the agent; its rank is the other rank
    assert agents[other].returncode in (1, 2), outs[other][-3000:]
    [line] = errors[other]
    assert line.startswith((f"error: stage pretrain (rank {1 - int(killed[1])}) failed: a collective lost a peer rank "
                            "(it stopped, "
                            "or its node failed or left; its own node's line says why): RuntimeError: ",
                            "error: lost the rendezvous (RendezvousConnectionError: ")), outs[other][-3000:]


@pytest.mark.parametrize("node1", ["other params", "own folder"])
def test_nodes_that_differ_in_params_or_storage_stop_before_training_in_one_line(tmp_path, node1):
    """Each node runs from its own copy of the project. One whose params.yaml
    differs (another learning rate) would train another job in the same run, and
    one whose models/ is not the folder rank 0 writes would resume from other
    checkpoints: both nodes stop before the first step, each in one line."""
    port = free_port()
    launch = {"nproc_per_node": 1, "nnodes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": f"127.0.0.1:{port}",
              "rdzv_id": f"test-{port}"}
    params = {f"launch.{k}": v for k, v in launch.items()}
    nodes = [project(tmp_path / "node0", **params),
             project(tmp_path / "node1", **params, **({"lr": 3e-3} if node1 == "other params" else {}))]
    cmd = torchrun_command("stages.pretrain", LaunchConfig(**launch))
    agents = [subprocess.Popen(cmd, cwd=cwd, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for cwd in nodes]
    try:
        outs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    host = socket.gethostname()
    for agent, out in zip(agents, outs):
        assert agent.returncode == 2, out[-3000:]
        [line] = [line for line in out.splitlines() if line.startswith("error:") or "Traceback" in line]
        if node1 == "other params":
            why = (f"rank 1 (on {host}) was not started on the job rank 0 (on {host}) runs: pretrain.optimizer.lr is "
                   "0.003 there, 0.01 on rank 0; every node needs the same commit, params.yaml and data")
        else:
            why = (f"rank 1 (on {host}) cannot see the file rank 0 (on {host}) wrote in models/pretrain: every node "
                   "needs that folder on storage all nodes share, at the same path")
        assert re.fullmatch(rf"error: stage pretrain \(rank [01]\) failed: {re.escape(why)}", line), line
    for cwd in nodes:
        assert not (cwd / "plots" / "pretrain.csv").exists(), "no step was trained"
        assert [p.name for p in (cwd / "models" / "pretrain").iterdir()] == [f".lock-{host}"]
