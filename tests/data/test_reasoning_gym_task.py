"""reasoning-gym tasks as data: rows generated from the config, scored by each task's own scorer."""

from __future__ import annotations

import pandas as pd
import pytest

rg = pytest.importorskip("reasoning_gym")

from hybridrl.data.reasoning_gym_task import RG_DATA_SOURCE, ensure_reasoning_gym_data, extract_answer  # noqa: E402
from hybridrl.reward.scorers import default_compute_score  # noqa: E402

TASKS = [
    {"name": "leg_counting", "size": 6, "seed": 3, "val_size": 2},
    {
        "name": "basic_arithmetic",
        "size": 4,
        "seed": 5,
        "val_size": 2,
        "config": {"min_terms": 2, "max_terms": 2},
    },
]


def test_rows_match_the_package_and_score_with_its_own_scorer(tmp_path):
    paths = ensure_reasoning_gym_data(TASKS, str(tmp_path), system_prompt="Answer in <answer></answer>.")
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert len(train) == 10 and len(val) == 4
    ref = rg.create_dataset("basic_arithmetic", size=4, seed=5, min_terms=2, max_terms=2)
    rows = train[train["ability"] == "basic_arithmetic"].reset_index(drop=True)
    for i, row in rows.iterrows():
        entry = ref[i]
        assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["content"] == entry["question"]
        assert row["reward_model"]["ground_truth"] == entry["answer"]
        # ours vs the package's score_answer on the same answers
        for text, answer in (
            (f"so <answer>{entry['answer']}</answer>", entry["answer"]),
            (f"#### {entry['answer']}", entry["answer"]),
            ("<answer>123456789</answer>", "123456789"),
            ("no idea", "no idea"),
        ):
            got = default_compute_score(
                RG_DATA_SOURCE, text, row["reward_model"]["ground_truth"], dict(row["extra_info"])
            )
            assert got == float(ref.score_answer(answer, entry))
        correct = default_compute_score(
            RG_DATA_SOURCE, f"<answer>{entry['answer']}</answer>", entry["answer"], dict(row["extra_info"])
        )
        assert correct == 1.0
    assert val["extra_info"].map(lambda e: e["rg_seed"]).tolist() == [4, 4, 6, 6]  # val_seed = seed + 1
    # generated once: a second call returns the same files without rewriting them
    mtime = (tmp_path / paths["train"]).stat().st_mtime_ns
    assert ensure_reasoning_gym_data(TASKS, str(tmp_path), "Answer in <answer></answer>.") == paths
    assert (tmp_path / paths["train"]).stat().st_mtime_ns == mtime


def test_answer_extraction():
    assert extract_answer("x <answer> 4 </answer> y <answer>5</answer>") == "5"
    assert extract_answer("12+3=#### 15") == "15"
    assert extract_answer("  7 ") == "7"


@pytest.mark.parametrize(
    ("tasks", "match"),
    [
        ([{"name": "no_such_task"}], "not a reasoning-gym task; known: .*leg_counting"),
        ([{"name": "leg_counting", "sise": 3}], r"unknown keys \['sise'\]"),
        ([{"name": "basic_arithmetic", "config": {"min_terms": 5, "max_terms": 2}}], "reasoning-gym refused"),
        ([], "is empty"),
    ],
)
def test_bad_tasks_are_refused(tmp_path, tasks, match):
    with pytest.raises(ValueError, match=match):
        ensure_reasoning_gym_data(tasks, str(tmp_path))


def test_config_generates_the_files_main_ppo_reads(tmp_path):
    from hybridrl.trainer.ppo.setup import resolve_builtin
    from tests.e2e.ppo_runs import compose_config

    tasks = "[{name:leg_counting,size:8,seed:1,val_size:2}]"
    cfg = compose_config(
        [f"data.reasoning_gym.tasks={tasks}", f"data.reasoning_gym.data_dir={tmp_path}"], tmp_path
    )
    resolve_builtin(cfg)
    assert str(cfg.data.train_files).startswith(str(tmp_path)) and str(cfg.data.val_files).endswith(
        "val.parquet"
    )
    assert len(pd.read_parquet(cfg.data.train_files)) == 8
    cfg.data.val_files = None  # a data file beside the tasks is refused
    with pytest.raises(ValueError, match="data.train_files and data.val_files must be null"):
        resolve_builtin(cfg)
