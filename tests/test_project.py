"""The project's own files agree with each other: one name per stage everywhere,
every shipped params section validates, and each DVC stage depends on exactly
its own params section (its code deps: tests/test_deps.py)."""

import importlib.util
import subprocess

import pytest
import yaml

from pipeline import layout
from pipeline.config import SCHEMAS, load_params
from tests.conftest import ROOT

DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
EXPECTED_ORDER = ["ingest", "clean", "tokenizer", "pack", "pretrain", "sft", "evaluate", "export"]


def test_stage_names_agree_everywhere():
    assert list(DVC) == [s for s in EXPECTED_ORDER if s in DVC]
    for stage in DVC:
        assert stage in PARAMS, f"params.yaml has no section {stage!r}"
        assert stage in SCHEMAS, f"pipeline.config.SCHEMAS has no schema for {stage!r}"
        assert importlib.util.find_spec(f"stages.{stage}") is not None, f"no module stages/{stage}.py"
        assert DVC[stage]["cmd"] == f"python -m stages.{stage}"


@pytest.mark.parametrize("stage", list(DVC))
def test_each_stage_depends_on_its_own_params_code_and_writes_its_metrics(stage):
    spec = DVC[stage]
    assert spec["params"] == [stage], "a stage tracks exactly its own params section"
    deps = spec["deps"]
    assert f"stages/{stage}.py" in deps  # and the rest of its code: tests/test_deps.py
    metrics = [next(iter(m)) if isinstance(m, dict) else m for m in spec["metrics"]]
    assert metrics == [str(layout.metrics_path(stage))]


@pytest.mark.parametrize("stage", [s for s in PARAMS])
def test_shipped_params_validate(stage):
    cfg = load_params(stage, ROOT / "params.yaml")
    assert type(cfg).__name__.endswith("Config")


def test_gitignore_keeps_generated_state_out_of_git():
    ignored = (ROOT / ".gitignore").read_text()
    for pattern in ("/data/*", "/models/", "/mlflow.db", "/mlartifacts/", ".venv/"):
        assert pattern in ignored


def test_metrics_and_plots_stay_visible_to_git():
    # dvc exp run commits them into each experiment; dvc exp show / plots diff read them there
    paths = ["metrics/pretrain.json", "plots/pretrain.csv", "dvc.lock", "models/pretrain/x", "data/packed/x"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["models/pretrain/x", "data/packed/x"]


def test_readme_params_reference_is_current():
    from pipeline.reference import reference

    readme = (ROOT / "README.md").read_text()
    assert reference(ROOT / "params.yaml") in readme, "run `python -m pipeline.reference --write`"

