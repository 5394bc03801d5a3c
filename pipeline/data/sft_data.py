"""SFT data: chat sources -> tokenized, loss-masked, packed Arrow shards.

Input: ``SFTDataConfig.sources``, each ``{path, format}``. ``path`` is a file, a
directory (its ``*.json``, ``*.jsonl`` and ``*.ndjson`` files, recursively, dot-files
left out) or a glob; ``.jsonl``/``.ndjson`` files hold one record per line, ``.json``
files an array of records (or one record, or an object wrapping one array of
records, ``{"data": [...]}``; a ``.json`` file of one record a line is read as
JSON Lines, as ingest reads it). ``path`` may instead name a built-in
dataset, ``builtin:<name>`` (:data:`BUILTIN_DATASETS`; ``stdlib-docstrings`` is
:mod:`pipeline.data.stdlib_qa`). ``format`` is one of
:data:`pipeline.data.chat.FORMAT_NAMES`; ``auto`` detects it per record.

Template. ``chat_template`` is ``auto`` (the tokenizer's own chat template when it
brings one, as an adopted Hugging Face tokenizer does, else ChatML), ``chatml``,
or the path of a ``.jinja`` file. Conversations are rendered and labelled by
:mod:`pipeline.data.chat_template`: only what the assistant writes is trained,
its closing end-of-turn token included. The template is tried on probe
conversations before any record is read; one whose assistant spans cannot be
located stops the build with one line. ``template_date`` is the day templates
read as today (Llama 3.x writes it into every system block), pinned so that
the data is reproducible.

Accounting. Every record read is either an example in ``train`` or ``val`` or a
skip counted by reason and sampled into the quarantine JSONL (source, location,
reason, detail, the record): the converter reasons of :data:`pipeline.data.chat.REASONS`,
plus ``malformed_json``, ``non_utf8``, ``unreadable`` (the rest of a compressed
file whose data is damaged or cut short), ``duplicate`` (a conversation identical to
an earlier one; dropping it keeps copies out of both splits), ``too_long``, and
the template's reasons of :data:`pipeline.data.chat_template.TEMPLATE_REASONS`
(a conversation the template refuses or rewrites, or whose text does not
survive encode/decode).
``examples_in == train + val + sum(skipped)`` is checked. ``max_examples`` caps the
records read from each source (its first ones in the source's order).

Split. An example is in ``val`` iff ``h(seed, key) < val_fraction · 2**64``, where
``key`` is the hex BLAKE2b-128 digest of the conversation (roles and contents) and
``h`` the 64-bit BLAKE2b digest of ``f"{seed}\\0{key}"`` (person ``sft-spl``). So a
conversation always lands in the same split, wherever it comes from. When no
example hashes into ``val`` the one with the smallest ``h`` is moved there, and
when all do the one with the largest goes to ``train`` (counted in ``forced``).

Length. An example of ``n`` tokens fits a row when ``n <= row_len = seq_len + 1``
(its last token, e.g. ChatML's ``\\n`` after ``<|im_end|>``, is only ever a target). A longer
one is dropped (``overlong: drop``, reason ``too_long``) or cut to ``row_len``
tokens (``overlong: truncate``, counted as ``truncated``); a cut that leaves no
labelled token past the first position is dropped as ``too_long`` as well.

Output. Under ``out_dir``, in the packed-row format of
:mod:`pipeline.data.shards` (format ``pipeline.sft_data/1``), at most
``shard_rows`` rows per shard, with the ``labels`` column: the token id where
the loss is taken, -100 elsewhere (training uses ``input_ids[:-1]`` ->
``labels[1:]``). Every example starts a segment in ``doc_starts``; the padding
(the tokenizer's ``pad_id``, label -100) that fills the rest of a row is a segment of its own.
The schema metadata adds ``pad_id`` and ``ignore_index``.

With ``pack: true`` a row holds as many whole examples as fit (best-fit
decreasing by length; an example never spans rows), so with document masking no
example attends to another. With ``pack: false`` a row holds one example. Rows
are then put in a seeded random order, so that any prefix of ``val`` (which
evaluation reads) is a fair sample. ``label`` at an example's first position is
always -100, so no example is trained to follow its row-neighbour.

The manifest's own fields are ``chat_template`` (the Jinja text),
``chat_template_name`` (``chatml``, ``tokenizer (<source>)`` or the file),
``template_date``, ``end_of_turn_ids`` (the ids that close assistant turns),
``stop_ids`` (those and the tokenizer's eos ids: where generation from a model
trained on this data should stop), ``pack``,
``overlong``, ``seed``, ``val_fraction``, ``python`` (the version whose stdlib a
built-in dataset was derived from), ``sources`` (per source: path, format,
records, examples, capped) and ``forced``; each split lists ``examples``,
``truncated``, ``rows``, ``tokens`` (example tokens, padding not counted),
``label_tokens`` and ``pad_tokens``.

Examples are held in memory as token arrays between reading and packing: SFT
sets are small, and packing and the tiny-split rule need them all.
"""

from __future__ import annotations

import bisect
import codecs
import datetime as dt
import fcntl
import glob
import hashlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import pyarrow as pa
from pydantic import ConfigDict, Field, field_validator, model_validator

from pipeline.config import ParamsModel
from pipeline.data import chat, chat_template, compressed, remote, resume, shards, stdlib_qa
from pipeline.data.accounting import Ledger, counts_text
from pipeline.data.chat import IGNORE_INDEX, ChatFormatError, to_messages
from pipeline.data.chat_template import (
    DEFAULT_DATE,
    TemplateSkip,
    check_template,
    encode_conversation,
    load_chat_template,
    stop_ids,
)
from pipeline.data.compressed import COMPRESSIONS, format_suffix, open_input, until_damaged
from pipeline.data.remote import RemotePath
from pipeline.data.shards import MANIFEST, SPLITS, ShardWriter, clear_outputs, row_schema, split_counts, write_manifest
from pipeline.data.tokenizer import id_space, load_specials, open_tokenizer
from pipeline.errors import StageError
from pipeline.files import read_json, sha256_file, write_json
from pipeline.progress import progress

log = logging.getLogger("pipeline.data.sft_data")

FORMAT = "pipeline.sft_data/1"
BUILTIN_PREFIX = "builtin:"
SUFFIX_KINDS: dict[str, str] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}

ChatFormatName = Literal["auto", "messages", "sharegpt", "alpaca"]


# --- built-in datasets -------------------------------------------------------------------------

# name -> generator of (location, record in the ``messages`` format).
BUILTIN_DATASETS: dict[str, Callable[[], Iterator[tuple[str, dict]]]] = {
    "stdlib-docstrings": stdlib_qa.records,
}


# --- config ------------------------------------------------------------------------------------


class SFTSource(ParamsModel):
    path: str = Field(min_length=1, description="a file, directory or glob of .json/.jsonl, here or in an object "
                      "store (s3://, gs://), or builtin:<name>")
    format: ChatFormatName = Field("auto", description="record format; auto detects it per record")

    @field_validator("path")
    @classmethod
    def _readable_path(cls, v: str) -> str:
        remote.check_url(v)
        if v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX):] not in BUILTIN_DATASETS:
            raise ValueError("unknown built-in dataset; known: "
                             + ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_DATASETS))
        return v

    @model_validator(mode="after")
    def _builtin_format(self) -> "SFTSource":
        if self.path.startswith(BUILTIN_PREFIX) and self.format not in ("auto", "messages"):
            raise ValueError(f"built-in datasets are in the messages format, not {self.format!r}")
        return self


class SFTDataConfig(ParamsModel):
    """The data part of the sft stage's config (embeddable: frozen, no extra keys)."""

    model_config = ConfigDict(validate_default=True)

    sources: list[SFTSource] = Field(
        default_factory=lambda: [SFTSource(path=BUILTIN_PREFIX + "stdlib-docstrings")], min_length=1,
        description="list of {path, format}: JSON/JSONL files, dirs or globs, or builtin:<name>")
    seq_len: int = Field(256, ge=8, le=1_048_576, description="tokens a model sees per row; rows hold seq_len + 1")
    pack: bool = Field(True, description="several whole examples per row (document-masked); false: one per row")
    overlong: Literal["drop", "truncate"] = Field(
        "drop",
        description="an example longer than a row: drop, or truncate to the row (kept only if a label survives)")
    val_fraction: float = Field(0.05, gt=0.0, le=0.5, description="share of examples in the val split")
    seed: int = Field(0, ge=0, description="chooses the split and the row order")
    max_examples: int | None = Field(None, ge=1, description="records read per source, first ones; null = all")
    quarantine_per_reason: int = Field(100, ge=0, description="skipped records kept verbatim per reason")
    shard_rows: int = Field(16_384, ge=1, description="rows per Arrow shard file")
    chat_template: str = Field("auto", min_length=1, description="auto (the tokenizer's own template, else ChatML), "
                               "chatml, or the path of a .jinja chat template")
    template_date: dt.date = Field(DEFAULT_DATE, description="the date chat templates read as today (strftime_now), "
                                   "YYYY-MM-DD, pinned so that the data is reproducible")

    @field_validator("template_date", mode="before")
    @classmethod
    def _date_not_number(cls, v: Any) -> Any:
        # pydantic reads a number as Unix time: 0 would be 1970-01-01, in silence.
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            raise ValueError("a date is expected as YYYY-MM-DD (quoted: DVC rejects YAML dates), not a number")
        return v


class SFTDataError(StageError):
    """SFT data cannot be built: a missing source or tokenizer, or an empty split."""


# --- reading sources ---------------------------------------------------------------------------


@dataclass
class Raw:
    """One record read from a source, or the reason it could not be read."""

    location: str
    record: Any = None
    reason: str = ""
    detail: str = ""
    text: str | None = None


def _display(p: Path | RemotePath) -> str:
    if isinstance(p, RemotePath):
        return str(p)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def resolve_source(src: SFTSource, index: int) -> list[Path | RemotePath]:
    """The files of one source, sorted (empty for a built-in), on disk or in an
    object store. Raises SFTDataError naming ``sft.data.sources.<index>.path`` (the
    params key, as ingest's errors name theirs) when the path matches nothing usable."""
    where = f"sft.data.sources.{index}.path"
    if src.path.startswith(BUILTIN_PREFIX):
        return []
    p = Path(src.path)
    if remote.scheme_of(src.path):
        root, files = remote.listed(src.path, where, SFTDataError)
        if files != [RemotePath(src.path)]:  # a glob or a folder leaves hidden names out, as below
            files = [x for x in files if not x.hidden_below(root)]
            if not glob.has_magic(src.path):  # a folder keeps its chat files, as below
                files = [x for x in files if format_suffix(x) in SUFFIX_KINDS]
    elif glob.has_magic(src.path):
        files = sorted(Path(m) for m in glob.glob(src.path, recursive=True) if Path(m).is_file())
    elif p.is_dir():
        files = sorted(x for x in p.rglob("*") if x.is_file() and format_suffix(x) in SUFFIX_KINDS
                       and not any(part.startswith(".") for part in x.relative_to(p).parts))
    elif p.is_file():
        files = [p]
    else:
        raise SFTDataError(f"{where}: no such file or directory: {src.path!r}")
    if not files:
        raise SFTDataError(f"{where}: {src.path!r} matched no .json/.jsonl/.ndjson files")
    bad = [f for f in files if format_suffix(f) not in SUFFIX_KINDS]
    if bad:
        raise SFTDataError(f"{where}: {str(bad[0])!r} is not .json, .jsonl or .ndjson (or one of them compressed: "
                           f"{', '.join(COMPRESSIONS)})")
    return files


# What json.loads raises for text it cannot turn into a value: JSONDecodeError (a ValueError), a plain
# ValueError for an integer of more than sys.get_int_max_str_digits() digits, RecursionError for nesting
# too deep to parse. Each is a malformed_json skip of that record, not the end of the build.
_UNPARSABLE = (ValueError, RecursionError)


def _read_jsonl(path: Path) -> Iterator[Raw]:
    # As ingest reads JSON Lines: a byte-order mark before the first record is dropped, and a
    # line's "\r\n" is JSON whitespace.
    with open_input(path) as fh:
        for n, raw in enumerate(fh, 1):
            loc = f"line:{n}"
            if n == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark some editors write
            if not raw.strip():
                continue  # blank lines carry no record
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Raw(loc, reason="non_utf8", detail=f"invalid UTF-8 at byte {e.start} of the line")
                continue
            try:
                yield Raw(loc, json.loads(line))
            except _UNPARSABLE as e:
                yield Raw(loc, reason="malformed_json", detail=str(e), text=line)


def _read_json(path: Path) -> Iterator[Raw]:
    try:
        with open_input(path) as fh:
            data = json.loads(fh.read().decode("utf-8-sig"))  # a byte-order mark is not the document's
    except UnicodeDecodeError as e:
        yield Raw("file", reason="non_utf8", detail=f"invalid UTF-8 at byte {e.start}")
        return
    except _UNPARSABLE as e:
        if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data":
            # a value and more after it: one record a line (JSON Lines under a .json name, as many chat
            # sets ship), read as ingest reads such a file
            yield from _read_jsonl(path)
            return
        yield Raw("file", reason="malformed_json", detail=str(e))
        return
    if isinstance(data, dict) and not any(f.key in data for f in chat.FORMATS.values()):
        # not a record but a wrapper, {"data": [...], "version": ...}: its one list of objects, as ingest reads it
        lists = [v for v in data.values() if isinstance(v, list) and any(isinstance(x, dict) for x in v)]
        data = lists[0] if len(lists) == 1 else data
    if isinstance(data, list):
        for i, rec in enumerate(data):
            yield Raw(f"item:{i}", rec)
    else:
        yield Raw("file", data)  # one record; to_messages rejects a non-object


READERS: dict[str, Callable[[Path | RemotePath], Iterator[Raw]]] = {"jsonl": _read_jsonl, "json": _read_json}


def iter_source(src: SFTSource, files: list[Path | RemotePath]) -> Iterator[tuple[str, Raw]]:
    """``(display name, raw record)`` for every record of one source, in order."""
    if src.path.startswith(BUILTIN_PREFIX):
        for loc, rec in BUILTIN_DATASETS[src.path[len(BUILTIN_PREFIX):]]():
            yield src.path, Raw(loc, rec)
        return
    for f in files:
        name = _display(f)
        for raw in until_damaged(READERS[SUFFIX_KINDS[format_suffix(f)]](f), f,
                                 lambda why: Raw("file", reason="unreadable", detail=why), unit="record"):
            yield name, raw


# --- examples, split, packing ------------------------------------------------------------------


@dataclass
class Example:
    ids: np.ndarray  # (n,) int32
    labels: np.ndarray  # (n,) int32, IGNORE_INDEX where no loss
    h: int  # split hash
    truncated: bool = False


def _digest(text: str, person: bytes, size: int = 8) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size, person=person).digest()


def conversation_key(messages: list[dict]) -> str:
    """Content identity of a conversation: the same roles, texts and weights give the same key
    (a message of weight 1, the default, is keyed as one without a weight)."""
    canon = json.dumps([[m["role"], m["content"], *([0] if m.get("weight", 1) == 0 else [])] for m in messages],
                       ensure_ascii=False)
    return _digest(canon, b"sft-key", 16).hex()


def split_hash(seed: int, key: str) -> int:
    return int.from_bytes(_digest(f"{seed}\x00{key}", b"sft-spl"), "big")


def pack_examples(lengths: list[int], row_len: int, pack: bool) -> list[list[int]]:
    """Assign examples (by index) to rows: each row's example indices in order.
    ``pack=False``: one per row. ``pack=True``: best-fit decreasing, ties broken by
    index, so the result is deterministic. Every length must be ``<= row_len``."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (space left, row index)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            space, r = free.pop(k)
        else:
            space, r = row_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, r))
    return rows


def build_rows(examples: list[Example], row_len: int, pack: bool, pad_id: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """``(input_ids (rows, row_len), labels (rows, row_len), doc_starts per row)``,
    rows in a seeded random order (see the module docstring)."""
    assignment = pack_examples([len(e.ids) for e in examples], row_len, pack)
    order = np.random.default_rng([seed, len(assignment)]).permutation(len(assignment))
    ids = np.full((len(assignment), row_len), pad_id, np.int32)
    labels = np.full((len(assignment), row_len), IGNORE_INDEX, np.int32)
    starts: list[list[int]] = []
    for r, k in enumerate(order):
        pos, row_starts = 0, []
        for i in assignment[k]:
            e = examples[i]
            ids[r, pos:pos + len(e.ids)] = e.ids
            labels[r, pos:pos + len(e.ids)] = e.labels
            row_starts.append(pos)
            pos += len(e.ids)
        if pos < row_len:
            row_starts.append(pos)  # the padding is a segment of its own
        starts.append(row_starts)
    return ids, labels, starts


def sft_schema(row_len: int, pad_id: int) -> pa.Schema:
    return row_schema(FORMAT, row_len, labels=True,
                      metadata={"pad_id": str(pad_id), "ignore_index": str(IGNORE_INDEX)})


def write_split(out_dir: Path, split: str, examples: list[Example], cfg: SFTDataConfig, pad_id: int) -> dict:
    """Pack one split and write its shards; return its manifest entry."""
    row_len = cfg.seq_len + 1
    ids, labels, starts = build_rows(examples, row_len, cfg.pack, pad_id, cfg.seed)
    start_offsets = np.cumsum([0] + [len(st) for st in starts])
    start_values = np.fromiter((p for st in starts for p in st), np.int32, count=int(start_offsets[-1]))
    writer = ShardWriter(out_dir, split, sft_schema(row_len, pad_id))
    for lo in range(0, len(ids), cfg.shard_rows):
        hi = min(lo + cfg.shard_rows, len(ids))
        writer.write(ids[lo:hi], start_offsets[lo:hi + 1], start_values, labels[lo:hi])
    tokens = sum(len(e.ids) for e in examples)
    label_tokens = int((labels != IGNORE_INDEX).sum())
    if label_tokens != sum(int((e.labels != IGNORE_INDEX).sum()) for e in examples):
        raise AssertionError(f"{split}: packing lost or overlapped labelled tokens")
    return {
        "examples": len(examples),
        "truncated": sum(e.truncated for e in examples),
        "rows": len(ids),
        "tokens": tokens,
        "label_tokens": label_tokens,
        "pad_tokens": ids.size - tokens,
        "shards": writer.shards,
    }


def _force_nonempty(splits: dict[str, list[Example]]) -> int:
    """Tiny sets: move one example so that neither split is empty (module docstring)."""
    train, val = splits["train"], splits["val"]
    if not val and len(train) >= 2:
        k = min(range(len(train)), key=lambda i: train[i].h)
        val.append(train.pop(k))
        return 1
    if not train and len(val) >= 2:
        k = max(range(len(val)), key=lambda i: val[i].h)
        train.append(val.pop(k))
        return 1
    return 0


def build_sft_data(cfg: SFTDataConfig, tokenizer_path: str | Path, out_dir: str | Path,
                   quarantine_path: str | Path) -> dict:
    """Read ``cfg.sources``, convert, encode with the chat template
    (:func:`pipeline.data.chat_template.encode_conversation`), split, pack and write shards and manifest under ``out_dir`` (format in the
    module docstring) and the quarantine sample to ``quarantine_path``. Stale
    shards of an earlier run are removed first, from ``train/`` and ``val/``
    only (another folder, a user's copy, is left and named in a warning); on
    failure no manifest is left.

    Returns metrics: examples_in, train/val {examples, truncated, rows, tokens,
    label_tokens, pad_tokens, shards (count)}, skipped {reason: n}, truncated,
    forced, fill (share of row positions that are example tokens), sources
    {path: {records, examples, capped}}. No timings: the metrics are data/sft's
    report.json, whose DVC hash should change only with the data.
    Raises SFTDataError on a missing source path or tokenizer (before any
    reading), or when the examples kept cannot fill both splits;
    ChatTemplateError (one line) for a chat template that cannot be used.
    """
    t0 = time.perf_counter()
    tokenizer_path, out_dir = Path(tokenizer_path), Path(out_dir)
    tok, special_ids = open_tokenizer(tokenizer_path, SFTDataError)
    specials = load_specials(tokenizer_path)
    template = load_chat_template(cfg.chat_template, tokenizer_path, tok, cfg.template_date)
    end_of_turn = check_template(tok, template)
    stops = stop_ids(tok, template, specials.eos_ids)
    if not set(end_of_turn) <= set(specials.eos_ids):
        log.warning("chat template %s closes assistant turns with id(s) %s, which are not among the tokenizer's "
                    "eos ids %s: generation must stop at them too (manifest stop_ids)", template.name,
                    list(end_of_turn), list(specials.eos_ids))
    files = [resolve_source(src, i) for i, src in enumerate(cfg.sources)]
    clear_outputs(out_dir, SPLITS)
    row_len = cfg.seq_len + 1
    threshold = int(cfg.val_fraction * 2**64)
    ledger = Ledger(per_reason=cfg.quarantine_per_reason)
    splits: dict[str, list[Example]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    per_source: list[dict] = []
    examples_in = 0

    bar = progress(desc="sft data", unit="rec")
    for src, src_files in zip(cfg.sources, files):
        info = {"path": src.path, "format": src.format, "records": 0, "examples": 0, "capped": False}
        per_source.append(info)
        for name, raw in iter_source(src, src_files):
            bar.update(1)
            if cfg.max_examples is not None and info["records"] >= cfg.max_examples:
                info["capped"] = True
                break
            info["records"] += 1
            examples_in += 1
            if raw.reason:
                ledger.record(raw.reason, name, raw.location, raw.text, raw.detail)
                continue
            text = json.dumps(raw.record, ensure_ascii=False, default=str)
            try:
                messages = to_messages(raw.record, src.format)
            except ChatFormatError as e:
                ledger.record(e.reason, name, raw.location, text, e.detail)
                continue
            key = conversation_key(messages)
            if key in seen:
                ledger.record("duplicate", name, raw.location, text, f"same conversation as an earlier record ({key})")
                continue
            seen.add(key)
            try:
                ids, labels = encode_conversation(tok, messages, template)
            except TemplateSkip as e:
                ledger.record(e.reason, name, raw.location, text, e.detail)
                continue
            truncated = False
            if len(ids) > row_len:
                kept = cfg.overlong == "truncate" and any(x != IGNORE_INDEX for x in labels[1:row_len])
                if not kept:
                    ledger.record("too_long", name, raw.location, text,
                                  f"{len(ids)} tokens > row_len {row_len}"
                                  + (" and no labelled token within it" if cfg.overlong == "truncate" else ""))
                    continue
                ids, labels, truncated = ids[:row_len], labels[:row_len], True
            h = split_hash(cfg.seed, key)
            splits["val" if h < threshold else "train"].append(
                Example(np.asarray(ids, np.int32), np.asarray(labels, np.int32), h, truncated))
            info["examples"] += 1

    bar.close()
    forced = _force_nonempty(splits)
    kept = {s: len(v) for s, v in splits.items()}
    if examples_in != kept["train"] + kept["val"] + ledger.total:
        raise AssertionError(f"{examples_in} records read but {kept} kept and {ledger.total} skipped")
    ledger.write(quarantine_path)
    if ledger.total:  # the data stages' line: the counts alone are in the metrics only
        log.info("skipped %s record(s): %s (samples in %s)", f"{ledger.total:,}", counts_text(ledger.counts),
                 quarantine_path)
    empty = [s for s in SPLITS if not splits[s]]
    if empty:
        too_long = ledger.counts.get("too_long", 0)
        fix = (f"; {too_long} were longer than a row of {row_len} tokens: raise sft.data.seq_len"
               + (" or set sft.data.overlong: truncate" if cfg.overlong == "drop" else "")) if too_long else ""
        raise SFTDataError(
            f"the {' and '.join(empty)} split(s) got no examples: {examples_in} record(s) read, "
            f"{kept['train'] + kept['val']} kept, skipped {ledger.as_dict()} (see {quarantine_path}){fix}; "
            "add data, or fix the records quarantined there")

    try:
        written = {s: write_split(out_dir, s, splits[s], cfg, specials.pad_id) for s in SPLITS}
    except BaseException:
        clear_outputs(out_dir, SPLITS)
        raise
    uses_builtin = any(s.path.startswith(BUILTIN_PREFIX) for s in cfg.sources)
    write_manifest(out_dir, fmt=FORMAT, seq_len=cfg.seq_len, vocab_size=id_space(tok),
                   special_ids=special_ids, tokenizer_path=tokenizer_path, labels=True, splits=written, fields={
                       "chat_template": template.text,
                       "chat_template_name": template.name,
                       "template_date": template.date.isoformat(),
                       "end_of_turn_ids": list(end_of_turn),
                       "stop_ids": list(stops),
                       "pack": cfg.pack,
                       "overlong": cfg.overlong,
                       "seed": cfg.seed,
                       "val_fraction": cfg.val_fraction,
                       "python": sys.version.split()[0] if uses_builtin else None,
                       "sources": per_source,
                       "forced": forced,
                   })
    positions = sum(w["rows"] for w in written.values()) * row_len
    log.info("built the SFT data in %.1f s: %d train and %d val rows", time.perf_counter() - t0,
             written["train"]["rows"], written["val"]["rows"])
    return {
        "examples_in": examples_in,
        **split_counts(written),
        "skipped": ledger.as_dict(),
        "truncated": sum(w["truncated"] for w in written.values()),
        "forced": forced,
        "fill": round(sum(w["tokens"] for w in written.values()) / positions, 4),
        "sources": {s["path"]: {k: s[k] for k in ("records", "examples", "capped")} for s in per_source},
    }


# --- one build for the nodes of a run --------------------------------------------------------

BUILD_RECORD = ".build.json"  # <out_dir>/.build.json: the fingerprint and metrics of its complete build
BUILD_LOCK = ".build.lock"  # <out_dir>/.build.lock: held while a build is checked or made


def build_fingerprint(cfg: SFTDataConfig, tokenizer_path: str | Path) -> str:
    """What a build depends on: the data params, the tokenizer's folder (its
    files' sizes and times, in subfolders too: the tokenizer, any chat template
    in it, and an adopted tokenizer's ``hf/tokenizer_config.json``, whose
    special-token texts a template renders), the
    sources' files (sizes and times) and a ``.jinja`` template's, the Python
    (the built-in dataset reads its standard library) and the code."""
    folder = Path(tokenizer_path).parent
    files = [f for i, src in enumerate(cfg.sources) for f in resolve_source(src, i)]
    if Path(cfg.chat_template).expanduser().is_file():
        files.append(Path(cfg.chat_template).expanduser())
    return resume.digest_json({
        "params": cfg.model_dump(mode="json"), "tokenizer": sha256_file(tokenizer_path),
        "tokenizer folder": resume.files_digest(sorted(p for p in folder.rglob("*") if p.is_file())),  # and hf/
        "sources": resume.files_digest(files), "python": sys.version,
        "code": resume.code_digest(sys.modules[__name__], chat, chat_template, compressed, remote, shards,
                                   stdlib_qa)})


def _build_record(path: Path) -> dict[str, Any] | None:
    """The build record at ``path``, or None where there is none or it is not one
    that :func:`build_once` wrote (cut short, or edited): the data is then built
    again, with a warning, rather than a traceback."""
    if not path.exists():
        return None
    try:
        built = read_json(path)
    except (OSError, ValueError) as e:
        built, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "not a build record"
    if isinstance(built, dict) and isinstance(built.get("fingerprint"), str) and isinstance(built.get("metrics"),
                                                                                            dict):
        return built
    log.warning("%s is damaged (%s): the SFT data is built again", path, why)
    return None


def build_once(cfg: SFTDataConfig, tokenizer_path: str | Path, out_dir: str | Path,
               quarantine_path: str | Path) -> dict:
    """:func:`build_sft_data`, unless ``out_dir`` holds a complete build of the
    same :func:`build_fingerprint`; returns the build's metrics either way.

    Every node of a multi-node run starts the stage, and so the build. On
    storage the nodes share, two builds at once would remove each other's
    shards; so the check and the build hold an exclusive lock on
    ``out_dir/.build.lock`` (flock, which is cluster-wide over NFS): the first
    node builds while the others wait, and they then find it built."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = build_fingerprint(cfg, tokenizer_path)
    record = out_dir / BUILD_RECORD
    fd = os.open(out_dir / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for the SFT data build in %s that another process (or node) holds", out_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        built = _build_record(record) if (out_dir / MANIFEST).exists() else None
        if built is not None and built["fingerprint"] == fingerprint:
            log.info("%s holds this build already (made on %s): not built again", out_dir, built.get("host"))
            return built["metrics"]
        record.unlink(missing_ok=True)
        metrics = build_sft_data(cfg, tokenizer_path, out_dir, quarantine_path)
        write_json(record, {"fingerprint": fingerprint, "host": socket.gethostname(), "metrics": metrics})
        return metrics
    finally:
        os.close(fd)  # and with it the lock
