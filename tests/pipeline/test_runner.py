"""An expected stage failure is one line on stderr, ``error: stage <name> failed:
<message>``, and exit code 2: no traceback. Each case runs the real stage module
in an empty folder, so its inputs are missing (or its params are wrong)."""

import os
import subprocess
import sys

import pytest

from pipeline.errors import StageError
from pipeline.runner import one_line
from tests.conftest import ROOT

CASES = {
    # stage, params.yaml text (None: the shipped one), what the message must name
    "pack-before-tokenizer": ("pack", None, "data/tokenizer/tokenizer.json"),
    "evaluate-without-models": ("evaluate", None, "data/tokenizer/tokenizer.json"),
    "export-before-evaluate": ("export", None, "metrics/evaluate.json not found; run `dvc repro evaluate` first"),
    "clean-bad-params": ("clean", "clean:\n  num_workers: -1\n  bogus: 1\n", "clean.num_workers"),
}


def run_stage_module(stage: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_TRACKING": "0"}
    return subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_expected_failure_is_one_line_and_exit_2(case, tmp_path):
    stage, params, named = CASES[case]
    (tmp_path / "params.yaml").write_text(params if params is not None else (ROOT / "params.yaml").read_text())
    r = run_stage_module(stage, tmp_path)
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: stage {stage} failed: ") and named in lines[0], lines[0]
    assert r.returncode == 2


def test_every_stage_error_class_is_a_stage_error():
    from pipeline.config import ConfigError
    from pipeline.data.clean import CleanError
    from pipeline.data.ingest import IngestError
    from pipeline.data.pack import PackError
    from pipeline.data.shards import DataError
    from pipeline.data.tokenizer import TokenizerError
    from pipeline.evaluate import EvaluateError
    from pipeline.export import ExportError

    for cls in (ConfigError, CleanError, IngestError, PackError, DataError, TokenizerError, EvaluateError,
                ExportError):
        assert issubclass(cls, StageError), cls.__name__
    assert issubclass(ConfigError, ValueError)  # callers that catch ValueError keep working


def test_one_line_joins_a_config_error_list():
    msg = "params.yaml is invalid:\n  pack.seq_len: too small\n  pack.bogus: unknown key"
    assert one_line(msg) == "params.yaml is invalid: pack.seq_len: too small; pack.bogus: unknown key"
