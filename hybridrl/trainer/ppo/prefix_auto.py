"""`actor_rollout_ref.actor.use_prefix_grouper`: true / false as given, `auto` decided here at start-up.

`auto` (hybridrl's default; veRL's is false) turns the shared-prompt forward
(`engine/prefix_group.py`) on when it can only help: the run samples several responses
per prompt (`rollout.n > 1`) for an estimator that compares the responses of one prompt
(`algos.estimator_groups_by_prompt`: grpo, rloo, grpo_passk, opo, gpg, gdpo, ...), on the FSDP
engine, without Ulysses SP, on a model the grouper supports (`prefix_group.model_refusal`:
no sliding-window attention, a forward that passes the layout down to attention; of the
vision-language models, Qwen2-VL, Qwen2.5-VL and Qwen3-VL). Otherwise it
is off. The decision and its reason are printed once; the config then holds a plain bool, so the
workers see what the driver decided. Measured gain: bench/prefix_grouper.py (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

from hybridrl import algos
from hybridrl.utils.config_loader import ConfigError

KEY = "actor_rollout_ref.actor.use_prefix_grouper"
FSDP_STRATEGIES = ("fsdp", "fsdp2")


def _model_config(path: str | None, trust_remote_code: bool) -> Any:
    """The model's HF config, or None when it cannot be read here (a hub id not cached)."""
    from transformers import AutoConfig

    from hybridrl.models.builtin import resolve_model_path

    if not path:
        return None
    try:
        return AutoConfig.from_pretrained(resolve_model_path(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None


def auto_decision(config: Any, hf_config: Any) -> tuple[bool, str]:
    """(on, reason) of `use_prefix_grouper: auto` for this run.

    Args:
        config: the PPO config (rollout.n, algorithm.adv_estimator, the actor's strategy and SP).
        hf_config: the actor model's transformers config, or None when it could not be read.
    """
    arr, estimator = config.actor_rollout_ref, config.algorithm.adv_estimator
    a = arr.actor
    if arr.rollout.n < 2:
        return False, f"rollout.n={arr.rollout.n}: no prompt is shared by two rows"
    if not algos.estimator_groups_by_prompt(estimator):
        return False, f"algorithm.adv_estimator={estimator} does not compare the responses of one prompt"
    if a.strategy not in FSDP_STRATEGIES:
        return False, f"actor.strategy={a.strategy}: the shared-prompt forward is built for the FSDP engine"
    if a.ulysses_sequence_parallel_size > 1:
        return False, f"actor.ulysses_sequence_parallel_size={a.ulysses_sequence_parallel_size} (Ulysses SP)"
    if arr.model.enable_gradient_checkpointing:
        return False, GRAD_CKPT
    dist = getattr(config, "distillation", None)
    if dist is not None and dist.enabled and "topk" in str(dist.distillation_loss.loss_mode):
        return (
            False,
            f"distillation loss_mode={dist.distillation_loss.loss_mode} (top-k: not with the grouper)",
        )
    if hf_config is None:
        return False, f"the model config of {arr.model.path!r} cannot be read here to check the model"
    from hybridrl.engine.prefix_group import model_refusal

    refusal = model_refusal(hf_config)
    if refusal is not None:
        return False, refusal
    return True, f"rollout.n={arr.rollout.n} responses per prompt for {estimator}, FSDP, a supported model"


GRAD_CKPT = (
    "model.enable_gradient_checkpointing=True: the grouped attention is set for the forward only, and the "
    "backward's recomputation would run the plain attention"
)


def _check_explicit(a: Any, model: Any) -> None:
    """use_prefix_grouper=True where it cannot run fails here (as veRL refuses it)."""
    if model.enable_gradient_checkpointing:
        raise ConfigError(f"{KEY}=True with {GRAD_CKPT}; set one of them to false")
    if a.strategy not in FSDP_STRATEGIES:
        raise ConfigError(
            f"{KEY}=True with strategy={a.strategy}: the shared-prompt forward is built for the FSDP "
            "engine (as in veRL); set it to false"
        )
    if a.ulysses_sequence_parallel_size > 1:
        raise ConfigError(
            f"{KEY}=True with ulysses_sequence_parallel_size={a.ulysses_sequence_parallel_size}: the two "
            "do not combine (as in veRL); use one of them"
        )


def resolve_prefix_grouper(config: Any, hf_config: Any = "read") -> bool:
    """Turn the key into a bool on the driver (mutates `config`); print the decision of `auto` once.

    Args:
        hf_config: the actor model's config; "read" loads it from `actor_rollout_ref.model.path`.

    Raises:
        ConfigError: a value other than true / false / auto, or true where it cannot run.
    """
    a = config.actor_rollout_ref.actor
    value = a.use_prefix_grouper
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if value is True or value is False:
        a.use_prefix_grouper = value
        if value:
            _check_explicit(a, config.actor_rollout_ref.model)
        return value
    if value != "auto":
        raise ConfigError(f"{KEY}={value!r}: expected true, false or auto (hybridrl's default)")
    if hf_config == "read":
        m = config.actor_rollout_ref.model
        hf_config = _model_config(m.path, m.trust_remote_code)
    on, reason = auto_decision(config, hf_config)
    a.use_prefix_grouper = on
    print(f"[hybridrl] {KEY}=auto -> {'on' if on else 'off'}: {reason}")
    return on
