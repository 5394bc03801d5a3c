"""One long text file as a corpus: ingest (split_by: chunk), clean, tokenizer and
pack on a 1.2 MB book made here, checked end to end against the text itself.

The book is generated prose: chapters, wrapped paragraphs, blank-line runs of
one to four lines, and one chunk with a 'lorem ipsum' line that clean drops.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import parse_section
from pipeline.data.clean import CleanConfig, NormaliseConfig, normalise, run_clean
from pipeline.data.docs import DocTable
from pipeline.data.ingest import IngestConfig, run_ingest
from pipeline.data.executor import ExecutorConfig
from pipeline.data.pack import PackConfig, plan_splits, run_pack
from pipeline.data.shards import MANIFEST, PackedRows
from pipeline.data.tokenizer import (
    EOT_ID,
    TokenizerConfig,
    adopt_tokenizer,
    load_specials,
    load_tokenizer,
    train_tokenizer,
)
from pipeline.errors import StageError
from pipeline.files import read_json
from tests.pipeline.data.test_pack import packed_files

CHUNK_BYTES = 16_384
MAX_DOC_BYTES = 200_000  # the book is six times larger: chunking must not skip it
SEQ_LEN = 127
ROW = SEQ_LEN + 1
PACK = PackConfig(seq_len=SEQ_LEN, val_fraction=0.1, seed=1, num_workers=1, task_bytes=40_000)

WORDS = ("the of and to a in that it was he she they his her for on with as at by from had not but all were "
         "when there one which said out into would more been then over some what up about only time could like "
         "river house garden morning evening letter window road winter summer old young long little great "
         "light dark door table voice hand eyes heart night day year town hill field ship sea naïve café "
         "walked spoke looked turned waited heard knew thought found left came went gave told asked answered "
         "quietly slowly again never always already perhaps before after between under behind across").split()


def make_book(target_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    size = chapter = 0
    while size < target_bytes:
        if chapter == 0 or rng.random() < 0.03:
            chapter += 1
            out.append(f"CHAPTER {chapter}\n\n\n")
        sentences = []
        for _ in range(rng.randint(2, 7)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 18))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!", " —"]))
        para, line = [], ""
        for word in " ".join(sentences).split():  # wrapped at 72 columns, as plain-text books are
            if line and len(line) + 1 + len(word) > 72:
                para.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        para.append(line)
        if rng.random() < 0.05:
            para = ["    " + p for p in para]  # an indented quotation
        text = "\n".join(para) + "\n" + "\n" * rng.choice([1, 1, 1, 1, 2, 4])
        out.append(text)
        size += len(text.encode())
    book = "".join(out)
    mid = book.index("\n\n", len(book) // 2) + 2
    return book[:mid] + "lorem ipsum dolor sit amet\n" + book[mid:]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    d = tmp_path_factory.mktemp("book")
    path = d / "book.txt"
    path.write_text(make_book(1_200_000), encoding="utf-8")
    ingest = parse_section(IngestConfig, {
        "sources": [{"path": path.name, "split_by": "chunk", "chunk_bytes": CHUNK_BYTES}],
        "max_doc_bytes": MAX_DOC_BYTES, "max_bytes": None}, "ingest")
    # A chunk's id hashes its file's path as given, and the split hashes the id: a
    # relative path keeps the train/val layout the tests below rely on the same in
    # every temporary folder.
    cwd = os.getcwd()
    os.chdir(d)
    try:
        ingest_metrics = run_ingest(ingest, d / "ingest", d / "ingest-quarantine.jsonl")
    finally:
        os.chdir(cwd)
    clean_metrics = run_clean(CleanConfig(num_workers=1), d / "ingest", d / "clean",
                              d / "quarantine.jsonl", d / "clean-report.json")
    train_tokenizer(TokenizerConfig(vocab_size=512, sample_bytes=400_000, eval_bytes=50_000), d / "clean",
                    d / "tokenizer.json")
    run_pack(PACK, d / "clean", d / "tokenizer.json", d / "packed")
    return {"dir": d, "path": path, "ingest": ingest_metrics, "clean": clean_metrics,
            "chunks": [r for f in DocTable(d / "ingest", StageError).files for r in pq.read_table(f).to_pylist()],
            "kept": [r for f in DocTable(d / "clean", StageError).files for r in pq.read_table(f).to_pylist()],
            "tok": load_tokenizer(d / "tokenizer.json")}


def runs(book, cfg: PackConfig = PACK) -> dict[str, list[list[dict]]]:
    """The surviving chunks of each split, grouped into runs of consecutive chunks."""
    plan = plan_splits(DocTable(book["dir"] / "clean", StageError), cfg.seed, cfg.val_fraction, val_by=cfg.val_by)
    out: dict[str, list[list[dict]]] = {"train": [], "val": []}
    for c in book["kept"]:
        split = out[plan.split_of(c["id"], c["source"], c["chunk"])]
        if split and split[-1][-1]["chunk"] == c["chunk"] - 1:
            split[-1].append(c)
        else:
            split.append([c])
    return out


def flat_rows(packed, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All rows of a split back to back, and their segment ids."""
    rows = PackedRows(packed / split)
    index = np.arange(len(rows))
    return rows.input_ids(index).reshape(-1), rows.segment_ids(index).reshape(-1)


def check_round_trip(book, packed, cfg: PackConfig = PACK) -> dict[str, list[list[dict]]]:
    """Decoding each split's rows in order gives back its surviving chunks' text:
    one EOT after each run of consecutive chunks, none inside a run. What the rows
    lack is the split's last ``dropped_tail_tokens`` (< one row): the end of its
    last run and the EOT after it. Returns the runs."""
    tok, manifest = book["tok"], read_json(packed / MANIFEST)
    by_split = runs(book, cfg)
    for split, split_runs in by_split.items():
        flat, _ = flat_rows(packed, split)
        texts = ["".join(c["text"] for c in run) for run in split_runs]
        segments = np.split(flat, np.flatnonzero(flat == EOT_ID) + 1)
        assert [tok.decode(s[:-1].tolist()) for s in segments[:-1]] == texts[:-1]  # all runs but the last
        assert len(segments) == len(texts)  # the tail lies in the last run
        last_run = [t for c in split_runs[-1] for t in tok.encode(c["text"]).ids] + [EOT_ID]
        tail = manifest["splits"][split]["dropped_tail_tokens"]
        assert 0 < tail < ROW and segments[-1].tolist() + last_run[len(last_run) - tail:] == last_run
        assert tok.decode(last_run[:-1]) == texts[-1]
        assert manifest["splits"][split]["joined"] == sum(len(run) - 1 for run in split_runs)
    return by_split


def boundaries(book, split_runs) -> list[tuple[int, bool]]:
    """Stream position of the first token of every surviving chunk but the split's
    first, and whether it continues the chunk before (same run)."""
    tok, pos, out = book["tok"], 0, []
    for i, run in enumerate(split_runs):
        for j, c in enumerate(run):
            if i or j:
                out.append((pos, j > 0))
            pos += len(tok.encode(c["text"]).ids)
        pos += 1  # the run's EOT
    return out


def test_one_text_file_goes_through_pack_with_train_and_val(book):
    assert book["path"].stat().st_size > MAX_DOC_BYTES  # never skipped for its size
    assert book["ingest"]["skipped"] == 0 and book["ingest"]["docs"] == len(book["chunks"]) > 60
    manifest = read_json(book["dir"] / "packed" / MANIFEST)
    assert manifest["splits"]["train"]["rows"] > 0 and manifest["splits"]["val"]["rows"] > 0
    assert manifest["forced"] == {}  # the val split is the rule's own, not a tiny-corpus fallback
    assert manifest["docs"] == len(book["kept"]) == len(book["chunks"]) - 1


def test_rows_decode_to_the_surviving_chunks_text(book):
    by_split = check_round_trip(book, book["dir"] / "packed")
    assert len(by_split["val"]) >= 3 and len(by_split["train"]) >= 4
    # the chunks join back into the text: blank lines and paragraph breaks are in it
    train = "".join(c["text"] for run in by_split["train"] for c in run)
    assert "\n\n\nCHAPTER" in train and ".\n\n" in train


def test_consecutive_chunks_are_one_segment(book):
    by_split = runs(book)
    for split in ("train", "val"):
        flat, seg = flat_rows(book["dir"] / "packed", split)
        for pos, continues in boundaries(book, by_split[split]):
            if pos >= len(flat):
                break
            if continues:
                assert flat[pos - 1] != EOT_ID
                assert pos % ROW == 0 or seg[pos] == seg[pos - 1]  # a row start is a segment start anyway
            else:
                assert flat[pos - 1] == EOT_ID and (pos % ROW == 0 or seg[pos] == seg[pos - 1] + 1)
    joined = sum(continues for pos, continues in boundaries(book, by_split["train"]))
    assert joined > 40


def test_a_dropped_chunk_breaks_contiguity_there(book):
    kept = {c["chunk"] for c in book["kept"]}
    (dropped,) = [c for c in book["chunks"] if c["chunk"] not in kept]
    assert "lorem ipsum" in dropped["text"]
    k = dropped["chunk"]
    train = runs(book)["train"]
    before = next(i for i, run in enumerate(train) if run[-1]["chunk"] == k - 1)
    assert train[before + 1][0]["chunk"] == k + 1  # both neighbours are in train, in two runs
    flat, seg = flat_rows(book["dir"] / "packed", "train")
    boundary = [p for p, continues in boundaries(book, train) if not continues][before]  # chunk k + 1 begins
    assert boundary % ROW
    assert flat[boundary - 1] == EOT_ID and seg[boundary] == seg[boundary - 1] + 1


def test_a_val_chunk_inside_the_file_splits_train_on_both_sides(book):
    by_split = runs(book)
    inner = [run for run in by_split["val"] if run[0]["chunk"] > 0 and run[-1]["chunk"] < book["kept"][-1]["chunk"]]
    assert inner
    train_runs = by_split["train"]
    ends = {run[-1]["chunk"] for run in train_runs}
    starts = {run[0]["chunk"] for run in train_runs}
    for run in inner:
        assert run[0]["chunk"] - 1 in ends and run[-1]["chunk"] + 1 in starts


def test_split_by_position_holds_out_the_end_of_the_text(book, tmp_path):
    cfg = PACK.model_copy(update={"val_by": "position"})
    run_pack(cfg, book["dir"] / "clean", book["dir"] / "tokenizer.json", tmp_path)
    by_split = check_round_trip(book, tmp_path, cfg)
    assert len(by_split["val"]) == 1 and len(by_split["train"]) == 2  # one cut: the dropped chunk
    val = by_split["val"][0]
    assert val[-1]["chunk"] == book["kept"][-1]["chunk"]
    val_bytes = sum(len(c["text"].encode()) for c in val)
    total = sum(len(c["text"].encode()) for c in book["kept"])
    assert abs(val_bytes / total - 0.1) < CHUNK_BYTES / total


def test_results_are_identical_for_one_and_two_workers(book, tmp_path):
    d = book["dir"]
    metrics = run_clean(CleanConfig(num_workers=2, batch_docs=8), d / "ingest", tmp_path / "clean",
                        tmp_path / "quarantine.jsonl", tmp_path / "clean-report.json")
    assert metrics["workers"] == 2
    assert pq.read_table(tmp_path / "clean" / "shard-00000.parquet").equals(pq.read_table(d / "clean" / "shard-00000.parquet"))
    assert (tmp_path / "quarantine.jsonl").read_bytes() == (d / "quarantine.jsonl").read_bytes()
    assert read_json(tmp_path / "clean-report.json") == read_json(d / "clean-report.json")
    cfg = PACK.model_copy(update={"executor": ExecutorConfig(num_workers=2), "task_bytes": 1000})  # a task per chunk: every join crosses one
    run_pack(cfg, tmp_path / "clean", d / "tokenizer.json", tmp_path / "packed")
    files = packed_files(d / "packed")
    assert len(files) == 3
    for f in files:
        assert (tmp_path / "packed" / f).read_bytes() == (d / "packed" / f).read_bytes(), f


def test_every_chunk_is_accounted_for_and_the_quarantine_names_file_and_offset(book):
    d = book["dir"]
    report = read_json(d / "clean-report.json")
    assert report["docs_in"] == len(book["chunks"]) == book["clean"]["docs"] + sum(report["dropped"].values())
    assert {k: v for k, v in report["dropped"].items() if v} == {"c4_lorem_ipsum": 1}
    (q,) = [json.loads(line) for line in (d / "quarantine.jsonl").read_text().splitlines()]
    assert q["source"] == book["path"].name and q["location"].startswith("byte:")
    offset = int(q["location"].removeprefix("byte:"))
    data = book["path"].read_bytes()
    assert data[offset:].decode().startswith(q["text"][:200]) and (offset == 0 or data[offset - 1:offset] == b"\n")
    # clean changed what it would change in the whole text (blank-line runs over two),
    # since a run of blank lines is never cut between chunks
    joined = "".join(c["text"] for c in book["kept"] if c["chunk"] < 20)
    raw = "".join(c["text"] for c in book["chunks"] if c["chunk"] < 20)
    assert joined == normalise(raw, NormaliseConfig(strip_blank_edges=False)) != raw


@pytest.mark.parametrize("layout", ["prepend-normalizer", "metaspace", "llama3"])
def test_chunks_pack_as_the_text_with_a_tokenizer_that_adds_to_every_text(tmp_path, layout):
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's layout) puts '▁'
    and <s> before every text it encodes, Llama 3's <|begin_of_text|>. A chunk
    after the first continues its file's text after a newline, so it gets
    neither: each split's document has the ids of its text encoded in one
    piece, and decodes back to it exactly."""
    from tests.hf_tokenizers import save_family_tokenizer, sentencepiece_tokenizer

    book = make_book(3_000, seed=2)
    (tmp_path / "book.txt").write_text(book, encoding="utf-8")
    ingest = parse_section(IngestConfig, {
        "sources": [{"path": str(tmp_path / "book.txt"), "split_by": "chunk", "chunk_bytes": 300}],
        "max_bytes": None}, "ingest")
    run_ingest(ingest, tmp_path / "ingest", tmp_path / "quarantine.jsonl")
    chunks = [r for f in DocTable(tmp_path / "ingest", StageError).files for r in pq.read_table(f).to_pylist()]
    assert len(chunks) > 8 and "".join(c["text"] for c in chunks) == book
    hf = tmp_path / "hf"
    if layout == "llama3":
        save_family_tokenizer("llama3", hf, corpus=[book])
    else:
        hf.mkdir()
        sentencepiece_tokenizer([book], metaspace=layout == "metaspace").save(str(hf / "tokenizer.json"))
    adopt_tokenizer(TokenizerConfig(source=str(hf)), tmp_path / "no-docs", tmp_path / "tok" / "tokenizer.json")
    tok, eot = load_tokenizer(tmp_path / "tok" / "tokenizer.json"), load_specials(tmp_path / "tok").eot_id
    begins = ["<|begin_of_text|>", "H"] if layout == "llama3" else ["<s>", "\u2581"]  # and a dummy prefix
    assert tok.encode("H").tokens[:2] == begins

    cfg = PackConfig(seq_len=15, val_fraction=0.3, val_by="position", num_workers=1)
    run_pack(cfg, tmp_path / "ingest", tmp_path / "tok" / "tokenizer.json", tmp_path / "packed")
    plan = plan_splits(DocTable(tmp_path / "ingest", StageError), cfg.seed, cfg.val_fraction, val_by="position")
    (first_val,) = plan.first_val_chunk.values()
    assert 3 <= first_val <= len(chunks) - 3  # chunk boundaries inside both splits
    cut = sum(len(c["text"]) for c in chunks if c["chunk"] < first_val)
    newline = tok.encode("\n").ids
    # train: the file's first chunks, as the text's start encodes; val: the rest, as it encodes after a
    # newline (no <s> either: a chunk that continues its file is not the start of a text)
    rest = (tok.encode(book[cut:], add_special_tokens=False).ids if layout == "llama3"
            else tok.encode("\n" + book[cut:]).ids[len(newline):])
    for split, text, ids in (("train", book[:cut], tok.encode(book[:cut]).ids), ("val", book[cut:], rest)):
        flat, _ = flat_rows(tmp_path / "packed", split)
        assert flat.tolist() == (ids + [eot])[:len(flat)]  # one document, the rows drop less than a row of it
        assert len(ids) + 1 - len(flat) <= cfg.seq_len
        assert tok.decode(ids) == text  # so the packed document decodes to the file's text
    # the same bytes with two workers and tasks of a few chunks (joins cross tasks)
    two = run_pack(cfg.model_copy(update={"executor": ExecutorConfig(num_workers=2), "task_bytes": 1000}),
                   tmp_path / "ingest", tmp_path / "tok" / "tokenizer.json", tmp_path / "two")
    assert two["workers"] == 2
    for f in packed_files(tmp_path / "packed"):
        assert (tmp_path / "two" / f).read_bytes() == (tmp_path / "packed" / f).read_bytes(), f
