#!/usr/bin/env bash
# GRPO that learns to call a calculator: the built-in tool task (3-digit x 2-digit products) on CPU.
#
#   bash recipes/agent/run.sh [extra key=value overrides]            # synchronous (main_ppo)
#   AGENT_TRAINER=main_async bash recipes/agent/run.sh [overrides]    # asynchronous (main_async)
#
# 1. SFT warm start (recipes/agent/warm_start.py, cached in $AGENT_OUT/warm_start), run until its
#    loss reaches the level at which the tool path is learnt (the recipe stops with exit 1 if the
#    step cap comes first): the built-in
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
# two or more torch threads on a busy machine spin unless OpenMP waits passively (bench/threads.py)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
OUT=${AGENT_OUT:-outputs/agent}
TRAINER=${AGENT_TRAINER:-main_ppo}
SFT="$OUT/warm_start"
# The warm start runs until its loss reaches the level at which the tool path is learnt (mean of
# the last 20 steps <= AGENT_SFT_TARGET_LOSS, default H(0.3) + 0.015 = 0.626) or AGENT_SFT_STEPS
# steps (the cap, default 1500); without the tool path GRPO sees reward 0 on every sample.
if [ ! -f "$SFT/warm_start.json" ]; then
    # shellcheck disable=SC2086  # AGENT_SFT_ARGS: extra warm_start.py flags, e.g. "--seed 1 --threads 1"
    python recipes/agent/warm_start.py --out "$SFT" --steps "${AGENT_SFT_STEPS:-1500}" \
        ${AGENT_SFT_TARGET_LOSS:+--target-loss "$AGENT_SFT_TARGET_LOSS"} ${AGENT_SFT_ARGS:-} || true
fi
if ! python - "$SFT/warm_start.json" <<'PY'
import json, sys
try:
    info = json.load(open(sys.argv[1]))
except FileNotFoundError:
    sys.exit(f"agent recipe: no warm start at {sys.argv[1]} (see the warm start's error above)")
if info.get("reached_target") is not True:
    sys.exit(
        f"agent recipe: stopping before GRPO: the warm start in {sys.argv[1].rsplit('/', 1)[0]} "
        f"did not reach its loss target (mean loss {info.get('window_loss', info.get('final_loss'))}"
        f" after {info.get('stop_step', info.get('steps'))} steps, target {info.get('target_loss')}),"
        " so the model does not produce the tool-call format and every GRPO reward would be 0. "
        "Delete that folder and rerun with a larger AGENT_SFT_STEPS, or another seed "
        "(AGENT_SFT_ARGS='--seed 1')."
    )
try:  # a warm start cached before 2026-12-02 has a tokenizer that drops every space and newline
    from transformers import AutoTokenizer

    from hybridrl.models.hf import check_whitespace

    check_whitespace(AutoTokenizer.from_pretrained(sys.argv[1].rsplit("/", 1)[0]), "the cached warm start")
except ValueError as err:
    sys.exit(f"agent recipe: {err}. Delete {sys.argv[1].rsplit('/', 1)[0]} and rerun (it is rebuilt).")
if info["target_loss"] <= 0:
    print(f"agent recipe: warm start ran {info['stop_step']} steps without a loss target (mean loss "
          f"{info['window_loss']})")
else:
    print(f"agent recipe: warm start reached loss {info['window_loss']} (target {info['target_loss']}) "
          f"at step {info['stop_step']}")
PY
then
    exit 1
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
