"""The token loss: one definition for training, validation and evaluation.

The model returns logits; every caller scores them here. The loss is a *sum*
over positions whose target is not ``IGNORE_INDEX`` (the packed-row format's
no-loss label: padding, SFT prompt tokens), computed in fp32 whatever the autocast dtype, so that callers can
normalise by the token count they need (a rank's micro-batch, the global batch,
a whole val split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.data.shards import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def scored_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many positions of ``targets`` count towards the loss."""
    return (targets != IGNORE_INDEX).sum()
