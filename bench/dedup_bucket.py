"""Sharded near dedup on one large bucket of near-identical documents: the
default (a bucket of more than ``dedup.LARGE_BUCKET`` documents gives its
members, checked against its kept documents) against all of its pairs, side by
side, and the memory of each step.

    python -m bench.dedup_bucket                         # 3,000 and 6,000 documents both ways, 100,000 the default way
    python -m bench.dedup_bucket --docs 256 257 --large 30000 300000

A bucket of m near-identical documents (boilerplate pages, templated files)
has m(m-1)/2 pairs: 4.5 M for 3,000, 18 M for 6,000. Written as pairs (what
every bucket gave before ``dedup.LARGE_BUCKET``, forced here by raising it),
the band tasks (``dedup.band_pairs``) compute them all, in every band where
the bucket's documents are equal, and write those first found in each band,
and the decision pass (``dedup.resolve``) reads them all. As members, each
band task writes one record per document, and the decision pass compares each
document with the bucket's kept ones: here the first, so m - 1 comparisons.
Both must drop the same documents; the bench checks it.

The documents: 128-slot signatures in 16 bands, equal in the first 15 bands and
random in the last, so one bucket in each of 15 bands. Each way and size runs
in a fresh process, which polls its own ``/proc/self/status`` every 5 ms: the
peak of anonymous memory (the process's own) above what it held before the
step, and the peak of file-backed pages above what it held before (the runs,
memory-mapped; the kernel can reclaim them). Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(status: str | None = None) -> dict[str, int]:
    """RssAnon and RssFile of this process (or of the ``status`` text given), in
    whole MiB (2**20 bytes; /proc's kB are KiB), rounded down."""
    out = {}
    for line in (Path("/proc/self/status").read_text() if status is None else status).splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) // 1024
    return out


def one(docs: int, folder: Path, way: str) -> dict:
    """In this process: one bucket of ``docs`` documents, the band tasks of
    every band, then the decision pass; ``way``: default or pairs."""
    import numpy as np

    from pipeline.data import dedup

    if way == "pairs":
        dedup.LARGE_BUCKET = docs  # no bucket is large: every one gives its pairs
    work = dedup.WorkDir(folder, docs, num_perm=128, bands=16, partition_docs=1_000_000)
    writer = dedup.SignatureWriter(work, exact=True, near=True)
    rng = np.random.default_rng(0)
    sigs = np.tile(rng.integers(0, 2**32, 128, dtype=np.uint32), (docs, 1))
    sigs[:, 120:] = rng.integers(0, 2**32, (docs, 8), dtype=np.uint32)  # the last band differs: 15 of 16 equal
    writer.add(np.full(docs, dedup.CANDIDATE, np.uint8), rng.integers(0, 2**63, (docs, 2)).astype("<u8"), sigs)
    writer.close()
    peak: dict[str, int] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for k, v in _status().items():
                peak[k] = max(peak.get(k, 0), v)
            time.sleep(0.005)

    def measured(fn, *args):
        base = _status()
        peak.clear()
        peak.update(base)  # the step's start counts, so a step too short for one poll still has a peak
        done.clear()
        t = threading.Thread(target=poll)
        t.start()
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        finally:
            done.set()
            t.join()
        for k, v in _status().items():  # and its end
            peak[k] = max(peak[k], v)
        return result, {"seconds": round(time.perf_counter() - t0, 2), "anon_mb": peak["RssAnon"] - base["RssAnon"],
                        "file_mb": peak["RssFile"] - base["RssFile"]}

    def band_tasks() -> list[str]:
        return [r for b in range(work.bands) for r in dedup.band_pairs(work, b, 0, writer.size(work.band_path(b, 0)))]

    try:
        runs, band = measured(band_tasks)
        loaded = [np.load(r, mmap_mode="r") for r in runs]
        pairs = sum(len(r) for r in loaded if r.dtype == dedup.PAIR)
        members = sum(len(r) for r in loaded if r.dtype == dedup.MEMBER)
        del loaded
        res, decide = measured(dedup.resolve, work, runs, 0.8, 10)
        disk = sum(Path(r).stat().st_size for r in runs)
        state = work.state().tolist()
    finally:
        dedup.remove(folder)
    return {"docs": docs, "way": way, "pairs": pairs, "members": members, "disk_mb": disk / 1e6,
            "near": res["near"], "checked": res["candidates_checked"], "state": hash(tuple(state)),
            "band_tasks": band, "decision_pass": decide}


def measure(docs: int, way: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.dedup_bucket", "--one", str(docs), way], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def row(r: dict) -> str:
    b, d = r["band_tasks"], r["decision_pass"]
    pairs = f"{r['pairs'] / 1e6:.1f} M pairs" if r["pairs"] >= 100_000 else f"{r['pairs']:,} pairs"
    records = " + ".join([pairs] * bool(r["pairs"] or not r["members"])
                         + [f"{r['members']:,} members"] * bool(r["members"]))
    return (f"| {r['docs']:,} | {r['way']} | {records} | {r['disk_mb']:.1f} MB | {r['checked']:,} | {b['anon_mb']} MiB "
            f"| {d['anon_mb']} MiB | {d['file_mb']} MiB | {b['seconds']} + {d['seconds']} s |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, nargs="*", default=[3000, 6000], help="bucket sizes run both ways")
    ap.add_argument("--large", type=int, nargs="*", default=[100_000], help="bucket sizes run the default way only")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # the child process's size and way
    args = ap.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(one(int(args.one[0]), Path(d) / "work", args.one[1])))
        return 0
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print("memory in MiB (2**20 bytes), disk in MB (10**6 bytes)")
    print("| bucket | way | records | on disk | candidates checked | band tasks: own peak | decision pass: own peak "
          "| its mapped runs | time (band tasks + decisions) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    for docs in args.docs:
        members, pairs = measure(docs, "default"), measure(docs, "pairs")
        if (members["state"], members["near"]) != (pairs["state"], pairs["near"]):
            raise SystemExit(f"{docs} documents: the two ways dropped different documents")
        print(row(members))
        print(row(pairs))
        total = {k: r["band_tasks"]["seconds"] + r["decision_pass"]["seconds"] for k, r in (("m", members),
                                                                                          ("p", pairs))}
        ratios.append(f"{docs:,} documents: pairs / default time {total['p'] / max(total['m'], 0.01):.0f}x, "
                      f"disk {pairs['disk_mb'] / max(members['disk_mb'], 1e-6):.0f}x")
    for docs in args.large:
        print(row(measure(docs, "default")))
    for line in ratios:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
