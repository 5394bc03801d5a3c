"""Tests for pipeline/model/generate.py: sampling rules, seeded determinism, KV-cache
decoding against full forwards, stopping, loading, and the CLI.

The builders at the top (a tiny tokenizer trained here, a tiny checkpoint) are
shared with test_export.py and test_registry.py."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pipeline.data.chat import encode_prompt
from pipeline.data.tokenizer import EOT_ID, load_tokenizer
from pipeline.files import sha256_file
from pipeline.model.generate import (
    CHAT_STOP_IDS,
    TEXT_STOP_IDS,
    generate,
    iter_generate,
    load_for_inference,
    main,
    sample_next,
)
from pipeline.model.transformer import Transformer
from pipeline.training import checkpoint as ckpt
from tests.helpers import save_checkpoint, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def tok(tok_path) -> Tokenizer:
    return load_tokenizer(tok_path)


@pytest.fixture(scope="module")
def model(tok) -> Transformer:
    return tiny_model(tiny_config(tok.get_vocab_size()))


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, model, tok_path) -> Path:
    folder = tmp_path_factory.mktemp("models") / "sft"
    save_checkpoint(folder, model, meta={"tokenizer_sha256": sha256_file(tok_path)})
    return folder


def prompt(tok: Tokenizer, text: str = "def function_3(value") -> list[int]:
    return tok.encode(text).ids


# --------------------------------------------------------------------------- sample_next


def random_logits(rows: int = 8, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    logits = random_logits()
    assert torch.equal(sample_next(logits, 0.0), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
def test_a_tiny_temperature_is_argmax_not_nan(temperature):
    """logits / 1e-40 overflowed float32 to inf, and softmax made nan of it: a multinomial traceback."""
    logits = random_logits()
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, temperature, top_k=50, top_p=0.95, generator=generator),
                       logits.argmax(-1))


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "tiny top_p"])
def test_a_cut_to_one_token_is_greedy(kw):
    logits = random_logits()
    for seed in range(5):
        got = sample_next(logits, 1.5, generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(got, logits.argmax(-1))


def draws(logits: torch.Tensor, n: int = 3000, **kw) -> set[int]:
    """The set of ids drawn in n samples from one row of logits."""
    batch = logits.expand(n, -1)
    return set(sample_next(batch, 1.0, generator=torch.Generator().manual_seed(0), **kw).tolist())


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0, 2.0])
    assert draws(logits, top_k=3) == {1, 3, 5}
    assert draws(logits, top_k=0) == set(range(6))  # 0 = off


@pytest.mark.parametrize("top_p, kept", [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert draws(logits, top_p=top_p) == kept


@pytest.mark.parametrize("top_p, kept", [(0.5, {0}), (0.75, {0, 1}), (0.875, {0, 1, 2})])
def test_top_p_leaves_out_a_token_once_those_above_it_reach_p_exactly(top_p, kept):
    # probabilities 0.5, 0.25, 0.125, 0.125, exact in float32: the mass above each is 0, 0.5, 0.75, 0.875
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    assert draws(logits, top_p=top_p) == kept


def test_top_k_then_top_p_within_the_k():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top_k=2 renormalises to 4/7, 3/7; top_p 0.5 then keeps only the first
    assert draws(logits, top_k=2, top_p=0.5) == {0}
    assert draws(logits, top_k=2, top_p=0.6) == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.tensor([0.7, 0.2, 0.1]).log()
    ids = sample_next(logits.expand(20000, -1), 1.0, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(ids, minlength=3).float() / len(ids)
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.02, rtol=0)


@pytest.mark.parametrize("kw, message", [({"temperature": -1}, "temperature"), ({"top_k": -1}, "top_k"),
                                         ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                         ({"temperature": float("nan")}, "temperature"),
                                         ({"temperature": float("inf")}, "temperature")])
def test_invalid_sampling_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        sample_next(random_logits(), **{"temperature": 1.0, **kw})


# --------------------------------------------------------------------------- generate


def test_same_seed_same_tokens_other_seed_other_tokens(model, tok):
    kw = dict(max_new_tokens=20, temperature=1.0, top_k=None, top_p=None)
    a = generate(model, prompt(tok), seed=0, **kw)
    assert a == generate(model, prompt(tok), seed=0, **kw)
    assert len(a) == 20
    assert a != generate(model, prompt(tok), seed=1, **kw)


def test_greedy_equals_argmax_of_repeated_full_forwards(model, tok):
    ids = prompt(tok)
    got = generate(model, ids, max_new_tokens=12, temperature=0)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(12):  # the slow way: a full forward per token, no cache
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(ids):]


def test_cached_sampling_equals_uncached_sampling(model, tok):
    ids = prompt(tok)
    kw = dict(temperature=0.9, top_k=40, top_p=0.9)
    got = generate(model, ids, max_new_tokens=15, seed=3, **kw)
    generator = torch.Generator().manual_seed(3)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(15):
            logits = model(torch.tensor([seq]))[0, -1]
            seq.append(int(sample_next(logits, generator=generator, **kw)))
    assert got == seq[len(ids):]


def test_stops_after_emitting_a_stop_id(model, tok):
    free = generate(model, prompt(tok), max_new_tokens=12, temperature=0)
    stop = free[4]
    first = free.index(stop)
    got = generate(model, prompt(tok), max_new_tokens=12, temperature=0, stop_ids=[stop])
    assert got == free[:first + 1]  # the stop id is the last token returned


def test_stops_at_the_models_context_length(tok):
    model = tiny_model(tiny_config(tok.get_vocab_size(), max_seq_len=16))
    ids = list(range(10, 20))
    assert len(generate(model, ids, max_new_tokens=100, temperature=0)) == 6
    assert generate(model, ids + list(range(6)), max_new_tokens=5) == []
    with pytest.raises(ValueError, match="at most 16"):
        generate(model, ids * 2, max_new_tokens=5)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], max_new_tokens=5)


# --------------------------------------------------------------------------- loading


def test_load_from_a_checkpoint_folder_and_a_step_folder(model, tok_path, ckpt_dir):
    for path in (ckpt_dir, ckpt.latest(ckpt_dir).path):
        loaded, tokenizer, config = load_for_inference(path, tokenizer_path=tok_path)
        assert config == model.config
        assert not loaded.training
        assert tokenizer.get_vocab_size() == model.config.vocab_size
        for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(a, b), name
        assert loaded.output.weight is loaded.tok_embeddings.weight  # still tied


def test_a_tokenizer_other_than_the_trained_one_is_refused(tmp_path, model, tok_path):
    save_checkpoint(tmp_path / "sft", model, meta={"tokenizer_sha256": "0" * 64})
    with pytest.raises(ValueError, match="not the tokenizer this model was trained with"):
        load_for_inference(tmp_path / "sft", tokenizer_path=tok_path)


def test_a_folder_without_a_model_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_for_inference(tmp_path)


def test_a_folder_whose_model_files_are_links_to_nothing_says_so(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").symlink_to("../../blobs/abc")  # a Hugging Face cache snapshot copied with cp -r
    with pytest.raises(FileNotFoundError, match=r"model.safetensors is a link to nothing .*cp -rL"):
        load_for_inference(tmp_path)


@pytest.mark.parametrize("top", [700, 640])  # 640: one past the last row
def test_a_tokenizer_with_an_id_past_the_embedding_is_refused_even_when_it_counts_fewer_tokens(tmp_path, top):
    import json

    from tests.hf_models import save_tiny_hf_folder

    folder = save_tiny_hf_folder("llama", tmp_path / "m", vocab_size=640)
    load_for_inference(folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = top  # a gap: still 523 tokens, but an id the model has no row for
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=rf"the tokenizer has ids up to {top} \(523 tokens\), the model embeds only 640"):
        load_for_inference(folder)


# --------------------------------------------------------------------------- CLI


def test_cli_prompt_prints_the_completion(capsys, model, tok, tok_path, ckpt_dir):
    text = "def function_3(value"
    rc = main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--prompt", text,
               "--temperature", "0", "--max-new-tokens", "10"])
    new = generate(model, tok.encode(text).ids, max_new_tokens=10, temperature=0, stop_ids=TEXT_STOP_IDS)
    if new and new[-1] == EOT_ID:
        new = new[:-1]
    assert rc == 0
    assert capsys.readouterr().out == tok.decode(new, skip_special_tokens=False) + "\n"


def test_cli_empty_prompt_samples_after_endoftext(capsys, model, tok, tok_path, ckpt_dir):
    rc = main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--prompt", "", "--seed", "2",
               "--max-new-tokens", "6"])
    new = generate(model, [EOT_ID], max_new_tokens=6, seed=2, stop_ids=TEXT_STOP_IDS)
    assert rc == 0
    if new[-1] == EOT_ID:
        new = new[:-1]
    assert capsys.readouterr().out == tok.decode(new, skip_special_tokens=False) + "\n"


def chat_reply(model, tok, messages, **kw) -> str:
    new = generate(model, encode_prompt(tok, messages), stop_ids=CHAT_STOP_IDS, **kw)
    return tok.decode(new[:-1] if new and new[-1] in CHAT_STOP_IDS else new, skip_special_tokens=False)


def test_cli_chat_answers_each_turn_with_the_history(capsys, model, tok, tok_path, ckpt_dir):
    kw = dict(max_new_tokens=8, temperature=0.7, top_k=50, top_p=0.95, seed=4)
    rc = main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--system", "Be brief.",
               "--chat", "hello", "--chat", "and then?", "--max-new-tokens", "8", "--temperature", "0.7",
               "--seed", "4"])
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    first = chat_reply(model, tok, history, **kw)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
    second = chat_reply(model, tok, history, **kw)
    assert rc == 0
    assert first.strip()  # else the history above would differ from the CLI's
    assert capsys.readouterr().out == f"{first}\n{second}\n"


def test_a_chat_too_long_drops_its_oldest_exchange_whole_and_keeps_one_that_fits_exactly(tok):
    from pipeline.model import generate as gen

    system, u1, a1, u2 = ({"role": r, "content": c} for r, c in (
        ("system", "Be brief."), ("user", "hello"), ("assistant", "hi there"), ("user", "and then?")))
    full = encode_prompt(tok, [system, u1, a1, u2])
    assert gen._encode_chat_prompt(tok, [system, u1, a1, u2], len(full) + 5, room=5) == full  # fits to the token
    # one token short: the oldest user/assistant pair goes, never half of it (roles must alternate)
    assert gen._encode_chat_prompt(tok, [system, u1, a1, u2], len(full) + 4, room=5) == encode_prompt(tok, [system, u2])


def test_the_reply_leaves_out_the_stop_id_it_ended_on(monkeypatch, tok):
    import argparse

    from pipeline.data.tokenizer import IM_END_ID
    from pipeline.model import generate as gen

    words = tok.encode("sure, here it is").ids
    monkeypatch.setattr(gen, "generate", lambda *a, **kw: [*words, IM_END_ID])
    args = argparse.Namespace(max_new_tokens=20, temperature=0.0, top_k=None, top_p=None, seed=0)
    assert gen._reply(None, tok, [1], args, CHAT_STOP_IDS) == tok.decode(words, skip_special_tokens=False)


def test_cli_interactive_reads_turns_until_exit(capsys, monkeypatch, model, tok, tok_path, ckpt_dir):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\nnever read\n"))
    rc = main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--interactive", "--temperature", "0",
               "--max-new-tokens", "6"])
    expected = chat_reply(model, tok, [{"role": "user", "content": "hello"}], max_new_tokens=6, temperature=0)
    assert rc == 0
    assert capsys.readouterr().out == expected + "\n"


def test_cli_interactive_says_a_message_is_too_long_and_keeps_the_session(capsys, monkeypatch, model, tok, tok_path,
                                                                          ckpt_dir):
    """One message longer than the model reads ended the whole interactive session
    (its history with it) on the error; now that message is refused and the next answered."""
    long = "word " * (2 * model.config.max_seq_len)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{long}\nhello\n/exit\n"))
    rc = main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--interactive", "--temperature", "0",
               "--max-new-tokens", "6"])
    expected = chat_reply(model, tok, [{"role": "user", "content": "hello"}], max_new_tokens=6, temperature=0)
    out = capsys.readouterr()
    assert rc == 0 and out.out == expected + "\n"
    assert re.search(rf"^error: that message takes \d+ tokens; the model reads at most {model.config.max_seq_len}"
                     r"; send a shorter one$", out.err, re.M)


def test_cli_forgets_an_exchange_with_a_blank_reply_and_reset_keeps_the_system_message(monkeypatch, tok_path,
                                                                                       ckpt_dir):
    from pipeline.model import generate as gen

    seen, replies = [], iter(["", "ok", "fine"])
    real = gen._encode_chat_prompt
    monkeypatch.setattr(gen, "_encode_chat_prompt", lambda tok, history, *a, **kw: (
        seen.append([m["content"] for m in history]) or real(tok, history, *a, **kw)))
    monkeypatch.setattr(gen, "_reply", lambda *a: next(replies))
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n/reset\nthree\n/exit\n"))
    assert main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--interactive", "--system", "S"]) == 0
    assert seen == [["S", "one"], ["S", "two"], ["S", "three"]]


def test_a_checkpoint_with_an_adopted_tokenizer_stops_raw_text_at_its_own_end_ids(tmp_path, tok, ckpt_dir):
    from pipeline.data.tokenizer import TokenizerConfig, adopt_tokenizer, load_specials
    from pipeline.model.generate import prompting
    from tests.hf_models import save_tiny_hf_folder

    hf = save_tiny_hf_folder("qwen2", tmp_path / "qwen2")
    tok_json = tmp_path / "data" / "tokenizer" / "tokenizer.json"
    adopt_tokenizer(TokenizerConfig(source=str(hf)), tmp_path / "no-docs.parquet", tok_json)
    roles = load_specials(tok_json)
    manifest = tmp_path / "manifest.json"  # SFT's data, rendered with the tokenizer's own template
    manifest.write_text(json.dumps({"chat_template": roles.chat_template, "tokenizer_sha256": sha256_file(tok_json)}))
    for sft_manifest in (None, manifest):
        _, _, text_stops = prompting(ckpt_dir, load_tokenizer(tok_json), tok_json, sft_manifest=sft_manifest,
                                     chat=False)
        assert text_stops == tuple(dict.fromkeys([roles.eot_id, *roles.eos_ids])) != (EOT_ID,)


def test_cli_reports_a_missing_model_without_a_traceback(capsys, tmp_path):
    assert main(["--model", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_checkpoint_is_prompted_with_the_template_sft_trained_with(tmp_path, tok, tok_path, ckpt_dir, monkeypatch):
    """Our own tokenizer, sft.data.chat_template a .jinja file: --chat on a checkpoint folder renders
    the prompt as the SFT data was rendered (data/sft/manifest.json), not as ChatML; data of
    another tokenizer is not taken for this one's."""
    from pipeline.data.chat_template import encode_prompt as template_prompt
    from pipeline.data.chat_template import load_chat_template
    from pipeline.files import write_json
    from pipeline.model.generate import prompting
    from tests.hf_tokenizers import QWEN2_TEMPLATE

    (tmp_path / "custom.jinja").write_text(QWEN2_TEMPLATE)
    template = load_chat_template(str(tmp_path / "custom.jinja"), tok_path, tok)
    manifest = tmp_path / "manifest.json"
    record = {"chat_template": template.text, "chat_template_name": template.name, "stop_ids": [3, 0],
              "tokenizer_sha256": sha256_file(tok_path)}
    write_json(manifest, record)
    got, chat_stops, text_stops = prompting(ckpt_dir, tok, tok_path, sft_manifest=manifest)
    assert got.source == QWEN2_TEMPLATE and chat_stops == (3, 0) and text_stops == (EOT_ID,)
    messages = [{"role": "user", "content": "Hi"}]
    assert template_prompt(tok, messages, got) != encode_prompt(tok, messages)
    write_json(manifest, {**record, "tokenizer_sha256": "0" * 64})
    assert prompting(ckpt_dir, tok, tok_path, sft_manifest=manifest)[0] is None  # ChatML
    # the CLI reads data/sft/manifest.json from the project root
    (tmp_path / "data" / "sft").mkdir(parents=True)
    write_json(tmp_path / "data" / "sft" / "manifest.json", record)
    import pipeline.model.generate as gen

    seen = []
    real = gen._encode_chat_prompt
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gen, "_encode_chat_prompt", lambda *a, **kw: seen.append(kw["template"]) or real(*a, **kw))
    assert main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--chat", "Hi", "--max-new-tokens", "2"]) == 0
    assert [t.source for t in seen] == [QWEN2_TEMPLATE]


def test_cli_a_damaged_sft_manifest_is_one_line_naming_it(tmp_path, capsys, tok_path, ckpt_dir, monkeypatch):
    """--chat on a checkpoint reads data/sft/manifest.json: cut short, it printed json's bare
    'Expecting value: ...', naming no file."""
    (tmp_path / "data" / "sft").mkdir(parents=True)
    (tmp_path / "data" / "sft" / "manifest.json").write_text('{"chat_template": ')
    monkeypatch.chdir(tmp_path)
    assert main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--chat", "Hi"]) == 2
    assert re.fullmatch(r"error: data/sft/manifest.json is damaged: not valid JSON \(.+\); run the stage that writes "
                        r"it again\n", capsys.readouterr().err)


@pytest.mark.parametrize("device, message", [
    ("gpu", r"device 'gpu' is not a device name; use auto, cpu, cuda, cuda:N or mps"),
    ("xla", r"device 'xla' is not supported; use auto, cpu, cuda, cuda:N or mps"),
    *([] if torch.cuda.is_available() else [
        ("cuda", r"device 'cuda' was asked for, but torch .* sees no CUDA GPU here; set the device to auto or cpu"),
        ("cuda:0", r"device 'cuda:0' was asked for, but torch .* sees no CUDA GPU here")]),
])
def test_cli_a_device_this_machine_lacks_is_one_line(capsys, tok_path, ckpt_dir, device, message):
    """The stages' device check (pick_device), before any weight is loaded: no traceback, exit code 2."""
    assert main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--prompt", "x", "--device", device]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: {message}.*\n", err), err


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_hugging_face_folder_is_prompted_with_its_own_template_and_stop_ids(family, tmp_path, capsys):
    from pipeline.model.generate import main, prompting
    from tests.hf_models import save_tiny_hf_folder

    folder = save_tiny_hf_folder(family, tmp_path / family, max_position_embeddings=512)
    _, tok, _ = load_for_inference(folder)
    template, chat_stops, text_stops = prompting(folder, tok)
    end_of_turn = {"qwen2": "<|im_end|>", "llama": "<|eot_id|>"}[family]
    assert template is not None and chat_stops[0] == tok.token_to_id(end_of_turn)
    assert text_stops[0] == tok.token_to_id({"qwen2": "<|endoftext|>", "llama": "<|end_of_text|>"}[family])
    assert tok.encode(end_of_turn, add_special_tokens=False).ids != [chat_stops[0]]  # in text, text, as ours reads it
    assert main(["--model", str(folder), "--chat", "Hi", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert main(["--model", str(folder), "--prompt", "", "--max-new-tokens", "3"]) == 0


def _without_template(folder: Path, *, tokenizer_config: bool) -> Path:
    """``folder`` with its chat template removed: with ``tokenizer_config=False``
    the whole tokenizer_config.json goes, as in Qwen-style folders that ship
    only tokenizer.json."""
    import json

    config_file = folder / "tokenizer_config.json"
    if tokenizer_config:
        config = json.loads(config_file.read_text())
        config.pop("chat_template", None)
        config_file.write_text(json.dumps(config))
    else:
        config_file.unlink()
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


def test_a_hugging_face_folder_without_a_template_chats_in_chatml_with_its_own_ids(tmp_path, capsys):
    """As sft's chat_template auto does: no template, but <|im_start|>/<|im_end|>
    as special tokens, means ChatML with the folder's ids (not ours, 0-3)."""
    from pipeline.data.chat_template import encode_prompt as template_prompt
    from pipeline.model.generate import main, prompting
    from tests.hf_models import save_tiny_hf_folder

    folder = _without_template(save_tiny_hf_folder("qwen2", tmp_path / "qwen2", max_position_embeddings=512),
                               tokenizer_config=False)
    capsys.readouterr()  # transformers' progress bar while saving
    _, tok, _ = load_for_inference(folder)
    template, chat_stops, _ = prompting(folder, tok)
    assert template is not None and template.name == "chatml"
    assert chat_stops[0] == tok.token_to_id("<|im_end|>") != 3
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.decode(template_prompt(tok, messages, template), skip_special_tokens=False) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert main(["--model", str(folder), "--chat", "Hi", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().err == ""


def test_a_hugging_face_folder_without_a_template_or_chatml_tokens_refuses_chat_in_one_line(tmp_path, capsys):
    from pipeline.model.generate import main
    from tests.hf_models import save_tiny_hf_folder

    folder = _without_template(save_tiny_hf_folder("llama", tmp_path / "llama", max_position_embeddings=512),
                               tokenizer_config=True)
    capsys.readouterr()  # transformers' progress bar while saving
    assert main(["--model", str(folder), "--chat", "hi"]) == 2
    assert capsys.readouterr().err == (f"error: {folder} has no chat template (and no <|im_start|>/<|im_end|> "
                                       "tokens for ChatML); use --prompt\n")
    assert main(["--model", str(folder), "--prompt", "def", "--max-new-tokens", "3"]) == 0  # completion still works


@pytest.mark.parametrize("args, message", [(["--max-new-tokens", "-3"], "max_new_tokens must be >= 0 (got -3)"),
                                           (["--temperature", "nan"], "temperature must be a finite number")])
def test_cli_a_negative_length_or_a_nan_temperature_is_one_line(capsys, tok_path, ckpt_dir, args, message):
    """-3 printed an empty completion as if the model had nothing to say; nan was a multinomial traceback."""
    assert main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--prompt", "def", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {message}") and captured.err.count("\n") == 1
    assert captured.out == ""


def test_cli_a_system_message_with_a_raw_prompt_is_refused(capsys, tok_path, ckpt_dir):
    """--prompt has no system turn: the message was dropped without a word."""
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--prompt", "def", "--system", "be brief"])
    assert exit_.value.code == 2
    assert "error: --system goes with --chat or --interactive" in capsys.readouterr().err


def test_cli_an_empty_chat_message_is_refused_in_words(capsys, tok_path, ckpt_dir):
    """It was `error: empty_content: message 0 (user)`."""
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--chat", "hi", "--chat", " "])
    assert exit_.value.code == 2
    assert "error: --chat takes a message with some text; one was empty" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [str(2**64), "-1"])
def test_cli_a_seed_torch_cannot_take_is_refused_naming_the_flag(capsys, tok_path, ckpt_dir, seed):
    """2^64 printed torch's `error: Overflow when unpacking long long`."""
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(ckpt_dir), "--tokenizer", str(tok_path), "--prompt", "def", "--seed", seed])
    assert exit_.value.code == 2
    assert f"error: argument --seed: must be from 0 to 2^64 - 1, got {seed}" in capsys.readouterr().err


def test_cli_a_tokenizer_folder_stands_for_its_tokenizer_json(capsys, tok_path, ckpt_dir):
    """--tokenizer data/tokenizer said `tokenizer not found: data/tokenizer; run the tokenizer stage first`."""
    args = ["--model", str(ckpt_dir), "--prompt", "def", "--temperature", "0", "--max-new-tokens", "4"]
    assert main([*args, "--tokenizer", str(tok_path)]) == 0
    by_file = capsys.readouterr().out
    assert main([*args, "--tokenizer", str(tok_path.parent)]) == 0
    assert capsys.readouterr().out == by_file


def test_generation_builds_no_autograd_graph(model, tok):
    """Like evaluate's scoring (whose no_grad had slipped onto another function): every
    forward of the prefill and of each step runs without autograd, so no activations
    are kept for a backward pass that never comes."""
    seen = []
    handle = model.register_forward_hook(
        lambda _module, _args, out: seen.append((torch.is_grad_enabled(), out.requires_grad)))
    try:
        new = generate(model, prompt(tok), max_new_tokens=4, temperature=0)
    finally:
        handle.remove()
    assert len(new) == 4 and seen == [(False, False)] * 4


def test_no_new_tokens_is_nothing_and_a_negative_count_is_refused(model, tok):
    assert generate(model, prompt(tok), max_new_tokens=0) == []
    for bad in (-1, -5):  # would print nothing, as if the model had nothing to say
        with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 0 \(got {bad}\)"):
            generate(model, prompt(tok), max_new_tokens=bad)


def test_streaming_leaves_the_callers_autograd_alone_between_tokens(model, tok):
    """iter_generate held inference mode across its yields: the caller's code between
    tokens, and after a break until the generator was collected, ran without autograd."""
    stream = iter_generate(model, prompt(tok), max_new_tokens=4, temperature=0)
    tokens = [next(stream)]
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    weight = torch.ones(2, requires_grad=True)
    assert (weight * 2).sum().requires_grad  # a training step here still builds its graph
    tokens += list(stream)
    assert tokens == generate(model, prompt(tok), max_new_tokens=4, temperature=0)
