"""The environment interface: a multi-turn task the policy acts in, over chat messages.

    @register_environment("guess_number")
    class GuessNumber(Environment):
        async def reset(self, row):            # the data row: extra_info, raw_prompt, ...
            self.secret = row["extra_info"]["secret"]
            return "Guess a number from 1 to 9."          # the first user message
        async def step(self, action):          # the policy's last assistant message (text)
            ...
            return "higher", 0.0, False, {}               # observation, reward, done, info

`reset(row)` returns the first observation: a user message (str), a list of chat messages (the
conversation the policy starts from), None (start from the row's own prompt), or token ids
(list[int]: the whole prompt, already templated).
`step(action)` gets the policy's turn as an `Action`: a str (the decoded text) whose `token_ids`
are the tokens the policy generated. It returns `(observation, reward, done, info)`: the next user
message (str, rendered by the chat template as a user turn; ignored when done) or token ids
(list[int], appended to the conversation as they are: the environment writes the template's turn
markers itself), this turn's reward (a float), whether the episode ended, and a dict of numbers
for the metrics. The episode's reward is the sum of its turns' rewards (so a final reward is the reward of
the last step); the per-turn rewards are kept as the row's `turn_scores`.

Registered by name (`@register_environment`); a row picks one with `agent_name: env_agent` and
`extra_info.env_name` (constructor keyword arguments in `extra_info.env_kwargs`). Every episode
gets a new instance, in a process of its own (hybridrl.env.host): the class must be importable
by its module path there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.reward.scorers.environment import ENV_DATA_SOURCE

__all__ = [
    "ENV_DATA_SOURCE",
    "Action",
    "Environment",
    "get_environment_class",
    "list_environments",
    "register_environment",
]


class Action(str):
    """The policy's turn as an environment's `step` gets it: the decoded text (special tokens
    skipped), with the generated token ids (end-of-turn token included) as `token_ids`."""

    token_ids: list[int]

    def __new__(cls, text: str, token_ids: list[int]) -> Action:
        action = super().__new__(cls, text)
        action.token_ids = [int(t) for t in token_ids]
        return action

    def __reduce__(self):  # the episode's process gets both through the pipe
        return (Action, (str(self), self.token_ids))


class Environment:
    """Base class of environments (see the module docstring). One instance plays one episode."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    async def reset(self, row: dict[str, Any]) -> str | list[dict[str, Any]] | list[int] | None:
        raise NotImplementedError(f"{type(self).__qualname__}.reset is not implemented")

    async def step(self, action: Action) -> tuple[str | list[int], float, bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__qualname__}.step is not implemented")

    async def close(self) -> None:
        """Release what the episode holds (called once, also after an error)."""


_ENVIRONMENTS: dict[str, type[Environment]] = {}
_BUILTIN = {"guess_number": "hybridrl.env.guess_number", "openenv": "hybridrl.env.openenv_env"}


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: rows with `extra_info.env_name == name` play this environment."""

    def deco(cls: type[Environment]) -> type[Environment]:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_environment({name!r}): {cls!r} is not an Environment subclass")
        known = _ENVIRONMENTS.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"environment {name!r} is already registered to {known!r}; pick another name")
        _ENVIRONMENTS[name] = cls
        return cls

    return deco


def list_environments() -> list[str]:
    return sorted(set(_ENVIRONMENTS) | set(_BUILTIN))


def get_environment_class(name: str) -> type[Environment]:
    """The environment registered as `name`; ValueError naming the known ones."""
    if name not in _ENVIRONMENTS and name in _BUILTIN:
        import importlib

        importlib.import_module(_BUILTIN[name])
    if name not in _ENVIRONMENTS:
        raise ValueError(
            f"unknown environment {name!r} (a row's extra_info.env_name); known: {list_environments()}. "
            "Register one with @register_environment in a module the rollout workers import."
        )
    return _ENVIRONMENTS[name]
