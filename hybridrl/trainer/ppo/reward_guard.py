"""A console warning when every reward of a training batch is the same for N steps in a row.

With a group-normalised estimator (GRPO, RLOO, GRPO passk, ...) a batch whose sequence rewards
are all identical has advantages of exactly 0, so the policy gradient is zero and the step
learns nothing; a run can spend hours like this and end with exit 0. The usual reasons: the model
never produces the answer format the reward function parses, the reward function fails or returns
a constant, or the response budget cuts every answer before it is complete.

`trainer.constant_reward_warn_steps` (hybridrl; veRL has no such key): warn once when that many
consecutive training steps had constant rewards; 0 turns the check off.
"""

from __future__ import annotations

import torch

from hybridrl import algos

# absolute tolerance under which two sequence rewards count as the same value
_ATOL = 1e-6


def rewards_are_constant(scores: torch.Tensor, atol: float = _ATOL) -> bool:
    """Whether every sequence reward of a batch is the same value (within ``atol``).

    Args:
        scores: (B,) sequence rewards, or (B, T) token-level scores (summed over T first).

    Returns:
        True when max - min <= atol (an empty batch counts as constant).
    """
    if scores.dim() == 2:
        scores = scores.sum(-1)
    if scores.numel() == 0:
        return True
    return bool((scores.max() - scores.min()).abs() <= atol)


def constant_reward_message(value: float, steps: int, adv_estimator: str) -> str:
    """The console warning: what a constant reward means for ``adv_estimator`` and likely causes."""
    if algos.estimator_needs_critic(adv_estimator):
        effect = (
            f"with adv_estimator={adv_estimator} the actor only follows the critic's errors and the "
            "reward carries no signal"
        )
    else:
        effect = (
            f"with adv_estimator={adv_estimator} (GRPO-family: advantages are rewards relative to "
            "the group or batch) every advantage is 0, so the policy gradient is zero and the "
            "steps learn nothing"
        )
    return (
        f"[hybridrl] warning: every reward of the training batch was {value:g} for {steps} steps "
        f"in a row: {effect}. Likely causes: the model never produces the answer format the "
        "reward function parses (warm start or prompt template missing; look at the decoded "
        "samples, trainer.rollout_data_dir); the reward function always fails or returns a "
        "constant (test it on a known-good response); data.max_response_length cuts every answer "
        "before it ends (see response_length/clip_ratio); or the task is too hard (all 0) or too "
        "easy (all 1) for this model. This is said once per run; "
        "trainer.constant_reward_warn_steps=0 turns it off."
    )


class ConstantRewardGuard:
    """Counts consecutive training steps with constant rewards; warns once at ``steps`` of them.

    Args:
        steps: consecutive constant-reward steps before the warning (0: never warn).
        adv_estimator: the run's `algorithm.adv_estimator` (worded into the message).
    """

    def __init__(self, steps: int, adv_estimator: str):
        if steps < 0:
            raise ValueError(
                f"trainer.constant_reward_warn_steps must be >= 0 (0 turns the check off), got {steps}"
            )
        self.steps = steps
        self.adv_estimator = adv_estimator
        self.run = 0
        self.warned = False

    def observe(self, scores: torch.Tensor) -> str | None:
        """Record one training batch's rewards; returns the message the one time it is printed.

        Args:
            scores: (B,) sequence rewards or (B, T) token-level scores of the step's batch.
        """
        if self.steps == 0 or self.warned:
            return None
        if not rewards_are_constant(scores):
            self.run = 0
            return None
        self.run += 1
        if self.run < self.steps:
            return None
        self.warned = True
        value = float(scores.sum(-1)[0] if scores.dim() == 2 else scores[0]) if scores.numel() else 0.0
        message = constant_reward_message(value, self.run, self.adv_estimator)
        print(message, flush=True)
        return message
