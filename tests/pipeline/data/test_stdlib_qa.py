import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time

from pipeline.data.sft_data import BUILTIN_DATASETS
from pipeline.data.stdlib_qa import records, stdlib_qa


def test_records_are_questions_and_answers_about_the_stdlib():
    t0 = time.perf_counter()
    full = list(records())
    assert time.perf_counter() - t0 < 20  # a few seconds normally; this is a shared CPU
    assert len(full) >= 1000
    questions = [r["messages"][0]["content"] for _, r in full]
    answers = [r["messages"][1]["content"] for _, r in full]
    assert len(set(questions)) == len(questions)
    assert len(set(answers)) > len(full) // 2  # not one boilerplate answer
    by_loc = dict(full)
    assert len(by_loc) == len(full)
    q, a = (m["content"] for m in by_loc["json/__init__.py:dump"]["messages"])
    assert q == "What does `json.dump(obj, fp, *, skipkeys=False, ensure_ascii=True, ...)` do?"
    assert a.startswith("Serialize ``obj`` as a JSON formatted stream to ``fp``")
    q, _ = (m["content"] for m in by_loc["json/decoder.py:JSONDecoder.decode"]["messages"])
    assert "`json.decoder.JSONDecoder.decode(s)`" in q  # its private _w=WHITESPACE.match left out
    assert not any("site-packages" in loc or loc.startswith("test/") for loc in by_loc)
    # Ordered by a hash of the question, so a capped prefix spans the library.
    assert len({loc.split("/")[0].split(".")[0] for loc in list(by_loc)[:300]}) > 50


def test_registered_as_the_builtin_sft_dataset():
    assert BUILTIN_DATASETS["stdlib-docstrings"] is records


def test_identical_across_processes():
    root = os.path.join(sysconfig.get_paths()["stdlib"], "email")
    code = ("import hashlib, json; from pipeline.data.stdlib_qa import stdlib_qa; "
            f"print(hashlib.sha256(json.dumps(stdlib_qa({root!r})).encode()).hexdigest())")
    here = hashlib.sha256(json.dumps(stdlib_qa(root)).encode()).hexdigest()
    assert len(stdlib_qa(root)) >= 50
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert got.stdout.strip() == here
