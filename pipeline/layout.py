"""Where each stage reads and writes, relative to the project root.

``dvc.yaml`` declares the same paths as deps and outs; ``tests/test_project.py``
checks that the two agree.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA = Path("data")
MODELS = Path("models")
METRICS = Path("metrics")
PLOTS = Path("plots")

RAW = DATA / "raw"  # users drop their own files here; tracked as an ingest dep

INGEST_DIR = DATA / "ingest"
INGEST_DOCS = INGEST_DIR / "docs"  # a documents folder (pipeline/data/docs.py)
INGEST_QUARANTINE = INGEST_DIR / "quarantine.jsonl"

CLEAN_DIR = DATA / "clean"
CLEAN_DOCS = CLEAN_DIR / "docs"
CLEAN_QUARANTINE = CLEAN_DIR / "quarantine.jsonl"

TOKENIZER_DIR = DATA / "tokenizer"
TOKENIZER_JSON = TOKENIZER_DIR / "tokenizer.json"

PACKED = DATA / "packed"
PACKED_MANIFEST = PACKED / "manifest.json"

SFT_DATA = DATA / "sft"
SFT_QUARANTINE = SFT_DATA / "quarantine.jsonl"

BASE_MODELS = MODELS / "base"  # published models to start from: users put them here
PRETRAIN_MODEL = MODELS / "pretrain"
SFT_MODEL = MODELS / "sft"
EXPORT_DIR = MODELS / "export"
EVALUATE_DIR = DATA / "evaluate"
EVALUATE_REPORT = EVALUATE_DIR / "report.json"  # which checkpoint each model's metrics describe; export checks it

# The stage that writes each folder of packed rows, for the line that says what to run when one is missing.
PACKED_ROWS_WRITERS = {PACKED: "pack", SFT_DATA: "sft"}


def in_base_models(path: Path) -> bool:
    """Whether ``path`` (resolved) lies under ``models/base/``, where DVC sees a
    replaced model: tokenizer and pretrain warn about a folder elsewhere."""
    try:
        Path(path).resolve().relative_to(BASE_MODELS.resolve())
        return True
    except ValueError:
        return False


def through_link(path: Path) -> str:
    """For a model folder that :func:`in_base_models` finds outside models/base/
    although its name lies inside: " (through a link: it is <target>)", as DVC
    does not follow a linked folder (it hashes no file in it); else ""."""
    named_inside = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(BASE_MODELS))
    return f" (through a link: it is {Path(path).resolve()})" if named_inside else ""


def metrics_path(stage: str) -> Path:
    return METRICS / f"{stage}.json"


def plots_path(stage: str) -> Path:
    return PLOTS / f"{stage}.csv"


def packed_rows_writer(path: str | Path) -> str | None:
    """The stage that writes the packed rows at ``path`` (a folder of
    :data:`PACKED_ROWS_WRITERS` or one inside it, relative to the working
    directory or absolute), or None for a folder of no stage."""
    path = Path(path).resolve()
    for folder, stage in PACKED_ROWS_WRITERS.items():
        if path.is_relative_to(folder.resolve()):
            return stage
    return None
