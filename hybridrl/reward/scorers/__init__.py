"""Rule-based scorers, chosen by a row's ``data_source``.

``default_compute_score(data_source, solution_str, ground_truth, extra_info)`` is the reward function
used when ``custom_reward_function.path`` is not set. Built in:

==========================================================  ==================================
data_source                                                 scorer
==========================================================  ==================================
``hybridrl/arith`` (the built-in task)                      :mod:`hybridrl.data.builtin_score` (1.0 / 0.0)
``hybridrl/arith_tool`` (the built-in tool task)            :mod:`hybridrl.data.builtin_score` (1.0 / 0.0)
``hybridrl/arith_long`` (the long-tailed built-in task)     :mod:`hybridrl.data.long_task` (0.0 .. 1.0)
``hybridrl/shapes`` (the built-in visual task)              :mod:`hybridrl.data.visual_task` (1.0 / 0.0)
``openai/gsm8k``                                            :mod:`.gsm8k` (1.0 / 0.0)
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,  :func:`.math.compute_score`
``HuggingFaceH4/MATH-500``, ``math``                        (1.0 / 0.0)
``math_dapo``, ``aime2024``, ``aime2025``                   :func:`.math.compute_score_dapo`
                                                            (dict, score 1.0 / -1.0)
``hybridrl/env`` (rows that played an environment)          :mod:`.environment` (the episode reward)
``reasoning_gym`` (``data.reasoning_gym.tasks``)              each task's own ``score_answer`` (0.0 .. 1.0)
==========================================================  ==================================

Add a data source with :func:`register_scorer`::

    @register_scorer("my_org/my_task")
    def my_score(solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.data import builtin_score, long_task, reasoning_gym_task, visual_task
from hybridrl.data.agent_task import AGENT_DATA_SOURCE
from hybridrl.data.builtin_task import BUILTIN_DATA_SOURCE
from hybridrl.reward.scorers import environment, gsm8k
from hybridrl.reward.scorers import math as math_scorer
from hybridrl.reward.scorers.environment import ENV_DATA_SOURCE

# A scorer: (solution_str, ground_truth, extra_info) -> float, or a dict with at least "score".
Scorer = Callable[[str, Any, "dict | None"], "float | dict"]

_SCORERS: dict[str, Scorer] = {}


def register_scorer(*data_sources: str, overwrite: bool = False) -> Callable[[Scorer], Scorer]:
    """Decorator registering a scorer for one or more ``data_source`` names.

    Raises:
        ValueError: a name is already registered and ``overwrite`` is False.
    """
    if not data_sources:
        raise ValueError("register_scorer needs at least one data_source name")

    def decorator(fn: Scorer) -> Scorer:
        for name in data_sources:
            if name in _SCORERS and not overwrite and _SCORERS[name] is not fn:
                raise ValueError(
                    f"a scorer for data_source {name!r} is already registered "
                    f"({_SCORERS[name].__module__}.{_SCORERS[name].__qualname__}); pass overwrite=True to replace it"
                )
            _SCORERS[name] = fn
        return fn

    return decorator


def registered_data_sources() -> list[str]:
    """Names with a registered scorer, sorted."""
    return sorted(_SCORERS)


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for ``data_source``.

    Raises:
        NotImplementedError: no scorer for this data source.
    """
    try:
        return _SCORERS[data_source]
    except KeyError:
        raise NotImplementedError(
            f"no built-in reward function for data_source {data_source!r} (known: "
            f"{', '.join(registered_data_sources())}). Set custom_reward_function.path to a Python file "
            f"defining compute_score(data_source, solution_str, ground_truth, extra_info), or register "
            f"one with hybridrl.reward.scorers.register_scorer."
        ) from None


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float | dict:
    """Score one response with the scorer of its ``data_source``.

    Returns:
        A float, or a dict with a ``"score"`` key plus extra per-sample metrics.

    Raises:
        NotImplementedError: unknown data source (message says to set ``custom_reward_function.path``).
    """
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)


register_scorer(BUILTIN_DATA_SOURCE, AGENT_DATA_SOURCE)(builtin_score.compute_score)
register_scorer("openai/gsm8k")(gsm8k.compute_score)
register_scorer(long_task.LONG_DATA_SOURCE)(long_task.compute_score)
register_scorer(visual_task.VISUAL_DATA_SOURCE)(visual_task.compute_score)
register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")(
    math_scorer.compute_score
)
register_scorer("math_dapo", "aime2024", "aime2025")(math_scorer.compute_score_dapo)
register_scorer(ENV_DATA_SOURCE)(environment.compute_score)
register_scorer(reasoning_gym_task.RG_DATA_SOURCE)(reasoning_gym_task.compute_score)

__all__ = ["Scorer", "default_compute_score", "get_scorer", "register_scorer", "registered_data_sources"]
