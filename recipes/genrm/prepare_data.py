"""Copy the built-in task's RL parquet files, adding each row's question to extra_info (as veRL's
GSM8K preprocessing does), for the GenRM recipe's judge prompt.

    python recipes/genrm/prepare_data.py --out /tmp/genrm_data   # writes train.parquet, val.parquet
"""

from __future__ import annotations

import argparse
import os

import pandas as pd

from hybridrl.data.builtin_task import ensure_builtin_data


def add_question(df: pd.DataFrame) -> pd.DataFrame:
    """extra_info["question"] = the user turn of the row's prompt."""
    df = df.copy()
    df["extra_info"] = [
        {**dict(info), "question": next(m["content"] for m in prompt if m["role"] == "user")}
        for info, prompt in zip(df["extra_info"], df["prompt"])
    ]
    return df


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    files = ensure_builtin_data()
    for split in ("train", "val"):
        add_question(pd.read_parquet(files[split])).to_parquet(os.path.join(args.out, f"{split}.parquet"))
        print(os.path.join(args.out, f"{split}.parquet"))


if __name__ == "__main__":
    main()
