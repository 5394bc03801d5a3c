import json
import re
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.config import ConfigError, parse_section
from pipeline.data.chat import IGNORE_INDEX, encode_chat, to_messages
from pipeline.data.sft_data import (
    FORMAT,
    Example,
    SFTDataConfig,
    SFTDataError,
    SFTSource,
    _force_nonempty,
    build_fingerprint,
    build_rows,
    build_sft_data,
    conversation_key,
    pack_examples,
)
from pipeline.data.shards import MANIFEST, PackedRows
from pipeline.data.tokenizer import IM_END, IM_START_ID, PAD_ID
from pipeline.files import read_json, sha256_file
from tests.pipeline.data.test_chat import tiny_tokenizer


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("sfttok") / "tokenizer.json"
    path.write_text(tiny_tokenizer().to_str())
    return path


@pytest.fixture(scope="module")
def tok(tok_path):
    from pipeline.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_path)


def qa(i: int) -> tuple[str, str]:
    return f"Question number {i}: what is {i} + {i}?", f"The answer to {i} + {i} is {2 * i}."


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def messages_rec(i):
    q, a = qa(i)
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def sharegpt_rec(i):
    q, a = qa(i)
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def alpaca_rec(i):
    q, a = qa(i)
    return {"instruction": q, "input": "", "output": a}


def read_split(out, split):
    """(input_ids, labels, doc_starts) of all shards of a split, in order."""
    ids, labels, starts = [], [], []
    for shard in read_json(out / MANIFEST)["splits"][split]["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(out / shard["path"]))).read_all()
        ids += table.column("input_ids").to_pylist()
        labels += table.column("labels").to_pylist()
        starts += table.column("doc_starts").to_pylist()
    return np.array(ids), np.array(labels), starts


def assistant_texts(tok, ids, labels) -> list[str]:
    """Decode each maximal run of labelled positions of every row."""
    out = []
    for row_ids, row_labels in zip(ids, labels):
        run = []
        for t, lab in zip(row_ids, row_labels):
            if lab != IGNORE_INDEX:
                assert lab == t
                run.append(int(t))
            elif run:
                out.append(tok.decode(run, skip_special_tokens=False))
                run = []
        if run:
            out.append(tok.decode(run, skip_special_tokens=False))
    return out


def build(tmp_path, tok_path, name="out", **kw):
    cfg = SFTDataConfig(**{"val_fraction": 0.25, "seq_len": 64, **kw})
    out = tmp_path / name
    metrics = build_sft_data(cfg, tok_path, out, tmp_path / f"{name}-quarantine.jsonl")
    return out, metrics


@pytest.fixture
def three_formats(tmp_path):
    write_jsonl(tmp_path / "messages.jsonl", [messages_rec(i) for i in range(0, 10)])
    (tmp_path / "sharegpt.json").write_text(json.dumps([sharegpt_rec(i) for i in range(10, 20)]))
    write_jsonl(tmp_path / "alpaca.ndjson", [alpaca_rec(i) for i in range(20, 30)])
    return tmp_path


@pytest.mark.parametrize("explicit", [True, False])
def test_each_format_from_files(tmp_path, tok_path, tok, three_formats, explicit):
    fmt = (lambda f: f) if explicit else (lambda f: "auto")
    sources = [SFTSource(path=str(three_formats / "messages.jsonl"), format=fmt("messages")),
               SFTSource(path=str(three_formats / "sharegpt.json"), format=fmt("sharegpt")),
               SFTSource(path=str(three_formats / "*.ndjson"), format=fmt("alpaca"))]
    out, m = build(tmp_path, tok_path, sources=sources, pack=False)
    assert m["examples_in"] == 30 and m["skipped"] == {}
    assert m["train"]["examples"] + m["val"]["examples"] == 30 and m["val"]["examples"] > 0
    got = []
    for split in ("train", "val"):
        ids, labels, _ = read_split(out, split)
        got += assistant_texts(tok, ids, labels)
    assert sorted(got) == sorted(qa(i)[1] + IM_END for i in range(30))


def test_a_directory_source_reads_json_files_only(tmp_path, tok_path, three_formats):
    (three_formats / "README.md").write_text("not data")
    (three_formats / ".hidden.jsonl").write_text("not json\n")
    out, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))])
    assert m["examples_in"] == 30 and m["skipped"] == {}


def test_compressed_sources_give_the_examples_of_the_plain_files(tmp_path, tok_path, three_formats):
    """messages.jsonl.gz, sharegpt.json.zst and alpaca.ndjson.xz, found by a
    folder source: the bytes of the plain files' build; one cut short keeps its
    first records and counts the rest as unreadable."""
    from tests.pipeline.data.test_ingest import compress

    packed = tmp_path / "packed"
    packed.mkdir()
    for name, codec in (("messages.jsonl", "gzip"), ("sharegpt.json", "zstd"), ("alpaca.ndjson", "xz")):
        (packed / name).write_bytes((three_formats / name).read_bytes())
        compress(packed / name, codec)
        (packed / name).unlink()
    want, m_want = build(tmp_path, tok_path, "plain", sources=[SFTSource(path=str(three_formats / f))
                                                              for f in ("alpaca.ndjson", "messages.jsonl",
                                                                        "sharegpt.json")])
    got, m_got = build(tmp_path, tok_path, "packed", sources=[SFTSource(path=str(packed))])
    same = lambda m: {k: v for k, v in m.items() if k != "sources"}  # sources: by path
    assert same(m_got) == same(m_want) and m_got["examples_in"] == 30 and m_got["skipped"] == {}
    for split in ("train", "val"):
        assert [a.tolist() for a in read_split(got, split)[:2]] == [a.tolist() for a in read_split(want, split)[:2]]

    write_jsonl(tmp_path / "many.jsonl", [messages_rec(i) for i in range(3000)])
    cut = compress(tmp_path / "many.jsonl", "gzip")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    _, m = build(tmp_path, tok_path, "cut", sources=[SFTSource(path=str(cut))], seq_len=512)
    assert m["skipped"] == {"unreadable": 1} and 0 < m["examples_in"] - 1 < 3000
    [q] = [json.loads(x) for x in (tmp_path / "cut-quarantine.jsonl").read_text().splitlines()]
    assert q["location"] == "file" and q["detail"].startswith(
        f"its gzip data is damaged or cut short after {m['examples_in'] - 1} record(s); the rest of the file was "
        "not read: ")


def test_malformed_rows_are_counted_and_quarantined(tmp_path, tok_path):
    good = [messages_rec(i) for i in range(8)]
    lines = [json.dumps(r).encode() for r in good] + [
        b"{not json",
        b'{"messages": "\xff\xfe"}',
        json.dumps({"messages": [{"role": "robot", "content": "q"}]}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "q"}]}).encode(),
        json.dumps(messages_rec(3)).encode(),  # a duplicate of line 4
        json.dumps(["a list"]).encode(),
        b"",  # blank: not a record
        b"[" * 100_000 + b"]" * 100_000,  # nested too deeply to parse
        b'{"messages": [{"role": "user", "content": "lone \\ud800 half"}, {"role": "assistant", "content": "a"}]}',
    ]
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "broken.json").write_text("[{")
    out, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "mixed.jsonl")),
                                                SFTSource(path=str(tmp_path / "broken.json"))],
                   quarantine_per_reason=5)
    assert m["skipped"] == {"malformed_json": 3, "non_utf8": 2, "unknown_role": 1, "no_assistant": 1,
                            "duplicate": 1, "not_an_object": 1}
    assert m["examples_in"] == 8 + 9 == m["train"]["examples"] + m["val"]["examples"] + sum(m["skipped"].values())
    q = [json.loads(x) for x in (tmp_path / "out-quarantine.jsonl").read_text().splitlines()]
    by_reason = {e["reason"]: e for e in q}
    assert set(by_reason) == set(m["skipped"])
    assert by_reason["unknown_role"]["location"] == "line:11" and "robot" in by_reason["unknown_role"]["detail"]
    assert by_reason["duplicate"]["location"] == "line:13"
    assert [e["location"] for e in q if e["reason"] == "non_utf8"] == ["line:10", "line:17"]
    assert "U+D800" in next(e["detail"] for e in q if e["location"] == "line:17")
    assert by_reason["unknown_role"]["source"].endswith("mixed.jsonl")
    assert json.loads(by_reason["no_assistant"]["text"]) == {"conversations": [{"from": "human", "value": "q"}]}
    assert any(e["source"].endswith("broken.json") and e["location"] == "file" for e in q)


def test_a_byte_order_mark_and_crlf_lines_cost_no_record(tmp_path, tok_path):
    """Read as ingest reads them: a BOM before the first record (utf-8-sig) is
    not the JSON's, nor is a line's \\r, in .jsonl, .json and compressed files."""
    import gzip

    lines = "\r\n".join(json.dumps(messages_rec(i)) for i in range(6)) + "\r\n"
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([messages_rec(i) for i in range(6, 12)],
                                                                     indent=1).replace("\n", "\r\n").encode())
    (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + json.dumps(messages_rec(12)).encode()))
    _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / name))
                                              for name in ("bom.jsonl", "bom.json", "bom.jsonl.gz")])
    assert m["skipped"] == {} and m["train"]["examples"] + m["val"]["examples"] == 13


def test_a_json_object_wrapping_the_records_is_read_as_they_are(tmp_path, tok_path):
    """{"data": [...], "version": ...}: ingest unwraps its one list of objects;
    SFT counted the whole file as one unknown_format skip. A record of a known
    format is still one record, though its messages are a list of objects."""
    records = [messages_rec(i) for i in range(12)]
    (tmp_path / "wrapped.json").write_text(json.dumps({"version": "1.0", "tags": ["chat", "en"], "data": records}))
    _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "wrapped.json"))])
    assert m["examples_in"] == 12 and m["skipped"] == {}
    assert m["train"]["examples"] + m["val"]["examples"] == 12
    from pipeline.data.sft_data import _read_json

    (tmp_path / "one.json").write_text(json.dumps(records[0]))
    assert [(r.location, r.record) for r in _read_json(tmp_path / "one.json")] == [("file", records[0])]


def test_a_json_file_of_one_record_a_line_is_read_as_json_lines(tmp_path, tok_path):
    """Many chat sets ship JSON Lines under a .json name. ingest reads such a file
    as JSON Lines; SFT read it as one malformed record ("Extra data"), so a whole
    file of conversations counted as a single skip."""
    write_jsonl(tmp_path / "chat.json", [messages_rec(i) for i in range(12)] + [{"messages": "not a list"}])
    out, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "chat.json"))])
    assert m["examples_in"] == 13 and m["skipped"] == {"bad_type": 1}
    assert m["train"]["examples"] + m["val"]["examples"] == 12
    (q,) = [json.loads(line) for line in (tmp_path / "out-quarantine.jsonl").read_text().splitlines()]
    assert q["location"] == "line:13"
    # read as JSON Lines, a bad line costs that line alone, as in a .jsonl file
    (tmp_path / "bad.json").write_text(json.dumps(messages_rec(0)) + "\n{oops\n")
    _, m = build(tmp_path, tok_path, "bad", sources=[SFTSource(path=str(tmp_path / "chat.json")),
                                                   SFTSource(path=str(tmp_path / "bad.json"))])
    assert m["skipped"] == {"bad_type": 1, "duplicate": 1, "malformed_json": 1}


def test_the_build_says_why_records_were_skipped(tmp_path, tok_path, caplog):
    """One line of skip counts by reason and where their samples are, as the data
    stages log it; the metrics alone did not say it."""
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(i % 5) for i in range(60)] + [{"nope": 1}])
    with caplog.at_level("INFO", logger="pipeline.data.sft_data"):
        _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "d.jsonl"))])
    assert m["skipped"] == {"duplicate": 55, "unknown_format": 1}
    assert f"skipped 56 record(s): duplicate 55, unknown_format 1 (samples in {tmp_path / 'out-quarantine.jsonl'})" \
        in caplog.messages
    caplog.clear()
    write_jsonl(tmp_path / "clean.jsonl", [messages_rec(i) for i in range(8)])
    with caplog.at_level("INFO", logger="pipeline.data.sft_data"):
        build(tmp_path, tok_path, "clean", sources=[SFTSource(path=str(tmp_path / "clean.jsonl"))])
    assert not any(line.startswith("skipped") for line in caplog.messages)


def test_overlong_drop_vs_truncate(tmp_path, tok_path, tok):
    records = [messages_rec(i) for i in range(6)]
    long_answer = " ".join(f"word{i}" for i in range(80))
    records.append({"messages": [{"role": "user", "content": "Say many words."},
                                 {"role": "assistant", "content": long_answer}]})
    records.append({"messages": [{"role": "user", "content": "a very long question " * 30},
                                 {"role": "assistant", "content": "short"}]})
    write_jsonl(tmp_path / "d.jsonl", records)
    src = [SFTSource(path=str(tmp_path / "d.jsonl"))]
    _, drop = build(tmp_path, tok_path, "drop", sources=src, overlong="drop")
    assert drop["skipped"] == {"too_long": 2} and drop["truncated"] == 0
    out, cut = build(tmp_path, tok_path, "cut", sources=src, overlong="truncate")
    # The long answer survives in part; the long question leaves no label and is dropped.
    assert cut["skipped"] == {"too_long": 1} and cut["truncated"] == 1
    texts = []
    for split in ("train", "val"):
        ids, labels, _ = read_split(out, split)
        assert ids.shape[1] == 65
        texts += assistant_texts(tok, ids, labels)
    partial = [t for t in texts if t.startswith("word0 word1")]
    assert len(partial) == 1 and not partial[0].endswith(IM_END) and long_answer.startswith(partial[0])
    for m in (drop, cut):
        assert m["examples_in"] == 8 == m["train"]["examples"] + m["val"]["examples"] + sum(m["skipped"].values())


def test_an_example_of_exactly_row_len_tokens_fits_and_a_cut_one_fills_the_row(tmp_path, tok_path, tok):
    """row_len = seq_len + 1 tokens fit; one more is too long, and truncate cuts it to exactly row_len."""
    long = {"messages": [{"role": "user", "content": "Count."},
                         {"role": "assistant", "content": " ".join(f"n{i}" for i in range(30))}]}
    n = len(encode_chat(tok, to_messages(long))[0])
    write_jsonl(tmp_path / "d.jsonl", [long] + [messages_rec(i) for i in range(6)])
    src = [SFTSource(path=str(tmp_path / "d.jsonl"))]
    _, fits = build(tmp_path, tok_path, "fits", sources=src, seq_len=n - 1)
    assert fits["skipped"] == {} and fits["truncated"] == 0
    _, over = build(tmp_path, tok_path, "over", sources=src, seq_len=n - 2)
    assert over["skipped"] == {"too_long": 1}
    cut_dir, cut = build(tmp_path, tok_path, "cut", sources=src, seq_len=n - 2, overlong="truncate")
    assert cut["skipped"] == {} and cut["truncated"] == 1
    assert cut["train"]["tokens"] + cut["val"]["tokens"] == fits["train"]["tokens"] + fits["val"]["tokens"] - 1
    # the cut example lost its last token ("\n" after <|im_end|>, unlabelled) and nothing else
    assert cut["train"]["label_tokens"] + cut["val"]["label_tokens"] == \
        fits["train"]["label_tokens"] + fits["val"]["label_tokens"]
    for m in (fits, cut):
        for split in ("train", "val"):
            assert m[split]["pad_tokens"] == m[split]["rows"] * (n if m is fits else n - 1) - m[split]["tokens"]


def _example(n: int, h: int = 0) -> Example:
    ids = np.arange(1, n + 1, dtype=np.int32)
    return Example(ids, np.where(ids > 1, ids, IGNORE_INDEX).astype(np.int32), h)


def test_a_full_row_has_no_padding_segment():
    ids, labels, starts = build_rows([_example(6), _example(4), _example(3)], 10, pack=True, pad_id=0, seed=0)
    # 6 + 4 fill a row exactly: two segments; 3 + padding: two segments, the padding's starting at 3
    assert sorted(starts) == [[0, 3], [0, 6]] and (ids != 0).sum() == 13


def test_rows_are_put_in_a_seeded_random_order():
    examples = [_example(5 + i % 7) for i in range(40)]
    a = build_rows(examples, 16, pack=False, pad_id=0, seed=1)[0]
    assert (a == build_rows(examples, 16, pack=False, pad_id=0, seed=1)[0]).all()
    lengths = (a != 0).sum(axis=1)
    assert list(lengths) != [5 + i % 7 for i in range(40)]  # not the order read
    assert (a != build_rows(examples, 16, pack=False, pad_id=0, seed=2)[0]).any()


def test_a_split_that_would_be_empty_takes_one_example_from_the_other():
    splits = {"train": [_example(3, h) for h in (5, 2, 9)], "val": []}
    assert _force_nonempty(splits) == 1
    assert [e.h for e in splits["val"]] == [2] and [e.h for e in splits["train"]] == [5, 9]  # the lowest hash
    splits = {"train": [], "val": [_example(3, h) for h in (5, 2, 9)]}
    assert _force_nonempty(splits) == 1
    assert [e.h for e in splits["train"]] == [9] and [e.h for e in splits["val"]] == [5, 2]  # the highest hash
    one = {"train": [_example(3)], "val": []}
    assert _force_nonempty(one) == 0 and len(one["train"]) == 1  # one example cannot fill two splits
    assert _force_nonempty({"train": [_example(3)], "val": [_example(4)]}) == 0
    two = {"train": [], "val": [_example(3, h) for h in (5, 2)]}  # the fewest that can fill both
    assert _force_nonempty(two) == 1 and [e.h for e in two["train"]] == [5] and [e.h for e in two["val"]] == [2]


def test_the_conversation_key_holds_roles_and_contents():
    a = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    b = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    assert conversation_key(a) == conversation_key([dict(m) for m in a]) != conversation_key(b)
    weighted = [a[0], a[1] | {"weight": 0}]  # the same text, as context only: another example
    assert conversation_key(weighted) != conversation_key(a) == conversation_key([a[0], a[1] | {"weight": 1}])


def test_the_val_share_follows_val_fraction(tmp_path, tok_path):
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(i) for i in range(400)])
    _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "d.jsonl"))], val_fraction=0.25,
                 seq_len=512)
    assert 0.18 < m["val"]["examples"] / 400 < 0.32


def test_the_build_fingerprint_follows_a_jinja_template_file(tmp_path, tok_path):
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(0)])
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages }}")
    cfg = SFTDataConfig(sources=[SFTSource(path=str(tmp_path / "d.jsonl"))], chat_template=str(jinja))
    before = build_fingerprint(cfg, tok_path)
    jinja.write_text("{{ messages }} edited")
    assert build_fingerprint(cfg, tok_path) != before


def test_the_build_fingerprint_follows_an_adopted_tokenizers_hf_config(tmp_path):
    # hf/tokenizer_config.json holds the special-token texts a template renders
    # (bos_token ...): a hand edit of it alone must build the data again.
    folder = tmp_path / "tok"
    (folder / "hf").mkdir(parents=True)
    (folder / "tokenizer.json").write_text(tiny_tokenizer().to_str())
    config = folder / "hf" / "tokenizer_config.json"
    config.write_text('{"bos_token": "<s>"}')
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(0)])
    cfg = SFTDataConfig(sources=[SFTSource(path=str(tmp_path / "d.jsonl"))])
    before = build_fingerprint(cfg, folder / "tokenizer.json")
    config.write_text('{"bos_token": "<|begin|>"}')
    assert build_fingerprint(cfg, folder / "tokenizer.json") != before


def check_rows(ids, labels, starts, row_len):
    for row, lab, st in zip(ids, labels, starts):
        assert st[0] == 0 and st == sorted(st) and len(ids[0]) == row_len
        ends = st[1:] + [row_len]
        for s, e in zip(st, ends):
            if row[s] == PAD_ID:  # the padding segment, which ends the row
                assert e == row_len and (row[s:] == PAD_ID).all() and (lab[s:] == IGNORE_INDEX).all()
            else:  # an example: begins with <|im_start|>, unlabelled, so no cross-example target
                assert row[s] == IM_START_ID and lab[s] == IGNORE_INDEX


def test_packing_on_and_off(tmp_path, tok_path, tok, three_formats):
    src = [SFTSource(path=str(three_formats))]
    # Examples are 54-55 tokens: rows of 201 fit three.
    on, m_on = build(tmp_path, tok_path, "on", sources=src, pack=True, seq_len=200)
    off, m_off = build(tmp_path, tok_path, "off", sources=src, pack=False, seq_len=200)
    for split in ("train", "val"):
        a, b = m_on[split], m_off[split]
        assert a["examples"] == b["examples"] and a["tokens"] == b["tokens"] and a["label_tokens"] == b["label_tokens"]
        ids, labels, starts = read_split(off, split)
        assert len(ids) == b["examples"] == b["rows"]
        check_rows(ids, labels, starts, 201)
        assert all(len(s) == 2 for s in starts)  # one example, then its padding
        ids, labels, starts = read_split(on, split)
        check_rows(ids, labels, starts, 201)
        assert a["rows"] < b["rows"] or a["examples"] == 1
        n_examples = sum(sum(row[s] == IM_START_ID for s in st) for row, st in zip(ids, starts))
        assert n_examples == a["examples"]
    ids, _, starts = read_split(on, "train")
    assert max(sum(row[s] == IM_START_ID for s in st) for row, st in zip(ids, starts)) >= 3
    assert m_on["fill"] > m_off["fill"]


def test_pack_examples_best_fit():
    rows = pack_examples([5, 3, 7, 2, 8, 1], 10, pack=True)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum([5, 3, 7, 2, 8, 1][i] for i in r) <= 10 for r in rows)
    assert len(rows) == 3  # 26 tokens in rows of 10: optimal
    assert pack_examples([5, 3], 10, pack=False) == [[0], [1]]


def test_packed_rows_loads_the_output(tmp_path, tok_path, tok, three_formats):
    out, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))])
    manifest = read_json(out / MANIFEST)
    assert manifest["format"] == FORMAT and manifest["row_len"] == 65 and manifest["vocab_size"] == tok.get_vocab_size()
    assert manifest["tokenizer_sha256"] == sha256_file(tok_path)
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            assert sha256_file(out / shard["path"]) == shard["sha256"]
    data = PackedRows(out / "train")
    assert len(data) == m["train"]["rows"] and data.seq_len == 64
    rows = np.arange(len(data))
    batch = data.batch(rows, torch.device("cpu"))
    x, y, seg = batch["input_ids"], batch["targets"], batch["segment_ids"]
    assert x.shape == y.shape == seg.shape == (len(data), 64)
    has = y != IGNORE_INDEX
    # A target is the next input token, and never crosses into another segment.
    assert (y[:, :-1][has[:, :-1]] == x[:, 1:][has[:, :-1]]).all()
    assert (seg[:, 1:][has[:, :-1]] == seg[:, :-1][has[:, :-1]]).all()
    # The targets, decoded run by run, are exactly the assistant answers + <|im_end|>.
    texts = assistant_texts(tok, y.numpy(), y.numpy())
    assert len(texts) == m["train"]["examples"]
    assert set(texts) <= {qa(i)[1] + IM_END for i in range(30)}
    assert int(has.sum()) == m["train"]["label_tokens"]


def test_split_is_deterministic_and_content_keyed(tmp_path, tok_path, tok, three_formats):
    src = [SFTSource(path=str(three_formats / "messages.jsonl")), SFTSource(path=str(three_formats / "sharegpt.json"))]
    a, ma = build(tmp_path, tok_path, "a", sources=src)
    b, mb = build(tmp_path, tok_path, "b", sources=src)
    assert (a / MANIFEST).read_bytes() == (b / MANIFEST).read_bytes()
    assert ma == mb  # data/sft/report.json: no timings, so DVC's hash of data/sft is its data

    def val_texts(out):
        ids, labels, _ = read_split(out, "val")
        return sorted(assistant_texts(tok, ids, labels))

    # The same conversations in another format, file and order land in the same splits.
    write_jsonl(tmp_path / "moved.jsonl", [sharegpt_rec(i) for i in reversed(range(20))])
    c, _ = build(tmp_path, tok_path, "c", sources=[SFTSource(path=str(tmp_path / "moved.jsonl"))])
    assert val_texts(c) == val_texts(a)
    d, _ = build(tmp_path, tok_path, "d", sources=src, seed=1)
    assert val_texts(d) != val_texts(a)


def test_tiny_set_forces_a_val_example(tmp_path, tok_path):
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(i) for i in range(3)])
    _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "d.jsonl"))], val_fraction=1e-9)
    assert m["forced"] == 1 and m["val"]["examples"] == 1 and m["train"]["examples"] == 2


def test_max_examples_caps_each_source(tmp_path, tok_path, three_formats):
    src = [SFTSource(path=str(three_formats / "messages.jsonl")), SFTSource(path=str(three_formats / "sharegpt.json"))]
    _, m = build(tmp_path, tok_path, sources=src, max_examples=4)
    assert m["examples_in"] == 8
    assert [s["records"] for s in m["sources"].values()] == [4, 4]
    assert all(s["capped"] for s in m["sources"].values())


def test_builtin_dataset_is_the_default_source(tmp_path, tok_path):
    out, m = build(tmp_path, tok_path, seq_len=256, max_examples=600)
    assert m["examples_in"] == 600 and m["sources"]["builtin:stdlib-docstrings"]["capped"]
    assert m["train"]["examples"] + m["val"]["examples"] >= 500
    assert read_json(out / MANIFEST)["python"] == sys.version.split()[0]


def test_errors(tmp_path, tok_path):
    with pytest.raises(SFTDataError, match=r"^sft\.data\.sources\.1\.path: no such file"):  # the params key
        build(tmp_path, tok_path, sources=[SFTSource(path="builtin:stdlib-docstrings"),
                                           SFTSource(path=str(tmp_path / "missing.jsonl"))])
    with pytest.raises(SFTDataError, match=r"^sft\.data\.sources\.0\.path: .* matched no"):
        build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "*.jsonl"))])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(SFTDataError, match=r"not \.json, \.jsonl or \.ndjson"):
        build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "data.csv"))])
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(0)])
    with pytest.raises(SFTDataError, match="tokenizer not found"):
        build_sft_data(SFTDataConfig(sources=[SFTSource(path=str(tmp_path / "d.jsonl"))]),
                       tmp_path / "nope.json", tmp_path / "o", tmp_path / "q.jsonl")


def test_empty_result_is_an_error_and_leaves_no_manifest(tmp_path, tok_path, three_formats):
    out, _ = build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))])
    assert (out / MANIFEST).exists()
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}, messages_rec(0)])
    with pytest.raises(SFTDataError, match=r"split\(s\) got no examples.*unknown_format"):
        build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "bad.jsonl"))])
    assert not (out / MANIFEST).exists() and not list((out / "train").glob("*.arrow"))
    assert "unknown_format" in (tmp_path / "out-quarantine.jsonl").read_text()
    # every record longer than a row: the message names the params that let them in
    long = [{"messages": [{"role": "user", "content": f"question {i} " * 40}, {"role": "assistant", "content": "a"}]}
            for i in range(4)]
    write_jsonl(tmp_path / "long.jsonl", long)
    for overlong, fix in (("drop", "raise sft.data.seq_len or set sft.data.overlong: truncate; "),
                          ("truncate", "raise sft.data.seq_len; ")):
        with pytest.raises(SFTDataError, match=r"skipped \{'too_long': 4\} \(see .*\); 4 were longer than a row of "
                                               r"65 tokens: " + re.escape(fix) + "add data"):
            build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "long.jsonl"))], overlong=overlong)


def test_a_rebuild_removes_its_stale_shards_but_keeps_a_users_backup_folder(tmp_path, tok_path, three_formats,
                                                                             caplog):
    """A user's copy of the shards inside data/sft (``my-backup/``) lost its files to the next build."""
    src = [SFTSource(path=str(three_formats / "messages.jsonl"))]  # not the folder, which holds the output
    out, _ = build(tmp_path, tok_path, sources=src)
    (out / "my-backup").mkdir()
    backup = {}
    for p in (out / "train").iterdir():
        backup[p.name] = (out / "my-backup" / p.name)
        backup[p.name].write_bytes(p.read_bytes())
    (out / "train" / "shard-00099.arrow").write_bytes(b"stale")
    (out / "val" / ".shard-00007.tmp").write_bytes(b"half")
    with caplog.at_level("WARNING"):
        _, m = build(tmp_path, tok_path, sources=src)
    assert not (out / "train" / "shard-00099.arrow").exists() and not (out / "val" / ".shard-00007.tmp").exists()
    assert len(list((out / "train").glob("*.arrow"))) == m["train"]["shards"]
    assert {p.name for p in (out / "my-backup").iterdir()} == set(backup) and backup
    assert sum("left alone my-backup/" in r.getMessage() for r in caplog.records) == 1


def test_a_record_neither_kept_nor_counted_as_skipped_stops_the_build(tmp_path, tok_path, monkeypatch):
    """examples_in == train + val + skipped is checked: a skip that is not counted is an error, not a loss."""
    import pipeline.data.sft_data as sft_data
    from pipeline.data.accounting import Ledger

    class Forgets(Ledger):
        def record(self, reason, *args, **kw):
            if reason != "duplicate":
                super().record(reason, *args, **kw)

    monkeypatch.setattr(sft_data, "Ledger", Forgets)
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(i) for i in range(6)] + [messages_rec(0)])
    with pytest.raises(AssertionError, match=r"7 records read but .* and 0 skipped"):
        build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "d.jsonl"))])
    assert not (tmp_path / "out" / MANIFEST).exists()


@pytest.mark.parametrize("data, key", [
    ({"seq_len": 4}, "sft.seq_len"),
    ({"overlong": "wrap"}, "sft.overlong"),
    ({"sources": [{"path": "x.jsonl", "fmt": "auto"}]}, "sft.sources.0.fmt"),
    ({"sources": [{"path": "builtin:nope"}]}, "sft.sources.0.path"),
    ({"sources": [{"path": "builtin:stdlib-docstrings", "format": "alpaca"}]}, "sft.sources.0"),
    ({"sources": [{"path": "builtin:stdlib-docstrings", "format": "sharegpt"}]}, "sft.sources.0"),
    ({"sources": []}, "sft.sources"),
    ({"packing": True}, "sft.packing"),
    ({"seq_len": 7}, "sft.seq_len"),
    ({"seq_len": 1_048_577}, "sft.seq_len"),
    ({"val_fraction": 0}, "sft.val_fraction"),
    ({"val_fraction": 0.51}, "sft.val_fraction"),
    ({"max_examples": 0}, "sft.max_examples"),
    ({"quarantine_per_reason": -1}, "sft.quarantine_per_reason"),
    ({"shard_rows": 0}, "sft.shard_rows"),
    ({"sources": [{"path": ""}]}, "sft.sources.0.path"),
    ({"chat_template": ""}, "sft.chat_template"),
    ({"template_date": "26/07/2024"}, "sft.template_date"),
    ({"seed": -1}, "sft.seed"),
])
def test_config_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        parse_section(SFTDataConfig, data, "sft")
    assert f"  {key}: " in str(err.value) and len(str(err.value).splitlines()) == 2


@pytest.mark.parametrize("value", [0, 86400, 20240726])
def test_a_template_date_given_as_a_number_is_refused_not_read_as_unix_time(value):
    """0 was taken as 1970-01-01 (and 86400 as the day after) in silence."""
    with pytest.raises(ConfigError) as err:
        parse_section(SFTDataConfig, {"template_date": value}, "sft.data")
    assert str(err.value).splitlines()[1:] == [
        "  sft.data.template_date: a date is expected as YYYY-MM-DD (quoted: DVC rejects YAML dates), "
        f"not a number (got {value})"]


def test_config_edges_that_are_valid():
    edges = {"seq_len": 8, "val_fraction": 0.5, "max_examples": 1, "quarantine_per_reason": 0, "shard_rows": 1,
             "seed": 0}
    cfg = parse_section(SFTDataConfig, edges, "sft")
    assert {k: getattr(cfg, k) for k in edges} == edges
    assert parse_section(SFTDataConfig, {"seq_len": 1_048_576}, "sft").seq_len == 1_048_576


def test_a_url_source_is_refused_with_how_to_read_it():
    with pytest.raises(ConfigError) as err:
        parse_section(SFTDataConfig, {"sources": [{"path": "https://example.org/chat.jsonl.gz"}]}, "sft.data")
    assert "  sft.data.sources.0.path: a URL (https://), but inputs are read from this machine's " \
           "filesystem (and from s3://, gs://, gcs://; see the README's Ingest sources): mount the storage at the " \
           "same path on every node" in str(err.value)


def test_config_defaults():
    cfg = SFTDataConfig()
    assert cfg.sources == [SFTSource(path="builtin:stdlib-docstrings", format="auto")]
    assert (cfg.seq_len, cfg.pack, cfg.overlong) == (256, True, "drop")
    with pytest.raises(Exception):
        cfg.seq_len = 3  # frozen: safe to embed in a stage config


# --- the model's own chat template -----------------------------------------------------------------

@pytest.fixture(scope="module")
def adopted(tmp_path_factory):
    """``family`` -> a tokenizer folder adopted from a tiny Hugging Face folder of it."""
    from pipeline.data.tokenizer import TokenizerConfig, adopt_tokenizer
    from tests.hf_tokenizers import save_family_tokenizer

    def make(family):
        base = tmp_path_factory.mktemp(family)
        src = save_family_tokenizer(family, base / "hf")
        adopt_tokenizer(TokenizerConfig(source=str(src)), base / "no-docs.parquet", base / "tokenizer" / "tokenizer.json")
        return base / "tokenizer" / "tokenizer.json"
    return make


END_OF_TURN = {"qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "mistral"])
def test_adopted_tokenizer_rows_use_its_template_pad_and_end_of_turn(tmp_path, three_formats, adopted, family):
    from pipeline.data.tokenizer import load_specials, load_tokenizer

    path = adopted(family)
    tok, specials = load_tokenizer(path), load_specials(path)
    out, m = build(tmp_path, path, sources=[SFTSource(path=str(three_formats))], seq_len=200)
    assert m["skipped"] == {} and m["train"]["examples"] + m["val"]["examples"] == 30
    manifest = read_json(out / MANIFEST)
    eot = tok.token_to_id(END_OF_TURN[family])
    assert manifest["chat_template_name"].startswith("tokenizer (") and manifest["chat_template"] == specials.chat_template
    assert manifest["pad_id"] == specials.pad_id and manifest["end_of_turn_ids"] == [eot]
    assert manifest["stop_ids"][0] == eot and set(specials.eos_ids) <= set(manifest["stop_ids"])
    texts, padded = [], 0
    first = {"qwen2": "<|im_start|>", "qwen3": "<|im_start|>", "llama3": "<|begin_of_text|>", "mistral": "<s>"}
    for split in ("train", "val"):
        ids, labels, starts = read_split(out, split)
        texts += assistant_texts(tok, ids, labels)
        for row, lab, st in zip(ids, labels, starts):
            n_examples = len(st) - (row[st[-1]] == specials.pad_id)
            assert all(row[s] == tok.token_to_id(first[family]) for s in st[:n_examples])
            if n_examples < len(st):  # the rest of the row is padding, never trained
                padded += 1
                assert (row[st[-1]:] == specials.pad_id).all() and (lab[st[-1]:] == IGNORE_INDEX).all()
    assert padded > 0
    lead = " " if family == "mistral" else ""
    think = "<think>\n\n</think>\n\n" if family == "qwen3" else ""
    assert sorted(texts) == sorted(lead + think + qa(i)[1] + END_OF_TURN[family] for i in range(30))


def test_qwen3_reasoning_in_content_is_a_counted_skip(tmp_path, adopted):
    path = adopted("qwen3")
    records = [messages_rec(i) for i in range(6)] + [
        {"messages": [{"role": "user", "content": "Why?"},
                      {"role": "assistant", "content": "<think>\nsince\n</think>\n\nBecause."}]}]
    write_jsonl(tmp_path / "d.jsonl", records)
    _, m = build(tmp_path, path, sources=[SFTSource(path=str(tmp_path / "d.jsonl"))])
    assert m["skipped"] == {"template_rewrites_content": 1}
    q = [json.loads(x) for x in (tmp_path / "out-quarantine.jsonl").read_text().splitlines()]
    assert q[0]["reason"] == "template_rewrites_content" and q[0]["location"] == "line:7"


def test_chat_template_file_overrides_chatml(tmp_path, tok_path, tok, three_formats):
    from tests.hf_tokenizers import QWEN2_TEMPLATE

    template = tmp_path / "qwen.jinja"
    template.write_text(QWEN2_TEMPLATE)  # ChatML tokens, plus a default system prompt
    out, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))], seq_len=200,
                   chat_template=str(template))
    manifest = read_json(out / MANIFEST)
    assert manifest["chat_template_name"] == str(template) and manifest["chat_template"] == QWEN2_TEMPLATE
    ids, labels, _ = read_split(out, "train")
    assert tok.decode(ids[0].tolist(), skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert set(assistant_texts(tok, ids, labels)) <= {qa(i)[1] + IM_END for i in range(30)}
    chatml, _ = build(tmp_path, tok_path, "chatml", sources=[SFTSource(path=str(three_formats))], seq_len=200)
    assert read_json(chatml / MANIFEST)["chat_template_name"] == "chatml"
    assert read_json(chatml / MANIFEST)["splits"]["train"]["tokens"] < manifest["splits"]["train"]["tokens"]


def test_unusable_template_fails_in_one_line_before_reading(tmp_path, tok_path, three_formats):
    from pipeline.data.chat_template import ChatTemplateError

    bad = tmp_path / "upper.jinja"
    bad.write_text("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content|upper + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    with pytest.raises(ChatTemplateError) as e:
        build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))], chat_template=str(bad))
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
    assert not (tmp_path / "out-quarantine.jsonl").exists()
    with pytest.raises(ChatTemplateError, match="neither auto, chatml nor an existing"):
        build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))], chat_template="nope.jinja")


# Two processes (the launchers of two nodes) call build_once on one folder at the
# same moment (a file each touches, then waits for the other's), and print
# whether they built or found it built.
BUILD_AT_ONCE = """
import json, logging, sys, time
from pathlib import Path
from pipeline.data.sft_data import SFTDataConfig, build_once

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
me, tok, out, sources = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
cfg = SFTDataConfig(sources=sources, seq_len=64, val_fraction=0.25)
(out.parent / f"ready-{me}").touch()
while len(list(out.parent.glob("ready-*"))) < 2:
    time.sleep(0.001)
metrics = build_once(cfg, tok, out, out.parent / f"quarantine-{me}.jsonl")
print("RESULT " + json.dumps(metrics["examples_in"]), flush=True)
"""


def test_the_nodes_of_a_run_build_the_sft_data_once_on_the_folder_they_share(tmp_path, tok_path):
    """Every node's launcher builds the SFT data; on shared storage two builds
    at once would remove each other's shards. One builds, the other waits for
    it and finds it built; the folder is the bytes of a build alone. A change
    to the data params (or the sources) builds it again."""
    import subprocess

    from pipeline.data.sft_data import build_once
    from tests.conftest import ROOT

    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(1500)])
    sources = [{"path": str(tmp_path / "chat.jsonl")}]
    alone = build(tmp_path, tok_path, "alone", sources=[SFTSource(**s) for s in sources])[0]
    shared = tmp_path / "nodes" / "sft"
    shared.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_AT_ONCE, me, str(tok_path), str(shared),
                               json.dumps(sources)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for me in ("node0", "node1")]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    found = [("holds this build already" in out) for out in outs]
    assert sorted(found) == [False, True], outs
    assert all("RESULT 1500" in out for out in outs)
    files = lambda d: {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*")
                       if p.is_file() and not p.name.startswith(".build")}
    assert files(shared) == files(alone)

    cfg = SFTDataConfig(sources=sources, seq_len=64, val_fraction=0.25)
    manifest = (shared / MANIFEST).stat().st_mtime_ns
    build_once(cfg, tok_path, shared, tmp_path / "q.jsonl")
    assert (shared / MANIFEST).stat().st_mtime_ns == manifest, "the same build is not made again"
    build_once(cfg.model_copy(update={"seed": 1}), tok_path, shared, tmp_path / "q.jsonl")
    assert (shared / MANIFEST).stat().st_mtime_ns != manifest, "other params build again"
    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(1400)])
    assert build_once(cfg.model_copy(update={"seed": 1}), tok_path, shared, tmp_path / "q.jsonl")[
        "examples_in"] == 1400, "a changed source builds again"


@pytest.mark.parametrize("damage", ['{"fingerprint": "ab', "[1, 2]", '{"fingerprint": "x"}', '{"metrics": {}}', ""])
def test_a_damaged_build_record_builds_again_with_a_warning_not_a_traceback(tmp_path, tok_path, damage, caplog):
    from pipeline.data.sft_data import BUILD_RECORD, build_once

    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(12)])
    cfg = SFTDataConfig(sources=[SFTSource(path=str(tmp_path / "chat.jsonl"))], seq_len=64, val_fraction=0.25)
    first = build_once(cfg, tok_path, tmp_path / "sft", tmp_path / "q.jsonl")
    (tmp_path / "sft" / BUILD_RECORD).write_text(damage)
    with caplog.at_level("WARNING"):
        assert build_once(cfg, tok_path, tmp_path / "sft", tmp_path / "q.jsonl") == first
    assert any("is damaged" in r.getMessage() and "built again" in r.getMessage() for r in caplog.records)
    assert read_json(tmp_path / "sft" / BUILD_RECORD)["metrics"] == first  # written anew


def test_a_glob_reaches_nested_folders_and_a_wrapper_of_two_lists_is_one_record(tmp_path, tok_path):
    """``**`` matches folders at any depth; a JSON object holding two lists of records is no
    wrapper of one (which list would it be?): it is one record, a counted skip."""
    for i, sub in enumerate(("a", "a/b", "a/b/c")):
        (tmp_path / "chats" / sub).mkdir(parents=True, exist_ok=True)
        write_jsonl(tmp_path / "chats" / sub / "part.jsonl", [messages_rec(i)])
    (tmp_path / "two.json").write_text(json.dumps({"train": [messages_rec(5)], "test": [messages_rec(6)]}))
    sources = [SFTSource(path=str(tmp_path / "chats" / "**" / "*.jsonl")), SFTSource(path=str(tmp_path / "two.json"))]
    out, m = build(tmp_path, tok_path, sources=sources)
    assert [s["records"] for s in m["sources"].values()] == [3, 1] and m["examples_in"] == 4
    assert sum(m["skipped"].values()) == 1 and m["train"]["examples"] + m["val"]["examples"] == 3
    assert read_json(out / MANIFEST)["python"] is None  # no built-in dataset read: no Python version to record


def test_small_shards_hold_every_row(tmp_path, tok_path):
    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(40)])
    out, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "chat.jsonl"))], shard_rows=2,
                   pack=False)
    for split in ("train", "val"):
        rows = PackedRows(out / split)
        assert len(rows) == m[split]["rows"] == m[split]["examples"] > 2
        assert len(read_json(out / MANIFEST)["splits"][split]["shards"]) == -(-len(rows) // 2)


def test_a_failed_write_leaves_no_shard_and_a_build_without_its_manifest_is_built_again(tmp_path, tok_path,
                                                                                         monkeypatch):
    import pipeline.data.sft_data as sft_data
    from pipeline.data.sft_data import build_once

    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(20)])
    cfg = SFTDataConfig(sources=[SFTSource(path=str(tmp_path / "chat.jsonl"))], seq_len=64, val_fraction=0.25)
    real = sft_data.write_split

    def val_fails(out_dir, split, *args):
        if split == "val":
            raise OSError("the disk went away")
        return real(out_dir, split, *args)

    monkeypatch.setattr(sft_data, "write_split", val_fails)
    with pytest.raises(OSError, match="the disk went away"):
        build_once(cfg, tok_path, tmp_path / "sft", tmp_path / "q.jsonl")
    assert not list((tmp_path / "sft").rglob("*.arrow"))  # train's shards went with the failed build
    monkeypatch.setattr(sft_data, "write_split", real)
    first = build_once(cfg, tok_path, tmp_path / "sft", tmp_path / "q.jsonl")
    (tmp_path / "sft" / MANIFEST).unlink()
    assert build_once(cfg, tok_path, tmp_path / "sft", tmp_path / "q.jsonl") == first
    assert (tmp_path / "sft" / MANIFEST).is_file()


def test_the_manifest_vocab_size_covers_a_gapped_tokenizer_and_a_non_utf8_json_file_is_counted(tmp_path):
    """sft's model is checked against the manifest's vocab_size: a gap in the ids puts the largest
    past the count of tokens. A .json file that is not UTF-8 is a non_utf8 skip, as a JSON line is."""
    data = json.loads(tiny_tokenizer().to_str())
    vocab = data["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 1000  # the top learned token moves past a gap; the count stays
    gapped = tmp_path / "tokenizer.json"
    gapped.write_text(json.dumps(data))
    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(8)])
    (tmp_path / "latin1.json").write_bytes(json.dumps([messages_rec(9)]).encode().replace(b"Question", b"Qu\xe9stion"))
    out, m = build(tmp_path, gapped, sources=[SFTSource(path=str(tmp_path / "chat.jsonl")),
                                              SFTSource(path=str(tmp_path / "latin1.json"))])
    assert read_json(out / MANIFEST)["vocab_size"] == 1001
    assert m["skipped"] == {"non_utf8": 1}


def test_a_tokenizer_rewritten_to_the_same_size_and_time_builds_the_data_again(tmp_path, caplog):
    """The build is reused only for the same tokenizer bytes: a copy kept its size and time
    (`cp -p` of another tokenizer of that size) is still another tokenizer."""
    import os

    from pipeline.data.sft_data import build_once

    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text(tiny_tokenizer().to_str())
    write_jsonl(tmp_path / "chat.jsonl", [messages_rec(i) for i in range(8)])
    cfg = SFTDataConfig(sources=[SFTSource(path=str(tmp_path / "chat.jsonl"))], seq_len=64, val_fraction=0.25)
    build_once(cfg, tok, tmp_path / "sft", tmp_path / "q.jsonl")
    st = tok.stat()
    tok.write_text(tok.read_text().replace('"fuse_unk":false', '"fuse_unk":true '))  # same size, other bytes
    os.utime(tok, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tok.stat().st_size == st.st_size
    with caplog.at_level("INFO", logger="pipeline"):
        build_once(cfg, tok, tmp_path / "sft", tmp_path / "q.jsonl")
    assert "holds this build already" not in caplog.text and "built the SFT data" in caplog.text


def test_a_number_too_long_for_python_is_a_malformed_record_not_a_crash(tmp_path, tok_path):
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer of more than 4,300 digits: one
    such record ended the build with a traceback, in a .jsonl line as in a .json file."""
    huge = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "n": ' + \
           "1" * 5000 + "}"
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(i) for i in range(8)])
    with open(tmp_path / "d.jsonl", "a") as f:
        f.write(huge + "\n")
    (tmp_path / "one.json").write_text(huge)
    _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "d.jsonl")),
                                              SFTSource(path=str(tmp_path / "one.json"))])
    assert m["examples_in"] == 10 and m["skipped"] == {"malformed_json": 2}
    q = [json.loads(x) for x in (tmp_path / "out-quarantine.jsonl").read_text().splitlines()]
    assert [e["location"] for e in q] == ["line:9", "file"] and all("4300 digits" in e["detail"] for e in q)


def test_the_quarantine_keeps_at_most_quarantine_per_reason_samples_and_counts_them_all(tmp_path, tok_path):
    write_jsonl(tmp_path / "d.jsonl", [messages_rec(i) for i in range(8)] + [{"nope": i} for i in range(3)])
    _, m = build(tmp_path, tok_path, sources=[SFTSource(path=str(tmp_path / "d.jsonl"))], quarantine_per_reason=1)
    assert m["skipped"] == {"unknown_format": 3}
    (q,) = [json.loads(x) for x in (tmp_path / "out-quarantine.jsonl").read_text().splitlines()]
    assert q["location"] == "line:9"


def test_a_template_that_ends_turns_with_a_token_that_is_not_an_eos_says_so(tmp_path, tok_path, three_formats, caplog):
    """Generation stops at the eos ids unless told: the manifest's stop_ids add the template's end of turn, and
    the build warns."""
    from pipeline.data.chat import CHAT_TEMPLATE_JINJA
    from pipeline.data.tokenizer import EOT_ID, IM_END_ID, PAD_ID

    template = tmp_path / "pad.jinja"
    template.write_text(CHAT_TEMPLATE_JINJA.replace("<|im_end|>", "<|pad|>"))
    with caplog.at_level("WARNING", logger="pipeline.data.sft_data"):
        out, _ = build(tmp_path, tok_path, sources=[SFTSource(path=str(three_formats))], chat_template=str(template))
    manifest = read_json(out / MANIFEST)
    assert manifest["end_of_turn_ids"] == [PAD_ID] and manifest["stop_ids"] == [PAD_ID, IM_END_ID, EOT_ID]
    assert any(f"closes assistant turns with id(s) [{PAD_ID}], which are not among the tokenizer's eos ids" in line
               for line in caplog.messages)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.data.sft_data"):
        build(tmp_path, tok_path, "chatml", sources=[SFTSource(path=str(three_formats))])
    assert not any("not among the tokenizer's eos ids" in line for line in caplog.messages)
