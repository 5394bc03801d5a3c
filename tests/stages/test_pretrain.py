"""The pretrain stage as DVC runs it: ``python -m stages.pretrain`` launching
torchrun with gloo on CPU. Slow (each run starts torchrun), so kept few."""

import contextlib
import csv
import os
import re
import signal
import subprocess
import sys
import time

import mlflow
import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer

from pipeline.model.transformer import ModelConfig, Transformer
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import OptimizerSection
from pipeline.training.optimizer import build_optimizer
from pipeline.training.torchrun import lock_name
from tests.conftest import ROOT
from tests.helpers import on_small_disk, small_disks, train_params, write_packed
from tests.hf_models import save_tiny_hf_folder

pytestmark = pytest.mark.slow

BASE = train_params({"model": {"preset": "tiny"}}, precision="fp32", micro_batch_size=4, grad_accum_steps=1,
                    max_steps=4, warmup_steps=1, lr=1e-2, min_lr=1e-3, log_every=1, eval_every=100,
                    eval_rows=16, checkpoint_every=100, track=False, peak_flops=1e9)


def project(tmp_path, hf=None, **params):
    """A project folder with packed data and params.yaml. ``hf``: a family; the run
    starts from a tiny model of it in models/base/<family> (init_from), and the
    data is packed with that model's tokenizer."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if hf is None:
        write_packed(tmp_path / "data" / "packed", n_docs=600)
    else:
        folder = save_tiny_hf_folder(hf, tmp_path / "models" / "base" / hf)
        vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
        write_packed(tmp_path / "data" / "packed", n_docs=600, vocab=vocab, tokenizer=folder / "tokenizer.json")
        params = {"init_from": f"models/base/{hf}", **params}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"pretrain": train_params(BASE, **params)}))
    return tmp_path


def env(**extra):
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "PIPELINE_PROGRESS": "0", **extra}


def stage(cwd, timeout=240, **kw):
    """``python -m stages.pretrain`` in ``cwd``. One that outlives ``timeout`` fails
    the test with the Python stacks of every process of its tree (faulthandler,
    on SIGABRT): a hang names where each rank and the launcher were waiting."""
    cmd = [sys.executable, "-m", "stages.pretrain"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(PYTHONFAULTHANDLER="1", **kw), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid)
        for p in [*tree.children(recursive=True), tree]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"stages.pretrain ran past {timeout} s; the stacks of its processes:\n{err[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def losses(cwd):
    with open(cwd / "plots" / "pretrain.csv", newline="") as f:
        return [(r["step"], r["loss"]) for r in csv.DictReader(f)]


def weights(cwd):
    """The newest checkpoint's weights, full, whichever layout it has."""
    last = ckpt.latest(cwd / "models" / "pretrain")
    if ckpt.is_sharded(last):
        model = Transformer(ModelConfig(**last.meta["model"]))
        return ckpt.full_model_state(last.path, model)
    return load_file(str(last.path / "model.safetensors"))


def test_two_ranks_give_the_same_update_as_one_rank_with_the_same_global_batch(tmp_path):
    two = project(tmp_path / "two", nproc_per_node=2, micro_batch_size=4, grad_accum_steps=1, max_steps=3)
    one = project(tmp_path / "one", nproc_per_node=1, micro_batch_size=4, grad_accum_steps=2, max_steps=3,
                  checkpoint_every=1, keep_checkpoints=2)
    for p in (two, one):
        r = stage(p)
        assert r.returncode == 0, r.stderr[-3000:]
    w2, w1 = weights(two), weights(one)
    assert w2.keys() == w1.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)
    l2, l1 = losses(two), losses(one)
    assert [s for s, _ in l2] == ["1", "2", "3"]
    assert [float(x) for _, x in l2] == pytest.approx([float(x) for _, x in l1], rel=1e-5)
    # FSDP on 2 ranks, 2 micro-batches each, against DDP with the same split. FSDP reduce-scatters each
    # micro-batch's gradients, DDP all-reduces their sum once: the same sum taken in another order, which
    # moves AdamW's weights by a few 1e-6 in 3 steps (3.2e-6 at most, measured), as another split does
    # (~1e-5, above); one step's update is far larger (checked below)
    split = dict(nproc_per_node=2, micro_batch_size=2, grad_accum_steps=2, max_steps=3)
    ddp, fsdp = project(tmp_path / "ddp", **split), project(tmp_path / "fsdp", parallelism="fsdp", **split)
    for p in (ddp, fsdp):
        r = stage(p)
        assert r.returncode == 0, r.stderr[-3000:]
    wd, wf = weights(ddp), weights(fsdp)
    for k in wd:
        torch.testing.assert_close(wf[k], wd[k], rtol=1e-5, atol=1e-5, msg=k)
    assert [float(x) for _, x in losses(fsdp)] == pytest.approx([float(x) for _, x in l1], rel=1e-5)
    # and the comparisons can fail: one step's update is far outside either tolerance
    before, last = ckpt.complete_checkpoints(one / "models" / "pretrain")
    assert (before.step, last.step) == (2, 3)
    step2 = load_file(str(before.path / "model.safetensors"))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(step2["layers.0.attention.wq.weight"], w1["layers.0.attention.wq.weight"],
                                   rtol=1e-5, atol=1e-5)


def interrupted(p, tmp_path, act, **extra_env):
    """Start the stage in ``p`` in a session of its own, its stderr to a file;
    ``act(proc)`` disturbs it and waits for it to end. Whatever happens, the
    stage's process group is killed after. Returns the stage's stderr."""
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "stages.pretrain"], cwd=p, start_new_session=True,
                                env=env(**extra_env), stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            act(proc)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        err.seek(0)
        return proc, err.read()


def wait_for_step(path, step, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, "trainer exited before it could be killed"
        if path.exists():
            rows = path.read_text().strip().splitlines()
            if len(rows) > step:
                return
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {path}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sigkill_then_resume_is_bit_exact_on_cuda_in_bf16(tmp_path):
    # a GPU takes milliseconds a step: more steps, so that the kill lands mid-run
    kill_and_resume(tmp_path, nproc_per_node=1, device="cuda", precision="bf16", max_steps=600, checkpoint_every=20,
                    eval_every=200)


def test_sigkill_then_resume_is_bit_exact_with_two_fsdp_ranks(tmp_path):
    # 9 val rows: rank 0 scores 2 micro-batches, rank 1 one (FSDP needs both in every forward)
    kill_and_resume(tmp_path, nproc_per_node=2, parallelism="fsdp", eval_rows=9)
    run = tmp_path / "run" / "models" / "pretrain"
    assert all(ckpt.is_sharded(c) and c.meta["world_size"] == 2 for c in ckpt.complete_checkpoints(run))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sigkill_then_resume_is_bit_exact_with_fsdp_on_cuda_in_bf16(tmp_path):
    # FSDP's bf16 mixed-precision policy over NCCL, on a mesh of one GPU
    kill_and_resume(tmp_path, nproc_per_node=1, device="cuda", precision="bf16", parallelism="fsdp", max_steps=600,
                    checkpoint_every=20, eval_every=200)


def test_sigkill_then_resume_is_bit_exact_with_two_ranks_for_a_run_started_from_a_hugging_face_model(tmp_path):
    # also the plain two-rank DDP case (a run from scratch differs only in its first weights); the continued run
    # below is killed and resumed from scratch-initialised weights
    kill_and_resume(tmp_path, hf="qwen2", nproc_per_node=2)


def kill_and_resume(tmp_path, hf=None, **overrides):
    """An uninterrupted run and a run SIGKILLed mid-way then resumed give the same
    per-step losses, string-exact, and the same final weights. ``hf``: both start
    from a tiny Hugging Face model of that family (see :func:`project`)."""
    params = {"max_steps": 24, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 12, **overrides}
    ref = project(tmp_path / "ref", hf=hf, **params)
    r = stage(ref)
    assert r.returncode == 0, r.stderr[-3000:]
    if hf is not None:
        assert "pretrain.model key(s) preset are ignored" in r.stderr
        assert ckpt.latest(ref / "models" / "pretrain").meta["init"]["id"].startswith("hf:")
    run = project(tmp_path / "run", hf=hf, **params)
    proc = subprocess.Popen([sys.executable, "-m", "stages.pretrain"], cwd=run, env=env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = 2 * params["checkpoint_every"] + 2  # at least one checkpoint is on disk by then
    wait_for_step(run / "plots" / "pretrain.csv", after, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group; the ranks die with it (their parent)
    proc.wait()
    killed_at = len(losses(run))
    assert after <= killed_at < params["max_steps"]
    r = stage(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr
    assert losses(run) == losses(ref)  # every step's loss, string-exact
    for k, v in weights(ref).items():
        assert torch.equal(weights(run)[k], v), k


def test_a_checkpoint_the_disk_cannot_hold_is_one_line_and_the_last_one_stays(tmp_path):
    """models/pretrain on a real 2.5 MB filesystem: the tiny model's first
    checkpoint (1.5 MB) fits, the second does not."""
    if small_disks():
        pytest.skip(small_disks())
    p = project(tmp_path, max_steps=4, checkpoint_every=1)
    (p / "models" / "pretrain").mkdir(parents=True)
    # What the filesystem held when the stage had stopped (it ends with the command).
    after = (f"{sys.executable} -c 'from pipeline.training import checkpoint as c; from pathlib import Path; "
             "f = Path(\"models/pretrain\"); c.verify(c.latest(f)); print(sorted(p.name for p in f.iterdir()))'")
    r = subprocess.run(on_small_disk("models/pretrain", 2500, f"{sys.executable} -m stages.pretrain; "
                                     f"echo exit $?; {after}"),
                       cwd=p, env=env(), capture_output=True, text=True, timeout=240)
    assert r.stdout.splitlines()[-2:] == ["exit 2", str(sorted([lock_name(), "curve.csv", "step-00000001"]))], \
        r.stdout + r.stderr
    [line] = [line for line in r.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert re.fullmatch(
        r"error: stage pretrain \(rank 0\) failed: no space left on the device for checkpoint step 2 in "
        rf"models/pretrain \(\d+ kB free on {re.escape(str(p / 'models' / 'pretrain'))}; a checkpoint takes at least "
        r"1\.5 MB, and checkpoint\.keep = 2 are kept\); free some space, or lower checkpoint\.keep, and run the stage "
        r"again: it resumes from step 1 \(models/pretrain/step-00000001\), which is intact", line), line


def test_a_checkpoint_folder_on_a_read_only_disk_is_one_line_before_any_rank_starts(tmp_path):
    if small_disks():
        pytest.skip(small_disks())
    p = project(tmp_path)
    (p / "models" / "pretrain").mkdir(parents=True)
    r = subprocess.run(on_small_disk("models/pretrain", 64, f"exec {sys.executable} -m stages.pretrain", True),
                       cwd=p, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        f"error: stage pretrain failed: read-only file system: models/pretrain/{lock_name()} (EROFS)"]


def test_fsdp_in_fp16_is_one_line_from_the_launcher_before_any_rank_starts(tmp_path):
    p = project(tmp_path, precision="fp16", parallelism="fsdp")
    r = stage(p, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        "error: stage pretrain failed: compute.parallelism fsdp trains in bf16 or fp32, not fp16 (its gradient "
        "scaler does not apply to sharded gradients); set compute.precision to bf16 or fp32"]
    assert not list((p / "models" / "pretrain").glob("step-*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "oom"])
def test_a_stop_or_a_killed_rank_stops_every_rank_in_one_line_that_names_the_checkpoint_to_resume_from(tmp_path, sig):
    """Ctrl-C reaches the launcher's whole process group, as a terminal sends it
    (torchrun starts the ranks in sessions of their own); SIGTERM (Prefect's
    timeout, a service manager) reaches the launcher alone; SIGKILL (the
    kernel's OOM killer) one rank. Either way every rank stops, and the stage
    exits 128 + the signal's number with one line."""
    p = project(tmp_path, nproc_per_node=2, max_steps=100000, checkpoint_every=2, track=True)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ranks, victim = [], []

    def stop(proc):
        wait_for_step(p / "plots" / "pretrain.csv", 3, proc)  # checkpoint_every 2: one is on disk
        ranks.extend(c for c in psutil.Process(proc.pid).children(recursive=True) if "-u" in c.cmdline())
        assert len(ranks) == 2, ranks  # torchrun runs a rank as `python -u -m stages.pretrain`
        victim.extend([ranks[1].pid, ranks[1].environ()["RANK"]])
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        elif sig == signal.SIGTERM:
            proc.send_signal(sig)
        else:
            ranks[1].send_signal(sig)
        proc.wait(timeout=60)

    proc, stderr = interrupted(p, tmp_path, stop, PIPELINE_TRACKING="1", MLFLOW_TRACKING_URI=uri,
                               MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="0")
    assert proc.returncode == 128 + sig, stderr[-3000:]
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"ranks still running after the stage stopped: {alive}"
    last = ckpt.latest(p / "models" / "pretrain")
    what = (f"stopped by {sig.name}; the ranks were stopped" if sig != signal.SIGKILL else
            f"failed: rank {victim[1]} (pid {victim[0]}) was killed by SIGKILL")
    assert [line for line in stderr.splitlines() if "error" in line.lower()] == [
        f"error: stage pretrain {what}; running the stage again resumes from its newest checkpoint, "
        f"step {last.step} ({last.path.relative_to(p)})"], stderr[-3000:]
    assert "Traceback" not in stderr
    # rank 0 could not end its MLflow run: the launcher did
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in runs] == [
        ("pretrain", "FAILED" if sig == signal.SIGKILL else "KILLED")]
    # every step up to the checkpoint a rerun resumes after reached MLflow before the stop
    logged = {m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")}
    assert set(range(1, last.step + 1)) <= logged, sorted(logged)


def test_a_rank_that_stalls_past_launch_timeout_s_stops_the_run_in_one_line(tmp_path):
    """A rank that stops answering (here SIGSTOP: a swapped-out or frozen
    process, a node cut off) leaves the others waiting in a collective; past
    launch.timeout_s they stop, and the one that waited says so in one line,
    no traceback, naming the key to raise."""
    p = project(tmp_path, nproc_per_node=2, max_steps=100000, **{"launch.timeout_s": 4})
    def stall(proc):
        wait_for_step(p / "plots" / "pretrain.csv", 2, proc)
        [stalled] = [c for c in psutil.Process(proc.pid).children(recursive=True)
                     if "-u" in c.cmdline() and c.environ()["RANK"] == "1"]
        stalled.suspend()
        time.sleep(12)  # rank 0 waits 4 s, then 3 s of grace before it speaks
        stalled.resume()
        proc.wait(timeout=90)

    proc, stderr = interrupted(p, tmp_path, stall)
    assert proc.returncode == 2, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert re.fullmatch(r"error: stage pretrain \(rank 0\) failed: a collective waited more than 4 s "
                        r"\(launch.timeout_s\) for another rank, which stalled or was cut off: RuntimeError: .*"
                        r"Timed out waiting 4000ms .*; if a rank was only busy \(writing a checkpoint alone, "
                        r"compiling\), raise launch.timeout_s", line), line
    assert "Traceback" not in stderr


def test_a_second_trainer_is_refused_while_orphans_run(tmp_path):
    p = project(tmp_path, nproc_per_node=1, max_steps=100000)
    # `sh` plays `dvc repro`: SIGKILL to it orphans the stage process and its ranks
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} -m stages.pretrain; exit $?"], cwd=p, env=env(),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(p / "plots" / "pretrain.csv", 2, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        r = stage(p, timeout=60)
        assert r.returncode == 2
        assert "another trainer is still running" in r.stderr
        rows, t0 = len(losses(p)), time.time()
        while len(losses(p)) == rows and time.time() - t0 < 30:
            time.sleep(0.2)
        assert len(losses(p)) > rows, "the orphaned trainer should still be training, untouched"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # sh and the launcher; the ranks die with their parent
    # once the orphans are gone the lock is free again: the kernel drops flocks of dead processes
    time.sleep(1.0)
    p2 = yaml.safe_load((p / "params.yaml").read_text())
    p2["pretrain"]["schedule"]["max_steps"] = 3
    (p / "params.yaml").write_text(yaml.safe_dump(p2))
    r = stage(p, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_non_finite_loss_stops_with_a_clear_message(tmp_path):
    p = project(tmp_path, lr=1e6, min_lr=1e6, warmup_steps=0, grad_clip=0, max_steps=50, checkpoint_every=1)
    r = stage(p)
    assert r.returncode == 3, r.stderr[-3000:]  # the rank's own code for a fault of the run, not a StageError's 2
    assert "non-finite" in r.stderr and "at step" in r.stderr
    last = ckpt.latest(p / "models" / "pretrain")
    assert last is not None and "intact" in r.stderr


def test_mlflow_outage_does_not_stop_training(tmp_path):
    p = project(tmp_path, track=True, max_steps=3)
    t0 = time.time()
    r = stage(p, MLFLOW_TRACKING_URI="http://127.0.0.1:9", PIPELINE_TRACKING="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (p / "metrics" / "pretrain.json").exists()
    assert time.time() - t0 < 120
    assert "mlflow" in r.stderr.lower()  # one warning says where the metrics went
    stores = [d for d in (p / ".tracking-offline").iterdir() if d.is_dir()]
    assert len(stores) == 1  # the metrics went to a local MLflow store, to be replayed later
    from mlflow import MlflowClient

    from pipeline.tracking.tracker import offline_uri

    client = MlflowClient(offline_uri(stores[0]))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == [1, 2, 3]


def one_error_line(r, stage_name="pretrain"):
    """An expected failure: exit 2, and stderr's only error is one line naming the stage."""
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: stage {stage_name} failed:"), r.stderr[-3000:]
    return errors[0]


def test_pretrain_before_pack_is_one_line_naming_the_fix(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"pretrain": BASE}))
    line = one_error_line(stage(tmp_path, timeout=60))
    assert "data/packed/manifest.json" in line and "dvc repro pack" in line
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").rglob("step-*"))


def test_a_batch_the_data_cannot_fill_is_refused_by_the_launcher(tmp_path):
    """The launcher's own line (no rank's "(rank 0)"), before torchrun starts."""
    p = project(tmp_path, micro_batch_size=4000)
    line = one_error_line(stage(p, timeout=60))
    assert "one step needs 4000 rows" in line and "lower them or add data" in line
    assert [f.name for f in (p / "models" / "pretrain").iterdir()] == [".lock-vm"]  # the trainer lock only


def test_a_damaged_checkpoint_is_named_and_resume_falls_back_or_stops(tmp_path):
    p = project(tmp_path, max_steps=4, checkpoint_every=2, keep_checkpoints=2)
    assert stage(p).returncode == 0
    folder = p / "models" / "pretrain"
    newest, older = ckpt.latest(folder), ckpt.complete_checkpoints(folder)[0]
    assert (newest.step, older.step) == (4, 2)
    reference = losses(p)
    weights_file = newest.path / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights_file.write_bytes(bytes(data))
    # the newest is damaged: resume from step 2, with a warning naming the file, and redo steps 3-4 exactly
    r = stage(p)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step-00000004/model.safetensors" in r.stderr and "resumed from" in r.stderr
    assert losses(p) == reference
    # every checkpoint damaged: one line, and nothing is trained from the damaged weights
    for c in ckpt.complete_checkpoints(folder):
        (c.path / "optimizer.pt").write_bytes(b"truncated")
    line = one_error_line(stage(p))
    assert "optimizer.pt" in line and "damaged" in line


def set_params(p, **short):
    params = yaml.safe_load((p / "params.yaml").read_text())
    (p / "params.yaml").write_text(yaml.safe_dump({"pretrain": train_params(params["pretrain"], **short)}))


def metrics(p):
    import json

    return json.loads((p / "metrics" / "pretrain.json").read_text())


def test_a_continued_run_killed_and_resumed_is_bit_exact_with_two_ranks(tmp_path):
    """Raise max_steps 12 -> 36 (wsd): the continuation (from before the old decay), SIGKILLed mid-way and
    resumed, gives the same per-step losses, string-exact, and the same weights
    as the continuation left alone."""
    params = {"nproc_per_node": 2, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 12, "kind": "wsd",
              "warmup_steps": 2, "max_steps": 12}
    ref = project(tmp_path / "ref", **params)
    assert stage(ref).returncode == 0
    set_params(ref, max_steps=36)
    r = stage(ref)
    assert r.returncode == 0, r.stderr[-3000:]
    # from step 8, the last checkpoint before the 12-step run's decay (steps 11-12); step 12 is kept under previous/
    assert "continuing the run from its checkpoint at step 8" in r.stderr and "had started decaying" not in r.stderr
    assert metrics(ref)["resumed_from_step"] == 8 and [s for s, _ in losses(ref)] == [str(i) for i in range(1, 37)]
    assert metrics(ref)["moved_aside"] == 1
    run = project(tmp_path / "run", **params)
    assert stage(run).returncode == 0
    set_params(run, max_steps=36)
    proc = subprocess.Popen([sys.executable, "-m", "stages.pretrain"], cwd=run, env=env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = 12 + 2 * 4 + 2  # at least one checkpoint of the continuation is on disk by then
    wait_for_step(run / "plots" / "pretrain.csv", after, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(losses(run))
    assert after <= killed_at < 36
    r = stage(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and metrics(run)["resumed_from_step"] > 12
    assert losses(run) == losses(ref)
    for k, v in weights(ref).items():
        assert torch.equal(weights(run)[k], v), k


def test_max_steps_0_passes_the_model_through_and_a_changed_run_is_kept_under_previous(tmp_path):
    p = project(tmp_path, hf="llama", nproc_per_node=1, max_steps=0)
    r = stage(p)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(p)
    assert m["steps"] == 0 and m["val_loss"] > 0 and (m["moved_aside"], m["previous_runs"]) == (0, 0)
    [c] = ckpt.complete_checkpoints(p / "models" / "pretrain")
    assert c.step == 0 and c.meta["final"] and c.meta["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    set_params(p, max_steps=3, lr=5e-3)
    r = stage(p)
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(p)["steps"] == 3 and (metrics(p)["moved_aside"], metrics(p)["previous_runs"]) == (1, 1)
    [aside] = (p / "models" / "pretrain" / "previous").iterdir()
    assert [c.step for c in ckpt.complete_checkpoints(aside)] == [0]
    assert "changed: optimizer.lr 0.01 -> 0.005" in r.stderr


def test_max_steps_0_without_init_from_is_one_line_before_any_rank_starts(tmp_path):
    p = project(tmp_path, nproc_per_node=2, max_steps=0)
    line = one_error_line(stage(p, timeout=60))
    assert "max_steps 0" in line and "init_from is null" in line
    assert not (p / "models" / "pretrain").exists() or not list((p / "models" / "pretrain").rglob("step-*"))


def test_a_two_rank_fsdp_checkpoint_resumes_on_one_rank_and_on_ddp_with_its_weights_and_exports(tmp_path, tok_path):
    """Resharding: a checkpoint written by 2 FSDP ranks resumes on 1 FSDP rank, on
    1 plain rank and on 2 DDP ranks (the global batch kept, so the run is the
    same). Each resumes at the checkpoint's step with nothing left to train,
    which re-saves that step in its own layout: its weights and AdamW state
    equal the sharded ones exactly. The sharded checkpoint also exports to a
    Hugging Face folder that transformers runs to our logits."""
    import shutil

    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()

    def make(path, **params):
        path.mkdir(parents=True)
        write_packed(path / "data" / "packed", n_docs=600, vocab=vocab, tokenizer=tok_path)
        (path / "params.yaml").write_text(yaml.safe_dump({"pretrain": train_params(BASE, **params)}))
        return path

    common = dict(micro_batch_size=4, max_steps=6, checkpoint_every=3, keep_checkpoints=2)
    src = make(tmp_path / "fsdp2", nproc_per_node=2, parallelism="fsdp", grad_accum_steps=1, **common)
    r = stage(src)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = ckpt.resolve(src / "models" / "pretrain" / "step-00000003")
    assert ckpt.is_sharded(saved) and saved.meta["world_size"] == 2
    assert sorted(n for n in saved.meta["files"] if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    def training_state(c):
        """Weights and AdamW state by parameter name, read without the code under test:
        DCP's own converter for a sharded checkpoint, the files themselves for a single-file one."""
        if ckpt.is_sharded(c):
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(c.path, tmp_path / "full.pt")
            full = torch.load(tmp_path / "full.pt", weights_only=False)  # written just now by this test
            return full["model"], full["optim"]["state"]
        model = Transformer(ModelConfig(**c.meta["model"]))
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in build_optimizer(model, OptimizerSection(), torch.device("cpu")).param_groups
                 for p in g["params"]]
        moments = torch.load(c.path / "optimizer.pt", weights_only=True)["state"]
        return load_file(str(c.path / "model.safetensors")), {order[i]: v for i, v in moments.items()}

    want_weights, want_moments = training_state(saved)
    for name, nproc, parallelism, accum in [("fsdp1", 1, "fsdp", 2), ("ddp1", 1, "ddp", 2), ("ddp2", 2, "ddp", 1)]:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        ckpt.discard([ckpt.latest(dst / "models" / "pretrain")])  # keep step 3 only
        (dst / "params.yaml").write_text(yaml.safe_dump({"pretrain": train_params(
            BASE, nproc_per_node=nproc, parallelism=parallelism, grad_accum_steps=accum, **{**common, "max_steps": 3})}))
        r = stage(dst)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stderr, name
        resaved = ckpt.latest(dst / "models" / "pretrain")
        assert resaved.step == 3 and ckpt.is_sharded(resaved) == (parallelism == "fsdp"), name
        assert resaved.meta["world_size"] == nproc and resaved.meta["fingerprint"] == saved.meta["fingerprint"]
        got_weights, got_moments = training_state(resaved)
        for k in got_weights.keys() & want_weights.keys():  # a single file holds a tied weight once
            assert torch.equal(got_weights[k], want_weights[k]), (name, k)
        assert len(got_weights.keys() & want_weights.keys()) >= len(want_weights) - 1
        assert got_moments.keys() == want_moments.keys()
        for param, moments in want_moments.items():
            assert moments["exp_avg"].abs().sum() > 0  # trained moments, not a fresh optimizer's
            for k, v in moments.items():
                assert torch.equal(torch.as_tensor(got_moments[param][k]), torch.as_tensor(v)), (name, param, k)

    from transformers import AutoModelForCausalLM

    from pipeline.export import export_model

    export_model(src / "models" / "pretrain", tok_path, tmp_path / "export", card_info={})
    ours = Transformer(ModelConfig(**ckpt.latest(src / "models" / "pretrain").meta["model"])).eval()
    ckpt.load_model_weights(ckpt.latest(src / "models" / "pretrain"), ours)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(4, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
