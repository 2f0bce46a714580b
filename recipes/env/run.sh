#!/usr/bin/env bash
# GRPO that learns to bisect in guess-the-number (hybridrl.env.guess_number) on CPU.
#
#   bash recipes/env/run.sh [extra key=value overrides]
#
# 1. SFT warm start (recipes/env/warm_start.py, cached in $ENV_OUT/warm_start): the built-in model
#    learns the game's format and two strategies, a scan upwards (70% of its openings; wins half the
#    games) and bisection (30%; wins every game). Greedy decoding scans.
# 2. GRPO with the env_agent loop: each episode runs in a process of its own; the reward is 1 when
#    the secret is found within 4 turns. Greedy validation (64 held-out secrets) every 5 steps;
#    env/turn metrics every step in $ENV_OUT/logs/metrics.jsonl. recipes/env/README.md has the curves.
#
# SEED (default 0) seeds both stages: the warm start's data and init order, the trainer's data
# order (data.seed 42+SEED), sampling (rollout.seed SEED) and driver (trainer.seed 1+SEED).
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
OUT=${ENV_OUT:-outputs/env}
SEED=${SEED:-0}
SFT="$OUT/warm_start-seed$SEED"
if [ ! -f "$SFT/warm_start.json" ]; then
    python recipes/env/warm_start.py --out "$SFT" --steps "${ENV_SFT_STEPS:-60}" --seed "$SEED"
fi
python recipes/env/make_data.py --out "$OUT/data" --high 8 --max-turns 4
export HYBRIDRL_LOG_DIR="$OUT/logs"
python -m hybridrl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
    data.return_raw_chat=true data.max_prompt_length=16 data.max_response_length=64 \
    data.train_batch_size=8 actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.model.path="$SFT" \
    actor_rollout_ref.actor.optim.lr="${ENV_LR:-1e-4}" \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4 \
    actor_rollout_ref.rollout.agent.default_agent_loop=env_agent \
    actor_rollout_ref.rollout.agent.agent_loop_config_path=recipes/env/loops.yaml \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.cpus_per_worker=1 \
    trainer.total_training_steps="${ENV_STEPS:-30}" trainer.test_freq=5 \
    trainer.logger='[console,file]' trainer.progress_bar=false \
    data.seed=$((42 + SEED)) actor_rollout_ref.rollout.seed="$SEED" trainer.seed=$((1 + SEED)) \
    trainer.experiment_name=env_guess_number_grpo trainer.resume_mode=disable "$@"
