"""Cost of the start-up check of every data row (hybridrl/trainer/ppo/data_checks.py).

    nice -n 10 python bench/data_row_check.py [--rows 10000] [--repeats 5]

Writes a parquet file of `--rows` rows (the built-in task's rows repeated), then alternates, in one
process, the row check (`check_file`) and the dataset construction it precedes (`RLHFDataset`,
which reads every row as well) and prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import pandas as pd

    from hybridrl.config.roles import ModelConfig
    from hybridrl.data.builtin_task import ensure_builtin_data
    from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.models.hf import load_tokenizer
    from hybridrl.reward.scorers import registered_data_sources
    from hybridrl.trainer.ppo.data_checks import RowSpec, check_file

    base = pd.read_parquet(ensure_builtin_data(None)["train"])
    df = pd.concat([base] * (args.rows // len(base) + 1), ignore_index=True).head(args.rows)
    spec = RowSpec("prompt", "data_source", True, tuple(registered_data_sources()))
    tok = load_tokenizer(ModelConfig(path=get_builtin_model_path()))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rows.parquet")
        df.to_parquet(path)
        check_s, build_s = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            assert check_file(path, "data.train_files", spec) == args.rows
            check_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            RLHFDataset(path, tok, RLDataConfig(max_prompt_length=64))
            build_s.append(time.perf_counter() - t0)
    check, build = statistics.median(check_s), statistics.median(build_s)
    print(f"rows={args.rows} repeats={args.repeats}")
    print(
        f"row check (every row):        {check * 1e3:8.1f} ms  (runs {[round(s * 1e3, 1) for s in check_s]})"
    )
    print(
        f"dataset construction:         {build * 1e3:8.1f} ms  (runs {[round(s * 1e3, 1) for s in build_s]})"
    )
    print(f"check / construction:         {check / build:8.2f}")


if __name__ == "__main__":
    main()
