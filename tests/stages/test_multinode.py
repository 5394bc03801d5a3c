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
import socket
import subprocess

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
    assert [s for s, _ in losses(two)] == ["1", "2", "3"]
    assert losses(two) == losses(one)  # string-exact
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
