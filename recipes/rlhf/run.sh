#!/usr/bin/env bash
# The whole RLHF pipeline on the built-in tiny model, on CPU, no download:
#   1. SFT     main_sft fine-tunes the built-in model on the task's SFT data (256 steps): its last
#              checkpoint starts the reward model;
#   2. RM      main_rm trains a reward model on the built-in preference pairs (RM_EPOCHS epochs at
#              RM_LR) and writes it as a Hugging Face sequence-classification folder;
#   3. PPO     main_ppo (GRPO, PPO_PROMPTS prompts x 8 samples a step) trains the policy (POLICY,
#              default the shipped built-in model, 31.5% greedy, so that RL has room to show a gain)
#              with the reward model as the ONLY training reward (reward_model.enable=true);
#              validation scores greedy answers by the rule every VAL_EVERY steps, and a checkpoint
#              is saved at each validation;
#   4. BEST    the checkpoint with the best rule-scored validation is linked as $OUT/ppo/best.
# Guards against the policy exploiting the reward model's mistakes: a reward model trained long
# enough to rank answers with a wrong tens digit below the right one (RM_EPOCHS), a KL loss to the
# starting policy (KL_COEF), and keeping the best-validated checkpoint rather than the last.
# SEED seeds all three stages (trainer.seed; PPO's data order and sampling too); SEED=1 is each
# entry point's default.
# Usage: bash recipes/rlhf/run.sh [extra main_ppo key=value overrides]   (OUT=... output folder)
set -euo pipefail
OUT=${OUT:-checkpoints/rlhf}
POLICY=${POLICY:-builtin:tiny}
RM_EPOCHS=${RM_EPOCHS:-40}
RM_LR=${RM_LR:-3e-4}
PPO_STEPS=${PPO_STEPS:-150}
PPO_PROMPTS=${PPO_PROMPTS:-16}
VAL_EVERY=${VAL_EVERY:-10}
KL_COEF=${KL_COEF:-0.05}
SEED=${SEED:-1}
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0

# the built-in preference pairs (their paths, written once)
read -r PREF_TRAIN PREF_VAL < <(python -c "
from hybridrl.data.preference import ensure_builtin_preference_data as e
p = e(); print(p['pref_train'], p['pref_val'])")

python -m hybridrl.trainer.main_sft trainer.default_local_dir="$OUT/sft" trainer.save_freq=64 \
  trainer.checkpoint.save_contents=[model,hf_model] trainer.resume_mode=disable trainer.seed="$SEED"

python -m hybridrl.trainer.main_rm model.partial_pretrain="$OUT/sft/global_step_256/huggingface" \
  data.train_files="$PREF_TRAIN" data.val_files="$PREF_VAL" \
  optim.lr="$RM_LR" data.train_batch_size=64 data.micro_batch_size_per_gpu=64 trainer.test_freq=160 \
  trainer.total_epochs="$RM_EPOCHS" trainer.default_local_dir="$OUT/rm" trainer.resume_mode=disable \
  trainer.seed="$SEED"

HYBRIDRL_LOG_DIR="$OUT/ppo/logs" python -m hybridrl.trainer.main_ppo actor_rollout_ref.model.path="$POLICY" \
  reward_model.enable=true reward_model.model.path="$OUT/rm/reward_model" \
  reward_model.model.fsdp_config.model_dtype=fp32 \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef="$KL_COEF" \
  actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model] \
  data.train_batch_size="$PPO_PROMPTS" data.seed=$((41 + SEED)) trainer.seed="$SEED" \
  actor_rollout_ref.rollout.seed=$((SEED - 1)) \
  trainer.total_training_steps="$PPO_STEPS" trainer.test_freq="$VAL_EVERY" trainer.save_freq="$VAL_EVERY" \
  trainer.default_local_dir="$OUT/ppo" trainer.resume_mode=disable trainer.logger=[console,file] \
  trainer.experiment_name=rlhf_rm_reward "$@"

# the checkpoint whose greedy validation the rule scored best (step 0 is the starting policy)
python - "$OUT/ppo" <<'EOF'
import json, os, sys

ppo = sys.argv[1]
key = "val-core/hybridrl/arith/acc/mean@1"
curve = {}
with open(os.path.join(ppo, "logs", "metrics.jsonl")) as f:
    for line in f:
        row = json.loads(line)
        if row.get(key) is not None:
            curve[row["step"]] = row[key]
print("rule-scored greedy validation by step:", {s: round(v, 3) for s, v in sorted(curve.items())})
saved = {s: v for s, v in curve.items() if os.path.isdir(os.path.join(ppo, f"global_step_{s}"))}
if not saved:
    sys.exit("no validated checkpoint was saved")
best = max(saved, key=lambda s: (saved[s], -s))
link = os.path.join(ppo, "best")
if os.path.islink(link):
    os.remove(link)
os.symlink(f"global_step_{best}", link)
print(f"best: step {best}, validation {saved[best]:.3f} (step 0: {curve.get(0, float('nan')):.3f}) -> {link}")
EOF
