"""pipeline/tracking/lineage.py: the upstream closure of a stage, from DVC's own
stage graph (the same one the flows run)."""

from pipeline.tracking.lineage import upstream_closure
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
