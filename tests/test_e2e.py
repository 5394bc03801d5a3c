"""The whole pipeline, as a user runs it: ``dvc repro`` over all eight stages on
tiny params in a throw-away copy of the project. One slow test module that
shares one run; each test checks one promise of the issues."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.conftest import BIN, dvc, project_copy

pytestmark = pytest.mark.slow

TINY = {
    "ingest.max_bytes": 400_000,
    "tokenizer.vocab_size": 512, "tokenizer.sample_bytes": 300_000, "tokenizer.eval_bytes": 50_000,
    "pack.seq_len": 64,
    "pretrain.model": {"preset": "tiny"}, "pretrain.batch.micro_batch_size": 8, "pretrain.schedule.max_steps": 150,
    "pretrain.schedule.warmup_steps": 10, "pretrain.eval.every": 75, "pretrain.checkpoint.every": 75,
    "pretrain.logging.every": 5, "pretrain.optimizer.lr": 1.0e-2,
    "sft.data.seq_len": 64, "sft.data.max_examples": 300, "sft.batch.micro_batch_size": 8,
    "sft.schedule.max_steps": 10, "sft.schedule.warmup_steps": 2, "sft.eval.every": 5, "sft.checkpoint.every": 5,
    "sft.logging.every": 5, "sft.data.overlong": "truncate",
    "evaluate.max_rows": 16, "evaluate.samples": {"max_new_tokens": 8},
}
STAGES = ["ingest", "clean", "tokenizer", "pack", "pretrain", "sft", "evaluate", "export"]


def ran(output):
    return re.findall(r"Running stage '([\w-]+)'", output)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("e2e"), TINY)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PIPELINE_TRACKING": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"}
    first = dvc(root, "repro", env=env)
    return root, env, first


def metrics(root, stage):
    return json.loads((root / "metrics" / f"{stage}.json").read_text())


def test_all_stages_ran_and_wrote_metrics(project):
    root, _, first = project
    assert ran(first) == STAGES
    for stage in STAGES:
        assert (root / "metrics" / f"{stage}.json").exists(), stage
    ingest, clean = metrics(root, "ingest"), metrics(root, "clean")
    clean_report = json.loads((root / "data" / "clean" / "report.json").read_text())
    assert ingest["docs"] == clean_report["docs_in"]
    assert clean_report["docs_in"] == clean["docs"] + sum(clean_report["dropped"].values())
    assert clean["dropped"] == sum(clean_report["dropped"].values())
    pre = metrics(root, "pretrain")
    assert pre["steps"] == 150 and pre["val_loss"] < pre["unigram_entropy"]
    ev = metrics(root, "evaluate")
    for model in ("pretrain", "sft"):
        assert {"val_loss", "perplexity", "bits_per_byte"} <= set(ev[model])
    assert (root / "plots" / "pretrain.csv").read_text().count("\n") > 5


def test_second_repro_is_a_no_op(project):
    root, env, _ = project
    assert ran(dvc(root, "repro", env=env)) == []
    assert "up to date" in dvc(root, "status", env=env)


def test_exported_model_perplexity_in_transformers_matches_evaluate(project):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.shards import PackedRows

    root, _, _ = project
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "export", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(root / "models" / "export")
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    rows = PackedRows(root / "data" / "packed" / "val")
    n = min(len(rows), 16)  # evaluate.max_rows
    nll, count = 0.0, 0
    with torch.no_grad():
        for r in range(n):
            row = torch.from_numpy(rows.input_ids(np.array([r]))[0].astype(np.int64))
            seg = rows.segment_ids(np.array([r]))[0, :-1]
            inputs, targets = row[:-1], row[1:]
            logits = torch.empty(len(inputs), model.config.vocab_size)
            for s in np.unique(seg):  # one document at a time, as document masking sees it
                idx = np.flatnonzero(seg == s)
                logits[idx] = model(inputs[idx][None]).logits[0]
            nll += F.cross_entropy(logits, targets, reduction="sum").item()
            count += len(targets)
    hf_ppl = math.exp(nll / count)
    ours = metrics(root, "evaluate")["sft"]["perplexity"]
    assert hf_ppl == pytest.approx(ours, rel=0.01)


def test_mlflow_has_a_run_per_stage_and_the_registry_aliases(project):
    from mlflow import MlflowClient

    root, env, _ = project
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("llm-pipeline")
    runs = client.search_runs([exp.experiment_id])
    names = {r.info.run_name for r in runs}
    assert set(STAGES) <= names
    pre = next(r for r in runs if r.info.run_name == "pretrain")
    assert "loss" in pre.data.metrics and pre.data.params["pretrain.optimizer.lr"] == "0.01"
    assert "mlflow.source.git.commit" in pre.data.tags
    mv = client.get_model_version_by_alias("llm-pipeline", "champion")
    assert client.get_model_version_by_alias("llm-pipeline", "candidate").version == mv.version


def test_a_failed_export_leaves_the_last_export_in_place(project):
    """DVC removes a stage's outputs before it runs it, unless they persist:
    models/export does, and export swaps a new folder in whole, so an export
    that stops (here: asked for a best checkpoint no run recorded) keeps the last one."""
    import subprocess

    root, env, _ = project
    before = {p.name: p.read_bytes() for p in (root / "models" / "export").iterdir() if p.is_file()}
    text = (root / "params.yaml").read_text()
    params = yaml.safe_load(text)
    params["export"]["checkpoint"] = "best"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        r = subprocess.run([str(BIN / "dvc"), "repro", "export"], cwd=root, env=env, capture_output=True, text=True,
                           timeout=600)
    finally:
        (root / "params.yaml").write_text(text)
    assert r.returncode != 0 and "best" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in (root / "models" / "export").iterdir() if p.is_file()} == before
    assert "model.safetensors" in before


def test_editing_pack_seq_len_reruns_pack_only(project):
    root, env, _ = project
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pack"]["seq_len"] = 48
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = dvc(root, "status", env=env)
    assert "pack" in status and "ingest:" not in status and "tokenizer:" not in status
    assert ran(dvc(root, "repro", "pack", env=env)) == ["pack"]
    assert json.loads((root / "data" / "packed" / "manifest.json").read_text())["seq_len"] == 48
