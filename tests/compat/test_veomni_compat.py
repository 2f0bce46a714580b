"""`model_engine=veomni` and `*.veomni.*` (veRL's VeOmni engine) on hybridrl's FSDP2 engine: each
translation lands on the FSDP field doing the same, each refusal names its key."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module

from hybridrl.compat.veomni import ACCEPTED
from hybridrl.compat.verl_layout import layout_knows
from hybridrl.trainer.ppo.config import ConfigError
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv

ARR = "actor_rollout_ref"
A, R = f"{ARR}.actor", f"{ARR}.ref"


def _check(overrides, explicit=True):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_trainer",
            overrides=prepare_argv(
                ["x", "trainer.n_gpus_per_node=2", f"{ARR}.model.use_remove_padding=True", *overrides]
            )[1:],
        )
    keys = {override_key(o) for o in overrides} if explicit else None
    return check_startup(cfg, explicit_keys=keys)


def _get(config, key):
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


# (veomni key, value, hybridrl field it lands on)
TRANSLATIONS = [
    (f"{A}.veomni.param_offload", True, f"{A}.fsdp_config.param_offload"),
    (f"{A}.veomni.optimizer_offload", True, f"{A}.fsdp_config.optimizer_offload"),
    (f"{A}.veomni.fsdp_size", 1, f"{A}.fsdp_config.fsdp_size"),
    (f"{A}.veomni.forward_prefetch", True, f"{A}.fsdp_config.forward_prefetch"),
    (f"{A}.veomni.ulysses_parallel_size", 2, f"{A}.ulysses_sequence_parallel_size"),
    (f"{A}.veomni.use_torch_compile", True, f"{A}.use_torch_compile"),
    (f"{A}.veomni.entropy_from_logits_with_chunking", True, f"{A}.entropy_from_logits_with_chunking"),
    (f"{A}.veomni.entropy_checkpointing", True, f"{A}.entropy_checkpointing"),
    (f"{R}.veomni.param_offload", True, f"{R}.fsdp_config.param_offload"),
    (f"{R}.veomni.ulysses_parallel_size", 2, f"{R}.ulysses_sequence_parallel_size"),
    ("critic.veomni.param_offload", True, "critic.model.fsdp_config.param_offload"),
    ("critic.veomni.optimizer_offload", True, "critic.model.fsdp_config.optimizer_offload"),
    ("critic.veomni.fsdp_size", 1, "critic.model.fsdp_config.fsdp_size"),
    ("critic.veomni.ulysses_parallel_size", 2, "critic.ulysses_sequence_parallel_size"),
]


@pytest.mark.parametrize("explicit", [True, False])
def test_each_translation_lands_on_the_fsdp_field(explicit):
    """All translations in one config (the composes are the slow part): each lands on its field."""
    base = _check([])
    for _, value, field in TRANSLATIONS:
        assert _get(base, field) != value  # the test can tell the translation from the default
    config = _check(["model_engine=veomni", *(f"{k}={v}" for k, v, _ in TRANSLATIONS)], explicit)
    for key, value, field in TRANSLATIONS:
        assert _get(config, field) == value, key
    assert config.actor_rollout_ref.actor.strategy == "fsdp"
    assert config.critic.strategy == "fsdp"


# (veomni key under the actor, a refused value, a word of the reason)
REFUSALS = [
    ("expert_parallel_size", 8, "expert parallelism"),
    ("mixed_precision", False, "mixed_precision"),
    ("enable_full_shard", False, "ZeRO-3"),
    ("attn_implementation", "flash_attention_3", "attn_implementation"),
    ("moe_implementation", "fused_triton", "MoE"),
    ("cross_entropy_loss_implementation", "liger_kernel", "kernel"),
    ("rms_norm_implementation", "triton", "kernel"),
    ("router_replay.mode", "R2", "routing replay"),
    ("activation_gpu_limit", 0.5, "offloading"),
    ("load_checkpoint_path", "/x", "resume"),
    ("seed", 7, "trainer.seed"),  # through the FSDP spelling's own refusal
]


@pytest.mark.parametrize(("name", "bad", "why"), REFUSALS)
def test_each_refusal_names_its_key(name, bad, why):
    with pytest.raises(ConfigError, match=rf"{A}\.(veomni|fsdp_config)\.{name}") as e:
        _check(["model_engine=veomni", f"{A}.veomni.{name}={bad}"])
    assert why in str(e.value)


def test_defaults_of_veomni_yaml_are_accepted():
    """veRL's engine/veomni.yaml defaults (as the scripts spell them) all pass."""
    defaults = {
        "expert_parallel_size": 1,
        "mixed_precision": True,
        "init_device": "meta",
        "enable_full_shard": True,
        "ckpt_manager": "dcp",
        "attn_implementation": "flash_attention_2",
        "moe_implementation": "fused",
        "cross_entropy_loss_implementation": "eager",
        "router_replay.mode": "disabled",
        "seed": 42,
        "strategy": "veomni",
    }
    config = _check(["model_engine=veomni", *(f"{A}.veomni.{k}={v}" for k, v in defaults.items())])
    assert config.actor_rollout_ref.actor.strategy == "fsdp"
    assert set(defaults) <= set(ACCEPTED) | {"seed"}


def test_veomni_key_without_model_engine_veomni_is_refused():
    with pytest.raises(ConfigError, match=rf"{A}\.veomni\.param_offload.*model_engine=veomni"):
        _check([f"{A}.veomni.param_offload=True"])


def test_role_strategy_veomni_enables_its_keys_and_runs_fsdp():
    config = _check([f"{R}.strategy=veomni", f"{R}.veomni.param_offload=True"])
    assert config.actor_rollout_ref.ref.strategy == "fsdp"
    assert config.actor_rollout_ref.ref.fsdp_config.param_offload is True


def test_unknown_veomni_key_and_disagreement_are_refused():
    with pytest.raises(ConfigError, match=rf"{A}\.veomni\.no_such_key"):
        _check(["model_engine=veomni", f"{A}.veomni.no_such_key=1"])
    with pytest.raises(ConfigError, match=r"veomni\.param_offload.*fsdp_config\.param_offload.*disagree"):
        _check(
            ["model_engine=veomni", f"{A}.veomni.param_offload=True", f"{A}.fsdp_config.param_offload=False"]
        )


def test_model_engine_veomni_equals_the_fsdp_spelling_and_prints_once(capsys):
    optim = [
        f"{o}.optim.{k}={v}"
        for o in (A, "critic")
        for k, v in (("lr", 1e-3), ("lr_scheduler_type", "cosine"))
    ]
    veomni = _check(
        ["model_engine=veomni", f"{A}.veomni.param_offload=True", f"{A}.veomni.ulysses_parallel_size=2"]
    )
    out = capsys.readouterr().out
    assert out.count("VeOmni is veRL's FSDP2-based engine") == 1
    assert "ulysses_parallel_size" in out
    fsdp = _check(
        [
            "model_engine=dp",
            f"{A}.fsdp_config.param_offload=True",
            f"{A}.ulysses_sequence_parallel_size=2",
            *optim,
        ]
    )
    assert dataclasses.asdict(veomni) == dataclasses.asdict(fsdp)


def test_veomni_optimizer_defaults_and_keys():
    """veRL's optim/veomni.yaml: cosine decay (and lr 1e-3) unless set; lr_min is the floor; lr_start
    and lr_decay_ratio only at their defaults."""
    config = _check(["model_engine=veomni"])
    assert config.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert config.actor_rollout_ref.actor.optim.lr == 1e-3
    assert config.critic.optim.lr_scheduler_type == "cosine"
    config = _check(
        [
            "model_engine=veomni",
            f"{A}.optim.lr=1e-6",
            f"{A}.optim.lr_scheduler_type=constant",
            f"{A}.optim.lr_min=1e-7",
        ]
    )
    optim = config.actor_rollout_ref.actor.optim
    assert (optim.lr, optim.lr_scheduler_type) == (1e-6, "constant")
    assert abs(optim.min_lr_ratio - 0.1) < 1e-9
    assert _check([]).actor_rollout_ref.actor.optim.lr_scheduler_type == "constant"  # FSDP: unchanged
    with pytest.raises(ConfigError, match=rf"{A}\.optim\.lr_start=0\.1.*warmup"):
        _check(["model_engine=veomni", f"{A}.optim.lr_start=0.1"])


def test_command_line_check_knows_the_veomni_keys():
    assert layout_knows(f"{A}.veomni.param_offload")
    assert layout_knows("critic.veomni.router_replay.mode")
    assert not layout_knows(f"{A}.veomnix.param_offload")


_NOT_COMPARED = ("timing_s/", "perf/", "timing_per_token_ms/")
_TIMES = ("_per_s", "seconds", "_s/")  # wall-clock quantities differ between any two runs


def _compared(rows: list[dict]) -> list[dict]:
    return [
        {
            k: v
            for k, v in r.items()
            if not k.startswith(_NOT_COMPARED)
            and not any(t in k for t in _TIMES)
            and isinstance(v, (int, float))
        }
        for r in rows
        if "actor/pg_loss" in r
    ]


def test_a_main_ppo_step_with_model_engine_veomni_equals_the_fsdp_spelling(tmp_path):
    """One GRPO step on the built-in tiny model (in-process backend, FSDP2, HF rollout), spelled
    with veRL's VeOmni keys and with the FSDP keys: the same metrics."""
    import math

    from tests.e2e.ppo_runs import run

    common = [
        "trainer.backend=local",
        "trainer.total_training_steps=1",
        f"{R}.log_prob_micro_batch_size_per_gpu=8",
    ]
    veomni = run(
        [
            *common,
            "model_engine=veomni",
            f"++{A}.veomni.param_offload=True",
            f"++{A}.veomni.optimizer_offload=True",
            f"++{A}.veomni.entropy_checkpointing=True",
            f"++{A}.veomni.expert_parallel_size=1",
            f"++{A}.veomni.attn_implementation=flash_attention_2",
            f"++{R}.veomni.param_offload=True",
        ],
        tmp_path / "veomni",
    )
    fsdp = run(
        [
            *common,
            "model_engine=dp",
            f"{A}.fsdp_config.param_offload=True",
            f"{A}.fsdp_config.optimizer_offload=True",
            f"{A}.entropy_checkpointing=True",
            f"{R}.fsdp_config.param_offload=True",
            f"{A}.optim.lr_scheduler_type=cosine",  # veRL's optim/veomni.yaml default
        ],
        tmp_path / "fsdp",
    )
    a, b = _compared(veomni), _compared(fsdp)
    assert len(a) == len(b) == 1 and a[0] and set(a[0]) == set(b[0])
    for key in a[0]:
        assert math.isclose(a[0][key], b[0][key], rel_tol=1e-5, abs_tol=1e-7), (key, a[0][key], b[0][key])
