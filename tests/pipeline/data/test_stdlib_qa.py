import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from collections import Counter

import pytest

from pipeline.data.sft_data import BUILTIN_DATASETS
from pipeline.data.stdlib_qa import records, stdlib_files, stdlib_qa
from pipeline.errors import StageError


def test_records_are_questions_and_answers_about_the_stdlib():
    full = list(records())
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


# --- a small made-up standard library: every rule of the derivation, pinned --------------------

ALPHA = '''
def f(a, /, b, *, c=1, **kw):
    """Return a value computed from a, b and c here."""

async def fetch(url, _cache=None):
    """Fetch the resource at url asynchronously, for tests."""

def _private():
    """A private function with a long enough docstring."""

def undocumented(x):
    pass

class Thing:
    """A thing that holds values for the synthetic stdlib tests."""

    def __init__(self, size, *args):
        pass

    def method(self, x):
        """Return x scaled by the size of this thing, rounded."""

    @staticmethod
    def build(x, y):
        """Build a thing from x and y, the static way round."""

    def _hidden(self):
        """A hidden method with a long enough docstring."""

    def parse(self, s):
        """parse(s) -> Thing

        Parse s into a thing, carefully and in full."""

class Bare:
    """A class without an __init__ method, described here."""

class Plain:
    """Another class without an __init__, so no parameters."""

class Empty:
    """A third class without an __init__, and no parameters."""

class Hollow:
    """A fourth class without an __init__, nor parameters."""

def sigline(x):
    """sigline(x) -> int

    Return the integer value of x, after checks."""

def lines(x):
    """First line of a paragraph that
    wraps onto a second line, unwrapped.

    A second paragraph, left out."""

def doctest(x):
    """>>> doctest(12345678901234567890)
    12345678901234567890"""

def symbols(x):
    """------------------------------------------"""

def short(x):
    """Too short to answer."""

def toolong(x):
    """%s"""

def exact(aaaaaaaaaa, bbbbbbbbbb, cccccccccc, dddddddddd, eeeee, fffff):
    """A signature of exactly sixty characters, shown whole."""

def over(aaaaaaaaaa, bbbbbbbbbb, cccccccccc, dddddddddd, eeeee, ffffff):
    """A signature of sixty-one characters, cut short."""

def defaults(x=123456789012345678901, y=12345678901234567890):
    """Defaults of more than twenty characters, and of twenty."""

def again():
    """The first definition of again, the one kept."""

def again():
    """The second definition of again, left out."""

def spaced(x):
    """A paragraph ended by a line of the docstring's indent.
    \n    A second paragraph, left out."""
''' % ("word " * 150)

GOLDEN = [
    ('alpha/__init__.py:Thing.method',
     'What does `alpha.Thing.method(x)` do?',
     'Return x scaled by the size of this thing, rounded.'),
    ('alpha/__init__.py:Thing.build',
     'Briefly, what happens when you call `alpha.Thing.build(x, y)`?',
     'Build a thing from x and y, the static way round.'),
    ('alpha/__init__.py:Bare',
     "In Python's `alpha` module, what is the class `Bare` for?",
     'A class without an __init__ method, described here.'),
    ('alpha/__init__.py:over',
     'What does `alpha.over(aaaaaaaaaa, bbbbbbbbbb, cccccccccc, dddddddddd, eeeee, ...)` do?',
     'A signature of sixty-one characters, cut short.'),
    ('omega.py:twice',
     "In Python's `omega` module, what is `twice` used for?",
     'The omega module as a file, the one kept.'),
    ('alpha/__init__.py:Thing.parse',
     'Briefly, what happens when you call `alpha.Thing.parse(s)`?',
     'Parse s into a thing, carefully and in full.'),
    ('alpha/__init__.py:defaults',
     'What does `alpha.defaults(x=..., y=12345678901234567890)` do?',
     'Defaults of more than twenty characters, and of twenty.'),
    ('epsilon.py:nested',
     "In Python's `epsilon` module, what is `nested` used for?",
     'A default value nested too deep to unparse.'),
    ('alpha/__init__.py:f',
     'Explain what `alpha.f(a, /, b, *, c=1, **kw)` does in the Python standard library.',
     'Return a value computed from a, b and c here.'),
    ('alpha/__init__.py:Hollow',
     "In Python's `alpha` module, what is the class `Hollow` for?",
     'A fourth class without an __init__, nor parameters.'),
    ('alpha/__init__.py:sigline',
     'Explain what `alpha.sigline(x)` does in the Python standard library.',
     'Return the integer value of x, after checks.'),
    ('alpha/__init__.py:Thing',
     'What does the class `alpha.Thing(size, *args)` represent?',
     'A thing that holds values for the synthetic stdlib tests.'),
    ('alpha/__init__.py:lines',
     'Explain what `alpha.lines(x)` does in the Python standard library.',
     'First line of a paragraph that wraps onto a second line, unwrapped.'),
    ('gamma.py:café', 'What does `gamma.café()` do?', 'Café au lait, from a latin-1 source file.'),
    ('alpha/__init__.py:again',
     'Explain what `alpha.again()` does in the Python standard library.',
     'The first definition of again, the one kept.'),
    ('alpha/__init__.py:exact',
     'Briefly, what happens when you call `alpha.exact(aaaaaaaaaa, bbbbbbbbbb, cccccccccc, dddddddddd, eeeee, fffff)`?',
     'A signature of exactly sixty characters, shown whole.'),
    ('alpha/__init__.py:Empty',
     "In Python's `alpha` module, what is the class `Empty` for?",
     'A third class without an __init__, and no parameters.'),
    ('alpha/__init__.py:spaced',
     'What does `alpha.spaced(x)` do?',
     "A paragraph ended by a line of the docstring's indent."),
    ('alpha/__init__.py:Plain',
     "What is the `alpha.Plain` class in Python's standard library?",
     'Another class without an __init__, so no parameters.'),
    ('beta.py:beta',
     "In Python's `beta` module, what is `beta` used for?",
     'The only function of the beta module, kept.'),
    ('alpha/__init__.py:fetch',
     'Explain what `alpha.fetch(url)` does in the Python standard library.',
     'Fetch the resource at url asynchronously, for tests.'),
]


def make_stdlib(root):
    (root / "alpha").mkdir(parents=True)
    (root / "alpha" / "__init__.py").write_text(ALPHA)
    (root / "alpha" / "_impl.py").write_text('def hidden_module():\n    """A function in a private module."""\n')
    (root / "test").mkdir()
    (root / "test" / "mod.py").write_text('def in_tests():\n    """A function of the test suite, left out."""\n')
    (root / "_private_pkg").mkdir()
    (root / "_private_pkg" / "mod.py").write_text('def in_private():\n    """A function of a private package."""\n')
    (root / "__init__.py").write_text('def top():\n    """In no module at all, so left out."""\n')
    (root / "omega").mkdir()  # "omega" twice: the file before the folder's __init__.py, which repeats it
    (root / "omega.py").write_text('def twice():\n    """The omega module as a file, the one kept."""\n')
    (root / "omega" / "__init__.py").write_text('def twice():\n    """The omega module as a package, left out."""\n')
    (root / "beta.py").write_text('def beta():\n    """The only function of the beta module, kept."""\n')
    latin = b'# -*- coding: latin-1 -*-\ndef caf\xe9():\n    """Caf\xe9 au lait, from a latin-1 source file."""\n'
    (root / "gamma.py").write_bytes(latin)
    (root / "delta.py").write_bytes(latin.split(b"\n", 1)[1])  # the same without its coding line: not UTF-8
    (root / "broken.py").write_text("def broken(:\n")
    (root / "deep.py").write_text("x = " + "+".join(["1"] * 50_000) + "\n")  # deeper than ast can build
    (root / "epsilon.py").write_text("def nested(a=" + "+".join(["1"] * 900) + "):\n"  # deeper than ast.unparse goes
                                     '    """A default value nested too deep to unparse."""\n')
    (root / "huge.py").write_text('def huge():\n    """A function in a huge generated file."""\n' + "#" * 400_000)
    (root / "dangling.py").symlink_to(root / "missing.py")
    (root / "notes.txt").write_text("not Python")
    return root


def test_a_made_up_stdlib(tmp_path):
    skipped = Counter()
    # every pair, in its order (by a hash of the question) and with the template picked for it
    assert stdlib_qa(make_stdlib(tmp_path / "lib"), skipped) == GOLDEN
    assert skipped == {"file unreadable": 1, "file too large": 1, "file not parsable": 3, "no docstring": 1,
                       "no usable first paragraph": 4, "repeated question or location": 2}


def test_a_location_given_twice_with_other_parameters_keeps_its_first(tmp_path):
    """A property and its setter: one location, two questions (their parameter lists differ; the
    template picked for P.length shows them)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mod.py").write_text(
        "class P:\n"
        "    @property\n"
        "    def length(self):\n"
        '        """The length of the thing, in bytes, as read."""\n'
        "    @length.setter\n"
        "    def length(self, value):\n"
        '        """Set the length of the thing to value bytes."""\n')
    skipped = Counter()
    pairs = [(loc, a) for loc, _, a in stdlib_qa(tmp_path / "lib", skipped) if loc.endswith("length")]
    assert pairs == [("mod.py:P.length", "The length of the thing, in bytes, as read.")]
    assert skipped["repeated question or location"] == 1


def test_the_order_of_the_file_system_does_not_matter(tmp_path, monkeypatch):
    root = make_stdlib(tmp_path / "lib")
    want_files, want = stdlib_files(root), stdlib_qa(root)
    # sorted names, a folder's files before its subfolders
    assert [p.relative_to(root).as_posix() for p in want_files] == [
        "__init__.py", "beta.py", "broken.py", "deep.py", "delta.py", "epsilon.py", "gamma.py", "omega.py",
        "alpha/__init__.py", "omega/__init__.py"]
    walk = os.walk

    def reversed_walk(top):  # what another file system may list first
        for dirpath, dirnames, filenames in walk(top):
            dirnames.reverse()
            filenames.reverse()
            yield dirpath, dirnames, filenames

    monkeypatch.setattr(os, "walk", reversed_walk)
    assert stdlib_files(root) == want_files
    assert stdlib_qa(root) == want


def test_a_python_without_library_sources_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    with pytest.raises(StageError, match="no documented .py files"):
        list(records())
