"""Pure tensor functions of RL for language models, and the registries at the plug points.

No Ray, FSDP or config objects here: tensors and keyword hyper-parameters in, results (and
metrics) out. Files, one idea each:
    utils.py            masked statistics, log-probs and entropy from logits
    groups.py           prompt groups (uid -> group id, per-group sums)
    returns.py          GAE, REINFORCE++, ReMax (per-token returns)
    group_advantage.py  GRPO, RLOO, REINFORCE++-baseline, OPO, GPG, pass@k, GDPO (group-relative)
    advantage.py        the advantage-estimator registry
    kl.py               per-token KL estimators (registry), exact KL from logits, KL-in-reward
    agg.py              loss aggregation modes (registry), LossScale for gradient accumulation
    policy_loss.py      policy losses (registry): PPO clip and its variants
    dppo.py             DPPO: trust region on the binary TV / KL divergence (policy losses)
    soft_pg.py          SAPO's soft gate, DRO's quadratic log-ratio penalty (policy losses)
    value.py            clipped value loss
    kl_ctrl.py          fixed / adaptive KL coefficient
    rollout_is.py       rollout-vs-training importance weights
    rollout_rs.py       rejection by KL estimators (token_k1, seq_max_k2, ...), the bypass-mode loss
    dapo.py             overlong reward shaping, dynamic-sampling group filter
    pf_ppo.py           policy-filtered PPO resampling weights
    otb.py              optimal token baseline (per-token baseline, sum of pi^2; multi-turn form)
"""

from hybridrl.algos.advantage import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    estimator_groups_by_prompt,
    estimator_needs_critic,
    get_adv_estimator_fn,
    list_adv_estimators,
    register_adv_est,
)
from hybridrl.algos.agg import (
    LOSS_AGG_MODES,
    LossScale,
    agg_loss,
    list_loss_agg_modes,
    loss_counts,
    register_loss_agg,
)
from hybridrl.algos.dapo import apply_overlong_penalty, filter_groups_by_metric
from hybridrl.algos.dppo import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv
from hybridrl.algos.group_advantage import (
    broadcast_to_tokens,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_outcome_advantage_loop,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_outcome_advantage_loop,
    grpo_response_advantages,
    outcome_scores,
)
from hybridrl.algos.groups import Groups
from hybridrl.algos.kl import (
    KL_ESTIMATORS,
    apply_kl_penalty,
    get_kl_estimator_fn,
    kl_penalty,
    kl_penalty_full_from_logits,
    list_kl_estimators,
    register_kl_estimator,
)
from hybridrl.algos.kl_ctrl import AdaptiveKLController, FixedKLController, get_kl_controller
from hybridrl.algos.otb import (
    compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
    sum_pi_squared_from_logits,
)
from hybridrl.algos.pf_ppo import pf_ppo_resample_indices, pf_ppo_weights
from hybridrl.algos.policy_loss import (
    POLICY_LOSSES,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_decoupled,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    list_policy_losses,
    register_policy_loss,
)
from hybridrl.algos.registry import Registry
from hybridrl.algos.returns import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    discounted_returns,
    gae_before_whitening,
)
from hybridrl.algos.rollout_is import (
    compute_rollout_correction,
    compute_rollout_importance_weights,
    parse_is_threshold,
    parse_rs_threshold,
)
from hybridrl.algos.rollout_rs import (
    compute_policy_loss_bypass_mode,
    compute_rollout_rejection_mask,
    is_kl_rs,
    parse_kl_rs,
)
from hybridrl.algos.soft_pg import compute_policy_loss_dro, compute_policy_loss_sapo
from hybridrl.algos.utils import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_from_logits,
    masked_mean,
    masked_row_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    mean_var_from_moments,
)
from hybridrl.algos.value import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "Groups",
    "LossScale",
    "Registry",
    "agg_loss",
    "apply_kl_penalty",
    "apply_overlong_penalty",
    "broadcast_to_tokens",
    "compute_gae_advantage_return",
    "compute_tir_optimal_token_baseline_advantage",
    "compute_policy_loss_sapo",
    "compute_policy_loss_dro",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "gae_before_whitening",
    "grpo_response_advantages",
    "compute_grpo_outcome_advantage_loop",
    "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_decoupled",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_outcome_advantage_loop",
    "compute_rollout_correction",
    "compute_rollout_importance_weights",
    "compute_rollout_rejection_mask",
    "is_kl_rs",
    "parse_kl_rs",
    "parse_is_threshold",
    "parse_rs_threshold",
    "compute_value_loss",
    "discounted_returns",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "estimator_groups_by_prompt",
    "estimator_needs_critic",
    "filter_groups_by_metric",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_kl_estimator_fn",
    "get_policy_loss_fn",
    "kl_penalty",
    "kl_penalty_full_from_logits",
    "list_adv_estimators",
    "list_kl_estimators",
    "list_loss_agg_modes",
    "list_policy_losses",
    "logprobs_from_logits",
    "loss_counts",
    "masked_mean",
    "masked_row_moments",
    "mean_var_from_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_scores",
    "pf_ppo_resample_indices",
    "pf_ppo_weights",
    "sum_pi_squared_from_logits",
    "register_adv_est",
    "register_kl_estimator",
    "register_loss_agg",
    "register_policy_loss",
]
