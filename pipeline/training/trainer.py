"""The training loop shared by pretrain and sft, assembled from parts.

One ``Trainer`` runs on every rank (torchrun starts them; see
pipeline/training/torchrun.py). Its parts each live in their own module:

* config.py       the nested config and the run identity;
* parallelize.py  activation checkpointing, compile and DDP around the model;
* optimizer.py    AdamW and the warmup-cosine schedule;
* precision.py    the autocast dtype;
* loss.py         the token loss (the model returns logits);
* sampler.py      which rows each rank trains on at each step;
* checkpoint.py   the checkpoint manager: identity, atomic save, keep-last-K,
                  verification and resume;
* metrics.py      console, CSV, MLflow, MFU and memory.

Loss normalisation: each micro-batch contributes ``sum(token losses) ·
world / (valid tokens in the whole global batch)``, so after DDP's gradient
averaging the update is the gradient of the mean token loss over the global
batch, however the batch is split over ranks and micro-batches. That is what
makes "2 ranks × 1 micro-batch" and "1 rank × 2 micro-batches" the same update,
and it weights SFT's masked tokens correctly.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.config import flatten
from pipeline.data.shards import PackedRows
from pipeline.errors import StageError
from pipeline.model.transformer import ModelConfig, Transformer, flops_per_token, num_params
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed
from pipeline.training.config import TrainConfig, run_identity
from pipeline.training.loss import scored_tokens, token_loss_sum
from pipeline.training.metrics import MetricsLogger
from pipeline.training.optimizer import build_optimizer, build_scheduler
from pipeline.training.parallelize import parallelize
from pipeline.training.precision import DTYPES, autocast, resolve_precision
from pipeline.training.sampler import GlobalOrder, eval_rows
from pipeline.training.torchrun import hold_shared

log = logging.getLogger("pipeline.training")
CURVE = "curve.csv"  # <out_dir>/curve.csv: the plots CSV's rows, kept beside the checkpoints for resume


class NonFiniteError(StageError):
    """Loss or gradient norm became NaN/inf. The last good checkpoint is untouched."""


def run_fingerprint(cfg: TrainConfig, model_cfg: ModelConfig, world_size: int, data_id: str,
                    init_from: ckpt.Checkpoint | None) -> str:
    """The identity of a run (pipeline/training/config.py) with the global batch of ``world_size`` ranks."""
    global_batch = cfg.batch.micro_batch_size * cfg.batch.grad_accum_steps * world_size
    return run_identity(cfg, model_cfg.to_dict(), global_batch, data_id,
                        init_from.meta.get("fingerprint") if init_from else None)


def check_resume(cfg: TrainConfig, model_cfg: ModelConfig, out_dir: Path, *, data_id: str,
                 init_from: ckpt.Checkpoint | None = None) -> ckpt.Checkpoint | None:
    """Launcher side, before any rank starts: the checkpoint this run will resume
    from (verified), or None for a fresh run. Raises the one-line CheckpointError
    when this run has checkpoints and none is intact, so that a damaged folder
    stops the stage before any rank starts. Reads only: rank 0 moves other runs'
    checkpoints aside when it starts."""
    fingerprint = run_fingerprint(cfg, model_cfg, cfg.launch.nproc_per_node * cfg.launch.nnodes, data_id, init_from)
    manager = ckpt.CheckpointManager(Path(out_dir), fingerprint=fingerprint, keep=cfg.checkpoint.keep, is_main=True)
    return manager.resume_point()


class Trainer:
    """Train ``model_cfg`` on the rows in ``train_dir``, checkpointing into ``out_dir``.

    ``init_from`` (a verified checkpoint) seeds the weights of a fresh run, e.g.
    sft starting from pretrain; a checkpoint of this run already in ``out_dir``
    always wins, so a killed run resumes instead of restarting.
    """

    def __init__(self, stage: str, cfg: TrainConfig, model_cfg: ModelConfig, train_dir: Path, val_dir: Path,
                 out_dir: Path, csv_path: Path, *, data_id: str, init_from: ckpt.Checkpoint | None = None,
                 extra_meta: dict[str, Any] | None = None):
        self.stage, self.cfg, self.model_cfg = stage, cfg, model_cfg
        self.out_dir = Path(out_dir)
        self.extra_meta = extra_meta or {}
        self.d = d = distributed.init(cfg.compute.device)
        self._lock_fd = hold_shared(self.out_dir)
        self.precision = resolve_precision(cfg.compute.precision, d.device)
        if self.precision == "fp16" and d.device.type == "cpu":
            log.warning("fp16 autocast on CPU is slow and rarely useful; consider bf16")

        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        self.train_data, self.val_data = PackedRows(train_dir), PackedRows(val_dir)
        self.seq_len = self.train_data.seq_len
        if self.seq_len > model_cfg.max_seq_len:
            raise StageError(f"packed rows have seq_len {self.seq_len} > model max_seq_len {model_cfg.max_seq_len}")
        self.model = Transformer(model_cfg).to(d.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, d.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer.lr, cfg.schedule)
        self.scaler = torch.amp.GradScaler(d.device.type, enabled=self.precision == "fp16")
        self.order = GlobalOrder(len(self.train_data), cfg.seed, cfg.batch.micro_batch_size,
                                 cfg.batch.grad_accum_steps, d.world_size, d.rank)
        self.step, self.loss_spikes, self._loss_ema = 0, 0, None

        self.fingerprint = run_fingerprint(cfg, model_cfg, d.world_size, data_id, init_from)
        self.checkpoints = ckpt.CheckpointManager(self.out_dir, fingerprint=self.fingerprint,
                                                  keep=cfg.checkpoint.keep, is_main=d.is_main)
        self.checkpoints.prepare()
        distributed.barrier(d)
        last = self.checkpoints.resume_point()
        if last is not None:
            self._resume(last)
        elif init_from is not None:
            ckpt.load_model_weights(init_from, self.model)
            log.info("initialised weights from %s", init_from.path)
        self.fwd_model = parallelize(self.model, cfg.compute, d)

        self.tokens_per_step = self.order.global_batch * self.seq_len
        measure_dtype = DTYPES[self.precision] if self.precision != "fp16" or d.device.type == "cuda" else torch.float32
        self.metrics = MetricsLogger(stage, cfg.logging, d, Path(csv_path), self.out_dir / CURVE,
                                     precision_dtype=measure_dtype, nnodes=cfg.launch.nnodes,
                                     tokens_per_step=self.tokens_per_step,
                                     flops_per_token=flops_per_token(model_cfg, self.seq_len),
                                     max_steps=cfg.schedule.max_steps)

    # -- checkpoint state --

    def _resume(self, last: ckpt.Checkpoint) -> None:
        state = self.checkpoints.load(last, self.model, self.optimizer)
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

    def save(self, metrics: dict[str, Any]) -> None:
        """Checkpoint the current step (a collective: every rank's RNG state is gathered)."""
        rngs = distributed.gather_objects(ckpt.rng_state(), self.d)
        if self.d.is_main:
            state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "data": self.order.state_dict(), "rng": rngs, "loss_spikes": self.loss_spikes,
                     "loss_ema": self._loss_ema}
            meta = {"stage": self.stage, "model": self.model_cfg.to_dict(), "world_size": self.d.world_size,
                    "precision": self.precision, "seq_len": self.seq_len,
                    "tokens_seen": self.step * self.tokens_per_step, "metrics": metrics,
                    "final": self.step >= self.cfg.schedule.max_steps, **self.extra_meta}
            self.checkpoints.save(self.step, self.model, self.optimizer, state, meta)
        distributed.barrier(self.d)

    # -- steps --

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast(self.d.device, self.precision):
            logits = self.fwd_model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
        return token_loss_sum(logits, batch["targets"])

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns loss, lr, grad norm and the spike flag."""
        model, d = self.fwd_model, self.d
        model.train()
        batches = [self.train_data.batch(rows, d.device, self.cfg.data.doc_mask) for rows in self.order.next_step()]
        local_tokens = torch.tensor(float(sum(int(scored_tokens(b["targets"])) for b in batches)), device=d.device)
        global_tokens = distributed.all_reduce_mean(local_tokens, d) * d.world_size
        if global_tokens.item() == 0:
            raise StageError(f"step {self.step + 1}: no target tokens in the global batch")
        scale = d.world_size / global_tokens.item()
        loss_total = torch.zeros((), device=d.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync():
                loss_sum = self._loss_sum(batch)
                self.scaler.scale(loss_sum * scale).backward()
            loss_total += loss_sum.detach()
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.cfg.optimizer.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optimizer.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        mean_loss = float(distributed.all_reduce_mean(loss_total, d) * d.world_size / global_tokens)
        lr = self.optimizer.param_groups[0]["lr"]
        self._check_finite("loss", mean_loss)
        gn = float(grad_norm)
        if self.precision != "fp16":  # fp16: an inf gradient is the scaler's signal to skip the step
            self._check_finite("gradient norm", gn)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        spike = self._loss_ema is not None and mean_loss > self.cfg.logging.spike_factor * self._loss_ema
        self.loss_spikes += int(spike)
        self._loss_ema = mean_loss if self._loss_ema is None else 0.95 * self._loss_ema + 0.05 * mean_loss
        return {"loss": mean_loss, "lr": lr, "grad_norm": gn, "loss_spike": float(spike)}

    def _check_finite(self, what: str, value: float) -> None:
        if math.isfinite(value):
            return
        last = ckpt.latest(self.out_dir)
        where = f"the last good checkpoint, {last.path} (step {last.step}), is intact" if last else "no checkpoint was written yet"
        raise NonFiniteError(f"non-finite {what} ({value}) at step {self.step + 1}; training stopped, {where}")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over a fixed slice of the val split, exact across world sizes."""
        self.fwd_model.eval()
        rows = eval_rows(len(self.val_data), self.cfg.eval.rows, self.d.world_size, self.d.rank)
        total = torch.zeros(2, device=self.d.device, dtype=torch.float64)
        mb = self.cfg.batch.micro_batch_size
        for i in range(0, len(rows), mb):
            batch = self.val_data.batch(rows[i:i + mb], self.d.device, self.cfg.data.doc_mask)
            total[0] += self._loss_sum(batch).double()
            total[1] += scored_tokens(batch["targets"])
        total = distributed.all_reduce_mean(total, self.d) * self.d.world_size
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    # -- the run --

    def fit(self) -> dict[str, Any]:
        """Train to ``schedule.max_steps`` (from the resumed step), evaluating and
        checkpointing on schedule; return the summary (rank 0's is complete)."""
        cfg, start_step, val_loss = self.cfg, self.step, None
        with self.metrics.start(start_step) as metrics:
            metrics.log_params(self.run_params())
            while self.step < cfg.schedule.max_steps:
                m = self.train_step()
                last_step = self.step == cfg.schedule.max_steps
                if self.step % cfg.eval.every == 0 or last_step:
                    with metrics.paused():
                        m["val_loss"] = val_loss = self.evaluate()
                metrics.log(self.step, {**m, "loss_spikes": self.loss_spikes}, force=last_step or "val_loss" in m)
                if self.step % cfg.checkpoint.every == 0 or last_step:
                    with metrics.paused():
                        self.save({"loss": m["loss"], "val_loss": val_loss})
            if val_loss is None:  # resumed at max_steps: nothing left to train, still report
                val_loss = self.evaluate()
            last = ckpt.latest(self.out_dir)
            summary = {"final_loss": metrics.last_logged_loss, "val_loss": val_loss,
                       "tokens_per_s": metrics.tokens_per_s, "mfu": metrics.mfu, "steps": self.step,
                       "resumed_from_step": start_step, "tokens_seen": self.step * self.tokens_per_step,
                       "loss_spikes": self.loss_spikes, "world_size": self.d.world_size,
                       "n_params": num_params(self.model)}
            metrics.log_summary(summary, self.step, last.path / "meta.json" if last else None)
        return summary

    def run_params(self) -> dict[str, Any]:
        """Everything that describes this run, flattened for MLflow (rank 0 only)."""
        if not self.d.is_main or not self.cfg.logging.track:
            return {}
        from pipeline.tracking.tracker import current_stage_fingerprint, git_tags

        lineage = git_tags()
        return {"git_commit": lineage.get("mlflow.source.git.commit"), "git_dirty": lineage.get("git.dirty"),
                "dvc_stage_hash": current_stage_fingerprint(self.stage), **flatten(self.cfg, self.stage),
                **flatten(self.model_cfg.to_dict(), "model"), "world_size": self.d.world_size,
                "precision.resolved": self.precision, "device": self.d.device.type,
                "global_batch_rows": self.order.global_batch, "global_batch_tokens": self.tokens_per_step,
                "seq_len": self.seq_len, "n_params": num_params(self.model),
                "flops_per_token": self.metrics.flops_per_token, "peak_flops_total": self.metrics.peak_flops_total,
                "peak_flops_source": self.metrics.peak_source, "run_fingerprint": self.fingerprint}

    def close(self) -> None:
        os.close(self._lock_fd)
        distributed.shutdown()
