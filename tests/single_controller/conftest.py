"""One in-process Ray instance for the whole session, plus shared toy worker groups."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    import ray
    import sc_toy_workers

    # The actors get the toy worker classes by value, so they need not import this folder.
    ray.cloudpickle.register_pickle_by_value(sc_toy_workers)
    if ray.is_initialized():  # another test module's Ray may have other settings: start our own
        ray.shutdown()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        # no idle task workers: every worker here is an actor with its own process
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )
    yield ray
    ray.shutdown()


def _toy_group(world_size: int):
    from sc_toy_workers import TOY_CPUS, ToyWorker

    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool(
        [world_size], use_gpu=False, cpus_per_slot=TOY_CPUS, name_prefix=f"toy{world_size}"
    )
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ToyWorker, offset=5), name_prefix=f"toy{world_size}")
    return wg, pool


@pytest.fixture(scope="session")
def group2(ray_session):
    wg, pool = _toy_group(2)
    yield wg
    wg.shutdown()
    pool.remove()


@pytest.fixture(scope="session")
def group3(ray_session):
    wg, pool = _toy_group(3)
    yield wg
    wg.shutdown()
    pool.remove()


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def group(request):
    """The shared 2-rank and 3-rank toy groups (one test run each)."""
    return request.getfixturevalue(f"group{request.param}")
