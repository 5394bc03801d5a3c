"""ingest under a real local Ray instance (2 CPUs, one for this module, shut down
at the end): the same bytes as one process, and a stage killed mid-way and rerun
gives them too. Marked slow: Ray takes seconds to start."""

import pytest

from tests.pipeline.data.test_ingest import mixed_corpus, outputs
from tests.pipeline.data.test_ingest_resume import kill_and_rerun

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_instance")]

ray = pytest.importorskip("ray")


def test_ingest_under_ray_writes_the_bytes_of_one_process(tmp_path):
    sources = mixed_corpus(tmp_path)
    one = outputs(tmp_path, "one", sources, executor={"num_workers": 1})
    on_ray = outputs(tmp_path, "ray", sources, executor={"kind": "ray", "num_workers": 2})
    streamed = outputs(tmp_path, "streamed", sources, executor={"kind": "ray", "num_workers": 2},
                       worker_file_bytes=100)
    assert on_ray == one and streamed == one


def test_sigkill_of_a_stage_on_ray_then_rerun_gives_the_same_bytes(tmp_path):
    address = ray.get_runtime_context().gcs_address  # the stage joins this module's instance as a cluster
    kill_and_rerun(tmp_path, {"kind": "ray", "address": address, "num_workers": 2})
