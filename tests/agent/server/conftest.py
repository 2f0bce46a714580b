"""One local Ray instance for the rollout-server tests (the gateway is a Ray actor)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_local():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})  # fmt: skip
    yield ray
    if started:
        ray.shutdown()
