#!/usr/bin/env bash
# The whole RLHF pipeline on the built-in tiny model, on CPU, no download:
#   1. SFT     main_sft fine-tunes the built-in model on the task's SFT data (256 steps): its last
#              checkpoint starts the reward model;
#   2. RM      main_rm trains a reward model on the built-in preference pairs (15 epochs) and writes
#              it as a Hugging Face sequence-classification folder;
#   3. PPO     main_ppo (GRPO) trains the policy (POLICY, default the shipped built-in model, 31.5%
#              greedy, so that RL has room to show a gain) with the reward model as the ONLY
#              training reward (reward_model.enable=true); validation scores greedy answers by the rule.
# Usage: bash recipes/rlhf/run.sh [extra main_ppo key=value overrides]   (OUT=... output folder)
set -euo pipefail
OUT=${OUT:-checkpoints/rlhf}
POLICY=${POLICY:-builtin:tiny}
RM_EPOCHS=${RM_EPOCHS:-15}
PPO_STEPS=${PPO_STEPS:-100}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0

# the built-in preference pairs (their paths, written once)
read -r PREF_TRAIN PREF_VAL < <(python -c "
from hybridrl.data.preference import ensure_builtin_preference_data as e
p = e(); print(p['pref_train'], p['pref_val'])")

python -m hybridrl.trainer.main_sft trainer.default_local_dir="$OUT/sft" trainer.save_freq=64 \
  trainer.checkpoint.save_contents=[model,hf_model] trainer.resume_mode=disable

python -m hybridrl.trainer.main_rm model.partial_pretrain="$OUT/sft/global_step_256/huggingface" \
  data.train_files="$PREF_TRAIN" data.val_files="$PREF_VAL" \
  optim.lr=1e-4 data.train_batch_size=64 data.micro_batch_size_per_gpu=64 trainer.test_freq=80 \
  trainer.total_epochs="$RM_EPOCHS" trainer.default_local_dir="$OUT/rm" trainer.resume_mode=disable

python -m hybridrl.trainer.main_ppo actor_rollout_ref.model.path="$POLICY" \
  reward_model.enable=true reward_model.model.path="$OUT/rm/reward_model" \
  reward_model.model.fsdp_config.model_dtype=fp32 \
  trainer.total_training_steps="$PPO_STEPS" trainer.test_freq=10 trainer.experiment_name=rlhf_rm_reward "$@"
