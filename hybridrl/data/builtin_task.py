"""The built-in task: two-digit addition with the answer after ``####``.

``python -m hybridrl.trainer.main_ppo`` with no arguments trains the built-in tiny model on this task,
so it has to be learnable by a 0.5M-parameter model on two CPU cores within minutes, and its data has
to be generated offline, deterministically, from a seed.

A question is ``"a+b="`` with ``a, b`` in ``[10, 99]``; the reference response is ``"#### <a+b>"``
(the GSM8K answer convention, so the same habit carries over to real data sets). The scorer
(:mod:`hybridrl.data.builtin_score`) reads the number after the last ``####``.

Train/validation split: every ordered pair ``(a, b)`` belongs to exactly one split, decided by a fixed
hash of the pair (about 10% go to validation), so the splits never overlap whatever seeds are used.
The seed only chooses and orders pairs inside a split.

Row formats (the veRL schema users already know):

* RL rows (:func:`make_rl_rows`): ``data_source``, ``prompt`` (chat messages), ``ability``,
  ``reward_model`` (``{"style": "rule", "ground_truth": "46"}``), ``extra_info``
  (``{"split": ..., "index": i}``).
* SFT rows (:func:`make_sft_rows`): ``prompt`` (plain string ``"12+34="``), ``response``
  (``"#### 46"``), and ``messages``: a two-turn conversation (this row's question and answer followed
  by the next pair's) for multi-turn SFT.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path
from typing import Any

BUILTIN_DATA_SOURCE = "hybridrl/arith"
ABILITY = "math"
ANSWER_MARKER = "####"
OPERAND_MIN = 10
OPERAND_MAX = 99
VAL_BUCKETS = 10  # one pair in VAL_BUCKETS (by hash) is a validation pair
SPLITS = ("train", "val")
# Bump when the generator or the row format changes: cached parquet files are then rewritten.
TASK_VERSION = 1

DEFAULT_N_VAL = 200
DEFAULT_N_SFT_TRAIN = 4096
DEFAULT_N_SFT_VAL = 200
DEFAULT_TRAIN_SEED = 0
DEFAULT_VAL_SEED = 1


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def pair_split(a: int, b: int) -> str:
    """The split a pair belongs to: fixed by a hash of the pair, independent of any seed."""
    return "val" if zlib.crc32(f"{a}+{b}".encode()) % VAL_BUCKETS == 0 else "train"


def split_pool(split: str) -> list[tuple[int, int]]:
    """All ``(a, b)`` pairs of one split, in a fixed order."""
    _check_split(split)
    operands = range(OPERAND_MIN, OPERAND_MAX + 1)
    return [(a, b) for a in operands for b in operands if pair_split(a, b) == split]


def sample_pairs(n: int, seed: int, split: str) -> list[tuple[int, int]]:
    """``n`` pairs of ``split``, chosen by ``seed``.

    Pairs are drawn without repetition by walking a seeded shuffle of the split's pool; when ``n`` is
    larger than the pool the pool is reshuffled and walked again.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = split_pool(split)
    rng = random.Random(f"{split}:{seed}")
    out: list[tuple[int, int]] = []
    while len(out) < n:
        epoch = list(pool)
        rng.shuffle(epoch)
        out.extend(epoch[: n - len(out)])
    return out


def format_question(a: int, b: int) -> str:
    return f"{a}+{b}="


def format_answer(a: int, b: int) -> str:
    return str(a + b)


def format_response(a: int, b: int) -> str:
    """The reference response the SFT warm start imitates: ``"#### 46"``."""
    return f"{ANSWER_MARKER} {a + b}"


def make_rl_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """RL prompts in the veRL parquet schema.

    Args:
        n: number of rows.
        seed: chooses and orders the pairs inside the split.
        split: ``"train"`` or ``"val"``.

    Returns:
        ``n`` dicts with keys ``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info``.
    """
    rows = []
    for i, (a, b) in enumerate(sample_pairs(n, seed, split)):
        rows.append(
            {
                "data_source": BUILTIN_DATA_SOURCE,
                "prompt": [{"role": "user", "content": format_question(a, b)}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": format_answer(a, b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def make_sft_rows(n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """SFT rows: ``prompt`` / ``response`` strings plus a two-turn ``messages`` conversation.

    Row ``i``'s ``messages`` holds its own question and answer, then those of the next sampled pair,
    so a multi-turn SFT dataset trains on two assistant turns per row.
    """
    pairs = sample_pairs(n + 1, seed, split)
    rows = []
    for i in range(n):
        (a, b), (c, d) = pairs[i], pairs[i + 1]
        rows.append(
            {
                "prompt": format_question(a, b),
                "response": format_response(a, b),
                "messages": [
                    {"role": "user", "content": format_question(a, b)},
                    {"role": "assistant", "content": format_response(a, b)},
                    {"role": "user", "content": format_question(c, d)},
                    {"role": "assistant", "content": format_response(c, d)},
                ],
                "data_source": BUILTIN_DATA_SOURCE,
                "ground_truth": format_answer(a, b),
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | os.PathLike) -> str:
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a private file, then rename: concurrent writers (several Ray workers) never see a
    # half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return str(path)


def write_rl_parquet(path: str | os.PathLike, n: int, seed: int, split: str) -> str:
    """Write :func:`make_rl_rows` to a parquet file; returns the path."""
    return write_parquet(make_rl_rows(n, seed, split), path)


def write_sft_parquet(path: str | os.PathLike, n: int, seed: int, split: str = "train") -> str:
    """Write :func:`make_sft_rows` to a parquet file; returns the path."""
    return write_parquet(make_sft_rows(n, seed, split), path)


def default_data_dir() -> str:
    """``$HYBRIDRL_DATA_DIR`` if set, else ``~/.cache/hybridrl/builtin_arith``."""
    env = os.environ.get("HYBRIDRL_DATA_DIR")
    return env if env else str(Path.home() / ".cache" / "hybridrl" / "builtin_arith")


def ensure_builtin_data(
    data_dir: str | os.PathLike | None = None,
    n_train: int | None = None,
    n_val: int = DEFAULT_N_VAL,
    n_sft_train: int = DEFAULT_N_SFT_TRAIN,
    n_sft_val: int = DEFAULT_N_SFT_VAL,
    train_seed: int = DEFAULT_TRAIN_SEED,
    val_seed: int = DEFAULT_VAL_SEED,
) -> dict[str, str]:
    """Write the built-in task's parquet files once and return their paths.

    The files are reused while a ``manifest.json`` next to them records the same sizes, seeds and
    :data:`TASK_VERSION`; otherwise they are regenerated.

    Args:
        data_dir: where to write; default :func:`default_data_dir`.
        n_train: RL train prompts; default the whole train pool (7279 pairs), each once, shuffled.
        n_val: RL validation prompts (default 200: the set the shipped model's numbers are measured on).
        n_sft_train, n_sft_val: SFT rows.
        train_seed, val_seed: seeds of the train-split and val-split files.

    Returns:
        ``{"train": ..., "val": ..., "sft_train": ..., "sft_val": ...}`` (absolute paths).
    """
    if n_train is None:
        n_train = len(split_pool("train"))
    root = Path(data_dir if data_dir is not None else default_data_dir()).expanduser().resolve()
    spec = {
        "version": TASK_VERSION,
        "n_train": n_train,
        "n_val": n_val,
        "n_sft_train": n_sft_train,
        "n_sft_val": n_sft_val,
        "train_seed": train_seed,
        "val_seed": val_seed,
    }
    paths, fresh = cached_task_files(root, spec)
    if fresh:
        return paths
    write_rl_parquet(paths["train"], n_train, train_seed, "train")
    write_rl_parquet(paths["val"], n_val, val_seed, "val")
    write_sft_parquet(paths["sft_train"], n_sft_train, train_seed, "train")
    write_sft_parquet(paths["sft_val"], n_sft_val, val_seed, "val")
    write_manifest(root, spec)
    return paths


def cached_task_files(root: Path, spec: dict) -> tuple[dict[str, str], bool]:
    """The four parquet paths of a task folder, and whether they are there and were written for `spec`
    (its manifest.json equals it; a damaged manifest counts as stale)."""
    paths = {name: str(root / f"{name}.parquet") for name in ("train", "val", "sft_train", "sft_val")}
    manifest = root / "manifest.json"
    if manifest.exists() and all(Path(p).exists() for p in paths.values()):
        try:
            return paths, json.loads(manifest.read_text()) == spec
        except json.JSONDecodeError:
            pass
    return paths, False


def write_manifest(root: Path, spec: dict) -> None:
    """Record `spec` as the folder's manifest.json, atomically (written last, after the files)."""
    manifest = root / "manifest.json"
    tmp = manifest.with_name(f".manifest.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec, indent=1))
    os.replace(tmp, manifest)
