#!/usr/bin/env bash
# PPO with a critic (GAE) on GSM8K. Usage: MODEL=... DATA=... bash recipes/gsm8k/run_ppo.sh [overrides]
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local HF model folder}
DATA=${DATA:-$HOME/data/gsm8k}
python -m hybridrl.trainer.main_ppo \
  algorithm.adv_estimator=gae \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=512 \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.rollout.n=1 \
  actor_rollout_ref.rollout.load_format=dummy actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  critic.model.path="$MODEL" critic.model.use_remove_padding=true critic.optim.lr=1e-5 \
  critic.ppo_mini_batch_size=64 critic.ppo_micro_batch_size_per_gpu=8 \
  critic.model.fsdp_config.mixed_precision.param_dtype=bf16 \
  trainer.logger='[console,file]' trainer.project_name=hybridrl_gsm8k trainer.experiment_name=ppo \
  trainer.n_gpus_per_node=8 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15 "$@"
