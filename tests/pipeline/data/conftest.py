"""Fixtures shared by the data-stage tests."""

import os

import pytest


@pytest.fixture(scope="module")
def ray_instance():
    """A real local Ray instance with 2 CPUs for one test module, shut down at its
    end (ENVIRONMENT: one instance per module keeps the suite fast)."""
    ray = pytest.importorskip("ray")
    from pipeline.data.executor import loopback_only

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with loopback_only():
        # "local": a new instance, even where a `ray start` elsewhere left /tmp/ray/ray_current_cluster
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
        yield ray
        ray.shutdown()
