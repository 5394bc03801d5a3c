"""SFT data: chat sources -> tokenized, loss-masked, packed Arrow shards.

Input: ``SFTDataConfig.sources``, each ``{path, format}``. ``path`` is a file, a
directory (its ``*.json``, ``*.jsonl`` and ``*.ndjson`` files, recursively, dot-files
left out) or a glob; ``.jsonl``/``.ndjson`` files hold one record per line, ``.json``
files an array of records (or one record). ``path`` may instead name a built-in
dataset, ``builtin:<name>`` (:data:`BUILTIN_DATASETS`). ``format`` is one of
:data:`pipeline.data.chat.FORMAT_NAMES`; ``auto`` detects it per record.

Accounting. Every record read is either an example in ``train`` or ``val`` or a
skip counted by reason and sampled into the quarantine JSONL (source, location,
reason, detail, the record): the converter reasons of :data:`pipeline.data.chat.REASONS`,
plus ``malformed_json``, ``non_utf8``, ``duplicate`` (a conversation identical to
an earlier one; dropping it keeps copies out of both splits) and ``too_long``.
``examples_in == train + val + sum(skipped)`` is checked. ``max_examples`` caps the
records read from each source (its first ones in the source's order).

Split. An example is in ``val`` iff ``h(seed, key) < val_fraction · 2**64``, where
``key`` is the hex BLAKE2b-128 digest of the conversation (roles and contents) and
``h`` the 64-bit BLAKE2b digest of ``f"{seed}\\0{key}"`` (person ``sft-spl``). So a
conversation always lands in the same split, wherever it comes from. When no
example hashes into ``val`` the one with the smallest ``h`` is moved there, and
when all do the one with the largest goes to ``train`` (counted in ``forced``).

Length. An example of ``n`` tokens fits a row when ``n <= row_len = seq_len + 1``
(its last token, the ``\\n`` after ``<|im_end|>``, is only ever a target). A longer
one is dropped (``overlong: drop``, reason ``too_long``) or cut to ``row_len``
tokens (``overlong: truncate``, counted as ``truncated``); a cut that leaves no
labelled token past the first position is dropped as ``too_long`` as well.

On-disk format (``pipeline.sft_data/1``), under ``out_dir``::

    train/shard-00000.arrow ...   val/shard-00000.arrow ...   manifest.json

Shards are Arrow IPC *file* format, one record batch of at most ``shard_rows``
rows each, read by :class:`pipeline.data.PackedRows`. Columns:

- ``input_ids``: ``fixed_size_list<int32>[row_len]``;
- ``labels``: same shape: the token id where the loss is taken, -100 elsewhere,
  aligned with ``input_ids`` (training uses ``input_ids[:-1]`` -> ``labels[1:]``);
- ``doc_starts``: ``list<int32>``, the sorted offsets where a segment starts. Every
  example starts a segment; the padding (``pad_id``, label -100) that fills the
  rest of a row is a segment of its own. Offset 0 is always present.

With ``pack: true`` a row holds as many whole examples as fit (best-fit
decreasing by length; an example never spans rows), so with document masking no
example attends to another. With ``pack: false`` a row holds one example. Rows
are then put in a seeded random order, so that any prefix of ``val`` (which
evaluation reads) is a fair sample. ``label`` at an example's first position is
always -100, so no example is trained to follow its row-neighbour.

``manifest.json`` (written last, atomically): ``format``, ``seq_len``, ``row_len``,
``dtype``, ``ignore_index``, ``vocab_size``, ``eot_id``, ``pad_id``,
``special_ids``, ``tokenizer_sha256``, ``chat_template`` (the Jinja text),
``pack``, ``overlong``, ``seed``, ``val_fraction``, ``python`` (the version whose
stdlib a built-in dataset was derived from), ``sources`` (per source: path,
format, records, examples, capped), ``forced``, and ``splits.{train,val}`` with
``examples``, ``truncated``, ``rows``, ``tokens`` (example tokens, padding not
counted), ``label_tokens``, ``pad_tokens`` and ``shards: [{path, rows, sha256}]``.

Examples are held in memory as token arrays between reading and packing: SFT
sets are small, and packing and the tiny-split rule need them all.
"""

from __future__ import annotations

import ast
import bisect
import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.errors import StageError
from pipeline.data.accounting import Ledger
from pipeline.data.chat import CHAT_TEMPLATE_JINJA, IGNORE_INDEX, ChatFormatError, encode_chat, to_messages
from pipeline.files import atomic_path, sha256_file, write_json
from pipeline.progress import progress
from pipeline.data.tokenizer import EOT_ID, PAD_ID, TokenizerError, load_tokenizer, special_ids
from pipeline.errors import StageError

FORMAT = "pipeline.sft_data/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
BUILTIN_PREFIX = "builtin:"
SUFFIX_KINDS: dict[str, str] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}

ChatFormatName = Literal["auto", "messages", "sharegpt", "alpaca"]


# --- built-in datasets -------------------------------------------------------------------------

# Directories of the stdlib that are tests, tools, vendored wheels, generated tables or
# deprecated; their docstrings make poor or misleading answers.
STDLIB_SKIP_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "distutils", "ensurepip",
    "pydoc_data", "encodings", "site-packages", "dist-packages", "lib-dynload", "__pycache__",
})
STDLIB_MAX_FILE_BYTES = 400_000  # larger files are generated tables, not documented APIs
ANSWER_CHARS = (30, 700)  # first paragraphs outside this range are too thin or too long
SIGNATURE_CHARS = 60  # longer parameter lists end in ", ..."
DEFAULT_CHARS = 20  # longer default values show as "..."

FUNCTION_QUESTIONS = (
    "What does `{name}({sig})` do?",
    "Explain what `{name}({sig})` does in the Python standard library.",
    "In Python's `{module}` module, what is `{short}` used for?",
    "Briefly, what happens when you call `{name}({sig})`?",
)
CLASS_QUESTIONS = (
    "What is the `{name}` class in Python's standard library?",
    "What does the class `{name}({sig})` represent?",
    "In Python's `{module}` module, what is the class `{short}` for?",
)


def _digest(text: str, person: bytes, size: int = 8) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size, person=person).digest()


def _signature(args: ast.arguments, drop_first: bool) -> str:
    """A short, readable parameter list (annotations left out)."""
    def default(node: ast.expr | None) -> str:
        text = ast.unparse(node) if node is not None else ""
        return text if len(text) <= DEFAULT_CHARS else "..."

    positional = [*args.posonlyargs, *args.args]
    pos_defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts: list[str] = []
    # Parameters named with a leading underscore are private (caching tricks such as
    # ``_w=WHITESPACE.match``), not part of the documented call.
    for i, (a, d) in enumerate(zip(positional, pos_defaults)):
        if not (i == 0 and drop_first) and not a.arg.startswith("_"):
            parts.append(a.arg if d is None else f"{a.arg}={default(d)}")
        if args.posonlyargs and i == len(args.posonlyargs) - 1 and parts:
            parts.append("/")
    kwonly = [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if not a.arg.startswith("_")]
    if args.vararg:
        parts.append(f"*{args.vararg.arg}")
    elif kwonly:
        parts.append("*")
    for a, d in kwonly:
        parts.append(a.arg if d is None else f"{a.arg}={default(d)}")
    if args.kwarg:
        parts.append(f"**{args.kwarg.arg}")
    out = ""
    for p in parts:
        nxt = f"{out}, {p}" if out else p
        if len(nxt) > SIGNATURE_CHARS:
            return f"{out}, ..." if out else "..."
        out = nxt
    return out


def _first_paragraph(doc: str, name: str) -> str | None:
    """The docstring's first prose paragraph, unwrapped; None if unsuitable."""
    paras = [p.strip() for p in doc.split("\n\n") if p.strip()]
    # Some docstrings open with a signature line ("dumps(obj) -> str"); skip it.
    if paras and paras[0].startswith(f"{name}("):
        paras = paras[1:]
    # Unwrapping a doctest would garble it; such a docstring has no prose summary.
    if not paras or ">>>" in paras[0]:
        return None
    text = " ".join(line.strip() for line in paras[0].splitlines())
    if not ANSWER_CHARS[0] <= len(text) <= ANSWER_CHARS[1] or not any(c.isalpha() for c in text):
        return None
    return text


def _question(kind: str, qualname: str, module: str, sig: str | None) -> str:
    templates = CLASS_QUESTIONS if kind == "class" else FUNCTION_QUESTIONS
    if sig is None:  # a class without __init__: no parameter list to show
        templates = tuple(t for t in templates if "({sig})" not in t)
    pick = int.from_bytes(_digest(qualname, b"sft-phr"), "big") % len(templates)
    name = f"{module}.{qualname}"
    return templates[pick].format(name=name, sig=sig or "", module=module, short=qualname)


def _module_defs(tree: ast.Module) -> Iterator[tuple[str, str, ast.AST, bool]]:
    """(kind, qualname, node, is_method) for public top-level functions and classes
    and the public methods defined directly in those classes."""
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, funcs) and not node.name.startswith("_"):
            yield "function", node.name, node, False
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield "class", node.name, node, False
            for m in node.body:
                if isinstance(m, funcs) and not m.name.startswith("_"):
                    yield "function", f"{node.name}.{m.name}", m, True


def _class_signature(node: ast.ClassDef) -> str | None:
    for m in node.body:
        if isinstance(m, ast.FunctionDef) and m.name == "__init__":
            return _signature(m.args, drop_first=True)
    return None


def stdlib_files(root: Path) -> list[Path]:
    """Public ``.py`` files under ``root`` in sorted order, skipping
    :data:`STDLIB_SKIP_DIRS`, private modules and packages, and huge files."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in STDLIB_SKIP_DIRS and not d.startswith(("_", ".", "config-")))
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if f.endswith(".py") and (f == "__init__.py" or not f.startswith("_")) \
                    and p.stat().st_size <= STDLIB_MAX_FILE_BYTES:
                out.append(p)
    return out


def stdlib_qa(root: str | Path | None = None) -> list[tuple[str, str, str]]:
    """Question/answer pairs about the public API of the Python stdlib at ``root``
    (default: this interpreter's, from ``sysconfig``), derived with ``ast`` only:
    nothing is imported. Returns ``(location, question, answer)`` triples, one per
    distinct question and location (the first in file order wins), ordered by a
    hash of the question so that any prefix is spread over the whole library."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[tuple[bytes, str, str, str]] = []
    for path in stdlib_files(root):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if not parts:
            continue
        module = ".".join(parts)
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
            continue  # a stray template or foreign-syntax file is not part of the API
        for kind, qualname, node, is_method in _module_defs(tree):
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                continue
            answer = _first_paragraph(doc, qualname.rsplit(".", 1)[-1])
            if answer is None:
                continue
            if kind == "class":
                sig = _class_signature(node)
            else:
                is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
                sig = _signature(node.args, drop_first=is_method and not is_static)
            question = _question(kind, qualname, module, sig)
            location = f"{rel.as_posix()}.py:{qualname}"
            # A name defined twice (a property's setter, a redefinition) keeps its first.
            if question in seen or location in seen:
                continue
            seen.update((question, location))
            out.append((_digest(question, b"sft-ord"), location, question, answer))
    out.sort()
    return [(loc, q, a) for _, loc, q, a in out]


@functools.lru_cache(maxsize=2)
def _stdlib_qa_cached(root: str) -> tuple[tuple[str, str, str], ...]:
    # The stdlib does not change under a running process; tests and a stage that
    # read it twice pay for the parse once.
    return tuple(stdlib_qa(root))


def builtin_stdlib_docstrings() -> Iterator[tuple[str, dict]]:
    for loc, q, a in _stdlib_qa_cached(sysconfig.get_paths()["stdlib"]):
        yield loc, {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


# name -> generator of (location, record in the ``messages`` format).
BUILTIN_DATASETS: dict[str, Callable[[], Iterator[tuple[str, dict]]]] = {
    "stdlib-docstrings": builtin_stdlib_docstrings,
}


# --- config ------------------------------------------------------------------------------------


class SFTSource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, description="a file, directory or glob of .json/.jsonl, or builtin:<name>")
    format: ChatFormatName = Field("auto", description="record format; auto detects it per record")

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, v: str) -> str:
        if v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX):] not in BUILTIN_DATASETS:
            raise ValueError("unknown built-in dataset; known: "
                             + ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_DATASETS))
        return v

    @model_validator(mode="after")
    def _builtin_format(self) -> "SFTSource":
        if self.path.startswith(BUILTIN_PREFIX) and self.format not in ("auto", "messages"):
            raise ValueError(f"built-in datasets are in the messages format, not {self.format!r}")
        return self


class SFTDataConfig(BaseModel):
    """The data part of the sft stage's config (embeddable: frozen, no extra keys)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    sources: list[SFTSource] = Field(
        default_factory=lambda: [SFTSource(path=BUILTIN_PREFIX + "stdlib-docstrings")], min_length=1,
        description="list of {path, format}: JSON/JSONL files, dirs or globs, or builtin:<name>")
    seq_len: int = Field(256, ge=8, le=1_048_576, description="tokens a model sees per row; rows hold seq_len + 1")
    pack: bool = Field(True, description="several whole examples per row (document-masked); false: one per row")
    overlong: Literal["drop", "truncate"] = Field(
        "drop", description="an example longer than a row: drop it, or cut it (kept only if a label survives)")
    val_fraction: float = Field(0.05, gt=0.0, le=0.5, description="share of examples in the val split")
    seed: int = Field(0, ge=0, description="chooses the split and the row order")
    max_examples: int | None = Field(None, ge=1, description="records read per source, first ones; null = all")
    quarantine_per_reason: int = Field(100, ge=0, description="skipped records kept verbatim per reason")
    shard_rows: int = Field(16_384, ge=1, description="rows per Arrow shard file")


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


def _display(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def resolve_source(src: SFTSource, index: int) -> list[Path]:
    """The files of one source, sorted (empty for a built-in). Raises SFTDataError
    naming ``sources.<index>.path`` when the path matches nothing usable."""
    where = f"sources.{index}.path"
    if src.path.startswith(BUILTIN_PREFIX):
        return []
    p = Path(src.path)
    if glob.has_magic(src.path):
        files = sorted(Path(m) for m in glob.glob(src.path, recursive=True) if Path(m).is_file())
    elif p.is_dir():
        files = sorted(x for x in p.rglob("*") if x.is_file() and x.suffix.lower() in SUFFIX_KINDS
                       and not any(part.startswith(".") for part in x.relative_to(p).parts))
    elif p.is_file():
        files = [p]
    else:
        raise SFTDataError(f"{where}: no such file or directory: {src.path!r}")
    if not files:
        raise SFTDataError(f"{where}: {src.path!r} matched no .json/.jsonl/.ndjson files")
    bad = [f for f in files if f.suffix.lower() not in SUFFIX_KINDS]
    if bad:
        raise SFTDataError(f"{where}: {str(bad[0])!r} is not .json, .jsonl or .ndjson")
    return files


def _read_jsonl(path: Path) -> Iterator[Raw]:
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            loc = f"line:{n}"
            if not raw.strip():
                continue  # blank lines carry no record
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Raw(loc, reason="non_utf8", detail=f"invalid UTF-8 at byte {e.start} of the line")
                continue
            try:
                yield Raw(loc, json.loads(line))
            except json.JSONDecodeError as e:
                yield Raw(loc, reason="malformed_json", detail=str(e), text=line)


def _read_json(path: Path) -> Iterator[Raw]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        yield Raw("file", reason="non_utf8", detail=f"invalid UTF-8 at byte {e.start}")
        return
    except json.JSONDecodeError as e:
        yield Raw("file", reason="malformed_json", detail=str(e))
        return
    if isinstance(data, list):
        for i, rec in enumerate(data):
            yield Raw(f"item:{i}", rec)
    else:
        yield Raw("file", data)  # one record; to_messages rejects a non-object


READERS: dict[str, Callable[[Path], Iterator[Raw]]] = {"jsonl": _read_jsonl, "json": _read_json}


def iter_source(src: SFTSource, files: list[Path]) -> Iterator[tuple[str, Raw]]:
    """``(display name, raw record)`` for every record of one source, in order."""
    if src.path.startswith(BUILTIN_PREFIX):
        for loc, rec in BUILTIN_DATASETS[src.path[len(BUILTIN_PREFIX):]]():
            yield src.path, Raw(loc, rec)
        return
    for f in files:
        name = _display(f)
        for raw in READERS[SUFFIX_KINDS[f.suffix.lower()]](f):
            yield name, raw


# --- examples, split, packing ------------------------------------------------------------------


@dataclass
class Example:
    ids: np.ndarray  # (n,) int32
    labels: np.ndarray  # (n,) int32, IGNORE_INDEX where no loss
    h: int  # split hash
    truncated: bool = False


def conversation_key(messages: list[dict]) -> str:
    """Content identity of a conversation: the same roles and texts give the same key."""
    canon = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
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


def sft_schema(row_len: int) -> pa.Schema:
    return pa.schema(
        [pa.field("input_ids", pa.list_(pa.int32(), row_len), nullable=False),
         pa.field("labels", pa.list_(pa.int32(), row_len), nullable=False),
         pa.field("doc_starts", pa.list_(pa.int32()), nullable=False)],
        metadata={"format": FORMAT, "row_len": str(row_len), "pad_id": str(PAD_ID),
                  "ignore_index": str(IGNORE_INDEX)},
    )


def write_split(out_dir: Path, split: str, examples: list[Example], cfg: SFTDataConfig) -> dict:
    """Pack one split and write its shards; return its manifest entry."""
    row_len = cfg.seq_len + 1
    ids, labels, starts = build_rows(examples, row_len, cfg.pack, PAD_ID, cfg.seed)
    schema = sft_schema(row_len)
    shards = []
    for s, lo in enumerate(range(0, len(ids), cfg.shard_rows)):
        hi = min(lo + cfg.shard_rows, len(ids))
        batch = pa.record_batch([
            pa.FixedSizeListArray.from_arrays(pa.array(ids[lo:hi].reshape(-1)), row_len),
            pa.FixedSizeListArray.from_arrays(pa.array(labels[lo:hi].reshape(-1)), row_len),
            pa.array(starts[lo:hi], pa.list_(pa.int32())),
        ], schema=schema)
        rel = f"{split}/shard-{s:05d}.arrow"
        with atomic_path(out_dir / rel) as tmp:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                writer.write_batch(batch)
        shards.append({"path": rel, "rows": hi - lo, "sha256": sha256_file(out_dir / rel)})
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
        "shards": shards,
    }


def _clear_outputs(out_dir: Path) -> None:
    # The manifest goes first: a directory without one is incomplete by contract.
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for split in SPLITS:
        d = out_dir / split
        if d.is_dir():
            for p in [*d.glob("shard-*.arrow"), *d.glob(".shard-*.tmp")]:
                p.unlink()


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
    """Read ``cfg.sources``, convert, encode with :func:`pipeline.data.chat.encode_chat`,
    split, pack and write shards and manifest under ``out_dir`` (format in the
    module docstring) and the quarantine sample to ``quarantine_path``. Stale
    shards of an earlier run are removed first; on failure no manifest is left.

    Returns metrics: examples_in, train/val {examples, truncated, rows, tokens,
    label_tokens, pad_tokens, shards (count)}, skipped {reason: n}, truncated,
    forced, fill (share of row positions that are example tokens), sources
    {path: {records, examples, capped}}, seconds.
    Raises SFTDataError on a missing source path or tokenizer (before any
    reading), or when the examples kept cannot fill both splits.
    """
    t0 = time.perf_counter()
    tokenizer_path, out_dir = Path(tokenizer_path), Path(out_dir)
    try:
        tok = load_tokenizer(tokenizer_path)
        specials = special_ids(tok)
    except TokenizerError as e:
        raise SFTDataError(str(e)) from e
    files = [resolve_source(src, i) for i, src in enumerate(cfg.sources)]
    _clear_outputs(out_dir)
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
            ids, labels = encode_chat(tok, messages)
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
    empty = [s for s in SPLITS if not splits[s]]
    if empty:
        raise SFTDataError(
            f"the {' and '.join(empty)} split(s) got no examples: {examples_in} record(s) read, "
            f"{kept['train'] + kept['val']} kept, skipped {ledger.as_dict()} (see {quarantine_path}); "
            "add data, or fix the records quarantined there")

    try:
        written = {s: write_split(out_dir, s, splits[s], cfg) for s in SPLITS}
    except BaseException:
        _clear_outputs(out_dir)
        raise
    uses_builtin = any(s.path.startswith(BUILTIN_PREFIX) for s in cfg.sources)
    write_json(out_dir / MANIFEST, {
        "format": FORMAT,
        "seq_len": cfg.seq_len,
        "row_len": row_len,
        "dtype": "int32",
        "ignore_index": IGNORE_INDEX,
        "vocab_size": tok.get_vocab_size(),
        "eot_id": EOT_ID,
        "pad_id": PAD_ID,
        "special_ids": specials,
        "tokenizer_sha256": sha256_file(tokenizer_path),
        "chat_template": CHAT_TEMPLATE_JINJA,
        "pack": cfg.pack,
        "overlong": cfg.overlong,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "python": sys.version.split()[0] if uses_builtin else None,
        "sources": per_source,
        "forced": forced,
        "splits": written,
    })
    positions = sum(w["rows"] for w in written.values()) * row_len
    return {
        "examples_in": examples_in,
        **{s: {**{k: v for k, v in w.items() if k != "shards"}, "shards": len(w["shards"])}
           for s, w in written.items()},
        "skipped": ledger.as_dict(),
        "truncated": sum(w["truncated"] for w in written.values()),
        "forced": forced,
        "fill": round(sum(w["tokens"] for w in written.values()) / positions, 4),
        "sources": {s["path"]: {k: s[k] for k in ("records", "examples", "capped")} for s in per_source},
        "seconds": round(time.perf_counter() - t0, 3),
    }
