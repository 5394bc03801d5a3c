import json
import logging
import random
import re
import shutil
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers

from pipeline import layout
from pipeline.config import ConfigError, parse_section
from pipeline.data import tokenizer as tokenizer_module
from pipeline.data.tokenizer import (
    EOT,
    EOT_ID,
    HF_TOKENIZER_FILES,
    IM_END,
    IM_START,
    OWN_SPECIALS,
    PAD,
    ROUNDTRIP_PROBES,
    SOURCE_TRAIN,
    SPECIAL_TOKENS,
    TRAINING_KEYS,
    TokenizerConfig,
    TokenizerError,
    build,
    build_tokenizer,
    check_fits,
    check_roundtrip,
    check_trained_with,
    choose_sample,
    id_space,
    load_specials,
    load_tokenizer,
    special_ids,
    train_tokenizer,
)
from pipeline.files import read_json, sha256_file

WORDS = ["def", "return", "self", "value", "import", "the", "data", "for", "in", "if", "else", "None",
         "naïve", "café", "日本", "数据", "🎉", "x", "y", "print", "class", "lambda"]


def make_docs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = []
        for _ in range(rng.randint(3, 30)):
            indent = rng.choice(["", "    ", "\t", "        "])
            lines.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))))
        docs.append((f"doc{i:04d}", "\n".join(lines) + "\n"))
    return docs


def write_docs(path, docs) -> None:
    table = pa.table({
        "id": [d[0] for d in docs],
        "text": [d[1] for d in docs],
        "source": ["test"] * len(docs),
        "location": [str(i) for i in range(len(docs))],
    })
    pq.write_table(table, path, row_group_size=50)


SMALL = TokenizerConfig(vocab_size=400, sample_bytes=20_000, eval_bytes=2_000)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "docs.parquet"
    write_docs(path, make_docs(200))
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokout") / "tokenizer.json"
    metrics = train_tokenizer(SMALL, corpus, out, out.parent / "report.json")
    return out, metrics, read_json(out.parent / "report.json")


def test_special_tokens_have_fixed_ids(trained):
    tok = load_tokenizer(trained[0])
    assert special_ids(tok) == {"eot": 0, "pad": 1, "im_start": 2, "im_end": 3}
    assert [tok.id_to_token(i) for i in range(4)] == [EOT, PAD, IM_START, IM_END] == list(SPECIAL_TOKENS)
    # all 256 bytes are in the vocabulary, so nothing is ever unknown
    assert tok.get_vocab_size() >= 256 + 4


TRICKY = [
    *ROUNDTRIP_PROBES,
    "if x:\n\treturn  [1,\t2]\n\n\n        # comment   \n",
    "   leading and trailing   ",
    "\n",
    "🦀🐍" * 20,
    "Ἀρχιμήδης — ∮ E⋅da = Q,  n → ∞",
    "mixed\u00a0nbsp\u2028line\u2029para",
]


@pytest.mark.parametrize("text", TRICKY)
def test_exact_roundtrip(trained, text):
    tok = load_tokenizer(trained[0])
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_special_strings_in_text_are_not_special(trained):
    tok = load_tokenizer(trained[0])
    text = f"a{EOT}b {IM_START}user\nhi{IM_END}{PAD}"
    ids = tok.encode(text).ids
    assert min(ids) >= len(SPECIAL_TOKENS)
    assert tok.decode(ids) == text
    # the opt-in path for trusted templates does see them
    assert 0 in load_tokenizer(trained[0], parse_special=True).encode(text).ids


def test_metrics_report_and_output(trained, corpus):
    out, m, report = trained
    assert report["roundtrip_ok"] is True
    assert m["vocab_size"] <= SMALL.vocab_size == report["vocab_size_requested"]
    assert m["vocab_size"] == load_tokenizer(out).get_vocab_size()
    assert 0 < m["sample_bytes"] <= SMALL.sample_bytes
    assert report["heldout_docs"] > 0 and report["bytes_per_token_on"] == "heldout"
    assert m["bytes_per_token"] > 1.0  # BPE merged something
    assert report["corpus_docs"] == 200
    assert report["sha256"] == sha256_file(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.json", "specials.json", "tokenizer.json"]  # no temp files
    assert load_specials(out) == OWN_SPECIALS
    json.loads(out.read_text())
    # bytes per token is measured on the held-out documents, none of which was trained on
    _, heldout, _ = choose_sample(corpus, SMALL.sample_bytes, SMALL.eval_bytes, SMALL.seed)
    texts = [t for t, held in zip(pq.read_table(corpus).column("text").to_pylist(), heldout) if held]
    tok = load_tokenizer(out)
    tokens = sum(len(tok.encode(t).ids) for t in texts)
    assert len(texts) == report["heldout_docs"]
    assert m["bytes_per_token"] == round(sum(len(t.encode()) for t in texts) / tokens, 4)


def test_a_vocabulary_smaller_than_asked_is_a_warning_naming_both_sizes(corpus, tmp_path, caplog):
    """The test corpus (22 words) runs out of pairs to merge near 357 tokens: asked
    for 400, the tokenizer is smaller, and the log says so, not only report.json."""
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        m = train_tokenizer(SMALL, corpus, tmp_path / "t.json")
    assert m["vocab_size"] < SMALL.vocab_size
    assert f"tokenizer.vocab_size is 400 but the trained tokenizer has {m['vocab_size']} tokens: the BPE trainer " \
           f"ran out of pairs to merge in its sample ({m['sample_bytes']:,} bytes; pairs seen fewer than " \
           "tokenizer.min_frequency = 2 times are not merged): give it more text (tokenizer.sample_bytes, or a " \
           "larger corpus) or a smaller tokenizer.vocab_size" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        m = train_tokenizer(TokenizerConfig(vocab_size=300, sample_bytes=20_000, eval_bytes=2_000), corpus,
                            tmp_path / "t.json")
    assert m["vocab_size"] == 300 and "tokenizer.vocab_size" not in caplog.text


def test_pairs_seen_fewer_than_min_frequency_times_are_not_merged(corpus, tmp_path, caplog):
    """No pair of the sample is seen a million times: nothing is merged, and the
    warning names the setting that stopped it."""
    cfg = TokenizerConfig(vocab_size=400, min_frequency=10**6, sample_bytes=20_000, eval_bytes=2_000)
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        m = train_tokenizer(cfg, corpus, tmp_path / "t.json")
    assert m["vocab_size"] == 256 + len(SPECIAL_TOKENS)
    assert "pairs seen fewer than tokenizer.min_frequency = 1000000 times are not merged" in caplog.text


def test_the_tokenizer_is_the_same_bytes_whatever_the_row_order_and_read_batches(corpus, tmp_path, trained,
                                                                                 monkeypatch):
    """The clean stage's row order depends on its workers and executor, and the
    corpus is streamed in batches: neither may change a byte of tokenizer.json,
    which the pipeline's outputs are compared by."""
    docs = list(zip(*pq.read_table(corpus, columns=["id", "text"]).to_pydict().values()))
    shuffled = tmp_path / "shuffled.parquet"
    write_docs(shuffled, random.Random(7).sample(docs, len(docs)))
    monkeypatch.setattr(tokenizer_module, "READ_BATCH_ROWS", 7)  # many batches, rows read by their offsets
    for path in (corpus, shuffled):
        train_tokenizer(SMALL, path, tmp_path / "t.json", tmp_path / "report.json")
        assert (tmp_path / "t.json").read_bytes() == trained[0].read_bytes()
        assert read_json(tmp_path / "report.json") == trained[2]


@pytest.mark.slow
def test_the_tokenizer_is_the_same_bytes_with_the_trainer_s_threads_on(corpus, tmp_path, trained):
    """The tests train with TOKENIZERS_PARALLELISM=false (conftest), the stage
    with the BPE trainer's thread pool on: both give one tokenizer.json. The
    pool is set once per process, hence a subprocess."""
    import os
    import subprocess
    import sys

    code = ("import sys; from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer; "
            "train_tokenizer(TokenizerConfig(vocab_size=400, sample_bytes=20_000, eval_bytes=2_000), sys.argv[1], "
            "sys.argv[2])")
    assert SMALL == TokenizerConfig(vocab_size=400, sample_bytes=20_000, eval_bytes=2_000)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "4"}
    subprocess.run([sys.executable, "-c", code, str(corpus), str(tmp_path / "t.json")], env=env, check=True,
                   cwd=Path(__file__).resolve().parents[3])
    assert (tmp_path / "t.json").read_bytes() == trained[0].read_bytes()


def test_the_stage_trains_on_the_clean_docs_into_the_tokenizer_folder(corpus, tmp_path, trained, monkeypatch):
    from stages import tokenizer as stage

    monkeypatch.chdir(tmp_path)
    layout.CLEAN_DOCS.parent.mkdir(parents=True)
    shutil.copyfile(corpus, layout.CLEAN_DOCS)  # one Parquet file where the clean stage writes its folder
    assert stage.main(SMALL) == {**trained[1], "train_seconds": ANY, "total_seconds": ANY}
    assert layout.TOKENIZER_JSON.read_bytes() == trained[0].read_bytes()
    assert read_json(stage.REPORT) == trained[2] and stage.REPORT.parent == layout.TOKENIZER_DIR


def test_sample_respects_bound_is_spread_and_disjoint(corpus):
    sample, heldout, stats = choose_sample(corpus, 10_000, 3_000, seed=0)
    sizes = np.array([len(t.encode()) for t in pq.read_table(corpus).column("text").to_pylist()])
    assert sizes[sample].sum() <= 10_000
    assert sizes[sample].sum() > 10_000 - sizes.max()  # greedy fill, not a token gesture
    assert sizes[heldout].sum() <= 3_000
    assert not (sample & heldout).any()
    idx = np.flatnonzero(sample)
    assert idx.max() > 2 * len(idx)  # not simply the first rows
    assert stats["corpus_bytes"] == sizes.sum()


@pytest.mark.parametrize("pre_taken, budget, taken", [
    ([], 7, [0, 2]),  # 3 does not fit after 5; 2 fills the budget exactly
    ([1], 8, [0, 1, 2]),  # a document taken already (held out) is passed over and spends nothing
    ([], 4, [1]),  # a document larger than the budget is passed over, so one huge one cannot crowd the rest out
])
def test_the_sample_takes_whole_documents_in_rank_order_while_they_fit(pre_taken, budget, taken):
    sizes = np.array([5, 3, 2, 9])
    mask = np.zeros(len(sizes), bool)
    mask[pre_taken] = True
    tokenizer_module._greedy(np.arange(len(sizes)), sizes, budget, mask)
    assert np.flatnonzero(mask).tolist() == taken


def test_sample_depends_on_seed_and_ids_not_row_order(corpus, tmp_path):
    docs = list(zip(*pq.read_table(corpus, columns=["id", "text"]).to_pydict().values()))
    shuffled = tmp_path / "shuffled.parquet"
    write_docs(shuffled, random.Random(1).sample(docs, len(docs)))

    def chosen(path, seed):
        mask, _, _ = choose_sample(path, 10_000, 3_000, seed)
        ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
        return {i for i, m in zip(ids, mask) if m}

    assert chosen(corpus, 0) == chosen(shuffled, 0)
    assert chosen(corpus, 0) != chosen(corpus, 1)


def test_documents_that_share_an_id_are_warned_about(tmp_path, caplog):
    """The sample is the same whatever the row order only for distinct ids: equal
    ids rank alike, and their row order picks among them."""
    path = tmp_path / "dups.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "a", None, None, "a"], "text": ["x"] * 6}), path)
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        choose_sample(path, 1_000, 1_000, seed=0)
    assert f"{path}: 3 document(s) have the id of one before them in rank order, so which of them the sample (and " \
           "the held-out set) takes depends on the row order" in caplog.text  # two more a's, a second null
    caplog.clear()
    write_docs(path, make_docs(50))
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        choose_sample(path, 1_000, 1_000, seed=0)
    assert caplog.text == ""


def test_the_held_out_documents_are_the_last_in_rank_order_and_at_most_a_tenth(tmp_path):
    path = tmp_path / "even.parquet"
    write_docs(path, [(f"d{i:03d}", f"{i:03d}" + "x" * 96 + "\n") for i in range(100)])  # 100 bytes each
    sample, heldout, _ = choose_sample(path, 2_000, 1_500, seed=3)  # 1,500 asked, a tenth of 10,000 given
    by_rank = sorted(range(100), key=lambda i: tokenizer_module._rank(3, f"d{i:03d}"))
    assert set(np.flatnonzero(heldout)) == set(by_rank[-10:])
    assert set(np.flatnonzero(sample)) == set(by_rank[:20])


def test_when_no_document_fits_the_first_one_not_held_out_is_trained_on(tmp_path):
    """Every document is larger than sample_bytes: the first in rank order is
    taken (train_tokenizer clips it), but not one held out, which the held-out
    greedy can reach from the far end by passing over the large ones."""
    by_rank = sorted((f"d{i}" for i in range(10)), key=lambda i: tokenizer_module._rank(0, i))
    path = tmp_path / "large.parquet"
    write_docs(path, [(i, "x" * (100 if i == by_rank[0] else 2_000)) for i in sorted(by_rank)])
    ids = sorted(by_rank)
    sample, heldout, _ = choose_sample(path, 50, 10**6, seed=0)
    assert [ids[i] for i in np.flatnonzero(heldout)] == [by_rank[0]]
    assert [ids[i] for i in np.flatnonzero(sample)] == [by_rank[1]]


def test_the_one_document_to_train_on_is_not_also_held_out(tmp_path):
    """A corpus almost all split: val: its one other document is what training
    gets, so it leaves the held-out set (which must not overlap the sample)."""
    path = tmp_path / "mostly_val.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["v" * 10_000, "t" * 100], "split": ["val", None]}), path)
    sample, heldout, _ = choose_sample(path, 1_000, 10**6, seed=0)
    assert sample.tolist() == [False, True] and not heldout.any()


def test_documents_without_text_are_neither_held_out_nor_trained_on(tmp_path):
    path = tmp_path / "gaps.parquet"
    texts = ["", None, *(f"document {i} " * 20 for i in range(30))]
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(len(texts))], "text": texts}), path)
    sample, heldout, _ = choose_sample(path, 10**6, 10**6, seed=0)
    assert heldout.any() and not heldout[:2].any() and not sample[:2].any() and sample[2:].sum() > 20


def test_sample_weights_with_every_document_over_its_share_train_on_a_prefix_of_one(tmp_path):
    path = tmp_path / "large.parquet"
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(20)], "text": [f"{i} " + "word " * 400 for i in range(20)],
                             "source_name": ["a", "b"] * 10}), path)  # 2,000 bytes each, over a share of 500
    cfg = TokenizerConfig(vocab_size=300, sample_bytes=1_000, eval_bytes=1_000, sample_weights={"a": 1, "b": 1})
    m = train_tokenizer(cfg, path, tmp_path / "t.json", tmp_path / "report.json")
    assert read_json(tmp_path / "report.json")["sample_docs"] == 1
    assert 900 < m["sample_bytes"] <= 1_000  # one document, clipped to the bound, not nothing


def test_a_corpus_of_empty_texts_has_no_text_to_train_on(tmp_path):
    path = tmp_path / "blank.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["", None]}), path)
    with pytest.raises(TokenizerError, match=r"no text to train on \(2 documents, 0 bytes\)"):
        choose_sample(path, 1_000, 1_000, seed=0)


def test_documents_marked_for_validation_are_never_trained_on(corpus, tmp_path):
    table = pq.read_table(corpus)
    marks = ["val" if i % 3 == 0 else None for i in range(table.num_rows)]
    marked = tmp_path / "marked.parquet"
    pq.write_table(table.append_column("split", pa.array(marks, pa.string())), marked)
    sample, _, _ = choose_sample(marked, 10**9, 3_000, seed=0)  # a budget that would take everything
    val = np.array([m == "val" for m in marks])
    assert not (sample & val).any() and sample[~val].sum() > 0.8 * (~val).sum()
    pq.write_table(table.append_column("split", pa.array(["val"] * table.num_rows)), marked)
    for adopting in (False, True):  # an adopted tokenizer trains nothing, but the model would have no train split
        with pytest.raises(TokenizerError, match="every document with text is marked split: val, so train would "
                                                 "be empty: a source must be left unmarked"):
            choose_sample(marked, 0 if adopting else 10_000, 3_000, seed=0)


def test_training_is_deterministic(corpus, tmp_path, trained):
    again = tmp_path / "again.json"
    train_tokenizer(SMALL, corpus, again)
    assert again.read_bytes() == trained[0].read_bytes()


def test_huge_single_document_is_clipped_to_the_bound(tmp_path):
    docs = tmp_path / "docs.parquet"
    write_docs(docs, [("big", "word " * 5_000), ("big2", "more text " * 3_000)])
    cfg = TokenizerConfig(vocab_size=300, sample_bytes=2_000, eval_bytes=1_000)
    m = train_tokenizer(cfg, docs, tmp_path / "t.json", tmp_path / "report.json")
    assert 0 < m["sample_bytes"] <= 2_000
    assert read_json(tmp_path / "report.json")["sample_docs"] == 1


def test_a_huge_single_document_is_clipped_in_utf8_bytes_at_a_character(tmp_path):
    docs = tmp_path / "docs.parquet"
    write_docs(docs, [("big", "xx" + "日本語 " * 300)])  # 3,002 bytes: too many, in 1,202 characters
    cfg = TokenizerConfig(vocab_size=300, sample_bytes=2_000, eval_bytes=1_000)
    assert train_tokenizer(cfg, docs, tmp_path / "t.json")["sample_bytes"] == 1_998  # 2,000 cuts a character


def dummy_prefixed(kind: str) -> Tokenizer:
    tok = build_tokenizer()
    if kind == "byte-level prefix space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    elif kind in ("\u2581", " "):
        tok.pre_tokenizer, tok.normalizer = None, normalizers.Prepend(kind)
    return tok


@pytest.mark.parametrize("kind, prefixed", [("ours", False), ("byte-level prefix space", True), ("metaspace", True),
                                            ("\u2581", True), (" ", True)])
def test_a_dummy_prefix_is_measured_from_what_the_tokenizer_makes_of_a_text(kind, prefixed):
    assert tokenizer_module.adds_dummy_prefix(dummy_prefixed(kind)) is prefixed


def test_roundtrip_check_catches_text_that_encodes_to_a_special_id(trained):
    tok = load_tokenizer(trained[0], parse_special=True)  # as a loader that parses specials would
    with pytest.raises(TokenizerError, match="^round-trip check: doc A encodes to a special token id$"):
        check_roundtrip(tok, [("doc A", f"a {EOT} b")])


def test_a_corpus_too_small_to_hold_any_out_is_measured_on_a_tenth_of_the_sample(tmp_path):
    docs = tmp_path / "docs.parquet"
    write_docs(docs, [(f"d{i:02d}", f"document {i} " + "word " * 300) for i in range(20)])  # > eval_bytes each
    cfg = TokenizerConfig(vocab_size=300, sample_bytes=100_000, eval_bytes=1_000)
    train_tokenizer(cfg, docs, tmp_path / "t.json", tmp_path / "report.json")
    report = read_json(tmp_path / "report.json")
    assert (report["heldout_docs"], report["sample_docs"], report["bytes_per_token_on"]) == (0, 20, "sample")
    assert report["roundtrip_docs"] == 2 + len(ROUNDTRIP_PROBES)


def test_roundtrip_check_catches_a_lossy_tokenizer():
    tok = build_tokenizer()
    tok.normalizer = normalizers.Lowercase()
    with pytest.raises(TokenizerError, match=r"round-trip check failed on doc A at character 0 \(U\+0048 came back "
                                             r"as the end\): 'Hello' came back as ''$"):  # no vocabulary at all
        check_roundtrip(tok, [("doc A", "Hello")])
    # a change the excerpts print alike (NFC, as Qwen's normalizer does) is told by its code points
    tok.train_from_iterator([], trainers.BpeTrainer(initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    tok.normalizer = normalizers.NFC()
    with pytest.raises(TokenizerError, match=r"at character 1 \(U\+0065 came back as U\+00E9\)"):
        check_roundtrip(tok, [("doc B", "ne\u0301e")])
    tok.normalizer = normalizers.Replace("\n", "")  # text lost at the end
    with pytest.raises(TokenizerError, match=r"at character 2 \(U\+000A came back as the end\)"):
        check_roundtrip(tok, [("doc C", "ab\n")])


def test_errors(tmp_path, trained):
    with pytest.raises(TokenizerError, match="documents not found"):
        train_tokenizer(SMALL, tmp_path / "missing.parquet", tmp_path / "t.json")
    empty = tmp_path / "empty.parquet"
    write_docs(empty, [])
    with pytest.raises(TokenizerError, match="no text"):
        train_tokenizer(SMALL, empty, tmp_path / "t.json")
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), nocol)
    with pytest.raises(TokenizerError, match=r"missing column\(s\) \['text'\]"):
        train_tokenizer(SMALL, nocol, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()

    with pytest.raises(TokenizerError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        load_tokenizer(bad)
    # a tokenizer whose specials moved is refused, since packed data and models depend on the ids
    tok = build_tokenizer()
    tok.train_from_iterator(["abc abd"], trainers.BpeTrainer(vocab_size=300, special_tokens=[PAD, EOT],
                                                             show_progress=False))
    swapped = tmp_path / "swapped.json"
    tok.save(str(swapped))
    with pytest.raises(TokenizerError, match=r"special token '<\|endoftext\|>' has id 1, expected 0; retrain"):
        load_tokenizer(swapped)


def test_a_specials_file_from_before_adoption_is_our_own_tokenizer_s(tmp_path):
    (tmp_path / "specials.json").write_text('{"eot_id": 0, "pad_id": 1, "bos_id": null, "eos_ids": [3, 0]}')
    specials = load_specials(tmp_path / "tokenizer.json")
    assert specials.own and specials.ids() == {"eot": 0, "pad": 1, "im_start": 2, "im_end": 3}


@pytest.mark.parametrize("specials", ['{"eot_id": 5, "pad_id": 5, "eos_ids": 5}', '[5]', '{"eot_id": null}',
                                      '{"pad_id": 1, "eos_ids": [1]}', '{"eot_id": "x"'])
def test_a_damaged_specials_file_is_one_line(tmp_path, specials):
    (tmp_path / "specials.json").write_text(specials)
    with pytest.raises(TokenizerError, match=r"specials.json: unreadable \(\w+Error: .*\); rerun the tokenizer stage"):
        load_specials(tmp_path / "tokenizer.json")


def named(corpus, tmp_path, names):
    """The corpus with a source name for each document."""
    table = pq.read_table(corpus)
    path = tmp_path / "named.parquet"
    pq.write_table(table.append_column("source_name", pa.array(names)), path)
    return path, np.array([len(t.encode()) for t in table.column("text").to_pylist()])


def test_sample_weights_give_each_source_its_share_of_the_sample(corpus, tmp_path):
    """A mixture's upweighted source is trained on as much as its weight says,
    not as much as its size: here 'small' holds a quarter of the documents and
    asks for half the sample."""
    names = ["small" if i % 4 == 0 else "big" for i in range(200)]
    path, sizes = named(corpus, tmp_path, names)
    small = np.array([n == "small" for n in names])
    plain, _, _ = choose_sample(path, 20_000, 3_000, seed=0)
    assert sizes[plain & small].sum() < 0.4 * sizes[plain].sum()  # by hash alone: about its share of the text
    sample, heldout, stats = choose_sample(path, 20_000, 3_000, seed=0, weights={"big": 1.0, "small": 1.0})
    assert not (sample & heldout).any()
    got = {"big": int(sizes[sample & ~small].sum()), "small": int(sizes[sample & small].sum())}
    assert stats["sample_bytes_per_source"] == got
    for n in got:  # each fills its half greedily, short of it by less than its largest document
        assert 10_000 - sizes.max() < got[n] <= 10_000
    assert stats["heldout_sources"] == [n for n, h in zip(names, heldout) if h]
    # the same seed and ids give the same sample whatever the weights' order; another weight another share
    again, _, _ = choose_sample(path, 20_000, 3_000, seed=0, weights={"small": 1.0, "big": 1.0})
    assert (again == sample).all()
    _, _, stats = choose_sample(path, 20_000, 3_000, seed=0, weights={"big": 3.0, "small": 1.0})
    assert 5_000 - sizes.max() < stats["sample_bytes_per_source"]["small"] <= 5_000


def test_a_source_short_of_its_share_is_repeated_up_to_it_and_names_must_match(corpus, tmp_path, caplog):
    """As pack upsamples a mixture's source: every document of the source the
    same number of times, then one more time for some, in rank order."""
    names = ["small" if i % 20 == 0 else "big" for i in range(200)]
    path, sizes = named(corpus, tmp_path, names)
    with caplog.at_level("INFO", logger="pipeline.data.tokenizer"):
        sample, heldout, stats = choose_sample(path, 30_000, 3_000, seed=0, weights={"big": 1, "small": 1})
    small = np.array([n == "small" for n in names])
    have = int(sizes[small & ~heldout].sum())
    copies = np.zeros(len(names), np.int64)
    copies[sample] = stats["copies"]
    assert (sample == (copies > 0)).all() and not (sample & heldout).any()
    assert have < 15_000 and set(copies[small & ~heldout]) == {15_000 // have, 15_000 // have + 1}
    assert set(copies[~small & sample]) == {1}  # big has enough: each document once
    assert 15_000 - sizes.max() < stats["sample_bytes_per_source"]["small"] == int((sizes * copies)[small].sum()) \
        <= 15_000
    assert stats["text_used_per_source"]["small"] == round(stats["sample_bytes_per_source"]["small"] / have, 4)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"source 'small' has {have:,} bytes of text to train the tokenizer on, less than its "
                           "share of the sample, 15,000 bytes (weight 1 of 2): its documents are repeated")
    with pytest.raises(TokenizerError, match=r"no entry for source\(s\) \['small'\]"):
        choose_sample(path, 10_000, 3_000, seed=0, weights={"big": 1})
    with pytest.raises(TokenizerError, match=r"names source\(s\) \['web'\] that have no train documents"):
        choose_sample(path, 10_000, 3_000, seed=0, weights={"big": 1, "small": 1, "web": 1})
    with pytest.raises(TokenizerError, match="needs the documents' source names"):
        choose_sample(corpus, 10_000, 3_000, seed=0, weights={"big": 1})


def test_sample_weights_need_no_entry_for_a_source_of_validation_documents(corpus, tmp_path):
    names = ["bench" if i % 10 == 0 else "web" if i % 2 else "code" for i in range(200)]
    path, _ = named(corpus, tmp_path, names)
    marked = tmp_path / "marked.parquet"
    table = pq.read_table(path)
    pq.write_table(table.append_column("split", pa.array(["val" if n == "bench" else None for n in names])), marked)
    sample, _, stats = choose_sample(marked, 10_000, 3_000, seed=0, weights={"web": 1, "code": 1})
    assert sorted(stats["sample_bytes_per_source"]) == ["code", "web"]
    assert not any(sample[i] for i, n in enumerate(names) if n == "bench")


def test_a_small_vocabulary_from_a_sample_of_repeats_asks_for_a_larger_corpus(corpus, tmp_path, caplog):
    """With sample_weights, a source short of its share is repeated up to it: the
    sample's bytes are then mostly copies, and more tokenizer.sample_bytes would
    only add copies, so the warning gives the distinct bytes and asks for text."""
    names = ["small" if i % 20 == 0 else "big" for i in range(200)]
    path, _ = named(corpus, tmp_path, names)
    cfg = TokenizerConfig(vocab_size=8192, sample_bytes=60_000, eval_bytes=3_000, sample_weights={"big": 1, "small": 1})
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        m = train_tokenizer(cfg, path, tmp_path / "t.json")
    [line] = [r.getMessage() for r in caplog.records if "trained tokenizer has" in r.getMessage()]
    assert line.startswith(f"tokenizer.vocab_size is 8192 but the trained tokenizer has {m['vocab_size']} tokens: "
                           f"the BPE trainer ran out of pairs to merge in its sample ({m['sample_bytes']:,} bytes, "
                           "of which ")
    assert line.endswith(" are distinct text, repeated for sample_weights; pairs seen fewer than "
                         "tokenizer.min_frequency = 2 times are not merged): give it more text (a larger corpus: the "
                         "sample already repeats what it has) or a smaller tokenizer.vocab_size")


def test_sample_weights_near_the_largest_float_share_as_any_others(corpus, tmp_path):
    """Their sum overflows to inf, and each share (weight over sum) would be 0 or
    NaN, a traceback; they share as their ratios do, as pack's mixture weights do."""
    names = ["small" if i % 4 == 0 else "big" for i in range(200)]
    path, _ = named(corpus, tmp_path, names)
    huge = choose_sample(path, 20_000, 3_000, seed=0, weights={"big": 1.5e308, "small": 1.5e308})
    plain = choose_sample(path, 20_000, 3_000, seed=0, weights={"big": 1.0, "small": 1.0})
    assert (huge[0] == plain[0]).all() and huge[2]["sample_bytes_per_source"] == plain[2]["sample_bytes_per_source"]


def test_sample_weights_report_each_source_s_sample_and_bytes_per_token(corpus, tmp_path):
    names = ["small" if i % 20 == 0 else "big" for i in range(200)]
    path, _ = named(corpus, tmp_path, names)
    cfg = TokenizerConfig(vocab_size=400, sample_bytes=30_000, eval_bytes=3_000, sample_weights={"big": 1, "small": 1})
    metrics = train_tokenizer(cfg, path, tmp_path / "out" / "tokenizer.json", tmp_path / "out" / "report.json")
    report = read_json(tmp_path / "out" / "report.json")
    assert set(report["sample_bytes_per_source"]) == {"big", "small"} == set(report["text_used_per_source"])
    assert sum(report["sample_bytes_per_source"].values()) == metrics["sample_bytes"]  # what BPE was trained on
    assert report["text_used_per_source"]["small"] > 2 and report["text_used_per_source"]["big"] < 0.5
    per_source = report["heldout_bytes_per_token_per_source"]
    assert set(per_source) <= {"big", "small"} and per_source
    assert min(per_source.values()) <= metrics["bytes_per_token"] <= max(per_source.values())


@pytest.mark.parametrize("key, value, msg", [
    ("sample_weights", {"web": -1, "code": 1}, r"weights are finite and >= 0 \(got \{'web': -1\.0\}\)"),
    ("sample_weights", {"web": 0}, "at least one weight is above 0"),
    ("vocab_size", 100, "greater than or equal to 260"),
    ("sample_bytes", 10, "greater than or equal to 1000"),
    ("min_frequency", 0, "greater than or equal to 1"),
    ("vocab_sise", 5, "unknown key"),
])
def test_config_errors_name_the_key(key, value, msg):
    with pytest.raises(ConfigError, match=rf"tokenizer\.{key}: .*{msg}"):
        parse_section(TokenizerConfig, {key: value}, "tokenizer")


# --- adopting a Hugging Face model's tokenizer -------------------------------------------------

# family -> (end-of-text token pack separates documents with, first stop id's text, bos text)
ADOPTED = {
    "qwen2": ("<|endoftext|>", "<|im_end|>", None),
    "qwen3": ("<|endoftext|>", "<|im_end|>", None),
    "llama3": ("<|end_of_text|>", "<|eot_id|>", "<|begin_of_text|>"),
    "mistral": ("</s>", "</s>", "<s>"),
}


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    from tests.hf_tokenizers import save_family_tokenizer

    root = tmp_path_factory.mktemp("families")
    return {family: save_family_tokenizer(family, root / family) for family in ADOPTED}


def adopt(folder, out_dir, corpus, **cfg):
    cfg = TokenizerConfig(source=str(folder), **cfg)
    return build(cfg, corpus, out_dir / "tokenizer.json", out_dir / "report.json")


def test_adopting_measures_on_a_documents_folder_as_the_stage_gives_it(family_folders, corpus, tmp_path):
    """The clean stage's output is a documents folder, not one file: the adopted
    tokenizer's bytes per token and round trip are measured on it all the same."""
    from pipeline.data.docs import FORMAT
    from pipeline.data.resume import ShardLog

    table = pq.read_table(corpus)
    folder = tmp_path / "docs"
    log = ShardLog(folder, "test")
    log.open()
    log.commit(0, lambda tmp: pq.write_table(table, tmp), {"rows": table.num_rows})
    log.finish(1, {"format": FORMAT, "rows": table.num_rows})
    from_file = adopt(family_folders["qwen2"], tmp_path / "file", corpus)
    from_folder = adopt(family_folders["qwen2"], tmp_path / "folder", folder)
    assert from_folder["bytes_per_token"] == from_file["bytes_per_token"] > 1.0
    report = read_json(tmp_path / "folder" / "report.json")
    assert report["heldout_docs"] > 10 and report["corpus_docs"] == table.num_rows


@pytest.mark.parametrize("family", ADOPTED)
def test_adopting_copies_the_tokenizer_byte_for_byte_and_records_its_roles(family, family_folders, corpus, tmp_path,
                                                                           caplog):
    folder = family_folders[family]
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        metrics = adopt(folder, tmp_path, corpus)
    assert (tmp_path / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    copied = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert copied == sorted(f for f in HF_TOKENIZER_FILES if (folder / f).is_file())
    for name in copied:
        assert (tmp_path / "hf" / name).read_bytes() == (folder / name).read_bytes(), name
    specials = load_specials(tmp_path)
    tok = load_tokenizer(tmp_path / "tokenizer.json")  # no fixed-id check for an adopted tokenizer
    eot, stop, bos = ADOPTED[family]
    assert not specials.own and specials.source == str(folder)
    assert specials.eot_id == tok.token_to_id(eot)
    assert specials.eos_ids[0] == tok.token_to_id(stop) and specials.eot_id in specials.eos_ids
    assert specials.bos_id == (tok.token_to_id(bos) if bos else None)
    assert specials.chat_template == (folder / "chat_template.jinja").read_text()
    assert set(specials.ids()) >= {"eot", "pad"} and len(set(specials.eos_ids)) == len(specials.eos_ids)
    with_bos = {"bos": specials.bos_id} if bos else {}
    assert specials.ids() == {"eot": specials.eot_id, "pad": specials.pad_id, **with_bos}
    assert specials.texts["eos"] == stop and specials.texts.get("bos") == bos
    # Qwen's NFC normalizer composes the probe's e + U+0301: counted and said, not refused (it is the model's own)
    nfc = family.startswith("qwen")
    assert metrics["roundtrip_failures"] == read_json(tmp_path / "report.json")["roundtrip_failures"] == int(nfc)
    assert ("does not round-trip every text exactly (first: round-trip check failed on probe 8 at character 11 "
            "(U+0065 came back as U+00E9)" in caplog.text) is nfc
    assert metrics["vocab_size"] == tok.get_vocab_size() and metrics["bytes_per_token"] > 1.0
    # text never encodes to a special id, even when it spells one
    assert specials.eot_id not in tok.encode(f"a {eot} b", add_special_tokens=False).ids


def test_adopting_is_quiet_about_training_keys_left_at_their_defaults(family_folders, corpus, tmp_path, caplog):
    """params.yaml ships every training key at its default value: adopting with them
    says nothing of them, and names only the one changed from its default."""
    from pipeline.config import load_params

    shipped = load_params("tokenizer")
    assert set(TRAINING_KEYS) <= shipped.model_fields_set
    source = {"source": str(family_folders["qwen2"])}
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        build(shipped.model_copy(update=source), corpus, tmp_path / "a" / "tokenizer.json")
    assert "training key" not in caplog.text
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        build(shipped.model_copy(update={**source, "vocab_size": 1000}), corpus, tmp_path / "b" / "tokenizer.json")
    assert "tokenizer.source is a Hugging Face folder: ignoring the training key(s) tokenizer.vocab_size\n" \
        in caplog.text


def test_adopting_warns_about_ignored_training_keys_and_takes_an_eot_override(family_folders, corpus, tmp_path,
                                                                               caplog):
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt(family_folders["qwen2"], tmp_path, corpus, vocab_size=1000, seed=3, eot_token="<|im_end|>")
    # seed is not ignored: with eval_bytes it picks the held-out documents the adopted tokenizer is measured on
    assert "ignoring the training key(s) tokenizer.vocab_size\n" in caplog.text
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert load_specials(tmp_path).eot_id == tok.token_to_id("<|im_end|>")
    with pytest.raises(TokenizerError, match=r"tokenizer\.eot_token\) '<\|nope\|>' is not in the tokenizer"):
        adopt(family_folders["qwen2"], tmp_path, corpus, eot_token="<|nope|>")


def test_an_eot_token_that_text_encodes_to_is_refused(family_folders, corpus, tmp_path):
    """pack puts the end-of-text id between documents, and evaluate and generation
    stop at it: an ordinary token (here Ġthe, " the") would also come out of the
    documents' own text, so every " the" would read as an end of text."""
    folder = family_folders["qwen2"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.token_to_id("Ġthe") is not None
    with pytest.raises(TokenizerError, match=r"tokenizer\.eot_token 'Ġthe' \(id \d+\) is an ordinary token, which "
                                             r"text encodes to.*special tokens: .*'<\|endoftext\|>'"):
        adopt(folder, tmp_path / "out", corpus, eot_token="Ġthe")
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # refused before anything is written
    # an added token that is not special is matched in text too: detected, it is named, not taken
    from tokenizers import AddedToken, models, pre_tokenizers

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.add_tokens([AddedToken("<|endoftext|>", special=False)])
    (tmp_path / "plain").mkdir()
    plain.save(str(tmp_path / "plain" / "tokenizer.json"))
    assert plain.encode("a <|endoftext|>").ids[-1] == plain.token_to_id("<|endoftext|>")
    with pytest.raises(TokenizerError, match=r"the end-of-text token '<\|endoftext\|>' \(id 0\) is an ordinary "
                                             r"token.*\(it has none: mark its end-of-text token special"):
        adopt(tmp_path / "plain", tmp_path / "out", corpus)


def tiny_folder(folder, added: dict[str, bool], config: dict | None = None):
    """A Hugging Face tokenizer folder: a byte-level BPE with the ``added`` tokens
    (text -> special) and ``config`` as its tokenizer_config.json."""
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.train_from_iterator(["abc abd"], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(text, special=special) for text, special in added.items()])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, tok


@pytest.mark.parametrize("added, config, eot, pad", [
    # a known end-of-text token that is special comes before one that text encodes to
    ({"<|endoftext|>": False, "</s>": True}, {}, "</s>", "</s>"),
    # no known one: the eos_token, here as an AddedToken dict; a named pad token is taken
    ({"<|eot|>": True, "<|pad|>": True}, {"eos_token": {"content": "<|eot|>"}, "pad_token": "<|pad|>"}, "<|eot|>",
     "<|pad|>"),
])
def test_the_end_of_text_and_pad_tokens_of_an_adopted_tokenizer(corpus, tmp_path, added, config, eot, pad):
    folder, tok = tiny_folder(tmp_path / "model", added, config)
    adopt(folder, tmp_path / "out", corpus)
    specials = load_specials(tmp_path / "out")
    assert (specials.eot_id, specials.pad_id) == (tok.token_to_id(eot), tok.token_to_id(pad))
    assert specials.ids() == {"eot": specials.eot_id, "pad": specials.pad_id}  # what pack's manifest records
    assert specials.texts["eot"] == eot and specials.texts["pad"] == pad


def test_a_tokenizer_with_no_end_of_text_token_is_told_to_name_one(corpus, tmp_path):
    folder, _ = tiny_folder(tmp_path / "model", {"<|x|>": True})
    with pytest.raises(TokenizerError, match=r"model: no end-of-text token found \(looked for <\|endoftext\|>, "
                                             r".*and tokenizer_config.json's eos_token\); name one with "
                                             r"tokenizer.eot_token$"):
        adopt(folder, tmp_path / "out", corpus)
    adopt(folder, tmp_path / "out", corpus, eot_token="<|x|>")
    assert load_specials(tmp_path / "out").texts["eot"] == "<|x|>"


def test_a_stop_token_that_text_encodes_to_is_warned_about(family_folders, corpus, tmp_path, caplog):
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    data = read_json(folder / "tokenizer.json")
    [eot_id] = [t for t in data["added_tokens"] if t["content"] == "<|eot_id|>"]
    eot_id["special"] = False
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt(folder, tmp_path / "out", corpus)
    assert f"{folder}: the stop token(s) '<|eot_id|>' (id {eot_id['id']}) are ordinary tokens, which text encodes " \
           "to:" in caplog.text
    assert load_specials(tmp_path / "out").eos_ids[0] == eot_id["id"]  # still the end of a turn
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt(family_folders["llama3"], tmp_path / "as shipped", corpus)
    assert "stop token" not in caplog.text


@pytest.mark.parametrize("name, data, said", [
    ("tokenizer_config.json", b'{"eos_token": "<|end', "not valid JSON"),  # a download cut short
    ("generation_config.json", b"{oops", "not valid JSON"),
    ("generation_config.json", b"[128001]", "expected a JSON object, got list"),
    ("special_tokens_map.json", b"", "not valid JSON"),
    ("chat_template.jinja", b"{{ bos_token }}\xff", "not UTF-8"),
])
def test_a_damaged_file_of_the_adopted_folder_is_one_line(family_folders, corpus, tmp_path, name, data, said):
    """A model folder from an interrupted download or a hand edit: the file is
    named in one line (it was a JSONDecodeError, AttributeError or
    UnicodeDecodeError traceback), and nothing is written."""
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    (folder / name).write_bytes(data)
    with pytest.raises(TokenizerError, match=rf"{re.escape(str(folder / name))}: {said}"):
        adopt(folder, tmp_path / "out", corpus)
    assert not (tmp_path / "out").exists()


def test_a_copied_cache_snapshot_whose_tokenizer_is_a_link_to_nothing_says_so(family_folders, corpus, tmp_path):
    """`cp -r` of a Hugging Face cache snapshot copies its relative links into
    blobs/, which then point nowhere: the tokenizer stage, the first to read the
    folder, says so (it said "has no tokenizer.json")."""
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("../../blobs/0a1b2c")
    with pytest.raises(TokenizerError, match=r"tokenizer.json is a link to nothing \(tokenizer.json -> "
                                             r"\.\./\.\./blobs/0a1b2c\).*cp -rL"):
        adopt(folder, tmp_path / "out", corpus)
    assert not (tmp_path / "out").exists()


def test_generation_config_ids_that_are_not_ids_are_left_out(family_folders, corpus, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    (folder / "generation_config.json").write_text('{"eos_token_id": ["<|eot_id|>", true, 520]}')
    adopt(folder, tmp_path / "out", corpus)
    specials = load_specials(tmp_path / "out")  # it read back as "unreadable; rerun the tokenizer stage"
    assert all(type(i) is int for i in specials.eos_ids) and 520 in specials.eos_ids
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    eot, stop, _ = ADOPTED["llama3"]
    assert specials.eos_ids == (tok.token_to_id(stop), 520, tok.token_to_id(eot))  # true is no id 1


@pytest.mark.parametrize("ids, said", [([128009], r"\[128009\] is no id"), (-1, r"\[-1\] is no id"),
                                       ([513, 600, 700], r"\[600, 700\] are no ids")])
def test_generation_config_stop_ids_the_tokenizer_lacks_are_a_one_line_error(family_folders, corpus, tmp_path, ids,
                                                                             said):
    """A generation_config.json of another model (the real Llama 3's, beside a
    smaller vocabulary): its stop ids were recorded, generation never stopped
    there and export wrote them on."""
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    size = id_space(Tokenizer.from_file(str(folder / "tokenizer.json")))
    assert size == 523  # the fixture: 513 is its <|end_of_text|>, 600 and 700 are past its ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    with pytest.raises(TokenizerError, match=rf"^{re.escape(str(folder / 'generation_config.json'))}: eos_token_id "
                                             rf"{said} of the tokenizer \(ids 0 to 522\): the file belongs to another "
                                             r"model; fetch the model's own"):
        adopt(folder, tmp_path / "out", corpus)
    assert not (tmp_path / "out").exists()


def test_a_generation_config_stop_id_in_a_gap_of_the_ids_is_no_id_either(family_folders, corpus, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    data = read_json(folder / "tokenizer.json")
    vocab = data["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 600  # the last learned token, 511, moves: 511 and 523 to 599 have no token
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [511]}))
    with pytest.raises(TokenizerError, match=r"eos_token_id \[511\] is no id of the tokenizer \(ids 0 to 600\)"):
        adopt(folder, tmp_path / "out", corpus)


def test_adopted_roles_come_from_special_tokens_map_where_tokenizer_config_has_none(family_folders, corpus, tmp_path):
    """An empty token is no token; a role tokenizer_config.json does not name is
    looked for in special_tokens_map.json (as a string or an AddedToken); without
    a pad token, padding uses the end-of-text token."""
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    config = read_json(folder / "tokenizer_config.json")
    config.pop("eos_token")
    config["bos_token"] = ""
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok_map = {"eos_token": {"content": "<|eot_id|>"}, "bos_token": ""}
    (folder / "special_tokens_map.json").write_text(json.dumps(tok_map))
    adopt(folder, tmp_path / "out", corpus)
    specials = load_specials(tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert specials.eos_ids[0] == tok.token_to_id("<|eot_id|>") and specials.bos_id is None
    assert specials.pad_id == specials.eot_id == tok.token_to_id("<|end_of_text|>")
    assert specials.texts["pad"] == "<|end_of_text|>"


@pytest.mark.parametrize("file, role, value", [
    ("tokenizer_config.json", "eos_token", ["<|eot_id|>", "<|end_of_text|>"]),  # the stop ids, as a list
    ("tokenizer_config.json", "bos_token", 128000),  # an id, not a text
    ("special_tokens_map.json", "eos_token", {"content": ["<|eot_id|>"]}),
])
def test_a_role_s_token_that_is_no_text_is_a_one_line_error(family_folders, corpus, tmp_path, file, role, value):
    """Read as no token, a list of eos tokens made the end-of-turn token, the
    first stop id, silently the end-of-text one."""
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    config = read_json(folder / "tokenizer_config.json")
    config.pop(role)  # special_tokens_map.json is read where tokenizer_config.json names no token
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / file).write_text(json.dumps({**tokenizer_module.read_folder_json(folder / file), role: value}))
    with pytest.raises(TokenizerError, match=rf"^{re.escape(str(folder / file))}: {role} is .+, neither a token's "
                                             r"text nor an AddedToken object with one; give one token's text \(more "
                                             r"ids that end generation go in generation_config.json's eos_token_id"):
        adopt(folder, tmp_path / "out", corpus)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("files, config, template", [
    ({"chat_template.jinja": "J", "chat_template.json": '{"chat_template": "C"}'}, {"chat_template": "T"}, "J"),
    ({"chat_template.json": '{"chat_template": "C"}'}, {"chat_template": "T"}, "C"),
    ({}, {"chat_template": "T"}, "T"),
    ({}, {"chat_template": [{"name": "tool_use", "template": "U"}, {"name": "default", "template": "D"}]}, "D"),
    ({}, {"chat_template": [{"name": "tool_use", "template": "U"}]}, None),
    ({}, {"chat_template": "  \n"}, None),
    ({"chat_template.jinja": "", "chat_template.json": '{"chat_template": "C"}'}, {}, None),  # the first file found
    ({"chat_template.jinja": " \n\n"}, {"chat_template": "T"}, None),
    ({}, {}, None),
])
def test_the_chat_template_is_read_where_transformers_looks_for_it(tmp_path, files, config, template):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert tokenizer_module.read_chat_template(tmp_path, config) == template


def test_named_chat_templates_without_a_default_are_none_with_a_warning(tmp_path, caplog):
    config = {"chat_template": [{"name": "tool_use", "template": "U"}, {"name": "rag", "template": "R"}]}
    with caplog.at_level(logging.WARNING, logger="pipeline.data.tokenizer"):
        assert tokenizer_module.read_chat_template(tmp_path, config) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'tokenizer_config.json'}: chat_template holds named templates (rag, tool_use) but none called "
        "'default', so the tokenizer is taken as having no chat template (sft.data.chat_template auto uses ChatML); "
        "to use one, save it as a .jinja file and give its path as sft.data.chat_template"]


@pytest.mark.parametrize("value", [{"default": "D"}, 3, [{"name": "default", "template": ["D"]}]])
def test_a_chat_template_that_is_no_text_is_a_one_line_error(tmp_path, value):
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": value}))
    with pytest.raises(TokenizerError, match=rf"^{re.escape(str(tmp_path / 'chat_template.json'))}: chat_template is "
                                             r"a (dict|int|list), neither a template nor a list of named ones; "
                                             r"the model folder is damaged"):
        tokenizer_module.read_chat_template(tmp_path, {})


@pytest.mark.parametrize("specials, missing", [([IM_START, IM_END], []), ([IM_START], [IM_END]),
                                               ([IM_END], [IM_START]), ([], [IM_START, IM_END])])
def test_missing_chatml_tokens(specials, missing):
    tok = build_tokenizer()
    tok.add_special_tokens(specials)
    tok.add_tokens([t for t in (IM_START, IM_END) if t not in specials])  # present, but not special
    assert tokenizer_module.missing_chatml_tokens(tok) == missing


def test_adopting_measures_the_held_out_documents_alone_their_specials_as_text(family_folders, tmp_path):
    docs = tmp_path / "docs.parquet"
    eot, stop, _ = ADOPTED["llama3"]  # a byte-level BPE that round-trips every probe
    rows = [(f"d{i:03d}", f"document {i} says {eot} and {stop} in its text\n" * 5) for i in range(100)]
    write_docs(docs, rows)
    folder = family_folders["llama3"]
    metrics = adopt(folder, tmp_path / "out", docs)
    assert metrics["roundtrip_failures"] == 0  # a special token's text in a document is text
    _, heldout, _ = choose_sample(docs, 0, TokenizerConfig().eval_bytes, TokenizerConfig().seed)
    texts = [text for (_, text), held in zip(rows, heldout) if held]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.encode_special_tokens = True
    tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in texts)
    assert texts and metrics["bytes_per_token"] == round(sum(len(t.encode()) for t in texts) / tokens, 4)


def test_training_again_replaces_an_adopted_tokenizer(family_folders, corpus, tmp_path):
    adopt(family_folders["llama3"], tmp_path, corpus)
    assert (tmp_path / "hf").is_dir()
    build(SMALL, corpus, tmp_path / "tokenizer.json", tmp_path / "report.json")
    assert not (tmp_path / "hf").exists() and load_specials(tmp_path) == OWN_SPECIALS


def test_adoption_errors_are_one_line(family_folders, corpus, tmp_path):
    with pytest.raises(TokenizerError, match="is not a folder"):
        adopt(tmp_path / "missing", tmp_path / "out", corpus)
    spm = tmp_path / "spm"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(TokenizerError, match=r"spm has no tokenizer.json \(it has only a slow tokenizer's "
                                             r"tokenizer.model: convert it once with transformers"):
        adopt(spm, tmp_path / "out", corpus)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "vocab.json").write_text("{}")
    (gpt2 / "merges.txt").write_text("")
    with pytest.raises(TokenizerError, match=r"gpt2 has no tokenizer.json \(it has only a slow tokenizer's "
                                             r"vocab.json and merges.txt: convert it once"):
        adopt(gpt2, tmp_path / "out", corpus)
    with pytest.raises(TokenizerError, match=rf"tokenizer.json is not a folder; give 'train' or a local Hugging Face "
                                             rf"model folder \(here {re.escape(str(family_folders['qwen2']))}, the "
                                             r"folder that holds it\)$"):
        adopt(family_folders["qwen2"] / "tokenizer.json", tmp_path / "out", corpus)
    cut = tmp_path / "cut"
    shutil.copytree(family_folders["qwen2"], cut)
    (cut / "tokenizer.json").write_bytes((family_folders["qwen2"] / "tokenizer.json").read_bytes()[:2000])
    with pytest.raises(TokenizerError, match=r"cut/tokenizer.json: not a valid tokenizer file: EOF while parsing .*; "
                                             r"the model folder is damaged or incomplete \(an interrupted download"):
        adopt(cut, tmp_path / "out", corpus)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="tokenizer.source"):
        parse_section(TokenizerConfig, {"source": " "}, "tokenizer")


def test_the_stage_s_own_output_is_no_source_to_adopt_from(family_folders, corpus, tmp_path):
    """Its top holds no tokenizer_config.json or template and its hf/ no
    generation_config.json: adopting from either lost bos, stop ids and the
    template without a word (and read files the run replaces)."""
    out = tmp_path / "tokenizer"
    adopt(family_folders["llama3"], out, corpus)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for source in (out, out / "hf", out / "hf" / ".." / "hf"):
        with pytest.raises(TokenizerError, match=rf"^tokenizer.source {re.escape(str(source))} is the tokenizer "
                                                 r"stage's own output \(.*\), which this run replaces: give the model "
                                                 rf"folder itself \(the last one adopted: "
                                                 rf"{re.escape(str(family_folders['llama3']))}\)$"):
            adopt(source, out, corpus)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    build(SMALL, corpus, out / "tokenizer.json")
    with pytest.raises(TokenizerError, match=r"which this run replaces: give the model folder itself$"):
        adopt(out, out, corpus)
    shutil.copytree(family_folders["llama3"], out / "model")  # a model folder of its own, kept there
    adopt(out / "model", out, corpus)
    assert load_specials(out).source == str(out / "model")


def test_an_adoption_that_fails_leaves_the_previous_tokenizer_as_it_was(family_folders, corpus, tmp_path):
    """Measuring the adopted tokenizer on the clean documents can fail (here every
    one is split: val); the tokenizer folder was already replaced by then."""
    out = tmp_path / "tokenizer"
    build(SMALL, corpus, out / "tokenizer.json", out / "report.json")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    marked = tmp_path / "marked.parquet"
    table = pq.read_table(corpus)
    pq.write_table(table.append_column("split", pa.array(["val"] * table.num_rows)), marked)
    with pytest.raises(TokenizerError, match="every document with text is marked split: val"):
        adopt(family_folders["llama3"], out, marked)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_run_stopped_between_the_tokenizer_and_its_roles_is_refused_on_load(family_folders, corpus, tmp_path,
                                                                              monkeypatch):
    """tokenizer.json and specials.json are two files: a run stopped between them
    must not leave one tokenizer with another's ids (pack would separate documents
    with an ordinary token), but a pair that load_tokenizer refuses."""
    out = tmp_path / "tokenizer"

    def stop(*args):
        raise KeyboardInterrupt

    for first, then in ((family_folders["llama3"], SOURCE_TRAIN), (SOURCE_TRAIN, family_folders["qwen2"]),
                        (family_folders["llama3"], family_folders["qwen2"])):
        shutil.rmtree(out, ignore_errors=True)
        cfg = SMALL if first == SOURCE_TRAIN else TokenizerConfig(source=str(first))
        build(cfg, corpus, out / "tokenizer.json")
        with monkeypatch.context() as m:
            m.setattr(tokenizer_module, "_write_specials", stop)
            with pytest.raises(KeyboardInterrupt):
                build(SMALL if then == SOURCE_TRAIN else TokenizerConfig(source=str(then)), corpus,
                      out / "tokenizer.json")
        try:
            tok = load_tokenizer(out / "tokenizer.json")
        except TokenizerError as e:
            assert "expected 0; retrain the tokenizer" in str(e)
        else:  # only where what was written is our own tokenizer, which the roles left read as
            assert then == SOURCE_TRAIN and special_ids(tok) and load_specials(out) == OWN_SPECIALS


def test_truncation_and_padding_set_in_an_adopted_tokenizer_json_are_turned_off(family_folders, corpus, tmp_path,
                                                                                 caplog):
    """A tokenizer.json can ship with them set: loaded as it was, every document
    pack encoded was cut to max_length tokens and padded, without a word (and
    every round trip failed, the first said to encode to a special id)."""
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(8)
    tok.enable_padding(length=16, pad_id=513, pad_token="<|end_of_text|>")
    tok.save(str(folder / "tokenizer.json"))
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        metrics = adopt(folder, tmp_path / "out", corpus)
    assert f"{folder}: its tokenizer.json sets truncation to 8 tokens and padding, which would cut or pad every " \
           "text: the pipeline turns that off wherever it loads the tokenizer" in caplog.text
    assert metrics["roundtrip_failures"] == 0
    assert metrics["bytes_per_token"] == adopt(family_folders["llama3"], tmp_path / "plain", corpus)["bytes_per_token"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    text = "hello world, this is a text of more than eight tokens " * 3
    loaded = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert loaded.decode(loaded.encode(text, add_special_tokens=False).ids) == text
    opened = tokenizer_module.open_hf_tokenizer(folder)  # generate's reader of a model folder
    assert opened.decode(opened.encode(text, add_special_tokens=False).ids) == text


def test_pack_separates_documents_with_the_adopted_end_of_text(family_folders, corpus, tmp_path):
    from pipeline.data.pack import PackConfig, run_pack
    from pipeline.data.shards import PackedRows

    adopt(family_folders["llama3"], tmp_path / "tok", corpus)
    run_pack(PackConfig(seq_len=32, num_workers=1), corpus, tmp_path / "tok" / "tokenizer.json", tmp_path / "packed")
    manifest = read_json(tmp_path / "packed" / "manifest.json")
    eot = load_specials(tmp_path / "tok").eot_id
    assert eot != EOT_ID and manifest["eot_id"] == eot
    rows = PackedRows(tmp_path / "packed" / "train")
    ids = np.concatenate(list(rows.iter_input_ids()))
    assert (ids == eot).sum() > 10 and not (ids == EOT_ID).any()


def test_an_eot_token_while_training_is_warned_about_but_not_by_the_default_params(corpus, tmp_path, caplog):
    """The reverse of the ignored training keys: eot_token names a token of an
    adopted tokenizer, so training ignores it, and says so. params.yaml sets it
    to null, which is no setting: the default run does not warn."""
    from pipeline.config import load_params

    default = load_params("tokenizer")
    assert default.source == "train" and "eot_token" in default.model_fields_set
    small = {"vocab_size": 300, "sample_bytes": 20_000, "eval_bytes": 2_000}  # a size the corpus reaches
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        build(default.model_copy(update=small), corpus, tmp_path / "a" / "tokenizer.json")
    assert caplog.text == ""
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        build(TokenizerConfig(eot_token="</s>", **small), corpus, tmp_path / "b" / "tokenizer.json")
    assert "tokenizer.source is train: ignoring tokenizer.eot_token '</s>' (the trained tokenizer's end of text " \
           "is <|endoftext|>, id 0)" in caplog.text


def test_adopting_from_outside_models_base_is_warned_about(family_folders, corpus, tmp_path, caplog, monkeypatch):
    """DVC tracks models/base/ for the tokenizer stage; a folder elsewhere works,
    but its changes go unseen, which the stage says, as pretrain does for init_from."""
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt(family_folders["qwen2"], tmp_path / "outside", corpus)
    assert f"tokenizer.source {family_folders['qwen2']} is outside models/base/, so DVC does not see changes to " \
           "it" in caplog.text
    caplog.clear()
    monkeypatch.chdir(tmp_path)
    shutil.copytree(family_folders["qwen2"], tmp_path / "models" / "base" / "qwen2")
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt("models/base/qwen2", tmp_path / "inside", corpus)
    assert "outside" not in caplog.text
    # a link under models/base/ is as unseen as a folder elsewhere: DVC hashes no file of a linked folder
    (tmp_path / "models" / "base" / "linked").symlink_to(family_folders["qwen2"])
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt("models/base/linked", tmp_path / "linked", corpus)
    assert f"tokenizer.source models/base/linked is outside models/base/ (through a link: it is " \
           f"{family_folders['qwen2'].resolve()}), so DVC does not see changes to it" in caplog.text


@pytest.mark.parametrize("config, warned", [
    ({"vocab_size": 522}, True),  # one row short of the fixture's 523 ids
    ({"text_config": {"vocab_size": 100}}, True),  # a multimodal model's language part
    ({"vocab_size": 523}, False), ({"vocab_size": 1024}, False), ({}, False), (None, False), ("{oops", False),
])
def test_adopting_from_a_model_whose_embedding_is_smaller_than_the_tokenizer_is_warned_about(
        family_folders, corpus, tmp_path, caplog, config, warned):
    folder = tmp_path / "model"
    shutil.copytree(family_folders["llama3"], folder)
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with caplog.at_level("WARNING", logger="pipeline.data.tokenizer"):
        adopt(folder, tmp_path / "out", corpus)
    rows = config.get("vocab_size") or config["text_config"]["vocab_size"] if warned else None
    said = f"{folder}: the tokenizer has ids up to 522 but config.json's vocab_size is {rows}: its weights have no " \
           "embedding row for the ids past it, so pretrain.init_from this folder will refuse the pair"
    assert (said in caplog.text) if warned else ("config.json" not in caplog.text)


def test_adopting_a_tokenizer_without_a_template_or_chatml_tokens_warns_that_sft_needs_one(
        family_folders, corpus, tmp_path, caplog):
    """Llama 3 without its template has no <|im_start|>: sft's auto could not
    fall back to ChatML, which the tokenizer stage says before pretrain runs."""
    for family, line in (("llama3", "chat template: none, and no ChatML tokens: sft needs sft.data.chat_template"),
                         ("qwen2", "chat template: none (ChatML for sft)")):
        folder = tmp_path / family
        shutil.copytree(family_folders[family], folder)
        config = read_json(folder / "tokenizer_config.json")
        config.pop("chat_template", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        caplog.clear()
        with caplog.at_level("INFO", logger="pipeline.data.tokenizer"):
            adopt(folder, tmp_path / f"{family}-out", corpus)
        [record] = [r for r in caplog.records if r.getMessage().startswith("adopted the tokenizer")]
        assert line in record.getMessage()
        assert record.levelname == ("WARNING" if family == "llama3" else "INFO")


def test_a_tokenizer_belongs_to_a_model_by_its_recorded_sha256_and_by_every_id_having_a_row(trained, tmp_path):
    path = trained[0]
    check_trained_with(path, sha256_file(path), fix="unused")
    for marker in (None, "", "synthetic"):  # nothing recorded, or no sha256: nothing to compare
        check_trained_with(path, marker, fix="unused")
    with pytest.raises(ValueError, match=r"tokenizer.json \(sha256 \w{12}…\) is not the tokenizer this model was "
                                         r"trained with \(sha256 aaaaaaaaaaaa…\); do this$"):
        check_trained_with(path, "a" * 64, fix="do this")

    tok = load_tokenizer(path)
    rows = id_space(tok)
    check_fits(tok, rows)  # fills the table exactly
    with pytest.raises(ValueError, match=rf"ids up to {rows - 1} \({rows} tokens\), the model embeds only {rows - 1}$"):
        check_fits(tok, rows - 1)
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = rows + 50  # a gap: as many tokens, an id far past them
    gapped = Tokenizer.from_str(json.dumps(data))
    assert gapped.get_vocab_size() < id_space(gapped) == rows + 51
    with pytest.raises(ValueError, match=rf"ids up to {rows + 50} \(\d+ tokens\), the model embeds only {rows}; fix it$"):
        check_fits(gapped, rows, fix="fix it")
