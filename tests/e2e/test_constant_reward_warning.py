"""A real run whose reward function always returns 0 says so once (trainer.constant_reward_warn_steps)."""

from __future__ import annotations

from tests.e2e.ppo_runs import run

ZERO_FN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.0
"""


def test_all_zero_rewards_warn_once(tmp_path, capsys):
    fn = tmp_path / "zero.py"
    fn.write_text(ZERO_FN)
    rows = run(
        [
            f"custom_reward_function.path={fn}",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=3",
            "trainer.constant_reward_warn_steps=2",
            "trainer.test_freq=-1",
        ],
        tmp_path,
    )
    out = capsys.readouterr().out
    assert out.count("[hybridrl] warning: every reward of the training batch was 0 for 2 steps") == 1, out
    assert "with adv_estimator=grpo" in out and "policy gradient is zero" in out
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 3 and all(abs(r["actor/pg_loss"]) < 1e-6 for r in steps), steps
