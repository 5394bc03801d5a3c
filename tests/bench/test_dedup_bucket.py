import pytest

from bench import dedup_bucket
from pipeline.data import dedup


def test_status_is_whole_mib_of_anonymous_and_file_pages():
    status = "Name:\tpython\nRssAnon:\t  3072 kB\nRssFile:\t  2047 kB\nRssShmem:\t 999999 kB\n"
    assert dedup_bucket._status(status) == {"RssAnon": 3, "RssFile": 1}


def test_a_tiny_bucket_both_ways_drops_the_same_and_has_peaks(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "LARGE_BUCKET", dedup.LARGE_BUCKET)  # the pairs way raises it: restore after
    a = dedup_bucket.one(5, tmp_path / "a", "default")
    b = dedup_bucket.one(5, tmp_path / "b", "pairs")
    assert (a["state"], a["near"]) == (b["state"], b["near"]) and b["pairs"] == 10
    for r in (a, b):  # a step shorter than one poll still reports its own memory, never below its start
        for step in ("band_tasks", "decision_pass"):
            assert r[step]["anon_mb"] >= 0 and r[step]["file_mb"] >= 0


def test_the_bench_stops_when_the_two_ways_drop_different_documents(monkeypatch):
    def measure(docs, way):
        step = {"seconds": 0.1, "anon_mb": 0, "file_mb": 0}
        return {"docs": docs, "way": way, "pairs": 0, "members": docs, "disk_mb": 0.1, "checked": docs - 1,
                "near": 4 if way == "default" else 3, "state": 1, "band_tasks": step, "decision_pass": step}

    monkeypatch.setattr(dedup_bucket, "measure", measure)
    with pytest.raises(SystemExit, match="dropped different documents"):
        dedup_bucket.main(["--docs", "5", "--large"])


class NeverPolls:
    """A poller thread that is never scheduled before its step ends."""

    def __init__(self, target):
        pass

    def start(self):
        pass

    def join(self):
        pass


def test_a_step_over_before_its_first_poll_still_has_a_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup_bucket.threading, "Thread", NeverPolls)
    r = dedup_bucket.one(5, tmp_path / "w", "default")
    assert r["band_tasks"]["anon_mb"] >= 0 and r["decision_pass"]["file_mb"] >= 0


def test_a_step_peak_counts_its_end(tmp_path, monkeypatch):
    """Memory that grows through a step unpolled: the sample at its end is its peak."""
    calls = iter(range(100))
    monkeypatch.setattr(dedup_bucket, "_status", lambda: {"RssAnon": 10 * next(calls), "RssFile": 5})
    monkeypatch.setattr(dedup_bucket.threading, "Thread", NeverPolls)
    r = dedup_bucket.one(5, tmp_path / "w", "default")
    assert (r["band_tasks"]["anon_mb"], r["decision_pass"]["anon_mb"], r["decision_pass"]["file_mb"]) == (10, 10, 0)
