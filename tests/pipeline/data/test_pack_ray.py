"""pack under a real local Ray instance (2 CPUs, one for this module, shut down
at the end): the same bytes as the local pool. Marked slow: Ray takes seconds to start."""

import pyarrow.parquet as pq
import pytest

from pipeline.data.docs import DocTable, row_spans
from pipeline.data.pack import PackConfig, PackError, run_pack
from tests.pipeline.data.test_pack_sources import CFG, corpus  # noqa: F401 - the corpus fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_instance")]

ray = pytest.importorskip("ray")


def files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("groups", ["large", "small"])
def test_pack_under_ray_writes_the_bytes_of_the_local_pool(corpus, tmp_path, groups):  # noqa: F811
    """Row groups of 40 documents, more than BIG_GROUP tasks of text, which the
    stage reads and sends; or of 5, which the workers read themselves."""
    path, tok, _ = corpus
    if groups == "small":
        path = tmp_path / "small.parquet"
        pq.write_table(pq.read_table(corpus[0]), path, row_group_size=5)
    spans = row_spans(DocTable(path, PackError), CFG["task_bytes"])
    assert all(s.by_worker == (groups == "small") for s in spans) and len(spans) > 4
    mix = {"web": {"weight": 2}, "code": {"weight": 1}}
    out = {}
    for name, executor in {"local": {"num_workers": 2}, "ray1": {"kind": "ray", "num_workers": 1},
                           "ray2": {"kind": "ray", "num_workers": 2}}.items():
        cfg = PackConfig(**{**CFG, "num_workers": None}, executor=executor, mixture=mix)
        metrics = run_pack(cfg, path, tok, tmp_path / name)
        assert metrics["workers"] == executor["num_workers"]
        out[name] = files(tmp_path / name)
    assert len(out["local"]) > 6  # train and val shards, per-source val shards, the manifest
    assert out["ray1"] == out["local"] and out["ray2"] == out["local"]
