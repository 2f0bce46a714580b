"""Rollout config, registry and the shared output contract (no model needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.protocol import DataProto
from hybridrl.rollout import (
    BaseRollout,
    GenerationResult,
    RolloutConfig,
    build_rollout_output,
    derive_seed,
    get_rollout_class,
    list_rollouts,
    register_rollout,
    resolve_sampling,
)
from hybridrl.rollout.base import truncate_at_eos


# ---- config -------------------------------------------------------------------------------------
def test_config_defaults_follow_verl():
    cfg = RolloutConfig()
    assert (cfg.name, cfg.mode, cfg.temperature, cfg.top_k, cfg.top_p, cfg.n) == (
        "vllm",
        "sync",
        1.0,
        -1,
        1.0,
        1,
    )
    assert (cfg.do_sample, cfg.ignore_eos, cfg.enforce_eager, cfg.free_cache_engine) == (
        True,
        False,
        True,
        True,
    )
    assert (cfg.val_kwargs.temperature, cfg.val_kwargs.do_sample, cfg.val_kwargs.top_k) == (0.0, False, -1)
    assert cfg.engine_kwargs.vllm == {} and cfg.engine_kwargs.sglang == {}
    assert cfg.is_dummy_load and cfg.effective_max_model_len == cfg.prompt_length + cfg.response_length


def test_config_is_an_omegaconf_structured_config():
    base = OmegaConf.structured(RolloutConfig)
    merged = OmegaConf.merge(
        base,
        OmegaConf.create(
            {"name": "hf", "val_kwargs": {"temperature": 0.5}, "engine_kwargs": {"vllm": {"swap_space": 1}}}
        ),
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, RolloutConfig)
    assert (
        cfg.name == "hf" and cfg.val_kwargs.temperature == 0.5 and cfg.engine_kwargs.vllm == {"swap_space": 1}
    )
    with pytest.raises(Exception, match="not_a_key"):
        OmegaConf.merge(base, OmegaConf.create({"not_a_key": 1}))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": -1.0}, "rollout.temperature"),
        ({"top_p": 0.0}, "rollout.top_p"),
        ({"load_format": "bogus"}, "rollout.load_format"),
        ({"max_model_len": 10, "prompt_length": 8, "response_length": 8}, "rollout.max_model_len"),
        ({"val_kwargs": {"top_p": 2.0}}, "rollout.val_kwargs.top_p"),
        ({"dtype": "int8"}, "rollout.dtype"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        RolloutConfig(**kwargs)


def test_config_accepts_plain_dicts_for_sections():
    cfg = RolloutConfig(val_kwargs={"temperature": 0.3, "do_sample": True}, engine_kwargs={"vllm": {"a": 1}})
    assert cfg.val_kwargs.temperature == 0.3 and cfg.engine_kwargs.vllm == {"a": 1}


# ---- sampling and seeds -------------------------------------------------------------------------
def test_resolve_sampling():
    cfg = RolloutConfig(temperature=0.7, top_k=0, top_p=0.9, val_kwargs={"temperature": 0.0, "top_k": 5})
    train, val = resolve_sampling(cfg, validate=False), resolve_sampling(cfg, validate=True)
    assert (train.greedy, train.temperature, train.top_k, train.top_p) == (False, 0.7, -1, 0.9)
    assert val.greedy and val.temperature == 1.0
    assert resolve_sampling(RolloutConfig(do_sample=False, temperature=0.7), False).greedy
    assert resolve_sampling(RolloutConfig(temperature=0.0), False).greedy
    forced = resolve_sampling(RolloutConfig(temperature=0.7), False, force_greedy=True)
    assert forced.greedy and forced.temperature == 1.0
    sampled_val = resolve_sampling(
        RolloutConfig(val_kwargs={"do_sample": True, "temperature": 0.6, "top_k": 5}), True
    )
    assert (sampled_val.greedy, sampled_val.temperature, sampled_val.top_k) == (False, 0.6, 5)


def test_derive_seed_is_deterministic_and_distinct():
    seeds = {derive_seed(s, c, r, d) for s in (0, 1) for c in range(3) for r in range(50) for d in (0, 1)}
    assert len(seeds) == 600  # no two (seed, call, row, rank) share a seed
    assert derive_seed(7, 2, 3) == derive_seed(7, 2, 3)
    assert all(0 <= s < 2**31 for s in seeds)


# ---- output assembly ----------------------------------------------------------------------------
def _prompts():
    # row 0: 3 real tokens; row 1: 1 real token, left-padded with pad id 0
    return DataProto.from_dict(
        {
            "input_ids": torch.tensor([[5, 6, 7], [0, 0, 9]]),
            "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 1]]),
            "position_ids": torch.tensor([[0, 1, 2], [0, 0, 0]]),
        },
        {"uid": ["a", "b"]},
        {"validate": False},
    )


def test_build_rollout_output_hand_checked():
    # T=4; row 0 stops with EOS (id 1) after 2 tokens, row 1 runs out of budget.
    result = GenerationResult(
        token_ids=[[11, 1], [12, 13, 14, 15]], log_probs=[[-0.5, -0.25], [-1.0, -2.0, -3.0, -4.0]]
    )
    out = build_rollout_output(_prompts(), result, pad_token_id=0, response_length=4, metrics={"m": 1})
    b = out.batch
    assert b["prompts"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert b["responses"].tolist() == [[11, 1, 0, 0], [12, 13, 14, 15]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["input_ids"].tolist() == [[5, 6, 7, 11, 1, 0, 0], [0, 0, 9, 12, 13, 14, 15]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]
    assert b["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0, -2.0, -3.0, -4.0]]
    assert list(out.non_tensor_batch["uid"]) == ["a", "b"]
    assert out.meta_info["validate"] is False and out.meta_info["metrics"] == {"m": 1}


def test_build_rollout_output_rejects_overlong_and_mismatched():
    with pytest.raises(ValueError, match="more than response_length"):
        build_rollout_output(_prompts(), GenerationResult([[1, 2, 3], [4]]), 0, 2)
    with pytest.raises(ValueError, match="2 prompts"):
        build_rollout_output(_prompts(), GenerationResult([[1]]), 0, 2)
    with pytest.raises(ValueError, match="log-probs"):
        build_rollout_output(_prompts(), GenerationResult([[1], [2]], [[0.0, 0.0], [0.0]]), 0, 2)


def test_truncate_at_eos():
    assert truncate_at_eos([4, 5, 1, 6, 1], [1]) == [4, 5, 1]
    assert truncate_at_eos([4, 5, 6], [1, 2]) == [4, 5, 6]
    assert truncate_at_eos([2, 1], [1, 2]) == [2]


# ---- registry and the generate_sequences plumbing -----------------------------------------------
class _Tok:
    pad_token_id = 0
    eos_token_id = 1


class _CountingRollout(BaseRollout):
    """A real (trivial) engine: answers row r with r+1 copies of its last prompt token, then EOS."""

    def _generate(self, request):
        toks = [[p[-1]] * (r + 1) + [1] for r, p in enumerate(request.prompt_token_ids)]
        toks = [t[: request.max_new_tokens] for t in toks]
        lps = [[-0.1] * len(t) for t in toks] if request.want_log_probs else None
        return GenerationResult(toks, lps)

    def update_weights(self, named_tensors):
        self.updated = [n for n, _ in named_tensors]


def test_register_and_generate_through_the_base_contract():
    register_rollout("counting-test")(_CountingRollout)
    assert "counting-test" in list_rollouts()
    cfg = RolloutConfig(name="counting-test", response_length=3, prompt_length=3, calculate_log_probs=True)
    rollout = get_rollout_class("counting-test")(cfg, None, _Tok())
    out = rollout.generate_sequences(_prompts())
    assert out.batch["responses"].tolist() == [[7, 1, 0], [9, 9, 1]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out.batch["rollout_log_probs"][0].tolist() == pytest.approx([-0.1, -0.1, 0.0])
    assert out.meta_info["metrics"]["rollout/num_response_tokens"] == 5
    assert rollout.num_generate_calls == 1


def test_generate_rejects_right_padding_and_overlong_prompts():
    cfg = RolloutConfig(name="counting-test", response_length=3, prompt_length=3)
    register_rollout("counting-test")(_CountingRollout)
    rollout = _CountingRollout(cfg, None, _Tok())
    right = _prompts()
    right.batch["attention_mask"] = torch.tensor([[1, 1, 1], [1, 0, 0]])
    with pytest.raises(ValueError, match="LEFT-padded"):
        rollout.generate_sequences(right)
    short = _CountingRollout(RolloutConfig(response_length=3, prompt_length=2), None, _Tok())
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate_sequences(_prompts())


def test_unknown_rollout_name_lists_known_engines():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.name='nope'.*'hf'.*'sglang'.*'vllm'"):
        get_rollout_class("nope")


def test_register_rejects_name_clash_and_non_rollouts():
    with pytest.raises(ValueError, match="already registered"):
        register_rollout("hf")(_CountingRollout)
    with pytest.raises(TypeError):
        register_rollout("x")(dict)


@pytest.mark.parametrize("name", ["hf", "vllm", "sglang"])
def test_every_builtin_engine_resolves_to_a_rollout_class(name):
    cls = get_rollout_class(name)
    assert issubclass(cls, BaseRollout) and cls.name == name


def test_importing_engines_does_not_import_vllm_or_sglang():
    code = (
        "import sys, hybridrl, hybridrl.rollout as r;"
        "[r.get_rollout_class(n) for n in ('vllm', 'sglang')];"
        "bad = [m for m in ('vllm', 'sglang') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
