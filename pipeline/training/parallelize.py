"""Wrapping the model for training, from the outside: the attention backend,
activation checkpointing, torch.compile, and DDP or FSDP2. The model's own code
knows nothing of any of them, and its parameter names (hence checkpoints) are
the same with or without them.

``compute.parallelism: fsdp`` shards with FSDP2 (``fully_shard``) over a 1-D
device mesh of all ranks: each transformer block is its own unit (its weights
are gathered just before its forward and backward and freed after), then the
root takes what is left (embeddings, final norm, the tied head). On CUDA in
bf16 the gathered weights are bf16 and gradients are reduced in fp32
(MixedPrecisionPolicy); the sharded master weights and AdamW state stay fp32.
autocast still runs around the forward as with DDP, so the ops it keeps in fp32
(softmax, norms, the loss) stay there. Unlike DDP, the residual stream between
blocks is bf16 too (the embedding is gathered in bf16, and each block's inputs
are cast to it), as in torchtitan; so DDP and FSDP in bf16 agree closely, not
exactly (a tiny model's first loss: 3.42793 under DDP, 3.42817 under FSDP, on
CPU with the CUDA policy). Activation checkpointing and compile are
applied per block before sharding, as torchtitan does. On CPU (gloo) FSDP runs
in fp32 parameters with autocast alone, which is what the tests use."""

from __future__ import annotations

import functools

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from pipeline.errors import StageError
from pipeline.model import attention
from pipeline.model.transformer import Transformer
from pipeline.training.config import ComputeSection
from pipeline.training.distributed import Dist, pick_device
from pipeline.training.precision import resolve_precision


class ParallelismError(StageError):
    """A parallelism setting this run cannot use (one line)."""


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
    if cfg.parallelism == "fsdp":
        return shard(model, cfg, d, precision)
    wrapped: torch.nn.Module = model
    if cfg.compile:
        wrapped = torch.compile(model)
    if d.world_size > 1:
        wrapped = DDP(wrapped, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    return wrapped


def check_fsdp(d: Dist, precision: str) -> None:
    """Raise ParallelismError (one line) when FSDP cannot run here: in every
    rank, a backstop to :func:`check_parallelism` in the launcher."""
    if not d.enabled:
        raise ParallelismError("compute.parallelism fsdp needs a process group (torchrun, or "
                               "distributed.init(need_group=True) in one process)")
    _check_fsdp_precision(precision)


def check_parallelism(cfg: ComputeSection) -> None:
    """Launcher side, before any rank starts: with ``parallelism: fsdp``, the
    precision the device this machine gives a rank resolves to (``auto`` is fp16
    on a GPU without bf16), as every rank's :func:`check_fsdp` resolves it again.
    Raises ParallelismError, or DeviceError for a device this machine lacks
    (one line each)."""
    if cfg.parallelism == "fsdp":
        _check_fsdp_precision(resolve_precision(cfg.precision, pick_device(cfg.device)))


def _check_fsdp_precision(precision: str) -> None:
    if precision == "fp16":
        raise ParallelismError("compute.parallelism fsdp trains in bf16 or fp32, not fp16 (its gradient scaler "
                               "does not apply to sharded gradients); set compute.precision to bf16 or fp32")


def mixed_precision(d: Dist, precision: str) -> "MixedPrecisionPolicy":  # noqa: F821
    """bf16 weights for compute with fp32 gradient reduction on CUDA in bf16;
    otherwise parameters stay in their own dtype (fp32) and autocast decides."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP's modules load only for FSDP runs

    if d.device.type == "cuda" and precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: Transformer, cfg: ComputeSection, d: Dist, precision: str) -> torch.nn.Module:
    """FSDP2 over all ranks: each block, then the root. ``model`` is changed in
    place (its parameters become DTensor shards under the same names) and
    returned; build the optimizer after this. A mesh of one rank is allowed: it
    trains like a plain run and writes the same sharded checkpoints, so a
    one-GPU run can resume on eight and back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_fsdp(d, precision)
    mesh = init_device_mesh(d.device.type, (d.world_size,))
    policy = mixed_precision(d, precision)
    for block in model.layers:
        if cfg.compile:
            block.compile()  # per block, before sharding: FSDP's hooks stay outside the compiled graph
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reset_after_failed_pass(model: torch.nn.Module) -> None:
    """Make a model sharded by :func:`shard` fit to train again after a forward or
    backward pass that raised (a CUDA out-of-memory error while probing the
    micro-batch). FSDP2 leaves such a pass half done: parameters gathered, hooks
    pending; its next passes then run on full, unsynchronised parameters, so the
    ranks drift apart without a word. ``FSDPModule.reset_iter_state`` (newer
    torch) reshards and clears that state; without it, raise ParallelismError
    (one line) rather than train so."""
    reset = getattr(model, "reset_iter_state", None)
    if reset is None:
        raise ParallelismError(f"batch.micro_batch_size auto: torch {torch.__version__} cannot recover a model "
                               "sharded by FSDP from running out of memory in a probe (FSDPModule.reset_iter_state "
                               "came later); set batch.micro_batch_size to a number")
    reset()


def is_sharded(module: torch.nn.Module) -> bool:
    """True for a model sharded by :func:`shard` (its parameters are DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
