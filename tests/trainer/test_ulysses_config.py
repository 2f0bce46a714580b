"""Start-up handling of `*.ulysses_sequence_parallel_size` (Ulysses SP, see docs/architecture.md):
sizes count per SP group as in veRL, the reference follows the actor, bad layouts fail naming the fix."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from hybridrl.trainer.ppo.config import ConfigError
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv
from hybridrl.utils.config_loader import WARNED
from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

SP = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.n_gpus_per_node=4",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
]


def _check(overrides):
    WARNED.clear()
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    return check_startup(cfg, explicit_keys={override_key(o) for o in overrides})


def test_sizes_count_per_sp_group_and_the_reference_follows_the_actor():
    c = _check([*SP, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    arr = c.actor_rollout_ref
    assert arr.ref.ulysses_sequence_parallel_size == 2  # veRL's interpolation
    sizes = normalize_actor_batch_sizes(arr.actor, rollout_n=4, dp_size=4)
    assert (sizes.dp_size, sizes.mini_batch_size, sizes.micro_batch_size) == (2, 8, 8)
    # without SP the 4 ranks split the 16 rows 4 ways: 8 rows per micro-batch no longer fit
    with pytest.raises(
        ConfigError, match="not divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"
    ):
        _check([*SP[:-1], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    # a deprecated global size is divided by world / sp, as veRL does
    c = _check([*SP, "actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    assert c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ["actor_rollout_ref.model.use_remove_padding=false"],
            r"actor\.ulysses_sequence_parallel_size=2 needs the packed path",
        ),
        (
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"],
            r"=3 does not divide the 4 ranks.*\[1, 2, 4\]",
        ),
        (
            [
                "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
            ],
            r"ref\.ulysses_sequence_parallel_size=1 differs from the actor's 2",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=2"],
            r"critic\.ulysses.*packed path",
        ),
        (["reward_model.ulysses_sequence_parallel_size=2"], r"not for the reward model"),
        (  # the built-in model has 2 attention heads
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
            r"=4 does not divide the model's 2 attention heads",
        ),
    ],
)
def test_bad_layouts_fail_naming_the_fix(extra, match):
    with pytest.raises(ConfigError, match=match):
        _check([*SP, *extra])
