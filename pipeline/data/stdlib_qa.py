"""The built-in SFT dataset ``builtin:stdlib-docstrings``: question/answer pairs
about the public API of the Python standard library.

Each public function, method and class with a docstring gives one question (a
template picked by a hash of its name, showing a short signature) and one
answer (the docstring's first prose paragraph). It is derived with ``ast``
only: nothing is imported, so the set depends on the stdlib's files alone and is
identical across processes and hash seeds. Tests, tools, vendored and
generated modules are left out (:data:`STDLIB_SKIP_DIRS`).

:func:`records` yields the pairs in the ``messages`` chat format for
:mod:`pipeline.data.sft_data`. What is left out is counted by reason
(:func:`stdlib_qa`'s ``skipped``) and logged: files too large, unreadable or not
parsable as Python, and definitions without a docstring, without a usable
first paragraph, or whose question or location came earlier.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import os
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator

from pipeline.data.accounting import counts_text
from pipeline.errors import StageError

log = logging.getLogger("pipeline.data.stdlib_qa")

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
        try:
            text = ast.unparse(node) if node is not None else ""
        except RecursionError:  # a pathologically nested default: far too long to show anyway
            return "..."
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


def stdlib_files(root: Path, skipped: Counter[str] | None = None) -> list[Path]:
    """Public ``.py`` files under ``root`` in sorted order, skipping
    :data:`STDLIB_SKIP_DIRS`, private modules and packages, and huge files and
    ones that cannot be read (a broken link), which are counted in ``skipped``."""
    skipped = Counter() if skipped is None else skipped
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in STDLIB_SKIP_DIRS and not d.startswith(("_", ".", "config-")))
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if not (f.endswith(".py") and (f == "__init__.py" or not f.startswith("_"))):
                continue
            try:
                size = p.stat().st_size
            except OSError:
                skipped["file unreadable"] += 1
                continue
            if size > STDLIB_MAX_FILE_BYTES:
                skipped["file too large"] += 1
                continue
            out.append(p)
    return out


def stdlib_qa(root: str | Path | None = None, skipped: Counter[str] | None = None) -> list[tuple[str, str, str]]:
    """Question/answer pairs about the public API of the Python stdlib at ``root``
    (default: this interpreter's, from ``sysconfig``), derived with ``ast`` only:
    nothing is imported. Returns ``(location, question, answer)`` triples, one per
    distinct question and location (the first in file order wins), ordered by a
    hash of the question so that any prefix is spread over the whole library.
    What is left out is counted by reason in ``skipped`` and logged."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skipped = Counter() if skipped is None else skipped
    seen: set[str] = set()
    out: list[tuple[bytes, str, str, str]] = []
    files = stdlib_files(root, skipped)
    for path in files:
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if not parts:
            continue
        module = ".".join(parts)
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except OSError:
            skipped["file unreadable"] += 1
            continue
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
            skipped["file not parsable"] += 1  # a stray template, foreign syntax or an encoding error
            continue
        for kind, qualname, node, is_method in _module_defs(tree):
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                skipped["no docstring"] += 1
                continue
            answer = _first_paragraph(doc, qualname.rsplit(".", 1)[-1])
            if answer is None:
                skipped["no usable first paragraph"] += 1
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
                skipped["repeated question or location"] += 1
                continue
            seen.update((question, location))
            out.append((_digest(question, b"sft-ord"), location, question, answer))
    out.sort()
    log.info("stdlib-docstrings: %s question/answer pairs from %s files under %s; left out: %s", f"{len(out):,}",
             f"{len(files):,}", root, counts_text(skipped) or "nothing")
    return [(loc, q, a) for _, loc, q, a in out]


@functools.lru_cache(maxsize=2)
def _stdlib_qa_cached(root: str) -> tuple[tuple[str, str, str], ...]:
    # The stdlib does not change under a running process; tests and a stage that
    # read it twice pay for the parse once.
    return tuple(stdlib_qa(root))


def records() -> Iterator[tuple[str, dict]]:
    """``(location, record)`` for this interpreter's stdlib, records in the ``messages`` format.
    Raises :class:`StageError` if it gives none (a Python installed without its library's sources)."""
    root = sysconfig.get_paths()["stdlib"]
    pairs = _stdlib_qa_cached(root)
    if not pairs:
        raise StageError(f"builtin:stdlib-docstrings: no documented .py files in this Python's standard library "
                         f"at {root} (installed without its sources?); use another sft.data.sources entry")
    for loc, q, a in pairs:
        yield loc, {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}

