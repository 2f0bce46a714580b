"""End-to-end PPO runs on the built-in tiny model: real Ray actors, FSDP2, HF rollout, parquet data.

Each run is two training steps; the assertions check that every stage ran and produced the
metrics users chart, and that the policy actually received gradient.
"""

from __future__ import annotations

import pytest

from tests.e2e.ppo_runs import assert_finite, run

pytestmark = pytest.mark.usefixtures("ray_local")

CORE = [
    "critic/score/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "perf/throughput",
]


@pytest.mark.parametrize(
    "estimator, extra",
    [
        ("grpo", []),
        ("reinforce_plus_plus", []),
        ("rloo", []),
        ("remax", []),
        (
            "gae",
            [
                "actor_rollout_ref.rollout.n=1",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            ],
        ),
    ],
)
def test_estimators_run_end_to_end(tmp_path, estimator, extra):
    rows = run([f"algorithm.adv_estimator={estimator}", *extra], tmp_path)
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert_finite(train, CORE + ["critic/advantages/mean"])
    assert any(r["actor/grad_norm"] > 0 for r in train)
    assert any(k.startswith("val-core/hybridrl/arith/") for k in rows[-1])
    # one epoch over one mini-batch: exactly on-policy, so no separate old-log-prob pass
    assert not any("timing_s/old_log_prob" in r for r in train)
    if estimator == "gae":
        assert_finite(train, ["critic/vf_loss", "critic/values/mean", "critic/grad_norm"])


def test_kl_loss_and_kl_in_reward(tmp_path):
    rows = run(
        [
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert_finite(train, ["actor/kl_loss", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"])
    assert_finite(train, ["timing_s/old_log_prob"])  # the KL in the reward reads the old log-probs
    # step 1 samples from the reference itself, so its KL to the reference is 0.
    assert train[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)


def test_dapo_dynamic_sampling(tmp_path):
    rows = run(
        [
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.max_num_gen_batches=20",
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            "reward_model.reward_manager=dapo",
            "reward_manager_kwargs.overlong_buffer.enable=true",
            "reward_manager_kwargs.overlong_buffer.len=4",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert_finite(train, ["train/num_gen_batches"])
    # every kept group has a non-constant score, so its advantages are not all zero
    assert all(r["critic/advantages/max"] > 0 for r in train)


def test_two_ranks_with_dynamic_batch_and_remove_padding(tmp_path):
    """The whole loop on 2 FSDP ranks (gloo): padding of uneven batches, balance_batch, token budgets."""
    rows = run(
        [
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=128",
            "data.val_max_samples=15",  # odd: validation batches are padded across the 2 ranks
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert_finite(train, CORE + ["perf/balance_max_min_ratio"])
    acc = rows[-1]["val-core/hybridrl/arith/acc/mean@1"]
    # The shipped model's greedy accuracy is ~0.4 (random weights score 0), and it is a mean over
    # exactly the 15 validation prompts: the row padded onto the odd batch for 2 ranks is dropped
    # again (counted, it would make the mean a multiple of 1/16).
    assert 0.1 < acc < 1.0
    assert acc * 15 == pytest.approx(round(acc * 15), abs=1e-6)


@pytest.mark.vllm
def test_vllm_rollout_end_to_end(tmp_path):
    pytest.importorskip("vllm")
    rows = run(
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.load_format=dummy",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "algorithm.rollout_is=true",
            "algorithm.rollout_is_threshold=2.0",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert_finite(train, CORE + ["rollout_is/rollout_is_mean"])
    # dummy weights + the first sync must give the trained model's behaviour: the shipped model
    # scores well above chance on validation (random weights score 0).
    assert rows[-1]["val-core/hybridrl/arith/acc/mean@1"] > 0.1
