"""AReaL's and veRL v1's async keys on main_async's command line, and partial_rollout's checks (no Ray)."""

from __future__ import annotations

import pytest

from hybridrl.compat import async_keys as foreign_keys
from hybridrl.compat.async_keys import selects_v1_async, translate_argv
from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config
from hybridrl.utils.config_loader import ConfigError

AREAL_SEED = [  # AReaL's gsm8k GRPO config, as command-line overrides (scaled to this machine)
    "allocation_mode=vllm:d2p1t1+d1p1t1",
    "rollout.max_concurrent_rollouts=24",
    "rollout.queue_size=100",
    "rollout.consumer_batch_size=8",
    "rollout.max_head_offpolicyness=2",
    "actor.recompute_logprob=true",
    "actor.use_decoupled_loss=true",
    "actor.behave_imp_weight_cap=4.0",
    "weight_update_mode=xccl",  # the seed's value: the collective path
    "gconfig.n_samples=4",
    "train_dataset.batch_size=8",
]


def cpu():
    return False


def test_areal_seed_keys_load_into_the_async_config(capsys, monkeypatch):
    monkeypatch.setattr(foreign_keys, "_printed", False)
    argv = translate_argv(AREAL_SEED, gpu=cpu)
    assert "actor_rollout_ref.rollout.name=vllm" in argv
    assert "async_training.rollout_n_gpus_per_node=2" in argv and "trainer.n_gpus_per_node=1" in argv
    printed = capsys.readouterr().out
    assert "rollout.max_concurrent_rollouts=24 -> async_training.max_concurrent_rollouts=24" in printed
    translate_argv(AREAL_SEED, gpu=cpu)
    assert capsys.readouterr().out == ""  # printed once per process
    c = load_async_config(
        compose_async_config([*argv, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"])
    )
    at = c.async_training
    assert (at.max_concurrent_rollouts, at.queue_size, at.max_head_offpolicyness) == (24, 100, 2)
    assert at.consumer_batch_size == c.data.train_batch_size == 8
    assert at.behave_imp_weight_cap == 4.0 and at.rollout_n_gpus_per_node == 2
    assert c.actor_rollout_ref.rollout.n == 4 and c.trainer.n_gpus_per_node == 1
    assert c.actor_rollout_ref.actor.policy_loss.loss_mode == "decoupled"
    assert at.weight_update_mode == "collective"
    assert "weight_update_mode=xccl -> async_training.weight_update_mode=collective" in printed


@pytest.mark.parametrize(
    "arg, mode",
    [
        ("weight_update_mode=disk", "object_store"),
        ("actor.weight_update_mode=xccl", "collective"),
        ("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "collective"),  # veRL's spelling
        (
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
            "collective",
        ),  # left alone: the default
    ],
)
def test_weight_update_mode_spellings(arg, mode):
    argv = translate_argv([arg], gpu=cpu)
    c = load_async_config(
        compose_async_config([*argv, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"])
    )
    assert c.async_training.weight_update_mode == mode


@pytest.mark.parametrize(
    "arg, words",
    [
        ("weight_update_mode=nvlink", "use xccl"),
        ("allocation_mode=sglang:d4p1t2+d4p1t1", "rollout tensor parallelism"),
        ("allocation_mode=sglang:d4p2t1+d4p1t1", "pipeline parallelism"),
        ("allocation_mode=d4p1t1", "needs a rollout and a training part"),
        ("allocation_mode=sglang:d4p1t1+d2p1t2", "megatron"),
        ("allocation_mode=sglang:x4+d4p1t1", "cannot read"),
    ],
)
def test_areal_values_hybridrl_cannot_honour_are_refused(arg, words):
    with pytest.raises(ConfigError, match=words):
        translate_argv([arg], gpu=cpu)


@pytest.mark.parametrize(
    "argv",
    [
        ["allocation_mode=vllm:d2p1t1+d1p1t1", "allocation_mode=sglang:d1p1t1+d1p1t1"],
        ["weight_update_mode=disk", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
    ],
)
def test_foreign_keys_that_disagree_are_refused(argv):
    """A translation sets several hybridrl keys, so a second, different value would only partly
    replace the first: refused, naming both; the same argument twice is harmless."""
    with pytest.raises(ConfigError, match="disagree"):
        translate_argv(argv, gpu=cpu)
    assert translate_argv([argv[0], argv[0]], gpu=cpu) == translate_argv([argv[0]], gpu=cpu) * 2


@pytest.mark.parametrize(
    "mode, slots, engines",
    [("vllm:d1p1t2+d1p1t1", 2, 1), ("vllm:d2p1t2+d1p1t1", 4, 2), ("vllm:d2p1t1+d1p1t1", 2, 2)],
)
def test_areal_rollout_tensor_parallelism_becomes_rollout_tp(mode, slots, engines):
    """AReaL's d<D>t<T> rollout part is D engines of T TP ranks: D x T rollout slots, rollout TP = T."""
    from hybridrl.trainer.async_ppo.config import n_rollout_engines, n_rollout_workers

    argv = translate_argv([f"allocation_mode={mode}"], gpu=cpu)
    tp = slots // engines
    assert f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}" in argv
    assert f"async_training.rollout_n_gpus_per_node={slots}" in argv
    c = load_async_config(
        compose_async_config([*argv, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"])
    )
    assert c.actor_rollout_ref.rollout.name == "vllm"
    assert c.actor_rollout_ref.rollout.tensor_model_parallel_size == tp
    assert (n_rollout_workers(c), n_rollout_engines(c)) == (slots, engines)
    assert c.trainer.n_gpus_per_node == 1


def test_verl_v1_separate_async_selects_partial_rollout_on_its_own_rollout_pool():
    argv = [
        "trainer.use_v1=True",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=2",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "trainer.v1.separate_async.num_warmup_batches=1",
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "trainer.v1.sampler.max_off_policy_strategy=wait",
        "trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio=0.5",
        "actor_rollout_ref.rollout.name=hf",
    ]
    assert selects_v1_async(argv)  # main_ppo hands this command line to main_async
    out = translate_argv(argv, gpu=cpu)
    assert not any(
        a.startswith(("trainer.v1", "trainer.use_v1", "actor_rollout_ref.rollout.nnodes")) for a in out
    )
    c = load_async_config(compose_async_config(out))
    at = c.async_training
    assert at.partial_rollout and at.rollout_n_gpus_per_node == 2 and at.max_head_offpolicyness == 2


def test_verl_v1_colocate_async_on_cpu_and_refusals():
    out = translate_argv(
        ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async", "trainer.n_gpus_per_node=2"],
        gpu=cpu,
    )
    assert "async_training.rollout_n_gpus_per_node=2" in out and "async_training.partial_rollout=true" in out
    with pytest.raises(ConfigError, match="same GPUs"):
        translate_argv(["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async"], gpu=lambda: True)
    assert not selects_v1_async(["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"])
    refused = {
        "trainer.v1.trainer_mode=sync": "main_ppo",
        "trainer.v1.sampler.max_off_policy_strategy=drop": "never drops",
        "trainer.v1.separate_async.hybrid_rollout.enable_switch=true": "not implemented",
        "trainer.v1.separate_async.parameter_sync_step=3": "parameter_sync_step x",
        "trainer.v1.separate_async.num_warmup_batches=5": "0..2",
        "trainer.v1.separate_async.unknown_knob=1": "does not translate",
    }
    for arg, words in refused.items():
        mode = [] if "trainer_mode" in arg else ["trainer.v1.trainer_mode=separate_async"]
        with pytest.raises(ConfigError, match=words):
            translate_argv(["trainer.use_v1=true", *mode, arg], gpu=cpu)
    with pytest.raises(ConfigError, match="trainer.use_v1=true only"):
        translate_argv(["trainer.v1.trainer_mode=separate_async"], gpu=cpu)


def test_partial_rollout_is_checked_at_start_up():
    ok = load_async_config(compose_async_config(["async_training.partial_rollout=true"]))
    assert ok.async_training.partial_rollout and ok.actor_rollout_ref.rollout.name == "hf"
    vllm = load_async_config(
        compose_async_config(["async_training.partial_rollout=true", "actor_rollout_ref.rollout.name=vllm"])
    )
    assert vllm.async_training.partial_rollout and vllm.actor_rollout_ref.rollout.name == "vllm"
    with pytest.raises(ConfigError, match=r"rollout.name=hf or vllm \(got 'sglang'\)"):
        load_async_config(
            compose_async_config(
                ["async_training.partial_rollout=true", "actor_rollout_ref.rollout.name=sglang"]
            )
        )
    with pytest.raises(ConfigError, match="unknown rollout engine"):
        load_async_config(
            compose_async_config(
                ["async_training.partial_rollout=true", "actor_rollout_ref.rollout.name=nope"]
            )
        )
