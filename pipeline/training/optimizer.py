"""AdamW with decay on linear weights only, and the warmup-cosine schedule."""

from __future__ import annotations

import math
from typing import Any

import torch

from pipeline.training.config import OptimizerSection, ScheduleSection


def lr_at(step: int, peak: float, schedule: ScheduleSection) -> float:
    """Linear warmup to ``peak``, then cosine decay to the ``min_lr`` floor at
    ``max_steps``. ``step`` counts optimizer steps from 0."""
    if step < schedule.warmup_steps:
        return peak * (step + 1) / schedule.warmup_steps
    progress = (step - schedule.warmup_steps) / max(1, schedule.max_steps - schedule.warmup_steps)
    return schedule.min_lr + 0.5 * (peak - schedule.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


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
