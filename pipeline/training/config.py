"""The training config, nested by concern, and the run identity derived from it.

pretrain and sft share one schema (``TrainConfig``) made of sections, in the
spirit of torchtitan's JobConfig::

    seed        initial weights and the global sample order
    model       architecture (pretrain only: sft takes it from the checkpoint)
    data        what rows are trained on and how they are masked
    batch       micro-batch and accumulation (with the world size: the global batch)
    optimizer   AdamW and clipping
    schedule    steps, warmup and the cosine floor
    compute     device, precision, compile, activation checkpointing
    launch      torchrun settings
    eval        how often and on how many val rows
    checkpoint  how often and how many are kept
    logging     console/CSV/MLflow reporting, MFU, spike counting

Every section declares whether it is part of the *run identity*: what a run
computes, as opposed to how it is executed or reported. A checkpoint resumes
only a run with the same identity (plus the resolved model, the global batch,
the data and the starting weights). Because the flag lives on the section, a key
added to a section is covered automatically; a new section cannot be added
without deciding (``Section.__init_subclass__`` insists).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.config import StageConfig
from pipeline.training.torchrun import LaunchConfig


class Section(BaseModel):
    """A frozen, strict config section. Subclasses set ``identity``: True when a
    change to any key of theirs changes what training computes."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    identity: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not any("identity" in vars(c) for c in cls.__mro__ if c is not Section):
            raise TypeError(f"{cls.__name__}: a config section must declare identity = True or False")


class DataSection(Section):
    identity = True
    doc_mask: bool = Field(True, description="block-diagonal causal attention inside packed rows")


class BatchSection(Section):
    """Only the global batch (micro × accum × world size) is part of the identity;
    how it is split over ranks and micro-batches is not (see pipeline/training/sampler.py)."""

    identity = False
    micro_batch_size: int = Field(16, ge=1, description="rows per rank per forward pass")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step (no gradient sync until the last)")


class OptimizerSection(Section):
    identity = True
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay of linear weights (not norms, biases, embeddings)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")


class ScheduleSection(Section):
    identity = True
    max_steps: int = Field(600, ge=1, description="optimizer steps; the cosine schedule ends here")
    warmup_steps: int = Field(50, ge=0, description="linear warmup from 0 to optimizer.lr")
    min_lr: float = Field(3e-4, ge=0, description="floor of the cosine schedule")

    @model_validator(mode="after")
    def _warmup_fits(self) -> "ScheduleSection":
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})")
        return self


class ComputeSection(Section):
    identity = False
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: bf16 where the device supports it (CPU included), else fp32; fp16 uses a GradScaler")
    compile: bool = Field(False, description="torch.compile the model")
    activation_checkpointing: bool = Field(False, description="recompute each block in backward to save memory")


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


class LoggingSection(Section):
    identity = False
    every: int = Field(10, ge=1, description="steps between console/CSV/MLflow reports")
    spike_factor: float = Field(2.0, gt=1, description="a loss above factor × its running mean counts as a spike")
    peak_flops: float | None = Field(None, gt=0, description="peak FLOP/s per device for MFU; null = measure a matmul")
    track: bool = Field(True, description="log to MLflow (rank 0)")
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, GPU with pynvml)")


class TrainConfig(StageConfig):
    """Everything the training loop needs; pretrain adds ``model``, sft widens ``data``."""

    seed: int = Field(1337, description="initial weights and the global sample order")
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


def identity_sections(cfg: TrainConfig) -> dict[str, Any]:
    """The parts of ``cfg`` that define what a run computes: every section whose
    class says ``identity = True``, and every plain (non-section) key such as
    ``seed``. ``model`` is left to the caller, which passes the resolved
    ModelConfig instead of the preset name."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, Section):
            if type(value).identity:
                out[name] = value.model_dump(mode="json")
        elif not isinstance(value, BaseModel):
            out[name] = value
    return out


def run_identity(cfg: TrainConfig, model: dict[str, Any], global_batch: int, data_id: str, init_id: str | None) -> str:
    """Fingerprint of a training run: its identity sections, the resolved model,
    the global batch (not its split into micro-batches × ranks), the data and the
    weights it started from."""
    blob = json.dumps([identity_sections(cfg), model, global_batch, data_id, init_id], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
