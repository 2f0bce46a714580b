"""The advantage-estimator plug point: `algorithm.adv_estimator` name -> estimator.

Every registered estimator is called the same way:

    advantages, returns = get_adv_estimator_fn(name)(
        token_level_rewards,   # (B, T)
        response_mask,         # (B, T)
        index=uids,            # np.ndarray (B,), equal uid = responses to the same prompt
        values=values,         # (B, T) critic values, or None
        gamma=1.0, lam=1.0,
        norm_adv_by_std_in_grpo=True, epsilon=1e-6,
        reward_baselines=None, # (B,) greedy-response score (ReMax), or None
        old_log_probs=None,    # (B, T) log pi_old (optimal_token_baseline), or None
        sum_pi_squared=None,   # (B, T) sum_v pi_old(v)^2 (optimal_token_baseline), or None
        rollout_is_weights=None,  # (B, T) rollout IS weights, or None
        reward_components=None,   # (K, B) per-component scores (gdpo), or None
        reward_weights=None,      # K weights of the components (gdpo), or None
    )

Each entry takes the keywords it needs and ignores the others (**_). The math lives in
`returns.py` (per-token returns), `group_advantage.py` (group-relative outcome advantages) and
`otb.py` (the optimal token baseline);
the entries below only adapt the uniform call to those functions. `estimator_needs_critic`
tells the trainer, at config-validation time, whether a critic must be built;
`estimator_groups_by_prompt` whether the estimator compares the responses of one prompt (it
needs `index`), which is when the actor's shared-prompt forward pays (`use_prefix_grouper: auto`).

Shapes: B batch, T response length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from hybridrl.algos import group_advantage as group
from hybridrl.algos import otb, returns
from hybridrl.algos.registry import Registry
from hybridrl.algos.utils import masked_whiten

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
_NEEDS_CRITIC: set[str] = set()
_GROUPS_BY_PROMPT: set[str] = set()


def _requires_index(fn: Callable) -> bool:
    """True when `fn` takes `index` without a default: it cannot run without the prompt groups."""
    param = inspect.signature(fn).parameters.get("index")
    return param is not None and param.default is inspect.Parameter.empty


def register_adv_est(
    name: str, *, needs_critic: bool = False, groups_by_prompt: bool | None = None
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an advantage estimator under `name`.

    Args:
        name: the value of `algorithm.adv_estimator` that selects it.
        needs_critic: the estimator reads `values`, so the trainer must build a critic.
        groups_by_prompt: the estimator compares the responses to one prompt (GRPO, RLOO, ...);
            None infers it from the signature: a required keyword `index` (the prompt uids).
    """
    add = ADV_ESTIMATORS.register(name)

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        add(fn)
        if needs_critic:
            _NEEDS_CRITIC.add(name)
        if _requires_index(fn) if groups_by_prompt is None else groups_by_prompt:
            _GROUPS_BY_PROMPT.add(name)
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> AdvantageEstimator:
    """The estimator registered under `name` (ValueError listing the known names otherwise)."""
    return ADV_ESTIMATORS.get(name)


def list_adv_estimators() -> list[str]:
    """Names accepted by `algorithm.adv_estimator`, sorted."""
    return ADV_ESTIMATORS.names()


def estimator_needs_critic(name: str) -> bool:
    """Whether the estimator `name` needs critic values (True for gae)."""
    ADV_ESTIMATORS.get(name)
    return name in _NEEDS_CRITIC


def estimator_groups_by_prompt(name: str) -> bool:
    """Whether the estimator `name` compares the responses to one prompt (True for grpo, rloo,
    grpo_passk, opo, gpg, gdpo, ...; False for gae, reinforce_plus_plus, remax)."""
    ADV_ESTIMATORS.get(name)
    return name in _GROUPS_BY_PROMPT


def _required(value, what: str, estimator: str, fix: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}; {fix}")
    return value


@register_adv_est("gae", needs_critic=True)
def _gae(token_level_rewards, response_mask, *, values=None, gamma=1.0, lam=1.0, **_):
    values = _required(
        values, "values (B, T) from the critic", "gae", "the trainer must build a critic and pass its values"
    )
    return returns.compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


@register_adv_est("reinforce_plus_plus")
def _reinforce_plus_plus(token_level_rewards, response_mask, *, gamma=1.0, **_):
    return returns.compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)


@register_adv_est("remax")
def _remax(token_level_rewards, response_mask, *, reward_baselines=None, **_):
    reward_baselines = _required(
        reward_baselines,
        "reward_baselines (B,), the score of each prompt's greedy response",
        "remax",
        "generate one greedy response per prompt and score it before computing advantages",
    )
    return returns.compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask)


@register_adv_est("grpo")
@register_adv_est("grpo_vectorized")
def _grpo(token_level_rewards, response_mask, *, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_):
    return group.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


@register_adv_est("grpo_batch_whitened")
def _grpo_batch_whitened(
    token_level_rewards, response_mask, *, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_
):
    """GRPO's group-normalised advantage, then whitened over every response token of the batch
    (AReaL's `reward_norm` at group level followed by `adv_norm` at batch level):
    A = (A_grpo - mean_batch(A_grpo)) / std_batch(A_grpo), mean and std over the unmasked tokens.
    """
    advantages, _ = group.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )
    advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("rloo")
@register_adv_est("rloo_vectorized")
def _rloo(token_level_rewards, response_mask, *, index, **_):
    return group.compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, index, **_):
    return group.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards, response_mask, index
    )


@register_adv_est("opo")
def _opo(token_level_rewards, response_mask, *, index, **_):
    return group.compute_opo_outcome_advantage(token_level_rewards, response_mask, index)


@register_adv_est("gpg")
def _gpg(token_level_rewards, response_mask, *, index, f_norm=1.0, **_):
    return group.compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, f_norm)


@register_adv_est("grpo_passk")
def _grpo_passk(
    token_level_rewards, response_mask, *, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_
):
    return group.compute_grpo_passk_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


@register_adv_est("optimal_token_baseline")
def _optimal_token_baseline(
    token_level_rewards,
    response_mask,
    *,
    index,
    old_log_probs=None,
    sum_pi_squared=None,
    rollout_is_weights=None,
    **_,
):
    fix = "set actor_rollout_ref.actor.calculate_sum_pi_squared=True (the old-log-prob pass computes both)"
    old_log_probs = _required(old_log_probs, "old_log_probs (B, T)", "optimal_token_baseline", fix)
    sum_pi_squared = _required(sum_pi_squared, "sum_pi_squared (B, T)", "optimal_token_baseline", fix)
    return otb.compute_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights
    )


@register_adv_est("gdpo")
def _gdpo(
    token_level_rewards,
    response_mask,
    *,
    index,
    reward_components=None,
    reward_weights=None,
    epsilon=1e-6,
    norm_adv_by_std_in_grpo=True,
    **_,
):
    return group.compute_gdpo_outcome_advantage(
        token_level_rewards, response_mask, index, reward_components, reward_weights, epsilon,
        norm_adv_by_std_in_grpo,
    )  # fmt: skip


@register_adv_est("tir_optimal_token_baseline")
def _tir_optimal_token_baseline(
    token_level_rewards,
    response_mask,
    *,
    index,
    old_log_probs=None,
    sum_pi_squared=None,
    rollout_is_weights=None,
    **_,
):
    name = "tir_optimal_token_baseline"
    fix = "set actor_rollout_ref.actor.calculate_sum_pi_squared=True (the old-log-prob pass computes both)"
    old_log_probs = _required(old_log_probs, "old_log_probs (B, T)", name, fix)
    sum_pi_squared = _required(sum_pi_squared, "sum_pi_squared (B, T)", name, fix)
    return otb.compute_tir_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights
    )


__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
    "estimator_groups_by_prompt",
    "estimator_needs_critic",
    "get_adv_estimator_fn",
    "list_adv_estimators",
    "register_adv_est",
]
