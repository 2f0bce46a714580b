#!/usr/bin/env bash
# Submit the quickstart as a Ray job to a cluster. With no RAY_ADDRESS it starts a local head on
# 127.0.0.1 first (and stops it at the end), so the whole path can be tried on one machine.
# Logs: `ray job logs <id>`; metrics and report: $OUT/logs; checkpoints: $OUT/ckpt.
# Usage: bash recipes/cluster/submit_quickstart.sh [extra key=value overrides]
set -euo pipefail
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-$PWD/outputs/cluster_quickstart}
mkdir -p "$OUT"
STARTED=0
if [ -z "${RAY_JOB_ADDRESS:-}" ]; then
  ray start --head --node-ip-address=127.0.0.1 --port=6399 --dashboard-host=127.0.0.1 \
    --dashboard-port=8265 --num-cpus="${NUM_CPUS:-2}" --disable-usage-stats >/dev/null
  STARTED=1
  export RAY_JOB_ADDRESS=http://127.0.0.1:8265
fi
cleanup() { if [ "$STARTED" = 1 ]; then ray stop --force >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
ray job submit --address "$RAY_JOB_ADDRESS" \
  --runtime-env-json "{\"env_vars\": {\"HYBRIDRL_LOG_DIR\": \"$OUT/logs\", \"RAY_AUTH_MODE\": \"disabled\"}}" \
  -- python -m hybridrl.trainer.main_ppo trainer.default_local_dir="$OUT/ckpt" "$@"
