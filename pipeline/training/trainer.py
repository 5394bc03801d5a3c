"""The training loop shared by pretrain and sft.

One ``Trainer`` runs on every rank (torchrun starts them; see pipeline/training/torchrun.py):
DDP with gradient accumulation (``no_sync`` on all but the last micro-batch),
AMP (bf16 / fp16 with a GradScaler / fp32), gradient clipping, fused AdamW with
no weight decay on norms, biases and embeddings, a cosine schedule with linear
warmup and a floor, atomic checkpoints with every rank's RNG state, and exact
resume. Rank 0 reports to the console, to ``plots/<stage>.csv`` (appended live)
and to MLflow.

Loss normalisation: each micro-batch contributes ``sum(token losses) ·
world / (valid tokens in the whole global batch)``, so after DDP's gradient
averaging the update is the gradient of the mean token loss over the global
batch, however the batch is split over ranks and micro-batches. That is what
makes "2 ranks × 1 micro-batch" and "1 rank × 2 micro-batches" the same update,
and it weights SFT's masked tokens correctly.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import logging
import math
import os
import resource
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed
from pipeline.config import flatten
from pipeline.data.shards import PackedRows
from pipeline.training.sampler import GlobalOrder, eval_rows
from pipeline.training.torchrun import LaunchConfig, hold_shared
from pipeline.model.transformer import ModelConfig, Transformer, flops_per_token, num_params
from pipeline.progress import progress

log = logging.getLogger("pipeline.training.trainer")

Precision = Literal["auto", "bf16", "fp16", "fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class TrainConfig(LaunchConfig):
    """Everything the loop needs (launch settings come from LaunchConfig); pretrain
    and sft add their own keys on top."""

    # device and numerics
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    precision: Precision = Field("auto", description="auto: bf16 where the device supports it (CPU included), else fp32; fp16 uses a GradScaler")
    compile: bool = Field(False, description="torch.compile the model")
    activation_checkpointing: bool = Field(False, description="recompute each block in backward to save memory")
    doc_mask: bool = Field(True, description="block-diagonal causal attention inside packed rows")
    seed: int = Field(1337, description="initial weights and the global sample order")
    # batch and schedule
    micro_batch_size: int = Field(16, ge=1, description="rows per rank per forward pass")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step (no gradient sync until the last)")
    max_steps: int = Field(600, ge=1, description="optimizer steps; the cosine schedule ends here")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    min_lr: float = Field(3e-4, ge=0, description="floor of the cosine schedule")
    warmup_steps: int = Field(50, ge=0, description="linear warmup from 0 to lr")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay of linear weights (not norms, biases, embeddings)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    # faults
    spike_factor: float = Field(2.0, gt=1, description="a loss above factor × its running mean counts as a spike")
    # reporting
    log_every: int = Field(10, ge=1, description="steps between console/CSV/MLflow reports")
    eval_every: int = Field(200, ge=1, description="steps between val-loss evaluations (and at the end)")
    eval_rows: int | None = Field(512, ge=1, description="val rows per evaluation; null = the whole split")
    peak_flops: float | None = Field(None, gt=0, description="peak FLOP/s per device for MFU; null = measure a matmul")
    track: bool = Field(True, description="log to MLflow (rank 0)")
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, GPU with pynvml)")
    # checkpoints
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints (and at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept; older ones are deleted")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})")
        return self


# Keys that change how a run is executed or reported, not what it computes: a
# checkpoint written under other values of these is still resumed.
EXECUTION_KEYS = {
    "nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "device", "compile",
    "activation_checkpointing", "log_every", "eval_every", "eval_rows", "peak_flops", "track", "system_metrics",
    "checkpoint_every", "keep_checkpoints", "micro_batch_size", "grad_accum_steps",
}


def run_fingerprint(cfg: TrainConfig, model_cfg: ModelConfig, global_batch: int, data_id: str, init_id: str | None) -> str:
    """Identity of a training run: what it computes, not how it is spread over
    processes. A checkpoint resumes only a run with the same fingerprint; the
    global batch (not its split into micro-batches × ranks) is part of it."""
    import hashlib
    import json

    semantic = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in EXECUTION_KEYS}
    blob = json.dumps([semantic, model_cfg.to_dict(), global_batch, data_id, init_id], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class NonFiniteError(RuntimeError):
    """Loss or gradient norm became NaN/inf. The last good checkpoint is untouched."""


# --- pieces ------------------------------------------------------------------------------------


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu":
        try:
            return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
        except (AttributeError, RuntimeError):
            return "fp32"
    return "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to the ``min_lr`` floor at max_steps.
    ``step`` counts optimizer steps from 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress_ = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress_)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only matrices of linear layers; norms, biases and embeddings are exempt
    (decaying them shrinks scales and rare-token rows for no regularisation gain)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # fused kernel missing for this device/dtype
        return torch.optim.AdamW(groups, foreach=device.type != "cpu", **kwargs)


def enable_activation_checkpointing(model: Transformer) -> None:
    """Recompute each block in backward instead of storing its activations.
    Patches ``forward`` so parameter names (and checkpoints) are unchanged."""
    for block in model.layers:
        inner = block.forward
        block.forward = functools.partial(activation_checkpoint, inner, use_reentrant=False)


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Achievable dense matmul FLOP/s of this device in ``dtype`` (all CPU threads),
    measured with ``F.linear``, the op behind every weight matmul of the model: on
    CPUs without native bf16 the plain ``a @ b`` path in bf16 is ~20x slower than
    the oneDNN path ``F.linear`` takes, and would understate the peak."""
    n = 8192 if device.type == "cuda" else 1024
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        x = torch.randn(n, n, device=device, dtype=dtype)
        w = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            F.linear(x, w)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        iters, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            F.linear(x, w)
            iters += 1
        sync()
        return 2 * n**3 * iters / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class CsvLog:
    """``plots/<stage>.csv``, appended and flushed per row so ``tail -f`` shows progress.
    On resume, rows after the checkpoint's step are cut so the file matches the run."""

    COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb", "val_loss", "elapsed_s"]

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict[str, str]] = []
        if resume_step > 0 and path.exists():
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, self.COLUMNS)
            w.writeheader()
            w.writerows(kept)
        self._f = open(path, "a", newline="")
        self._w = csv.DictWriter(self._f, self.COLUMNS)

    def write(self, row: dict[str, Any]) -> None:
        self._w.writerow({k: ("" if row.get(k) is None else row[k]) for k in self.COLUMNS})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


# --- the trainer -------------------------------------------------------------------------------


class Trainer:
    """Train ``model_cfg`` on ``train_dir`` rows, checkpointing into ``out_dir``.

    ``init_weights`` (a checkpoint folder) seeds the weights of a fresh run, e.g.
    sft starting from pretrain; a checkpoint already in ``out_dir`` always wins,
    so a killed run resumes instead of restarting.
    """

    def __init__(self, stage: str, cfg: TrainConfig, model_cfg: ModelConfig, train_dir: Path, val_dir: Path,
                 out_dir: Path, csv_path: Path, *, data_id: str, init_weights: Path | None = None,
                 extra_meta: dict[str, Any] | None = None):
        self.stage, self.cfg, self.model_cfg = stage, cfg, model_cfg
        self.out_dir, self.csv_path = Path(out_dir), Path(csv_path)
        self.extra_meta = extra_meta or {}
        self.d = distributed.init(cfg.device)
        self._lock_fd = hold_shared(self.out_dir)
        self.precision = resolve_precision(cfg.precision, self.d.device)
        if self.precision == "fp16" and self.d.device.type == "cpu":
            log.warning("fp16 autocast on CPU is slow and rarely useful; consider bf16")

        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        self.train_data = PackedRows(train_dir)
        self.val_data = PackedRows(val_dir)
        self.seq_len = self.train_data.seq_len
        if self.seq_len > model_cfg.max_seq_len:
            raise ValueError(f"packed rows have seq_len {self.seq_len} > model max_seq_len {model_cfg.max_seq_len}")
        self.model = Transformer(model_cfg).to(self.d.device)
        self.optimizer = build_optimizer(self.model, cfg, self.d.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(s, cfg) / cfg.lr)
        self.scaler = torch.amp.GradScaler(self.d.device.type, enabled=self.precision == "fp16")
        self.order = GlobalOrder(len(self.train_data), cfg.seed, cfg.micro_batch_size, cfg.grad_accum_steps,
                                 self.d.world_size, self.d.rank)
        self.step = 0
        self.loss_spikes = 0
        self._loss_ema: float | None = None

        init_id = ckpt.latest(Path(init_weights)).meta.get("fingerprint") if init_weights else None
        self.fingerprint = run_fingerprint(cfg, model_cfg, self.order.global_batch, data_id, init_id)
        if self.d.is_main:
            ckpt.sweep(self.out_dir)
            stale = [c for c in ckpt.complete_checkpoints(self.out_dir) if c.meta.get("fingerprint") != self.fingerprint]
            if stale:
                log.warning("params, model or data changed since the checkpoints in %s were written: "
                            "starting a fresh run and removing %d old checkpoint(s)", self.out_dir, len(stale))
                ckpt.discard(stale)
        distributed.barrier(self.d)
        last = ckpt.latest(self.out_dir)
        if last is not None:
            self._resume(last)
        elif init_weights is not None:
            ckpt.load_model_weights(ckpt.latest(Path(init_weights)), self.model)
            log.info("initialised weights from %s", init_weights)

        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self.fwd_model: torch.nn.Module = self.model
        if cfg.compile:
            self.fwd_model = torch.compile(self.model)
        if self.d.world_size > 1:
            self.fwd_model = DDP(self.fwd_model, device_ids=[self.d.device.index] if self.d.device.type == "cuda" else None)

        self.tokens_per_step = self.order.global_batch * self.seq_len
        self.flops_per_token = flops_per_token(model_cfg, self.seq_len)
        self.peak_flops_total, self.peak_source = self._peak_flops()

    # -- state --

    def _resume(self, last: ckpt.Checkpoint) -> None:
        ckpt.load_model_weights(last, self.model)
        self.optimizer.load_state_dict(ckpt.load_state(last, "optimizer.pt"))
        state = ckpt.load_state(last, "trainer.pt")
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.order.load_state_dict(state["data"])
        self.step = int(state["step"])
        self.loss_spikes = int(state.get("loss_spikes", 0))
        self._loss_ema = state.get("loss_ema")
        rngs = state["rng"]
        if len(rngs) == self.d.world_size:
            ckpt.set_rng_state(rngs[self.d.rank])
        else:
            log.warning("checkpoint has RNG states for %d ranks, running with %d: RNG streams not restored",
                        len(rngs), self.d.world_size)
        if self.d.is_main:
            log.info("resumed from %s (step %d)", last.path, self.step)

    def _save(self, metrics: dict[str, Any]) -> ckpt.Checkpoint | None:
        rngs = distributed.gather_objects(ckpt.rng_state(), self.d)
        saved = None
        if self.d.is_main:
            state = {
                "step": self.step,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "data": self.order.state_dict(),
                "rng": rngs,
                "loss_spikes": self.loss_spikes,
                "loss_ema": self._loss_ema,
            }
            meta = {
                "stage": self.stage,
                "fingerprint": self.fingerprint,
                "model": self.model_cfg.to_dict() if hasattr(self.model_cfg, "to_dict") else vars(self.model_cfg),
                "world_size": self.d.world_size,
                "precision": self.precision,
                "seq_len": self.seq_len,
                "tokens_seen": self.step * self.tokens_per_step,
                "metrics": metrics,
                "final": self.step >= self.cfg.max_steps,
                **self.extra_meta,
            }
            saved = ckpt.save(self.out_dir, self.step, self.model, self.optimizer, state, meta, self.cfg.keep_checkpoints)
        distributed.barrier(self.d)
        return saved

    def _peak_flops(self) -> tuple[float, str]:
        dev = self.d.device
        # CPU ranks on one node share one processor; GPUs are one device per rank.
        devices = self.d.world_size if dev.type == "cuda" else max(1, self.cfg.nnodes)
        if self.cfg.peak_flops:
            return self.cfg.peak_flops * devices, "params"
        peak = None
        if self.d.is_main:
            peak = measure_peak_flops(dev, DTYPES[self.precision] if self.precision != "fp16" or dev.type == "cuda" else torch.float32)
        peak = float(distributed.broadcast_object(peak, self.d))
        return peak * devices, "measured"

    # -- steps --

    def _loss(self, batch: dict[str, torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.d.device, self.precision):
            logits, _ = self.fwd_model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), ignore_index=-100,
                                   reduction="sum")
        return loss_sum * scale, loss_sum.detach()

    def train_step(self) -> dict[str, float]:
        model, cfg, d = self.fwd_model, self.cfg, self.d
        model.train()
        micro_rows = self.order.next_step()
        batches = [self.train_data.batch(rows, d.device, cfg.doc_mask) for rows in micro_rows]
        local_tokens = torch.tensor(float(sum(int((b["targets"] != -100).sum()) for b in batches)), device=d.device)
        global_tokens = distributed.all_reduce_mean(local_tokens, d) * d.world_size
        if global_tokens.item() == 0:
            raise RuntimeError(f"step {self.step + 1}: no target tokens in the global batch")
        scale = d.world_size / global_tokens.item()
        loss_total = torch.zeros((), device=d.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
            with sync:
                loss, loss_sum = self._loss(batch, scale)
                self.scaler.scale(loss).backward()
            loss_total += loss_sum
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        mean_loss = float(distributed.all_reduce_mean(loss_total, d) * d.world_size / global_tokens)
        step = self.step + 1
        lr = self.optimizer.param_groups[0]["lr"]
        if not math.isfinite(mean_loss):
            raise NonFiniteError(self._nonfinite_message("loss", mean_loss, step))
        gn = float(grad_norm)
        if not math.isfinite(gn) and self.precision != "fp16":
            raise NonFiniteError(self._nonfinite_message("gradient norm", gn, step))
        # fp16: an inf gradient is the scaler's signal to skip this step and lower the scale.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step = step
        spike = self._loss_ema is not None and mean_loss > cfg.spike_factor * self._loss_ema
        self.loss_spikes += int(spike)
        self._loss_ema = mean_loss if self._loss_ema is None else 0.95 * self._loss_ema + 0.05 * mean_loss
        return {"loss": mean_loss, "lr": lr, "grad_norm": gn, "loss_spike": float(spike)}

    def _nonfinite_message(self, what: str, value: float, step: int) -> str:
        last = ckpt.latest(self.out_dir)
        where = f"the last good checkpoint, {last.path} (step {last.step}), is intact" if last else "no checkpoint was written yet"
        return f"non-finite {what} ({value}) at step {step}; training stopped, {where}"

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over a fixed slice of the val split, exact across world sizes."""
        self.fwd_model.eval()
        rows = eval_rows(len(self.val_data), self.cfg.eval_rows, self.d.world_size, self.d.rank)
        total = torch.zeros(2, device=self.d.device, dtype=torch.float64)
        for i in range(0, len(rows), self.cfg.micro_batch_size):
            batch = self.val_data.batch(rows[i:i + self.cfg.micro_batch_size], self.d.device, self.cfg.doc_mask)
            _, loss_sum = self._loss(batch, 1.0)
            total[0] += loss_sum.double()
            total[1] += (batch["targets"] != -100).sum()
        total = distributed.all_reduce_mean(total, self.d) * self.d.world_size
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    # -- the run --

    def run_params(self) -> dict[str, Any]:
        from pipeline.tracking.tracker import current_stage_fingerprint, git_tags

        lineage = git_tags()
        return {
            "git_commit": lineage.get("mlflow.source.git.commit"),
            "git_dirty": lineage.get("git.dirty"),
            "dvc_stage_hash": current_stage_fingerprint(self.stage),
            **flatten(self.cfg, self.stage),
            **flatten(self.model_cfg.to_dict() if hasattr(self.model_cfg, "to_dict") else vars(self.model_cfg), "model"),
            "world_size": self.d.world_size,
            "precision.resolved": self.precision,
            "device": str(self.d.device.type),
            "global_batch_rows": self.order.global_batch,
            "global_batch_tokens": self.tokens_per_step,
            "seq_len": self.seq_len,
            "n_params": num_params(self.model),
            "flops_per_token": self.flops_per_token,
            "peak_flops_total": self.peak_flops_total,
            "peak_flops_source": self.peak_source,
        }

    def fit(self) -> dict[str, Any]:
        cfg, d = self.cfg, self.d
        start_step = self.step
        csvlog = CsvLog(self.csv_path, start_step) if d.is_main else None
        tracker = self._tracker() if d.is_main else contextlib.nullcontext()
        t_start = time.perf_counter()
        val_loss = None
        summary: dict[str, Any] = {}
        with tracker as tr:
            if tr is not None:
                tr.log_params(self.run_params())
            bar = progress(total=cfg.max_steps, initial=start_step, desc=self.stage, unit="step") if d.is_main else None
            window_t, window_steps = time.perf_counter(), 0
            tokens_per_s = mfu = 0.0
            while self.step < cfg.max_steps:
                m = self.train_step()
                window_steps += 1
                row: dict[str, Any] = {"step": self.step, **m}
                is_last = self.step >= cfg.max_steps
                if self.step % cfg.eval_every == 0 or is_last:
                    t_eval = time.perf_counter()
                    val_loss = self.evaluate()
                    row["val_loss"] = val_loss
                    window_t += time.perf_counter() - t_eval  # throughput counts training only
                if self.step % cfg.log_every == 0 or is_last or "val_loss" in row:
                    if self.d.device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - window_t
                    tokens_per_s = window_steps * self.tokens_per_step / dt
                    mfu = tokens_per_s * self.flops_per_token / self.peak_flops_total
                    window_t, window_steps = time.perf_counter(), 0
                    peak_mem = float(distributed.all_reduce_max(torch.tensor(peak_memory_mb(d.device)), d))
                    row.update(tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_mb=peak_mem,
                               elapsed_s=time.perf_counter() - t_start, loss_spikes=self.loss_spikes)
                    if d.is_main:
                        csvlog.write(row)
                        if tr is not None:
                            tr.log_metrics({k: v for k, v in row.items() if k != "step" and v is not None}, step=self.step)
                        bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", tok_s=f"{tokens_per_s:,.0f}")
                if bar is not None:
                    bar.update(1)
                if self.step % cfg.checkpoint_every == 0 or is_last:
                    t_save = time.perf_counter()
                    self._save({"loss": m["loss"], "val_loss": val_loss})
                    window_t += time.perf_counter() - t_save
            if bar is not None:
                bar.close()
            if val_loss is None:  # resumed at max_steps: nothing left to train, still report
                val_loss = self.evaluate()
            last = ckpt.latest(self.out_dir)
            summary = {
                "final_loss": self._final_train_loss(),
                "val_loss": val_loss,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "steps": self.step,
                "resumed_from_step": start_step,
                "tokens_seen": self.step * self.tokens_per_step,
                "loss_spikes": self.loss_spikes,
                "world_size": d.world_size,
                "precision": self.precision,
                "n_params": num_params(self.model),
                "checkpoint": str(last.path) if last else None,
            }
            if tr is not None and last is not None:
                tr.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None},
                               step=self.step)
                tr.log_artifact(last.path / "meta.json")
        if csvlog is not None:
            csvlog.close()
        return summary

    def _final_train_loss(self) -> float | None:
        if not self.d.is_main or not self.csv_path.exists():
            return None
        with open(self.csv_path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("loss")]
        return float(rows[-1]["loss"]) if rows else None

    def _tracker(self):
        if not self.cfg.track:
            return contextlib.nullcontext()
        from pipeline.tracking.tracker import Tracker

        return Tracker(self.stage, rank=self.d.rank, system_metrics=self.cfg.system_metrics)

    def close(self) -> None:
        os.close(self._lock_fd)
        distributed.shutdown()


def unigram_entropy(rows: PackedRows) -> float:
    """Entropy (nats/token) of the split's unigram token distribution: the loss of
    the best model that ignores context, the bar a trained model must clear."""
    counts = np.zeros(0, dtype=np.int64)
    for block in rows.iter_input_ids():
        c = np.bincount(block[:, 1:].ravel())
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[:len(c)] += c
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
