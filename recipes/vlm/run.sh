#!/usr/bin/env bash
# Vision-language GRPO smoke run on CPU, no download: a tiny random-initialised Qwen2-VL
# (hybridrl.models.vlm) on the built-in coloured-shapes task (hybridrl.data.visual_task, images as
# PNG bytes in veRL's geo3k format). It shows the whole image path working (data -> HF rollout with
# pixels -> FSDP update); it is NOT the learning recipe of issue 24: a random model almost never
# answers "#### <colour>", so the reward stays near 0 (no warm start is shipped yet; docs/vlm.md).
# Usage: bash recipes/vlm/run.sh [extra key=value overrides]   (OUT=folder for model and data)
set -euo pipefail
OUT=${OUT:-outputs/vlm_recipe}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
python - "$OUT" <<'PY'
import sys
from pathlib import Path

from hybridrl.data import visual_task
from hybridrl.models.vlm import build_tiny_vlm

out = Path(sys.argv[1])
if not (out / "model" / "model.safetensors").exists():
    build_tiny_vlm(out / "model", "qwen2_vl", seed=0)
visual_task.write_rl_parquet(str(out / "train.parquet"), 512, seed=0, split="train")
visual_task.write_rl_parquet(str(out / "val.parquet"), 64, seed=0, split="val")
PY
exec python -m hybridrl.trainer.main_ppo \
  actor_rollout_ref.model.path="$OUT/model" \
  data.train_files="$OUT/train.parquet" \
  data.val_files="$OUT/val.parquet" \
  data.max_prompt_length=40 \
  data.max_response_length=8 \
  data.train_batch_size=8 \
  algorithm.adv_estimator=grpo \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 \
  actor_rollout_ref.model.use_remove_padding=true \
  trainer.total_training_steps=${STEPS:-10} \
  trainer.experiment_name=vlm_shapes "$@"
