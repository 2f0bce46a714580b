"""Asynchronous PPO with strategy=megatron (it used to be ignored there): a TP=2 Megatron actor
(+ reference) and critic on two training slots, one HF rollout worker on a third (logical) CPU.

Slow; starts its own Ray instance with 3 logical CPUs (the package's ray_local fixture has 2).
"""

from __future__ import annotations

import math
import os
import sys

import pytest

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_async_e2e import SMALL, run_async  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture()
def ray_three_cpus():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        ray.shutdown()
    env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


MEGATRON_ASYNC = [
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.strategy=megatron",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "algorithm.adv_estimator=gae",
    "critic.strategy=megatron",
    "critic.megatron.tensor_model_parallel_size=2",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "async_training.max_head_offpolicyness=1",
]


def test_async_with_megatron_tp2_actor_and_critic(tmp_path, ray_three_cpus):
    """strategy=megatron in asynchronous mode (it used to be ignored): a TP=2 Megatron actor
    (+ reference) and critic on two training slots train, and publish weights to the rollout worker."""
    pytest.importorskip("megatron.core")
    from hybridrl.trainer.async_ppo.trainer import _train_classes
    from hybridrl.workers.engine_workers import ActorRolloutRefWorker, CriticWorker

    cfg = load_async_config(compose_async_config([*SMALL, *MEGATRON_ASYNC]))
    classes = _train_classes(cfg, 2, None, None)
    # one worker class per role; the Megatron engine (TP=2) is chosen through the driver's dims
    actor, critic = classes["actor"], classes["critic"]
    assert actor.cls is ActorRolloutRefWorker and critic.cls is CriticWorker
    assert actor.kwargs["disaggregated"] and actor.kwargs["dims"].model_parallel
    assert (actor.kwargs["dims"].tp, critic.kwargs["dims"].tp) == (2, 2) and critic.kwargs[
        "dims"
    ].model_parallel
    trainer = run_async(MEGATRON_ASYNC, tmp_path)
    rows = trainer.history
    assert len(trainer.consumed_versions) == 3
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "critic/vf_loss",
        "timing_s/publish_weights",
    ):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert any(r["actor/grad_norm"] > 0 for r in rows) and any(r["critic/grad_norm"] > 0 for r in rows)
