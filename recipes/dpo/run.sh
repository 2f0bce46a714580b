#!/usr/bin/env bash
# Preference optimisation of the built-in tiny model on the built-in pairs (a correct and a wrong
# answer to the same question), on CPU, no download. Greedy accuracy on the held-out questions is
# printed before training and at the end (val/greedy_acc).
# LOSS=sigmoid (DPO, default) | ipo | simpo; LORA=8 trains a LoRA adapter with the base as reference.
# Usage: bash recipes/dpo/run.sh [extra key=value overrides]
set -euo pipefail
LOSS=${LOSS:-sigmoid}
LORA=${LORA:-0}
OUT=${OUT:-checkpoints/hybridrl-dpo/builtin_${LOSS}}
extra=()
if [ "$LORA" != "0" ]; then
  extra+=(model.lora_rank="$LORA" model.lora_alpha=$((2 * LORA)) optim.lr=2e-3)
fi
if [ "$LOSS" = "ipo" ]; then
  extra+=(dpo.beta=0.5)
fi
exec python -m hybridrl.trainer.main_dpo dpo.loss_type="$LOSS" trainer.default_local_dir="$OUT" \
  trainer.experiment_name="builtin_${LOSS}" "${extra[@]}" "$@"
