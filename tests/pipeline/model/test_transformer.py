"""Tests for pipeline/model/transformer.py: shapes, masking, KV cache, presets,
accounting, a tiny overfit, and logit parity with transformers' Llama."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeline.model.transformer import (
    PRESETS,
    KVCache,
    ModelConfig,
    RMSNorm,
    Transformer,
    build_config,
    document_mask,
    flops_per_token,
    num_params,
)
from pipeline.training.loss import token_loss_sum

VOCAB = 97  # odd size, so a vocab/d_model mix-up shows up as a shape error


def tiny(**overrides) -> ModelConfig:
    return build_config("tiny", VOCAB, **overrides)


def model_for(config: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config).eval()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    return model_for(tiny())


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- forward and loss


def test_the_model_returns_logits(model):
    logits = model(tokens(3, 11))
    assert logits.shape == (3, 11, VOCAB)


def test_causality(model):
    idx = tokens(1, 16)
    changed = idx.clone()
    changed[0, 9] = (changed[0, 9] + 1) % VOCAB
    a = model(idx)
    b = model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert (a[:, 9:] - b[:, 9:]).abs().amax() > 1e-3


# --------------------------------------------------------------------------- document masking

STARTS = [0, 7, 15]  # three documents in a row of 24: [0, 7), [7, 15), [15, 24)
T_ROW = 24
SEGMENTS = torch.tensor([[0] * 7 + [1] * 8 + [2] * 9])  # (1, T_ROW)


def test_document_mask():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_document_mask_isolates_documents(model):
    idx = tokens(1, T_ROW)
    changed = idx.clone()
    changed[0, 8:15] = (changed[0, 8:15] + 1) % VOCAB  # perturb the middle document (not its first token)

    masked_a = model(idx, segment_ids=SEGMENTS)
    masked_b = model(changed, segment_ids=SEGMENTS)
    torch.testing.assert_close(masked_a[:, :7], masked_b[:, :7], rtol=0, atol=1e-6)  # earlier document
    torch.testing.assert_close(masked_a[:, 15:], masked_b[:, 15:], rtol=0, atol=1e-6)  # later document
    assert (masked_a[:, 8:15] - masked_b[:, 8:15]).abs().amax() > 1e-3  # the perturbed one did change

    # Without the mask the later document sees the change, so the check above can fail.
    plain_a = model(idx)
    plain_b = model(changed)
    assert (plain_a[:, 15:] - plain_b[:, 15:]).abs().amax() > 1e-3


def test_each_packed_document_matches_it_run_alone(model):
    idx = tokens(1, T_ROW)
    packed = model(idx, segment_ids=SEGMENTS)
    for start, end in zip(STARTS, STARTS[1:] + [T_ROW]):
        alone = model(idx[:, start:end])  # the document at the start of its own row
        torch.testing.assert_close(packed[:, start:end], alone, rtol=0, atol=1e-5)


def test_one_segment_equals_plain_causal(model):
    idx = tokens(2, 12)
    masked = model(idx, segment_ids=torch.zeros(2, 12, dtype=torch.long))
    plain = model(idx)
    torch.testing.assert_close(masked, plain, rtol=0, atol=1e-5)


def test_segment_ids_and_cache_are_exclusive(model):
    cache = KVCache(model.config, 1)
    with pytest.raises(ValueError, match="segment_ids and a KV cache"):
        model(tokens(1, 4), segment_ids=torch.zeros(1, 4, dtype=torch.long), cache=cache)


def test_start_pos_without_a_cache_is_an_error(model):
    with pytest.raises(ValueError, match="start_pos is only meaningful with a KV cache"):
        model(tokens(1, 4), start_pos=3)


# --------------------------------------------------------------------------- GQA, tying, init


def test_gqa_shapes():
    c = tiny()
    assert c.n_kv_head < c.n_head
    m = model_for(c)
    attn = m.layers[0].attention
    assert attn.wq.weight.shape == (c.n_head * c.head_dim, c.d_model)
    assert attn.wk.weight.shape == (c.n_kv_head * c.head_dim, c.d_model)
    assert attn.wv.weight.shape == (c.n_kv_head * c.head_dim, c.d_model)
    cache = KVCache(c, batch_size=2)
    assert cache.k.shape == (c.n_layer, 2, c.n_kv_head, c.max_seq_len, c.head_dim)
    logits = m(tokens(2, 5))
    assert logits.shape == (2, 5, VOCAB)


def test_gqa_equals_multi_head_with_each_kv_head_copied_to_its_group():
    gqa = model_for(tiny())
    c = gqa.config
    n_rep, hd = c.n_head // c.n_kv_head, c.head_dim
    mha = model_for(tiny(n_kv_head=c.n_head))
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # query head h reads kv head h // n_rep
            state[key] = value.view(c.n_kv_head, hd, c.d_model).repeat_interleave(n_rep, 0).reshape(-1, c.d_model)
    mha.load_state_dict(state)
    idx = tokens(2, 10)
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], rtol=0, atol=1e-5)


def test_weight_tying():
    tied = model_for(tiny(tie_embeddings=True))
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    untied = model_for(tiny(tie_embeddings=False))
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    c = tied.config
    assert num_params(untied) - num_params(tied) == c.vocab_size * c.d_model
    assert num_params(tied) == num_params(tied.config)
    assert num_params(untied) == num_params(untied.config)


def test_meta_build_then_init_weights_restores_tying():
    with torch.device("meta"):
        m = Transformer(tiny())
    m.to_empty(device="cpu")
    m.init_weights()
    assert m.output.weight is m.tok_embeddings.weight
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_init_scales_residual_projections():
    c = tiny(d_model=128, n_head=4, n_kv_head=4, n_layer=8)
    m = model_for(c)
    block = m.layers[3]
    residual_std = c.init_std / math.sqrt(2 * c.n_layer)
    assert block.attention.wq.weight.std().item() == pytest.approx(c.init_std, rel=0.05)
    assert block.feed_forward.w1.weight.std().item() == pytest.approx(c.init_std, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(block.attention_norm.weight, torch.ones(c.d_model))
    assert torch.equal(m.norm.weight, torch.ones(c.d_model))


def test_an_untied_embedding_and_head_start_at_init_std():
    c = tiny(tie_embeddings=False, init_std=0.05)
    m = model_for(c)
    assert m.tok_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert m.output.weight.std().item() == pytest.approx(0.05, rel=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_llama_bit_for_bit(dtype):
    """eps counts (inputs near zero), and a half-precision input is cast back
    before the scale, as LlamaRMSNorm does."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(16, eps=1e-5), llama.LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(1 + torch.randn(16, generator=g))
        theirs.weight.copy_(ours.weight)
    x = (torch.randn(3, 16, generator=g) * 1e-3).to(dtype)  # mean square ~1e-6: eps = 1e-5 dominates
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours(x * 1e3), theirs(x * 1e3))


# --------------------------------------------------------------------------- KV cache


def test_kv_cache_decoding_matches_full_forward(model):
    idx = tokens(2, 14)
    full = model(idx)

    cache = KVCache(model.config, batch_size=2, max_len=14)
    steps = [model(idx[:, :5], cache=cache)]  # prefill 5 tokens
    steps.append(model(idx[:, 5:8], cache=cache, start_pos=5))  # a chunk of 3 after the prefill
    for pos in range(8, 14):  # then one token at a time
        steps.append(model(idx[:, pos:pos + 1], cache=cache, start_pos=pos))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


# The other families' options, each with its parameters perturbed off their init
# (biases 0 and norm scales 1 would hide a bias or norm dropped on one path).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
FAMILY_OPTIONS = {
    "qwen2": dict(family="qwen2", qkv_bias=True),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=32),  # n_head * head_dim = 128 != d_model = 64
    "llama3-rope": dict(rope_scaling=LLAMA3),
}


def perturbed(config: ModelConfig) -> Transformer:
    m = model_for(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


@pytest.mark.parametrize("name", FAMILY_OPTIONS)
def test_kv_cache_decoding_matches_full_forward_for_each_family(name):
    m = perturbed(tiny(**FAMILY_OPTIONS[name]))
    idx = tokens(2, 14)
    full = m(idx)
    cache = KVCache(m.config, batch_size=2, max_len=14)
    assert cache.k.shape[-1] == m.config.head_dim
    steps = [m(idx[:, :5], cache=cache)] + [m(idx[:, p:p + 1], cache=cache, start_pos=p) for p in range(5, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_qk_norms_use_norm_eps():
    """Qwen3's q_norm and k_norm take rms_norm_eps, as transformers' do."""
    c = tiny(**FAMILY_OPTIONS["qwen3"], norm_eps=0.5)
    x = torch.randn(2, 3, 4, c.head_dim, generator=torch.Generator().manual_seed(0)) * 0.1
    for layer in model_for(c).layers:
        for norm in (layer.attention.q_norm, layer.attention.k_norm):
            torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.5))


def test_family_options_shape_the_model():
    q2 = model_for(tiny(**FAMILY_OPTIONS["qwen2"])).layers[0].attention
    assert q2.wq.bias.shape == (64,) and q2.wk.bias.shape == q2.wv.bias.shape == (32,) and q2.wo.bias is None
    assert torch.equal(q2.wq.bias, torch.zeros(64))
    c3 = tiny(**FAMILY_OPTIONS["qwen3"])
    q3 = model_for(c3).layers[0].attention
    assert q3.wq.weight.shape == (4 * 32, 64) and q3.wk.weight.shape == (2 * 32, 64) and q3.wo.weight.shape == (64, 128)
    assert q3.q_norm.weight.shape == q3.k_norm.weight.shape == (32,)
    assert not hasattr(model_for(tiny()).layers[0].attention, "q_norm")


@pytest.mark.parametrize("name", FAMILY_OPTIONS)
def test_accounting_for_each_family(name):
    c = tiny(**FAMILY_OPTIONS[name])
    m = model_for(c)
    assert num_params(m) == num_params(c)
    assert num_params(m, exclude_embedding=True) == num_params(c, exclude_embedding=True)
    matmul_weights = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))
    assert flops_per_token(c, 50) == 6 * matmul_weights + 12 * c.n_layer * c.n_head * c.head_dim * 50


def test_new_fields_stay_out_of_to_dict_at_their_defaults():
    """Run fingerprints and checkpoint meta of a plain model are built from to_dict:
    the options added for other families must not change them."""
    assert set(tiny().to_dict()) == {"vocab_size", "n_layer", "n_head", "d_model", "n_kv_head", "ffn_hidden",
                                     "multiple_of", "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings",
                                     "init_std"}
    assert tiny(head_dim=16) == tiny() and "head_dim" not in tiny(head_dim=16).to_dict()
    for options in FAMILY_OPTIONS.values():
        c = tiny(**options)
        assert ModelConfig(**c.to_dict()) == c
        assert set(options) <= set(c.to_dict())


def test_llama3_rope_keeps_fast_frequencies_and_stretches_slow_ones():
    from pipeline.model.transformer import llama3_inv_freq

    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    # wavelengths 2*pi/inv_freq: 6.3, 19.9, 62.8, 199, ... positions; with an original
    # context of 64: < 64/4 = 16 kept, > 64/1 = 64 divided by factor, in between blended
    out = llama3_inv_freq(inv_freq, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
    assert torch.equal(out[:1], inv_freq[:1])
    assert torch.equal(out[3:], inv_freq[3:] / 8.0)
    assert ((out[1:3] < inv_freq[1:3]) & (out[1:3] > inv_freq[1:3] / 8.0)).all()


def test_llama3_rope_blends_continuously_into_both_bands_at_their_edges():
    """A wavelength exactly at an edge (64 = original / low_freq_factor, 16 = original /
    high_freq_factor; both exact in fp32) is in the blended band, as in transformers:
    the blend there equals the neighbouring band's value."""
    from pipeline.model.transformer import llama3_inv_freq

    inv_freq = 2 * math.pi / torch.tensor([64.0, 16.0])
    assert torch.equal(2 * math.pi / inv_freq, torch.tensor([64.0, 16.0]))
    out = llama3_inv_freq(inv_freq, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
    torch.testing.assert_close(out, torch.stack([inv_freq[0] / 8.0, inv_freq[1]]))


def test_kv_cache_overflow_is_an_error(model):
    cache = KVCache(model.config, batch_size=1, max_len=4)
    with pytest.raises(ValueError, match="KV cache holds 4"):
        model(tokens(1, 5), cache=cache)


# --------------------------------------------------------------------------- config, presets, accounting

PRESET_CLASSES = {  # preset -> (low, high) parameter count at vocab 50304
    "small": (100e6, 170e6),
    "medium": (300e6, 420e6),
    "large": (650e6, 900e6),
    "xl": (1.3e9, 1.8e9),
}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_count(name):
    config = build_config(name, 50304)
    with torch.device("meta"):  # no memory, even for xl
        model = Transformer(config)
    assert num_params(model) == num_params(config)
    assert num_params(model, exclude_embedding=True) == num_params(config, exclude_embedding=True)
    low, high = PRESET_CLASSES.get(name, (0, 100e6))
    assert low <= num_params(config) <= high


def test_mini_is_small_enough_for_a_cpu_run():
    assert 1e6 <= num_params(build_config("mini", 8192)) <= 10e6


def test_build_config_overrides_and_derivations():
    c = build_config("small", 1000, n_layer=3, max_seq_len=256, ffn_hidden=None)
    assert (c.n_layer, c.d_model, c.n_head, c.max_seq_len) == (3, 768, 12, 256)
    assert c.n_kv_head == 12  # derived: plain multi-head
    assert c.ffn_hidden == 2048  # derived: 256 * ceil(int(8 * 768 / 3) / 256)
    assert build_config("small", 1000, d_model=384, n_head=6).ffn_hidden == 1024

    # multiple_of rounds the derived width: int(8 * 64 / 3) = 170 -> 3 * 64
    assert build_config(None, 1000, n_layer=1, d_model=64, n_head=2, multiple_of=64).ffn_hidden == 192
    # a None override (a schema's unset optional field) leaves the preset's value
    assert build_config("tiny", 1000, n_layer=None, d_model=None).to_dict() == build_config("tiny", 1000).to_dict()

    c = build_config(None, 1000, n_layer=1, d_model=32, n_head=2, ffn_hidden=40)
    assert c.ffn_hidden == 40 and c.n_kv_head == 2
    assert ModelConfig(**c.to_dict()) == c


@pytest.mark.parametrize("args, message", [
    (("huge", 100), "unknown model preset 'huge'; presets are: tiny, mini, small"),
    (("tiny", 100, {"n_layers": 3}), "unknown model field.*n_layers"),
    ((None, 100, {"n_layer": 2}), "without a preset, give n_head, d_model"),
])
def test_build_config_errors(args, message):
    preset, vocab, *rest = args
    with pytest.raises(ValueError, match=message):
        build_config(preset, vocab, **(rest[0] if rest else {}))


@pytest.mark.parametrize("overrides, message", [
    ({"d_model": 65}, r"d_model \(65\) must be divisible by n_head \(4\)"),
    ({"d_model": 12, "n_head": 4, "n_kv_head": 4}, "head_dim = d_model / n_head = 3 must be even"),
    ({"n_kv_head": 3}, r"n_head \(4\) must be divisible by n_kv_head \(3\)"),
    ({"n_layer": 0}, r"n_layer must be a positive integer \(got 0\)"),
    ({"norm_eps": -1.0}, "norm_eps must be a positive number"),
    ({"d_model": 64.0}, "d_model must be a positive integer"),
    ({"n_layer": True}, r"n_layer must be a positive integer \(got True\)"),  # not one layer
    ({"rope_theta": 0.0}, "rope_theta must be a positive number"),
    ({"init_std": 0}, "init_std must be a positive number"),
    ({"norm_eps": math.inf}, r"norm_eps must be a positive number \(got inf\)"),
    ({"tie_embeddings": "yes"}, "tie_embeddings must be true or false"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"family": "gpt2"}, "family must be one of llama, qwen2, qwen3, mistral"),
    ({"family": "qwen2"}, r"family 'qwen2' \(Qwen2ForCausalLM\) has qkv_bias = true"),
    ({"qk_norm": True}, r"family 'llama' \(LlamaForCausalLM\) has qk_norm = false"),
    ({"head_dim": 15}, "head_dim = 15 must be even"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling must be null or {rope_type: llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor must be a positive"),
    # equal factors: transformers' blend divides by high - low
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor must be larger than low_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "beta_fast": 32}}, r"rope_scaling has unknown key\(s\) beta_fast"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 16.5}},
     r"original_max_position_embeddings must be a whole number \(got 16.5\)"),
    # config.json may say Infinity: this was an OverflowError traceback, and an infinite factor was taken
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": math.inf}},
     r"original_max_position_embeddings must be a positive number \(got inf\)"),
    ({"rope_scaling": {**LLAMA3, "factor": math.inf}}, r"rope_scaling.factor must be a positive number \(got inf\)"),
])
def test_family_option_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_config_validation_lists_every_problem():
    with pytest.raises(ValueError) as err:
        ModelConfig(vocab_size=0, n_layer=-1, n_head=4, d_model=64)
    assert "vocab_size" in str(err.value) and "n_layer" in str(err.value)


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_against_an_explicit_count(tie):
    c = tiny(tie_embeddings=tie)
    m = model_for(c)
    # every nn.Linear is a per-token matmul; the output head counts even when tied
    matmul_weights = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))
    seq_len = 50
    expected = 6 * matmul_weights + 12 * c.n_layer * c.n_head * c.head_dim * seq_len
    assert flops_per_token(c, seq_len) == expected
    # and by hand for the tiny shape: per layer q,o 64*64 each, k,v 64*32 each, MLP 3*64*256
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256
    assert expected == 6 * (2 * per_layer + VOCAB * 64) + 12 * 2 * 4 * 16 * seq_len


# --------------------------------------------------------------------------- training smoke test


def test_tiny_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    m = Transformer(tiny()).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    idx, targets = tokens(4, 32), tokens(4, 32, seed=2)
    losses = []
    for _ in range(50):
        loss = token_loss_sum(m(idx), targets) / targets.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)  # small init: near-uniform predictions
    assert losses[-1] < 0.1 * losses[0]


# --------------------------------------------------------------------------- Hugging Face parity


def to_llama(model: Transformer):
    """Load our weights into transformers.LlamaForCausalLM (a stand-in for the exporter)."""
    transformers = pytest.importorskip("transformers")
    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_hidden,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False,
    )
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight,
             "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        state["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers):
        for key, value in layer.state_dict().items():
            module, param = key.rsplit(".", 1)
            state[f"model.layers.{i}.{names[module]}.{param}"] = value
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    return hf


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers_llama(tie):
    config = tiny(tie_embeddings=tie, rope_theta=500.0, norm_eps=1e-6)  # non-defaults prove they are wired
    ours = model_for(config)
    hf = to_llama(ours)
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    idx = tokens(2, 40)
    with torch.no_grad():
        expected = hf(input_ids=idx).logits
    got = ours(idx)
    assert (got - expected).abs().max().item() < 1e-4
