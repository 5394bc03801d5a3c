import math
import re

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import ConfigError, parse_section
from pipeline.data.shards import PackedRows
from pipeline.evaluate import EvaluateConfig, EvaluateError, evaluate_models, record_samples, score, token_bytes
from pipeline.files import read_json
from tests.helpers import save_checkpoint, synthetic_docs, tiny_config, tiny_model, write_split


def test_token_bytes_counts_utf8_bytes_and_zero_for_specials(tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_path)
    nbytes = token_bytes(tok)
    assert nbytes[:4].tolist() == [0, 0, 0, 0]
    for text in ["def function_3(value):", "héllo wörld ✓ 🙂", "\t\n  x"]:
        ids = tok.encode(text).ids
        assert int(nbytes[ids].sum()) == len(text.encode("utf-8"))


def test_token_bytes_of_a_sentencepiece_layout(tmp_path):
    """Llama 2's and Mistral's layout: '▁' for a space and <0xNN> byte-fallback
    tokens, one byte each. The text's bytes, plus the one of the space the
    normaliser puts before it (which the decoder strips)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", *"abcdefghijklmnopqrstuvwxyz\u00e9", "af", "\u2581c", "\u2581caf", "\u2581caf\u00e9"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("\u2581", "c"), ("a", "f"), ("\u2581c", "af"), ("\u2581caf", "\u00e9")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    nbytes = token_bytes(tok)
    for text in ["caf\u00e9 x", "x\n\u4e2d"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert "<0x0A>" in tok.encode("x\n").tokens and tok.decode(ids) == text
        assert int(nbytes[ids].sum()) == len(text.encode("utf-8")) + 1


def adopted_sentencepiece(tmp_path):
    """A tiny SentencePiece-style tokenizer (Llama 2's, Mistral's layout) adopted as the tokenizer stage would."""
    from pipeline.data.tokenizer import TokenizerConfig, adopt_tokenizer
    from tests.hf_tokenizers import sentencepiece_tokenizer

    (tmp_path / "hf").mkdir()
    sentencepiece_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    out = tmp_path / "tok" / "tokenizer.json"
    adopt_tokenizer(TokenizerConfig(source=str(tmp_path / "hf")), tmp_path / "no-docs", out)
    return out


def test_the_dummy_prefix_is_measured(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.evaluate import dummy_prefix_bytes

    for path, prefix in ((tok_path, 0), (adopted_sentencepiece(tmp_path), 1)):
        tok = load_tokenizer(path)
        assert dummy_prefix_bytes(tok) == prefix
        # what it says is what the tokenizer does: the bytes of "a" encoded, less the one of "a"
        assert token_bytes(tok)[tok.encode("a", add_special_tokens=False).ids].sum() - 1 == prefix


def test_bits_per_byte_counts_the_documents_bytes_with_a_dummy_prefix_tokenizer(tmp_path):
    """A SentencePiece-style tokenizer encodes a document "The cat" as "<s>",
    "▁The", "▁cat": "▁The" stands for a space the document does not have. The
    bytes scored are the documents' own: here each row is one document after an
    end-of-text, so every token of every document is scored."""
    import random

    from pipeline.data.tokenizer import load_specials, load_tokenizer

    tok_json = adopted_sentencepiece(tmp_path)
    tok, eot = load_tokenizer(tok_json), load_specials(tok_json).eot_id
    # words of one token each ("café" among them), so that each document is one row
    words = sorted(p[1:] for p in tok.get_vocab() if p.startswith("\u2581") and p[1:].isalpha()
                   and len(tok.encode(p[1:], add_special_tokens=False).ids) == 1)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(20)]
    docs = [np.array([eot, *tok.encode(t).ids], np.int32) for t in texts]
    assert {len(d) for d in docs} == {14} and tok.id_to_token(int(docs[0][2])).startswith("\u2581")
    write_split(tmp_path / "val", docs, seq_len=13)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(tok.get_vocab_size())))
    cfg = parse_section(EvaluateConfig, {"batch_size": 8}, "evaluate")
    evaluate_models(cfg, {"m": tmp_path / "m"}, {"text": tmp_path / "val"}, tok_json, tmp_path / "report.json")
    report = read_json(tmp_path / "report.json")["m"]["text"]
    assert report["tokens"] == 20 * 13
    assert report["bytes"] == sum(len(t.encode("utf-8")) for t in texts)


def test_score_is_summed_nll_over_targets_and_bits_per_byte(tmp_path):
    vocab = 40
    write_split(tmp_path / "val", synthetic_docs(60, vocab, seed=1), seq_len=16)
    rows = PackedRows(tmp_path / "val")
    model = tiny_model(tiny_config(vocab))
    nbytes = np.full(vocab, 2)
    m = score(model, rows, nbytes, batch_size=3, max_rows=5, doc_mask=True, device=torch.device("cpu"),
              precision="fp32")
    b = rows.batch(np.arange(5), torch.device("cpu"))
    logits = model(b["input_ids"], segment_ids=b["segment_ids"])
    nll = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(), reduction="sum").item()
    assert m["tokens"] == 5 * 16 and m["bytes"] == 2 * 5 * 16
    assert m["val_loss"] == pytest.approx(nll / 80, rel=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(nll / 80), rel=1e-5)
    assert m["bits_per_byte"] == pytest.approx(nll / math.log(2) / 160, rel=1e-5)


def test_scoring_builds_no_autograd_graph(tmp_path):
    # Under autograd every batch's activations were kept for a backward pass that
    # never comes (memory), and torch warned on each split's first batch.
    vocab = 40
    write_split(tmp_path / "val", synthetic_docs(30, vocab, seed=1), seq_len=16)
    model = tiny_model(tiny_config(vocab))
    seen = []
    model.register_forward_hook(lambda _module, _args, out: seen.append((torch.is_grad_enabled(), out.requires_grad)))
    score(model, PackedRows(tmp_path / "val"), np.full(vocab, 2), batch_size=2, max_rows=4, doc_mask=True,
          device=torch.device("cpu"), precision="fp32")
    assert seen == [(False, False)] * 2


def test_only_labelled_tokens_are_scored(tmp_path):
    vocab = 40
    docs = synthetic_docs(30, vocab, seed=2)
    labels = [np.where(np.arange(len(d)) % 2 == 0, d, -100).astype(np.int32) for d in docs]
    write_split(tmp_path / "val", docs, seq_len=16, labels=labels)
    rows = PackedRows(tmp_path / "val")
    m = score(tiny_model(tiny_config(vocab)), rows, np.ones(vocab, int), batch_size=4, max_rows=None,
              doc_mask=True, device=torch.device("cpu"), precision="fp32")
    assert m["tokens"] == int((rows.labels(np.arange(len(rows)))[:, 1:] != -100).sum())
    for shard in rows.shards:  # nothing left to score is an error, not a NaN
        shard.labels = np.full_like(shard.labels, -100)
    with pytest.raises(EvaluateError, match="no scored tokens"):
        score(tiny_model(tiny_config(vocab)), rows, np.ones(vocab, int), batch_size=4, max_rows=None,
              doc_mask=True, device=torch.device("cpu"), precision="fp32")


def test_evaluate_models_and_seeded_samples(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(40, vocab, seed=3), seq_len=16)
    for name, seed in (("a", 0), ("b", 1)):
        save_checkpoint(tmp_path / name, tiny_model(tiny_config(vocab), seed=seed))
    cfg = parse_section(EvaluateConfig, {"batch_size": 4, "samples": {"max_new_tokens": 8}}, "evaluate")
    metrics, models = evaluate_models(cfg, {"a": tmp_path / "a", "b": tmp_path / "b"},
                                      {"text": tmp_path / "val"}, tok_path, tmp_path / "report.json")
    assert set(metrics) == {"a", "b"} and metrics["a"]["val_loss"] != metrics["b"]["val_loss"]
    assert set(metrics["a"]) == {"val_loss", "perplexity", "bits_per_byte", "text"}
    assert metrics["a"]["text"] == {k: metrics["a"][k] for k in ("val_loss", "perplexity", "bits_per_byte")}
    report = read_json(tmp_path / "report.json")
    assert report["a"]["checkpoint_step"] == 5 and report["a"]["checkpoint"].startswith(str(tmp_path / "a"))
    assert report["a"]["which"] == "last" and report["a"]["fingerprint"] == "f" * 16
    assert report["a"]["text"]["tokens"] > 0 and report["a"]["text"]["bytes"] > 0
    s1 = record_samples(cfg.samples, models, tok_path)
    s2 = record_samples(cfg.samples, models, tok_path)
    assert s1 == s2 and len(s1) == 2 * (len(cfg.samples.prompts) + len(cfg.samples.chat))
    assert {s["kind"] for s in s1} == {"text", "chat"}
    assert not any("prompt_tokens_left_out" in s for s in s1)
    # A prompt longer than the model reads keeps its end, and the sample says how much was left out.
    long = parse_section(EvaluateConfig, {"samples": {"max_new_tokens": 8, "prompts": ["def f(x): return x\n" * 40],
                                                      "chat": []}}, "evaluate").samples
    [a, _] = record_samples(long, models, tok_path)
    max_len = models["a"].config.max_seq_len
    n = len(load_tokenizer(tok_path).encode(long.prompts[0], add_special_tokens=False).ids)
    assert n > max_len and a["prompt_tokens_left_out"] == n - (max_len - 8) and a["completion"]


def test_a_sharded_checkpoint_evaluates_like_the_single_file_one(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.training import checkpoint as ckpt

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(40, vocab, seed=3), seq_len=16)
    model = tiny_model(tiny_config(vocab), seed=4)
    save_checkpoint(tmp_path / "file", model)
    save_checkpoint(tmp_path / "sharded", model, sharded=True)
    assert ckpt.is_sharded(ckpt.latest(tmp_path / "sharded"))
    cfg = parse_section(EvaluateConfig, {"batch_size": 4, "samples": {"max_new_tokens": 4}}, "evaluate")
    metrics, models = evaluate_models(cfg, {"file": tmp_path / "file", "sharded": tmp_path / "sharded"},
                                      {"text": tmp_path / "val"}, tok_path)
    assert metrics["sharded"] == metrics["file"]
    for k, v in models["file"].state_dict().items():
        assert torch.equal(models["sharded"].state_dict()[k], v), k


def test_an_unfinished_run_is_scored_with_a_warning_and_flagged(tmp_path, tok_path, caplog):
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    model = tiny_model(tiny_config(vocab))
    save_checkpoint(tmp_path / "done", model)
    save_checkpoint(tmp_path / "killed", model, step=3, meta={"final": False, "schedule": {"max_steps": 8}})
    cfg = parse_section(EvaluateConfig, {"batch_size": 4}, "evaluate")
    with caplog.at_level("WARNING", logger="pipeline.evaluate"):
        metrics, _ = evaluate_models(cfg, {"done": tmp_path / "done", "killed": tmp_path / "killed"},
                                     {"text": tmp_path / "val"}, tok_path, tmp_path / "report.json")
    [warning] = [r.getMessage() for r in caplog.records]
    assert "step-00000003 is not sft's final checkpoint (step 3 of 8); sft was interrupted: run `dvc repro sft`" \
        in warning and "killed scores describe an unfinished run" in warning
    assert metrics["killed"]["finished"] is False and "finished" not in metrics["done"]
    assert metrics["killed"]["val_loss"] == metrics["done"]["val_loss"]
    report = read_json(tmp_path / "report.json")
    assert report["killed"]["run_finished"] is False and report["done"]["run_finished"] is True


def test_missing_checkpoint_is_clear(tmp_path, tok_path):
    write_split(tmp_path / "val", synthetic_docs(20, 40, seed=3), seq_len=16)
    with pytest.raises(EvaluateError, match="run its training stage first"):
        evaluate_models(EvaluateConfig(), {"x": tmp_path / "none"}, {"text": tmp_path / "val"}, tok_path)


def test_a_tokenizer_the_model_was_not_trained_with_is_refused_before_any_scoring(tmp_path, tok_path):
    """Scored with another tokenizer, bits per byte counted other bytes and a sample's id
    past the embedding stopped the stage in a traceback: it is one line before any work."""
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.files import sha256_file
    from tests.helpers import train_tiny_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    other = tmp_path / "other" / "tokenizer.json"
    train_tiny_tokenizer(other, vocab_size=vocab + 100)
    model = tiny_model(tiny_config(vocab))
    save_checkpoint(tmp_path / "recorded", model, meta={"tokenizer_sha256": sha256_file(tok_path)})
    save_checkpoint(tmp_path / "unrecorded", model)  # no sha256 to compare: the ids still must fit
    cfg = parse_section(EvaluateConfig, {"samples": {"max_new_tokens": 2}}, "evaluate")
    for name, message in (("recorded", r"\S*other/tokenizer.json \(sha256 \w+…\) is not the tokenizer this model was "
                                       r"trained with .*; rerun the training stages on it"),
                          ("unrecorded", rf"the tokenizer has ids up to {vocab + 99} .*, the model embeds only "
                                         rf"{vocab}$")):
        with pytest.raises(EvaluateError, match=rf"^\S*{name}/step-00000005: {message}"):
            evaluate_models(cfg, {name: tmp_path / name}, {"text": tmp_path / "val"}, other, tmp_path / "report.json")
    assert not (tmp_path / "report.json").exists()
    evaluate_models(cfg, {"recorded": tmp_path / "recorded"}, {"text": tmp_path / "val"}, tok_path)  # its own passes


def test_a_split_made_with_another_tokenizer_is_one_line_not_an_index_error(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    docs = synthetic_docs(20, vocab, seed=3)
    docs[3][0] = vocab  # the first id of a larger tokenizer: past the byte table and the embedding
    write_split(tmp_path / "val", docs, seq_len=16)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab)))
    with pytest.raises(EvaluateError, match=rf"val: token id {vocab} is beyond the tokenizer's {vocab} ids or "
                                            rf"the model's {vocab}; the split was made with another tokenizer"):
        evaluate_models(EvaluateConfig(), {"m": tmp_path / "m"}, {"text": tmp_path / "val"}, tok_path)


def test_a_split_whose_manifest_names_another_tokenizer_is_refused_before_any_scoring(tmp_path, tok_path):
    """Another tokenizer of the same size gives ids in range: only the sha256 the
    split's manifest records tells the two apart."""
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.files import sha256_file, write_json

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "packed" / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab)))
    manifest = tmp_path / "packed" / "manifest.json"
    write_json(manifest, {"tokenizer_sha256": sha256_file(tok_path)})  # the same tokenizer: scored
    metrics, _ = evaluate_models(EvaluateConfig(), {"m": tmp_path / "m"}, {"text": tmp_path / "packed" / "val"},
                                 tok_path)
    assert math.isfinite(metrics["m"]["text"]["val_loss"])
    write_json(manifest, {"tokenizer_sha256": "ab" * 32})
    with pytest.raises(EvaluateError, match=rf"packed/val was made with another tokenizer \(sha256 abababababab…\) "
                                            rf"than {re.escape(str(tok_path))} \(sha256 [0-9a-f]{{12}}…\); rerun"):
        evaluate_models(EvaluateConfig(), {"m": tmp_path / "m"}, {"text": tmp_path / "packed" / "val"}, tok_path)


def test_each_source_is_scored_on_its_own_val_split(tmp_path, tok_path, caplog, monkeypatch):
    import pipeline.evaluate
    from pipeline.data.tokenizer import load_tokenizer

    bars = []
    monkeypatch.setattr(pipeline.evaluate, "progress", lambda **kw: bars.append(kw["desc"]) or kw["iterable"])

    vocab = load_tokenizer(tok_path).get_vocab_size()
    web, code = synthetic_docs(30, vocab, seed=4), synthetic_docs(20, vocab, seed=5)
    write_split(tmp_path / "val", web + code, seq_len=16)
    write_split(tmp_path / "val-web", web, seq_len=16)
    write_split(tmp_path / "val-code", code, seq_len=16)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab)))
    cfg = parse_section(EvaluateConfig, {"batch_size": 4}, "evaluate")
    sources = {"web": tmp_path / "val-web", "code": tmp_path / "val-code"}
    with caplog.at_level("INFO", logger="pipeline.evaluate"):
        metrics, models = evaluate_models(cfg, {"m": tmp_path / "m"}, {"text": tmp_path / "val"}, tok_path,
                                          tmp_path / "report.json", sources=sources)
    model = models["m"]
    # what the stage's output says: a bar per model and split, named, and one line of the model's scores
    assert bars == ["score m text", "score m source web", "score m source code"]
    m = metrics["m"]
    assert [r.getMessage() for r in caplog.records] == [
        f"m (step 5): text loss {m['val_loss']:.4f}, ppl {m['perplexity']:.2f}, {m['bits_per_byte']:.4f} bits/byte; "
        f"bits/byte by source: web {m['sources']['web']['bits_per_byte']:.4f}, "
        f"code {m['sources']['code']['bits_per_byte']:.4f}"]
    for name, path in sources.items():
        alone = score(model, PackedRows(path), token_bytes(load_tokenizer(tok_path)), batch_size=4, max_rows=None,
                      doc_mask=True, device=torch.device("cpu"), precision="fp32")
        assert metrics["m"]["sources"][name] == {k: alone[k] for k in ("val_loss", "perplexity", "bits_per_byte")}
        assert read_json(tmp_path / "report.json")["m"]["sources"][name]["bytes"] == alone["bytes"]
    assert metrics["m"]["sources"]["web"] != metrics["m"]["sources"]["code"]
    plain, _ = evaluate_models(cfg, {"m": tmp_path / "m"}, {"text": tmp_path / "val"}, tok_path)
    assert "sources" not in plain["m"]


@pytest.mark.parametrize("chat", [[""], ["What is os?", "  "]])
def test_an_empty_chat_sample_is_refused_before_any_work(chat):
    """It stopped the stage after the scoring, at the first sample, as `empty_content: message 0 (user)`."""
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"evaluate\.samples\.chat: .*is empty; a chat sample needs some text"):
        parse_section(EvaluateConfig, {"samples": {"chat": chat}}, "evaluate")


def test_a_top_p_of_zero_is_refused_before_any_work():
    # sampling keeps no token at top_p 0: it stopped the stage after the scoring
    with pytest.raises(ConfigError, match=r"evaluate.samples.top_p: Input should be greater than 0"):
        parse_section(EvaluateConfig, {"samples": {"top_p": 0}}, "evaluate")


def test_a_step_folder_scored_by_itself_reports_no_run_end(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    c = save_checkpoint(tmp_path / "run", tiny_model(tiny_config(vocab)))
    evaluate_models(EvaluateConfig(), {"step": c.path, "run": tmp_path / "run"}, {"text": tmp_path / "val"}, tok_path,
                    tmp_path / "report.json")
    report = read_json(tmp_path / "report.json")
    assert "run_finished" not in report["step"] and report["run"]["run_finished"] is True


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_sample_seed_out_of_range_is_refused_before_any_work(seed):
    """2^64 stopped the stage with a traceback after the scoring (torch: Overflow when unpacking long long)."""
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"evaluate\.samples\.seed: "):
        parse_section(EvaluateConfig, {"samples": {"seed": seed}}, "evaluate")


def test_the_dummy_prefix_comes_off_only_for_document_starts_that_are_scored(tmp_path):
    """SFT val with a dummy-prefix tokenizer: a document start whose label is
    -100 (a prompt token) is not scored, so its prefix byte is not in the bytes."""
    docs = [[5, 6, 0], [7, 8, 0], [9, 10, 11, 0], [12, 13, 0], [14, 15, 0]]  # 0 ends a document
    labels = [[t if t not in (7, 14) else -100 for t in d] for d in docs]
    write_split(tmp_path / "val", [np.array(d, np.int32) for d in docs], seq_len=7,
                labels=[np.array(x, np.int32) for x in labels])
    # rows (inputs | targets): 5 6 0 7 8 0 9 | 6 0 - 8 0 9 10  and  11 0 12 13 0 14 15 | 0 12 13 0 - 15 0
    m = score(tiny_model(tiny_config(16)), PackedRows(tmp_path / "val"), np.arange(16), batch_size=1,
              max_rows=None, doc_mask=True, device=torch.device("cpu"), precision="fp32", eot_id=0, prefix_bytes=1)
    # scored targets 6 0 8 0 9 10 and 0 12 13 0 15 0: 73 bytes, less one for each of 9 and 12 (after a 0)
    assert (m["tokens"], m["bytes"]) == (12, 73 - 2)
    assert m["bits_per_byte"] == pytest.approx(m["val_loss"] * 12 / math.log(2) / 71, rel=1e-9)


def test_the_top_level_scores_are_the_first_splits_and_the_report_has_every_split(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    text = write_split(tmp_path / "val", synthetic_docs(40, vocab, seed=3), seq_len=16)
    sft = write_split(tmp_path / "sft", synthetic_docs(20, vocab, seed=6), seq_len=16)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab)))
    cfg = parse_section(EvaluateConfig, {"batch_size": 4}, "evaluate")
    metrics, _ = evaluate_models(cfg, {"m": tmp_path / "m"}, {"text": tmp_path / "val", "sft": tmp_path / "sft"},
                                 tok_path, tmp_path / "report.json")
    m = metrics["m"]
    assert {k: m[k] for k in ("val_loss", "perplexity", "bits_per_byte")} == m["text"] != m["sft"]
    report = read_json(tmp_path / "report.json")["m"]
    assert (report["text"]["tokens"], report["sft"]["tokens"]) == (text["rows"] * 16, sft["rows"] * 16)


def test_evaluate_models_scores_max_rows_with_the_configured_doc_mask(tmp_path, tok_path):
    """evaluate.max_rows and evaluate.doc_mask reach the scoring: the first 3
    rows, each read as one sequence (no per-document attention)."""
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(40, vocab, seed=3), seq_len=16)
    model = tiny_model(tiny_config(vocab))
    save_checkpoint(tmp_path / "m", model)
    ids = torch.from_numpy(PackedRows(tmp_path / "val").input_ids(np.arange(3)).astype(np.int64))
    expected = {}
    for doc_mask in (False, True):
        cfg = parse_section(EvaluateConfig, {"batch_size": 2, "max_rows": 3, "doc_mask": doc_mask}, "evaluate")
        metrics, _ = evaluate_models(cfg, {"m": tmp_path / "m"}, {"text": tmp_path / "val"}, tok_path,
                                     tmp_path / "report.json")
        assert read_json(tmp_path / "report.json")["m"]["text"]["tokens"] == 3 * 16
        expected[doc_mask] = metrics["m"]["val_loss"]
    with torch.no_grad():
        logits = model(ids[:, :-1])
    nll = F.cross_entropy(logits.double().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    assert expected[False] == pytest.approx(nll / 48, rel=1e-5)
    assert expected[True] != pytest.approx(expected[False], rel=1e-3)  # the rows do hold several documents


def test_the_best_checkpoint_is_scored_when_asked_for(tmp_path, tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab), seed=1), step=2)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab), seed=2), step=4)
    (tmp_path / "m" / "best.json").write_text('{"step": 2, "path": "step-00000002", "val_loss": 1.0, '
                                              '"fingerprint": "ffffffffffffffff"}')
    cfg = parse_section(EvaluateConfig, {"batch_size": 4}, "evaluate")
    runs = {"m": tmp_path / "m"}
    split = {"text": tmp_path / "val"}
    best, _ = evaluate_models(cfg, runs, split, tok_path, tmp_path / "best.json", which={"m": "best"})
    last, _ = evaluate_models(cfg, runs, split, tok_path, tmp_path / "last.json")
    reports = {name: read_json(tmp_path / f"{name}.json")["m"] for name in ("best", "last")}
    assert (reports["best"]["checkpoint_step"], reports["last"]["checkpoint_step"]) == (2, 4)
    assert (reports["best"]["which"], reports["last"]["which"]) == ("best", "last")
    assert best["m"]["val_loss"] != last["m"]["val_loss"]


def test_sample_i_is_generated_with_the_seed_it_records(tmp_path, tok_path):
    """``samples.seed``: sample i uses seed + i, so a recorded sample can be
    generated again from its record."""
    from pipeline.data.tokenizer import load_specials, load_tokenizer
    from pipeline.model.generate import generate

    tok = load_tokenizer(tok_path)
    specials = load_specials(tok_path)
    model = tiny_model(tiny_config(tok.get_vocab_size()))
    cfg = parse_section(EvaluateConfig, {"samples": {"prompts": ["def f(x):", "def f(x):"], "chat": [], "seed": 7,
                                                     "max_new_tokens": 12}}, "evaluate").samples
    samples = record_samples(cfg, {"m": model}, tok_path)
    assert [s["seed"] for s in samples] == [7, 8]
    stops = [specials.eot_id, *specials.eos_ids]
    for s in samples:
        new = generate(model, tok.encode(s["prompt"], add_special_tokens=False).ids, max_new_tokens=12,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=s["seed"], stop_ids=stops)
        assert s["completion"] == tok.decode([t for t in new if t not in stops], skip_special_tokens=False)
    assert samples[0]["completion"] != samples[1]["completion"]  # the same prompt, another seed


def test_samples_stop_where_the_sft_data_says_and_leave_the_stop_out(tmp_path, tok_path, monkeypatch):
    """Chat samples stop at the SFT data's stop ids (its template's end of turn), raw text at the
    end-of-text and the tokenizer's eos ids; an empty prompt starts after an end-of-text; the
    completion leaves out the stop id it ended on."""
    import pipeline.model.generate
    from pipeline.data.tokenizer import EOT_ID, load_specials, load_tokenizer
    from pipeline.files import write_json

    tok, specials = load_tokenizer(tok_path), load_specials(tok_path)
    model = tiny_model(tiny_config(tok.get_vocab_size()))
    calls = []

    def fake_generate(model, prompt_ids, *, stop_ids, **kw):
        calls.append((list(prompt_ids), list(stop_ids)))
        return [tok.token_to_id("def"), stop_ids[0]]

    monkeypatch.setattr(pipeline.model.generate, "generate", fake_generate)
    write_json(tmp_path / "manifest.json", {"stop_ids": [9, 3]})
    cfg = parse_section(EvaluateConfig, {"samples": {"prompts": [""], "chat": ["hi"]}}, "evaluate").samples
    text, chat = record_samples(cfg, {"m": model}, tok_path, tmp_path / "manifest.json")
    assert calls[0] == ([EOT_ID], list(dict.fromkeys([EOT_ID, *specials.eos_ids])))
    assert calls[1][1] == [9, 3]
    assert text["completion"] == chat["completion"] == "def"


def test_max_rows_beyond_the_split_scores_every_row_in_batches_that_do_not_divide_it(tmp_path):
    """evaluate.max_rows larger than a small split (a quick check's max_rows: 1000 on a
    tiny corpus) reached past its last row: an IndexError instead of the whole split."""
    vocab = 40
    write_split(tmp_path / "val", synthetic_docs(30, vocab, seed=1), seq_len=16)
    rows = PackedRows(tmp_path / "val")
    assert len(rows) % 4 != 0
    kw = dict(batch_size=4, doc_mask=True, device=torch.device("cpu"), precision="fp32")
    whole = score(tiny_model(tiny_config(vocab)), rows, np.full(vocab, 2), max_rows=None, **kw)
    beyond = score(tiny_model(tiny_config(vocab)), rows, np.full(vocab, 2), max_rows=len(rows) + 100, **kw)
    assert beyond == whole and whole["tokens"] == len(rows) * 16


def test_an_id_past_the_models_embedding_is_one_line_even_when_the_byte_table_has_it(tmp_path):
    """score checks ids against the model as well as the byte table: a table of a
    larger tokenizer let an id past the embedding through to an IndexError."""
    write_split(tmp_path / "val", synthetic_docs(30, 60, seed=1), seq_len=16)
    with pytest.raises(EvaluateError, match=r"beyond the tokenizer's 100 ids or the model's 40"):
        score(tiny_model(tiny_config(40)), PackedRows(tmp_path / "val"), np.full(100, 2), batch_size=4,
              max_rows=None, doc_mask=True, device=torch.device("cpu"), precision="fp32")


def test_the_models_scored_and_sampled_are_in_eval_mode(tmp_path, tok_path):
    """The contract load_checkpoint_model states: scores and samples come from eval-mode
    modules, whatever layers (dropout) a model family adds."""
    from pipeline.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(tok_path).get_vocab_size()
    write_split(tmp_path / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    save_checkpoint(tmp_path / "m", tiny_model(tiny_config(vocab)))
    cfg = parse_section(EvaluateConfig, {"batch_size": 4}, "evaluate")
    _, models = evaluate_models(cfg, {"m": tmp_path / "m"}, {"text": tmp_path / "val"}, tok_path)
    assert not any(module.training for module in models["m"].modules())


def test_samples_of_no_new_tokens_are_refused_before_any_work():
    # every completion would be empty, and samples.json would look like a model with nothing to say
    with pytest.raises(ConfigError, match=r"evaluate\.samples\.max_new_tokens: Input should be greater than or equal to 1"):
        parse_section(EvaluateConfig, {"samples": {"max_new_tokens": 0}}, "evaluate")


def test_token_bytes_counts_a_plain_added_tokens_text_in_utf8(tmp_path):
    """An added token that is not special (an adopted tokenizer's extra words) is
    matched in the raw text, so its string is text, not the byte-level alphabet:
    "héllo✓" stood for 6 bytes instead of its 9, and bits per byte came out high."""
    from tokenizers import AddedToken

    from tests.helpers import train_tiny_tokenizer

    tok = train_tiny_tokenizer(tmp_path / "tokenizer.json")
    tok.add_tokens([AddedToken("héllo✓", special=False), AddedToken("<tool>", special=False)])
    nbytes = token_bytes(tok)
    for text in ["say héllo✓ now", "<tool>ünïcode", "plain"]:
        enc = tok.encode(text, add_special_tokens=False)
        assert int(nbytes[enc.ids].sum()) == len(text.encode("utf-8")), enc.tokens
    assert "héllo✓" in tok.encode("say héllo✓ now", add_special_tokens=False).tokens
