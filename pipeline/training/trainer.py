"""The training loop shared by pretrain and sft, assembled from parts.

One ``Trainer`` runs on every rank (torchrun starts them; see
pipeline/training/torchrun.py). Its parts each live in their own module:

* config.py       the nested config and the run identity;
* parallelize.py  activation checkpointing, compile, and DDP or FSDP2 around the model;
* optimizer.py    AdamW and the learning-rate schedules (cosine, wsd);
* precision.py    the autocast dtype;
* loss.py         the token loss (the model returns logits);
* sampler.py      which rows each rank trains on at each step;
* checkpoint.py   the checkpoint manager: identity, atomic save, keep-last-K,
                  the best checkpoint, previous runs, verification and resume;
* metrics.py      console, CSV, MLflow, MFU and memory.

Loss normalisation: each micro-batch contributes ``sum(token losses) ·
world / (valid tokens in the whole global batch)``, so after DDP's gradient
averaging the update is the gradient of the mean token loss over the global
batch, however the batch is split over ranks and micro-batches. That is what
makes "2 ranks × 1 micro-batch" and "1 rank × 2 micro-batches" the same update,
and it weights SFT's masked tokens correctly. FSDP averages the reduce-scattered
gradients over the ranks as DDP does, so the same holds under ``compute.parallelism:
fsdp``; its gradient norm and clipping work on the sharded gradients (DTensors)
and equal the unsharded ones.

How a run starts, in order of precedence:

1. **resume**: ``out_dir`` holds a checkpoint of this run (same identity):
   continue from the newest intact one, bit for bit. ``schedule.max_steps`` is
   not part of the identity, so raising it continues the run from its latest
   checkpoint, with the schedule recomputed for the new length (lowering it
   below that checkpoint's step starts a fresh run instead; see
   CheckpointManager.prepare).
2. **warm start**: ``init_from`` (a verified checkpoint of ours: any stage, any
   step, a previous run) gives the weights, and with ``init_optimizer`` also the
   AdamW moments; or ``init_weights`` (e.g. a Hugging Face folder) fills the
   model. The step counter, the schedule and the data order start at 0.
3. **fresh**: the seeded random init.

Checkpoints of any other run in ``out_dir`` are moved aside to
``out_dir/previous/<fingerprint>/``, never deleted because params changed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.config import flatten
from pipeline.data.shards import PackedRows
from pipeline.errors import StageError
from pipeline.files import source_digest
from pipeline.model import attention
from pipeline.model.transformer import ModelConfig, Transformer, flops_per_token, num_params
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed
from pipeline.training import memory
from pipeline.training.config import (ScheduleSection, TrainConfig, fingerprint_of, identity_record,
                                       requested_rows_per_rank)
from pipeline.training.init import InitError
from pipeline.training.loss import scored_tokens, token_loss_sum
from pipeline.training.metrics import MetricsLogger
from pipeline.training.optimizer import build_optimizer, build_scheduler, load_moments, set_schedule_lr
from pipeline.training.parallelize import check_fsdp, parallelize, reset_after_failed_pass
from pipeline.training.precision import DTYPES, autocast, resolve_precision
from pipeline.training.sampler import GlobalOrder, check_global_batch, eval_rows
from pipeline.training.torchrun import hold_shared

log = logging.getLogger("pipeline.training")
CURVE = ckpt.CURVE  # <out_dir>/curve.csv: the plots CSV's rows, kept beside the checkpoints for resume


class NonFiniteError(StageError):
    """Loss or gradient norm became NaN/inf. The last good checkpoint is untouched."""


def init_identity(init_from: ckpt.Checkpoint | None = None, init_id: str | None = None,
                  init_optimizer: bool = False) -> str | None:
    """What a run starts from, as it enters the run identity: the sha256 of
    ``init_from``'s weights (so a checkpoint that changes, say a lengthened
    pretrain run, starts a new run downstream), plus whether its AdamW moments
    are loaded; or the caller's ``init_id`` for ``init_weights``; None for a
    random init. Raises InitError for contradictory options."""
    if init_from is not None and init_id is not None:
        raise InitError("give init_from (a checkpoint of ours) or init_weights with init_id, not both")
    if init_optimizer and init_from is None:
        raise InitError("init_optimizer loads AdamW moments from a checkpoint of ours: it needs init_from")
    if init_from is not None:
        return f"checkpoint:{ckpt.weights_id(init_from)}" + ("+optimizer" if init_optimizer else "")
    return init_id


def run_record(cfg: TrainConfig, model_cfg: ModelConfig, world_size: int, data_id: str,
               init_id: str | None) -> dict[str, Any]:
    """The identity record (pipeline/training/config.py) with the global batch of ``world_size`` ranks."""
    global_batch = requested_rows_per_rank(cfg.batch) * world_size  # micro_batch_size auto: the same global batch
    return identity_record(cfg, model_cfg.to_dict(), global_batch, data_id, init_id)


def run_fingerprint(cfg: TrainConfig, model_cfg: ModelConfig, world_size: int, data_id: str,
                    init_id: str | None) -> str:
    """The identity of a run: the digest of :func:`run_record`."""
    return fingerprint_of(run_record(cfg, model_cfg, world_size, data_id, init_id))


def job_record(stage: str, cfg: TrainConfig, model_cfg: ModelConfig, data_id: str, init_id: str | None) -> dict[str, Any]:
    """What every rank of a run must agree on (distributed.check_one_job), as
    flat keys: the stage's params as given (but ``launch.node_rank``, which names
    the node), the resolved model, digests of the data and the code, the
    starting weights and the torch version."""
    params = {f"{stage}.{k}": v for k, v in flatten(cfg).items() if k != "launch.node_rank"}
    model = {f"model.{k}": v for k, v in flatten(model_cfg.to_dict()).items()}
    return {**params, **model, "data (digest)": hashlib.sha256(data_id.encode()).hexdigest()[:16],
            "starting weights": init_id, "pipeline code (digest)": source_digest(), "torch": torch.__version__}


def wsd_branch(schedule: ScheduleSection, step: int, meta: dict[str, Any]) -> tuple[int, str] | None:
    """A wsd run lengthened after its newest checkpoint (at ``step``, with ``meta``)
    began the old decay: the last step that continues the run exactly (the old
    decay start: the longer run's learning rates agree up to it) and why; else None."""
    try:
        old = ScheduleSection.model_validate(meta.get("schedule"))
    except ValueError:
        return None  # written before checkpoints recorded their schedule
    if schedule.kind != "wsd" or old.kind != "wsd" or schedule.max_steps <= old.max_steps:
        return None
    if step <= old.decay_start():
        return None
    return old.decay_start(), (f"schedule.max_steps was raised from {old.max_steps} to {schedule.max_steps}, and "
                               f"these checkpoints lie in the old run's decay (steps {old.decay_start() + 1}-"
                               f"{old.max_steps}), whose learning rates the longer run does not use")


def check_resume(cfg: TrainConfig, model_cfg: ModelConfig, out_dir: Path, *, data_id: str,
                 init_from: ckpt.Checkpoint | None = None, init_id: str | None = None,
                 init_optimizer: bool = False) -> ckpt.Checkpoint | None:
    """Launcher side, before any rank starts: the checkpoint this run will resume
    from (verified), or None for a fresh run. Takes the same init arguments as
    :class:`Trainer`. Raises the one-line CheckpointError when this run has
    checkpoints and none is intact, so that a damaged folder stops the stage
    before any rank starts. Reads only: rank 0 moves other runs' checkpoints
    aside when it starts."""
    identity = init_identity(init_from, init_id, init_optimizer)
    fingerprint = run_fingerprint(cfg, model_cfg, cfg.launch.nproc_per_node * cfg.launch.nnodes, data_id, identity)
    manager = ckpt.CheckpointManager(Path(out_dir), fingerprint=fingerprint, keep=cfg.checkpoint.keep, is_main=True)
    last = manager.resume_point()
    return last if last is None or last.step <= cfg.schedule.max_steps else None  # lowered: a fresh run


def check_batch(cfg: TrainConfig, train_dir: Path) -> None:
    """Launcher side, before any rank starts: one step's rows fit the train split
    (a DataError naming the batch params otherwise), as every rank's
    :class:`GlobalOrder` checks again. ``micro_batch_size: auto`` leaves the
    global batch as it is, so it is checked too."""
    world = cfg.launch.nproc_per_node * cfg.launch.nnodes
    check_global_batch(requested_rows_per_rank(cfg.batch), world, len(PackedRows(train_dir)))


def check_compute(cfg: TrainConfig) -> None:
    """Launcher side, before any rank starts: the device this machine gives a
    rank, and the attention backend on it in the resolved precision, as every
    rank resolves them again (a DeviceError or AttentionBackendError, one line).
    On CUDA every rank of a node needs a GPU of its own: more ranks than GPUs
    would put two ranks on one GPU (local_rank modulo the GPUs), which NCCL
    refuses only once the ranks have started."""
    device = distributed.pick_device(cfg.compute.device)
    ranks = cfg.launch.nproc_per_node
    if device.type == "cuda" and ranks > 1:
        gpus = torch.cuda.device_count()
        if ranks > gpus:
            raise distributed.DeviceError(
                f"launch.nproc_per_node is {ranks}, but this machine has {gpus} CUDA GPU(s): one rank per GPU; "
                f"set launch.nproc_per_node to {gpus} or fewer")
    attention.resolve(cfg.compute.attention, device, resolve_precision(cfg.compute.precision, device))


class Trainer:
    """Train ``model_cfg`` on the rows in ``train_dir``, checkpointing into ``out_dir``.

    Starting weights of a fresh run (a checkpoint of this run already in
    ``out_dir`` always wins, so a killed run resumes instead of restarting):

    - ``init_from``: a verified checkpoint of ours (any stage and step,
      ``previous/<id>/step-N`` included) whose model equals ``model_cfg``;
      ``init_optimizer`` also loads its AdamW moments (the step counter, the
      schedule and the data order still start at 0);
    - ``init_weights(model)``: fills the freshly built model in place (e.g. from
      a Hugging Face folder); ``init_id`` names those weights in the run
      identity (e.g. a digest of the files) and is required with it.

    The model is always built with the seeded random init first, so that the
    default run's numbers do not depend on whether an init is given.
    Raises InitError (one line) for an init that does not fit.
    """

    def __init__(self, stage: str, cfg: TrainConfig, model_cfg: ModelConfig, train_dir: Path, val_dir: Path,
                 out_dir: Path, csv_path: Path, *, data_id: str, init_from: ckpt.Checkpoint | None = None,
                 init_optimizer: bool = False, init_weights: Callable[[Transformer], None] | None = None,
                 init_id: str | None = None, extra_meta: dict[str, Any] | None = None):
        if (init_weights is None) != (init_id is None):
            raise InitError("init_weights and init_id go together: init_id names the weights in the run identity")
        if init_from is not None and ckpt_model(init_from) != model_cfg:
            raise InitError(f"init_from {init_from.path}: its model ({describe_diff(ckpt_model(init_from), model_cfg)}) "
                            "differs from this run's; build the run's model from the checkpoint's meta")
        self.stage, self.cfg, self.model_cfg = stage, cfg, model_cfg
        self.requested_micro_batch = cfg.batch.micro_batch_size
        self.out_dir = Path(out_dir)
        self.extra_meta = extra_meta or {}
        self.init_id = init_identity(init_from, init_id, init_optimizer)
        self.init_meta = {"id": self.init_id, "from": str(init_from.path) if init_from else None,
                          "optimizer": init_optimizer}
        self._init_run = init_from.meta.get("mlflow_run_id") if init_from is not None else None
        self.sharded = cfg.compute.parallelism == "fsdp"
        self.d = d = distributed.init(cfg.compute.device, need_group=self.sharded, timeout_s=cfg.launch.timeout_s)
        self._lock_fd = hold_shared(self.out_dir)
        self.precision = resolve_precision(cfg.compute.precision, d.device)
        try:
            distributed.check_one_job(d, job_record(stage, cfg, model_cfg, data_id, self.init_id), self.out_dir)
            if self.sharded:
                check_fsdp(d, self.precision)
        except StageError:
            self.close()
            raise
        attention.resolve(cfg.compute.attention, d.device, self.precision)  # a backend that cannot run fails here, early
        planned = cfg.launch.nproc_per_node * cfg.launch.nnodes
        if d.world_size != planned and d.is_main:  # torchrun run by hand with other counts
            log.warning("%d rank(s) run, but launch.nproc_per_node x launch.nnodes is %d: the global batch (part of "
                        "the run identity) follows the ranks that run, so a run of the other size is not resumed",
                        d.world_size, planned)
        if self.precision == "fp16" and d.device.type == "cpu":
            log.warning("fp16 autocast on CPU is slow and rarely useful; consider bf16")

        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        # Nothing here draws from Python's or NumPy's global generators, but each
        # checkpoint saves their states: seeded, identical runs write identical files.
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.train_data, self.val_data = PackedRows(train_dir), PackedRows(val_dir)
        self.seq_len = self.train_data.seq_len
        if self.seq_len > model_cfg.max_seq_len:
            raise StageError(f"packed rows have seq_len {self.seq_len} > model max_seq_len {model_cfg.max_seq_len}")
        self.model = Transformer(model_cfg).to(d.device)
        # micro_batch_size auto on CUDA probes the model as it trains: once parallelize() has applied
        # activation checkpointing, DDP's gradient buckets or FSDP's shards (below)
        probe = memory.probes(d.device) and cfg.batch.micro_batch_size == "auto"
        if not probe:
            self.cfg = cfg = self._resolve_micro_batch(cfg)
        if not self.sharded:  # FSDP: built over the shards, once the model is sharded (below)
            self._build_optimizer()
        self.scaler = torch.amp.GradScaler(d.device.type, enabled=self.precision == "fp16")
        if not probe:
            self._build_order()
        self.step, self.loss_spikes, self._loss_ema = 0, 0, None
        self.resumed: ckpt.Checkpoint | None = None

        self.identity = run_record(cfg, model_cfg, d.world_size, data_id, self.init_id)
        self.fingerprint = fingerprint_of(self.identity)
        self.checkpoints = ckpt.CheckpointManager(self.out_dir, fingerprint=self.fingerprint,
                                                  keep=cfg.checkpoint.keep, is_main=d.is_main,
                                                  identity=self.identity, keep_best=cfg.checkpoint.keep_best,
                                                  keep_previous=cfg.checkpoint.keep_previous)
        moments_from = None
        if init_from is not None:  # before prepare(), which may move or prune the folder it lies in; a resume overwrites it
            ckpt.load_model_weights(init_from, self.model)
            if init_optimizer and self.sharded:
                moments_from = init_from  # loaded once the optimizer exists over the shards
            elif init_optimizer and ckpt.is_sharded(init_from):
                self._load_moments_sharded(init_from)
            elif init_optimizer:
                try:
                    load_moments(self.optimizer, ckpt.load_state(init_from, "optimizer.pt"))
                except (ValueError, KeyError) as err:
                    raise InitError(f"init_from {init_from.path}: its optimizer state does not fit this model's "
                                    f"parameter groups ({err})".replace("\n", " ")) from None
        self.moved_aside = self.checkpoints.prepare(cfg.schedule.max_steps,
                                                    in_use=init_from.path if init_from else None,
                                                    branch=functools.partial(wsd_branch, cfg.schedule))
        distributed.barrier(d)
        last = self.checkpoints.resume_point()
        resume_late = self.sharded or probe  # it needs the shards (FSDP) or the data order of the probed micro-batch
        if last is not None and not resume_late:
            self._resume(last)
        elif last is not None:
            pass  # resumed below, once the model is sharded or the micro-batch probed
        elif init_from is not None:
            pass  # said below, once its AdamW moments are loaded (under FSDP, after sharding)
        elif init_weights is not None:
            init_weights(self.model)
            if d.is_main:
                log.info("initialised weights from %s", init_id)
        self.fwd_model = parallelize(self.model, cfg.compute, d, self.precision)
        if probe:
            self.cfg = cfg = self._resolve_micro_batch(cfg)
            self._build_order()
        if self.sharded:
            self._build_optimizer()
        if last is not None and resume_late:
            self._resume(last)
        elif moments_from is not None:  # FSDP only
            self._load_moments_sharded(moments_from)
        if init_from is not None and last is None and d.is_main:
            moments = init_optimizer and bool(self.optimizer.state)
            log.info("initialised weights%s from %s (step %d)", " and AdamW moments" if moments else "",
                     init_from.path, init_from.step)
            if init_optimizer and not moments:
                log.warning("init_optimizer: %s holds no AdamW moments (its run took no optimizer step, as max_steps "
                            "0 does), so they start at zero, as in a run without init_optimizer", init_from.path)

        self.tokens_per_step = self.order.global_batch * self.seq_len
        measure_dtype = DTYPES[self.precision] if self.precision != "fp16" or d.device.type == "cuda" else torch.float32
        self.metrics = MetricsLogger(stage, cfg.logging, d, Path(csv_path), self.out_dir / CURVE,
                                     precision_dtype=measure_dtype, nnodes=cfg.launch.nnodes,
                                     tokens_per_step=self.tokens_per_step,
                                     flops_per_token=flops_per_token(model_cfg, self.seq_len),
                                     max_steps=cfg.schedule.max_steps)

    def _build_order(self) -> None:
        b = self.cfg.batch
        self.order = GlobalOrder(len(self.train_data), self.cfg.seed, b.micro_batch_size, b.grad_accum_steps,
                                 self.d.world_size, self.d.rank)

    def _build_optimizer(self) -> None:
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer, self.d.device)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optimizer.lr, self.cfg.schedule)

    def _load_moments_sharded(self, init_from: ckpt.Checkpoint) -> None:
        """init_optimizer where the model or ``init_from`` is sharded: load the
        checkpoint's weights and AdamW moments (they are the weights already
        loaded), keeping this run's hyperparameters as :func:`load_moments` does."""
        keep = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        ckpt.load_training_state(init_from, self.model, self.optimizer, self.d)
        for group, settings in zip(self.optimizer.param_groups, keep, strict=True):
            group.update(settings)

    def _resolve_micro_batch(self, cfg: TrainConfig) -> TrainConfig:
        """``batch.micro_batch_size: auto`` made concrete, the same on every rank
        (the minimum over ranks); the global batch is unchanged (memory.py)."""
        if cfg.batch.micro_batch_size != "auto":
            return cfg
        d, rows = self.d, requested_rows_per_rank(cfg.batch)
        if memory.probes(d.device):
            micro = memory.probe_micro_batch(self._probe_step, rows,
                                             agree=lambda m: int(distributed.all_reduce_min(torch.tensor(m, device=d.device), d)))
        else:
            try:
                micro, _ = memory.choose_micro_batch(self.model_cfg, self.seq_len, cfg.batch.grad_accum_steps,
                                                     precision=self.precision, ranks_per_node=cfg.launch.nproc_per_node,
                                                     available=memory.available_cpu_bytes(),
                                                     checkpointing=cfg.compute.activation_checkpointing,
                                                     doc_mask=cfg.data.doc_mask,
                                                     fsdp_world=d.world_size if self.sharded else None)
            except MemoryError as err:
                raise StageError(str(err)) from None
            micro = int(distributed.all_reduce_min(torch.tensor(micro), d))
        batch = cfg.batch.model_copy(update={"micro_batch_size": micro, "grad_accum_steps": rows // micro})
        if d.is_main:
            log.info("batch.micro_batch_size auto: %d rows per forward x %d accumulation steps per rank "
                     "(global batch unchanged)", micro, rows // micro)
        return cfg.model_copy(update={"batch": batch})

    def _keep_micro_batch(self, saved: int | None) -> None:
        """``micro_batch_size: auto`` on resume: the checkpoint's micro-batch where it
        still fits (the one auto picks now, or less), so that the run adds up its
        losses in the same order as before (a step's rows do not depend on the
        split). A larger one no longer fits: the new one, with a warning."""
        chosen = self.cfg.batch.micro_batch_size
        if self.requested_micro_batch != "auto" or saved is None or saved == chosen:
            return
        rows = requested_rows_per_rank(self.cfg.batch)
        if saved > chosen or rows % saved:
            if self.d.is_main:
                log.warning("batch.micro_batch_size auto: the checkpoint's %d rows per forward do not fit now; "
                            "continuing with %d, whose sums of the loss may differ from the run's in the last bits",
                            saved, chosen)
            return
        batch = self.cfg.batch.model_copy(update={"micro_batch_size": saved, "grad_accum_steps": rows // saved})
        self.cfg = self.cfg.model_copy(update={"batch": batch})
        self._build_order()
        if self.d.is_main:
            log.info("batch.micro_batch_size auto: %d rows per forward, as the checkpoint's run (%d would fit now)",
                     saved, chosen)

    def _probe_step(self, micro: int) -> None:
        """CUDA only: one forward and backward pass over ``micro`` rows of zeros,
        gradients dropped, on the model as parallelize() left it (activation
        checkpointing, DDP's buckets, FSDP's shards), while holding the memory
        AdamW's moments take from the first step on (unless already loaded)."""
        model = self.model
        optimizer = getattr(self, "optimizer", None)  # FSDP: built after the probe
        moments = 0 if optimizer is not None and optimizer.state else memory.optimizer_state_bytes(model)
        idx = torch.zeros(micro, self.seq_len, dtype=torch.long, device=self.d.device)
        seg = idx if self.cfg.data.doc_mask else None
        held = memory.hold(moments, self.d.device)  # noqa: F841  (alive until the pass is over)
        try:
            with autocast(self.d.device, self.precision):
                logits = model(idx, segment_ids=seg)
            token_loss_sum(logits, idx).backward()
        except BaseException:
            if self.sharded:  # a pass that ran out of memory leaves FSDP's parameters gathered and its hooks pending
                reset_after_failed_pass(model)
            raise
        finally:
            model.zero_grad(set_to_none=True)

    # -- checkpoint state --

    def _resume(self, last: ckpt.Checkpoint) -> None:
        state = self.checkpoints.load(last, self.model, self.optimizer, self.d)
        self._keep_micro_batch(state.get("micro_batch_size"))
        self.scheduler.load_state_dict(state["scheduler"])
        before = set_schedule_lr(self.scheduler)  # this run's schedule, which may be longer than the checkpoint's
        if state["scaler"]:  # a disabled scaler (bf16, fp32) ignores an fp16 run's state
            self.scaler.load_state_dict(state["scaler"])
        elif self.scaler.is_enabled() and self.d.is_main:  # torch refuses the empty state of a disabled one
            log.info("compute.precision fp16: the checkpoint was trained in another precision, so the loss scale "
                     "starts afresh at %g", self.scaler.get_scale())
        self.order.load_state_dict(state["data"])
        self.step = int(state["step"])
        self.loss_spikes = int(state.get("loss_spikes", 0))
        self._loss_ema = state.get("loss_ema")
        self.resumed = last
        rngs = state["rng"]
        if len(rngs) == self.d.world_size:
            ckpt.set_rng_state(rngs[self.d.rank])
        elif self.d.is_main:
            log.warning("checkpoint has RNG states for %d ranks, running with %d: RNG streams not restored",
                        len(rngs), self.d.world_size)
        if self.d.is_main:
            log.info("resumed from %s (step %d)", last.path, self.step)
            self._log_continuation(last, before[0])

    def _log_continuation(self, last: ckpt.Checkpoint, old_lr: float) -> None:
        """Say how the schedule changed when the run's length did (main rank)."""
        try:
            old = ScheduleSection.model_validate(last.meta.get("schedule"))
        except ValueError:
            return  # written before checkpoints recorded their schedule
        new, step = self.cfg.schedule, self.step
        if old.max_steps == new.max_steps:
            return
        new_lr = float(self.optimizer.param_groups[0]["lr"])
        head = (f"continuing the run from its checkpoint at step {step}: schedule.max_steps {old.max_steps} -> "
                f"{new.max_steps}, so {max(0, new.max_steps - step)} more step(s) run")
        if step >= new.max_steps:
            log.info("%s", head)
        elif new.kind == "cosine" or new.max_steps < old.max_steps:
            log.warning("%s. The %s schedule is recomputed for the new length, which changes the learning rate of "
                        "the remaining steps: step %d trains at lr %.6g (it was %.6g under max_steps %d)",
                        head, new.kind, step + 1, new_lr, old_lr, old.max_steps)
        else:
            log.info("%s. wsd: the learning rate up to the old decay start (step %d) is what it always was; the "
                     "decay now runs over steps %d-%d", head, old.decay_start(), new.decay_start() + 1, new.max_steps)
            if step > old.decay_start():
                log.warning("the run had started decaying: its checkpoint at step %d lies inside the old decay phase "
                            "(steps %d-%d), so step %d trains at lr %.6g again (it was %.6g) and the run differs from "
                            "an uninterrupted %d-step run; only a checkpoint at or before step %d continues exactly "
                            "as that run would, and this run has none left", step, old.decay_start() + 1,
                            old.max_steps, step + 1, new_lr, old_lr, new.max_steps, old.decay_start())

    def save(self, metrics: dict[str, Any]) -> None:
        """Checkpoint the current step (a collective: every rank's RNG state is gathered).
        ``metrics`` holds ``loss`` and ``val_loss`` with ``val_step``, the step
        that val loss was measured at (the best checkpoint is chosen among
        checkpoints whose own weights were evaluated)."""
        rngs = distributed.gather_objects(ckpt.rng_state(), self.d)
        self.metrics.flush()  # MLflow has every step up to this checkpoint before a resume would skip past them
        if self.sharded and not self.d.is_main:
            self.checkpoints.save(self.step, self.model, self.optimizer, {}, {}, sharded=self.d)
        if self.d.is_main:
            state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "data": self.order.state_dict(), "rng": rngs, "loss_spikes": self.loss_spikes,
                     "loss_ema": self._loss_ema, "micro_batch_size": self.cfg.batch.micro_batch_size}
            meta = {"stage": self.stage, "model": self.model_cfg.to_dict(), "world_size": self.d.world_size,
                    "precision": self.precision, "seq_len": self.seq_len,
                    "tokens_seen": self.step * self.tokens_per_step, "metrics": metrics,
                    "final": self.step >= self.cfg.schedule.max_steps,
                    "schedule": self.cfg.schedule.model_dump(mode="json"), "init": self.init_meta,
                    "mlflow_run_id": self.metrics.run_id, **self.extra_meta}
            own = metrics.get("val_loss") if metrics.get("val_step") == self.step else None
            self.checkpoints.save(self.step, self.model, self.optimizer, state, meta, val_loss=own,
                                  sharded=self.d if self.sharded else None, protect=self._before_decay())
        distributed.barrier(self.d)

    def _before_decay(self) -> frozenset[int]:
        """wsd: the newest checkpoint at or before the decay start, which
        keep-last-K keeps: a run lengthened later goes on exactly from it."""
        schedule = self.cfg.schedule
        if schedule.kind != "wsd" or self.step <= schedule.decay_start():
            return frozenset()
        steps = [c.step for c in ckpt.complete_checkpoints(self.out_dir) if c.step <= schedule.decay_start()]
        return frozenset(steps[-1:])

    # -- steps --

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast(self.d.device, self.precision):
            logits = self.fwd_model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
        return token_loss_sum(logits, batch["targets"])

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns loss, lr, grad norm and the spike flag."""
        # no local for the model: a traceback (NonFiniteError below) would keep DDP alive past close()
        d = self.d
        self.fwd_model.train()
        batches = [self.train_data.batch(rows, d.device, self.cfg.data.doc_mask) for rows in self.order.next_step()]
        local_tokens = torch.tensor(float(sum(int(scored_tokens(b["targets"])) for b in batches)), device=d.device)
        global_tokens = distributed.all_reduce_mean(local_tokens, d) * d.world_size
        if global_tokens.item() == 0:
            raise StageError(f"step {self.step + 1}: no target tokens in the global batch")
        scale = d.world_size / global_tokens.item()
        loss_total = torch.zeros((), device=d.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            # DDP all-reduces after the last micro-batch only. FSDP reduce-scatters after every one, as
            # torchtitan does: skipping it would hold the whole model's unsharded gradients from the first
            # micro-batch to the last, which the sharding exists to avoid (and memory.estimate counts only
            # this rank's shard of them).
            ddp = isinstance(self.fwd_model, DDP)
            with contextlib.nullcontext() if last or not ddp else self.fwd_model.no_sync():
                loss_sum = self._loss_sum(batch)
                self.scaler.scale(loss_sum * scale).backward()
            loss_total += loss_sum.detach()
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.sharded:
            grad_norm = sharded_grad_norm(params, self.cfg.optimizer.grad_clip)
        elif self.cfg.optimizer.grad_clip > 0:
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
        if self.sharded:
            # every forward gathers weights from all ranks, so every rank runs as many as
            # rank 0 (which has the most rows); the extra ones score nothing
            most = len(eval_rows(len(self.val_data), self.cfg.eval.rows, self.d.world_size, 0))
            for _ in range(math.ceil(len(rows) / mb), math.ceil(most / mb)):
                self._loss_sum(self.val_data.batch(np.arange(1), self.d.device, self.cfg.data.doc_mask))
        total = distributed.all_reduce_mean(total, self.d) * self.d.world_size
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    # -- the run --

    def fit(self) -> dict[str, Any]:
        """Train to ``schedule.max_steps`` (from the resumed step), evaluating and
        checkpointing on schedule; return the summary (rank 0's is complete).

        A run with nothing left to train (``max_steps: 0``, or resumed at its
        end) still evaluates, and writes a final checkpoint at its step unless
        one is there: with ``max_steps: 0`` that is ``step-0`` holding the
        initial weights, so that later stages can take them as this stage's result."""
        cfg, start_step, val_loss, val_step = self.cfg, self.step, None, None
        keep_best = cfg.checkpoint.keep_best
        with self.metrics.start(start_step) as metrics:
            metrics.log_params(self.run_params())
            metrics.set_tags(self.lineage_tags())
            while self.step < cfg.schedule.max_steps:
                m = self.train_step()
                last_step = self.step == cfg.schedule.max_steps
                save_now = self.step % cfg.checkpoint.every == 0 or last_step
                if self.step % cfg.eval.every == 0 or last_step or (keep_best and save_now):
                    with metrics.paused():
                        m["val_loss"] = val_loss = self.evaluate()
                        val_step = self.step
                metrics.log(self.step, {**m, "loss_spikes": self.loss_spikes}, force=last_step or "val_loss" in m)
                if save_now:
                    with metrics.paused():
                        self.save({"loss": m["loss"], "val_loss": val_loss, "val_step": val_step})
            if val_loss is None:  # nothing left to train: still report
                val_loss, val_step = self.evaluate(), self.step
            if self.step == start_step and not (self.resumed and self.resumed.meta.get("final")):
                # max_steps 0, or lowered to exactly the resumed step: mark this step's weights as the result
                loss = self.resumed.meta.get("metrics", {}).get("loss") if self.resumed else None
                self.save({"loss": loss, "val_loss": val_loss, "val_step": val_step})
            last = ckpt.latest(self.out_dir)
            summary = {"final_loss": metrics.last_logged_loss, "val_loss": val_loss,
                       "tokens_per_s": metrics.tokens_per_s, "mfu": metrics.mfu, "steps": self.step,
                       "resumed_from_step": start_step, "tokens_seen": self.step * self.tokens_per_step,
                       "loss_spikes": self.loss_spikes, "world_size": self.d.world_size,
                       "n_params": num_params(self.model), **self.runs_summary()}
            metrics.log_summary(summary, self.step, last.path / "meta.json" if last else None)
        return summary

    def runs_summary(self) -> dict[str, Any]:
        """Rank 0: earlier runs moved aside by this one and kept under previous/,
        and the best checkpoint when ``checkpoint.keep_best`` is on."""
        if not self.d.is_main:
            return {}
        out: dict[str, Any] = {"moved_aside": len(self.moved_aside),
                               "previous_runs": len(self.checkpoints.previous_runs())}
        best = self.checkpoints.best() if self.cfg.checkpoint.keep_best else None
        if best is not None:
            out.update(best_step=int(best["step"]), best_val_loss=float(best["val_loss"]))
        return out

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
                "attention.resolved": self.model.attention_backend.name,
                "global_batch_rows": self.order.global_batch, "global_batch_tokens": self.tokens_per_step,
                "seq_len": self.seq_len, "n_params": num_params(self.model),
                "batch.micro_batch_size.requested": self.requested_micro_batch,
                "flops_per_token": self.metrics.flops_per_token, "peak_flops_total": self.metrics.peak_flops_total,
                "peak_flops_source": self.metrics.peak_source, "run_fingerprint": self.fingerprint}

    def lineage_tags(self) -> dict[str, Any]:
        """MLflow tags that tie this run to the runs it continues: the run whose
        checkpoint it resumed from (a run killed, or lengthened, goes on in a new
        MLflow run), and the run that wrote the checkpoint it started from
        (``init_from``: sft's pretrain run). "unknown" for a checkpoint written
        untracked or offline."""
        tags: dict[str, Any] = {}
        if self.resumed is not None:
            tags["pipeline.resumed_from_run_id"] = self.resumed.meta.get("mlflow_run_id") or "unknown"
            tags["pipeline.resumed_from_step"] = self.resumed.step
        if self.init_meta["from"] is not None:
            tags["pipeline.init_from_run_id"] = self._init_run or "unknown"
        return tags

    def close(self) -> None:
        os.close(self._lock_fd)
        # DDP's C++ Reducer goes before the process group (distributed.shutdown)
        model, self.fwd_model = getattr(self, "fwd_model", None), None  # None: closed while being built
        distributed.shutdown(model)


def sharded_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The global gradient norm of FSDP-sharded parameters (the norm of the full
    gradients, one all-reduce), clipping them to ``max_norm`` when it is above 0."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def ckpt_model(checkpoint: ckpt.Checkpoint) -> ModelConfig | None:
    """The model config a checkpoint's meta records (None when it records none that parses)."""
    try:
        return ModelConfig(**checkpoint.meta["model"])
    except (KeyError, TypeError, ValueError):
        return None


def describe_diff(theirs: ModelConfig | None, ours: ModelConfig) -> str:
    if theirs is None:
        return "not recorded in its meta.json"
    a, b = theirs.to_dict(), ours.to_dict()
    return ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))
