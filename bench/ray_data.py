"""The data stages on Ray against the local pool, and their memory.

    python -m bench.ray_data            # clean and pack on ~63 MB, 3 rounds; memory on ~63 and ~220 MB
    python -m bench.ray_data --quick    # the default 8 MB corpus, 1 round
    python -m bench.ray_data --tasks    # only clean's task size on short documents (about 2 min)
    python -m bench.ray_data --driver   # only the CPU time of a stage's own process (about 1 min)
    python -m bench.ray_data --dedup    # only clean's dedup memory against corpus size (about 2 min)

What it measures, each run a fresh process (so Ray's start-up is included):

* clean and pack under Ray with 2 workers against Ray with 1 (goal: at least
  1.6x), beside the local pool's own 2-against-1 (what the machine allows at
  the time);
* clean and pack under Ray (2 workers) against the local pool (2 workers) on
  the same corpus: wall time ratio (goal: at most 1.3x, start-up included);
* the CPU-seconds of each run's whole process tree, and from them the most
  2 workers could give over 1 on this machine: the 1-worker wall time over
  the 2-worker run's CPU-seconds spread evenly on every core, with no core
  ever idle (where Ray's own processes take a share of few cores, this
  bound falls below the goal however the work is scheduled);
* the same two ratios for stages that join a long-lived local Ray instance
  (``executor.address: 127.0.0.1:PORT``, started once with ``ray start --head``
  on the loopback interface, its start-up timed and reported on its own): the
  README's recipe for many short runs, which pay no start-up each;
* the peak RSS of the main process and of the largest worker process, and of
  Ray's own processes (GCS, raylet, agents) together;
* peak memory per worker under Ray against corpus size (two sizes, about
  60 and 200 MB), for clean and pack (goal: flat, under 1 GB), and on the
  larger corpus, where Ray's fixed start-up and shutdown (about 4 s here)
  count for less, Ray with 2 workers against 1 again;
* dedup memory against corpus size: the main process and the largest worker
  with ``dedup.method: memory`` (the index lives in the main process) and
  ``sharded`` (bounded per task), on two corpus sizes;
* the CPU time of a stage's own process (the driver) with its work on the
  joined instance: the most text one driver can feed, however many workers;
* clean on many short documents (one per paragraph), local and Ray: tasks of
  64 documents (the cut before ``task_bytes``) against the default tasks of up
  to 1 MB of text.

The corpus is the Python standard library ingested once and repeated with
letters rotated by k in copy k, so copies are not duplicates and the dedup
indexes grow as on a real corpus of that size. The machine may be shared:
figures vary from run to run; the ratios compare runs made in one invocation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
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

MB = 1e6  # of text and of memory alike, and said so in every printout's first line
RAY_SYSTEM = ("gcs_server", "raylet", "ray::RuntimeEnv", "ray::Dashboard", "ray::IDLE_SpillWorker")


def rot(text: str, k: int) -> str:
    lower = "abcdefghijklmnopqrstuvwxyz"
    table = str.maketrans(lower + lower.upper(), lower[k:] + lower[:k] + (lower[k:] + lower[:k]).upper())
    return text.translate(table)


def build_corpora(work: Path, copies: list[int], quick: bool, paragraphs: bool = False) -> dict[int, Path]:
    """``n`` rot-copies of the stdlib for each n; with ``paragraphs`` every
    blank-line-separated paragraph is a document (many short documents, as in a
    web corpus, so that the dedup indexes are large)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import parse_section
    from pipeline.data.docs import DocTable
    from pipeline.data.ingest import IngestConfig, IngestError, run_ingest

    base = work / "stdlib"  # a documents folder (pipeline/data/docs.py)
    section = {} if quick else {"max_bytes": None, "sources": [
        {"path": "{stdlib}/**/*.py", "exclude": ["*/site-packages/*", "*/dist-packages/*"]}]}
    run_ingest(parse_section(IngestConfig, section, "ingest"), base, work / "q.jsonl")
    columns = ["id", "text", "source", "location"]
    table = pa.concat_tables([pq.read_table(f, columns=columns) for f in DocTable(base, IngestError).files])
    if paragraphs:
        rows: dict[str, list] = {"id": [], "text": [], "source": [], "location": []}
        for d in table.to_pylist():
            for j, para in enumerate(p for p in d["text"].split("\n\n") if p.strip()):
                rows["id"].append(f"{d['id']}/{j}")
                rows["text"].append(para + "\n")
                rows["source"].append(d["source"])
                rows["location"].append(f"para:{j}")
        table = pa.table(rows, schema=table.schema)
    out = {}
    for n in copies:
        path = work / f"corpus-{'p' if paragraphs else ''}{n}x.parquet"
        with pq.ParquetWriter(path, table.schema) as w:
            for k in range(n):
                copy = pa.table({
                    "id": [f"{i}-{k}" for i in table.column("id").to_pylist()],
                    "text": [rot(t, k) for t in table.column("text").to_pylist()],
                    "source": table.column("source"), "location": table.column("location")}, schema=table.schema)
                for a, b in row_groups(copy):
                    w.write_table(copy.slice(a, b - a), row_group_size=b - a)
        out[n] = path
    return out


def row_groups(table, docs: int = 2000, text_bytes: int = 1 << 20) -> list[tuple[int, int]]:
    """Row groups as ingest cuts them (row_group_docs, row_group_bytes defaults)."""
    import pyarrow.compute as pc

    out, first, size = [], 0, 0
    for i, n in enumerate(pc.binary_length(table.column("text")).to_pylist()):
        size += n or 0
        if i + 1 - first >= docs or size >= text_bytes:
            out.append((first, i + 1))
            first, size = i + 1, 0
    if first < table.num_rows:
        out.append((first, table.num_rows))
    return out


def _child(stage: str, corpus: str, out: str, section: str, tokenizer: str) -> None:
    from pipeline.config import parse_section

    out_dir = Path(out)
    if stage == "clean":
        from pipeline.data.clean import CleanConfig, run_clean

        cfg = parse_section(CleanConfig, json.loads(section), "clean")
        m = run_clean(cfg, corpus, out_dir / "docs", out_dir / "q.jsonl", out_dir / "report.json")
    else:
        from pipeline.data.pack import PackConfig, run_pack

        cfg = parse_section(PackConfig, json.loads(section), "pack")
        m = run_pack(cfg, corpus, tokenizer, out_dir / "packed")
    print("RESULT " + json.dumps(m), flush=True)
    print(f"CPU {time.process_time()}", flush=True)  # the stage's own process, all its threads


def digests(out: Path) -> dict[str, str]:
    """sha256 of every file a run wrote, by path in its output folder."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _role(p: psutil.Process, main_pid: int) -> str:
    if p.pid == main_pid:
        return "main"
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return "other"
    if name.startswith(RAY_SYSTEM) or cmd.startswith(RAY_SYSTEM) or "ray/" in cmd or "dashboard" in cmd:
        return "ray-system"
    if name.startswith("ray::") or cmd.startswith("ray::") or "multiprocessing" in cmd:
        return "worker"
    return "other"


def measure(corpus: Path, section: dict, work: Path, stage: str = "clean", tokenizer: Path | None = None) -> dict:
    """One clean or pack run in a fresh process tree: wall time (start-up included),
    metrics, peak RSS (MB) of the main process, the largest worker, and Ray's
    own processes summed, and the CPU-seconds of the whole tree (``cpu_s``:
    each process's as last sampled, the main process's as it reports at its
    end; a process's last 0.1 s may be missed, so this is a lower bound)."""
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PIPELINE_PROGRESS": "0", "PIPELINE_TRACKING": "0", "RAY_AUTH_MODE": "disabled"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bench.ray_data", "--child", stage, str(corpus), str(out),
                             json.dumps(section), str(tokenizer)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    peak: dict[str, float] = {"main": 0, "worker": 0, "ray-system": 0}
    cpu: dict[int, float] = {}  # CPU-seconds of each process of the tree, as last sampled
    stop = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            system = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    times = p.cpu_times()
                except psutil.Error:
                    continue
                cpu[p.pid] = times.user + times.system
                role = _role(p, proc.pid)
                if role == "ray-system":
                    system += rss
                elif role in peak:
                    peak[role] = max(peak[role], rss)
            peak["ray-system"] = max(peak["ray-system"], system)
            stop.wait(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    stdout, _ = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{stage} run failed (exit {proc.returncode}): {section}")
    metrics = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    files = digests(out)
    report = json.loads((out / "report.json").read_text()) if stage == "clean" else {}
    main_cpu = float(next(line for line in stdout.splitlines() if line.startswith("CPU "))[4:])
    cpu[proc.pid] = max(cpu.get(proc.pid, 0.0), main_cpu)
    return {"wall_s": wall, "metrics": metrics, "files": files, "report": report, "out": out, "main_cpu_s": main_cpu,
            "cpu_s": sum(cpu.values()), **{f"peak_{k}_mb": round(v / MB) for k, v in peak.items()}}


class LongLivedRay:
    """``ray start --head --block`` on 127.0.0.1 with 2 CPUs, for the runs that
    join it; ``start_s`` is its one-time start-up."""

    def __init__(self, work: Path, cpus: int = 2):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
        self.log = open(work / "ray-head.log", "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                                      "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--num-cpus={cpus}",
                                      "--include-dashboard=false", "--disable-usage-stats",
                                      # not /tmp/ray: leave no ray_current_cluster naming it
                                      f"--temp-dir={work / 'ray'}"],
                                     env=env, stdout=self.log, stderr=self.log, start_new_session=True)
        while True:  # up when the GCS answers and the raylet has registered its CPUs
            probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(address='127.0.0.1:%d', "
                                    "logging_level='error'); print(int(ray.cluster_resources().get('CPU', 0)))"
                                    % self.port], env=env, capture_output=True, text=True, timeout=120)
            if probe.returncode == 0 and probe.stdout.strip() == str(cpus):
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start failed: see {work / 'ray-head.log'}")
            time.sleep(0.2)
        self.start_s = time.perf_counter() - t0  # an upper bound: it includes the probes
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()  # --block: ray start stops the head's processes
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()


def train_tokenizer(corpus: Path, work: Path) -> Path:
    """The tokenizer stage's default BPE, trained on ``corpus`` (pack needs one)."""
    from pipeline.config import parse_section
    from pipeline.data.tokenizer import TokenizerConfig, build

    out = work / "tokenizer" / "tokenizer.json"
    build(parse_section(TokenizerConfig, {}, "tokenizer"), corpus, out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved speed rounds (default 3; 1 with --quick)")
    ap.add_argument("--tasks", action="store_true", help="only clean's task size on short documents")
    ap.add_argument("--driver", action="store_true", help="only the stage's own process's CPU time")
    ap.add_argument("--dedup", action="store_true", help="only clean's dedup memory against corpus size")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return
    args.rounds = args.rounds or (1 if args.quick else 3)
    # The corpora, outputs and Ray's session files of a full run take about 3 GB:
    # removed at the end, kept (and named) when the run fails.
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    try:
        run(args, work)
    except BaseException:
        print(f"bench.ray_data failed; its work folder is kept: {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    speed_n, big_n, mem_sizes = (2, 3, [1, 2]) if args.quick else (2, 7, [1, 3])
    if args.driver:
        long, para = build_corpora(work, [speed_n], args.quick), build_corpora(work, mem_sizes[:1], args.quick, True)
        tokenizer = train_tokenizer(long[speed_n], work)
        print(header())
        head = LongLivedRay(work)
        try:
            driver_cpu({"long documents": (long[speed_n], _text_mb(long[speed_n])),
                        "short documents": (para[mem_sizes[0]], _text_mb(para[mem_sizes[0]]))}, head, work, tokenizer)
        finally:
            head.stop()
        return
    if args.dedup:
        para = build_corpora(work, mem_sizes, args.quick, paragraphs=True)
        print(header())
        dedup_memory(para, {n: _text_mb(p) for n, p in para.items()}, mem_sizes, work)
        return
    if args.tasks:
        para = build_corpora(work, mem_sizes[:1], args.quick, paragraphs=True)
        print(header())
        task_size(para[mem_sizes[0]], _text_mb(para[mem_sizes[0]]), args.rounds, work)
        return
    corpora = build_corpora(work, [speed_n, big_n], args.quick)
    para = build_corpora(work, mem_sizes, args.quick, paragraphs=True)
    tokenizer = train_tokenizer(corpora[speed_n], work)
    text_mb = {n: _text_mb(p) for n, p in corpora.items()}
    para_mb = {n: _text_mb(p) for n, p in para.items()}
    print(header())

    head = LongLivedRay(work)
    print(f"a long-lived local Ray instance (ray start --head, 2 CPUs, loopback only) started in "
          f"{head.start_s:.1f} s, once; the 'joined' runs use it")
    runs = {
        "local, 1 worker": {"executor": {"kind": "local", "num_workers": 1}},
        "local, 2 workers": {"executor": {"kind": "local", "num_workers": 2}},
        "ray, 1 worker": {"executor": {"kind": "ray", "num_workers": 1}},
        "ray, 2 workers": {"executor": {"kind": "ray", "num_workers": 2}},
        "joined, 1 worker": {"executor": {"kind": "ray", "address": head.address, "num_workers": 1}},
        "joined, 2 workers": {"executor": {"kind": "ray", "address": head.address, "num_workers": 2}},
    }
    worker_peak: dict[tuple[str, int], int] = {}
    try:
        for stage in ("clean", "pack"):
            speed(stage, runs, args.rounds, corpora[speed_n], text_mb[speed_n], work, tokenizer, worker_peak, speed_n)
        driver_cpu({"long documents": (corpora[speed_n], text_mb[speed_n]),
                    "short documents": (para[mem_sizes[0]], para_mb[mem_sizes[0]])}, head, work, tokenizer)
    finally:
        head.stop()
    del runs["joined, 1 worker"], runs["joined, 2 workers"]
    memory_and_dedup(runs, corpora, text_mb, para, para_mb, mem_sizes, speed_n, big_n, work, tokenizer, worker_peak)
    task_size(para[mem_sizes[0]], para_mb[mem_sizes[0]], args.rounds, work)


def speed(stage: str, runs: dict, n_rounds: int, corpus: Path, corpus_mb: float, work: Path, tokenizer: Path,
          worker_peak: dict, speed_n: int) -> None:
    """Every run kind on one stage in interleaved rounds (so that a noisy
    neighbour hurts every kind alike); the table and the ratios."""
    rounds: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(n_rounds):
        for name, section in runs.items():
            rounds[name].append(measure(corpus, section, work, stage, tokenizer))
    first = rounds["local, 2 workers"][0]["files"]
    same = all(r["files"] == first for rs in rounds.values() for r in rs)
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in rounds.items()}
    worker_peak[stage, speed_n] = max(r["peak_worker_mb"] for r in rounds["ray, 2 workers"])
    print(f"\n{stage} on {corpus_mb:.0f} MB, {n_rounds} interleaved rounds, medians (wall time includes "
          f"start-up; outputs byte-identical across all runs: {same}; a joined run's workers belong to the "
          "long-lived instance, not to the run's process tree, so their memory is not shown)")
    cpu = {name: statistics.median(r["cpu_s"] for r in rs) for name, rs in rounds.items()}
    print(f"{'run':<20}{'wall s':>8}{'MB/s':>8}{'CPU s':>8}{'main MB':>9}{'worker MB':>11}{'ray sys MB':>12}")
    for name, rs in rounds.items():
        peak = {k: max(r[k] for r in rs) for k in ("peak_main_mb", "peak_worker_mb", "peak_ray-system_mb")}
        print(f"{name:<20}{wall[name]:>8.1f}{corpus_mb / wall[name]:>8.2f}"
              f"{'-' if name.startswith('joined') else f'{cpu[name]:.1f}':>8}{peak['peak_main_mb']:>9}"
              f"{peak['peak_worker_mb'] or '-':>11}{peak['peak_ray-system_mb'] or '-':>12}")

    def ratio(a: str, b: str, *target) -> str:
        """Median wall time of ``a`` over ``b``, each round's range, and the goal ``target`` judged."""
        per = [x["wall_s"] / y["wall_s"] for x, y in zip(rounds[a], rounds[b])]
        value = wall[a] / wall[b]
        return f"{value:.2f}x (rounds {min(per):.2f}-{max(per):.2f})" + (f" {goal(value, *target)}" if target else "")

    print(f"{stage}: ray 2 workers / 1 worker speed-up: {ratio('ray, 1 worker', 'ray, 2 workers', '>=', 1.6)}")
    print(f"{stage}: local 2 workers / 1 worker speed-up: {ratio('local, 1 worker', 'local, 2 workers')} "
          "(what the machine gives two processes now)")
    from pipeline.files import available_cores

    cores = available_cores()  # the runs' processes inherit this affinity
    for kind in ("ray", "local"):
        floor = cpu[f"{kind}, 2 workers"] / cores  # no run of that much CPU work ends sooner on this machine
        print(f"{stage}: {kind} 2 workers' CPU-seconds over the {cores} cores they may use: {floor:.1f} s, the shortest "
              f"wall time this machine allows them, so at most {wall[f'{kind}, 1 worker'] / floor:.2f}x over 1 worker "
              "here")
    print(f"{stage}: ray / local wall time (2 workers): {ratio('ray, 2 workers', 'local, 2 workers', '<=', 1.3)}")
    if "joined, 2 workers" in runs:
        print(f"{stage}: joined 2 workers / 1 worker speed-up: {ratio('joined, 1 worker', 'joined, 2 workers')}")
        print(f"{stage}: joined / local wall time (2 workers): {ratio('joined, 2 workers', 'local, 2 workers')}")


def memory_and_dedup(runs: dict, corpora: dict, text_mb: dict, para: dict, para_mb: dict, mem_sizes: list[int],
                     speed_n: int, big_n: int, work: Path, tokenizer: Path, worker_peak: dict) -> None:
    print("\npeak memory per worker under Ray (2 workers) against corpus size (goal: flat, under 1 GB), and on the "
          "larger corpus, where Ray's fixed start-up counts for less, Ray 2 workers against 1 (one round)")
    print(f"{'stage':<8}{'corpus MB':>11}{'worker MB':>11}{'main MB':>9}{'wall s':>8}{'1-worker s':>12}{'speed-up':>10}")
    for stage in ("clean", "pack"):
        r = measure(corpora[big_n], runs["ray, 2 workers"], work, stage, tokenizer)
        one = measure(corpora[big_n], runs["ray, 1 worker"], work, stage, tokenizer)
        worker_peak[stage, big_n] = r["peak_worker_mb"]
        print(f"{stage:<8}{text_mb[speed_n]:>11.0f}{worker_peak[stage, speed_n]:>11}")
        print(f"{stage:<8}{text_mb[big_n]:>11.0f}{r['peak_worker_mb']:>11}{r['peak_main_mb']:>9}{r['wall_s']:>8.1f}"
              f"{one['wall_s']:>12.1f}{one['wall_s'] / r['wall_s']:>9.2f}x")
    for stage in ("clean", "pack"):
        small, big = worker_peak[stage, speed_n], worker_peak[stage, big_n]
        if not (small and big):  # 0: the sampler saw no worker process, so there is nothing to judge
            print(f"{stage}: worker peak {small} -> {big} MB: no worker process seen in a run, goal not measured")
            continue
        print(f"{stage}: worker peak {small} -> {big} MB (1 GB = 1000 MB) {goal(max(small, big), '<', 1000)}; "
              f"flat? {big / small:.2f}x for {text_mb[big_n] / text_mb[speed_n]:.1f}x the text")

    dedup_memory(para, para_mb, mem_sizes, work)


def dedup_memory(para: dict, para_mb: dict, mem_sizes: list[int], work: Path) -> None:
    print("\ndedup memory against corpus size (local, 2 workers; one document per stdlib paragraph; peak RSS in MB)")
    print(f"{'method':<10}{'corpus MB':>11}{'docs':>9}{'main MB':>9}{'worker MB':>11}{'wall s':>8}{'identical':>11}")
    for n in mem_sizes:
        base = None
        for method in ("memory", "sharded"):
            r = measure(para[n], {"executor": {"kind": "local", "num_workers": 2},
                                  "dedup": {"method": method}}, work)
            # the records and manifest name the fingerprint, which differs by method; the data must not
            same_files = {k: v for k, v in r["files"].items() if k.endswith((".parquet", ".jsonl", "report.json"))}
            base = base or same_files
            print(f"{method:<10}{para_mb[n]:>11.0f}{r['report']['docs_in']:>9}{r['peak_main_mb']:>9}"
                  f"{r['peak_worker_mb']:>11}{r['wall_s']:>8.1f}{str(same_files == base):>11}")


def _text_mb(path: Path) -> float:
    import pyarrow.parquet as pq

    return sum(len(t.encode()) for t in pq.read_table(path, columns=["text"]).column("text").to_pylist()) / MB


def stage_tasks(table, batch_docs: int, task_bytes: int) -> int:
    """The tasks clean (``dedup.method: memory``) makes of ``table``: a span of
    row groups its workers read is one; a row group too large for one the
    stage sends run by run (:func:`pipeline.data.docs.row_spans`)."""
    from pipeline.data.docs import row_spans

    return sum(1 if span.by_worker else sum(1 for _ in table.runs(batch_docs, task_bytes, ["text"], span.start,
                                                                   span.stop, max_docs=batch_docs))
               for span in row_spans(table, task_bytes, task_docs=batch_docs))


def task_size(corpus: Path, corpus_mb: float, n_rounds: int, work: Path) -> None:
    """clean on many short documents (one per standard-library paragraph, about
    270 bytes each), 2 workers, local and on a private Ray instance: tasks of 64
    documents (``batch_docs: 64`` with no size bound, the cut clean made before
    ``task_bytes``) against the default tasks (up to 1 MB of text or 1024
    documents). The documents written must be the same; only their grouping
    into row groups may differ."""
    import pyarrow as pa

    from pipeline.data.docs import DocTable

    old = {"batch_docs": 64, "task_bytes": 10 ** 12}
    runs = {f"{kind}, {label}": {"executor": {"kind": kind, "num_workers": 2}, **cut}
            for kind in ("local", "ray") for label, cut in (("64 docs", old), ("1 MB", {}))}
    rounds: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(n_rounds):
        for name, section in runs.items():
            rounds[name].append(measure(corpus, section, work))
    first = rounds["local, 1 MB"][0]
    docs = DocTable(first["out"] / "docs", RuntimeError)
    want = pa.Table.from_batches(list(docs.iter_batches(4096)))
    same = all(pa.Table.from_batches(list(DocTable(r["out"] / "docs", RuntimeError).iter_batches(4096))).equals(want)
               and r["report"] == first["report"] for rs in rounds.values() for r in rs)
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in rounds.items()}
    print(f"\nclean on {corpus_mb:.0f} MB of short documents ({first['report']['docs_in']} documents), 2 workers, "
          f"{n_rounds} interleaved rounds, medians (same documents and report in every run: {same})")
    print(f"{'run':<18}{'tasks':>7}{'wall s':>8}{'MB/s':>8}{'main MB':>9}")
    table = DocTable(corpus, RuntimeError)
    tasks = {label: stage_tasks(table, n, size) for label, n, size in (("64 docs", 64, 10 ** 12),
                                                                      ("1 MB", 1024, 1_000_000))}
    for name, rs in rounds.items():
        print(f"{name:<18}{tasks[name.split(', ')[1]]:>7}{wall[name]:>8.1f}{corpus_mb / wall[name]:>8.2f}"
              f"{max(r['peak_main_mb'] for r in rs):>9}")
    for kind in ("local", "ray"):
        print(f"clean, {kind}: tasks of 64 docs / tasks of 1 MB wall time: "
              f"{wall[f'{kind}, 64 docs'] / wall[f'{kind}, 1 MB']:.2f}x")


def driver_cpu(corpora: dict[str, tuple[Path, float]], head: LongLivedRay, work: Path, tokenizer: Path) -> None:
    """The CPU time of a stage's own process (the driver: it reads the input,
    submits the tasks, makes the dedup decisions and writes the outputs) when
    the work runs on a joined instance, so that none of it runs there, less
    its fixed cost (the same run on the first 100 documents): the most text
    one driver can feed a stage however many workers a cluster has."""
    import pyarrow.parquet as pq

    tiny = work / "tiny.parquet"
    pq.write_table(pq.read_table(next(iter(corpora.values()))[0]).slice(0, 100), tiny)
    print("\nthe stage's own process (the driver) joined to the long-lived instance, 2 workers, one run each: "
          "its CPU seconds, its fixed cost (the run on 100 documents), and the MB of text per driver CPU-second "
          "beyond that: the most one driver can feed")
    print(f"{'stage':<15}{'corpus':<17}{'wall s':>8}{'driver CPU s':>14}{'fixed s':>9}{'MB/CPU-s':>10}")
    for stage, extra in (("clean", {}), ("clean sharded", {"dedup": {"method": "sharded"}}), ("pack", {})):
        section = {"executor": {"kind": "ray", "address": head.address, "num_workers": 2}, **extra}
        fixed = measure(tiny, section, work, stage.split()[0], tokenizer)["main_cpu_s"]
        for shape, (corpus, mb) in corpora.items():
            r = measure(corpus, section, work, stage.split()[0], tokenizer)
            print(f"{stage:<15}{shape:<17}{r['wall_s']:>8.1f}{r['main_cpu_s']:>14.2f}{fixed:>9.2f}"
                  f"{mb / (r['main_cpu_s'] - fixed):>10.1f}")


def date() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def header() -> str:
    """When and on what a run was measured, its first line."""
    return (f"{date()}  {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores; "
            "MB = 10**6 bytes, of text and of memory alike")


if __name__ == "__main__":
    main()
