"""Wrapping the model for training, from the outside: the attention backend,
activation checkpointing, torch.compile and DDP. The model's own code knows nothing of any of them, and
its parameter names (hence checkpoints) are the same with or without them."""

from __future__ import annotations

import functools

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from pipeline.model import attention
from pipeline.model.transformer import Transformer
from pipeline.training.config import ComputeSection
from pipeline.training.distributed import Dist


def enable_activation_checkpointing(model: Transformer) -> None:
    """Recompute each block in backward instead of storing its activations.
    Patches ``forward`` so parameter names (and checkpoints) are unchanged."""
    for block in model.layers:
        inner = block.forward
        block.forward = functools.partial(activation_checkpoint, inner, use_reentrant=False)


def parallelize(model: Transformer, cfg: ComputeSection, d: Dist, precision: str = "fp32") -> torch.nn.Module:
    """Set the attention backend, apply activation checkpointing, compile and DDP
    as configured; return the module to call in the training loop (``model``
    itself keeps the weights). ``precision`` is the resolved one (bf16, fp16,
    fp32): varlen needs half precision. Raises AttentionBackendError (one line)
    for a backend that cannot train on this device."""
    attention.use_backend(model, attention.resolve(cfg.attention, d.device, precision))
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    wrapped: torch.nn.Module = model
    if cfg.compile:
        wrapped = torch.compile(model)
    if d.world_size > 1:
        wrapped = DDP(wrapped, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    return wrapped
