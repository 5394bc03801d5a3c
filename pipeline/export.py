"""Export a checkpoint as a Hugging Face folder that loads with no custom code.

``export_model("models/sft", "data/tokenizer/tokenizer.json", "models/export", card_info=...)``
writes::

    config.json              the model family's config (pipeline.model.hf_adapter.hf_config)
    model.safetensors        weights under Hugging Face names, float32
    generation_config.json   eos = [<|im_end|>, <|endoftext|>], pad, sampling defaults
    tokenizer.json           byte-identical copy of ours (same sha256)
    tokenizer_config.json    PreTrainedTokenizerFast, special tokens, the chat_template SFT trained with (ChatML)
    special_tokens_map.json  the same special tokens, for older loaders
    README.md                model card: architecture, metrics, lineage, use, limitations

so that ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` work without ``trust_remote_code``. The
export stage then adds ``report.json`` (:func:`write_report`): the summary and
the registry's outcome.

Choices
    * Family: a model trained from scratch is a ``LlamaForCausalLM``. A run
      started from a Hugging Face model keeps that model's family
      (``ModelConfig.family``: Qwen2 with its biases, Qwen3 with its q/k norms,
      Llama with its RoPE scaling, ...), and its checkpoints carry the original
      config.json as meta ``hf_config``: the export's config.json is that file
      with our values for everything our ModelConfig describes (shapes, RoPE,
      norms, tying, dtype float32), so it differs from the original only where
      the model does (and in naming no custom code: ``auto_map`` is left out).
    * eos: the tokenizer's ``eos_token`` is ``<|im_end|>``, because the exported
      model is the chat (SFT) model and chat front ends stop at the tokenizer's
      eos. ``generation_config.json`` (and ``config.json``) list both
      ``<|im_end|>`` and ``<|endoftext|>`` as eos ids, so raw-text completion
      also ends at a document boundary.
    * Sampling settings: a model started from a Hugging Face folder ships that
      folder's ``generation_config.json`` as it reads at export time (the
      ``init_from`` chain of the checkpoint leads to it), with SFT's end-of-turn
      id added to its eos ids. Editing the file reruns export only: it is no part
      of the run identity, since it does not change what training computes.
    * bos: we never prepend one; every document in pretraining follows an
      ``<|endoftext|>``, so that is declared as bos (as GPT-2 does), with
      ``add_bos_token: false`` so that encoding matches ours exactly.
    * Tied embeddings: ``lm_head.weight`` is not stored and
      ``tie_word_embeddings: true`` makes transformers re-tie it, which it does
      without a missing-key warning. Untied models store ``lm_head.weight``.
    * dtype (``export.dtype``): ``auto`` is the dtype of the Hugging Face model
      the run started from (a bf16 base ships bf16, at half the size), and
      float32, as trained (master weights), for a model of ours.
    * The Hugging Face tokenizer turns special-token strings inside text into
      special ids (its chat template relies on it); ours does not. On text
      without such strings both give identical ids.

The folder is built beside ``out_dir`` under a hidden temporary name, every file
fsynced, then swapped in by rename (``pipeline.files.atomic_dir``), so readers (and DVC, whose output it is)
never see a half-written export. A crash between the two renames of the swap
leaves no ``out_dir`` but the previous export whole as ``.old-export-<pid>``
beside it, which the next export moves back before it starts.
An ``out_dir`` holding anything no export wrote (a user's notes, another model, a
file in its place, a file changed since the last export wrote it: an edited model
card) is refused in one line before any work, not replaced.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import torch
import yaml
from pydantic import Field, model_validator
from safetensors.torch import save_file

from pipeline.config import StageConfig, flatten
from pipeline.data.chat import CHAT_TEMPLATE_JINJA
from pipeline.data.tokenizer import EOT_ID, HF_DIR, OWN_TOKEN_VARIABLES, PAD_ID, load_specials, tokenizer_dir
from pipeline.errors import StageError
from pipeline.files import atomic_dir, read_json, read_stage_json, restore_swapped_out, sha256_file, write_json
from pipeline.model import generate as gen
from pipeline.model import hf_adapter
from pipeline.model.families import FAMILIES
from pipeline.model.transformer import ModelConfig, Transformer, num_params
from pipeline.training import checkpoint as ckpt

log = logging.getLogger("pipeline.export")

DTYPE = "float32"  # a model trained from scratch: its fp32 master weights, as trained
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(requested: str, meta: Mapping[str, Any]) -> str:
    """The dtype ``export.dtype`` asks for; ``auto``: that of the Hugging Face
    model the run started from (``torch_dtype``, or ``dtype`` in newer configs;
    fp32 when it names none we write), else :data:`DTYPE`."""
    if requested != "auto":
        return requested
    original = meta.get("hf_config") or {}
    named = original.get("torch_dtype") or original.get("dtype")
    return named if named in DTYPES else DTYPE


REPORT = "report.json"  # beside the Hugging Face files, written after registration
# What an export writes besides an adopted tokenizer's own files (Specials.hf_files)
EXPORT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md", REPORT)
METRICS = ("params", "vocab_size", "step")
STOP_IDS = gen.CHAT_STOP_IDS  # <|im_end|>, <|endoftext|>: where generation ends, in config.json too
OWN_TOKEN_IDS = {"bos_token_id": EOT_ID, "eos_token_id": list(STOP_IDS), "pad_token_id": PAD_ID}  # our tokenizer's
CARD_KEYS = {
    "name": "title of the model card",
    "description": "a paragraph under the title",
    "metrics": "evaluation metrics, {name: number or nested dict}",
    "lineage": "where it came from, {name: value or nested dict}: git commit, dataset, manifest ...",
    "intended_use": "text for the 'Intended use' section",
    "limitations": "text for the 'Limitations' section",
    "license": "license identifier for the card's metadata",
}
DEFAULT_INTENDED_USE = (
    "Research and teaching: a small model trained end to end by this pipeline, for studying how "
    "data, tokenizer, training and fine-tuning choices show up in a model. Not for production use.")
DEFAULT_LIMITATIONS = (
    "Small and trained on a small corpus: it makes factual errors, writes code that may not run, and "
    "its answers have not been checked for safety or bias. It has seen only the pipeline's training "
    "data, and its context is limited to `max_position_embeddings` tokens.")


class ExportConfig(StageConfig):
    """``params.yaml: export``. The card's metrics and lineage come from the
    pipeline's own outputs, not from params."""

    source: Literal["sft", "pretrain"] = Field("sft", description="export models/sft or models/pretrain")
    checkpoint: Literal["last", "best"] = Field("last", description="the run's last checkpoint, or its best by val "
                                                "loss (needs checkpoint.keep_best in that stage, and evaluate.checkpoint "
                                                "to score the same one: export refuses to label it with another's metrics)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the weights' dtype in model.safetensors: auto = the dtype of the Hugging Face model the "
        "run started from (its config's torch_dtype), float32 for a model trained from scratch (its master weights)")
    register_model: bool = Field(True, description="register the export in the MLflow model registry "
                                                   "(skipped with a warning when MLflow is unreachable)")
    model_name: str = Field("llm-pipeline", pattern=r"^[A-Za-z0-9][\w.\-]*$",
                            description="registered model name")
    primary_metric: str = Field("sft.chat.bits_per_byte", min_length=1,
                                description="dotted key of metrics/evaluate.json that decides the champion alias; with "
                                "register_model, export refuses a key that file lacks before any work, and one that "
                                "scores the other model (an sft. key with source: pretrain: use "
                                "pretrain.chat.bits_per_byte)")
    lower_is_better: bool = Field(True, description="direction of primary_metric")
    name: str | None = Field(None, description="model card title; null = 'llm-pipeline model'")
    license: str | None = Field(None, description="license id for the model card; null = none stated")
    intended_use: str | None = Field(None, description="model card text; null = the default")
    limitations: str | None = Field(None, description="model card text; null = the default")

    @model_validator(mode="after")
    def _primary_metric_of_the_model_shipped(self) -> "ExportConfig":
        # The champion alias moves by this number: another model's would rank the export by scores not its own.
        scored, _, metric = self.primary_metric.partition(".")
        if self.register_model and scored in ("pretrain", "sft") and scored != self.source:
            raise ValueError(f"primary_metric {self.primary_metric} scores the {scored} model, but source is "
                             f"{self.source}; the registry would rank the {self.source} export by another model's "
                             f"numbers: set primary_metric: {self.source}.{metric or 'bits_per_byte'}")
        return self


class ExportError(StageError):
    """The checkpoint or tokenizer cannot be exported (missing, mismatched)."""


def export_model(checkpoint_folder: str | Path, tokenizer_path: str | Path, out_dir: str | Path, *,
                 card_info: Mapping[str, Any], which: str = "last",
                 sft_manifest: str | Path | None = None, evaluated: Mapping[str, Any] | None = None,
                 dtype: str = "auto") -> dict[str, Any]:
    """Write the Hugging Face folder ``out_dir`` (see the module doc) and return a summary.

    ``checkpoint_folder`` is a training output folder (its latest complete
    checkpoint is exported, or its best with ``which="best"``) or one
    ``step-XXXXXXXX`` folder. ``card_info`` feeds the model card; its keys are
    those of ``CARD_KEYS``, all optional. ``sft_manifest``: the SFT data's
    manifest, whose chat template and stop ids the export carries. ``evaluated``:
    evaluate's report of the model (``checkpoint``, ``checkpoint_step``,
    ``fingerprint``, ``which``), whose metrics ``card_info`` carries; the export is
    refused unless that is the checkpoint shipped (:func:`check_evaluated`).
    ``dtype``: the weights' dtype (:func:`export_dtype`; ``export.dtype``).

    Returns ``{out_dir, checkpoint, stage, step, fingerprint, architecture, params, vocab_size,
    tie_word_embeddings, dtype, tokenizer_sha256, files: {name: {bytes, sha256}}}``.
    Raises ExportError for a missing checkpoint, a run folder whose run has not
    finished (its newest checkpoint is not ``final``: the run was interrupted),
    a checkpoint other than the one ``evaluated`` scored, or a tokenizer other
    than the one the checkpoint was trained with, or an ``out_dir`` that holds what
    no export wrote (:func:`check_replaceable`), TokenizerError for a missing or invalid
    tokenizer, ValueError for unknown ``card_info`` keys; ``out_dir`` is then
    left as it was.
    """
    unknown = sorted(set(card_info) - set(CARD_KEYS))
    if unknown:
        raise ValueError(f"unknown card_info key(s) {', '.join(unknown)}; known: {', '.join(CARD_KEYS)}")
    folder, out_dir, tokenizer_path = Path(checkpoint_folder), Path(out_dir), Path(tokenizer_path)
    checkpoint = ckpt.resolve(folder, which)  # verified; a damaged one raises CheckpointError
    if checkpoint is None:
        raise ExportError(f"{folder}: no complete checkpoint to export")
    end = ckpt.run_end(folder, checkpoint)
    why = ckpt.unfinished(end) if end is not None else None
    if why:  # e.g. sft killed: its newest checkpoint is not the model the run was asked for
        raise ExportError(why)
    if evaluated is not None:
        check_evaluated(checkpoint, which, evaluated)
    specials = load_specials(tokenizer_path)
    check_replaceable(out_dir, (*EXPORT_FILES, *specials.hf_files))
    meta = checkpoint.meta
    try:
        model, _, config = gen.load_for_inference(checkpoint.path, tokenizer_path=tokenizer_path)
    except ValueError as err:  # a tokenizer that does not belong to this model
        raise ExportError(str(err)) from err

    manifest = read_stage_json(sft_manifest) if sft_manifest and Path(sft_manifest).is_file() else {}
    token_ids = None
    if not specials.own and not meta.get("hf_config"):  # trained from scratch with an adopted tokenizer
        token_ids = {"bos_token_id": specials.bos_id, "pad_token_id": specials.pad_id,
                     "eos_token_id": list(manifest.get("stop_ids") or specials.eos_ids)}
    elif specials.own and meta.get("hf_config"):
        # a published model trained on with our tokenizer (its folder had none to adopt): the original's
        # ids name other tokens of the tokenizer shipped, so config.json declares ours
        token_ids = dict(OWN_TOKEN_IDS)
    dtype = export_dtype(dtype, meta)
    check_fits(model, dtype)
    with atomic_dir(out_dir) as tmp:
        write_model_files(tmp, model, meta, token_ids=token_ids, dtype=dtype)
        if specials.own:
            own_template = write_tokenizer_files(tmp, tokenizer_path, config, manifest)
        else:
            own_template = write_adopted_tokenizer_files(tmp, tokenizer_path, meta, manifest)
        summary = {
            "out_dir": str(out_dir),
            "checkpoint": str(checkpoint.path),
            "stage": meta.get("stage"),
            "step": meta.get("step"),
            "fingerprint": meta.get("fingerprint"),
            "architecture": FAMILIES[config.family].architecture,
            "params": num_params(model),
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": config.tie_embeddings,
            "dtype": dtype,
            "tokenizer_sha256": sha256_file(tmp / "tokenizer.json"),
        }
        chat = (CHATML_FORMAT if not own_template else TRAINED_FORMAT) if specials.own else (
            "The chat template that SFT rendered its data with, `chat_template.jinja`, which transformers "
            "prefers to the tokenizer's own." if own_template else
            "The tokenizer's own chat template (`tokenizer_config.json` or `chat_template.jinja`), as the model "
            "it was adopted from uses it.") + " Generation stops at the ids in `generation_config.json`."
        (tmp / "README.md").write_text(model_card(config, meta, summary, card_info,
                                                  sha256_file(tmp / "model.safetensors"), chat), encoding="utf-8")
        summary["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                            for f in sorted(tmp.iterdir())}
    return summary


def check_replaceable(out_dir: Path, written: Iterable[str]) -> None:
    """Raise ExportError, one line, when replacing ``out_dir`` whole would delete
    what no export wrote: a file in its place, entries other than the files
    an export writes (``written``) and those its previous export's report.json
    lists, or a listed file whose size or sha256 is not the one that report
    records (edited since: a model card readied for publishing). A user's notes,
    edits or model kept there are theirs to move, not ours to delete."""
    restore_swapped_out(out_dir)  # the last export, if a kill cut its replacement short: checked as it is
    if out_dir.is_symlink() or not out_dir.exists():  # a link is replaced, not what it points to
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} is a file, not an export folder; move it away (export writes a folder there) "
                          "and run the stage again")
    try:
        report = read_json(out_dir / REPORT)
    except (OSError, ValueError):  # none (a first export, or one stopped before its report) or unreadable
        report = {}
    listed = report.get("files") if isinstance(report, dict) else None
    listed = listed if isinstance(listed, dict) else {}
    known = {*written, *listed}
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                     if p.name not in known or p.is_dir())
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise ExportError(f"{out_dir} holds {', '.join(foreign[:5])}{more}, which no export wrote (its {REPORT} "
                          "does not list them); an export replaces the folder whole, so move them out of it (or delete "
                          "them) and run the stage again")
    edited = sorted(p.name for p in out_dir.iterdir() if _changed(p, listed.get(p.name)))
    if edited:
        more = f" and {len(edited) - 5} more" if len(edited) > 5 else ""
        raise ExportError(f"{out_dir} holds {', '.join(edited[:5])}{more}, changed since the export wrote "
                          f"{'it' if len(edited) == 1 else 'them'} (its size or sha256 is not the one its {REPORT} "
                          "records); an export replaces the folder whole, so move your version out of it (or delete "
                          "it) and run the stage again")


def _changed(path: Path, recorded: Any) -> bool:
    """Whether the file ``path`` differs from what an export's report.json
    ``recorded`` of it ({bytes, sha256}); False when nothing is recorded. The
    size is compared first, so only a file of the recorded size is hashed."""
    if not isinstance(recorded, dict) or not path.is_file():
        return False
    size, digest = recorded.get("bytes"), recorded.get("sha256")
    if isinstance(size, int) and path.stat().st_size != size:
        return True
    return isinstance(digest, str) and sha256_file(path) != digest


def check_fits(model: Transformer, dtype: str) -> None:
    """Raise ExportError, one line, when a weight of ``model`` lies outside the
    finite range of ``dtype`` (float16's largest is 65504; bfloat16 has float32's
    range): the cast would write it as infinite, and the model would compute NaN."""
    if dtype == "float32":  # the weights' own dtype
        return
    largest = torch.finfo(DTYPES[dtype]).max
    over = [name for name, p in model.named_parameters()
            if max(p.detach().max().item(), -p.detach().min().item()) > largest]  # no full-size copy of |p|
    if over:
        more = f" and {len(over) - 5} more" if len(over) > 5 else ""
        raise ExportError(f"export.dtype {dtype}: {', '.join(over[:5])}{more} hold weights beyond {dtype}'s largest "
                          f"value ({largest:g}), which the cast would make infinite; set export.dtype: bfloat16 or "
                          "float32")


def check_evaluated(checkpoint: ckpt.Checkpoint, which: str, evaluated: Mapping[str, Any]) -> None:
    """Raise ExportError, one line saying what to set, unless ``evaluated`` (evaluate's
    report of a model) scored ``checkpoint``, the one export ships: the model card and
    the registry (whose champion is chosen by these numbers) must describe the
    weights shipped, not another checkpoint of the run."""
    fingerprint = checkpoint.meta.get("fingerprint")
    scored, step = evaluated.get("checkpoint"), evaluated.get("checkpoint_step")
    if (scored is not None and step == checkpoint.step and Path(scored).resolve() == checkpoint.path.resolve()
            and evaluated.get("fingerprint") in (None, fingerprint)):
        return
    stage = checkpoint.meta.get("stage") or "sft"
    scored_which = evaluated.get("which", "last")
    fix = (f"set evaluate.checkpoint.{stage}: {which} (or export.checkpoint: {scored_which}) and run `dvc repro`"
           if scored_which != which else "run `dvc repro evaluate` so that it scores the checkpoint shipped")
    raise ExportError(f"export.checkpoint: {which} ships {checkpoint.path} (step {checkpoint.step}), but the evaluate "
                      f"metrics describe {scored} (step {step}), so the model card and the registry would label it with "
                      f"another checkpoint's numbers; {fix}")


def write_model_files(folder: Path, model: Transformer, meta: Mapping[str, Any], *,
                      token_ids: Mapping[str, Any] | None = None, dtype: str = DTYPE) -> None:
    """``model.safetensors`` and ``config.json`` of ``model`` in ``folder``, in its family.

    ``meta`` is the checkpoint's: with ``meta["hf_config"]`` (the config.json of
    the Hugging Face model the run started from) config.json is that file updated
    with our values (:func:`pipeline.model.hf_adapter.hf_config`); otherwise it is
    written from scratch. ``token_ids`` ({bos,eos,pad}_token_id) are written as
    given; None keeps the original's, or, for a model of ours, our tokenizer's.
    """
    config = model.config
    tensors = {k: v.to(DTYPES[dtype]) for k, v in hf_adapter.to_hf(model.state_dict(), config).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    original = meta.get("hf_config")
    if token_ids is None:
        token_ids = {} if original else dict(OWN_TOKEN_IDS)
    _write_json(folder / "config.json", hf_adapter.hf_config(config, dtype=dtype, original=original, **token_ids))


def write_tokenizer_files(folder: Path, tokenizer_path: Path, config: ModelConfig,
                          sft_manifest: Mapping[str, Any] | None = None) -> bool:
    """The tokenizer's files and ``generation_config.json`` (its stop and pad ids)
    in ``folder``: ``tokenizer.json`` byte for byte, and our ChatML set-up, with
    the chat template SFT rendered its data with (``sft_manifest``:
    ``sft.data.chat_template``, ChatML by default) in ``tokenizer_config.json``, and
    its stop ids after ours in ``generation_config.json``, so that the model is
    prompted the way it was trained. Returns whether that template is not ChatML."""
    sft_manifest = sft_manifest or {}
    template = sft_manifest.get("chat_template") or CHAT_TEMPLATE_JINJA
    generation = generation_config()
    generation["eos_token_id"] = list(dict.fromkeys([*generation["eos_token_id"], *sft_manifest.get("stop_ids", ())]))
    _write_json(folder / "generation_config.json", generation)
    shutil.copyfile(tokenizer_path, folder / "tokenizer.json")
    _write_json(folder / "tokenizer_config.json", tokenizer_config(config.max_seq_len, template))
    _write_json(folder / "special_tokens_map.json", SPECIAL_TOKENS_MAP)
    return template != CHAT_TEMPLATE_JINJA


def write_adopted_tokenizer_files(folder: Path, tokenizer_path: Path, meta: Mapping[str, Any],
                                  sft_manifest: Mapping[str, Any]) -> bool:
    """An adopted tokenizer ships as it came: every tokenizer file of the original
    folder (``data/tokenizer/hf/``) byte for byte, its chat template included.
    Only when SFT rendered with another template (``sft.data.chat_template``: a
    .jinja file) is that one written as ``chat_template.jinja``, which transformers
    prefers, so that the model is prompted the way it was trained.
    ``generation_config.json`` is the original model's as its folder holds it
    now (:func:`original_generation_config`), else built from the tokenizer's
    roles and SFT's stop ids.
    Returns whether it wrote SFT's template as ``chat_template.jinja``."""
    specials = load_specials(tokenizer_path)
    hf_dir = tokenizer_dir(tokenizer_path) / HF_DIR
    missing = [name for name in specials.hf_files if not (hf_dir / name).is_file()]
    if missing:
        raise ExportError(f"{hf_dir}: the adopted tokenizer's {', '.join(missing)} are missing; "
                          "rerun `dvc repro tokenizer`")
    for name in specials.hf_files:
        shutil.copyfile(hf_dir / name, folder / name)
    trained_with = sft_manifest.get("chat_template")
    own_template = bool(trained_with) and trained_with != specials.chat_template
    if own_template:
        (folder / "chat_template.jinja").write_text(trained_with, encoding="utf-8")
    generation = dict(original_generation_config(meta) or {})
    if not generation:
        generation = {"eos_token_id": list(sft_manifest.get("stop_ids") or specials.eos_ids),
                      "pad_token_id": specials.pad_id}
        if specials.bos_id is not None:
            generation["bos_token_id"] = specials.bos_id
    elif sft_manifest.get("stop_ids"):  # the original's stop ids, plus the end of turn SFT trained
        known = generation.get("eos_token_id")
        known = known if isinstance(known, list) else [] if known is None else [known]
        generation["eos_token_id"] = list(dict.fromkeys([*known, *sft_manifest["stop_ids"]]))
    _write_json(folder / "generation_config.json", generation)
    return own_template


def original_generation_config(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``generation_config.json`` of the Hugging Face model a checkpoint
    descends from (``meta``: the checkpoint's), as that model's folder holds it
    now; None for a model of ours or a folder that ships none.

    Sampling settings do not change what training computes, so the file is no
    part of the run identity (pipeline/training/init.py): an edited or
    re-downloaded one reruns export (``models/base`` is its DVC dep), not
    training, and the copy recorded in the checkpoint when the run started
    (meta ``hf_generation_config``) may be stale. That copy is used only when
    the folder can no longer be found (moved, or a link of the ``init_from``
    chain gone) or holds another model (its config.json is not meta
    ``hf_config``), with a warning. Raises ExportError, one line, for a file
    that does not parse."""
    if not meta.get("hf_config"):
        return None
    recorded = meta.get("hf_generation_config")
    origin = hf_origin(meta)
    why = (None if origin is not None and hf_adapter.is_hf_model_folder(origin) else
           f"the Hugging Face model folder the run started from is gone (its init_from chain ends at {origin})")
    if why is None:
        try:
            same = hf_adapter.read_hf_config(origin) == meta["hf_config"]
        except StageError:
            same = False
        why = None if same else f"{origin} now holds another model (its config.json is not the one trained)"
    if why:
        log.warning("%s, so the export carries the generation_config.json recorded when the run started%s; edits "
                    "to the model's file since then are not in it", why, "" if recorded else " (none)")
        return recorded
    try:
        return hf_adapter.read_generation_config(origin)
    except StageError as err:
        raise ExportError(str(err)) from None


def hf_origin(meta: Mapping[str, Any], max_links: int = 32) -> Path | None:
    """The folder at the start of a checkpoint's ``init_from`` chain: sft's
    points at the pretrain checkpoint it started from, a warm start at the
    checkpoint of ours it started from, and a run started from a Hugging Face
    model at that model's folder. Paths are as recorded (relative ones from the
    project root, where the stages run). Returns the Hugging Face folder, or the
    first link that is neither it nor a readable checkpoint (moved aside,
    deleted: the caller tells them apart with ``hf_adapter.is_hf_model_folder``);
    None when no ``init_from`` is recorded."""
    path = None
    for _ in range(max_links):  # paths are reused across runs, so a chain could loop back: bound it
        source = meta.get("init_from")
        if not source:
            return path
        path = Path(source)
        if hf_adapter.is_hf_model_folder(path):
            return path
        try:
            meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return path
        if not isinstance(meta, dict):
            return path
    return path


def write_report(out_dir: str | Path, summary: Mapping[str, Any], registry: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``out_dir/report.json``: the :func:`export_model` summary (paths,
    hashes, the file listing) and the model registry's outcome. Returns the
    metrics, the numbers compared across exports: params, vocab_size, step."""
    write_json(Path(out_dir) / REPORT, {**summary, "registry": registry})
    return {k: summary[k] for k in METRICS}


# --------------------------------------------------------------------------- file contents

SPECIAL_TOKENS_MAP = OWN_TOKEN_VARIABLES


def tokenizer_config(max_seq_len: int, chat_template: str = CHAT_TEMPLATE_JINJA) -> dict[str, Any]:
    """``tokenizer_config.json``: no bos/eos added on encode, no space clean-up on
    decode (both would break exact round-trips), and the chat template (ChatML's
    unless SFT trained with another)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL_TOKENS_MAP,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_seq_len,
        "chat_template": chat_template,
    }


def generation_config() -> dict[str, Any]:
    """``generation_config.json``: stop at either end token; sample like
    ``python -m pipeline.model.generate`` does by default."""
    return {
        "bos_token_id": EOT_ID,
        "eos_token_id": list(STOP_IDS),
        "pad_token_id": PAD_ID,
        "do_sample": True,
        "temperature": gen.DEFAULT_TEMPERATURE,
        "top_k": gen.DEFAULT_TOP_K,
        "top_p": gen.DEFAULT_TOP_P,
        "max_new_tokens": gen.DEFAULT_MAX_NEW_TOKENS,
    }


CHATML_FORMAT = ("ChatML: each message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and the model answers "
                 "after `<|im_start|>assistant\\n`. The tokenizer's `chat_template` renders it; generation stops at "
                 "`<|im_end|>` or `<|endoftext|>` (`generation_config.json`).")


TRAINED_FORMAT = ("The chat template that SFT rendered its data with (`sft.data.chat_template`), the tokenizer's "
                  "`chat_template` in `tokenizer_config.json`; `apply_chat_template` renders conversations as SFT did. "
                  "Generation stops at the ids in `generation_config.json`.")


def model_card(config: ModelConfig, meta: Mapping[str, Any], summary: Mapping[str, Any], card_info: Mapping[str, Any],
               weights_sha256: str, chat_format: str = CHATML_FORMAT) -> str:
    """The README.md text: YAML metadata, then Markdown sections; ``chat_format``
    says how conversations are rendered."""
    name = card_info.get("name") or "llm-pipeline model"
    family = FAMILIES[config.family]
    front: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation",
                             "tags": [family.model_type, "causal-lm", "llm-pipeline"]}
    if card_info.get("license"):
        front["license"] = card_info["license"]
    out_dir = summary["out_dir"]
    n = summary["params"]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {name}", ""]
    if card_info.get("description"):
        lines += [card_info["description"].strip(), ""]

    lines += ["## Model", "", *_table(("", ""), [
        ("architecture", f"`{family.architecture}`: decoder-only, RoPE{' (llama3 scaling)' if config.rope_scaling else ''}, "
                         "SwiGLU, RMSNorm, grouped-query attention"
                         f"{', q/k/v biases' if config.qkv_bias else ''}{', q/k RMSNorm' if config.qk_norm else ''}"),
        ("parameters", f"{n / 1e6:.2f}M ({n:,}; a tied embedding counted once)"),
        ("layers", config.n_layer),
        ("hidden size", config.d_model),
        ("attention heads / key-value heads", f"{config.n_head} / {config.n_kv_head}"),
        ("head dimension", config.head_dim),
        ("MLP hidden size", config.ffn_hidden),
        ("vocabulary", config.vocab_size),
        ("context length", config.max_seq_len),
        ("RoPE theta", config.rope_theta),
        ("tied embeddings", "yes" if config.tie_embeddings else "no"),
        ("weights", f"{summary['dtype']}, safetensors" + ("" if summary["dtype"] == DTYPE else
                    f" (cast from the {DTYPE} weights trained and evaluated)")),
    ]), ""]

    metrics = flatten(dict(card_info.get("metrics") or {}))
    lines += ["## Evaluation", ""]
    lines += _table(("metric", "value"), metrics.items()) if metrics else ["No evaluation metrics were recorded."]
    lines.append("")

    training = {k: meta.get(k) for k in ("stage", "step", "tokens_seen", "precision", "world_size", "saved_at")
                if meta.get(k) is not None}
    training.update({f"metrics.{k}": v for k, v in flatten(dict(meta.get("metrics") or {})).items()})
    lines += ["## Training (the exported checkpoint)", "", *_table(("", ""), training.items()), ""]

    lineage = {
        "checkpoint": summary["checkpoint"],
        "checkpoint step": summary["step"],
        "checkpoint fingerprint": summary["fingerprint"],
        "tokenizer sha256": summary["tokenizer_sha256"],
        "model.safetensors sha256": weights_sha256,
        **flatten(dict(card_info.get("lineage") or {})),
    }
    lines += ["## Lineage", "", *_table(("", ""), ((k, v) for k, v in lineage.items() if v is not None)), ""]

    lines += ["## Intended use", "", (card_info.get("intended_use") or DEFAULT_INTENDED_USE).strip(), ""]
    lines += ["## Limitations", "", (card_info.get("limitations") or DEFAULT_LIMITATIONS).strip(), ""]
    lines += [
        "## Chat format", "",
        chat_format, "",
        "## How to use", "",
        "With transformers (no custom code):", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"tok = AutoTokenizer.from_pretrained({json.dumps(out_dir)})",
        f"model = AutoModelForCausalLM.from_pretrained({json.dumps(out_dir)})",
        'messages = [{"role": "user", "content": "How do I reverse a list?"}]',
        "ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", return_dict=True)",
        "out = model.generate(**ids, max_new_tokens=64)",
        "print(tok.decode(out[0, ids[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
        "```", "",
        "With this project's code:", "",
        "```sh",
        f"python -m pipeline.model.generate --model {out_dir} --chat \"How do I reverse a list?\"",
        f"python -m pipeline.model.generate --model {out_dir} --prompt \"def fibonacci(\" --temperature 0",
        "```", "",
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = "NaN" if math.isnan(value) else f"{value:.6g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(map(str, value))
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, str], rows: Any) -> list[str]:
    return [f"| {header[0]} | {header[1]} |", "| --- | --- |", *(f"| {_cell(k)} | {_cell(v)} |" for k, v in rows)]


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
