"""veRL algorithm and engine keys that map onto hybridrl's own settings, applied on the driver.

`apply_verl_misc(config, explicit_keys)` runs in `load_config` after `apply_verl_compat`:
- `*.model.torch_dtype` (the Hugging Face load dtype) becomes the `fsdp_config.model_dtype` of
  the roles that load that model; an explicit, different model_dtype is an error;
- `trainer.use_legacy_worker_impl`: veRL picks one of its two worker implementations; hybridrl
  has one, which is what `auto` means; `enable` / `disable` name a veRL implementation and fail;
- `algorithm.use_pf_ppo` / `algorithm.pf_ppo.*`: checked here (veRL applies PF-PPO with GAE only);
- `algorithm.rollout_correction.bypass_mode` / `loss_type`: the actor's `bypass_mode` loss;
- `algorithm.adv_estimator=optimal_token_baseline` / `tir_optimal_token_baseline` needs
  `actor.calculate_sum_pi_squared=True` and the old-log-prob pass of the FSDP actor (which computes
  that sum);
- `algorithm.adv_estimator=gdpo` needs `algorithm.gdpo_reward_keys` (and as many
  `gdpo_reward_weights`, when given).
"""

from __future__ import annotations

from typing import Any

from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.torch_utils import str_to_dtype

OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")  # read sum_pi_squared

LEGACY_WORKER_CHOICES = ("auto", "enable", "disable")
PF_PPO_METHODS = ("pow", "max_min", "max_random")


def _explicit(key: str, explicit_keys) -> bool:
    return explicit_keys is not None and key in explicit_keys


def _model_dtype_targets(config: Any) -> list[tuple[str, Any, list[tuple[str, Any]]]]:
    """(model key, model section, [(fsdp_config key, fsdp_config section), ...]) per model."""
    arr, critic = config.actor_rollout_ref, config.critic
    return [
        (
            "actor_rollout_ref.model",
            arr.model,
            [
                ("actor_rollout_ref.actor.fsdp_config", arr.actor.fsdp_config),
                ("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config),
            ],
        ),
        ("critic.model", critic.model, [("critic.model.fsdp_config", critic.model.fsdp_config)]),
    ]


def apply_model_torch_dtype(config: Any, explicit_keys) -> None:
    """`<model>.torch_dtype` -> `fsdp_config.model_dtype` of each role loading that model."""
    for model_key, model, targets in _model_dtype_targets(config):
        dtype = model.torch_dtype
        if dtype is None:
            continue
        try:
            str_to_dtype(dtype)
        except ValueError:
            raise ConfigError(
                f"{model_key}.torch_dtype={dtype!r} is not a dtype; use bfloat16, float16 or float32 "
                "('auto' is not supported: name the dtype)"
            ) from None
        for fsdp_key, fsdp in targets:
            key = f"{fsdp_key}.model_dtype"
            if _explicit(key, explicit_keys) and str_to_dtype(fsdp.model_dtype) != str_to_dtype(dtype):
                raise ConfigError(
                    f"{model_key}.torch_dtype={dtype} and {key}={fsdp.model_dtype} disagree; set one of them"
                )
            fsdp.model_dtype = dtype


def check_legacy_worker_impl(config: Any) -> None:
    """`trainer.use_legacy_worker_impl`: only `auto` (the library's choice) has a meaning here."""
    value = config.trainer.use_legacy_worker_impl
    key = "trainer.use_legacy_worker_impl"
    if value not in LEGACY_WORKER_CHOICES:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(LEGACY_WORKER_CHOICES)}")
    if value != "auto":
        raise ConfigError(
            f"{key}={value} selects one of veRL's two worker implementations (enable: the legacy "
            "fsdp_workers, disable: the model-engine workers); hybridrl has a single implementation "
            f"(engine/ behind the role workers), which is what auto means here. Leave {key}=auto"
        )


def check_pf_ppo(config: Any) -> None:
    """`algorithm.use_pf_ppo`: a reweight method hybridrl knows, and GAE (where veRL applies it)."""
    algo = config.algorithm
    if not algo.use_pf_ppo:
        return
    pf = algo.pf_ppo
    if pf.reweight_method not in PF_PPO_METHODS:
        raise ConfigError(
            f"algorithm.pf_ppo.reweight_method={pf.reweight_method!r} is not one of {', '.join(PF_PPO_METHODS)}"
        )
    if algo.adv_estimator != "gae":
        raise ConfigError(
            f"algorithm.use_pf_ppo=True with adv_estimator={algo.adv_estimator}: veRL resamples the batch "
            "(policy-filtered PPO) only after GAE and ignores the key otherwise; use adv_estimator=gae "
            "or set use_pf_ppo=False"
        )


def check_sum_pi_squared(config: Any) -> None:
    """The optimal token baseline reads `sum_pi_squared`, which the FSDP old-log-prob pass computes."""
    actor = config.actor_rollout_ref.actor
    key = "actor_rollout_ref.actor.calculate_sum_pi_squared"
    est = config.algorithm.adv_estimator
    if est in OTB_ESTIMATORS and not actor.calculate_sum_pi_squared:
        raise ConfigError(f"algorithm.adv_estimator={est} needs the per-token sum of pi^2: set {key}=True")
    if not actor.calculate_sum_pi_squared:
        return
    if actor.strategy == "megatron":
        raise ConfigError(f"{key}=True is implemented for the FSDP actor only; use actor.strategy=fsdp")
    if config.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(
            f"{key}=True needs the old-log-prob pass, which algorithm.rollout_correction.bypass_mode=True "
            "skips; turn bypass_mode off"
        )


def check_gdpo(config: Any) -> None:
    """`algorithm.adv_estimator=gdpo` names its reward components (veRL asserts the same at step 1)."""
    algo = config.algorithm
    keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
    if algo.adv_estimator == "gdpo" and not keys:
        raise ConfigError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components, keys of the "
            "dict your score function returns, e.g. algorithm.gdpo_reward_keys='[accuracy_reward,format_reward]'"
        )
    if weights is not None and len(weights) != len(keys or []):
        raise ConfigError(
            f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys or [])} "
            "algorithm.gdpo_reward_keys; give one weight per key (or null for all 1)"
        )
    if keys and len(set(keys)) != len(keys):
        raise ConfigError(f"algorithm.gdpo_reward_keys={list(keys)} names a component twice; list each once")


def apply_bypass_loss(config: Any) -> None:
    """`algorithm.rollout_correction.bypass_mode=True`: the actor's loss becomes `bypass_mode`
    (IS weights and rejection from the current policy against the rollout's, inside the loss) with
    the section's settings, as veRL does; `loss_type` means something in bypass mode only."""
    rc = config.algorithm.rollout_correction
    pl = config.actor_rollout_ref.actor.policy_loss
    key = "algorithm.rollout_correction"
    if rc.loss_type not in ("ppo_clip", "reinforce"):
        raise ConfigError(f"{key}.loss_type={rc.loss_type!r} is not one of ppo_clip, reinforce")
    if not rc.bypass_mode:
        if rc.loss_type != "ppo_clip":
            raise ConfigError(
                f"{key}.loss_type={rc.loss_type} is the loss of bypass mode (veRL ignores it otherwise): "
                f"set {key}.bypass_mode=True, or leave loss_type=ppo_clip"
            )
        return
    if pl.loss_mode not in ("vanilla", "bypass_mode"):
        raise ConfigError(
            f"{key}.bypass_mode=True replaces the policy loss (PPO-clip or REINFORCE, {key}.loss_type); "
            f"actor_rollout_ref.actor.policy_loss.loss_mode={pl.loss_mode} would be ignored: leave it at vanilla"
        )
    pl.loss_mode = "bypass_mode"
    for name in (
        "loss_type",
        "rollout_is",
        "rollout_is_threshold",
        "rollout_is_batch_normalize",
        "rollout_rs",
        "rollout_rs_threshold",
    ):
        setattr(pl.rollout_correction, name, getattr(rc, name))


def apply_verl_misc(config: Any, explicit_keys=None) -> None:
    """Map and check the keys above on a merged config (mutates it)."""
    explicit = None if explicit_keys is None else set(explicit_keys)
    apply_model_torch_dtype(config, explicit)
    check_legacy_worker_impl(config)
    check_pf_ppo(config)
    check_sum_pi_squared(config)
    check_gdpo(config)
    apply_bypass_loss(config)
