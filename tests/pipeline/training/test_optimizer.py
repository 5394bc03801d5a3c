"""pipeline/training/optimizer.py: AdamW's parameter groups and the learning-rate
schedules (cosine, warmup-stable-decay), including what a lengthened run keeps."""

import math

import pytest
import torch

from pipeline.model.transformer import Transformer, build_config
from pipeline.training.config import OptimizerSection, ScheduleSection
from pipeline.training.optimizer import build_optimizer, build_scheduler, load_moments, lr_at, param_groups, set_schedule_lr


def wsd(**kw):
    return ScheduleSection(**{"kind": "wsd", "warmup_steps": 10, "max_steps": 100, "min_lr": 0.1, **kw})


def test_lr_schedule_warmup_cosine_floor():
    c = ScheduleSection(min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, 1.0, c) == pytest.approx(0.1) and lr_at(9, 1.0, c) == pytest.approx(1.0)
    assert lr_at(60, 1.0, c) == pytest.approx(0.55)
    assert lr_at(110, 1.0, c) == pytest.approx(0.1) and lr_at(500, 1.0, c) == pytest.approx(0.1)
    assert all(lr_at(s, 1.0, c) >= lr_at(s + 1, 1.0, c) for s in range(10, 120))


def test_no_weight_decay_on_norms_and_embeddings():
    model = Transformer(build_config("tiny", 64))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] or "embeddings" in names[id(p)] for p in no_decay["params"])
    assert any("wq" in names[id(p)] for p in decay["params"])
    assert not any("embeddings" in names[id(p)] or "norm" in names[id(p)] for p in decay["params"])


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_to_min_lr_at_the_last_step():
    s = wsd(decay_fraction=0.2)
    assert (s.decay_length(), s.decay_start()) == (20, 80)
    cosine = ScheduleSection(warmup_steps=10, max_steps=100, min_lr=0.1)
    assert [lr_at(i, 1.0, s) for i in range(10)] == [lr_at(i, 1.0, cosine) for i in range(10)]  # the same warmup
    assert all(lr_at(i, 1.0, s) == 1.0 for i in range(9, 80))  # stable at the peak up to the decay start
    assert lr_at(80, 1.0, s) == pytest.approx(0.1 + 0.9 * (1 - 1 / 20))  # the first decay step is below the peak
    assert lr_at(89, 1.0, s) == pytest.approx(0.55)  # halfway down
    assert lr_at(99, 1.0, s) == pytest.approx(0.1) and lr_at(150, 1.0, s) == pytest.approx(0.1)  # the last step: min_lr
    assert all(lr_at(i, 1.0, s) > lr_at(i + 1, 1.0, s) for i in range(79, 99))


def test_wsd_decay_steps_override_the_fraction():
    s = wsd(decay_fraction=0.2, decay_steps=30)
    assert (s.decay_length(), s.decay_start()) == (30, 70)
    assert lr_at(69, 1.0, s) == 1.0 and lr_at(70, 1.0, s) < 1.0 and lr_at(99, 1.0, s) == pytest.approx(0.1)


def test_wsd_1_sqrt_decay_shape():
    s = wsd(decay_steps=16, decay_shape="1-sqrt")
    for k in range(16):  # step 84 + k is the (k+1)-th of 16 decay steps
        p = (k + 1) / 16
        assert lr_at(84 + k, 1.0, s) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(p)))
    assert lr_at(87, 1.0, s) == pytest.approx(0.1 + 0.9 * 0.5)  # p = 1/4: half the way down already
    assert lr_at(87, 1.0, s) < lr_at(87, 1.0, wsd(decay_steps=16))  # 1-sqrt drops faster early than linear


@pytest.mark.parametrize("extra", [{"decay_fraction": 0.2}, {"decay_steps": 4}, {"decay_fraction": 0.25, "decay_shape": "1-sqrt"}])
def test_a_lengthened_wsd_run_keeps_every_learning_rate_before_the_old_decay_start(extra):
    old = wsd(max_steps=20, warmup_steps=2, **extra)
    new = old.model_copy(update={"max_steps": 30})
    start = old.decay_start()
    assert start < new.decay_start()
    assert [lr_at(i, 3e-3, new) for i in range(start)] == [lr_at(i, 3e-3, old) for i in range(start)]  # exactly
    assert lr_at(start, 3e-3, new) != lr_at(start, 3e-3, old)  # the old decay is not part of the longer run
    # under cosine every step after warmup changes
    cos_old = ScheduleSection(max_steps=20, warmup_steps=2, min_lr=1e-4)
    cos_new = cos_old.model_copy(update={"max_steps": 30})
    assert all(lr_at(i, 3e-3, cos_new) != lr_at(i, 3e-3, cos_old) for i in range(3, 20))


def scheduler_at(schedule, steps, peak=1e-2):
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimizerSection(lr=peak), torch.device("cpu"))
    sched = build_scheduler(opt, peak, schedule)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt, sched


def test_set_schedule_lr_puts_the_new_schedules_value_in_the_optimizer():
    old = ScheduleSection(max_steps=20, warmup_steps=2, min_lr=1e-4)
    new = old.model_copy(update={"max_steps": 30})
    opt, sched = scheduler_at(old, 12)
    state_opt, state_sched = opt.state_dict(), sched.state_dict()
    # the same schedule: the very same float, so an exact resume stays exact
    opt2, sched2 = scheduler_at(old, 0)
    opt2.load_state_dict(state_opt); sched2.load_state_dict(state_sched)
    assert set_schedule_lr(sched2) == [opt.param_groups[0]["lr"]] * 2
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    # a longer schedule: the value of the new schedule at the same step
    opt3, sched3 = scheduler_at(new, 0)
    opt3.load_state_dict(state_opt); sched3.load_state_dict(state_sched)
    assert opt3.param_groups[0]["lr"] == lr_at(12, 1e-2, old)  # what the checkpoint holds
    set_schedule_lr(sched3)
    assert opt3.param_groups[0]["lr"] == pytest.approx(lr_at(12, 1e-2, new)) and sched3.get_last_lr()[0] == opt3.param_groups[0]["lr"]
    opt3.step(); sched3.step()
    assert opt3.param_groups[0]["lr"] == pytest.approx(lr_at(13, 1e-2, new))


def test_load_moments_keeps_this_runs_hyperparameters():
    model = torch.nn.Linear(4, 4)
    donor = build_optimizer(model, OptimizerSection(lr=1.0, beta1=0.5, weight_decay=0.3), torch.device("cpu"))
    model(torch.randn(2, 4)).sum().backward()
    donor.step()
    opt = build_optimizer(model, OptimizerSection(lr=1e-3), torch.device("cpu"))
    build_scheduler(opt, 1e-3, ScheduleSection(max_steps=10, warmup_steps=2))
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    load_moments(opt, donor.state_dict())
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == settings
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg"], donor.state[p]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], donor.state[p]["exp_avg_sq"])


def test_build_optimizer_takes_its_settings_from_the_config_and_decays_linear_weights_only():
    """lr, betas, eps and weight_decay come from ``optimizer:``; one AdamW step
    with zero gradients (no Adam update) shrinks a linear weight by exactly
    lr × weight_decay and leaves biases and embeddings as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 3))
    cfg = OptimizerSection(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.25)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    settings = ("lr", "betas", "eps", "weight_decay")
    assert [decay[k] for k in settings] == [0.01, (0.8, 0.99), 1e-6, 0.25]
    assert [no_decay[k] for k in settings] == [0.01, (0.8, 0.99), 1e-6, 0.0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["1.weight"].detach(), before["1.weight"] * (1 - 0.01 * 0.25), rtol=0, atol=1e-7)
    assert torch.equal(after["1.bias"].detach(), before["1.bias"])
    assert torch.equal(after["0.weight"].detach(), before["0.weight"])


def test_set_schedule_lr_updates_a_tensor_lr_in_place():
    """A tensor lr (capturable and compiled optimizers hold one) is filled in
    place, as LambdaLR does, so that whatever holds that tensor sees the value."""
    old = ScheduleSection(max_steps=20, warmup_steps=2, min_lr=1e-4)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    sched = build_scheduler(opt, 1e-2, old)
    sched.last_epoch = 12  # as load_state_dict leaves it
    held = opt.param_groups[0]["lr"]
    set_schedule_lr(sched)
    assert opt.param_groups[0]["lr"] is held and float(held) == pytest.approx(lr_at(12, 1e-2, old))
