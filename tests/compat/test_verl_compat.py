"""veRL spellings and start-up behaviour: each key changes what runs (not only that it parses)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module

from hybridrl import algos
from hybridrl.agent.runner import agent_loops_configured
from hybridrl.compat.verl_legacy import REFUSED
from hybridrl.trainer.ppo.config import ConfigError
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv
from hybridrl.trainer.ppo.launch import merge_runtime_env
from hybridrl.utils.config_loader import WARNED

SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
]


def _check(overrides, explicit=True):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    keys = {override_key(o) for o in overrides} if explicit else None
    return check_startup(cfg, explicit_keys=keys)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    WARNED.clear()


def test_small_batch_without_micro_batch_uses_the_per_rank_mini_batch_and_says_so(capsys):
    c = _check(SMALL)
    assert c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 16
    err = capsys.readouterr().err
    assert err.count("the default micro-batch size (64) does not fit") == 1
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16" in err
    _check(SMALL)
    assert "default 64" not in capsys.readouterr().err  # said once


def test_explicit_indivisible_micro_batch_still_fails():
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu=64"):
        _check([*SMALL, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"])


def test_prepare_argv_turns_plus_and_plain_overrides_into_set_or_add():
    argv = ["m", "+a.b=1", "c=2", "++d=3", "~e", "hydra.run.dir=x", "--config-name", "y"]
    assert prepare_argv(argv) == [
        "m",
        "++a.b=1",
        "++c=2",
        "++d=3",
        "~e",
        "hydra.run.dir=x",
        "--config-name",
        "y",
    ]
    # veRL writes `+key=` for keys its yaml lacks; here the key exists: it is simply set
    c = _check(["+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"])
    assert c.actor_rollout_ref.actor.fsdp_config.model_dtype == "bf16"
    with pytest.raises(ConfigError, match="unknown config key 'actor_rollout_ref.actor.nope'"):
        _check(["actor_rollout_ref.actor.nope=1"])


def test_deprecated_global_micro_batch_is_divided_by_the_ranks(capsys):
    c = _check(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size=6"])  # fmt: skip
    assert c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 3
    assert "actor_rollout_ref.actor.ppo_micro_batch_size is deprecated" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="both"):
        _check(
            [
                "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            ]
        )


@pytest.mark.parametrize("entry", REFUSED, ids=lambda r: r.key)
def test_every_refused_key_errors_on_a_non_default_value(entry):
    value = {bool: not entry.default, int: 7, str: "other", type(None): "x", dict: "{a: 1}"}[
        type(entry.default)
    ]
    if entry.key == "actor_rollout_ref.rollout.mode":
        value = "async"
    with pytest.raises(ConfigError, match=rf"{entry.key}=.*not supported here"):
        _check([f"{entry.key}={value}"])


def test_engine_only_keys_with_hf_rollout_give_one_warning(capsys):
    _check(
        [
            "actor_rollout_ref.rollout.enable_chunked_prefill=False",
            "actor_rollout_ref.rollout.max_num_seqs=3",
            "actor_rollout_ref.rollout.enable_prefix_caching=False",  # honoured by HF (shared prefill)
        ]
    )
    err = capsys.readouterr().err
    assert err.count("rollout.name=hf ignores") == 1
    assert "enable_chunked_prefill" in err and "max_num_seqs" in err
    assert "enable_prefix_caching" not in err


def test_checkpoint_engine_bucket_size_replaces_the_top_level_key():
    c = _check(["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=3"])
    assert c.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 3
    with pytest.raises(ConfigError, match="checkpoint_engine.backend"):
        _check(["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"])


def test_checkpoint_engine_options_are_refused_not_ignored():
    """veRL passes engine_kwargs[backend] to the backend's constructor; the naive backend takes none here."""
    key = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs"
    _check([f"{key}={{naive: {{}}}}"])  # an empty section sets nothing
    with pytest.raises(ConfigError, match="checkpoint_engine.engine_kwargs.*takes no constructor options"):
        _check([f"{key}={{naive: {{is_master: true}}}}"])
    with pytest.raises(ConfigError, match="checkpoint_engine.engine_kwargs"):
        _check([f"+{key}.nccl.rebuild_group=true"])


def test_rollout_correction_needs_rollout_log_probs_and_one_spelling():
    with pytest.raises(ConfigError, match="calculate_log_probs=True"):
        _check(["algorithm.rollout_correction.rollout_is=token"])
    with pytest.raises(ConfigError, match="one spelling"):
        _check(["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_is=true",
                "actor_rollout_ref.rollout.calculate_log_probs=true"])  # fmt: skip
    with pytest.raises(ConfigError, match="loss_type"):
        _check(["algorithm.rollout_correction.loss_type=reinforce"])


def test_rollout_correction_weights_hand_derived():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))  # ratios 2, 1, 5
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, _ = algos.compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=3.0, rollout_is_batch_normalize=False,
        rollout_rs=None, rollout_rs_lower=0.0, rollout_rs_upper=1.0,
    )  # fmt: skip
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 3.0]]))
    w, m = algos.compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
        rollout_rs="token", rollout_rs_lower=0.5, rollout_rs_upper=4.0,
    )  # fmt: skip
    # normalised by the mean (2+1+3)/3 = 2, then the ratio-5 token is rejected
    assert torch.allclose(w, torch.tensor([[1.0, 0.5, 0.0]]))
    assert float(m["rs_reject_frac"]) == pytest.approx(1 / 3)


def test_rollout_is_threshold_lower_upper_is_icepop():
    """veRL's 'lower_upper' rollout_is_threshold: weights outside [lower, upper] become 0 (IcePop),
    the ones inside keep their ratio (no truncation)."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.1, 0.8]]))  # ratios 2, 1, 5, 0.625
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, _ = algos.compute_rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_is_threshold="0.8_4.0", rollout_is_batch_normalize=False,
        rollout_rs=None, rollout_rs_lower=0.0, rollout_rs_upper=1.0,
    )  # fmt: skip
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0, 0.0]]))
    assert algos.parse_is_threshold("0.5_4.0") == (0.5, 4.0) and algos.parse_is_threshold(2) == (None, 2.0)
    on = [
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]
    _check([*on, "algorithm.rollout_correction.rollout_is_threshold=0.5_4.0"])
    for bad in ("4.0_0.5", "x_y", "-1"):
        with pytest.raises(ConfigError, match="rollout_is_threshold"):
            _check([*on, f"algorithm.rollout_correction.rollout_is_threshold={bad}"])
    assert algos.parse_rs_threshold("0.5_2.0", 9.0) == (0.5, 2.0)
    assert algos.parse_rs_threshold(None, 4.0) == (0.25, 4.0)


def test_ray_init_runtime_env_is_merged_with_hybridrl_s():
    ours = {"env_vars": {"A": "1", "B": "2"}}
    user = {"env_vars": {"B": "x", "C": 3}, "working_dir": "/w", "py_executable": "python3"}
    assert merge_runtime_env(ours, user) == {
        "env_vars": {"A": "1", "B": "x", "C": "3"},
        "working_dir": "/w",
        "py_executable": "python3",
    }


def test_ray_init_runtime_env_on_an_already_started_ray_is_said_not_applied(capsys, monkeypatch):
    from types import SimpleNamespace

    import ray

    from hybridrl.trainer.ppo.launch import start_ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # Ray started by the caller

    start_ray(1, SimpleNamespace(runtime_env={"env_vars": {"A": "1"}}, num_cpus=None))
    assert "ray_kwargs.ray_init.runtime_env is not applied" in capsys.readouterr().err
    start_ray(1, SimpleNamespace(runtime_env={}, num_cpus=None))  # nothing to apply: nothing said
    assert "runtime_env" not in capsys.readouterr().err


def _cli(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None) if env is None else None
    return subprocess.run(
        [sys.executable, "-m", "hybridrl.trainer.main_ppo", *args],
        capture_output=True, text=True, env=full_env, timeout=120,
    )  # fmt: skip


def test_cli_config_error_is_one_line_exit_1_and_full_with_hydra_full_error():
    r = _cli("actor_rollout_ref.hybrid_engine=False")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and "hybrid_engine=False" in lines[-1] and "Leave it at True" in lines[-1]
    r = _cli("actor_rollout_ref.hybrid_engine=False", env={"HYDRA_FULL_ERROR": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_ray_init_num_cpus_and_env_vars_reach_ray(monkeypatch):
    """ray_kwargs.ray_init.num_cpus sizes the local Ray; runtime_env.env_vars reach the workers."""
    import ray

    from hybridrl.trainer.ppo.launch import start_ray
    from hybridrl.trainer.ppo.sections import RayInitConfig

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    start_ray(1, RayInitConfig(num_cpus=3, runtime_env={"env_vars": {"H13_FLAG": "on"}}))
    try:
        assert ray.cluster_resources()["CPU"] == 3

        @ray.remote(num_cpus=0)
        def read_env():
            return os.environ.get("H13_FLAG"), os.environ.get("TOKENIZERS_PARALLELISM")

        assert ray.get(read_env.remote()) == ("on", "false")  # the user's and hybridrl's variables
    finally:
        ray.shutdown()


def test_rollout_mode_async_generates_through_the_agent_loops():
    from hybridrl.agent.runner import uses_agent_loops
    from hybridrl.protocol import DataProto
    from hybridrl.rollout import RolloutConfig

    batch = DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    assert uses_agent_loops(RolloutConfig(name="hf", mode="async"), batch)
    assert not uses_agent_loops(RolloutConfig(name="hf", mode="sync"), batch)
    assert _check(["actor_rollout_ref.rollout.mode=async"]).actor_rollout_ref.rollout.mode == "async"


def test_agent_rollout_options_validate_at_start_up(capsys):
    """over_sample_rate / trace need the agent loops; server.max_start_wait_time and trace=weave
    are refused; multi_stage_wake_up with rollout.name=hf is named in the engine-only warning."""
    mt = "actor_rollout_ref.rollout.multi_turn.enable=true"
    with pytest.raises(ConfigError, match="over_sample_rate=0.2 is invalid: it aborts the slowest"):
        _check(["actor_rollout_ref.rollout.over_sample_rate=0.2"])
    assert (
        _check(
            [mt, "actor_rollout_ref.rollout.over_sample_rate=0.2"]
        ).actor_rollout_ref.rollout.over_sample_rate
        == 0.2
    )
    with pytest.raises(
        ConfigError, match="max_start_wait_time=10.0 is invalid: hybridrl's engines start in-process"
    ):
        _check(["actor_rollout_ref.rollout.server.max_start_wait_time=10"])
    with pytest.raises(ConfigError, match="sglang_rollout_mode='http'"):
        _check(["actor_rollout_ref.rollout.sglang_rollout_mode=http"])
    with pytest.raises(ConfigError, match="weave is not supported"):
        _check([mt, "actor_rollout_ref.rollout.trace.backend=weave"])
    with pytest.raises(ConfigError, match="traces agent-loop trajectories"):
        _check(["actor_rollout_ref.rollout.trace.backend=mlflow"])
    c = _check(["actor_rollout_ref.rollout.sglang_rollout_mode=server", "trainer.project_name=p1"])
    assert c.actor_rollout_ref.rollout.trace.project_name == "p1"  # linked to trainer.project_name
    capsys.readouterr()
    _check(["actor_rollout_ref.rollout.multi_stage_wake_up=true"])
    assert "multi_stage_wake_up" in capsys.readouterr().err


@pytest.mark.parametrize(
    "agent_key",
    [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ],
)
def test_rollout_tp_with_agent_loops_passes_the_config_stage(agent_key):
    """The agent loops run over a TP engine (TP leader relays its engine calls, agent/
    tp_relay.py), so TP > 1 with them passes the config stage; the TP layout checks still apply
    (an engine without TP is refused with the agent loops too)."""
    tp = [
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=2",
    ]
    c = _check([*tp, "actor_rollout_ref.rollout.name=vllm", agent_key])
    assert c.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert agent_loops_configured(c.actor_rollout_ref.rollout)
    with pytest.raises(
        ConfigError, match="tensor_model_parallel_size=2 with actor_rollout_ref.rollout.name=hf"
    ):
        _check([*tp, "actor_rollout_ref.rollout.name=hf", agent_key])
