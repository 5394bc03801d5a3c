"""Tiny random Hugging Face model folders of each supported family, built offline
with transformers' own config and model classes and ``save_pretrained``.

    save_tiny_hf_model("qwen3", tmp_path / "qwen3")   # config.json + model.safetensors

Every parameter is redrawn from a seeded generator, biases and norm scales
included (transformers initialises those to 0 and 1, which would let a
dropped bias or norm go unnoticed), with a spread that gives logits of order 1.
Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
# Llama 3.1's scaling, with a short "original" context so that the tiny head's
# frequencies fall in all three bands: kept, interpolated and divided by factor.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_hf_config(family: str, *, vocab_size: int = 384, tie: bool = True, rope_scaling: bool = False,
                   **overrides: Any):
    """The transformers config object of a tiny model of ``family``.

    qwen3 gets head_dim 32, not hidden_size / heads = 16, as Qwen3 models do
    (their head_dim is set, not derived). ``overrides`` go to the config class.
    """
    import transformers

    rope_theta = {"llama": 500000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "mistral": 10000.0}[family]
    rope = {**(LLAMA3_ROPE if rope_scaling else {"rope_type": "default"}), "rope_theta": rope_theta}
    kwargs: dict[str, Any] = dict(SHAPE, vocab_size=vocab_size, tie_word_embeddings=tie, rope_parameters=rope,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3":
        kwargs["head_dim"] = 32
    if family == "mistral":
        kwargs["sliding_window"] = None  # as Mistral 7B v0.2+; v0.1's 4096 is tested on its own
    kwargs.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[family]
    return cls(**kwargs)


def tiny_hf_model(family: str, *, seed: int = 0, **config_kwargs: Any):
    """A random transformers ``*ForCausalLM`` of ``family`` in fp32, eval mode (see :func:`tiny_hf_config`)."""
    import transformers

    config = tiny_hf_config(family, **config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is listed once
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)  # unit-scale activations through every matmul
    return model


def save_tiny_hf_model(family: str, folder: str | Path, *, vocab_size: int = 384, tie: bool = True,
                       dtype: torch.dtype = torch.float32, sharded: bool = False, rope_scaling: bool = False,
                       seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``family`` model to ``folder`` with ``save_pretrained``; return ``folder``.

    ``dtype``: the weights' dtype in the file (float32, bfloat16 or float16).
    ``sharded``: several safetensors files and ``model.safetensors.index.json``.
    ``rope_scaling``: Llama 3.1's llama3 RoPE scaling (:data:`LLAMA3_ROPE`).
    ``overrides``: more config keys (``sliding_window=16``, ...).
    """
    folder = Path(folder)
    model = tiny_hf_model(family, seed=seed, vocab_size=vocab_size, tie=tie, rope_scaling=rope_scaling, **overrides)
    model.to(dtype)
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": "40KB"} if sharded else {}))
    return folder


TOKENIZER_FAMILY = {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


def save_tiny_hf_folder(family: str, folder: str | Path, *, vocab_size: int = 640, seed: int = 0,
                        **model_kwargs: Any) -> Path:
    """A whole model folder as the hub ships one: a tiny random ``family`` model
    whose bos/eos/pad ids are those of the family's tokenizer
    (:func:`tests.hf_tokenizers.save_family_tokenizer`, written into the same
    folder with its chat template and generation config)."""
    from tokenizers import Tokenizer

    from tests.hf_tokenizers import save_family_tokenizer

    folder = Path(folder)
    tok_dir = folder.parent / f".{folder.name}-tokenizer"
    save_family_tokenizer(TOKENIZER_FAMILY[family], tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() <= vocab_size, "the tokenizer must fit the model's embedding table"
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())

    def token_id(role: str) -> int | None:
        value = tok_config.get(role)
        value = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(value) if isinstance(value, str) else None

    ids = {k: token_id(f"{k}_token") for k in ("bos", "eos", "pad")}
    save_tiny_hf_model(family, folder, vocab_size=vocab_size, seed=seed,
                       **{f"{k}_token_id": v for k, v in ids.items()}, **model_kwargs)
    for file in tok_dir.iterdir():  # the tokenizer's generation_config.json (family stop ids) wins
        file.replace(folder / file.name)
    tok_dir.rmdir()
    return folder
