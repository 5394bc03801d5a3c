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
