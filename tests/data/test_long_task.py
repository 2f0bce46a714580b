"""The long-tailed built-in task (hybridrl/data/long_task.py): lengths, splits, scorer, files."""

from __future__ import annotations

import collections

import pandas as pd
import pytest

from hybridrl.data import builtin_task, long_task
from hybridrl.reward.scorers import default_compute_score


def test_response_lengths_are_long_tailed_from_7_to_44_tokens():
    problems = long_task.sample_problems(5000, seed=0, split="train")
    lengths = [len(long_task.response(p)) for p in problems]  # characters = tokens of the built-in tokenizer
    counts = collections.Counter(len(p) for p in problems)
    assert min(lengths) == 7 and 40 <= max(lengths) <= 44
    assert set(counts) == set(range(1, long_task.MAX_SUMS + 1))
    assert counts[1] > counts[2] > counts[3] > counts[4]  # a tail, not a uniform law
    assert sum(n <= 8 for n in lengths) / len(lengths) > 0.5  # most responses are short
    assert sum(n >= 30 for n in lengths) / len(lengths) > 0.05  # a few are long


def test_reference_response_repeats_the_builtin_answer():
    assert long_task.question([(12, 34)] * 2) == "12+34,12+34="
    assert long_task.response([(12, 34)]) == "#### 46"
    assert long_task.response([(12, 34)] * 3) == "#### 46 #### 46 #### 46"
    for pairs in long_task.sample_problems(200, 0, "val"):
        assert long_task.compute_score(long_task.response(pairs), long_task.answer(pairs)) == 1.0


def test_deterministic_and_splits_share_no_sum():
    assert long_task.sample_problems(50, 3, "train") == long_task.sample_problems(50, 3, "train")
    assert long_task.sample_problems(50, 3, "train") != long_task.sample_problems(50, 4, "train")
    for split in ("train", "val"):
        for pairs in long_task.sample_problems(300, 0, split):
            assert all(builtin_task.pair_split(a, b) == split for a, b in pairs)
    with pytest.raises(ValueError, match="split"):
        long_task.sample_problems(1, 0, "test")


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("#### 46 #### 134", 1.0),
        ("#### 46 ####134", 1.0),
        ("#### 46 #### 135", 0.5),
        ("46 134", 0.0),  # the answers follow ####
        ("#### 134 #### 46", 0.0),  # position by position
        ("#### 46", 0.5),  # a missing answer is wrong
        ("#### 46 #### 134 #### 7 #### 8", 0.5),  # extra answers divide by their own count
        ("", 0.0),
    ],
)
def test_scorer_is_registered_and_scores_position_by_position(response, score):
    assert default_compute_score(long_task.LONG_DATA_SOURCE, response, "46 134") == pytest.approx(score)


def test_rows_and_parquet_files(tmp_path):
    paths = long_task.main(
        ["--out", str(tmp_path), "--n-train", "64", "--n-val", "16", "--n-sft-train", "32"]
    )
    train, sft = pd.read_parquet(paths["train"]), pd.read_parquet(paths["sft_train"])
    assert len(train) == 64 and len(pd.read_parquet(paths["val"])) == 16 and len(sft) == 32
    row = train.iloc[0]
    assert row["data_source"] == long_task.LONG_DATA_SOURCE
    q = row["prompt"][0]["content"]
    truth = row["reward_model"]["ground_truth"]
    sums = [eval(s) for s in q.rstrip("=").split(",")]  # noqa: S307 - our own "a+b" strings
    assert truth == " ".join(map(str, sums)) and row["extra_info"]["n_sums"] == len(sums)
    assert len(set(q.rstrip("=").split(","))) == 1
    assert all(long_task.compute_score(r, t) == 1.0 for r, t in zip(sft["response"], sft["ground_truth"]))
    before = (tmp_path / "train.parquet").stat().st_mtime_ns
    long_task.ensure_long_data(tmp_path, 64, 16, 32)  # same spec: files reused
    assert (tmp_path / "train.parquet").stat().st_mtime_ns == before
