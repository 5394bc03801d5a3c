"""pipeline/training/distributed.py: the device a run asks for, one job on every rank, and tearing the
process group down."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pipeline.errors import StageError
from pipeline.training.distributed import DeviceError, pick_device
from tests.conftest import ROOT


def test_auto_and_cpu():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_one_line_stage_error():
    with pytest.raises(DeviceError, match=r"^device 'cuda' was asked for, but torch .* sees no CUDA GPU here; "
                                          r"set the device to auto or cpu"):
        pick_device("cuda")
    assert issubclass(DeviceError, StageError)


def test_a_numbered_or_unknown_device_is_checked_too():
    """cuda:N is a CUDA device (checked like cuda); a name torch does not know, or a
    device the pipeline does not run on, is a DeviceError, never the CPU in its place."""
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"^device 'cuda:0' was asked for, but torch .* sees no CUDA GPU here"):
            pick_device("cuda:0")
    else:
        assert pick_device("cuda:0") == torch.device("cuda", 0)
        with pytest.raises(DeviceError, match=r"CUDA GPU\(s\), numbered from 0"):
            pick_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(DeviceError, match=r"^device 'gpu' is not a device name"):
        pick_device("gpu")
    with pytest.raises(DeviceError, match=r"^device 'meta' is not supported"):
        pick_device("meta")


# Rank 0 closes a DDP Trainer while a gloo worker thread still holds a collective whose
# tensor has a Python object (rank 1 joins it 2 s late), as a worker can at the end of a
# run on a busy machine; then the Trainer goes, as when run_pretrain returns. With
# "raised", the module's forward has raised, and the exception's traceback keeps DDP
# alive until after close(), as when a forward pass fails in a rank.
CLOSE_WHILE_A_WORKER_HOLDS_A_TENSOR = """
import os, sys, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.distributed.nn  # imported before the group exists, as in a rank: it must not hold the group
from pipeline.training.trainer import Trainer

class Failing(nn.Linear):
    def forward(self, x):
        raise RuntimeError("forward failed")

rank, store, lock, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
ddp = nn.parallel.DistributedDataParallel(Failing(4, 4) if mode == "raised" else nn.Linear(4, 4))
error = None
if mode == "raised":
    try:
        ddp(torch.ones(1, 4))
    except RuntimeError as e:
        error = e  # its traceback holds DDP.forward's frame, and so the module
if rank == 1:
    time.sleep(2)
    dist.all_reduce(torch.ones(1000))
    os._exit(0)
trainer = Trainer.__new__(Trainer)  # only what close() uses
trainer._lock_fd, trainer.fwd_model = os.open(lock, os.O_RDWR | os.O_CREAT), ddp
del ddp
t = torch.ones(1000)
work = dist.all_reduce(t, async_op=True)
del work, t  # the worker thread holds the last reference to the tensor
trainer.close()
del trainer, error
print("closed", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["finished", "raised"])
def test_closing_a_ddp_trainer_does_not_deadlock_with_a_gloo_worker_that_needs_the_gil(tmp_path, mode):
    """A two-rank run once hung after its last step: rank 1 froze freeing its DDP
    Reducer, which freed the destroyed gloo group with the GIL held and joined a
    worker thread that waited for the GIL to free a tensor. Trainer.close() frees
    DDP's Reducer before the group (distributed.shutdown), also while a traceback
    still holds the module."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(CLOSE_WHILE_A_WORKER_HOLDS_A_TENSOR))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(tmp_path / "store"), str(tmp_path / "lock"), mode]
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), *args], env=env, text=True,
                              stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True) for rank in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=120)
    except subprocess.TimeoutExpired:
        out = None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert out is not None, "rank 0 deadlocked closing its Trainer (a gloo worker waits for the GIL)"
    assert procs[0].returncode == 0 and "closed" in out, out[-3000:]


def test_init_reads_torchruns_variables_and_passes_the_timeout_on(monkeypatch):
    """The global RANK (not LOCAL_RANK) is the rank: on a second node of eight
    GPUs, local rank 0 is rank 8, and only rank 0 of the whole run is main."""
    from datetime import timedelta

    from pipeline.training import distributed

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    alone = distributed.init("cpu")
    assert alone == distributed.Dist(0, 0, 1, torch.device("cpu"), None) and alone.is_main and not alone.enabled
    made = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: made.append(kw))
    monkeypatch.setenv("MASTER_ADDR", "node0")
    for key, value in (("RANK", "8"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "16"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(key, value)
    d = distributed.init("cpu", timeout_s=30)
    assert d == distributed.Dist(8, 0, 16, torch.device("cpu"), "gloo") and not d.is_main and d.enabled
    assert made == [{"backend": "gloo", "device_id": None, "timeout": timedelta(seconds=30)}]
    assert distributed.Dist(0, 0, 16, torch.device("cpu"), "gloo").is_main


REDUCE = """
import json, sys
import torch
import torch.distributed as dist
from pipeline.training.distributed import Dist, all_reduce_max, all_reduce_mean, all_reduce_min

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
d = Dist(rank, rank, 2, torch.device("cpu"), "gloo")
t = torch.tensor([1.0, 4.0]) if rank == 0 else torch.tensor([3.0, 2.0])
print(json.dumps([f(t, d).tolist() for f in (all_reduce_mean, all_reduce_max, all_reduce_min)] + [t.tolist()]))
dist.destroy_process_group()
"""


def test_the_reductions_over_two_ranks_leave_their_input_alone(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(REDUCE)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store")], text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
             for rank in (0, 1)]
    try:
        outs = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    mean_max_min = [[2.0, 3.0], [3.0, 4.0], [1.0, 2.0]]
    assert outs == [mean_max_min + [[1.0, 4.0]], mean_max_min + [[3.0, 2.0]]]


# Two ranks (gloo, a file store) call check_one_job once per case, in order, and
# print each outcome as a JSON line: "ok", or the error's class and message.
ONE_JOB = """
import json, sys
import torch.distributed as dist
from pathlib import Path
from pipeline.training.distributed import Dist, JobMismatchError, check_one_job
import torch

rank, store, cases = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
d = Dist(rank, rank, 2, torch.device("cpu"), "gloo")
for case in cases:
    job, folder = case["jobs"][rank], Path(case["folders"][rank])
    try:
        check_one_job(d, job, folder, wait=0.5)
        print(json.dumps("ok"), flush=True)
    except JobMismatchError as e:
        print(json.dumps([type(e).__name__, str(e)]), flush=True)
dist.destroy_process_group()
"""


def test_every_rank_runs_rank_0s_job_on_a_folder_both_see(tmp_path):
    """What must agree is compared key by key, and the folder rank 0 writes must
    be the one every rank sees: either breach stops every rank with the same
    line; a run that agrees leaves nothing behind."""
    shared, mine, theirs = (tmp_path / n for n in ("shared", "mine", "theirs"))
    for f in (shared, mine, theirs):
        f.mkdir()
    job = {"pretrain.optimizer.lr": 0.003, "pretrain.seed": 1, "data (digest)": "ab12"}
    many = {**job, **{f"pretrain.k{i}": i for i in range(6)}}
    cases = [
        {"jobs": [job, job], "folders": [str(shared)] * 2},
        {"jobs": [job, {**job, "pretrain.optimizer.lr": 0.001}], "folders": [str(shared)] * 2},
        {"jobs": [job, {k: v for k, v in job.items() if k != "pretrain.seed"}], "folders": [str(shared)] * 2},
        {"jobs": [job, many], "folders": [str(shared)] * 2},
        {"jobs": [job, job], "folders": [str(mine), str(theirs)]},
    ]
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(ONE_JOB))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store"), json.dumps(cases)],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [[json.loads(line) for line in out.splitlines() if line.startswith(('"', "["))] for out in outs]
    assert results[0][:4] == results[1][:4], "every rank says the same"
    ok, lr, absent, more, folder = results[0]
    assert ok == "ok"
    assert lr == ["JobMismatchError", f"rank 1 (on {os.uname().nodename}) was not started on the job rank 0 "
                  f"(on {os.uname().nodename}) runs: pretrain.optimizer.lr is 0.001 there, 0.003 on rank 0; every "
                  "node needs the same commit, params.yaml and data"]
    assert "pretrain.seed is absent there, 1 on rank 0;" in absent[1]
    assert "pretrain.k0 is 0 there, absent on rank 0; " in more[1] and "(and 2 more); every node" in more[1]
    assert more[1].count(" there, ") == 4, "four keys shown, and the count of the rest"
    for result, here in zip((folder, results[1][4]), (mine, theirs)):  # each rank names the folder by its own path
        assert result == ["JobMismatchError", f"rank 1 (on {os.uname().nodename}) cannot see the file rank 0 "
                          f"(on {os.uname().nodename}) wrote in {here}: every node needs that folder on storage "
                          "all nodes share, at the same path"]
    assert [p.name for f in (shared, mine, theirs) for p in f.iterdir()] == [], "the probes are gone"


@pytest.mark.parametrize("env, message", [
    ({"RANK": "x"}, r"^RANK='x' in the environment is not a whole number of at least 0; torchrun sets it"),
    ({"WORLD_SIZE": "0"}, r"^WORLD_SIZE='0' in the environment is not a whole number of at least 1;"),
    ({"WORLD_SIZE": ""}, r"^WORLD_SIZE='' in the environment is not a whole number"),
    ({"LOCAL_RANK": "-1"}, r"^LOCAL_RANK='-1' in the environment is not a whole number of at least 0;"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
     r"^RANK=2 in the environment is not below WORLD_SIZE=2;"),
    ({"MASTER_ADDR": "node0"}, r"^MASTER_ADDR is set in the environment, but RANK and WORLD_SIZE and MASTER_PORT are "
                               r"not, so this process cannot join a process group; start the ranks with torchrun, or "
                               r"unset MASTER_ADDR to train in one process$"),
    ({"MASTER_ADDR": "node0", "RANK": "0", "WORLD_SIZE": "1"}, r"^MASTER_ADDR is set in the environment, but "
                                                               r"MASTER_PORT is not,"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, r"^WORLD_SIZE=2 in the environment, but MASTER_ADDR is not set, so this process "
                                       r"cannot join the other ranks; start the ranks with torchrun"),
])
def test_a_launch_environment_that_cannot_describe_this_process_is_one_line(monkeypatch, env, message):
    """A bad RANK or WORLD_SIZE stops the run before any work, naming the variable, rather
    than a ValueError traceback from int(), or a 'rank' of a world nobody joins, which would
    train its share of the data alone without a word."""
    from pipeline.training import distributed

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: pytest.fail("joined a group"))
    with pytest.raises(distributed.LaunchEnvError, match=message) as err:
        distributed.init("cpu", need_group=True)
    assert "\n" not in str(err.value) and isinstance(err.value, StageError)


def test_need_group_alone_makes_a_group_of_one_and_shutdown_ends_it(monkeypatch):
    """FSDP and sharded checkpoints need a process group even in one process: an
    in-memory one of world size 1, whatever LOCAL_RANK says, gone after shutdown."""
    import torch.distributed as dist

    from pipeline.training import distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert not dist.is_initialized()
    try:
        d = distributed.init("cpu", need_group=True)
        assert d == distributed.Dist(0, 0, 1, torch.device("cpu"), "gloo") and d.enabled and d.is_main
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert distributed.gather_objects({"a": 1}, d) == [{"a": 1}]
        monkeypatch.delenv("LOCAL_RANK")
        assert distributed.init("cpu") == d  # a second call joins the group that is there
    finally:
        distributed.shutdown()
    assert not dist.is_initialized()
