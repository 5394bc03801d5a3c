"""Tests for pipeline/export.py and pipeline/model/hf_adapter.py: the exported folder
loads in transformers with no custom code and computes our logits, its tokenizer
and chat template give our ids, generation stops where ours does, the card
carries what it was given, and the folder is replaced atomically."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.data.chat import encode_chat, encode_prompt
from pipeline.data.tokenizer import (
    EOT_ID,
    IM_END,
    IM_END_ID,
    PAD,
    PAD_ID,
    ROUNDTRIP_PROBES,
    SPECIAL_TOKENS,
    load_tokenizer,
)
from pipeline.export import ExportConfig, ExportError, export_model, write_report
from pipeline.files import sha256_file
from pipeline.model import hf_adapter
from pipeline.model.generate import CHAT_STOP_IDS, generate, load_for_inference
from pipeline.model.hf_adapter import load_hf_model
from pipeline.training import checkpoint as ckpt
from tests.helpers import save_checkpoint, tiny_config, tiny_model
from tests.hf_models import save_tiny_hf_model

transformers = pytest.importorskip("transformers")

CARD = {
    "name": "tiny-test-model",
    "metrics": {"sft": {"bits_per_byte": 1.2345, "val_loss": 2.5}, "pretrain.val_loss": 3.25},
    "lineage": {"git_commit": "0123abcd" * 5, "dataset": {"manifest_sha256": "feedbeef" * 8, "docs": 1234}},
    "license": "mit",
}
# Every shape feature the mapping must get right: tying, grouped-query and plain
# multi-head attention, and non-default RoPE theta / norm eps.
VARIANTS = {
    "tied-gqa": dict(tie_embeddings=True, rope_theta=500.0, norm_eps=1e-6),
    "untied-gqa": dict(tie_embeddings=False),
    "untied-mha": dict(tie_embeddings=False, n_kv_head=4),
}
MESSAGES = [
    {"role": "system", "content": "You answer in Python."},
    {"role": "user", "content": "How do I reverse a list?"},
    {"role": "assistant", "content": "  Use `items[::-1]`,\nor items.reverse() — in place. ✓"},
    {"role": "user", "content": "And a string?\n\n"},
]


pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def tok(tok_path):
    return load_tokenizer(tok_path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory, tok, tok_path):
    """(our model, its checkpoint folder, the export folder) for each variant."""
    root = tmp_path_factory.mktemp(request.param)
    model = tiny_model(tiny_config(tok.get_vocab_size(), **VARIANTS[request.param]))
    save_checkpoint(root / "sft", model, meta={"tokenizer_sha256": sha256_file(tok_path)})
    summary = export_model(root / "sft", tok_path, root / "export", card_info=CARD)
    return model, root / "sft", root / "export", summary


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tok, tok_path) -> Path:
    """One tied export for the tests that do not depend on the shape."""
    root = tmp_path_factory.mktemp("plain")
    save_checkpoint(root / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    export_model(root / "sft", tok_path, root / "export", card_info=CARD)
    return root / "export"


@pytest.fixture(scope="module")
def hf_tok(export_dir):
    return transformers.AutoTokenizer.from_pretrained(export_dir)


def batch(tok, text: str = "def function_7(value, items):\n    total = value") -> torch.Tensor:
    return torch.tensor([tok.encode(text).ids])


def load_hf(path: Path):
    """from_pretrained, failing on any missing/unexpected key or logged warning."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated config key would warn here
            model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert not any(info.values()), info
    assert not records, [r.getMessage() for r in records]
    return model.eval()


# --------------------------------------------------------------------------- model


def test_transformers_computes_our_logits(exported, tok):
    model, _, out, _ = exported
    hf = load_hf(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.dtype == torch.float32
    idx = batch(tok)
    with torch.no_grad():
        diff = (hf(input_ids=idx).logits - model(idx)).abs().max().item()
    assert diff < 1e-4
    if model.config.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_tied_head_is_stored_once(exported):
    model, _, out, _ = exported
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert ("lm_head.weight" in names) == (not model.config.tie_embeddings)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == model.config.tie_embeddings
    card_row = f"| tied embeddings | {'yes' if model.config.tie_embeddings else 'no'} |"
    assert card_row in (out / "README.md").read_text(encoding="utf-8")


def test_load_for_inference_of_the_export_equals_the_checkpoint(exported, tok_path, tok):
    _, ckpt_dir, out, _ = exported
    a, _, config_a = load_for_inference(ckpt_dir, tokenizer_path=tok_path)
    b, tok_b, config_b = load_for_inference(out)
    assert config_a == config_b
    assert tok_b.to_str() == tok.to_str()
    idx = batch(tok)
    with torch.no_grad():
        assert torch.equal(a(idx)[0], b(idx)[0])


def test_greedy_generation_in_transformers_equals_ours(exported, tok):
    model, _, out, _ = exported
    hf = load_hf(out)
    ids = encode_prompt(tok, MESSAGES[:2])
    ours = generate(model, ids, max_new_tokens=12, temperature=0, stop_ids=CHAT_STOP_IDS)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):].tolist()
    assert theirs == ours


def test_transformers_generate_stops_at_im_end(tmp_path, tok, tok_path):
    model = tiny_model(tiny_config(tok.get_vocab_size(), tie_embeddings=False))
    ids = encode_prompt(tok, MESSAGES[:2])
    first = generate(model, ids, max_new_tokens=1, temperature=0)[0]
    assert first not in (IM_END_ID, *ids)  # else swapping would change the prompt's meaning
    with torch.no_grad():  # make <|im_end|> the greedy first answer token
        w = model.output.weight
        w[[first, IM_END_ID]] = w[[IM_END_ID, first]]
    save_checkpoint(tmp_path / "sft", model)
    export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={})
    hf = load_hf(tmp_path / "export")
    gen_config = transformers.GenerationConfig.from_pretrained(tmp_path / "export")
    assert gen_config.eos_token_id == [IM_END_ID, EOT_ID] == hf.config.eos_token_id
    assert gen_config.pad_token_id == PAD_ID
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10)[0, len(ids):].tolist()
    assert out == [IM_END_ID]


# --------------------------------------------------------------------------- tokenizer


def test_hf_tokenizer_encodes_like_ours_and_round_trips(hf_tok, tok):
    assert hf_tok.eos_token == IM_END and hf_tok.eos_token_id == IM_END_ID
    assert hf_tok.pad_token == PAD and hf_tok.pad_token_id == PAD_ID
    texts = [t for t in ROUNDTRIP_PROBES if not any(s in t for s in SPECIAL_TOKENS)]  # see export's doc
    texts.append("def function_7(value, items):\n    return  items[::-1]  # ✓\n")
    for text in texts:
        ids = hf_tok(text)["input_ids"]
        assert ids == tok.encode(text).ids, text
        assert hf_tok.decode(ids) == text


def test_the_tokenizer_config_adds_no_tokens_and_cleans_up_no_spaces(export_dir):
    """Said explicitly for the loaders that read these keys (llama.cpp's GGUF converter takes
    add_bos_token from here; transformers 4 cleans up spaces on decode unless told not to)."""
    config = json.loads((export_dir / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"], config["clean_up_tokenization_spaces"]) == (
        False, False, False)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_gives_encode_prompt_ids(hf_tok, tok, generation_prompt):
    for messages in (MESSAGES[:2], MESSAGES):
        got = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                         return_dict=False)
        assert got == encode_prompt(tok, messages, add_generation_prompt=generation_prompt)


def test_chat_template_gives_encode_chat_ids(hf_tok, tok):
    messages = MESSAGES[:3]
    got = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert got == encode_chat(tok, messages)[0]


def test_our_tokenizer_ships_the_chat_template_sft_trained_with(tmp_path, tok, tok_path):
    """sft.data.chat_template: a .jinja file on the pipeline's own tokenizer. The export's tokenizer
    renders and encodes as SFT did (not ChatML), stops where SFT's data says, and the card says so."""
    from pipeline.data.chat_template import encode_conversation, load_chat_template, render
    from pipeline.data.chat_template import encode_prompt as template_prompt
    from pipeline.data.chat_template import stop_ids as template_stops
    from pipeline.files import write_json
    from tests.hf_tokenizers import QWEN2_TEMPLATE

    (tmp_path / "custom.jinja").write_text(QWEN2_TEMPLATE)  # ChatML's tokens, a default system prompt
    template = load_chat_template(str(tmp_path / "custom.jinja"), tok_path, tok)
    write_json(tmp_path / "manifest.json", {  # the fields build_sft_data records
        "chat_template": template.text, "chat_template_name": template.name, "template_date": "2024-07-26",
        "stop_ids": list(template_stops(tok, template, CHAT_STOP_IDS)), "tokenizer_sha256": sha256_file(tok_path)})
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())),
                    meta={"tokenizer_sha256": sha256_file(tok_path)})
    export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={}, sft_manifest=tmp_path / "manifest.json")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    for messages in (MESSAGES[1:2], MESSAGES[1:]):  # no system message: the template adds its own
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == render(template, messages, add_generation_prompt=True) != \
            tok.decode(encode_prompt(tok, messages), skip_special_tokens=False)
        assert hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False) \
            == template_prompt(tok, messages, template)
    assert hf_tok.apply_chat_template(MESSAGES[1:3], tokenize=True, return_dict=False) == \
        encode_conversation(tok, MESSAGES[1:3], template)[0]
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(CHAT_STOP_IDS)
    card = (tmp_path / "export" / "README.md").read_text()
    chat_format = card.split("## Chat format")[1].split("##")[0]
    assert "ChatML" not in chat_format and "SFT rendered its data with" in chat_format


def test_a_template_reads_the_special_tokens_the_export_declares(tmp_path, tok, tok_path):
    """A template using bos_token, eos_token and pad_token renders the same in SFT (our own tokenizer) and in
    transformers on the export, whose tokenizer_config.json declares them."""
    from pipeline.data.chat_template import load_chat_template, render
    from pipeline.files import write_json

    (tmp_path / "tokens.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}{{ pad_token }}")
    template = load_chat_template(str(tmp_path / "tokens.jinja"), tok_path, tok)
    write_json(tmp_path / "manifest.json", {"chat_template": template.text, "chat_template_name": template.name,
                                            "tokenizer_sha256": sha256_file(tok_path)})
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())),
                    meta={"tokenizer_sha256": sha256_file(tok_path)})
    export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={}, sft_manifest=tmp_path / "manifest.json")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = render(template, MESSAGES[1:3], add_generation_prompt=True)
    assert ours.startswith("<|endoftext|>user: ") and ours.endswith("assistant: <|pad|>")
    assert hf_tok.apply_chat_template(MESSAGES[1:3], tokenize=False, add_generation_prompt=True) == ours


# --------------------------------------------------------------------------- card and files


def test_model_card_carries_metrics_and_lineage(exported, tok_path):
    model, _, out, summary = exported
    text = (out / "README.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert front["library_name"] == "transformers" and front["license"] == "mit"
    assert "# tiny-test-model" in text
    assert "| sft.bits_per_byte | 1.2345 |" in text
    assert "| pretrain.val_loss | 3.25 |" in text
    assert f"| git_commit | {'0123abcd' * 5} |" in text
    assert f"| dataset.manifest_sha256 | {'feedbeef' * 8} |" in text
    assert f"| tokenizer sha256 | {sha256_file(tok_path)} |" in text
    assert "| checkpoint step | 5 |" in text
    assert f"| model.safetensors sha256 | {summary['files']['model.safetensors']['sha256']} |" in text
    assert f"{summary['params']:,}" in text
    assert f"python -m pipeline.model.generate --model {out}" in text


def test_summary_describes_the_files(exported, tok_path):
    model, _, out, summary = exported
    assert set(summary["files"]) == {"config.json", "generation_config.json", "model.safetensors", "README.md",
                                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}
    assert set(summary["files"]) == {p.name for p in out.iterdir()}
    for name, info in summary["files"].items():
        assert info["sha256"] == sha256_file(out / name)
    assert summary["tokenizer_sha256"] == sha256_file(tok_path)  # copied byte for byte
    assert summary["step"] == 5 and summary["tie_word_embeddings"] == model.config.tie_embeddings


def test_report_keeps_the_summary_and_metrics_keep_the_numbers(exported, tmp_path):
    _, _, _, summary = exported
    registry = {"registered": False, "reason": "export.register_model is false"}
    metrics = write_report(tmp_path, summary, registry)
    assert metrics == {"params": summary["params"], "vocab_size": summary["vocab_size"], "step": 5}
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == {**json.loads(json.dumps(summary)), "registry": registry}
    assert report["files"]["model.safetensors"]["sha256"] and report["checkpoint"] == summary["checkpoint"]


def test_export_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path, tok, tok_path):
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.bin").write_text("from an older export")
    (out / "report.json").write_text(json.dumps({"files": {"stale.bin": {}}}))  # which listed it
    export_model(tmp_path / "sft", tok_path, out, card_info={})
    assert not (out / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "sft"]


@pytest.mark.parametrize("user", ["NOTES.md", "my-model/", "README.md/", "file"])
def test_what_no_export_wrote_is_refused_in_one_line_and_kept(tmp_path, tok, tok_path, user):
    """Replacing the folder whole deleted a user's notes or model kept in it (or a file
    in its place) without a word: export refuses, naming them, and leaves them as they were."""
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    out = tmp_path / "export"
    if user == "file":
        out.write_text("mine")
        message = r"export is a file, not an export folder; move it away"
    else:
        out.mkdir()
        (out / "config.json").write_text("{}")  # an export's name, from an export stopped before its report
        (out / "report.json").write_text(json.dumps({"files": {"old.bin": {}}}))
        mine = out / user.rstrip("/") / "weights.bin" if user.endswith("/") else out / user
        mine.parent.mkdir(exist_ok=True)
        mine.write_text("mine")
        message = rf"export holds {user}, which no export wrote \(its report.json does not list them\); .* move them"
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ExportError, match=message):
        export_model(tmp_path / "sft", tok_path, out, card_info={})
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "sft"]


def test_an_export_over_a_link_replaces_the_link_and_leaves_its_target(tmp_path, tok, tok_path):
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "NOTES.md").write_text("mine")
    (tmp_path / "export").symlink_to(tmp_path / "elsewhere")
    export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={})
    assert not (tmp_path / "export").is_symlink() and (tmp_path / "export" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["NOTES.md"]


def test_a_damaged_sft_manifest_is_one_line_and_leaves_no_export(tmp_path, tok, tok_path):
    from pipeline.files import DamagedFileError

    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    (tmp_path / "manifest.json").write_text('{"chat_template": "{{')  # cut short
    with pytest.raises(DamagedFileError, match=r"manifest.json is damaged: not valid JSON"):
        export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={},
                     sft_manifest=tmp_path / "manifest.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "sft"]


def test_a_failed_export_leaves_the_previous_one(tmp_path, tok, tok_path):
    model = tiny_model(tiny_config(tok.get_vocab_size()))
    save_checkpoint(tmp_path / "sft", model, meta={"tokenizer_sha256": "0" * 64})  # another tokenizer
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="not the tokenizer"):
        export_model(tmp_path / "sft", tok_path, out, card_info={})
    assert (out / "config.json").read_text() == "{}"
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export_model(tmp_path / "nothing", tok_path, out, card_info={})
    with pytest.raises(ValueError, match="unknown card_info key"):
        export_model(tmp_path / "sft", tok_path, out, card_info={"metric": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "sft"]


# --------------------------------------------------------------------------- adapter


def test_names_round_trip_and_match_transformers(tok):
    for variant in VARIANTS.values():
        config = tiny_config(tok.get_vocab_size(), **variant)
        ours = tiny_model(config).state_dict()
        hf_state = hf_adapter.to_hf(ours, config)
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_adapter.hf_config(
            config, bos_token_id=0, eos_token_id=3, pad_token_id=1)))
        expected = set(llama.state_dict()) - ({"lm_head.weight"} if config.tie_embeddings else set())
        assert set(hf_state) == expected
        back = hf_adapter.from_hf(hf_state, config)
        assert back.keys() == ours.keys()
        assert all(torch.equal(back[k], ours[k]) for k in ours)
        assert hf_adapter.config_from_hf(hf_adapter.hf_config(config, bos_token_id=0, eos_token_id=3,
                                                              pad_token_id=1)) == config


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type"),
    ({"attention_bias": True}, "biases"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "RoPE scaling"),
    ({"head_dim": 15}, "head_dim = 15 must be even"),  # an explicit head_dim (Qwen3) is supported; an odd one is not
])
def test_configs_our_model_cannot_run_are_refused(tok, change, message):
    hf = hf_adapter.hf_config(tiny_config(tok.get_vocab_size()), bos_token_id=0, eos_token_id=3, pad_token_id=1)
    with pytest.raises(ValueError, match=message):
        hf_adapter.config_from_hf({**hf, **change})


def test_unknown_weights_are_refused(tok):
    config = tiny_config(tok.get_vocab_size())
    with pytest.raises(ValueError, match="layers.0.attention.bias"):
        hf_adapter.to_hf({"layers.0.attention.bias": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias"):
        hf_adapter.from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, config)


def test_the_cards_usage_snippets_run(export_dir, capsys):
    import shlex

    from pipeline.model.generate import main

    text = (export_dir / "README.md").read_text()
    python = text.split("```python\n")[1].split("```")[0]
    exec(compile(python, "README.md", "exec"), {})  # loads, chats and prints through transformers
    shell = text.split("```sh\n")[1].split("```")[0].strip().splitlines()
    assert len(shell) == 2
    for line in shell:
        argv = shlex.split(line)
        assert argv[:3] == ["python", "-m", "pipeline.model.generate"]
        assert main(argv[3:] + ["--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("\n") >= 3


# --------------------------------------------------------------------------- Hugging Face families in and out

# name: (family, save_tiny_hf_model options)
ROUND_TRIPS = {
    "llama": ("llama", {}),
    "llama-untied-llama3": ("llama", dict(tie=False, rope_scaling=True)),
    "qwen2": ("qwen2", {}),
    "qwen3-untied": ("qwen3", dict(tie=False)),
    "mistral": ("mistral", {}),
    "mistral-window": ("mistral", dict(sliding_window=16)),  # max_seq_len capped at the window
}


@pytest.fixture(scope="module", params=list(ROUND_TRIPS))
def round_trip(request, tmp_path_factory, tok_path):
    """(original Hugging Face folder, its export after import with no training, the imported model)."""
    family, options = ROUND_TRIPS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    original = save_tiny_hf_model(family, root / "original", vocab_size=384, **options)
    _, model = load_hf_model(original)
    # the trainer records the original config.json in every checkpoint of a run started from it
    meta = {"hf_config": json.loads((original / "config.json").read_text())}
    save_checkpoint(root / "sft", model, meta=meta)
    summary = export_model(root / "sft", tok_path, root / "export", card_info={})
    assert summary["architecture"] == meta["hf_config"]["architectures"][0]
    return original, root / "export", model.eval()


def test_import_export_round_trip_gives_the_original_model_in_transformers(round_trip):
    original, export, _ = round_trip
    theirs = transformers.AutoModelForCausalLM.from_pretrained(original).eval()
    ours = load_hf(export)  # no custom code, no missing or unexpected keys, no warnings
    assert type(ours) is type(theirs) and ours.dtype == torch.float32
    idx = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(input_ids=idx).logits - theirs(input_ids=idx).logits).abs().max().item() <= 1e-5  # measured: 0.0
        prompt = idx[:1, :8]
        generated = ours.generate(prompt, do_sample=False, max_new_tokens=6, eos_token_id=None)
    assert generated.shape == (1, 14)
    with torch.no_grad():
        assert torch.equal(generated, theirs.generate(prompt, do_sample=False, max_new_tokens=6, eos_token_id=None))


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def test_exported_config_is_the_original_in_float32(round_trip):
    original, export, _ = round_trip
    before = json.loads((original / "config.json").read_text())
    after = json.loads((export / "config.json").read_text())
    assert after["dtype"] == after["torch_dtype"] == "float32"
    assert {k: v for k, v in after.items() if k not in ("torch_dtype", *TOKEN_IDS)} == {
        k: v for k, v in before.items() if k not in TOKEN_IDS}


def test_a_published_model_trained_with_our_tokenizer_declares_our_token_ids(round_trip, tok):
    """The original folder had no tokenizer.json, so the run used ours (pretrain only warns): the
    original's ids (bos 1, eos 2, pad 0) would name <|pad|>, <|im_start|> and <|endoftext|> in the
    tokenizer shipped. config.json declares the ids the shipped tokenizer and generation_config.json use."""
    original, export, _ = round_trip
    assert json.loads((original / "config.json").read_text())["eos_token_id"] == 2
    config = json.loads((export / "config.json").read_text())
    generation = json.loads((export / "generation_config.json").read_text())
    assert config["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert config["bos_token_id"] == generation["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert config["pad_token_id"] == generation["pad_token_id"] == tok.token_to_id("<|pad|>")
    assert set(config["eos_token_id"]) <= set(generation["eos_token_id"])


def test_export_of_an_import_loads_back_as_the_same_model(round_trip):
    original, export, model = round_trip
    loaded, _, config = load_for_inference(export)
    assert config == model.config
    idx = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    architecture = json.loads((original / "config.json").read_text())["architectures"][0]
    assert f"| architecture | `{architecture}`: decoder-only" in (export / "README.md").read_text()


def test_a_bf16_base_exports_in_bf16_by_default_and_in_the_dtype_asked_for(tmp_path, tok_path):
    """export.dtype auto: a run started from a bf16 model ships bf16, the base's own
    bits where nothing was trained (its fp32 master weights hold bf16 values
    exactly), at half the size; float32 when asked, as trained."""
    from safetensors import safe_open

    original = save_tiny_hf_model("qwen2", tmp_path / "original", dtype=torch.bfloat16)
    _, model = load_hf_model(original)
    save_checkpoint(tmp_path / "sft", model, meta={"hf_config": json.loads((original / "config.json").read_text())})
    sizes = {}
    for dtype, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"export-{dtype}"
        summary = export_model(tmp_path / "sft", tok_path, out, card_info={}, dtype=dtype)
        name = str(want).removeprefix("torch.")
        config = json.loads((out / "config.json").read_text())
        assert summary["dtype"] == config["dtype"] == config["torch_dtype"] == name
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {want}
        sizes[dtype] = (out / "model.safetensors").stat().st_size
        theirs = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=want).eval()
        ours = load_hf(out)
        assert ours.dtype == want
        idx = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(ours(input_ids=idx).logits, theirs(input_ids=idx).logits)
    assert sizes["auto"] < 0.6 * sizes["float32"]
    assert "| weights | bfloat16, safetensors (cast from the float32 weights trained and evaluated) |" in (
        tmp_path / "export-auto" / "README.md").read_text()


def test_a_weight_beyond_float16_s_range_is_refused_for_float16_not_for_bfloat16(tmp_path, tok_path):
    """float16's largest value is 65504: a weight past it would be written as
    infinite (and the model compute NaN); bfloat16 keeps float32's range."""
    original = save_tiny_hf_model("qwen2", tmp_path / "original")
    _, model = load_hf_model(original)
    with torch.no_grad():
        model.layers[0].feed_forward.w1.weight[0, 0] = 70000.0
        model.layers[0].attention.wq.weight[0, 0] = -70000.0  # beyond it below zero: -inf
    save_checkpoint(tmp_path / "sft", model, meta={"hf_config": json.loads((original / "config.json").read_text())})
    with pytest.raises(ExportError) as err:
        export_model(tmp_path / "sft", tok_path, tmp_path / "f16", card_info={}, dtype="float16")
    assert str(err.value).startswith("export.dtype float16: layers.0.attention.wq.weight, layers.0.feed_forward.w1.weight "
                                     "hold weights beyond float16's largest value (65504)")
    assert not (tmp_path / "f16").exists()
    export_model(tmp_path / "sft", tok_path, tmp_path / "bf16", card_info={}, dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert all(torch.isfinite(f.get_tensor(k)).all() for k in f.keys())


def test_more_than_five_tensors_beyond_float16_are_named_five_and_counted(tok):
    from pipeline.export import check_fits

    model = tiny_model(tiny_config(tok.get_vocab_size()))
    names = [name for name, _ in model.named_parameters()][:7]
    with torch.no_grad():
        for name in names:
            model.get_parameter(name).view(-1)[0] = 1e5
    with pytest.raises(ExportError, match=rf"^export.dtype float16: {re.escape(', '.join(names[:5]))} and 2 more hold "
                                          r"weights beyond float16's largest value"):
        check_fits(model, "float16")
    check_fits(model, "bfloat16")
    with torch.no_grad():  # finite in float32, beyond bfloat16's largest (3.39e38): the cast makes it infinite
        model.get_parameter(names[0]).view(-1)[0] = 3.4e38
    assert torch.isinf(torch.tensor(3.4e38).to(torch.bfloat16))
    with pytest.raises(ExportError, match=rf"^export.dtype bfloat16: {re.escape(names[0])} hold weights beyond"):
        check_fits(model, "bfloat16")


def test_export_dtype_auto_takes_the_original_s_dtype_when_it_is_one_we_write():
    from pipeline.export import export_dtype

    assert export_dtype("auto", {}) == "float32"  # a model of ours: its master weights
    assert export_dtype("auto", {"hf_config": {"dtype": "bfloat16"}}) == "bfloat16"
    assert export_dtype("auto", {"hf_config": {"torch_dtype": "float16", "dtype": "float16"}}) == "float16"
    for unwritten in ("float64", "auto", "int8"):
        assert export_dtype("auto", {"hf_config": {"torch_dtype": unwritten}}) == "float32"
    assert export_dtype("float16", {"hf_config": {"dtype": "bfloat16"}}) == "float16"


def test_a_model_trained_from_scratch_writes_todays_llama_config(export_dir):
    config = json.loads((export_dir / "config.json").read_text())
    assert list(config) == [
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
        "rope_parameters", "rms_norm_eps", "hidden_act", "attention_bias", "attention_dropout", "mlp_bias",
        "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
        "torch_dtype", "use_cache"]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bos_token_id"] == EOT_ID
    assert config["eos_token_id"] == [IM_END_ID, EOT_ID] and config["pad_token_id"] == PAD_ID


def test_export_config_defaults_and_validation():
    from pydantic import ValidationError

    cfg = ExportConfig()
    assert (cfg.source, cfg.register_model, cfg.primary_metric) == ("sft", True, "sft.chat.bits_per_byte")
    for bad in ({"source": "export"}, {"model_name": "has space"}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            ExportConfig(**bad)


def test_export_takes_the_last_or_the_best_checkpoint(tmp_path, tok, tok_path):
    from safetensors.torch import load_file

    from pipeline.files import write_json

    models = {step: tiny_model(tiny_config(tok.get_vocab_size()), seed=step) for step in (2, 4)}
    for step, model in models.items():
        save_checkpoint(tmp_path / "sft", model, step=step)
    best = ckpt.step_dir(tmp_path / "sft", 2)
    write_json(tmp_path / "sft" / ckpt.BEST, {"step": 2, "path": best.name, "val_loss": 1.0, "fingerprint": "f" * 16})
    for which, step in (("last", 4), ("best", 2)):
        summary = export_model(tmp_path / "sft", tok_path, tmp_path / which, card_info={}, which=which)
        assert summary["step"] == step
        weights = load_file(str(tmp_path / which / "model.safetensors"))
        assert torch.equal(weights["model.embed_tokens.weight"], models[step].tok_embeddings.weight)
    (tmp_path / "sft" / ckpt.BEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="no best checkpoint is recorded"):
        export_model(tmp_path / "sft", tok_path, tmp_path / "none", card_info={}, which="best")


def test_export_ships_only_the_checkpoint_evaluate_scored(tmp_path, tok, tok_path):
    """The card's and the registry's metrics come from evaluate's report of one checkpoint: another
    step, or the same step of another run (fingerprint), is refused before anything is written."""
    from pipeline.export import check_evaluated

    c = save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())), step=4)
    scored = {"checkpoint": str(c.path), "checkpoint_step": 4, "fingerprint": "f" * 16, "which": "last"}
    check_evaluated(c, "last", scored)
    assert export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={}, evaluated=scored)["step"] == 4
    for other, fix in (({"checkpoint": str(c.path.parent / "step-00000006"), "checkpoint_step": 6, "which": "best"},
                        r"set evaluate.checkpoint.sft: last \(or export.checkpoint: best\) and run `dvc repro`$"),
                       ({"fingerprint": "e" * 16}, r"run `dvc repro evaluate` so that it scores the checkpoint shipped$"),
                       ({"checkpoint": str(tmp_path / "copy" / c.path.name), "fingerprint": None},  # another folder
                        r"run `dvc repro evaluate` so that it scores the checkpoint shipped$")):
        with pytest.raises(ExportError, match=r"^export.checkpoint: last ships \S*step-00000004 \(step 4\), but the "
                                              rf"evaluate metrics describe .*; {fix}"):
            export_model(tmp_path / "sft", tok_path, tmp_path / "export2", card_info={}, evaluated={**scored, **other})
    assert not (tmp_path / "export2").exists()


def test_an_unfinished_run_is_refused_in_one_line(tmp_path, tok, tok_path):
    """sft killed before max_steps: its newest checkpoint is not final, so neither it nor the run's
    best is shipped; the line names the step, max_steps and what to run. One step folder asked for
    by name still exports (the caller chose it)."""
    from pipeline.files import write_json

    model = tiny_model(tiny_config(tok.get_vocab_size()))
    for step in (2, 4):
        save_checkpoint(tmp_path / "sft", model, step=step, meta={"final": False, "schedule": {"max_steps": 8}})
    write_json(tmp_path / "sft" / ckpt.BEST, {"step": 2, "path": "step-00000002", "val_loss": 1.0,
                                              "fingerprint": "f" * 16})
    for which in ("last", "best"):
        with pytest.raises(ExportError, match=r"^\S*step-00000004 is not sft's final checkpoint \(step 4 of 8\); "
                                              r"sft was interrupted: run `dvc repro sft` to finish it$"):
            export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={}, which=which)
    assert not (tmp_path / "export").exists()
    assert export_model(ckpt.step_dir(tmp_path / "sft", 4), tok_path, tmp_path / "export", card_info={})["step"] == 4
    save_checkpoint(tmp_path / "sft", model, step=8, meta={"schedule": {"max_steps": 8}})  # the run finishes
    write_json(tmp_path / "sft" / ckpt.BEST, {"step": 4, "path": "step-00000004", "val_loss": 1.0,
                                              "fingerprint": "f" * 16})
    assert export_model(tmp_path / "sft", tok_path, tmp_path / "export", card_info={}, which="best")["step"] == 4


def test_a_sharded_checkpoint_exports_the_same_folder(tmp_path, tok, tok_path):
    """An FSDP run's DCP checkpoint exports the weights a single-file one does."""
    from safetensors.torch import load_file

    model = tiny_model(tiny_config(tok.get_vocab_size()), seed=3)
    save_checkpoint(tmp_path / "file", model, meta={"tokenizer_sha256": sha256_file(tok_path)})
    save_checkpoint(tmp_path / "sharded", model, meta={"tokenizer_sha256": sha256_file(tok_path)}, sharded=True)
    assert ckpt.is_sharded(ckpt.latest(tmp_path / "sharded"))
    a = export_model(tmp_path / "file", tok_path, tmp_path / "a", card_info={})
    b = export_model(tmp_path / "sharded", tok_path, tmp_path / "b", card_info={})
    wa, wb = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["files"]["config.json"] == b["files"]["config.json"]


def test_a_model_trained_from_scratch_with_an_adopted_tokenizer_carries_its_ids(tmp_path):
    """No hf_config to take the ids from: config.json gets the adopted tokenizer's
    own (not the pipeline's tokenizer's 0/3/1), as generation_config.json does,
    and the card does not call its template ChatML."""
    import transformers
    from tokenizers import Tokenizer

    from pipeline.data.tokenizer import TokenizerConfig, adopt_tokenizer, load_specials
    from tests.hf_models import save_tiny_hf_folder

    hf = save_tiny_hf_folder("qwen2", tmp_path / "base" / "qwen2")
    tok_json = tmp_path / "data" / "tokenizer" / "tokenizer.json"
    adopt_tokenizer(TokenizerConfig(source=str(hf)), tmp_path / "no-docs.parquet", tok_json)
    specials = load_specials(tok_json)
    model = tiny_model(tiny_config(Tokenizer.from_file(str(tok_json)).get_vocab_size()))
    save_checkpoint(tmp_path / "sft", model, meta={"tokenizer_sha256": sha256_file(tok_json), "final": True})
    export_model(tmp_path / "sft", tok_json, tmp_path / "export", card_info={})
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert config["pad_token_id"] == specials.pad_id == generation["pad_token_id"] != 1
    assert config["eos_token_id"] == list(specials.eos_ids) == generation["eos_token_id"]
    assert config.get("bos_token_id") == specials.bos_id
    assert transformers.AutoConfig.from_pretrained(tmp_path / "export").pad_token_id == specials.pad_id
    assert ("bos_token_id" in generation) == (specials.bos_id is not None)  # none declared, not null
    card = (tmp_path / "export" / "README.md").read_text()
    assert "ChatML" not in card and "The tokenizer's own chat template" in card
    # SFT rendered with the tokenizer's own template: nothing to add beside the tokenizer's files
    (tmp_path / "manifest.json").write_text(json.dumps({"chat_template": specials.chat_template}))
    export_model(tmp_path / "sft", tok_json, tmp_path / "own", card_info={}, sft_manifest=tmp_path / "manifest.json")
    assert sorted(f.name for f in (tmp_path / "own").iterdir()) == sorted(f.name for f in (tmp_path / "export").iterdir())
    assert "The tokenizer's own chat template" in (tmp_path / "own" / "README.md").read_text()
    gone = tok_json.parent / "hf" / specials.hf_files[0]
    gone.unlink()
    with pytest.raises(ExportError, match=rf"the adopted tokenizer's {specials.hf_files[0]} are missing; rerun "
                                          r"`dvc repro tokenizer`$"):
        export_model(tmp_path / "sft", tok_json, tmp_path / "missing", card_info={})
    assert not (tmp_path / "missing").exists()


def test_the_card_s_tables_escape_a_pipe_and_the_files_share_one_mode(export_dir, tmp_path, tok, tok_path):
    import stat

    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in export_dir.iterdir()}
    assert len(set(modes.values())) == 1, modes  # safetensors writes its file owner-only
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    export_model(tmp_path / "sft", tok_path, tmp_path / "export",
                 card_info={"lineage": {"command": "a | b\nc"}, "metrics": {"loss": float("nan")}})
    card = (tmp_path / "export" / "README.md").read_text()
    assert "| command | a \\| b c |" in card and "| loss | NaN |" in card


def test_the_hf_origin_of_a_chain_stops_at_a_link_whose_meta_is_not_an_object(tmp_path):
    from pipeline.export import hf_origin

    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / "meta.json").write_text("[]")
    assert hf_origin({"init_from": str(tmp_path / "step-00000002")}) == tmp_path / "step-00000002"
    assert hf_origin({}) is None


def adopted_tokenizer(tmp_path, family: str = "qwen2", extra_files: dict[str, str] | None = None):
    """(tokenizer.json, specials) adopted from a tiny ``family`` folder holding ``extra_files`` too."""
    from pipeline.data.tokenizer import TokenizerConfig, adopt_tokenizer, load_specials
    from tests.hf_models import save_tiny_hf_folder

    hf = save_tiny_hf_folder(family, tmp_path / "base" / family)
    for name, text in (extra_files or {}).items():
        (hf / name).write_text(text)
    tok_json = tmp_path / "data" / "tokenizer" / "tokenizer.json"
    adopt_tokenizer(TokenizerConfig(source=str(hf)), tmp_path / "no-docs.parquet", tok_json)
    return tok_json, load_specials(tok_json)


def test_a_model_trained_from_scratch_with_an_adopted_tokenizer_stops_where_sft_s_data_says(tmp_path):
    """sft's stop ids (its template's end of turn) are the eos ids of config.json, not only the tokenizer's."""
    from tokenizers import Tokenizer

    tok_json, specials = adopted_tokenizer(tmp_path)
    stops = [7, *specials.eos_ids]  # 7: an end-of-turn id the tokenizer's own roles do not name
    assert 7 not in specials.eos_ids
    (tmp_path / "manifest.json").write_text(json.dumps({"stop_ids": stops}))
    model = tiny_model(tiny_config(Tokenizer.from_file(str(tok_json)).get_vocab_size()))
    save_checkpoint(tmp_path / "sft", model, meta={"tokenizer_sha256": sha256_file(tok_json)})
    export_model(tmp_path / "sft", tok_json, tmp_path / "export", card_info={}, sft_manifest=tmp_path / "manifest.json")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert config["eos_token_id"] == stops == generation["eos_token_id"]


@pytest.mark.parametrize("recorded_eos, expected", [(5, [5, 7]), ([5, 6], [5, 6, 7]), ([7, 5], [7, 5]), (None, [7])])
def test_the_original_generation_config_gets_sft_s_stop_ids_after_its_own(tmp_path, recorded_eos, expected):
    from pipeline.export import write_adopted_tokenizer_files

    tok_json, _ = adopted_tokenizer(tmp_path)
    meta = {"hf_config": {"architectures": ["Qwen2ForCausalLM"]},  # no init_from: the recorded copy is used
            "hf_generation_config": {"bos_token_id": 1, "eos_token_id": recorded_eos, "top_k": 20}}
    (tmp_path / "out").mkdir()
    write_adopted_tokenizer_files(tmp_path / "out", tok_json, meta, {"stop_ids": [7]})
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": expected, "top_k": 20}


def test_a_generation_config_built_from_an_adopted_tokenizer_s_roles_declares_its_bos(tmp_path):
    """No Hugging Face generation_config.json to carry (a model of ours): the file is built from the
    tokenizer's roles, with its bos where it has one (Llama 3's <|begin_of_text|>; Qwen2's has none)."""
    from pipeline.export import write_adopted_tokenizer_files

    tok_json, specials = adopted_tokenizer(tmp_path, "llama")
    assert specials.bos_id is not None
    (tmp_path / "out").mkdir()
    write_adopted_tokenizer_files(tmp_path / "out", tok_json, {}, {})
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {
        "eos_token_id": list(specials.eos_ids), "pad_token_id": specials.pad_id, "bos_token_id": specials.bos_id}


def test_every_adopted_tokenizer_file_ships_and_an_export_over_its_own_is_not_refused(tmp_path):
    """Files export does not write itself (Qwen's vocab.json and merges.txt) ship byte for byte too, and
    an export over the previous one, which has no report.json (export_model alone, or a stage stopped
    before registering), does not take them for a user's files."""
    from tokenizers import Tokenizer

    tok_json, specials = adopted_tokenizer(tmp_path, extra_files={"vocab.json": "{}", "merges.txt": "#version: 0.2\n"})
    assert {"vocab.json", "merges.txt"} <= set(specials.hf_files)
    model = tiny_model(tiny_config(Tokenizer.from_file(str(tok_json)).get_vocab_size()))
    save_checkpoint(tmp_path / "sft", model, meta={"tokenizer_sha256": sha256_file(tok_json)})
    for _ in range(2):
        export_model(tmp_path / "sft", tok_json, tmp_path / "export", card_info={})
    for name in specials.hf_files:
        assert (tmp_path / "export" / name).read_bytes() == (tok_json.parent / "hf" / name).read_bytes(), name


def test_a_model_of_ours_has_no_original_generation_config_to_look_for(caplog):
    from pipeline.export import original_generation_config

    with caplog.at_level(logging.WARNING, logger="pipeline.export"):
        assert original_generation_config({"init_from": "models/pretrain/step-00000004"}) is None
    assert not caplog.records  # no "the folder the run started from is gone" for a run that started from none


def test_the_hf_origin_of_a_chain_that_ends_at_a_checkpoint_of_ours_is_that_checkpoint(tmp_path):
    from pipeline.export import hf_origin

    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "meta.json").write_text(json.dumps({"stage": "pretrain"}))  # trained from scratch
    assert hf_origin({"init_from": str(tmp_path / "pretrain")}) == tmp_path / "pretrain"


def test_our_tokenizer_s_generation_config_adds_sft_s_stop_ids_to_ours(tmp_path, tok_path, tok):
    from pipeline.export import write_tokenizer_files

    write_tokenizer_files(tmp_path, tok_path, tiny_config(tok.get_vocab_size()), {"stop_ids": [IM_END_ID, 9]})
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [*CHAT_STOP_IDS, 9]


def test_the_tokenizer_s_model_max_length_is_the_model_s_context(tmp_path, tok_path, tok):
    from pipeline.export import write_tokenizer_files

    write_tokenizer_files(tmp_path, tok_path, tiny_config(tok.get_vocab_size(), max_seq_len=96))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).model_max_length == 96


def test_an_edited_generation_config_reaches_the_export_without_retraining(tmp_path, caplog):
    """The Hugging Face model's generation_config.json is read anew at export time,
    through the checkpoint's init_from chain (sft -> pretrain -> the model folder):
    an edit after training is carried (its sampling settings, with SFT's end of
    turn added to its eos ids), though it leaves the run identity alone, so that
    pretrain resumes and sft is not rerun. Only when the folder has gone does the
    export fall back, with a warning, to the copy recorded when the run started."""
    from tokenizers import Tokenizer

    from pipeline.data.tokenizer import TokenizerConfig, adopt_tokenizer, load_specials
    from pipeline.model.transformer import Transformer
    from pipeline.training.init import resolve_init
    from tests.hf_models import save_tiny_hf_folder

    hf = save_tiny_hf_folder("qwen2", tmp_path / "models" / "base" / "qwen2")
    tok_json = tmp_path / "data" / "tokenizer" / "tokenizer.json"
    adopt_tokenizer(TokenizerConfig(source=str(hf)), tmp_path / "no-docs.parquet", tok_json)
    specials, tokenizer_sha = load_specials(tok_json), sha256_file(tok_json)
    im_end = Tokenizer.from_file(str(tok_json)).token_to_id("<|im_end|>")
    manifest = tmp_path / "data" / "sft" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"stop_ids": [im_end]}))
    # pretrain passes the model through (max_steps 0) with init.meta in its checkpoint; sft records
    # its start as sft.plan does: init_from the pretrain checkpoint, the Hugging Face metadata carried
    init = resolve_init(str(hf), warn_outside_base=False)
    model = Transformer(init.model)
    init.load_weights(model)
    pretrain = save_checkpoint(tmp_path / "models" / "pretrain", model, step=0,
                               meta={"stage": "pretrain", "tokenizer_sha256": tokenizer_sha, **init.meta})
    save_checkpoint(tmp_path / "models" / "sft", model, meta={
        "stage": "sft", "tokenizer_sha256": tokenizer_sha, "init_from": str(pretrain.path),
        **{k: init.meta[k] for k in ("hf_config", "hf_generation_config")}})

    def exported_generation(name: str) -> dict:
        export_model(tmp_path / "models" / "sft", tok_json, tmp_path / name, card_info={}, sft_manifest=manifest)
        return json.loads((tmp_path / name / "generation_config.json").read_text())

    original = json.loads((hf / "generation_config.json").read_text())
    before = exported_generation("before")
    # config.json is the original's but for the dtype: its token ids, the adopted tokenizer's, not ours
    def but_dtype(folder: Path) -> dict:
        return {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
                if k not in ("dtype", "torch_dtype")}

    unchanged = but_dtype(hf)
    assert but_dtype(tmp_path / "before") == unchanged
    assert (unchanged["eos_token_id"], unchanged["pad_token_id"]) == (specials.eos_ids[0], specials.pad_id)
    assert "temperature" not in original and im_end in original["eos_token_id"]
    assert before == {**original, "eos_token_id": list(dict.fromkeys([*original["eos_token_id"], im_end]))}

    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (hf / "generation_config.json").write_text(json.dumps({**original, **sampling}, indent=2))
    assert resolve_init(str(hf), warn_outside_base=False).init_id == init.init_id  # nothing retrains
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.export"):
        after = exported_generation("after")
    assert not [r for r in caplog.records if r.name == "pipeline.export"]
    assert after == {**before, **sampling}
    assert after["pad_token_id"] == specials.pad_id and set(specials.eos_ids) <= set(after["eos_token_id"])
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path / "after")
    assert (loaded.do_sample, loaded.temperature, loaded.top_p, loaded.top_k, loaded.repetition_penalty) == (
        True, 0.7, 0.8, 20, 1.05)

    hf.rename(hf.with_name("moved"))  # the folder has gone: the copy recorded at the start, and a warning
    with caplog.at_level("WARNING", logger="pipeline.export"):
        assert exported_generation("gone") == before
    assert f"init_from chain ends at {hf}" in caplog.text and "recorded when the run started" in caplog.text

    hf.with_name("moved").rename(hf)  # back, but holding another model now: the recorded copy again
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "rope_theta": config.get("rope_theta", 1e4) * 2}))
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.export"):
        assert exported_generation("another") == before
    assert f"{hf} now holds another model (its config.json is not the one trained)" in caplog.text


def test_an_export_whose_replacement_was_cut_short_is_put_back_and_checked(tmp_path):
    """A kill between the swap's two renames left no models/export, and the last
    export whole beside it: it is put back, and what no export wrote in it is
    refused as it would have been, not replaced unseen."""
    from pipeline.export import check_replaceable

    old = tmp_path / ".old-export-77"
    old.mkdir()
    (old / "NOTES.md").write_text("mine")
    with pytest.raises(ExportError, match=r"holds NOTES.md, which no export wrote"):
        check_replaceable(tmp_path / "export", ["model.safetensors"])
    assert (tmp_path / "export" / "NOTES.md").read_text() == "mine" and not old.exists()


@pytest.mark.parametrize("edit", ["appended", "same size"])
def test_a_file_edited_since_the_last_export_is_refused_in_one_line_and_kept(tmp_path, tok, tok_path, edit):
    """A user's edits to a file the last export wrote (the model card, before pushing it)
    were replaced without a word, since report.json lists its name: export now compares
    each listed file with the size and sha256 the report records, and refuses a changed one."""
    save_checkpoint(tmp_path / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    out = tmp_path / "export"
    write_report(out, export_model(tmp_path / "sft", tok_path, out, card_info={}), {"registered": False})
    # unchanged: replaced as before
    write_report(out, export_model(tmp_path / "sft", tok_path, out, card_info={}), {"registered": False})
    card = (out / "README.md").read_text(encoding="utf-8")
    mine = card + "\nMy notes.\n" if edit == "appended" else card.replace("# llm-pipeline model", "# llm-pipeline modeL")
    assert mine != card and (edit == "appended" or len(mine) == len(card))
    (out / "README.md").write_text(mine, encoding="utf-8")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ExportError, match=r"export holds README.md, changed since the export wrote it \(its size or "
                                          r"sha256 is not the one its report.json records\); .* move"):
        export_model(tmp_path / "sft", tok_path, out, card_info={})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "sft"]


def test_a_primary_metric_of_the_other_model_is_refused_before_any_work():
    """export.source: pretrain with the default primary_metric (sft.chat.bits_per_byte)
    registered the pretrained model and moved its champion alias by the SFT model's numbers."""
    from pipeline.config import ConfigError, parse_section

    with pytest.raises(ConfigError, match=r"export: primary_metric sft.chat.bits_per_byte scores the sft model, but "
                                          r"source is pretrain; .*pretrain.chat.bits_per_byte"):
        parse_section(ExportConfig, {"source": "pretrain"}, "export")
    for ok in ({"source": "pretrain", "primary_metric": "pretrain.chat.bits_per_byte"},
               {"source": "pretrain", "register_model": False},  # no registry to rank by it
               {"primary_metric": "sft.text.val_loss"}, {"source": "sft", "primary_metric": "custom.score"}):
        parse_section(ExportConfig, ok, "export")
