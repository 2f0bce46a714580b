"""Suite-wide isolation (per test module): a module that creates the default torch.distributed process group, or sets the
rendezvous environment variables, in the pytest process must not leak them into later modules (forked
2-rank tests would inherit a world of size 1; vLLM would pick the wrong launcher)."""

from __future__ import annotations

import os

import pytest

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def _isolate_torch_distributed():
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
