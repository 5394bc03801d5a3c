"""The Hugging Face model families we read and write: a registry, as data.

Each entry says what one ``transformers`` architecture is in terms of our
``pipeline.model.transformer.ModelConfig``: the same decoder (pre-norm, RoPE
with rotate_half, SwiGLU, RMSNorm, grouped-query attention), plus

    llama    LlamaForCausalLM    nothing more (Llama 3.x adds ``llama3`` RoPE frequency scaling)
    qwen2    Qwen2ForCausalLM    biases on the q, k and v projections
    qwen3    Qwen3ForCausalLM    RMSNorm over head_dim on each query and key head, before RoPE;
                                 head_dim set explicitly (128 when config.json leaves it out)
    mistral  MistralForCausalLM  a sliding attention window (see pipeline.model.hf_adapter)

``defaults`` are the values ``transformers`` (5.x) assumes for config.json keys
that a file leaves out, for the keys that change what we compute; a file is
read as transformers would read it. ``extra_config`` holds the keys that a
config.json of that family carries besides the shared ones
(:func:`pipeline.model.hf_adapter.hf_config`), as ``transformers`` 5.23's
``to_dict()`` writes them for a model with full attention.

Adding a family is one entry here, a test in tests/pipeline/model/test_hf_adapter.py,
and whatever the model lacks for it in transformer.py. Nothing here imports
torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    architecture: str  # config.json "architectures": [architecture]
    model_type: str  # config.json "model_type"
    qkv_bias: bool = False  # q, k and v projections carry biases (o does not)
    qk_norm: bool = False  # per-head RMSNorm on q and k
    # transformers reads config.json's "attention_bias" (true: biases on q, k, v and o, which we do not have)
    attention_bias_key: bool = False
    # config.json's "sliding_window" limits attention in every layer (Mistral); Qwen's needs use_sliding_window
    sliding_window_everywhere: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    extra_config: dict[str, Any] = field(default_factory=dict)
    # config.json lists each layer's attention kind ("layer_types", with "max_window_layers"):
    # hf_config writes "full_attention" for every layer.
    layer_types: bool = False


# Shared by all four families (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig in transformers 5.23).
_COMMON_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
                    "attention_dropout": 0.0, "initializer_range": 0.02}
_QWEN_EXTRA = {"use_sliding_window": False, "sliding_window": None}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", attention_bias_key=True,
           defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 2048, "num_key_value_heads": None,
                     "head_dim": None},
           extra_config={"attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False}),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True,
           defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32,
                     "head_dim": None},
           # Qwen2 always has q/k/v biases; transformers ignores this key, it is written for other readers.
           extra_config={"attention_bias": True, "attention_dropout": 0.0, **_QWEN_EXTRA}, layer_types=True),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True, attention_bias_key=True,
           defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32,
                     "head_dim": 128},
           extra_config={"attention_bias": False, "attention_dropout": 0.0, **_QWEN_EXTRA}, layer_types=True),
    Family("mistral", "MistralForCausalLM", "mistral", sliding_window_everywhere=True,
           defaults={**_COMMON_DEFAULTS, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
                     "head_dim": None, "sliding_window": 4096},
           extra_config={"attention_dropout": 0.0, "sliding_window": None}),
)}
BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES.values()}
BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES.values()}

# RoPE variants the model implements (config.json rope_type); "llama3" is Llama 3.1's
# frequency scaling, with these parameters.
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
