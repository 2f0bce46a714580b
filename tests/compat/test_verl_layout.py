"""veRL's newest config layout: moved keys drive the same typed settings as the old spellings,
keys without a field are accepted at veRL's value or refused naming the key."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from hybridrl.compat.verl_layout import apply_verl_layout
from hybridrl.compat.verl_layout_refusals import ANY, LEAVES, SECTIONS
from hybridrl.trainer.ppo.config import ConfigError, PPOConfig
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv

ARR = "actor_rollout_ref"


def _check(overrides, explicit=True):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    keys = {override_key(o) for o in overrides} if explicit else None
    return check_startup(cfg, explicit_keys=keys)


def _reward(c):
    return (
        dataclasses.asdict(c.reward_model),
        dataclasses.asdict(c.custom_reward_function),
        dataclasses.asdict(c.reward_manager),
    )


@pytest.fixture
def score_file(tmp_path):
    f = tmp_path / "score.py"
    f.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    return str(f)


def _old_and_new(score_file, rm_path):
    old = [
        "reward_model.use_reward_loop=True",
        "reward_model.enable=True",
        f"reward_model.model.path={rm_path}",
        "reward_model.rollout.name=hf",
        "reward_model.rollout.tensor_model_parallel_size=1",
        "reward_model.rollout.prompt_length=64",
        "reward_model.rollout.response_length=32",
        "reward_model.num_workers=2",
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.max_resp_len=16",
    ]
    new = [
        "reward.reward_model.enable=True",
        f"reward.reward_model.model_path={rm_path}",
        "reward.reward_model.rollout.name=hf",
        "reward.reward_model.rollout.tensor_model_parallel_size=1",
        "reward.reward_model.rollout.prompt_length=64",
        "reward.reward_model.rollout.response_length=32",
        "reward.num_workers=2",
        "reward.reward_manager.name=dapo",
        "reward.reward_kwargs.max_resp_len=16",
    ]
    return old, new


@pytest.mark.parametrize("explicit", [True, False])
def test_new_reward_section_gives_the_same_reward_config_as_the_old_keys(score_file, tmp_path, explicit):
    old, new = _old_and_new(score_file, str(tmp_path))
    a, b = _check(old, explicit), _check(new, explicit)
    assert _reward(a) == _reward(b)
    assert b.reward_model.use_reward_loop and b.reward_model.enable  # veRL's reward loop serves the RM
    assert b.reward_model.model.path == str(tmp_path) and b.reward_model.num_workers == 2
    assert b.reward_model.reward_manager == b.reward_manager.name == "dapo"
    assert _reward(b) != _reward(_check([]))
    crf_old = [f"custom_reward_function.path={score_file}", "custom_reward_function.name=my_score"]
    crf_new = [
        f"reward.custom_reward_function.path={score_file}",
        "reward.custom_reward_function.name=my_score",
    ]
    a, b = _check(crf_old, explicit), _check(crf_new, explicit)
    assert _reward(a) == _reward(b) and b.custom_reward_function.name == "my_score"


def test_new_reward_manager_and_sandbox_keys_land_on_the_old_ones():
    c = _check(["reward.reward_manager.name=prime", "reward.sandbox_fusion.url=http://sandbox:8080/run_code"])
    assert c.reward_model.reward_manager == "prime"
    assert c.reward_model.sandbox_fusion.url == "http://sandbox:8080/run_code"
    assert not c.reward_model.use_reward_loop  # rule scores only: no reward-loop key given
    c = _check(["sandbox_fusion.max_concurrent=8"])  # the newest veRL's legacy top-level spelling
    assert c.reward_model.sandbox_fusion.max_concurrent == 8


@pytest.mark.parametrize("explicit", [True, False])
def test_both_spellings_differing_is_an_error_naming_both(explicit):
    with pytest.raises(ConfigError, match=r"reward.num_workers=3.*reward_model.num_workers=2.*disagree"):
        _check(["reward.num_workers=3", "reward_model.num_workers=2"], explicit)
    c = _check(
        ["reward.num_workers=2", "reward_model.num_workers=2", "reward_model.use_reward_loop=True"], explicit
    )
    assert c.reward_model.num_workers == 2


def test_moved_engine_keys_set_the_role_keys():
    c = _check(
        [
            f"{ARR}.actor.fsdp_config.entropy_from_logits_with_chunking=True",
            f"{ARR}.actor.fsdp_config.entropy_checkpointing=True",
            f"{ARR}.ref.fsdp_config.entropy_from_logits_with_chunking=True",
            "critic.fsdp.param_offload=True",
            "critic.fsdp.mixed_precision.param_dtype=fp32",
            f"{ARR}.actor.fsdp_config.use_orig_params=True",
        ]
    )
    a = c.actor_rollout_ref
    assert a.actor.entropy_from_logits_with_chunking and a.actor.entropy_checkpointing
    assert a.ref.entropy_from_logits_with_chunking
    assert c.critic.model.fsdp_config.param_offload
    assert c.critic.model.fsdp_config.mixed_precision.param_dtype == "fp32"
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2.*disagree"):
        _check(
            [
                f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                f"{ARR}.actor.ulysses_sequence_parallel_size=1",
            ]
        )


def test_min_lr_becomes_the_same_floor_as_min_lr_ratio():
    c = _check([f"{ARR}.actor.optim.lr=1e-5", f"{ARR}.actor.optim.min_lr=1e-6"])
    assert c.actor_rollout_ref.actor.optim.min_lr_ratio == pytest.approx(0.1)
    _check(
        [
            f"{ARR}.actor.optim.lr=1e-5",
            f"{ARR}.actor.optim.min_lr=1e-6",
            f"{ARR}.actor.optim.min_lr_ratio=0.1",
        ]
    )
    with pytest.raises(ConfigError, match="min_lr=.*min_lr_ratio=0.5 disagree"):
        _check(
            [
                f"{ARR}.actor.optim.lr=1e-5",
                f"{ARR}.actor.optim.min_lr=1e-6",
                f"{ARR}.actor.optim.min_lr_ratio=0.5",
            ]
        )


# veRL layout keys: (a value hybridrl takes, a value it refuses)
LISTED = [
    (f"{ARR}.actor.fsdp_config.use_orig_params", "False", None),
    (f"{ARR}.actor.optim.optimizer", "AdamW", "SGD"),
    (f"{ARR}.actor.checkpoint.strict", "True", "False"),
    (f"{ARR}.actor.megatron.vanilla_mbridge", "True", None),
    (f"{ARR}.actor.megatron.use_megatron_fsdp", "False", "True"),
    (f"{ARR}.rollout.skip_tokenizer_init", "True", "False"),
    (f"{ARR}.rollout.prometheus.enable", "False", "True"),
    (f"{ARR}.rollout.profiler.relocate_results", "True", None),  # rollout.profiler.enable: a real key now
    ("critic.model.mtp.enable", "False", "True"),  # the actor's model.mtp is a real key (docs/megatron.md)
    ("critic.model.lora.rank", "0", "8"),  # the actor's model.lora.* is the Megatron LoRA (docs/megatron.md)
    (f"{ARR}.model.lora.dropout", "0.0", "0.1"),
    (f"{ARR}.model.lora.type", "lora", "dora"),
    ("data.audio_key", "audios", "sounds"),
]


@pytest.mark.parametrize("key,ok,bad", LISTED, ids=[k for k, _, _ in LISTED])
def test_listed_keys_are_taken_at_their_value_or_refused_naming_the_key(key, ok, bad):
    if ok is not None:
        node = _layout([f"{key}={ok}"])
        assert OmegaConf.select(node, key, default="gone") == "gone"
    if bad is not None:
        with pytest.raises(
            ConfigError, match=f"{key.rsplit('.', 1)[0]}.*is a veRL key hybridrl does not implement"
        ):
            _layout([f"{key}={bad}"])


def test_listed_keys_at_their_values_pass_the_whole_config_stage():
    _check([f"{k}={ok}" for k, ok, _ in LISTED if ok is not None])


def _layout(dotlist):
    node = OmegaConf.from_dotlist(dotlist)
    apply_verl_layout(node, None, OmegaConf.structured(PPOConfig))
    return node


@pytest.mark.parametrize("leaf", LEAVES, ids=[leaf.key for leaf in LEAVES])
def test_every_accepted_leaf_is_dropped_at_its_value_and_refused_at_another(leaf):
    value = "anything" if leaf.ok is ANY else leaf.ok[0]
    node = OmegaConf.create({})
    OmegaConf.update(node, leaf.key, value, force_add=True)
    apply_verl_layout(node, None, OmegaConf.structured(PPOConfig))
    assert OmegaConf.select(node, leaf.key, default="gone") == "gone"
    if leaf.ok is not ANY:
        with pytest.raises(ConfigError, match=leaf.key.replace(".", r"\.")):
            _layout([f"{leaf.key}=__not_a_veRL_value__"])


@pytest.mark.parametrize("section", SECTIONS, ids=[s.prefix for s in SECTIONS])
def test_every_section_is_dropped_when_off_and_refused_when_on(section):
    node = _layout([f"{section.prefix}.some_key=1"])
    assert OmegaConf.select(node, section.prefix, default="gone") == "gone"
    if section.switch is not None:
        with pytest.raises(ConfigError, match=f"{section.prefix}.{section.switch}".replace(".", r"\.")):
            _layout([f"{section.prefix}.{section.switch}=__on__"])


def test_command_line_check_lets_the_newest_layout_through():
    """`python -m hybridrl.trainer.main_ppo reward.reward_manager.name=naive ...` reaches the config
    stage (the unknown-key check before compose asks verl_layout), while a typo still fails."""
    from hybridrl.compat.verl_layout import layout_knows
    from hybridrl.trainer.ppo.config import PPOConfig
    from hybridrl.utils.config_loader import check_override_keys

    ok = [
        "++reward.reward_manager.name=naive",
        "reward.num_workers=2",
        "reward.reward_model.rollout.name=hf",
        "critic.fsdp.param_offload=true",
        f"{ARR}.actor.fsdp_config.use_orig_params=False",
        f"{ARR}.model.mtp.enable=False",
    ]
    check_override_keys(ok, PPOConfig, "ppo_trainer.yaml", layout_knows)
    for bad in ("reward.reward_manger.name=naive", f"{ARR}.actor.fsdp_config.use_orig_param=False"):
        with pytest.raises(ConfigError, match="unknown config key"):
            check_override_keys([bad], PPOConfig, "ppo_trainer.yaml", layout_knows)


def test_megatron_lr_decay_style_is_the_schedule():
    """veRL's Megatron optimizer names the schedule `lr_decay_style` (Megatron's values)."""
    for style in ("constant", "cosine", "linear", "inverse_square_root"):
        c = _check([f"{ARR}.actor.strategy=megatron", f"{ARR}.actor.optim.lr_decay_style={style}"])
        assert c.actor_rollout_ref.actor.optim.scheduler_type == style
    c = _check(["critic.optim.lr_decay_style=linear"])
    assert c.critic.optim.scheduler_type == "linear"
    with pytest.raises(ConfigError, match="lr_decay_style.*lr_scheduler_type"):
        _check([f"{ARR}.actor.optim.lr_decay_style=linear", f"{ARR}.actor.optim.lr_scheduler_type=cosine"])
    with pytest.raises((ConfigError, ValueError), match="polynomial"):
        _check([f"{ARR}.actor.optim.lr_decay_style=polynomial"])
