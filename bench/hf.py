"""Hugging Face import benchmark: load memory and time, and training speed, against transformers.

    python -m bench.hf                        # Qwen2.5-0.5B's shape in bf16 (~1 GB file), CPU (~10 min)
    python -m bench.hf --quick                # a tiny Qwen2 shape (~1 min)
    python -m bench.hf --family llama --hidden 2048 --layers 16 --heads 32 --kv-heads 8 \\
        --intermediate 8192 --vocab 128256    # Llama 3.2 1B's shape

A random model of the given shape is built with transformers' own config class
on the meta device, filled with seeded bf16 noise and saved with
``save_pretrained`` (nothing is downloaded). Then, each in a fresh process:

* load: ``pipeline.model.hf_adapter.load_hf_model`` against transformers'
  ``AutoModelForCausalLM.from_pretrained(..., dtype=float32)``: wall time and
  peak resident memory (VmHWM), the latter also as a ratio to the model's fp32
  parameter bytes after subtracting the process's resident memory before
  loading (Python, torch). The aim for ours is one fp32 copy plus the pages of
  the file mapping, 1 + (file bytes / fp32 bytes) = 1.5 for a bf16 file, plus
  the one tensor being converted at a time.
* train: forward, cross-entropy, backward and a fused AdamW step on one
  ``--batch`` x ``--seq-len`` batch, our model against transformers' model of the
  same weights: tokens/s over ``--steps`` steps after ``--warmup``, and peak
  resident memory (params + grads + two Adam moments = 4 fp32 copies, plus
  activations).

The two sides alternate (ours, theirs, ours, theirs) and every number is
printed side by side with its ratio.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 1 << 20  # every memory and file size here is in MiB (2**20 bytes), and labelled so
# Qwen2.5-0.5B (config.json of the published model): tied embeddings, q/k/v biases.
DEFAULT_SHAPE = dict(family="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
                     head_dim=None, tie=True)
QUICK_SHAPE = dict(family="qwen2", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab=8192,
                   head_dim=None, tie=True)


def memory_mb(status: str | None = None) -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB (VmRSS, VmHWM:
    the kernel's kB are KiB), from /proc/self/status or the ``status`` text given."""
    status = (Path("/proc/self/status").read_text() if status is None else status).splitlines()
    values = {line.split(":")[0]: float(line.split()[1]) / 1024 for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return values["VmRSS"], values["VmHWM"]


def hf_config_object(shape: dict):
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    kwargs = dict(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
                  vocab_size=shape["vocab"], tie_word_embeddings=shape["tie"], max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if shape["head_dim"] or shape["family"] == "qwen3":
        kwargs["head_dim"] = shape["head_dim"] or shape["hidden"] // shape["heads"]
    if shape["family"] == "mistral":
        kwargs["sliding_window"] = None
    return classes[shape["family"]](**kwargs)


def build_folder(shape: dict, folder: Path) -> None:
    """A random bf16 model of ``shape`` saved with save_pretrained, without ever
    holding more than the bf16 weights."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config_object(shape), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(folder, safe_serialization=True)


# --------------------------------------------------------------------------- children (fresh processes)


def child(mode: str, side: str, folder: Path, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if side == "ours":
        from pipeline.model.hf_adapter import load_hf_model

        def load():
            return load_hf_model(folder)[1]

        def logits(model, idx):
            return model(idx)
    else:
        import transformers

        def load():
            return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

        def logits(model, idx):
            return model(input_ids=idx).logits

    before, _ = memory_mb()  # interpreter + torch (+ transformers) imported
    t0 = time.perf_counter()
    model = load()
    load_s = time.perf_counter() - t0
    _, load_peak = memory_mb()
    n_params = sum(p.numel() for p in model.parameters())
    out = {"load_s": load_s, "rss_before_mb": before, "load_peak_mb": load_peak, "params": n_params,
           "fp32_mb": n_params * 4 / MB}
    if mode == "load":
        return out

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        out_logits = logits(model, idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(out_logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    out.update(tokens_per_s=args.batch * args.seq_len * len(times) / sum(times), step_s=statistics.median(times),
               train_peak_mb=memory_mb()[1], loss=loss.item())
    return out


def run_child(mode: str, side: str, folder: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "bench.hf", "--child", mode, side, str(folder), "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{side} {mode} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


def summarise(runs: dict[str, dict[str, list[dict]]], fp32_mb: float) -> dict:
    """Each side's medians over its runs (``runs[mode][side]``, the children's
    dicts; memory in MiB), the memory over the fp32 parameter bytes, and
    ``ours_over_transformers``: ours over theirs, figure by figure (time and
    memory: below 1 is ours smaller; tokens/s: above 1 is ours faster)."""
    def med(mode: str, side: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode][side])

    summary = {}
    for side in ("ours", "transformers"):
        loaded = med("load", side, "load_peak_mb") - med("load", side, "rss_before_mb")
        summary[side] = {
            "load_s": med("load", side, "load_s"),
            "load_peak_mb": med("load", side, "load_peak_mb"),
            "rss_before_load_mb": med("load", side, "rss_before_mb"),
            "load_added_mb": loaded,
            "load_added_over_fp32": loaded / fp32_mb,
            "train_tokens_per_s": med("train", side, "tokens_per_s"),
            "train_peak_mb": med("train", side, "train_peak_mb"),
            "train_peak_over_fp32": med("train", side, "train_peak_mb") / fp32_mb,
        }
    o, t = summary["ours"], summary["transformers"]
    summary["ours_over_transformers"] = {k: o[k] / t[k] for k in ("load_s", "load_added_mb", "train_tokens_per_s",
                                                                  "train_peak_mb")}
    return summary


def loss_line(runs: dict[str, dict[str, list[dict]]]) -> str:
    """Both sides' last training losses, run by run: the same weights and batch
    on both sides, so after the same steps they should agree closely."""
    return "last training loss, ours / transformers: " + ", ".join(
        f"{a['loss']:.6f} / {b['loss']:.6f}" for a, b in zip(runs["train"]["ours"], runs["train"]["transformers"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny shape instead of Qwen2.5-0.5B's")
    ap.add_argument("--family", choices=["llama", "qwen2", "qwen3", "mistral"])
    for name in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab", "head-dim"):
        ap.add_argument(f"--{name}", type=int)
    ap.add_argument("--untied", action="store_true", help="separate lm_head (default: tied, as Qwen2.5-0.5B)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="runs per side (alternating)")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "SIDE", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, side, folder = args.child
        print(json.dumps(child(mode, side, Path(folder), args)))
        return

    shape = dict(QUICK_SHAPE if args.quick else DEFAULT_SHAPE)
    for key in ("family", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "head_dim"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    shape["tie"] = not args.untied
    if args.quick:
        args.steps, args.repeats = 2, 1

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        build_folder(shape, folder)
        file_mb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / MB
        print(f"built a random {shape['family']} model, {file_mb:,.0f} MiB of bf16 safetensors, in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        runs: dict[str, dict[str, list[dict]]] = {m: {"ours": [], "transformers": []} for m in ("load", "train")}
        for r in range(args.repeats):
            for mode in ("load", "train"):
                for side in ("ours", "transformers"):
                    runs[mode][side].append(run_child(mode, side, folder, args))
                    res = runs[mode][side][-1]
                    extra = (f", {res['tokens_per_s']:.0f} tok/s, peak {res['train_peak_mb']:,.0f} MiB"
                             if mode == "train" else "")
                    print(f"repeat {r + 1} {mode:5s} {side:12s}: load {res['load_s']:.1f} s, "
                          f"peak {res['load_peak_mb']:,.0f} MiB{extra}", flush=True)

    fp32_mb = runs["load"]["ours"][0]["fp32_mb"]
    summary = summarise(runs, fp32_mb)
    import torch

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "shape": shape, "params": runs["load"]["ours"][0]["params"], "fp32_mb": fp32_mb, "file_mb": file_mb,
        "memory_unit": "MiB", "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "repeats": args.repeats,
        **summary,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    print()
    o, t, ratio = summary["ours"], summary["transformers"], report["ours_over_transformers"]
    aim = 1 + file_mb / fp32_mb
    print(f"{report['params'] / 1e6:,.0f}M parameters = {fp32_mb:,.0f} MiB in fp32, file {file_mb:,.0f} MiB (bf16)")
    print(f"load  ours {o['load_s']:.1f} s, +{o['load_added_mb']:,.0f} MiB resident = {o['load_added_over_fp32']:.2f}x "
          f"fp32 (one fp32 copy + the whole file mapped: {aim:.2f}x); transformers {t['load_s']:.1f} s, "
          f"+{t['load_added_mb']:,.0f} MiB = {t['load_added_over_fp32']:.2f}x; ours/transformers time "
          f"{ratio['load_s']:.2f}, memory {ratio['load_added_mb']:.2f}")
    print(f"train ours {o['train_tokens_per_s']:.0f} tok/s, peak {o['train_peak_mb']:,.0f} MiB = "
          f"{o['train_peak_over_fp32']:.2f}x fp32; transformers {t['train_tokens_per_s']:.0f} tok/s, peak "
          f"{t['train_peak_mb']:,.0f} MiB = {t['train_peak_over_fp32']:.2f}x; ours/transformers speed "
          f"{ratio['train_tokens_per_s']:.2f}, memory {ratio['train_peak_mb']:.2f} "
          f"(batch {args.batch} x {args.seq_len}, fused AdamW, fp32)")
    print(loss_line(runs))
    if args.quick:
        print(f"--quick: {args.repeats} run a side of {args.steps} timed steps: a smoke test of the bench, "
              "not a measurement (its speed ratio swings many-fold on a busy machine)")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    name = "quick" if args.quick else f"{shape['family']}-{shape['hidden']}x{shape['layers']}"
    (out / f"hf-{name}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
