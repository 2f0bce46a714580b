#!/usr/bin/env bash
# DAPO (clip-higher, token-mean loss, dynamic sampling, overlong shaping) on the built-in task, on CPU.
# Point data.* and actor_rollout_ref.model.path at real data/models for the full recipe.
set -euo pipefail
export RAY_AUTH_MODE=disabled
python -m hybridrl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.use_kl_loss=false algorithm.use_kl_in_reward=false \
  algorithm.filter_groups.enable=true algorithm.filter_groups.metric=score \
  algorithm.filter_groups.max_num_gen_batches=10 \
  reward_model.reward_manager=dapo \
  reward_manager_kwargs.overlong_buffer.enable=true reward_manager_kwargs.overlong_buffer.len=4 \
  reward_manager_kwargs.overlong_buffer.penalty_factor=1.0 \
  trainer.experiment_name=builtin_dapo "$@"
