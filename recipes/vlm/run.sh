#!/usr/bin/env bash
# Vision-language GRPO on CPU, no download: a tiny Qwen2-VL (hybridrl.models.vlm, ~0.43M parameters)
# learns the built-in coloured-shapes task (hybridrl.data.visual_task, "What colour is the shape?",
# images as PNG bytes in veRL's geo3k format).
# 1. Warm start (~20 s): the random model is trained on "#### <colour>" answers with the colour drawn
#    at random (hybridrl.models.vlm_warm_start): it learns the answer format, not the colours, and
#    answers one colour greedily (about 25% on four colours).
# 2. GRPO with the HF rollout: the reward (1 for the right colour) teaches it to read the pixels.
# Greedy validation accuracy every 10 steps; measured numbers in docs/vlm.md.
# Usage: bash recipes/vlm/run.sh [extra key=value overrides]   (OUT=folder for model and data)
set -euo pipefail
OUT=${OUT:-outputs/vlm_recipe}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
python - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

from hybridrl.data import visual_task
from hybridrl.models.vlm import build_tiny_vlm
from hybridrl.models.vlm_warm_start import format_warm_start

out = Path(sys.argv[1])
if not (out / "model" / "warm_start.json").exists():
    build_tiny_vlm(out / "model", "qwen2_vl", seed=0)
    info = format_warm_start(str(out / "model"), steps=60, seed=0)
    (out / "model" / "warm_start.json").write_text(json.dumps(info) + "\n")
    print("warm start:", info, flush=True)
visual_task.write_rl_parquet(str(out / "train.parquet"), 2400, seed=0, split="train")
visual_task.write_rl_parquet(str(out / "val.parquet"), 64, seed=0, split="val")
PY
exec python -m hybridrl.trainer.main_ppo \
  actor_rollout_ref.model.path="$OUT/model" \
  data.train_files="$OUT/train.parquet" \
  data.val_files="$OUT/val.parquet" \
  data.max_prompt_length=40 \
  data.max_response_length=12 \
  data.train_batch_size=16 \
  algorithm.adv_estimator=grpo \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.optim.lr=${LR:-3e-4} \
  actor_rollout_ref.model.use_remove_padding=false \
  trainer.total_training_steps=${STEPS:-150} \
  trainer.test_freq=10 \
  trainer.log_freq=10 \
  trainer.project_name=hybridrl_vlm \
  trainer.experiment_name=vlm_shapes "$@"
