"""ingest: read raw sources into one table of documents.

Input: ``ingest.sources``, a list of ``{path, format, text_field, split_by}``.
Output: a documents folder (:mod:`pipeline.data.docs`: Parquet shards of
``(id, text, source, location, chunk, offset, source_name, split)`` and a
manifest) and a quarantine JSONL of skipped records. The shards are committed
one by one, so a killed run rerun keeps the finished ones (see
:func:`run_ingest`). ``id``
is stable: a hash of the source (with placeholders such as ``{stdlib}`` kept
unexpanded, so ids agree across machines) and the location inside it.

``source`` is the file (or dataset) a document came from; ``source_name`` is the
name of the ``ingest.sources`` entry that read it (its ``name``, by default its
``path``), under which later stages report per source. ``split`` is the entry's
mark: null for the default (pack splits by hash), or ``train`` / ``val`` for a
source whose documents all go to that split (``split: val`` is a validation set
of the user's choosing, such as a benchmark's own validation split).

``split_by: chunk`` cuts a long text file into contiguous chunks (see
:func:`read_chunks`): each chunk is a document whose ``chunk`` column holds its
index in the file and ``offset`` its byte offset; the other modes leave both
null. Joined back in ``chunk`` order, the chunks of a file are the file's bytes,
less any chunk that was skipped (and the skip is counted).

Every record read either becomes a document or is counted in the ledger with a
reason; nothing is dropped silently. A missing path is an error raised before
any reading starts.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fnmatch
import glob
import hashlib
import io
import itertools
import json
import logging
import os
import re
import socket
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Literal, Union

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline.config import ParamsModel
from pipeline.data import accounting, compressed, remote, resume
from pipeline.data import docs as docs_format
from pipeline.data.accounting import Ledger
from pipeline.data.compressed import compression_of, format_suffix, open_input, rewound, until_damaged
from pipeline.data.docs import ShardedParquetWriter
from pipeline.data.executor import Executor, ParallelStageConfig, open_executor
from pipeline.data.remote import RemotePath
from pipeline.data.resume import ShardLog
from pipeline.errors import StageError
from pipeline.files import write_json
from pipeline.progress import progress
from pipeline.tracking.tracker import MAX_KEY_LENGTH, mlflow_key

log = logging.getLogger("pipeline.data.ingest")

Format = Literal["auto", "text", "jsonl", "json", "parquet", "csv", "hf"]
SplitBy = Literal["file", "paragraph", "line", "chunk"]

# Placeholders usable at the start of a source path. They are resolved at run
# time, so the same params.yaml works on every machine.
PLACEHOLDERS: dict[str, Callable[[], str]] = {
    "{stdlib}": lambda: sysconfig.get_paths()["stdlib"],
}

SUFFIX_FORMATS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}

# A compressed file counts as this many times its size on disk against
# worker_file_bytes (text compresses about 3-6x with gzip, zstd or xz), so that a
# worker reading one whole holds about as much as for a plain file of that limit.
COMPRESSED_SIZE_FACTOR = 4
SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("location", pa.string()),
    ("chunk", pa.int64()), ("offset", pa.int64()), ("source_name", pa.string()), ("split", pa.string()),
])

DEFAULT_CHUNK_BYTES = 65_536

BINARY_SNIFF_BYTES = 8192
# The longest MLflow key of a source, sources.<name>: the rest of MAX_KEY_LENGTH is room for a stage's or a
# model's prefix and the metric's name (pretrain.sources.<name>.requested_share).
SOURCE_KEY_LENGTH = MAX_KEY_LENGTH - 50


class HFDataset(ParamsModel):
    """Which part of a Hugging Face dataset to read: ``load_dataset(path, name, split=split)``,
    or one split of a ``save_to_disk`` folder."""

    name: str | None = Field(None, min_length=1, description="the dataset's config, e.g. wikitext-103-raw-v1 "
                             "(load_dataset's name; a save_to_disk folder has none)")
    split: str = Field("train", min_length=1, description="the dataset split to read, e.g. validation")
    revision: str | None = Field(None, min_length=1, description="for a dataset named for load_dataset: the "
                                 "commit, tag or branch to read (pins what a rerun reads); a local folder has none")


SPLIT_MARKS = ("auto", "train", "val")


class Source(ParamsModel):
    name: str | None = Field(None, min_length=1, description="what metrics and reports call this source "
                             "(default: its path, with the hf config and split when given); at most 192 "
                             "characters, which MLflow's keys can hold")

    path: str = Field(min_length=1, description="a file, a directory or a glob, here or in an object store "
                      "(s3://, gs://); may start with {stdlib}")
    format: Format = "auto"
    text_field: str = Field("text", min_length=1, description="field/column holding the text (record formats)")
    split_by: SplitBy = Field(
        "file", description="one document per file/record, per blank-line paragraph, per line, "
                            "or per chunk of a text file (packed back to back)")
    split: Literal["auto", "train", "val"] = Field(
        "auto", description="where the source's documents go: auto (pack's hash split), train (all to train) "
                            "or val (all to val: a validation set of your choosing)")
    hf: HFDataset = Field(default_factory=HFDataset,
                          description="format hf only: {name, split, revision} of the dataset")
    exclude: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns on the displayed path ('*' crosses '/'), e.g. '*/site-packages/*'",
    )
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=1, description="split_by: chunk only: bytes per chunk, "
                             "cut at line ends; at most max_doc_bytes")

    # Source is not a StageConfig: defaults are not validated, so these run only on
    # values written in params.yaml.
    @field_validator("path")
    @classmethod
    def _path_is_readable(cls, path: str) -> str:
        return remote.check_url(path)

    @field_validator("split", mode="before")
    @classmethod
    def _split_is_a_mark(cls, split: object) -> object:
        if isinstance(split, str) and split not in SPLIT_MARKS:
            raise ValueError(f"{split!r} is not one of {' | '.join(SPLIT_MARKS)}: split marks where the source's "
                             f"documents go; the split of a Hugging Face dataset to read is hf.split "
                             f"(hf: {{split: {split}}})")
        return split

    @field_validator("hf")
    @classmethod
    def _hf_reads_datasets(cls, hf: HFDataset, info: ValidationInfo) -> HFDataset:
        if info.data.get("format") not in (None, "auto", "hf"):
            raise ValueError(f"applies only to format hf (or auto on a dataset folder), not {info.data['format']!r}")
        return hf

    @property
    def label(self) -> str:
        """The source's name in metrics and reports."""
        if self.name:
            return self.name
        if "hf" not in self.model_fields_set:
            return self.path
        return self.path + (f":{self.hf.name}" if self.hf.name else "") + f"[{self.hf.split}]"

    @field_validator("split_by")
    @classmethod
    def _chunk_reads_text(cls, split_by: str, info: ValidationInfo) -> str:
        fmt = info.data.get("format")
        if split_by == "chunk" and fmt not in (None, "auto", "text"):
            raise ValueError(f"chunk cuts plain text files; format {fmt!r} is a record format "
                             "(use file, paragraph or line)")
        return split_by

    @field_validator("chunk_bytes")
    @classmethod
    def _chunk_bytes_needs_chunk(cls, chunk_bytes: int, info: ValidationInfo) -> int:
        if info.data.get("split_by", "file") != "chunk":
            raise ValueError("applies only to split_by: chunk")
        return chunk_bytes


class IngestConfig(ParallelStageConfig):
    sources: list[Source] = Field(
        default_factory=lambda: [Source(path="{stdlib}/**/*.py", exclude=["*/site-packages/*", "*/dist-packages/*"])],
        min_length=1,
        description="list of {path, name, format, text_field, split_by, split, hf, exclude, chunk_bytes}; "
                    "see 'ingest sources' above",
    )
    max_bytes: int | None = Field(8_000_000, ge=1, description="reading stops after the document that brings the "
                                  "UTF-8 bytes read to this or past it: documents are kept whole, so the last one (a "
                                  "whole file with split_by: file) can take the total past the cap by up to its own "
                                  "size (at most max_doc_bytes). Sources are read in their order (files left unread "
                                  "are counted, a source never reached is a warning); null = no cap")
    max_doc_bytes: int = Field(1_000_000, ge=1, description="longer documents or lines are skipped as too_large "
                               "(split_by: chunk never skips a file for its size, only a longer line). A "
                               "record's text is measured, not its JSON: a JSON line is parsed unless it is over "
                               "6 × this (the most JSON's escapes grow a text), when it is a too_large skip unparsed")
    include_hidden: bool = Field(False, description="read dot-files and files under dot-directories")
    quarantine_per_reason: int = Field(100, ge=0, description="skipped records kept verbatim per reason")
    row_group_docs: int = Field(2000, ge=1, description="documents per Parquet row group written at most")
    row_group_bytes: int = Field(1 << 20, ge=1, description="a Parquet row group also ends at the document that "
                                 "brings its text to this many bytes: the unit a reader can start at (clean's "
                                 "sharded dedup reads row groups in its workers)")
    shard_bytes: int = Field(64 << 20, ge=1, description="the output's shards: a new one starts at a document "
                             "once the current one holds this many bytes of text (a rerun after a kill keeps "
                             "the committed shards)")
    worker_file_bytes: int = Field(64 << 20, ge=0, description="with more than one worker, files up to this size "
                                   "(a compressed one counts 4x its size) are read whole by the executor's "
                                   "workers; larger ones (and datasets) stream in the stage's own process")

    @model_validator(mode="after")
    def _chunks_fit(self) -> "IngestConfig":
        for i, src in enumerate(self.sources):
            if src.split_by == "chunk" and src.chunk_bytes > self.max_doc_bytes:
                raise ValueError(f"sources.{i}.chunk_bytes={src.chunk_bytes} exceeds max_doc_bytes="
                                 f"{self.max_doc_bytes}; lower it or raise max_doc_bytes")
        return self

    @model_validator(mode="after")
    def _names_differ(self) -> "IngestConfig":
        seen: dict[str, int] = {}
        keys: dict[str, int] = {}  # later stages log metrics per source as sources.<name>.<metric> in MLflow
        for i, src in enumerate(self.sources):
            if src.label in seen:
                raise ValueError(f"sources.{seen[src.label]} and sources.{i} are both called {src.label!r}; "
                                 "give them distinct names (name: ...)")
            seen[src.label] = i
            key = mlflow_key(f"sources.{src.label}")
            if len(key) > SOURCE_KEY_LENGTH:
                raise ValueError(f"sources.{i} is called {src.label[:40]!r}... ({len(src.label):,} characters): its "
                                 f"per-source metrics are logged to MLflow as sources.<name>.<metric>, under a "
                                 f"stage's or model's prefix, and MLflow cuts a key at {MAX_KEY_LENGTH} characters, "
                                 f"so they would mix; give it a name of at most {SOURCE_KEY_LENGTH - 8} characters "
                                 "(name: ...)")
            if key in keys:
                j = keys[key]
                raise ValueError(f"sources.{j} ({self.sources[j].label!r}) and sources.{i} ({src.label!r}) would "
                                 f"both be logged to MLflow as {key!r} (it takes only letters, digits, _ - . / and "
                                 "space in a key, and cuts a long one short), so their per-source metrics would mix; "
                                 "give them names that differ in those (name: ...)")
            keys[key] = i
        return self

    @model_validator(mode="after")
    def _some_train(self) -> "IngestConfig":
        if all(src.split == "val" for src in self.sources):
            raise ValueError("every source is marked split: val, so no document could be trained on (pack and "
                             "the tokenizer would stop on it later); leave a source unmarked (split: auto) or "
                             "mark it split: train")
        return self


class IngestError(StageError):
    """A source cannot be ingested at all (missing path, unreadable dataset)."""


# --- resolving sources -------------------------------------------------------------------------


@dataclass(frozen=True)
class InputFile:
    path: Path | RemotePath  # real path on this machine, or a file in an object store
    display: str  # how it is named in ids and quarantine (placeholders kept)
    format: str
    source: Source

    @property
    def key(self) -> tuple:
        """What is read: the same key from two sources is read once. A dataset's
        splits and configs are different inputs."""
        real = self.path.resolve() if self.path.exists() else self.path
        return (real, self.source.hf.name, self.source.hf.split) if self.format == "hf" else (real,)


def _hf_display(display: str, src: Source) -> str:
    """A dataset read by config or split is named with them, so that ids of the same
    row number in two splits differ. Without an ``hf`` section the name (and ids)
    are the path's alone."""
    if "hf" not in src.model_fields_set:
        return display
    return display + (f":{src.hf.name}" if src.hf.name else "") + f"[{src.hf.split}]"


def expand_placeholders(path: str) -> tuple[str, str | None, str | None]:
    """Return (expanded path, placeholder, its value) for a source path."""
    for name, resolve in PLACEHOLDERS.items():
        if path.startswith(name):
            value = resolve()
            return value + path[len(name):], name, value
    return path, None, None


def _display(p: Path | RemotePath, placeholder: str | None, value: str | None) -> str:
    """How the documents of ``p`` name their source (ids, the ``source`` column,
    reports): relative to the working folder where it lies below it. A name that
    is not UTF-8 shows its odd bytes as ``\\xNN``, so that it can be stored."""
    s = str(p)
    if isinstance(p, RemotePath):
        return s
    if placeholder and value and s.startswith(value):
        return _as_utf8(placeholder + s[len(value):])
    try:
        real = p.resolve()
    except (OSError, RuntimeError):  # a link in a loop (RuntimeError before Python 3.13): its folder's path
        real = p.parent.resolve() / p.name
    try:
        return _as_utf8(str(real.relative_to(Path.cwd().resolve())))
    except ValueError:
        return _as_utf8(s)


def _as_utf8(s: str) -> str:
    """A file name (or a text read with ``errors="surrogateescape"``) as UTF-8
    text: bytes that were not UTF-8 (decoded as lone surrogates) become ``\\xNN``."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _is_hidden(p: Path | RemotePath, root: Path | RemotePath) -> bool:
    if isinstance(p, RemotePath):
        return p.hidden_below(root)
    try:
        parts = p.relative_to(root).parts
    except ValueError:
        parts = p.parts
    return any(part.startswith(".") for part in parts)


def _is_hf_dir(p: Path) -> bool:
    try:
        return p.is_dir() and any((p / n).exists() for n in ("state.json", "dataset_dict.json", "dataset_info.json"))
    except PermissionError:  # a folder that cannot be searched: listed as such (_walk, _unlisted_folders)
        return False


def _in_hf_dir(folder: Path, root: Path, seen: dict[Path, bool]) -> bool:
    """Whether ``folder``, or a folder between it and ``root`` (not ``root``
    itself), is a ``save_to_disk`` folder: a file in ``folder`` is then a file
    of the dataset, read with it. ``seen`` remembers each folder's answer, as
    a glob's files share their folders."""
    if folder not in seen:
        below = folder != root and root in folder.parents
        seen[folder] = below and (_is_hf_dir(folder) or _in_hf_dir(folder.parent, root, seen))
    return seen[folder]


def _walk(folder: Path, datasets: bool) -> list[Path]:
    """The files below ``folder``, sorted; with ``datasets``, a ``save_to_disk``
    folder is one input (read as a dataset) and its own files are not.

    Entries that are not files are listed too, for :func:`read_items` to skip
    and count: a link to a folder (not walked, as DVC does not look into it
    either), a link to nothing, a FIFO or a socket. Left out, they would be
    lost without a word: a dataset folder linked into ``data/raw`` would give
    no documents and no warning. So is a folder that cannot be listed (a
    permission), which ``os.walk`` would pass over in silence."""
    found: list[Path] = []
    for top, dirs, files in os.walk(folder, onerror=lambda e: found.append(Path(e.filename))):
        here = Path(top)
        if datasets:
            inputs = [d for d in dirs if _is_hf_dir(here / d)]
            found.extend(here / d for d in inputs)
            dirs[:] = [d for d in dirs if d not in inputs]
        found.extend(here / d for d in dirs if (here / d).is_symlink())
        found.extend(here / f for f in files)
    return sorted(found)


def _unlisted_folders(pattern: str, root: Path, include_hidden: bool) -> list[Path]:
    """The folders below ``root`` that ``glob.glob(pattern)`` would have looked
    into but could not list (a permission): glob passes over them in silence,
    and their files would be lost without a word. A ``root`` that is no folder
    (a typo in the pattern's folder) holds none: the pattern matches nothing."""
    if not root.is_dir():
        return []
    parts = Path(pattern).relative_to(root).parts
    into = parts if parts[-1] == "**" else parts[:-1]  # the parts a folder on the way must match

    def on_the_way(rel: tuple[str, ...], pat: tuple[str, ...]) -> bool:
        if not rel:
            return True
        if not pat:
            return False
        if pat[0] == "**":
            return on_the_way(rel, pat[1:]) or on_the_way(rel[1:], pat)
        return fnmatch.fnmatchcase(rel[0], pat[0]) and on_the_way(rel[1:], pat[1:])

    unlisted: list[Path] = []
    for top, dirs, _ in os.walk(root, onerror=lambda e: unlisted.append(Path(e.filename))):
        rel = Path(top).relative_to(root).parts
        dirs[:] = [d for d in dirs if (include_hidden or not d.startswith(".")) and on_the_way((*rel, d), into)]
    return unlisted


def not_a_file(path: Path) -> str | None:
    """Why an input that should be a file is none, or None when it is one."""
    if path.is_file():
        return None
    if path.is_dir() and not path.is_symlink():
        try:
            os.scandir(path).close()
        except OSError as e:
            return f"a folder that cannot be listed ({e.strerror}), so none of its files were read"
    if path.is_symlink() and not path.exists():
        try:
            path.stat()
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"a symbolic link to {os.readlink(path)}, which leads back to itself (a loop of links)"
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    if path.is_dir():
        return ("a symbolic link to a folder, which is not read: DVC does not look into it, so a rerun would not "
                "see its files change; link the files, or list the folder as a source of its own")
    if not path.exists():
        return "no longer exists"
    mode = path.stat().st_mode
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{kind}, not a regular file"


def _infer_format(p: Path | RemotePath) -> str:
    if isinstance(p, Path) and _is_hf_dir(p):
        return "hf"
    return SUFFIX_FORMATS.get(format_suffix(p), "text")


def resolve_sources(cfg: IngestConfig) -> list[InputFile]:
    """Expand every source to a sorted list of files. Raises IngestError, naming the
    source, when a path matches nothing.

    Sources marked ``split: val`` come first, then the others in their listed
    order: clean's dedup keeps the first copy of a document, so a validation
    document that the training data also holds stays in val and its training
    copies are dropped (validation text is never trained on)."""
    files: list[InputFile] = []
    for i, src in sorted(enumerate(cfg.sources), key=lambda item: item[1].split != "val"):
        where = f"ingest.sources.{i}.path"
        expanded, ph, value = expand_placeholders(src.path)
        fmt = src.format
        if fmt == "hf" and remote.scheme_of(expanded):
            raise IngestError(f"{where}: format hf reads a local dataset folder or a dataset name, not "
                              f"{src.path!r}; save the dataset as Parquet or JSON Lines files there instead")
        if fmt == "hf" and not Path(expanded).exists() and not glob.has_magic(expanded):
            # A dataset name for datasets.load_dataset (needs the network or the HF cache); a name has no
            # wildcard, and a pattern matches dataset folders here.
            if src.hf.revision is None:
                log.warning("%s: the Hugging Face dataset %r is read at whatever revision the Hub (or the cache) "
                            "has, and a rerun does not notice when it changes; pin it with hf.revision",
                            where, src.path)
            files.append(InputFile(Path(expanded), _hf_display(src.path, src), "hf", src))
            continue
        if src.hf.revision is not None:
            raise IngestError(f"{where}: hf.revision pins a dataset named for load_dataset, but {src.path} is a "
                              "local path (its files are what a rerun compares); remove hf.revision")
        p = Path(expanded)
        if remote.scheme_of(expanded):
            root, candidates = remote.listed(expanded, where, IngestError)
        elif glob.has_magic(expanded) and not os.path.lexists(expanded):  # a name with [ ] * ? is itself first
            matches = sorted(Path(m) for m in glob.glob(expanded, recursive=True, include_hidden=cfg.include_hidden))
            # The folder before the first wildcard: its own name is the user's, never a hidden part.
            root = Path(os.path.dirname(expanded.split("*")[0].split("?")[0].split("[")[0]) or ".")
            datasets_too, seen = fmt in ("auto", "hf"), {}
            # Folders a pattern matches are not inputs; a link to nothing, a FIFO or a socket
            # is, to be skipped and counted (read_items).
            candidates = [m for m in matches if (not m.is_dir() or (datasets_too and _is_hf_dir(m)))
                          and not (datasets_too and _in_hf_dir(m.parent, root, seen))]
            candidates = sorted({*candidates, *_unlisted_folders(expanded, root, cfg.include_hidden)})
        elif p.is_dir() and (fmt == "hf" or (fmt == "auto" and _is_hf_dir(p))):
            candidates, root = [p], p.parent
        elif p.is_dir():
            root = p
            candidates = _walk(p, datasets=fmt == "auto")
        elif p.exists():
            candidates, root = [p], p.parent
        else:
            raise IngestError(f"{where}: no such file or directory: {src.path!r} (expanded to {expanded!r})")
        listed = len(candidates)
        if not cfg.include_hidden:
            candidates = [c for c in candidates if not _is_hidden(c, root)]
        hidden = listed - len(candidates)
        if src.exclude:
            candidates = [
                c for c in candidates
                if not any(fnmatch.fnmatchcase(_display(c, ph, value), pat) for pat in src.exclude)
            ]
        if not candidates:
            left_out = ", ".join(part for part in (
                f"{hidden} hidden (ingest.include_hidden is false)" if hidden else "",
                f"{listed - hidden} left out by exclude {src.exclude}" if listed - hidden else "") if part)
            raise IngestError(f"{where}: {src.path!r} matched no files (expanded to {expanded!r})"
                              + (f"; of the {listed} it found, {left_out}" if listed else ""))
        for c in candidates:
            f_fmt = fmt if fmt != "auto" else _infer_format(c)
            if "hf" in src.model_fields_set and f_fmt != "hf":
                raise IngestError(f"{where}: hf applies to Hugging Face datasets, but {_display(c, ph, value)} "
                                  f"reads as {f_fmt}")
            display = _display(c, ph, value)
            if f_fmt == "hf" and c.is_file():  # load_dataset would say it "couldn't find any data file" there
                raise IngestError(f"{where}: format hf reads a dataset folder (save_to_disk's, or a dataset "
                                  f"repository's) or a dataset name, but {display} is a file; read it with "
                                  f"format: {SUFFIX_FORMATS.get(format_suffix(c), 'text')} (or auto)")
            f = InputFile(c, _hf_display(display, src) if f_fmt == "hf" else display, f_fmt, src)
            if src.split_by == "chunk" and f.format != "text":
                raise IngestError(f"{where}: split_by: chunk cuts plain text files, but {f.display} reads as "
                                  f"{f.format} (set format: text to cut it as text, or exclude it)")
            files.append(f)
    _warn_compressed_twins(files)
    return files


def _warn_compressed_twins(files: list[InputFile]) -> None:
    """A warning for each file read beside its own compressed copy (``a.jsonl`` and ``a.jsonl.gz``): if they
    hold the same records, every document is read twice (clean's exact dedup drops the second copies)."""
    read = {str(f.path): f for f in files}
    for f in files:
        plain = str(f.path)[:-len(f.path.suffix)] if compression_of(f.path) else None
        if plain in read:
            log.warning("%s and %s are both read: if one is a copy of the other, each of its documents is read "
                        "twice; exclude one of them", read[plain].display, f.display)


# --- readers: each yields Doc or Skip ---------------------------------------------------------


@dataclass
class Doc:
    location: str
    text: str
    chunk: int | None = None  # split_by: chunk: index in the file, and byte offset
    offset: int | None = None


@dataclass
class Skip:
    reason: str
    location: str
    detail: str = ""
    text: str | None = None
    n: int = 1


Item = Union[Doc, Skip]


LINE_END = re.compile(r"\r\n|\r|\n")


def line_ends(fh: BinaryIO) -> io.TextIOWrapper:
    """``fh`` as lines that end at ``\\n``, ``\\r\\n`` or a lone ``\\r`` (old Mac OS
    text), each end kept in its line. Latin-1 maps each byte to one character and
    back, so the text layer only finds the line ends and a line's bytes are
    ``line.encode("latin-1")``, whatever the file's encoding."""
    return io.TextIOWrapper(fh, encoding="latin-1", newline="")


def split_text(text: str, split_by: str, base: str = "") -> Iterator[tuple[str, str]]:
    """Split one text into (location, piece). A line ends at ``\\n``, ``\\r\\n`` or a
    lone ``\\r``, which no piece keeps (a paragraph's lines are joined with ``\\n``).
    Blank lines separate paragraphs and are not records themselves; in line
    mode, blank lines are skipped likewise."""
    prefix = f"{base}#" if base else ""
    if split_by == "file":
        yield (base or "file"), text
        return
    lines = LINE_END.split(text)
    if split_by == "line":
        for n, line in enumerate(lines, 1):
            if line.strip():
                yield f"{prefix}line:{n}", line
        return
    start, buf = 0, []
    for n, line in enumerate(lines, 1):
        if line.strip():
            if not buf:
                start = n
            buf.append(line)
        elif buf:
            yield f"{prefix}para:{start}", "\n".join(buf)
            buf = []
    if buf:
        yield f"{prefix}para:{start}", "\n".join(buf)


def _texts(text: object, split_by: str, base: str, max_doc_bytes: int) -> Iterator[Item]:
    """Checks shared by the record formats: type, emptiness, size, then splitting."""
    if text is None:  # JSON null, an empty cell, a Parquet null: the field is there, its text is not
        yield Skip("missing_field", base, detail="the value is null")
        return
    if not isinstance(text, str):
        yield Skip("bad_type", base, detail=f"expected a string, got {type(text).__name__}")
        return
    if not text.strip():
        yield Skip("empty_text", base)
        return
    for loc, piece in split_text(text, split_by, base):
        try:
            size = len(piece.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate: JSON's "\ud800" escape decodes to one
            yield Skip("non_utf8", loc, detail=f"a lone surrogate U+{ord(piece[e.start]):04X} at character {e.start}, "
                       "which has no UTF-8 form", text=piece)
            continue
        if size > max_doc_bytes:
            yield Skip("too_large", loc, detail=f"{size} bytes > max_doc_bytes={max_doc_bytes}", text=piece)
        else:
            yield Doc(loc, piece)


def _not_text(head: bytes) -> Skip | None:
    """The skip of a text file whose first BINARY_SNIFF_BYTES are ``head``: empty, or binary."""
    if not head:
        return Skip("empty_file", "file")
    if b"\x00" in head:
        # UTF-32 LE's byte-order mark begins with UTF-16 LE's, so it is tried first
        wide = next((name for name, bom in (("UTF-32", codecs.BOM_UTF32_LE), ("UTF-32", codecs.BOM_UTF32_BE),
                                            ("UTF-16", codecs.BOM_UTF16_LE), ("UTF-16", codecs.BOM_UTF16_BE))
                     if head.startswith(bom)), None)
        return Skip("binary", "file", detail="NUL byte in the first 8 KiB" + (
            f": {wide} text by its byte-order mark; convert it to UTF-8 (iconv -f {wide} -t UTF-8)" if wide else ""))
    return None


def read_text(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    if f.source.split_by == "chunk":
        yield from read_chunks(f, cfg)
        return
    with open_input(f.path) as fh:
        head = fh.read(BINARY_SNIFF_BYTES)
        if (skip := _not_text(head)) is not None:
            yield skip
            return
        if f.source.split_by == "file":
            data = head + fh.read(max(0, cfg.max_doc_bytes + 1 - len(head)))  # holds one byte too many at most
            if len(data) > cfg.max_doc_bytes:
                size = (f"more than {cfg.max_doc_bytes} bytes once decompressed" if compression_of(f.path)
                        else f"{f.path.stat().st_size} bytes")  # a compressed file's is not known until read whole
                yield Skip("too_large", "file", detail=f"{size} > max_doc_bytes={cfg.max_doc_bytes}")
                return
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Skip("non_utf8", "file", detail=f"invalid UTF-8 at byte {e.start}")
                return
            if not text.strip():
                yield Skip("empty_text", "file")
                return
            yield Doc("file", text)
            return
        # line / paragraph mode: stream lines so that a huge file is never held whole,
        # and a bad byte costs one line, not the whole file.
        yield from _lines_of(rewound(head, fh), f, cfg)


def _lines_of(fh: BinaryIO, f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    """The documents of a text file read by line or by paragraph. A document is
    measured against max_doc_bytes by its own text: a line without its end, a
    paragraph's lines joined with ``\n``. A paragraph is held only while it
    fits: one that runs on (a long log file with no blank line) is a too_large
    skip whose sample holds its beginning, not a whole file held in memory."""
    para: list[str] = []
    para_start = 0
    para_bytes = -1  # the paragraph's text bytes so far; -1: none begun (each line adds a \n before it)
    for n, latin in enumerate(line_ends(fh), 1):
        raw = latin.encode("latin-1")
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            yield Skip("non_utf8", f"line:{n}", detail=f"invalid UTF-8 at byte {e.start} of the line")
            continue
        size = len(raw.rstrip(b"\r\n"))
        if f.source.split_by == "line":
            if not line.strip():
                continue
            if size > cfg.max_doc_bytes:
                yield Skip("too_large", f"line:{n}", detail=f"{size} bytes > max_doc_bytes={cfg.max_doc_bytes}",
                           text=line)
            else:
                yield Doc(f"line:{n}", line)
            continue
        if line.strip():
            if para_bytes < 0:
                para_start = n
            if para_bytes <= cfg.max_doc_bytes:  # past it the paragraph is too_large, and its rest is not kept
                para.append(line)
            para_bytes += 1 + size
            continue
        if para_bytes >= 0:
            yield from _emit_para(para, para_start, para_bytes, cfg)
            para, para_bytes = [], -1
    if para_bytes >= 0:
        yield from _emit_para(para, para_start, para_bytes, cfg)


def read_chunks(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    """``split_by: chunk``: cut a text file into chunks of about ``chunk_bytes``,
    streaming, so a file of any size is read (none is skipped for its size).

    A line ends at ``\n``, ``\r\n`` or a lone ``\r`` (old Mac OS text), which
    stays in its line, so the chunks join back into the file's bytes.
    A chunk takes whole lines while it stays within ``chunk_bytes``; the next
    non-blank line that would overflow it starts the next chunk. Blank lines
    never start a chunk: they stay at the end of the one before (up to
    ``max_doc_bytes``), so a run of blank lines is never cut in two and clean
    normalises it as it would in the whole file. A line longer than
    ``chunk_bytes`` is not cut: it ends the chunk it is in, which may therefore be
    larger; a line longer than ``max_doc_bytes`` is skipped as ``too_large``.

    Every chunk gets the next index, skipped ones too (``non_utf8`` for a chunk
    with an invalid byte, ``empty_text`` for one of only whitespace), so a gap in
    the indices marks where text is missing. Locations are ``byte:<offset>``.
    """
    chunk_bytes, max_line = f.source.chunk_bytes, cfg.max_doc_bytes
    with open_input(f.path) as opened:
        head = opened.read(BINARY_SNIFF_BYTES)
        if (skip := _not_text(head)) is not None:
            yield skip
            return
        text_fh = line_ends(rewound(head, opened))

        def readline(limit: int) -> bytes:
            return text_fh.readline(limit).encode("latin-1")

        lines: list[bytes] = []
        size = start = pos = index = 0

        def cut() -> Item:
            nonlocal lines, size, start, index
            item = _chunk(b"".join(lines), index, start)
            lines, size, start, index = [], 0, pos, index + 1
            return item

        carry: bytes | None = None  # a line read past the end of a skipped one
        while line := readline(max_line + 1) if carry is None else carry:
            carry = None
            if len(line) > max_line:
                if lines:
                    yield cut()
                n, head = len(line), line
                while not line.endswith((b"\n", b"\r")) and (line := readline(1 << 20)):
                    n += len(line)
                if line.endswith(b"\r") and (carry := readline(max_line + 1)) == b"\n":
                    n, carry = n + 1, None  # the piece ended between the \r and the \n of its CRLF
                yield Skip("too_large", f"byte:{pos}", detail=f"a line of {n} bytes > max_doc_bytes={max_line}",
                           text=head[:4000].decode("utf-8", "replace"))
                pos += n
                start, index = pos, index + 1
                continue
            blank = not line.strip()
            if lines and size + len(line) > (max_line if blank else chunk_bytes):
                yield cut()
            lines.append(line)
            size += len(line)
            pos += len(line)
        if lines:
            yield cut()


def _chunk(data: bytes, index: int, offset: int) -> Item:
    loc = f"byte:{offset}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Skip("non_utf8", loc, detail=f"chunk {index}: invalid UTF-8 at byte {offset + e.start} of the file")
    if not text.strip():
        return Skip("empty_text", loc, detail=f"chunk {index}: only whitespace")
    return Doc(loc, text, chunk=index, offset=offset)


def _emit_para(lines: list[str], start: int, nbytes: int, cfg: IngestConfig) -> Iterator[Item]:
    """A paragraph of ``nbytes`` of text; of a too_large one, ``lines`` hold its beginning only."""
    text = "\n".join(lines)
    if nbytes > cfg.max_doc_bytes:
        yield Skip("too_large", f"para:{start}", detail=f"{nbytes} bytes > max_doc_bytes={cfg.max_doc_bytes}", text=text)
    else:
        yield Doc(f"para:{start}", text)


# The most JSON's escapes grow a text's UTF-8 bytes: "\u0001" is 6 bytes for 1. A JSON line longer than
# this many times max_doc_bytes is skipped unparsed; a shorter one is parsed and its text measured.
JSON_ESCAPE_GROWTH = 6


def read_jsonl(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    field, split_by = f.source.text_field, f.source.split_by
    with open_input(f.path) as fh:
        if not fh.peek(1):
            yield Skip("empty_file", "file")
            return
        for n, raw in enumerate(fh, 1):
            loc = f"line:{n}"
            if n == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark some editors write
            if not raw.strip():
                continue  # blank lines separate nothing and carry nothing
            if len(raw) > JSON_ESCAPE_GROWTH * cfg.max_doc_bytes:
                # not parsed, so that a runaway line costs no parse; a shorter one's text is measured below
                yield Skip("too_large", loc, detail=f"a JSON line of {len(raw)} bytes > {JSON_ESCAPE_GROWTH} x "
                           f"max_doc_bytes={cfg.max_doc_bytes} is not parsed")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Skip("non_utf8", loc, detail=f"invalid UTF-8 at byte {e.start} of the line")
                continue
            try:
                obj = json.loads(line)
            # ValueError: besides JSONDecodeError, an integer past Python's 4,300 digits; RecursionError: nested
            # too deeply to parse
            except (ValueError, RecursionError) as e:
                yield Skip("malformed_json", loc, detail=str(e), text=line)
                continue
            if not isinstance(obj, dict):
                yield Skip("malformed_json", loc, detail=f"expected an object, got {type(obj).__name__}", text=line)
                continue
            if field not in obj:
                yield Skip("missing_field", loc, detail=f"no field {field!r}", text=line)
                continue
            yield from _texts(obj[field], split_by, loc, cfg.max_doc_bytes)


def read_json(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    with open_input(f.path) as fh:
        raw = fh.read()
    if not raw:
        yield Skip("empty_file", "file")
        return
    try:
        data = json.loads(raw.decode("utf-8-sig"))  # a byte-order mark is not the document's
    except UnicodeDecodeError as e:
        yield Skip("non_utf8", "file", detail=f"invalid UTF-8 at byte {e.start}")
        return
    except (ValueError, RecursionError) as e:  # as for a JSON line: an integer too long, nested too deeply
        if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data":  # a value per line: JSON Lines
            if f.source.format == "auto":  # a .json name says no more than that: read it as what it is
                yield from read_jsonl(f, cfg)
                return
            yield Skip("malformed_json", "file", detail=f"{e} (one JSON value per line? set format: jsonl)")
            return
        yield Skip("malformed_json", "file", detail=str(e))
        return
    field = f.source.text_field
    if isinstance(data, dict):
        data = _records_of(data, field)
    if not isinstance(data, list):
        yield Skip("malformed_json", "file", detail=f"expected a list of objects, got {type(data).__name__}")
        return
    for i, obj in enumerate(data):
        loc = f"item:{i}"
        if not isinstance(obj, dict):
            yield Skip("malformed_json", loc, detail=f"expected an object, got {type(obj).__name__}")
            continue
        if field not in obj:
            yield Skip("missing_field", loc, detail=f"no field {field!r}")
            continue
        yield from _texts(obj[field], f.source.split_by, loc, cfg.max_doc_bytes)


def _records_of(obj: dict, field: str) -> list:
    """The records of a JSON file holding one object: the object itself when it
    has the text field; else its one list of objects (``{"data": [...], "version":
    ...}``), or its one list of anything (whose items are checked one by one)."""
    if field in obj:
        return [obj]
    lists = [v for v in obj.values() if isinstance(v, list)]
    of_objects = [v for v in lists if any(isinstance(x, dict) for x in v)]
    if len(of_objects) == 1:
        return of_objects[0]
    return lists[0] if len(lists) == 1 and not of_objects else [obj]


def _read_columns(batches: Iterator[pa.RecordBatch], field: str, split_by: str, cfg: IngestConfig,
                  row: int = 0) -> Iterator[Item]:
    """The items of column ``field``, rows numbered from ``row``. A binary
    column (CSV's, read undecoded) is decoded here, value by value, so that an
    invalid byte skips its row as ``non_utf8`` and not the rest of the file."""
    for batch in batches:
        col = batch.column(batch.schema.get_field_index(field))
        binary = pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)
        for value in col.to_pylist():
            if binary and value is not None:
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield Skip("non_utf8", f"row:{row}", detail=f"invalid UTF-8 at byte {e.start} of the value")
                    row += 1
                    continue
            yield from _texts(value, split_by, f"row:{row}", cfg.max_doc_bytes)
            row += 1


def read_parquet(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    try:
        source = remote.open_file(f.path) if isinstance(f.path, RemotePath) else f.path
        pf = pq.ParquetFile(source, pre_buffer=False, buffer_size=1 << 20)  # pre_buffer keeps every chunk read
    except (pa.ArrowInvalid, OSError) as e:
        yield Skip("unreadable", "file", detail=f"not a readable Parquet file: {e}")
        return
    field = f.source.text_field
    if pf.schema_arrow.names.count(field) != 1:
        yield _no_single_column(field, pf.schema_arrow.names, max(pf.metadata.num_rows, 1))
        return
    # Row group by row group, so that a damaged one costs its own rows (counted), not the rest of the file.
    row = 0
    for group in range(pf.metadata.num_row_groups):
        size, last = pf.metadata.row_group(group).num_rows, None
        try:
            for last in _read_columns(pf.iter_batches(batch_size=1000, row_groups=[group], columns=[field]),
                                      field, f.source.split_by, cfg, row):
                yield last
        except (pa.ArrowException, OSError) as e:
            done = 0 if last is None else _row_of(last) + 1 - row  # rows read before the damage
            yield Skip("unreadable", f"row:{row + done}", n=size - done,
                       detail=f"row group {group} is damaged, its last {size - done} of {size} rows not read: "
                              + str(e).replace("\n", " "))
        row += size


def _row_of(item: Item) -> int:
    """The row number in an item's location (``row:12`` or ``row:12#para:3``)."""
    return int(item.location.split("#", 1)[0].removeprefix("row:"))


def read_csv(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    """A CSV file's text column, row by row, with pyarrow's reader. Where it
    stops on the way (a row with the wrong number of columns, or larger than its
    1 MiB block), the rest comes from Python's ``csv`` module
    (:func:`_read_csv_rest`), which counts a malformed row with its line and
    goes on. (pyarrow's handler of invalid rows gets no line number where
    values may hold newlines, and none at all when the row is not UTF-8.)"""
    with open_input(f.path) as fh:
        if not fh.peek(1):
            yield Skip("empty_file", "file")
            return
        # pyarrow reads a plain local file by its path; a compressed or remote one through this stream
        plain = isinstance(f.path, Path) and compression_of(f.path) is None
        yield from _read_csv(f, cfg, f.path if plain else fh)


def _read_csv(f: InputFile, cfg: IngestConfig, source: Path | BinaryIO) -> Iterator[Item]:
    import pyarrow.csv as pacsv

    field = f.source.text_field
    try:
        reader = pacsv.open_csv(
            source,
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            # The text column undecoded (_read_columns decodes it row by row) and no other checked, so an
            # invalid byte costs its row, not the rest of the file.
            convert_options=pacsv.ConvertOptions(column_types={field: pa.binary()}, check_utf8=False),
        )
        names = reader.schema.names  # decoded here: a header that is not UTF-8 raises
    except pa.ArrowInvalid as e:  # the first block, read to find the columns, stopped it
        log.debug("%s: pyarrow's CSV reader stopped in its first block (%s); reading it with Python's csv",
                  f.display, e)
        yield from _read_csv_rest(f, cfg, 0)
        return
    except UnicodeDecodeError as e:
        yield Skip("non_utf8", "file", detail=f"the header row is not UTF-8 (invalid byte at {e.start})")
        return
    if names.count(field) != 1:  # every row is skipped, and counted (as Parquet's are)
        rows = 0
        with contextlib.suppress(pa.ArrowInvalid):  # a row the reader stops at ends the count
            for batch in reader:
                rows += batch.num_rows
        yield _no_single_column(field, names, max(rows, 1))
        return
    done = [0]
    try:
        yield from _read_columns(_counted(reader, done), field, f.source.split_by, cfg)
    except pa.ArrowInvalid as e:
        log.debug("%s: pyarrow's CSV reader stopped after %d rows (%s); reading the rest with Python's csv",
                  f.display, done[0], e)
        yield from _read_csv_rest(f, cfg, done[0])


def _no_single_column(field: str, names: list[str], rows: int) -> Skip:
    """The skip of every row of a file whose columns (a CSV header, a Parquet
    schema) name the text column not once: none, or several (which one holds the
    text would be a guess; for CSV, pyarrow's reader and Python's guess differently)."""
    if field not in names:
        return Skip("missing_field", "file", detail=f"no column {field!r} (columns: {names})", n=rows)
    return Skip("ambiguous_field", "file", n=rows,
                detail=f"the header names column {field!r} {names.count(field)} times (columns: {names}); "
                       f"rename all but the one that holds the text")


def _counted(batches: Iterable[pa.RecordBatch], done: list[int]) -> Iterator[pa.RecordBatch]:
    """``batches``; ``done[0]`` counts the rows of those the caller has finished with (asked for the next)."""
    for batch in batches:
        yield batch
        done[0] += batch.num_rows


def _not_utf8(text: str) -> int | None:
    """Where a text read with ``errors="surrogateescape"`` had its first byte that is not UTF-8 (None: none)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return len(text[:e.start].encode("utf-8"))


def _read_csv_rest(f: InputFile, cfg: IngestConfig, skip: int) -> Iterator[Item]:
    """The items of a CSV file after its first ``skip`` well-formed rows (those
    pyarrow gave), with Python's ``csv`` module: any row size, and a malformed row
    counted wherever it is, with its line. Well-formed rows are numbered as
    pyarrow numbers them (blank lines and malformed rows are not rows)."""
    import csv

    csv.field_size_limit(sys.maxsize)  # a value's size is max_doc_bytes' to judge
    row = 0
    with io.TextIOWrapper(open_input(f.path), encoding="utf-8-sig", errors="surrogateescape", newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader, [])
            if any(_not_utf8(name) is not None for name in header):
                yield Skip("non_utf8", "file", detail="the header row is not UTF-8")
                return
            if header.count(f.source.text_field) != 1:
                yield _no_single_column(f.source.text_field, header, max(sum(1 for record in reader if record), 1))
                return
            column, width = header.index(f.source.text_field), len(header)
            for record in reader:
                if not record:
                    continue
                if len(record) != width:
                    yield Skip("malformed_csv", f"line:{reader.line_num}",
                               detail=f"{len(record)} columns, the header has {width}",
                               text=_as_utf8(",".join(record)))
                    continue
                if row >= skip:
                    value = record[column]
                    bad = _not_utf8(value)
                    if bad is not None:
                        yield Skip("non_utf8", f"row:{row}", detail=f"invalid UTF-8 at byte {bad} of the value")
                    else:
                        yield from _texts(value, f.source.split_by, f"row:{row}", cfg.max_doc_bytes)
                row += 1
        except csv.Error as e:
            yield Skip("unreadable", f"line:{reader.line_num}",
                       detail=f"CSV read stopped, the rest of the file not read: {e}")


def read_hf(f: InputFile, cfg: IngestConfig) -> Iterator[Item]:
    import datasets

    hf = f.source.hf
    saved = _is_hf_dir(f.path)
    if saved and hf.name:
        raise IngestError(f"{f.display}: a save_to_disk folder has no configs; remove hf.name={hf.name!r} "
                          "(or point the source at the dataset's repository)")
    try:
        if saved:
            ds = datasets.load_from_disk(str(f.path))
        else:  # a dataset repository: a local folder, or a name (needs the network or the HF cache)
            ds = datasets.load_dataset(str(f.path), hf.name, split=hf.split, revision=hf.revision)
    except Exception as e:  # datasets raises many types; the message is what matters
        if not saved and hf.name is None and len(configs := _config_names(f)) > 1:
            raise IngestError(f"{f.display}: the dataset has configs {configs}; pick one with hf.name (a source "
                              "per config to read several)") from e
        first = (str(e).strip().splitlines() or [""])[0]
        raise IngestError(f"{f.display}: cannot load Hugging Face dataset: {type(e).__name__}: {first}") from e
    if isinstance(ds, datasets.DatasetDict):
        if hf.split not in ds:
            raise IngestError(f"{f.display}: no split {hf.split!r}; splits are {list(ds)} (set hf.split)")
        ds = ds[hf.split]
    elif saved and "split" in hf.model_fields_set and (ds.split is None or str(ds.split) != hf.split):
        raise IngestError(f"{f.display}: the folder holds one dataset (split {ds.split}), not a split "
                          f"{hf.split!r}; remove hf.split")
    field = f.source.text_field
    if field not in ds.column_names:
        raise IngestError(f"{f.display}: no column {field!r}; columns are {ds.column_names}")
    yield from _read_columns(ds.data.to_batches(max_chunksize=1000), field, f.source.split_by, cfg)


def _config_names(f: InputFile) -> list[str]:
    """The configs of a dataset repository (local, or named where the Hub or the
    cache answers), or [] where they cannot be listed: what to tell a user whose
    source gives no hf.name, which datasets reports in lines of its own."""
    import datasets

    try:
        return list(datasets.get_dataset_config_names(str(f.path), revision=f.source.hf.revision))
    except Exception:  # noqa: BLE001 - only a better message is at stake; the load's own error is raised
        return []


READERS: dict[str, Callable[[InputFile, IngestConfig], Iterator[Item]]] = {
    "text": read_text,
    "jsonl": read_jsonl,
    "json": read_json,
    "parquet": read_parquet,
    "csv": read_csv,
    "hf": read_hf,
}


# --- the stage ---------------------------------------------------------------------------------


def doc_id(source: str, location: str) -> str:
    return hashlib.blake2b(f"{source}\x00{location}".encode(), digest_size=8).hexdigest()


def read_items(f: InputFile, cfg: IngestConfig, duplicate: Source | None = None) -> Iterator[Item]:
    """What one input gives, streamed: its documents and skips. ``duplicate``:
    the source that reads this input already."""
    if duplicate is not None:
        other_field = duplicate.text_field != f.source.text_field
        yield Skip("duplicate_path", "file", detail=f"listed by more than one source: source {duplicate.label!r} "
                   "reads it" + (f" (with text_field {duplicate.text_field!r}; documents are named by input and "
                                 "row, so a second column of one input needs a copy of it)" if other_field else ""))
        return
    if f.format != "hf" and (why := not_a_file(f.path)) is not None:
        yield Skip("not_a_file", "file", detail=why)
        return
    try:
        yield from until_damaged(READERS[f.format](f, cfg), f.path, lambda why: Skip("unreadable", "file", detail=why))
    except (PermissionError, IsADirectoryError, FileNotFoundError) as e:  # gone since it was listed: a race
        yield Skip("unreadable", "file", detail=str(e))


_WORKER: dict[str, IngestConfig] = {}


def _init_reader(cfg: IngestConfig) -> None:
    _WORKER["cfg"] = cfg


def _read_whole(f: InputFile, seen: tuple[int, int] | None) -> list[Item] | str | None:
    """A worker's task: every item of ``f`` at once; None for an input that the
    stage's own process reads itself (``seen`` is None); or, where this worker
    does not see the file the stage saw (``seen``: its size and mtime in ns
    there), a line saying so, and the stage reads it itself. On a Ray cluster
    whose nodes do not share the input's storage, a node may lack the file or
    hold another one at its path."""
    if seen is None:
        return None
    try:
        st = os.stat(f.path) if isinstance(f.path, Path) else f.path.restat()
    except OSError as e:
        return f"{f.path} is not readable on {socket.gethostname()} ({type(e).__name__})"
    if (st.st_size, st.st_mtime_ns) != seen:
        return f"{f.path} on {socket.gethostname()} is not the file the stage sees (size or modification time)"
    return list(read_items(f, _WORKER["cfg"]))


Position = tuple[int, int]  # (index of the input in the resolved files, items of it already read)


def iter_items(files: list[InputFile], cfg: IngestConfig, ex: Executor | None = None, start: Position = (0, 0)
               ) -> Iterator[tuple[Position, InputFile, Item, bool]]:
    """Every item of every input, in order, from ``start``, each with its
    position (the input's index in ``files`` and the item's index in that
    input's :func:`read_items` stream) and whether it is its input's last
    (each input is read one item ahead, never the next input). With an executor of more than one worker,
    files of at most ``worker_file_bytes`` (a compressed one counts
    :data:`COMPRESSED_SIZE_FACTOR` times its size) are read whole by the workers, a
    window of them ahead; larger files and datasets are streamed here, in their
    turn, so memory stays bounded. A worker that does not see a file as this
    process does (a Ray node without the input's storage) hands it back and it
    is read here; one warning line counts them. The items are the same either way.

    Starting at ``(i, n)`` reads input ``i`` again from its beginning and drops
    its first ``n`` items (a worker reads a small file whole and the stage drops
    them; a large file or a dataset is streamed past them here): the readers
    have no seek that is sure to give the same items, and re-reading one input
    up to the position is cheap beside the shards a resumed run keeps."""
    seen: dict[tuple, Source] = {}  # each input's first reader
    plan = []
    for f in files:
        plan.append((f, seen.get(f.key)))
        seen.setdefault(f.key, f.source)
    first, skip = start

    def positioned(i: int, f: InputFile, items: Iterable[Item]) -> Iterator[tuple[Position, InputFile, Item, bool]]:
        numbered = enumerate(items)
        if i == first and skip:
            numbered = itertools.islice(numbered, skip, None)
        held = next(numbered, None)
        while held is not None:
            following = next(numbered, None)
            yield (i, held[0]), f, held[1], following is None
            held = following

    if ex is None or ex.workers == 1:
        for i in range(first, len(plan)):
            f, dup = plan[i]
            yield from positioned(i, f, read_items(f, cfg, dup))
        return

    def stat_of(f: InputFile, dup: Source | None) -> tuple[int, int] | None:
        """The size and mtime of a file for a worker to read, or None."""
        if dup is not None or f.format == "hf" or not f.path.is_file():
            return None
        st = f.path.stat()
        return (st.st_size, st.st_mtime_ns) if _input_bytes(f) <= cfg.worker_file_bytes else None

    elsewhere: list[str] = []
    results = ex.map(_read_whole, ((f, stat_of(f, dup)) for f, dup in plan[first:]))
    try:
        for i, (f, dup), items in zip(itertools.count(first), plan[first:], results):
            if isinstance(items, str):
                elsewhere.append(items)
                items = None
            yield from positioned(i, f, read_items(f, cfg, dup) if items is None else items)
    finally:
        if elsewhere:
            log.warning("%d input file(s) were read by the stage itself, not by the workers, which do not see them "
                        "as it does (for example %s); put the input on storage every node mounts at the same path "
                        "to spread the reading", len(elsewhere), elsewhere[0])


# --- the output: shards committed one by one, resumed after a kill ---------------------------

# Params that never change the output (tested: the same bytes under every executor,
# worker count and worker_file_bytes), so a rerun with another of them resumes.
OUTPUT_NEUTRAL = {"executor", "num_workers", "worker_file_bytes"}


def inputs_digest(files: list[InputFile]) -> str:
    """What the fingerprint knows of the input without reading it: the path, size
    and modification time of every file read (each file of a dataset folder),
    and the name of a dataset that ``load_dataset`` finds by name alone."""
    paths: list[Path] = []
    named: list[str] = []
    for f in files:
        if f.path.is_file():
            paths.append(f.path)
        elif f.path.is_dir() and f.format == "hf":
            paths.extend(sorted(p for p in f.path.rglob("*") if p.is_file()))
        else:  # a dataset named for load_dataset, or an entry skipped as not a file
            named.append(f.display)
    return resume.digest_json({"files": resume.files_digest(paths), "named": named})


def ingest_fingerprint(cfg: IngestConfig, files: list[InputFile]) -> str:
    return resume.fingerprint(
        "ingest", params=cfg.model_dump(mode="json", exclude=OUTPUT_NEUTRAL),
        inputs={"files": inputs_digest(files)},
        code=resume.code_digest(sys.modules[__name__], accounting, compressed, docs_format, remote, resume))


class _Shard:
    """What one shard holds while it is written: its rows not yet flushed, and its
    counts, which its record keeps."""

    def __init__(self, per_reason: int):
        self.ledger = Ledger(per_reason=per_reason)
        self.docs = self.bytes = 0
        self.per_source: dict[str, int] = {}
        self.skipped_per_source: dict[str, dict[str, int]] = {}
        self.rows: dict[str, list] = {k: [] for k in SCHEMA.names}
        self.rows_bytes = 0  # text bytes of the rows not yet flushed

    def add(self, f: InputFile, item: Doc, size: int) -> None:
        self.rows["id"].append(doc_id(f.display, item.location))
        self.rows["text"].append(item.text)
        self.rows["source"].append(f.display)
        self.rows["location"].append(item.location)
        self.rows["chunk"].append(item.chunk)
        self.rows["offset"].append(item.offset)
        self.rows["source_name"].append(f.source.label)
        self.rows["split"].append(None if f.source.split == "auto" else f.source.split)
        self.docs += 1
        self.bytes += size
        self.rows_bytes += size
        self.per_source[f.source.label] = self.per_source.get(f.source.label, 0) + 1

    def skip(self, f: InputFile, item: Skip) -> None:
        self.ledger.record(item.reason, f.display, item.location, item.text, item.detail, n=item.n)
        reasons = self.skipped_per_source.setdefault(f.source.label, {})
        reasons[item.reason] = reasons.get(item.reason, 0) + item.n

    def flush(self, writer: ShardedParquetWriter) -> None:
        if self.rows["id"]:
            writer.write(pa.table(self.rows, schema=SCHEMA))
            for v in self.rows.values():
                v.clear()
            self.rows_bytes = 0

    def seal(self, writer: ShardedParquetWriter, end: Position, capped: bool, last: bool,
             rest_unread: bool = False) -> dict:
        """Commit the shard; ``rest_unread``: max_bytes stopped the reading part-way
        through the file it ends in (recorded only then)."""
        self.flush(writer)
        return writer.seal({"docs": self.docs, "bytes": self.bytes, "per_source": self.per_source,
                            "skipped_per_source": self.skipped_per_source,
                            "end": list(end), "capped": capped, "last": last, "ledger": self.ledger.to_dict(),
                            **({"rest_unread": True} if rest_unread else {})})


class _Totals:
    """The run's counts: the committed shards' records, merged in order, give the
    counts and the quarantine of one uninterrupted run."""

    def __init__(self, per_reason: int):
        self.per_reason = per_reason
        self.ledger = Ledger(per_reason=per_reason)
        self.docs = self.bytes = self.shards = 0
        self.per_source: dict[str, int] = {}
        self.skipped_per_source: dict[str, dict[str, int]] = {}
        self.capped = self.rest_unread = False

    def add(self, rec: dict) -> None:
        self.ledger.merge(Ledger.from_dict(rec["ledger"], per_reason=self.per_reason))
        self.docs += rec["docs"]
        self.bytes += rec["bytes"]
        for name, n in rec["per_source"].items():
            self.per_source[name] = self.per_source.get(name, 0) + n
        for name, reasons in rec["skipped_per_source"].items():
            mine = self.skipped_per_source.setdefault(name, {})
            for reason, n in reasons.items():
                mine[reason] = mine.get(reason, 0) + n
        self.capped, self.rest_unread = rec["capped"], rec.get("rest_unread", False)
        self.shards += 1


def run_ingest(cfg: IngestConfig, out_dir: str | Path, quarantine_path: str | Path,
               report_path: str | Path | None = None) -> dict:
    """Read every source into the documents folder ``out_dir`` (see
    :mod:`pipeline.data.docs`) and a sample of the skipped records into
    ``quarantine_path``.

    The documents are cut into shards at document boundaries: a shard ends
    before the first document that finds it holding ``shard_bytes`` of text.
    Each shard is committed with a record (:mod:`pipeline.data.resume`) of where
    in the input it ends, its counts, its ledger and whether ``max_bytes``
    stopped the reading in it. A rerun keeps the shards committed under the
    same fingerprint (input files, params other than the executor's, code) and
    replays their records; it writes a missing or invalid shard by reading from
    the end of the one before, so its output, quarantine and report are those of
    an uninterrupted run.

    Returns the metrics: docs, bytes, files, skipped (total), shards and
    shards_resumed. The report, written to ``report_path`` when given, holds
    ``skipped`` by reason, ``capped``, ``docs_per_source``,
    ``skipped_per_source`` (by reason) and ``unread_files_per_source``.
    Raises IngestError when no document was read."""
    files = resolve_sources(cfg)
    shard_log = ShardLog(out_dir, ingest_fingerprint(cfg, files))
    shard_log.open()
    totals = _Totals(cfg.quarantine_per_reason)
    sizes = [_input_bytes(f) for f in files]
    bar_total = min(sum(sizes), cfg.max_bytes) if cfg.max_bytes else sum(sizes)
    k, start, done, resumed = 0, (0, 0), False, 0

    with contextlib.ExitStack() as stack:
        bar = _FileBar(stack.enter_context(progress(total=bar_total, unit="B", unit_scale=True, desc="ingest")),
                       sizes)
        writer = ShardedParquetWriter(shard_log, SCHEMA, cfg.row_group_docs)
        stack.callback(writer.abort)
        ex: Executor | None = None
        while not done:
            rec = shard_log.committed(k)
            if rec is not None:  # kept from an earlier run: replay its record
                totals.add(rec)
                bar.reach(rec["end"][0])
                k, start, done, resumed = k + 1, (rec["end"][0], rec["end"][1]), rec["last"], resumed + 1
                continue
            if ex is None:
                ex = stack.enter_context(open_executor(cfg.executor, _init_reader, (cfg,),
                                                       max_workers=len(files), desc="ingest"))
            k, start, done = _write_shards(cfg, files, ex, writer, totals, bar, k, start)
        bar.reach(len(files))
    if resumed:
        log.info("resumed: %d of %d shards kept from an earlier run", resumed, totals.shards)
    unread = _unread_files(cfg, files, start, totals.rest_unread) if totals.capped else {}
    totals.ledger.write(quarantine_path)
    if totals.docs == 0:
        raise IngestError(
            f"ingest produced no documents from {len(files)} file(s); skipped: {totals.ledger.as_dict()}"
            f"{_examples(totals.ledger)} (see {quarantine_path})"
        )
    _say_skips(cfg, totals, unread, quarantine_path, report_path)
    if report_path is not None:
        partly = {"partly_read_file": {"path": files[start[0]].display, "source": files[start[0]].source.label,
                                       "items_read": start[1]}} if totals.rest_unread else {}
        write_json(report_path, {"skipped": totals.ledger.as_dict(), "capped": totals.capped,
                                 "docs_per_source": totals.per_source, "skipped_per_source": totals.skipped_per_source,
                                 "unread_files_per_source": unread, **partly})
    shard_log.finish(totals.shards, {"format": docs_format.FORMAT, "rows": totals.docs, "bytes": totals.bytes,
                                     "columns": SCHEMA.names})
    return {"docs": totals.docs, "bytes": totals.bytes, "files": len(files), "unread_files": sum(unread.values()),
            "skipped": totals.ledger.total, "shards": totals.shards, "shards_resumed": resumed}


def _unread_files(cfg: IngestConfig, files: list[InputFile], end: Position, rest_unread: bool = False
                  ) -> dict[str, int]:
    """The input files ``max_bytes`` left unread (every one after the file the cap
    stopped in), by source name, and a line saying so, which also says when the
    cap stopped part-way through a file (``rest_unread``: one large JSONL file
    is read in part, and no file is left unread); a warning for each source
    of which no file was read, since its documents are simply missing downstream."""
    listed: dict[str, int] = {}
    unread: dict[str, int] = {}
    for i, f in enumerate(files):
        listed[f.source.label] = listed.get(f.source.label, 0) + 1
        if i > end[0]:
            unread[f.source.label] = unread.get(f.source.label, 0) + 1
    where = files[min(end[0], len(files) - 1)]
    counts = "; ".join(f"{name}: {n:,} of {listed[name]:,}" for name, n in unread.items())
    partly = f" after its first {end[1]:,} item(s), so the rest of that file was not read" if rest_unread else ""
    log.info("ingest.max_bytes (%s bytes) reached in %s (source %r)%s: %s of %s input files not read%s; "
             "set ingest.max_bytes: null to read everything", f"{cfg.max_bytes:,}", where.display,
             where.source.label, partly, f"{sum(unread.values()):,}", f"{len(files):,}",
             f" ({counts})" if counts else "")
    for name, n in unread.items():
        if n == listed[name]:
            log.warning("source %r was not read at all: ingest.max_bytes (%s bytes) was reached before its %s "
                        "file(s); raise ingest.max_bytes, or set it to null", name, f"{cfg.max_bytes:,}",
                        f"{n:,}")
    return unread


def _examples(ledger: Ledger, reasons: int = 3) -> str:
    """"; e.g. <reason>: <where> (<detail>)" for the first quarantined record of
    each of the most frequent ``reasons``: the error that no document was kept
    says why in its one line, not only in the quarantine file."""
    first: dict[str, dict] = {}
    for sample in ledger.samples:
        first.setdefault(sample["reason"], sample)
    said = [f"{r}: {' '.join(filter(None, (first[r]['source'], first[r]['location'])))}"
            + (f" ({first[r]['detail']})" if first[r].get("detail") else "")
            for r, _ in ledger.counts.most_common() if r in first][:reasons]
    return f"; e.g. {'; '.join(said)}" if said else ""


def _say_skips(cfg: IngestConfig, totals: _Totals, unread: dict[str, int], quarantine_path: str | Path,
               report_path: str | Path | None) -> None:
    """One line with the skipped records by reason, and a warning for each
    source that gave no document although it was read (a wrong ``text_field``,
    a damaged file, files another source already read): its data is missing
    downstream, and the counts alone would not say so."""
    if totals.ledger.total:
        reasons = accounting.counts_text(totals.ledger.counts)
        where = f"; by source in {report_path}" if report_path is not None else ""
        log.info("skipped %s record(s): %s (samples in %s%s)", f"{totals.ledger.total:,}", reasons, quarantine_path,
                 where)
    for src in cfg.sources:
        skipped = totals.skipped_per_source.get(src.label, {})
        if totals.per_source.get(src.label) or (src.label in unread and not skipped):  # never reached: warned
            continue
        log.warning("source %r gave no documents; skipped: %s", src.label,
                    accounting.counts_text(skipped) or "nothing read")


def _input_bytes(f: InputFile) -> int:
    """The bytes of an input on disk: a file's, a saved dataset folder's files'; 0
    for a dataset named for load_dataset (its size is not known here). A
    compressed file counts COMPRESSED_SIZE_FACTOR times its size, about the
    text it holds, so that the bar moves through it at the pace of its text."""
    if f.path.is_file():
        return f.path.stat().st_size * (COMPRESSED_SIZE_FACTOR if compression_of(f.path) else 1)
    if f.path.is_dir() and f.format == "hf":
        return sum(p.stat().st_size for p in f.path.rglob("*") if p.is_file())
    return 0


class _FileBar:
    """The stage's progress bar, in bytes of input: a document advances it by its
    text's bytes, but by no more than its file's size (:func:`_input_bytes`;
    compressed Parquet holds more text than bytes); a file read to its end (skips, markup, a
    format's overhead) brings the bar to its whole size."""

    def __init__(self, bar: Any, sizes: list[int]):
        self.bar, self.left, self.at = bar, list(sizes), 0

    def read(self, index: int, nbytes: int) -> None:
        """A document of input ``index`` with ``nbytes`` of text."""
        self.reach(index)
        step = min(nbytes, self.left[index])
        self.left[index] -= step
        self._update(step)

    def reach(self, index: int) -> None:
        """Every input before ``index`` is read."""
        while self.at < min(index, len(self.left)):
            self._update(self.left[self.at])
            self.left[self.at] = 0
            self.at += 1

    def _update(self, n: int) -> None:
        if self.bar.total is not None:
            n = min(n, self.bar.total - self.bar.n)  # max_bytes caps the total
        if n > 0:
            self.bar.update(n)


def _write_shards(cfg: IngestConfig, files: list[InputFile], ex: Executor, writer: ShardedParquetWriter,
                  totals: _Totals, bar: _FileBar, k: int, start: Position) -> tuple[int, Position, bool]:
    """Write shard ``k`` and the ones after it, reading from ``start``, until the
    input ends, ``max_bytes`` is reached, or the next shard is already
    committed. Returns (the next shard's index, where it starts, whether the
    output is complete)."""
    shard = _Shard(cfg.quarantine_per_reason)
    writer.start(k)
    with contextlib.closing(iter_items(files, cfg, ex, start)) as items:
        for pos, f, item, last_of_file in items:
            if isinstance(item, Skip):
                shard.skip(f, item)
                continue
            if shard.bytes >= cfg.shard_bytes:  # full: this document starts the next shard
                totals.add(shard.seal(writer, end=pos, capped=False, last=False))
                k += 1
                if writer.log.committed(k) is not None:
                    return k, pos, False
                shard = _Shard(cfg.quarantine_per_reason)
                writer.start(k)
            size = len(item.text.encode("utf-8", "surrogatepass"))
            shard.add(f, item, size)
            bar.read(pos[0], size)
            if len(shard.rows["id"]) >= cfg.row_group_docs or shard.rows_bytes >= cfg.row_group_bytes:
                shard.flush(writer)
            if cfg.max_bytes and totals.bytes + shard.bytes >= cfg.max_bytes:
                end = (pos[0], pos[1] + 1)
                totals.add(shard.seal(writer, end=end, capped=True, last=True, rest_unread=not last_of_file))
                return k + 1, end, True
    if shard.docs == 0:  # nothing read at all: no shard to commit (the stage raises)
        writer.abort()
        totals.ledger.merge(shard.ledger)
        return k, start, True
    totals.add(shard.seal(writer, end=(len(files), 0), capped=False, last=True))
    return k + 1, (len(files), 0), True
