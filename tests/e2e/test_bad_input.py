"""Bad input fails fast with a message naming the cause and the fix; written checkpoints stay loadable."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from hybridrl.trainer.ppo.launch import run_ppo_config
from hybridrl.utils import checkpointing
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config, run


def test_missing_prompt_column_names_file_and_column(tmp_path):
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"question": ["1+1="], "data_source": ["hybridrl/arith"]}).to_parquet(bad)
    config = compose_config([f"data.train_files={bad}", f"data.val_files={bad}"], tmp_path)
    # checked before Ray starts (trainer/ppo/data_checks.py): a ConfigError naming the file and column
    with pytest.raises(ConfigError, match=r"prompt.*bad\.parquet|bad\.parquet.*prompt"):
        run_ppo_config(config)


def test_missing_model_path_names_the_key(tmp_path):
    config = compose_config([f"actor_rollout_ref.model.path={tmp_path}/no_model"], tmp_path)
    with pytest.raises(FileNotFoundError, match="actor_rollout_ref.model.path"):
        run_ppo_config(config)


def test_too_small_dataset_for_the_batch(tmp_path):
    from hybridrl.data.builtin_task import write_rl_parquet

    small = write_rl_parquet(tmp_path / "small.parquet", 2, 0, "train")
    config = compose_config([f"data.train_files={small}"], tmp_path)
    with pytest.raises(ValueError, match="data.train_batch_size"):
        run_ppo_config(config)


@pytest.mark.usefixtures("ray_local")
def test_crashing_reward_function_names_data_source_and_sample(tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ZeroDivisionError('boom')\n"
    )
    with pytest.raises(RuntimeError, match=r"hybridrl/arith") as err:
        run([f"custom_reward_function.path={fn}"], tmp_path)
    assert "boom" in repr(err.value.__cause__) or "boom" in str(err.value)


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    root = str(tmp_path)
    os.makedirs(checkpointing.tmp_step_dir(root, 2))
    checkpointing.finalize(root, 2)
    os.makedirs(checkpointing.tmp_step_dir(root, 4))  # a save of step 4 that crashed half way
    assert checkpointing.find_latest(root) == checkpointing.step_dir(root, 2)
    assert checkpointing.list_checkpoints(root) == [2]
    checkpointing.finalize(root, 4)
    os.makedirs(checkpointing.tmp_step_dir(root, 6))
    checkpointing.finalize(root, 6)
    assert checkpointing.prune(root, keep=2) == [2]
    assert checkpointing.list_checkpoints(root) == [4, 6]
    assert checkpointing.find_latest(root) == checkpointing.step_dir(root, 6)
    with pytest.raises(ValueError, match="global_step_<N>"):
        checkpointing.step_of(str(tmp_path / "elsewhere"))
