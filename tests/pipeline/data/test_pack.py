import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, parse_section
from pipeline.data import pack
from pipeline.data.docs import BIG_GROUP, DocTable, identity, row_spans
from pipeline.data.executor import ExecutorConfig
from pipeline.data.pack import (
    FORMAT,
    Keys,
    PackConfig,
    PackError,
    SplitPlan,
    encode_columns,
    encode_texts,
    follows,
    plan_splits,
    row_starts,
    run_pack,
    split_hash,
    split_hashes,
    split_parts,
    val_threshold,
)
from pipeline.data.shards import MANIFEST, DataError, PackedRows, verify
from pipeline.data.tokenizer import (
    EOT,
    EOT_ID,
    TokenizerConfig,
    load_tokenizer,
    train_tokenizer,
)
from pipeline.files import read_json, sha256_file
from tests.conftest import ROOT
from tests.pipeline.data.test_tokenizer import make_docs, write_docs

# Small rows and shards so that a tiny corpus spans many rows, shards and tasks.
CFG = PackConfig(seq_len=31, val_fraction=0.2, seed=3, num_workers=2, shard_tokens=40 * 32 + 5,
                 batch_docs=16, task_bytes=2_000)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    items = make_docs(120, seed=7)
    items[5] = ("doc0005", "")  # encodes to nothing
    items[9] = ("doc0009", f"text with {EOT} inside")
    items[10] = ("doc0010", "x")  # one token
    path = d / "docs.parquet"
    write_docs(path, items)
    tok = d / "tokenizer.json"
    train_tokenizer(TokenizerConfig(vocab_size=350, sample_bytes=20_000, eval_bytes=2_000), path, tok)
    return path, tok, items


@pytest.fixture(scope="module")
def packed(docs, tmp_path_factory):
    path, tok, _ = docs
    out = tmp_path_factory.mktemp("packed")
    metrics = run_pack(CFG, path, tok, out)
    return out, metrics


def expected_streams(items, docs_path, tok_path, cfg, keys=None):
    """The token stream of each split, built the slow obvious way: documents in
    table order, a chunk appended to the run before it when that run's last
    document in the split is the previous chunk of the same file, each run closed
    by EOT. ``keys`` holds (source, chunk) or None per item."""
    tok = load_tokenizer(tok_path)
    plan = plan_splits(pq.ParquetFile(docs_path), cfg.seed, cfg.val_fraction, val_by=cfg.val_by)
    runs, last = {"train": [], "val": []}, {"train": None, "val": None}
    for (doc_id, text), key in zip(items, keys or [None] * len(items)):
        split = plan.split_of(doc_id, *(key or (None, None)))
        ids = tok.encode(text or "").ids
        if not ids:
            continue
        prev, last[split] = last[split], key
        if key is not None and prev is not None and (prev[0], prev[1] + 1) == key:
            runs[split][-1].extend(ids)
        else:
            runs[split].append(list(ids))
    streams, starts = {}, {}
    for split, rs in runs.items():
        starts[split] = list(np.cumsum([0] + [len(r) + 1 for r in rs[:-1]]))
        streams[split] = np.array([t for r in rs for t in r + [EOT_ID]], np.int32)
    return streams, starts


def packed_files(out):
    """The files of the packed format (manifest and shards), relative to ``out``;
    the commit records and checkpoints beside them depend on how the run was cut
    into tasks, the output itself does not."""
    return sorted(p.relative_to(out) for p in out.rglob("*")
                  if p.is_file() and (p.suffix == ".arrow" or p.name == MANIFEST))


def all_rows(split):
    return np.concatenate(list(split.iter_input_ids()))


def test_rows_are_the_split_stream_cut_into_fixed_lengths(docs, packed):
    path, tok, items = docs
    out, metrics = packed
    streams, _ = expected_streams(items, path, tok, CFG)
    manifest = read_json(out / MANIFEST)
    for name in ("train", "val"):
        split = PackedRows(out / name)
        rows = all_rows(split)
        info = manifest["splits"][name]
        assert rows.shape == (info["rows"], CFG.seq_len + 1) and rows.dtype == np.int32
        assert len(streams[name]) == info["tokens"] == info["rows"] * 32 + info["dropped_tail_tokens"]
        assert info["dropped_tail_tokens"] < 32
        np.testing.assert_array_equal(rows.reshape(-1), streams[name][:rows.size])
        assert metrics[f"{name}_rows"] == info["rows"]
    assert len(manifest["splits"]["train"]["shards"]) > 1


def test_doc_starts_mark_every_document_boundary(docs, packed):
    path, tok, items = docs
    out, _ = packed
    _, starts = expected_streams(items, path, tok, CFG)
    for name in ("train", "val"):
        split = PackedRows(out / name)
        rows, seg = split.input_ids(np.arange(len(split))), split.segment_ids(np.arange(len(split)))
        got = []
        for i in range(len(split)):
            s = np.flatnonzero(np.diff(seg[i], prepend=-1))  # where a segment starts
            assert np.all(rows[i][s[1:] - 1] == EOT_ID)
            got.extend(i * 32 + s)
        cut = len(split) * 32
        want = sorted(set(range(0, cut, 32)) | {p for p in starts[name] if p < cut})
        assert got == want


def test_split_is_by_document_and_seeded(docs, packed):
    path, _, items = docs
    out, _ = packed
    plan = plan_splits(pq.ParquetFile(path), CFG.seed, CFG.val_fraction)
    val = {i for i, _ in items if plan.split_of(i) == "val"}
    assert 0 < len(val) < len(items)
    splits = read_json(out / MANIFEST)["splits"]
    assert splits["val"]["docs"] == len(val) and splits["train"]["docs"] == len(items) - len(val)
    # the rule is a pure function of (seed, id); another seed gives another split
    assert all((split_hash(CFG.seed, i) < val_threshold(CFG.val_fraction)) == (i in val) for i, _ in items)
    other = plan_splits(pq.ParquetFile(path), CFG.seed + 1, CFG.val_fraction)
    assert {i for i, _ in items if other.split_of(i) == "val"} != val


def test_output_does_not_depend_on_workers_or_batching(docs, packed, tmp_path):
    path, tok, _ = docs
    out, metrics = packed
    cfg = CFG.model_copy(update={"executor": ExecutorConfig(num_workers=1), "batch_docs": 7, "task_bytes": 50_000})
    m1 = run_pack(cfg, path, tok, tmp_path)
    assert m1["workers"] == 1 and metrics["workers"] == 2
    assert (tmp_path / MANIFEST).read_bytes() == (out / MANIFEST).read_bytes()
    for entry in read_json(out / MANIFEST)["splits"]["train"]["shards"]:
        assert (tmp_path / entry["path"]).read_bytes() == (out / entry["path"]).read_bytes()


def test_manifest_vocab_size_covers_the_largest_id_of_a_tokenizer_with_gaps(docs, tmp_path):
    """A model built from the manifest (pretrain from scratch) sizes its embedding
    table by vocab_size: it must hold the largest id, which a gap in the ids puts
    past the count of tokens (the count left the top id outside the table)."""
    path, tok, _ = docs
    data = json.loads(tok.read_text())
    vocab = data["model"]["vocab"]
    count = len(set(vocab.values()) | {t["id"] for t in data["added_tokens"]})
    vocab[max(vocab, key=vocab.get)] = 400  # the top learned token moves past a gap; the count stays
    gapped = tmp_path / "tokenizer.json"
    gapped.write_text(json.dumps(data))
    assert load_tokenizer(gapped).get_vocab_size() == count < 401
    run_pack(CFG, path, gapped, tmp_path / "out")
    assert read_json(tmp_path / "out" / MANIFEST)["vocab_size"] == 401


def test_manifest_and_accounting(docs, packed):
    _, tok, items = docs
    out, metrics = packed
    m = read_json(out / MANIFEST)
    assert m["format"] == "pipeline.pack/1"
    assert (m["seq_len"], m["row_len"], m["eot_id"], m["pad_id"]) == (31, 32, 0, 1)
    assert m["vocab_size"] == load_tokenizer(tok).get_vocab_size()
    assert m["tokenizer_sha256"] == sha256_file(tok)
    assert (m["seed"], m["val_fraction"], m["val_by"], m["forced"]) == (3, 0.2, "hash", {})
    assert m["splits"]["train"]["joined"] == m["splits"]["val"]["joined"] == 0  # no chunks here
    assert m["docs"] == len(items) == metrics["docs"] == m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"]
    assert m["tokens"] == metrics["tokens"] == m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    assert m["splits"]["train"]["empty_docs"] + m["splits"]["val"]["empty_docs"] == 1
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    listed = sorted(e["path"] for s in m["splits"].values() for e in s["shards"])
    # beside the manifest and the shards: each shard's commit record, the checkpoints to resume from, and the
    # finished run's record
    records = [p.removesuffix(".arrow") + ".json" for p in listed]
    checkpoints = [f for f in files if f.startswith("checkpoint-")]
    assert files == sorted([MANIFEST, *listed, *records, *checkpoints, pack.COMPLETE])
    assert metrics["shards"] == len(listed) and metrics["shards_resumed"] == 0
    for s in m["splits"].values():
        for e in s["shards"]:
            assert sha256_file(out / e["path"]) == e["sha256"]
        assert sum(e["rows"] for e in s["shards"]) == s["rows"]
        # shard_tokens = 40 rows and a bit: rounded down to whole rows
        assert all(e["rows"] == 40 for e in s["shards"][:-1]) and 0 < s["shards"][-1]["rows"] <= 40
    assert metrics["bytes"] == sum(len(t.encode()) for _, t in items)
    assert metrics["tokens_per_s"] > 0 and metrics["mb_per_s"] > 0


def test_worker_encoding_ignores_special_strings_and_leaves_separation_to_the_writer(docs):
    _, tok, _ = docs
    flat, lens = encode_texts(load_tokenizer(tok), [f"a {EOT} b", "", "c"])
    assert (lens > 0).tolist() == [True, False, True] and lens.sum() == len(flat)
    assert EOT_ID not in flat.tolist()  # the literal string is ordinary bytes; no EOT yet


def test_output_verifies_against_its_manifest(packed, tmp_path):
    out, _ = packed
    assert verify(out, FORMAT)["splits"]["train"]["rows"] == len(PackedRows(out / "train"))
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = bad / read_json(bad / MANIFEST)["splits"]["val"]["shards"][0]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    verify(bad, sha256=False)  # without the digest, a flipped token is not noticed
    with pytest.raises(DataError, match="sha256"):
        verify(bad)
    victim.unlink()
    with pytest.raises(DataError, match="missing"):
        verify(bad)
    (bad / MANIFEST).unlink()
    with pytest.raises(DataError, match="not found"):
        verify(bad)


def test_row_starts_against_a_reference():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(1, 20, size=rng.integers(1, 12))
        starts = np.cumsum(lens) - lens
        L = int(rng.integers(2, 15))
        n = int(lens.sum()) // L
        counts, offs = row_starts(starts[starts < n * L], n, L)
        assert len(counts) == n and counts.sum() == len(offs) and offs.dtype == np.int32
        per_row = np.split(offs, np.cumsum(counts)[:-1]) if n else []
        for r in range(n):
            assert list(per_row[r]) == sorted({0} | {int(p - r * L) for p in starts if r * L <= p < (r + 1) * L})


def write_items(path, items):
    write_docs(path, items)
    return path


def test_tiny_corpus_forces_one_doc_into_each_split(docs, tmp_path):
    _, tok, _ = docs
    long_text = "some words that repeat " * 30
    path = write_items(tmp_path / "two.parquet", [("a", long_text), ("b", long_text)])
    plan = plan_splits(pq.ParquetFile(path), 0, 0.01)
    assert list(plan.forced.values()) == ["val"]
    m = run_pack(PackConfig(seq_len=8, val_fraction=0.01, num_workers=1), path, tok, tmp_path / "out")
    manifest = read_json(tmp_path / "out" / MANIFEST)
    assert manifest["splits"]["train"]["docs"] == 1 and manifest["splits"]["val"]["docs"] == 1
    assert m["train_rows"] >= 1 and m["val_rows"] >= 1
    assert manifest["forced"] == plan.forced
    # the other way: with seed 4 both ids hash below 0.5, so the larger hash goes to train
    assert all(SplitPlan(2, 4, val_threshold(0.5)).split_of(i) == "val" for i in "ab")
    plan = plan_splits(pq.ParquetFile(path), 4, 0.5)
    assert plan.forced == {max("ab", key=lambda i: split_hash(4, i)): "train"}


def test_errors(docs, tmp_path):
    path, tok, _ = docs
    cfg = PackConfig(num_workers=1)
    with pytest.raises(PackError, match="documents not found"):
        run_pack(cfg, tmp_path / "missing.parquet", tok, tmp_path / "o")
    with pytest.raises(PackError, match="tokenizer not found"):
        run_pack(cfg, path, tmp_path / "missing.json", tmp_path / "o")
    with pytest.raises(PackError, match="empty"):
        run_pack(cfg, write_items(tmp_path / "e.parquet", []), tok, tmp_path / "o")
    with pytest.raises(PackError, match="at least two documents"):
        run_pack(cfg, write_items(tmp_path / "one.parquet", [("a", "hello")]), tok, tmp_path / "o")

    # too little text for one row: a clear error, and no half-written output left behind
    out = tmp_path / "small"
    (out / "train").mkdir(parents=True)
    (out / "train" / "shard-00042.arrow").write_bytes(b"stale")
    (out / MANIFEST).write_text(json.dumps({"format": "stale"}))
    small = write_items(tmp_path / "s.parquet", [(f"d{i}", "hi there") for i in range(30)])
    with pytest.raises(PackError, match=r"fewer than one row of 4097.*pack\.seq_len"):
        run_pack(PackConfig(seq_len=4096, num_workers=1), small, tok, out)
    assert not list(out.rglob("*.arrow")) and not (out / MANIFEST).exists()

    # train fills shards, val cannot fill a row: the train shards already written go too
    ids = [f"d{i}" for i in range(30)]
    plan = plan_splits(pq.ParquetFile(write_items(tmp_path / "v.parquet", [(i, "x") for i in ids])), 0, 0.05)
    uneven = write_items(tmp_path / "v.parquet",
                         [(i, "x" if plan.split_of(i) == "val" else "long text " * 50) for i in ids])
    with pytest.raises(PackError, match="the val split has"):
        run_pack(PackConfig(seq_len=64, shard_tokens=100, num_workers=1), uneven, tok, out)
    assert not list(out.rglob("*.arrow")) and not (out / MANIFEST).exists()


def test_a_split_too_short_for_a_row_is_told_the_fix_that_helps_it(docs, tmp_path):
    """A larger val_fraction grows val at train's cost: it is the advice for a
    short val split only. A short train split was told to raise it too."""
    _, tok, _ = docs
    ids = [f"d{i}" for i in range(30)]
    plan = plan_splits(pq.ParquetFile(write_items(tmp_path / "v.parquet", [(i, "x") for i in ids])), 0, 0.2)
    assert 0 < sum(plan.split_of(i) == "val" for i in ids) < 30
    short_train = write_items(tmp_path / "t.parquet",
                              [(i, "long text " * 50 if plan.split_of(i) == "val" else "x") for i in ids])
    with pytest.raises(PackError) as err:
        run_pack(PackConfig(seq_len=64, val_fraction=0.2, num_workers=1), short_train, tok, tmp_path / "a")
    message = str(err.value)
    assert message.startswith("the train split has ") and "fewer than one row of 65; " in message
    assert "raise pack.val_fraction" not in message and "lower pack.val_fraction" in message
    both = write_items(tmp_path / "s.parquet", [(i, "hi there") for i in ids])
    with pytest.raises(PackError) as err:
        run_pack(PackConfig(seq_len=4096, val_fraction=0.2, num_workers=1), both, tok, tmp_path / "b")
    assert re.fullmatch(r"the train split has \d+ tokens from \d+ document\(s\) and the val split has \d+ tokens "
                        r"from \d+ document\(s\), fewer than one row of 4097 each; lower pack\.seq_len, or add data",
                        str(err.value))
    # every document empty: no row length helps, so none is offered
    empty = write_items(tmp_path / "e.parquet", [(i, "") for i in ids])
    with pytest.raises(PackError) as err:
        run_pack(PackConfig(seq_len=8, val_fraction=0.2, num_workers=1), empty, tok, tmp_path / "c")
    assert re.fullmatch(r"the train split has 0 tokens from \d+ document\(s\) and the val split has 0 tokens from "
                        r"\d+ document\(s\): every one of those documents is empty \(no text, or text that encodes "
                        r"to no tokens\); check the text column of the documents \(did clean empty them\?\), or add "
                        r"data", str(err.value))


def test_a_seq_len_the_kept_output_shows_too_long_is_refused_before_anything_is_read_or_removed(docs, tmp_path,
                                                                                                 monkeypatch):
    """Only seq_len changed: the finished output's manifest already counts each
    split's tokens, so the run need not remove it and tokenize to find out."""
    path, tok, _ = docs
    out = tmp_path / "packed"
    run_pack(PackConfig(seq_len=16, num_workers=1), path, tok, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    val = read_json(out / MANIFEST)["splits"]["val"]

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized")

    monkeypatch.setattr(pack, "_encoded", no_tokenizing)
    with pytest.raises(PackError) as err:
        run_pack(PackConfig(seq_len=val["tokens"], shard_tokens=1 << 20, num_workers=1), path, tok, out)
    assert str(err.value) == (
        f"the val split has {val['tokens']} tokens from {val['docs']} document(s), fewer than one row of "
        f"{val['tokens'] + 1}; lower pack.seq_len, raise pack.val_fraction, or add data (the count of the output "
        f"in {out}, packed from the same documents, tokenizer and split, which is left as it was)")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    # one token fewer fills the row: the check refuses nothing the run would have packed
    m = run_pack(PackConfig(seq_len=val["tokens"] - 1, num_workers=1), path, tok, out)
    assert m["val_rows"] == 1


def test_rerun_removes_stale_shards(docs, tmp_path):
    path, tok, _ = docs
    stale = tmp_path / "train" / "shard-00099.arrow"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    run_pack(CFG.model_copy(update={"executor": ExecutorConfig(num_workers=1), "shard_tokens": 1 << 20}), path, tok, tmp_path)
    assert not stale.exists()
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["shard-00000.arrow", "shard-00000.json"]


def test_a_users_folder_of_shards_in_the_output_is_left_and_named_but_an_old_source_split_goes(docs, tmp_path,
                                                                                                caplog):
    """Every subfolder holding shard-named files was taken for a split of another run and emptied, a user's
    backup (``data/packed/my-backup/``) too, at each run's start and again when a run failed on its data."""
    path, tok, _ = docs
    for d in ("my-backup", "val-source-03"):
        (tmp_path / d).mkdir()
        for name in ("shard-00000.arrow", "shard-00000.json"):
            (tmp_path / d / name).write_bytes(b"old")
    cfg = CFG.model_copy(update={"executor": ExecutorConfig(num_workers=1)})  # shards, so checkpoints, mid-run
    with caplog.at_level("WARNING"):
        run_pack(cfg, path, tok, tmp_path)
        assert not list((tmp_path / "val-source-03").iterdir())  # a per-source val split of an earlier run
        assert sorted(p.name for p in (tmp_path / "my-backup").iterdir()) == ["shard-00000.arrow", "shard-00000.json"]
        verify(tmp_path, FORMAT)
        (tmp_path / pack.COMPLETE).unlink()  # a rerun as after a kill: it keeps its committed shards
        assert run_pack(cfg, path, tok, tmp_path)["shards_resumed"] > 0
        with pytest.raises(PackError, match="fewer than one row"):  # fails on its data: clears its own splits
            run_pack(cfg.model_copy(update={"seq_len": 100_000, "seed": 4}), path, tok, tmp_path)
    assert not list(tmp_path.glob("train/shard-*")) and not (tmp_path / MANIFEST).exists()
    assert sorted(p.name for p in (tmp_path / "my-backup").iterdir()) == ["shard-00000.arrow", "shard-00000.json"]
    told = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert len(told) == 1 and "left alone my-backup/, which holds" in told[0]  # the run's own splits are not named


def test_a_document_lost_between_reading_and_packing_stops_the_run(docs, tmp_path, monkeypatch):
    """Every document read is packed into a split or counted: the run checks it before the manifest."""
    path, tok, _ = docs
    real = pack.split_parts

    def loses_one(*args):
        parts = real(*args)
        parts["train"].docs -= parts["train"].docs > 0
        return parts

    monkeypatch.setattr(pack, "split_parts", loses_one)
    with pytest.raises(AssertionError, match=r"120 documents read but \d+ \+ \d+ packed"):
        run_pack(CFG.model_copy(update={"executor": ExecutorConfig(num_workers=1)}), path, tok, tmp_path)
    assert not (tmp_path / MANIFEST).exists()


@pytest.mark.parametrize("data, key, msg", [
    ({"seq_len": 0}, "seq_len", "greater than or equal to 8"),
    ({"val_fraction": 0}, "val_fraction", "greater than 0"),
    ({"val_fraction": 0.9}, "val_fraction", "less than or equal to 0.5"),
    ({"num_workers": -1}, "num_workers", "greater than or equal to 0"),
    ({"shard_tokens": 1 << 30}, "shard_tokens", "less than or equal to 67108864"),
    ({"seq_lenn": 4}, "seq_lenn", "unknown key"),
])
def test_config_errors_name_the_key(data, key, msg):
    with pytest.raises(ConfigError, match=rf"pack\.{key}: .*{msg}"):
        parse_section(PackConfig, data, "pack")


def test_shipped_params_parse(root):
    import yaml

    params = yaml.safe_load((root / "params.yaml").read_text())
    parse_section(PackConfig, params["pack"], "pack")
    parse_section(TokenizerConfig, params["tokenizer"], "tokenizer")


def test_split_hash_is_pinned():
    # changing the hash would silently reshuffle every existing train/val split
    assert split_hash(0, "doc0001") == 5218321516855388672
    assert split_hash(7, "abc") == 14866354295510190835


# --- chunks of long texts ---------------------------------------------------------------------


def write_chunked(path, rows):
    """rows: (id, text, source, chunk or None) in table order."""
    import pyarrow as pa

    pq.write_table(pa.table({
        "id": [r[0] for r in rows], "text": [r[1] for r in rows], "source": [r[2] for r in rows],
        "location": ["x"] * len(rows), "chunk": pa.array([r[3] for r in rows], pa.int64()),
        "offset": pa.array([None] * len(rows), pa.int64()),
    }), path, row_group_size=37)
    return path


@pytest.fixture(scope="module")
def chunked(docs, tmp_path_factory):
    """Chunked files around plain documents: a.txt with chunk 7 missing (dropped by
    clean) and chunks 11 and 10 in swapped rows, then c.txt's chunk 30, then b.txt
    with an empty chunk 5."""
    _, tok, items = docs
    texts = [t for _, t in items if t]
    rows = []
    a = [k for k in range(30) if k != 7]
    a[9:11] = [11, 10]
    rows += [(f"a{k}", texts[k], "a.txt", k) for k in a]
    rows += [("c30", texts[29], "c.txt", 30)]  # chunk 30 after chunk 29, but of another file
    rows += [(f"p{i}", texts[30 + i], "plain.txt", None) for i in range(20)]
    rows += [(f"b{k}", "" if k == 5 else texts[50 + k], "b.txt", k) for k in range(40)]
    path = write_chunked(tmp_path_factory.mktemp("chunked") / "docs.parquet", rows)
    return path, tok, rows


def keys_of(rows):
    return [None if r[3] is None else (r[2], r[3]) for r in rows]


@pytest.mark.parametrize("val_by", ["hash", "position"])
def test_consecutive_chunks_are_packed_as_one_document(chunked, tmp_path, val_by):
    path, tok, rows = chunked
    cfg = CFG.model_copy(update={"val_by": val_by, "val_fraction": 0.25})
    run_pack(cfg, path, tok, tmp_path / "a")
    streams, starts = expected_streams([r[:2] for r in rows], path, tok, cfg, keys_of(rows))
    manifest = read_json(tmp_path / "a" / MANIFEST)
    plan = plan_splits(pq.ParquetFile(path), cfg.seed, cfg.val_fraction, val_by=val_by)
    for name in ("train", "val"):
        split = PackedRows(tmp_path / "a" / name)
        flat = all_rows(split).reshape(-1)
        np.testing.assert_array_equal(flat, streams[name][:len(flat)])
        seg = split.segment_ids(np.arange(len(split))).reshape(-1)
        begins = np.flatnonzero(np.diff(seg, prepend=-1) != 0)
        row_begins = set(range(0, len(flat), cfg.seq_len + 1))
        want = [p for p in starts[name] if 0 < p < len(flat) and p not in row_begins]
        assert sorted(set(begins) - row_begins) == want
        n_docs = sum(1 for r in rows if plan.split_of(r[0], r[2], r[3]) == name)
        assert manifest["splits"][name]["docs"] == n_docs
    joined = sum(manifest["splits"][s]["joined"] for s in ("train", "val"))
    assert joined > 20 and joined == len(rows) - 1 - sum(len(starts[s]) for s in ("train", "val"))
    # same bytes with one worker and one chunk per task (every join crosses a task)
    run_pack(cfg.model_copy(update={"executor": ExecutorConfig(num_workers=1), "task_bytes": 1000, "batch_docs": 5}), path, tok, tmp_path / "b")
    assert packed_files(tmp_path / "a") == packed_files(tmp_path / "b")
    for f in packed_files(tmp_path / "a"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_joins_follow_the_recorded_chunk_index_not_the_row_order(chunked, tmp_path):
    path, tok, rows = chunked
    cfg = CFG.model_copy(update={"val_fraction": 0.01, "seed": 0, "executor": ExecutorConfig(num_workers=1)})  # all but one in train
    plan = plan_splits(pq.ParquetFile(path), cfg.seed, cfg.val_fraction)
    assert [r[0] for r in rows if plan.split_of(r[0], r[2], r[3]) == "val"] == ["b28"]
    run_pack(cfg, path, tok, tmp_path)
    train = PackedRows(tmp_path / "train")
    flat = all_rows(train).reshape(-1)
    eots = np.flatnonzero(flat == EOT_ID)
    lengths = {r[0]: len(load_tokenizer(tok).encode(r[1]).ids) for r in rows}
    # a.txt: 0-6 | (7 dropped) 8 9 | 11 | 10 | 12-29; c.txt: 30; plain docs one by one;
    # b.txt: 0-4 | (5 empty) 6-27 | (28 in val) 29-39
    groups = [[f"a{k}" for k in range(7)], ["a8", "a9"], ["a11"], ["a10"], [f"a{k}" for k in range(12, 30)],
              ["c30"], *[[f"p{i}"] for i in range(20)], [f"b{k}" for k in range(5)], [f"b{k}" for k in range(6, 28)],
              [f"b{k}" for k in range(29, 40)]]
    ends = np.cumsum([sum(lengths[d] for d in g) + 1 for g in groups]) - 1
    assert eots.tolist() == [e for e in ends if e < len(flat)]
    assert read_json(tmp_path / MANIFEST)["splits"]["train"]["joined"] == sum(len(g) - 1 for g in groups)


def test_position_split_holds_out_the_end_of_each_file(tmp_path):
    text = "x" * 99 + "\n"  # 100 bytes a chunk
    rows = [(f"a{k}", text, "a.txt", k) for k in range(10)] + [("s0", text, "single.txt", 0)]
    rows += [(f"p{i}", text, "plain.txt", None) for i in range(50)]
    path = write_chunked(tmp_path / "d.parquet", rows)
    for f, val_chunks in ((0.1, ["a9"]), (0.25, ["a8", "a9"]), (0.5, ["a5", "a6", "a7", "a8", "a9"])):
        plan = plan_splits(pq.ParquetFile(path), 0, f, val_by="position")
        got = [r[0] for r in rows if r[3] is not None and plan.split_of(r[0], r[2], r[3]) == "val"]
        assert got == val_chunks, f  # the middle byte in the last f; a file of one chunk stays in train
        plain_val = [r[0] for r in rows if r[3] is None and plan.split_of(r[0], r[2], r[3]) == "val"]
        assert plain_val == [r[0] for r in rows if r[3] is None and split_hash(0, r[0]) < val_threshold(f)]
    # with no chunk landing in val and no plain documents, the chunk nearest a file's end is moved there
    only = write_chunked(tmp_path / "o.parquet", [(f"a{k}", text, "a.txt", k) for k in range(3)])
    assert plan_splits(pq.ParquetFile(only), 0, 0.05, val_by="position").forced == {"a2": "val"}
    plain = write_items(tmp_path / "plain.parquet", [("a", "x"), ("b", "y")])
    with pytest.raises(PackError, match="val_by: position .* no chunk column"):
        plan_splits(pq.ParquetFile(plain), 0, 0.1, val_by="position")
    with pytest.raises(PackError, match="no document is a chunk"):
        plan_splits(pq.ParquetFile(write_chunked(tmp_path / "n.parquet", rows[11:])), 0, 0.1, val_by="position")


def test_position_split_of_files_of_one_chunk_each_is_not_one_distinct_id(tmp_path, caplog):
    """Many short files cut with split_by: chunk are one chunk each, which
    val_by: position keeps in train, all with the same score. The tie made the
    smallest and the largest score the same document, read as 'one distinct id':
    pack refused 30 documents. Now the tiny-corpus rule moves one to val, and a
    warning says why val is so small and what to do."""
    text = "x" * 99 + "\n"
    rows = [(f"f{k}", text, f"f{k}.txt", 0) for k in range(30)]
    path = write_chunked(tmp_path / "d.parquet", rows)
    with caplog.at_level("WARNING", logger="pipeline.data.pack"):
        plan = plan_splits(pq.ParquetFile(path), 0, 0.1, val_by="position")
    assert plan.forced == {"f0": "val"}
    assert [r[0] for r in rows if plan.split_of(r[0], r[2], r[3]) == "val"] == ["f0"]
    assert plan.val_mask(0, 30).tolist() == [True] + [False] * 29
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("pack.val_by: position: 30 of 30 chunked file(s) are one chunk each, which stays in "
                           "train") and "pack.val_by: hash" in line and "chunk_bytes" in line
    # one chunked file of several chunks among them: its tail is val, the one-chunk files are still told of
    caplog.clear()
    more = write_chunked(tmp_path / "m.parquet", rows + [(f"a{k}", text, "a.txt", k) for k in range(10)])
    with caplog.at_level("WARNING", logger="pipeline.data.pack"):
        plan = plan_splits(pq.ParquetFile(more), 0, 0.1, val_by="position")
    assert plan.forced == {} and "30 of 31 chunked file(s) are one chunk each" in caplog.text
    with pytest.raises(PackError, match="one distinct id"):  # a real single id is still refused
        plan_splits(pq.ParquetFile(write_chunked(tmp_path / "s.parquet", [("a0", text, "a.txt", 0)] * 3)), 0, 0.1,
                    val_by="position")


@pytest.mark.parametrize("val_by", ["hash", "position"])
def test_one_chunk_says_that_chunks_end_only_at_line_ends(tmp_path, val_by):
    """One text with no line break is one chunk however low chunk_bytes is: the
    error's advice to lower chunk_bytes says so, or the user lowers it in vain."""
    path = write_chunked(tmp_path / "d.parquet", [("a0", "no line break at all " * 40, "a.txt", 0)])
    with pytest.raises(PackError, match=r"lower chunk_bytes; a chunk ends only at a line end, so a text with no "
                                        r"line break stays one chunk"):
        plan_splits(pq.ParquetFile(path), 0, 0.1, val_by=val_by)


def test_position_split_of_chunks_all_marked_in_ingest_says_so(tmp_path):
    """A chunked text marked split: train (or val) in ingest is not held out by
    position, and the error says that, not that no document is a chunk."""
    import pyarrow as pa

    text = "x" * 99 + "\n"
    path = write_chunked(tmp_path / "d.parquet", [(f"a{k}", text, "a.txt", k) for k in range(10)]
                         + [(f"p{i}", text, "plain.txt", None) for i in range(20)])
    table = pq.read_table(path)
    marks = pa.array(["train"] * 10 + [None] * 20, pa.string())
    pq.write_table(table.append_column("split", marks), tmp_path / "m.parquet")
    with pytest.raises(PackError, match=r"but every chunk \(10\) is marked split: train or val in ingest.sources, "
                                        r"which goes before it; set split: auto on the chunked source, or "
                                        r"pack.val_by: hash$"):
        plan_splits(pq.ParquetFile(tmp_path / "m.parquet"), 0, 0.1, val_by="position")


# --- the array operations, each against the rule it encodes, one document at a time ----------------


def test_split_hashes_are_split_hash():
    ids = ["doc0001", "", "é", "a\x00b", "x" * 300, *[f"d{i}" for i in range(50)]]
    for seed in (0, 7, 123456789):
        assert split_hashes(seed, ids).tolist() == [split_hash(seed, i) for i in ids]


def plan_rows(path):
    t = pq.read_table(path)
    cols = {c: t.column(c).to_pylist() if c in t.column_names else [None] * t.num_rows
            for c in ("id", "source", "chunk")}
    return list(zip(cols["id"], cols["source"], cols["chunk"]))


@pytest.mark.parametrize("val_by", ["hash", "position"])
def test_plan_bits_are_split_of(chunked, tmp_path, val_by):
    path, _, _ = chunked
    for seed, f in ((0, 0.25), (3, 0.5), (1, 0.05)):
        plan = plan_splits(pq.ParquetFile(path), seed, f, val_by=val_by)
        want = [plan.split_of(*r) == "val" for r in plan_rows(path)]
        assert 0 < sum(want) < len(want)
        assert plan.val_mask(0, plan.docs).tolist() == want
        for a, b in ((0, 1), (3, 11), (5, 8), (9, 9), (13, 90), (plan.docs - 3, plan.docs)):
            assert plan.val_mask(a, b).tolist() == want[a:b], (a, b)
        with pytest.raises(IndexError):
            plan.val_mask(0, plan.docs + 1)
    # a forced id moves every row that carries it, as split_of decides by id
    long_text = "some words that repeat " * 30
    dup = write_items(tmp_path / "dup.parquet", [("a", long_text), ("b", long_text), ("a", long_text)])
    for seed, f, forced in ((0, 0.01, "val"), (4, 0.5, "train")):
        plan = plan_splits(pq.ParquetFile(dup), seed, f)
        assert list(plan.forced.values()) == [forced]
        assert plan.val_mask(0, 3).tolist() == [plan.split_of(i) == "val" for i in ("a", "b", "a")]


def test_fast_encoding_gives_the_ids_of_encode_batch(docs):
    _, tok_path, items = docs
    tok = load_tokenizer(tok_path)
    texts = [t for _, t in items] + ["", " ", "\n\n\t", f"x{EOT}y", "naïve café ünïcödé 🙂", "a" * 5000]
    flat, lens = encode_texts(tok, texts)
    want = [e.ids for e in tok.encode_batch(texts)]
    assert lens.tolist() == [len(w) for w in want] and flat.dtype == np.int32
    assert flat.tolist() == [t for w in want for t in w]


def test_continuing_chunks_lose_the_dummy_prefix_and_a_failed_check_is_counted(docs):
    """With a SentencePiece-style tokenizer a chunk that continues its file is
    encoded after a newline, the newline's ids (and the <s> before them) taken
    off; where they are not how its ids begin it keeps the prefix (not the <s>),
    counted. Our byte-level tokenizer adds nothing to a text: no context."""
    from tests.hf_tokenizers import sentencepiece_tokenizer

    assert pack.continuation_context(load_tokenizer(docs[1])) is None
    tok = sentencepiece_tokenizer()
    context = pack.continuation_context(tok)
    assert [tok.id_to_token(i) for i in context] == ["<s>", "\u2581", "<0x0A>"]
    texts = ["The capital", "of France", "    x = 1", "", "is Paris."]
    continues = np.array([False, True, True, True, False])
    flat, lens, kept = pack.encode_continued(tok, texts, continues, context)
    want = [tok.encode(("\n" + t) if c else t).ids[3 if c else 0:] for t, c in zip(texts, continues)]
    assert kept == 0 and lens.tolist() == [len(w) for w in want] and flat.tolist() == sum(want, [])
    pieces = ["".join(map(tok.id_to_token, ids)).replace("\u2581", " ") for ids in want]
    assert pieces[0] == "<s> The capital" and pieces[1:4] == texts[1:4]  # continuing: no <s>, no prefix
    flat, lens, kept = pack.encode_continued(tok, texts, continues, [1, 999])
    assert kept == 3 and flat.tolist() == [i for t, c in zip(texts, continues)
                                           for i in tok.encode(t, add_special_tokens=not c).ids]
    got = encode_columns(tok, [pa.array(texts[:2]), pa.array(texts[2:])], 1000, 2, continues, context)
    assert got.kept_prefix == 0 and got.flat.tolist() == sum(want, [])


def test_continuing_chunks_get_no_bos_from_a_tokenizer_that_adds_one(tmp_path):
    """Llama 3's tokenizer (byte-level, no dummy prefix) puts <|begin_of_text|>
    before every text: a chunk that continues its file is encoded without it."""
    from tokenizers import Tokenizer

    from tests.hf_tokenizers import save_family_tokenizer

    tok = Tokenizer.from_file(str(save_family_tokenizer("llama3", tmp_path) / "tokenizer.json"))
    assert pack.continuation_context(tok) == []
    texts = ["The capital", "of France", "\n  x = 1"]
    continues = np.array([False, True, True])
    flat, lens, kept = pack.encode_continued(tok, texts, continues, [])
    want = [tok.encode(t, add_special_tokens=not c).ids for t, c in zip(texts, continues)]
    assert kept == 0 and flat.tolist() == sum(want, []) and lens.tolist() == [len(w) for w in want]
    bos = tok.token_to_id("<|begin_of_text|>")
    assert want[0][0] == bos and bos not in flat.tolist()[len(want[0]):]


def reference_parts(flat, lens, val, keys):
    """What split_parts computes, the slow obvious way: one document at a time."""
    ids = np.split(flat, np.cumsum(lens)[:-1]) if len(lens) else []
    out = {}
    for split in ("train", "val"):
        docs = [i for i in range(len(lens)) if bool(val[i]) == (split == "val")]
        kept = [i for i in docs if lens[i] > 0]
        ks = [keys[i] if keys else None for i in kept]
        out[split] = {"flat": [t for i in kept for t in ids[i].tolist()], "lens": [int(lens[i]) for i in kept],
                      "joins": [False] + [follows(a, b) for a, b in zip(ks, ks[1:])] if kept else [],
                      "docs": len(docs), "empty": len(docs) - len(kept),
                      "head": ks[0] if ks else None, "tail": ks[-1] if ks else None}
    return out


def test_split_parts_against_a_reference():
    import pyarrow as pa

    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 25))
        lens = rng.integers(0, 4, size=n) * rng.integers(0, 2, size=n)  # many empty documents
        flat = rng.integers(2, 1000, size=int(lens.sum())).astype(np.int32)
        val = rng.random(n) < [0.0, 0.3, 1.0][trial % 3]
        keys = None
        if trial % 4:
            chunk = rng.integers(0, 4, size=n)
            chunk = np.maximum.accumulate(chunk) if trial % 2 else chunk  # runs of consecutive chunks
            source = [rng.choice([None, "a.txt", "b.txt"]) for _ in range(n)]
            has = rng.random(n) < 0.8
            keys = [(source[i], int(chunk[i])) if has[i] else None for i in range(n)]
            arrays = Keys.of(pa.array(source, pa.string()),
                             pa.array([int(c) if h else None for c, h in zip(chunk, has)], pa.int64()))
        else:
            arrays = None
        parts = split_parts(flat, lens, val, arrays)
        want = reference_parts(flat, lens, val, keys)
        for split, part in parts.items():
            got = {"flat": part.flat.tolist(), "lens": part.lens.tolist(), "joins": part.joins.tolist(),
                   "docs": part.docs, "empty": part.empty, "head": part.head, "tail": part.tail}
            assert got == want[split], (trial, split)


def test_a_row_group_too_large_for_a_task_is_read_by_the_stage_in_runs(docs, packed, tmp_path, monkeypatch):
    """The corpus as one row group, more than BIG_GROUP tasks of text: the
    stage sends it in runs of task_bytes; the bytes of the packed fixture's
    many row groups."""
    path, tok, _ = docs
    one = tmp_path / "one.parquet"
    pq.write_table(pq.read_table(path), one, row_group_size=10_000)
    assert DocTable(one, PackError).row_groups()[1][0] > BIG_GROUP * CFG.task_bytes
    sent = []
    real = pack._encode_task
    monkeypatch.setattr(pack, "_encode_task", lambda a, b, message: sent.append((a, b, message is not None)) or real(
        a, b, message))
    run_pack(CFG.model_copy(update={"executor": ExecutorConfig(num_workers=1)}), one, tok, tmp_path / "out")
    assert len(sent) > BIG_GROUP and all(m for _, _, m in sent)
    assert [b for _, b, _ in sent[:-1]] == [a for a, _, _ in sent[1:]] and sent[-1][1] == 120
    out, _ = packed
    assert packed_files(tmp_path / "out") == packed_files(out)
    assert all((tmp_path / "out" / f).read_bytes() == (out / f).read_bytes() for f in packed_files(out))


def test_encoding_calls_hold_about_task_bytes_or_batch_docs(docs, monkeypatch):
    path, tok, items = docs
    t = load_tokenizer(tok)
    calls = []
    real = pack.encode_texts
    monkeypatch.setattr(pack, "encode_texts", lambda tk, texts: calls.append(texts) or real(tk, texts))
    texts = [text for _, text in items]
    columns = [pa.array(texts[:50]), pa.array(texts[50:])]
    longest = max(len((x or "").encode()) for x in texts)
    for task_bytes, batch_docs in ((1000, 1000), (10**9, 7)):
        calls.clear()
        got = encode_columns(t, columns, task_bytes, batch_docs)
        want = encode_texts(t, [x or "" for x in texts])
        np.testing.assert_array_equal(got.flat, want[0])
        np.testing.assert_array_equal(got.lens, want[1])
        assert got.text_bytes == sum(len((x or "").encode()) for x in texts)
        assert len(calls) > 5 and all(len(c) <= batch_docs for c in calls)
        assert all(sum(len(x.encode()) for x in c) < task_bytes + longest for c in calls)


def test_a_worker_reads_and_encodes_its_rows_in_batches(docs):
    path, tok, items = docs
    table = DocTable(path, PackError)
    pack._init_worker(Path(tok).read_text(), pa.schema([("text", pa.string())]), (str(path), identity(table)), 7,
                      1000)
    t = load_tokenizer(tok)
    for a, b in ((0, 120), (3, 4), (45, 61), (100, 120)):
        got = pack._encode_task(a, b, None)
        want = encode_texts(t, [text or "" for _, text in items[a:b]])
        np.testing.assert_array_equal(got.flat, want[0])
        np.testing.assert_array_equal(got.lens, want[1])
        assert got.text_bytes == sum(len((text or "").encode()) for _, text in items[a:b])


def small_groups(path, out):
    """The documents at ``path`` in row groups of 10 (about 5 KB of text), which
    CFG's task_bytes makes tasks that a worker reads."""
    pq.write_table(pq.read_table(path), out, row_group_size=10)
    assert all(s.by_worker for s in row_spans(DocTable(out, PackError), CFG.task_bytes))
    return out


def test_a_fresh_worker_encodes_its_rows_without_importing_pandas(docs, tmp_path):
    """pyarrow imports pandas on its first compute call or to_numpy: 0.17 s of
    CPU in each worker process, a tenth of the default run's pack."""
    path = small_groups(docs[0], tmp_path / "small.parquet")
    script = (
        "import sys, pyarrow as pa\n"
        "from pipeline.data import pack\n"
        "from pipeline.data.docs import DocTable, identity\n"
        f"path = {str(path)!r}\n"
        f"pack._init_worker(open({str(docs[1])!r}).read(), pa.schema([('text', pa.string())]),"
        " (path, identity(DocTable(path, pack.PackError))), 7, 1000)\n"
        "encoded = pack._encode_task(0, 40, None)\n"
        "print(len(encoded.lens), 'pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["40", "False"], out.stderr


def test_the_stage_reads_no_text_when_its_workers_read_their_rows(docs, packed, tmp_path, monkeypatch):
    """Two spawned workers read the text; the stage's own process reads only
    the columns it routes by, and packs the same bytes."""
    path = small_groups(docs[0], tmp_path / "small.parquet")
    read = []
    real = DocTable.iter_batches
    monkeypatch.setattr(DocTable, "iter_batches", lambda self, *a, **kw:
                        read.append(kw.get("columns", a[1] if len(a) > 1 else None)) or real(self, *a, **kw))
    run_pack(CFG, path, docs[1], tmp_path / "out")
    assert read and not any(c is None or "text" in c for c in read)
    out, _ = packed
    assert packed_files(tmp_path / "out") == packed_files(out)
    assert all((tmp_path / "out" / f).read_bytes() == (out / f).read_bytes() for f in packed_files(out))


def test_tasks_a_worker_cannot_read_are_encoded_by_the_stage_then_sent(docs, packed, tmp_path, monkeypatch,
                                                                        caplog):
    """As on a Ray node without the stage's storage (here one in-process worker
    told of other files than it sees): the first task comes back with the
    reason, the stage encodes it and sends the text of the rest; the same bytes,
    and one warning."""
    path, tok = small_groups(docs[0], tmp_path / "small.parquet"), docs[1]
    monkeypatch.setattr(pack, "identity", lambda table: [[str(path), 1, 2]])
    sent = []
    real = pack._encode_task
    monkeypatch.setattr(pack, "_encode_task", lambda a, b, message: sent.append(message is not None) or real(
        a, b, message))
    cfg = CFG.model_copy(update={"executor": ExecutorConfig(num_workers=1)})
    with caplog.at_level("WARNING", logger="pipeline.data.pack"):
        run_pack(cfg, path, tok, tmp_path / "out")
    assert sent[0] is False and all(sent[1:]) and len(sent) > 3
    [line] = [r.getMessage() for r in caplog.records if "does not see" in r.getMessage()]
    assert re.match(rf"1 task\(s\) went to a worker that does not see the documents as the stage does \(on \S+: "
                    rf"{re.escape(str(path))} is \d+ bytes, modified at \d+ ns here, not as the stage saw it\); "
                    r"the stage encoded them itself and sent the text of the tasks after them", line), line
    out, _ = packed
    assert packed_files(tmp_path / "out") == packed_files(out)
    assert all((tmp_path / "out" / f).read_bytes() == (out / f).read_bytes() for f in packed_files(out))


def test_adversarial_corpus_packs_as_the_reference_for_any_worker_count(docs, tmp_path):
    """Null and empty texts, a duplicate id, chunks of a file with no source,
    a chunk sequence broken by plain documents and by empty chunks, tasks of one
    document or of many: the vectorized path gives the reference's streams, and the
    same bytes with 1 or 3 workers."""
    _, tok, items = docs
    texts = [t for _, t in items if t]
    rows = [(f"a{k}", texts[k], "a.txt", k) for k in range(12)]
    rows[4] = ("a4", None, "a.txt", 4)
    rows[7] = ("a7", "", "a.txt", 7)
    rows += [(f"n{k}", texts[20 + k], None, k) for k in range(6)]  # no source: key (None, k)
    rows += [("a12", texts[30], "a.txt", 12), ("p0", texts[31], "p.txt", None), ("a13", texts[32], "a.txt", 13)]
    rows += [(f"q{i}", None if i % 5 == 0 else texts[40 + i], "q.txt", None) for i in range(40)]
    rows += [("q3", texts[99], "q.txt", None)]  # a duplicate id: same split as the first q3
    path = write_chunked(tmp_path / "adv.parquet", rows)
    for val_by in ("hash", "position"):
        cfg = CFG.model_copy(update={"val_by": val_by, "val_fraction": 0.3, "executor": ExecutorConfig(num_workers=3),
                                     "task_bytes": 1000, "batch_docs": 4})
        run_pack(cfg, path, tok, tmp_path / val_by / "3")
        one = {"executor": ExecutorConfig(num_workers=1), "task_bytes": 1_000_000, "batch_docs": 1000}
        run_pack(cfg.model_copy(update=one), path, tok, tmp_path / val_by / "1")
        a, b = tmp_path / val_by / "3", tmp_path / val_by / "1"
        files = packed_files(a)
        assert files == packed_files(b)
        assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
        streams, starts = expected_streams([r[:2] for r in rows], path, tok, cfg, keys_of(rows))
        m = read_json(a / MANIFEST)
        for name in ("train", "val"):
            split = PackedRows(a / name)
            flat = all_rows(split).reshape(-1)
            np.testing.assert_array_equal(flat, streams[name][:len(flat)])
            seg = split.segment_ids(np.arange(len(split))).reshape(-1)
            row_begins = set(range(0, len(flat), cfg.seq_len + 1))
            begins = set(np.flatnonzero(np.diff(seg, prepend=-1) != 0).tolist())  # a row's first is not seen
            assert begins - row_begins == {p for p in starts[name] if p < len(flat)} - row_begins
        assert m["splits"]["train"]["empty_docs"] + m["splits"]["val"]["empty_docs"] == sum(not r[1] for r in rows)
        assert m["splits"]["train"]["joined"] + m["splits"]["val"]["joined"] > 5


def test_position_split_scores_a_files_chunks_in_chunk_order_not_row_order(tmp_path):
    """a.txt's chunk 9 lies in the first row: it is still the file's last 100 bytes of 1000, the only chunk
    whose middle byte (950) lies in the last 10%; chunk 8's middle (850) does not."""
    text = "x" * 99 + "\n"
    rows = [("a9", text, "a.txt", 9)] + [(f"a{k}", text, "a.txt", k) for k in range(9)]
    rows += [(f"p{i}", text, "plain.txt", None) for i in range(20)]
    plan = plan_splits(pq.ParquetFile(write_chunked(tmp_path / "d.parquet", rows)), 0, 0.1, val_by="position")
    assert plan.first_val_chunk == {"a.txt": 9}
    assert plan.val_mask(0, 10).tolist() == [True] + [False] * 9


def test_a_files_first_chunk_is_not_a_continuing_one():
    """Chunk 0 starts its file's text: encoded as any text, with the BOS or dummy prefix a tokenizer adds;
    a later chunk (even after a gap) continues it; a plain document is no chunk."""
    keys = Keys.of(pa.array(["a.txt", "a.txt", "p.txt", "a.txt", "b.txt"]), pa.array([0, 1, None, 3, 0], pa.int64()))
    assert keys.continuing().tolist() == [False, True, False, True, False]
