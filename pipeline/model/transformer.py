"""A decoder-only transformer in the Llama layout.

    x = tok_embeddings(idx)
    for each layer:
        x = x + wo(attention(rope(wq(norm(x))), rope(wk(norm(x))), wv(norm(x))))   # pre-norm, GQA
        x = x + w2(silu(w1(norm(x))) * w3(norm(x)))                                   # SwiGLU
    logits = output(norm(x))

Conventions, chosen so the weights export to ``transformers.LlamaForCausalLM``
without any permutation:

* RoPE rotates the two *halves* of each head (``rotate_half``), not interleaved
  pairs; cos/sin are computed in fp32 and cast to the activation dtype.
* RMSNorm normalises in fp32, casts back, then scales (LlamaRMSNorm's order).
* No biases anywhere; ``n_kv_head`` key/value heads are shared by groups of
  ``n_head // n_kv_head`` query heads (head ``h`` reads kv head ``h // n_rep``).

The other Hugging Face families (``pipeline.model.families``) need four options,
all off by default:

* ``head_dim`` set explicitly (Qwen3, some Mistrals): wq maps d_model to
  n_head * head_dim, which need not be d_model, and wo maps it back;
* ``qkv_bias`` (Qwen2): wq, wk and wv add a bias;
* ``qk_norm`` (Qwen3): each query and key head is RMS-normalised over head_dim,
  with its own learnt scale, before RoPE;
* ``rope_scaling`` (Llama 3.1+): the ``llama3`` rule stretches the low RoPE
  frequencies by ``factor`` (:func:`llama3_inv_freq`).

Packed rows hold several documents. ``segment_ids`` (B, T) says which document
each position belongs to (``pipeline.data.shards.PackedRows.segment_ids`` derives them
from a row's ``doc_starts``); attention is then causal *and* block-diagonal, so
no token sees another document. RoPE positions stay 0..T-1 along the row: with
RoPE, attention scores depend only on the distance between two positions, so a
document that starts at position 412 gets the scores (up to rounding) it would
get starting at 0, which is how it runs at inference.

Nothing here knows about DDP, AMP, compile or activation checkpointing: the
trainer wraps ``Transformer.layers`` (one module per block) from outside. How
attention is computed (SDPA with a dense mask, FlexAttention, varlen flash
attention: all the same function) is chosen from outside too
(``pipeline.model.attention.use_backend``); the default is SDPA.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.attention import SDPA, document_mask  # noqa: F401  (document_mask: re-exported)
from pipeline.model.families import FAMILIES, LLAMA3_ROPE_KEYS

# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the network. ``ffn_hidden`` and ``n_kv_head`` are derived when None.

    Raises ValueError, listing every problem at once, when the shape is invalid.
    """

    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    n_kv_head: int | None = None  # None: one kv head per query head (plain multi-head)
    ffn_hidden: int | None = None  # None: Llama's 2/3 * 4 * d_model, rounded up to multiple_of
    multiple_of: int = 256
    max_seq_len: int = 1024  # longest sequence forward accepts; the default KV cache length
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # For Hugging Face families (see the module doc); the defaults are the plain Llama layout.
    head_dim: int | None = None  # None: d_model // n_head
    qkv_bias: bool = False  # Qwen2: biases on wq, wk, wv
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", **LLAMA3_ROPE_KEYS}; None: plain RoPE
    family: str = "llama"  # the Hugging Face architecture it converts to: a key of families.FAMILIES

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "multiple_of", "max_seq_len",
                     "n_kv_head", "ffn_hidden", "head_dim"):
            value = getattr(self, name)
            if value is None and name in ("n_kv_head", "ffn_hidden", "head_dim"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer (got {value!r})")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not _positive_number(value):
                problems.append(f"{name} must be a positive number (got {value!r})")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false (got {getattr(self, name)!r})")
        family = FAMILIES.get(self.family) if isinstance(self.family, str) else None
        if family is None:
            problems.append(f"family must be one of {', '.join(FAMILIES)} (got {self.family!r})")
        else:  # each family is one architecture in transformers: its options are not free
            for name in ("qkv_bias", "qk_norm"):
                if getattr(self, name) != getattr(family, name):
                    problems.append(f"family {self.family!r} ({family.architecture}) has {name} = "
                                    f"{str(getattr(family, name)).lower()} (got {getattr(self, name)!r})")
        if self.rope_scaling is not None:
            problems += _rope_scaling_problems(self.rope_scaling)
        if problems:  # the checks below assume positive integers
            raise ValueError("invalid model config:\n  " + "\n  ".join(problems))

        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", llama_ffn_hidden(self.d_model, self.multiple_of))
        if self.rope_scaling is not None:  # a plain dict with exactly the keys the rule reads
            object.__setattr__(self, "rope_scaling", {
                "rope_type": "llama3", **{k: float(self.rope_scaling[k]) for k in LLAMA3_ROPE_KEYS[:3]},
                "original_max_position_embeddings": int(self.rope_scaling["original_max_position_embeddings"])})

        if self.head_dim is None:
            if self.d_model % self.n_head:
                problems.append(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
            else:
                object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if self.head_dim is not None and self.head_dim % 2:
            problems.append(f"head_dim = {'d_model / n_head = ' if self.d_model == self.n_head * self.head_dim else ''}"
                            f"{self.head_dim} must be even for RoPE, which rotates pairs of dimensions")
        if self.n_head % self.n_kv_head:
            problems.append(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head}), "
                            "so that each kv head serves a whole group of query heads")
        if problems:
            raise ValueError("invalid model config:\n  " + "\n  ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, with derived values filled in; ``ModelConfig(**d)`` round-trips.

        The Hugging Face options (head_dim, qkv_bias, qk_norm, rope_scaling, family)
        are left out where they have their default (or derived) value, so that a
        plain Llama-layout model has the dict it had before they existed: its run
        fingerprint and checkpoint metadata, both built from this dict, stay the same.
        """
        d = asdict(self)
        defaults = {"head_dim": self.d_model // self.n_head, "qkv_bias": False, "qk_norm": False,
                    "rope_scaling": None, "family": "llama"}
        return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}


def _rope_scaling_problems(scaling: Any) -> list[str]:
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        return [f"rope_scaling must be null or {{rope_type: llama3, {', '.join(LLAMA3_ROPE_KEYS)}}} (got {scaling!r})"]
    problems = [f"rope_scaling.{k} must be a positive number (got {scaling.get(k)!r})" for k in LLAMA3_ROPE_KEYS
                if not _positive_number(scaling.get(k))]
    if not problems and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append("rope_scaling.high_freq_factor must be larger than low_freq_factor")
    context = scaling.get("original_max_position_embeddings")
    if not problems and not float(context).is_integer():  # int() below would round what transformers keeps
        problems.append(f"rope_scaling.original_max_position_embeddings must be a whole number (got {context!r})")
    unknown = sorted(set(scaling) - {"rope_type", *LLAMA3_ROPE_KEYS})
    if unknown:
        problems.append(f"rope_scaling has unknown key(s) {', '.join(unknown)}")
    return problems


def _positive_number(value: Any) -> bool:
    """A real number in (0, inf): a config.json may hold Infinity (Python's json reads it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def llama_ffn_hidden(d_model: int, multiple_of: int = 256) -> int:
    """SwiGLU has three matrices instead of two, so Llama shrinks the hidden size
    by 2/3 to keep the MLP's parameters near those of a 4*d_model GELU MLP."""
    hidden = int(2 * (4 * d_model) / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


# Size presets: every ModelConfig field except vocab_size, which comes from the
# tokenizer. Parameter counts with tied embeddings (``num_params``; the test
# suite checks that each preset lands in its class):
#
#   preset  layers d_model heads/kv  ffn   vocab 50304  vocab 32000  non-embedding
#   tiny       2      64     4/2     256       3.3M         2.2M          0.12M   CPU unit tests
#   mini       4     128     4/2     512       7.4M         5.1M          0.98M   default run (CPU)
#   small     12     768    12/12   2048     123.6M       109.5M         85.0M    GPT-2 small class
#   medium    24    1024    16/16   2816     359.8M       341.1M        308.3M    GPT-2 medium class
#   large     36    1280    20/20   3584     795.9M       772.4M        731.5M    GPT-2 large class
#   xl        48    1600    25/25   4352    1574.9M      1545.6M       1494.4M    GPT-2 XL class
#
# "mini" is sized for a few minutes of training on two CPU cores over the ~8 MB
# default corpus (~5k tokens/s measured: batch 8 x 256, forward, backward and
# AdamW); at vocab 8192 it has 2.0M parameters. From "small" up, attention is
# plain multi-head so that the sizes stay comparable to GPT-2's.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=128),
    "mini": dict(n_layer=4, d_model=128, n_head=4, n_kv_head=2, max_seq_len=512),
    "small": dict(n_layer=12, d_model=768, n_head=12, max_seq_len=1024),
    "medium": dict(n_layer=24, d_model=1024, n_head=16, max_seq_len=1024),
    "large": dict(n_layer=36, d_model=1280, n_head=20, max_seq_len=1024),
    "xl": dict(n_layer=48, d_model=1600, n_head=25, max_seq_len=1024),
}


def build_config(preset: str | None, vocab_size: int, **overrides: Any) -> ModelConfig:
    """Start from ``PRESETS[preset]`` (or nothing), apply ``overrides``, validate.

    Overrides that are None are ignored, so a caller can pass every optional
    field of its own schema through. Without a preset, n_layer, n_head and
    d_model must be given. Raises ValueError for an unknown preset or field.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets are: {', '.join(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)} - {"vocab_size"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown model field(s) {', '.join(unknown)}; fields are: {', '.join(sorted(known))}")
    values = dict(PRESETS[preset]) if preset is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k in ("n_layer", "n_head", "d_model") if k not in values]
    if missing:
        raise ValueError(f"without a preset, give {', '.join(missing)} (or pick one of: {', '.join(PRESETS)})")
    return ModelConfig(vocab_size=vocab_size, **values)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Normalised in fp32 because the mean of squares
    loses precision in bf16; cast back before the scale, as LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape (T, head_dim), in fp32.

    Dimension pair (i, i + head_dim/2) rotates at frequency theta^(-2i/head_dim),
    rescaled by :func:`llama3_inv_freq` when ``scaling`` is given.
    Computed per call from the positions: it costs T * head_dim/2 multiplies,
    and unlike a cached buffer it cannot be silently cast to bf16 by ``.to()``.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, **{k: v for k, v in scaling.items() if k != "rope_type"})
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim): both halves share a frequency
    return angles.cos(), angles.sin()


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: stretch the slow frequencies, keep the fast ones.

    A frequency whose wavelength (2*pi / inv_freq, in positions) is longer than
    original_max_position_embeddings / low_freq_factor never completed a turn in
    pretraining: it is divided by ``factor``, so the context can grow by that
    factor without unseen angles. Wavelengths shorter than
    original_max_position_embeddings / high_freq_factor stay; those in between
    are interpolated. The operations and their order are those of transformers'
    ``_compute_llama3_parameters``, so that logits match to the last bits.
    """
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair of x (B, n_head, T, head_dim) by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-x2, x1], dim=-1)
    # cast to the activation dtype like HF Llama, so exported bf16 inference sees the same numbers
    return x * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)


class KVCache:
    """Keys and values of past positions, preallocated for ``max_len`` positions.

    Stores ``n_kv_head`` heads (not the expanded ``n_head``) per layer. Create it
    with the dtype attention runs in (the parameters' dtype, or the autocast dtype).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        self.max_len = max_len or config.max_seq_len
        shape = (config.n_layer, batch_size, config.n_kv_head, self.max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_head, T, head_dim) at start_pos; return all keys and values so far."""
        end = start_pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked to write up to {end}")
        self.k[layer, :, :, start_pos:end] = k
        self.v[layer, :, :, start_pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, n_kv_head, end, head_dim)


class Attention(nn.Module):
    backend = SDPA()  # computes softmax(q k^T / sqrt(head_dim)) v under a mask; see pipeline.model.attention

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.d_model, config.n_head * config.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.d_model, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.d_model, config.n_kv_head * config.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # one scale per head dimension, shared by all heads
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, layer: int = 0, start_pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)  # (B, T, n_head, head_dim)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, n_kv_head, head_dim)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim)
        if self.qk_norm:  # over head_dim, each head on its own
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, start_pos, k, v)  # (B, n_kv_head, start_pos + T, head_dim)
        # GQA: kv head h // (n_head / n_kv_head) serves query head h
        y = self.backend.attend(q, k, v, mask)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)
        self.w3 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, start_pos: int = 0) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, self.layer_id, start_pos)
        return x + self.feed_forward(self.ffn_norm(x))


# --------------------------------------------------------------------------- masks


def causal_mask(T: int, S: int, start_pos: int, device: torch.device) -> torch.Tensor:
    """(1, 1, T, S) mask for T new queries at start_pos..start_pos+T-1 over S cached keys.

    SDPA's is_causal aligns the triangle to the top-left corner, which is wrong
    once queries start past key 0, so decoding with a cache spells it out.
    """
    q_pos = torch.arange(start_pos, start_pos + T, device=device)
    k_pos = torch.arange(S, device=device)
    return (k_pos[None, :] <= q_pos[:, None])[None, None]


# --------------------------------------------------------------------------- model


class Transformer(nn.Module):
    attention_backend = Attention.backend  # builds the document mask its layers' backend reads

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere, biases to 0, norms to 1, and the projections that write
        into the residual stream (wo, w2) scaled by 1/sqrt(2 * n_layer): each layer
        adds two such terms, so this keeps the residual's variance from growing
        with depth (GPT-2). Also (re)ties the head, which ``to_empty`` unties: call
        this after building on the meta device and moving to a real one."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("attention.wo", "feed_forward.w2"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the head the embedding matrix, if the config ties them."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, idx: torch.Tensor, segment_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids idx (B, T). The loss is the
        caller's (pipeline/training/loss.py), so one definition serves training
        and evaluation.

        segment_ids (B, T): document of each position in a packed row; attention
            stays inside a document. None: plain causal attention over the row.
        cache, start_pos: incremental decoding. idx holds positions
            start_pos..start_pos+T-1; keys and values of earlier positions come
            from ``cache``, which this call extends. Not combined with segment_ids.
        """
        T = idx.size(1)
        if start_pos + T > self.config.max_seq_len:
            raise ValueError(f"sequence reaches position {start_pos + T}, beyond max_seq_len {self.config.max_seq_len}")
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids and a KV cache cannot be combined: decoding runs one document")
        if cache is None and start_pos != 0:
            raise ValueError("start_pos is only meaningful with a KV cache")

        # Built once per forward and shared by every layer.
        positions = torch.arange(start_pos, start_pos + T, device=idx.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta,
                                self.config.rope_scaling)  # (T, head_dim)
        if segment_ids is not None:
            mask = self.attention_backend.document_mask(segment_ids)  # sdpa: (B, 1, T, T)
        elif cache is not None:
            mask = causal_mask(T, start_pos + T, start_pos, idx.device)  # (1, 1, T, start_pos + T)
        else:
            mask = None  # causal fast path

        x = self.tok_embeddings(idx)  # (B, T, d_model)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, start_pos)
        return self.output(self.norm(x))  # (B, T, vocab_size)


# --------------------------------------------------------------------------- accounting


def num_params(model_or_config: nn.Module | ModelConfig, exclude_embedding: bool = False) -> int:
    """Number of parameters, counting a tied embedding/head matrix once.

    ``exclude_embedding`` leaves out the input embedding table (vocab_size * d_model);
    an untied output head is still counted, since it is a matmul. For a config the
    count is arithmetic, so it costs nothing even for the largest preset.
    """
    if isinstance(model_or_config, nn.Module):
        total = sum(p.numel() for p in model_or_config.parameters())  # parameters() yields a shared tensor once
        if exclude_embedding:
            total -= model_or_config.tok_embeddings.weight.numel()
        return total
    c = model_or_config
    embedding = c.vocab_size * c.d_model
    head = 0 if c.tie_embeddings else c.vocab_size * c.d_model
    total = embedding + c.n_layer * _params_per_layer(c) + c.d_model + head  # + final norm
    return total - embedding if exclude_embedding else total


def _attention_params(c: ModelConfig) -> int:
    q_and_o = 2 * c.d_model * c.n_head * c.head_dim
    k_and_v = 2 * c.d_model * c.n_kv_head * c.head_dim
    return q_and_o + k_and_v


def _params_per_layer(c: ModelConfig) -> int:
    biases = (c.n_head + 2 * c.n_kv_head) * c.head_dim if c.qkv_bias else 0
    qk_norms = 2 * c.head_dim if c.qk_norm else 0
    return _attention_params(c) + biases + qk_norms + 3 * c.d_model * c.ffn_hidden + 2 * c.d_model  # + two norms


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N_matmul + 12 * n_layer * n_head * head_dim * seq_len.

    N_matmul counts every weight that multiplies an activation for each token: all
    linear layers of every block plus the output head (even when it is tied to the
    embedding, because the head is still a matmul), but not the embedding lookup,
    biases or norm scales. Each such weight costs 2 FLOPs forward and 4 backward, hence 6.
    The second term is attention itself: QK^T and attention*V each take
    2 * seq_len * n_head * head_dim FLOPs forward per token per layer, again
    tripled for the backward pass: 3 * 2 * 2 = 12. This is PaLM's formula
    (appendix B); like PaLM and Chinchilla (appendix F) it counts the full
    seq_len x seq_len attention, not the causal half that a fused kernel computes.
    """
    c = config
    n_matmul = c.n_layer * (_attention_params(c) + 3 * c.d_model * c.ffn_hidden) + c.vocab_size * c.d_model
    return 6 * n_matmul + 12 * c.n_layer * c.n_head * c.head_dim * seq_len
