"""How much memory a training run needs per device, and the micro-batch that fits.

    python -m pipeline.training.memory --preset medium --seq-len 2048 --gpus 8
    python -m pipeline.training.memory                  # every preset, seq_len 1024

prints, per preset, the bytes per device of the parameters, gradients, AdamW
state and activations, for DDP and for FSDP over N devices, with and without
activation checkpointing, in bf16 (autocast) and fp32.

The model of memory (bytes; N parameters, N_L per block, L blocks, b rows of T
tokens, V vocabulary):

* parameters: fp32 master weights, 4N; under bf16 autocast the matmul weights
  also get a bf16 working copy, 2N. FSDP: the sharded 4N / n, plus what it
  gathers in the compute dtype (2 bytes in bf16, 4 in fp32): two blocks in
  flight with prefetch, 2 * N_L, and the root unit (embeddings, final norm,
  head), which FSDP2 keeps gathered from its forward to its backward.
* gradients: fp32, 4N (FSDP: 4N / n).
* optimizer: AdamW's two fp32 moments, 8N (FSDP: 8N / n).
* activations: what autograd keeps for backward, counted tensor by tensor for
  our block (:func:`activation_bytes_per_token`), plus the output head's
  logits and cross-entropy, which dominate small models with large
  vocabularies, plus the dense (B, 1, T, T) document mask of the sdpa path.
  With activation checkpointing a block keeps only its input, and one block's
  activations live at a time, recomputed in backward.

Not counted: the CUDA context and allocator fragmentation (budget about 1-2 GB
per GPU), DDP's gradient buckets (another 4N with more than one rank) and the
framework's own code. ``tests/pipeline/training/test_memory.py`` checks the
total against the measured peak of one CPU step for the tiny and mini presets.

``batch.micro_batch_size: auto`` (:func:`choose_micro_batch`) keeps the global
batch that the default micro-batch (16) would give, and splits it into the
largest micro-batch that fits: on CPU from this estimate against the available
memory (a container's cgroup limit, where lower); on CUDA by probing forward
and backward passes with an OOM back-off (:func:`probe_micro_batch`), as
Hugging Face's ``auto_find_batch_size`` does.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.model.transformer import PRESETS, ModelConfig, build_config, num_params

GIB = 1024 ** 3
AUTO_TARGET_MICRO = 16  # micro_batch_size: auto keeps the global batch of this default micro-batch
CPU_HEADROOM = 0.8  # share of the available memory a CPU run may plan to use


@dataclass(frozen=True)
class Estimate:
    """Bytes per device for one training step."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def activation_bytes_per_token(c: ModelConfig, precision: str) -> int:
    """Bytes one block keeps per token for backward: the fp32 residual stream and
    norms (4 bytes per element), the matmul inputs and outputs in the autocast
    dtype (2 in bf16, 4 in fp32)."""
    p = 2 if precision in ("bf16", "fp16") else 4
    d, dq, dkv, f = c.d_model, c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.ffn_hidden
    norms = 2 * (2 * 4 * d + p * d)  # per RMSNorm: input, normalised value (fp32), output cast for the matmul
    qkv = p * (dq + 2 * dkv) * 2  # projections, then q and k rotated (v kept as is, counted twice for simplicity)
    copied_kv = 2 * p * dq if c.n_kv_head != c.n_head else 0  # repeat_interleave'd k and v (CPU sdpa path)
    attn_out = 2 * p * dq  # SDPA output and its contiguous copy for wo
    mlp = 4 * p * f  # w1 out, silu(w1 out), w3 out, their product
    return norms + qkv + copied_kv + attn_out + mlp


def estimate(c: ModelConfig, micro_batch: int, seq_len: int, *, precision: str = "bf16", gpus: int = 1,
             fsdp: bool = False, checkpointing: bool = False, doc_mask: bool = True, dense_mask: bool = True) -> Estimate:
    """Per-device memory of one step of ``micro_batch`` rows of ``seq_len`` tokens.
    ``dense_mask``: the sdpa backend's (B, 1, T, T) mask (flex and varlen have none)."""
    n = num_params(c)
    n_layer_params = (n - c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)) // max(1, c.n_layer)
    half = precision in ("bf16", "fp16")
    shard = gpus if fsdp else 1
    params = 4 * n // shard
    if fsdp:  # gathered in the compute dtype: two blocks (prefetch), and the root unit (embeddings, head, final norm)
        root = n - c.n_layer * n_layer_params
        params += (2 if half else 4) * (2 * n_layer_params + root)
    elif half:
        params += 2 * n
    tokens = micro_batch * seq_len
    block = activation_bytes_per_token(c, precision) * tokens
    blocks = (c.n_layer * 4 * c.d_model * tokens + block) if checkpointing else c.n_layer * block
    # head: logits in the autocast dtype, their fp32 copy, log-softmax (kept), and in backward its gradient
    head = tokens * c.vocab_size * ((2 if half else 0) + 4 + 4 + 4) + tokens * c.d_model * 4 * 3
    mask = micro_batch * seq_len * seq_len * (1 + 4) if doc_mask and dense_mask else 0  # bool mask + its float form
    return Estimate(params, 4 * n // shard, 8 * n // shard, blocks + head + mask)


# --------------------------------------------------------------------------- the micro-batch


def divisors_up_to(n: int, limit: int | None = None) -> list[int]:
    """Divisors of n, largest first (at most ``limit``)."""
    return [m for m in range(n, 0, -1) if n % m == 0 and (limit is None or m <= limit)]


def available_cpu_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory;
    less where this process's cgroup (a container's memory limit) leaves less
    (:func:`cgroup_available_bytes`): /proc/meminfo shows the host's memory, and
    a plan made from it is killed by the container's OOM killer without a word."""
    machine = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if machine is None:
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limited = cgroup_available_bytes()
    return machine if limited is None else min(machine, limited)


CGROUP_V2 = ("memory.max", "memory.current", "inactive_file")  # limit, usage, the memory.stat key of reclaimable cache
CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def cgroup_available_bytes(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroups still allow: the least, over the
    cgroup and its ancestors, of the limit minus the working set (usage less
    inactive file cache, which the kernel reclaims first; Kubernetes counts it
    so). cgroup v2 (memory.max) and v1 (memory.limit_in_bytes). None where no
    limit is set or none can be read."""
    base = Path(root)
    candidates: list[tuple[Path, tuple[str, str, str]]] = []
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2), "4:memory:/path" (v1)
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1], Path(parts[2].lstrip("/")).parts
        if controllers == "":  # v2: the limits of the parents apply too
            candidates += [(base.joinpath(*rel[:i]), CGROUP_V2) for i in range(len(rel), -1, -1)]
        elif "memory" in controllers.split(","):  # v1: in a container the mount's root is often its own cgroup
            candidates += [((base / "memory").joinpath(*rel), CGROUP_V1), (base / "memory", CGROUP_V1)]
    least = None
    for folder, (limit_name, usage_name, inactive_name) in candidates:
        try:
            limit = (folder / limit_name).read_text().strip()
            if limit == "max":
                continue
            working_set = int((folder / usage_name).read_text()) - _stat(folder / "memory.stat", inactive_name)
            free = int(limit) - max(0, working_set)
        except (OSError, ValueError):
            continue
        least = free if least is None else min(least, free)
    return None if least is None else max(0, least)


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat ("key value" lines); 0 where absent."""
    try:
        return next((int(line.split()[1]) for line in path.read_text().splitlines() if line.split()[:1] == [key]), 0)
    except (OSError, ValueError, IndexError):
        return 0


def choose_micro_batch(c: ModelConfig, seq_len: int, grad_accum: int, *, precision: str, ranks_per_node: int,
                       available: int, checkpointing: bool = False, doc_mask: bool = True,
                       fsdp_world: int | None = None) -> tuple[int, int]:
    """CPU: (micro_batch, grad_accum) with micro_batch x grad_accum equal to
    AUTO_TARGET_MICRO x ``grad_accum``, the largest micro-batch whose estimate
    fits in CPU_HEADROOM of ``available`` shared by ``ranks_per_node`` ranks.
    ``fsdp_world``: the model is sharded over that many ranks (FSDP).
    Raises MemoryError (one line) when not even one row fits."""
    rows = AUTO_TARGET_MICRO * grad_accum
    budget = CPU_HEADROOM * available / ranks_per_node
    sharding = {"fsdp": True, "gpus": fsdp_world} if fsdp_world else {}
    for m in divisors_up_to(rows):
        if estimate(c, m, seq_len, precision=precision, checkpointing=checkpointing, doc_mask=doc_mask,
                    **sharding).total <= budget:
            return m, rows // m
    one = estimate(c, 1, seq_len, precision=precision, checkpointing=checkpointing, doc_mask=doc_mask,
                   **sharding).total
    raise MemoryError(f"batch.micro_batch_size auto: one row of {seq_len} tokens needs about {one / GIB:.2f} GiB, "
                      f"more than {budget / GIB:.2f} GiB available per rank; use a smaller model or seq_len")


def probes(device) -> bool:
    """Whether ``micro_batch_size: auto`` probes real passes on ``device`` (CUDA,
    which reports running out of memory) rather than trusting :func:`estimate`."""
    return device.type == "cuda"


def optimizer_state_bytes(model) -> int:
    """Bytes of AdamW's two moments for ``model``'s parameters on this rank (its
    shards under FSDP), each the size and dtype of its parameter. torch makes
    them at the first optimizer step, after any probe of the micro-batch."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # DTensor: this rank's shard
    return 2 * sum(p.numel() * p.element_size() for p in local)


def hold(nbytes: int, device):
    """A placeholder of ``nbytes`` on ``device``, so that a probe runs with that much less memory."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def probe_micro_batch(step: Callable[[int], None], rows: int, *, start: int | None = None,
                      agree: Callable[[int], int] = lambda m: m) -> int:
    """CUDA: the largest divisor of ``rows`` for which ``step(m)`` (a forward and
    backward pass over m rows, gradients discarded) runs without running out of
    memory, trying from ``start`` (default ``rows``) downwards and emptying the
    cache after each OOM. ``agree`` makes every rank take the same value (the
    minimum over ranks; an all-reduce). Raises MemoryError when one row fails."""
    import torch

    for m in divisors_up_to(rows, start):
        try:
            step(m)
            ok = m
        except torch.cuda.OutOfMemoryError:
            ok = 0
        torch.cuda.empty_cache()
        ok = agree(ok)
        if ok:
            return min(ok, m)
    raise MemoryError("batch.micro_batch_size auto: one row does not fit on this GPU; use activation "
                      "checkpointing, a smaller seq_len or FSDP")


# --------------------------------------------------------------------------- the table


def table(c: ModelConfig, name: str, micro_batch: int, seq_len: int, gpus: int, precisions: list[str]) -> str:
    head = (f"{name}: {num_params(c) / 1e6:.1f}M params, micro-batch {micro_batch} x {seq_len} tokens, "
            f"FSDP over {gpus}; GiB per device")
    lines = [head, f"{'precision':9} {'sharding':10} {'act ckpt':8} {'params':>8} {'grads':>8} {'optim':>8} "
             f"{'activ':>8} {'total':>8}"]
    for precision in precisions:
        for fsdp in (False, True):
            for ac in (False, True):
                e = estimate(c, micro_batch, seq_len, precision=precision, gpus=gpus, fsdp=fsdp, checkpointing=ac,
                             dense_mask=False)
                lines.append(f"{precision:9} {('fsdp/' + str(gpus)) if fsdp else 'ddp':10} {'on' if ac else 'off':8} "
                             + " ".join(f"{v / GIB:8.2f}" for v in (e.params, e.grads, e.optimizer, e.activations,
                                                                    e.total)))
    return "\n".join(lines)


def _positive(text: str) -> int:
    """argparse type: a whole number of at least 1 (0 GPUs divided by zero; negatives printed negative GiB)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.training.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), action="append", help="repeatable; default: every preset")
    ap.add_argument("--vocab-size", type=_positive, default=50304)
    ap.add_argument("--seq-len", type=_positive, default=1024)
    ap.add_argument("--micro-batch", type=_positive, default=8)
    ap.add_argument("--gpus", type=_positive, default=8, help="devices FSDP shards over")
    ap.add_argument("--precision", choices=["bf16", "fp32"], action="append", help="default: both")
    args = ap.parse_args(argv)
    for name in args.preset or list(PRESETS):
        c = build_config(name, args.vocab_size, max_seq_len=max(args.seq_len, PRESETS[name]["max_seq_len"]))
        print(table(c, name, args.micro_batch, args.seq_len, args.gpus, args.precision or ["bf16", "fp32"]), "\n")
    print("Activations assume flex/varlen (no dense mask); the sdpa backend adds 5 bytes x micro x seq_len^2 "
          "for its document mask. Not counted: CUDA context and fragmentation (~1-2 GiB), DDP buckets (4 B/param).")


if __name__ == "__main__":
    main()
