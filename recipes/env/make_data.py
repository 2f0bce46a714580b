"""Write the guess-the-number RL data (veRL's parquet schema + agent_name / extra_info.env_name).

python recipes/env/make_data.py --out outputs/env/data [--n-train 2048] [--n-val 64] [--high 8] [--max-turns 4]
"""

from __future__ import annotations

import argparse
import os

import pandas as pd

from hybridrl.env.guess_number import make_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/env/data")
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-val", type=int, default=64)
    parser.add_argument("--high", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split, n, seed in (("train", args.n_train, 0), ("val", args.n_val, 1)):
        rows = make_rows(n, seed, args.high, args.max_turns)
        pd.DataFrame(rows).to_parquet(os.path.join(args.out, f"{split}.parquet"), index=False)
    print(f"wrote {args.out}/train.parquet ({args.n_train} rows) and val.parquet ({args.n_val} rows)")


if __name__ == "__main__":
    main()
