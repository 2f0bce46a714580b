"""Shared set-up of the end-to-end runs: one local Ray instance for the whole module."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_local():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # another test module's Ray may have other settings: start our own
        ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={
            "env_vars": {
                "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "HF_HUB_OFFLINE": "1",
            }
        },
    )
    yield ray
    ray.shutdown()
