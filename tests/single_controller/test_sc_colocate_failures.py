"""Colocated roles in one actor; dead workers and failing constructors surface as errors."""

from __future__ import annotations

import inspect
import time

import pytest
import torch
from sc_toy_workers import TOY_CPUS, BrokenInit, ToyActor, ToyCritic, ToyWorker

from hybridrl.protocol import DataProto
from hybridrl.single_controller import WorkerDiedError
from hybridrl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)


def test_colocated_roles_share_one_process(ray_session):
    cls = create_colocated_worker_cls(
        {
            "actor_rollout": RayClassWithInitArgs(ToyActor, scale=3),
            "critic": RayClassWithInitArgs(ToyCritic, bias=0.5).update_options(
                {"runtime_env": {"env_vars": {"TOY_FLAG": "on"}}}
            ),
        }
    )
    # one slot of 2 CPUs shared by up to 2 groups: the actor holds 1 CPU but runs 2 threads
    pool = RayResourcePool([1], use_gpu=False, cpus_per_slot=2, max_colocate_count=2)
    wg = RayWorkerGroup(pool, cls, name_prefix="coloc", detached=True)
    try:
        assert {"actor_rollout_compute_log_prob", "critic_compute_values"} <= set(wg.method_names)
        roles = wg.spawn(["actor_rollout", "critic"])
        actor, critic = roles["actor_rollout"], roles["critic"]
        assert actor.pid() == critic.pid() == wg.actor_rollout_pid()
        data = DataProto.from_dict({"x": torch.arange(4)})
        assert actor.compute_log_prob(data).batch["old_log_prob"].tolist() == [0.0, 3.0, 6.0, 9.0]
        assert critic.compute_values(data).batch["values"].tolist() == [0.5, 1.5, 2.5, 3.5]
        assert wg.critic_compute_values(data).batch["values"].tolist() == [0.5, 1.5, 2.5, 3.5]
        assert actor.num_calls() == [1] and critic.num_calls() == [2]  # each role keeps its own state
        assert actor.compute_log_prob.__doc__ == "Toy log-probs: x * scale."
        assert str(inspect.signature(actor.compute_log_prob)) == "(data: 'DataProto') -> 'DataProto'"
        assert actor.threads() == [("2", 2, "on")]
        with pytest.raises(ValueError, match="unknown roles"):
            wg.spawn(["reward"])

        # detached, named actors: a second handle attaches by name and sees the same role state
        assert wg.worker_names == ["coloc_rank0"]
        again = RayWorkerGroup(ray_cls_with_init=cls, worker_names=wg.worker_names)
        assert again.spawn(["critic"])["critic"].num_calls() == [2]
        assert (again.master_addr, again.master_port) == (wg.master_addr, wg.master_port)
    finally:
        wg.shutdown()
        pool.remove()


def test_dead_workers_surface_as_errors_quickly(ray_session):
    import ray

    pool = RayResourcePool([2], use_gpu=False, cpus_per_slot=TOY_CPUS)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ToyWorker), name_prefix="doomed")
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            wg.nap_or_die(1, 60.0)  # rank 1 exits at once, rank 0 would sleep a minute
        assert time.monotonic() - start < 15
        assert err.value.rank == 1 and "'doomed'" in str(err.value) and "'nap_or_die'" in str(err.value)

        ray.kill(wg.workers[0])
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 0 died .*'add'"):
            wg.add(1)
        assert time.monotonic() - start < 10
    finally:
        wg.shutdown()
        pool.remove()


def test_failing_constructor_names_rank_and_cause(ray_session):
    pool = RayResourcePool([1], use_gpu=False, cpus_per_slot=TOY_CPUS)
    try:
        with pytest.raises(WorkerDiedError, match="(?s)rank 0 .*'__init__'.*cannot load the model"):
            RayWorkerGroup(pool, RayClassWithInitArgs(BrokenInit), name_prefix="broken")
    finally:
        pool.remove()


def test_a_colocated_role_keeps_its_concurrency_group(ray_session):
    """A role's Ray concurrency group (partial rollout's `abort_generation` uses one) survives
    colocation: its control method runs while the default group is busy with another call."""
    from sc_toy_workers import ControlledWorker

    cls = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(ToyActor, scale=1), "rollout": RayClassWithInitArgs(ControlledWorker)}
    )
    pool = RayResourcePool([1], use_gpu=False, cpus_per_slot=0.25, name_prefix="coloc_cg")
    wg = RayWorkerGroup(pool, cls, name_prefix="coloc_cg")
    try:
        actor = wg.workers[0]
        blocked = actor.rollout_block.remote(30.0)  # holds the default group until released
        assert ray_session.get(actor.rollout_release.remote(), timeout=20)  # the control group runs now
        assert ray_session.get(blocked, timeout=20) is True
    finally:
        wg.shutdown()
        pool.remove()
