"""Hugging Face model folders in and out: Llama, Qwen2, Qwen3 and Mistral.

The one place that knows both namings (the role of torchtitan's
``state_dict_adapter.py``). :mod:`pipeline.export` writes Hugging Face folders
with it; :func:`load_hf_model` reads them (an export of ours, or a published
model to start a run from), and :func:`pipeline.model.generate.load_for_inference`
goes through it.

No tensor is permuted: ``pipeline.model.transformer`` already uses Llama's RoPE
layout (rotate_half), RMSNorm order and GQA grouping, which all four families
share, so conversion is a renaming (one table, :data:`TO_HF`; the family decides
which of its optional entries, biases and q/k norms, a model has). With tied
embeddings Hugging Face stores the matrix once, as ``model.embed_tokens.weight``,
and re-ties ``lm_head`` on load (``tie_word_embeddings: true``); so
``output.weight`` is left out on export and re-created from the embedding on
import. A stored ``lm_head.weight`` beside ``tie_word_embeddings: true`` is
ignored when it equals the embedding (transformers ties them then); when it
differs, transformers 4 ignores it and transformers 5 unties the two, so the
folder is refused rather than read one way or the other.

What a config.json may ask for is checked before any weight is read
(:func:`config_from_hf`); anything the model does not compute exactly like
transformers raises :class:`UnsupportedModelError`, one line naming it and
what is supported. A config.json whose ``auto_map`` names custom modelling
code is refused too: from_pretrained(trust_remote_code=True) runs that code,
which may compute otherwise than the family's class. Sliding windows:
Qwen2/Qwen3's ``use_sliding_window: true`` is refused. Mistral's
``sliding_window`` is honoured by capping ``max_seq_len`` at the window (with
a warning): a causal window of W positions lets a query see the W - 1
positions before it, which is every earlier position of a sequence of at most
W tokens, so within ``max_seq_len`` full attention computes exactly what the
window does.

Nothing here imports transformers: reading an export must work without it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from pipeline.errors import StageError
from pipeline.model.families import BY_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, LLAMA3_ROPE_KEYS, ROPE_TYPES, Family
from pipeline.model.transformer import ModelConfig, Transformer

log = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
FILE_DTYPES = ("F32", "BF16", "F16")  # safetensors dtypes read into fp32 master weights
SUPPORTED = ", ".join(BY_ARCHITECTURE)


class UnsupportedModelError(StageError, ValueError):
    """A Hugging Face model folder we cannot load exactly: another architecture,
    a config feature the model does not implement, or weights that do not fit.
    Also a ValueError, which is what callers of the older Llama-only adapter caught."""


# ours -> Hugging Face, with ``{}`` standing for the layer number. The biases and
# q/k norms exist only in the families that have them (families.FAMILIES).
TO_HF: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.wq.bias": "model.layers.{}.self_attn.q_proj.bias",  # Qwen2
    "layers.{}.attention.wk.bias": "model.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attention.wv.bias": "model.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",  # Qwen3
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",  # SwiGLU gate
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FROM_HF: dict[str, str] = {hf: ours for ours, hf in TO_HF.items()}
# Buffers some older checkpoints saved; transformers recomputes them and so do we.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

_LAYER = re.compile(r"\.(\d+)\.")


def _rename(key: str, table: Mapping[str, str]) -> str | None:
    """Map one key through ``table``; None if it has no entry."""
    m = _LAYER.search(key)
    if m is None:
        return table.get(key)
    target = table.get(key[:m.start()] + ".{}." + key[m.end():])
    return None if target is None else target.format(m.group(1))


def _expected_keys(config: ModelConfig) -> list[str]:
    """Our state dict's keys for ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return list(Transformer(config).state_dict())


# --------------------------------------------------------------------------- weights


def to_hf(state_dict: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (``Transformer.state_dict()``) renamed for ``config.family``'s architecture.

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
    """A Hugging Face state dict of ``config.family`` renamed for ``Transformer.load_state_dict``.

    With ``config.tie_embeddings`` the head is the embedding; a stored
    ``lm_head.weight`` is then ignored, since Hugging Face would ignore it too.
    Raises ValueError naming keys that ``config``'s model does not have (a
    bias of a family without biases, say); missing ones surface in the strict
    ``load_state_dict`` that follows. For whole folders use :func:`load_hf_model`,
    which copies tensor by tensor instead of holding a second state dict.
    """
    expected = set(_expected_keys(config))
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state_dict.items():
        if (key == "lm_head.weight" and config.tie_embeddings) or IGNORED.search(key):
            continue
        name = _rename(key, FROM_HF)
        if name is None or name not in expected:
            unknown.append(key)
        else:
            out[name] = tensor
    if unknown:
        raise ValueError(f"not a weight of a {FAMILIES[config.family].architecture} of this shape: "
                         f"{', '.join(sorted(unknown))}")
    if config.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# --------------------------------------------------------------------------- config.json out

# The keys that hf_config takes from our ModelConfig when it updates an original config.json.
OWN_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
            "rms_norm_eps", "hidden_act", "tie_word_embeddings", "initializer_range", "layer_types", "dtype",
            "torch_dtype")


def hf_config(config: ModelConfig, *, bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
              pad_token_id: int | None = None, dtype: str = "float32",
              original: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of ``config.family``'s architecture describing ``config``.

    Written like transformers 5.23's ``to_dict()`` for that family, and readable
    by transformers 4 too: RoPE both ways, ``rope_parameters`` (transformers 5)
    and the legacy ``rope_theta`` plus, for llama3 scaling, ``rope_scaling``
    (with ``rope_type``, without ``rope_theta``, which transformers 4 would warn
    about); likewise ``dtype`` and ``torch_dtype``.

    ``original``: the config.json of the model a run started from. The result
    is then that file with ``dtype`` and ``torch_dtype`` set, and those of
    :data:`OWN_KEYS` that it has set from ``config``, and ``architectures`` even
    where it has none (a file that named only its ``model_type``): the export keeps the
    original's style (transformers 4 or 5) and whatever else it says (token ids,
    ``max_position_embeddings``, which is larger than our max_seq_len where
    Mistral's window capped it, ``sliding_window``, ``transformers_version``…).
    Token ids given here still win. Its ``auto_map`` is left out: the model
    computes what the family's own transformers class does, with no custom code.
    """
    family = FAMILIES[config.family]
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling = None
    if config.rope_scaling is not None:
        rope_scaling = dict(config.rope_scaling)
        rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        **({"rope_scaling": rope_scaling} if rope_scaling else {}),
        "rope_parameters": rope_parameters,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        **family.extra_config,
        **({"max_window_layers": config.n_layer, "layer_types": ["full_attention"] * config.n_layer}
           if family.layer_types else {}),
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if original is None:
        return out
    # auto_map names code files of the original's folder that the export does not ship (the model is the
    # stock class): from_pretrained(trust_remote_code=True) would look for them and fail
    merged = {k: v for k, v in original.items() if k != "auto_map"}
    merged.update({k: out[k] for k in OWN_KEYS if k in out and k in original})
    # the class a loader builds (vLLM, TGI and the Hub read it) is named even where the original left it to
    # model_type, as every config.json save_pretrained writes names it
    merged.update(architectures=out["architectures"], dtype=dtype, torch_dtype=dtype)
    merged.update({k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                                     ("pad_token_id", pad_token_id)) if v is not None})
    return merged


# --------------------------------------------------------------------------- config.json in


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Our ModelConfig from a config.json dict of a supported architecture.

    Reads both the transformers 4 style (``rope_theta``, ``rope_scaling``) and
    the transformers 5 style (``rope_parameters``); keys the file leaves out
    take transformers' defaults for that family. ``max_seq_len`` is
    ``max_position_embeddings``, capped at Mistral's ``sliding_window`` (see
    the module doc). Raises UnsupportedModelError, one line naming every
    problem and what is supported, when the architecture or any setting is one
    the model does not implement exactly; nothing has been read but the dict.
    """
    family = _family(hf)

    def get(key: str) -> Any:  # as transformers reads it: the file's value, else the family's default
        if key in _NULL_IS_A_VALUE and key in hf and hf[key] is None:
            return None
        return hf[key] if hf.get(key) is not None else family.defaults.get(key)

    problems = [f"config.json lacks {key}" for key in
                ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                if hf.get(key) is None]
    problems += _type_problems(get)
    if problems:  # a value of the wrong type would fail the checks below in its own way
        raise UnsupportedModelError(f"unsupported Hugging Face model ({family.architecture}): " + "; ".join(problems))
    problems += _feature_problems(hf, family, get)
    rope_theta, rope_scaling, rope_problems = _rope(hf, get)
    problems += rope_problems
    if problems:
        raise UnsupportedModelError(f"unsupported Hugging Face model ({family.architecture}): " + "; ".join(problems))

    max_seq_len = get("max_position_embeddings")
    window = get("sliding_window") if family.sliding_window_everywhere else None
    if window is not None and window < max_seq_len:
        log.warning("%s: sliding_window %d < max_position_embeddings %d: max_seq_len capped at %d, where full "
                    "attention computes exactly what the window does", family.architecture, window, max_seq_len, window)
        max_seq_len = window
    kv_heads = get("num_key_value_heads")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            n_layer=hf["num_hidden_layers"],
            n_head=hf["num_attention_heads"],
            d_model=hf["hidden_size"],
            n_kv_head=hf["num_attention_heads"] if kv_heads is None else kv_heads,  # null: one per head; 0 is refused
            ffn_hidden=hf["intermediate_size"],
            max_seq_len=max_seq_len,
            rope_theta=float(rope_theta),
            norm_eps=float(get("rms_norm_eps")),
            tie_embeddings=bool(get("tie_word_embeddings")),
            init_std=float(get("initializer_range")),
            head_dim=get("head_dim"),
            qkv_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            rope_scaling=rope_scaling,
            family=family.name,
        )
    except ValueError as err:  # a shape our model cannot take (odd head_dim, ...), as one line
        detail = "; ".join(line.strip() for line in str(err).splitlines()[1:]) or str(err)
        raise UnsupportedModelError(f"unsupported Hugging Face model ({family.architecture}): {detail}") from None


def _family(hf: Mapping[str, Any]) -> Family:
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise UnsupportedModelError(f"config.json's architectures is {json.dumps(architectures)[:60]}, not a list of names "
                                    f"such as [\"LlamaForCausalLM\"]; supported: {SUPPORTED}")
    model_type = hf.get("model_type")
    if not architectures and model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    if len(architectures) != 1 or architectures[0] not in BY_ARCHITECTURE:
        named = ", ".join(architectures) or f"model_type {model_type!r}"
        raise UnsupportedModelError(f"unsupported Hugging Face architecture {named}; supported: {SUPPORTED}")
    family = BY_ARCHITECTURE[architectures[0]]
    if model_type != family.model_type:
        raise UnsupportedModelError(f"unsupported Hugging Face config: model_type is {model_type!r} but the "
                                    f"architecture {family.architecture} has model_type {family.model_type!r}")
    return family


# The type transformers gives each key it reads (bool is not an int here, as in JSON).
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "head_dim", "sliding_window")
_NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range", "attention_dropout", "partial_rotary_factor")
_BOOLS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias")
_MAPPINGS = ("rope_scaling", "rope_parameters", "quantization_config", "auto_map")
_STRINGS = ("hidden_act",)
# the names transformers gives nn.SiLU (its ACT2CLS): a config may say either
SILU = ("silu", "swish")
_STRING_LISTS = ("layer_types",)


# Keys whose explicit null transformers reads as a value, not as "the default": no sliding window, as many
# key/value heads as heads, head_dim from hidden_size (Qwen3 alone keeps a null head_dim, and cannot build).
_NULL_IS_A_VALUE = ("sliding_window", "num_key_value_heads", "head_dim")


def _type_problems(get) -> list[str]:
    """Every key whose value (the file's, else the family's default) is of the wrong JSON type."""
    problems = []
    for keys, ok, kind in ((_INTS, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
                           (_NUMBERS, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
                           (_BOOLS, lambda v: isinstance(v, bool), "true or false"),
                           (_MAPPINGS, lambda v: isinstance(v, Mapping), "an object"),
                           (_STRINGS, lambda v: isinstance(v, str), "a string"),
                           (_STRING_LISTS, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                            "a list of strings")):
        for key in keys:
            value = get(key)
            if value is not None and not ok(value):
                problems.append(f"{key} is {json.dumps(value)[:60]}, not {kind}")
    return problems


def _feature_problems(hf: Mapping[str, Any], family: Family, get) -> list[str]:
    """Every setting of ``hf`` that would make transformers compute something our model does not."""
    problems = []
    if get("hidden_act") not in SILU:
        problems.append(f"hidden_act {get('hidden_act')!r} (supported: silu, the SwiGLU gate)")
    if family.attention_bias_key and hf.get("attention_bias"):
        problems.append("attention_bias true: biases on the q/k/v/o projections are not supported "
                        "(only Qwen2ForCausalLM's q/k/v biases are)")
    if family.defaults.get("head_dim") is not None and "head_dim" in hf and hf["head_dim"] is None:
        problems.append(f"head_dim null: {family.architecture} takes it as given (transformers cannot build the "
                        "model); set it, or leave the key out for its default")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias true: MLP biases are not supported")
    if get("attention_dropout"):
        problems.append(f"attention_dropout {get('attention_dropout')} (supported: 0)")
    window = get("sliding_window") if family.sliding_window_everywhere else None
    if window is not None and window < 1:  # else "max_seq_len capped at 0", then an error naming max_seq_len
        problems.append(f"sliding_window {window} (supported: a positive integer, or null for none)")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window true: sliding-window attention is not supported for "
                        f"{family.architecture} (supported: full attention)")
    layer_types = hf.get("layer_types")
    other_layers = sorted(set(layer_types or []) - {"full_attention"})
    if other_layers:
        problems.append(f"layer_types {', '.join(other_layers)} (supported: full_attention)")
    if layer_types is not None and len(layer_types) != hf["num_hidden_layers"]:  # transformers 5 refuses it too
        problems.append(f"layer_types has {len(layer_types)} entries but num_hidden_layers is "
                        f"{hf['num_hidden_layers']} (supported: one entry per layer)")
    # trust_remote_code=True would run the code an auto_map names, not the family's class
    named = [v if isinstance(v, list) else [v] for v in (hf.get("auto_map") or {}).values()]  # a tokenizer's: a pair
    code = sorted({name for names in named for name in names if isinstance(name, str) and name})
    if code:
        problems.append(f"auto_map names custom code ({_some(code, 3)}) that is not run here and may compute "
                        f"otherwise than {family.architecture} (supported: the stock transformers classes; "
                        "if the model is the stock class, delete auto_map from config.json)")
    if hf.get("quantization_config"):
        method = (hf["quantization_config"] or {}).get("quant_method", "?")
        problems.append(f"quantization_config ({method}): quantized weights are not supported "
                        f"(supported: {', '.join(FILE_DTYPES)} safetensors)")
    return problems


def _rope(hf: Mapping[str, Any], get) -> tuple[float, dict[str, Any] | None, list[str]]:
    """(rope_theta, our rope_scaling or None, problems), read the way transformers 5 reads it:
    a legacy ``rope_scaling`` dict wins over ``rope_parameters``, and rope_theta comes from
    that dict, else the top level, else the default."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        return 0.0, None, [f"per-layer-type rope_parameters ({', '.join(rope)}) (supported: one RoPE for all layers)"]
    theta = rope["rope_theta"] if rope.get("rope_theta") is not None else get("rope_theta")  # 0 is a value
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    problems = []
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        problems.append(f"rope_theta is {json.dumps(theta)[:60]}, not a number")
    elif not theta > 0:  # transformers would divide by 0 ** (i / head_dim): infinite frequencies
        problems.append(f"rope_theta {theta} (supported: a positive number)")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor {partial} (supported: 1.0, RoPE on the whole head)")
    if rope_type not in ROPE_TYPES:
        problems.append(f"RoPE scaling rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if rope_type != "llama3":
        return theta, None, problems
    scaling = {"rope_type": "llama3", **{k: rope.get(k) for k in LLAMA3_ROPE_KEYS}}
    if scaling["original_max_position_embeddings"] is None:  # a 0 stays, for ModelConfig to refuse
        scaling["original_max_position_embeddings"] = get("max_position_embeddings")
    missing = [k for k in LLAMA3_ROPE_KEYS if scaling[k] is None]
    if missing:
        problems.append(f"llama3 RoPE scaling lacks {', '.join(missing)}")
    return theta, scaling, problems


# --------------------------------------------------------------------------- folders


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The config.json dict of a model folder. Raises UnsupportedModelError if it is
    missing or not a JSON object."""
    return _read_object(Path(folder) / CONFIG, "a Hugging Face config")


def read_generation_config(folder: str | Path) -> dict[str, Any] | None:
    """The generation_config.json dict of a model folder, None where it has none.
    Raises UnsupportedModelError if it cannot be read or is not a JSON object."""
    path = Path(folder) / GENERATION_CONFIG
    return _read_object(path, "a generation config") if path.is_file() else None


def _read_object(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UnsupportedModelError(f"{path}: cannot read {what} ({err})") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path}: not a JSON object")
    return data


def is_hf_model_folder(path: str | Path) -> bool:
    """True for a folder with config.json and safetensors weights (one file or an index of shards)."""
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file())


def weight_files(folder: str | Path) -> dict[str, list[str]]:
    """The safetensors files of a model folder (names relative to it, in order)
    and the tensor names each holds.

    Reads only the headers (and the index, for sharded weights). Raises
    UnsupportedModelError for a folder without safetensors weights, an index
    whose ``weight_map`` is not {tensor: shard file in the folder}, a shard the
    index names that is missing, or an index entry its shard does not hold.
    """
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        files = {folder / WEIGHTS: None}
    elif (folder / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((folder / WEIGHTS_INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UnsupportedModelError(f"{folder / WEIGHTS_INDEX}: not a safetensors index ({err!r})") from None
        _check_weight_map(folder, weight_map)
        files = {}
        for name, file in weight_map.items():
            files.setdefault(folder / file, []).append(name)
        absent = sorted(str(f.name) for f in files if not f.is_file())
        if absent:
            raise UnsupportedModelError(f"{folder}: shard(s) named in {WEIGHTS_INDEX} are missing: {', '.join(absent)}")
    else:
        others = sorted(p.name for p in folder.glob("*.bin")) if folder.is_dir() else []
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        named = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        if named and not others:  # e.g. Mistral's consolidated.safetensors: its own tensor names, not transformers'
            hint = (f" (found {', '.join(named[:3])}: weights in another layout than transformers' saves; "
                    f"use the model's transformers files, {WEIGHTS} or {WEIGHTS_INDEX} with its shards)")
        raise UnsupportedModelError(f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX}{hint}")
    out = {}
    for path, listed in sorted(files.items()):
        try:
            with safe_open(str(path), framework="pt") as f:
                held = list(f.keys())
        except Exception as err:  # safetensors raises its own SafetensorError (and OSError) for a bad header
            raise UnsupportedModelError(f"{path}: not a readable safetensors file ({one_line(err)})") from None
        if listed is not None and set(listed) - set(held):
            raise UnsupportedModelError(f"{path}: lacks {', '.join(sorted(set(listed) - set(held)))}, "
                                        f"which {WEIGHTS_INDEX} places there")
        out[str(path.relative_to(folder))] = listed if listed is not None else held
    return out


def _check_weight_map(folder: Path, weight_map: Any) -> None:
    """An index's ``weight_map`` is {tensor name: file name of a shard in ``folder``}; a
    shard elsewhere would be read but neither hashed into the run identity nor seen by DVC."""
    where = folder / WEIGHTS_INDEX
    if not isinstance(weight_map, dict):
        raise UnsupportedModelError(f"{where}: weight_map is {json.dumps(weight_map)[:60]}, not an object "
                                    "{tensor name: shard file}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise UnsupportedModelError(f"{where}: weight_map names {json.dumps(file)[:60]} as the file of {name}, "
                                        "not a file name")
        path = Path(file)
        if path.is_absolute() or ".." in path.parts:
            raise UnsupportedModelError(f"{where}: weight_map places {name} in {file}, outside {folder}; "
                                        "shards must lie in the model folder")


def one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]


def load_hf_model(folder: str | Path) -> tuple[ModelConfig, Transformer]:
    """(config, model with fp32 weights on the CPU) from a Hugging Face model folder.

    ``folder`` holds config.json and ``model.safetensors`` or
    ``model.safetensors.index.json`` with its shards, in bf16, fp16 or fp32.
    The model is built on the meta device and given uninitialised storage, then
    each tensor is copied in from the memory-mapped file: no random init pass
    and no second copy of the weights, so peak host memory stays near the fp32
    weights plus the pages of the file mapping. Raises UnsupportedModelError
    (one line) for an unsupported config, before any weight is read, and for
    missing, unexpected or misshapen tensors, an unsupported dtype, or NaN or
    infinite values (damaged bytes behind an intact header).
    """
    folder = Path(folder)
    config = _config_of(folder)
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    _copy_weights(model, folder)
    return config, model


# The fields two configs must share for one's weights to mean the same in the other's model.
_SAME_COMPUTATION = ("vocab_size", "n_layer", "n_head", "d_model", "n_kv_head", "ffn_hidden", "head_dim", "rope_theta",
                     "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "rope_scaling", "family")


def load_hf_weights(model: Transformer, folder: str | Path) -> None:
    """Copy the weights of the Hugging Face folder into ``model`` (any device), in place.

    For a trainer that builds its model itself: ``model.config`` must equal the
    folder's (:func:`config_from_hf`) in everything but ``max_seq_len`` and
    ``init_std``. Call it before wrapping the model (DDP, FSDP, compile).
    Raises UnsupportedModelError naming the fields that differ, or as
    :func:`load_hf_model` does.
    """
    folder = Path(folder)
    theirs = _config_of(folder)
    differ = [f"{k} {getattr(model.config, k)!r} != {getattr(theirs, k)!r}" for k in _SAME_COMPUTATION
              if getattr(model.config, k) != getattr(theirs, k)]
    if differ:
        raise UnsupportedModelError(f"{folder}: the model's config differs from the folder's: {'; '.join(differ)}")
    _copy_weights(model, folder)


def _config_of(folder: Path) -> ModelConfig:
    try:
        return config_from_hf(read_hf_config(folder))
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{folder}: {err}") from None


def check_weights(folder: str | Path, config: ModelConfig) -> dict[str, list[str]]:
    """The folder's :func:`weight_files`, each tensor checked to fit a model of
    ``config`` by name, dtype and shape from the safetensors headers alone (the
    model is built on the meta device): the launcher's check, before any rank
    loads a weight. Raises UnsupportedModelError as :func:`load_hf_weights` does."""
    with torch.device("meta"):
        model = Transformer(config)
    files = weight_files(folder)
    _weight_plan(model, Path(folder), files)
    return files


def _weight_plan(model: Transformer, folder: Path, files: Mapping[str, list[str]]) -> dict[str, list[tuple[str, str]]]:
    """Which tensor of which file goes to which of ``model``'s parameters (file ->
    [(their name, our name)]), every name, dtype and shape checked from the headers."""
    config = model.config
    targets = dict(model.named_parameters())  # a tied head appears once, as the embedding
    plan: dict[str, list[tuple[str, str]]] = {}
    unexpected, bad = [], []
    for file, names in files.items():
        with safe_open(str(folder / file), framework="pt") as f:
            for key in names:
                if IGNORED.search(key):
                    continue  # transformers recomputes these
                # a stored head beside tied embeddings is not loaded, but must be the embedding (_check_stored_head)
                tied_head = key == "lm_head.weight" and config.tie_embeddings
                ours = "tok_embeddings.weight" if tied_head else _rename(key, FROM_HF)
                if ours not in targets:
                    unexpected.append(key)
                    continue
                piece = f.get_slice(key)
                dtype, shape = piece.get_dtype(), list(piece.get_shape())
                if dtype not in FILE_DTYPES:
                    bad.append(f"{key} is {dtype} (supported: {', '.join(FILE_DTYPES)})")
                elif shape != list(targets[ours].shape):
                    bad.append(f"{key} has shape {shape}, the config says {list(targets[ours].shape)}")
                if not tied_head:
                    plan.setdefault(file, []).append((key, ours))
    missing = sorted(set(targets) - {ours for pairs in plan.values() for _, ours in pairs})
    problems = [f"unexpected tensor(s) {_some(sorted(unexpected))}"] if unexpected else []
    problems += bad[:5] + ([f"{len(bad) - 5} more of another shape or dtype"] if len(bad) > 5 else [])
    if missing:
        problems.append(f"missing tensor(s) {_some([_rename(m, TO_HF) or m for m in missing])}")
    if missing == ["output.weight"]:  # transformers would leave the head randomly initialised
        problems.append("config.json has tie_word_embeddings false; if the model's head is its embedding, set it true")
    if unexpected and missing and all(_rename("model." + k, FROM_HF) in targets for k in unexpected):
        problems.append("the file's names lack the 'model.' prefix: it holds a backbone saved without its "
                        "*ForCausalLM wrapper")
    if problems:
        raise UnsupportedModelError(f"{folder}: weights do not fit {FAMILIES[config.family].architecture} "
                                    f"of this config: {'; '.join(problems)}")
    return plan


def _some(names: list[str], shown: int = 8) -> str:
    """The first ``shown`` names and how many more: a model of many layers lists
    hundreds, which would make the one line unreadable."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _copy_weights(model: Transformer, folder: Path) -> None:
    """Check every tensor's name, dtype and shape from the headers, then copy them in one by one."""
    model.tie_weights()  # to_empty (or a caller's .to()) may have untied them
    files = weight_files(folder)
    plan = _weight_plan(model, folder, files)
    targets = dict(model.named_parameters())
    non_finite = []
    with torch.no_grad():
        for file, pairs in plan.items():
            with safe_open(str(folder / file), framework="pt") as f:
                for key, ours in pairs:
                    targets[ours].copy_(f.get_tensor(key))  # one tensor at a time, cast to the model's dtype
                    if not _all_finite(targets[ours]):
                        non_finite.append(key)
    if non_finite:  # safetensors has no checksum: damaged bytes behind an intact header read as numbers
        raise UnsupportedModelError(f"{folder}: NaN or infinite values in {_some(non_finite, 5)}: the weights are "
                                    "damaged; fetch the model again")
    if model.config.tie_embeddings:
        _check_stored_head(model, folder, files)


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """True when no value is NaN or infinite; checked in chunks, so that a large
    embedding needs no boolean copy of its own size."""
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


def _check_stored_head(model: Transformer, folder: Path, files: Mapping[str, list[str]]) -> None:
    for file, names in files.items():
        if "lm_head.weight" in names:
            with safe_open(str(folder / file), framework="pt") as f:
                head = f.get_tensor("lm_head.weight")
            embedding = model.tok_embeddings.weight
            if not torch.equal(head.to(embedding), embedding):
                raise UnsupportedModelError(
                    f"{folder}: tie_word_embeddings is true but the stored lm_head.weight differs from "
                    "model.embed_tokens.weight (transformers 4 would ignore it, transformers 5 unties the two): "
                    "set tie_word_embeddings in config.json to what the model is")
