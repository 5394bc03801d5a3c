"""pack resumes a killed run: committed shards kept untouched, the rest written as
an uninterrupted run writes them, byte for byte (pipeline.data.pack.run_pack, "Resume")."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import pack
from pipeline.data.pack import CHECKPOINT, PackConfig, run_pack
from pipeline.data.docs import DocTable, row_spans
from pipeline.data.shards import MANIFEST, PackedRows, verify
from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer
from pipeline.files import read_json
from tests.pipeline.data.test_tokenizer import make_docs

ROOT = Path(__file__).resolve().parents[3]
# rows of 16 tokens, 32 rows a shard, a task every few documents: many train, val and val-source shards
CFG = dict(seq_len=15, val_fraction=0.25, seed=5, num_workers=1, shard_tokens=32 * 16, batch_docs=8,
           task_bytes=1000)
TIMINGS = ("tokens_per_s", "mb_per_s", "pack_seconds", "workers", "shards_resumed")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three sources: web and code documents, and a book cut into 40 chunks (consecutive
    chunks join into one document, across task boundaries and checkpoints)."""
    d = tmp_path_factory.mktemp("resume")
    web = [(f"w{i}", t[:300], None, None, "web") for i, (_, t) in enumerate(make_docs(60, seed=1))]
    code = [(f"c{i}", t[:150], None, None, "code") for i, (_, t) in enumerate(make_docs(30, seed=2))]
    book = [(f"b{k}", t[:300], "book.txt", k, "book") for k, (_, t) in enumerate(make_docs(40, seed=3))]
    rows = [r for trio in zip(web[:30], code, book[:30]) for r in trio] + book[30:] + web[30:]
    path = d / "docs.parquet"
    table = pa.table({
        "id": [r[0] for r in rows], "text": [r[1] for r in rows], "source": [r[2] for r in rows],
        "location": [str(i) for i in range(len(rows))], "chunk": pa.array([r[3] for r in rows], pa.int64()),
        "offset": pa.nulls(len(rows), pa.int64()), "source_name": [r[4] for r in rows],
        "split": pa.nulls(len(rows), pa.string())})
    # row groups of 4 documents (a task that a worker reads), and rows 48-87 in one group of more than
    # docs.BIG_GROUP tasks' text, which the stage reads and sends in runs of task_bytes
    with pq.ParquetWriter(path, table.schema) as w:
        for a, b in [(a, a + 4) for a in range(0, 48, 4)] + [(48, 88)] + [(a, a + 4) for a in range(88, 130, 4)]:
            w.write_table(table.slice(a, b - a))
    spans = row_spans(DocTable(path, pack.PackError), CFG["task_bytes"])
    assert [s.by_worker for s in spans].count(False) == 1 and len(spans) > 20
    tok = d / "tokenizer.json"
    train_tokenizer(TokenizerConfig(vocab_size=300, sample_bytes=20_000, eval_bytes=2_000), path, tok)
    ref = d / "ref"
    metrics = run_pack(PackConfig(**CFG), path, tok, ref)
    return path, tok, ref, metrics


def files(d):
    """Every file under ``d``: shards, records, checkpoints, manifest (not the
    finished run's record, whose metrics hold its timings)."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != pack.COMPLETE}


def stamps(d):
    """(inode, mtime) of every shard: a shard rewritten, even with the same bytes, changes them."""
    return {p.relative_to(d).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.rglob("*.arrow")}


def same_metrics(a, b):
    return {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}


class Killed(BaseException):
    """Stands for a kill: not an error of the data, so the committed shards stay."""


def interrupt_at_flush(monkeypatch, n):
    """Raise Killed at the n-th shard any split writes (before it is written)."""
    calls = {"n": 0}
    flush = pack.SplitWriter._flush

    def dying(self):
        if self.fill >= self.row_len:
            calls["n"] += 1
            if calls["n"] == n:
                raise Killed(f"killed before shard {n}")
        flush(self)

    monkeypatch.setattr(pack.SplitWriter, "_flush", dying)


def test_the_corpus_exercises_what_resume_must_carry(corpus):
    path, tok, ref, metrics = corpus
    m = read_json(ref / MANIFEST)
    assert len(m["splits"]["train"]["shards"]) >= 6 and len(m["splits"]["val"]["shards"]) >= 3
    assert set(m["val_sources"]) == {"web", "code", "book"}
    assert m["splits"]["train"]["joined"] >= 5 and m["splits"]["val"]["joined"] > 0
    assert metrics["shards"] == sum(len(s["shards"]) for s in m["splits"].values())
    assert len(list(ref.glob(f"{CHECKPOINT}-*.json"))) >= 5
    verify(ref, pack.FORMAT)


@pytest.mark.parametrize("at", [3, 20, 40])
def test_a_run_interrupted_after_some_shards_resumes_to_the_same_bytes(corpus, tmp_path, monkeypatch, caplog, at):
    path, tok, ref, metrics = corpus
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_at_flush(m, at)
        with pytest.raises(Killed):
            run_pack(PackConfig(**CFG), path, tok, out)
    assert not (out / MANIFEST).exists()
    before = stamps(out)
    with caplog.at_level(logging.INFO, logger="pipeline.data.pack"):
        resumed = run_pack(PackConfig(**CFG), path, tok, out)
    assert files(out) == files(ref)  # shards, records, checkpoints and manifest
    assert same_metrics(resumed, metrics) and resumed["shards"] == metrics["shards"]
    kept = {k: v for k, v in stamps(out).items() if before.get(k) == v}
    assert 0 < resumed["shards_resumed"] == len(kept) < at  # shards after the last checkpoint are redone
    assert f"resumed: {len(kept)} of {metrics['shards']} shards kept from an earlier run" in caplog.text
    verify(out, pack.FORMAT)
    assert len(PackedRows(out / "train")) == metrics["train_rows"]


def test_a_rerun_of_a_finished_output_keeps_every_shard(corpus, tmp_path, caplog):
    """Same params, input and code on a finished output (dvc repro --force, or a
    kill after the manifest was written): nothing is redone, nothing rewritten."""
    path, tok, ref, metrics = corpus
    out = tmp_path / "out"
    first = run_pack(PackConfig(**CFG), path, tok, out)
    before, kept = stamps(out), files(out)
    with caplog.at_level(logging.INFO, logger="pipeline.data.pack"):
        again = run_pack(PackConfig(**{**CFG, "num_workers": 2}), path, tok, out)  # not in the fingerprint
    assert stamps(out) == before and files(out) == kept == files(ref)
    assert same_metrics(again, first) and again["shards_resumed"] == first["shards"] and again["workers"] == 0
    assert f"is the finished output of these params, input and code: all {first['shards']} shards kept" in caplog.text


@pytest.mark.parametrize("damage", ["shard", "manifest", "record"])
def test_a_finished_output_that_changed_is_resumed_as_after_a_kill(corpus, tmp_path, damage):
    path, tok, ref, metrics = corpus
    out = tmp_path / "out"
    run_pack(PackConfig(**CFG), path, tok, out)
    target = {"shard": out / "val" / "shard-00000.arrow", "manifest": out / MANIFEST, "record": out / pack.COMPLETE}
    with open(target[damage], "r+b") as f:
        f.seek(20)
        f.write(b"!")
    again = run_pack(PackConfig(**CFG), path, tok, out)
    assert files(out) == files(ref) and same_metrics(again, metrics)
    assert again["shards_resumed"] < metrics["shards"]


def test_checkpoints_carry_open_documents_and_joins(corpus):
    """The checkpoints the resume tests restore do cut a document and a chunk run:
    a writer with buffered tokens, an open document, and a chunk key in ``last``."""
    _, _, ref, _ = corpus
    states = [w for p in sorted(ref.glob(f"{CHECKPOINT}-*.json")) for w in read_json(p)["writers"].values()]
    assert any(w["fill"] and w["open"] for w in states)
    assert any(w["last"] is not None and w["last"][0] == "book.txt" for w in states)
    assert any(w["base"] < int(p.stem.split("-")[1]) for p in ref.glob(f"{CHECKPOINT}-*.json")
               for w in read_json(p)["writers"].values())  # a buffer kept across checkpoints, in pieces


def test_a_param_change_removes_the_old_shards_as_stale(corpus, tmp_path, monkeypatch, caplog):
    path, tok, _, _ = corpus
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_at_flush(m, 8)
        with pytest.raises(Killed):
            run_pack(PackConfig(**CFG), path, tok, out)
    other = PackConfig(**{**CFG, "seed": 6})
    with caplog.at_level(logging.WARNING):
        metrics = run_pack(other, path, tok, out)
    assert metrics["shards_resumed"] == 0
    assert "made under another fingerprint" in caplog.text
    run_pack(other, path, tok, tmp_path / "fresh")
    assert files(out) == files(tmp_path / "fresh")


def test_a_damaged_shard_falls_back_to_the_last_checkpoint_before_it(corpus, tmp_path, caplog):
    path, tok, ref, metrics = corpus
    out = tmp_path / "out"
    for rel, data in files(ref).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    damaged, unrecorded = out / "train" / "shard-00004.arrow", out / "val" / "shard-00002.json"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")
    unrecorded.unlink()
    checkpoints = [read_json(p)["writers"] for p in sorted(ref.glob(f"{CHECKPOINT}-*.json"))]
    fallback = [w for w in checkpoints if w["train"]["shards"] <= 4 and w["val"]["shards"] <= 2][-1]
    assert fallback != checkpoints[-1]
    before = stamps(out)
    with caplog.at_level(logging.WARNING):
        resumed = run_pack(PackConfig(**CFG), path, tok, out)
    assert "sha256 does not match its record: shard-00004.arrow, shard-00004.json" in caplog.text
    assert "as `dvc exp run --temp` and `dvc checkout` make; it is written again): shard-00002.arrow" in caplog.text
    assert files(out) == files(ref)
    assert resumed["shards_resumed"] == sum(w["shards"] for w in fallback.values())
    kept = {k for k, v in stamps(out).items() if before.get(k) == v}
    assert kept == {f"{n}/shard-{k:05d}.arrow" for n, w in fallback.items() for k in range(w["shards"])}


def test_a_damaged_sidecar_falls_back_to_an_earlier_checkpoint(corpus, tmp_path):
    path, tok, ref, metrics = corpus
    out = tmp_path / "out"
    for rel, data in files(ref).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    records = [read_json(p) for p in sorted(ref.glob(f"{CHECKPOINT}-*.json"))]
    # a sidecar in the middle of the last checkpoint's chain: every later checkpoint needs it
    j = (min(w["base"] for w in records[-1]["writers"].values()) + len(records)) // 2
    assert 0 < j < len(records) - 1
    damaged = out / f"{CHECKPOINT}-{j:05d}.npz"
    damaged.write_bytes(damaged.read_bytes() + b"\x00")
    resumed = run_pack(PackConfig(**CFG), path, tok, out)
    assert files(out) == files(ref)
    assert resumed["shards_resumed"] == sum(w["shards"] for w in records[j - 1]["writers"].values()) > 0


@pytest.fixture(scope="module")
def mixed(corpus, tmp_path_factory):
    path, tok, _, _ = corpus
    cfg = PackConfig(**CFG, mixture={"web": {"weight": 1}, "code": {"weight": 2}, "book": {"weight": 1}})
    ref = tmp_path_factory.mktemp("mixture") / "ref"
    return cfg, ref, run_pack(cfg, path, tok, ref)


@pytest.mark.parametrize("phase", ["stream", "realise"])
def test_a_mixture_run_resumes_to_the_same_bytes(corpus, mixed, tmp_path, monkeypatch, phase):
    """Killed while the train documents are encoded (val shards written, the train
    documents kept in pieces), or while the mixture writes the train split."""
    path, tok, _, _ = corpus
    cfg, ref, metrics = mixed
    at = 4 if phase == "stream" else metrics["shards"] - 3
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_at_flush(m, at)
        with pytest.raises(Killed):
            run_pack(cfg, path, tok, out)
    assert list((out / pack.MIX_DIR).glob("piece-*.json")), "the train documents were kept in committed pieces"
    if phase == "realise":
        assert read_json(sorted(out.glob(f"{CHECKPOINT}-*.json"))[-1])["mixture"]["round"] >= 1
    before = stamps(out)
    resumed = run_pack(cfg, path, tok, out)
    assert files(out) == files(ref)
    assert same_metrics(resumed, metrics)
    kept = {k for k, v in stamps(out).items() if before.get(k) == v}
    assert 0 < resumed["shards_resumed"] == len(kept) < at
    if phase == "realise":
        assert any(k.startswith("train/") for k in kept)
    assert not (out / pack.MIX_DIR).exists()


def test_the_sidecar_is_read_without_pickle(corpus):
    _, _, ref, _ = corpus
    with np.load(sorted(ref.glob(f"{CHECKPOINT}-*.npz"))[-1], allow_pickle=False) as z:
        assert z["train/tokens"].dtype == np.int32 and z["train/starts"].dtype == np.int64


# --- SIGKILL on the whole process group ----------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import sys, time
    from tests.pipeline.data.ray_tasks import ray_only
    from pipeline.data import pack
    from pipeline.data.pack import PackConfig, run_pack

    save = pack.Checkpoints.save

    def slow_save(self, *a, **k):  # time to be killed between checkpoints; the bytes are the same
        save(self, *a, **k)
        time.sleep(0.25)

    pack.Checkpoints.save = slow_save
    if __name__ == "__main__":
        cfg = PackConfig.model_validate_json(sys.argv[1])
        if cfg.executor.kind == "ray":
            ray_only(sys.argv[4] + ".ray-connected")
        run_pack(cfg, sys.argv[2], sys.argv[3], sys.argv[4])
""")


def group_alive(pgid):
    """Processes of the stage's group, or of its session (Ray's workers make groups of
    their own), that still run (zombies waiting to be reaped do not)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue
        if pgid in (int(fields[2]), int(fields[3])) and fields[0] != "Z":
            alive.append(stat.parent.name)
    return alive


def kill_and_resume(corpus, tmp_path, executor):
    path, tok, ref, metrics = corpus
    cfg = PackConfig(**{**CFG, "num_workers": None}, executor=executor)
    out = tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, str(script), cfg.model_dump_json(), str(path), str(tok), str(out)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.time()
    while not len(list(out.glob(f"{CHECKPOINT}-*.json"))) >= 2:
        if proc.poll() is not None or time.time() - t0 > 120:
            proc.kill()
            pytest.fail(f"the stage ended (or hung) before its second checkpoint: {proc.stderr.read()[-2000:]!r}")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / MANIFEST).exists(), "the kill came too late: the stage had finished"
    assert list(out.rglob("shard-*.json")), "the kill came too early: no shard committed"
    if executor["kind"] == "ray":  # the committed shards came from Ray tasks
        assert Path(f"{out}.ray-connected").exists()
    t0 = time.time()
    while group_alive(proc.pid) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not group_alive(proc.pid), "a process of the killed stage is still running"
    before = stamps(out)
    resumed = run_pack(cfg, path, tok, out)  # under the same executor
    assert files(out) == files(ref)
    assert same_metrics(resumed, metrics)
    assert 0 < resumed["shards_resumed"] == sum(before.get(k) == v for k, v in stamps(out).items())


def test_sigkill_on_the_process_group_with_two_local_workers_then_rerun(corpus, tmp_path):
    kill_and_resume(corpus, tmp_path, {"kind": "local", "num_workers": 2})


@pytest.mark.slow
def test_sigkill_on_the_process_group_under_ray_then_rerun(corpus, tmp_path):
    pytest.importorskip("ray")
    kill_and_resume(corpus, tmp_path, {"kind": "ray", "num_workers": 2})


def test_the_fingerprint_moves_with_the_documents_the_tokenizer_and_its_roles(tmp_path):
    """Shards packed with another tokenizer (or other special-token roles: another EOT id) are stale."""
    docs, tok_dir = tmp_path / "docs.parquet", tmp_path / "tok"
    tok_dir.mkdir()
    tok = tok_dir / "tokenizer.json"
    docs.write_bytes(b"docs")
    tok.write_text('{"model": 1}')
    cfg = PackConfig(**CFG)
    keys = [(pack.pack_fingerprint(cfg, docs, tok), pack.streams_key(cfg, docs, tok))]
    for change in (lambda: tok.write_text('{"model": 2}'),
                   lambda: (tok_dir / "specials.json").write_text('{"eot_id": 0}'),
                   lambda: (tok_dir / "specials.json").write_text('{"eot_id": 1}'),
                   lambda: docs.write_bytes(b"other docs")):
        change()
        keys.append((pack.pack_fingerprint(cfg, docs, tok), pack.streams_key(cfg, docs, tok)))
    assert len({fp for fp, _ in keys}) == len({s for _, s in keys}) == 5


def test_a_finished_output_whose_manifest_was_rewritten_is_not_taken_as_finished(corpus, tmp_path):
    """A manifest edited into other valid JSON still lists the shards as they are (verify passes), but it
    is not the one the run wrote: the rerun writes it again."""
    import json

    path, tok, ref, metrics = corpus
    out = tmp_path / "out"
    run_pack(PackConfig(**CFG), path, tok, out)
    manifest = read_json(out / MANIFEST)
    manifest["docs"] += 1
    (out / MANIFEST).write_text(json.dumps(manifest))
    verify(out)
    again = run_pack(PackConfig(**CFG), path, tok, out)
    assert files(out) == files(ref) and same_metrics(again, metrics) and again["workers"] > 0


@pytest.mark.parametrize("module", ["pack", "mixture", "shares", "shards", "docs", "tokenizer"])
def test_the_fingerprint_moves_with_the_code_of_each_module_that_makes_the_rows(tmp_path, monkeypatch, module):
    docs, tok = tmp_path / "docs.parquet", tmp_path / "tokenizer.json"
    docs.write_bytes(b"docs")
    tok.write_text("{}")
    cfg = PackConfig(**CFG)
    before = pack.pack_fingerprint(cfg, docs, tok)
    mod = pack if module == "pack" else getattr(pack, f"{module}_module")
    edited = tmp_path / os.path.basename(mod.__file__)
    with open(mod.__file__) as f:
        edited.write_text(f.read() + "\n# edited\n")
    monkeypatch.setattr(mod, "__file__", str(edited))
    assert pack.pack_fingerprint(cfg, docs, tok) != before
