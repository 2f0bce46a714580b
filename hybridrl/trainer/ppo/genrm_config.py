"""Start-up checks and reward-function wiring of a generative reward model (GenRM).

A GenRM run is veRL's reward loop (`reward_model.use_reward_loop`, turned on by the
`reward.reward_model.enable` spelling) with `reward_model.enable` and
`custom_reward_function.path`: the judge is served by `reward_model.rollout.*` and the custom
function receives `reward_model_client` / `reward_model_tokenizer` (reward/genrm.py) and/or
veRL's `reward_router_address` (reward/genrm_router.py), whichever its signature takes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

GENRM_MANAGERS = ("naive", "batch", "dapo")  # in-process managers; prime scores in a process pool
CLIENT_KWARGS = ("reward_model_client", "reward_model_tokenizer")
ROUTER_KWARG = "reward_router_address"  # veRL's: "host:port" of the judge's OpenAI-compatible router
JUDGE_KWARGS = (*CLIENT_KWARGS, ROUTER_KWARG)


def is_genrm(config: Any) -> bool:
    """Whether the run's reward model is a generative judge called from the custom reward function."""
    rm = config.reward_model
    return bool(rm.use_reward_loop and rm.enable and config.custom_reward_function.path)


def check_genrm_config(config: Any, error: Callable[[str], Exception]) -> None:
    """Raise `error(message)` naming the key when a GenRM setting cannot work."""
    rm, r = config.reward_model, config.reward_model.rollout
    if not rm.model.path:
        raise error(
            "reward.reward_model.model_path (reward_model.model.path) must name the judge's model for a GenRM"
        )
    if config.reward_manager.source == "register" and rm.reward_manager not in GENRM_MANAGERS:
        raise error(
            f"reward_model.reward_manager={rm.reward_manager!r} with a generative reward model: use one of "
            f"{list(GENRM_MANAGERS)} (the judge's client is not passed into prime's process pool)"
        )
    if r.n != 1:
        raise error(
            f"reward_model.rollout.n={r.n}: the GenRM client returns one answer per prompt; set it to 1"
        )
    if not r.request_timeout_s > 0:
        raise error(f"reward_model.rollout.request_timeout_s={r.request_timeout_s} must be > 0 (seconds)")
    if r.temperature < 0 or not 0 < r.top_p <= 1:
        raise error(
            f"reward_model.rollout.temperature={r.temperature} must be >= 0 and top_p={r.top_p} in (0, 1]"
        )
    if r.response_length < 1 or r.prompt_length < 1:
        raise error(
            f"reward_model.rollout.prompt_length={r.prompt_length} and response_length={r.response_length} "
            "(the judge's default max_tokens) must be >= 1"
        )


def genrm_reward_kwargs(config: Any, compute_score: Callable | None) -> dict[str, Any]:
    """Placeholders for the judge in the reward managers' kwargs (filled once the judge runs); {} when
    the run has no GenRM (see `judge_kwargs`)."""
    if not is_genrm(config):
        return {}
    return judge_kwargs(compute_score, config.custom_reward_function.name)


def judge_kwargs(compute_score: Callable | None, name: str = "compute_score") -> dict[str, None]:
    """{kwarg: None} of the judge's arguments the score function takes: `reward_model_client`
    (hybridrl's client) and `reward_model_tokenizer` when it names them or takes **kwargs, and
    `reward_router_address` (veRL's HTTP router, reward/genrm_router.py, started only for a
    function that names it) when it names it.

    Raises:
        ValueError: the function takes neither the client nor the router's address.
    """
    try:
        params = inspect.signature(compute_score).parameters if compute_score is not None else None
    except (TypeError, ValueError):
        params = None
    if params is None:
        return dict.fromkeys(CLIENT_KWARGS)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = [k for k in JUDGE_KWARGS if k in params or (var_kw and k in CLIENT_KWARGS)]
    if not {"reward_model_client", ROUTER_KWARG} & set(names):
        raise ValueError(
            f"custom_reward_function {name!r} takes neither reward_model_client nor {ROUTER_KWARG}, so it "
            "cannot reach the generative reward model; add one of them (or **kwargs) to its signature "
            "(docs/genrm.md)"
        )
    return dict.fromkeys(names)
