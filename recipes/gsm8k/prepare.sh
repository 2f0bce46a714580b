#!/usr/bin/env bash
# Convert the original GSM8K files (train/test as parquet or jsonl, from a local folder) into the RL schema.
# Usage: bash recipes/gsm8k/prepare.sh /path/to/gsm8k ~/data/gsm8k
set -euo pipefail
python -m hybridrl.data.preprocess.gsm8k --local_dir "$1" --out_dir "${2:-$HOME/data/gsm8k}"
