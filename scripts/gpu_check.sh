#!/usr/bin/env bash
# Every GPU path of hybridrl end to end for a few steps, then one table of what passed.
# Budget: <= ~8 minutes on one GPU (each check has its own timeout). Untested on GPU: written for
# the first run on a GPU machine. Without a GPU (or a package) each check prints SKIP and why.
#
#   bash scripts/gpu_check.sh            # from the repository root, in the project's virtualenv
#   GPU_CHECK_TIMEOUT=150 bash scripts/gpu_check.sh
#
# Checks: GPU unit tests (-m gpu), FSDP + vLLM colocated on CUDA (rollout TP=1), FSDP + vLLM TP=2
# (needs 2 GPUs), SGLang rollout, Megatron actor (+ vLLM rollout, load_format=dummy_megatron).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python}"
LIMIT="${GPU_CHECK_TIMEOUT:-120}"
OUT="$(mktemp -d /tmp/hybridrl_gpu_check.XXXXXX)"
declare -a NAMES STATUS NOTES

record() { NAMES+=("$1"); STATUS+=("$2"); NOTES+=("$3"); echo "[gpu_check] $1: $2 $3"; }

has_module() { "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" 2>/dev/null; }

N_GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"

# A few PPO steps on the built-in task: 4 prompts x 4 responses, validation at the end.
SMALL=(data.train_batch_size=4 data.val_max_samples=16 actor_rollout_ref.rollout.n=4
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
  critic.ppo_micro_batch_size_per_gpu=8 trainer.total_training_steps=3 trainer.val_before_train=false
  trainer.device=cuda trainer.logger=[console,file] trainer.progress_bar=false trainer.make_report=false
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 actor_rollout_ref.rollout.dtype=bfloat16)

run_ppo() {  # name, needed GPUs, needed module ("" = none), extra config args...
  local name="$1" gpus="$2" module="$3"; shift 3
  if [ "$N_GPUS" -lt "$gpus" ]; then record "$name" SKIP "needs $gpus GPU(s), found $N_GPUS"; return; fi
  if [ -n "$module" ] && ! has_module "$module"; then record "$name" SKIP "package '$module' is not installed"; return; fi
  local dir="$OUT/$name" start=$SECONDS
  mkdir -p "$dir"
  HYBRIDRL_LOG_DIR="$dir/logs" timeout "$LIMIT" "$PY" -m hybridrl.trainer.main_ppo "${SMALL[@]}" \
    trainer.n_gpus_per_node="$gpus" trainer.default_local_dir="$dir/ckpt" "$@" >"$dir/out.txt" 2>&1
  local rc=$? secs=$((SECONDS - start))
  if [ $rc -ne 0 ]; then
    record "$name" FAIL "rc=$rc after ${secs}s; last lines of $dir/out.txt:"; tail -n 15 "$dir/out.txt"; return
  fi
  local acc
  acc="$("$PY" - "$dir/logs/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in rows if "actor/pg_loss" in r]
acc = [r[k] for r in rows for k in r if k.startswith("val-core/") and "/acc/" in k]
print(f"{len(steps)} steps, final val acc {acc[-1]:.3f}" if acc else f"{len(steps)} steps, no validation row")
EOF
)"
  record "$name" PASS "${secs}s, $acc"
}

if [ "$N_GPUS" -eq 0 ]; then
  echo "[gpu_check] no CUDA device visible (torch.cuda.is_available() is False): every check is skipped"
fi

# 1. unit tests that need a device
if [ "$N_GPUS" -ge 1 ]; then
  start=$SECONDS
  if timeout "$LIMIT" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests >"$OUT/pytest_gpu.txt" 2>&1; then
    record pytest-gpu PASS "$((SECONDS - start))s, $(tail -n 1 "$OUT/pytest_gpu.txt")"
  else
    record pytest-gpu FAIL "see $OUT/pytest_gpu.txt: $(tail -n 1 "$OUT/pytest_gpu.txt")"
  fi
else
  record pytest-gpu SKIP "no GPU"
fi

# 2-5. end-to-end runs
run_ppo fsdp+vllm 1 vllm actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.load_format=dummy_dtensor
run_ppo fsdp+vllm-tp2 2 vllm actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.rollout.load_format=dummy_dtensor
run_ppo fsdp+sglang 1 sglang actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.load_format=dummy_dtensor
run_ppo megatron+vllm 1 megatron.core actor_rollout_ref.actor.strategy=megatron actor_rollout_ref.ref.strategy=megatron \
  critic.strategy=megatron actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.load_format=dummy_megatron

echo
echo "hybridrl GPU check ($N_GPUS GPU(s); logs in $OUT)"
printf '%-16s %-5s %s\n' check result note
fails=0
for i in "${!NAMES[@]}"; do
  printf '%-16s %-5s %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${NOTES[$i]}"
  [ "${STATUS[$i]}" = FAIL ] && fails=$((fails + 1))
done
exit $((fails > 0))
