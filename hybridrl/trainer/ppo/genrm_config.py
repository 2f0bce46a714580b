"""Start-up checks and reward-function wiring of a generative reward model (GenRM).

A GenRM run is veRL's reward loop (`reward_model.use_reward_loop`, turned on by the
`reward.reward_model.enable` spelling) with `reward_model.enable` and
`custom_reward_function.path`: the judge is served by `reward_model.rollout.*` and the custom
function receives `reward_model_client` / `reward_model_tokenizer` (workers/reward/genrm.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

GENRM_MANAGERS = ("naive", "batch", "dapo")  # in-process managers; prime scores in a process pool
CLIENT_KWARGS = ("reward_model_client", "reward_model_tokenizer")


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
    """Placeholders for the judge's client in the reward managers' kwargs (filled once the judge runs);
    {} when the run has no GenRM. A function written for veRL's HTTP router is refused here."""
    if not is_genrm(config):
        return {}
    try:
        params = inspect.signature(compute_score).parameters if compute_score is not None else {}
    except (TypeError, ValueError):
        params = {}
    if "reward_router_address" in params:
        raise ValueError(
            f"custom_reward_function {config.custom_reward_function.name!r} takes reward_router_address (veRL's "
            "HTTP router to the GenRM), which is not served here; take reward_model_client instead and call "
            "reward_model_client.chat([messages]) or .generate([prompt]) (docs/genrm.md)"
        )
    return dict.fromkeys(CLIENT_KWARGS)
