"""One local Ray instance for all async tests (starting Ray is the slowest part of these tests).

`ray_local` starts it on first use and again in a later module if a module with its own cluster
(test_async_megatron's fixture) shut it down meanwhile; the instance started here is shut down once,
at the end of the session.
"""

from __future__ import annotations

import os

import pytest

_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
}


@pytest.fixture(scope="session")
def _ray_started_here():
    started = {"yes": False}
    yield started
    import ray

    if started["yes"] and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_started_here):
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": _ENV})
        _ray_started_here["yes"] = True
    yield ray
