"""Data-stage benchmark: clean and pack memory, pack throughput against raw tokenizers.

    python -m bench.data            # ~200 MB corpus, 5 interleaved throughput rounds (about 13 minutes)
    python -m bench.data --quick    # ~60 MB corpus, 1 round

What it checks (the goals of the data-stage issue), all measured in this run:

* clean and pack stream: peak memory of the whole process tree (main process +
  workers, sampled every 50 ms) on a ~60 MB and a ~200 MB corpus, side by side,
  must stay under 1 GB and not grow with the corpus;
* pack's MB/s is at least 0.85x what raw ``tokenizers`` ``encode_batch`` reaches on
  the same texts with the same tokenizer, using the same 2 cores (the library's
  own threads);
* pack with 2 worker processes reaches at least 1.6x its 1-worker MB/s.

The corpus is the whole Python standard library (about 30 MB of .py files)
repeated with distinct ids; copy k has its letters rotated by k (rot-k), so
that copies are not duplicates of each other and clean's dedup indexes grow
as they would on a real corpus of that size. Every measured run is a fresh
subprocess; throughput runs alternate (pack-1, pack-2, raw, pack-1, ...) and
medians are reported, so a noisy neighbour hurts all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1 << 30


# --- corpus ----------------------------------------------------------------------------------


def rot(text: str, k: int) -> str:
    if k == 0:
        return text
    lower = "abcdefghijklmnopqrstuvwxyz"
    table = str.maketrans(lower + lower.upper(), lower[k:] + lower[:k] + (lower[k:] + lower[:k]).upper())
    return text.translate(table)


def build_corpora(work: Path, copies: list[int]) -> dict[int, Path]:
    """Ingest the whole stdlib once, then write a corpus of ``n`` rot-copies for each n."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import parse_section
    from pipeline.data.ingest import IngestConfig, run_ingest

    base = work / "stdlib.parquet"
    cfg = parse_section(IngestConfig, {"max_bytes": None, "sources": [
        {"path": "{stdlib}/**/*.py", "exclude": ["*/site-packages/*", "*/dist-packages/*"]}]}, "ingest")
    run_ingest(cfg, base, work / "q.jsonl")
    table = pq.read_table(base)
    out = {}
    for n in copies:
        path = work / f"corpus-{n}x.parquet"
        with pq.ParquetWriter(path, table.schema) as w:
            for k in range(n):
                texts = [rot(t, k) for t in table.column("text").to_pylist()]
                ids = [f"{i}-{k}" for i in table.column("id").to_pylist()]
                w.write_table(pa.table({"id": ids, "text": texts, "source": table.column("source"),
                                        "location": table.column("location")}, schema=table.schema),
                              row_group_size=2000)
        out[n] = path
    return out


# --- one measured run, in a subprocess -----------------------------------------------------------


def _child(kind: str, corpus: str, tokenizer: str, workers: int, out: str) -> None:
    """Run one stage (or the raw baseline) and print its metrics as JSON."""
    from pipeline.config import parse_section

    if kind == "clean":
        from pipeline.data.clean import CleanConfig, run_clean

        m = run_clean(parse_section(CleanConfig, {"num_workers": workers}, "clean"), corpus,
                      Path(out) / "clean.parquet", Path(out) / "q.jsonl")
    elif kind == "pack":
        from pipeline.data.pack import PackConfig, run_pack

        m = run_pack(parse_section(PackConfig, {"num_workers": workers}, "pack"), corpus, tokenizer, Path(out) / "packed")
    else:  # raw encode_batch over the same texts, loaded first (not timed), library threads
        import pyarrow.parquet as pq

        from pipeline.data.pack import baseline_encode

        texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
        m = baseline_encode(texts, tokenizer)
    print("RESULT " + json.dumps(m, default=str), flush=True)


def measure(kind: str, corpus: Path, tokenizer: Path, workers: int, work: Path, sample_memory: bool = True) -> dict:
    """Run ``kind`` in a fresh process tree; return its metrics plus peak RSS (MB)
    of the main process and of the whole tree (sum over live processes). Throughput
    runs pass ``sample_memory=False``: on 2 cores even a light sampler competes."""
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PIPELINE_PROGRESS": "0", "PIPELINE_TRACKING": "0",
           "TOKENIZERS_PARALLELISM": "true"}  # the raw baseline uses the library's own threads (one per core)
    proc = subprocess.Popen([sys.executable, "-m", "bench.data", "--child", kind, str(corpus), str(tokenizer),
                             str(workers), str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    peak = {"main": 0, "tree": 0}
    stop = threading.Event()

    def sample() -> None:
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                rss_main = p.memory_info().rss
                rss_tree = rss_main + sum(c.memory_info().rss for c in p.children(recursive=True))
            except psutil.Error:
                rss_main = rss_tree = 0
            peak["main"] = max(peak["main"], rss_main)
            peak["tree"] = max(peak["tree"], rss_tree)
            stop.wait(0.05)

    t = threading.Thread(target=sample if sample_memory else stop.wait, daemon=True)
    t.start()
    stdout, _ = proc.communicate()
    stop.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed (exit {proc.returncode})")
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {**result, "peak_main_mb": peak["main"] / 2**20, "peak_tree_mb": peak["tree"] / 2**20}


def mb_per_s(kind: str, m: dict, corpus_bytes: int) -> float:
    if kind == "raw":
        return m["mb_per_s"]
    return corpus_bytes / m["pack_seconds"] / 1e6  # pack's own timed section (excludes interpreter start)


# --- report ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~60 MB corpus only, one throughput round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", nargs=5, metavar=("KIND", "CORPUS", "TOKENIZER", "WORKERS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, corpus, tokenizer, workers, out = args.child
        _child(kind, corpus, tokenizer, int(workers), out)
        return

    import pyarrow.parquet as pq

    from pipeline.config import parse_section
    from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer

    copies = [2] if args.quick else [2, 7]
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        corpora = build_corpora(work, copies)
        sizes = {n: sum(len(t.as_py().encode()) for t in pq.read_table(p, columns=["text"]).column("text"))
                 for n, p in corpora.items()}
        tok = work / "tokenizer.json"
        train_tokenizer(parse_section(TokenizerConfig, {}, "tokenizer"), corpora[copies[0]], tok)
        print(f"corpora {', '.join(f'{sizes[n] / 1e6:.0f} MB' for n in copies)} built in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)

        memory = []
        for n in copies:
            for kind in ("clean", "pack"):
                m = measure(kind, corpora[n], tok, 2, work)
                memory.append({"stage": kind, "corpus_mb": sizes[n] / 1e6, "peak_main_mb": m["peak_main_mb"],
                               "peak_tree_mb": m["peak_tree_mb"], "mb_per_s": m["mb_per_s"]})
                print(f"memory {kind:5s} {sizes[n] / 1e6:5.0f} MB corpus: main {m['peak_main_mb']:.0f} MB, "
                      f"main + workers {m['peak_tree_mb']:.0f} MB ({m['mb_per_s']:.2f} MB/s, 2 workers)", flush=True)

        small = copies[0]
        speed: dict[str, list[float]] = {"pack-1": [], "pack-2": [], "raw": []}
        for r in range(rounds):
            for name, kind, workers in (("pack-1", "pack", 1), ("pack-2", "pack", 2), ("raw", "raw", 0)):
                m = measure(kind, corpora[small], tok, workers, work, sample_memory=False)
                speed[name].append(mb_per_s(kind, m, sizes[small]))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} MB/s" for k, v in speed.items()), flush=True)

    med = {k: statistics.median(v) for k, v in speed.items()}
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{psutil.virtual_memory().total / GB:.0f} GiB",
        "memory": memory,
        "throughput_corpus_mb": sizes[small] / 1e6,
        "mb_per_s": {k: {"median": med[k], "runs": v} for k, v in speed.items()},
        "pack2_over_raw": med["pack-2"] / med["raw"],
        "pack2_over_pack1": med["pack-2"] / med["pack-1"],
        "max_tree_mb": max(x["peak_tree_mb"] for x in memory),
    }
    print(json.dumps(report, indent=2))
    print()
    print(f"pack (2 workers) / raw encode_batch (2 threads) = {report['pack2_over_raw']:.2f}  (goal >= 0.85)")
    print(f"pack 2 workers / 1 worker                       = {report['pack2_over_pack1']:.2f}  (goal >= 1.6)")
    print(f"peak memory, main + workers, any run            = {report['max_tree_mb']:.0f} MB  (goal < 1024 MB)")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "data.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
