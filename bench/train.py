"""Training throughput: the pretrain stage against a minimal PyTorch loop.

    python -m bench.train                      # CPU defaults: mini preset, seq 256, batch 16 (~15 min)
    python -m bench.train --preset small --device cuda --precisions bf16 --compile

Both sides train the same model on the same packed rows with the same batch:

* "stage": ``python -m stages.pretrain`` in a scratch project, exactly as DVC
  runs it (torchrun, the Trainer, CSV/console logging, checkpoints at the end);
  its tokens/s is the one it reports in metrics/pretrain.json, which counts
  training steps only (start-up, evaluation and checkpoint time excluded);
* "plain": a dozen-line loop (forward, cross-entropy, backward, clip, AdamW)
  in a fresh process of its own, timed over the same number of steps after the
  same warm-up.

They run alternately (plain, stage, plain, stage, …) and the medians are
compared, so a noisy neighbour hurts both. The goal is stage overhead ≤ 5%.
MFU is model FLOPs per token (6N + attention, pipeline.model.transformer.flops_per_token)
× tokens/s over the matmul peak measured here in fp32 and in bf16 (with
``F.linear``, the op behind the model's weight matmuls).

``--matrix`` runs the stage alone over a grid instead, for GPUs (bf16)::

    python -m bench.train --matrix --device cuda                 # small, medium x 1024, 4096 x doc mask on/off
                                                                 # x sdpa, flex, varlen x ddp, fsdp on 1 GPU
    python -m bench.train --matrix --device cuda --nproc 8 --parallelism fsdp --presets medium

Each cell is one stage run (torchrun with ``--nproc`` ranks, ``micro_batch_size:
auto`` over a global batch of ``--tokens-per-step`` tokens) and reports tokens/s
over the timed steps, MFU against ``--nproc`` × the bf16 matmul peak measured
on this device, and the peak memory per device (on a GPU the peak that torch
allocated, ``max_memory_allocated``: less than its cache and the CUDA context
that nvidia-smi shows; on a CPU the process's peak RSS). A cell that fails (out of
memory, a backend this device lacks) prints its one-line error and the grid
goes on. The table is printed as Markdown and saved to bench/results/.
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
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.model.transformer import Transformer, build_config, flops_per_token, num_params  # noqa: E402
from pipeline.training.loss import token_loss_sum  # noqa: E402
from pipeline.training.metrics import measure_peak_flops  # noqa: E402
from pipeline.training.optimizer import param_groups  # noqa: E402
from pipeline.training.precision import DTYPES, autocast  # noqa: E402
from bench.goals import goal  # noqa: E402
from tests.helpers import write_packed  # noqa: E402


def run_pretrain_stage(project: Path, params: dict) -> subprocess.CompletedProcess:
    """``python -m stages.pretrain`` in ``project`` with ``params`` as its params.yaml
    (no progress bars, no MLflow); its output captured."""
    import yaml  # lazily: the GPU machine may lack it (README), and only stage runs need it

    (project / "params.yaml").write_text(yaml.safe_dump(params))
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "PIPELINE_PROGRESS": "0", "PIPELINE_TRACKING": "0"}
    return subprocess.run([sys.executable, "-m", "stages.pretrain"], cwd=project, env=env, capture_output=True,
                          text=True)


def plain_loop(args, packed: Path, steps: int, warmup: int) -> float:
    """Tokens/s of the minimal loop, run in a fresh process like the stage is."""
    cmd = [sys.executable, "-m", "bench.train", "--child-plain", str(packed), str(steps), str(warmup),
           "--preset", args.preset, "--vocab", str(args.vocab), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--device", args.device, "--precisions", args.precision]
    if args.compile:
        cmd.append("--compile")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())})  # as the launcher sets it
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return float(out.stdout.strip().splitlines()[-1])


def _plain_loop(args, packed: Path, steps: int, warmup: int) -> float:
    """Tokens/s of the minimal loop over ``steps`` steps after ``warmup``."""
    from pipeline.data.shards import PackedRows

    device = torch.device(args.device)
    rows = PackedRows(packed / "train")
    cfg = build_config(args.preset, args.vocab, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), fused=True)
    fwd = torch.compile(model) if args.compile else model
    rng = np.random.default_rng(0)
    precision = args.precision
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")  # as the stage does in fp16

    def step() -> None:
        b = rows.batch(rng.choice(len(rows), args.batch, replace=False), device)
        with autocast(device, precision):
            logits = fwd(b["input_ids"], segment_ids=b["segment_ids"])
        loss = token_loss_sum(logits, b["targets"]) / b["targets"].numel()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return steps * args.batch * args.seq_len / (time.perf_counter() - t0)


def stage_run(args, project: Path, steps: int, warmup: int) -> float:
    """Tokens/s the real stage reports, over its steps after ``warmup`` (log_every
    = warmup makes the first logged window the warm-up, the rest the timed part)."""
    for p in ("models", "metrics", "plots"):
        subprocess.run(["rm", "-rf", str(project / p)], check=True)
    params = {"pretrain": {
        "model": {"preset": args.preset, "max_seq_len": args.seq_len},
        "compute": {"device": args.device, "precision": args.precision, "compile": args.compile},
        "batch": {"micro_batch_size": args.batch},
        "schedule": {"max_steps": warmup + steps, "warmup_steps": 1},
        "eval": {"every": 10**6, "rows": args.batch},
        "checkpoint": {"every": 10**6},
        "logging": {"every": warmup, "track": False, "peak_flops": 1.0e12},
    }}
    out = run_pretrain_stage(project, params)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    import csv

    with open(project / "plots" / "pretrain.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f)]
    return timed_tokens_per_s(rows, warmup)


def timed_tokens_per_s(rows: list[dict], warmup: int) -> float:
    """Tokens/s of the stage's logged windows after step ``warmup`` (the first
    window, at step ``warmup``, includes compile and first touch): all their
    tokens over all their time. A window's rate is weighted by its steps, since
    the last one (logged at ``max_steps``) is shorter when the timed steps are not
    a multiple of ``warmup``."""
    steps = [int(r["step"]) for r in rows]
    windows = [(step - prev, float(r["tokens_per_s"])) for prev, step, r in zip([0, *steps], steps, rows)
               if step > warmup]
    return statistics.harmonic_mean([rate for _, rate in windows], weights=[n for n, _ in windows])


def compare(args, precision: str, steps: int) -> dict:
    """One precision: alternate plain and stage runs, return the medians and MFU."""
    args = argparse.Namespace(**{**vars(args), "precision": precision})
    warmup = args.warmup
    slow_bf16 = precision == "bf16" and args.device == "cpu"  # see --bf16-cpu-steps
    if slow_bf16:
        warmup, args.repeats = 2, min(args.repeats, 2)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        n_docs = max(2000, 4 * args.batch * (steps + warmup) * args.seq_len // 20)
        packed = write_packed(project / "data" / "packed", vocab=args.vocab, seq_len=args.seq_len, n_docs=n_docs)
        plain, stage = [], []
        for i in range(args.repeats):
            plain.append(plain_loop(args, packed, steps, warmup))
            stage.append(stage_run(args, project, steps, warmup))
            print(f"{precision} repeat {i + 1}: plain {plain[-1]:,.0f} tok/s, stage {stage[-1]:,.0f} tok/s", flush=True)
    cfg = build_config(args.preset, args.vocab, max_seq_len=args.seq_len)
    fpt = flops_per_token(cfg, args.seq_len)
    peak = measure_peak_flops(device, DTYPES[precision], seconds=1.0)
    return {"precision": precision, "steps": steps, "repeats": args.repeats, **summarise(plain, stage, fpt, peak)}


def summarise(plain: list[float], stage: list[float], flops_per_token: float, peak: float) -> dict:
    """Medians of the runs' tokens/s, the stage's over the plain loop's (below 1:
    the stage is slower, by ``stage_overhead_pct``), and the stage's MFU."""
    p_med, s_med = statistics.median(plain), statistics.median(stage)
    return {
        "plain_tokens_per_s": p_med, "stage_tokens_per_s": s_med,
        "stage_over_plain": s_med / p_med, "stage_overhead_pct": 100 * (1 - s_med / p_med),
        "flops_per_token": flops_per_token, "matmul_peak_flops": peak, "mfu": s_med * flops_per_token / peak,
        "plain_runs": plain, "stage_runs": stage,
    }


def matrix_cell(args, project: Path, preset: str, seq_len: int, doc_mask: bool, attention: str,
                parallelism: str) -> dict:
    """One stage run of the grid: tokens/s over the steps after warm-up, and the peak memory per device (MiB)."""
    import csv

    for p in ("models", "metrics", "plots"):
        subprocess.run(["rm", "-rf", str(project / p)], check=True)
    rows = max(1, args.tokens_per_step // seq_len)
    accum = max(1, rows // 16 // args.nproc)  # micro_batch_size auto keeps 16 x accum x ranks rows per step
    params = {"pretrain": {
        "model": {"preset": preset, "max_seq_len": seq_len},
        "data": {"doc_mask": doc_mask},
        "compute": {"device": args.device, "precision": args.matrix_precision, "compile": args.compile,
                    "attention": attention, "parallelism": parallelism,
                    "activation_checkpointing": args.activation_checkpointing},
        "launch": {"nproc_per_node": args.nproc},
        "batch": {"micro_batch_size": "auto", "grad_accum_steps": accum},
        "schedule": {"max_steps": args.warmup + args.steps, "warmup_steps": 1},
        "eval": {"every": 10**6, "rows": 1},
        "checkpoint": {"every": 10**6},
        "logging": {"every": args.warmup, "track": False, "peak_flops": 1.0e12},
    }}
    out = run_pretrain_stage(project, params)
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        return {"error": (errors or lines or ["failed"])[0][-300:]}
    with open(project / "plots" / "pretrain.csv", newline="") as f:
        logged = list(csv.DictReader(f))
    return {"tokens_per_s": timed_tokens_per_s(logged, args.warmup),
            "peak_mem_mb": max(float(r["peak_mem_mb"]) for r in logged),
            "rows_per_step": 16 * accum * args.nproc}


def matrix(args) -> None:
    """The grid of --matrix (see the module docstring)."""
    import itertools

    device = torch.device(args.device)
    dtype = DTYPES[args.matrix_precision]
    peak = measure_peak_flops(device, dtype, seconds=2.0)
    print(f"measured {args.matrix_precision} matmul peak: {peak / 1e12:,.1f} TFLOP/s per device", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        for seq_len in args.seq_lens:
            n_docs = max(2000, 3 * args.tokens_per_step * (args.steps + args.warmup + 2) // 20)
            packed = project / "data" / "packed"
            subprocess.run(["rm", "-rf", str(packed)], check=True)
            write_packed(packed, vocab=args.vocab, seq_len=seq_len, n_docs=n_docs)
            for preset, doc_mask, attention, parallelism in itertools.product(
                    args.presets, args.doc_mask, args.attention, args.parallelism):
                cfg = build_config(preset, args.vocab, max_seq_len=seq_len)
                cell = {"preset": preset, "params": num_params(Transformer(cfg)), "seq_len": seq_len,
                        "doc_mask": doc_mask == "on", "attention": attention, "parallelism": parallelism,
                        "nproc": args.nproc}
                cell.update(matrix_cell(args, project, preset, seq_len, doc_mask == "on", attention, parallelism))
                if "tokens_per_s" in cell:
                    cell["mfu"] = cell["tokens_per_s"] * flops_per_token(cfg, seq_len) / (peak * args.nproc)
                results.append(cell)
                print(json.dumps(cell), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "torch": torch.__version__, "precision": args.matrix_precision, "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing, "matmul_peak_flops": peak,
        "tokens_per_step": args.tokens_per_step, "steps": args.steps, "warmup": args.warmup, "results": results,
    }
    print()
    print(f"| preset | seq | doc mask | attention | parallelism x {args.nproc} | tokens/s | MFU | peak allocated / device |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        what = (f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_mem_mb'] / 1024:,.1f} GiB"
                if "tokens_per_s" in r else f"failed: {r['error']} | | ")
        print(f"| {r['preset']} | {r['seq_len']} | {'on' if r['doc_mask'] else 'off'} | {r['attention']} | "
              f"{r['parallelism']} | {what} |")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"train-matrix-{args.device}-{args.nproc}.json").write_text(json.dumps(report, indent=2))


def result_line(r: dict) -> str:
    """One precision's summary from :func:`compare`'s medians, the overhead goal judged."""
    return (f"{r['precision']}: stage {r['stage_tokens_per_s']:,.0f} tok/s, plain {r['plain_tokens_per_s']:,.0f} "
            f"tok/s, stage/plain = {r['stage_over_plain']:.3f}, overhead {r['stage_overhead_pct']:.1f}% "
            f"{goal(r['stage_overhead_pct'], '<=', 5)}; MFU {r['mfu']:.1%} of the measured {r['precision']} "
            f"matmul peak ({r['matmul_peak_flops'] / 1e9:,.1f} GFLOP/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run (fp32 / GPU)")
    ap.add_argument("--bf16-cpu-steps", type=int, default=4,
                    help="timed steps for bf16 on a CPU (2 warm-up steps, 2 repeats): without "
                         "AVX512-BF16/AMX it is many times slower than fp32")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child-plain", nargs=3, metavar=("PACKED", "STEPS", "WARMUP"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--compile", action="store_true")
    grid = ap.add_argument_group("--matrix: the stage over a grid (GPU)")
    grid.add_argument("--matrix", action="store_true")
    grid.add_argument("--presets", nargs="+", default=["small", "medium"])
    grid.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096])
    grid.add_argument("--doc-mask", nargs="+", choices=["on", "off"], default=["on", "off"])
    grid.add_argument("--attention", nargs="+", choices=["sdpa", "flex", "varlen"], default=["sdpa", "flex", "varlen"])
    grid.add_argument("--parallelism", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    grid.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) per run")
    grid.add_argument("--tokens-per-step", type=int, default=65536, help="global batch in tokens")
    grid.add_argument("--matrix-precision", choices=["bf16", "fp32"], default="bf16")
    grid.add_argument("--activation-checkpointing", action="store_true")
    args = ap.parse_args()
    if args.matrix:
        matrix(args)
        return
    if args.child_plain:
        packed, steps, warmup = args.child_plain
        args.precision = args.precisions[0]
        print(_plain_loop(args, Path(packed), int(steps), int(warmup)))
        return
    device = torch.device(args.device)
    cfg = build_config(args.preset, args.vocab, max_seq_len=args.seq_len)
    results = []
    for precision in args.precisions:
        steps = args.bf16_cpu_steps if precision == "bf16" and device.type == "cpu" else args.steps
        results.append(compare(args, precision, steps))
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
        "preset": args.preset, "params": num_params(Transformer(cfg)), "seq_len": args.seq_len,
        "batch": args.batch, "compile": args.compile, "results": results,
    }
    print(json.dumps(report, indent=2))
    print()
    for r in results:
        print(result_line(r))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"train-{args.device}-{args.preset}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
