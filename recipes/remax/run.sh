#!/usr/bin/env bash
# remax on the built-in task, on CPU. Point data.* and actor_rollout_ref.model.path at real data/models
# (and rollout.name=vllm on GPUs) for a full run.
set -euo pipefail
export RAY_AUTH_MODE=disabled
python -m hybridrl.trainer.main_ppo algorithm.adv_estimator=remax trainer.experiment_name=builtin_remax "$@"
