"""Convert the original GSM8K files into hybridrl's RL parquet schema.

    python -m hybridrl.data.preprocess.gsm8k --local_dir IN --out_dir OUT

IN holds GSM8K's train and test splits as parquet or jsonl files with `question` and `answer`
columns, as published (e.g. `train.jsonl`, `main/train-00000-of-00001.parquet`). Nothing is
downloaded. OUT receives `train.parquet` and `test.parquet` with one row per problem:

    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + INSTRUCTION}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": the number after "####", commas removed}
    extra_info   {"split", "index", "answer", "question"}
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_SOURCE",
    "INSTRUCTION",
    "extract_gsm8k_answer",
    "find_split_file",
    "make_row",
    "preprocess_gsm8k",
]

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SUFFIXES = (".parquet", ".jsonl")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_gsm8k_answer(answer: str) -> str:
    """The final number of a GSM8K solution: the text after the last "####", commas removed.

    >>> extract_gsm8k_answer("3 + 4 = 7\\n#### 1,007")
    '1007'
    """
    if "####" not in answer:
        raise ValueError(f'GSM8K answer has no "####" marker: {answer[-200:]!r}')
    match = _NUMBER.search(answer.rsplit("####", 1)[1])
    if match is None:
        raise ValueError(f'GSM8K answer has no number after "####": {answer[-200:]!r}')
    return match.group(0).replace(",", "")


def make_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One RL row from a GSM8K (question, answer) pair."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_gsm8k_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def find_split_file(local_dir: str | os.PathLike, split: str) -> Path:
    """The file under `local_dir` (searched recursively) whose name starts with `split` and ends
    in .parquet or .jsonl, e.g. `train.jsonl` or `main/train-00000-of-00001.parquet`.

    Raises:
        FileNotFoundError: no such file, listing the files that were found.
        ValueError: several candidates (names them, so the user can point at one folder).
    """
    root = Path(local_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"--local_dir {str(root)!r} is not a directory; give the folder holding GSM8K."
        )
    candidates = sorted(
        p for p in root.rglob(f"{split}*") if p.is_file() and p.name.lower().endswith(_SUFFIXES)
    )
    if not candidates:
        seen = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())[:20]
        raise FileNotFoundError(
            f"no GSM8K {split!r} file in {str(root)!r}: expected a file named {split}*.parquet or "
            f"{split}*.jsonl with question/answer columns (found: {seen or 'no files'})."
        )
    if len(candidates) > 1:
        raise ValueError(
            f"several GSM8K {split!r} files in {str(root)!r}: {[str(p) for p in candidates]}; "
            "point --local_dir at a folder holding one of them (e.g. the 'main' config)."
        )
    return candidates[0]


def _read_question_answer(path: Path) -> list[tuple[str, str]]:
    import pandas as pd

    frame = pd.read_parquet(path) if path.suffix.lower() == ".parquet" else pd.read_json(path, lines=True)
    missing = [c for c in ("question", "answer") if c not in frame.columns]
    if missing:
        raise KeyError(f"{str(path)!r} lacks column(s) {missing}; columns present: {list(frame.columns)}.")
    if frame.empty:
        raise ValueError(f"{str(path)!r} has no rows.")
    return list(zip(frame["question"].astype(str), frame["answer"].astype(str)))


def preprocess_gsm8k(
    local_dir: str | os.PathLike, out_dir: str | os.PathLike, splits: Sequence[str] = ("train", "test")
) -> dict[str, Path]:
    """Convert each split under `local_dir` into `out_dir/{split}.parquet`; returns the paths."""
    import pandas as pd

    out = Path(out_dir).expanduser()
    sources = {split: find_split_file(local_dir, split) for split in splits}  # fail before writing
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, src in sources.items():
        rows = []
        for index, (question, answer) in enumerate(_read_question_answer(src)):
            try:
                rows.append(make_row(question, answer, split, index))
            except ValueError as exc:
                raise ValueError(f"{str(src)!r} row {index}: {exc}") from exc
        dest = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(dest, index=False)
        logger.info("wrote %d %s rows from %s to %s", len(rows), split, src, dest)
        written[split] = dest
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", required=True, help="folder with the original GSM8K train/test files")
    parser.add_argument("--out_dir", required=True, help="folder to write train.parquet / test.parquet")
    parser.add_argument("--splits", default="train,test", help="comma-separated splits (default: train,test)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = preprocess_gsm8k(args.local_dir, args.out_dir, [s for s in args.splits.split(",") if s])
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
