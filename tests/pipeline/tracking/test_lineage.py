"""pipeline/tracking/lineage.py: the upstream closure of a stage, from DVC's own
stage graph (the same one the flows run)."""

from pathlib import Path

from pipeline.tracking.lineage import dvc_stage_hashes, load_stages, read_metrics, select, upstream_closure
from tests.conftest import ROOT


def test_upstream_closure_follows_outputs_in_dvc_yaml_order():
    assert upstream_closure("ingest", ROOT) == ["ingest"]
    assert upstream_closure("pack", ROOT) == ["ingest", "clean", "tokenizer", "pack"]
    assert upstream_closure("export", ROOT) == [
        "ingest", "clean", "tokenizer", "pack", "pretrain", "sft", "evaluate", "export"]


def test_upstream_closure_matches_deps_under_an_output_folder_only(tmp_path):
    from dvc.repo import Repo

    Repo.init(str(tmp_path), no_scm=True).close()
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  a: {cmd: x, outs: [data/a]}\n"
        "  ab: {cmd: x, outs: [data/ab]}\n"
        "  b: {cmd: x, deps: [data/a/f.parquet, code.py], outs: [data/b]}\n"
        "  c: {cmd: x, deps: [data/b], metrics: [{m/c.json: {cache: false}}]}\n"
        "  d: {cmd: x, deps: [m/c.json]}\n"
        "  e: {cmd: x, deps: [data/ab/g.txt]}\n")  # under data/ab, not data/a
    assert upstream_closure("b", tmp_path) == ["a", "b"]
    assert upstream_closure("d", tmp_path) == ["a", "b", "c", "d"]
    assert upstream_closure("e", tmp_path) == ["ab", "e"]
    assert upstream_closure("nope", tmp_path) == ["nope"]


def dvc_project(path, dvc_yaml: str, files: dict[str, str] | None = None):
    from dvc.repo import Repo

    Repo.init(str(path), no_scm=True).close()
    (path / "dvc.yaml").write_text(dvc_yaml)
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def test_a_nested_dvc_yaml_stage_is_named_as_dvc_repro_takes_it_with_paths_from_the_root(tmp_path):
    root = dvc_project(tmp_path, "stages:\n  a: {cmd: x, outs: [models/a]}\n", {
        "sub/dvc.yaml": "stages:\n  train: {cmd: y, deps: [../models/a, cfg.txt], outs: [out], "
                        "metrics: [{m.json: {cache: false}}], plots: [{p.csv: {cache: false}}]}\n"})
    a, train = load_stages(root)
    assert (a.name, train.name) == ("a", "sub/dvc.yaml:train")
    assert train.upstream == ("a",)
    assert (train.deps, train.outs, train.metrics) == (("models/a", "sub/cfg.txt"), ("sub/out",), ("sub/m.json",))
    assert not train.is_data_stage, "it reads a model"


def test_data_stages_stages_without_outputs_and_dvc_files(tmp_path):
    root = dvc_project(tmp_path, "stages:\n"
                       "  ingest: {cmd: x, deps: [data/raw], outs: [data/ingest]}\n"
                       "  report: {cmd: x, deps: [data/ingest], metrics: [{m/report.json: {cache: false}}]}\n",
                       {"data/raw/a.txt": "a"})
    Path(root / "data" / "raw.dvc").write_text("outs:\n- md5: 0cc175b9c0f1b6a831c399e269772661.dir\n  path: raw\n")
    stages = load_stages(root)
    assert [s.name for s in stages] == ["ingest", "report"], "a .dvc file is an input, not a stage"
    assert [s.is_data_stage for s in stages] == [True, False], "a stage without outputs is not retried"
    assert select(stages, []) == select(stages, None) == stages


def test_metrics_files_are_merged_and_a_missing_lock_has_no_hashes(tmp_path):
    root = dvc_project(tmp_path, "stages:\n  e: {cmd: x, metrics: [{m/a.json: {cache: false}}, "
                       "{m/b.yaml: {cache: false}}, {m/gone.json: {cache: false}}]}\n",
                       {"m/a.json": '{"loss": 1.5, "n": 2}', "m/b.yaml": "acc: 0.5\nn: 3\n"})
    [stage] = load_stages(root)
    assert read_metrics(root, stage) == {"loss": 1.5, "n": 3, "acc": 0.5}
    assert dvc_stage_hashes(root) == {}


def test_descendants_are_found_through_every_level():
    from pipeline.tracking.lineage import StageInfo, descendants

    stages = [StageInfo("a", "x"), StageInfo("b", "x", upstream=("a",)), StageInfo("c", "x", upstream=("b",)),
              StageInfo("d", "x")]
    assert descendants(stages, "a") == {"b", "c"}
    assert descendants(stages, "c") == set()


def test_reading_published_base_models_does_not_make_a_model_stage():
    from pipeline.tracking.lineage import BASE_PREFIX, StageInfo

    tokenizer = StageInfo("tokenizer", "x", deps=("data/clean", f"{BASE_PREFIX}/gpt2/tokenizer.json"), outs=("data/tok",))
    assert tokenizer.is_data_stage, "the tokenizer reads models/base: still a data stage, retried by the flows"
    assert StageInfo("tokenizer", "x", deps=(BASE_PREFIX,), outs=("data/tok",)).is_data_stage
    assert not StageInfo("score", "x", deps=("models/sft",), outs=("data/scores",)).is_data_stage
    assert not StageInfo("pretrain", "x", deps=("data/packed",), outs=("models/pretrain",)).is_data_stage
    # a trained model whose folder merely starts with the same letters is a model
    assert not StageInfo("score", "x", deps=(f"{BASE_PREFIX}line/ckpt.pt",), outs=("data/scores",)).is_data_stage


# --------------------------------------------------------------------------- probe3-track: mutation survivors


def test_independent_stages_keep_their_dvc_yaml_order(tmp_path):
    # "stages that could go either way keep their dvc.yaml order": the flows run them in this order
    root = dvc_project(tmp_path, "stages:\n  z: {cmd: x, outs: [data/z]}\n  a: {cmd: x, outs: [data/a]}\n"
                                 "  m: {cmd: x, deps: [data/a], outs: [data/m]}\n")
    assert [s.name for s in load_stages(root)] == ["z", "a", "m"]


def test_a_folder_outside_any_dvc_project_has_no_hashes(tmp_path):
    # stages/export.py writes dvc.* lineage from this: a copy of the code without DVC still exports
    assert dvc_stage_hashes(tmp_path) == {}
