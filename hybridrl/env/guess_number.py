"""Guess-the-number: the built-in multi-turn environment.

The secret is an integer in [1, `high`] (from the row's `extra_info.secret`); the policy answers
`#### N` each turn and hears "higher" or "lower" until it finds it or runs out of `max_turns`.
Reward: 1 on the turn it finds the secret, 0 otherwise (an answer without `#### N` counts as a
wrong guess, "say #### N").
"""

from __future__ import annotations

import re
from typing import Any

from hybridrl.env.base import Environment, register_environment

__all__ = ["GuessNumber", "make_rows"]

_ANSWER = re.compile(r"####\s*(-?\d+)")


@register_environment("guess_number")
class GuessNumber(Environment):
    def __init__(self, high: int = 8, max_turns: int = 4) -> None:
        super().__init__(high=high, max_turns=max_turns)
        self.high, self.max_turns = int(high), int(max_turns)
        self.secret, self.turn = 0, 0

    async def reset(self, row: dict[str, Any]) -> str:
        secret = (row.get("extra_info") or {}).get("secret")
        if not isinstance(secret, int) or not 1 <= secret <= self.high:
            raise ValueError(f"guess_number needs extra_info.secret in [1, {self.high}]; got {secret!r}")
        self.secret, self.turn = secret, 0
        return f"guess 1-{self.high}"

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.turn += 1
        found = _ANSWER.findall(action)
        guess = int(found[-1]) if found else None
        if guess == self.secret:
            return "", 1.0, True, {"turns": self.turn}
        done = self.turn >= self.max_turns
        if guess is None:
            return "say #### N", 0.0, done, {"turns": self.turn}
        return ("higher" if guess < self.secret else "lower"), 0.0, done, {"turns": self.turn}


def make_rows(n: int, seed: int, high: int = 8, max_turns: int = 4) -> list[dict[str, Any]]:
    """RL rows in veRL's schema: `agent_name: env_agent`, `extra_info: {env_name, env_kwargs, secret}`."""
    import random

    from hybridrl.env.base import ENV_DATA_SOURCE

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        secret = rng.randint(1, high)
        rows.append(
            {
                "data_source": ENV_DATA_SOURCE,
                "agent_name": "env_agent",
                "prompt": [{"role": "user", "content": f"guess 1-{high}"}],
                "ability": "game",
                "reward_model": {"style": "environment", "ground_truth": str(secret)},
                "extra_info": {
                    "index": i,
                    "env_name": "guess_number",
                    "env_kwargs": {"high": high, "max_turns": max_turns},
                    "secret": secret,
                },
            }
        )
    return rows
