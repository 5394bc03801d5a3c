import json
import time

from bench import pack_resume
from pipeline.data import pack


def test_cpu_seconds_cover_the_run_alone(monkeypatch, capsys):
    """main_cpu_s is the CPU of the pack run, like wall_s: not what the process
    spent before it (here: the whole test session's)."""
    monkeypatch.setattr(pack, "run_pack", lambda cfg, corpus, tokenizer, out: {"shards": 3})
    before = time.process_time()
    pack_resume._child("on", "corpus.parquet", "tokenizer.json", "out", 1 << 18, 2)
    spent = time.process_time() - before
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["shards"] == 3
    assert 0 <= result["main_cpu_s"] <= spent


def test_the_digest_covers_the_shards_and_nothing_else(tmp_path):
    for split, k, data in (("train", 0, b"a"), ("train", 1, b"b"), ("val", 0, b"c")):
        (tmp_path / split).mkdir(exist_ok=True)
        (tmp_path / split / f"shard-{k:05d}.arrow").write_bytes(data)
    before = pack_resume.shards_digest(tmp_path)
    (tmp_path / "train" / "shard-00000.json").write_text("{}")  # a record: "on" only
    (tmp_path / "checkpoint-00000.npz").write_bytes(b"x")
    assert pack_resume.shards_digest(tmp_path) == before
    (tmp_path / "val" / "shard-00000.arrow").write_bytes(b"C")
    assert pack_resume.shards_digest(tmp_path) != before
    (tmp_path / "val" / "shard-00000.arrow").write_bytes(b"c")
    (tmp_path / "val" / "shard-00000.arrow").rename(tmp_path / "val" / "shard-00001.arrow")
    assert pack_resume.shards_digest(tmp_path) != before  # the same bytes under another name


def test_the_bench_stops_when_on_and_off_write_different_shards():
    import pytest

    run = {"shards_sha256": "a"}
    results = {("long", "default", "off"): [run, run], ("long", "default", "on"): [run, run],
               ("short", "256Ki", "off"): [run, run], ("short", "256Ki", "on"): [run, {"shards_sha256": "b"}]}
    with pytest.raises(SystemExit, match="short documents, shard_tokens 256Ki: the runs wrote different shards"):
        pack_resume.same_shards(results)
    results["short", "256Ki", "on"][1] = run
    pack_resume.same_shards(results)
