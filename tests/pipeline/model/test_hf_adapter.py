"""Tests for pipeline/model/hf_adapter.py and pipeline/model/families.py: Hugging Face
folders of each family load into our model and compute transformers' logits,
in every file layout (tied or not, sharded, bf16/fp16/fp32); config.json reads
both transformers 4 and 5 styles and round-trips; everything we do not
implement is refused before any work, in one line."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import StageError
from pipeline.model import hf_adapter
from pipeline.model.families import FAMILIES
from pipeline.model.hf_adapter import (
    UnsupportedModelError,
    check_weights,
    config_from_hf,
    hf_config,
    is_hf_model_folder,
    load_hf_model,
    load_hf_weights,
)
from pipeline.model.transformer import Transformer
from tests.hf_models import FAMILIES as HF_FAMILIES
from tests.hf_models import LLAMA3_ROPE, save_tiny_hf_model, tiny_hf_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 384
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


def tokens(B: int = 2, T: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(folder, ours: Transformer, idx: torch.Tensor | None = None) -> float:
    """Largest |logit difference| between transformers' model of ``folder`` and ``ours``."""
    idx = tokens() if idx is None else idx
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return (theirs(input_ids=idx).logits - ours(idx)).abs().max().item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A lazily built tiny folder per (family, options), shared by the module."""
    made = {}

    def get(family: str, **options):
        key = (family, *sorted(options.items()))
        if key not in made:
            name = "-".join([family, *(f"{k}={v}" for k, v in sorted(options.items()))]).replace(".", "_")
            made[key] = save_tiny_hf_model(family, tmp_path_factory.mktemp(name), vocab_size=VOCAB, **options)
        return made[key]

    return get


# --------------------------------------------------------------------------- logits parity


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_imported_model_computes_transformers_logits(folders, family, tie):
    folder = folders(family, tie=tie)
    config, model = load_hf_model(folder)
    assert config.family == family and config.tie_embeddings == tie
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    # Measured: exactly 0.0 on this CPU (same operations in the same order); logits are of order 1-5.
    assert max_diff(folder, model) <= 1e-5


def test_each_family_uses_its_features(folders):
    """The parity above means something: each family's extra really is in play."""
    qwen2 = load_hf_model(folders("qwen2"))[1]
    assert qwen2.layers[0].attention.wq.bias.abs().max() > 0.05
    cfg3, qwen3 = load_hf_model(folders("qwen3"))
    assert cfg3.head_dim == 32 != cfg3.d_model // cfg3.n_head
    assert qwen3.layers[0].attention.wq.weight.shape == (cfg3.n_head * 32, cfg3.d_model)
    assert (qwen3.layers[0].attention.q_norm.weight - 1).abs().max() > 0.05


def test_llama3_rope_scaling_matches_transformers_and_matters(folders):
    folder = folders("llama", rope_scaling=True)
    config, model = load_hf_model(folder)
    assert config.rope_scaling == LLAMA3_ROPE
    idx = tokens(1, 120)  # long enough for the slow, stretched frequencies to turn visibly
    assert max_diff(folder, model, idx) <= 1e-5
    unscaled = Transformer(config.__class__(**{**config.to_dict(), "rope_scaling": None}))
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unscaled(idx) - model(idx)).abs().max() > 1e-3


def test_sharded_folder_loads_like_a_single_file(folders):
    sharded, single = folders("qwen2", sharded=True), folders("qwen2")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    files = hf_adapter.weight_files(sharded)
    assert list(files) == sorted(p.name for p in sharded.glob("model-*.safetensors"))  # names, relative
    assert sorted(k for keys in files.values() for k in keys) == sorted(
        json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"])
    assert is_hf_model_folder(sharded) and is_hf_model_folder(single)
    a, b = load_hf_model(sharded)[1], load_hf_model(single)[1]
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_files_become_exact_fp32_weights(folders, dtype):
    folder = folders("qwen3", dtype=dtype, tie=False)
    _, model = load_hf_model(folder)
    stored = load_file(str(folder / "model.safetensors"))
    ours = hf_adapter.to_hf(model.state_dict(), model.config)
    assert ours.keys() == stored.keys()
    for key, tensor in stored.items():
        assert tensor.dtype == dtype
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], tensor.float()), key


def test_loading_draws_no_random_numbers_and_leaves_nothing_on_meta(folders):
    folder = folders("llama")
    state = torch.random.get_rng_state()
    _, model = load_hf_model(folder)
    assert torch.equal(torch.random.get_rng_state(), state)  # no random init pass
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_load_hf_weights_into_a_built_model(folders):
    folder = folders("qwen2", tie=False)
    config, reference = load_hf_model(folder)
    model = Transformer(config)  # randomly initialised, as a trainer builds it
    load_hf_weights(model, folder)
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())
    # every field that changes what the weights compute, though the weights fit
    for change, words in [({"norm_eps": 1e-5}, "norm_eps 1e-05 != 1e-06"),
                          ({"rope_theta": 1e4}, "rope_theta 10000.0 != "),
                          ({"rope_scaling": LLAMA3_ROPE}, "rope_scaling {'rope_type': 'llama3'")]:
        other = Transformer(config.__class__(**{**config.to_dict(), **change}))
        with pytest.raises(UnsupportedModelError, match=re.escape(f"differs from the folder's: {words}")):
            load_hf_weights(other, folder)


def test_a_model_of_more_than_ten_layers_loads_every_layer(tmp_path):
    """Two-digit layer numbers map like one-digit ones (model.layers.10.* is layers.10.*)."""
    folder = save_tiny_hf_model("llama", tmp_path / "m", vocab_size=VOCAB, num_hidden_layers=11)
    _, model = load_hf_model(folder)
    stored = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.layers[10].feed_forward.w2.weight, stored["model.layers.10.mlp.down_proj.weight"])


# --------------------------------------------------------------------------- weights that do not fit


def rewrite_weights(src, dst, change):
    """Copy folder ``src`` to ``dst`` with ``change(tensors)`` applied to its model.safetensors."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_stored_head_equal_to_the_tied_embedding_is_ignored_and_a_different_one_refused(folders, tmp_path):
    def add_copy(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    folder = rewrite_weights(folders("llama", tie=True), tmp_path / "same", add_copy)
    _, model = load_hf_model(folder)
    assert model.output.weight is model.tok_embeddings.weight
    assert max_diff(folder, model) <= 1e-5
    # in a bf16 file the copy is compared with the fp32 embedding made from it
    half = rewrite_weights(folders("llama", tie=True, dtype=torch.bfloat16), tmp_path / "same-bf16", add_copy)
    _, model = load_hf_model(half)
    assert model.output.weight is model.tok_embeddings.weight

    def add_other(t):
        t["lm_head.weight"] = torch.randn_like(t["model.embed_tokens.weight"])

    folder = rewrite_weights(folders("llama", tie=True), tmp_path / "other", add_other)
    with pytest.raises(UnsupportedModelError, match="stored lm_head.weight differs from model.embed_tokens.weight"):
        load_hf_model(folder)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}),
     r"unexpected tensor\(s\) model.layers.0.self_attn.o_proj.bias"),
    (lambda t: t.update({"model.norm.weight": torch.ones(32)}), r"model.norm.weight has shape \[32\], the config says \[64\]"),
    (lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}), r"model.norm.weight is I8"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()}), r"model.norm.weight is F64"),
    # a tied model stored as its head alone: the embedding is missing, not taken from the head
    (lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}),
     r"missing tensor\(s\) model.embed_tokens.weight$"),
    # a head stored beside tied embeddings (qwen2 here ties them) is checked from the headers too: the launcher's
    # check passed it and every rank then failed on loading it
    (lambda t: t.update({"lm_head.weight": torch.zeros(3, 64)}),
     r"lm_head.weight has shape \[3, 64\], the config says"),
    (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].to(torch.int8)}), r"lm_head.weight is I8"),
], ids=["missing", "unexpected", "shape", "dtype", "float64", "head-without-embedding", "tied-head-shape",
        "tied-head-dtype"])
def test_weights_that_do_not_fit_are_named_in_one_line(folders, tmp_path, change, message):
    folder = rewrite_weights(folders("qwen2"), tmp_path / "m", change)
    with pytest.raises(UnsupportedModelError, match=message) as err:
        load_hf_model(folder)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)
    # the launcher's check finds the same from the headers, with the model on the meta device
    with pytest.raises(UnsupportedModelError) as headers_only:
        check_weights(folder, config_from_hf(json.loads((folder / "config.json").read_text())))
    assert str(headers_only.value) == str(err.value)
    assert check_weights(folders("qwen2"), config_from_hf(json.loads((folders("qwen2") / "config.json").read_text())))


def test_a_tied_model_whose_config_says_untied_is_refused_with_the_likely_cause(folders, tmp_path):
    """transformers would give it a random head; the line says which setting would fit the file."""
    folder = shutil.copytree(folders("llama", tie=True), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(UnsupportedModelError, match=r"missing tensor\(s\) lm_head.weight; config.json has "
                       r"tie_word_embeddings false; if the model's head is its embedding, set it true$"):
        load_hf_model(folder)
    with pytest.raises(UnsupportedModelError) as err:  # another missing tensor besides: no such guess
        load_hf_model(rewrite_weights(folders("llama", tie=False), tmp_path / "two",
                                      lambda t: [t.pop("lm_head.weight"), t.pop("model.norm.weight")]))
    assert "missing tensor(s) model.norm.weight, lm_head.weight" in str(err.value)
    assert "tie_word_embeddings" not in str(err.value)


def test_weights_damaged_behind_an_intact_header_are_refused_not_loaded(folders, tmp_path):
    def damage(t):  # what bytes overwritten inside the data look like: NaN, inf, for a few values
        t["model.layers.1.mlp.up_proj.weight"].view(-1)[5] = float("nan")
        t["model.norm.weight"][0] = float("inf")

    folder = rewrite_weights(folders("qwen2", dtype=torch.bfloat16), tmp_path / "m", damage)
    with pytest.raises(UnsupportedModelError, match=r"NaN or infinite values in .*(up_proj|norm).*(up_proj|norm)"
                       r".*fetch the model again") as err:
        load_hf_model(folder)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)
    config, model = load_hf_model(folders("qwen2", dtype=torch.bfloat16))
    with pytest.raises(UnsupportedModelError, match="NaN or infinite"):
        load_hf_weights(model, folder)


def test_a_backbone_saved_without_its_wrapper_is_named_in_a_short_line(folders, tmp_path):
    """A LlamaModel's state dict under a LlamaForCausalLM config: every name lacks 'model.'. The line
    names a few of each kind and says what the names lack, rather than listing every tensor twice."""
    def strip(t):
        for key in list(t):
            t[key.removeprefix("model.")] = t.pop(key)

    folder = rewrite_weights(folders("llama"), tmp_path / "m", strip)
    with pytest.raises(UnsupportedModelError) as err:
        load_hf_model(folder)
    message = str(err.value)
    assert "unexpected tensor(s) embed_tokens.weight, layers.0.input_layernorm.weight" in message
    assert message.count(" and 12 more") == 2  # 20 tensors of each kind, 8 shown
    assert message.endswith("the file's names lack the 'model.' prefix: it holds a backbone saved without its "
                            "*ForCausalLM wrapper")

    def stray(t):  # one name without the prefix beside an unrelated unexpected tensor: no backbone
        t["norm.weight"] = t.pop("model.norm.weight")
        t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)

    with pytest.raises(UnsupportedModelError) as err:
        load_hf_model(rewrite_weights(folders("llama"), tmp_path / "stray", stray))
    assert "unexpected tensor(s) model.layers.0.self_attn.o_proj.bias, norm.weight" in str(err.value)
    assert "prefix" not in str(err.value)


def test_rotary_buffers_that_older_checkpoints_saved_are_ignored(folders, tmp_path):
    """transformers recomputes rotary_emb.inv_freq rather than loading it, and so do we."""
    def add(t):
        for i in range(2):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    folder = rewrite_weights(folders("llama"), tmp_path / "m", add)
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    assert "model.layers.1.self_attn.rotary_emb.inv_freq" in check_weights(folder, config)["model.safetensors"]
    ours, reference = load_hf_model(folder)[1].state_dict(), load_hf_model(folders("llama"))[1].state_dict()
    assert ours.keys() == reference.keys() and all(torch.equal(v, reference[k]) for k, v in ours.items())


def test_model_safetensors_wins_over_an_index_beside_it_as_in_transformers(folders, tmp_path):
    """transformers looks for model.safetensors first; a stale index left beside it is not read."""
    folder = shutil.copytree(folders("llama"), tmp_path / "m")
    stale = {"weight_map": {"model.norm.weight": "gone.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(stale))
    assert list(hf_adapter.weight_files(folder)) == ["model.safetensors"]
    assert max_diff(folder, load_hf_model(folder)[1]) <= 1e-5


def test_an_index_placing_a_tensor_in_a_shard_that_lacks_it_is_one_line(folders, tmp_path):
    folder = shutil.copytree(folders("llama", sharded=True), tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    moved = next(k for k, v in index["weight_map"].items() if v == first)
    index["weight_map"][moved] = second
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError, match=re.escape(
            f"{second}: lacks {moved}, which model.safetensors.index.json places there")) as err:
        load_hf_model(folder)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [("[1, 2]", "config.json: not a JSON object"),
                                           ('{"vocab_size": ', "config.json: cannot read a Hugging Face config"),
                                           (None, "config.json: cannot read a Hugging Face config")],
                         ids=["list", "truncated", "absent"])
def test_a_config_json_that_is_not_an_object_is_one_line(folders, tmp_path, text, message):
    folder = shutil.copytree(folders("llama"), tmp_path / "m")
    if text is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match=re.escape(message)) as err:
        load_hf_model(folder)
    assert "\n" not in str(err.value)


def test_a_missing_shard_or_weights_file_is_named(folders, tmp_path):

    folder = shutil.copytree(folders("llama", sharded=True), tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(UnsupportedModelError, match=f"missing: {shard.name}"):
        load_hf_model(folder)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    (bare / "pytorch_model.bin").write_bytes(b"")
    assert not is_hf_model_folder(bare)
    with pytest.raises(UnsupportedModelError, match="no model.safetensors.*found pytorch_model.bin"):
        load_hf_model(bare)
    (bare / "pytorch_model.bin").unlink()
    (bare / "consolidated.safetensors").write_bytes(b"")  # Mistral's own layout, shipped beside transformers'
    with pytest.raises(UnsupportedModelError, match=r"no model.safetensors.*found consolidated.safetensors: "
                                                    r"weights in another layout"):
        load_hf_model(bare)


@pytest.mark.parametrize("weight_map, message", [
    ("model.safetensors", r"weight_map is \"model.safetensors\", not an object"),
    ({"model.norm.weight": 3}, r"weight_map names 3 as the file of model.norm.weight, not a file name"),
    ({"model.norm.weight": "../elsewhere/model.safetensors"}, r"places model.norm.weight in \.\./elsewhere.*outside"),
    ({"model.norm.weight": "/elsewhere/model.safetensors"}, r"places model.norm.weight in /elsewhere/model.*outside"),
], ids=["not-a-map", "not-a-name", "outside", "absolute"])
def test_an_index_whose_weight_map_is_not_shards_in_the_folder_is_one_line(folders, tmp_path, weight_map, message):

    folder = shutil.copytree(folders("llama", sharded=True), tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(UnsupportedModelError, match=message) as err:
        hf_adapter.weight_files(folder)
    assert "\n" not in str(err.value) and "model.safetensors.index.json" in str(err.value)


# --------------------------------------------------------------------------- config.json


def saved_config(family: str, **kwargs) -> dict:
    """config.json as save_pretrained writes it for a tiny model of ``family``."""
    config = tiny_hf_config(family, **kwargs)
    config.architectures = [ARCHITECTURES[family]]
    return json.loads(config.to_json_string())


@pytest.mark.parametrize("rope_scaling", [False, True], ids=["rope", "llama3"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_config_round_trip(family, rope_scaling):
    original = saved_config(family, vocab_size=VOCAB, rope_scaling=rope_scaling)
    config = config_from_hf(original)
    ours = hf_config(config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert ours["architectures"] == [ARCHITECTURES[family]] and ours["model_type"] == family
    assert config_from_hf(ours) == config
    # what transformers reads from ours is what it read from the original
    theirs = transformers.AutoConfig.for_model(**ours).to_dict()
    for key, value in original.items():
        if key not in ("dtype", "transformers_version", "max_window_layers"):
            assert theirs[key] == value, key
    # and updating the original with our values changes nothing but the dtype
    merged = hf_config(config, original=original)
    assert {k for k in merged if merged[k] != original.get(k, "absent")} == {"dtype", "torch_dtype"}
    assert merged["dtype"] == merged["torch_dtype"] == "float32"


@pytest.mark.parametrize("style", ["transformers-5", "transformers-4"])
def test_our_values_replace_the_originals_in_its_own_style(style):
    import dataclasses

    original = saved_config("llama", rope_scaling=True, tie=False)
    if style == "transformers-4":
        rope = dict(original.pop("rope_parameters"))
        original.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    config = config_from_hf(original)
    config = dataclasses.replace(config, vocab_size=512, rope_theta=2e5, tie_embeddings=True, norm_eps=1e-5,
                                 head_dim=32, rope_scaling={**config.rope_scaling, "factor": 4.0})
    merged = hf_config(config, original=original)
    assert config_from_hf(merged) == config
    assert (merged["vocab_size"], merged["tie_word_embeddings"], merged["rms_norm_eps"]) == (512, True, 1e-5)
    assert ("rope_parameters" in merged) == (style == "transformers-5")  # no key the original lacked
    assert ("rope_theta" in merged) == (style == "transformers-4")
    assert merged["bos_token_id"] == original["bos_token_id"] == 1
    assert hf_config(config, original=original, bos_token_id=7)["bos_token_id"] == 7


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_merged_qwen_config_of_another_depth_lists_a_layer_type_per_layer(family):
    """transformers 5 refuses a config.json whose layer_types and num_hidden_layers disagree."""
    import dataclasses

    original = saved_config(family)
    config = dataclasses.replace(config_from_hf(original), n_layer=3)
    merged = hf_config(config, original=original)
    assert merged["layer_types"] == ["full_attention"] * 3
    assert transformers.AutoConfig.for_model(**merged).num_hidden_layers == 3
    assert config_from_hf(merged) == config


@pytest.mark.parametrize("architectures", ["absent", None, []], ids=["absent", "null", "empty"])
def test_an_original_naming_only_its_model_type_exports_naming_its_architecture(architectures):
    """config_from_hf takes such a file by its model_type; the export names the class to build,
    as every config.json that save_pretrained writes does (vLLM, TGI and the Hub read it)."""
    original = {k: v for k, v in saved_config("qwen2").items() if k != "architectures"}
    if architectures != "absent":
        original["architectures"] = architectures
    merged = hf_config(config_from_hf(original), original=original)
    assert merged["architectures"] == ["Qwen2ForCausalLM"]
    assert {k for k in merged if merged[k] != original.get(k, "absent")} == {"architectures", "dtype", "torch_dtype"}


def test_an_original_s_auto_map_is_left_out_for_the_export_needs_no_custom_code(tmp_path):
    """The code files an auto_map names are not exported (the model is the stock class), and
    from_pretrained(trust_remote_code=True), as many scripts call it, would look for them and fail."""
    original = {**saved_config("llama"), "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    merged = hf_config(config_from_hf(saved_config("llama")), original=original)  # config_from_hf refuses the original
    assert "auto_map" not in merged and merged["architectures"] == ["LlamaForCausalLM"]
    folder = tmp_path / "export"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**merged)).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(merged))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_an_auto_map_that_names_no_code_is_no_custom_code():
    assert config_from_hf({**saved_config("llama"), "auto_map": {"AutoModelForCausalLM": None, "AutoConfig": ""}}) == \
        config_from_hf(saved_config("llama"))


def test_swish_is_transformers_other_name_for_silu():
    assert config_from_hf(saved_config("llama") | {"hidden_act": "swish"}) == config_from_hf(saved_config("llama"))
    activations = pytest.importorskip("transformers.activations")
    x = torch.linspace(-20, 20, 401)
    assert torch.equal(activations.ACT2FN["swish"](x), activations.ACT2FN["silu"](x))


def test_llama3_scaling_is_written_for_transformers_4_readers_too():
    """A reader of the legacy keys alone (transformers 4 knows no rope_parameters) sees the same RoPE:
    rope_theta at the top level, the scaling in rope_scaling without it."""
    config = config_from_hf(saved_config("llama", rope_scaling=True))
    ours = hf_config(config)
    assert ours["rope_scaling"] == LLAMA3_ROPE and ours["rope_theta"] == config.rope_theta
    assert config_from_hf({k: v for k, v in ours.items() if k != "rope_parameters"}) == config


def test_to_hf_makes_every_tensor_contiguous_as_safetensors_requires(tmp_path):
    config = config_from_hf(saved_config("llama", tie=False))
    state = Transformer(config).state_dict()
    state["output.weight"] = state["output.weight"].t().contiguous().t()  # the same values, column-major
    assert not state["output.weight"].is_contiguous()
    save_file(hf_adapter.to_hf(state, config), str(tmp_path / "model.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["lm_head.weight"], state["output.weight"])


def test_transformers_4_and_5_styles_read_alike():
    t5 = saved_config("llama", rope_scaling=True)
    assert "rope_theta" not in t5 and t5["rope_parameters"]["rope_type"] == "llama3"
    rope = dict(t5["rope_parameters"])
    t4 = {k: v for k, v in t5.items() if k != "rope_parameters"}
    t4.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert config_from_hf(t4) == config_from_hf(t5)
    assert config_from_hf(t5).rope_theta == 500000.0 and config_from_hf(t5).rope_scaling == LLAMA3_ROPE
    # the pre-4.43 spelling "type" and a null rope_scaling beside rope_theta
    old = {**t4, "rope_theta": 1e4, "rope_scaling": None}
    assert config_from_hf(old).rope_scaling is None and config_from_hf(old).rope_theta == 1e4
    typed = {**t4, "rope_scaling": {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "llama3"}}
    assert config_from_hf(typed) == config_from_hf(t5)


def test_our_config_json_loads_in_transformers_without_warnings(caplog):
    import warnings

    for family in HF_FAMILIES:
        config = config_from_hf(saved_config(family, rope_scaling=family == "llama"))
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="transformers"):
            warnings.simplefilter("error")
            theirs = transformers.AutoConfig.for_model(**hf_config(config, bos_token_id=1, eos_token_id=2))
        assert type(theirs).__name__ == f"{ARCHITECTURES[family][:-len('ForCausalLM')]}Config"
        assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_our_config_json_has_every_key_transformers_writes(family):
    """families.FAMILIES' extra_config and layer_types: a config.json of ours lists
    what transformers' own to_dict() lists for that family (Qwen's layer_types and
    max_window_layers, Llama's mlp_bias, ...), so other readers need no defaults."""
    original = saved_config(family)
    ours = hf_config(config_from_hf(original))
    assert set(original) - set(ours) <= {"transformers_version", "pretraining_tp"}  # a version stamp; Llama 2's 1


def test_keys_left_out_take_transformers_defaults():
    minimal = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 100, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 32}
    ours = config_from_hf(minimal)
    theirs = transformers.Qwen3Config(**{k: v for k, v in minimal.items() if k != "architectures"})
    assert (ours.head_dim, ours.n_kv_head, ours.max_seq_len, ours.norm_eps, ours.tie_embeddings, ours.rope_theta) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.max_position_embeddings, theirs.rms_norm_eps,
        theirs.tie_word_embeddings, theirs.rope_parameters["rope_theta"])


def test_a_mistral_config_without_sliding_window_has_transformers_default_window(caplog):
    hf = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 100, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "max_position_embeddings": 8192}
    theirs = transformers.MistralConfig(**json.loads(json.dumps(hf)))
    with caplog.at_level(logging.WARNING, logger="pipeline.model.hf_adapter"):
        assert config_from_hf(hf).max_seq_len == theirs.sliding_window == 4096
    assert "capped" in caplog.text


def test_llama3_rope_scaling_without_its_original_length_takes_max_position_embeddings_as_transformers_does():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 16384, "rope_scaling": scaling}
    ours = config_from_hf(hf)
    theirs = transformers.LlamaConfig(**json.loads(json.dumps(hf)))  # a copy: it fills rope_scaling in place
    assert ours.rope_scaling["original_max_position_embeddings"] == \
        theirs.rope_parameters["original_max_position_embeddings"] == 16384


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_an_explicit_null_means_what_it_means_to_transformers(family, caplog):
    """A config.json key set to null is not the key left out: Mistral v0.2's "sliding_window": null is full
    attention (not the 4096 default), "num_key_value_heads": null is one per head."""
    nulls = {"sliding_window": None, "max_position_embeddings": 8192,
             **({"num_key_value_heads": None} if family != "mistral" else {}),  # MistralConfig types it int
             **({"head_dim": None} if family != "qwen3" else {})}
    hf = {**saved_config(family), **nulls}
    with caplog.at_level(logging.WARNING, logger="pipeline.model.hf_adapter"):
        ours = config_from_hf(hf)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    assert (ours.n_kv_head, ours.max_seq_len, ours.head_dim) == (
        theirs.num_key_value_heads, 8192, theirs.head_dim or theirs.hidden_size // theirs.num_attention_heads)
    assert "capped" not in caplog.text
    if family == "qwen3":
        with pytest.raises(UnsupportedModelError, match="head_dim null: Qwen3ForCausalLM takes it as given"):
            config_from_hf({**hf, "head_dim": None})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_s_sliding_window_without_use_sliding_window_is_not_a_cap(family, caplog):
    """Qwen2.5's config.json carries sliding_window beside use_sliding_window false: full attention, no cap."""
    with caplog.at_level(logging.WARNING, logger="pipeline.model.hf_adapter"):
        config = config_from_hf({**saved_config(family), "sliding_window": 16, "use_sliding_window": False})
    assert config.max_seq_len == 128 and "capped" not in caplog.text


def test_mistral_sliding_window_caps_max_seq_len(folders, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.model.hf_adapter"):
        config = config_from_hf(saved_config("mistral", sliding_window=16))
    assert config.max_seq_len == 16
    assert "sliding_window 16 < max_position_embeddings 128: max_seq_len capped at 16" in caplog.text
    assert config_from_hf(saved_config("mistral", sliding_window=4096)).max_seq_len == 128  # wider than the model
    # within the window full attention is the window: transformers with the window agrees
    folder = folders("mistral", sliding_window=16)
    _, model = load_hf_model(folder)
    assert max_diff(folder, model, tokens(2, 16)) <= 1e-5
    with pytest.raises(ValueError, match="beyond max_seq_len 16"):
        model(tokens(1, 17))


UNSUPPORTED = {  # name: (family, config.json changes, the words the one line must hold)
    "gpt2": ("llama", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    "gemma": ("llama", {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
    "mixtral": ("mistral", {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "MixtralForCausalLM"),
    "no-architecture": ("llama", {"architectures": None, "model_type": "phi3"}, "model_type 'phi3'"),
    "two-architectures": ("llama", {"architectures": ["LlamaForCausalLM", "LlamaModel"]}, "LlamaModel"),
    "model-type-mismatch": ("llama", {"model_type": "mistral"}, "model_type is 'mistral'"),
    "linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                    "rope_type 'linear'"),
    "dynamic-rope": ("qwen2", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    "yarn-rope": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32}}, "rope_type 'yarn'"),
    "longrope": ("mistral", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
    "llama3-incomplete": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
                          "llama3 RoPE scaling lacks low_freq_factor, high_freq_factor"),
    "per-layer-rope": ("qwen2", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
                       "per-layer-type rope_parameters (full_attention, sliding_attention)"),
    "partial-rotary": ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    "partial-rotary-in-rope": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                             "partial_rotary_factor": 0.25}},
                               "partial_rotary_factor 0.25"),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 32}, "use_sliding_window true"),
    "qwen3-sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": 32}, "use_sliding_window true"),
    "sliding-layers": ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]},
                       "layer_types sliding_attention"),
    # a layer_types list of another length was read as all full attention; transformers 5 cannot build it
    "short-layer-types": ("qwen2", {"layer_types": ["full_attention"]},
                          "layer_types has 1 entries but num_hidden_layers is 2"),
    "long-layer-types": ("llama", {"layer_types": ["full_attention"] * 3},
                         "layer_types has 3 entries but num_hidden_layers is 2"),
    # custom modelling code, which from_pretrained(trust_remote_code=True) runs instead of the family's class
    "auto-map": ("llama", {"auto_map": {"AutoConfig": "configuration_x.XConfig",
                                        "AutoModelForCausalLM": "modeling_x.XForCausalLM"}},
                 "auto_map names custom code (configuration_x.XConfig, modeling_x.XForCausalLM)"),
    "auto-map-of-a-hub-repo": ("qwen2", {"auto_map": {"AutoModelForCausalLM": "org/repo--modeling_x.XForCausalLM",
                                                      "AutoTokenizer": ["org/repo--tok.XTokenizer", None]}},
                               "auto_map names custom code (org/repo--modeling_x.XForCausalLM, "
                               "org/repo--tok.XTokenizer)"),
    "string-auto-map": ("mistral", {"auto_map": "modeling_x.XForCausalLM"},
                        'auto_map is "modeling_x.XForCausalLM", not an object'),
    "empty-layer-types": ("qwen3", {"layer_types": []}, "layer_types has 0 entries but num_hidden_layers is 2"),
    "gelu": ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "mlp-bias": ("llama", {"mlp_bias": True}, "mlp_bias true"),
    "llama-attention-bias": ("llama", {"attention_bias": True}, "attention_bias true"),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}, "attention_bias true"),
    "attention-dropout": ("mistral", {"attention_dropout": 0.1}, "attention_dropout 0.1"),
    "quantized": ("qwen2", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config (gptq)"),
    "odd-head-dim": ("qwen3", {"head_dim": 15}, "head_dim = 15 must be even"),
    "no-vocab": ("llama", {"vocab_size": None}, "config.json lacks vocab_size"),
    # a rope_theta of 0 inside rope_parameters was read as absent and replaced by the default
    "zero-rope-theta": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
                        "rope_theta 0 (supported: a positive number)"),
    # likewise a 0 for the key/value heads (read as one per head) or llama3's original context (read as
    # max_position_embeddings): transformers cannot compute either
    "zero-kv-heads": ("llama", {"num_key_value_heads": 0}, "n_kv_head must be a positive integer (got 0)"),
    "zero-llama3-context": ("llama", {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4,
                                                          "original_max_position_embeddings": 0}},
                            "rope_scaling.original_max_position_embeddings must be a positive number (got 0)"),
    # transformers computes with 64.5; it was silently read as 64, logits off by ~0.2
    "fractional-llama3-context": ("llama", {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4,
                                                                "original_max_position_embeddings": 64.5}},
                                  "rope_scaling.original_max_position_embeddings must be a whole number (got 64.5)"),
    # json reads Infinity: an OverflowError traceback from init_from
    "infinite-llama3-context": ("llama", {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4,
                                                              "original_max_position_embeddings": float("inf")}},
                                "rope_scaling.original_max_position_embeddings must be a positive number (got inf)"),
    "zero-window": ("mistral", {"sliding_window": 0}, "sliding_window 0 (supported: a positive integer, or null"),
    "string-rope-theta": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
                          'rope_theta is "1e4", not a number'),
    # values of the wrong JSON type
    "string-rope-scaling": ("llama", {"rope_scaling": "linear"}, 'rope_scaling is "linear", not an object'),
    "string-window": ("mistral", {"sliding_window": "4096"}, 'sliding_window is "4096", not an integer'),
    "list-eps": ("qwen2", {"rms_norm_eps": [1e-6]}, "rms_norm_eps is [1e-06], not a number"),
    "string-tie": ("llama", {"tie_word_embeddings": "false"}, 'tie_word_embeddings is "false", not true or false'),
    "float-heads": ("qwen3", {"num_key_value_heads": 2.0}, "num_key_value_heads is 2.0, not an integer"),
    "bool-eps": ("qwen2", {"rms_norm_eps": True}, "rms_norm_eps is true, not a number"),
    "bool-layers": ("llama", {"num_hidden_layers": True}, "num_hidden_layers is true, not an integer"),
    "string-architectures": ("llama", {"architectures": "LlamaForCausalLM"},
                             'architectures is "LlamaForCausalLM", not a list'),
    # these ended in a TypeError or AttributeError traceback, or named a string "false" as true
    "null-architecture": ("llama", {"architectures": [None]}, "architectures is [null], not a list"),
    "string-quantization": ("qwen2", {"quantization_config": "gptq"}, 'quantization_config is "gptq", not an object'),
    "number-layer-types": ("qwen2", {"layer_types": [1, 2]}, "layer_types is [1, 2], not a list of strings"),
    "string-layer-types": ("qwen3", {"layer_types": "full_attention"},
                           'layer_types is "full_attention", not a list of strings'),
    "string-mlp-bias": ("llama", {"mlp_bias": "false"}, 'mlp_bias is "false", not true or false'),
    "string-dropout": ("mistral", {"attention_dropout": "0"}, 'attention_dropout is "0", not a number'),
    "list-activation": ("llama", {"hidden_act": ["silu"]}, 'hidden_act is ["silu"], not a string'),
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_models_are_refused_in_one_line(name, tmp_path):
    family, change, words = UNSUPPORTED[name]
    hf = {**saved_config(family), **change}
    with pytest.raises(UnsupportedModelError) as err:
        config_from_hf(hf)
    message = str(err.value)
    assert words in message and "\n" not in message and "supported" in message, message
    assert isinstance(err.value, StageError) and isinstance(err.value, ValueError)
    # a folder fails on its config.json, naming the folder, before any weight is read
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match=f"^{tmp_path}: "):
        load_hf_model(tmp_path)


def test_unsupported_lists_every_problem_and_what_is_supported():
    hf = {**saved_config("llama"), "hidden_act": "relu", "mlp_bias": True}
    with pytest.raises(UnsupportedModelError, match=r"hidden_act 'relu' \(supported: silu.*; mlp_bias true"):
        config_from_hf(hf)
    with pytest.raises(UnsupportedModelError, match="supported: " + ", ".join(ARCHITECTURES.values())):
        config_from_hf({**hf, "architectures": ["GPT2LMHeadModel"]})


def test_the_registry_matches_the_model():
    assert set(FAMILIES) == set(HF_FAMILIES) == set(ARCHITECTURES)
    for name, family in FAMILIES.items():
        assert family.architecture == ARCHITECTURES[name]
        config = config_from_hf(saved_config(name))
        # each family's state dict is exactly transformers' (biases, q/k norms), tied head left out
        theirs = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(name)).state_dict()
        with torch.device("meta"):
            ours = Transformer(config).state_dict()
        assert set(hf_adapter.to_hf(ours, config)) == set(theirs) - {"lm_head.weight"}


def test_a_generation_config_is_none_when_absent_and_one_line_when_not_an_object(tmp_path):
    assert hf_adapter.read_generation_config(tmp_path) is None
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7}')
    assert hf_adapter.read_generation_config(tmp_path) == {"temperature": 0.7}
    (tmp_path / "generation_config.json").write_text("[0.7]")
    with pytest.raises(UnsupportedModelError, match=r"generation_config\.json: not a JSON object$"):
        hf_adapter.read_generation_config(tmp_path)


@pytest.mark.parametrize("damage", [lambda b: b"not a safetensors file", lambda b: b"", lambda b: b[:-100],
                                    lambda b: b + b"\0" * 8], ids=["garbage", "empty", "truncated", "appended"])
def test_a_damaged_safetensors_file_is_one_line_naming_the_file(folders, tmp_path, damage):
    """A download cut short (or anything but a whole file) is refused on its header, before any tensor is read."""
    folder = shutil.copytree(folders("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(UnsupportedModelError, match=r"model\.safetensors: not a readable safetensors file") as err:
        load_hf_model(folder)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_every_familys_defaults_are_transformers_defaults(family):
    """families.FAMILIES' defaults, each family's own (Llama's 2048 positions,
    Qwen's 32 kv heads, Mistral's window): a config.json that leaves a key out
    builds the model transformers builds from it."""
    minimal = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": 100,
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 32}
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in minimal.items() if k != "architectures"})
    ours = config_from_hf(minimal)
    window = getattr(theirs, "sliding_window", None) if FAMILIES[family].sliding_window_everywhere else None
    positions = min(theirs.max_position_embeddings, window or theirs.max_position_embeddings)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    kv_heads = theirs.num_key_value_heads or theirs.num_attention_heads
    assert (ours.head_dim, ours.n_kv_head, ours.max_seq_len, ours.norm_eps, ours.tie_embeddings, ours.rope_theta) == (
        head_dim, kv_heads, positions, theirs.rms_norm_eps, theirs.tie_word_embeddings,
        theirs.rope_parameters["rope_theta"])
