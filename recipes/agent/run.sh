#!/usr/bin/env bash
# GRPO that learns to call a calculator: the built-in tool task (3-digit x 2-digit products) on CPU.
#
#   bash recipes/agent/run.sh [extra key=value overrides]            # synchronous (main_ppo)
#   AGENT_TRAINER=main_async bash recipes/agent/run.sh [overrides]    # asynchronous (main_async)
#
# 1. SFT warm start (recipes/agent/warm_start.py, cached in $AGENT_OUT/warm_start): the built-in
#    model learns the hermes tool-call format and to copy the result, but starts an answer with a
#    tool call only 30% of the time, so greedy decoding answers directly and gets ~0% right.
# 2. GRPO with the tool agent (actor_rollout_ref.rollout.multi_turn.*, a veRL-format tool yaml,
#    per-row agent_name / extra_info.tools_kwargs from hybridrl.data.agent_task): the calls earn the
#    reward, so the policy learns to call the tool every time and to copy its result.
# Validation (greedy, 200 held-out products) every 5 steps; tool calls per trajectory
# (tool/calls_per_traj), tool error rate (tool/error_rate), num_turns/* are logged every step to
# $AGENT_OUT/logs/metrics.jsonl. docs/agent.md has the measured numbers.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export TOKENIZERS_PARALLELISM=false
# two or more torch threads on a busy machine spin unless OpenMP waits passively (NOTES-cpu.md)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
OUT=${AGENT_OUT:-outputs/agent}
TRAINER=${AGENT_TRAINER:-main_ppo}
SFT="$OUT/warm_start"
if [ ! -f "$SFT/model.safetensors" ]; then
    python recipes/agent/warm_start.py --out "$SFT" --steps "${AGENT_SFT_STEPS:-300}"
fi
python -c "from hybridrl.data.agent_task import ensure_agent_data; ensure_agent_data('$OUT/data')"
ASYNC=()
if [ "$TRAINER" = main_async ]; then
    ASYNC=(
        async_training.rollout_nnodes=1 async_training.rollout_n_gpus_per_node=1
        async_training.rollout_cpus_per_worker=1 async_training.max_head_offpolicyness=1
        async_training.recompute_logprob=true async_training.use_decoupled_loss=true
        async_training.behave_imp_weight_cap=5.0
    )
fi
export HYBRIDRL_LOG_DIR="$OUT/logs/$TRAINER"
python -m "hybridrl.trainer.$TRAINER" \
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
    actor_rollout_ref.rollout.multi_turn.enable=true \
    actor_rollout_ref.rollout.multi_turn.tool_config_path=recipes/agent/calculator_tool.yaml \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
    actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=ignore_strippable \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.cpus_per_worker=1 \
    trainer.total_training_steps="${AGENT_STEPS:-60}" trainer.test_freq=5 \
    trainer.logger='[console,file]' trainer.progress_bar=false \
    trainer.experiment_name="agent_grpo_$TRAINER" trainer.resume_mode=disable \
    "${ASYNC[@]}" "$@"
