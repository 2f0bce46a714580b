"""Per-token KL between the policy and the reference policy: the KL-estimator plug point.

Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html). Tokens
are sampled from pi; with the log ratio log r = log pi_ref - log pi:
    k1 = -log r                      unbiased estimate of KL(pi || pi_ref), high variance
    k2 = 1/2 (log r)^2               biased, low variance; its gradient is that of the true KL
                                     to first order
    k3 = (r - 1) - log r             unbiased, low variance, always >= 0
`abs` is |log r|. `k1+` and `k3+` report the value of k1/k3 but backpropagate the gradient
of k2 (straight-through), an unbiased gradient of the KL *loss* for both.

The exact KL over the vocabulary (`full`) needs logits, not log-probs of the sampled tokens:
use `kl_penalty_full_from_logits`.

Shapes: B batch, T response length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrl.algos.registry import Registry
from hybridrl.algos.utils import masked_mean

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
register_kl_estimator = KL_ESTIMATORS.register

K3_LOG_RATIO_BOUND = 10.0  # |log r| is clamped here before exp(): r stays in [4.5e-5, 2.2e4]
K3_MAX = 10.0  # and k3 itself is clamped to [-K3_MAX, K3_MAX] (k3 >= 0, so only the top binds)


def get_kl_estimator_fn(name: str) -> KLEstimator:
    """The KL estimator registered under `name` (ValueError listing the known names otherwise)."""
    if name == "full":
        raise ValueError(
            "kl_penalty 'full' is the exact KL over the vocabulary and needs the logits of both "
            "policies, not the log-probs of the sampled tokens: call "
            "kl_penalty_full_from_logits(logits, ref_logits), or pick a sampled estimator "
            f"({', '.join(KL_ESTIMATORS.names())})"
        )
    return KL_ESTIMATORS.get(name)


def list_kl_estimators() -> list[str]:
    """Names accepted by `kl_penalty` / `actor.kl_loss_type` (plus "full", see the module doc)."""
    return KL_ESTIMATORS.names()


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate named `kl_penalty` (see the module docstring).

    Args:
        logprob: (B, T) log pi of the sampled tokens.
        ref_logprob: (B, T) log pi_ref of the same tokens.
        kl_penalty: an estimator name: kl/k1, abs, mse/k2, low_var_kl/k3, k1+, k3+.

    Returns:
        (B, T) per-token estimate (the caller masks and aggregates it).
    """
    return get_kl_estimator_fn(kl_penalty)(logprob, ref_logprob)


@register_kl_estimator("kl")
@register_kl_estimator("k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref. Args/returns: (B, T)."""
    return logprob - ref_logprob


@register_kl_estimator("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|. Args/returns: (B, T)."""
    return (logprob - ref_logprob).abs()


@register_kl_estimator("mse")
@register_kl_estimator("k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = 1/2 (log pi - log pi_ref)^2. Args/returns: (B, T)."""
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_estimator("low_var_kl")
@register_kl_estimator("k3")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r with r = pi_ref / pi, clamped for stability. Args/returns: (B, T)."""
    log_r = (ref_logprob - logprob).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    k3 = log_r.exp() - 1 - log_r
    return k3.clamp(-K3_MAX, K3_MAX)


def _straight_through(value_fn: KLEstimator) -> KLEstimator:
    """value of `value_fn`, gradient of k2: value.detach() + (k2 - k2.detach())."""

    def estimator(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logprob, ref_logprob)
        return value_fn(logprob, ref_logprob).detach() + (k2 - k2.detach())

    estimator.__doc__ = f"Value of {value_fn.__name__}, gradient of k2 (straight-through)."
    estimator.__name__ = estimator.__qualname__ = f"{value_fn.__name__}_plus"
    return estimator


kl_k1_plus = register_kl_estimator("k1+")(_straight_through(kl_k1))
kl_k3_plus = register_kl_estimator("k3+")(_straight_through(kl_k3))


def kl_penalty_full_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact per-position KL(pi || pi_ref) = sum_v pi_v (log pi_v - log pi_ref_v).

    Args:
        logits: (B, T, V) policy logits.
        ref_logits: (B, T, V) reference-policy logits.

    Returns:
        (B, T) KL at each position.
    """
    logp = torch.log_softmax(logits, dim=-1)
    ref_logp = torch.log_softmax(ref_logits, dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(dim=-1)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Fold a KL penalty into the rewards: r_t = score_t - beta * KL_t.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", eq. 2 (the
    reward R(x, y) = r(x, y) - beta log(pi(y|x) / rho(y|x)), here spread over tokens).

    Args:
        token_level_scores: (B, T) task reward of each token.
        old_log_prob: (B, T) log pi of the sampled tokens at rollout time.
        ref_log_prob: (B, T) log pi_ref of the same tokens.
        response_mask: (B, T).
        kl_coef: beta.
        kl_penalty_type: KL estimator name (see `kl_penalty`).

    Returns:
        token_level_rewards: (B, T).
        metrics: reward_kl_penalty (batch mean of each sequence's mean KL; feed it to an
            adaptive KL controller) and reward_kl_penalty_coeff.
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()
    metrics = {
        "reward_kl_penalty": current_kl.detach(),
        "reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return token_level_rewards, metrics
