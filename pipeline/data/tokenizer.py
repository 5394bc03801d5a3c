"""tokenizer: train a byte-level BPE tokenizer on a bounded sample of the clean docs.

Input: a Parquet table of documents with at least the columns ``id`` and ``text``
(``data/clean/docs.parquet``). Output: ``data/tokenizer/tokenizer.json``, a Hugging
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

Sample: every document gets a rank, a 64-bit hash of ``(seed, id)``. Documents
are taken whole in rank order, each one that still fits in ``sample_bytes`` of
UTF-8 (one that does not is passed over; if none fits at all, a prefix of the
first is used). So the sample is spread over the whole corpus, is the same for the
same seed and ids whatever the row order, and never exceeds the bound (memory of
BPE training grows with it). A held-out set for measuring compression is taken
the same way from the other end of the rank order (at most ``eval_bytes`` and a
tenth of the corpus) and is never trained on. The corpus is streamed twice in
batches: once for ids and sizes, once for the chosen texts.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.config import StageConfig
from pipeline.errors import StageError
from pipeline.files import atomic_write, sha256_file, write_json
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


class TokenizerConfig(StageConfig):
    vocab_size: int = Field(8192, ge=BYTE_ALPHABET + len(SPECIAL_TOKENS), le=262_144,
                            description="target vocabulary size, specials and the 256 byte tokens included")
    min_frequency: int = Field(2, ge=1, description="a pair seen fewer times is never merged")
    sample_bytes: int = Field(4_000_000, ge=1_000, le=20_000_000_000,
                              description="UTF-8 bytes of whole documents to train on (bounds memory)")
    eval_bytes: int = Field(1_000_000, ge=1_000,
                            description="held-out bytes for the compression and round-trip check")
    seed: int = Field(0, ge=0, description="chooses the sample")


class TokenizerError(StageError):
    """The tokenizer cannot be trained or loaded (missing input, empty corpus, bad file)."""


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
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception with the parse error
        raise TokenizerError(f"{path}: not a valid tokenizer file: {e}") from e
    special_ids(tok)
    tok.encode_special_tokens = not parse_special
    return tok


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


def open_docs_streaming(path: str | Path) -> pq.ParquetFile:
    """A ParquetFile whose ``iter_batches`` holds one row group's pages at a time.
    pyarrow's default ``pre_buffer=True`` keeps every column chunk it has read cached
    until the reader is closed, so memory would grow with the file."""
    return pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)


def open_docs(docs_path: Path, error: type[Exception]) -> pq.ParquetFile:
    """The clean documents for streaming (``id`` and ``text`` columns required);
    a missing, unreadable or malformed file raises ``error`` with a clear message."""
    if not docs_path.is_file():
        raise error(f"documents not found: {docs_path}; run the clean stage first")
    try:
        pf = open_docs_streaming(docs_path)
    except (pa.ArrowInvalid, OSError) as e:
        raise error(f"{docs_path}: not a readable Parquet file: {e}") from e
    missing = {"id", "text"} - set(pf.schema_arrow.names)
    if missing:
        raise error(f"{docs_path}: missing column(s) {sorted(missing)}; columns are {pf.schema_arrow.names}")
    return pf


def open_tokenizer(path: Path, error: type[Exception]) -> tuple[Tokenizer, dict[str, int]]:
    """:func:`load_tokenizer` and its :func:`special_ids`; a missing or invalid
    tokenizer raises ``error`` with the TokenizerError's message."""
    try:
        tok = load_tokenizer(path)
        return tok, special_ids(tok)
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


def choose_sample(docs_path: str | Path, sample_bytes: int, eval_bytes: int, seed: int
                  ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Row masks ``(sample, heldout)`` over the table, disjoint, plus corpus stats.

    Reads only ``id`` and the byte length of ``text``. Raises TokenizerError on a
    missing file or column, and on a corpus with no non-empty text.
    """
    pf = open_docs(Path(docs_path), TokenizerError)
    ranks: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=["id", "text"]):
        ids = batch.column(0).to_pylist()
        ranks.append(np.fromiter((_rank(seed, str(i)) for i in ids), np.uint64, count=len(ids)))
        sizes.append(pc.fill_null(pc.binary_length(batch.column(1)), 0).to_numpy().astype(np.int64))
    size = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    total = int(size.sum())
    if total == 0:
        raise TokenizerError(f"{docs_path}: no text to train on ({len(size)} documents, 0 bytes)")
    rank = np.concatenate(ranks)
    order = np.argsort(rank, kind="stable")
    nonempty = size > 0
    heldout = np.zeros(len(size), bool)
    # Held-out docs come from the far end of the rank order; capping them at a tenth
    # of the corpus keeps small corpora mostly available for training.
    _greedy(order[::-1][nonempty[order[::-1]]], size, min(eval_bytes, total // 10), heldout)
    sample = heldout.copy()
    _greedy(order[nonempty[order]], size, sample_bytes, sample)
    sample &= ~heldout
    if not sample.any():
        # Every document is larger than the budget: a clipped prefix of the first one in
        # rank order is better than no tokenizer. train_tokenizer does the clipping.
        # Held-out docs hold at most a tenth of the bytes, so some non-empty doc is left.
        first = order[nonempty[order] & ~heldout[order]]
        sample[first[0]] = True
    stats = {"corpus_docs": len(size), "corpus_bytes": total}
    return sample, heldout, stats


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


def check_roundtrip(tok: Tokenizer, items: Iterator[tuple[str, str]]) -> tuple[int, int, int]:
    """Encode and decode each ``(name, text)``; return (count, bytes, tokens).
    Raises TokenizerError naming the first text that does not round-trip or that
    encodes to a special id."""
    n = nbytes = ntok = 0
    for name, text in items:
        ids = tok.encode(text).ids
        if ids and min(ids) < len(SPECIAL_TOKENS):
            raise TokenizerError(f"round-trip check: {name} encodes to a special token id")
        back = tok.decode(ids, skip_special_tokens=False)
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            raise TokenizerError(
                f"round-trip check failed on {name} at character {at}: "
                f"{text[max(0, at - 20):at + 20]!r} came back as {back[max(0, at - 20):at + 20]!r}"
            )
        n += 1
        nbytes += len(text.encode("utf-8"))
        ntok += len(ids)
    return n, nbytes, ntok


def train_tokenizer(cfg: TokenizerConfig, docs_path: str | Path, out_path: str | Path,
                    report_path: str | Path | None = None) -> dict:
    """Train on a sample of ``docs_path``, verify, write ``out_path`` atomically.

    Returns metrics: vocab_size (actual; smaller than asked when the sample has too
    few distinct pairs), bytes_per_token on the held-out docs (on the sample when
    the corpus is too small to hold any out), sample_bytes, train_seconds,
    total_seconds. The report, written to ``report_path`` when given, holds
    vocab_size_requested, corpus_docs/bytes, sample_docs, heldout_docs/bytes,
    bytes_per_token_on ("heldout" or "sample"), roundtrip_ok, roundtrip_docs and
    the sha256 of ``out_path``.
    Raises TokenizerError on missing input, an empty corpus or a failed round-trip;
    ``out_path`` is then left as it was.
    """
    t0 = time.perf_counter()
    docs_path, out_path = Path(docs_path), Path(out_path)
    sample_mask, heldout_mask, stats = choose_sample(docs_path, cfg.sample_bytes, cfg.eval_bytes, cfg.seed)
    sample, heldout = _read_rows(docs_path, sample_mask, heldout_mask)
    texts = [t or "" for _, t in sample]
    if len(texts) == 1 and len(texts[0].encode("utf-8")) > cfg.sample_bytes:
        texts = [_clip_utf8(texts[0], cfg.sample_bytes)]
    sample_bytes = sum(len(t.encode("utf-8")) for t in texts)
    log.info("training BPE (vocab %d) on %d docs, %.1f MB of %d docs, %.1f MB",
             cfg.vocab_size, len(texts), sample_bytes / 1e6, stats["corpus_docs"], stats["corpus_bytes"] / 1e6)

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
    special_ids(tok)
    tok.encode_special_tokens = True

    probes = ((f"probe {i}", s) for i, s in enumerate(ROUNDTRIP_PROBES))
    check_roundtrip(tok, probes)
    measured_on = "heldout" if heldout else "sample"
    check_set = heldout or sample[:max(1, len(sample) // 10)]
    n_check, check_bytes, check_tokens = check_roundtrip(tok, ((f"document {i!r}", t or "") for i, t in check_set))

    with atomic_write(out_path) as f:
        f.write(tok.to_str(pretty=True))
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
