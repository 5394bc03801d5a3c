"""In-process tests of the training loop (one rank, no torchrun). The torchrun
paths (DDP equivalence, kill-and-resume, the lock) are in tests/stages/."""

import csv
import math

import pytest
import torch

from pipeline.config import ConfigError, parse_section
from pipeline.model.transformer import Transformer
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import ScheduleSection
from pipeline.training.optimizer import lr_at, param_groups
from pipeline.training.precision import resolve_precision
from pipeline.training.pretrain import PretrainConfig, run_pretrain
from pipeline.training.trainer import NonFiniteError
from tests.helpers import train_params, write_packed

TINY = train_params({"model": {"preset": "tiny"}}, precision="fp32", micro_batch_size=4, max_steps=12,
                    warmup_steps=2, lr=1e-2, min_lr=1e-3, log_every=1, eval_every=6, eval_rows=16,
                    checkpoint_every=4, keep_checkpoints=2, track=False, peak_flops=1e15)


def cfg(**kw):
    return parse_section(PretrainConfig, train_params(TINY, **kw), "pretrain")


def report(tmp_path):
    import json

    return json.loads((tmp_path / "models" / "report.json").read_text())


def run(tmp_path, **kw):
    packed = tmp_path / "packed"
    if not packed.exists():
        write_packed(packed)
    return run_pretrain(cfg(**kw), packed, tmp_path / "models", tmp_path / "plots.csv")


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_trains_logs_and_checkpoints(tmp_path):
    m = run(tmp_path, max_steps=40, eval_every=20, lr=2e-2, peak_flops=None)  # MFU against a measured matmul peak
    rows = read_csv(tmp_path / "plots.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 41))
    assert float(rows[-1]["loss"]) < 0.6 * float(rows[0]["loss"])
    assert m["steps"] == 40 and m["val_loss"] < m["unigram_entropy"]
    for key in ("final_loss", "val_loss", "tokens_per_s", "mfu", "steps"):
        assert m[key] is not None and math.isfinite(m[key]), key
    assert 0 < m["mfu"] < 1
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path / "models")] == [36, 40]
    assert ckpt.latest(tmp_path / "models").meta["final"] is True
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb"} <= set(rows[0])


def test_resume_in_process_matches_uninterrupted(tmp_path):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    full = run(tmp_path / "a", max_steps=12)
    run(tmp_path / "b", max_steps=12, checkpoint_every=4)
    # simulate a crash after step 8: drop the later checkpoint and rerun
    for c in ckpt.complete_checkpoints(tmp_path / "b" / "models"):
        if c.step > 8:
            ckpt.discard([c])
    resumed = run(tmp_path / "b", max_steps=12)
    assert resumed["resumed_from_step"] == 8
    a = [r["loss"] for r in read_csv(tmp_path / "a" / "plots.csv")]
    b = [r["loss"] for r in read_csv(tmp_path / "b" / "plots.csv")]
    assert a == b  # string-exact: bit-identical losses
    assert full["val_loss"] == resumed["val_loss"]


def test_changed_params_start_fresh_instead_of_resuming(tmp_path):
    run(tmp_path, max_steps=8)
    m = run(tmp_path, max_steps=8, lr=5e-3)
    assert m["resumed_from_step"] == 0
    m = run(tmp_path, max_steps=8, lr=5e-3, log_every=2)  # a reporting-only change resumes
    assert m["resumed_from_step"] == 8


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    original = Transformer.forward
    calls = {"n": 0}

    def poisoned(self, idx, *a, **kw):
        logits = original(self, idx, *a, **kw)
        if self.training:
            calls["n"] += 1
            if calls["n"] >= 7:  # micro-batch 7 = step 7
                logits = logits * float("nan")
        return logits

    monkeypatch.setattr(Transformer, "forward", poisoned)
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(nan\) at step 7.*step-00000004.*intact"):
        run(tmp_path, max_steps=12, checkpoint_every=4)
    last = ckpt.latest(tmp_path / "models")
    assert last.step == 4
    model = Transformer(cfg().model.build(64, 32))
    ckpt.load_model_weights(last, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lr_schedule_warmup_cosine_floor():
    c = ScheduleSection(min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, 1.0, c) == pytest.approx(0.1) and lr_at(9, 1.0, c) == pytest.approx(1.0)
    assert lr_at(60, 1.0, c) == pytest.approx(0.55)
    assert lr_at(110, 1.0, c) == pytest.approx(0.1) and lr_at(500, 1.0, c) == pytest.approx(0.1)
    assert all(lr_at(s, 1.0, c) >= lr_at(s + 1, 1.0, c) for s in range(10, 120))


def test_no_weight_decay_on_norms_and_embeddings():
    model = Transformer(cfg().model.build(64, 32))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] or "embeddings" in names[id(p)] for p in no_decay["params"])
    assert any("wq" in names[id(p)] for p in decay["params"])
    assert not any("embeddings" in names[id(p)] or "norm" in names[id(p)] for p in decay["params"])


def test_precision_resolution():
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cpu")) in ("bf16", "fp32")


def test_bf16_autocast_on_cpu_trains(tmp_path):
    m = run(tmp_path, precision="bf16", max_steps=6)
    assert report(tmp_path)["precision"] == "bf16" and math.isfinite(m["final_loss"])


def test_activation_checkpointing_gives_same_losses(tmp_path):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    run(tmp_path / "a", max_steps=4)
    run(tmp_path / "b", max_steps=4, activation_checkpointing=True)
    a = [float(r["loss"]) for r in read_csv(tmp_path / "a" / "plots.csv")]
    b = [float(r["loss"]) for r in read_csv(tmp_path / "b" / "plots.csv")]
    assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("bad, key", [
    ({"precision": "fp8"}, "pretrain.compute.precision"),
    ({"lr": -1}, "pretrain.optimizer.lr"),
    ({"model": {"preset": "huge"}}, "pretrain.model.preset"),
    ({"model": {"n_layers": 2}}, "pretrain.model.n_layers"),
    ({"min_lr": 1.0, "lr": 0.1}, "schedule.min_lr"),
    ({"nproc_per_node": 0}, "pretrain.launch.nproc_per_node"),
    ({"warmup_steps": 20, "max_steps": 10}, "warmup_steps"),
    ({"log_every": 5, "logging": {"evry": 2}}, "pretrain.logging.evry"),
])
def test_params_validation(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cfg(**bad)


def test_fp16_uses_a_grad_scaler_whose_state_is_checkpointed(tmp_path):
    m = run(tmp_path, precision="fp16", max_steps=4, checkpoint_every=2)
    assert report(tmp_path)["precision"] == "fp16" and math.isfinite(m["final_loss"])
    state = ckpt.load_state(ckpt.latest(tmp_path / "models"), "trainer.pt")
    assert state["scaler"]["scale"] > 0 and state["scaler"]["_growth_tracker"] == 4
    # a resume restores the scaler: drop the last checkpoint and run again
    ckpt.discard([ckpt.latest(tmp_path / "models")])
    again = run(tmp_path, precision="fp16", max_steps=4, checkpoint_every=2)
    assert again["resumed_from_step"] == 2
    state = ckpt.load_state(ckpt.latest(tmp_path / "models"), "trainer.pt")
    assert state["scaler"]["_growth_tracker"] == 4  # 2 restored + 2 new successful steps


@pytest.mark.slow
def test_compile_flag_trains_and_saves_uncompiled_names(tmp_path):
    m = run(tmp_path, compile=True, max_steps=3, checkpoint_every=3)
    assert math.isfinite(m["final_loss"])
    from safetensors import safe_open

    with safe_open(str(ckpt.latest(tmp_path / "models").path / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("_orig_mod") for k in f.keys())


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_autocast_takes_effect_inside_the_training_step(tmp_path, precision, dtype):
    """The trainer's forward runs its matmuls in the configured dtype: if autocast
    stopped taking effect, the bf16 case would see fp32 activations."""
    from pipeline.training.trainer import Trainer

    packed = write_packed(tmp_path / "packed")
    c = cfg(precision=precision, max_steps=4)
    trainer = Trainer("pretrain", c, c.model.build(64, 32), packed / "train", packed / "val", tmp_path / "models",
                      tmp_path / "plots.csv", data_id="x")
    seen = []
    trainer.model.layers[0].attention.wq.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    try:
        trainer.train_step()
        trainer.evaluate()
    finally:
        trainer.close()
    assert seen and set(seen) == {dtype}


def test_the_curve_survives_dvc_deleting_the_plots_csv_before_a_resume(tmp_path):
    """DVC deletes plots/<stage>.csv (a plain output) before it reruns a stage, but
    keeps the persist checkpoint folder: a resumed run still reports the whole curve."""
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    run(tmp_path / "a", max_steps=12)
    run(tmp_path / "b", max_steps=12)
    uninterrupted = [(r["step"], r["loss"]) for r in read_csv(tmp_path / "a" / "plots.csv")]
    for c in ckpt.complete_checkpoints(tmp_path / "b" / "models"):  # a crash after step 8
        if c.step > 8:
            ckpt.discard([c])
    (tmp_path / "b" / "plots.csv").unlink()
    assert run(tmp_path / "b", max_steps=12)["resumed_from_step"] == 8
    assert [(r["step"], r["loss"]) for r in read_csv(tmp_path / "b" / "plots.csv")] == uninterrupted
    # a rerun with nothing left to train (a code-only change) keeps the curve and the final loss too
    (tmp_path / "b" / "plots.csv").unlink()
    m = run(tmp_path / "b", max_steps=12)
    assert [(r["step"], r["loss"]) for r in read_csv(tmp_path / "b" / "plots.csv")] == uninterrupted
    assert m["final_loss"] == float(uninterrupted[-1][1])
    assert m["resumed_from_step"] == 12 and m["tokens_per_s"] is None and m["mfu"] is None  # nothing timed, not 0
