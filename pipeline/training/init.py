"""Where a run's starting weights come from: ``init_from``.

``pretrain.init_from`` names one of

* nothing (``null``): random initialisation from the seed;
* a local Hugging Face model folder (``config.json`` plus ``model.safetensors``
  or a sharded ``model.safetensors.index.json``): the architecture and weights
  of that model (pipeline/model/hf_adapter.py reads them);
* a checkpoint of ours, from any stage and step: a run folder
  (``models/sft``: its newest checkpoint), a ``step-*`` folder, or one under
  ``previous/<run-id>/``: a warm start of a new run from its weights (and, with
  ``init_optimizer``, its AdamW moments).

:func:`resolve_init` turns the param into an :class:`InitSource`: the model to
build, an identity for the run fingerprint (content hashes, so that replacing
the model folder starts a new run), the tokenizer the model belongs with, and
the metadata that travels with every checkpoint of the new run (the original
``config.json``, so that export writes the same family). Every problem is one
line (:class:`InitError`), raised before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from safetensors import SafetensorError

from pipeline import layout
from pipeline.errors import StageError
from pipeline.files import broken_links, sha256_file
from pipeline.model import hf_adapter
from pipeline.model.transformer import ModelConfig, Transformer
from pipeline.training import checkpoint as ckpt

log = logging.getLogger("pipeline.training")

BASE_DIR = layout.BASE_MODELS  # DVC tracks this folder as a dep of tokenizer, pretrain and export


class InitError(StageError):
    """init_from names nothing usable, a model that does not fit the data or the
    run (another shape), or init options that contradict each other."""


@dataclass(frozen=True)
class InitSource:
    kind: Literal["hf", "checkpoint"]
    path: Path
    model: ModelConfig
    init_id: str  # goes into the run identity
    tokenizer_sha256: str | None  # sha256 of the tokenizer.json this model was trained with, when known
    meta: dict[str, Any] = field(default_factory=dict)  # carried into every checkpoint of the new run
    checkpoint: ckpt.Checkpoint | None = None

    def load_weights(self, model: Transformer) -> None:
        """Copy the starting weights into ``model`` (built from :attr:`model`)."""
        if self.kind == "hf":
            hf_adapter.load_hf_weights(model, self.path)
        else:
            ckpt.load_model_weights(self.checkpoint, model)


FOLDER_ID_ENV = "PIPELINE_INIT_FOLDER_ID"  # the launcher's hash, inherited by the ranks it starts


def _folder_id(folder: Path, names: list[str]) -> str:
    """sha256 over the named files' contents: the identity of a model folder.

    Hashing a 7B model reads ~15 GB, so the launcher hashes once and leaves the
    result in the environment for the ranks torchrun starts; a rank reuses it
    only while every file still has the size and mtime it had when hashed."""
    stat = json.dumps([str(folder.resolve()), *[[n, (folder / n).stat().st_size, (folder / n).stat().st_mtime_ns]
                                                for n in sorted(names)]])
    cached = os.environ.get(FOLDER_ID_ENV, "")
    if cached.startswith(stat + "\n"):
        return cached[len(stat) + 1:]
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode() + b"\0" + sha256_file(folder / name).encode() + b"\n")
    folder_id = h.hexdigest()[:16]
    os.environ[FOLDER_ID_ENV] = stat + "\n" + folder_id
    return folder_id


def resolve_init(init_from: str | None, *, warn_outside_base: bool = True) -> InitSource | None:
    """The starting point named by ``init_from`` (None for random initialisation).
    Raises InitError (one line) for a path that is neither kind, a damaged
    checkpoint, or a Hugging Face model we do not implement. ``warn_outside_base``:
    log the launcher's warnings (a model folder DVC does not see, a run folder
    whose run has not finished); the ranks resolve again without them."""
    if init_from is None:
        return None
    path = Path(init_from).expanduser()
    if not path.exists():
        raise InitError(f"init_from {path} does not exist; give a local Hugging Face model folder (under "
                        f"{BASE_DIR}/) or a checkpoint folder of ours")
    broken = broken_links(path)
    if broken:
        raise InitError(f"init_from {path}: {broken}")
    if path.is_file():  # e.g. the path of model.safetensors, or of a checkpoint's meta.json
        holder = path.parent
        hint = (f"; name the folder that holds it, {holder}" if hf_adapter.is_hf_model_folder(holder)
                or (holder / "meta.json").is_file() else "")
        raise InitError(f"init_from {path} is a file; init_from names a folder: a Hugging Face model folder "
                        f"(config.json and model.safetensors) or a checkpoint folder of ours{hint}")
    if hf_adapter.is_hf_model_folder(path):
        return _from_hf(path, warn_outside_base)
    if (path / "adapter_config.json").is_file():
        raise InitError(f"init_from {path} is a PEFT (LoRA) adapter (adapter_config.json), not a whole model: merge "
                        "it into its base model first (peft's merge_and_unload(), then save_pretrained with "
                        "safe_serialization) and name that folder")
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        try:  # a Hugging Face folder without safetensors weights: say what is there instead
            hf_adapter.weight_files(path)
        except StageError as err:
            raise InitError(f"init_from {path} is a Hugging Face model folder without safetensors weights: "
                            f"{err}") from None
    try:
        found = ckpt.resolve(path)
    except ckpt.CheckpointError as err:
        raise InitError(f"init_from: {err}") from None
    if found is None:
        raise InitError(f"init_from {path} is neither a Hugging Face model folder (config.json and "
                        "model.safetensors or model.safetensors.index.json) nor a checkpoint of ours (meta.json)"
                        f"{_inside_hint(path)}")
    if warn_outside_base and not ckpt.is_checkpoint(path):
        why = ckpt.unfinished(found)  # a run folder names its result, which a killed run has not reached
        if why:
            log.warning("init_from %s: %s; starting from that checkpoint anyway (name its step folder to do so "
                        "without this warning)", path, why)
    return _from_checkpoint(found)


def _inside_hint(path: Path) -> str:
    """'; it holds ...' naming the model or run folders one level down (models/base/, a
    run's previous/), which is what a user who names their parent meant; else ''."""
    if not path.is_dir():
        return ""
    inside = sorted(p for p in path.iterdir() if p.is_dir() and (
        hf_adapter.is_hf_model_folder(p) or ckpt.step_folders(p) or ckpt.STEP_RE.match(p.name)))
    if not inside:
        return ""
    names = ", ".join(str(p) for p in inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
    return f"; it holds {names}: name one of them"


def _from_hf(folder: Path, warn_outside_base: bool) -> InitSource:
    # every problem with the folder is one line, before any rank starts: a config.json
    # that does not parse, an unsupported model, weights whose headers are damaged, or
    # tensors whose names, dtypes or shapes do not fit the config
    try:
        config = hf_adapter.read_hf_config(folder)
        model = hf_adapter.config_from_hf(config)
        weights = hf_adapter.check_weights(folder, model)
    except (StageError, ValueError) as err:
        message = str(err)  # the adapter's messages mostly name the folder or a file in it first
        raise InitError(f"init_from {message}" if message.startswith(str(folder)) else
                        f"init_from {folder}: {message}") from None
    except SafetensorError as err:
        raise InitError(f"init_from {folder}: damaged safetensors weights ({err})") from None
    if warn_outside_base and not layout.in_base_models(folder):
        log.warning("init_from %s is outside %s/%s, so DVC does not see changes to it: a replaced model there "
                    "does not rerun pretrain by itself (the run identity still changes)", folder, BASE_DIR,
                    layout.through_link(folder))
    tok = folder / "tokenizer.json"
    meta: dict[str, Any] = {"init_from": str(folder), "hf_config": config}
    try:
        generation = hf_adapter.read_generation_config(folder)
    except StageError as err:
        raise InitError(f"init_from {err}") from None
    if generation is not None:
        meta["hf_generation_config"] = generation
    return InitSource(kind="hf", path=folder, model=model,
                      init_id="hf:" + _folder_id(folder, ["config.json", *weights]),
                      tokenizer_sha256=sha256_file(tok) if tok.is_file() else None, meta=meta)


def _from_checkpoint(found: ckpt.Checkpoint) -> InitSource:
    meta = found.meta
    carried = {k: meta[k] for k in ("hf_config", "hf_generation_config") if k in meta}
    return InitSource(kind="checkpoint", path=found.path, model=ckpt.model_config(found),
                      init_id="ckpt:" + str(meta.get("fingerprint")) + ":" + ckpt.weights_id(found)[:16],
                      tokenizer_sha256=meta.get("tokenizer_sha256"),
                      meta={"init_from": str(found.path), **carried}, checkpoint=found)


def check_tokenizer(init: InitSource, manifest: dict[str, Any], *, warn: bool = True) -> None:
    """The packed data's tokenizer and the initial model belong together: the same
    tokenizer.json when the model's is known, and every token id inside the
    model's embedding table. Raises InitError, one line, otherwise. ``warn``: say
    when only the vocabulary size can be checked (the launcher does; its ranks check quietly)."""
    vocab = int(manifest["vocab_size"])
    data_sha = manifest.get("tokenizer_sha256")
    if init.tokenizer_sha256 is not None and data_sha is not None and init.tokenizer_sha256 != data_sha:
        fix = (f"set tokenizer.source: {init.path}" if init.kind == "hf"
               else "use the tokenizer that checkpoint was trained with")
        raise InitError(f"the tokenizer of the packed data (data/tokenizer, sha256 {data_sha[:12]}) is not the one "
                        f"{init.path} was trained with (sha256 {init.tokenizer_sha256[:12]}); {fix}, then "
                        "`dvc repro`")
    if vocab > init.model.vocab_size:
        raise InitError(f"the tokenizer's ids need {vocab} embedding rows but {init.path} embeds only "
                        f"{init.model.vocab_size}; they do not belong together")
    if warn and init.tokenizer_sha256 is None:
        log.warning("%s ships no tokenizer.json, so the pairing with data/tokenizer cannot be checked beyond the "
                    "vocabulary size (%d <= %d)", init.path, vocab, init.model.vocab_size)
