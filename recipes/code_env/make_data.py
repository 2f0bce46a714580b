"""Write the code recipe's RL data (veRL's parquet schema; the ground truth is unit-test code).

python recipes/code_env/make_data.py --out outputs/code_env/data [--n-train 4096]

The validation file holds every validation spec once.
"""

from __future__ import annotations

import argparse
import os
import sys

import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from task import make_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/code_env/data")
    parser.add_argument("--n-train", type=int, default=4096)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split, n in (("train", args.n_train), ("val", 0)):
        rows = make_rows(split, n, seed=0)
        pd.DataFrame(rows).to_parquet(os.path.join(args.out, f"{split}.parquet"), index=False)
        print(f"wrote {args.out}/{split}.parquet ({len(rows)} rows)")


if __name__ == "__main__":
    main()
