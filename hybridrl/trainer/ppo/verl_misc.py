"""veRL algorithm and engine keys that map onto hybridrl's own settings, applied on the driver.

`apply_verl_misc(config, explicit_keys)` runs in `load_config` after `apply_verl_compat`:
- `*.model.torch_dtype` (the Hugging Face load dtype) becomes the `fsdp_config.model_dtype` of
  the roles that load that model; an explicit, different model_dtype is an error;
- `trainer.use_legacy_worker_impl`: veRL picks one of its two worker implementations; hybridrl
  has one, which is what `auto` means; `enable` / `disable` name a veRL implementation and fail;
- `algorithm.use_pf_ppo` / `algorithm.pf_ppo.*`: checked here (veRL applies PF-PPO with GAE only).
"""

from __future__ import annotations

from typing import Any

from hybridrl.trainer.ppo.verl_compat import config_error
from hybridrl.utils.torch_utils import str_to_dtype

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
            raise config_error(
                f"{model_key}.torch_dtype={dtype!r} is not a dtype; use bfloat16, float16 or float32 "
                "('auto' is not supported: name the dtype)"
            ) from None
        for fsdp_key, fsdp in targets:
            key = f"{fsdp_key}.model_dtype"
            if _explicit(key, explicit_keys) and str_to_dtype(fsdp.model_dtype) != str_to_dtype(dtype):
                raise config_error(
                    f"{model_key}.torch_dtype={dtype} and {key}={fsdp.model_dtype} disagree; set one of them"
                )
            fsdp.model_dtype = dtype


def check_legacy_worker_impl(config: Any) -> None:
    """`trainer.use_legacy_worker_impl`: only `auto` (the library's choice) has a meaning here."""
    value = config.trainer.use_legacy_worker_impl
    key = "trainer.use_legacy_worker_impl"
    if value not in LEGACY_WORKER_CHOICES:
        raise config_error(f"{key}={value!r} is not one of {', '.join(LEGACY_WORKER_CHOICES)}")
    if value != "auto":
        raise config_error(
            f"{key}={value} selects one of veRL's two worker implementations (enable: the legacy "
            "fsdp_workers, disable: the model-engine workers); hybridrl has a single implementation "
            f"(workers/engine behind the role workers), which is what auto means here. Leave {key}=auto"
        )


def check_pf_ppo(config: Any) -> None:
    """`algorithm.use_pf_ppo`: a reweight method hybridrl knows, and GAE (where veRL applies it)."""
    algo = config.algorithm
    if not algo.use_pf_ppo:
        return
    pf = algo.pf_ppo
    if pf.reweight_method not in PF_PPO_METHODS:
        raise config_error(
            f"algorithm.pf_ppo.reweight_method={pf.reweight_method!r} is not one of {', '.join(PF_PPO_METHODS)}"
        )
    if algo.adv_estimator != "gae":
        raise config_error(
            f"algorithm.use_pf_ppo=True with adv_estimator={algo.adv_estimator}: veRL resamples the batch "
            "(policy-filtered PPO) only after GAE and ignores the key otherwise; use adv_estimator=gae "
            "or set use_pf_ppo=False"
        )


def apply_verl_misc(config: Any, explicit_keys=None) -> None:
    """Map and check the keys above on a merged config (mutates it)."""
    explicit = None if explicit_keys is None else set(explicit_keys)
    apply_model_torch_dtype(config, explicit)
    check_legacy_worker_impl(config)
    check_pf_ppo(config)
