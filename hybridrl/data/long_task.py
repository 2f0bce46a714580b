"""The long-tailed built-in task: one sum of the built-in task, asked for one to five times.

A question is one sum of the built-in task written ``k`` times, ``"12+34,12+34,12+34="``; the reference
response is the built-in task's answer ``k`` times, ``"#### 46 #### 46 #### 46"``. ``k`` is drawn from
a long-tailed law, ``P(k) ∝ k ** -TAIL_EXPONENT`` on ``1..MAX_SUMS`` (57% once, 5% five times), so
with the built-in character tokenizer a response is 7 to 44 tokens (plus EOS): most are short, a
few are long. This is the task docs/async.md measures partial rollout on: a batch's generation
lasts as long as its longest response, and a weight update that waits for it holds the whole
rollout pool back.

Why this variant: with ``k = 1`` it *is* the built-in task, which the built-in model already answers
(31% greedy), and every further answer is the same sum, so the only new skill is to repeat the
answer once per copy of the sum; a short, gentle supervised warm start with ``main_sft`` on
:func:`make_sft_rows` teaches it (recipes/async/long_tail.sh; docs/async.md "The long-tailed task").
Two richer variants failed with the 0.5M-parameter model: ``k`` different sums answered ``"46 134"``
(the count was learnt, the sums no longer: 0.01 greedy after 250 SFT steps), and the same with each
sum written out before its answer (``"12+34=46 56+78=134"``: it could not copy the k-th sum, 0.03).

Scoring (:func:`compute_score`, data source ``hybridrl/arith_long``): the fraction of the ``k``
answers that are right, position by position; the answers are the integers after each ``####``, and
a response with more answers than ``k`` is divided by its own count, so padding never pays and a
shorter answer never scores higher: the lengths stay long-tailed while RL trains.

Splits: the built-in task's (its fixed hash, :func:`hybridrl.data.builtin_task.pair_split`), so
train and validation prompts share no sum.

    python -m hybridrl.data.long_task --out DIR     # writes DIR/{train,val,sft_train,sft_val}.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path
from typing import Any

from hybridrl.data import builtin_task

LONG_DATA_SOURCE = "hybridrl/arith_long"
ABILITY = "math"
MAX_SUMS = 5
TAIL_EXPONENT = 1.5
# Bump when the generator or the row format changes: cached parquet files are then rewritten.
TASK_VERSION = 3

DEFAULT_N_TRAIN = 8192
DEFAULT_N_VAL = 200
DEFAULT_N_SFT_TRAIN = 16384
DEFAULT_N_SFT_VAL = 200

_ANSWER = re.compile(r"####\s*(-?\d+)")

__all__ = [
    "LONG_DATA_SOURCE",
    "compute_score",
    "ensure_long_data",
    "make_rl_rows",
    "make_sft_rows",
    "response",
    "sample_problems",
    "sum_count_weights",
]


def sum_count_weights(max_sums: int = MAX_SUMS, exponent: float = TAIL_EXPONENT) -> list[float]:
    """Probabilities of ``k = 1..max_sums`` sums in a prompt: ``P(k) = k**-exponent / Z``."""
    if max_sums < 1:
        raise ValueError(f"max_sums must be >= 1, got {max_sums}")
    raw = [k**-exponent for k in range(1, max_sums + 1)]
    z = sum(raw)
    return [w / z for w in raw]


def sample_problems(n: int, seed: int, split: str) -> list[list[tuple[int, int]]]:
    """``n`` problems of ``split``; a problem is one pair repeated ``k`` times, ``k`` from the long tail.

    Deterministic in ``(n, seed, split)``; the pairs come from the split's pool of the built-in task.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = builtin_task.split_pool(split)  # raises on an unknown split
    rng = random.Random(f"long:{split}:{seed}")
    ks = rng.choices(range(1, MAX_SUMS + 1), weights=sum_count_weights(), k=n)
    return [[pool[rng.randrange(len(pool))]] * k for k in ks]


def question(pairs: list[tuple[int, int]]) -> str:
    """``[(12, 34), (12, 34)] -> "12+34,12+34="``."""
    return ",".join(f"{a}+{b}" for a, b in pairs) + "="


def answer(pairs: list[tuple[int, int]]) -> str:
    """``[(12, 34), (12, 34)] -> "46 46"``: the ground truth."""
    return " ".join(str(a + b) for a, b in pairs)


def response(pairs: list[tuple[int, int]]) -> str:
    """The reference response: ``"#### 46"`` per sum, ``"#### 46 #### 46"`` for two."""
    return " ".join(f"{builtin_task.ANSWER_MARKER} {a + b}" for a, b in pairs)


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Fraction of the sums answered right, position by position, in [0, 1].

    ``score = #{i : pred_i == ref_i} / max(len(ref), len(pred))`` where ``pred`` are the integers
    after each ``####`` of the response, in order, and ``ref`` the space-separated reference answers.
    """
    ref = str(ground_truth).split()
    pred = _ANSWER.findall(solution_str)
    if not ref:
        raise ValueError(f"{LONG_DATA_SOURCE}: empty ground truth")
    right = sum(p == r for p, r in zip(pred, ref))
    return right / max(len(ref), len(pred))


def make_rl_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """RL prompts in the veRL parquet schema (``extra_info.n_sums`` = ``k``)."""
    rows = []
    for i, pairs in enumerate(sample_problems(n, seed, split)):
        rows.append(
            {
                "data_source": LONG_DATA_SOURCE,
                "prompt": [{"role": "user", "content": question(pairs)}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": answer(pairs)},
                "extra_info": {"split": split, "index": i, "n_sums": len(pairs)},
            }
        )
    return rows


def make_sft_rows(n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """SFT rows for ``main_sft``: ``prompt`` / ``response`` strings, ``data_source``, ``ground_truth``."""
    rows = []
    for i, pairs in enumerate(sample_problems(n, seed + 1000, split)):
        rows.append(
            {
                "prompt": question(pairs),
                "response": response(pairs),
                "data_source": LONG_DATA_SOURCE,
                "ground_truth": answer(pairs),
                "extra_info": {"split": split, "index": i, "n_sums": len(pairs)},
            }
        )
    return rows


def ensure_long_data(
    data_dir: str | os.PathLike,
    n_train: int = DEFAULT_N_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    n_sft_train: int = DEFAULT_N_SFT_TRAIN,
    n_sft_val: int = DEFAULT_N_SFT_VAL,
    seed: int = 0,
) -> dict[str, str]:
    """Write the task's four parquet files once (a manifest records sizes, seed and version).

    Returns:
        ``{"train", "val", "sft_train", "sft_val"}`` -> absolute paths.
    """
    root = Path(data_dir).expanduser().resolve()
    spec = {"version": TASK_VERSION, "n_train": n_train, "n_val": n_val, "n_sft_train": n_sft_train}
    spec.update({"n_sft_val": n_sft_val, "seed": seed})
    paths, fresh = builtin_task.cached_task_files(root, spec)
    if fresh:
        return paths
    builtin_task.write_parquet(make_rl_rows(n_train, seed, "train"), paths["train"])
    builtin_task.write_parquet(make_rl_rows(n_val, seed + 1, "val"), paths["val"])
    builtin_task.write_parquet(make_sft_rows(n_sft_train, seed, "train"), paths["sft_train"])
    builtin_task.write_parquet(make_sft_rows(n_sft_val, seed + 1, "val"), paths["sft_val"])
    builtin_task.write_manifest(root, spec)
    return paths


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for train/val/sft_train/sft_val.parquet")
    p.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN)
    p.add_argument("--n-val", type=int, default=DEFAULT_N_VAL)
    p.add_argument("--n-sft-train", type=int, default=DEFAULT_N_SFT_TRAIN)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    paths = ensure_long_data(args.out, args.n_train, args.n_val, args.n_sft_train, seed=args.seed)
    print(json.dumps(paths, indent=1))
    return paths


if __name__ == "__main__":
    main()
