#!/usr/bin/env bash
# The built-in calculator task (recipes/agent/) trained entirely through the rollout server: main_ppo with
# actor_rollout_ref.rollout.mode=server serves every trajectory (training and greedy validation) on an
# OpenAI-compatible endpoint, and recipes/agent_server/calc_agent.py, a separate process written against the
# openai client, drives them with its own calculator tool.
#
#   bash recipes/agent_server/run.sh [extra key=value overrides]
#
# Needs the warm start of recipes/agent (AGENT_SFT, default outputs/agent/warm_start: run
# `bash recipes/agent/run.sh` once, or recipes/agent/warm_start.py). Port: AGENT_SERVER_PORT (8000).
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
OUT=${AGENT_OUT:-outputs/agent_server}
SFT=${AGENT_SFT:-outputs/agent/warm_start}
PORT=${AGENT_SERVER_PORT:-8000}
python -c "import json,sys; i=json.load(open('$SFT/warm_start.json')); sys.exit(0 if i.get('reached_target') else 'warm start $SFT did not reach its loss target (recipes/agent/run.sh)')"
python -c "from hybridrl.data.agent_task import ensure_agent_data; ensure_agent_data('$OUT/data')"
python recipes/agent_server/calc_agent.py "http://127.0.0.1:$PORT/v1" "${AGENT_CONCURRENCY:-64}" > "$OUT/agent.log" 2>&1 &
AGENT_PID=$!
trap 'kill $AGENT_PID 2>/dev/null || true' EXIT
export HYBRIDRL_LOG_DIR="$OUT/logs"
python -m hybridrl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
    data.return_raw_chat=true data.max_prompt_length=16 data.max_response_length=128 \
    data.train_batch_size=8 actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.model.path="$SFT" \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.mode=server \
    actor_rollout_ref.rollout.agent_server.port="$PORT" \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.cpus_per_worker=1 \
    trainer.total_training_steps="${AGENT_STEPS:-30}" trainer.test_freq=5 \
    trainer.logger='[console,file]' trainer.progress_bar=false \
    trainer.experiment_name=agent_server_grpo trainer.resume_mode=disable \
    "$@"
