#!/usr/bin/env bash
# GenRM on the built-in task, on CPU: the judge is the built-in model after the zero-argument SFT
# (main_sft, 98.0% greedy), served by HF generate in the reward loop; the policy (the shipped warm
# start) is rewarded 1 when its answer equals the judge's (recipes/genrm/judge_reward.py).
# Usage: bash recipes/genrm/run.sh [extra main_ppo key=value overrides]
# WORK (default /tmp/hybridrl_genrm) holds the data copy and the judge; an existing judge is reused.
set -euo pipefail
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/hybridrl_genrm}
JUDGE=$WORK/judge_sft/global_step_256/huggingface
python "$HERE/prepare_data.py" --out "$WORK/data"
if [ ! -f "$JUDGE/config.json" ]; then
  # the zero-argument SFT run, plus a checkpoint (with its huggingface/ export) at its last step
  python -m hybridrl.trainer.main_sft trainer.save_freq=256 trainer.default_local_dir="$WORK/judge_sft"
fi
# veRL's old spelling (reward_model.*, custom_reward_function.*); the reward.* section works in yaml
# configs (the command-line key check does not know it yet)
exec python -m hybridrl.trainer.main_ppo \
  data.train_files="$WORK/data/train.parquet" data.val_files="$WORK/data/val.parquet" \
  reward_model.enable=True reward_model.use_reward_loop=True reward_model.model.path="$JUDGE" \
  reward_model.rollout.name=hf reward_model.rollout.dtype=float32 reward_model.rollout.do_sample=False \
  reward_model.rollout.prompt_length=64 reward_model.rollout.response_length=12 \
  reward_model.rollout.request_timeout_s=120 reward_model.reward_manager=batch \
  custom_reward_function.path="$HERE/judge_reward.py" custom_reward_function.name=compute_score_batch \
  trainer.total_training_steps=40 trainer.test_freq=10 trainer.experiment_name=builtin_genrm "$@"
