"""The start-up validation sweep, one bad value per row (docs/reliability.md lists it).

Three tiers, each row must fail with a message that names the key:

* CONFIG_ROWS: values set on a typed config of the real yaml defaults, then the whole config stage
  (`run_config_stage`: derivations, veRL compat, every start-up check) runs (milliseconds a row);
* LOADER_ROWS: overrides composed from the yaml like a command line (the typed loader's own
  checks: types, unknown keys, the sections' checks), about 1-2 s a row;
* FILE_ROWS: real input files (train/val parquet schemas and every row, model folder and config.json,
  tokenizer, reward function file, tool / interaction / agent-loop configs and the classes they
  name) read by `prepare_run`, the driver's part that runs before Ray starts.
"""

from __future__ import annotations

import copy
import json
import shutil

import pandas as pd
import pytest
import yaml

from hybridrl.trainer.ppo.config import run_config_stage
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config

GAE = "algorithm.adv_estimator=gae"
KL = "algorithm.use_kl_in_reward=true"
RM = "reward_model.enable=true reward_model.model.path=builtin:tiny reward_model.use_reward_loop=true"

# (overrides, the key the message must name)
CONFIG_ROWS = [
    ("data.train_batch_size=0", "data.train_batch_size"),
    ("data.max_prompt_length=0", "data.max_prompt_length"),
    ("data.max_response_length=0", "data.max_response_length"),
    ("data.truncation=bogus", "data.truncation"),
    ("data.val_batch_size=0", "data.val_batch_size"),
    ("data.dataloader_num_workers=-1", "data.dataloader_num_workers"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
    ("actor_rollout_ref.actor.ppo_epochs=0", "actor_rollout_ref.actor.ppo_epochs"),
    ("actor_rollout_ref.actor.clip_ratio=-0.1", "actor_rollout_ref.actor.clip_ratio"),
    ("actor_rollout_ref.actor.clip_ratio_low=-1", "actor_rollout_ref.actor.clip_ratio_low"),
    ("actor_rollout_ref.actor.clip_ratio_high=-1", "actor_rollout_ref.actor.clip_ratio_high"),
    ("actor_rollout_ref.actor.clip_ratio_c=0.5", "actor_rollout_ref.actor.clip_ratio_c"),
    ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.actor.optim.weight_decay=-1", "actor_rollout_ref.actor.optim.weight_decay"),
    (
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=2",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    ),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps=-5", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.5]", "actor_rollout_ref.actor.optim.betas"),
    ("actor_rollout_ref.actor.optim.warmup_style=bogus", "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=2", "actor_rollout_ref.actor.optim.min_lr_ratio"),
    ("actor_rollout_ref.actor.grad_clip=-1", "actor_rollout_ref.actor.grad_clip"),
    ("actor_rollout_ref.actor.loss_agg_mode=bogus", "actor_rollout_ref.actor.loss_agg_mode"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=bogus", "actor_rollout_ref.actor.policy_loss.loss_mode"),
    (
        "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_type=bogus",
        "actor_rollout_ref.actor.kl_loss_type",
    ),
    (
        "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=-1",
        "actor_rollout_ref.actor.kl_loss_coef",
    ),
    (
        "actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp7",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp7",
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
    ),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=3", "ulysses_sequence_parallel_size"),
    (
        "actor_rollout_ref.actor.checkpoint.save_contents=[bogus]",
        "actor_rollout_ref.actor.checkpoint.save_contents",
    ),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.rollout.name=bogus", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.rollout.top_k=-2", "actor_rollout_ref.rollout.top_k"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=0", "tensor_model_parallel_size"),
    ("actor_rollout_ref.rollout.val_kwargs.n=0", "actor_rollout_ref.rollout.val_kwargs.n"),
    (
        "actor_rollout_ref.rollout.val_kwargs.temperature=-1",
        "actor_rollout_ref.rollout.val_kwargs.temperature",
    ),
    ("actor_rollout_ref.rollout.val_kwargs.top_p=2", "actor_rollout_ref.rollout.val_kwargs.top_p"),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ),
    ("actor_rollout_ref.model.lora_rank=-1", "actor_rollout_ref.model.lora_rank"),
    (
        "actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=0",
        "actor_rollout_ref.model.lora_alpha",
    ),
    (f"{GAE} critic.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size"),
    (f"{GAE} critic.ppo_micro_batch_size_per_gpu=0", "critic.ppo_micro_batch_size_per_gpu"),
    (f"{GAE} critic.ppo_epochs=0", "critic.ppo_epochs"),
    (f"{GAE} critic.optim.lr=-1", "critic.optim.lr"),
    (f"{GAE} critic.cliprange_value=-1", "critic.cliprange_value"),
    ("algorithm.adv_estimator=bogus", "algorithm.adv_estimator"),
    ("algorithm.adv_estimator=grpo_passk actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.n"),
    ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("algorithm.lam=-0.1", "algorithm.lam"),
    (f"{KL} algorithm.kl_ctrl.type=bogus", "algorithm.kl_ctrl.type"),
    (f"{KL} algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef"),
    (f"{KL} algorithm.kl_ctrl.type=adaptive algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon"),
    (f"{KL} algorithm.kl_penalty=bogus", "algorithm.kl_penalty"),
    (
        "algorithm.filter_groups.enable=true actor_rollout_ref.rollout.n=1 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.filter_groups.enable",
    ),
    (
        "algorithm.filter_groups.enable=true algorithm.filter_groups.metric=bogus",
        "algorithm.filter_groups.metric",
    ),
    ("trainer.total_training_steps=0", "trainer.total_training_steps"),
    ("trainer.total_training_steps=-5", "trainer.total_training_steps"),
    ("trainer.total_training_steps=null trainer.total_epochs=0", "trainer.total_epochs"),
    ("trainer.nnodes=0", "trainer.nnodes"),
    ("trainer.log_freq=0", "trainer.log_freq"),
    ("trainer.save_freq=-2", "trainer.save_freq"),
    ("trainer.test_freq=-2", "trainer.test_freq"),
    ("trainer.save_freq_secs=-1", "trainer.save_freq_secs"),
    ("trainer.resume_mode=bogus", "trainer.resume_mode"),
    ("trainer.resume_mode=resume_path", "trainer.resume_from_path"),
    ("trainer.device=tpu", "trainer.device"),
    ("trainer.backend=bogus", "trainer.backend"),
    ("trainer.logger=[bogus]", "trainer.logger"),
    ("trainer.max_actor_ckpt_to_keep=-1", "trainer.max_actor_ckpt_to_keep"),
    ("trainer.max_critic_ckpt_to_keep=-1", "trainer.max_critic_ckpt_to_keep"),
    ("trainer.step_timeout_s=0", "trainer.step_timeout_s"),
    ("trainer.reward_timeout_s=-1", "trainer.reward_timeout_s"),
    ("trainer.max_restarts=-1", "trainer.max_restarts"),
    ("trainer.critic_warmup=-1", "trainer.critic_warmup"),
    ("trainer.log_val_generations=-1", "trainer.log_val_generations"),
    ("trainer.constant_reward_warn_steps=-1", "trainer.constant_reward_warn_steps"),
    ("trainer.cpus_per_worker=0", "trainer.cpus_per_worker"),
    ("reward_model.enable=true", "reward_model.model.path"),
    (f"{RM} reward_model.rollout.request_timeout_s=0", "reward_model.rollout.request_timeout_s"),
    (f"{RM} reward_model.micro_batch_size_per_gpu=0", "reward_model.micro_batch_size_per_gpu"),
    ("reward_model.sandbox_fusion.url=file:///etc/passwd", "reward_model.sandbox_fusion.url"),
    (
        "reward_model.sandbox_fusion.url=http://localhost:1/run_code reward_model.sandbox_fusion.max_concurrent=0",
        "reward_model.sandbox_fusion.max_concurrent",
    ),
]

LOADER_ROWS = [
    ("actor_rollout_ref.actor.optim.lr=abc", "actor_rollout_ref.actor.optim.lr"),
    ("data.shuffle=maybe", "data.shuffle"),
    ("trainer.no_such_key=1", "no_such_key"),
    ("actor_rollout_ref.rollout.temperature=-1", "actor_rollout_ref.rollout.temperature"),
    ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p"),
    ("actor_rollout_ref.rollout.response_length=-3", "actor_rollout_ref.rollout.response_length"),
    ("actor_rollout_ref.rollout.multi_turn.interaction_timeout_s=0", "multi_turn.interaction_timeout_s"),
    (
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nonexistent.yaml",
        "multi_turn.tool_config_path",
    ),
]


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    return compose_config([], tmp_path_factory.mktemp("base"))


def _put(config, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    obj = config
    for name in path:
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
    if isinstance(obj, dict):
        obj[last] = value
    else:
        assert hasattr(obj, last), f"no key {dotted} in the typed config"
        setattr(obj, last, value)


def _message(excinfo) -> str:
    return str(excinfo.value)


@pytest.mark.parametrize(("overrides", "key"), CONFIG_ROWS, ids=[r[0] for r in CONFIG_ROWS])
def test_a_bad_value_fails_the_config_stage_naming_the_key(base_config, overrides, key):
    config = copy.deepcopy(base_config)
    for item in overrides.split():
        name, value = item.split("=", 1)
        _put(config, name, yaml.safe_load(value))
    with pytest.raises((ConfigError, ValueError)) as err:
        run_config_stage(config)
    assert key in _message(err), _message(err)


@pytest.mark.parametrize(("overrides", "key"), LOADER_ROWS, ids=[r[0] for r in LOADER_ROWS])
def test_a_bad_value_fails_the_loader_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(Exception) as err:  # noqa: B017  (ConfigError; hydra's own for an unknown key)
        compose_config(overrides.split(), tmp_path)
    assert key in _message(err), _message(err)


# ---------------------------------------------------------------- input files (before Ray)
def _builtin():
    from hybridrl.data.builtin_task import ensure_builtin_data
    from hybridrl.models.builtin import get_builtin_model_path

    return ensure_builtin_data(None), get_builtin_model_path()


def _parquet(tmp_path, name, drop=None, rows=None, change=None) -> str:
    data, _ = _builtin()
    df = pd.read_parquet(data["train"]).head(rows or 64)
    if drop:
        df = df.drop(columns=[drop])
    if change:
        df[change[0]] = change[1]
    path = tmp_path / name
    df.to_parquet(path)
    return str(path)


def _model_copy(tmp_path, edit=None, drop=None) -> str:
    _, model = _builtin()
    dst = tmp_path / "model"
    shutil.copytree(model, dst)
    if drop:
        (dst / drop).unlink()
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(edit(cfg) if callable(edit) else edit)
    return str(dst)


def _small_vocab(cfg: dict) -> str:
    cfg["vocab_size"] = 8
    return json.dumps(cfg)


def _reward_py(tmp_path) -> str:
    path = tmp_path / "reward.py"
    path.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    return str(path)


def _mkdir(path) -> str:
    path.mkdir()
    return str(path)


def _text(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _bad_row(tmp_path, name, column, value, row=37) -> str:
    """The built-in task's rows with one bad value in the middle (all rows are checked before Ray)."""
    data, _ = _builtin()
    df = pd.read_parquet(data["train"]).head(64).reset_index(drop=True)
    values = list(df[column])
    values[row] = value
    df[column] = pd.Series(values, dtype=object)
    return _parquet_of(df, tmp_path / name)


def _parquet_of(df, path) -> str:
    df.to_parquet(path)
    return str(path)


def _with_agent_name(tmp_path, name: str) -> str:
    data, _ = _builtin()
    df = pd.read_parquet(data["train"]).head(64)
    return _parquet_of(df.assign(agent_name=name), tmp_path / "agent.parquet")


def _tool_yaml(tmp_path, entry) -> str:
    return _text(
        tmp_path / "tools.yaml", yaml.safe_dump({"tools": [entry]} if entry is not None else {"x": 1})
    )


SCHEMA = {
    "type": "function",
    "function": {"name": "calc", "description": "d", "parameters": {"type": "object"}},
}
MT = "actor_rollout_ref.rollout.multi_turn"
AGENT = "actor_rollout_ref.rollout.agent"

# name -> builds the bad file(s) in tmp_path and returns (overrides, the key the message must name)
FILE_ROWS = {
    "missing train file": lambda t: ([f"data.train_files={t}/missing.parquet"], "data.train_files"),
    "missing val file": lambda t: ([f"data.val_files={t}/missing.parquet"], "data.val_files"),
    "train file not parquet": lambda t: (
        [f"data.train_files={_text(t / 'a.csv', 'a,b')}"],
        "data.train_files",
    ),
    "train without prompt column": lambda t: (
        [f"data.train_files={_parquet(t, 't.parquet', drop='prompt')}"],
        "data.train_files",
    ),
    "val without prompt column": lambda t: (
        [f"data.val_files={_parquet(t, 'v.parquet', drop='prompt')}"],
        "data.val_files",
    ),
    "train prompts not chat lists": lambda t: (
        [f"data.train_files={_parquet(t, 's.parquet', change=('prompt', 7))}"],
        "data.train_files",
    ),
    "fewer rows than a batch": lambda t: (
        [f"data.train_files={_parquet(t, 'few.parquet', rows=2)}"],
        "data.train_batch_size",
    ),
    "missing model folder": lambda t: (
        [f"actor_rollout_ref.model.path={t}/nope"],
        "actor_rollout_ref.model.path",
    ),
    "model folder without config.json": lambda t: (
        [f"actor_rollout_ref.model.path={_model_copy(t, drop='config.json')}"],
        "actor_rollout_ref.model.path",
    ),
    "model config.json not JSON": lambda t: (
        [f"actor_rollout_ref.model.path={_model_copy(t, edit='{not json')}"],
        "actor_rollout_ref.model.path",
    ),
    "tokenizer larger than the model's vocab": lambda t: (
        [f"actor_rollout_ref.model.path={_model_copy(t, edit=_small_vocab)}"],
        "actor_rollout_ref.model.tokenizer_path",
    ),
    "tokenizer folder without a tokenizer": lambda t: (
        [f"actor_rollout_ref.model.tokenizer_path={_mkdir(t / 'empty')}"],
        "actor_rollout_ref.model",
    ),
    "missing reward file": lambda t: (
        [f"custom_reward_function.path={t}/nope.py"],
        "custom_reward_function.path",
    ),
    "reward function not in the file": lambda t: (
        [f"custom_reward_function.path={_reward_py(t)}", "custom_reward_function.name=nope"],
        "custom_reward_function.name",
    ),
    "unknown reward manager": lambda t: (
        ["reward_model.reward_manager=bogus"],
        "reward_model.reward_manager",
    ),
    "reward function with the wrong signature": lambda t: (
        [
            f"custom_reward_function.path={_text(t / 'sig.py', 'def compute_score(text):' + chr(10) + '    return 0.0' + chr(10))}"
        ],
        "custom_reward_function.name",
    ),
    # every row of the data files (not only the first) -----------------------------------------
    "empty prompt in the middle of the train file": lambda t: (
        [f"data.train_files={_bad_row(t, 'p.parquet', 'prompt', [])}"],
        "data.train_files",
    ),
    # (the val rows: data.val_max_samples=16 here, rows past it are not used, so not checked)
    "unknown data source in the middle of the val file": lambda t: (
        [f"data.val_files={_bad_row(t, 's.parquet', 'data_source', 'my/task', row=10)}"],
        "data.reward_fn_key",
    ),
    "no reward_model in a row of the val file": lambda t: (
        [f"data.val_files={_bad_row(t, 'g.parquet', 'reward_model', None, row=10)}"],
        "data.val_files",
    ),
    "train file without the data_source column": lambda t: (
        [f"data.train_files={_parquet(t, 'nods.parquet', drop='data_source')}"],
        "data.reward_fn_key",
    ),
    # plug-ins the rollout workers would load after Ray started ----------------------------------
    "tool class that does not import": lambda t: (
        [f"{MT}.tool_config_path={_tool_yaml(t, {'class_name': 'no_such_pkg.Tool', 'tool_schema': SCHEMA})}"],
        f"{MT}.tool_config_path",
    ),
    "tool class that is not a BaseTool": lambda t: (
        [
            f"{MT}.tool_config_path={_tool_yaml(t, {'class_name': 'collections.OrderedDict', 'tool_schema': SCHEMA})}"
        ],
        f"{MT}.tool_config_path",
    ),
    "tool schema that is not a function schema": lambda t: (
        [
            f"{MT}.tool_config_path="
            + _tool_yaml(
                t,
                {
                    "class_name": "hybridrl.agent.builtin_tools.Gsm8kTool",
                    "tool_schema": {"type": "function", "function": "calc"},
                },
            )
        ],
        f"{MT}.tool_config_path",
    ),
    "tool yaml without a tools list": lambda t: (
        [f"{MT}.tool_config_path={_tool_yaml(t, None)}"],
        f"{MT}.tool_config_path",
    ),
    "function tool file without tools": lambda t: (
        [f"{MT}.function_tool_path={_text(t / 'ft.py', 'x = 1' + chr(10))}"],
        f"{MT}.function_tool_path",
    ),
    "interaction class that does not import": lambda t: (
        [
            f"{MT}.interaction_config_path="
            + _text(
                t / "i.yaml",
                yaml.safe_dump({"interaction": [{"name": "u", "class_name": "no_such_pkg.User"}]}),
            )
        ],
        f"{MT}.interaction_config_path",
    ),
    "agent loop that is not an AgentLoopBase": lambda t: (
        [
            f"{AGENT}.agent_loop_config_path="
            + _text(
                t / "loops.yaml", yaml.safe_dump([{"name": "mine", "_target_": "collections.OrderedDict"}])
            )
        ],
        f"{AGENT}.agent_loop_config_path",
    ),
    "unknown default agent loop": lambda t: (
        [f"{AGENT}.default_agent_loop=nope_agent"],
        f"{AGENT}.default_agent_loop",
    ),
    "unknown agent_name in the data": lambda t: (
        [f"data.train_files={_with_agent_name(t, 'nope_agent')}"],
        "agent_name",
    ),
    "unregistered tool-call format": lambda t: (
        [f"{MT}.enable=true", f"{MT}.format=nope_format"],
        f"{MT}.format",
    ),
}


@pytest.mark.parametrize("case", list(FILE_ROWS))
def test_a_bad_input_file_fails_before_ray_naming_the_key(tmp_path, case):
    import ray

    from hybridrl.trainer.ppo.setup import prepare_run

    overrides, key = FILE_ROWS[case](tmp_path)
    started_before = ray.is_initialized()
    with pytest.raises(Exception) as err:  # noqa: B017  (the type varies; the message is checked)
        prepare_run(compose_config(overrides, tmp_path))  # the config stage checks paths, the rest here
    assert key in _message(err), f"{type(err.value).__name__}: {_message(err)}"
    assert ray.is_initialized() == started_before
