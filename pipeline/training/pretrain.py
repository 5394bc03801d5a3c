"""pretrain: train the model on the packed shards, from scratch or from ``init_from``.

Runs on every rank under torchrun (stages/pretrain.py launches it). Reads
``data/packed/{train,val}``, writes checkpoints to ``models/pretrain/``, the
live curve to ``plots/pretrain.csv``, and returns the summary that rank 0 writes
to ``metrics/pretrain.json``; what is not a number to compare (precision, the
final checkpoint's path) goes to ``models/pretrain/report.json``.

With ``init_from`` (pipeline/training/init.py) the architecture and the starting
weights come from a local Hugging Face model or a checkpoint of ours, and the
keys of ``pretrain.model`` are ignored (with a warning naming them).
``schedule.max_steps: 0`` then passes the initial model through unchanged as
the stage's output, so that sft, evaluate and export run on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import logging

import numpy as np
from pydantic import Field, field_validator

from pipeline.data import shards
from pipeline.data.shards import DataError, PackedRows
from pipeline.errors import StageError
from pipeline.files import write_json
from pipeline.model.transformer import PRESETS, ModelConfig, build_config
from pipeline.training import checkpoint as ckpt
from pipeline.training.config import Section, TrainConfig
from pipeline.training.init import InitError, InitSource, check_tokenizer, resolve_init
from pipeline.training.parallelize import check_parallelism
from pipeline.training.trainer import Trainer, check_batch, check_compute, check_resume

log = logging.getLogger("pipeline.training")

REPORT = "report.json"


class ModelSection(Section):
    """A preset from pipeline.model.transformer.PRESETS; any dimension given here overrides it."""

    identity = True
    preset: str | None = Field("mini", description="tiny | mini | small | medium | large | xl (0.65M, 2.0M, 91M, 317M, 742M, 1.51B parameters at vocab 8192); null: give n_layer, n_head, d_model")
    n_layer: int | None = Field(None, ge=1, description="transformer blocks")
    n_head: int | None = Field(None, ge=1, description="query heads")
    n_kv_head: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention); must divide n_head")
    d_model: int | None = Field(None, ge=1, description="residual width")
    ffn_hidden: int | None = Field(None, ge=1, description="SwiGLU hidden width (default: Llama's 8/3 d_model, rounded)")
    max_seq_len: int | None = Field(None, ge=1, description="longest sequence (RoPE, KV cache); null: the preset's, raised to pack.seq_len if smaller; a value below pack.seq_len is an error")
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
        """The model these params give; a shape it cannot take (heads that do not
        divide the width, ...) is a StageError naming the section, in one line."""
        overrides = self.model_dump(exclude={"preset"})
        try:
            cfg = build_config(self.preset, vocab_size, **overrides)
            if self.max_seq_len is None and cfg.max_seq_len < seq_len:
                cfg = build_config(self.preset, vocab_size, **{**overrides, "max_seq_len": seq_len})
        except ValueError as err:
            problems = [line.strip() for line in str(err).splitlines()[1:]] or [str(err)]
            raise StageError(f"pretrain.model (preset {self.preset}, with its overrides): " + "; ".join(problems)
                             ) from None
        return cfg


class PretrainConfig(TrainConfig):
    model: ModelSection = Field(default_factory=ModelSection)
    init_from: str | None = Field(None, description="null (random init), a local Hugging Face model folder, or a "
                                  "checkpoint folder of ours (any stage, any step, previous/ runs included)")
    init_optimizer: bool = Field(False, description="with init_from a checkpoint of ours: also load its AdamW moments")
    # Both enter the run identity as the content of what they load (init_id), not
    # as a path: moving a model folder is not a new run, replacing its weights is.
    identity_by_init: ClassVar[frozenset[str]] = frozenset({"init_from", "init_optimizer"})

    @field_validator("init_from")
    @classmethod
    def _a_path_or_null(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():  # Path("") is the project root, which would be looked for a model
            raise ValueError("is empty; null starts from a random init, or name a model or checkpoint folder")
        return v


def plan(cfg: PretrainConfig, packed_dir: Path, out_dir: Path, *, warn: bool = False
         ) -> tuple[ModelConfig, str, dict[str, Any], InitSource | None]:
    """The model to build, the data identity, the checkpoint metadata and the
    starting point, from pack's manifest and ``init_from``. ``warn``: log what
    params are ignored (once, in the launcher)."""
    try:
        manifest = shards.read_manifest(packed_dir)
    except DataError as err:
        raise DataError(f"{err}; run `dvc repro pack` first") from None
    if cfg.init_from is not None and _names_live_checkpoints(Path(cfg.init_from), Path(out_dir)):
        raise InitError(f"pretrain.init_from {cfg.init_from} names this stage's own live checkpoints, which move to "
                        f"{out_dir}/previous/ as soon as the new run starts; name the moved copy "
                        f"({out_dir}/previous/<run-id>/step-N) or a copy elsewhere")
    init = resolve_init(cfg.init_from, warn_outside_base=warn)
    if init is None:
        if cfg.schedule.max_steps == 0:
            raise InitError("pretrain.schedule.max_steps 0 passes init_from through unchanged, but init_from is "
                            "null; set pretrain.init_from or train at least one step")
        if cfg.init_optimizer:
            raise InitError("pretrain.init_optimizer needs init_from to name a checkpoint of ours")
        model_cfg = cfg.model.build(manifest["vocab_size"], manifest["seq_len"])
        if manifest["seq_len"] > model_cfg.max_seq_len:
            raise StageError(f"pack.seq_len {manifest['seq_len']} exceeds pretrain.model.max_seq_len "
                             f"{model_cfg.max_seq_len}; raise it (null follows pack.seq_len) or lower pack.seq_len")
    else:
        check_tokenizer(init, manifest, warn=warn)
        if cfg.init_optimizer and init.kind != "checkpoint":
            raise InitError(f"pretrain.init_optimizer: {init.path} is a Hugging Face model, which has no optimizer "
                            "state; set it to false")
        model_cfg = init.model
        if manifest["seq_len"] > model_cfg.max_seq_len:
            raise InitError(f"pack.seq_len {manifest['seq_len']} exceeds the max_seq_len {model_cfg.max_seq_len} "
                            f"of {init.path}; lower pack.seq_len")
        fields = type(cfg.model).model_fields  # keys left at their defaults (params.yaml ships preset: mini) say nothing
        ignored = sorted(k for k in cfg.model.model_fields_set if getattr(cfg.model, k) != fields[k].get_default())
        if warn and ignored:
            log.warning("init_from is set: the architecture comes from %s, so pretrain.model key(s) %s are ignored",
                        init.path, ", ".join(ignored))
    data_id = manifest.get("tokenizer_sha256", "") + ":" + ",".join(
        s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"])
    meta = {"tokenizer_sha256": manifest.get("tokenizer_sha256"), "vocab_size": manifest["vocab_size"],
            **(init.meta if init else {})}
    return model_cfg, data_id, meta, init


def _names_live_checkpoints(path: Path, out_dir: Path) -> bool:
    """True for ``out_dir`` itself or one of its ``step-*`` folders (not ``previous/``)."""
    path, out_dir = path.expanduser().resolve(), out_dir.resolve()
    return path == out_dir or (path.parent == out_dir and path.name.startswith("step-"))


def _init_kwargs(cfg: PretrainConfig, init: InitSource | None) -> dict[str, Any]:
    """How the Trainer starts the run from ``init`` (nothing for random init)."""
    if init is None:
        return {}
    if init.kind == "checkpoint":
        return {"init_from": init.checkpoint, "init_optimizer": cfg.init_optimizer}
    return {"init_weights": init.load_weights, "init_id": init.init_id}


def prepare_pretrain(cfg: PretrainConfig, packed_dir: Path, out_dir: Path) -> None:
    """Once, in the launcher: the packed data and the starting point exist, and
    the run can start or resume."""
    model_cfg, data_id, _, init = plan(cfg, packed_dir, out_dir, warn=True)
    kwargs = _init_kwargs(cfg, init)
    kwargs.pop("init_weights", None)  # the launcher only decides whether to resume
    check_batch(cfg, Path(packed_dir) / "train")
    check_compute(cfg)
    check_parallelism(cfg.compute)
    check_resume(cfg, model_cfg, out_dir, data_id=data_id, **kwargs)


def run_pretrain(cfg: PretrainConfig, packed_dir: Path, out_dir: Path, csv_path: Path) -> dict[str, Any]:
    """Train on every rank; rank 0 returns the metrics and writes ``out_dir/report.json``."""
    model_cfg, data_id, meta, init = plan(cfg, packed_dir, out_dir)
    trainer = Trainer("pretrain", cfg, model_cfg, Path(packed_dir) / "train", Path(packed_dir) / "val",
                      out_dir, csv_path, data_id=data_id, extra_meta=meta, **_init_kwargs(cfg, init))
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
