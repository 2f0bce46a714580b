"""Environments for tests/env (importable by module path in the episode processes)."""

from __future__ import annotations

import time

from hybridrl.env.base import Environment, register_environment


@register_environment("test_counting")
class Counting(Environment):
    """Three steps of reward 0.25 each; observations name the step."""

    async def reset(self, row):
        self.n = 0
        return "count"

    async def step(self, action):
        self.n += 1
        return f"step{self.n}", 0.25, self.n >= 3, {}


@register_environment("test_raising")
class Raising(Environment):
    async def reset(self, row):
        return "go"

    async def step(self, action):
        raise KeyError("the environment broke")


@register_environment("test_hanging")
class Hanging(Environment):
    async def reset(self, row):
        return "go"

    async def step(self, action):
        time.sleep(600)  # blocks its own process, not the trainer's


@register_environment("test_malformed")
class Malformed(Environment):
    async def reset(self, row):
        return "go"

    async def step(self, action):
        return "not a tuple"


@register_environment("test_token_ids")
class TokenIds(Environment):
    """Speaks token ids: the prompt and every observation are ids; each step's reward is the number
    of tokens the policy generated (read from the action's token ids)."""

    PROMPT = [5, 6, 7, 8]
    OBSERVATION = [9, 10, 11]

    async def reset(self, row):
        self.n = 0
        return list(self.PROMPT)

    async def step(self, action):
        self.n += 1
        assert isinstance(action, str) and all(isinstance(t, int) for t in action.token_ids)
        return list(self.OBSERVATION), float(len(action.token_ids)), self.n >= 2, {}


@register_environment("test_token_ids_out_of_vocab")
class TokenIdsOutOfVocab(Environment):
    async def reset(self, row):
        return "go"

    async def step(self, action):
        return [10**9], 0.0, False, {}
