#!/usr/bin/env bash
# GRPO on GSM8K (veRL's example shape). Needs a GPU machine for a real model; set MODEL and DATA.
# Usage: MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=~/data/gsm8k bash recipes/gsm8k/run_grpo.sh [overrides]
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local HF model folder}
DATA=${DATA:-$HOME/data/gsm8k}
python -m hybridrl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024 \
  data.filter_overlong_prompts=true data.truncation=error \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.use_remove_padding=true \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \
  actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.dtype=bfloat16 \
  actor_rollout_ref.rollout.load_format=dummy \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
  algorithm.use_kl_in_reward=false \
  trainer.logger='[console,file]' trainer.project_name=hybridrl_gsm8k trainer.experiment_name=grpo \
  trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 \
  trainer.total_epochs=15 "$@"
