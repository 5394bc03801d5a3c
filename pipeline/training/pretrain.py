"""pretrain: train the model from scratch on the packed shards.

Runs on every rank under torchrun (stages/pretrain.py launches it). Reads
``data/packed/{train,val}``, writes checkpoints to ``models/pretrain/``, the
live curve to ``plots/pretrain.csv``, and returns the summary that rank 0 writes
to ``metrics/pretrain.json``; what is not a number to compare (precision, the
final checkpoint's path) goes to ``models/pretrain/report.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from pipeline.data import shards
from pipeline.data.shards import DataError, PackedRows
from pipeline.files import write_json
from pipeline.model.transformer import PRESETS, ModelConfig, build_config
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import Section, TrainConfig
from pipeline.training.trainer import Trainer, check_resume

REPORT = "report.json"


class ModelSection(Section):
    """A preset from pipeline.model.transformer.PRESETS; any dimension given here overrides it."""

    identity = True
    preset: str | None = Field("mini", description="tiny | mini | small (124M) | medium (~350M) | large (~760M) | xl (~1.5B); null: give n_layer, n_head, d_model")
    n_layer: int | None = Field(None, ge=1, description="transformer blocks")
    n_head: int | None = Field(None, ge=1, description="query heads")
    n_kv_head: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention); must divide n_head")
    d_model: int | None = Field(None, ge=1, description="residual width")
    ffn_hidden: int | None = Field(None, ge=1, description="SwiGLU hidden width (default: Llama's 8/3 d_model, rounded)")
    max_seq_len: int | None = Field(None, ge=1, description="longest sequence (RoPE, KV cache); raised to pack.seq_len if smaller")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool | None = Field(None, description="share the input embedding and output head")
    init_std: float | None = Field(None, gt=0, description="std of the normal init")

    @field_validator("preset")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; presets are {', '.join(PRESETS)}")
        return v

    def build(self, vocab_size: int, seq_len: int) -> ModelConfig:
        overrides = self.model_dump(exclude={"preset"})
        cfg = build_config(self.preset, vocab_size, **overrides)
        if self.max_seq_len is None and cfg.max_seq_len < seq_len:
            cfg = build_config(self.preset, vocab_size, **{**overrides, "max_seq_len": seq_len})
        return cfg


class PretrainConfig(TrainConfig):
    model: ModelSection = Field(default_factory=ModelSection)


def plan(cfg: PretrainConfig, packed_dir: Path) -> tuple[ModelConfig, str, dict[str, Any]]:
    """The model to build, the data identity and the checkpoint metadata, from pack's manifest."""
    try:
        manifest = shards.read_manifest(packed_dir)
    except DataError as err:
        raise DataError(f"{err}; run `dvc repro pack` first") from None
    model_cfg = cfg.model.build(manifest["vocab_size"], manifest["seq_len"])
    data_id = manifest.get("tokenizer_sha256", "") + ":" + ",".join(
        s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"])
    return model_cfg, data_id, {"tokenizer_sha256": manifest.get("tokenizer_sha256"),
                                "vocab_size": manifest["vocab_size"]}


def prepare_pretrain(cfg: PretrainConfig, packed_dir: Path, out_dir: Path) -> None:
    """Once, in the launcher: the packed data exists and the run can start or resume."""
    model_cfg, data_id, _ = plan(cfg, packed_dir)
    check_resume(cfg, model_cfg, out_dir, data_id=data_id)


def run_pretrain(cfg: PretrainConfig, packed_dir: Path, out_dir: Path, csv_path: Path) -> dict[str, Any]:
    """Train on every rank; rank 0 returns the metrics and writes ``out_dir/report.json``."""
    model_cfg, data_id, meta = plan(cfg, packed_dir)
    trainer = Trainer("pretrain", cfg, model_cfg, Path(packed_dir) / "train", Path(packed_dir) / "val",
                      out_dir, csv_path, data_id=data_id, extra_meta=meta)
    try:
        summary = trainer.fit()
        if not trainer.d.is_main:
            return {}
        summary["unigram_entropy"] = unigram_entropy(trainer.train_data)
        write_report(out_dir, trainer)
        return summary
    finally:
        trainer.close()


def write_report(out_dir: Path, trainer: Trainer, **extra: Any) -> None:
    """What describes the finished run but is not a number to compare across runs."""
    last = ckpt.latest(Path(out_dir))
    write_json(Path(out_dir) / REPORT, {"checkpoint": str(last.path) if last else None,
                                        "fingerprint": trainer.fingerprint, "precision": trainer.precision,
                                        "device": trainer.d.device.type, **extra})


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
