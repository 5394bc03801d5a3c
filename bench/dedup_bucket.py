"""Sharded near dedup on one large bucket: the memory of its band task and of its
decision pass against the bucket's size.

    python -m bench.dedup_bucket                 # buckets of 3,000 and 6,000 documents
    python -m bench.dedup_bucket --docs 2000 8000

A bucket of m near-identical documents (boilerplate pages, templated files)
gives m(m-1)/2 candidate pairs: 4.5 M for 3,000, 18 M for 6,000. The band task
(``dedup.band_pairs``) writes them in sorted runs of ``PAIRS_PER_RUN`` and the
decision pass (``dedup.resolve``) reads at most ``RESOLVE_PAIRS`` of them at a
time, so their own memory should not grow with m; the time and the disk do.

Each size runs in a fresh process, which polls its own ``/proc/self/status``
every 5 ms: the peak of anonymous memory (the process's own) above what it held
before the step, and the peak of file-backed pages (the runs, memory-mapped;
the kernel can reclaim them). Linux only.
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


def _status() -> dict[str, int]:
    """RssAnon and RssFile of this process, in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) // 1024
    return out


def one(docs: int, folder: Path) -> dict:
    """In this process: one bucket of ``docs`` documents, its band task, then the decision pass."""
    import numpy as np

    from pipeline.data import dedup

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
        peak.clear()
        base = _status()["RssAnon"]
        done.clear()
        t = threading.Thread(target=poll)
        t.start()
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        finally:
            done.set()
            t.join()
        return result, {"seconds": round(time.perf_counter() - t0, 2), "anon_mb": peak["RssAnon"] - base,
                        "file_mb": peak["RssFile"]}

    try:
        runs, band = measured(dedup.band_pairs, work, 0, 0, writer.size(work.band_path(0, 0)))
        pairs = sum(len(np.load(r, mmap_mode="r")) for r in runs)
        res, decide = measured(dedup.resolve, work, runs, 0.8, 10)
        disk = sum(Path(r).stat().st_size for r in runs)
    finally:
        dedup.remove(folder)
    return {"docs": docs, "pairs": pairs, "runs": len(runs), "pairs_disk_mb": round(disk / 1e6),
            "near": res["near"], "band_task": band, "decision_pass": decide}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[3000, 6000], help="bucket sizes")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process's size
    args = ap.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(one(args.one, Path(d) / "work")))
        return 0
    print("| bucket | pairs | on disk | band task: own peak | decision pass: own peak | its mapped runs | time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for docs in args.docs:
        out = subprocess.run([sys.executable, "-m", "bench.dedup_bucket", "--one", str(docs)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        b, d = r["band_task"], r["decision_pass"]
        print(f"| {docs:,} | {r['pairs'] / 1e6:.1f} M | {r['pairs_disk_mb']} MB | {b['anon_mb']} MB "
              f"| {d['anon_mb']} MB | {d['file_mb']} MB | {b['seconds']} + {d['seconds']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
