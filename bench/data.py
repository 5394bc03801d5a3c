"""Data-stage benchmark: pack against raw tokenizers on two corpus shapes, and memory.

    python -m bench.data            # both shapes at ~64 MB, 3 interleaved rounds; memory at ~64 and ~200 MB
    python -m bench.data --quick    # 1 round, memory at ~64 MB only
    python -m bench.data --clean    # also clean's memory at both sizes (few long documents)
    python -m bench.data --ray      # instead: clean and pack under Ray against the local pool (bench/ray_data.py)

Two corpus shapes, built here from the Python standard library's own source
(no download):

* **few long documents**: every ``.py`` file of the standard library (about 1,800
  files averaging 17 KB), repeated until the corpus reaches the size asked;
* **many short documents**: the paragraphs (runs of lines between blank lines) of
  those files that are 100 to 300 bytes long (about 54,000, averaging 180 bytes),
  repeated likewise: about 350,000 documents at 64 MB.

Copy ``k`` has its letters rotated by ``k`` (rot-k), so that copies are not
duplicates of each other, and its own ids. One tokenizer, trained on the long
corpus with the default tokenizer params, serves both shapes.

What it reports, per shape, every figure from this one run:

* **pack, whole stage**: ``python -m stages.pack`` in a scratch project holding
  the corpus and tokenizer, timed from process start to exit (interpreter,
  imports, worker spawn, the split plan, writing: everything a user waits for);
* **pack, own timer**: the stage's ``pack_seconds`` metric;
* **raw encode_batch, 1 process**: ``Tokenizer.encode_batch`` over the same texts
  with the same tokenizer, about 1 MB of text a call (pack's ``task_bytes``),
  texts loaded before the clock starts, the library's threads off;
* **raw encode_batch, one process per core**: the same in ``--workers``
  processes at once, each over an interleaved share of the texts, timed from a
  common start to the last one done: the tokenizer-bound limit of this machine;
* the same with ``encode_batch_fast`` (the call pack makes: the ids of
  ``encode_batch`` without character offsets), to show how much of pack's
  margin comes from that call;
* **stage start-up**: a process that imports the stage, loads the tokenizer and
  starts the workers, then exits: the fixed cost a small corpus pays;
* **CPU seconds** of the whole stage (every process of it) against those of the
  raw ``encode_batch`` calls alone: a ratio that a busy machine disturbs much less
  than wall-clock ratios;
* **peak memory** of the whole process tree of the stage (sampled every 50 ms) at
  both sizes: it must stay flat and under 1 GiB.

Goals (issue 14): many short documents, pack whole stage >= 0.85x and by its own
timer >= 0.9x one process per core of raw ``encode_batch``; few long documents
>= 0.95x; peak memory < 1 GiB at ~200 MB.

Units: text sizes and MB/s in MB (10**6 bytes); memory in MiB (2**20 bytes),
as the printout says (the ``*_mb`` keys of the JSON report hold MiB too). Every measured run is a fresh
subprocess; the runs of a round alternate, and medians over rounds are reported,
so that a noisy neighbour hurts all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import resource
import shutil
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

from bench.goals import goal  # noqa: E402

GB = 1 << 30  # the memory goal, 1 GiB
MIB = 1 << 20  # memory is reported in MiB; text sizes and MB/s in MB (10**6 bytes)
SHAPES = ("short", "long")
SHAPE_NAMES = {"short": "many short documents", "long": "few long documents"}
SHORT_MIN, SHORT_MAX = 100, 300  # bytes of a short document
PARAGRAPH = re.compile(r"\n[ \t]*\n")
# Raw encode calls take about this much text each, as pack's tasks do (its default task_bytes).
BATCH_BYTES = 1_000_000


# --- corpora ---------------------------------------------------------------------------------


def rot(text: str, k: int) -> str:
    k %= 26
    if k == 0:
        return text
    lower = "abcdefghijklmnopqrstuvwxyz"
    table = str.maketrans(lower + lower.upper(), lower[k:] + lower[:k] + (lower[k:] + lower[:k]).upper())
    return text.translate(table)


def stdlib_table(work: Path):
    """The standard library's .py files, through our own ingest stage."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import parse_section
    from pipeline.data.docs import DocTable
    from pipeline.data.ingest import IngestConfig, IngestError, run_ingest

    base = work / "stdlib"  # a documents folder (pipeline/data/docs.py)
    cfg = parse_section(IngestConfig, {"max_bytes": None, "sources": [
        {"path": "{stdlib}/**/*.py", "exclude": ["*/site-packages/*", "*/dist-packages/*"]}]}, "ingest")
    run_ingest(cfg, base, work / "q.jsonl")
    return pa.concat_tables([pq.read_table(f, columns=["id", "text"]) for f in DocTable(base, IngestError).files])


def short_paragraphs(texts: list[str]) -> list[str]:
    """Every paragraph of ``texts`` of SHORT_MIN to SHORT_MAX bytes, in order."""
    return [p for t in texts for p in PARAGRAPH.split(t) if SHORT_MIN <= len(p.encode()) <= SHORT_MAX]


def write_copies(path: Path, ids: list[str], texts: list[str], min_bytes: float) -> tuple[int, int]:
    """Write rot-k copies of (ids, texts) until the text reaches ``min_bytes``;
    return (documents, bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = size = k = 0
    schema = pa.schema([("id", pa.string()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema) as w:
        while size < min_bytes:
            copy = [rot(t, k) for t in texts]
            w.write_table(pa.table({"id": [f"{i}-{k}" for i in ids], "text": copy}, schema=schema),
                          row_group_size=20_000)
            docs += len(copy)
            size += sum(len(t.encode()) for t in copy)
            k += 1
    return docs, size


def build_corpora(work: Path, sizes_mb: list[float]) -> dict[tuple[str, float], dict]:
    """Both shapes at each size: {(shape, mb): {path, docs, bytes}}."""
    table = stdlib_table(work)
    ids, texts = table.column("id").to_pylist(), table.column("text").to_pylist()
    paragraphs = short_paragraphs(texts)
    sources = {"long": ([str(i) for i in ids], texts), "short": ([f"p{i}" for i in range(len(paragraphs))], paragraphs)}
    out = {}
    for shape, (shape_ids, shape_texts) in sources.items():
        for mb in sizes_mb:
            path = work / f"{shape}-{mb:g}mb.parquet"
            docs, nbytes = write_copies(path, shape_ids, shape_texts, mb * 1e6)
            out[shape, mb] = {"path": path, "docs": docs, "bytes": nbytes}
    return out


# --- children: each measured run is a fresh process ------------------------------------------------


def _encode_share(tokenizer: str, corpus: str, k: int, n: int, fast: bool, barrier, results) -> None:
    """Process ``k`` of ``n``: load its share of the texts, wait for the others,
    encode, report (seconds, bytes, tokens)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import pyarrow.parquet as pq

    from pipeline.data.tokenizer import load_tokenizer

    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()[k::n]
    sizes = [len(t.encode()) for t in texts]
    batches, start, size = [], 0, 0
    for i, s in enumerate(sizes):  # about BATCH_BYTES of text a call, as pack's tasks
        size += s
        if size >= BATCH_BYTES or i == len(texts) - 1:
            batches.append(texts[start:i + 1])
            start, size = i + 1, 0
    tok = load_tokenizer(tokenizer)
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for batch in batches:
        tokens += sum(len(e) for e in encode(batch))
    results.put((k, time.perf_counter() - t0, sum(sizes), tokens, time.process_time() - c0))


def raw_encode(corpus: str, tokenizer: str, procs: int, fast: bool) -> dict:
    """Raw encode over the corpus in ``procs`` processes started together;
    MB/s = all bytes / (common start to last done); ``encode_cpu_s``: the CPU
    seconds of the encode calls alone, summed over the processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=_encode_share, args=(tokenizer, corpus, k, procs, fast, barrier, results))
          for k in range(procs)]
    for p in ps:
        p.start()

    def failed() -> str | None:
        dead = [f"process {k} exited {p.exitcode}" for k, p in enumerate(ps) if p.exitcode not in (None, 0)]
        return "raw encode failed: " + ", ".join(dead) if dead else None

    # The parent joins the barrier from a thread, so that a child that dies before it (a bad
    # tokenizer or corpus) fails the run instead of leaving the parent waiting for ever.
    start: list[float] = []

    def join_barrier() -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return
        start.append(time.perf_counter())  # the common start, taken as the barrier opens

    waiter = threading.Thread(target=join_barrier, daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.2)
        if waiter.is_alive() and failed():
            barrier.abort()
            waiter.join()
            for p in ps:
                p.terminate()
            raise RuntimeError(failed())
    got = []
    while len(got) < procs:
        try:
            got.append(results.get(timeout=0.2))
        except queue.Empty:
            if failed():
                for p in ps:
                    p.terminate()
                raise RuntimeError(failed()) from None
    seconds = time.perf_counter() - start[0]
    for p in ps:
        p.join()
    nbytes = sum(g[2] for g in got)
    return {"seconds": seconds, "bytes": nbytes, "tokens": sum(g[3] for g in got), "mb_per_s": nbytes / seconds / 1e6,
            "encode_cpu_s": sum(g[4] for g in got)}


def startup(tokenizer: str, workers: int) -> dict:
    """What the stage does before its first document: import it, load the
    tokenizer, start ``workers`` worker processes (each imports and loads the
    tokenizer too). The caller times this whole process."""
    import importlib
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import pyarrow as pa

    importlib.import_module("stages.pack")  # the stage's own imports
    from pipeline.data.pack import PackError, _encode_task, _init_worker, open_tokenizer

    open_tokenizer(Path(tokenizer), PackError)
    schema = pa.schema([("text", pa.string())])
    message = pa.record_batch([pa.array(["x"])], schema=schema).serialize().to_pybytes()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(Path(tokenizer).read_text(encoding="utf-8"), schema, ("", []), 1024, 10**6)) as ex:
        for f in [ex.submit(_encode_task, 0, 1, message) for _ in range(workers)]:
            f.result()
    return {}


def _child(kind: str, corpus: str, tokenizer: str, workers: int, out: str) -> None:
    if kind == "raw":
        m = raw_encode(corpus, tokenizer, workers, fast=False)
    elif kind == "raw-fast":
        m = raw_encode(corpus, tokenizer, workers, fast=True)
    elif kind == "startup":
        m = startup(tokenizer, workers)
    elif kind == "clean":
        from pipeline.config import parse_section
        from pipeline.data.clean import CleanConfig, run_clean

        m = run_clean(parse_section(CleanConfig, {"num_workers": workers}, "clean"), corpus,
                      Path(out) / "clean", Path(out) / "q.jsonl")
    else:
        raise SystemExit(f"unknown kind {kind}")
    print("RESULT " + json.dumps(m, default=str), flush=True)


def stage_project(out: Path, corpus: Path, tokenizer: Path, workers: int) -> Path:
    """A scratch project where ``python -m stages.pack`` packs ``corpus``: the
    shipped params.yaml with ``pack.num_workers`` set, and the stage's inputs linked."""
    import yaml

    from pipeline import layout

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["pack"]["num_workers"] = workers
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    for link, target in ((layout.CLEAN_DOCS, corpus), (layout.TOKENIZER_JSON, tokenizer),
                         (layout.TOKENIZER_JSON.parent / "specials.json", tokenizer.parent / "specials.json")):
        (out / link).parent.mkdir(parents=True, exist_ok=True)
        (out / link).symlink_to(target)
    return out


def tree_rss(p) -> tuple[int, int]:
    """(RSS of ``p``, RSS of ``p`` and every live descendant) in bytes, one
    sample; a descendant gone mid-sample counts 0, the rest still count."""
    try:
        main = p.memory_info().rss
        children = p.children(recursive=True)
    except psutil.Error:
        return 0, 0
    tree = main
    for c in children:
        try:
            tree += c.memory_info().rss
        except psutil.Error:
            pass
    return main, tree


def measure(kind: str, corpus: Path, tokenizer: Path, workers: int, work: Path, sample_memory: bool = False) -> dict:
    """Run ``kind`` in a fresh process tree; return its metrics, its wall time
    (``wall_s``, process start to exit) and, with ``sample_memory``, the peak RSS
    (MiB, 2**20 bytes) of its main process and of the whole tree (sum over live processes).
    Throughput runs do not sample: on 2 cores even a light sampler competes."""
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PIPELINE_PROGRESS": "0", "PIPELINE_TRACKING": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if kind == "pack":
        cmd, cwd = [sys.executable, "-m", "stages.pack"], stage_project(out, corpus, tokenizer, workers)
    else:
        cmd, cwd = [sys.executable, "-m", "bench.data", "--child", kind, str(corpus), str(tokenizer), str(workers),
                    str(out)], ROOT
    peak = {"main": 0, "tree": 0}
    stop = threading.Event()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample() -> None:
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            rss_main, rss_tree = tree_rss(p)
            peak["main"] = max(peak["main"], rss_main)
            peak["tree"] = max(peak["tree"], rss_tree)
            stop.wait(0.05)

    t = threading.Thread(target=sample if sample_memory else stop.wait, daemon=True)
    t.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime  # the whole tree: it waits for its own
    stop.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed (exit {proc.returncode}): {stderr[-2000:]}")
    if kind == "pack":
        result = json.loads((cwd / "metrics" / "pack.json").read_text())
    else:
        result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    shutil.rmtree(out)
    return {**result, "wall_s": wall, "cpu_s": cpu, "peak_main_mb": peak["main"] / MIB, "peak_tree_mb": peak["tree"] / MIB}


# --- report ------------------------------------------------------------------------------------


RUNS = (  # name, child kind, processes (None: --workers)
    ("stage", "pack", None),
    ("raw-1", "raw", 1),
    ("raw-cores", "raw", None),
    ("raw-fast-cores", "raw-fast", None),
    ("startup", "startup", None),
)


def shape_summary(speed: dict[str, list[float]], own: list[float], cpu: dict[str, list[float]], c: dict) -> dict:
    """One shape's medians over the rounds and their ratios, each "x_over_y" the
    throughput of x over that of y (higher: x faster). ``speed``: MB/s per run
    name (start-up: seconds), ``own``: the stage's own-timer MB/s, ``cpu``: CPU
    seconds of the whole stage and of the raw encode calls, ``c``: the corpus."""
    med = {k: statistics.median(v) for k, v in speed.items()}
    med_own = statistics.median(own)
    return {
        "corpus_mb": c["bytes"] / 1e6, "docs": c["docs"],
        "mb_per_s": {**{k: {"median": med[k], "runs": v} for k, v in speed.items() if k != "startup"},
                     "stage_own_timer": {"median": med_own, "runs": own}},
        "startup_s": {"median": med["startup"], "runs": speed["startup"]},
        "startup_share_of_stage": med["startup"] / (c["bytes"] / 1e6 / med["stage"]),
        "cpu_s": {k: {"median": statistics.median(v), "runs": v} for k, v in cpu.items()},
        # robust to a busy machine: CPU seconds of the raw encode calls over those of the whole stage
        "raw_cpu_over_stage_cpu": statistics.median(cpu["raw-cores"]) / statistics.median(cpu["stage"]),
        "stage_over_raw_cores": med["stage"] / med["raw-cores"],
        "own_over_raw_cores": med_own / med["raw-cores"],
        "stage_over_raw_1": med["stage"] / med["raw-1"],
        "own_over_raw_1": med_own / med["raw-1"],
        "stage_over_raw_fast_cores": med["stage"] / med["raw-fast-cores"],
        "own_over_raw_fast_cores": med_own / med["raw-fast-cores"],
    }


def goal_lines(shapes: dict, memory: list[dict], quick: bool) -> list[str]:
    """The goals of issue 14, each verdict computed from this run's medians
    (``shapes``, as in the report) and memory peaks (MiB)."""
    s, lg = shapes["short"], shapes["long"]
    pack = [x for x in memory if x["stage"] == "pack"]
    peak = max(x["peak_tree_mb"] for x in pack)
    return [
        f"short: whole stage / raw per core = {s['stage_over_raw_cores']:.2f} "
        f"{goal(s['stage_over_raw_cores'], '>=', 0.85)}, "
        f"own timer = {s['own_over_raw_cores']:.2f} {goal(s['own_over_raw_cores'], '>=', 0.9)}",
        f"long:  whole stage / raw per core = {lg['stage_over_raw_cores']:.2f} "
        f"{goal(lg['stage_over_raw_cores'], '>=', 0.95)}, own timer = {lg['own_over_raw_cores']:.2f}",
        f"pack peak memory, main + workers, any run = {peak:.0f} MiB "
        f"{goal(peak, '<', GB / MIB) if all(x['peak_tree_mb'] for x in pack) else '(a run never sampled: not measured)'}"
        " at up to "
        f"{max(x['corpus_mb'] for x in pack):.0f} MB of text" + (" (--quick: no ~200 MB corpus)" if quick else "")
        + "; flat? by size: " + "; ".join(f"{SHAPE_NAMES[sh]} " + " -> ".join(
            f"{x['peak_tree_mb']:.0f}" for x in pack if x["shape"] == sh) for sh in SHAPES) + " MiB",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round; memory at --mb only")
    ap.add_argument("--mb", type=float, default=64, help="corpus size (MB of text) for throughput, both shapes")
    ap.add_argument("--memory-mb", type=float, default=200, help="the larger corpus for the memory check")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=psutil.cpu_count() or 2,
                    help="pack workers and raw processes per core (default: one per core)")
    ap.add_argument("--clean", action="store_true", help="also measure clean's peak memory (few long documents)")
    ap.add_argument("--ray", action="store_true",
                    help="run bench/ray_data.py instead (the executors side by side; --quick and --rounds pass on)")
    ap.add_argument("--child", nargs=5, metavar=("KIND", "CORPUS", "TOKENIZER", "WORKERS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, corpus, tokenizer, workers, out = args.child
        _child(kind, corpus, tokenizer, int(workers), out)
        return
    if args.ray:
        from bench import ray_data

        ray_data.main(["--quick"] if args.quick else ["--rounds", str(args.rounds)])
        return

    from pipeline.config import parse_section
    from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer

    os.environ["PIPELINE_PROGRESS"] = "0"  # building the corpora: no progress bars in the report
    sizes = [args.mb] if args.quick else [args.mb, args.memory_mb]
    rounds = 1 if args.quick else args.rounds
    w = args.workers
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpora = build_corpora(work, sizes)
        tok = work / "tokenizer" / "tokenizer.json"
        tok.parent.mkdir()
        train_tokenizer(parse_section(TokenizerConfig, {}, "tokenizer"), corpora["long", args.mb]["path"], tok)
        for (shape, mb), c in corpora.items():
            print(f"corpus {SHAPE_NAMES[shape]:21s} {c['bytes'] / 1e6:6.1f} MB, {c['docs']:8d} documents "
                  f"({c['bytes'] / c['docs']:.0f} bytes each)", flush=True)
        print(f"corpora and tokenizer built in {time.perf_counter() - t_start:.0f} s", flush=True)

        speed: dict[str, dict[str, list[float]]] = {s: {name: [] for name, _, _ in RUNS} for s in SHAPES}
        own: dict[str, list[float]] = {s: [] for s in SHAPES}
        cpu: dict[str, dict[str, list[float]]] = {s: {"stage": [], "raw-cores": []} for s in SHAPES}
        for r in range(rounds):
            for shape in SHAPES:
                c = corpora[shape, args.mb]
                for name, kind, procs in RUNS:
                    m = measure(kind, c["path"], tok, procs or w, work)
                    if name == "stage":
                        speed[shape][name].append(c["bytes"] / m["wall_s"] / 1e6)
                        own[shape].append(c["bytes"] / m["pack_seconds"] / 1e6)
                        cpu[shape][name].append(m["cpu_s"])
                    elif name == "raw-cores":
                        speed[shape][name].append(m["mb_per_s"])
                        cpu[shape][name].append(m["encode_cpu_s"])
                    elif name == "startup":
                        speed[shape][name].append(m["wall_s"])
                    else:
                        speed[shape][name].append(m["mb_per_s"])
                print(f"round {r + 1} {shape:5s}: stage {speed[shape]['stage'][-1]:.2f} MB/s (own timer "
                      f"{own[shape][-1]:.2f}), raw 1 process {speed[shape]['raw-1'][-1]:.2f}, raw per core "
                      f"{speed[shape]['raw-cores'][-1]:.2f}, raw fast per core {speed[shape]['raw-fast-cores'][-1]:.2f}"
                      f" MB/s, start-up {speed[shape]['startup'][-1]:.2f} s", flush=True)

        memory = []
        for shape in SHAPES:
            for mb in sizes:
                c = corpora[shape, mb]
                m = measure("pack", c["path"], tok, w, work, sample_memory=True)
                memory.append({"stage": "pack", "shape": shape, "corpus_mb": c["bytes"] / 1e6, "docs": c["docs"],
                               "peak_main_mb": m["peak_main_mb"], "peak_tree_mb": m["peak_tree_mb"]})
                print(f"memory pack  {SHAPE_NAMES[shape]:21s} {c['bytes'] / 1e6:5.0f} MB: main "
                      f"{m['peak_main_mb']:.0f} MiB, main + workers {m['peak_tree_mb']:.0f} MiB", flush=True)
        if args.clean:
            for mb in sizes:
                c = corpora["long", mb]
                m = measure("clean", c["path"], tok, w, work, sample_memory=True)
                memory.append({"stage": "clean", "shape": "long", "corpus_mb": c["bytes"] / 1e6, "docs": c["docs"],
                               "peak_main_mb": m["peak_main_mb"], "peak_tree_mb": m["peak_tree_mb"]})
                print(f"memory clean {SHAPE_NAMES['long']:21s} {c['bytes'] / 1e6:5.0f} MB: main "
                      f"{m['peak_main_mb']:.0f} MiB, main + workers {m['peak_tree_mb']:.0f} MiB", flush=True)

    shapes = {shape: shape_summary(speed[shape], own[shape], cpu[shape], corpora[shape, args.mb])
              for shape in SHAPES}
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{psutil.virtual_memory().total / GB:.0f} GiB",
        "workers": w, "rounds": rounds, "memory_unit": "MiB", "shapes": shapes, "memory": memory,
        "max_pack_tree_mb": max(x["peak_tree_mb"] for x in memory if x["stage"] == "pack"),
        "seconds": time.perf_counter() - t_start,
    }
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "data.json").write_text(json.dumps(report, indent=2))

    s, lg = shapes["short"], shapes["long"]
    print()
    print(f"{'pack against raw tokenizers (medians)':48s} {SHAPE_NAMES['short']:>22s} {SHAPE_NAMES['long']:>22s}")
    rows = [
        ("corpus", lambda x: f"{x['corpus_mb']:.0f} MB, {x['docs']} docs"),
        ("whole stage / raw encode_batch per core", lambda x: f"{x['stage_over_raw_cores']:.2f}"),
        ("own timer / raw encode_batch per core", lambda x: f"{x['own_over_raw_cores']:.2f}"),
        ("whole stage / raw encode_batch 1 process", lambda x: f"{x['stage_over_raw_1']:.2f}"),
        ("own timer / raw encode_batch 1 process", lambda x: f"{x['own_over_raw_1']:.2f}"),
        ("whole stage / raw encode_batch_fast per core", lambda x: f"{x['stage_over_raw_fast_cores']:.2f}"),
        ("own timer / raw encode_batch_fast per core", lambda x: f"{x['own_over_raw_fast_cores']:.2f}"),
        ("MB/s: stage, own timer", lambda x: f"{x['mb_per_s']['stage']['median']:.2f}, "
                                             f"{x['mb_per_s']['stage_own_timer']['median']:.2f}"),
        ("MB/s: raw 1 process, per core, fast per core",
         lambda x: f"{x['mb_per_s']['raw-1']['median']:.2f}, {x['mb_per_s']['raw-cores']['median']:.2f}, "
                   f"{x['mb_per_s']['raw-fast-cores']['median']:.2f}"),
        ("CPU s: whole stage, raw encode_batch calls", lambda x: f"{x['cpu_s']['stage']['median']:.1f}, "
                                                                 f"{x['cpu_s']['raw-cores']['median']:.1f}"),
        ("raw encode CPU / whole-stage CPU", lambda x: f"{x['raw_cpu_over_stage_cpu']:.2f}"),
        ("stage start-up (s, share of the stage)", lambda x: f"{x['startup_s']['median']:.2f}, "
                                                             f"{100 * x['startup_share_of_stage']:.0f}%"),
    ]
    for label, fmt in rows:
        print(f"{label:48s} {fmt(s):>22s} {fmt(lg):>22s}")
    print()
    for line in goal_lines(shapes, memory, args.quick):
        print(line)
    print(f"bench ran {report['seconds'] / 60:.1f} minutes; report in bench/results/data.json")


if __name__ == "__main__":
    main()
