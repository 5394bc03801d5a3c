"""In-process tests of the training loop (one rank, no torchrun). The torchrun
paths (DDP equivalence, kill-and-resume, the lock) are in tests/stages/."""

import csv
import json
import math

import pytest
import torch

from pipeline.config import ConfigError, parse_section
from pipeline.model.transformer import Transformer
from pipeline.training import checkpoint as ckpt
from pipeline.training.pretrain import PretrainConfig, run_pretrain
from pipeline.training.trainer import NonFiniteError, ckpt_model
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


def test_a_resumed_run_carries_on_its_loss_spike_count_and_running_mean(tmp_path):
    """A spike is a loss above spike_factor x the running mean of the losses before it: after a resume both
    the count and the mean go on as in the uninterrupted run (lr 0.1 makes the loss jump; factor 1.0001: a
    loss above the mean counts)."""
    spikes = {"lr": 0.1, "logging.spike_factor": 1.0001}
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    full = run(tmp_path / "a", max_steps=12, **spikes)
    run(tmp_path / "b", max_steps=12, **spikes)
    for c in ckpt.complete_checkpoints(tmp_path / "b" / "models"):
        if c.step > 8:
            ckpt.discard([c])
    [at_8] = ckpt.complete_checkpoints(tmp_path / "b" / "models")
    assert ckpt.load_state(at_8, "trainer.pt")["loss_spikes"] > 0  # some before the interruption
    resumed = run(tmp_path / "b", max_steps=12, **spikes)
    assert resumed["resumed_from_step"] == 8 and resumed["loss_spikes"] == full["loss_spikes"]
    a, b = (ckpt.load_state(ckpt.latest(tmp_path / name / "models"), "trainer.pt") for name in ("a", "b"))
    assert b["loss_ema"] == a["loss_ema"] and b["loss_spikes"] == a["loss_spikes"]


def test_the_loss_spike_mean_is_a_running_mean_with_weight_0_05_on_each_new_loss(tmp_path):
    """Recomputed by hand from the logged losses: the mean starts at the first loss, then
    mean = 0.95 mean + 0.05 loss; a loss above spike_factor x the mean before it is a spike."""
    m = run(tmp_path, max_steps=8, lr=0.1, **{"logging.spike_factor": 1.0001})
    losses = [float(r["loss"]) for r in read_csv(tmp_path / "plots.csv")]
    mean, spikes = losses[0], 0
    for loss in losses[1:]:
        spikes += loss > 1.0001 * mean
        mean = 0.95 * mean + 0.05 * loss
    state = ckpt.load_state(ckpt.latest(tmp_path / "models"), "trainer.pt")
    assert state["loss_ema"] == mean and m["loss_spikes"] == state["loss_spikes"] == spikes > 0


def test_val_loss_is_measured_every_eval_every_steps_and_at_the_end(tmp_path):
    run(tmp_path, max_steps=14, eval_every=6)
    assert [int(r["step"]) for r in read_csv(tmp_path / "plots.csv") if r["val_loss"]] == [6, 12, 14]


def test_identical_runs_write_identical_checkpoint_files(tmp_path):
    """Whatever the process drew from Python's and NumPy's global generators
    before, the checkpoint files of a run (their RNG states included) are the
    same: a rerun reproduces them byte for byte."""
    import random

    import numpy as np

    files = []
    for name in ("a", "b"):
        random.random(), np.random.rand()  # another process, another state
        (tmp_path / name).mkdir()
        run(tmp_path / name, max_steps=4)
        [c] = ckpt.complete_checkpoints(tmp_path / name / "models")
        files.append({f: (c.path / f).read_bytes() for f in ("model.safetensors", "optimizer.pt", "trainer.pt")})
    assert files[0] == files[1]


def test_changed_params_start_fresh_instead_of_resuming(tmp_path):
    run(tmp_path, max_steps=8)
    m = run(tmp_path, max_steps=8, lr=5e-3)
    assert m["resumed_from_step"] == 0
    m = run(tmp_path, max_steps=8, lr=5e-3, log_every=2)  # a reporting-only change resumes
    assert m["resumed_from_step"] == 8


def test_the_run_identity_holds_the_global_batch_of_all_ranks():
    """2 ranks x 4 rows and 1 rank x 8 rows are one run; 1 and 2 ranks of 4 rows are two
    (the same per-rank params train on other global batches)."""
    from pipeline.training.trainer import run_fingerprint, run_record
    from tests.helpers import tiny_config

    model = tiny_config(64)
    four, eight = cfg(micro_batch_size=4), cfg(micro_batch_size=8)
    assert four.batch.grad_accum_steps == eight.batch.grad_accum_steps == 1
    assert run_record(four, model, 2, "data", None)["global_batch"] == 8
    assert run_fingerprint(four, model, 2, "data", None) == run_fingerprint(eight, model, 1, "data", None)
    assert run_fingerprint(four, model, 1, "data", None) != run_fingerprint(four, model, 2, "data", None)


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


def labelled_packed(out, seq_len=32):
    """Packed rows with SFT-style labels whose count differs from row to row: each
    document scores a random share of its tokens (none, some or all)."""
    import numpy as np

    from tests.helpers import synthetic_docs, write_split

    docs = synthetic_docs(300, 64, seed=7)
    rng = np.random.default_rng(7)
    labels = [np.where(np.arange(len(d)) >= rng.integers(0, len(d) + 1), d, -100).astype(np.int32) for d in docs]
    for split, part in (("train", slice(30, None)), ("val", slice(0, 30))):
        write_split(out / split, docs[part], seq_len, labels[part])
    return out


@pytest.mark.parametrize("micro, accum", [(4, 2), (2, 4)])
def test_grad_accumulation_weights_every_labelled_token_of_the_global_batch_alike(tmp_path, micro, accum):
    """The same global batch split into micro-batches gives the same update: the loss is
    normalised by the labelled tokens of the whole global batch, not per micro-batch
    (its micro-batches score different numbers of tokens here) nor once more by the
    accumulation steps. Gradient norms and losses agree to float rounding."""
    from pipeline.training.trainer import Trainer

    data = labelled_packed(tmp_path / "sft")

    def steps(name, **kw):
        c = cfg(max_steps=4, **kw)
        t = Trainer("pretrain", c, c.model.build(64, 32), data / "train", data / "val", tmp_path / name / "models",
                    tmp_path / name / "plots.csv", data_id="x")
        try:
            counts = [[int((t.train_data.batch(r, t.d.device)["targets"] != -100).sum()) for r in t.order.next_step()]]
            t._build_order()
            return [t.train_step() for _ in range(3)], counts[0]
        finally:
            t.close()

    whole, _ = steps("whole", micro_batch_size=micro * accum, grad_accum_steps=1)
    split, counts = steps("split", micro_batch_size=micro, grad_accum_steps=accum)
    assert len(set(counts)) > 1  # the micro-batches of step 1 score different numbers of tokens
    for a, b in zip(whole, split, strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_a_resumed_run_accumulating_over_labelled_rows_repeats_the_uninterrupted_steps_bit_for_bit(tmp_path):
    """Resume with grad_accum_steps 2 over rows that score different numbers of tokens:
    the curve's numbers after the checkpoint are string-exact, and elapsed_s keeps rising."""
    labelled_packed(tmp_path / "packed")
    c = cfg(max_steps=6, micro_batch_size=2, grad_accum_steps=2, checkpoint_every=3, eval_every=3)
    fit(trainer(tmp_path, "a", c))
    fit(trainer(tmp_path, "b", c))
    ckpt.discard([x for x in ckpt.complete_checkpoints(tmp_path / "b" / "models") if x.step > 3])
    assert fit(trainer(tmp_path, "b", c))["resumed_from_step"] == 3
    cols = ("step", "loss", "lr", "grad_norm", "val_loss")
    assert rows_of(tmp_path / "b" / "plots.csv", cols) == rows_of(tmp_path / "a" / "plots.csv", cols)
    elapsed = [float(r["elapsed_s"]) for r in read_csv(tmp_path / "b" / "plots.csv")]
    assert len(elapsed) == 6 and elapsed == sorted(elapsed)


def test_evaluate_runs_without_autograd_in_eval_mode_and_training_goes_on_in_train_mode(tmp_path):
    """evaluate() builds no graph and leaves no gradient (torch.no_grad), runs the
    model in eval mode, and the next train step is back in train mode with autograd."""
    t = trainer(tmp_path, "a")
    seen = []
    t.model.register_forward_hook(lambda mod, inp, out: seen.append((torch.is_grad_enabled(), mod.training,
                                                                      out.requires_grad)))
    try:
        t.evaluate()
        assert seen and set(seen) == {(False, False, False)}
        assert all(p.grad is None for p in t.model.parameters())
        seen.clear()
        t.train_step()
        assert seen and set(seen) == {(True, True, True)}
    finally:
        t.close()


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_the_optimizer_steps_on_gradients_clipped_to_grad_clip(tmp_path, clip):
    """optimizer.grad_clip caps the global gradient norm the optimizer sees (0: off, the
    gradients as they are); the reported grad_norm is the norm before clipping."""
    t = trainer(tmp_path, "a", cfg(max_steps=4, grad_clip=clip))
    seen = []
    t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(float(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in t.model.parameters() if p.grad is not None])))))
    try:
        reported = [t.train_step()["grad_norm"] for _ in range(2)]
    finally:
        t.close()
    expected = [min(n, clip) if clip else n for n in reported]
    assert clip == 0 or min(reported) > clip  # the cap bites at every step
    assert seen == pytest.approx(expected, rel=1e-5)


def test_val_loss_is_the_mean_over_the_labelled_tokens_of_the_val_rows(tmp_path):
    """SFT-style val rows (labels on part of each row): val loss is the summed token
    loss over the evaluated rows divided by their labelled tokens, not by all positions."""
    from pipeline.training.loss import token_loss_sum
    from pipeline.training.sampler import eval_rows
    from pipeline.training.trainer import Trainer

    data = labelled_packed(tmp_path / "sft")
    c = cfg(max_steps=4, eval_rows=10, micro_batch_size=4)
    t = Trainer("pretrain", c, c.model.build(64, 32), data / "train", data / "val", tmp_path / "models",
                tmp_path / "plots.csv", data_id="x")
    try:
        got = t.evaluate()
        b = t.val_data.batch(eval_rows(len(t.val_data), 10, 1, 0), t.d.device)
        with torch.no_grad():
            loss = token_loss_sum(t.model(b["input_ids"], segment_ids=b["segment_ids"]), b["targets"])
    finally:
        t.close()
    scored = int((b["targets"] != -100).sum())
    assert 0 < scored < b["targets"].numel()
    assert got == pytest.approx(loss.item() / scored, rel=1e-5)


def test_fp16_skips_a_step_whose_gradients_overflow_and_goes_on(tmp_path):
    """An inf gradient under fp16 is the GradScaler's signal: that step leaves the weights
    as they were and halves the loss scale, and training goes on (no NonFiniteError)."""
    t = trainer(tmp_path, "a", cfg(max_steps=4, precision="fp16"))
    calls = []
    hook = t.model.layers[0].attention.wq.weight.register_hook(
        lambda g: calls.append(1) or (g * float("inf") if len(calls) == 1 else g))
    try:
        before = {k: v.clone() for k, v in t.model.state_dict().items()}
        scale = t.scaler.get_scale()
        first = t.train_step()
        assert math.isinf(first["grad_norm"]) and math.isfinite(first["loss"])
        assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
        assert t.scaler.get_scale() == scale / 2
        second = t.train_step()
        assert math.isfinite(second["grad_norm"])
        assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    finally:
        hook.remove()
        t.close()


def test_a_val_loss_measured_between_report_steps_still_gets_its_row(tmp_path):
    """Evaluations every 3 steps, reports every 4: each val loss gets a row of its own
    (forced), and the last step always has one."""
    run(tmp_path, max_steps=7, log_every=4, eval_every=3)
    rows = read_csv(tmp_path / "plots.csv")
    assert [(int(r["step"]), r["val_loss"] != "") for r in rows] == [(3, True), (4, False), (6, True), (7, True)]


def test_as_many_ranks_per_node_as_gpus_is_allowed(monkeypatch):
    """The boundary of the check above: one rank per GPU, every GPU used."""
    from pipeline.training import trainer as trainer_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(trainer_module, "resolve_precision", lambda *a: "bf16")
    resolved = []
    monkeypatch.setattr(trainer_module.attention, "resolve", lambda *a: resolved.append(a[1].type))
    c = parse_section(PretrainConfig, {"compute": {"device": "cuda"}, "launch": {"nproc_per_node": 2}}, "pretrain")
    trainer_module.check_compute(c)
    assert resolved == ["cuda"]


def test_a_global_batch_without_labelled_tokens_stops_in_one_line(tmp_path):
    """Rows whose labels are all masked leave nothing to normalise the loss by: a
    StageError naming the step, not a ZeroDivisionError traceback."""
    import numpy as np

    from pipeline.errors import StageError
    from pipeline.training.trainer import Trainer
    from tests.helpers import synthetic_docs, write_split

    docs = synthetic_docs(200, 64, seed=3)
    masked = [np.full(len(d), -100, dtype=np.int32) for d in docs]
    for split, part in (("train", slice(20, None)), ("val", slice(0, 20))):
        write_split(tmp_path / "sft" / split, docs[part], 32, masked[part])
    c = cfg(max_steps=4)
    t = Trainer("pretrain", c, c.model.build(64, 32), tmp_path / "sft" / "train", tmp_path / "sft" / "val",
                tmp_path / "models", tmp_path / "plots.csv", data_id="x")
    try:
        with pytest.raises(StageError, match=r"^step 1: no target tokens in the global batch$"):
            t.train_step()
    finally:
        t.close()


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


def test_fp16_clips_and_reports_the_unscaled_gradient(tmp_path):
    """Under fp16 the gradients are unscaled before their norm is taken and clipped:
    step 1's gradient norm is the fp32 run's (to fp16 rounding), not the loss scale's
    multiple (65536) of it, which clipping would then cut to grad_clip."""
    norms = {}
    for precision in ("fp32", "fp16"):
        t = trainer(tmp_path, precision, cfg(max_steps=4, precision=precision))
        try:
            norms[precision] = t.train_step()["grad_norm"]
        finally:
            t.close()
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=0.05)


@pytest.mark.slow
def test_compile_flag_trains_and_saves_uncompiled_names(tmp_path):
    # one layer: inductor's C++ compile on CPU is most of this test's time (48 -> 34 s from two layers)
    m = run(tmp_path, compile=True, max_steps=3, checkpoint_every=3, model={"preset": "tiny", "n_layer": 1})
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
    # nothing timed: the speed the curve recorded when the run trained, not nulls (and not 0)
    last = read_csv(tmp_path / "b" / "plots.csv")[-1]
    assert m["resumed_from_step"] == 12 and (m["tokens_per_s"], m["mfu"]) == (float(last["tokens_per_s"]),
                                                                             float(last["mfu"]))


# --------------------------------------------------------------------------- runs: continue, previous, best, init


def rows_of(path, cols=("step", "loss", "lr", "grad_norm")):
    """The CSV's numbers that depend on the computation only (not on timing), string-exact."""
    return [tuple(r[c] for c in cols) for r in read_csv(path)]


def count_steps(monkeypatch):
    from pipeline.training.trainer import Trainer

    calls = []
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: calls.append(self.step + 1) or original(self))
    return calls


def test_raising_max_steps_continues_the_run_without_repeating_a_step(tmp_path, monkeypatch, caplog):
    from pipeline.training.optimizer import lr_at

    run(tmp_path, max_steps=20, checkpoint_every=5)
    first = rows_of(tmp_path / "plots.csv")
    steps = count_steps(monkeypatch)
    with caplog.at_level("INFO", logger="pipeline.training"):
        m = run(tmp_path, max_steps=30, checkpoint_every=5)
    assert steps == list(range(21, 31))  # only the 10 new steps run
    assert m["resumed_from_step"] == 20 and m["steps"] == 30 and (m["moved_aside"], m["previous_runs"]) == (0, 0)
    rows = rows_of(tmp_path / "plots.csv")
    assert [int(r[0]) for r in rows] == list(range(1, 31)) and rows[:20] == first  # steps 1-20: the first run's rows
    # cosine: the schedule is recomputed for 30 steps, and the log says how the learning rate changed
    new = cfg(max_steps=30).schedule
    assert float(rows[20][2]) == lr_at(20, 1e-2, new) != lr_at(20, 1e-2, cfg(max_steps=20).schedule)
    [warning] = [r.getMessage() for r in caplog.records if "continuing the run" in r.getMessage()]
    assert "schedule.max_steps 20 -> 30, so 10 more step(s) run" in warning
    assert f"step 21 trains at lr {lr_at(20, 1e-2, new):.6g} (it was {1e-3:.6g} under max_steps 20)" in warning
    last = ckpt.latest(tmp_path / "models")
    assert last.step == 30 and last.meta["final"] and last.meta["schedule"]["max_steps"] == 30


WSD = {"kind": "wsd", "decay_fraction": 0.2, "warmup_steps": 2}  # 20 steps: decay over steps 17-20; 30: 25-30


def test_a_lengthened_wsd_run_goes_on_exactly_from_its_last_checkpoint_before_the_old_decay(tmp_path, caplog):
    """Raising max_steps of a finished wsd run: keep-last-K kept its checkpoint
    at the decay start (here keep 1), the run goes on from it and is the longer
    run bit for bit; its decayed checkpoints are kept under previous/ as a branch."""
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    run(tmp_path / "a", max_steps=30, **WSD)
    models = tmp_path / "b" / "models"
    run(tmp_path / "b", max_steps=20, keep_checkpoints=1, **WSD)
    assert [c.step for c in ckpt.complete_checkpoints(models)] == [16, 20]  # 16: the decay start, kept
    with caplog.at_level("WARNING", logger="pipeline.training"):
        m = run(tmp_path / "b", max_steps=30, keep_checkpoints=1, **WSD)
    assert m["resumed_from_step"] == 16 and m["moved_aside"] == 1
    assert rows_of(tmp_path / "b" / "plots.csv") == rows_of(tmp_path / "a" / "plots.csv")
    [branch] = (models / "previous").iterdir()
    assert [c.step for c in ckpt.complete_checkpoints(branch)] == [20] and ckpt.latest(branch).meta["final"]
    assert json.loads((branch / "run.json").read_text())["reason"].startswith(
        "schedule.max_steps was raised from 20 to 30, and these checkpoints lie in the old run's decay (steps 17-20)")
    assert f"moved aside to {branch}" in caplog.text


def test_a_lengthened_wsd_run_with_no_checkpoint_before_its_old_decay_goes_on_from_the_decayed_one(tmp_path, caplog):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    run(tmp_path / "a", max_steps=30, **WSD)
    uninterrupted = rows_of(tmp_path / "a" / "plots.csv")
    run(tmp_path / "b", max_steps=20, checkpoint_every=20, **WSD)  # its only checkpoint: step 20, decayed
    with caplog.at_level("WARNING", logger="pipeline.training"):
        assert run(tmp_path / "b", max_steps=30, **WSD)["resumed_from_step"] == 20
    continued = rows_of(tmp_path / "b" / "plots.csv")
    assert continued[:16] == uninterrupted[:16]  # up to the old decay start: the same steps, bit for bit
    assert all(c[2] < u[2] for c, u in zip(continued[16:20], uninterrupted[16:20]))  # 17-20 decayed in the 20-step run
    assert [c[2] for c in continued[20:]] == [u[2] for u in uninterrupted[20:]]  # 21-30: the 30-step schedule's lr
    assert continued[29][1] != uninterrupted[29][1]  # but from weights that had decayed: not the same run
    assert ("the run had started decaying: its checkpoint at step 20 lies inside the old decay phase (steps 17-20)"
            in caplog.text and "this run has none left" in caplog.text)


def test_a_wsd_run_continued_from_before_its_decay_equals_the_uninterrupted_longer_run(tmp_path):
    """What WSD promises: a 20-step run stopped at its decay start (here: its later
    checkpoints are gone, as after a kill) and lengthened to 30 steps is the
    30-step run, loss for loss and weight for weight."""
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    run(tmp_path / "a", max_steps=30, **WSD)
    run(tmp_path / "b", max_steps=20, checkpoint_every=4, **WSD)
    for c in ckpt.complete_checkpoints(tmp_path / "b" / "models"):
        if c.step > 16:
            ckpt.discard([c])
    assert run(tmp_path / "b", max_steps=30, **WSD)["resumed_from_step"] == 16
    assert rows_of(tmp_path / "b" / "plots.csv") == rows_of(tmp_path / "a" / "plots.csv")
    from safetensors.torch import load_file

    a, b = (load_file(str(ckpt.latest(tmp_path / x / "models").path / "model.safetensors")) for x in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_changed_lr_moves_the_old_run_to_previous_and_keep_previous_prunes(tmp_path, caplog):
    run(tmp_path, max_steps=8)
    with caplog.at_level("WARNING"):
        m = run(tmp_path, max_steps=8, lr=5e-3)
    assert m["resumed_from_step"] == 0 and (m["moved_aside"], m["previous_runs"]) == (1, 1)
    [aside] = (tmp_path / "models" / "previous").iterdir()
    assert [c.step for c in ckpt.complete_checkpoints(aside)] == [4, 8]
    info = json.loads((aside / "run.json").read_text())
    assert info["reason"] == "changed: optimizer.lr 0.01 -> 0.005" and "optimizer.lr 0.01 -> 0.005" in caplog.text
    assert ckpt.resolve(aside).meta["identity"]["optimizer"]["lr"] == 1e-2
    m = run(tmp_path, max_steps=8, lr=2e-3)
    assert (m["moved_aside"], m["previous_runs"]) == (1, 2)
    m = run(tmp_path, max_steps=8, lr=1e-3, keep_previous=1)  # only the newest previous run stays
    assert (m["moved_aside"], m["previous_runs"]) == (1, 1)
    [kept] = (tmp_path / "models" / "previous").iterdir()
    assert ckpt.resolve(kept).meta["identity"]["optimizer"]["lr"] == 2e-3
    assert f"deleting the earlier run {aside}" in caplog.text


def test_params_changed_back_take_the_earlier_run_back_from_previous_instead_of_training_again(tmp_path, caplog,
                                                                                                monkeypatch):
    first = run(tmp_path, max_steps=8)
    curve = read_csv(tmp_path / "plots.csv")
    run(tmp_path, max_steps=8, lr=5e-3)
    steps = count_steps(monkeypatch)
    with caplog.at_level("WARNING"):
        m = run(tmp_path, max_steps=8)  # lr back to the first run's
    assert steps == [] and m["resumed_from_step"] == 8 and (m["moved_aside"], m["previous_runs"]) == (1, 1)
    assert m["val_loss"] == first["val_loss"] and read_csv(tmp_path / "plots.csv") == curve  # its own curve, not lr 5e-3's
    [aside] = (tmp_path / "models" / "previous").iterdir()
    assert ckpt.resolve(aside).meta["identity"]["optimizer"]["lr"] == 5e-3 and (aside / "curve.csv").is_file()
    assert "its checkpoints (steps 4, 8) are moved back and the run goes on from step 8" in caplog.text
    # raised max_steps: the restored run goes on, as it would have without the detour
    m = run(tmp_path, max_steps=10, lr=5e-3)
    assert m["resumed_from_step"] == 8 and m["steps"] == 10


def test_lowering_max_steps_below_the_newest_checkpoint_starts_a_fresh_run(tmp_path, caplog):
    run(tmp_path, max_steps=12)
    with caplog.at_level("WARNING"):
        m = run(tmp_path, max_steps=8)
    assert m["resumed_from_step"] == 0 and m["steps"] == 8 and m["moved_aside"] == 1
    assert "schedule.max_steps was lowered to 8, below this run's newest checkpoint (step 12)" in caplog.text
    [aside] = (tmp_path / "models" / "previous").iterdir()
    assert [c.step for c in ckpt.complete_checkpoints(aside)] == [8, 12]
    assert ckpt.latest(tmp_path / "models").meta["schedule"]["max_steps"] == 8


def test_lowering_max_steps_to_the_newest_checkpoint_ends_the_run_there(tmp_path, monkeypatch):
    run(tmp_path, max_steps=12)
    ckpt.discard([ckpt.latest(tmp_path / "models")])  # as if killed between steps 8 and 12
    assert not ckpt.latest(tmp_path / "models").meta["final"]
    weights = (ckpt.latest(tmp_path / "models").path / "model.safetensors").read_bytes()
    steps = count_steps(monkeypatch)
    m = run(tmp_path, max_steps=8)
    assert steps == [] and m["resumed_from_step"] == 8 and m["moved_aside"] == 0
    last = ckpt.latest(tmp_path / "models")
    assert last.step == 8 and last.meta["final"] and (last.path / "model.safetensors").read_bytes() == weights


def test_keep_best_keeps_and_records_the_lowest_val_loss_checkpoint(tmp_path, monkeypatch):
    from pipeline.training.trainer import Trainer

    val = {4: 2.0, 8: 1.0, 12: 1.5, 16: 1.7, 20: 1.8, 24: 0.5, 28: 0.9}
    monkeypatch.setattr(Trainer, "evaluate", lambda self: val[self.step])
    m = run(tmp_path, max_steps=20, checkpoint_every=4, eval_every=100, keep_best=True)
    folder = tmp_path / "models"
    assert [c.step for c in ckpt.complete_checkpoints(folder)] == [8, 16, 20]  # the best besides the last 2
    assert json.loads((folder / "best.json").read_text())["step"] == 8 and (m["best_step"], m["best_val_loss"]) == (8, 1.0)
    best = ckpt.resolve(folder, which="best")
    assert best.step == 8 and best.meta["metrics"]["val_loss"] == 1.0 and best.meta["metrics"]["val_step"] == 8
    assert ckpt.resolve(folder, which="last").step == 20
    # a better one replaces it, and the old best goes the way of keep-last-K
    run(tmp_path, max_steps=28, checkpoint_every=4, eval_every=100, keep_best=True)
    assert [c.step for c in ckpt.complete_checkpoints(folder)] == [24, 28]
    assert ckpt.resolve(folder, which="best").step == 24
    # the best is verified like any checkpoint
    data = bytearray((folder / "step-00000024" / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "step-00000024" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="step-00000024/model.safetensors: sha256 differs"):
        ckpt.resolve(folder, which="best")
    with pytest.raises(ValueError, match="'first' is not one of last, best"):
        ckpt.resolve(folder, which="first")


def test_keep_best_measures_val_loss_at_each_checkpoint_without_changing_training(tmp_path):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    run(tmp_path / "a", max_steps=8, checkpoint_every=4, eval_every=100)
    run(tmp_path / "b", max_steps=8, checkpoint_every=4, eval_every=100, keep_best=True)
    a, b = read_csv(tmp_path / "a" / "plots.csv"), read_csv(tmp_path / "b" / "plots.csv")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[3]["val_loss"] == "" and b[3]["val_loss"] != ""  # step 4: evaluated only to rank the checkpoint
    assert ckpt.resolve(tmp_path / "a" / "models", which="last").step == 8
    with pytest.raises(ckpt.CheckpointError, match="best.json: missing, so no best checkpoint is recorded"):
        ckpt.resolve(tmp_path / "a" / "models", which="best")


def trainer(tmp_path, name, c=None, **kw):
    from pipeline.training.trainer import Trainer

    packed = tmp_path / "packed"
    if not packed.exists():
        write_packed(packed)
    c = c or cfg(max_steps=4)
    return Trainer("pretrain", c, c.model.build(64, 32), packed / "train", packed / "val", tmp_path / name / "models",
                   tmp_path / name / "plots.csv", data_id="x", **kw)


def fit(t):
    try:
        return t.fit()
    finally:
        t.close()


def test_warm_start_from_a_checkpoint_with_and_without_its_optimizer_moments(tmp_path):
    from safetensors.torch import load_file

    fit(trainer(tmp_path, "a", cfg(max_steps=8)))
    init = ckpt.resolve(tmp_path / "a" / "models")
    donor = load_file(str(init.path / "model.safetensors"))
    donor_opt = ckpt.load_state(init, "optimizer.pt")
    fresh, plain, moments = (trainer(tmp_path, "fresh"), trainer(tmp_path, "plain", init_from=init),
                             trainer(tmp_path, "moments", init_from=init, init_optimizer=True))
    try:
        for t in (plain, moments):
            assert all(torch.equal(t.model.state_dict()[k], v) for k, v in donor.items())
            assert t.step == 0 and t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 2)  # warmup step 1
        assert plain.optimizer.state_dict()["state"] == {}
        state = moments.optimizer.state_dict()["state"]
        assert all(torch.equal(state[i]["exp_avg"], donor_opt["state"][i]["exp_avg"]) for i in state)
        assert len({fresh.fingerprint, plain.fingerprint, moments.fingerprint}) == 3
        assert plain.identity["init"] == f"checkpoint:{init.meta['files']['model.safetensors']['sha256']}"
    finally:
        for t in (fresh, moments):
            t.close()
    m = fit(plain)
    assert m["resumed_from_step"] == 0 and m["steps"] == 4
    meta = ckpt.latest(tmp_path / "plain" / "models").meta
    assert meta["init"] == {"id": plain.identity["init"], "from": str(init.path), "optimizer": False}
    again = trainer(tmp_path, "plain", init_from=init)  # a rerun resumes; the init is not applied again
    assert again.step == 4 and fit(again)["resumed_from_step"] == 4


def test_init_optimizer_from_a_checkpoint_without_moments_says_they_start_at_zero(tmp_path, caplog):
    fit(trainer(tmp_path, "a", cfg(max_steps=0)))  # a pass-through: step 0, no optimizer step taken
    init = ckpt.resolve(tmp_path / "a" / "models")
    with caplog.at_level("INFO", logger="pipeline.training"):
        t = trainer(tmp_path, "b", init_from=init, init_optimizer=True)
    t.close()
    assert t.optimizer.state_dict()["state"] == {}
    assert f"init_optimizer: {init.path} holds no AdamW moments" in caplog.text
    assert f"initialised weights from {init.path} (step 0)" in caplog.text  # not "and AdamW moments" beside it
    caplog.clear()
    fit(trainer(tmp_path, "c", cfg(max_steps=3)))
    donor = ckpt.resolve(tmp_path / "c" / "models")
    with caplog.at_level("INFO", logger="pipeline.training"):
        trainer(tmp_path, "d", init_from=donor, init_optimizer=True).close()
    assert "holds no AdamW moments" not in caplog.text
    assert f"initialised weights and AdamW moments from {donor.path} (step 3)" in caplog.text


def test_warm_start_needs_the_same_model_and_consistent_options(tmp_path):
    from pipeline.training.trainer import InitError

    fit(trainer(tmp_path, "a", cfg(max_steps=3)))
    init = ckpt.resolve(tmp_path / "a" / "models")
    with pytest.raises(InitError, match=r"its model \(n_layer 2 vs 3\) differs from this run's"):
        trainer(tmp_path, "b", cfg(max_steps=3, model={"preset": "tiny", "n_layer": 3}), init_from=init)
    with pytest.raises(InitError, match="init_optimizer .* needs init_from"):
        trainer(tmp_path, "b", init_optimizer=True)
    with pytest.raises(InitError, match="init_weights and init_id go together"):
        trainer(tmp_path, "b", init_weights=lambda model: None)


def test_init_weights_hook_fills_a_fresh_run_and_its_id_enters_the_identity(tmp_path):
    calls = []

    def fill(model):
        calls.append(model)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01)

    t = trainer(tmp_path, "a", init_weights=fill, init_id="hf:abc")
    assert calls == [t.model] and all(torch.all(p == 0.01) for p in t.model.parameters())
    assert t.identity["init"] == "hf:abc"
    other = trainer(tmp_path, "b", init_weights=fill, init_id="hf:def")
    assert other.fingerprint != t.fingerprint
    other.close()
    fit(t)
    assert fit(trainer(tmp_path, "a", init_weights=fill, init_id="hf:abc"))["resumed_from_step"] == 4
    assert len(calls) == 2  # the resumed run did not call it


def test_max_steps_0_passes_the_initial_weights_through_as_a_final_checkpoint(tmp_path, monkeypatch):
    """The Trainer passes whatever it starts from through (pretrain itself refuses
    max_steps 0 without init_from: tests/pipeline/training/test_pretrain.py)."""
    from safetensors.torch import load_file

    steps = count_steps(monkeypatch)
    m = fit(trainer(tmp_path, "a", cfg(max_steps=0)))
    assert steps == [] and m["steps"] == 0 and math.isfinite(m["val_loss"]) and m["final_loss"] is None
    [c] = ckpt.complete_checkpoints(tmp_path / "a" / "models")
    assert c.step == 0 and c.meta["final"] and c.meta["metrics"]["val_loss"] == m["val_loss"]
    torch.manual_seed(cfg().seed)
    initial = Transformer(cfg().model.build(64, 32)).state_dict()
    saved = load_file(str(c.path / "model.safetensors"))
    assert all(torch.equal(initial[k], v) for k, v in saved.items())
    before = c.path.stat().st_ino
    assert fit(trainer(tmp_path, "a", cfg(max_steps=0)))["resumed_from_step"] == 0
    assert ckpt.latest(tmp_path / "a" / "models").path.stat().st_ino == before  # a rerun finds it final: not rewritten
    # with a warm start, max_steps 0 passes the starting checkpoint's weights through
    init = ckpt.resolve(tmp_path / "a" / "models")
    fit(trainer(tmp_path, "b", cfg(max_steps=0, lr=5e-3), init_weights=lambda model: ckpt.load_model_weights(init, model),
                init_id="x"))
    out = load_file(str(ckpt.latest(tmp_path / "b" / "models").path / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in out.items())


def test_warm_start_from_a_checkpoint_that_its_own_run_folder_moves_aside_and_prunes(tmp_path):
    """init_from may name a checkpoint in the run folder itself: the new run (another
    identity) moves it to previous/ and, with keep_previous 0, deletes it; the
    weights are read before the folder is rearranged."""
    from safetensors.torch import load_file

    fit(trainer(tmp_path, "a", cfg(max_steps=4)))
    init = ckpt.resolve(tmp_path / "a" / "models")
    donor = load_file(str(init.path / "model.safetensors"))
    t = trainer(tmp_path, "a", cfg(max_steps=4, keep_previous=0), init_from=init)
    try:
        assert not init.path.exists() and t.step == 0
        assert all(torch.equal(t.model.state_dict()[k], v) for k, v in donor.items())
    finally:
        t.close()


# --------------------------------------------------------------------------- FSDP on one rank (2 ranks: tests/stages)


def losses_and_norms(path):
    return [(r["loss"], r["grad_norm"]) for r in read_csv(path / "plots.csv")]


def test_fsdp_on_one_rank_trains_like_ddp_and_writes_sharded_checkpoints(tmp_path):
    """A mesh of one rank is a plain run: the same losses and gradient norms
    (string-exact, through gradient accumulation and clipping), the same final
    weights, written as a sharded checkpoint."""
    (tmp_path / "ddp").mkdir(); (tmp_path / "fsdp").mkdir()
    run(tmp_path / "ddp", max_steps=6, grad_accum_steps=2, micro_batch_size=2, grad_clip=0.5)
    run(tmp_path / "fsdp", max_steps=6, grad_accum_steps=2, micro_batch_size=2, grad_clip=0.5, parallelism="fsdp")
    assert losses_and_norms(tmp_path / "fsdp") == losses_and_norms(tmp_path / "ddp")
    assert any(float(n) > 0.5 for _, n in losses_and_norms(tmp_path / "ddp"))  # clipping took effect
    a, b = ckpt.latest(tmp_path / "ddp" / "models"), ckpt.latest(tmp_path / "fsdp" / "models")
    assert not ckpt.is_sharded(a) and ckpt.is_sharded(b) and b.meta["world_size"] == 1
    ma, mb = Transformer(ckpt_model(a)), Transformer(ckpt_model(b))
    ckpt.load_model_weights(a, ma)
    ckpt.load_model_weights(b, mb)
    for k, v in ma.state_dict().items():
        assert torch.equal(mb.state_dict()[k], v), k


def test_fsdp_keeps_gradients_sharded_between_micro_batches(tmp_path, monkeypatch):
    """Under FSDP each micro-batch's gradients are reduce-scattered into this
    rank's shards as its backward ends, so the second micro-batch starts with
    sharded gradients in place; skipping the reduction until the last one (no_sync)
    keeps the whole model's unsharded gradients instead, none in the shards."""
    from pipeline.training.trainer import Trainer

    seen = []
    loss_sum = Trainer._loss_sum

    def spy(self, batch):
        grads = [p.grad for p in self.model.parameters()]
        seen.append((sum(g is not None for g in grads), len(grads),
                     all(type(g).__name__ == "DTensor" for g in grads if g is not None)))
        return loss_sum(self, batch)

    monkeypatch.setattr(Trainer, "_loss_sum", spy)
    fit(trainer(tmp_path, "fsdp", cfg(max_steps=3, grad_accum_steps=3, micro_batch_size=2, parallelism="fsdp")))
    n = seen[0][1]
    assert seen[:3] == [(0, n, True), (n, n, True), (n, n, True)]


@pytest.mark.parametrize("first, then", [("fsdp", "fsdp"), ("fsdp", "ddp"), ("ddp", "fsdp")])
def test_a_run_resumes_bit_for_bit_across_parallelism(tmp_path, first, then):
    """parallelism is not part of the run identity: a run checkpointed under one
    resumes under the other (the checkpoint is resharded or gathered), exactly."""
    (tmp_path / "ref").mkdir(); (tmp_path / "run").mkdir()
    run(tmp_path / "ref", max_steps=12)
    run(tmp_path / "run", max_steps=12, parallelism=first)
    for c in ckpt.complete_checkpoints(tmp_path / "run" / "models"):
        if c.step > 8:
            ckpt.discard([c])  # as if killed after step 8
    m = run(tmp_path / "run", max_steps=12, parallelism=then)
    assert m["resumed_from_step"] == 8
    assert losses_and_norms(tmp_path / "run") == losses_and_norms(tmp_path / "ref")
    assert ckpt.is_sharded(ckpt.latest(tmp_path / "run" / "models")) == (then == "fsdp")


def test_warm_start_with_adamw_moments_across_parallelism(tmp_path):
    """init_from + init_optimizer from either layout into either parallelism
    gives the same run."""
    fit(trainer(tmp_path, "ddp", cfg(max_steps=8)))
    fit(trainer(tmp_path, "fsdp", cfg(max_steps=8, parallelism="fsdp")))
    sources = {p: ckpt.resolve(tmp_path / p / "models") for p in ("ddp", "fsdp")}
    assert ckpt.is_sharded(sources["fsdp"]) and not ckpt.is_sharded(sources["ddp"])
    curves = {}
    for src in ("ddp", "fsdp"):
        for into in ("ddp", "fsdp"):
            name = f"{src}-into-{into}"
            fit(trainer(tmp_path, name, cfg(max_steps=4, parallelism=into), init_from=sources[src],
                        init_optimizer=True))
            curves[name] = losses_and_norms(tmp_path / name)
    fit(trainer(tmp_path, "no-moments", cfg(max_steps=4), init_from=sources["ddp"]))
    assert len({tuple(c) for c in curves.values()}) == 1, curves
    assert losses_and_norms(tmp_path / "no-moments") != curves["ddp-into-ddp"]  # the moments made a difference


def test_fsdp_refuses_fp16_in_one_line(tmp_path):
    from pipeline.training.parallelize import ParallelismError

    with pytest.raises(ParallelismError, match="fsdp trains in bf16 or fp32, not fp16"):
        run(tmp_path, precision="fp16", parallelism="fsdp")


def test_fsdp_composes_with_activation_checkpointing(tmp_path):
    (tmp_path / "ddp").mkdir(); (tmp_path / "fsdp").mkdir()
    run(tmp_path / "ddp", max_steps=3, activation_checkpointing=True)
    run(tmp_path / "fsdp", max_steps=3, activation_checkpointing=True, parallelism="fsdp")
    assert losses_and_norms(tmp_path / "fsdp") == losses_and_norms(tmp_path / "ddp")


@pytest.mark.slow
def test_fsdp_composes_with_compile_and_activation_checkpointing(tmp_path):
    """Each block compiled and checkpointed, then sharded: the eager run's losses
    (compiled kernels round differently, hence the tolerance)."""
    (tmp_path / "eager").mkdir(); (tmp_path / "fsdp").mkdir()
    run(tmp_path / "eager", max_steps=3)
    run(tmp_path / "fsdp", max_steps=3, parallelism="fsdp", compile=True, activation_checkpointing=True)
    eager, fsdp = losses_and_norms(tmp_path / "eager"), losses_and_norms(tmp_path / "fsdp")
    assert [float(x) for row in fsdp for x in row] == pytest.approx([float(x) for row in eager for x in row], rel=1e-5)


def test_mlflow_ties_a_continued_run_and_a_warm_start_to_the_runs_they_come_from(tmp_path, monkeypatch):
    """A run that goes on from a checkpoint (lengthened here; killed and rerun
    alike) is a new MLflow run, tagged with the run that wrote that checkpoint
    and its step; a run started from a checkpoint of ours (init_from) is tagged
    with the run that wrote it. The checkpoint's meta records its run."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for key, value in {"PIPELINE_TRACKING": "1", "MLFLOW_TRACKING_URI": uri,
                       "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "0"}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "a").mkdir()
    run(tmp_path / "a", max_steps=4, checkpoint_every=2, track=True)
    run(tmp_path / "a", max_steps=6, checkpoint_every=2, track=True)
    last = ckpt.latest(tmp_path / "a" / "models")
    (tmp_path / "b").mkdir()
    run(tmp_path / "b", max_steps=3, track=True, init_from=str(last.path))
    client = mlflow.MlflowClient(uri)
    first, continued, warm = sorted(client.search_runs([e.experiment_id for e in client.search_experiments()]),
                                    key=lambda r: r.info.start_time)
    assert "pipeline.resumed_from_run_id" not in first.data.tags
    assert continued.data.tags["pipeline.resumed_from_run_id"] == first.info.run_id
    assert continued.data.tags["pipeline.resumed_from_step"] == "4"
    assert last.meta["mlflow_run_id"] == continued.info.run_id
    assert warm.data.tags["pipeline.init_from_run_id"] == continued.info.run_id
    assert "pipeline.resumed_from_run_id" not in warm.data.tags


def test_a_run_resumes_in_fp16_from_a_checkpoint_trained_in_another_precision(tmp_path, caplog):
    """compute is outside the run identity: an fp32 (or bf16) run's checkpoint,
    whose loss scaler was disabled and saved empty, resumes under fp16 with a
    fresh loss scale (torch refuses to load the empty state into an enabled one)."""
    run(tmp_path, max_steps=4, precision="fp32")
    with caplog.at_level("INFO", logger="pipeline.training"):
        m = run(tmp_path, max_steps=8, precision="fp16")
    assert m["resumed_from_step"] == 4 and math.isfinite(m["final_loss"])
    assert "the loss scale starts afresh" in caplog.text



def test_ranks_other_than_the_launch_params_say_are_warned_about(tmp_path, caplog):
    """torchrun run by hand with another --nproc_per_node than launch.nproc_per_node:
    the run goes on with the ranks that run, and says what that changes."""
    with caplog.at_level("WARNING", logger="pipeline.training"):
        run(tmp_path, max_steps=4, nproc_per_node=2)
    assert "1 rank(s) run, but launch.nproc_per_node x launch.nnodes is 2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.training"):
        run(tmp_path, max_steps=4)
    assert "rank(s) run, but" not in caplog.text


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_ranks_per_node_than_gpus_is_refused_before_any_rank_starts(monkeypatch, device):
    """Ranks beyond the GPUs shared a GPU (local_rank % device_count), which NCCL refuses
    only after every rank has started; here the launcher says so in one line."""
    from pipeline.training.distributed import DeviceError
    from pipeline.training.trainer import check_compute

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    c = parse_section(PretrainConfig, {"compute": {"device": device}, "launch": {"nproc_per_node": 4}}, "pretrain")
    with pytest.raises(DeviceError, match=r"launch.nproc_per_node is 4, but this machine has 2 CUDA GPU\(s\): one "
                                          r"rank per GPU; set launch.nproc_per_node to 2 or fewer"):
        check_compute(c)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_micro_batch_auto_probes_the_model_as_it_trains_with_room_for_adamw(tmp_path, monkeypatch, parallelism):
    """On CUDA, ``micro_batch_size: auto`` tries forward and backward passes: on the
    model with activation checkpointing applied (it is what lets a larger
    micro-batch fit), and while holding the bytes AdamW's moments take from the
    first step on, which a pass alone never allocates (a micro-batch that fits
    only without them runs out of memory at the first optimizer step). The CUDA
    probe is forced on the CPU here, and runs out of "memory" above 2 rows."""
    import functools

    from pipeline.training import memory
    from pipeline.training.trainer import Trainer

    monkeypatch.setattr(memory, "probes", lambda device: True)
    held, passes = [], []
    real_hold, real_step = memory.hold, Trainer._probe_step
    monkeypatch.setattr(memory, "hold", lambda nbytes, device: held.append(nbytes) or real_hold(nbytes, device))

    def probe_step(self, micro):
        passes.append((micro, all(isinstance(b.forward, functools.partial) for b in self.model.layers)))
        if micro > 2:
            raise torch.cuda.OutOfMemoryError("out of memory (simulated)")
        real_step(self, micro)

    monkeypatch.setattr(Trainer, "_probe_step", probe_step)
    run(tmp_path, micro_batch_size="auto", activation_checkpointing=True, parallelism=parallelism, max_steps=2,
        warmup_steps=1, eval_rows=2)
    model = Transformer(ckpt_model(ckpt.latest(tmp_path / "models")))
    assert passes and all(checkpointed for _, checkpointed in passes)
    assert passes[-1][0] == 2 and held == [memory.optimizer_state_bytes(model)]
    assert held[0] == 2 * 4 * sum(p.numel() for p in model.parameters())  # one rank: no shards
    # the checkpoint is loaded after the probe, which the data order waits for
    again = run(tmp_path, micro_batch_size="auto", activation_checkpointing=True, parallelism=parallelism,
                max_steps=3, warmup_steps=1, eval_rows=2)
    assert again["resumed_from_step"] == 2 and again["steps"] == 3


def test_the_probes_reserve_is_what_adamw_allocates_at_its_first_step():
    from pipeline.training import memory
    from pipeline.training.config import OptimizerSection
    from pipeline.training.optimizer import build_optimizer
    from pipeline.model.transformer import build_config

    model = Transformer(build_config("tiny", 97))
    opt = build_optimizer(model, OptimizerSection(), torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    allocated = sum(t.numel() * t.element_size() for state in opt.state.values() for k, t in state.items()
                    if k != "step")
    assert memory.optimizer_state_bytes(model) == allocated


def test_fsdp_stays_sharded_after_a_probe_runs_out_of_memory_mid_backward(tmp_path, monkeypatch):
    """A CUDA out-of-memory error inside a probe's backward pass leaves FSDP2's
    parameters gathered and its hooks pending: unless reset, the model trains
    on full, unsynchronised parameters from then on. Forced on the CPU (one
    rank), with the error raised from inside the backward pass above 2 rows."""
    from torch.distributed.tensor import DTensor

    from pipeline.training import memory
    from pipeline.training.trainer import Trainer

    monkeypatch.setattr(memory, "probes", lambda device: True)
    real_step, after = Trainer._probe_step, []

    def oom_in_backward(grad):
        raise torch.cuda.OutOfMemoryError("out of memory (simulated)")

    def fail_in_backward(module, args, out):
        out.register_hook(oom_in_backward)

    def probe_step(self, micro):
        hook = self.model.output.register_forward_hook(fail_in_backward if micro > 2 else lambda *a: None)
        try:
            real_step(self, micro)
        finally:
            hook.remove()
            after.append(all(isinstance(p, DTensor) for p in self.model.parameters()))

    monkeypatch.setattr(Trainer, "_probe_step", probe_step)
    m = run(tmp_path, micro_batch_size="auto", parallelism="fsdp", max_steps=2, warmup_steps=1, eval_rows=2)
    assert after == [True] * 4  # 16, 8 and 4 rows failed, then 2 fit
    assert ckpt.is_sharded(ckpt.latest(tmp_path / "models")) and math.isfinite(m["final_loss"])
