"""Faulty environments for bench/env_faults.py (imported in every worker through external_lib).

Each plays guess-the-number but fails on its first step in one way: it raises, hangs past the
env_agent deadline, or returns something that is not `(observation, reward, done, info)`.
"""

from __future__ import annotations

import time

from hybridrl.env.base import register_environment
from hybridrl.env.guess_number import GuessNumber


@register_environment("fault_raise")
class RaisingGuess(GuessNumber):
    async def step(self, action):
        raise RuntimeError("injected fault: the environment raised")


@register_environment("fault_hang")
class HangingGuess(GuessNumber):
    async def step(self, action):
        time.sleep(3600)  # past any deadline; only this episode's process is blocked


@register_environment("fault_malformed")
class MalformedGuess(GuessNumber):
    async def step(self, action):
        return {"observation": "higher"}  # a dict instead of the 4-tuple
