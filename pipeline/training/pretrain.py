"""pretrain: train the model from scratch on the packed shards.

Runs on every rank under torchrun (stages/pretrain.py launches it). Reads
``data/packed/{train,val}``, writes checkpoints to ``models/pretrain/``, the
live curve to ``plots/pretrain.csv``, and returns the summary that rank 0 writes
to ``metrics/pretrain.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.files import read_json
from pipeline.model.transformer import PRESETS, ModelConfig, build_config
from pipeline.training.trainer import TrainConfig, Trainer, unigram_entropy


class ModelSection(BaseModel):
    """A preset from pipeline.model.transformer.PRESETS; any dimension given here overrides it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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


def run_pretrain(cfg: PretrainConfig, packed_dir: Path, out_dir: Path, csv_path: Path) -> dict[str, Any]:
    manifest = read_json(Path(packed_dir) / "manifest.json")
    model_cfg = cfg.model.build(manifest["vocab_size"], manifest["seq_len"])
    data_id = manifest.get("tokenizer_sha256", "") + ":" + ",".join(
        s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"])
    trainer = Trainer("pretrain", cfg, model_cfg, Path(packed_dir) / "train", Path(packed_dir) / "val",
                      out_dir, csv_path, data_id=data_id,
                      extra_meta={"tokenizer_sha256": manifest.get("tokenizer_sha256"), "vocab_size": manifest["vocab_size"]})
    try:
        summary = trainer.fit()
        if trainer.d.is_main:
            summary["unigram_entropy"] = unigram_entropy(trainer.train_data)
        return summary if trainer.d.is_main else {}
    finally:
        trainer.close()
