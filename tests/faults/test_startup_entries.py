"""Start-up checks of main_sft, main_generation and main_eval, one bad value per row:
each fails before a process group, a model or a generation starts, with a message naming the key."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from hybridrl.trainer.offline.evaluation import run_eval
from hybridrl.trainer.offline.generation import load_generation_config, run_generation
from hybridrl.trainer.sft.config import load_sft_config
from hybridrl.trainer.sft.input_checks import check_sft_inputs
from hybridrl.utils.config_loader import ConfigError


def _builtin() -> dict:
    from hybridrl.data.builtin_task import ensure_builtin_data

    return ensure_builtin_data(None)


def _model_without_config_json(tmp_path) -> str:
    from hybridrl.models.builtin import get_builtin_model_path

    dst = tmp_path / "model"
    shutil.copytree(get_builtin_model_path(), dst)
    (dst / "config.json").unlink()
    return str(dst)


def _sft_file(tmp_path, change) -> str:
    df = change(pd.read_parquet(_builtin()["sft_train"]).head(64).reset_index(drop=True))
    path = tmp_path / "sft.parquet"
    df.to_parquet(path)
    return str(path)


def _none_at(df, column, row=40):
    values = list(df[column])
    values[row] = None
    return df.assign(**{column: pd.Series(values, dtype=object)})


SFT_VALUE_ROWS = [
    ("optim.weight_decay=-1", "optim.weight_decay"),
    ("optim.eps=-1", "optim.eps"),
    ("optim.clip_grad=-1", "optim.clip_grad"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("optim.lr_warmup_steps=-5", "optim.lr_warmup_steps"),
    ("optim.betas=[0.9,1.5]", "optim.betas"),
    ("trainer.save_freq=-2", "trainer.save_freq"),
    ("trainer.test_freq=-2", "trainer.test_freq"),
    ("trainer.max_ckpt_to_keep=-1", "trainer.max_ckpt_to_keep"),
    ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node"),
    ("trainer.logger=[bogus]", "trainer.logger"),
    ("data.train_max_samples=-2", "data.train_max_samples"),
    ("model.lora_rank=8 model.lora_alpha=0", "model.lora_alpha"),
    ("model.fsdp_config.mixed_precision.param_dtype=fp7", "model.fsdp_config.mixed_precision.param_dtype"),
    ("generation_eval.batch_size=0", "generation_eval.batch_size"),
    ("generation_eval.max_new_tokens=0", "generation_eval.max_new_tokens"),
]


@pytest.mark.parametrize(("overrides", "key"), SFT_VALUE_ROWS, ids=[r[0] for r in SFT_VALUE_ROWS])
def test_sft_bad_value_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_sft_config(overrides.split())
    assert key in str(err.value), str(err.value)


SFT_INPUT_ROWS = {
    "missing model folder": lambda t: ([f"model.partial_pretrain={t}/nope"], "model.partial_pretrain"),
    "model folder without config.json": lambda t: (
        [f"model.partial_pretrain={_model_without_config_json(t)}"],
        "model.partial_pretrain",
    ),
    "missing train file": lambda t: ([f"data.train_files={t}/nope.parquet"], "data.train_files"),
    "no response column": lambda t: (
        [f"data.train_files={_sft_file(t, lambda df: df.drop(columns=['response']))}"],
        "data.response_key",
    ),
    "a row without a response": lambda t: (
        [f"data.train_files={_sft_file(t, lambda df: _none_at(df, 'response'))}"],
        "data.response_key",
    ),
    "a conversation that is not a message list": lambda t: (
        [
            f"data.train_files={_sft_file(t, lambda df: _none_at(df, 'messages'))}",
            "data.multiturn.enable=true",
        ],
        "data.multiturn.messages_key",
    ),
}


@pytest.mark.parametrize("case", list(SFT_INPUT_ROWS))
def test_sft_bad_input_fails_before_the_model_loads(tmp_path, case):
    overrides, key = SFT_INPUT_ROWS[case](tmp_path)
    if not any(o.startswith("data.train_files") for o in overrides):
        overrides.append(f"data.train_files={_builtin()['sft_train']}")  # needed with another model
    with pytest.raises(ConfigError) as err:
        check_sft_inputs(load_sft_config(overrides))
    assert key in str(err.value), str(err.value)


def test_sft_data_rows_name_file_and_row(tmp_path):
    path = _sft_file(tmp_path, lambda df: _none_at(df, "response"))
    with pytest.raises(ConfigError, match=r"data.train_files: file .*sft.parquet' row 40: column 'response'"):
        check_sft_inputs(load_sft_config([f"data.train_files={path}"]))
    check_sft_inputs(load_sft_config([f"data.train_files={path}", "data.train_max_samples=40"]))  # unused row


GEN_VALUE_ROWS = [
    ("rollout.top_k=-2", "rollout.top_k"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.dtype=fp7", "rollout.dtype"),
    ("rollout.tensor_model_parallel_size=0", "rollout.tensor_model_parallel_size"),
    ("rollout.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs"),
    ("data.max_samples=0", "data.max_samples"),
    ("trainer.device=tpu", "trainer.device"),
]


@pytest.mark.parametrize(("overrides", "key"), GEN_VALUE_ROWS, ids=[r[0] for r in GEN_VALUE_ROWS])
def test_generation_bad_value_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_generation_config(overrides.split())
    assert key in str(err.value), str(err.value)


def _under_a_file(tmp_path) -> str:
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    return str(tmp_path / "notes.txt" / "out.parquet")


GEN_INPUT_ROWS = {
    "output path is a folder": lambda t: ([f"data.output_path={t}"], "data.output_path"),
    "output folder is a file": lambda t: ([f"data.output_path={_under_a_file(t)}"], "data.output_path"),
    "model folder without config.json": lambda t: (
        [f"model.path={_model_without_config_json(t)}"],
        "model.path",
    ),
}


@pytest.mark.parametrize("case", list(GEN_INPUT_ROWS))
def test_generation_bad_input_fails_before_generating(tmp_path, case):
    overrides, key = GEN_INPUT_ROWS[case](tmp_path)
    with pytest.raises(ConfigError) as err:
        run_generation(overrides)  # fails before the tokenizer, the engine or any generation
    assert key in str(err.value), str(err.value)


def _eval_file(tmp_path, source: str = "hybridrl/arith") -> str:
    df = pd.read_parquet(_builtin()["val"]).head(8)
    df = df.assign(responses=[["1"]] * len(df), data_source=[source] * len(df))
    path = tmp_path / "gen.parquet"
    df.to_parquet(path)
    return str(path)


def _reward(tmp_path, text: str) -> str:
    path = tmp_path / "r.py"
    path.write_text(text)
    return str(path)


EVAL_ROWS = {
    "output path is a folder": lambda t: ([f"data.path={_eval_file(t)}", f"output_path={t}"], "output_path"),
    "reward function with the wrong signature": lambda t: (
        [
            f"data.path={_eval_file(t)}",
            f"custom_reward_function.path={_reward(t, 'def compute_score(x):' + chr(10) + '    return 0.0' + chr(10))}",
        ],
        "custom_reward_function.name",
    ),
    "unknown data source": lambda t: ([f"data.path={_eval_file(t, 'my/task')}"], "data.data_source_key"),
}


@pytest.mark.parametrize("case", list(EVAL_ROWS))
def test_eval_bad_input_fails_before_scoring(tmp_path, case):
    overrides, key = EVAL_ROWS[case](tmp_path)
    with pytest.raises(ConfigError) as err:
        run_eval(overrides)
    assert key in str(err.value), str(err.value)
