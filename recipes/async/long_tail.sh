#!/usr/bin/env bash
# Asynchronous GRPO with partial rollout on the long-tailed built-in task (hybridrl/data/long_task.py:
# one sum asked 1-5 times, answers of 7-44 tokens), on CPU, 1 trainer core + 1 rollout core.
#
#   bash recipes/async/long_tail.sh [extra main_async overrides]
#
# 1. writes the task's parquet files to $OUT/data (python -m hybridrl.data.long_task);
# 2. warm-starts the built-in model on the format with main_sft (120 steps of 64, lr 3e-4; skipped when
#    $OUT/model exists), see docs/async.md "The long-tailed task";
# 3. trains with main_async, partial rollout on (a weight update aborts the generation in flight and
#    the unfinished responses continue from their prefix with the new weights).
# bench/async_vs_sync.py --task long --model $OUT/model compares it with main_ppo and with partial
# rollout off.
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
OUT=${OUT:-outputs/long_tail}

python -m hybridrl.data.long_task --out "$OUT/data"
if [ ! -d "$OUT/model" ]; then
    python -m hybridrl.trainer.main_sft model.partial_pretrain=builtin:tiny \
        data.train_files="$OUT/data/sft_train.parquet" data.val_files="$OUT/data/sft_val.parquet" \
        data.max_length=96 data.train_batch_size=64 data.micro_batch_size_per_gpu=64 optim.lr=3e-4 \
        trainer.total_training_steps=120 trainer.test_freq=60 trainer.save_freq=120 \
        trainer.resume_mode=disable trainer.default_local_dir="$OUT/sft" generation_eval.max_new_tokens=48
    cp -r "$OUT/sft/global_step_120/huggingface" "$OUT/model"
fi

python -m hybridrl.trainer.main_async \
    data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
    data.max_prompt_length=96 data.max_response_length=48 \
    actor_rollout_ref.model.path="$OUT/model" \
    algorithm.adv_estimator=grpo data.train_batch_size=8 actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.name=hf actor_rollout_ref.actor.optim.lr=3e-5 \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.cpus_per_worker=1 \
    async_training.rollout_nnodes=1 async_training.rollout_n_gpus_per_node=1 \
    async_training.rollout_cpus_per_worker=1 \
    async_training.max_head_offpolicyness=1 async_training.partial_rollout=true \
    trainer.total_training_steps=100 trainer.test_freq=20 \
    trainer.logger='[console,file]' trainer.experiment_name=async_long_tail trainer.resume_mode=disable \
    "$@"
