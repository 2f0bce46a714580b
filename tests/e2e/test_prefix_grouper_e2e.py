"""actor.use_prefix_grouper through main_ppo: the same training as without it.

Two 2-step GRPO runs of the built-in task (4 prompts x 4 responses, micro-batches of 8 rows, the
separate old-log-prob pass on), one with the key false, one with the default `auto` (which turns
the shared-prompt forward on here): the step metrics that the actor computes (old log-probs through
the PPO ratio, policy loss, gradient norm, entropy) agree. The second run also logs its
per-phase floors (`trainer.log_floors`).
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.ppo_runs import run

pytestmark = pytest.mark.usefixtures("ray_local")

KEYS = ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "critic/score/mean"]


def test_prefix_grouper_trains_like_the_plain_forward(tmp_path):
    common = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.skip_on_policy_old_log_prob=False"]
    plain = run([*common, "actor_rollout_ref.actor.use_prefix_grouper=false"], tmp_path / "plain")
    grouped = run([*common, "trainer.log_floors=true"], tmp_path / "grouped")  # auto: on for GRPO, n > 1
    rows = [[r for r in rows if "actor/pg_loss" in r] for rows in (plain, grouped)]
    assert len(rows[0]) == len(rows[1]) == 2
    for a, b in zip(*rows):
        for key in KEYS:
            assert key in a, (key, sorted(a))
            assert math.isclose(a[key], b[key], rel_tol=1e-3, abs_tol=1e-5), (key, a[key], b[key])
        assert "timing_s/old_log_prob" in b
        # trainer.log_floors: each step's update and generation against the start-up floors
        assert 0 < b["perf/floor/update_frac_of_gemm_peak"] < 2, b["perf/floor/update_frac_of_gemm_peak"]
        assert 0 < b["perf/floor/gen_frac_of_decode_bound"] < 1, b["perf/floor/gen_frac_of_decode_bound"]
        assert not any(k.startswith("perf/floor/") for k in a)
