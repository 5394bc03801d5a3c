"""pipeline.data.accounting: a ledger split by shard merges back to the ledger of the whole."""

from __future__ import annotations

import json

from pipeline.data.accounting import Ledger


def test_shard_ledgers_through_json_merge_to_the_whole():
    events = [("short", f"f{i % 3}", str(i)) for i in range(7)] + [("bad_utf8", "g", "x")] * 4
    whole = Ledger(per_reason=3)
    for e in events:
        whole.record(*e, text="t" * 5)
    merged = Ledger(per_reason=3)
    for a in range(0, len(events), 4):  # shards of four events, each through its record's JSON
        part = Ledger(per_reason=3)
        for e in events[a:a + 4]:
            part.record(*e, text="t" * 5)
        merged.merge(Ledger.from_dict(json.loads(json.dumps(part.to_dict())), per_reason=3))
    assert merged.counts == whole.counts == {"short": 7, "bad_utf8": 4}
    assert merged.samples == whole.samples
    assert len(merged.samples) == 6
    merged.record("short", "late")  # the per-reason bound survives the round trip
    assert len(merged.samples) == 6


def test_a_restored_ledger_keeps_its_per_reason_bound():
    full = Ledger(per_reason=2)
    for i in range(3):
        full.record("short", f"f{i}")
    restored = Ledger.from_dict(full.to_dict(), per_reason=2)
    restored.record("short", "late")
    assert restored.counts["short"] == 4
    assert [s["source"] for s in restored.samples] == ["f0", "f1"]


def test_counts_are_exact_and_reported_by_reason_name():
    from pipeline.data.accounting import counts_text

    ledger = Ledger(per_reason=1)
    ledger.record("too_large", "a.jsonl", n=1500)
    ledger.record("binary", "b.bin")
    ledger.record("too_large", "c.jsonl", n=2)
    assert ledger.total == 1503
    assert list(ledger.as_dict().items()) == [("binary", 1), ("too_large", 1502)]
    assert counts_text({"too_large": 1502, "binary": 1}) == "binary 1, too_large 1,502"


def test_a_quarantined_record_keeps_its_detail_and_at_most_max_chars_of_its_text():
    ledger = Ledger(max_chars=4)
    ledger.record("short", "s", "line 3", text="abcd", detail="4 chars")
    ledger.record("long", "s", "line 9", text="abcdefg")
    assert ledger.samples == [
        {"reason": "short", "source": "s", "location": "line 3", "detail": "4 chars", "text": "abcd"},
        {"reason": "long", "source": "s", "location": "line 9", "text": "abcd", "text_chars": 7}]


def test_a_lone_surrogate_is_written_as_its_escape(tmp_path):
    ledger = Ledger()
    ledger.record("non_utf8", "s", text="a\udc80b")
    ledger.record("short", "s", text="héllo")
    ledger.write(tmp_path / "q.jsonl")
    lines = (tmp_path / "q.jsonl").read_text(encoding="utf-8").splitlines()
    assert '"a\\udc80b"' in lines[0] and '"héllo"' in lines[1]  # other text stays readable
    assert [json.loads(line)["text"] for line in lines] == ["a\udc80b", "héllo"]


def test_a_record_is_one_line_for_any_line_reader(tmp_path):
    """JSON leaves NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR as they are in a string, and str.splitlines()
    ends lines at them: a quarantined text holding one split its record (json.loads failed on each half)."""
    texts = ["a\x85b", "c\u2028d", "e\u2029f", "g\x0bh\x1ci", "caf\u00e9"]
    ledger = Ledger()
    for t in texts:
        ledger.record("short", "s", text=t)
    ledger.write(tmp_path / "q.jsonl")
    lines = (tmp_path / "q.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in lines] == texts
    assert "café" in lines[-1]  # other text stays readable
