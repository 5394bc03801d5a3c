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
from typing import Any

from pydantic import Field

from pipeline.training import checkpoint as ckpt
from pipeline.files import read_json, write_json
from pipeline.model.transformer import ModelConfig
from pipeline.data.sft_data import SFTDataConfig, build_sft_data
from pipeline.training.trainer import TrainConfig, Trainer
from pipeline.errors import StageError

BUILD_METRICS = "build_metrics.json"


class SFTError(StageError):
    pass


class SFTConfig(TrainConfig, SFTDataConfig):
    """Training keys as in pretrain (smaller defaults: fine-tuning is short) plus
    the data keys of :class:`~pipeline.data.sft_data.SFTDataConfig`."""

    max_steps: int = Field(200, ge=1, description="optimizer steps; the cosine schedule ends here")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    min_lr: float = Field(1e-4, ge=0, description="floor of the cosine schedule")
    warmup_steps: int = Field(20, ge=0, description="linear warmup from 0 to lr")
    eval_every: int = Field(50, ge=1, description="steps between val-loss evaluations (and at the end)")
    checkpoint_every: int = Field(100, ge=1, description="steps between checkpoints (and at the end)")
    eval_rows: int | None = Field(None, ge=1, description="val rows per evaluation; null = the whole split")


def data_config(cfg: SFTConfig) -> SFTDataConfig:
    return SFTDataConfig(**{k: getattr(cfg, k) for k in SFTDataConfig.model_fields})


def prepare_sft(cfg: SFTConfig, tokenizer_path: Path, data_dir: Path, quarantine_path: Path) -> dict[str, Any]:
    metrics = build_sft_data(data_config(cfg), tokenizer_path, data_dir, quarantine_path)
    write_json(Path(data_dir) / BUILD_METRICS, metrics)
    return metrics


def pretrained(pretrain_dir: Path) -> ckpt.Checkpoint:
    last = ckpt.latest(Path(pretrain_dir))
    if last is None:
        raise SFTError(f"no checkpoint in {pretrain_dir}; run the pretrain stage first")
    if not last.meta.get("final"):
        raise SFTError(f"{last.path} is not pretrain's final checkpoint (step {last.step}); "
                       "pretrain was interrupted: rerun it to finish")
    return last


def run_sft(cfg: SFTConfig, data_dir: Path, pretrain_dir: Path, out_dir: Path, csv_path: Path) -> dict[str, Any]:
    init = pretrained(pretrain_dir)
    model_cfg = ModelConfig(**init.meta["model"])
    manifest = read_json(Path(data_dir) / "manifest.json")
    if cfg.seq_len > model_cfg.max_seq_len:
        raise SFTError(f"sft.seq_len {cfg.seq_len} exceeds the pretrained model's max_seq_len {model_cfg.max_seq_len}")
    if init.meta.get("tokenizer_sha256") not in (None, manifest["tokenizer_sha256"]):
        raise SFTError("the SFT data was tokenized with a different tokenizer than the pretrained model's")
    data_id = ",".join(s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"])
    trainer = Trainer("sft", cfg, model_cfg, Path(data_dir) / "train", Path(data_dir) / "val", out_dir, csv_path,
                      data_id=data_id, init_weights=Path(pretrain_dir),
                      extra_meta={"tokenizer_sha256": manifest["tokenizer_sha256"], "init_from": str(init.path),
                                  "vocab_size": model_cfg.vocab_size})
    try:
        summary = trainer.fit()
        if not trainer.d.is_main:
            return {}
        build = Path(data_dir) / BUILD_METRICS
        summary["data"] = read_json(build) if build.exists() else {}
        summary["init_from"] = {"path": str(init.path), "step": init.step, "fingerprint": init.meta.get("fingerprint")}
        return summary
    finally:
        trainer.close()
