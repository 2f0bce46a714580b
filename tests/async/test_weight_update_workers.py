"""Both weight paths of main_async on real Ray actors: an FSDP trainer worker and two HF rollout
workers (their own pool, random initial weights), the collective path over a real gloo group."""

from __future__ import annotations

import pytest
import ray
import torch

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config
from hybridrl.weight_sync.publisher import WeightPublisher

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]  # ~1 min on 2 shared cores

KEYS = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.cpus_per_worker=1",
    "async_training.rollout_n_gpus_per_node=2",
    "async_training.rollout_cpus_per_worker=0.5",
    "actor_rollout_ref.rollout.load_format=dummy",  # random weights until the first update
]


def load_everywhere(group, payload, version):
    return ray.get([w.load_weights.remote(payload, version) for w in group.workers], timeout=120)


def test_collective_update_gives_the_weights_of_the_object_store_update():
    from hybridrl.trainer.async_ppo.trainer import start_async_workers

    workers = start_async_workers(load_async_config(compose_async_config(KEYS)))
    try:
        train, group = workers.actor_rollout, workers.rollout
        before = ray.get(group.workers[0].rollout_weights.remote())
        collective = WeightPublisher(train, group, "collective", timeout_s=60)
        load_everywhere(group, collective.publish(1), 1)
        collective.check_last()
        assert collective.metrics["async/weight_update/mbytes"] > 0
        got = [ray.get(w.rollout_weights.remote()) for w in group.workers]
        store = WeightPublisher(train, group, "object_store", timeout_s=60)
        load_everywhere(group, store.publish(2), 2)
        store.check_last()
        want = ray.get(group.workers[0].rollout_weights.remote())
        assert any(not torch.equal(before[k], want[k]) for k in want)  # the update changed something
        for held in got:
            assert held.keys() == want.keys()
            for k in want:
                assert torch.equal(held[k], want[k]), k
    finally:
        workers.shutdown()
