"""reward_model.reward_kwargs (veRL's reward-manager kwargs) and the reward loop's keys at start-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module

from hybridrl.models.tokenizer_builder import build_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.config import ConfigError
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv
from hybridrl.trainer.ppo.setup import build_reward_fns
from hybridrl.utils.config_loader import WARNED


def _check(overrides):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    return check_startup(cfg, explicit_keys={override_key(o) for o in overrides})


@pytest.fixture(autouse=True)
def _fresh_warnings():
    WARNED.clear()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def batch_of(tok, answers: list[str], t: int = 8) -> DataProto:
    rows = [tok(a, add_special_tokens=False)["input_ids"][:t] for a in answers]
    responses = torch.full((len(rows), t), tok.pad_token_id)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        responses[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        non_tensors={
            "data_source": np.array(["openai/gsm8k"] * len(rows), dtype=object),
            "reward_model": np.array([{"ground_truth": "7"}] * len(rows), dtype=object),
        },
    )


DAPO = ["reward_model.reward_manager=dapo", "data.max_response_length=8"]
OVERLONG = [
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
    "+reward_model.reward_kwargs.max_resp_len=8",
]


def test_reward_kwargs_are_the_dapo_managers_overlong_penalty(tok):
    data = batch_of(tok, ["#### 7", "x = 1+6 #### 7"])  # 6 and 8 (full) response tokens
    plain = build_reward_fns(_check(DAPO), tok)[0](data).sum(-1)
    shaped = build_reward_fns(_check(DAPO + OVERLONG), tok)[0](data).sum(-1)
    # expected length 8 - 4 = 4: 6 tokens -> -0.5, 8 tokens -> -1.0 (penalty factor 1)
    torch.testing.assert_close(shaped, plain - torch.tensor([0.5, 1.0]))


def test_both_spellings_of_the_overlong_buffer_must_agree():
    same = _check(DAPO + OVERLONG + ["reward_manager_kwargs.overlong_buffer.len=4"])
    assert same.reward_manager_kwargs.overlong_buffer.len == 4
    with pytest.raises(
        ConfigError,
        match="overlong_buffer_cfg.len=4 and reward_manager_kwargs.overlong_buffer.len=2 disagree",
    ):
        _check(DAPO + OVERLONG + ["reward_manager_kwargs.overlong_buffer.len=2"])
    with pytest.raises(ConfigError, match="option of reward_manager=dapo"):
        _check(OVERLONG)  # naive has no overlong buffer


def test_other_reward_kwargs_go_to_the_score_function(tok, tmp_path):
    f = tmp_path / "score.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n    return bonus\n"
    )
    fn = [f"custom_reward_function.path={f}"]
    data = batch_of(tok, ["abc"])
    assert build_reward_fns(_check(fn + ["+reward_model.reward_kwargs.bonus=0.5"]), tok)[0](data).sum() == 0.5
    agree = fn + ["+reward_model.reward_kwargs.bonus=0.5", "+custom_reward_function.reward_kwargs.bonus=0.5"]
    assert build_reward_fns(_check(agree), tok)[0](data).sum() == 0.5
    with pytest.raises(ConfigError, match="custom_reward_function.reward_kwargs.bonus=0.25 disagree"):
        _check(
            fn + ["+reward_model.reward_kwargs.bonus=0.5", "+custom_reward_function.reward_kwargs.bonus=0.25"]
        )


RM = ["reward_model.enable=True", "reward_model.model.path=builtin:tiny", "reward_model.use_reward_loop=True"]


def test_reward_loop_keys_start_up_checks(tmp_path, capsys):
    c = _check(
        RM
        + [
            "reward_model.num_workers=8",
            "reward_model.rollout.name=vllm",
            "reward_model.rollout.prompt_length=16",
        ]
    )
    assert (c.reward_model.num_workers, c.reward_model.rollout.effective_max_model_len) == (8, 16 + 2048)
    with pytest.raises(ConfigError, match="sglang/trtllm reward serving"):
        _check(RM + ["reward_model.rollout.name=sglang"])
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 must divide the 1 slots"):
        _check(RM + ["reward_model.rollout.tensor_model_parallel_size=2"])
    f = tmp_path / "r.py"
    f.write_text("def compute_score(**kw):\n    return 0.0\n")
    genrm = _check(
        RM + [f"custom_reward_function.path={f}"]
    )  # a generative reward model (tests/reward/test_genrm.py)
    assert genrm.reward_model.rollout.request_timeout_s == 300.0
    _check(["reward_model.num_workers=4"])
    assert "only act with reward_model.use_reward_loop=True" in capsys.readouterr().err


def test_reward_manager_section_is_the_same_setting_as_reward_model_reward_manager(tok, tmp_path):
    c = _check(["reward_manager.name=dapo"])
    assert (c.reward_model.reward_manager, c.reward_manager.name) == ("dapo", "dapo")
    assert _check(["reward_model.reward_manager=prime"]).reward_manager.name == "prime"
    with pytest.raises(
        ConfigError, match="reward_manager.name='dapo' and reward_model.reward_manager='prime'"
    ):
        _check(["reward_manager.name=dapo", "reward_model.reward_manager=prime"])
    f = tmp_path / "mgr.py"
    f.write_text(
        "from hybridrl.reward.manager import NaiveRewardManager\n\n"
        "class Doubled(NaiveRewardManager):\n"
        "    def shape_rewards(self, samples, scores):\n"
        "        return [2 * s for s in scores], [{} for _ in samples]\n"
    )
    data = batch_of(tok, ["#### 7", "#### 3"])
    plain = build_reward_fns(_check([]), tok)[0](data).sum(-1)
    imported = [
        "reward_manager.source=importlib",
        f"reward_manager.module.path={f}",
        "reward_manager.module.name=Doubled",
    ]
    doubled = build_reward_fns(_check(imported), tok)[0](data).sum(-1)
    torch.testing.assert_close(doubled, 2 * plain)
    assert plain[0] > 0
    with pytest.raises(ConfigError, match="module.path"):
        _check(["reward_manager.source=importlib"])


def test_colocated_vllm_engines_must_fit_one_gpu_together():
    from hybridrl.trainer.ppo.workers import start_reward_loop

    c = _check(RM + ["reward_model.rollout.name=vllm", "actor_rollout_ref.rollout.name=vllm"])
    c.trainer.device = "cuda"  # a GPU run (checked when the loop starts, before anything is built)
    c.actor_rollout_ref.rollout.gpu_memory_utilization, c.reward_model.rollout.gpu_memory_utilization = (
        0.6,
        0.8,
    )
    with pytest.raises(ValueError, match="= 1.40 > 1 on the same GPUs"):
        start_reward_loop(c, reward_fn=None)
