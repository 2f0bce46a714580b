"""One local Ray instance per fault-test module that needs it (`ray_faults`)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_faults():
    import fault_workers
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.cloudpickle.register_pickle_by_value(fault_workers)
    if ray.is_initialized():  # another test module's Ray may have other settings: start our own
        ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )
    yield ray
    ray.shutdown()
