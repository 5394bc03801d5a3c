"""Shared test set-up: quiet progress bars, repo paths, and a helper to build a
throw-away copy of the project for end-to-end DVC tests."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

os.environ.setdefault("PIPELINE_PROGRESS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests that exercise MLflow opt in with PIPELINE_TRACKING=1 and a tmp database;
# nothing else pays mlflow's import or touches the repo's mlflow.db.
os.environ.setdefault("PIPELINE_TRACKING", "0")
# The tests' own DVC projects send no usage reports: `dvc init` runs before
# `core.analytics false` can be set, and its report's daemon leaves a file in
# the temp dir when it cannot reach the network.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
# `import dvc` gives its logger a handler on the sys.stdout of that moment. Imported
# first inside a test that captures output, that is the test's own stream, closed
# when the test ends, and every later DVC log line in that process raises
# (dvc.logger.LoggingException: I/O operation on closed file). Imported here, it
# is the session's.
import dvc  # noqa: E402,F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with more tests marked slow run first, the others keep their order.
    `make test` hands whole files to two processes (pytest-xdist, ``--dist
    loadfile --no-loadscope-reorder``) in this order: the end-to-end files start
    early, and the many quick files fill the end, instead of one long file
    running alone on one core while the other waits."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: on a shared machine a thread pool only adds contention.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with the pipeline's special tokens (tests/helpers.CORPUS)."""
    from tests.helpers import train_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tiny_tokenizer(path)
    return path


def dvc(cwd: Path, *args: str, env: dict | None = None, timeout: float = 900) -> str:
    """``dvc *args`` in ``cwd`` (with this environment's bin first on PATH unless
    ``env`` is given); asserts it succeeded and returns what it printed."""
    env = env or {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([str(BIN / "dvc"), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def project_copy(dest: Path, params_overrides: dict | None = None) -> Path:
    """Copy the project's code and DVC files into ``dest`` as a fresh git+DVC repo."""
    import yaml

    for name in ("pipeline", "stages", "flows", "dvc.yaml", "params.yaml", "pyproject.toml", ".dvcignore",
                 ".gitignore"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    (dest / "data" / "raw").mkdir(parents=True)
    shutil.copy2(ROOT / "data" / "raw" / "README.md", dest / "data" / "raw" / "README.md")
    (dest / "models" / "base").mkdir(parents=True)
    shutil.copy2(ROOT / "models" / "base" / "README.md", dest / "models" / "base" / "README.md")
    if params_overrides:
        params = yaml.safe_load((dest / "params.yaml").read_text())
        for dotted, value in params_overrides.items():
            node = params
            *parents, last = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for cmd in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"],
                [str(BIN / "dvc"), "config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=dest, check=True, env=env)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"], cwd=dest, check=True)
    return dest
