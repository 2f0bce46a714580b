#!/usr/bin/env bash
# Asynchronous (AReaL-style) GRPO on the built-in arithmetic task, on CPU:
# one rollout worker (1 core) generates while the trainer (1 core) trains; generation may run at
# most max_head_offpolicyness=1 policy version ahead, and the decoupled PPO loss corrects for the
# staleness with the rollout engine's (behaviour) log-probs.
#
#   bash recipes/async/run.sh [extra key=value overrides]
#
# Validation accuracy (greedy, the 200 held-out sums) is printed every 20 steps; expect it to rise
# from ~0.3 to ~0.6 within the 200 steps (docs/benchmarks.md has the measured curve).
# Metrics go to outputs/hybridrl_quickstart/async_grpo (metrics.jsonl, report.html at the end).
# docs/async.md explains every async_training key.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}

python -m hybridrl.trainer.main_async \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=8 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.actor.optim.lr=3e-5 \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.cpus_per_worker=1 \
    async_training.rollout_nnodes=1 async_training.rollout_n_gpus_per_node=1 \
    async_training.rollout_cpus_per_worker=1 \
    async_training.max_head_offpolicyness=1 \
    async_training.recompute_logprob=true \
    async_training.use_decoupled_loss=true \
    async_training.behave_imp_weight_cap=5.0 \
    trainer.total_training_steps=200 trainer.test_freq=20 \
    trainer.logger='[console,file]' \
    trainer.experiment_name=async_grpo \
    trainer.resume_mode=disable \
    "$@"
