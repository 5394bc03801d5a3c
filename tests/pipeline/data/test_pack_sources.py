"""pack with several named sources: split marks, each source's own val split, and mixtures."""

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import pack as pack_module
from pipeline.data.mixture import MixtureError, Share
from pipeline.data.pack import PackConfig, PackError, plan_splits, run_pack
from pipeline.data.shards import MANIFEST, PackedRows, val_sources, verify
from pipeline.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer
from pipeline.files import read_json
from tests.pipeline.data.test_tokenizer import make_docs

CFG = dict(seq_len=15, val_fraction=0.2, seed=3, num_workers=1, shard_tokens=20 * 16, batch_docs=16,
           task_bytes=1_500)


def write_sourced(path, rows):
    """rows: (id, text, source_name, split mark or None)."""
    pq.write_table(pa.table({
        "id": [r[0] for r in rows], "text": [r[1] for r in rows], "source": [r[2] for r in rows],
        "location": [str(i) for i in range(len(rows))], "chunk": pa.nulls(len(rows), pa.int64()),
        "offset": pa.nulls(len(rows), pa.int64()), "source_name": [r[2] for r in rows],
        "split": pa.array([r[3] for r in rows], pa.string())}), path, row_group_size=40)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """web: 150 documents; code: 60 shorter ones; bench: 20 marked split: val."""
    d = tmp_path_factory.mktemp("sources")
    web = [(f"w{i}", t, "web", None) for i, (_, t) in enumerate(make_docs(150, seed=1))]
    code = [(f"c{i}", t[: len(t) // 2], "code", None) for i, (_, t) in enumerate(make_docs(60, seed=2))]
    bench = [(f"b{i}", t, "bench", "val") for i, (_, t) in enumerate(make_docs(20, seed=3))]
    rows = [r for trio in zip(web[:60], code, web[60:120]) for r in trio] + web[120:] + bench
    path = write_sourced(d / "docs.parquet", rows)
    tok = d / "tokenizer.json"
    train_tokenizer(TokenizerConfig(vocab_size=300, sample_bytes=20_000, eval_bytes=2_000), path, tok)
    return path, tok, rows


def test_marked_documents_go_where_they_are_marked(corpus, tmp_path):
    path, tok, rows = corpus
    marked = [(i, r) for i, r in enumerate(rows)]
    rows[3] = (rows[3][0], rows[3][1], rows[3][2], "train")
    path = write_sourced(tmp_path / "docs.parquet", rows)
    plan = plan_splits(pq.ParquetFile(path), 3, 0.2)
    val = plan.val_mask(0, len(rows))
    for i, (doc_id, _, _, mark) in marked:
        assert val[i] == (plan.split_of(doc_id, mark=rows[i][3]) == "val")
    assert all(val[i] for i, r in enumerate(rows) if r[3] == "val")
    assert not val[3]
    assert 0 < val[[i for i, r in enumerate(rows) if r[3] is None]].sum() < len(rows) - 21
    assert plan.marked == {"train": 1, "val": 20}
    assert plan.sources == ("web", "code", "bench")


def test_marks_that_leave_a_split_empty_are_errors(corpus, tmp_path):
    _, tok, rows = corpus
    only_val = write_sourced(tmp_path / "v.parquet", [(r[0], r[1], r[2], "val") for r in rows[:10]])
    with pytest.raises(PackError, match="every document is marked split: val, so train would be empty"):
        plan_splits(pq.ParquetFile(only_val), 0, 0.1)
    only_train = write_sourced(tmp_path / "t.parquet", [(r[0], r[1], r[2], "train") for r in rows[:10]])
    with pytest.raises(PackError, match="every document is marked split: train, so val would be empty"):
        plan_splits(pq.ParquetFile(only_train), 0, 0.1)
    # one unmarked document beside marked val ones is trained on, however it hashes
    rows = [(r[0], r[1], r[2], "val") for r in rows[:5]] + [rows[6][:3] + (None,)]
    mixed = write_sourced(tmp_path / "m.parquet", rows)
    assert plan_splits(pq.ParquetFile(mixed), 0, 0.5).val_mask(0, 6).tolist() == [True] * 5 + [False]


def test_a_document_without_a_source_name_is_an_error(corpus, tmp_path):
    _, _, rows = corpus
    path = write_sourced(tmp_path / "d.parquet", rows[:5] + [(rows[5][0], rows[5][1], None, None)])
    with pytest.raises(PackError, match=r"1 document\(s\) in rows 0-5 have no source_name"):
        plan_splits(pq.ParquetFile(path), 0, 0.2)


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory):
    path, tok, _ = corpus
    out = tmp_path_factory.mktemp("packed")
    return out, run_pack(PackConfig(**CFG), path, tok, out)


def test_each_source_gets_its_own_val_split(corpus, packed):
    path, tok, rows = corpus
    out, metrics = packed
    manifest = verify(out)  # the per-source splits are listed with their digests
    dirs = val_sources(out)
    assert set(dirs) == {"web", "code", "bench"}
    plan = plan_splits(pq.ParquetFile(path), CFG["seed"], CFG["val_fraction"])
    val = plan.val_mask(0, len(rows))
    t = load_tokenizer(tok)
    for name, d in dirs.items():
        mine = [r[1] for r, v in zip(rows, val) if v and r[2] == name]
        info = manifest["splits"][d.name]
        assert info["docs"] == len(mine) == manifest["sources"][name]["val_docs"]
        stream = [x for text in mine for x in t.encode(text).ids + [manifest["eot_id"]]]
        assert info["tokens"] == len(stream)
        got = PackedRows(d).input_ids(np.arange(info["rows"])).reshape(-1)
        assert got.tolist() == stream[:len(got)]
    assert manifest["splits"]["val"]["docs"] == sum(manifest["splits"][d.name]["docs"] for d in dirs.values())
    assert manifest["sources"]["bench"]["train_docs"] == 0 and manifest["marked"] == {"val": 20}
    assert set(metrics["sources"]) == {"web", "code", "bench"}
    assert metrics["sources"]["bench"]["share"] == 0


def test_one_unmarked_source_writes_the_manifest_as_before(corpus, tmp_path):
    path, tok, rows = corpus
    one = write_sourced(tmp_path / "one.parquet", [(r[0], r[1], "web", None) for r in rows])
    run_pack(PackConfig(**CFG), one, tok, tmp_path / "a")
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(one).drop_columns(["source_name", "split"]), plain)
    run_pack(PackConfig(**CFG), plain, tok, tmp_path / "b")
    a, b = read_json(tmp_path / "a" / MANIFEST), read_json(tmp_path / "b" / MANIFEST)
    assert a == b and "sources" not in a and val_sources(tmp_path / "a") == {}


@pytest.mark.parametrize("mixture", [
    {"web": {"weight": 0.5}, "code": {"weight": 0.5}},          # code upsampled, web downsampled
    {"web": {"weight": 0.9}, "code": {"weight": 0.1}},
    {"web": {"tokens": 3000}, "code": {"weight": 1.0}},
])
def test_mixture_shares_are_realised(corpus, packed, tmp_path, mixture, caplog):
    path, tok, _ = corpus
    natural = read_json(packed[0] / MANIFEST)["sources"]
    cfg = PackConfig(**CFG, mixture=mixture)
    with caplog.at_level(logging.WARNING):
        metrics = run_pack(cfg, path, tok, tmp_path / "mix")
    manifest = verify(tmp_path / "mix")
    src = manifest["sources"]
    for name, share in mixture.items():
        target = src[name]["target_tokens"]
        assert abs(src[name]["train_tokens"] - target) <= 60  # within the shortest document left out
        if "weight" in share:
            want = share["weight"] / sum(s.get("weight", 0) for s in mixture.values())
            assert src[name]["requested_share"] == pytest.approx(
                want * (1 - 3000 / sum(x["target_tokens"] for x in src.values() if "target_tokens" in x))
                if "tokens" in str(mixture) else want, abs=1e-4)
        assert abs(src[name]["share"] - src[name]["requested_share"]) < 0.01
        assert src[name]["available_tokens"] == natural[name]["train_tokens"]
    assert metrics["sources"]["web"]["share"] == src["web"]["share"]
    # every document is accounted for: copies written, or dropped by the mixture
    train = manifest["splits"]["train"]
    assert train["docs"] == sum(src[n]["copies"] for n in mixture)
    assert all(src[n]["train_docs"] == natural[n]["train_docs"] for n in mixture)
    assert (src["web"]["dropped_docs"] > 0) == (src["web"]["target_tokens"] < src["web"]["available_tokens"])
    assert train["tokens"] == sum(src[n]["train_tokens"] for n in mixture) + train["docs"] - train["joined"]
    assert manifest["splits"]["val"] == read_json(packed[0] / MANIFEST)["splits"]["val"]  # val is never resampled
    assert not (tmp_path / "mix" / ".mixture.arrow").exists()


def test_a_killed_mixture_runs_leftover_is_removed_by_the_next_run(corpus, tmp_path):
    path, tok, _ = corpus
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".mixture.arrow").write_bytes(b"left by a SIGKILL")
    run_pack(PackConfig(**CFG), path, tok, tmp_path / "out")
    assert not (tmp_path / "out" / ".mixture.arrow").exists()


def test_mixture_is_deterministic_and_follows_the_seed(corpus, tmp_path):
    path, tok, _ = corpus
    mix = {"web": {"weight": 1}, "code": {"weight": 1}}
    run_pack(PackConfig(**CFG, mixture=mix), path, tok, tmp_path / "a")
    run_pack(PackConfig(**{**CFG, "num_workers": 2, "task_bytes": 1_000}, mixture=mix), path, tok, tmp_path / "b")
    run_pack(PackConfig(**{**CFG, "seed": 4}, mixture=mix), path, tok, tmp_path / "c")
    a, b, c = (read_json(tmp_path / x / MANIFEST)["splits"]["train"]["shards"] for x in "abc")
    assert [s["sha256"] for s in a] == [s["sha256"] for s in b]
    assert [s["sha256"] for s in a] != [s["sha256"] for s in c]


def test_a_source_repeated_too_often_is_a_warning_with_the_figures(corpus, tmp_path, caplog):
    path, tok, _ = corpus
    with caplog.at_level(logging.WARNING, logger="pipeline.data.pack"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}, "code": {"weight": 9}}, max_repeats=2), path, tok,
                 tmp_path / "out")
    [line] = [r.getMessage() for r in caplog.records if "max_repeats" in r.getMessage()]
    assert line.startswith("source 'code' has ") and "more than pack.max_repeats=2" in line


def test_a_source_the_mixture_takes_nothing_of_is_a_warning_with_the_figures(corpus, tmp_path, caplog):
    """A weight so small that the source's target is below its shortest document:
    none of it is trained on, which is said, not left to the metrics."""
    path, tok, _ = corpus
    with caplog.at_level(logging.WARNING, logger="pipeline.data.pack"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}, "code": {"weight": 1e-6}}), path, tok,
                 tmp_path / "out")
    src = read_json(tmp_path / "out" / MANIFEST)["sources"]["code"]
    assert src["train_tokens"] == 0 and src["target_tokens"] == 0 and src["dropped_docs"] == src["train_docs"]
    [line] = [r.getMessage() for r in caplog.records if "none of its documents" in r.getMessage()]
    assert line.startswith("source 'code': the mixture asks for 0 train tokens, fewer than its shortest document (")
    assert line.endswith(" tokens), so none of its documents is trained on; raise its weight or tokens")


def test_a_listed_source_the_hash_split_sends_wholly_to_val_is_one_line_that_says_so(corpus, tmp_path):
    """A source of one document that the hash puts in val has no train tokens:
    the mixture can neither weigh it nor leave it out (it is not marked split:
    val), and the error said it was split: val, dropped by clean or never read."""
    from pipeline.data.pack import split_hash, val_threshold

    path, tok, rows = corpus
    tiny = next(f"t{i}" for i in range(1000) if split_hash(CFG["seed"], f"t{i}") < val_threshold(CFG["val_fraction"]))
    alone = write_sourced(tmp_path / "docs.parquet", [r for r in rows if r[2] == "web"]
                          + [(tiny, rows[0][1], "tiny", None)])
    with pytest.raises(MixtureError, match=r"^pack.mixture lists source\(s\) \['tiny'\], but none of their documents "
                                           r"went to train: the split sent all of them to val \(tiny: 1 document\(s\); "
                                           r"pack.val_fraction=0.2, pack.seed=3\); mark such a source split: train"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}, "tiny": {"weight": 1}}), alone, tok,
                 tmp_path / "out")


def test_mixture_errors(corpus, tmp_path, monkeypatch):
    path, tok, rows = corpus
    calls = []
    encode = pack_module._encode_task
    monkeypatch.setattr(pack_module, "_encode_task", lambda *a: calls.append(1) or encode(*a))
    run_pack(PackConfig(**CFG), path, tok, tmp_path / "ok")
    tasks, calls[:] = len(calls), []
    with pytest.raises(MixtureError, match=r"no entry for source\(s\) \['code'\]"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}}), path, tok, tmp_path / "out")
    assert tasks > 10 and len(calls) <= 2, "the mixture's names are checked before the corpus is encoded"
    before = {p: p.read_bytes() for p in (tmp_path / "ok").rglob("*") if p.is_file()}
    with pytest.raises(MixtureError, match=r"no entry for source\(s\) \['code'\]"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}}), path, tok, tmp_path / "ok")
    assert {p: p.read_bytes() for p in (tmp_path / "ok").rglob("*") if p.is_file()} == before, \
        "a mixture refused leaves the earlier output as it was"
    with pytest.raises(MixtureError, match=r"names source\(s\) \['bench'\] that have no train documents"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}, "code": {"weight": 1}, "bench": {"weight": 1}}),
                 path, tok, tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST).exists() and not (tmp_path / "out" / ".mixture.arrow").exists()
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["source_name"]), plain)
    with pytest.raises(PackError, match="no source_name column"):
        run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}}), plain, tok, tmp_path / "out")
    assert PackConfig(**CFG, mixture={"web": {"weight": 1}}).mixture == {"web": Share(weight=1)}


def test_writing_a_mixture_has_its_own_progress_bar_in_tokens(corpus, tmp_path, monkeypatch):
    import contextlib

    class Bar:
        def __init__(self, total, desc, **_):
            self.total, self.desc, self.n = total, desc, 0

        def update(self, n):
            self.n += n

    bars = []
    monkeypatch.setattr(pack_module, "progress",
                        lambda **kw: contextlib.nullcontext(bars.append(Bar(**kw)) or bars[-1]))
    path, tok, _ = corpus
    metrics = run_pack(PackConfig(**CFG, mixture={"web": {"weight": 1}, "code": {"weight": 3}}), path, tok,
                       tmp_path / "out")
    [bar] = [b for b in bars if b.desc == "pack mixture"]
    assert bar.n == bar.total == sum(s["train_tokens"] for s in metrics["sources"].values()) > 0


def test_the_tiny_corpus_rule_moves_the_unmarked_rows_of_an_id_and_leaves_its_marked_rows(tmp_path):
    """Seed 0, val_fraction 0.01: "a" and "b" both hash into train, "b" the lower (h = 7900857904463132815 <
    15000076009323008316), so "b" is moved to val; seed 4, 0.5: both hash into val, "a" the higher
    (2496144048330497281 > 316770774436082721), so "a" is moved to train. A row of that id marked in ingest
    stays where it is marked."""
    for seed, f, moved, mark, want in ((0, 0.01, "b", "train", [False, True, False]),
                                       (4, 0.5, "a", "val", [False, True, True])):
        rows = [("a", "x", "web", None), ("b", "y", "web", None), (moved, "z", "web", mark)]
        plan = plan_splits(pq.ParquetFile(write_sourced(tmp_path / f"{seed}.parquet", rows)), seed, f)
        assert plan.forced == {moved: "val" if mark == "train" else "train"}
        assert plan.val_mask(0, 3).tolist() == want, seed


def test_per_source_figures_are_each_sources_documents_and_tokens_per_split(corpus, packed):
    """Documents and document tokens (EOTs not counted) per source and split, and the share of the train
    tokens, against a count one document at a time."""
    path, tok, rows = corpus
    out, metrics = packed
    val = plan_splits(pq.ParquetFile(path), CFG["seed"], CFG["val_fraction"]).val_mask(0, len(rows))
    t = load_tokenizer(tok)
    want = {name: {"train_docs": 0, "train_tokens": 0, "val_docs": 0, "val_tokens": 0}
            for name in ("web", "code", "bench")}
    for (_, text, name, _), v in zip(rows, val):
        split = "val" if v else "train"
        want[name][f"{split}_docs"] += 1
        want[name][f"{split}_tokens"] += len(t.encode(text).ids)
    train_total = sum(w["train_tokens"] for w in want.values())
    for w in want.values():
        w["share"] = round(w["train_tokens"] / train_total, 6)
    assert read_json(out / MANIFEST)["sources"] == want
    assert want["bench"]["val_tokens"] > 0 and 0 < want["code"]["share"] < want["web"]["share"]
    assert metrics["sources"] == {n: {k: w[k] for k in ("train_tokens", "val_tokens", "share")}
                                  for n, w in want.items()}


def test_a_source_whose_val_fills_no_row_gets_no_val_split_of_its_own(corpus, tmp_path, caplog):
    path, tok, rows = corpus
    web = [r for r in rows if r[2] == "web"]
    small = write_sourced(tmp_path / "d.parquet", web + [("t0", "x", "tiny", "val")])
    with caplog.at_level(logging.WARNING, logger="pipeline.data.pack"):
        run_pack(PackConfig(**CFG), small, tok, tmp_path / "out")
    manifest = verify(tmp_path / "out")
    assert manifest["val_sources"] == {"web": "val-source-00"}
    assert "val-source-01" not in manifest["splits"] and val_sources(tmp_path / "out") == {
        "web": tmp_path / "out" / "val-source-00"}
    n = len(load_tokenizer(tok).encode("x").ids) + 1
    assert f"source 'tiny': its 1 val document(s) give {n} tokens, less than one row; it gets no score of its own" \
        in caplog.text


def test_one_source_with_marked_documents_lists_the_marks_and_the_source(corpus, tmp_path):
    path, tok, rows = corpus
    web = [r for r in rows if r[2] == "web"][:60]
    web[:3] = [r[:3] + ("val",) for r in web[:3]]
    run_pack(PackConfig(**CFG), write_sourced(tmp_path / "d.parquet", web), tok, tmp_path / "out")
    manifest = read_json(tmp_path / "out" / MANIFEST)
    assert manifest["marked"] == {"val": 3} and list(manifest["sources"]) == ["web"]
    assert manifest["sources"]["web"]["share"] == 1.0 and manifest["val_sources"] == {}


def test_the_seed_chooses_which_documents_a_mixture_copies_and_drops(corpus, tmp_path):
    """Every document marked in ingest: the split does not depend on the seed, so only the mixture's own
    order (which web documents are dropped, which code documents copied once more) can tell two seeds apart."""
    path, tok, rows = corpus
    marked = write_sourced(tmp_path / "d.parquet", [r[:3] + (r[3] or "train",) for r in rows])
    mix = {"web": {"weight": 0.5}, "code": {"weight": 0.5}}
    for seed in (3, 4):
        run_pack(PackConfig(**{**CFG, "seed": seed}, mixture=mix), marked, tok, tmp_path / str(seed))
    a, b = (read_json(tmp_path / str(seed) / MANIFEST) for seed in (3, 4))
    assert a["splits"]["val"] == b["splits"]["val"] and a["marked"] == {"train": 210, "val": 20}
    digests = [[s["sha256"] for s in m["splits"]["train"]["shards"]] for m in (a, b)]
    assert digests[0] != digests[1]
