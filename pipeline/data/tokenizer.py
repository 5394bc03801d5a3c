"""tokenizer: train a byte-level BPE tokenizer on a bounded sample of the clean docs.

Input: a table of documents with at least the columns ``id`` and ``text``: the
clean stage's documents folder (``data/clean/docs``) or one Parquet file. Output: ``data/tokenizer/tokenizer.json``, a Hugging
Face ``tokenizers`` file, written atomically.

The tokenizer is byte-level BPE with no normalizer, so ``decode(encode(x)) == x``
for every string (code, whitespace runs, tabs, any Unicode). Four special tokens
have fixed ids, exported below so that every later stage agrees on them::

    0 <|endoftext|>  EOT: appended after every document by pack
    1 <|pad|>        PAD
    2 <|im_start|>   chat turn start (SFT)
    3 <|im_end|>     chat turn end (SFT)

Special tokens cannot be injected from text. :func:`load_tokenizer` returns a
tokenizer that encodes the string ``"<|endoftext|>"`` found in a document as
ordinary bytes, never as id 0; a stage that wants a special token inserts its id
(see :func:`special_ids`). Nor can a learned merge spell one: the byte-level
pre-tokenizer splits ``<|``, letters and ``|>`` into separate words before BPE
sees them. Note that other loaders of ``tokenizer.json`` (e.g.
``transformers``) parse special strings by default; that flag is not stored in
the file.

Adopting a published model's tokenizer: with ``source`` set to a local Hugging
Face model folder, the stage trains nothing. It copies that folder's tokenizer
files byte for byte into ``data/tokenizer/hf/`` (and its ``tokenizer.json`` to
``data/tokenizer/tokenizer.json``, so that every later stage reads the same
file either way), and records in ``specials.json`` which of its tokens play our
roles: the end-of-text token that pack puts between documents, padding, bos,
the ids that stop generation (end of turn first) and the chat template.
:func:`load_specials` reads that file; for our own tokenizer it returns the
fixed ids above and no template (ChatML).

Sample: every document gets a rank, a 64-bit hash of ``(seed, id)``. Documents
are taken whole in rank order, each one that still fits in ``sample_bytes`` of
UTF-8 (one that does not is passed over; if none fits at all, a prefix of the
first is used). So the sample is spread over the whole corpus, is the same for the
same seed and ids whatever the row order, and never exceeds the bound (memory of
BPE training grows with it). A held-out set for measuring compression is taken
the same way from the other end of the rank order (at most ``eval_bytes`` and a
tenth of the corpus) and is never trained on. Documents of a source marked
``split: val`` (ingest) are never in the sample either: a validation set of the
user's choosing stays unseen by every stage that learns. The corpus is streamed
twice in batches: once for ids and sizes, once for the chosen texts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, field_validator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline import layout
from pipeline.config import StageConfig
from pipeline.data.docs import DocTable
from pipeline.data.shares import check_names, multiplicities, summable
from pipeline.errors import StageError
from pipeline.files import atomic_dir, atomic_write, broken_links, read_json, sha256_file, write_json
from pipeline.progress import enabled as progress_enabled

log = logging.getLogger("pipeline.data.tokenizer")

EOT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# The id of each special token is its index here; changing the order breaks every
# packed dataset and checkpoint made before.
SPECIAL_TOKENS: tuple[str, ...] = (EOT, PAD, IM_START, IM_END)
EOT_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# What our own tokenizer declares to transformers (the exported tokenizer_config.json and
# special_tokens_map.json), and so what a chat template reads as bos_token, eos_token and pad_token.
OWN_TOKEN_VARIABLES = {"bos_token": EOT, "eos_token": IM_END, "pad_token": PAD}
SPECIAL_ROLES: dict[str, str] = {"eot": EOT, "pad": PAD, "im_start": IM_START, "im_end": IM_END}

BYTE_ALPHABET = 256
READ_BATCH_ROWS = 1024

# Strings that must survive encode/decode unchanged; checked after every training
# run in addition to held-out documents.
ROUNDTRIP_PROBES: tuple[str, ...] = (
    "",
    " ",
    "\t\t\tindented with tabs\n",
    "    four spaces\n        eight\n\n\n\ntrailing   \n",
    "def f(x):\r\n    return x ** 2  # CRLF\r\n",
    "naïve café — “quotes” ‘single’ … ©",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji: 🎉👩‍👩‍👧‍👦🏳️‍🌈 and flags 🇫🇷",
    "combining: e\u0301 a\u0308 \u200b zero-width \ufeff BOM",
    "math: ∑_{i=0}^{n} x_i ≤ ∞, ℝ³",
    f"raw specials in text: {EOT} {PAD}{IM_START}user\nhi{IM_END}",
    "<|endoftext",
    "\x00\x01\x7f control bytes \x1b[31m",
    "x" * 300,
)


SOURCE_TRAIN = "train"
# keys only training reads; eval_bytes and seed also choose the held-out documents an adopted tokenizer is measured on
TRAINING_KEYS = ("vocab_size", "min_frequency", "sample_bytes", "sample_weights")


class TokenizerConfig(StageConfig):
    source: str = Field(SOURCE_TRAIN, description="train (a byte-level BPE on the clean docs) or the path of a "
                        "local Hugging Face model folder whose tokenizer is adopted (then vocab_size, min_frequency, sample_bytes and sample_weights are ignored)")
    eot_token: str | None = Field(None, description="adopted tokenizers: the token pack puts between documents, "
                                  "one of the tokenizer's special tokens (null: the tokenizer's own end-of-text "
                                  "token, detected)")
    vocab_size: int = Field(8192, ge=BYTE_ALPHABET + len(SPECIAL_TOKENS), le=262_144,
                            description="target vocabulary size, specials and the 256 byte tokens included")
    min_frequency: int = Field(2, ge=1, description="a pair seen fewer times is never merged")
    sample_bytes: int = Field(4_000_000, ge=1_000, le=20_000_000_000,
                              description="UTF-8 bytes of whole documents to train on (bounds memory)")
    sample_weights: dict[str, float] = Field(
        {}, description="ingest source name -> its share of sample_bytes, e.g. a mixture's weights (every source "
        "with train documents listed); {} = documents taken as they come, by hash")
    eval_bytes: int = Field(1_000_000, ge=1_000,
                            description="held-out bytes for the compression and round-trip check")
    seed: int = Field(0, ge=0, description="chooses the sample")

    @field_validator("sample_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {name: w for name, w in v.items() if not math.isfinite(w) or w < 0}
        if bad:
            raise ValueError(f"weights are finite and >= 0 (got {bad})")
        if v and not sum(v.values()) > 0:
            raise ValueError("at least one weight is above 0")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("give 'train' or the path of a local Hugging Face model folder")
        return v

    @property
    def adopts(self) -> bool:
        return self.source != SOURCE_TRAIN


class TokenizerError(StageError):
    """The tokenizer cannot be trained or loaded (missing input, empty corpus, bad file)."""


# --- which token plays which role ------------------------------------------------------------

SPECIALS_FILE = "specials.json"
HF_DIR = "hf"
# Files of a Hugging Face tokenizer, copied byte for byte when one is adopted.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                      "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
# End-of-text tokens of the families we know, in the order they are looked for:
# GPT-2/Qwen, Llama 3, SentencePiece models (Llama 2, Mistral), Gemma, DeepSeek.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<\uff5cend\u2581of\u2581sentence\uff5c>")


@dataclass(frozen=True)
class Specials:
    """The token ids each later stage needs, whatever tokenizer is in use.

    eot_id     separates documents in pack (no document ever contains it)
    pad_id     fills SFT rows (never trained: labels are ignored there)
    bos_id     the tokenizer's begin-of-sequence token, or None
    eos_ids    ids that end generation, end of turn first
    chat_template  the tokenizer's own jinja chat template; None means ChatML
    source     "train", or the Hugging Face folder the tokenizer was adopted from
    hf_files   tokenizer files of that folder, copied under ``data/tokenizer/hf/``
    special_ids    every id that text can never encode to (the added special tokens)
    """

    eot_id: int
    pad_id: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None = None
    source: str = SOURCE_TRAIN
    hf_files: tuple[str, ...] = ()
    special_ids: tuple[int, ...] = field(default=tuple(range(len(SPECIAL_TOKENS))))
    texts: dict[str, str] = field(default_factory=dict)  # role -> token text, for reports and configs

    @property
    def own(self) -> bool:
        """True for the pipeline's own trained tokenizer (fixed ids, ChatML)."""
        return self.source == SOURCE_TRAIN

    def ids(self) -> dict[str, int]:
        """Role -> id for the packed manifests: eot and pad always, then whatever else is known."""
        out = {"eot": self.eot_id, "pad": self.pad_id}
        if self.own:
            out.update(im_start=IM_START_ID, im_end=IM_END_ID)
        elif self.bos_id is not None:
            out["bos"] = self.bos_id
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_ids"], d["hf_files"], d["special_ids"] = list(self.eos_ids), list(self.hf_files), list(self.special_ids)
        return d


OWN_SPECIALS = Specials(eot_id=EOT_ID, pad_id=PAD_ID, bos_id=None, eos_ids=(IM_END_ID, EOT_ID),
                        texts={"eot": EOT, "pad": PAD, "im_start": IM_START, "im_end": IM_END})


def tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer folder for a folder or its ``tokenizer.json``."""
    path = Path(path)
    return path.parent if path.suffix == ".json" else path


def load_specials(path: str | Path) -> Specials:
    """The roles recorded beside a tokenizer (``path``: the folder or its
    ``tokenizer.json``). A folder without ``specials.json`` holds our own
    tokenizer (as written before adoption existed): the fixed ids and ChatML."""
    file = tokenizer_dir(path) / SPECIALS_FILE
    if not file.is_file():
        return OWN_SPECIALS
    try:
        d = read_json(file)
        return Specials(eot_id=int(d["eot_id"]), pad_id=int(d["pad_id"]),
                        bos_id=None if d.get("bos_id") is None else int(d["bos_id"]),
                        eos_ids=tuple(int(i) for i in d["eos_ids"]), chat_template=d.get("chat_template"),
                        source=str(d.get("source", SOURCE_TRAIN)), hf_files=tuple(d.get("hf_files", ())),
                        special_ids=tuple(int(i) for i in d.get("special_ids", ())),
                        texts=dict(d.get("texts", {})))
    except (ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{file}: unreadable ({type(e).__name__}: {e}); rerun the tokenizer stage") from e


# --- loading and sharing ---------------------------------------------------------------------


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Role name -> id (``{"eot": 0, "pad": 1, "im_start": 2, "im_end": 3}``).
    Raises TokenizerError if the tokenizer does not have them at their fixed ids."""
    out = {}
    for role, text in SPECIAL_ROLES.items():
        got = tok.token_to_id(text)
        want = SPECIAL_TOKENS.index(text)
        if got != want:
            raise TokenizerError(f"special token {text!r} has id {got}, expected {want}; retrain the tokenizer")
        out[role] = got
    return out


def load_tokenizer(path: str | Path, parse_special: bool = False) -> Tokenizer:
    """Load ``tokenizer.json`` and check its special ids.

    With ``parse_special=False`` (the default, for corpus text) a special-token string
    inside the text is encoded as ordinary bytes. ``True`` restores the library's
    behaviour of matching them, for trusted templates only.
    Raises TokenizerError if the file is missing or not a valid tokenizer.
    """
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer not found: {path}; run the tokenizer stage first")
    try:
        tok = parse_tokenizer(path.read_text(encoding="utf-8"), parse_special)
    except Exception as e:  # the Rust side raises a bare Exception with the parse error
        raise TokenizerError(f"{path}: not a valid tokenizer file: {e}") from e
    if load_specials(path).own:
        special_ids(tok)
    return tok


def parse_tokenizer(text: str, parse_special: bool = False) -> Tokenizer:
    """A tokenizer from the text of a ``tokenizer.json`` that :func:`load_tokenizer`
    has loaded and checked, encoding as it does: for a worker that gets the
    text rather than the path, as a Ray node that cannot see the file does."""
    tok = whole_texts(Tokenizer.from_str(text))
    tok.encode_special_tokens = not parse_special
    return tok


def whole_texts(tok: Tokenizer) -> Tokenizer:
    """``tok`` with the truncation and padding its file may set turned off (a
    Hugging Face tokenizer.json can ship with them: every document would be cut
    to ``max_length`` tokens and padded, without a word). Pack encodes whole
    documents, SFT pads its rows itself, generation takes whole prompts."""
    tok.no_truncation()
    tok.no_padding()
    return tok


def adds_dummy_prefix(tok: Tokenizer) -> bool:
    """Whether ``tok`` puts a space before every text it encodes, its dummy
    prefix: SentencePiece-style tokenizers do (Llama 2's and Mistral 7B's, in
    the layout transformers converts them to: a normalizer ``Prepend("▁")``, or
    a ``Metaspace`` pre-tokenizer that prepends; "Hello" is "▁Hello"), as does
    a byte-level BPE with ``add_prefix_space``; ours does not. Measured, not
    guessed from the layout's names: what the tokenizer's own normalizer and
    pre-tokenizer make of "a". Pack (a chunk that continues its file) and
    evaluate (the bytes of a document) both go by this."""
    probe = "a"
    if tok.normalizer is not None:
        probe = tok.normalizer.normalize_str(probe)
    if tok.pre_tokenizer is not None:
        probe = "".join(piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(probe))
    return probe != "a"


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with our pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    # No normalizer: any normalisation (NFC, strip) would break exact round-trip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# --- choosing the sample ----------------------------------------------------------------------


def _rank(seed: int, doc_id: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{doc_id}".encode(), digest_size=8, person=b"tok-samp").digest()
    return int.from_bytes(digest, "big")


def open_docs_streaming(path: str | Path, error: type[Exception] | None = None) -> DocTable:
    """The documents at ``path`` (a documents folder or one Parquet file) as one
    table whose ``iter_batches`` holds one row group's pages at a time (see
    :class:`pipeline.data.docs.DocTable`). A missing or unreadable input raises
    ``error`` (default TokenizerError) with one line."""
    return DocTable(path, error or TokenizerError, "run the clean stage first")


def open_docs(docs_path: Path, error: type[Exception]) -> DocTable:
    """The clean documents (a documents folder or one Parquet file) for streaming
    (``id`` and ``text`` columns required); a missing, incomplete, unreadable or
    malformed input raises ``error`` with a clear message."""
    table = open_docs_streaming(docs_path, error)
    missing = {"id", "text"} - set(table.schema_arrow.names)
    if missing:
        raise error(f"{docs_path}: missing column(s) {sorted(missing)}; columns are {table.schema_arrow.names}")
    return table


def open_tokenizer(path: Path, error: type[Exception]) -> tuple[Tokenizer, dict[str, int]]:
    """:func:`load_tokenizer` and its roles (:meth:`Specials.ids`: ``eot`` and
    ``pad`` always); a missing or invalid tokenizer raises ``error`` with the
    TokenizerError's message."""
    try:
        tok = load_tokenizer(path)
        return tok, load_specials(path).ids()
    except TokenizerError as e:
        raise error(str(e)) from e


def _greedy(order: np.ndarray, sizes: np.ndarray, budget: int, taken: np.ndarray) -> None:
    """Mark docs in ``order`` as taken while they fit in ``budget``; a doc that does
    not fit is passed over, so one huge document cannot crowd the rest out."""
    left = budget
    smallest = int(sizes.min()) if len(sizes) else 0
    for i in order:
        if left < smallest:
            break
        s = sizes[i]
        if s <= left and not taken[i]:
            taken[i] = True
            left -= s


def choose_sample(docs_path: str | Path, sample_bytes: int, eval_bytes: int, seed: int,
                  weights: dict[str, float] | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Row masks ``(sample, heldout)`` over the table, disjoint, plus corpus stats.
    With ``weights`` (source name -> weight), each source's documents fill its
    share of ``sample_bytes`` on their own, in rank order, a source with less
    text than its share being repeated up to it as pack upsamples (whole
    copies, then one more of some documents in rank order); stats then add
    ``sample_bytes_per_source``, ``text_used_per_source`` (its sample bytes over
    the bytes of its documents: below 1 a part of them, above 1 repeated) and
    ``copies`` (each sampled row's, in table order).

    Reads only ``id``, the byte length of ``text``, ``split`` and (with weights)
    ``source_name``. Raises TokenizerError on a missing file or column, on a
    corpus with no non-empty text, and on weights that do not name exactly the
    sources with documents to train on.
    """
    pf = open_docs(Path(docs_path), TokenizerError)
    ranks: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    marked: list[np.ndarray] = []  # split: val
    names: list[np.ndarray] = []  # with weights: each document's source, as an index into `sources`
    sources: dict[str, int] = {}
    marks = "split" in pf.schema_arrow.names
    if weights and "source_name" not in pf.schema_arrow.names:
        raise TokenizerError(f"{docs_path}: tokenizer.sample_weights needs the documents' source names, and these "
                             "have none (rerun ingest and clean)")
    columns = ["id", "text", *(["split"] if marks else []), *(["source_name"] if weights else [])]
    for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=columns):
        ids = batch.column(0).to_pylist()
        ranks.append(np.fromiter((_rank(seed, str(i)) for i in ids), np.uint64, count=len(ids)))
        sizes.append(pc.fill_null(pc.binary_length(batch.column(1)), 0).to_numpy().astype(np.int64))
        if marks:
            marked.append(pc.fill_null(pc.equal(batch.column("split"), "val"), False).to_numpy(zero_copy_only=False))
        if weights:
            names.append(np.fromiter((sources.setdefault(n, len(sources)) for n in batch.column("source_name")
                                      .fill_null("").to_pylist()), np.int64, count=len(ids)))
    size = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    val_only = np.concatenate(marked) if marked else np.zeros(len(size), bool)
    total = int(size.sum())
    if total == 0:
        raise TokenizerError(f"{docs_path}: no text to train on ({len(size)} documents, 0 bytes)")
    rank = np.concatenate(ranks)
    order = np.argsort(rank, kind="stable")
    # equal ids rank alike and keep their row order, which then picks among them (clean's ids are unique)
    if shared := int((rank[order][1:] == rank[order][:-1]).sum()):
        log.warning("%s: %d document(s) have the id of one before them in rank order, so which of them the sample "
                    "(and the held-out set) takes depends on the row order, and so does the tokenizer: give each "
                    "document its own id", docs_path, shared)
    nonempty = size > 0
    heldout = np.zeros(len(size), bool)
    # Held-out docs come from the far end of the rank order; capping them at a tenth
    # of the corpus keeps small corpora mostly available for training.
    _greedy(order[::-1][nonempty[order[::-1]]], size, min(eval_bytes, total // 10), heldout)
    sample = heldout | val_only
    trainable = nonempty & ~val_only
    if not trainable.any():
        raise TokenizerError(f"{docs_path}: every document with text is marked split: val, so train would be "
                             "empty: a source must be left unmarked for the model to train on")
    stats: dict[str, Any] = {"corpus_docs": len(size), "corpus_bytes": total}
    if weights:
        source = np.concatenate(names)
        copies = np.zeros(len(size), np.int64)
        stats["sample_bytes_per_source"], stats["text_used_per_source"] = _weighted(
            rank, size, trainable, source, sources, weights, sample_bytes, copies, heldout | val_only)
        sample |= copies > 0
    else:
        _greedy(order[trainable[order]], size, sample_bytes, sample)
    sample &= ~(heldout | val_only)
    if not sample.any():
        # Every document is larger than the budget: a clipped prefix of the first one in
        # rank order is better than no tokenizer. train_tokenizer does the clipping.
        # Held-out docs hold at most a tenth of the bytes, so some non-empty doc is left.
        first = order[trainable[order] & ~heldout[order]]
        doc = (first if len(first) else order[trainable[order]])[0]
        sample[doc], heldout[doc] = True, False  # the held-out set never overlaps what is trained on
        if weights:
            copies[doc] = 1
    if weights:
        stats["copies"] = copies[sample]
        name_of = {k: name for name, k in sources.items()}
        stats["heldout_sources"] = [name_of[int(k)] for k in source[heldout]]
    return sample, heldout, stats


def _weighted(rank: np.ndarray, size: np.ndarray, trainable: np.ndarray, source: np.ndarray,
              sources: dict[str, int], weights: dict[str, float], sample_bytes: int, copies: np.ndarray,
              excluded: np.ndarray) -> tuple[dict[str, int], dict[str, float]]:
    """Set ``copies`` source by source: each takes its share of ``sample_bytes``
    (its weight over their sum) from its own documents as pack realises a
    mixture (:func:`pipeline.data.shares.multiplicities`, in rank order): every
    document k times, then one more time for some, so a source with less text
    than its share is repeated up to it. Returns each source's bytes in the
    sample, and those bytes over its documents' bytes."""
    train_names = sorted(name for name, k in sources.items() if (trainable & (source == k)).any())
    check_names(train_names, weights, "tokenizer.sample_weights", TokenizerError)
    weights = summable(weights)
    total_weight = sum(weights.values())
    taken: dict[str, int] = {}
    used: dict[str, float] = {}
    for name in train_names:
        budget = int(sample_bytes * weights[name] / total_weight)
        mine = np.flatnonzero(trainable & ~excluded & (source == sources[name]))
        copies[mine] = multiplicities(rank[mine], size[mine], budget)
        have = int(size[mine].sum())
        taken[name] = int((size[mine] * copies[mine]).sum())
        used[name] = round(taken[name] / have, 4) if have else 0.0
        if budget > have:
            log.info("source %r has %s bytes of text to train the tokenizer on, less than its share of the sample, "
                     "%s bytes (weight %g of %g): its documents are repeated %.2f times on average", name,
                     f"{have:,}", f"{budget:,}", weights[name], total_weight, used[name])
    return taken, used


def _read_rows(docs_path: Path, *masks: np.ndarray) -> list[list[tuple[str, str]]]:
    """(id, text) of the rows selected by each mask, in table order, streaming."""
    out: list[list[tuple[str, str]]] = [[] for _ in masks]
    row = 0
    for batch in open_docs_streaming(docs_path).iter_batches(batch_size=READ_BATCH_ROWS, columns=["id", "text"]):
        n = batch.num_rows
        for k, mask in enumerate(masks):
            idx = np.flatnonzero(mask[row:row + n])
            if len(idx):
                sel = batch.take(pa.array(idx))
                out[k].extend(zip(sel.column(0).to_pylist(), sel.column(1).to_pylist()))
        row += n
    return out


def _clip_utf8(text: str, max_bytes: int) -> str:
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


# --- training --------------------------------------------------------------------------------


def check_roundtrip(tok: Tokenizer, items: Iterator[tuple[str, str]],
                    specials: tuple[int, ...] = tuple(range(len(SPECIAL_TOKENS)))) -> tuple[int, int, int]:
    """Encode and decode each ``(name, text)``; return (count, bytes, tokens).
    Raises TokenizerError naming the first text that does not round-trip or that
    encodes to one of the ``specials`` ids."""
    n = nbytes = ntok = 0
    special = set(specials)
    for name, text in items:
        ids = tok.encode(text, add_special_tokens=False).ids  # no bos a post-processor would add
        if special.intersection(ids):
            raise TokenizerError(f"round-trip check: {name} encodes to a special token id")
        back = tok.decode(ids, skip_special_tokens=False)
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            # code points too: a normalizer's change (e + U+0301 -> é) prints the same in both excerpts
            raise TokenizerError(
                f"round-trip check failed on {name} at character {at} ({_code_point(text, at)} came back as "
                f"{_code_point(back, at)}): "
                f"{text[max(0, at - 20):at + 20]!r} came back as {back[max(0, at - 20):at + 20]!r}"
            )
        n += 1
        nbytes += len(text.encode("utf-8"))
        ntok += len(ids)
    return n, nbytes, ntok


def _code_point(text: str, at: int) -> str:
    return f"U+{ord(text[at]):04X}" if at < len(text) else "the end"


def train_tokenizer(cfg: TokenizerConfig, docs_path: str | Path, out_path: str | Path,
                    report_path: str | Path | None = None) -> dict:
    """Train on a sample of ``docs_path``, verify, write ``out_path`` atomically.

    Returns metrics: vocab_size (actual; smaller than asked when the sample has too
    few distinct pairs), bytes_per_token on the held-out docs (on the sample when
    the corpus is too small to hold any out), sample_bytes, train_seconds,
    total_seconds. The report, written to ``report_path`` when given, holds
    vocab_size_requested, corpus_docs/bytes, sample_docs, heldout_docs/bytes,
    bytes_per_token_on ("heldout" or "sample"), roundtrip_ok, roundtrip_docs and
    the sha256 of ``out_path``; with ``sample_weights``, also the sample's bytes
    and the held-out documents' bytes per token, source by source.
    Raises TokenizerError on missing input, an empty corpus or a failed round-trip;
    ``out_path`` is then left as it was.
    """
    t0 = time.perf_counter()
    if cfg.eot_token is not None:
        log.warning("tokenizer.source is train: ignoring tokenizer.eot_token %r (the trained tokenizer's end of "
                    "text is %s, id %d)", cfg.eot_token, EOT, EOT_ID)
    docs_path, out_path = Path(docs_path), Path(out_path)
    sample_mask, heldout_mask, stats = choose_sample(docs_path, cfg.sample_bytes, cfg.eval_bytes, cfg.seed,
                                                     cfg.sample_weights)
    heldout_sources = stats.pop("heldout_sources", None)
    copies = stats.pop("copies", None)
    sample, heldout = _read_rows(docs_path, sample_mask, heldout_mask)
    texts = [t or "" for _, t in sample]
    distinct_bytes = sum(len(t.encode("utf-8")) for t in texts)
    if copies is not None:  # sample_weights: a source short of its share is repeated (the same str objects)
        texts = [t for t, n in zip(texts, copies.tolist()) for _ in range(n)]
    if len(texts) == 1 and len(texts[0].encode("utf-8")) > cfg.sample_bytes:
        texts = [_clip_utf8(texts[0], cfg.sample_bytes)]
    sample_bytes = sum(len(t.encode("utf-8")) for t in texts)
    log.info("training BPE (vocab %d) on %d docs%s, %.1f MB of %d docs, %.1f MB", cfg.vocab_size, len(sample),
             f" ({len(texts)} with repeats)" if len(texts) != len(sample) else "", sample_bytes / 1e6,
             stats["corpus_docs"], stats["corpus_bytes"] / 1e6)

    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress_enabled(),  # HF's own bars; quiet under PIPELINE_PROGRESS=0
    )
    t_train = time.perf_counter()
    tok.train_from_iterator(texts, trainer, length=len(texts))
    train_seconds = time.perf_counter() - t_train
    del texts
    if tok.get_vocab_size() < cfg.vocab_size:  # else only report.json would show it
        # Repeats (sample_weights) add no new pair: more sample_bytes would only repeat the text more.
        repeated = sample_bytes > distinct_bytes
        log.warning("tokenizer.vocab_size is %d but the trained tokenizer has %d tokens: the BPE trainer ran out of "
                    "pairs to merge in its sample (%s bytes%s; pairs seen fewer than tokenizer.min_frequency = %d "
                    "times are not merged): give it more text (%s) or a smaller tokenizer.vocab_size",
                    cfg.vocab_size, tok.get_vocab_size(), f"{sample_bytes:,}",
                    f", of which {distinct_bytes:,} are distinct text, repeated for sample_weights" if repeated else "",
                    cfg.min_frequency,
                    "a larger corpus: the sample already repeats what it has" if repeated
                    else "tokenizer.sample_bytes, or a larger corpus")
    special_ids(tok)
    tok.encode_special_tokens = True

    probes = ((f"probe {i}", s) for i, s in enumerate(ROUNDTRIP_PROBES))
    check_roundtrip(tok, probes)
    measured_on = "heldout" if heldout else "sample"
    check_set = heldout or sample[:max(1, len(sample) // 10)]
    n_check, check_bytes, check_tokens = check_roundtrip(tok, ((f"document {i!r}", t or "") for i, t in check_set))
    if heldout_sources is not None:
        stats["heldout_bytes_per_token_per_source"] = _bytes_per_token_by_source(tok, heldout, heldout_sources)

    _write_tokenizer(out_path, tok.to_str(pretty=True), OWN_SPECIALS)
    _remove_adopted(out_path.parent)
    if report_path is not None:
        write_json(report_path, {
            "vocab_size_requested": cfg.vocab_size,
            **stats,
            "sample_docs": len(sample),
            "heldout_docs": len(heldout),
            "heldout_bytes": sum(len((t or "").encode("utf-8")) for _, t in heldout),
            "bytes_per_token_on": measured_on,
            "roundtrip_ok": True,
            "roundtrip_docs": n_check + len(ROUNDTRIP_PROBES),
            "sha256": sha256_file(out_path),
        })
    return {
        "vocab_size": tok.get_vocab_size(),
        "bytes_per_token": round(check_bytes / max(check_tokens, 1), 4),
        "sample_bytes": sample_bytes,
        "train_seconds": round(train_seconds, 3),
        "total_seconds": round(time.perf_counter() - t0, 3),
    }


def _bytes_per_token_by_source(tok: Tokenizer, rows: list[tuple[str, str]], names: list[str]) -> dict[str, float]:
    """UTF-8 bytes per token of the held-out documents, source by source."""
    texts: dict[str, list[str]] = {}
    for name, (_, text) in zip(names, rows):
        texts.setdefault(name, []).append(text or "")
    out = {}
    for name in sorted(texts):
        tokens = sum(len(e.ids) for e in tok.encode_batch(texts[name], add_special_tokens=False))
        out[name] = round(sum(len(t.encode("utf-8")) for t in texts[name]) / max(tokens, 1), 4)
    return out


# --- adopting a Hugging Face model's tokenizer -----------------------------------------------


def _write_specials(out_dir: Path, specials: Specials) -> None:
    write_json(Path(out_dir) / SPECIALS_FILE, specials.to_json())


def _write_tokenizer(out_path: Path, data: str | bytes, specials: Specials, hf_from: Path | None = None) -> None:
    """Write ``tokenizer.json`` (and, adopting, the copies of ``hf_from``'s
    tokenizer files under ``hf/``), then the ``specials.json`` that goes with it.
    Each file is atomic, the set is not: the old specials.json goes first, so a
    run stopped in between leaves none, which reads as our own tokenizer, and
    load_tokenizer's fixed-id check refuses any other rather than lend it the
    old roles (an ordinary token as pack's separator)."""
    out_dir = out_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPECIALS_FILE).unlink(missing_ok=True)
    if hf_from is not None:
        with atomic_dir(out_dir / HF_DIR) as tmp:
            for name in specials.hf_files:
                shutil.copyfile(hf_from / name, tmp / name)
    with atomic_write(out_path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    _write_specials(out_dir, specials)


def _remove_adopted(out_dir: Path) -> None:
    """Our own tokenizer replaces an adopted one: its copied files go (they are
    copies of the user's folder, which stays untouched)."""
    shutil.rmtree(Path(out_dir) / HF_DIR, ignore_errors=True)


def _token_text(value: Any, file: Path, role: str) -> str | None:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict;
    null or "" is no token. Anything else (a list, a number) is a one-line
    TokenizerError naming ``file`` and ``role``: read as no token, the role's
    token would silently be another."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is None or isinstance(text, str):
        return text or None
    raise TokenizerError(f"{file}: {role} is {json.dumps(value)[:80]}, neither a token's text nor an AddedToken "
                         "object with one; give one token's text (more ids that end generation go in "
                         "generation_config.json's eos_token_id, a list)")


DAMAGED_HINT = "the model folder is damaged or incomplete (an interrupted download?): fetch the file again"


def read_folder_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a Hugging Face folder (``tokenizer_config.json``,
    ``generation_config.json``, ...), or {} when there is none. One that does not
    parse, or holds something other than an object, is a one-line
    TokenizerError naming it."""
    if not path.is_file():
        return {}
    try:
        data = read_json(path)
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 (byte {e.start}); {DAMAGED_HINT}") from e
    except ValueError as e:  # json.JSONDecodeError
        raise TokenizerError(f"{path}: not valid JSON ({e}); {DAMAGED_HINT}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}; {DAMAGED_HINT}")
    return data


def read_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """The folder's default chat template, where transformers looks for it:
    ``chat_template.jinja``, then ``chat_template.json``, then ``tokenizer_config.json``
    (a string, or a list of named templates of which "default" is used); the first
    place that has one decides, and a blank template is none.
    A file that does not decode or parse is a one-line TokenizerError."""
    source = folder / "chat_template.jinja"
    template: Any = None
    if source.is_file():
        try:
            template = source.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{source}: not UTF-8 (byte {e.start}); {DAMAGED_HINT}") from e
        return template if template.strip() else None  # blank: no template, as in the other two places
    source = folder / "chat_template.json"
    template = read_folder_json(source).get("chat_template")
    if template is None:
        source, template = folder / "tokenizer_config.json", tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:  # transformers asks for a name then; auto would use ChatML without a word
            log.warning("%s: chat_template holds named templates (%s) but none called 'default', so the tokenizer "
                        "is taken as having no chat template (sft.data.chat_template auto uses ChatML); to use one, "
                        "save it as a .jinja file and give its path as sft.data.chat_template", source,
                        ", ".join(sorted(map(str, named))) or "none with a name")
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: chat_template is a {type(template).__name__}, neither a template nor a list "
                             f"of named ones; {DAMAGED_HINT}")
    return template if isinstance(template, str) and template.strip() else None


def hf_specials(folder: str | Path, tok: Tokenizer, eot_token: str | None = None) -> Specials:
    """The roles of a Hugging Face tokenizer's tokens, from ``tokenizer_config.json``
    (or ``special_tokens_map.json``), ``generation_config.json`` and the vocabulary.
    Raises TokenizerError, one line, when no end-of-text token can be found, a
    named token is not in the vocabulary, or one of those files does not parse."""
    folder = Path(folder)
    tok_config = read_folder_json(folder / "tokenizer_config.json")
    tok_map = read_folder_json(folder / "special_tokens_map.json")

    def named(role: str) -> str | None:
        return (_token_text(tok_config.get(role), folder / "tokenizer_config.json", role)
                or _token_text(tok_map.get(role), folder / "special_tokens_map.json", role))

    def id_of(text: str | None, what: str) -> int | None:
        if text is None:
            return None
        got = tok.token_to_id(text)
        if got is None:
            raise TokenizerError(f"{folder}: the {what} {text!r} is not in the tokenizer's vocabulary")
        return got

    eos_text, bos_text, pad_text = named("eos_token"), named("bos_token"), named("pad_token")
    special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    if eot_token is not None:
        eot_text = eot_token
    else:
        # a special one first; one that is not special is still found, for check_eot_is_special to name
        eot_text = (next((t for t in EOT_CANDIDATES if tok.token_to_id(t) in special), None) or eos_text
                    or next((t for t in EOT_CANDIDATES if tok.token_to_id(t) is not None), None))
    if eot_text is None:
        raise TokenizerError(f"{folder}: no end-of-text token found (looked for {', '.join(EOT_CANDIDATES)} and "
                             "tokenizer_config.json's eos_token); name one with tokenizer.eot_token")
    eot_id = id_of(eot_text, "end-of-text token (tokenizer.eot_token)" if eot_token else "end-of-text token")
    eos: list[int] = []
    eos_id = id_of(eos_text, "eos_token")
    if eos_id is not None:
        eos.append(eos_id)
    gen_file = folder / "generation_config.json"
    gen_eos = read_folder_json(gen_file).get("eos_token_id")
    gen_ids = [i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos])
               if isinstance(i, int) and not isinstance(i, bool)]  # an id, not a token's text or a flag
    # a stop id with no token: generation never stops there, export writes it, and a template's eos_token is None
    rows = id_space(tok)
    if unknown := [i for i in gen_ids if not 0 <= i < rows or tok.id_to_token(i) is None]:
        raise TokenizerError(f"{gen_file}: eos_token_id {unknown} {'is no id' if len(unknown) == 1 else 'are no ids'} "
                             f"of the tokenizer (ids 0 to {rows - 1}): the file belongs to another model; "
                             "fetch the model's own, or give its tokenizer's ids")
    eos.extend(gen_ids)
    eos.append(eot_id)
    pad_id = id_of(pad_text, "pad_token")
    texts = {"eot": eot_text, "pad": pad_text or eot_text}
    texts.update({k: v for k, v in (("bos", bos_text), ("eos", eos_text)) if v})
    return Specials(eot_id=eot_id, pad_id=eot_id if pad_id is None else pad_id, bos_id=id_of(bos_text, "bos_token"),
                    eos_ids=tuple(dict.fromkeys(eos)), chat_template=read_chat_template(folder, tok_config),
                    source=str(folder), hf_files=tuple(f for f in HF_TOKENIZER_FILES if (folder / f).is_file()),
                    special_ids=tuple(special), texts=texts)


def check_eot_is_special(folder: Path, tok: Tokenizer, specials: Specials, named: bool) -> None:
    """Raise TokenizerError, one line, when the end-of-text token of ``specials``
    is not one of the tokenizer's special added tokens. Only those are kept out of
    text (``encode_special_tokens``): any other token, a learned one or a plain
    added one, is also what some document encodes to, and pack's separator, where
    evaluate and generation stop, would come out of the documents' own text.
    ``named``: the user gave it as ``tokenizer.eot_token``."""
    if specials.eot_id in specials.special_ids:
        return
    added = tok.get_added_tokens_decoder()
    names = [repr(added[i].content) for i in specials.special_ids]
    listed = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    raise TokenizerError(
        f"{folder}: {'tokenizer.eot_token' if named else 'the end-of-text token'} {specials.texts['eot']!r} "
        f"(id {specials.eot_id}) is an ordinary token, which text encodes to: pack's document separator would also "
        "come out of the documents' own text; name one of the tokenizer's special tokens with tokenizer.eot_token"
        + (f" (its special tokens: {listed})" if names else " (it has none: mark its end-of-text token special, "
           "\"special\": true in the added_tokens of its tokenizer.json)"))


def missing_chatml_tokens(tok: Tokenizer) -> list[str]:
    """ChatML's tokens (``<|im_start|>``, ``<|im_end|>``) that ``tok`` does not
    have as special added tokens. A tokenizer without a chat template of its
    own can be prompted and trained in ChatML only when none is missing (what
    ``sft.data.chat_template: auto`` and ``generate --chat`` go by)."""
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return [t for t in (IM_START, IM_END) if t not in specials]


def id_space(tok: Tokenizer) -> int:
    """The rows an embedding table needs for ``tok``'s ids: its largest id + 1.
    ``get_vocab_size`` counts tokens, which a gap in the ids (an edited or merged
    vocabulary) makes fewer; for contiguous ids the two are the same."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def check_trained_with(tokenizer_path: str | Path, expected_sha256: str | None, fix: str) -> None:
    """Raise ValueError, ending in ``fix``, if ``tokenizer_path`` is not the tokenizer
    a model was trained with (the sha256 its checkpoint records). Only a recorded
    64-hex-digit sha256 is compared (tests and synthetic data record other markers)."""
    if not expected_sha256 or len(expected_sha256) != 64:
        return
    actual = sha256_file(tokenizer_path)
    if actual != expected_sha256:
        raise ValueError(f"{tokenizer_path} (sha256 {actual[:12]}…) is not the tokenizer this model was "
                         f"trained with (sha256 {expected_sha256[:12]}…); {fix}")


def check_fits(tok: Tokenizer, vocab_size: int, fix: str = "") -> None:
    """Raise ValueError if ``tok`` has an id past a model's ``vocab_size`` embedding
    rows (a gap in the ids can hide one from the token count; a forward pass would
    stop in an IndexError). ``fix``, when given, ends the message."""
    rows = id_space(tok)
    if rows > vocab_size:
        raise ValueError(f"the tokenizer has ids up to {rows - 1} ({tok.get_vocab_size()} tokens), the model "
                         f"embeds only {vocab_size}" + (f"; {fix}" if fix else ""))


def model_vocab_size(folder: Path) -> int | None:
    """The embedding rows the model of a Hugging Face folder declares
    (``config.json``'s ``vocab_size``, or its ``text_config``'s), or None when
    there is none to read: a folder of a tokenizer alone, or a config.json that
    does not parse (pretrain.init_from, which loads it, says so)."""
    try:
        config = read_folder_json(folder / "config.json")
    except TokenizerError:
        return None
    text_config = config.get("text_config")
    for value in (config.get("vocab_size"), text_config.get("vocab_size") if isinstance(text_config, dict) else None):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def open_hf_tokenizer(folder: str | Path) -> Tokenizer:
    """The ``tokenizer.json`` of a Hugging Face folder; a one-line TokenizerError
    when the folder or the file is missing or unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer.source {folder} is not a folder; give 'train' or a local Hugging Face "
                             "model folder" + (f" (here {folder.parent}, the folder that holds it)"
                                               if folder.is_file() else ""))
    if broken := broken_links(folder):
        raise TokenizerError(f"tokenizer.source {folder}: {broken}")
    file = folder / "tokenizer.json"
    if not file.is_file():
        # transformers converts a slow tokenizer's files (SentencePiece, or GPT-2's vocab.json and merges.txt)
        slow = [name for name in ("tokenizer.model", "vocab.json", "merges.txt") if (folder / name).is_file()]
        hint = (f" (it has only a slow tokenizer's {' and '.join(slow)}: convert it once with transformers, "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))" if slow else "")
        raise TokenizerError(f"{folder} has no tokenizer.json{hint}")
    try:
        return whole_texts(Tokenizer.from_file(str(file)))
    except Exception as e:  # the Rust side raises a bare Exception with the parse error
        raise TokenizerError(f"{file}: not a valid tokenizer file: {e}; {DAMAGED_HINT}") from e


def adopt_tokenizer(cfg: TokenizerConfig, docs_path: str | Path, out_path: str | Path,
                    report_path: str | Path | None = None) -> dict:
    """Adopt the tokenizer of the Hugging Face folder ``cfg.source`` instead of
    training one: copy its tokenizer files byte for byte to ``<out dir>/hf/`` and
    its ``tokenizer.json`` to ``out_path``, write ``specials.json``, and measure
    bytes per token and the round trip on held-out clean documents (a tokenizer
    that does not round-trip exactly, e.g. SentencePiece's space handling, is
    counted in ``roundtrip_failures`` and warned about, not refused: it is the
    model's own). Nothing is written until all that has passed, so a failed
    adoption leaves the previous tokenizer as it was. Returns metrics like
    :func:`train_tokenizer`."""
    t0 = time.perf_counter()
    folder, out_path = Path(cfg.source).expanduser(), Path(out_path)
    # params.yaml ships every training key at its default: only one changed from it is worth a warning
    fields = type(cfg).model_fields
    ignored = sorted(k for k in TRAINING_KEYS if getattr(cfg, k) != fields[k].get_default(call_default_factory=True))
    if ignored:
        log.warning("tokenizer.source is a Hugging Face folder: ignoring the training key(s) %s",
                    ", ".join(f"tokenizer.{k}" for k in ignored))
    out_dir = out_path.parent
    own = (out_dir.resolve(), (out_dir / HF_DIR).resolve())
    if folder.resolve() in own or own[1] in folder.resolve().parents:
        # out_dir's top holds no tokenizer_config.json or template, and hf/ no generation_config.json: roles
        # would be lost without a word, from files this run replaces
        last = load_specials(out_dir).source if (out_dir / SPECIALS_FILE).is_file() else SOURCE_TRAIN
        raise TokenizerError(f"tokenizer.source {folder} is the tokenizer stage's own output ({out_dir}), which this "
                             "run replaces: give the model folder itself"
                             + (f" (the last one adopted: {last})" if last != SOURCE_TRAIN else ""))
    tok = open_hf_tokenizer(folder)
    specials = hf_specials(folder, tok, cfg.eot_token)
    check_eot_is_special(folder, tok, specials, cfg.eot_token is not None)
    if ordinary := [i for i in specials.eos_ids if i not in specials.special_ids]:
        # not refused as the end of text is (pack puts no stop id between documents), but not silent either
        log.warning("%s: the stop token(s) %s are ordinary tokens, which text encodes to: a document that spells one "
                    "trains the model on it as text, and generation and evaluate stop where it comes out; mark them "
                    "special (\"special\": true in the added_tokens of its tokenizer.json)", folder,
                    ", ".join(f"{tok.id_to_token(i)!r} (id {i})" for i in ordinary))
    if (rows := model_vocab_size(folder)) is not None and id_space(tok) > rows:
        # a tokenizer adopted to train from scratch still works; init_from this folder's weights cannot
        log.warning("%s: the tokenizer has ids up to %d but config.json's vocab_size is %d: its weights have no "
                    "embedding row for the ids past it, so pretrain.init_from this folder will refuse the pair (a "
                    "model trained from scratch on this tokenizer is unaffected)", folder, id_space(tok) - 1, rows)
    if not layout.in_base_models(folder):  # pretrain's init_from warns alike (models/base/README.md)
        log.warning("tokenizer.source %s is outside %s/%s, so DVC does not see changes to it: a replaced model "
                    "there does not rerun the tokenizer stage by itself", folder, layout.BASE_MODELS,
                    layout.through_link(folder))
    data = (folder / "tokenizer.json").read_bytes()  # the bytes tok was read from, whatever happens to them now
    raw = json.loads(data)
    if cut := [*([f"truncation to {raw['truncation'].get('max_length')} tokens"] if raw.get("truncation") else []),
               *(["padding"] if raw.get("padding") else [])]:
        log.warning("%s: its tokenizer.json sets %s, which would cut or pad every text: the pipeline turns that off "
                    "wherever it loads the tokenizer (pack takes whole documents, sft pads its rows itself); the "
                    "copied file keeps it", folder, " and ".join(cut))

    tok.encode_special_tokens = True
    # the clean documents (a folder, or one Parquet file); a caller without any adopts without measuring
    _, heldout_mask, stats = choose_sample(docs_path, 0, cfg.eval_bytes, cfg.seed) if Path(docs_path).exists() \
        else (None, None, {"corpus_docs": 0, "corpus_bytes": 0})
    heldout = _read_rows(Path(docs_path), heldout_mask)[0] if heldout_mask is not None else []
    failures, nbytes, ntok = 0, 0, 0
    for name, text in [*((f"probe {i}", s) for i, s in enumerate(ROUNDTRIP_PROBES)),
                       *((f"document {i!r}", t or "") for i, t in heldout)]:
        try:
            _, b, n = check_roundtrip(tok, [(name, text)], specials.special_ids)
        except TokenizerError as e:
            if failures == 0:
                log.warning("the adopted tokenizer does not round-trip every text exactly (first: %s)", e)
            failures += 1
            continue
        if name.startswith("document"):
            nbytes, ntok = nbytes + b, ntok + n
    # written once measured: an adoption that fails leaves the previous tokenizer as it was
    _write_tokenizer(out_path, data, specials, hf_from=folder)
    if report_path is not None:
        write_json(report_path, {"source": str(folder), **stats, "heldout_docs": len(heldout),
                                 "roundtrip_failures": failures, "specials": specials.to_json(),
                                 "sha256": sha256_file(out_path)})
    # sft's chat_template auto takes the tokenizer's own template, else ChatML, which needs ChatML's tokens:
    # said now, not after pretrain has run
    if specials.chat_template:
        chat, level = "yes", logging.INFO
    elif missing_chatml_tokens(tok):
        chat, level = "none, and no ChatML tokens: sft needs sft.data.chat_template (a .jinja file)", logging.WARNING
    else:
        chat, level = "none (ChatML for sft)", logging.INFO
    log.log(level, "adopted the tokenizer of %s: %d tokens, end of text %r (id %d), chat template: %s",
            folder, tok.get_vocab_size(), specials.texts["eot"], specials.eot_id, chat)
    return {"vocab_size": tok.get_vocab_size(), "bytes_per_token": round(nbytes / max(ntok, 1), 4),
            "roundtrip_failures": failures, "total_seconds": round(time.perf_counter() - t0, 3)}


def build(cfg: TokenizerConfig, docs_path: str | Path, out_path: str | Path,
          report_path: str | Path | None = None) -> dict:
    """The tokenizer stage: train one, or adopt a Hugging Face model's (``cfg.source``)."""
    if cfg.adopts:
        return adopt_tokenizer(cfg, docs_path, out_path, report_path)
    return train_tokenizer(cfg, docs_path, out_path, report_path)
