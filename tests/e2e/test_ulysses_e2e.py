"""main_ppo with Ulysses sequence parallelism: 2 ranks, one SP group of 2 (actor, reference, critic).

The same run with SP=1 (the 2 ranks data-parallel) generates the same first rollouts (the rollout
mesh does not change) from the same weights (workers start from one torch seed, so the critic's
fresh value head is the same too): the first step's actor entropy (old-log-prob pass), KL loss,
values and value loss agree. The update itself is checked to 1e-5 in
tests/engine/test_ulysses.py."""

import pytest

from tests.e2e.ppo_runs import assert_finite, run

pytestmark = pytest.mark.usefixtures("ray_local")

SP_RUN = [
    "trainer.n_gpus_per_node=2",
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.model.use_remove_padding=true",
    "critic.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ulysses_sp2_run_matches_sp1(tmp_path):
    sp = run(
        [
            *SP_RUN,
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "critic.ulysses_sequence_parallel_size=2",
        ],
        tmp_path / "sp2",
    )
    dp = run(SP_RUN, tmp_path / "sp1")
    train_sp = [r for r in sp if "actor/pg_loss" in r]
    train_dp = [r for r in dp if "actor/pg_loss" in r]
    assert len(train_sp) == len(train_dp) == 2
    assert_finite(train_sp, ["actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "critic/values/mean"])
    for key in (
        "actor/entropy",
        "actor/kl_loss",
        "response_length/mean",
        "critic/values/mean",
        "critic/vf_loss",
    ):
        assert train_sp[0][key] == pytest.approx(train_dp[0][key], rel=1e-4, abs=1e-7), key
    # the update's SP forward of the critic (with gradients) reads the values compute_values gave
    assert train_sp[0]["critic/vpred_mean"] == pytest.approx(train_sp[0]["critic/values/mean"], abs=1e-5)
