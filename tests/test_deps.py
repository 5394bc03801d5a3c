"""Each DVC stage's ``deps`` name exactly the project code that can change its
outputs, so that an edit reruns what it affects and nothing else.

The code a stage runs is the import closure of its ``stages/<name>.py``, read
with ``ast`` (imports inside functions count: they run too). Two kinds of file
in a closure are left out of ``deps``:

* the files in ``NO_OUTPUT_EFFECT``, each with the reason it cannot change what
  a stage writes; the closure does not follow their imports either, since what
  they import serves them;
* package ``__init__.py`` files that hold only a docstring and dunder constants
  (``__version__``): importing them runs nothing that a stage's outputs depend on.

The slow test at the end checks the promise against DVC itself.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, dvc, project_copy
from tests.imports import closure, rel

# file (or glob) -> why a change to it cannot change any stage's outputs
NO_OUTPUT_EFFECT = {
    "pipeline/progress.py": "progress bars on stderr",
    "pipeline/errors.py": "the expected-failure type; a failed stage records nothing in dvc.lock",
    "pipeline/runner.py": "loads params, calls the stage, writes the metrics dict the stage returns, "
                          "and reports failures; the stage's own code computes everything it writes",
    "pipeline/tracking/*": "MLflow runs and lineage tags describe a run; they compute no output "
                           "(the export card quotes git/DVC hashes, which the commit fixes, not this code)",
}
CODE = re.compile(r"^(pipeline/.+\.py|stages/[^/]+\.py)$")

STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def exempt(path: Path) -> bool:
    name = rel(path)
    return any(fnmatch.fnmatch(name, pattern) for pattern in NO_OUTPUT_EFFECT) or inert_init(path)


def inert_init(path: Path) -> bool:
    """An ``__init__.py`` of only a docstring and ``__dunder__ = <constant>`` lines."""
    if path.name != "__init__.py":
        return False
    for i, node in enumerate(ast.parse(path.read_text(encoding="utf-8")).body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and all(
                isinstance(t, ast.Name) and t.id.startswith("__") and t.id.endswith("__") for t in node.targets):
            continue
        return False
    return True


def stage_script(stage: str) -> Path:
    match = re.fullmatch(r"python -m ([\w.]+)", STAGES[stage]["cmd"].strip())
    assert match, f"stage {stage}: cmd {STAGES[stage]['cmd']!r} is not `python -m <module>`; teach this test"
    path = ROOT.joinpath(*match.group(1).split(".")).with_suffix(".py")
    assert path.is_file(), f"stage {stage}: {rel(path)} does not exist"
    return path


def code_deps(stage: str) -> set[str]:
    """The stage's ``deps`` that are project code, by file name."""
    names = [next(iter(d)) if isinstance(d, dict) else d for d in STAGES[stage].get("deps", [])]
    return {d.rstrip("/") for d in names if d.startswith(("pipeline", "stages"))}


def required_deps(stage: str) -> set[str]:
    return {rel(p) for p in closure(stage_script(stage), stop_at=exempt) if not exempt(p)}


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_deps_are_exactly_the_code_it_imports(stage):
    required, listed = required_deps(stage), code_deps(stage)
    problems = [f"dvc.yaml stage {stage}: deps lack {f} (the stage imports it; add it to deps, or, if it "
                f"cannot change outputs, to NO_OUTPUT_EFFECT in tests/test_deps.py with the reason)"
                for f in sorted(required - listed)]
    for f in sorted(listed - required):
        if not CODE.match(f) or not (ROOT / f).is_file():
            why = "is not a Python file of the project; list code files one by one"
        elif exempt(ROOT / f):
            why = "cannot change outputs (NO_OUTPUT_EFFECT or an inert __init__.py); listing it reruns for nothing"
        else:
            why = "is not imported by the stage; remove it"
        problems.append(f"dvc.yaml stage {stage}: deps list {f}, which {why}")
    assert not problems, "\n".join(problems)


def test_no_output_effect_names_real_files():
    for pattern, reason in NO_OUTPUT_EFFECT.items():
        assert reason.strip(), pattern
        assert list(ROOT.glob(pattern)), f"NO_OUTPUT_EFFECT: {pattern} matches no file"


# --------------------------------------------------------------------------- DVC agrees

# the packed-row reader (the "training data loader") is read by every stage that trains or scores
READERS = {"pretrain", "sft", "evaluate"}


def changed_stages(status: str) -> set[str]:
    # `dvc status` prints "<stage>:" at the start of a line for each changed stage
    return {m for m in re.findall(r"^([\w-]+):\s*$", status, flags=re.M) if m in STAGES}


@pytest.mark.slow
def test_dvc_status_follows_code_edits(tmp_path):
    """With every stage recorded as up to date (placeholder outputs committed with
    ``dvc commit``, nothing trained), an edit to the packed-row reader makes exactly
    the stages that import it stale, an edit to the progress bars makes none stale,
    and a new file in data/raw makes ingest and sft stale."""
    root = project_copy(tmp_path)
    for stage, spec in STAGES.items():
        for item in [*spec.get("deps", []), *spec.get("outs", []), *spec.get("metrics", []),
                     *spec.get("plots", [])]:
            path = root / (next(iter(item)) if isinstance(item, dict) else item)
            if path.exists():
                continue
            if path.suffix:  # a file: metrics json, plots csv, tokenizer.json, docs.parquet
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("{}\n" if path.suffix == ".json" else "placeholder\n")
            else:
                path.mkdir(parents=True)
                (path / "placeholder").write_text(stage)
    dvc(root, "commit", "--force", "--quiet")
    assert changed_stages(dvc(root, "status")) == set()

    reader = root / "pipeline" / "data" / "shards.py"
    reader.write_text(reader.read_text() + "\n# an edit\n")
    expected = {s for s in STAGES if "pipeline/data/shards.py" in required_deps(s)}
    assert READERS <= expected, "the reader's importers changed; update this test"
    assert changed_stages(dvc(root, "status")) == expected

    dvc(root, "commit", "--force", "--quiet")
    progress = root / "pipeline" / "progress.py"
    progress.write_text(progress.read_text() + "\n# an edit\n")
    assert changed_stages(dvc(root, "status")) == set()

    # SFT data in data/raw, as the README's recipe puts it: sft reads it (ingest depends on the folder too).
    (root / "data" / "raw" / "chat.jsonl").write_text('{"messages": []}\n')
    assert changed_stages(dvc(root, "status")) == {"ingest", "sft"}
