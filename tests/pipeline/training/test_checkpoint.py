import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from pipeline.training import checkpoint as ckpt


class Tiny(torch.nn.Module):
    def __init__(self, n=8, tie=True):
        super().__init__()
        self.emb = torch.nn.Embedding(10, n)
        self.out = torch.nn.Linear(n, 10, bias=False)
        if tie:
            self.out.weight = self.emb.weight


def make(tmp_path, step, keep=2, model=None):
    model = model or Tiny()
    opt = torch.optim.AdamW(model.parameters())
    loss = model.out(model.emb(torch.tensor([1, 2]))).sum()
    loss.backward()
    opt.step()
    return ckpt.save(tmp_path, step, model, opt, {"step": step, "rng": [ckpt.rng_state()]}, {"note": "x"}, keep=keep)


def test_save_load_roundtrip_with_tied_weights(tmp_path):
    m = Tiny()
    c = make(tmp_path, 5, model=m)
    assert c.step == 5 and c.meta["step"] == 5 and set(c.meta["files"]) == {"model.safetensors", "optimizer.pt", "trainer.pt"}
    m2 = Tiny()
    ckpt.load_model_weights(c, m2)
    assert torch.equal(m2.emb.weight, m.emb.weight) and m2.out.weight is m2.emb.weight
    state = ckpt.load_state(c, "optimizer.pt")
    assert state["state"][0]["step"].item() == 1


def test_keep_last_k_and_latest(tmp_path):
    for s in (1, 2, 3, 4):
        make(tmp_path, s, keep=2)
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [3, 4]
    assert ckpt.latest(tmp_path).step == 4


def test_incomplete_folders_are_ignored_and_swept(tmp_path):
    make(tmp_path, 1)
    (tmp_path / ".tmp-step-00000002-123").mkdir()
    partial = tmp_path / "step-00000003"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"junk")
    assert ckpt.latest(tmp_path).step == 1
    ckpt.sweep(tmp_path)
    assert not (tmp_path / ".tmp-step-00000002-123").exists()


def test_damaged_file_is_detected(tmp_path):
    c = make(tmp_path, 1)
    with open(c.path / "optimizer.pt", "ab") as f:
        f.write(b"extra")
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.load_state(c, "optimizer.pt")


def test_rng_state_roundtrip():
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    s = ckpt.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    ckpt.set_rng_state(s)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_trainer_state_needs_no_pickle(tmp_path):
    c = make(tmp_path, 1)
    # weights_only=True refuses arbitrary objects; our files must load under it
    torch.load(c.path / "trainer.pt", weights_only=True)
    torch.load(c.path / "optimizer.pt", weights_only=True)


WRITER = textwrap.dedent("""
    import sys, torch
    from pipeline.training import checkpoint as ckpt
    folder = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward(); opt.step()
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        ckpt.save(ckpt.Path(folder), step, model, opt, {"step": step}, {}, keep=2)
        print(step, flush=True)
""")


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.29, 0.41])
def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path, root, delay):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "1"  # at least one save finished
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last = ckpt.latest(tmp_path)
    assert last is not None
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    ckpt.load_model_weights(last, model)
    assert all(torch.all(p == float(last.step)) for p in model.parameters())
    ckpt.load_state(last, "optimizer.pt")
    assert json.loads((last.path / "meta.json").read_text())["step"] == last.step
