"""Mixed precision: which dtype a device trains in, and the autocast context.

Kept apart from the trainer so that evaluation and benchmarks use the same
rules without importing the training loop.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` → bf16 where the device runs it natively (an Ampere or newer
    CUDA GPU, ROCm, a CPU whose oneDNN reports bf16 support), fp16 on older
    CUDA GPUs, else fp32."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if cuda_bf16_native(device) else "fp16"
    if device.type == "cpu":
        try:
            return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
        except (AttributeError, RuntimeError):
            return "fp32"
    return "fp32"


def cuda_bf16_native(device: torch.device) -> bool:
    """Whether the CUDA ``device`` computes in bf16 in hardware: compute capability
    8.0 (Ampere) or newer, or any ROCm GPU. ``torch.cuda.is_bf16_supported()``
    also says yes for a V100 or T4, which only emulate bf16, many times slower
    than their fp16, and whose flash attention takes neither."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to ``precision`` on ``device``; fp32 is a no-op context."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])
