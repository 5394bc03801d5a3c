"""What reading compressed inputs costs ingest: the same JSON Lines corpus as
plain files, gzip, zstd and xz, side by side.

    python -m bench.compressed                 # ~60 MB of text in 16 files, 3 interleaved rounds
    python -m bench.compressed --mb 20 --rounds 1

The corpus is the standard library's source as JSON Lines records, one per
file, repeated (rot-k copies, as bench.data makes them) to about ``--mb`` MB in
16 files, each then written compressed at its codec's default level. Each run
is a fresh process running ingest with ``--workers`` workers; the runs of a
round alternate between the kinds, and medians over rounds are reported. Every
kind must give the same documents (the bench checks the texts' digest).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"plain": None, "gzip": ".gz", "zstd": ".zst", "xz": ".xz"}
FILES = 16


def build(work: Path, mb: float) -> dict[str, Path]:
    """One folder per kind, the same records in each."""
    from bench.data import rot, stdlib_table

    texts = [t for t in stdlib_table(work)["text"].to_pylist() if t.strip()]
    lines, size, k = [], 0, 0
    while size < mb * 1e6:
        for t in texts:
            line = json.dumps({"text": rot(t, k) if k else t}) + "\n"
            lines.append(line)
            size += len(line.encode())
            if size >= mb * 1e6:
                break
        k += 1
    folders = {}
    for kind, suffix in KINDS.items():
        d = folders[kind] = work / kind
        d.mkdir()
        for i in range(FILES):
            data = "".join(lines[i::FILES]).encode()
            path = d / f"part-{i:02d}.jsonl{suffix or ''}"
            if kind == "plain":
                path.write_bytes(data)
            elif kind == "xz":
                path.write_bytes(lzma.compress(data))
            else:
                with pa.CompressedOutputStream(str(path), kind) as f:
                    f.write(data)
    return folders


def _child(folder: str, out: str, workers: int) -> None:
    import hashlib

    import pyarrow.parquet as pq

    from pipeline.config import parse_section
    from pipeline.data.docs import DocTable
    from pipeline.data.ingest import IngestConfig, IngestError, run_ingest

    cfg = parse_section(IngestConfig, {"sources": [{"path": f"{folder}/*"}], "max_bytes": None,
                                       "executor": {"num_workers": workers}},
                        "ingest")
    t0 = time.perf_counter()
    m = run_ingest(cfg, Path(out) / "docs", Path(out) / "q.jsonl", Path(out) / "report.json")
    wall = time.perf_counter() - t0
    h = hashlib.sha256()
    for f in DocTable(Path(out) / "docs", IngestError).files:
        for t in pq.read_table(f, columns=["text"])["text"].to_pylist():
            h.update(t.encode())
    print("RESULT " + json.dumps({"wall_s": wall, "docs": m["docs"], "bytes": m["bytes"],
                                  "digest": h.hexdigest()}), flush=True)


def run(folder: Path, work: Path, workers: int) -> dict:
    with tempfile.TemporaryDirectory(dir=work) as out:
        r = subprocess.run([sys.executable, "-m", "bench.compressed", "--child", str(folder), out, str(workers)],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PIPELINE_PROGRESS": "0"})
    if r.returncode != 0:
        raise SystemExit(f"ingest failed on {folder}:\n{r.stderr[-3000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=60, help="corpus size (MB of JSON Lines)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="ingest's executor.num_workers")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folders = build(work, args.mb)
        sizes = {k: sum(p.stat().st_size for p in d.iterdir()) for k, d in folders.items()}
        runs: dict[str, list[dict]] = {k: [] for k in KINDS}
        for _ in range(args.rounds):
            for kind, folder in folders.items():
                runs[kind].append(run(folder, work, args.workers))
    digests = {r["digest"] for rs in runs.values() for r in rs}
    if len(digests) != 1:  # not an assert: python -O would skip it and still print "the same documents"
        raise SystemExit(f"the kinds gave different documents ({len(digests)} different texts' digests): "
                         + ", ".join(f"{k} {sorted({r['digest'][:12] for r in rs})}" for k, rs in runs.items()))
    plain = statistics.median(r["wall_s"] for r in runs["plain"])
    docs, text = runs["plain"][0]["docs"], runs["plain"][0]["bytes"]
    print(f"ingest, {docs:,} documents, {text / 1e6:.1f} MB of text in {FILES} JSON Lines files, "
          f"{args.workers} worker(s), medians of {args.rounds} round(s); the same documents from every kind")
    print(f"{'kind':8s} {'on disk MB':>11s} {'ratio':>6s} {'wall s':>7s} {'wall / plain':>13s} {'MB/s of text':>13s}")
    for kind in KINDS:
        wall = statistics.median(r["wall_s"] for r in runs[kind])
        print(f"{kind:8s} {sizes[kind] / 1e6:11.1f} {sizes['plain'] / sizes[kind]:6.2f} {wall:7.2f} "
              f"{wall / plain:13.2f} {text / 1e6 / wall:13.1f}")


if __name__ == "__main__":
    main()
