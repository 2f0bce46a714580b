"""Every row of the train/val files is checked before Ray: a bad row in the middle of a
file fails at start-up naming the key, the file, the row, the column and the fix."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from hybridrl.trainer.ppo.data_checks import RowSpec, check_data_files, check_file
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config

BAD_ROW = 37


def _rows(n: int = 64) -> pd.DataFrame:
    from hybridrl.data.builtin_task import ensure_builtin_data

    return pd.read_parquet(ensure_builtin_data(None)["train"]).head(n).reset_index(drop=True)


def _with(df: pd.DataFrame, column: str, value) -> pd.DataFrame:
    values = list(df[column])
    values[BAD_ROW] = value
    return df.assign(**{column: pd.Series(values, dtype=object)})


def _write(df: pd.DataFrame, path) -> str:
    df.to_parquet(path)
    return str(path)


SPEC = RowSpec("prompt", "data_source", True, ("hybridrl/arith",))

# name -> (column, the value put in row BAD_ROW, what the message must say about it)
BAD_ROWS = {
    "empty message list": ("prompt", [], "not a string or a non-empty message list"),
    "message without a role": ("prompt", [{"role": None, "content": "hi"}], "without a string 'role'"),
    "no prompt": ("prompt", None, "is NoneType None"),
    "unknown data source": ("data_source", "my/task", "no built-in scorer handles"),
    "no reward_model": ("reward_model", None, "reward_model={'ground_truth': ...}"),
    "ground truth not set": ("reward_model", {"style": "rule", "ground_truth": None}, "ground_truth=None"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_in_the_middle_of_a_parquet_file_is_named(tmp_path, case):
    column, value, says = BAD_ROWS[case]
    path = _write(_with(_rows(), column, value), tmp_path / "t.parquet")
    with pytest.raises(ConfigError) as err:
        check_file(path, "data.train_files", SPEC)
    msg = str(err.value)
    assert msg.startswith(f"data.train_files: file {path!r} row {BAD_ROW}: column {column!r}"), msg
    assert says in msg and ("fix" in msg or "set" in msg or "drop" in msg), msg
    assert check_file(path, "data.train_files", SPEC, limit=BAD_ROW) == BAD_ROW  # rows before it pass


def test_a_bad_row_in_a_jsonl_file_is_named(tmp_path):
    rows = _rows(8).to_dict("records")
    for r in rows:
        r["prompt"] = [dict(m) for m in r["prompt"]]
    rows[5]["prompt"] = 7
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    with pytest.raises(
        ConfigError, match=r"data.val_files: file .*t.jsonl' row 5: column 'prompt' .* is int 7"
    ):
        check_file(str(path), "data.val_files", SPEC)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda df: df.drop(columns=["data_source"]), "has no column 'data_source'"),
        (
            lambda df: df.assign(reward_model=df["reward_model"].map(str)),
            "column 'reward_model' has type large_string in every row",
        ),
        (lambda df: df.assign(prompt=1), "column 'prompt' (data.prompt_key) has type int64"),
    ],
)
def test_a_column_of_the_wrong_shape_is_named(tmp_path, change, says):
    path = _write(change(_rows(8)), tmp_path / "t.parquet")
    with pytest.raises(ConfigError) as err:
        check_file(path, "data.train_files", SPEC)
    assert says in str(err.value) and path in str(err.value), str(err.value)


def test_what_is_checked_follows_the_reward(tmp_path):
    path = _write(
        _with(_with(_rows(), "data_source", "my/task"), "reward_model", None), tmp_path / "t.parquet"
    )
    with pytest.raises(ConfigError, match="data.reward_fn_key"):
        check_data_files(compose_config([f"data.train_files={path}"], tmp_path))
    reward = tmp_path / "r.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    custom = compose_config([f"data.train_files={path}", f"custom_reward_function.path={reward}"], tmp_path)
    with pytest.raises(
        ConfigError, match=rf"row {BAD_ROW}: column 'reward_model'"
    ):  # the source is its business
        check_data_files(custom)
    scored_by_a_model = compose_config(
        [f"data.train_files={path}", "reward_model.enable=true", "reward_model.model.path=builtin:tiny"],
        tmp_path,
    )
    check_data_files(scored_by_a_model)  # the reward model scores: no source / ground truth needed
    agents_report = compose_config(
        [
            f"data.train_files={path}",
            "actor_rollout_ref.rollout.mode=server",
            "actor_rollout_ref.rollout.agent_server.reward_source=agent",
        ],
        tmp_path,
    )
    check_data_files(agents_report)  # the external agents report the rewards: no source / ground truth needed
    limited = compose_config([f"data.train_files={path}", f"data.train_max_samples={BAD_ROW}"], tmp_path)
    check_data_files(limited)  # rows past train_max_samples are never used


def test_a_bad_row_fails_prepare_run_before_ray(tmp_path):
    import ray

    from hybridrl.trainer.ppo.setup import prepare_run

    path = _write(_with(_rows(), "prompt", []), tmp_path / "t.parquet")
    started_before = ray.is_initialized()
    with pytest.raises(ConfigError, match=rf"data.train_files: file .* row {BAD_ROW}: column 'prompt'"):
        prepare_run(compose_config([f"data.train_files={path}"], tmp_path))
    assert ray.is_initialized() == started_before


def test_the_arrow_check_imports_no_pandas(tmp_path):
    """The whole-file check of the default run stays off `pyarrow.compute`, whose first call imports
    pandas (part of the start-up budget); and it still tells good files from bad."""
    import subprocess
    import sys

    good = _write(_rows(), tmp_path / "good.parquet")
    bad = _write(_with(_rows(), "prompt", []), tmp_path / "bad.parquet")
    code = (
        "import sys, pyarrow.parquet as pq\n"  # ParquetFile.read, as check_file reads (read_table imports pandas)
        "from hybridrl.trainer.ppo.data_checks import RowSpec, _arrow_rows_ok\n"
        "spec = RowSpec('prompt', 'data_source', True, ('hybridrl/arith',))\n"
        f"ok = [_arrow_rows_ok(pq.ParquetFile(p).read(), spec) for p in ({good!r}, {bad!r})]\n"
        "print(ok, 'pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "[True, False] False", out
