"""sft: supervised fine-tuning from pretrain's final checkpoint.

Two phases, both reusing the pretrain machinery rather than forking it:

1. ``prepare_sft`` runs once, in the launcher process and under the trainer
   lock, before torchrun starts: it turns ``sft.sources`` into packed Arrow
   shards with a ``labels`` column (pipeline/data/sft_data.py; loss only on
   assistant tokens) under ``data/sft/``.
2. ``run_sft`` runs on every rank: the same :class:`~pipeline.training.trainer.Trainer`
   as pretrain, initialised from the newest checkpoint in ``models/pretrain``,
   checkpointing into ``models/sft`` and logging to ``plots/sft.csv`` and MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from pipeline.data import shards
from pipeline.data.sft_data import SFTDataConfig, build_once
from pipeline.errors import StageError
from pipeline.files import read_json, write_json
from pipeline.model.transformer import ModelConfig
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import (
    CheckpointSection,
    DataSection,
    EvalSection,
    OptimizerSection,
    ScheduleSection,
    TrainConfig,
)
from pipeline.training.parallelize import check_parallelism
from pipeline.training.pretrain import write_report
from pipeline.training.trainer import Trainer, check_batch, check_compute, check_resume

DATA_REPORT = "report.json"  # data/sft/report.json: the SFT data build, per source and split


class SFTError(StageError):
    """sft cannot start: no finished pretrain checkpoint, or data that does not fit the model."""


class SFTData(SFTDataConfig, DataSection):
    """The SFT dataset to build (:class:`~pipeline.data.sft_data.SFTDataConfig`) and how rows are masked."""

    # Keys that change what is trained only through the rows they build, which the data identity (the
    # shards' hashes) holds: the quarantine's sample size never, shard_rows and the template's date only
    # where they change the shards.
    THROUGH_THE_DATA: ClassVar[tuple[str, ...]] = ("quarantine_per_reason", "shard_rows", "template_date")

    def identity_values(self) -> dict[str, Any]:
        return {k: v for k, v in super().identity_values().items() if k not in self.THROUGH_THE_DATA}


class SFTOptimizer(OptimizerSection):
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")


class SFTSchedule(ScheduleSection):
    max_steps: int = Field(
        200, ge=1, description="optimizer steps (at least 1: sft has something to learn); the schedule ends here")
    warmup_steps: int = Field(20, ge=0, description="linear warmup from 0 to optimizer.lr")
    min_lr: float = Field(1e-4, ge=0, description="floor of the schedule (reached at the end under wsd)")


class SFTEval(EvalSection):
    every: int = Field(50, ge=1, description="steps between val-loss evaluations (and at the end)")
    rows: int | None = Field(None, ge=1, description="val rows per evaluation; null = the whole split")


class SFTCheckpoint(CheckpointSection):
    every: int = Field(100, ge=1, description="steps between checkpoints (and at the end)")


class SFTConfig(TrainConfig):
    """The training sections of pretrain (shorter defaults: fine-tuning is short),
    with ``data`` widened to the SFT dataset; the model comes from the checkpoint."""

    data: SFTData = Field(default_factory=SFTData)
    optimizer: SFTOptimizer = Field(default_factory=SFTOptimizer)
    schedule: SFTSchedule = Field(default_factory=SFTSchedule)
    eval: SFTEval = Field(default_factory=SFTEval)
    checkpoint: SFTCheckpoint = Field(default_factory=SFTCheckpoint)


def pretrained(pretrain_dir: Path) -> ckpt.Checkpoint:
    """pretrain's final checkpoint, verified; a one-line SFTError when there is none,
    a CheckpointError naming the file when the newest one is damaged."""
    last = ckpt.resolve(Path(pretrain_dir))
    if last is None:
        raise SFTError(f"no checkpoint in {pretrain_dir}; run `dvc repro pretrain` first")
    why = ckpt.unfinished(last, "pretrain")
    if why:
        raise SFTError(why)
    return last


def starting_model(cfg: SFTConfig, pretrain_dir: Path) -> tuple[ckpt.Checkpoint, ModelConfig]:
    """pretrain's final checkpoint (:func:`pretrained`) and its model, from the
    checkpoint's metadata, so before any SFT data is built; a one-line SFTError
    when ``sft.data.seq_len`` exceeds the model's ``max_seq_len``."""
    init = pretrained(pretrain_dir)
    model_cfg = ckpt.model_config(init)
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise SFTError(f"sft.data.seq_len {cfg.data.seq_len} exceeds the pretrained model's max_seq_len "
                       f"{model_cfg.max_seq_len}; lower it")
    return init, model_cfg


def check_tokenizer(tokenizer_path: Path, init: ckpt.Checkpoint, model_cfg: ModelConfig) -> None:
    """Before the SFT data is built: a one-line SFTError unless ``tokenizer_path`` is
    the tokenizer pretrain trained with (the sha256 its checkpoint records, when it
    records one) and the model embeds every id of it (a rank stopped at the first
    id past the embedding in an IndexError traceback)."""
    from pipeline.data.tokenizer import check_fits, check_trained_with, load_tokenizer

    try:
        check_trained_with(tokenizer_path, init.meta.get("tokenizer_sha256"),
                           fix="run `dvc repro tokenizer pretrain` before sft")
        check_fits(load_tokenizer(tokenizer_path), model_cfg.vocab_size,
                   fix="sft needs the tokenizer the model was pretrained with")
    except ValueError as err:
        raise SFTError(f"{init.path}: {err}") from None


def plan(cfg: SFTConfig, data_dir: Path, pretrain_dir: Path
         ) -> tuple[ckpt.Checkpoint, ModelConfig, str, dict[str, Any]]:
    """The starting checkpoint, its model, the data identity and the checkpoint metadata."""
    init, model_cfg = starting_model(cfg, pretrain_dir)
    manifest = shards.read_manifest(data_dir)
    if init.meta.get("tokenizer_sha256") not in (None, manifest["tokenizer_sha256"]):
        raise SFTError("the SFT data was tokenized with a different tokenizer than the pretrained model's; "
                       "rerun `dvc repro sft` after `dvc repro tokenizer pretrain`")
    data_id = ",".join(s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"])
    # The original Hugging Face config travels on, so that export writes the same family.
    carried = {k: init.meta[k] for k in ("hf_config", "hf_generation_config") if k in init.meta}
    meta = {"tokenizer_sha256": manifest["tokenizer_sha256"], "init_from": str(init.path),
            "vocab_size": model_cfg.vocab_size, **carried}
    return init, model_cfg, data_id, meta


def prepare_sft(cfg: SFTConfig, tokenizer_path: Path, data_dir: Path, quarantine_path: Path,
                pretrain_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Once, in the launcher: check that pretrain finished, that its model takes
    ``sft.data.seq_len`` and the tokenizer (:func:`check_tokenizer`), build the SFT
    shards, and check that the run can start or resume."""
    init, model_cfg = starting_model(cfg, pretrain_dir)
    check_compute(cfg)
    check_parallelism(cfg.compute)
    check_tokenizer(Path(tokenizer_path), init, model_cfg)
    metrics = build_once(cfg.data, tokenizer_path, data_dir, quarantine_path)  # once for the nodes sharing it
    write_json(Path(data_dir) / DATA_REPORT, metrics)
    init, model_cfg, data_id, _ = plan(cfg, data_dir, pretrain_dir)
    check_batch(cfg, Path(data_dir) / "train")
    check_resume(cfg, model_cfg, out_dir, data_id=data_id, init_from=init)
    return metrics


def data_metrics(build: dict[str, Any]) -> dict[str, Any]:
    """The SFT data build's numbers worth comparing across runs; the per-source
    and per-reason tables stay in data/sft/report.json."""
    splits = [build[s] for s in ("train", "val")]
    return {"examples_in": build["examples_in"], "examples": sum(s["examples"] for s in splits),
            "skipped": sum(build["skipped"].values()), "truncated": build["truncated"], "fill": build["fill"],
            "train_rows": build["train"]["rows"], "val_rows": build["val"]["rows"],
            "label_tokens": sum(s["label_tokens"] for s in splits)}


def run_sft(cfg: SFTConfig, data_dir: Path, pretrain_dir: Path, out_dir: Path, csv_path: Path) -> dict[str, Any]:
    """Fine-tune on every rank; rank 0 returns the metrics and writes ``out_dir/report.json``."""
    init, model_cfg, data_id, meta = plan(cfg, data_dir, pretrain_dir)
    trainer = Trainer("sft", cfg, model_cfg, Path(data_dir) / "train", Path(data_dir) / "val", out_dir, csv_path,
                      data_id=data_id, init_from=init, extra_meta=meta)
    try:
        summary = trainer.fit()
        if not trainer.d.is_main:
            return {}
        report = Path(data_dir) / DATA_REPORT
        summary.update(data_metrics(read_json(report)) if report.exists() else {})
        summary["init_step"] = init.step
        write_report(out_dir, trainer, init_from={"path": str(init.path), "step": init.step,
                                                  "fingerprint": init.meta.get("fingerprint")})
        return summary
    finally:
        trainer.close()
