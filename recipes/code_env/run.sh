#!/usr/bin/env bash
# GRPO that learns to write the bracket: the built-in model writes Python functions for linear
# formulas, and the reward is the share of unit tests its program passes in the local sandbox.
#
#   bash recipes/code_env/run.sh [extra key=value overrides]
#
# 1. SFT warm start (recipes/code_env/warm_start.py, cached in $CODE_OUT/warm_start): the model
#    learns the ```python block and, for bracketed specs such as f(x)=3(x+2), two teachers: 70% of
#    the programs have the precedence bug (return 3*x+2), 30% are right. Greedy decoding writes the bug.
# 2. GRPO; the reward is hybridrl/reward/scorers/code_tests.py (the program, then the row's asserts,
#    run once in the sandbox: 1 when all pass). Greedy validation on the 72 held-out specs every 5 steps.
#    recipes/code_env/README.md has the curves.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
OUT=${CODE_OUT:-outputs/code_env}
SFT="$OUT/warm_start"
if [ ! -f "$SFT/warm_start.json" ]; then
    python recipes/code_env/warm_start.py --out "$SFT" --steps "${CODE_SFT_STEPS:-250}"
fi
python recipes/code_env/make_data.py --out "$OUT/data"
export HYBRIDRL_LOG_DIR="$OUT/logs"
python -m hybridrl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
    data.max_prompt_length=16 data.max_response_length=48 \
    data.train_batch_size=8 actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.model.path="$SFT" \
    actor_rollout_ref.actor.optim.lr="${CODE_LR:-1e-4}" \
    actor_rollout_ref.rollout.name=hf \
    custom_reward_function.path=hybridrl/reward/scorers/code_tests.py \
    custom_reward_function.name=compute_score \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.cpus_per_worker=1 \
    trainer.total_training_steps="${CODE_STEPS:-20}" trainer.test_freq=5 \
    trainer.logger='[console,file]' trainer.progress_bar=false \
    trainer.experiment_name=code_env_grpo trainer.resume_mode=disable "$@"
