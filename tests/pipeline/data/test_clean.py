import json
import logging
import os
import random
import re
import subprocess
import sys
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_params, parse_section
from pipeline.data.clean import REQUIRED, SCHEMA, CleanConfig, CleanError, NormaliseConfig, normalise, run_clean
from pipeline.data.docs import DocTable
from pipeline.files import read_json
from tests.conftest import ROOT


def cfg(**kw) -> CleanConfig:
    kw.setdefault("num_workers", 1)
    return parse_section(CleanConfig, kw, "clean")


def write_docs(path, texts, row_group_size=3):
    rows = {
        "id": [f"id{i:03d}" for i in range(len(texts))],
        "text": texts,
        "source": [f"src/{i}.py" for i in range(len(texts))],
        "location": ["file"] * len(texts),
    }
    # the ingest columns clean requires; chunk and offset are absent and read as null
    pq.write_table(pa.table(rows, schema=pa.schema([SCHEMA.field(n) for n in REQUIRED])), path,
                   row_group_size=row_group_size)
    return path


def read_out(out) -> pa.Table:
    """The clean output folder's documents, through its manifest."""
    return pa.concat_tables([pq.read_table(f) for f in DocTable(out, CleanError).files])


def files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def run(tmp_path, texts, **kw):
    inp = write_docs(tmp_path / "in.parquet", texts)
    out, q = tmp_path / "out" / "docs", tmp_path / "out" / "quarantine.jsonl"
    metrics = run_clean(cfg(**kw), inp, out, q, tmp_path / "out" / "report.json")
    docs = read_out(out).to_pylist()
    quarantine = [json.loads(line) for line in q.read_text().splitlines()]
    return metrics, docs, quarantine


def report(tmp_path):
    return read_json(tmp_path / "out" / "report.json")


def prose(n: int, seed: int) -> str:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(n))


def code(seed: int) -> str:
    """A small function-per-paragraph module that the default filters keep."""
    w = prose(60, seed).split()
    return "\n\n".join(
        f"def {w[i]}_{w[i + 1]}({w[i + 2]}, {w[i + 3]}):\n    {w[i + 4]} = {w[i + 5]}({w[i + 2]}) + {i}\n"
        f"    return {w[i + 4]}.{w[i + 6]}({w[i + 3]})"
        for i in range(0, 49, 7)
    )


# --- normalisation -----------------------------------------------------------------------------


def test_unicode_forms():
    decomposed = "cafe\u0301 \ufb01le"
    assert normalise(decomposed, NormaliseConfig()) == "caf\u00e9 \ufb01le"
    assert normalise(decomposed, NormaliseConfig(unicode="NFKC")) == "caf\u00e9 file"
    assert normalise(decomposed, NormaliseConfig(unicode="none")) == decomposed


def test_whitespace_keeps_indentation():
    text = "\n  \n    def f():\r\n        return 1   \r\n\n\n\n\n\n\tx = 2\t\r    # end  \n\n"
    assert normalise(text, NormaliseConfig()) == "    def f():\n        return 1\n\n\n\tx = 2\n    # end\n"
    assert normalise("  x = 1", NormaliseConfig()) == "  x = 1"
    assert normalise("x = 1\n", NormaliseConfig()) == "x = 1\n"


def test_control_characters_removed_except_newline_and_tab():
    assert normalise("\ufeffa\x00b\x1b[0mc\td\x85e\n", NormaliseConfig()) == "ab[0mc\tde\n"
    assert normalise("a\x7fb\x9f", NormaliseConfig()) == "ab"  # DEL and the last C1 control


def test_each_normalisation_option_can_be_switched_off():
    text = "\n\ncafe\u0301\x07  \r\nx\n\n\n\n\ny\n"
    off = dict(unicode="none", newlines=False, remove_control_chars=False, strip_trailing_whitespace=False,
               max_blank_lines=None, strip_blank_edges=False)
    assert normalise(text, NormaliseConfig(**off)) == text
    assert normalise(text, NormaliseConfig(**{**off, "max_blank_lines": 1})) == "\ncafe\u0301\x07  \r\nx\n\ny\n"
    assert normalise(text, NormaliseConfig(**{**off, "max_blank_lines": 0})) == "cafe\u0301\x07  \r\nx\ny\n"
    assert normalise(text, NormaliseConfig(**{**off, "strip_blank_edges": True})) == "cafe\u0301\x07  \r\nx\n\n\n\n\ny\n"
    assert normalise("a\n\n \n", NormaliseConfig(**{**off, "strip_blank_edges": True})) == "a\n"
    assert normalise(text, NormaliseConfig(**{**off, "newlines": True})) == text.replace("\r\n", "\n")
    assert normalise(text, NormaliseConfig(**{**off, "remove_control_chars": True})) == text.replace("\x07", "")
    assert normalise("a  \nb\t", NormaliseConfig(**{**off, "strip_trailing_whitespace": True})) == "a\nb"


def test_a_run_of_blank_lines_no_longer_than_max_blank_lines_is_left_as_it_is():
    """Only longer runs are shortened: with trailing whitespace kept, a blank line of spaces in a run of
    max_blank_lines keeps them; a longer run becomes max_blank_lines empty lines."""
    keep_ws = NormaliseConfig(strip_trailing_whitespace=False, max_blank_lines=1)
    assert normalise("a\n  \nb\n", keep_ws) == "a\n  \nb\n"
    assert normalise("a\n  \n\t\nb\n", keep_ws) == "a\n\nb\n"
    assert normalise("a\n \n \nb\n", keep_ws.model_copy(update={"max_blank_lines": 2})) == "a\n \n \nb\n"


def test_newlines_are_converted_before_control_characters_go():
    """The order the docstring gives, which the cleaned data depends on: a control character between a
    "\\r" and a "\\n" leaves two line ends, not one "\\r\\n"."""
    assert normalise("a\r\x00\nb", NormaliseConfig()) == "a\n\nb"
    assert normalise("a\r\x00\nb", NormaliseConfig(max_blank_lines=0)) == "a\nb"


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_normalised_text_is_in_the_form_and_normalising_it_again_changes_nothing(form):
    """Removing a control character (or a BOM) between a letter and its accent brings them together: the form
    is taken after, so "cafe" + control + U+0301 becomes the same text as "café" (and dedups with it)."""
    cfg = NormaliseConfig(unicode=form)
    for text in ["cafe\x01\u0301 au lait", "cafe\ufeff\u0301", "A\x7f\u030a\r\n\ufb01 \u00a0\n"]:
        once = normalise(text, cfg)
        assert unicodedata.is_normalized(form, once)
        assert normalise(once, cfg) == once
    assert normalise("cafe\x01\u0301 au lait", cfg) == normalise("caf\u00e9 au lait", cfg) == "caf\u00e9 au lait"


def test_blank_document_normalises_to_empty():
    assert normalise(" \n\t\n  ", NormaliseConfig()) == ""
    # one blank line with no line end, its whitespace left by the options
    assert normalise(" \t ", NormaliseConfig(strip_trailing_whitespace=False)) == ""


# --- the stage ---------------------------------------------------------------------------------


def test_text_is_normalised_and_schema_kept(tmp_path):
    metrics, docs, _ = run(tmp_path, ["total = compute()   \r\nvalue = 2\r\n", "caf\u00e9 = brewed"])
    assert docs == [
        {"id": "id000", "text": "total = compute()\nvalue = 2\n", "source": "src/0.py", "location": "file",
         "chunk": None, "offset": None, "source_name": None, "split": None},
        {"id": "id001", "text": "caf\u00e9 = brewed", "source": "src/1.py", "location": "file",
         "chunk": None, "offset": None, "source_name": None, "split": None},
    ]
    assert DocTable(tmp_path / "out" / "docs", CleanError).schema_arrow.equals(SCHEMA)
    assert report(tmp_path)["docs_changed_by_normalise"] == 1
    assert report(tmp_path)["bytes_in"] == 33 + 14 and metrics["bytes"] == 28 + 14


def test_source_names_and_split_marks_are_carried_through(tmp_path):
    texts = [code(1), code(1), code(2)]  # the second is an exact duplicate
    table = pq.read_table(write_docs(tmp_path / "in.parquet", texts))
    table = table.append_column("source_name", pa.array(["web", "web", "bench"]))
    table = table.append_column("split", pa.array([None, None, "val"], pa.string()))
    pq.write_table(table, tmp_path / "named.parquet")
    out = tmp_path / "out" / "docs"
    run_clean(cfg(), tmp_path / "named.parquet", out, tmp_path / "out" / "q.jsonl")
    docs = read_out(out).to_pylist()
    assert [(d["id"], d["source_name"], d["split"]) for d in docs] == [("id000", "web", None), ("id002", "bench", "val")]


def test_exact_dedup_keeps_first_occurrence(tmp_path):
    a = code(1)
    metrics, docs, quarantine = run(tmp_path, [a, code(2), a.replace("\n", "   \r\n"), a])
    assert [d["id"] for d in docs] == ["id000", "id001"]
    assert report(tmp_path)["dropped"]["exact_duplicate"] == 2
    assert [q["source"] for q in quarantine] == ["src/2.py", "src/3.py"]

    metrics, docs, _ = run(tmp_path, [a, a], exact_dedup={"enabled": False}, near_dedup={"enabled": False})
    assert len(docs) == 2 and "exact_duplicate" not in report(tmp_path)["dropped"]


def test_near_dedup_drops_small_edits_and_keeps_unrelated(tmp_path):
    base = prose(400, seed=1).split()
    edited = list(base)
    for i in (50, 150, 250):
        edited[i] = "changed"
    texts = [" ".join(base), prose(400, seed=2), " ".join(edited)]
    metrics, docs, quarantine = run(tmp_path, texts)
    assert [d["id"] for d in docs] == ["id000", "id001"]
    assert report(tmp_path)["dropped"]["near_duplicate"] == 1
    (q,) = quarantine
    assert q["reason"] == "near_duplicate" and q["source"] == "src/2.py"
    assert "id id002:" in q["detail"] and "with kept id id000" in q["detail"]

    _, docs, _ = run(tmp_path, texts, near_dedup={"enabled": False})
    assert len(docs) == 3
    # A stricter threshold than the documents' similarity keeps the edited copy.
    _, docs, _ = run(tmp_path, texts, near_dedup={"threshold": 1.0})
    assert len(docs) == 3


MIXED = [
    code(1),                       # kept
    "lorem ipsum dolor sit amet",  # c4_lorem_ipsum
    code(1),                       # exact_duplicate
    "",                            # too_short
    code(2),                       # kept
    "counter = counter + 1\n" * 9,  # gopher_dup_lines
    prose(300, seed=5),            # kept
    prose(300, seed=5) + " tail",  # near_duplicate
    code(3),                       # kept
]


def test_accounting_identity_on_mixed_input(tmp_path):
    metrics, docs, quarantine = run(tmp_path, MIXED, batch_docs=2, row_group_docs=3)
    docs_in, dropped = report(tmp_path)["docs_in"], report(tmp_path)["dropped"]
    assert docs_in == len(MIXED) == 9
    assert metrics["docs"] == len(docs) == 4 and metrics["kept_frac"] == 0.4444
    # the manifest counts the rows written, which readers trust
    assert read_json(tmp_path / "out" / "docs" / "manifest.json")["rows"] == 4
    assert docs_in == metrics["docs"] + sum(dropped.values()) == metrics["docs"] + metrics["dropped"]
    fired = {k: v for k, v in dropped.items() if v}
    assert fired == {"c4_lorem_ipsum": 1, "exact_duplicate": 1, "too_short": 1, "gopher_dup_lines": 1,
                     "near_duplicate": 1}
    # Every enabled reason is listed, fired or not, so reports diff cleanly across runs.
    assert "gopher_bullet_lines" in dropped and "c4_curly_braces" not in dropped
    rep = report(tmp_path)
    assert set(rep["filters_enabled"]) | {"exact_duplicate", "near_duplicate"} == set(dropped)
    assert rep["near_dedup"]["candidates_checked"] >= 1 and rep["near_dedup"]["kept_in_index"] == 4
    assert metrics["bytes"] == sum(len(d["text"].encode()) for d in docs)
    assert pq.ParquetFile(tmp_path / "out" / "docs" / "shard-00000.parquet").metadata.num_row_groups == 2  # 3 + 1
    assert metrics["shards"] == 1 and metrics["shards_resumed"] == 0
    assert [d["id"] for d in docs] == ["id000", "id004", "id006", "id008"]


@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}, {"dedup": {"method": "sharded", "partition_docs": 3}}],
                         ids=["one-process", "two-workers", "sharded-dedup"])
def test_the_report_counts_each_source_s_documents_kept_and_dropped_by_reason(tmp_path, kw):
    """A mixture's user sees where a source's documents went: its drops are its
    own, told apart from the other sources' by ingest's source_name."""
    texts = MIXED * 2
    names = ["web", "code", "code"] * 6
    table = pq.read_table(write_docs(tmp_path / "in.parquet", texts))
    pq.write_table(table.append_column("source_name", pa.array(names)), tmp_path / "named.parquet", row_group_size=3)
    out = tmp_path / "out"
    metrics = run_clean(cfg(batch_docs=2, **kw), tmp_path / "named.parquet", out / "docs", out / "q.jsonl",
                        out / "report.json")
    # what each source should hold, from the documents written and the quarantine (every drop is kept in it)
    want: dict = {}
    for d in read_out(out / "docs").to_pylist():
        c = want.setdefault(d["source_name"], {"docs_in": 0, "docs": 0, "bytes": 0, "bytes_dropped": 0, "dropped": {}})
        c["docs_in"], c["docs"], c["bytes"] = c["docs_in"] + 1, c["docs"] + 1, c["bytes"] + len(d["text"].encode())
    for q in map(json.loads, (out / "q.jsonl").read_text().splitlines()):
        i = int(q["source"][4:-3])
        c = want.setdefault(names[i], {"docs_in": 0, "docs": 0, "bytes": 0, "bytes_dropped": 0, "dropped": {}})
        c["docs_in"] += 1
        c["bytes_dropped"] += len(texts[i].encode())
        c["dropped"][q["reason"]] = c["dropped"].get(q["reason"], 0) + 1
    got = read_json(out / "report.json")["per_source"]
    assert got == want and list(got) == ["code", "web"]
    assert sum(c["docs_in"] for c in got.values()) == 18 and sum(c["docs"] for c in got.values()) == metrics["docs"]
    assert {k: v for k, v in got["web"].items() if k != "bytes"} == {
        "docs_in": 6, "docs": 2, "bytes_dropped": len(code(1)) + len(prose(300, seed=5)),
        "dropped": {"too_short": 2, "exact_duplicate": 2}}


@pytest.mark.parametrize("kw", [{}, {"dedup": {"method": "sharded", "partition_docs": 3}}],
                         ids=["one-process", "sharded-dedup"])
def test_a_source_that_clean_empties_is_a_warning_with_its_reasons(tmp_path, kw, caplog):
    # junk: lorem, a duplicate, empty; one: a document of repeated lines
    names = ["web", "junk", "junk", "junk", "web", "one", "web", "web", "web"]
    table = pq.read_table(write_docs(tmp_path / "in.parquet", MIXED))
    pq.write_table(table.append_column("source_name", pa.array(names)), tmp_path / "named.parquet")
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="pipeline.data.clean"):
        run_clean(cfg(**kw), tmp_path / "named.parquet", out / "docs", out / "q.jsonl", out / "report.json")
    assert [r.getMessage() for r in caplog.records if r.name == "pipeline.data.clean"] == [
        f"source 'junk': clean dropped all 3 of its documents (c4_lorem_ipsum 1, exact_duplicate 1, too_short 1); "
        f"see {out / 'q.jsonl'}",
        f"source 'one': clean dropped all 1 of its documents (gopher_dup_lines 1); see {out / 'q.jsonl'}"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.data.clean"):
        run(tmp_path, MIXED)  # every source keeps documents
    assert not [r for r in caplog.records if r.name == "pipeline.data.clean"]


def test_an_input_without_source_names_is_counted_as_one_unnamed_source(tmp_path):
    metrics, docs, _ = run(tmp_path, MIXED)
    assert report(tmp_path)["per_source"] == {"(no source_name)": {
        "docs_in": 9, "docs": 4, "bytes": metrics["bytes"], "bytes_dropped": report(tmp_path)["bytes_in"] - sum(
            len(MIXED[int(d["id"][2:])].encode()) for d in docs),
        "dropped": {k: v for k, v in report(tmp_path)["dropped"].items() if v}}}


def test_quarantine_records_reason_source_location_and_text(tmp_path):
    texts = [code(1)] + [code(1)] * 3 + ["lorem ipsum"]
    metrics, _, quarantine = run(tmp_path, texts, quarantine_per_reason=1)
    assert report(tmp_path)["dropped"]["exact_duplicate"] == 3
    assert [(q["reason"], q["source"], q["location"]) for q in quarantine] == [
        ("exact_duplicate", "src/1.py", "file"),
        ("c4_lorem_ipsum", "src/4.py", "file"),
    ]
    assert quarantine[0]["text"] == code(1)
    assert quarantine[1]["detail"] == "id id004: contains 'lorem ipsum'"


def test_output_is_identical_for_any_worker_count(tmp_path):
    texts = MIXED * 3 + [prose(200, seed=s) for s in range(100, 110)] + [code(s) for s in range(10, 20)]
    results = []
    for workers in (1, 2):
        d = tmp_path / f"w{workers}"
        d.mkdir()
        metrics, docs, quarantine = run(d, texts, num_workers=workers, batch_docs=3)
        assert metrics.pop("workers") == workers
        metrics.pop("mb_per_s")
        results.append((metrics, report(d), docs, quarantine))
    assert results[0] == results[1]
    assert results[0][0]["docs"] == 4 + 20


def test_workers_are_capped_by_the_number_of_batches(tmp_path):
    metrics, _, _ = run(tmp_path, [code(1), code(2)], num_workers=4, batch_docs=64)
    assert metrics["workers"] == 1


def test_tasks_are_cut_by_text_size_and_workers_capped_by_it(tmp_path):
    """Eight documents are one task of the default size (in-process, one worker);
    with task_bytes below a document's size each is a task, both workers run,
    and the output is the same."""
    texts = [code(s) for s in range(1, 9)]
    assert min(len(t) for t in texts) > 500
    out = {}
    for name, kw in (("one", {}), ("many", {"task_bytes": 500})):
        (tmp_path / name).mkdir()
        metrics, docs, quarantine = run(tmp_path / name, texts, num_workers=2, **kw)
        metrics.pop("mb_per_s")
        out[name] = (metrics.pop("workers"), metrics, docs, quarantine)
    assert out["one"][0] == 1 and out["many"][0] == 2
    assert out["one"][1:] == out["many"][1:]


def test_row_groups_end_after_the_task_that_fills_row_group_bytes_or_docs(tmp_path):
    """Where pack's workers start reading: a row group ends after the task
    (here one document each) that brings its input text to row_group_bytes, or
    its documents to row_group_docs; the documents are the same either way."""
    texts = [code(s) for s in range(1, 13)]
    sizes = [len(t.encode()) for t in texts]
    out = {}
    for name, kw in (("bytes", {"row_group_bytes": 2 * max(sizes)}), ("docs", {"row_group_docs": 5}),
                     ("whole", {})):
        (tmp_path / name).mkdir()
        _, docs, _ = run(tmp_path / name, texts, task_bytes=1, **kw)
        table = DocTable(tmp_path / name / "out" / "docs", CleanError)
        out[name] = (docs, np.diff(table.row_groups()[0]).tolist())
    assert out["bytes"][0] == out["docs"][0] == out["whole"][0] and len(out["whole"][0]) == 12
    want, size = [0], 0
    for n in sizes:  # every document kept: the groups follow the input's sizes
        size += n
        want[-1] += 1
        if size >= 2 * max(sizes):
            want.append(0)
            size = 0
    assert out["bytes"][1] == [n for n in want if n] and len(want) > 3
    assert out["docs"][1] == [5, 5, 2] and out["whole"][1] == [12]


def test_empty_after_cleaning_is_a_clear_error(tmp_path):
    inp = write_docs(tmp_path / "in.parquet", ["a", "b"])
    out, q = tmp_path / "out" / "docs", tmp_path / "out" / "quarantine.jsonl"
    with pytest.raises(CleanError, match=r"no documents left after cleaning 2 document\(s\).*'too_short': 2"):
        run_clean(cfg(filters={"too_short": {"min_chars": 5}}), inp, out, q)
    one = write_docs(tmp_path / "one.parquet", ["a"])
    with pytest.raises(CleanError, match=r"no documents left after cleaning 1 document\(s\).*'too_short': 1"):
        run_clean(cfg(filters={"too_short": {"min_chars": 5}}), one, tmp_path / "one" / "docs", tmp_path / "q1.jsonl")
    # no manifest: readers refuse the folder
    assert not (out / "manifest.json").exists()
    with pytest.raises(CleanError, match="no manifest.json"):
        DocTable(out, CleanError)
    assert len(q.read_text().splitlines()) == 2


def test_missing_or_malformed_input_is_a_clear_error(tmp_path):
    out, q = tmp_path / "docs", tmp_path / "q.jsonl"
    with pytest.raises(CleanError, match="documents not found: .*nope.parquet; run the ingest stage first"):
        run_clean(cfg(), tmp_path / "nope.parquet", out, q)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["1"], "body": ["x"]}), bad)
    with pytest.raises(CleanError, match=r"lacks column\(s\) \['text', 'source', 'location'\]"):
        run_clean(cfg(), bad, out, q)
    empty = write_docs(tmp_path / "empty.parquet", [])
    with pytest.raises(CleanError, match="empty.parquet holds no documents: nothing to clean"):
        run_clean(cfg(), empty, out, q)  # not "no documents left after cleaning" and advice on the filters


def test_an_output_path_that_would_clear_or_replace_the_input_or_another_output_is_a_clear_error(tmp_path):
    """Checked before anything is removed: the output folder's stale shards were the input's (it was deleted,
    then a FileNotFoundError traceback), and a quarantine or report over the input file replaced it."""
    inp = write_docs(tmp_path / "in.parquet", [code(1), code(2)])
    run_clean(cfg(), inp, tmp_path / "docs", tmp_path / "q.jsonl")  # a documents folder, as ingest writes
    folder, before = tmp_path / "docs", files(tmp_path)
    for args, message in [
        ((folder, folder, tmp_path / "q2.jsonl"), "the output folder .*docs is the input"),
        ((folder / "shard-00000.parquet", folder, tmp_path / "q2.jsonl"), "the output folder .*docs holds the input"),
        ((inp, tmp_path / "out", inp), "the quarantine path .*in.parquet is the input"),
        ((inp, tmp_path / "out", tmp_path / "q2.jsonl", inp), "the report path .*in.parquet is the input"),
        ((folder, tmp_path / "out", folder / "manifest.json"), "the quarantine path .*manifest.json is inside the"),
        ((inp, tmp_path / "out", tmp_path / "out"), "the quarantine path .*out is the output folder"),
        ((inp, tmp_path / "out", tmp_path / "q2.jsonl", tmp_path / "q2.jsonl"), "the quarantine and the report are"),
    ]:
        with pytest.raises(CleanError, match=message):
            run_clean(cfg(), *args)
    assert files(tmp_path) == before  # nothing removed or written
    run_clean(cfg(), folder, tmp_path / "out", folder.parent / "q2.jsonl", tmp_path / "out" / "report.json")


@pytest.mark.parametrize("column,values,shown", [
    ("text", pa.array([b"caf\xe9 au lait", b"tea"], pa.binary()), "text: binary"),  # bytes that need not be UTF-8
    ("text", pa.array([1, 2]), "text: int64"),
    ("chunk", pa.array(["a", "b"]), "chunk: string"),
    ("offset", pa.array([1.5, 2.0]), "offset: double"),
])
def test_an_input_column_of_a_type_clean_does_not_read_is_a_clear_error(tmp_path, column, values, shown):
    """Found before any work, not as an Arrow cast error in a worker."""
    rows = {"id": ["a", "b"], "text": [code(1), code(2)], "source": ["a.py", "b.py"], "location": ["file", "file"]}
    pq.write_table(pa.table({**rows, column: values}), tmp_path / "in.parquet")
    with pytest.raises(CleanError, match=f"column\\(s\\) of a type clean does not read: {shown} "):
        run_clean(cfg(), tmp_path / "in.parquet", tmp_path / "docs", tmp_path / "q.jsonl")


def test_an_input_of_other_string_and_integer_types_is_read_as_the_schema_s(tmp_path):
    rows = pa.table({"id": pa.array([7, 8], pa.int32()), "text": pa.array([code(1), code(2)], pa.large_string()),
                     "source": pa.array(["a.py", "b.py"]).dictionary_encode(), "location": ["file", "file"],
                     "chunk": pa.nulls(2), "offset": pa.array([None, None], pa.int32())})
    pq.write_table(rows, tmp_path / "in.parquet")
    run_clean(cfg(), tmp_path / "in.parquet", tmp_path / "docs", tmp_path / "q.jsonl")
    out = read_out(tmp_path / "docs")
    assert out.schema == SCHEMA
    assert out.select(["id", "text", "source"]).to_pylist() == [
        {"id": "7", "text": code(1), "source": "a.py"}, {"id": "8", "text": code(2), "source": "b.py"}]


@pytest.mark.parametrize("data,key,message", [
    ({"near_dedup": {"bands": 3}}, "clean.near_dedup.bands", "must divide num_perm=128"),
    ({"near_dedup": {"num_perm": 64, "bands": 128}}, "clean.near_dedup.bands", "must divide num_perm=64"),
    ({"filters": {"gopher_dup_lines": {"max_fracc": 0.2}}}, "clean.filters.gopher_dup_lines.max_fracc", "unknown key"),
    ({"filters": {"no_such_filter": {}}}, "clean.filters.no_such_filter", "unknown key"),
    ({"num_workers": "two"}, "clean.num_workers", "valid integer"),
    ({"filters": {"gopher_bullet_lines": {"max_frac": 1.5}}}, "clean.filters.gopher_bullet_lines.max_frac",
     "less than or equal to 1"),
    ({"normalise": {"unicode": "NFD"}}, "clean.normalise.unicode", "'NFC', 'NFKC' or 'none'"),
    ({"near_dedup": {"threshold": 0}}, "clean.near_dedup.threshold", "greater than 0"),
    ({"near_dedup": {"num_perm": 128, "bands": 12}}, "clean.near_dedup.bands", "must divide num_perm=128"),
    # the default bands (16) must divide a num_perm given alone too, or rensa fails once the stage has started
    ({"near_dedup": {"num_perm": 100}}, "clean.near_dedup.bands", "must divide num_perm=100"),
])
def test_config_errors_name_the_dotted_key(data, key, message):
    with pytest.raises(ConfigError) as err:
        parse_section(CleanConfig, data, "clean")
    line = next(ln for ln in str(err.value).splitlines() if ln.strip().startswith(key + ":"))
    assert message in line


def test_shipped_params_parse_and_match_the_defaults():
    assert load_params("clean", ROOT / "params.yaml") == CleanConfig()


def test_stage_reports_a_missing_input_in_one_line(tmp_path):
    (tmp_path / "params.yaml").write_text("clean:\n  num_workers: 1\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "stages.clean"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert "error: stage clean failed: documents not found: data/ingest/docs" in r.stderr
    assert "Traceback" not in r.stderr


def write_chunks(path, chunks, row_group_size=2):
    """Chunks of one text file (``source`` book.txt) in the full ingest schema."""
    offsets = [0]
    for c in chunks[:-1]:
        offsets.append(offsets[-1] + len(c.encode()))
    rows = {"id": [f"c{i:03d}" for i in range(len(chunks))], "text": chunks, "source": ["book.txt"] * len(chunks),
            "location": [f"byte:{o}" for o in offsets], "chunk": list(range(len(chunks))), "offset": offsets,
            "source_name": ["book"] * len(chunks), "split": [None] * len(chunks)}
    pq.write_table(pa.table(rows, schema=SCHEMA), path, row_group_size=row_group_size)
    return path


def test_chunks_keep_their_blank_lines_and_are_accounted_like_documents(tmp_path):
    paras = [prose(30, seed=s) for s in range(6)]
    chunks = [f"{paras[0]}\n\n", f"{paras[1]}\n\n\n\n\n", f"{paras[2]} lorem ipsum\n\n", f"{paras[3]}   \n\n",
              f"{paras[0]}\n\n", f"\n{paras[4]}\n{paras[5]}\n"]
    inp = write_chunks(tmp_path / "in.parquet", chunks)
    for workers in (2, 1):  # the same result either way; the second run is the one inspected
        out, q = tmp_path / f"w{workers}" / "docs", tmp_path / f"w{workers}" / "quarantine.jsonl"
        metrics = run_clean(cfg(num_workers=workers, batch_docs=2), inp, out, q, tmp_path / "out" / "report.json")
        docs = read_out(out).to_pylist()
        if workers == 2:
            first = (docs, q.read_text())
    assert (docs, q.read_text()) == first and metrics["workers"] == 1
    # blank edges stay (they are the text's paragraph breaks); runs are still capped, trailing spaces stripped
    assert [(d["chunk"], d["text"]) for d in docs] == [
        (0, f"{paras[0]}\n\n"), (1, f"{paras[1]}\n\n\n"), (3, f"{paras[3]}\n\n"), (5, f"\n{paras[4]}\n{paras[5]}\n")]
    offsets = pq.read_table(inp).column("offset").to_pylist()
    assert (docs[1]["source"], docs[1]["location"], docs[1]["offset"]) == ("book.txt", f"byte:{offsets[1]}", offsets[1])
    rep = report(tmp_path)
    assert rep["docs_in"] == 6 == metrics["docs"] + metrics["dropped"]
    assert {k: v for k, v in rep["dropped"].items() if v} == {"c4_lorem_ipsum": 1, "exact_duplicate": 1}
    quarantine = [json.loads(line) for line in q.read_text().splitlines()]
    assert [(x["reason"], x["source"], x["location"]) for x in quarantine] == [
        ("c4_lorem_ipsum", "book.txt", f"byte:{offsets[2]}"), ("exact_duplicate", "book.txt", f"byte:{offsets[4]}")]


def test_the_older_num_workers_key_still_sets_the_executor():
    assert cfg(num_workers=3).executor.num_workers == 3
    assert cfg(num_workers=None).executor.num_workers == 0
    assert cfg(num_workers=2, executor={"num_workers": 2}).executor.num_workers == 2
    with pytest.raises(ConfigError, match="num_workers=2 and executor.num_workers=3 disagree"):
        cfg(num_workers=2, executor={"num_workers": 3})


# --- dedup.method memory: the workers read their rows -----------------------------------------

# Every outcome, normalisation changing some texts, a null text, a chunk.
READ_TEXTS = MIXED * 2 + [code(s) + "  \n\n\n\n" for s in range(30, 36)] + [None, "café\u0301 " + code(40)]


def parquet_and_quarantine(out) -> dict[str, bytes]:
    """The output's Parquet shards and the quarantine: what does not name the
    input (the shard records carry the input's digest in their fingerprint)."""
    got = {k: v for k, v in files(out).items() if k.endswith(".parquet") or k.endswith(".jsonl")}
    assert any(k.endswith(".parquet") for k in got)
    return got


def test_runs_and_outputs_do_not_depend_on_the_row_groups_the_workers_read(tmp_path):
    """The workers read whole row groups; the stage ends its runs, row groups and
    shards where it always did (every outcome, changed, null and accented
    texts), for any row groups and worker count."""
    outs = {}
    for groups, workers in ((1, 1), (4, 2), (50, 1)):
        d = tmp_path / f"g{groups}w{workers}"
        d.mkdir()
        inp = write_docs(d / "in.parquet", READ_TEXTS, row_group_size=groups)
        run_clean(cfg(num_workers=workers, batch_docs=3, task_bytes=900, row_group_docs=4, shard_bytes=3000), inp,
                  d / "out" / "docs", d / "out" / "quarantine.jsonl", d / "out" / "report.json")
        outs[groups, workers] = parquet_and_quarantine(d / "out")
        outs[groups, workers]["report"] = (d / "out" / "report.json").read_bytes()
    first = outs[1, 1]
    assert len([k for k in first if k.endswith(".parquet")]) >= 3
    assert all(o == first for o in outs.values())


def test_a_fresh_worker_cleans_its_rows_without_importing_pandas(tmp_path):
    """pyarrow imports pandas on its first compute call, to_numpy or pa.array of
    a list: 0.17 s of CPU in each worker process."""
    path = write_docs(tmp_path / "in.parquet", READ_TEXTS)
    script = (
        "import sys\n"
        "from pipeline.config import parse_section\n"
        "from pipeline.data import clean\n"
        "from pipeline.data.docs import identity\n"
        f"path = {str(path)!r}\n"
        "clean._init_worker(parse_section(clean.CleanConfig, {}, 'clean'),"
        " (path, identity(clean._open_input(__import__('pathlib').Path(path)))))\n"
        "res = clean.clean_rows(0, 20, None)\n"
        "print(res.rows.num_rows, res.normalised.null_count < 20, 'pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["20", "True", "False"], out.stderr


def test_the_stage_reads_no_text_when_its_workers_read_their_rows(tmp_path, monkeypatch):
    """Two spawned workers read the rows; the stage's own process reads none of
    the input (dedup.method memory), and writes what one in-process worker does."""
    want = tmp_path / "one"
    want.mkdir()
    run(want, READ_TEXTS, batch_docs=3, task_bytes=2000)
    read = []
    real = DocTable.iter_batches
    monkeypatch.setattr(DocTable, "iter_batches", lambda self, *a, **kw: read.append(self.path) or real(
        self, *a, **kw))
    got = tmp_path / "two"
    got.mkdir()
    metrics, _, _ = run(got, READ_TEXTS, batch_docs=3, task_bytes=2000, num_workers=2)
    assert metrics["workers"] == 2
    assert not [p for p in read if p.name == "in.parquet"], read
    assert parquet_and_quarantine(got / "out") == parquet_and_quarantine(want / "out")


def test_tasks_a_worker_cannot_read_are_cleaned_by_the_stage_then_sent(tmp_path, monkeypatch, caplog):
    """As on a Ray node without the stage's storage (here one in-process worker
    told of other files than it sees): the first task comes back with the
    reason, the stage cleans it and sends the rows of the rest; the same bytes,
    and one warning."""
    from pipeline.data import clean

    want = tmp_path / "want"
    want.mkdir()
    run(want, READ_TEXTS, batch_docs=3, task_bytes=2000)
    path = tmp_path / "in.parquet"
    monkeypatch.setattr(clean, "identity", lambda table: [[str(path), 1, 2]])
    sent = []
    real = clean.clean_rows
    monkeypatch.setattr(clean, "clean_rows", lambda a, b, message: sent.append(message is not None) or real(
        a, b, message))
    with caplog.at_level("WARNING", logger="pipeline.data.clean"):
        run(tmp_path, READ_TEXTS, batch_docs=3, task_bytes=2000)
    # the first task goes out unsent and comes back; the stage cleans it (sent), then sends the rest
    assert sent[:2] == [False, True] and all(sent[2:]) and len(sent) > 3
    [line] = [r.getMessage() for r in caplog.records if "does not see" in r.getMessage()]
    assert re.match(rf"1 task\(s\) went to a worker that does not see the input as the stage does \(on \S+: "
                    rf"{re.escape(str(path))} is \d+ bytes, modified at \d+ ns here, not as the stage saw it\); "
                    r"the stage cleaned them itself and sent the rows of the tasks after them", line), line
    assert parquet_and_quarantine(tmp_path / "out") == parquet_and_quarantine(want / "out")


def test_a_row_group_too_large_for_a_task_is_read_by_the_stage_in_runs(tmp_path, monkeypatch):
    """One row group of more than BIG_GROUP tasks of text: the stage sends it in
    runs (so that no task holds the whole group), with the bytes of small row
    groups that the workers read."""
    from pipeline.data import clean
    from pipeline.data.docs import BIG_GROUP

    want = tmp_path / "want"
    want.mkdir()
    run(want, READ_TEXTS, batch_docs=3, task_bytes=900)
    one = write_docs(tmp_path / "one.parquet", READ_TEXTS, row_group_size=len(READ_TEXTS))
    assert DocTable(one, CleanError).row_groups()[1][0] > BIG_GROUP * 900
    sent = []
    real = clean.clean_rows
    monkeypatch.setattr(clean, "clean_rows", lambda a, b, message: sent.append((a, b, message is not None)) or real(
        a, b, message))
    run_clean(cfg(batch_docs=3, task_bytes=900), one, tmp_path / "out" / "docs", tmp_path / "out" / "quarantine.jsonl")
    assert len(sent) > BIG_GROUP and all(m for _, _, m in sent)
    assert [b for _, b, _ in sent[:-1]] == [a for a, _, _ in sent[1:]] and sent[-1][1] == len(READ_TEXTS)
    assert parquet_and_quarantine(tmp_path / "out") == parquet_and_quarantine(want / "out")


def test_a_text_shorter_than_the_shingle_size_is_one_shingle():
    """So that short documents can still be near duplicates of each other; an empty one has none."""
    from pipeline.data.clean import shingles

    assert shingles("a  b\nc", 5) == ["a b c"]
    assert shingles("a b c", 2) == ["a b", "b c"]
    assert shingles(" \n", 5) == []


def test_filters_judge_the_normalised_text(tmp_path):
    """"ab" and five control characters: 7 characters as read, 2 once normalised, so too short for 4."""
    metrics, docs, quarantine = run(tmp_path, ["ab\x00\x01\x02\x03\x04", code(1)],
                                     filters={"too_short": {"min_chars": 4}})
    assert [d["id"] for d in docs] == ["id001"]
    assert [(q["reason"], q["detail"]) for q in quarantine] == [("too_short", "id id000: chars 2 < 4")]


class _AllKept:
    """An LSH stand-in whose every query returns every kept key, latest first or (``ascending``) earliest
    first: rensa's order is its own; NearDedup's rule decides."""

    def __init__(self, ascending=False):
        self.keys, self.ascending = [], ascending

    def insert(self, key, minhash):
        self.keys.append(key)

    def query(self, minhash):
        return list(self.keys) if self.ascending else list(reversed(self.keys))


class _Sig:
    def __init__(self, slots):
        self.slots = slots

    def digest(self):
        return self.slots


@pytest.mark.parametrize("ascending", [False, True])
def test_near_dedup_drops_at_the_threshold_and_names_the_earliest_of_equal_matches(ascending):
    from pipeline.data.clean import NearDedup, NearDedupConfig

    near = NearDedup(NearDedupConfig(num_perm=8, bands=2, threshold=0.75))
    near.lsh = _AllKept(ascending)
    assert near.check("a", _Sig([1, 2, 3, 4, 5, 6, 7, 8])) is None
    assert near.check("b", _Sig([1, 2, 3, 4, 5, 6, 70, 80])) == "jaccard~0.750 with kept id a"  # 6 of 8
    assert near.check("c", _Sig([1, 2, 3, 4, 5, 60, 70, 80])) is None  # 5 of 8 with a, below 0.75
    # d equals a and c in 6 slots each: a, the earlier kept, is named, whichever the index lists first
    assert near.check("d", _Sig([1, 2, 3, 4, 5, 60, 7, 99])) == "jaccard~0.750 with kept id a"
    assert near.check("e", _Sig([1, 2, 3, 4, 50, 60, 70, 80])) == "jaccard~0.875 with kept id c"
    assert (near.candidates_checked, near.candidates_rejected) == (1 + 1 + 2 + 2, 0 + 1 + 0 + 1)


def test_a_threshold_below_what_the_lsh_bands_find_is_a_warning(tmp_path, caplog):
    """16 bands of 8 rows make a candidate of 6% of the pairs of Jaccard 0.5: near_dedup.threshold 0.5 would
    drop few of them, silently."""
    for d in ("default", "rows-1", "off", "low"):
        (tmp_path / d).mkdir()
    with caplog.at_level(logging.WARNING, logger="pipeline.data.clean"):
        run(tmp_path / "default", [code(1)])  # 0.8: 95%
        run(tmp_path / "rows-1", [code(1)], near_dedup={"threshold": 0.5, "bands": 128})  # 100%
        run(tmp_path / "off", [code(1)], near_dedup={"threshold": 0.5, "enabled": False})
        assert not caplog.records
        run(tmp_path / "low", [code(1)], near_dedup={"threshold": 0.5})
    assert [r.getMessage() for r in caplog.records] == [
        "clean.near_dedup.threshold 0.5: the LSH (16 bands of 8 rows) makes a candidate of 6% of the pairs that "
        "similar, so most near duplicates at the threshold are kept; more bands of fewer rows find more"]


def test_lone_carriage_returns_are_line_ends_too():
    """A file saved with old Mac line ends has no "\\r\\n" at all: each "\\r" still ends a line."""
    assert normalise("x = 1\ry = 2\r", NormaliseConfig()) == "x = 1\ny = 2\n"


def test_row_groups_and_shards_end_at_the_run_that_brings_their_text_exactly_to_the_limit(tmp_path):
    """Twelve documents of one size, a run each: a row group ends once its text is two documents', a
    shard once it is three documents'."""
    texts = [prose(60, seed=s) for s in range(12)]
    size = max(map(len, texts))
    texts = [t + "q" * (size - len(t)) for t in texts]  # ASCII: a character is a byte
    metrics, docs, _ = run(tmp_path, texts, task_bytes=1, row_group_bytes=2 * size, shard_bytes=3 * size)
    assert len(docs) == 12 and metrics["shards"] == 4
    table = DocTable(tmp_path / "out" / "docs", CleanError)
    assert np.diff(table.row_groups()[0]).tolist() == [2, 1] * 4


def test_null_texts_are_empty_documents(tmp_path):
    """A null text (another tool's Parquet) is the empty text: too short by default, kept as "" (not null)
    when too_short is off, in runs of its own too."""
    texts = [None, code(1), None]
    metrics, docs, quarantine = run(tmp_path, texts, batch_docs=1)
    assert [d["id"] for d in docs] == ["id001"] and report(tmp_path)["bytes_in"] == len(code(1))
    assert [q["reason"] for q in quarantine] == ["too_short", "too_short"] and "text" not in quarantine[0]
    for method in ("memory", "sharded"):
        (tmp_path / method).mkdir()
        _, docs, _ = run(tmp_path / method, texts, batch_docs=1, filters={"too_short": {"enabled": False}},
                         dedup={"method": method})
        assert [(d["id"], d["text"]) for d in docs] == [("id000", ""), ("id001", code(1))]  # id002: a duplicate


def test_the_report_lists_every_enabled_filter_and_dedup_pass_that_did_not_fire(tmp_path):
    run(tmp_path, [code(1)])
    r = report(tmp_path)
    assert r["dropped"] == {**{name: 0 for name in r["filters_enabled"]}, "exact_duplicate": 0, "near_duplicate": 0}
    (tmp_path / "off").mkdir()
    run(tmp_path / "off", [code(1)], exact_dedup={"enabled": False}, near_dedup={"enabled": False},
        filters={"c4_policy": {"enabled": False}})
    r = report(tmp_path / "off")
    assert r["dropped"] == {name: 0 for name in r["filters_enabled"]} and "c4_policy" not in r["dropped"]
    assert r["near_dedup"] == {}


def test_the_quarantine_keeps_per_reason_samples_over_all_shards(tmp_path):
    """Each shard's record keeps its own samples; the quarantine keeps the first quarantine_per_reason of
    them all."""
    _, _, quarantine = run(tmp_path, ["x", "y", "z", code(1)], batch_docs=1, shard_bytes=1, quarantine_per_reason=2)
    assert [q["text"] for q in quarantine] == ["x", "y"]
    assert report(tmp_path)["dropped"]["gopher_mean_word_length"] == 3


@pytest.mark.parametrize("method", ["memory", "sharded"])
def test_documents_changed_by_normalise_are_those_whose_text_changed(tmp_path, method):
    # code(1), code(4): unchanged; a null text reads as "", which is unchanged (and too short)
    texts = [code(1), code(2) + "  ", code(3).replace("\n", "\r\n"), code(4), None, ""]
    run(tmp_path, texts, dedup={"method": method})
    assert report(tmp_path)["docs_changed_by_normalise"] == 2


def test_tasks_that_worker_processes_cannot_read_are_cleaned_by_the_stage_s_own_process(tmp_path, monkeypatch):
    """The stage's own process, whose worker state was never set (its workers are other processes here), sets
    it before it cleans a task they handed back."""
    from pipeline.data import clean

    want = tmp_path / "want"
    want.mkdir()
    run(want, READ_TEXTS, batch_docs=3, task_bytes=2000)
    monkeypatch.setattr(clean, "_worker", {})  # as in a fresh stage process
    monkeypatch.setattr(clean, "identity", lambda table: [[str(tmp_path / "in.parquet"), 1, 2]])
    metrics, _, _ = run(tmp_path, READ_TEXTS, batch_docs=3, task_bytes=2000, num_workers=2)
    assert metrics["workers"] == 2
    assert parquet_and_quarantine(tmp_path / "out") == parquet_and_quarantine(want / "out")
