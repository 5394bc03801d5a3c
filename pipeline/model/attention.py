"""Attention backends: three ways to compute the same causal, document-masked
softmax(q k^T / sqrt(head_dim)) v.

    sdpa    F.scaled_dot_product_attention with a dense (B, 1, T, T) boolean
            document mask. The reference, and the CPU path.
    flex    FlexAttention (torch.nn.attention.flex_attention) with a block mask
            built from the segment ids: blocks that cross a document boundary
            are skipped, no T x T mask exists. Compiled on CUDA. On CPU it runs
            forward only (torch has no CPU backward for it), so it trains on CUDA.
    varlen  flash attention over cumulative sequence lengths
            (torch.nn.attention.varlen.varlen_attn): every document of every row
            is one sequence of a flattened batch. CUDA and bf16/fp16 only.

A backend is an object with two methods, so the model stays backend-agnostic::

    mask = backend.document_mask(segment_ids)   # once per forward, shared by the layers
    y = backend.attend(q, k, v, mask)           # q (B, n_head, T, hd), k/v (B, n_kv_head, S, hd)

``mask`` is whatever the backend's own ``document_mask`` returned, or a dense
boolean tensor / None (the KV-cache and plain-causal paths of the model), which
every backend computes with SDPA.

Grouped-query attention: SDPA's ``enable_gqa`` gives the same forward output as
copying the key/value heads, but not the same key/value gradients on CPU (the
sum over a group runs in another order), so the CPU path keeps
``repeat_interleave`` and the default run keeps bit-identical losses. On CUDA,
plain causal SDPA (the flash kernel) and flex/varlen use the kernels' native GQA.

The model picks none of this: ``use_backend(model, resolve(name, device, precision))``
is called from outside (pipeline/training/parallelize.py).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import StageError

NAMES = ("auto", "sdpa", "flex", "varlen")


class AttentionBackendError(StageError):
    """A backend that cannot run where it was asked to (one line)."""


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, T, T) from segment ids (B, T); True = may attend.

    Query i sees key j iff j <= i and both belong to the same document. The
    diagonal is always True, so no row is fully masked (which would give NaN).
    """
    T = segment_ids.size(1)
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    return (same_doc & causal)[:, None]  # (B, 1, T, T), broadcast over heads


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA, causal when ``mask`` is None. Native GQA only where it is exact and
    supported: CUDA without a mask (the flash kernel); elsewhere the key/value
    heads are copied, which every SDPA kernel (incl. the masked ones) accepts."""
    n_rep = q.size(1) // k.size(1)
    native_gqa = n_rep > 1 and mask is None and q.device.type == "cuda"
    if n_rep > 1 and not native_gqa:
        k = k.repeat_interleave(n_rep, dim=1)  # (B, n_head, S, hd)
        v = v.repeat_interleave(n_rep, dim=1)
    # mask None means plain causal attention, which lets SDPA pick its fastest kernel
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=native_gqa)


class SDPA:
    name = "sdpa"

    def document_mask(self, segment_ids: torch.Tensor) -> torch.Tensor:
        return document_mask(segment_ids)  # (B, 1, T, T)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        return sdpa(q, k, v, mask)


class Flex:
    """FlexAttention with a block mask from the segment ids (compiled on CUDA)."""

    name = "flex"

    def __init__(self, compile: bool = False):
        from torch.nn.attention import flex_attention as fa

        self._fa = fa
        self._compile = compile
        self._kernel: Callable[..., torch.Tensor] = torch.compile(fa.flex_attention) if compile else fa.flex_attention

    def document_mask(self, segment_ids: torch.Tensor) -> Any:
        B, T = segment_ids.shape

        def causal_same_doc(b, h, q_idx, kv_idx):  # evaluated per block by the kernel, never as a T x T tensor
            return (q_idx >= kv_idx) & (segment_ids[b, q_idx] == segment_ids[b, kv_idx])

        # compiled, the mask is built block by block; eager, create_block_mask evaluates
        # causal_same_doc on all B x T x T positions at once (gigabytes at T = 4096)
        return self._fa.create_block_mask(causal_same_doc, B, None, T, T, device=segment_ids.device,
                                          _compile=self._compile)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        if not isinstance(mask, self._fa.BlockMask):
            return sdpa(q, k, v, mask)
        return self._kernel(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))


class Varlen:
    """Flash attention over the documents of the flattened batch.

    ``varlen_attn``'s keywords changed between torch releases: 2.10 takes
    ``is_causal``, later ones ``window_size=(-1, 0)``, and ``enable_gqa`` came
    later still. The call is built from the signature of the torch installed;
    without native GQA the key/value heads are copied."""

    name = "varlen"

    def __init__(self):
        from torch.nn.attention.varlen import varlen_attn

        self._kernel = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        self._causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        self._native_gqa = "enable_gqa" in params

    def document_mask(self, segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(cu_seqlens (n_docs + 1,) int32 over the flattened B*T positions, longest document)."""
        B, T = segment_ids.shape
        starts = torch.ones_like(segment_ids, dtype=torch.bool)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]  # each row starts a document too
        begin = starts.flatten().nonzero().flatten()
        total = torch.tensor([B * T], device=segment_ids.device)
        cu = torch.cat([begin, total]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())  # one host sync per forward, not per layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        if not isinstance(mask, tuple):
            return sdpa(q, k, v, mask)
        cu, longest = mask
        B, H, T, hd = q.shape
        n_rep = H // k.size(1)
        options = dict(self._causal)
        if self._native_gqa:
            options["enable_gqa"] = n_rep > 1
        elif n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, n_head, T, hd)
        packed = [t.transpose(1, 2).reshape(B * T, t.size(1), hd) for t in (q, k, v)]  # (B*T, heads, hd)
        y = self._kernel(*packed, cu, cu, longest, longest, **options)
        return y.view(B, T, H, hd).transpose(1, 2)  # (B, n_head, T, hd)


def resolve(name: str, device: torch.device, precision: str = "fp32", training: bool = True) -> Any:
    """The backend ``name`` stands for on ``device``; raises AttentionBackendError
    (one line) where it cannot run. ``auto``: sdpa on CPU; on CUDA varlen in
    bf16/fp16 on a GPU that runs flash attention (half precision, Ampere or
    newer), else flex. Flex in bf16 needs Ampere or ROCm too (Triton)."""
    if name not in NAMES:
        raise AttentionBackendError(f"attention {name!r} is not a backend; choose one of: {', '.join(NAMES)}")
    cuda = device.type == "cuda"
    asked = name
    if name == "auto":
        flash = cuda and precision in ("bf16", "fp16") and _has_varlen() and _flash_capable(device)
        name = "sdpa" if not cuda else ("varlen" if flash else "flex")
    if name == "sdpa":
        return SDPA()
    if name == "flex":
        if training and not cuda:
            raise AttentionBackendError(f"attention flex trains on CUDA only (torch {torch.__version__} has no CPU "
                                        "backward for FlexAttention); use sdpa or auto on CPU")
        if cuda and precision == "bf16" and not _flash_capable(device):  # the same line: Ampere, or ROCm
            major, minor = torch.cuda.get_device_capability(device)
            raise AttentionBackendError(
                f"attention {'auto (flex on this GPU)' if asked == 'auto' else 'flex'} in bf16: FlexAttention is "
                f"compiled by Triton, which has no bf16 before compute capability 8.0 (Ampere); {device} is "
                f"{major}.{minor}; set compute.precision to fp16 or auto (fp16 there), or compute.attention to sdpa")
        return Flex(compile=cuda)
    if not cuda:
        raise AttentionBackendError(f"attention varlen needs a CUDA device (flash attention kernels), not "
                                    f"{device.type}; use sdpa or auto")
    if precision not in ("bf16", "fp16"):
        raise AttentionBackendError(f"attention varlen runs in bf16 or fp16 (flash attention), not {precision}; "
                                    "set compute.precision or use flex")
    if not _has_varlen():
        raise AttentionBackendError(f"attention varlen: torch {torch.__version__} has no "
                                    "torch.nn.attention.varlen.varlen_attn; use flex")
    if not _flash_capable(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise AttentionBackendError(f"attention varlen needs flash attention, which runs on GPUs of compute "
                                    f"capability 8.0 (Ampere) or newer; {device} is {major}.{minor}; use flex")
    return Varlen()


def _flash_capable(device: torch.device) -> bool:
    """Whether flash attention (varlen_attn's kernel) runs on the CUDA ``device``:
    sm80 or newer; ROCm builds bring their own."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def use_backend(model: nn.Module, backend: Any) -> None:
    """Make ``model`` (a Transformer) build its masks and attend with ``backend``.
    Sets attributes only: parameters, their names and checkpoints are unchanged."""
    model.attention_backend = backend
    for block in model.layers:
        block.attention.backend = backend
