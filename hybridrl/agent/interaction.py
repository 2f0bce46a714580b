"""Interactions: a simulated user that answers the policy's turns (veRL's Interaction system).

`multi_turn.interaction_config_path` names a yaml in veRL's format::

    interaction:
      - name: "gsm8k"                                               # rows pick it by this name
        class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
        config: {}                                                   # given to the constructor

A row opts in with `extra_info.interaction_kwargs = {"name": "gsm8k", ...}`; the other keys are
passed to `start_interaction` and `generate_response` (e.g. `ground_truth`). In the tool agent,
an assistant turn that calls no tool is answered by the row's interaction: its text becomes a
`user` turn (chat-template ids, mask 0), its score is appended to the row's `turn_scores`, and
`should_terminate_sequence` ends the trajectory. Each user turn counts against
`multi_turn.max_user_turns` (as tool turns do, veRL's convention).

Life cycle of one interaction in one trajectory (veRL's `BaseInteraction` contract)::

    instance_id = await interaction.start_interaction(instance_id, **interaction_kwargs)
    done, text, score, extra = await interaction.generate_response(instance_id, messages, **interaction_kwargs)
    ...
    await interaction.finalize_interaction(instance_id)

veRL's example class `verl.interactions.gsm8k_interaction.Gsm8kInteraction` resolves to
`Gsm8kInteraction` here when veRL is not installed, so veRL's example yaml loads unchanged.
"""

from __future__ import annotations

import uuid
from typing import Any

__all__ = [
    "VERL_INTERACTION_ALIASES",
    "BaseInteraction",
    "Gsm8kInteraction",
    "interaction_entries",
    "load_interactions",
    "row_interaction_kwargs",
]

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
VERL_INTERACTION_ALIASES = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "hybridrl.agent.interaction.Gsm8kInteraction",
    "verl.interactions.base.BaseInteraction": "hybridrl.agent.interaction.BaseInteraction",
}


class BaseInteraction:
    """A simulated user. Subclasses override `generate_response` (and usually the others).

    Args:
        config: the yaml entry's `config` mapping, with `name` added.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config)
        self.name: str = str(self.config.get("name", "interaction_agent"))

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start the state of one trajectory; returns its instance id."""
        return instance_id if instance_id is not None else str(uuid.uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate_sequence, user text, this turn's score, extra data) after `messages`."""
        raise NotImplementedError(f"{type(self).__qualname__}.generate_response is not implemented")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Release the trajectory's state."""


class Gsm8kInteraction(BaseInteraction):
    """veRL's GSM8K user: scores the last assistant message against `ground_truth` (strict
    `#### N` format); a correct answer ends the trajectory ("Your response is correct!"), a wrong
    one asks the model to try again. The turn score is that 0/1 score.

    hybridrl addition: `config.correct_response` / `config.incorrect_response` replace the two
    texts (veRL's by default), e.g. for a small model with a short context.
    """

    CORRECT = "Your response is correct!"
    INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.correct = str(self.config.get("correct_response", self.CORRECT))
        self.incorrect = str(self.config.get("incorrect_response", self.INCORRECT))
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = str(last)
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, self.correct, score, {}
        return False, self.incorrect, score, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        from hybridrl.reward.scorers.gsm8k import compute_score

        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return float(compute_score(state["response"], str(state["ground_truth"])))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


def _default_name(class_name: str) -> str:
    simple = class_name.rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def interaction_entries(path: str) -> dict[str, tuple[type[BaseInteraction], dict[str, Any]]]:
    """name -> (class, config) of a veRL-format interaction yaml, checked (a missing name: the class
    name, lower case, without "Interaction"; duplicate names and non-BaseInteraction classes are
    refused) but not constructed."""
    import os

    from omegaconf import OmegaConf

    from hybridrl.tools.tool_loading import import_object

    data = OmegaConf.to_container(OmegaConf.load(os.path.expanduser(path)), resolve=True)
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{KEY}={path!r}: the yaml needs a top-level `interaction:` list (veRL's format)")
    out: dict[str, tuple[type[BaseInteraction], dict[str, Any]]] = {}
    for i, entry in enumerate(entries):
        where = f"{KEY}={path!r}, interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: each entry needs class_name (and optionally name, config)")
        cls = import_object(entry["class_name"], where, VERL_INTERACTION_ALIASES)
        if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
            raise TypeError(f"{where}: {entry['class_name']!r} is not a hybridrl BaseInteraction subclass")
        name = str(entry.get("name") or _default_name(entry["class_name"]))
        if name in out:
            raise ValueError(f"{where}: duplicate interaction name {name!r}; names must be unique")
        out[name] = (cls, {**dict(entry.get("config") or {}), "name": name})
    return out


def load_interactions(path: str) -> dict[str, BaseInteraction]:
    """The interactions of a veRL-format yaml by name (see `interaction_entries`)."""
    return {name: cls(config) for name, (cls, config) in interaction_entries(path).items()}


def row_interaction_kwargs(row: dict[str, Any], interactions: dict[str, BaseInteraction]) -> dict[str, Any]:
    """The row's `extra_info.interaction_kwargs` (veRL: required, with a `name` of the yaml)."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    kwargs = row.get("interaction_kwargs") or extra.get("interaction_kwargs")
    if not isinstance(kwargs, dict) or "name" not in kwargs:
        raise ValueError(
            f"{KEY} is set, so every row needs extra_info.interaction_kwargs with a 'name' "
            f"(one of {sorted(interactions)}); got {kwargs!r}. Add it in the data preprocessing."
        )
    if kwargs["name"] not in interactions:
        raise ValueError(
            f"interaction {kwargs['name']!r} (extra_info.interaction_kwargs.name) is not in {KEY}; "
            f"known: {sorted(interactions)}"
        )
    return dict(kwargs)
