#!/usr/bin/env bash
# Quickstart: GRPO on the built-in tiny model and arithmetic task, on CPU, no download.
# Validation accuracy (greedy) is printed every trainer.test_freq steps; the curves end up in
# outputs/<project>/<experiment>/report.png. Pass ALGO=gae for PPO with a critic.
# Usage: bash recipes/quickstart/run.sh [extra key=value overrides]
set -euo pipefail
ALGO=${ALGO:-grpo}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
if [ "$ALGO" = "gae" ]; then
  # PPO + critic: one response per prompt, more prompts per step, critic on the same model.
  exec python -m hybridrl.trainer.main_ppo \
    algorithm.adv_estimator=gae \
    actor_rollout_ref.rollout.n=1 \
    data.train_batch_size=64 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    critic.optim.lr=1e-3 \
    trainer.experiment_name=builtin_gae "$@"
fi
exec python -m hybridrl.trainer.main_ppo trainer.experiment_name=builtin_grpo "$@"
