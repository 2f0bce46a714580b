"""veRL keys that act during a run: profiler traces, validation dumps, checkpoint retention, resume clean-up.

One 2-step GAE run (actor + critic on one slot) with:
- global_profiler.tool=torch, steps=[2], actor.profiler.enable=True (all ranks): a Chrome trace for
  step 2 only;
- trainer.validation_data_dir: one jsonl of decoded validation samples per validation;
- trainer.save_freq=1, max_critic_ckpt_to_keep=1: both checkpoints keep the actor, only the newest
  keeps the critic;
then a resume to step 3 with trainer.del_local_ckpt_after_load=True: the loaded checkpoint is gone.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.ppo_runs import assert_finite, run

pytestmark = pytest.mark.usefixtures("ray_local")


def test_profiler_validation_dump_and_checkpoint_keys(tmp_path):
    prof, val_dir, ckpt = tmp_path / "prof", tmp_path / "val", tmp_path / "ckpt"
    run(
        [
            "algorithm.adv_estimator=gae",
            "global_profiler.tool=torch",
            "global_profiler.steps=[2]",
            f"global_profiler.save_path={prof}",
            "actor_rollout_ref.actor.profiler.enable=True",
            "actor_rollout_ref.actor.profiler.all_ranks=True",
            f"trainer.validation_data_dir={val_dir}",
            "trainer.test_freq=2",
            "trainer.save_freq=1",
            "trainer.max_critic_ckpt_to_keep=1",
        ],
        tmp_path,
    )
    assert sorted(os.listdir(prof)) == ["step_2"]
    with open(prof / "step_2" / "rank_0.json") as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::" in n for n in names)  # real torch ops of the step were recorded
    rows = [json.loads(line) for line in open(val_dir / "2.jsonl")]
    assert rows and {"prompt", "response", "score"} <= set(rows[0])
    # critic pruned (meta.json: the checkpoint's run identity and manifest, docs/reliability.md)
    assert sorted(os.listdir(ckpt / "global_step_1")) == ["actor", "data.pt", "meta.json"]
    assert "critic" in os.listdir(ckpt / "global_step_2")

    run(
        [
            "algorithm.adv_estimator=gae",
            "trainer.total_training_steps=3",
            "trainer.save_freq=1",
            "trainer.del_local_ckpt_after_load=True",
        ],
        tmp_path,
    )
    # loaded, then deleted once the next checkpoint (step 3) was saved: never the only copy
    assert not (ckpt / "global_step_2").exists()
    assert (ckpt / "global_step_3").exists() and (ckpt / "global_step_1").exists()


def test_rollout_correction_weights_reach_the_update(tmp_path):
    """algorithm.rollout_correction.*: IS + rejection weights computed from the engine's log-probs."""
    rows = run(
        [
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=sequence",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
            "algorithm.rollout_correction.rollout_is_batch_normalize=True",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert all("rollout_corr/rs_reject_frac" in r and "rollout_corr/rollout_is_mean" in r for r in train)
    # HF rollout and FSDP actor compute the same fp32 log-probs: ratios ~1, nothing rejected
    assert all(r["rollout_corr/rs_reject_frac"] == 0.0 for r in train)
    assert not any("timing_s/old_log_prob" not in r for r in train)  # correction needs the old-log-prob pass


def test_optimal_token_baseline_reads_sum_pi_squared_from_the_old_log_prob_pass(tmp_path):
    """algorithm.adv_estimator=optimal_token_baseline + actor.calculate_sum_pi_squared: the FSDP
    old-log-prob pass returns sum_pi_squared and the estimator reads it (examples/otb_trainer)."""
    rows = run(
        [
            "algorithm.adv_estimator=optimal_token_baseline",
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert all("timing_s/old_log_prob" in r for r in train)  # not skipped although on-policy
    assert_finite(train, ["critic/advantages/mean", "critic/advantages/max", "actor/grad_norm"])
    assert any(r["actor/grad_norm"] > 0 for r in train)


def test_bypass_reinforce_with_multi_option_rejection(tmp_path):
    """examples/rollout_correction: bypass mode (rollout log-probs as the old ones, no old-log-prob
    pass), loss_type=reinforce with sequence IS weights, and rollout_rs=token_k1,seq_max_k2."""
    rc = "algorithm.rollout_correction."
    rows = run(
        [
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            f"{rc}bypass_mode=True",
            f"{rc}loss_type=reinforce",
            f"{rc}rollout_is=sequence",
            f"{rc}rollout_is_batch_normalize=True",
            f"{rc}rollout_rs='token_k1,seq_max_k2'",
            f"{rc}rollout_rs_threshold='0.6_1.6,2.5'",
            "actor_rollout_ref.actor.skip_on_policy_old_log_prob=False",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert not any("timing_s/old_log_prob" in r for r in train)  # bypass: no old-log-prob pass
    # the bypass loss ran: its IS weights (normalised to mean 1) and rejection metrics are logged
    assert_finite(train, ["actor/bypass_is_mean", "actor/rollout_rs_masked_fraction", "actor/grad_norm"])
    assert all(abs(r["actor/bypass_is_mean"] - 1.0) < 1e-4 for r in train)
    assert all(r["actor/rollout_rs_masked_fraction"] == 0.0 for r in train)  # HF = FSDP fp32 log-probs
    assert any(r["actor/grad_norm"] > 0 for r in train)


@pytest.mark.slow
def test_pf_ppo_resamples_after_gae(tmp_path):
    """algorithm.use_pf_ppo (examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh): the batch the
    critic and actor update on is redrawn by reward weights (max_min keeps only extreme scores)."""
    rows = run(
        [
            "algorithm.adv_estimator=gae",
            "algorithm.use_pf_ppo=True",
            "algorithm.pf_ppo.reweight_method=max_min",
            "actor_rollout_ref.rollout.n=1",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert_finite(train, ["pf_ppo/unique_frac", "critic/vf_loss", "actor/grad_norm"])
    assert all(0 < r["pf_ppo/unique_frac"] <= 1 for r in train)
