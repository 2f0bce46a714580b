"""Rebuild the built-in tiny model shipped in hybridrl/models/assets/builtin_tiny/.

    python recipes/builtin_model/build.py --out hybridrl/models/assets/builtin_tiny
    python recipes/builtin_model/build.py --arch moe --out hybridrl/models/assets/builtin_tiny_moe

Builds the character tokenizer, a random Qwen2 init and the deterministic SFT warm start
(hybridrl.models.builtin.build_builtin_model), then measures greedy and sampled (T=1) exact-match
accuracy on the 200 validation prompts and records them in build_info.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

try:
    from hybridrl.models import builtin
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hybridrl.models import builtin


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder (an HF model folder)")
    parser.add_argument("--seed", type=int, default=builtin.DEFAULT_SEED)
    parser.add_argument("--sft-steps", type=int, default=None, help="default: 400 (dense), 540 (moe)")
    parser.add_argument("--lr", type=float, default=builtin.DEFAULT_SFT_LR)
    parser.add_argument("--batch-size", type=int, default=builtin.DEFAULT_SFT_BATCH)
    parser.add_argument("--threads", type=int, default=builtin.DEFAULT_NUM_THREADS)
    parser.add_argument("--n-eval", type=int, default=200, help="validation prompts for the accuracy numbers")
    parser.add_argument(
        "--arch", choices=("dense", "moe"), default="dense", help="moe: the Qwen3-MoE variant"
    )
    args = parser.parse_args()

    info = builtin.build_builtin_model(
        args.out,
        seed=args.seed,
        sft_steps=args.sft_steps
        or (builtin.DEFAULT_MOE_SFT_STEPS if args.arch == "moe" else builtin.DEFAULT_SFT_STEPS),
        lr=args.lr,
        batch_size=args.batch_size,
        num_threads=args.threads,
        arch=args.arch,
    )
    t0 = time.perf_counter()
    info["greedy_acc"] = builtin.evaluate_greedy_accuracy(args.out, n=args.n_eval)
    info["sampled_acc_t1"] = builtin.evaluate_accuracy(args.out, n=args.n_eval, temperature=1.0)
    info["eval_n"] = args.n_eval
    info["eval_seconds"] = round(time.perf_counter() - t0, 1)
    (Path(args.out) / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
