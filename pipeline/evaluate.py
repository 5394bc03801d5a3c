"""evaluate: val loss, perplexity and bits per byte for the pretrained and the SFT model.

Each model is scored on two splits:

* the packed pretraining val split (``data/packed/val``): every token counts;
* the SFT val split (``data/sft/val``): only assistant tokens count (labels != -100).

Bits per byte divides the summed negative log-likelihood (converted to bits) by
the number of UTF-8 bytes the scored target tokens stand for, so it does not
depend on the tokenizer and runs with different tokenizers can be compared.
Special tokens (end of document, chat markers) are scored but stand for zero
bytes. A tokenizer that puts a dummy prefix before every text (SentencePiece's
``▁``) has its first token of each document stand for one byte more than the
text has; that byte is taken off per scored document start (see :func:`score`).
Perplexity is ``exp(val_loss)`` per token.

Scoring uses the same document masking as training (``doc_mask``), in fp32 by
default so that the numbers are reproducible by any other implementation (the
export test recomputes the SFT model's perplexity with ``transformers``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from functools import partial
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import torch
from pydantic import Field, field_validator

from pipeline.config import ParamsModel, StageConfig
from pipeline.data.shards import MANIFEST, PackedRows, read_manifest
from pipeline.errors import StageError
from pipeline.files import sha256_file, write_json
from pipeline.model.transformer import Transformer
from pipeline.progress import progress
from pipeline.training import checkpoint as ckpt
from pipeline.training.loss import IGNORE_INDEX, token_loss_sum
from pipeline.training.precision import autocast, resolve_precision

log = logging.getLogger("pipeline.evaluate")


class SampleConfig(ParamsModel):
    """Fixed prompts completed with fixed seeds, recorded with every evaluation."""

    prompts: list[str] = Field(default_factory=lambda: ["def fibonacci(n):", "import os\n\n\ndef "],
                               description="raw-text prompts completed by both models")
    chat: list[str] = Field(default_factory=lambda: ["What does `os.path.join` do?", "What does `json.loads` do?"],
                            description="user messages answered in the template the SFT data was rendered with")
    max_new_tokens: int = Field(64, ge=1, description="tokens generated per sample at most")
    temperature: float = Field(0.8, ge=0, description="0 = greedy")
    top_k: int | None = Field(50, ge=1, description="sample among the k most likely tokens; null = off")
    top_p: float | None = Field(0.95, gt=0, le=1, description="nucleus sampling mass; null = off")
    # torch.Generator takes up to 2^64 - 1; beyond, the stage stopped after the scoring.
    seed: int = Field(0, ge=0, le=2**32 - 1, description="sample i uses seed + i (0 to 2^32 - 1)")

    @field_validator("chat")
    @classmethod
    def _no_empty_message(cls, v: list[str]) -> list[str]:
        # A chat template has no empty turn: it failed after the scoring, at the first sample.
        for i, text in enumerate(v):
            if not text.strip():
                raise ValueError(f"message {i} is empty; a chat sample needs some text")
        return v


class CheckpointChoice(ParamsModel):
    """Which checkpoint of each run is scored. export ships one checkpoint and labels
    it with these metrics, so it refuses to ship another than the one scored here."""

    pretrain: Literal["last", "best"] = Field("last", description="models/pretrain: its last checkpoint, or its best "
                                              "by val loss (needs pretrain.checkpoint.keep_best)")
    sft: Literal["last", "best"] = Field("last", description="models/sft: its last checkpoint, or its best by val loss "
                                         "(needs sft.checkpoint.keep_best); export.checkpoint must name the same")


class EvaluateConfig(StageConfig):
    max_rows: int | None = Field(None, ge=1, description="val rows scored per split; null = all")
    batch_size: int = Field(8, ge=1, description="rows per forward pass")
    doc_mask: bool = Field(True, description="score with the same per-document attention as training")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field("fp32", description="fp32 keeps the numbers reproducible by transformers")
    checkpoint: CheckpointChoice = Field(default_factory=CheckpointChoice)
    samples: SampleConfig = Field(default_factory=SampleConfig)


class EvaluateError(StageError):
    pass


SCORES = ("val_loss", "perplexity", "bits_per_byte")  # per model and split in metrics/evaluate.json


BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback: one byte


def token_bytes(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for; added special tokens stand for none.

    In a byte-level BPE (GPT-2's byte-to-unicode alphabet: ours, Llama 3's,
    Qwen's) every character of a token's string is one byte, but for an added
    token that is not special: it is matched in the raw text, and stands for
    its string's UTF-8 bytes. Otherwise
    (SentencePiece's layout: Llama 2's, Mistral's) a token is its text with
    ``▁`` for a space, in UTF-8, and ``<0xNN>`` is one byte. That counts the
    ``▁`` of such a tokenizer's dummy prefix too, which is not in the text:
    :func:`dummy_prefix_bytes` measures it, and :func:`score` takes it off."""
    spec = json.loads(tokenizer.to_str())
    byte_level = '"ByteLevel"' in json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    out = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    added = tokenizer.get_added_tokens_decoder().values()
    special = {t.content for t in added if t.special}
    plain_added = {t.content for t in added if not t.special}  # matched in the raw text: their string is text
    for token, idx in vocab.items():
        if token in special:
            continue
        if byte_level:
            out[idx] = len(token.encode("utf-8")) if token in plain_added else len(token)
        elif BYTE_TOKEN.fullmatch(token):
            out[idx] = 1
        else:
            out[idx] = len(token.replace("\u2581", " ").encode("utf-8"))
    return out


def dummy_prefix_bytes(tokenizer) -> int:
    """Bytes that ``tokenizer``'s encoding of a text stands for beyond the text
    (:func:`token_bytes`): 1 for a tokenizer that puts a space before every text
    (:func:`pipeline.data.tokenizer.adds_dummy_prefix`: SentencePiece-style
    ones, which encode "a" as "▁a"), 0 for a byte-level BPE such as ours."""
    from pipeline.data.tokenizer import adds_dummy_prefix

    return int(adds_dummy_prefix(tokenizer))


def load_checkpoint_model(folder: Path, device: torch.device, which: str = "last",
                          tokenizer_path: Path | None = None) -> tuple[Transformer, ckpt.Checkpoint]:
    """The checkpoint ``which`` of the run folder ``folder`` and its model, in eval
    mode on ``device``. With ``tokenizer_path``, an EvaluateError unless that is the
    tokenizer the checkpoint was trained with (its recorded sha256) and every id of
    it has an embedding: scored with another, bits per byte counts other bytes, and
    a sample's id past the embedding stopped the stage in a traceback."""
    from pipeline.data.tokenizer import check_fits, check_trained_with, load_tokenizer

    last = ckpt.resolve(Path(folder), which)  # verified; a damaged one raises CheckpointError
    if last is None:
        raise EvaluateError(f"no checkpoint in {folder}; run its training stage first")
    config = ckpt.model_config(last)
    if tokenizer_path is not None:
        try:
            check_trained_with(tokenizer_path, last.meta.get("tokenizer_sha256"),
                               fix="rerun the training stages on it (`dvc repro`)")
            check_fits(load_tokenizer(tokenizer_path), config.vocab_size)
        except ValueError as err:
            raise EvaluateError(f"{last.path}: {err}") from None
    model = Transformer(config)
    ckpt.load_model_weights(last, model)
    return model.to(device).eval(), last


def check_split_tokenizer(split_dir: Path, tokenizer_path: Path, tokenizer_sha256: str) -> None:
    """Raise EvaluateError, one line, when the packed split ``split_dir`` was made
    with another tokenizer than ``tokenizer_path`` (the sha256 its folder's manifest
    records): its ids would be scored, and counted in bytes, as other tokens. Only
    a recorded 64-hex-digit sha256 is compared; a split without a manifest is left
    to its reader."""
    if not (split_dir.parent / MANIFEST).is_file():
        return
    recorded = read_manifest(split_dir.parent).get("tokenizer_sha256")
    if isinstance(recorded, str) and len(recorded) == 64 and recorded != tokenizer_sha256:
        raise EvaluateError(f"{split_dir} was made with another tokenizer (sha256 {recorded[:12]}…) than "
                            f"{tokenizer_path} (sha256 {tokenizer_sha256[:12]}…); rerun `dvc repro` so that data and "
                            "model share this one")


@torch.no_grad()
def score(model: Transformer, rows: PackedRows, nbytes: np.ndarray, *, batch_size: int, max_rows: int | None,
          doc_mask: bool, device: torch.device, precision: str, eot_id: int | None = None,
          prefix_bytes: int = 0, label: str | None = None) -> dict[str, float]:
    """Summed NLL over scored targets of the first ``max_rows`` rows, as loss,
    perplexity and bits per byte.

    ``bytes`` is what the scored targets stand for by ``nbytes``, less
    ``prefix_bytes`` (:func:`dummy_prefix_bytes`) per scored target whose input
    is ``eot_id``: the first token of a document, which with a dummy-prefix
    tokenizer stands for that prefix too. A split's first document has no
    end-of-text before it, and a document whose first token begins a row is
    only an input there: neither is a scored start. A document that pack starts
    at a chunk continuing its file (after a dropped chunk, or one in the other
    split) has no prefix (:func:`pipeline.data.pack.encode_continued`) and is
    counted one byte short. With ``prefix_bytes`` 0 (a byte-level tokenizer)
    the count is the plain sum. ``label`` names the progress bar (default: the
    split's folder name)."""
    n = len(rows) if max_rows is None else min(len(rows), max_rows)
    nll = 0.0
    tokens = 0
    text_bytes = 0
    for i in progress(iterable=range(0, n, batch_size), desc=f"score {label or rows.dir.name}", unit="batch"):
        batch = rows.batch(np.arange(i, min(n, i + batch_size)), device, doc_mask)
        targets = batch["targets"]
        top = max(int(batch["input_ids"].max()), int(targets.max()))
        if top >= min(len(nbytes), model.config.vocab_size):  # an IndexError in the embedding or the byte table
            raise EvaluateError(f"{rows.dir}: token id {top} is beyond the tokenizer's {len(nbytes)} ids or the "
                                f"model's {model.config.vocab_size}; the split was made with another tokenizer: "
                                "rerun `dvc repro` so that data and model share this one")
        with autocast(device, precision):
            logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
        nll += float(token_loss_sum(logits, targets))
        mask = targets != IGNORE_INDEX
        scored = targets[mask].cpu().numpy()
        tokens += scored.size
        text_bytes += int(nbytes[scored].sum())
        if prefix_bytes:
            text_bytes -= prefix_bytes * int((mask & (batch["input_ids"] == eot_id)).sum())
    if tokens == 0:
        raise EvaluateError(f"{rows.dir}: no scored tokens in the first {n} rows")
    loss = nll / tokens
    return {
        "val_loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": nll / math.log(2) / max(text_bytes, 1),
        "tokens": tokens,
        "bytes": text_bytes,
    }


def results_line(model_name: str, step: int, per_split: Mapping[str, Mapping[str, float]],
                 per_source: Mapping[str, Mapping[str, float]]) -> str:
    """One log line of a model's scores, for a reader of the stage's output:
    ``pretrain (step 300): text loss 2.1480, ppl 8.57, 0.9100 bits/byte; ...``,
    then bits per byte by source where there are sources."""
    splits = "; ".join(f"{name} loss {v['val_loss']:.4f}, ppl {v['perplexity']:.2f}, "
                       f"{v['bits_per_byte']:.4f} bits/byte" for name, v in per_split.items())
    sources = ", ".join(f"{name} {v['bits_per_byte']:.4f}" for name, v in per_source.items())
    return f"{model_name} (step {step}): {splits}" + (f"; bits/byte by source: {sources}" if sources else "")


def evaluate_models(cfg: EvaluateConfig, models: dict[str, Path], splits: dict[str, Path], tokenizer_path: Path,
                    report_path: Path | None = None, sources: dict[str, Path] | None = None,
                    which: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Transformer]]:
    """Score every model on every split. Returns ``({model: {metric: value,
    <split>: {metric: value}}}, loaded models)`` with the metrics val_loss,
    perplexity and bits_per_byte; the top-level metrics of each model are those
    on the first split (the packed pretraining val split). ``sources`` (source
    name -> its own packed val split, see pack's ``val_sources``) adds
    ``sources: {name: {metric: value}}`` to each model. ``which`` (model name ->
    ``last`` or ``best``, default ``last``) picks the checkpoint of each run
    folder scored. The report, written to ``report_path`` when given, holds per
    model the checkpoint scored (``checkpoint``, ``checkpoint_step``,
    ``fingerprint``, ``which``: what export compares with the checkpoint it
    ships) and per split the ``tokens`` and
    ``bytes`` scored, and for a run folder ``run_finished``. A run whose newest
    checkpoint is not ``final`` (interrupted) is scored with a warning, and its
    model's metrics get ``finished: false``."""
    from pipeline.data.tokenizer import load_specials, load_tokenizer
    from pipeline.training.distributed import pick_device

    device = pick_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    tok = load_tokenizer(tokenizer_path)
    nbytes = token_bytes(tok)
    eot_id, prefix = load_specials(tokenizer_path).eot_id, dummy_prefix_bytes(tok)
    tokenizer_sha256 = sha256_file(tokenizer_path)
    for path in (*splits.values(), *(sources or {}).values()):
        check_split_tokenizer(Path(path), tokenizer_path, tokenizer_sha256)
    data = {name: PackedRows(path) for name, path in splits.items()}
    by_source = {name: PackedRows(path) for name, path in (sources or {}).items()}
    out: dict[str, Any] = {}
    report: dict[str, Any] = {}
    loaded: dict[str, Transformer] = {}
    for model_name, folder in models.items():
        model, last = load_checkpoint_model(folder, device, (which or {}).get(model_name, "last"), tokenizer_path)
        loaded[model_name] = model
        scorer = partial(score, model, nbytes=nbytes, batch_size=cfg.batch_size, max_rows=cfg.max_rows,
                         doc_mask=cfg.doc_mask, device=device, precision=precision, eot_id=eot_id,
                         prefix_bytes=prefix)
        per_split = {name: scorer(rows, label=f"{model_name} {name}") for name, rows in data.items()}
        per_source = {name: scorer(rows, label=f"{model_name} source {name}") for name, rows in by_source.items()}
        scores = {name: {k: v[k] for k in SCORES} for name, v in per_split.items()}
        out[model_name] = {**next(iter(scores.values())), **scores}
        end = ckpt.run_end(folder, last)
        why = ckpt.unfinished(end) if end is not None else None
        if why:  # scored all the same (the numbers are still true of these weights), but flagged
            log.warning("evaluate: %s; the %s scores describe an unfinished run", why, model_name)
            out[model_name]["finished"] = False
        report[model_name] = {"checkpoint": str(last.path), "checkpoint_step": last.step,
                              "fingerprint": last.meta.get("fingerprint"), "which": (which or {}).get(model_name, "last"),
                              **({"run_finished": why is None} if end is not None else {}),
                              **{name: {k: v[k] for k in ("tokens", "bytes")} for name, v in per_split.items()}}
        if per_source:
            out[model_name]["sources"] = {name: {k: v[k] for k in SCORES} for name, v in per_source.items()}
            report[model_name]["sources"] = {name: {k: v[k] for k in ("tokens", "bytes")}
                                             for name, v in per_source.items()}
        log.info("%s", results_line(model_name, last.step, per_split, per_source))
    if report_path is not None:
        write_json(report_path, report)
    return out, loaded


def record_samples(cfg: SampleConfig, models: dict[str, Transformer], tokenizer_path: Path,
                   sft_manifest: Path | None = None) -> list[dict[str, Any]]:
    """Complete every fixed prompt with every model, seeded, so runs can be compared
    sample for sample. Raw prompts go to every model; chat prompts are rendered
    with the template the SFT data was rendered with (``sft_manifest``; ChatML
    without one) and stop at its end of turn or the tokenizer's eos."""
    from pipeline.data.chat_template import encode_prompt, template_of_sft_data
    from pipeline.data.tokenizer import load_specials, load_tokenizer
    from pipeline.files import read_stage_json
    from pipeline.model.generate import generate

    tok = load_tokenizer(tokenizer_path)
    specials = load_specials(tokenizer_path)
    manifest = read_stage_json(sft_manifest) if sft_manifest is not None and Path(sft_manifest).is_file() else {}
    template = template_of_sft_data(manifest, tokenizer_path, tok)
    chat_stops = list(manifest.get("stop_ids") or specials.eos_ids)
    text_stops = list(dict.fromkeys([specials.eot_id, *specials.eos_ids]))
    out = []
    for name, model in models.items():
        kinds = [("text", p, tok.encode(p, add_special_tokens=False).ids or [specials.eot_id], text_stops)
                 for p in cfg.prompts]
        kinds += [("chat", p, encode_prompt(tok, [{"role": "user", "content": p}], template), chat_stops)
                  for p in cfg.chat]
        for i, (kind, prompt, prompt_ids, stops) in enumerate(kinds):
            # A prompt longer than the model reads keeps its end (what the completion follows), leaving
            # room for the new tokens; the sample says how many tokens of its start were left out.
            keep = max(1, model.config.max_seq_len - cfg.max_new_tokens)
            cut = max(0, len(prompt_ids) - keep)
            if cut:
                log.warning("evaluate: %s sample %d has %d prompt tokens, more than %s reads with %d new ones; "
                            "its first %d are left out", kind, i, len(prompt_ids), name, cfg.max_new_tokens, cut)
            new = generate(model, prompt_ids[cut:], max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                           top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed + i, stop_ids=stops)
            out.append({"model": name, "kind": kind, "prompt": prompt, "seed": cfg.seed + i,
                        **({"prompt_tokens_left_out": cut} if cut else {}),
                        "completion": tok.decode([t for t in new if t not in stops], skip_special_tokens=False)})
    return out
