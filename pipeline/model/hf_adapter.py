"""Conversion between our checkpoints and Hugging Face ``LlamaForCausalLM``.

The one place that knows both namings (the role of torchtitan's
``state_dict_adapter.py``): :mod:`pipeline.export` writes Hugging Face folders
with it, and :func:`pipeline.model.generate.load_for_inference` reads them back.

No tensor is permuted: ``pipeline.model.transformer`` already uses Llama's RoPE layout
(rotate_half), RMSNorm order and GQA grouping, so conversion is a renaming.
With tied embeddings Hugging Face stores the matrix once, as
``model.embed_tokens.weight``, and re-ties ``lm_head`` on load
(``tie_word_embeddings: true``); so ``output.weight`` is left out on export and
re-created from the embedding on import.

Nothing here imports transformers: reading an export must work without it.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from pipeline.model.transformer import ModelConfig

# ours -> Hugging Face, with ``{}`` standing for the layer number.
TO_HF: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",  # SwiGLU gate
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FROM_HF: dict[str, str] = {hf: ours for ours, hf in TO_HF.items()}

_LAYER = re.compile(r"\.(\d+)\.")


def _rename(key: str, table: Mapping[str, str]) -> str | None:
    """Map one key through ``table``; None if it has no entry."""
    m = _LAYER.search(key)
    if m is None:
        return table.get(key)
    target = table.get(key[:m.start()] + ".{}." + key[m.end():])
    return None if target is None else target.format(m.group(1))


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (``Transformer.state_dict()``) renamed for ``LlamaForCausalLM``.

    With ``config.tie_embeddings`` the head is left out (Hugging Face re-ties it).
    Tensors are made contiguous, as safetensors requires. Raises ValueError
    naming any key that has no Hugging Face counterpart.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state_dict.items():
        if key == "output.weight" and config.tie_embeddings:
            continue
        name = _rename(key, TO_HF)
        if name is None:
            unknown.append(key)
        else:
            out[name] = tensor.detach().contiguous()
    if unknown:
        raise ValueError(f"no Hugging Face name for: {', '.join(sorted(unknown))}")
    return out


def from_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict renamed for ``Transformer.load_state_dict``.

    With ``config.tie_embeddings`` the head is the embedding; a stored
    ``lm_head.weight`` is then ignored, since Hugging Face would ignore it too.
    Raises ValueError naming unknown keys; missing ones surface in the strict
    ``load_state_dict`` that follows.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state_dict.items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue
        name = _rename(key, FROM_HF)
        if name is None:
            unknown.append(key)
        else:
            out[name] = tensor
    if unknown:
        raise ValueError(f"not a weight of our Llama layout: {', '.join(sorted(unknown))}")
    if config.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(config: ModelConfig, *, bos_token_id: int, eos_token_id: int | list[int], pad_token_id: int,
              dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` describing ``config``.

    RoPE is written both ways: ``rope_parameters`` (transformers 5) and the
    legacy ``rope_theta`` (transformers 4 and tools that read the file
    themselves); likewise ``dtype`` and ``torch_dtype``.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Our ModelConfig from a Llama ``config.json`` dict.

    Raises ValueError if the file asks for something ``pipeline.model.transformer`` does not
    implement (another architecture, biases, another activation, RoPE scaling,
    a head_dim other than hidden_size / num_attention_heads), rather than load
    weights into a model that would compute something else.
    """
    problems = []
    if hf.get("model_type") != "llama":
        problems.append(f"model_type is {hf.get('model_type')!r}, not 'llama'")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append("biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.get('hidden_act')!r} is not silu")
    rope = hf.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or hf.get("rope_scaling"):
        problems.append("RoPE scaling is not supported")
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        d_model=hf["hidden_size"],
        n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    if hf.get("head_dim") not in (None, config.head_dim):
        raise ValueError(f"unsupported Hugging Face config: head_dim {hf['head_dim']} != "
                         f"hidden_size / num_attention_heads = {config.head_dim}")
    return config
