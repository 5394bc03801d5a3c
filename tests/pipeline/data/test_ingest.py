import itertools
import json
import lzma
import os
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, parse_section
from pipeline.data.compressed import COMPRESSIONS, open_input
from pipeline.data.docs import DocTable
from pipeline.data.ingest import IngestConfig, IngestError, doc_id, resolve_sources, run_ingest, split_text
from pipeline.files import read_json


def cfg(**kw):
    return parse_section(IngestConfig, kw, "ingest")


def read_docs(folder) -> pa.Table:
    """A documents folder's shards, in its manifest's order, as one table."""
    return pa.concat_tables([pq.read_table(f) for f in DocTable(folder, IngestError).files])


def folder_bytes(folder) -> dict[str, bytes]:
    """Every file of a folder (shards, records, manifest) by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def run(tmp_path, **kw):
    out, q = tmp_path / "out" / "docs", tmp_path / "out" / "quarantine.jsonl"
    metrics = run_ingest(cfg(**kw), out, q, tmp_path / "out" / "report.json")
    table = read_docs(out)
    quarantine = [json.loads(line) for line in q.read_text().splitlines()]
    return metrics, table.to_pylist(), quarantine


def report(tmp_path):
    return read_json(tmp_path / "out" / "report.json")


def compress(path, codec: str) -> Path:
    """``path`` compressed with ``codec`` beside it (its name plus the codec's suffix), as the tools that make
    corpora write it: pyarrow's codecs, Python's lzma for xz."""
    suffix = next(s for s, c in COMPRESSIONS.items() if c == codec)
    out = Path(str(path) + suffix)
    if codec == "xz":
        out.write_bytes(lzma.compress(Path(path).read_bytes()))
    else:
        with pa.CompressedOutputStream(str(out), codec) as f:
            f.write(Path(path).read_bytes())
    return out


def test_text_split_modes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\ntwo\n\n\nthree\n")
    _, docs, _ = run(tmp_path, sources=[{"path": str(f)}])
    assert [d["text"] for d in docs] == ["one\ntwo\n\n\nthree\n"]
    _, docs, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "paragraph"}])
    assert [(d["text"], d["location"]) for d in docs] == [("one\ntwo", "para:1"), ("three", "para:5")]
    _, docs, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "line"}])
    assert [(d["text"], d["location"]) for d in docs] == [("one", "line:1"), ("two", "line:2"), ("three", "line:5")]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_lines_and_paragraphs_end_at_every_kind_of_line_end(tmp_path, newline):
    """Text files and record values split by line or paragraph the same way
    whether their lines end in LF, CRLF or a lone CR (old Mac OS text): before,
    a lone-CR file was one line (one document, or a too_large skip of the whole
    file), and a CRLF record value's lines kept their CR."""
    text = newline.join(["one", "two", "", "", "three", ""])
    f = tmp_path / "a.txt"
    f.write_bytes(text.encode())
    _, docs, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "paragraph"}])
    assert [(d["text"], d["location"]) for d in docs] == [("one\ntwo", "para:1"), ("three", "para:5")]
    _, docs, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "line"}])
    assert [(d["text"], d["location"]) for d in docs] == [("one", "line:1"), ("two", "line:2"), ("three", "line:5")]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": text}) + "\n")
    _, docs, _ = run(tmp_path, sources=[{"path": str(rows), "split_by": "line"}])
    assert [d["text"] for d in docs] == ["one", "two", "three"]
    _, docs, _ = run(tmp_path, sources=[{"path": str(rows), "split_by": "paragraph"}])
    assert [d["text"] for d in docs] == ["one\ntwo", "three"]


def test_a_crlf_split_across_reads_is_one_line_end(tmp_path):
    """A CRLF whose CR ends one buffer of the reader and whose LF begins the next
    is still one line end, not a line and a blank line."""
    f = tmp_path / "a.txt"
    first = "x" * 8191  # with its CR, exactly 8 KiB: the text layer's buffer
    f.write_bytes(f"{first}\r\nsecond\r\n".encode())
    _, docs, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "line"}])
    assert [(d["text"], d["location"]) for d in docs] == [(first, "line:1"), ("second", "line:2")]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_lines_and_paragraphs_are_measured_by_their_own_text(tmp_path, newline):
    """A line or paragraph of max_doc_bytes of text is a document, one byte more a
    too_large skip that says its size: line ends are not the document's (a
    paragraph's lines are joined with one \\n, whatever ended them in the file).
    Before, a line's end counted, and each CRLF twice, so a document that fit was skipped."""
    f = tmp_path / "a.txt"
    f.write_bytes(newline.join(["0123456789", "", "01234", "5678", "", "01234", "56789", "", "abcdefghijk", ""]).encode())
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(f), "split_by": "line"}], max_doc_bytes=10)
    assert [d["text"] for d in docs] == ["0123456789", "01234", "5678", "01234", "56789"]
    assert [(q["location"], q["detail"]) for q in quarantine] == [("line:9", "11 bytes > max_doc_bytes=10")]
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(f), "split_by": "paragraph"}], max_doc_bytes=10)
    assert [d["text"] for d in docs] == ["0123456789", "01234\n5678"]
    assert [(q["location"], q["detail"]) for q in quarantine] == [("para:6", "11 bytes > max_doc_bytes=10"),
                                                                  ("para:9", "11 bytes > max_doc_bytes=10")]


def test_a_paragraph_that_runs_on_is_not_held_whole(tmp_path):
    """A text file read by paragraph that has no blank line (a log) is one
    too_large paragraph: it is streamed, and its sample holds its beginning."""
    import tracemalloc

    from pipeline.data import ingest

    f = tmp_path / "log.txt"
    f.write_bytes(b"".join(b"%07d " % i + b"x" * 92 + b"\n" for i in range(40_000)))  # 4 MB, one paragraph
    c = cfg(sources=[{"path": str(f), "split_by": "paragraph"}], max_doc_bytes=1000)
    tracemalloc.start()
    try:
        items = list(ingest.read_items(resolve_sources(c)[0], c))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(type(i).__name__, i.location, i.detail) for i in items] == \
        [("Skip", "para:1", f"{40_000 * 101 - 1} bytes > max_doc_bytes=1000")]  # 100 a line, and the \\n joins
    assert items[0].text.startswith("0000000 xxx") and len(items[0].text) < 1200
    assert peak < 1_000_000  # the whole paragraph would be 4 MB of text alone


def test_split_text_record_prefix():
    assert list(split_text("a\n\nb", "paragraph", "row:3")) == [("row:3#para:1", "a"), ("row:3#para:3", "b")]


def test_a_record_splits_at_blank_lines_which_are_no_documents_and_a_paragraph_is_named_by_its_first_line():
    text = "a\n  \t\nb\nc\n\n\nd"
    assert list(split_text(text, "line", "row:3")) == [("row:3#line:1", "a"), ("row:3#line:3", "b"),
                                                       ("row:3#line:4", "c"), ("row:3#line:7", "d")]
    assert list(split_text(text, "paragraph")) == [("para:1", "a"), ("para:3", "b\nc"), ("para:7", "d")]
    assert list(split_text(text, "file")) == [("file", text)]


def test_every_bad_input_is_a_counted_skip(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "good.txt").write_text("hello world")
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (d / "huge.txt").write_text("x" * (5 * 1024 * 1024))  # a single 5 MB line
    rows = [
        json.dumps({"text": "a fine record"}),
        '{"text": "unterminated',
        "[1, 2, 3]",
        json.dumps({"body": "wrong field"}),
        json.dumps({"text": 42}),
        json.dumps({"text": "   "}),
        json.dumps({"text": "y" * (5 * 1024 * 1024)}),
    ]
    data = ("\n".join(rows) + "\n").encode() + b'{"text": "bad \xff byte"}\n'
    (d / "recs.jsonl").write_bytes(data)
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(d)}], max_doc_bytes=1_000_000)

    assert sorted(x["text"] for x in docs) == ["a fine record", "hello world"]
    assert report(tmp_path)["skipped"] == {
        "bad_type": 1,
        "binary": 1,
        "empty_file": 1,
        "empty_text": 1,
        "malformed_json": 2,
        "missing_field": 1,
        "non_utf8": 2,
        "too_large": 2,
    }
    # accounting: 5 files of one record each + 8 JSONL records = docs + skips
    assert metrics["docs"] + sum(report(tmp_path)["skipped"].values()) == 5 + 8
    assert metrics["skipped"] == 11
    reasons = {(q["source"].rsplit("/", 1)[-1], q["reason"]) for q in quarantine}
    assert ("latin1.txt", "non_utf8") in reasons and ("huge.txt", "too_large") in reasons
    assert all(len(q.get("text", "")) <= 2000 for q in quarantine)  # quarantine stays small


def test_a_document_of_max_doc_bytes_is_kept_one_byte_more_is_too_large_and_whitespace_is_empty(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "fits.txt").write_text("x" * 20)
    (d / "over.txt").write_text("y" * 21)
    (d / "blank.txt").write_text(" \n\t\n")
    pq.write_table(pa.table({"text": ["z" * 20, "w" * 21, " \n "]}), d / "rows.parquet")
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(d)}], max_doc_bytes=20)
    assert sorted(doc["text"] for doc in docs) == ["x" * 20, "z" * 20]
    assert sorted((q["reason"], q["source"].rsplit("/", 1)[-1], q["location"]) for q in quarantine) == [
        ("empty_text", "blank.txt", "file"), ("empty_text", "rows.parquet", "row:2"),
        ("too_large", "over.txt", "file"), ("too_large", "rows.parquet", "row:1")]


def test_a_null_text_is_a_missing_field_skip_that_says_it_is_null(tmp_path):
    """A field that is there with a null value was a skip with no detail, unlike a field that is absent."""
    (tmp_path / "a.jsonl").write_text('{"text": null}\n{"body": "x"}\n{"text": "kept"}\n')
    pq.write_table(pa.table({"text": pa.array([None, "kept too"], pa.string())}), tmp_path / "b.parquet")
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "a.jsonl")},
                                                 {"path": str(tmp_path / "b.parquet")}])
    assert [d["text"] for d in docs] == ["kept", "kept too"]
    assert [(q["reason"], q["location"], q["detail"]) for q in quarantine] == [
        ("missing_field", "line:1", "the value is null"), ("missing_field", "line:2", "no field 'text'"),
        ("missing_field", "row:0", "the value is null")]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_text_is_a_binary_skip_that_says_what_it_is(tmp_path, encoding):
    """Windows tools write UTF-16 with a byte-order mark: its NUL bytes make it a
    binary skip, whose detail names the encoding and the conversion."""
    (tmp_path / "notes.txt").write_bytes("hello from Notepad".encode(encoding))  # Python writes the BOM
    (tmp_path / "ok.txt").write_text("hello world")
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "*.txt")}])
    assert [d["text"] for d in docs] == ["hello world"]
    name = encoding.upper()
    assert [(q["reason"], q["detail"]) for q in quarantine] == [
        ("binary", f"NUL byte in the first 8 KiB: {name} text by its byte-order mark; convert it to UTF-8 "
                   f"(iconv -f {name} -t UTF-8)")]


@pytest.mark.parametrize("pattern", ["", "/*"], ids=["folder", "glob"])
def test_entries_that_are_not_files_are_counted_skips_not_lost(tmp_path, pattern):
    """A dataset folder linked into data/raw, a link whose target is gone, a FIFO
    (reading it would wait for ever): each is a counted skip that says what it is."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "linked.txt").write_text("a document in a linked folder")
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "good.txt").write_text("hello world")
    (d / "gone.txt").symlink_to(tmp_path / "moved.txt")
    (d / "dataset").symlink_to(outside)
    (d / "linked-file.txt").symlink_to(outside / "linked.txt")  # a link to a file is read
    os.mkfifo(d / "pipe.txt")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": f"{d}{pattern}"}])
    assert sorted(x["text"] for x in docs) == ["a document in a linked folder", "hello world"]
    expected = {"gone.txt": f"a symbolic link to {tmp_path / 'moved.txt'}, which does not exist",
                "pipe.txt": "a FIFO, not a regular file"}
    if not pattern:  # a glob's ** would go into the linked folder; "*" matches it as a folder
        expected["dataset"] = ("a symbolic link to a folder, which is not read: DVC does not look into it, so a "
                               "rerun would not see its files change; link the files, or list the folder as a source "
                               "of its own")
    assert {q["source"].rsplit("/", 1)[-1]: q["detail"] for q in quarantine} == expected
    assert all(q["reason"] == "not_a_file" for q in quarantine)
    assert report(tmp_path)["skipped"] == {"not_a_file": len(expected)}
    assert metrics["files"] == 2 + len(expected)


@pytest.mark.parametrize("pattern", ["", "/*"], ids=["folder", "glob"])
def test_a_loop_of_links_is_a_counted_skip_not_a_traceback(tmp_path, pattern):
    """Links that point at each other cannot be resolved (Python raises on the
    loop): each is a not_a_file skip that says so, and the rest is read."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "good.txt").write_text("hello world")
    (d / "loop1").symlink_to("loop2")
    (d / "loop2").symlink_to("loop1")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": f"{d}{pattern}"}])
    assert [x["text"] for x in docs] == ["hello world"]
    assert {q["source"].rsplit("/", 1)[-1]: q["detail"] for q in quarantine} == {
        "loop1": "a symbolic link to loop2, which leads back to itself (a loop of links)",
        "loop2": "a symbolic link to loop1, which leads back to itself (a loop of links)"}
    assert report(tmp_path)["skipped"] == {"not_a_file": 2}
    assert metrics["files"] == 3


def refuse_listing(monkeypatch, folder: Path) -> None:
    """``os.scandir`` (which os.walk and glob use) refuses ``folder`` as a folder
    without read permission does; simulated, since the tests may run as root."""
    scandir = os.scandir

    def refusing(path="."):
        if Path(path) == folder:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)


@pytest.mark.parametrize("fmt", ["auto", "text"])
@pytest.mark.parametrize("pattern", ["", "/**/*.txt", "/*/*.txt", "/**"],
                         ids=["folder", "recursive-glob", "glob", "recursive-glob-of-all"])
def test_a_folder_that_cannot_be_listed_is_a_counted_skip_not_lost(tmp_path, monkeypatch, pattern, fmt):
    """A sub-folder without read permission: os.walk and glob pass over it in
    silence, so its files would be lost without a word. It is a not_a_file skip
    that says why. (The refusal is simulated: the tests may run as root.)"""
    d = tmp_path / "corpus"
    (d / "open").mkdir(parents=True)
    (d / "locked").mkdir()
    (d / "open" / "a.txt").write_text("hello world")
    (d / "locked" / "b.txt").write_text("never read")
    refuse_listing(monkeypatch, d / "locked")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": f"{d}{pattern}", "format": fmt}])
    assert [x["text"] for x in docs] == ["hello world"]
    assert [(q["reason"], q["source"].rsplit("/", 1)[-1], q["detail"]) for q in quarantine] == [
        ("not_a_file", "locked", "a folder that cannot be listed (Permission denied), so none of its files were read")]
    assert metrics["skipped"] == 1


def test_a_glob_does_not_count_folders_it_would_not_enter(tmp_path, monkeypatch):
    """Only the folders a pattern leads into are checked: a locked folder that
    the pattern's parts do not match is none of its business."""
    d = tmp_path / "corpus"
    (d / "web").mkdir(parents=True)
    (d / "private").mkdir()
    (d / "web" / "a.txt").write_text("hello world")
    refuse_listing(monkeypatch, d / "private")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": f"{d}/web*/*.txt"}])
    assert [x["text"] for x in docs] == ["hello world"] and quarantine == [] and metrics["skipped"] == 0


@pytest.mark.parametrize("folder", ["typo", "a.txt"], ids=["missing", "a-file"])
def test_a_glob_under_a_folder_that_is_not_there_matches_no_files(tmp_path, folder):
    """A glob whose folder before the wildcard is missing (a typo) or a file
    fails with "matched no files", alone or beside another source: before, the
    folder was listed as one that could not be listed, a not_a_file skip ("no
    longer exists") of a source that then gave no documents, and a file there
    was read as the glob's one match."""
    (tmp_path / "a.txt").write_text("a document")
    bad = f"{tmp_path}/{folder}/*.jsonl"
    for sources in ([{"path": bad}], [{"path": str(tmp_path / "a.txt"), "name": "good"}, {"path": bad}]):
        with pytest.raises(IngestError, match=rf"ingest\.sources\.{len(sources) - 1}\.path: .* matched no files"):
            resolve_sources(cfg(sources=sources))


def test_a_file_removed_after_it_was_listed_is_a_counted_skip(tmp_path, monkeypatch):
    from pipeline.data import ingest

    d = tmp_path / "corpus"
    d.mkdir()
    for name in ("a.txt", "b.txt"):
        (d / name).write_text(f"the text of {name}")
    listed = ingest.resolve_sources

    def then_one_goes(cfg):
        files = listed(cfg)
        (d / "b.txt").unlink()  # as a sync or a rotation may, while the stage starts
        return files

    monkeypatch.setattr(ingest, "resolve_sources", then_one_goes)
    monkeypatch.setattr(ingest, "not_a_file", lambda path: None)  # past that check too: the race at its worst
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(d)}])
    assert [x["text"] for x in docs] == ["the text of a.txt"]
    assert [(q["reason"], q["source"].rsplit("/", 1)[-1]) for q in quarantine] == [("unreadable", "b.txt")]
    assert "No such file or directory" in quarantine[0]["detail"]


def test_a_bad_record_deep_in_a_file_costs_its_own_rows_only(tmp_path):
    # CSV: an invalid byte past the reader's first block (1 MB), in the text column and in another one.
    rows = [f"row {i} fine,x" for i in range(120_000)]
    (tmp_path / "big.csv").write_bytes(("text,other\n" + "\n".join(rows[:100_000])).encode()
                                       + b"\nbad \xff byte,x\nfine,bad \xff other\n" + "\n".join(rows[100_000:]).encode())
    # Parquet: the second of three row groups damaged (a value's length overwritten).
    texts = [f"parquet document {i:04d}" for i in range(300)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "p.parquet", compression="none", use_dictionary=False,
                   row_group_size=100)
    data = bytearray((tmp_path / "p.parquet").read_bytes())
    at = data.index(b"parquet document 0150")
    data[at - 4:at] = b"\xff\xff\xff\x7f"
    (tmp_path / "p.parquet").write_bytes(bytes(data))
    # JSON: a lone surrogate escape (valid JSON, no UTF-8 form) and nesting too deep to parse.
    (tmp_path / "r.jsonl").write_text("\n".join([json.dumps({"text": "before"}), '{"text": "lone \\ud800 half"}',
                                                 "[" * 100_000 + "]" * 100_000, json.dumps({"text": "after"})]))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)

    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in
                                                       ("big.csv", "p.parquet", "r.jsonl", "deep.json")])
    texts_out = [d["text"] for d in docs]
    assert texts_out[:100_000] == [f"row {i} fine" for i in range(100_000)]
    assert texts_out[100_000:120_001] == ["fine"] + [f"row {i} fine" for i in range(100_000, 120_000)]
    assert docs[100_000]["location"] == "row:100001"  # the rows after a skipped one keep their numbers
    assert texts_out[120_001:] == texts[:100] + texts[200:] + ["before", "after"]
    assert report(tmp_path)["skipped"] == {"non_utf8": 2, "unreadable": 100, "malformed_json": 2}
    assert metrics["docs"] + metrics["skipped"] == 120_002 + 300 + 4 + 1  # every record accounted for
    where = {(q["source"].rsplit("/", 1)[-1], q["location"]): q["reason"] for q in quarantine}
    assert where == {("big.csv", "row:100000"): "non_utf8", ("p.parquet", "row:100"): "unreadable",
                     ("r.jsonl", "line:2"): "non_utf8", ("r.jsonl", "line:3"): "malformed_json",
                     ("deep.json", "file"): "malformed_json"}


def test_an_integer_too_long_for_python_is_a_malformed_record_not_a_crash(tmp_path):
    # json.loads raises a plain ValueError past 4,300 digits, not JSONDecodeError.
    huge = '{"text": "x", "id": 1' + "0" * 5000 + "}"
    (tmp_path / "r.jsonl").write_text("\n".join([json.dumps({"text": "before"}), huge, json.dumps({"text": "after"})]))
    (tmp_path / "one.json").write_text("[" + huge + "]")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("r.jsonl", "one.json")])
    assert [d["text"] for d in docs] == ["before", "after"]
    assert report(tmp_path)["skipped"] == {"malformed_json": 2}
    assert {(q["source"].rsplit("/", 1)[-1], q["location"]) for q in quarantine} == {("r.jsonl", "line:2"),
                                                                                       ("one.json", "file")}
    assert all("4300 digits" in q["detail"] for q in quarantine)


def test_a_damaged_page_costs_the_rest_of_its_row_group_and_the_rows_before_it_are_kept(tmp_path):
    """One row group of many pages: the batches read before the damaged one are
    documents, and the skip counts exactly the rows not read, from where they start."""
    texts = [f"parquet document {i:04d}" for i in range(3000)]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": texts}), path, compression="none", use_dictionary=False, row_group_size=3000,
                   data_page_size=1024)
    data = bytearray(path.read_bytes())
    at = data.index(b"parquet document 2500")
    data[at - 4:at] = b"\xff\xff\xff\x7f"
    path.write_bytes(bytes(data))
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(path)}])
    kept = len(docs)
    assert 0 < kept <= 2500 and [d["text"] for d in docs] == texts[:kept]
    assert metrics["docs"] + metrics["skipped"] == 3000
    assert [(q["reason"], q["location"]) for q in quarantine] == [("unreadable", f"row:{kept}")]
    assert report(tmp_path)["skipped"] == {"unreadable": 3000 - kept}


def test_blank_lines_of_json_lines_are_no_records(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('\n{"text": "a"}\n\n  \n{"text": "b"}\n\n')
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(path)}])
    assert [(d["text"], d["location"]) for d in docs] == [("a", "line:2"), ("b", "line:5")]
    assert metrics["skipped"] == 0


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    (tmp_path / "b.json").write_bytes(b'\xef\xbb\xbf[{"text": "one"}, {"text": "two"}]')
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("a.jsonl", "b.json")])
    assert [d["text"] for d in docs] == ["first", "second", "one", "two"]
    assert metrics["skipped"] == 0


def test_a_json_object_is_its_own_record_or_holds_its_one_list_of_records(tmp_path):
    (tmp_path / "paper.json").write_text(json.dumps({"title": "A paper", "text": "The body.", "authors": ["A", "B"]}))
    (tmp_path / "dump.json").write_text(json.dumps({"version": "1.0", "tags": ["news"],
                                                    "data": [{"text": "d1"}, {"text": "d2"}, {"text": "d3"}]}))
    (tmp_path / "two.json").write_text(json.dumps({"a": [{"text": "x"}], "b": [{"text": "y"}]}))
    (tmp_path / "strings.json").write_text(json.dumps({"version": 2, "data": ["s1", "s2"]}))  # a list, of no objects
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)}
                                                       for n in ("paper.json", "dump.json", "two.json", "strings.json")])
    assert [d["text"] for d in docs] == ["The body.", "d1", "d2", "d3"]
    assert [d["location"] for d in docs] == ["item:0", "item:0", "item:1", "item:2"]
    # two lists of records: which one is meant is not guessed; the file is one counted skip;
    # the one list of strings holds the records, each a counted skip of its own
    assert report(tmp_path)["skipped"] == {"missing_field": 1, "malformed_json": 2}
    assert [(q["source"].rsplit("/", 1)[-1], q["reason"], q["location"]) for q in quarantine] == [
        ("two.json", "missing_field", "item:0"), ("strings.json", "malformed_json", "item:0"),
        ("strings.json", "malformed_json", "item:1")]


def test_no_documents_says_why_in_its_one_line(tmp_path):
    """When nothing is kept the error gives an example per reason, most frequent
    first, with its file, place and detail: the cause of a 20 MB line with no
    line break was only in the quarantine file."""
    (tmp_path / "a.txt").write_text("x" * 300)
    (tmp_path / "b.txt").write_text("y" * 300)
    (tmp_path / "c.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(IngestError) as err:
        run(tmp_path, sources=[{"path": str(tmp_path / "*.txt")}], max_doc_bytes=100)
    message = str(err.value)
    assert "\n" not in message
    assert f"; e.g. too_large: {tmp_path / 'a.txt'} file (300 bytes > max_doc_bytes=100); non_utf8: " \
           f"{tmp_path / 'c.txt'} file (invalid UTF-8 at byte 0) (see " in message


def test_no_documents_gives_examples_of_the_three_most_frequent_reasons(tmp_path):
    for name, data in [("a1.txt", b"x" * 300), ("a2.txt", b"x" * 300), ("a3.txt", b"x" * 300), ("b1.txt", b"\xff"),
                       ("b2.txt", b"\xff"), ("c.txt", b" \n"), ("d.txt", b"")]:
        (tmp_path / name).write_bytes(data)
    with pytest.raises(IngestError) as err:
        run(tmp_path, sources=[{"path": str(tmp_path / "*.txt")}], max_doc_bytes=100)
    examples = str(err.value).split("; e.g. ", 1)[1]
    assert [part.split(":")[0] for part in examples.split("; ")] == ["too_large", "non_utf8", "empty_text"]


def test_json_lines_in_a_file_named_json(tmp_path):
    """format: auto reads a .json file of one object per line as JSON Lines; format: json says how to read it."""
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "lines.json")}])
    assert [(d["text"], d["location"]) for d in docs] == [("a", "line:1"), ("b", "line:2")]
    assert report(tmp_path)["skipped"] == {"malformed_json": 1} and quarantine[0]["location"] == "line:3"
    with pytest.raises(IngestError, match="no documents"):
        run(tmp_path, sources=[{"path": str(tmp_path / "lines.json"), "format": "json"}])
    written = [json.loads(line) for line in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert [q["location"] for q in written] == ["file"]
    assert written[0]["detail"].endswith("(one JSON value per line? set format: jsonl)")


@pytest.mark.parametrize("pattern", ["", "/*", "/**"])
def test_a_dataset_folder_inside_a_source_folder_is_read_as_a_dataset(tmp_path, pattern):
    import datasets

    (tmp_path / "mix" / "deep").mkdir(parents=True)
    (tmp_path / "mix" / "a.txt").write_text("plain text")
    datasets.Dataset.from_dict({"text": ["h0", "h1", "h2"]}).save_to_disk(str(tmp_path / "mix" / "hfds"))
    datasets.Dataset.from_dict({"text": ["deep"]}).save_to_disk(str(tmp_path / "mix" / "deep" / "ds"))
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "mix") + pattern}])
    expected = ["plain text", "deep", "h0", "h1", "h2"] if pattern != "/*" else ["plain text", "h0", "h1", "h2"]
    assert [d["text"] for d in docs] == expected
    assert metrics["skipped"] == 0


def test_a_glob_inside_a_folder_whose_name_starts_with_a_dot(tmp_path):
    (tmp_path / ".corpus").mkdir()
    (tmp_path / ".corpus" / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / ".corpus" / ".hidden.jsonl").write_text('{"text": "hidden"}\n')
    got = resolve_sources(cfg(sources=[{"path": str(tmp_path / ".corpus" / "*.jsonl")}]))
    assert [f.path.name for f in got] == ["a.jsonl"]  # the user's folder is named; what is below it is hidden


def test_a_file_name_that_is_not_utf8_keeps_its_documents(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "ok.txt").write_text("fine")
    with open(bytes(tmp_path / "corpus") + b"/caf\xe9.txt", "wb") as fh:
        fh.write(b"latin-1 name")
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "corpus")}])
    assert sorted((d["source"].rsplit("/", 1)[-1], d["text"]) for d in docs) == [
        ("caf\\xe9.txt", "latin-1 name"), ("ok.txt", "fine")]
    assert metrics["skipped"] == 0


@pytest.mark.parametrize("rows", [b"hello,1\n", b"hello,1\nbad,row,3\n"], ids=["pyarrow", "python-csv"])
def test_a_csv_header_that_is_not_utf8_is_a_counted_skip(tmp_path, rows):
    """Read by pyarrow, or by Python's csv where pyarrow stops in the first block (a malformed row)."""
    (tmp_path / "h.csv").write_bytes(b"text,caf\xe9\n" + rows)
    (tmp_path / "ok.txt").write_text("fine")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("h.csv", "ok.txt")])
    assert [d["text"] for d in docs] == ["fine"]
    assert report(tmp_path)["skipped"] == {"non_utf8": 1}
    assert "header row is not UTF-8" in quarantine[0]["detail"]


def test_a_csv_without_the_text_column_counts_its_rows(tmp_path):
    (tmp_path / "a.csv").write_text("body,n\nx,1\n\ny,2\nz,3\n")
    (tmp_path / "b.csv").write_bytes(b"body,n\n" + b"w" * 2_000_000 + b",1\nv,2\n")  # Python's csv counts these
    (tmp_path / "ok.txt").write_text("fine")
    metrics, _, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("a.csv", "b.csv", "ok.txt")])
    assert report(tmp_path)["skipped"] == {"missing_field": 5}
    assert metrics["docs"] + metrics["skipped"] == 3 + 2 + 1


def test_a_csv_read_by_python_s_csv_passes_over_blank_lines_and_counts_a_malformed_row(tmp_path):
    """A row of three columns in the first block: pyarrow's reader stops at once, Python's csv reads it all."""
    (tmp_path / "a.csv").write_text("text,n\nhello,1\n\nbad,row,3\n\nworld,2\n")
    (tmp_path / "b.csv").write_text("body,n\nx,1\n\ny,2,3\n\n")  # no text column: its 2 records, not the blanks
    pq.write_table(pa.table({"body": pa.array([], pa.string())}), tmp_path / "c.parquet")  # no column, no rows
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("a.csv", "b.csv", "c.parquet")])
    assert [(d["text"], d["location"]) for d in docs] == [("hello", "row:0"), ("world", "row:1")]
    assert report(tmp_path)["skipped_per_source"] == {
        str(tmp_path / "a.csv"): {"malformed_csv": 1}, str(tmp_path / "b.csv"): {"missing_field": 2},
        str(tmp_path / "c.parquet"): {"missing_field": 1}}  # an empty file without the column still says so


def test_a_csv_that_names_its_text_column_twice_is_a_counted_skip_not_a_guess(tmp_path):
    """pyarrow's reader took the second of two `text` columns and Python's csv (the
    reader a large first row leads to) the first: which text a file gave depended
    on its rows' sizes. Neither is kept; every row is counted, with the reason."""
    (tmp_path / "a.csv").write_text("text,n,text\nfirst,1,second\nx,2,y\n")
    (tmp_path / "b.csv").write_bytes(b"text,text\n" + b"w" * 2_000_000 + b",1\nv,2\n")  # Python's csv reads this
    (tmp_path / "ok.txt").write_text("fine")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("a.csv", "b.csv", "ok.txt")])
    assert [d["text"] for d in docs] == ["fine"]
    assert report(tmp_path)["skipped"] == {"ambiguous_field": 4}
    assert metrics["docs"] + metrics["skipped"] == 2 + 2 + 1
    assert "names column 'text' 2 times" in quarantine[0]["detail"]


def test_a_parquet_file_with_two_text_columns_is_a_counted_skip_not_a_guess(tmp_path):
    pq.write_table(pa.table([pa.array(["a", "b"]), pa.array(["c", "d"])], names=["text", "text"]),
                   tmp_path / "dup.parquet")
    (tmp_path / "ok.txt").write_text("fine")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / n)} for n in ("dup.parquet", "ok.txt")])
    assert [d["text"] for d in docs] == ["fine"]  # it kept the second column's 'c' and 'd'
    assert report(tmp_path)["skipped"] == {"ambiguous_field": 2}


@pytest.mark.parametrize("max_doc_bytes", [1_000_000, 4_000_000])
def test_a_csv_row_larger_than_the_readers_block(tmp_path, max_doc_bytes):
    """A 3 MB value (the reader's block is 1 MiB): the file is read again with larger blocks, past the rows
    already given; the big row is a document or a too_large skip, and the rows after it are read."""
    big = "y" * 3_000_000
    (tmp_path / "mid.csv").write_bytes(b"text,n\nrow one,1\nrow two,2,extra\nrow three,3\n" + big.encode()
                                       + b',4\n"row\nfive",5\nrow six \xff,6,extra\n')
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "mid.csv")}],
                                    max_doc_bytes=max_doc_bytes)
    kept = ["row one", "row three"] + ([big] if max_doc_bytes > len(big) else []) + ["row\nfive"]
    assert [d["text"] for d in docs] == kept
    assert [d["location"] for d in docs if d["text"] == "row\nfive"] == ["row:3"]
    skipped = {"malformed_csv": 2, **({} if max_doc_bytes > len(big) else {"too_large": 1})}
    assert report(tmp_path)["skipped"] == skipped
    assert metrics["docs"] + metrics["skipped"] == 6  # every row accounted for, none twice
    # each with its line: the value with a newline makes row six's line 8
    assert [(q["location"], q["text"]) for q in quarantine if q["reason"] == "malformed_csv"] == [
        ("line:3", "row two,2,extra"), ("line:8", "row six \\xff,6,extra")]


def test_line_mode_keeps_good_lines_around_bad_bytes(tmp_path):
    f = tmp_path / "mixed.txt"
    f.write_bytes(b"good one\nbad \xff line\ngood two\n")
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "line"}])
    assert [d["text"] for d in docs] == ["good one", "good two"]
    assert report(tmp_path)["skipped"] == {"non_utf8": 1} and metrics["skipped"] == 1


def test_record_formats(tmp_path):
    pq.write_table(pa.table({"content": ["p1", None, "p2"]}), tmp_path / "a.parquet")
    (tmp_path / "b.csv").write_text('content,other\n"c1, with comma",x\nc2,y\n')
    (tmp_path / "c.json").write_text(json.dumps({"data": [{"content": "j1"}, {"content": "j2"}, 7]}))
    metrics, docs, _ = run(tmp_path, sources=[
        {"path": str(tmp_path / "a.parquet"), "text_field": "content"},
        {"path": str(tmp_path / "b.csv"), "text_field": "content"},
        {"path": str(tmp_path / "c.json"), "text_field": "content"},
    ])
    assert [d["text"] for d in docs] == ["p1", "p2", "c1, with comma", "c2", "j1", "j2"]
    assert [d["location"] for d in docs][:2] == ["row:0", "row:2"]
    assert report(tmp_path)["skipped"] == {"missing_field": 1, "malformed_json": 1}


def test_a_path_whose_name_holds_glob_characters_is_read_as_named(tmp_path):
    """'notes[1].txt' as a pattern matches 'notes1.txt' only, so the file the
    user named was 'matched no files'; a path that exists is read as it is,
    and one that does not is still a pattern."""
    (tmp_path / "notes[1].txt").write_text("literal brackets")
    (tmp_path / "notes1.txt").write_text("matched by the pattern")
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "notes[1].txt")}])
    assert [d["text"] for d in docs] == ["literal brackets"]
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "notes[0-9].txt")}])
    assert [d["text"] for d in docs] == ["matched by the pattern"]


def test_a_source_whose_files_are_all_left_out_says_by_what(tmp_path):
    """A folder of dot-files, or an exclude that takes everything: the error says
    what left the files out, not only that nothing matched."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / ".notes.txt").write_text("hidden")
    (d / "a.txt").write_text("excluded")
    with pytest.raises(IngestError) as err:
        run(tmp_path, sources=[{"path": str(d), "exclude": ["*/a.txt"]}])
    assert str(err.value) == (f"ingest.sources.0.path: {str(d)!r} matched no files (expanded to {str(d)!r}); of the "
                              "2 it found, 1 hidden (ingest.include_hidden is false), 1 left out by exclude "
                              "['*/a.txt']")
    with pytest.raises(IngestError) as err:
        run(tmp_path, sources=[{"path": f"{d}/*.md"}])
    assert str(err.value).endswith("matched no files (expanded to " + repr(f"{d}/*.md") + ")")


def test_hf_save_to_disk(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["h1", "h2"]}).save_to_disk(str(tmp_path / "ds"))
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "ds")}])  # auto-detected
    assert [d["text"] for d in docs] == ["h1", "h2"]


def test_missing_path_fails_before_reading(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    with pytest.raises(IngestError, match=r"ingest\.sources\.1\.path: no such file"):
        run(tmp_path, sources=[{"path": str(tmp_path / "ok.txt")}, {"path": str(tmp_path / "nope")}])
    with pytest.raises(IngestError, match="matched no files"):
        run(tmp_path, sources=[{"path": str(tmp_path / "*.md")}])
    assert not (tmp_path / "out" / "docs").exists()


def test_all_skipped_is_an_error(tmp_path):
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(IngestError, match="no documents"):
        run(tmp_path, sources=[{"path": str(tmp_path / "e.txt")}])
    assert list((tmp_path / "out" / "docs").iterdir()) == []  # no shard, no manifest
    assert [json.loads(x)["reason"] for x in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()] == [
        "empty_file"]


def test_ids_are_stable_and_unique(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a\n\nb\n\nc")
    _, d1, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "paragraph"}])
    _, d2, _ = run(tmp_path, sources=[{"path": str(f), "split_by": "paragraph"}])
    assert [x["id"] for x in d1] == [x["id"] for x in d2]
    assert len({x["id"] for x in d1}) == 3
    assert d1[0]["id"] == doc_id(d1[0]["source"], d1[0]["location"])


def test_ids_do_not_change_between_versions():
    """Pack's split and clean's dedup key on ids: a changed id function would move
    documents between train and val in every existing corpus."""
    assert doc_id("{stdlib}/json/__init__.py", "file") == "e1a58af623a4fdae"
    assert doc_id("data/raw/r.jsonl", "line:1#para:3") == "bab321eed8da0e3e"
    # the source and the location are kept apart: the same characters split differently are another id
    assert doc_id("r.jsonl", "line:1#line:2") != doc_id("r.jsonlline:1#", "line:2")


def test_a_csv_that_pyarrow_stops_in_after_its_first_block_gives_each_row_once(tmp_path):
    rows = [f"row {i} fine,x" for i in range(100_000)]  # 1.6 MB: past pyarrow's first 1 MiB block
    (tmp_path / "big.csv").write_text("text,other\n" + "\n".join(rows[:90_000]) + "\nbad,row,3\n"
                                      + "\n".join(rows[90_000:]) + "\n")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "big.csv")}])
    assert [d["text"] for d in docs] == [f"row {i} fine" for i in range(100_000)]
    assert [d["location"] for d in docs[89_999:90_001]] == ["row:89999", "row:90000"]
    assert [(q["reason"], q["location"]) for q in quarantine] == [("malformed_csv", "line:90002")]


def test_duplicate_paths_are_counted_once(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("text")
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(f)}, {"path": str(tmp_path / "*.txt")}])
    assert len(docs) == 1 and report(tmp_path)["skipped"] == {"duplicate_path": 1}


def test_max_bytes_cap_stops_reading(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text("z" * 100)
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "*.txt")}], max_bytes=250)
    assert report(tmp_path)["capped"] is True and len(docs) == 3 and metrics["bytes"] == 300
    assert report(tmp_path)["docs_per_source"] == {str(tmp_path / "*.txt"): 3}


def test_max_bytes_keeps_the_document_that_reaches_it_whole_as_its_description_says(tmp_path):
    """Not a hard cap: a large file read past the cap is read whole, and the
    params reference says so (it said "stop after this many bytes")."""
    for name, size in (("a", 100), ("b", 1000), ("c", 100)):
        (tmp_path / f"{name}.txt").write_text(name * size)
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "*.txt")}], max_bytes=200)
    assert metrics["bytes"] == 1100 and [len(d["text"]) for d in docs] == [100, 1000] and metrics["unread_files"] == 1
    assert IngestConfig.model_fields["max_bytes"].description.startswith(
        "reading stops after the document that brings the UTF-8 bytes read to this or past it: documents are kept "
        "whole, so the last one (a whole file with split_by: file) can take the total past the cap by up to its own "
        "size")


def test_files_the_cap_leaves_unread_are_counted_by_source_and_a_source_never_reached_is_a_warning(tmp_path, caplog):
    for folder, n in (("a", 10), ("b", 3)):
        (tmp_path / folder).mkdir()
        for i in range(n):
            (tmp_path / folder / f"{i}.txt").write_text("z" * 100)
    sources = [{"path": str(tmp_path / name / "*.txt"), "name": name} for name in ("a", "b")]
    with caplog.at_level("INFO", logger="pipeline.data.ingest"):
        metrics, docs, _ = run(tmp_path, sources=sources, max_bytes=250)
    assert len(docs) == 3 and metrics["files"] == 13 and metrics["unread_files"] == 10
    assert report(tmp_path)["unread_files_per_source"] == {"a": 7, "b": 3}
    assert f"ingest.max_bytes (250 bytes) reached in {tmp_path / 'a' / '2.txt'} (source 'a'): 10 of 13 input files " \
           "not read (a: 7 of 10; b: 3 of 3)" in caplog.text
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.endswith("ingest")]
    assert warning.startswith("source 'b' was not read at all: ingest.max_bytes (250 bytes) was reached before its 3")
    # a cap that stops in the last file leaves nothing unread, and warns of nothing
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline.data.ingest"):
        metrics, docs, _ = run(tmp_path, sources=sources, max_bytes=1250)
    assert len(docs) == 13 and metrics["unread_files"] == 0 and report(tmp_path)["unread_files_per_source"] == {}
    assert "0 of 13 input files not read;" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name.endswith("ingest")]
    metrics, docs, _ = run(tmp_path, sources=sources, max_bytes=None)
    assert (report(tmp_path)["capped"], metrics["unread_files"], report(tmp_path)["unread_files_per_source"]) == \
        (False, 0, {})


@pytest.mark.parametrize("source", [{"path": "big.jsonl"},
                                    {"path": "book.txt", "split_by": "chunk", "chunk_bytes": 100}],
                         ids=["jsonl", "chunks"])
def test_a_cap_that_stops_part_way_through_a_file_says_so(tmp_path, caplog, source):
    """One large JSONL file (or one chunked text) is the common corpus: a cap
    inside it leaves no file unread, so "0 of 1 input files not read" alone
    would hide that most of it was not read. The line and the report say so,
    also when a rerun replays the shard's record."""
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": f"record {i} " + "z" * 90}) + "\n"
                                                for i in range(20)))
    (tmp_path / "book.txt").write_text("".join(f"line {i} " + "z" * 90 + "\n" for i in range(20)))
    sources = [{**source, "path": str(tmp_path / source["path"])}]
    for attempt in ("run", "rerun"):
        caplog.clear()
        with caplog.at_level("INFO", logger="pipeline.data.ingest"):
            metrics, docs, _ = run(tmp_path, sources=sources, max_bytes=250)
        assert len(docs) == 3 and metrics["unread_files"] == 0 and metrics["shards_resumed"] == (attempt == "rerun")
        assert report(tmp_path)["partly_read_file"] == {"path": sources[0]["path"], "source": sources[0]["path"],
                                                        "items_read": 3}
        assert (f"reached in {sources[0]['path']} (source {sources[0]['path']!r}) after its first 3 item(s), so the "
                "rest of that file was not read: 0 of 1 input files not read;") in caplog.text
    # a cap reached at a file's last item leaves nothing of it unread
    whole, _, _ = run(tmp_path, sources=sources, max_bytes=None)
    metrics, docs, _ = run(tmp_path, sources=sources, max_bytes=whole["bytes"])
    assert len(docs) == 20 and report(tmp_path)["capped"] is True and "partly_read_file" not in report(tmp_path)


def test_a_cap_at_a_file_s_last_item_opens_no_further_input(tmp_path, monkeypatch):
    """Telling a file read in part from one read whole looks one item ahead in
    that file only: the next input (a dataset named for load_dataset, an
    object in a store) is never opened for it."""
    from pipeline.data import ingest

    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {i} " + "z" * 90}) + "\n"
                                                        for i in range(3)))
    opened = []
    reader = ingest.READERS["jsonl"]
    monkeypatch.setitem(ingest.READERS, "jsonl", lambda f, c: (opened.append(f.path.name), reader(f, c))[1])
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "*.jsonl")}], max_bytes=250,
                           executor={"num_workers": 1})  # read here, where the reader is watched
    assert len(docs) == 3 and metrics["unread_files"] == 1 and opened == ["a.jsonl"]
    assert "partly_read_file" not in report(tmp_path)


def test_stdlib_placeholder_and_exclude():
    files = resolve_sources(cfg(sources=[{"path": "{stdlib}/json/*.py", "exclude": ["*/tool.py"]}]))
    names = [f.display for f in files]
    assert "{stdlib}/json/decoder.py" in names and "{stdlib}/json/tool.py" not in names
    assert str(files[0].path).startswith(sysconfig.get_paths()["stdlib"])


def test_hidden_files_skipped_unless_asked(tmp_path):
    (tmp_path / ".secret").write_text("hidden")
    (tmp_path / "shown.txt").write_text("shown")
    assert [f.path.name for f in resolve_sources(cfg(sources=[{"path": str(tmp_path)}]))] == ["shown.txt"]
    got = resolve_sources(cfg(sources=[{"path": str(tmp_path)}], include_hidden=True))
    assert sorted(f.path.name for f in got) == [".secret", "shown.txt"]


@pytest.mark.parametrize("pattern", ["", "/**/*"])
def test_files_under_a_hidden_folder_are_hidden(tmp_path, pattern):
    (tmp_path / "src" / ".git").mkdir(parents=True)
    (tmp_path / "src" / ".git" / "config").write_text("hidden")
    (tmp_path / "src" / "shown.txt").write_text("shown")
    source = {"path": f"{tmp_path / 'src'}{pattern}"}
    assert [f.path.name for f in resolve_sources(cfg(sources=[source]))] == ["shown.txt"]
    got = resolve_sources(cfg(sources=[source], include_hidden=True))
    assert sorted(f.path.name for f in got) == ["config", "shown.txt"]


def test_a_glob_inside_a_dataset_folder_reads_the_files_it_names(tmp_path):
    """The folder a pattern starts in is the user's choice, never a part of the
    dataset to read whole: its own files are read one by one."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "state.json").write_text("{}")  # what marks a save_to_disk folder
    (ds / "notes.txt").write_text("about the dataset")
    assert [f.path.name for f in resolve_sources(cfg(sources=[{"path": f"{ds}/*.txt"}]))] == ["notes.txt"]


# --- split_by: chunk ---------------------------------------------------------------------------


def chunk_source(path, chunk_bytes=100, **kw):
    return {"path": str(path), "split_by": "chunk", "chunk_bytes": chunk_bytes, **kw}


def test_chunks_are_the_file_cut_at_line_ends(tmp_path):
    f = tmp_path / "book.txt"
    paras = [" ".join(f"word{i}x{j}" for j in range(1 + i % 9)) for i in range(200)]
    text = "Title\n\n\n\n" + "".join(p + "\n" + "\n" * (i % 3) for i, p in enumerate(paras)) + "the end"
    f.write_text(text)
    metrics, docs, _ = run(tmp_path, sources=[chunk_source(f)])
    assert "".join(d["text"] for d in docs) == text  # every byte, blank lines included
    assert [d["chunk"] for d in docs] == list(range(len(docs))) and len(docs) > 20
    offsets = [0, *(len(d["text"].encode()) for d in docs)]
    for d, offset in zip(docs, itertools.accumulate(offsets)):
        assert (d["offset"], d["location"], d["source"]) == (offset, f"byte:{offset}", str(f))
        assert d["id"] == doc_id(str(f), d["location"])
    for d, nxt in itertools.pairwise(docs):
        assert d["text"].endswith("\n") and nxt["text"][0] != "\n"  # a blank-line run is never cut
        # within chunk_bytes, except for the blank lines a chunk keeps at its end
        assert len(d["text"].rstrip("\n").encode()) + 1 <= 100
        assert len(d["text"].encode()) + len(nxt["text"].split("\n")[0]) + 1 > 100  # the next line did not fit
    assert docs[0]["text"].startswith("Title\n\n\n\n")
    assert metrics["skipped"] == 0


def test_a_file_larger_than_max_doc_bytes_is_chunked_not_skipped(tmp_path):
    f = tmp_path / "big.txt"
    f.write_text("a line of text\n" * 2000)  # 30 kB
    metrics, docs, _ = run(tmp_path, sources=[chunk_source(f, chunk_bytes=1000)], max_doc_bytes=5000)
    assert metrics["skipped"] == 0 and "".join(d["text"] for d in docs) == f.read_text()
    # as one document, the same file is still a counted too_large skip
    (tmp_path / "small.txt").write_text("fits")
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "*.txt")}], max_doc_bytes=5000)
    assert [d["text"] for d in docs] == ["fits"] and report(tmp_path)["skipped"] == {"too_large": 1}
    assert [(q["reason"], q["source"]) for q in quarantine] == [("too_large", str(f))]


def test_chunk_skips_are_counted_and_leave_a_gap(tmp_path):
    f = tmp_path / "mixed.txt"
    long_line = "y" * 250 + "\n"  # longer than chunk_bytes, shorter than max_doc_bytes
    huge_line = "z" * 700 + "\n"  # longer than max_doc_bytes
    data = (b"first line\n" + long_line.encode() + b"after long\n" + huge_line.encode()
            + b"caf\xe9 is latin-1\n" + b"x" * 96 + b"\n" + b"last\n")
    f.write_bytes(data)
    metrics, docs, quarantine = run(tmp_path, sources=[chunk_source(f)], max_doc_bytes=500)
    assert [(d["chunk"], d["text"]) for d in docs] == [
        (0, "first line\n"), (1, long_line), (2, "after long\n"), (5, "x" * 96 + "\n"), (6, "last\n")]
    assert report(tmp_path)["skipped"] == {"non_utf8": 1, "too_large": 1}
    where = {q["reason"]: (q["source"], q["location"]) for q in quarantine}
    huge_at = data.index(b"zzz")
    assert where == {"too_large": (str(f), f"byte:{huge_at}"), "non_utf8": (str(f), f"byte:{huge_at + 701}")}
    assert metrics["docs"] + metrics["skipped"] == 7  # every chunk index is a document or a skip


def test_a_whitespace_chunk_is_a_counted_skip(tmp_path):
    f = tmp_path / "w.txt"
    f.write_text(" " * 150 + "\n" + "text\n")
    metrics, docs, _ = run(tmp_path, sources=[chunk_source(f)])
    assert [(d["chunk"], d["text"]) for d in docs] == [(1, "text\n")]
    assert report(tmp_path)["skipped"] == {"empty_text": 1}


@pytest.mark.parametrize("newline", ["\r", "\r\n"])
def test_chunks_cut_at_old_mac_and_windows_line_ends(tmp_path, newline):
    """A text whose lines end in a lone CR (classic Mac OS, some exports) is cut
    at them like any other: before, it read as one line, so it became one chunk
    however small chunk_bytes was, or a too_large skip of the whole file."""
    f = tmp_path / "mac.txt"
    lines = [" ".join(f"word{i}x{j}" for j in range(1 + i % 7)) for i in range(300)]
    data = newline.join(lines).encode() + newline.encode() * 2 + b"the end"
    f.write_bytes(data)  # ~10 kB, no "\n" at all with a lone CR
    metrics, docs, _ = run(tmp_path, sources=[chunk_source(f)], max_doc_bytes=5000)
    assert metrics["skipped"] == 0 and len(docs) > 50
    assert "".join(d["text"] for d in docs).encode() == data  # every byte, the line ends as they were
    for d in docs[:-1]:
        assert d["text"].endswith(newline) and len(d["text"].encode()) <= 100
    assert not any(d["text"].startswith("\n") for d in docs)  # a CRLF is never cut in two


@pytest.mark.parametrize("extra", [0, 1, 2])
def test_a_too_large_crlf_line_is_skipped_with_its_line_end(tmp_path, extra):
    """A line over max_doc_bytes is read in pieces; where a piece ends between the
    \\r and the \\n of its CRLF, the \\n is still the skipped line's, not a blank
    line at the head of the next chunk."""
    f = tmp_path / "crlf.txt"
    long = b"z" * (500 + extra)  # the line with its CRLF: 501 to 504 bytes, max_doc_bytes 500
    f.write_bytes(b"first\r\n" + long + b"\r\n" + b"next\r\n")
    metrics, docs, quarantine = run(tmp_path, sources=[chunk_source(f)], max_doc_bytes=500)
    assert [(d["chunk"], d["text"], d["offset"]) for d in docs] == [
        (0, "first\r\n", 0), (2, "next\r\n", 7 + len(long) + 2)]
    assert [(q["reason"], q["location"]) for q in quarantine] == [("too_large", "byte:7")]
    assert f"a line of {len(long) + 2} bytes" in quarantine[0]["detail"]


@pytest.mark.parametrize("source, extra, msg", [
    ({"split_by": "file", "chunk_bytes": 10}, {}, r"sources\.0\.chunk_bytes: .*only to split_by: chunk"),
    ({"split_by": "chunk", "format": "jsonl"}, {}, r"sources\.0\.split_by: .*record format"),
    ({"split_by": "chunk", "chunk_bytes": 2000}, {"max_doc_bytes": 1000}, r"chunk_bytes=2000 exceeds max_doc_bytes"),
])
def test_chunk_config_errors(source, extra, msg):
    with pytest.raises(ConfigError, match=msg):
        cfg(sources=[{"path": "x.txt", **source}], **extra)


def test_chunk_bytes_may_equal_max_doc_bytes():
    assert cfg(sources=[{"path": "x.txt", "split_by": "chunk", "chunk_bytes": 1000}], max_doc_bytes=1000)


def test_chunk_refuses_a_record_file(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(IngestError, match=r"ingest\.sources\.0\.path: split_by: chunk cuts plain text.*jsonl"):
        resolve_sources(cfg(sources=[chunk_source(tmp_path / "a.jsonl")]))
    assert resolve_sources(cfg(sources=[chunk_source(tmp_path / "a.jsonl", format="text")]))[0].format == "text"


# --- named sources, split marks and Hugging Face configs and splits ---------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """load_dataset builds its cache in the test's folder, never in ~/.cache, and never asks the Hub."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf-cache"


def _dataset_repo(root):
    """A local dataset repository with two configs, as on the Hub: load_dataset(root, name, split)."""
    import datasets

    for config, split, texts in [("small", "train", ["s1", "s2"]), ("small", "validation", ["sv"]),
                                 ("big", "train", ["b1", "b2", "b3"])]:
        (root / config).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(root / config / f"{split}.parquet"))
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: small\n  data_files:\n  - split: train\n    path: small/train.parquet\n"
        "  - split: validation\n    path: small/validation.parquet\n"
        "- config_name: big\n  data_files:\n  - split: train\n    path: big/train.parquet\n---\n")
    return root


def test_hf_config_name_and_split(tmp_path, hf_cache):
    repo = _dataset_repo(tmp_path / "repo")
    _, docs, _ = run(tmp_path, sources=[
        {"path": str(repo), "format": "hf", "hf": {"name": "big"}},
        {"path": str(repo), "format": "hf", "hf": {"name": "small", "split": "validation"}, "split": "val"},
    ])
    assert [d["text"] for d in docs] == ["sv", "b1", "b2", "b3"]  # split: val sources are read first
    assert [d["split"] for d in docs] == ["val", None, None, None]
    assert [d["source_name"] for d in docs] == [f"{repo}:small[validation]"] + [f"{repo}:big[train]"] * 3
    assert docs[0]["id"] != docs[1]["id"]  # row 0 of two configs: different documents
    with pytest.raises(IngestError, match=r"cannot load Hugging Face dataset: ValueError: .*'nope' not found"):
        run(tmp_path, sources=[{"path": str(repo), "format": "hf", "hf": {"name": "nope"}}])
    # a split the config lacks: the one line names the splits it has
    with pytest.raises(IngestError, match=r"^.*repo:big\[test\]: cannot load Hugging Face dataset: ValueError: "
                                          r"Unknown split \"test\"\. Should be one of \['train'\]"):
        run(tmp_path, sources=[{"path": str(repo), "format": "hf", "hf": {"name": "big", "split": "test"}}])


def test_a_dataset_of_several_configs_read_without_hf_name_names_them(tmp_path, hf_cache):
    """datasets says which configs there are only in lines after its first; the
    one-line error names them and the key that picks one."""
    repo = _dataset_repo(tmp_path / "repo")
    with pytest.raises(IngestError) as err:
        run(tmp_path, sources=[{"path": str(repo), "format": "hf"}])
    assert str(err.value) == (f"{repo}: the dataset has configs ['small', 'big']; pick one with hf.name "
                              "(a source per config to read several)")


def test_hub_dataset_revision_is_passed_and_an_unpinned_one_warned(tmp_path, monkeypatch, caplog):
    """A dataset named for load_dataset is read at hf.revision; without one, a warning says a rerun cannot
    notice the Hub's changes. (load_dataset is replaced: tests never ask the Hub.)"""
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split, kw.get("revision")))
        return datasets.Dataset.from_dict({"text": [f"{path} {name} {split}"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    source = {"path": "someone/corpus", "format": "hf", "hf": {"name": "en", "split": "validation"}}
    with caplog.at_level("WARNING", logger="pipeline.data.ingest"):
        _, docs, _ = run(tmp_path, sources=[{**source, "hf": {**source["hf"], "revision": "0123abc"}}])
    assert calls == [("someone/corpus", "en", "validation", "0123abc")]
    assert [d["text"] for d in docs] == ["someone/corpus en validation"]
    assert "revision" not in caplog.text
    with caplog.at_level("WARNING", logger="pipeline.data.ingest"):
        run(tmp_path, sources=[source])
    assert calls[-1][3] is None
    assert "ingest.sources.0.path: the Hugging Face dataset 'someone/corpus' is read at whatever revision" \
        in caplog.text
    datasets.Dataset.from_dict({"text": ["t"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(IngestError, match=r"^ingest.sources.0.path: hf.revision pins a dataset named for "
                                          r"load_dataset, but .*/ds is a local path"):
        run(tmp_path, sources=[{"path": str(tmp_path / "ds"), "hf": {"revision": "main"}}])


def test_save_to_disk_read_split_by_split(tmp_path):
    import datasets

    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["t1", "t2"]}),
        "validation": datasets.Dataset.from_dict({"text": ["v1"]}),
    }).save_to_disk(str(tmp_path / "ds"))
    ds = str(tmp_path / "ds")
    _, docs, quarantine = run(tmp_path, sources=[
        {"path": ds, "name": "wiki"},
        {"path": ds, "name": "wiki-val", "hf": {"split": "validation"}, "split": "val"},
        {"path": ds, "name": "wiki-again", "hf": {"split": "validation"}},  # the same input twice
    ])
    assert [(d["text"], d["source_name"], d["split"]) for d in docs] == [
        ("v1", "wiki-val", "val"), ("t1", "wiki", None), ("t2", "wiki", None)]
    assert len({d["id"] for d in docs}) == 3
    assert report(tmp_path)["skipped"] == {"duplicate_path": 1}
    assert report(tmp_path)["docs_per_source"] == {"wiki": 2, "wiki-val": 1}
    assert [(q["source"], q["detail"]) for q in quarantine] == [
        (f"{ds}[validation]", "listed by more than one source: source 'wiki-val' reads it")]
    _, _, quarantine = run(tmp_path, sources=[{"path": ds, "name": "a"}, {"path": ds, "name": "b", "text_field": "t"},
                                              {"path": ds, "name": "c"}])
    assert [q["detail"] for q in quarantine] == [
        "listed by more than one source: source 'a' reads it (with text_field 'text'; documents are named by input "
        "and row, so a second column of one input needs a copy of it)",
        "listed by more than one source: source 'a' reads it"]  # the one that reads it, not the one skipped
    with pytest.raises(IngestError, match=r"no split 'test'; splits are \['train', 'validation'\]"):
        run(tmp_path, sources=[{"path": ds, "hf": {"split": "test"}}])
    with pytest.raises(IngestError, match="a save_to_disk folder has no configs"):
        run(tmp_path, sources=[{"path": ds, "hf": {"name": "x"}}])


def test_a_dataset_without_the_text_column_is_an_error_naming_its_columns(tmp_path):
    """Not a read of another column: its last one, a string column here, is what
    the column lookup would give (pyarrow's index -1) without the check."""
    import datasets

    datasets.Dataset.from_dict({"content": ["c1"], "title": ["t1"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(IngestError, match=r"/ds: no column 'text'; columns are \['content', 'title'\]$"):
        run(tmp_path, sources=[{"path": str(tmp_path / "ds")}])
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "ds"), "text_field": "content"}])
    assert [d["text"] for d in docs] == ["c1"]


def test_every_row_of_a_dataset_is_a_document_or_a_counted_skip(tmp_path):
    import datasets

    texts = ["good", "", None, "x" * 50, "   ", "also good"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                          "test": datasets.Dataset.from_dict({"text": ["t"]})}).save_to_disk(str(tmp_path / "ds"))
    metrics, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "ds"), "name": "d"}], max_doc_bytes=10)
    assert [d["text"] for d in docs] == ["good", "also good"]
    assert report(tmp_path)["skipped_per_source"] == {"d": {"empty_text": 2, "missing_field": 1, "too_large": 1}}
    assert metrics["docs"] + metrics["skipped"] == len(texts)  # the train split's rows, none of test's


def test_source_names_and_marks_default_to_path_and_auto(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    _, docs, _ = run(tmp_path, sources=[{"path": str(f)}])
    assert (docs[0]["source_name"], docs[0]["split"]) == (str(f), None)
    _, docs, _ = run(tmp_path, sources=[{"path": str(f), "name": "greeting", "split": "train"}])
    assert (docs[0]["source_name"], docs[0]["split"]) == ("greeting", "train")
    assert report(tmp_path)["docs_per_source"] == {"greeting": 1}


@pytest.mark.parametrize("sources, message", [
    ([{"path": "x", "format": "hf", "split": "validation"}],
     r"'validation' is not one of auto \| train \| val: .* hf.split \(hf: \{split: validation\}\)"),
    ([{"path": "x", "format": "jsonl", "hf": {"split": "test"}}], "applies only to format hf"),
    ([{"path": "x", "name": "web"}, {"path": "y", "name": "web"}],
     "sources.0 and sources.1 are both called 'web'; give them distinct names"),
    ([{"path": "x"}, {"path": "x"}], "both called 'x'"),
    ([{"path": "x", "name": "c++"}, {"path": "y", "name": "c#"}, {"path": "z", "name": "c__"}],
     r"sources\.0 \('c\+\+'\) and sources\.2 \('c__'\) would both be logged to MLflow as 'sources\.c__'"),
    ([{"path": "x", "name": "a" * 300}, {"path": "y", "name": "a" * 300 + "b"}],
     r"sources\.0 is called 'a{40}'\.\.\. \(300 characters\): .* MLflow cuts a key at 250 characters, so they "
     r"would mix; give it a name of at most 192 characters \(name: \.\.\.\)"),
    ([{"path": "x/" + "p" * 200}], r"sources\.0 is called 'x/p{38}'\.\.\. \(202 characters\)"),  # a path's name too
    ([{"path": "x", "split": "val"}, {"path": "y", "name": "bench", "split": "val"}],
     "every source is marked split: val, so no document could be trained on"),
    ([{"path": "{stdlib}/json"}, {"path": "hf://datasets/org/corpus/*.parquet"}],
     r"ingest\.sources\.1\.path: a URL \(hf://\), but inputs are read from this machine's filesystem "
     r"\(and from s3://, gs://, gcs://; see the README's Ingest sources\): mount the storage at the same "
     r"path on every node \(an object store with mountpoint-s3, gcsfuse or blobfuse2\) or copy the files here, "
     r"and give that path \(got 'hf://datasets/org/corpus/\*\.parquet'\)"),
])
def test_bad_source_marks_are_one_line_errors(sources, message):
    with pytest.raises(ConfigError, match=message):
        cfg(sources=sources)


def test_a_source_name_is_refused_only_past_what_its_mlflow_keys_can_hold():
    cfg(sources=[{"path": "x", "name": "a" * 192}])  # sources.<192> leaves 50 characters for prefix and metric
    with pytest.raises(ConfigError, match=r"\(193 characters\)"):
        cfg(sources=[{"path": "x", "name": "a" * 193}])


def test_hf_section_on_a_plain_file_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("hi")
    with pytest.raises(IngestError, match=r"ingest\.sources\.0\.path: hf applies to Hugging Face datasets"):
        run(tmp_path, sources=[{"path": str(tmp_path / "a.txt"), "hf": {"split": "train"}}])
    (tmp_path / "b.jsonl").write_text('{"text": "hi"}\n')
    for path in ("b.jsonl", "*.jsonl"):  # not load_dataset's "couldn't find any data file" for a file that is there
        with pytest.raises(IngestError, match=r"^ingest\.sources\.0\.path: format hf reads a dataset folder .*, "
                                              r"but .*b\.jsonl is a file; read it with format: jsonl \(or auto\)$"):
            run(tmp_path, sources=[{"path": str(tmp_path / path), "format": "hf"}])



def test_a_pattern_with_format_hf_reads_the_dataset_folders_it_matches(tmp_path):
    """Not a dataset name for load_dataset (which has no wildcard): before, it was one, and failed."""
    import datasets

    for name in ("ds_a", "ds_b"):
        datasets.Dataset.from_dict({"text": [name]}).save_to_disk(str(tmp_path / name))
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "ds_*"), "format": "hf", "name": "both"}])
    assert [d["text"] for d in docs] == ["ds_a", "ds_b"]
    with pytest.raises(IngestError, match=r"ingest\.sources\.0\.path: .*/nothing_\*' matched no files"):
        run(tmp_path, sources=[{"path": str(tmp_path / "nothing_*"), "format": "hf"}])


# --- the executor: workers read whole files, the stage streams large ones -------------------------


def mixed_corpus(root):
    """Good and bad files of every format, a compressed one, a file listed twice, a dataset, and one large file."""
    import datasets

    d = root / "corpus"
    d.mkdir(parents=True)
    for i in range(12):
        (d / f"good{i:02d}.txt").write_text(f"document {i}\n\nsecond paragraph {i}\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "blob.txt").write_bytes(b"\x00\x01binary")
    (d / "big.txt").write_text("a large file\n\n" * 2000)
    (d / "rows.jsonl").write_text('{"text": "r1"}\n{"oops\n{"text": 3}\n{"text": "r2"}\n')
    (d / "more.jsonl").write_text("".join(f'{{"text": "z{i}"}}\n' for i in range(30)) + "{bad\n")
    compress(d / "more.jsonl", "zstd")
    (d / "more.jsonl").unlink()
    datasets.Dataset.from_dict({"text": ["h1", "h2"]}).save_to_disk(str(root / "ds"))
    return [{"path": str(d / "*.txt"), "split_by": "paragraph"}, {"path": str(d / "rows.jsonl")},
            {"path": str(d / "good00.txt"), "name": "again"}, {"path": str(root / "ds")},
            {"path": str(d / "more.jsonl.zst")}]


def outputs(tmp_path, name, sources, **kw):
    out = tmp_path / name
    metrics = run_ingest(cfg(sources=sources, **kw), out / "docs", out / "q.jsonl", out / "report.json")
    return metrics, folder_bytes(out / "docs"), [(out / f).read_bytes() for f in ("q.jsonl", "report.json")]


def test_workers_give_the_bytes_of_one_process(tmp_path):
    sources = mixed_corpus(tmp_path)
    one = outputs(tmp_path, "one", sources, executor={"num_workers": 1})
    assert one[0]["skipped"] >= 5 and one[0]["docs"] > 20
    two = outputs(tmp_path, "two", sources, executor={"num_workers": 2})
    streamed = outputs(tmp_path, "streamed", sources, executor={"num_workers": 2}, worker_file_bytes=100)
    capped = [outputs(tmp_path, f"capped{n}", sources, executor={"num_workers": n}, max_bytes=300) for n in (1, 2)]
    assert two == one and streamed == one
    assert capped[0] == capped[1] and capped[0][0]["docs"] < one[0]["docs"]


def test_the_report_counts_each_source_s_skips_by_reason(tmp_path):
    sources = mixed_corpus(tmp_path)
    (tmp_path / "table.csv").write_text("body\none\ntwo\nthree\n")  # no text column: 3 rows in one skip
    sources.append({"path": str(tmp_path / "table.csv"), "name": "csv"})
    # small shards: the counts are summed over several shard records
    metrics, _, (_, report_bytes) = outputs(tmp_path, "out", sources, executor={"num_workers": 2}, shard_bytes=200)
    assert metrics["shards"] > 3
    rep = json.loads(report_bytes)
    corpus = str(tmp_path / "corpus")
    assert rep["skipped_per_source"] == {
        f"{corpus}/*.txt": {"empty_file": 1, "non_utf8": 1, "binary": 1},
        f"{corpus}/rows.jsonl": {"malformed_json": 1, "bad_type": 1},
        "again": {"duplicate_path": 1},
        f"{corpus}/more.jsonl.zst": {"malformed_json": 1},
        "csv": {"missing_field": 3},
    }
    by_reason: dict = {}
    for reasons in rep["skipped_per_source"].values():
        for reason, n in reasons.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    assert by_reason == rep["skipped"] and sum(by_reason.values()) == metrics["skipped"]


def test_skips_are_summed_up_in_one_line_and_a_source_that_gave_no_document_is_a_warning(tmp_path, caplog):
    sources = mixed_corpus(tmp_path)
    (tmp_path / "table.csv").write_text("body\none\ntwo\nthree\n")
    sources.append({"path": str(tmp_path / "table.csv"), "name": "csv"})
    with caplog.at_level("INFO", logger="pipeline.data.ingest"):
        outputs(tmp_path, "out", sources, executor={"num_workers": 2})
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "pipeline.data.ingest"]
    out = tmp_path / "out"
    assert ("INFO", f"skipped 10 record(s): bad_type 1, binary 1, duplicate_path 1, empty_file 1, malformed_json 2, "
                    f"missing_field 3, non_utf8 1 (samples in {out / 'q.jsonl'}; by source in {out / 'report.json'})"
            ) in lines
    # 'again' lists a file the first source read; 'csv' has no text column; the others gave documents
    assert [m for level, m in lines if level == "WARNING"] == [
        "source 'again' gave no documents; skipped: duplicate_path 1",
        "source 'csv' gave no documents; skipped: missing_field 3"]
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline.data.ingest"):
        outputs(tmp_path, "good", [{"path": str(tmp_path / "corpus" / "good*.txt")}])
    assert not [r for r in caplog.records if r.name == "pipeline.data.ingest" and "skipped" in r.getMessage()]


def test_a_worker_reads_a_file_only_if_it_is_the_one_the_stage_saw(tmp_path):
    """A worker that lacks the file, or holds another one at its path (a Ray node
    without the input's storage), hands it back to the stage with a line saying so."""
    import os
    import socket

    from pipeline.data import ingest

    path = tmp_path / "a.txt"
    path.write_text("one\n\ntwo\n")
    ingest._init_reader(cfg(sources=[{"path": str(path), "split_by": "paragraph"}]))
    f, = resolve_sources(ingest._WORKER["cfg"])
    st = os.stat(path)
    seen = (st.st_size, st.st_mtime_ns)
    assert [item.text for item in ingest._read_whole(f, seen)] == ["one", "two"]
    assert ingest._read_whole(f, None) is None
    assert ingest._read_whole(f, (st.st_size + 1, st.st_mtime_ns)).endswith(
        f"a.txt on {socket.gethostname()} is not the file the stage sees (size or modification time)")
    assert "is not the file" in ingest._read_whole(f, (st.st_size, st.st_mtime_ns + 1))
    path.unlink()
    assert ingest._read_whole(f, seen).endswith(" (FileNotFoundError)")


def test_workers_read_the_files_of_at_most_worker_file_bytes_and_the_stage_streams_the_rest(tmp_path, monkeypatch):
    """A compressed file counts 4 times its size; the items are the same wherever a file is read."""
    from pipeline.data import ingest
    from pipeline.data.executor import InProcess

    (tmp_path / "fits.txt").write_text("x" * 99 + "\n")  # 100 bytes
    (tmp_path / "over.txt").write_text("y" * 100 + "\n")
    (tmp_path / "packed.txt").write_text("".join(chr(33 + i * 37 % 90) for i in range(60)))
    compress(tmp_path / "packed.txt", "gzip")  # 26 bytes or more, so more than 100 counted
    (tmp_path / "packed.txt").unlink()
    c = cfg(sources=[{"path": str(tmp_path / "*.txt*")}], worker_file_bytes=100)
    files = resolve_sources(c)
    handed: dict[str, bool] = {}
    read_whole = ingest._read_whole

    def recorded(f, seen):
        handed[f.path.name] = seen is not None
        return read_whole(f, seen)

    monkeypatch.setattr(ingest, "_read_whole", recorded)

    class TwoWorkersHere(InProcess):
        workers = 2

    ex = TwoWorkersHere("ingest", ingest._init_reader, (c,))
    items = [item.text for _, _, item, _ in ingest.iter_items(files, c, ex)]
    assert handed == {"fits.txt": True, "over.txt": False, "packed.txt.gz": False}
    assert items == [item.text for _, _, item, _ in ingest.iter_items(files, c)]
    handed.clear()  # one worker: every file is streamed here, none read whole
    assert [item.text for _, _, item, _ in ingest.iter_items(files, c, InProcess("ingest", None, ()))] == items
    assert handed == {}


def test_a_split_asked_of_a_dataset_without_splits_is_an_error(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["h"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(IngestError, match=r"the folder holds one dataset \(split None\), not a split 'test'"):
        outputs(tmp_path, "x", [{"path": str(tmp_path / "ds"), "hf": {"split": "test"}}])
    assert outputs(tmp_path, "y", [{"path": str(tmp_path / "ds")}])[0]["docs"] == 1


def test_a_row_group_ends_at_row_group_docs_or_at_the_document_that_fills_row_group_bytes(tmp_path):
    """The unit a reader can start at (clean's sharded workers read row groups)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    sizes = [300, 50, 50, 700, 10, 10, 10, 10, 10, 900, 5]
    for i, n in enumerate(sizes):
        (corpus / f"f{i:02d}.txt").write_text("x" * (n - 1) + "\n")
    run(tmp_path, sources=[{"path": str(corpus / "*.txt")}], row_group_docs=4, row_group_bytes=400,
        max_bytes=None, num_workers=1)
    (shard,) = DocTable(tmp_path / "out" / "docs", IngestError).files
    md = pq.ParquetFile(shard).metadata
    # 300+50+50 fills 400; 700 alone; four of 10; 10+900; the rest
    assert [md.row_group(g).num_rows for g in range(md.num_row_groups)] == [3, 1, 4, 2, 1]


@pytest.mark.parametrize("method", ["memory", "sharded"])
def test_a_validation_copy_outlives_its_training_copies_in_dedup(tmp_path, method):
    from pipeline.data.clean import CleanConfig, run_clean
    from tests.pipeline.data.test_clean import code

    train = [code(i) for i in range(8)]
    near = code(5).replace("return", "return  ", 1).replace("def", "async def", 1)  # a near copy of train 5
    val = [code(3), code(100), code(4), near]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in val))
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / "train.jsonl"), "name": "train"},
                                        {"path": str(tmp_path / "bench.jsonl"), "name": "bench", "split": "val"}])
    assert [d["source_name"] for d in docs] == ["bench"] * 4 + ["train"] * 8  # the val source is read first
    clean = parse_section(CleanConfig, {"num_workers": 1, "dedup": {"method": method}}, "clean")
    run_clean(clean, tmp_path / "out" / "docs", tmp_path / "clean", tmp_path / "q.jsonl", tmp_path / "r.json")
    kept = [(d["source_name"], d["text"]) for d in read_docs(tmp_path / "clean").to_pylist()]
    assert [t for s, t in kept if s == "bench"] == [t.strip() for t in val]  # every validation document stays
    assert [t for s, t in kept if s == "train"] == [t.strip() for i, t in enumerate(train) if i not in (3, 4, 5)]
    assert {k: v for k, v in read_json(tmp_path / "r.json")["dropped"].items() if v} == \
        {"exact_duplicate": 2, "near_duplicate": 1}


def test_the_progress_bar_counts_input_bytes_and_ends_full(tmp_path, monkeypatch):
    """Compressed Parquet holds more text than bytes on disk, a compressed file
    too, and a saved dataset is a folder: the bar neither passes its total nor
    leaves them out of it."""
    import contextlib

    import datasets

    from pipeline.data import ingest

    class Bar:
        def __init__(self, total, **_):
            self.total, self.n, self.most = total, 0, 0

        def update(self, n):
            self.n += n
            self.most = max(self.most, self.n)

    bars = []
    monkeypatch.setattr(ingest, "progress", lambda **kw: contextlib.nullcontext(bars.append(Bar(**kw)) or bars[-1]))
    pq.write_table(pa.table({"text": ["the same words again " * 50] * 400}), tmp_path / "z.parquet",
                   compression="zstd")
    datasets.Dataset.from_dict({"text": ["a saved dataset row"] * 50}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "t.txt").write_text("plain text\n")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(300)))
    gz = compress(tmp_path / "c.jsonl", "gzip")
    sources = [{"path": str(tmp_path / "z.parquet")}, {"path": str(tmp_path / "ds")}, {"path": str(tmp_path / "t.txt")},
               {"path": str(gz)}]
    metrics, _, _ = run(tmp_path, sources=sources)
    on_disk = (tmp_path / "z.parquet").stat().st_size
    assert metrics["bytes"] > 10 * on_disk  # the text is far larger than the file
    [bar] = bars
    folder = sum(p.stat().st_size for p in (tmp_path / "ds").rglob("*") if p.is_file())
    # a compressed file counts as the text it is taken to hold: 4 times its size
    assert bar.total == on_disk + folder + len("plain text\n") + 4 * gz.stat().st_size
    assert bar.most == bar.n == bar.total
    bars.clear()  # max_bytes caps the total, which the files the cap leaves unread do not pass
    run(tmp_path, sources=sources, max_bytes=5_000)
    [bar] = bars
    assert bar.total == 5_000 and bar.most == bar.n == bar.total


def plain_corpus(d):
    """One file of every format that can be compressed, with a skip in each record format."""
    d.mkdir()
    (d / "book.txt").write_text("".join(f"line {i} of the book\n\n" for i in range(300)))
    (d / "rows.jsonl").write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(500)) + '{"oops\n')
    (d / "list.json").write_text(json.dumps([{"text": f"item {i}"} for i in range(50)] + [7]))
    (d / "table.csv").write_text("text,id\n" + "".join(f'"cell {i}, quoted",{i}\n' for i in range(200)) + "x,1,2\n")
    (d / "long.txt").write_text("".join(f"sentence {i} of one long text\n" for i in range(2000)))
    return [{"path": str(d / "book.txt*"), "split_by": "paragraph"}, {"path": str(d / "rows.jsonl*")},
            {"path": str(d / "list.json*")}, {"path": str(d / "table.csv*")},
            {"path": str(d / "long.txt*"), "split_by": "chunk", "chunk_bytes": 4000}]


@pytest.mark.parametrize("codec", ["gzip", "zstd", "bz2", "lz4", "xz"])
def test_a_compressed_input_gives_what_the_plain_file_gives(tmp_path, codec):
    """corpus.jsonl.zst is JSON Lines read through zstd: the same documents,
    locations and counted skips as the file it was made from; only the source's
    name differs."""
    plain = plain_corpus(tmp_path / "plain")
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in (tmp_path / "plain").iterdir():
        (packed / f.name).write_bytes(f.read_bytes())
        compress(packed / f.name, codec)
        (packed / f.name).unlink()
    assert len(list(packed.iterdir())) == 5
    want, want_docs, want_q = run(tmp_path / "a", sources=plain)
    got, got_docs, got_q = run(tmp_path / "b", sources=[{**s, "path": s["path"].replace("plain", "packed")}
                                                        for s in plain])
    assert got == want and want["docs"] == 300 + 500 + 50 + 200 + 16  # 60,890 bytes in chunks of at most 4,000
    assert report(tmp_path / "b")["skipped"] == report(tmp_path / "a")["skipped"] == {
        "malformed_json": 2, "malformed_csv": 1}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("id", "source", "source_name")} for r in rows]
    assert strip(got_docs) == strip(want_docs) and strip(got_q) == strip(want_q)
    assert [d["source"].rsplit(".", 1)[0] for d in got_docs] == [d["source"].replace("plain", "packed")
                                                                 for d in want_docs]


@pytest.mark.parametrize("codec", ["gzip", "zstd", "xz"])
def test_a_damaged_compressed_file_keeps_what_came_before_and_counts_the_rest(tmp_path, codec):
    """A download cut short or a corrupt block: the items read before the damage
    stay (but for those in the last piece of DECOMPRESSED_PIECE bytes), the
    rest of the file is one counted skip that says so, and the other files are read."""
    d = tmp_path / "corpus"
    d.mkdir()
    rows = "".join(json.dumps({"text": f"row {i} " + "x" * (i % 97)}) + "\n" for i in range(20000))
    (d / "whole.jsonl").write_text('{"text": "intact"}\n')
    (d / "cut.jsonl").write_text(rows)
    for name in ("whole.jsonl", "cut.jsonl"):
        compress(d / name, codec)
        (d / name).unlink()
    cut = next(d.glob("cut.jsonl.*"))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size * 2 // 3])
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(d / "*.jsonl.*")}])
    texts = [doc["text"] for doc in docs]
    assert texts[-1] == "intact" and 20000 // 2 < len(texts) - 1 < 20000  # cut.jsonl.* is read first
    assert texts[:-1] == [f"row {i} " + "x" * (i % 97) for i in range(len(texts) - 1)], "a prefix, in order"
    assert report(tmp_path)["skipped"] == {"unreadable": 1} and metrics["skipped"] == 1
    [q] = quarantine
    assert q["source"] == str(cut) and q["location"] == "file"
    assert q["detail"].startswith(f"its {codec} data is damaged or cut short after {len(texts) - 1} item(s); the "
                                  "rest of the file was not read: "), q["detail"]


@pytest.mark.parametrize("name, source", [
    ("a.txt", {"split_by": "paragraph"}), ("a.txt", {"split_by": "line"}),
    ("a.txt", {"split_by": "chunk", "chunk_bytes": 64}), ("a.txt.gz", {"split_by": "paragraph"}),
    ("a.csv", {}), ("a.csv.gz", {}),
])
def test_a_file_is_opened_once(tmp_path, monkeypatch, name, source):
    """Checking a file's first bytes and reading it is one opening, so one
    request for a file in an object store (tests/pipeline/data/test_remote.py)."""
    from pipeline.data import ingest

    body = "text,n\n" + "".join(f"row {i},{i}\n\n" for i in range(4000))  # 60 KB: past the first 8 KiB read
    (tmp_path / "a.txt").write_text(body)
    (tmp_path / "a.csv").write_text(body.replace("\n\n", "\n"))
    for plain in ("a.txt", "a.csv"):
        compress(tmp_path / plain, "gzip")
    opened = []
    monkeypatch.setattr(ingest, "open_input", lambda path: opened.append(path) or open_input(path))
    _, docs, _ = run(tmp_path, sources=[{"path": str(tmp_path / name), **source}], max_bytes=None)
    assert len(opened) == 1 and len(docs) >= 900


def test_compressed_files_that_are_empty_binary_or_too_large_are_counted_as_plain_ones_are(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "blob.txt").write_bytes(b"\x00\x01binary")
    (d / "big.txt").write_text("y" * 5000)
    (d / "empty.jsonl").write_bytes(b"")
    (d / "empty.csv").write_bytes(b"")
    (d / "fine.txt").write_text("fine")
    for f in list(d.iterdir()):
        compress(f, "gzip")
        f.unlink()
    metrics, docs, quarantine = run(tmp_path, sources=[{"path": str(d)}], max_doc_bytes=4000)
    assert [doc["text"] for doc in docs] == ["fine"]
    assert report(tmp_path)["skipped"] == {"empty_file": 3, "binary": 1, "too_large": 1}
    [big] = [q for q in quarantine if q["reason"] == "too_large"]
    assert big["detail"] == "more than 4000 bytes once decompressed > max_doc_bytes=4000"


def test_a_json_line_is_measured_by_its_text_not_its_escapes_and_only_a_runaway_line_goes_unparsed(tmp_path):
    """JSON Lines were skipped as too_large by the raw line's length: an ensure_ascii text of 20 UTF-8 bytes
    (six CJK characters, 36 bytes escaped) or a record whose lines fit was lost at max_doc_bytes 20. The text is
    what is measured; a line over 6 x max_doc_bytes (what JSON's escapes can make of one byte) is not parsed."""
    cjk = "漢字テキスト"[:6]  # 18 UTF-8 bytes, 36 escaped
    lines = [json.dumps({"text": cjk + "ab"}),                         # 20 bytes of text, 40 of JSON: kept
             json.dumps({"text": cjk + "abc"}),                        # 21 bytes of text: too_large by its text
             json.dumps({"text": "short", "meta": "m" * 60}),          # 87 bytes of JSON, 5 of text: kept
             json.dumps({"text": "x", "meta": "m" * 120})]             # over 6 x 20 bytes: not parsed
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "a.jsonl")}], max_doc_bytes=20)
    assert [d["text"] for d in docs] == [cjk + "ab", "short"]
    assert [(q["location"], q["detail"]) for q in quarantine] == [
        ("line:2", "21 bytes > max_doc_bytes=20"),
        ("line:4", f"a JSON line of {len(lines[3]) + 1} bytes > 6 x max_doc_bytes=20 is not parsed")]

    # by line, a record longer than max_doc_bytes whose lines fit gives its lines
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "line one\nline two\nline three"}) + "\n")
    _, docs, quarantine = run(tmp_path, sources=[{"path": str(tmp_path / "a.jsonl"), "split_by": "line"}],
                              max_doc_bytes=12)
    assert [d["text"] for d in docs] == ["line one", "line two", "line three"] and quarantine == []


def test_a_file_read_beside_its_own_compressed_copy_is_a_warning(tmp_path, caplog):
    """a.jsonl and a.jsonl.gz in one folder were both read with no word: every document twice."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "one"}\n')
    compress(d / "a.jsonl", "gzip")
    (d / "b.jsonl").write_text('{"text": "two"}\n')
    compress(d / "b.jsonl", "gzip").rename(d / "c.jsonl.gz")  # another name: no twin
    with caplog.at_level("WARNING", logger="pipeline.data.ingest"):
        files = resolve_sources(cfg(sources=[{"path": str(d)}]))
    assert sorted(f.path.name for f in files) == ["a.jsonl", "a.jsonl.gz", "b.jsonl", "c.jsonl.gz"]
    twins = [r.getMessage() for r in caplog.records if "are both read" in r.getMessage()]
    assert twins == [f"{d / 'a.jsonl'} and {d / 'a.jsonl.gz'} are both read: if one is a copy of the other, each "
                     "of its documents is read twice; exclude one of them"]
