"""AdamW with decay on linear weights only, and the learning-rate schedules.

A schedule is a pure function of the (0-based) optimizer step, so a run that is
lengthened (``schedule.max_steps`` raised) can recompute it for the new length
at any step; :func:`set_schedule_lr` puts that value into the optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from pipeline.training.config import OptimizerSection, ScheduleSection


def _cosine(step: int, peak: float, schedule: ScheduleSection) -> float:
    progress = (step - schedule.warmup_steps) / max(1, schedule.max_steps - schedule.warmup_steps)
    return schedule.min_lr + 0.5 * (peak - schedule.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


# WSD decay shapes: the share of (peak - min_lr) left after a fraction p in (0, 1] of the decay
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),  # Hägele et al. 2024: stays high longer, then drops
}


def _wsd(step: int, peak: float, schedule: ScheduleSection) -> float:
    start = schedule.decay_start()
    if step < start:
        return peak
    # the decay's n steps are start .. max_steps-1; the last of them trains at min_lr exactly
    p = min(1.0, (step - start + 1) / schedule.decay_length())
    return schedule.min_lr + (peak - schedule.min_lr) * DECAY_SHAPES[schedule.decay_shape](p)


# schedule.kind -> the learning rate after warmup
SCHEDULES: dict[str, Callable[[int, float, ScheduleSection], float]] = {"cosine": _cosine, "wsd": _wsd}


def lr_at(step: int, peak: float, schedule: ScheduleSection) -> float:
    """The learning rate of optimizer step ``step`` (counted from 0): linear
    warmup to ``peak`` over ``warmup_steps``, then the ``schedule.kind`` shape.

    cosine: decays to the ``min_lr`` floor at ``max_steps``. wsd: stays at
    ``peak`` until :meth:`ScheduleSection.decay_start`, then decays to
    ``min_lr`` over the last ``decay_length()`` steps; every step before the
    decay start has the same value whatever ``max_steps`` is."""
    if step < schedule.warmup_steps:
        return peak * (step + 1) / schedule.warmup_steps
    return SCHEDULES[schedule.kind](step, peak, schedule)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only matrices of linear layers; norms, biases and embeddings are exempt
    (decaying them shrinks scales and rare-token rows for no regularisation gain)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerSection, device: torch.device) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # fused kernel missing for this device/dtype
        return torch.optim.AdamW(groups, foreach=device.type != "cpu", **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, peak: float, schedule: ScheduleSection
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, peak, schedule) / peak)


def set_schedule_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[float]:
    """After ``scheduler.load_state_dict``: set each param group's learning rate
    to this scheduler's value at its step, computed as LambdaLR computes it.

    The optimizer state restored beside it holds the rate of the schedule the
    checkpoint was written under; when the schedule changed (a lengthened run)
    the new one must win. When it did not change, the value is the same float,
    so an exact resume stays exact. Returns the rates that were replaced."""
    groups = scheduler.optimizer.param_groups
    before = [float(group["lr"]) for group in groups]
    for group, base, fn in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        lr = base * fn(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # a tensor lr is updated in place, as LambdaLR does
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in groups]
    return before


def load_moments(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Warm start: load another run's AdamW state (first and second moments, and
    the per-parameter step counts their bias correction goes with) into
    ``optimizer``, keeping this run's hyperparameters (lr, betas, eps, weight
    decay, the scheduler's ``initial_lr``). The param groups must match: the
    same model, grouped by :func:`param_groups`."""
    keep = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, keep, strict=True):
        group.update(settings)
