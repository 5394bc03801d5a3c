"""The training config, nested by concern, and the run identity derived from it.

pretrain and sft share one schema (``TrainConfig``) made of sections, in the
spirit of torchtitan's JobConfig::

    seed        initial weights and the global sample order
    model       architecture (pretrain only: sft takes it from the checkpoint)
    data        what rows are trained on and how they are masked
    batch       micro-batch and accumulation (with the world size: the global batch)
    optimizer   AdamW and clipping
    schedule    length, warmup and the LR shape (cosine or warmup-stable-decay)
    compute     device, precision, compile, activation checkpointing, attention kernel, DDP or FSDP
    launch      torchrun settings
    eval        how often and on how many val rows
    checkpoint  how often, how many are kept, the best one, previous runs
    logging     console/CSV/MLflow reporting, MFU, spike counting

Every section declares whether it is part of the *run identity*: what a run
computes, as opposed to how it is executed or reported. A checkpoint resumes
only a run with the same identity (plus the resolved model, the global batch,
the data and the starting weights). Because the flag lives on the section, a key
added to a section is covered automatically; a new section cannot be added
without deciding (``Section.__init_subclass__`` insists).

One key of an identity section is left out on purpose: ``schedule.max_steps``
only sets how long the run is, so raising it *continues* the run from its latest
checkpoint, with the schedule recomputed for the new length (see
pipeline/training/trainer.py). Keys a section ignores in its current setting
(the WSD keys under ``kind: cosine``) are left out too, so editing them changes
nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from pipeline.config import ParamsModel, StageConfig
from pipeline.training.torchrun import LaunchConfig


class Section(ParamsModel):
    """A frozen, strict config section (see ParamsModel). Subclasses set ``identity``: True when a
    change to any key of theirs changes what training computes."""

    model_config = ConfigDict(validate_default=True)
    identity: ClassVar[bool]

    def identity_values(self) -> dict[str, Any]:
        """What of this section enters the run identity (when ``identity`` is True):
        every key, unless a subclass leaves out keys that do not change what is computed."""
        return self.model_dump(mode="json")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not any("identity" in vars(c) for c in cls.__mro__ if c is not Section):
            raise TypeError(f"{cls.__name__}: a config section must declare identity = True or False")


class DataSection(Section):
    identity = True
    doc_mask: bool = Field(True, description="block-diagonal causal attention inside packed rows")


class BatchSection(Section):
    """Only the global batch (micro × accum × world size) is part of the identity;
    how it is split over ranks and micro-batches is not (see pipeline/training/sampler.py).
    ``micro_batch_size: auto`` keeps the global batch of the default micro-batch
    (16 × grad_accum_steps × world size) and picks the largest micro-batch that
    fits, raising the accumulation steps to match (pipeline/training/memory.py);
    its run identity is therefore the same as with 16."""

    identity = False
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        16, description="rows per rank per forward pass; auto: the largest that fits the device, keeping the "
                              "global batch of 16 x grad_accum_steps x world size (grad_accum_steps is raised to match)")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step (no gradient sync until the last)")

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _auto_or_count(cls, v: Any) -> Any:
        # One message, not one per member of the union ("...micro_batch_size.constrained-int: ...").
        if v == "auto" or isinstance(v, bool):  # a boolean: the section's own check names it
            return v
        try:
            _COUNT.validate_python(v)
        except ValidationError:
            raise ValueError("must be auto or a whole number of at least 1") from None
        return v


_COUNT = TypeAdapter(Annotated[int, Field(ge=1)])


class OptimizerSection(Section):
    identity = True
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay of linear weights (not norms, biases, embeddings)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")


class ScheduleSection(Section):
    """How many optimizer steps, and the learning rate at each (pipeline/training/optimizer.py).

    ``cosine``: linear warmup to ``optimizer.lr``, then cosine decay towards
    ``min_lr`` at ``max_steps``. ``wsd`` (warmup-stable-decay): linear warmup,
    constant peak, then decay to ``min_lr`` over the last ``decay_steps`` steps
    (or ``decay_fraction`` of ``max_steps``), so that lengthening a run leaves
    the learning rate up to the old decay start unchanged.
    """

    identity = True
    LENGTH: ClassVar[tuple[str, ...]] = ("max_steps",)  # set the run's length only: a change continues the run
    WSD_ONLY: ClassVar[tuple[str, ...]] = ("decay_fraction", "decay_steps", "decay_shape")

    kind: Literal["cosine", "wsd"] = Field("cosine", description="cosine | wsd (warmup-stable-decay)")
    max_steps: int = Field(600, ge=0, description="optimizer steps; raising it continues the run; 0 = no training: init_from (required) passes through as the result")
    warmup_steps: int = Field(50, ge=0, description="linear warmup from 0 to optimizer.lr")
    min_lr: float = Field(3e-4, ge=0, description="floor of the schedule (reached at the end under wsd)")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of max_steps spent decaying, at the end (rounded to whole steps)")
    decay_steps: int | None = Field(None, ge=1, description="wsd: decay length in steps; overrides decay_fraction")
    decay_shape: Literal["linear", "1-sqrt"] = Field("linear", description="wsd: linear | 1-sqrt decay from the peak to min_lr")

    @model_validator(mode="after")
    def _phases_fit(self) -> "ScheduleSection":
        if self.max_steps == 0:  # a pass-through run: no step takes a learning rate
            return self
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})")
        if self.kind == "wsd" and self.warmup_steps + self.decay_length() > self.max_steps:
            given = (f"decay_steps {self.decay_steps}" if self.decay_steps is not None
                     else f"decay_fraction {self.decay_fraction} of max_steps = {self.decay_length()} steps")
            raise ValueError(f"wsd: warmup_steps ({self.warmup_steps}) + decay ({given}) must fit in "
                             f"max_steps ({self.max_steps})")
        return self

    def decay_length(self) -> int:
        """WSD: steps of the final decay (at least 1)."""
        if self.decay_steps is not None:
            return self.decay_steps
        return max(1, round(self.decay_fraction * self.max_steps))

    def decay_start(self) -> int:
        """WSD: the first (0-based) step whose learning rate is below the peak;
        steps before it are warmup or stable and do not depend on ``max_steps``."""
        return self.max_steps - self.decay_length()

    def identity_values(self) -> dict[str, Any]:
        values = self.model_dump(mode="json")
        inert = set(self.LENGTH)
        if self.kind != "wsd":
            inert |= set(self.WSD_ONLY)
        elif self.decay_steps is not None:
            inert.add("decay_fraction")
        return {k: v for k, v in values.items() if k not in inert}


class ComputeSection(Section):
    identity = False
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: bf16 where the device runs it natively (Ampere+ GPUs, ROCm, CPUs with oneDNN "
                        "bf16), fp16 on older GPUs, else fp32; fp16 uses a GradScaler")
    compile: bool = Field(False, description="torch.compile the model")
    activation_checkpointing: bool = Field(False, description="recompute each block in backward to save memory")
    attention: Literal["auto", "sdpa", "flex", "varlen"] = Field(
        "auto", description="attention kernel (all compute the same function): auto = sdpa on CPU, varlen on CUDA in "
                            "bf16/fp16 on Ampere+ GPUs else flex; sdpa = dense document mask; flex = FlexAttention block mask "
                            "(CUDA for training); varlen = flash attention over document lengths (CUDA, "
                            "Ampere+, bf16/fp16)")
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp = full weights, gradients and AdamW state on every rank, one checkpoint file each; "
                           "fsdp = FSDP2 shards them over the ranks (each block, then the root), sharded DCP "
                           "checkpoints; bf16 params with fp32 gradient reduction on CUDA in bf16")


class LaunchSection(LaunchConfig, Section):
    identity = False


class EvalSection(Section):
    identity = False
    every: int = Field(200, ge=1, description="steps between val-loss evaluations (and at the end)")
    rows: int | None = Field(512, ge=1, description="val rows per evaluation; null = the whole split")


class CheckpointSection(Section):
    identity = False
    every: int = Field(200, ge=1, description="steps between checkpoints (and at the end)")
    keep: int = Field(2, ge=1, description="newest checkpoints of this run kept; older ones are deleted")
    keep_best: bool = Field(False, description="also keep the checkpoint with the lowest val loss (val loss is then measured at every checkpoint); recorded in best.json")
    keep_previous: int | None = Field(None, ge=0, description="earlier runs kept under previous/ (moved there when the run identity changes); null = all; N = the newest N, older ones are deleted")


class LoggingSection(Section):
    identity = False
    every: int = Field(10, ge=1, description="steps between console/CSV/MLflow reports")
    spike_factor: float = Field(2.0, gt=1, description="a loss above factor × its running mean counts as a spike")
    peak_flops: float | None = Field(None, gt=0, description="peak FLOP/s per device for MFU; null = measure a matmul")
    track: bool = Field(True, description="log to MLflow (rank 0)")
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, GPU with pynvml)")


class TrainConfig(StageConfig):
    """Everything the training loop needs; pretrain adds ``model``, sft widens ``data``."""

    identity_by_init: ClassVar[frozenset[str]] = frozenset()  # plain keys the init_id stands for
    # NumPy's range: the trainer seeds np.random with it, which raised in every rank outside it.
    seed: int = Field(1337, ge=0, le=2**32 - 1, description="initial weights and the global sample order "
                      "(0 to 2^32 - 1)")
    data: DataSection = Field(default_factory=DataSection)
    batch: BatchSection = Field(default_factory=BatchSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    compute: ComputeSection = Field(default_factory=ComputeSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="after")
    def _floor_below_peak(self) -> "TrainConfig":
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"schedule.min_lr ({self.schedule.min_lr}) must not exceed optimizer.lr ({self.optimizer.lr})")
        return self


def requested_rows_per_rank(batch: BatchSection) -> int:
    """micro_batch_size × grad_accum_steps, with ``auto`` standing for the default micro-batch (16)."""
    micro = BatchSection.model_fields["micro_batch_size"].default if batch.micro_batch_size == "auto" else batch.micro_batch_size
    return micro * batch.grad_accum_steps


def identity_sections(cfg: TrainConfig) -> dict[str, Any]:
    """The parts of ``cfg`` that define what a run computes: every section whose
    class says ``identity = True`` (its :meth:`Section.identity_values`), and
    every plain (non-section) key such as ``seed``, except those that enter as
    the starting weights' own identity (``identity_by_init``). ``model`` is left
    to the caller, which passes the resolved ModelConfig instead of the preset name."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, Section):
            if type(value).identity:
                out[name] = value.identity_values()
        elif not isinstance(value, BaseModel) and name not in cfg.identity_by_init:
            out[name] = value
    return out


def identity_record(cfg: TrainConfig, model: dict[str, Any], global_batch: int, data_id: str,
                    init_id: str | None) -> dict[str, Any]:
    """Everything the run identity is made of, as plain JSON: the identity
    sections, the resolved model (in place of the ``model`` section: a preset
    name and the dimensions it stands for are the same run), the global batch
    (not its split into micro-batches × ranks), a digest of the dataset and the
    starting weights. Checkpoints record it (meta ``identity``) so that a later
    run can say which keys changed."""
    return {**identity_sections(cfg), "model": model, "global_batch": global_batch,
            "dataset": hashlib.sha256(data_id.encode()).hexdigest()[:16], "init": init_id}


def fingerprint_of(record: dict[str, Any]) -> str:
    blob = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_identity(cfg: TrainConfig, model: dict[str, Any], global_batch: int, data_id: str, init_id: str | None) -> str:
    """Fingerprint of a training run: the digest of :func:`identity_record`."""
    return fingerprint_of(identity_record(cfg, model, global_batch, data_id, init_id))
