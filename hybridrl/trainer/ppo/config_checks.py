"""The config stage's own checks and small-batch defaults, run on the driver after the schema merge.

`run_config_checks(config, explicit_keys)` (called by `load_config`, before validation):
1. veRL's deprecated global micro-batch keys become the per-GPU keys (`hybridrl.compat.verl_legacy`);
2. a default micro-batch size the user did not set that does not fit the per-rank mini-batch is
   replaced by the largest size that does (said once); an explicit one is left to the check;
3. keys accepted for veRL compatibility but not supported here are refused (`verl_legacy.REFUSED`);
4. rollout correction, the reward side and the profiler keys are checked;
5. engine-only rollout keys set with `rollout.name=hf` are listed in one warning.
"""

from __future__ import annotations

from typing import Any

from hybridrl import algos
from hybridrl.compat.verl_legacy import (
    check_refused,
    convert_deprecated_micro_batches,
    data_parallel_ranks,
    get,
    same_value,
)
from hybridrl.config.rollout import RolloutConfig
from hybridrl.trainer.ppo.reward_kwargs import link_reward_manager, reward_manager_kwargs
from hybridrl.utils.config_loader import ConfigError, warn_once
from hybridrl.utils.profiler import check_profiler


def config_error(message: str) -> Exception:
    return ConfigError(message)


def is_explicit(key: str, explicit_keys) -> bool:
    """Whether the user set `key` (None: everything counts as set)."""
    return explicit_keys is None or key in explicit_keys


# ---------------------------------------------------------------- small configs just work
def largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def fit_default_micro_batches(config: Any, explicit_keys) -> None:
    """A micro-batch default that does not fit the per-rank mini-batch shrinks to one that does."""
    n = config.actor_rollout_ref.rollout.n
    roles = ["actor_rollout_ref.actor"]
    est = config.algorithm.adv_estimator
    if est in algos.list_adv_estimators() and algos.estimator_needs_critic(est):
        roles.append("critic")
    notes = []
    for role in roles:
        section, full = get(config, role), f"{role}.ppo_micro_batch_size_per_gpu"
        micro, rows = section.ppo_micro_batch_size_per_gpu, section.ppo_mini_batch_size * n
        world = data_parallel_ranks(config, full)
        if is_explicit(full, explicit_keys) or section.use_dynamic_bsz or micro is None or rows % world:
            continue
        per_rank = rows // world
        if per_rank % micro:
            section.ppo_micro_batch_size_per_gpu = largest_divisor_at_most(per_rank, micro)
            notes.append(f"{full}={section.ppo_micro_batch_size_per_gpu}")
    if notes:
        warn_once(
            f"the default micro-batch size ({micro}) does not fit the per-rank mini-batch of {per_rank} rows; "
            f"using {', '.join(notes)} (set the key to choose)"
        )


# ---------------------------------------------------------------- engine-only keys with rollout.name=hf
ENGINE_ONLY = (
    "gpu_memory_utilization",
    "enforce_eager",
    "free_cache_engine",
    "load_format",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "disable_log_stats",
    "scheduling_policy",
    "logprobs_mode",
    "cudagraph_capture_sizes",
    "engine_kwargs",
    "layered_summon",
    "multi_stage_wake_up",  # the HF engine never sleeps: the wake-up order has no memory effect
)


def engine_only_warning(config: Any, explicit_keys) -> list[str]:
    """With rollout.name=hf, the vLLM/SGLang keys the user set: one warning listing them."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.name != "hf" or explicit_keys is None:  # unknown which keys the user set: stay quiet
        return []
    default = RolloutConfig(name="hf")
    base = "actor_rollout_ref.rollout."
    keys = [
        base + k for k in ENGINE_ONLY
        if (base + k in explicit_keys or any(e.startswith(base + k + ".") for e in explicit_keys))
        and not same_value(getattr(rollout, k), getattr(default, k))
    ]  # fmt: skip
    if keys:
        warn_once(f"rollout.name=hf ignores these vLLM/SGLang keys: {', '.join(keys)}")
    return keys


def check_rollout_correction(config: Any) -> None:
    algo = config.algorithm
    rc = algo.rollout_correction
    key = "algorithm.rollout_correction"
    if rc.rollout_is is not None and rc.rollout_is not in ("token", "sequence"):
        raise config_error(f"{key}.rollout_is={rc.rollout_is!r} is not one of null, token, sequence")
    if rc.rollout_rs is not None and algos.is_kl_rs(rc.rollout_rs):  # veRL's estimator options
        try:
            algos.parse_kl_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            raise config_error(f"{key}.rollout_rs={rc.rollout_rs!r}: {e}") from None
    elif rc.rollout_rs is not None and rc.rollout_rs not in ("token", "sequence", "geometric"):
        raise config_error(
            f"{key}.rollout_rs={rc.rollout_rs!r} is not one of null, token, sequence, geometric, or "
            f"comma-joined options among {', '.join(algos.rollout_rs.KL_RS_OPTIONS)}"
        )
    active = rc.rollout_is is not None or rc.rollout_rs is not None or rc.bypass_mode
    if active and algo.rollout_is:
        raise config_error(
            f"both algorithm.rollout_is and {key}.* are set; use one spelling ({key}.* is veRL's current one)"
        )
    if active and not config.actor_rollout_ref.rollout.calculate_log_probs:
        raise config_error(
            f"{key}.* needs the rollout engine's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=True"
        )
    try:
        algos.parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        raise config_error(
            f"{key}.rollout_is_threshold={rc.rollout_is_threshold!r}: {e}; give a number U (truncate at U) or "
            "'lower_upper' (IcePop: 0 outside [lower, upper]) with 0 < lower <= upper"
        ) from None
    if algos.is_kl_rs(rc.rollout_rs):
        return
    try:
        lower, upper = algos.parse_rs_threshold(rc.rollout_rs_threshold, rc.rollout_is_threshold)
    except ValueError:
        raise config_error(
            f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold!r}: use 'lower_upper' (e.g. 0.5_2.0) or a number"
        ) from None
    if not 0 <= lower < upper:
        raise config_error(
            f"{key}.rollout_rs_threshold gives lower={lower} >= upper={upper}; use lower < upper"
        )


def check_profiler_keys(config: Any) -> None:
    arr = config.actor_rollout_ref
    roles = {
        "actor_rollout_ref.actor": arr.actor.profiler,
        "actor_rollout_ref.ref": arr.ref.profiler,
        "actor_rollout_ref.rollout": arr.rollout.profiler,
        "critic": config.critic.profiler,
    }
    try:
        check_profiler(config.global_profiler, roles)
    except ValueError as e:
        raise config_error(str(e)) from None


def check_reward_side(config: Any, explicit_keys) -> None:
    """reward_model.reward_kwargs against its other spellings; the reward loop's keys."""
    try:
        link_reward_manager(config, explicit_keys)
        reward_manager_kwargs(config)
    except ValueError as e:
        raise config_error(str(e)) from None
    rm = config.reward_model
    key = "reward_model"
    if rm.sandbox_fusion.url and config.custom_reward_function.path:
        raise config_error(
            f"{key}.sandbox_fusion.url is used by the built-in code scorer; with custom_reward_function.path, "
            "call the sandbox from your function (or drop one of them)"
        )
    if rm.sandbox_fusion.max_concurrent < 1:
        raise config_error(f"{key}.sandbox_fusion.max_concurrent must be >= 1")
    if not rm.use_reward_loop:
        set_keys = sorted(
            k for k in (explicit_keys or ()) if k.startswith(f"{key}.rollout.") or k == f"{key}.num_workers"
        )
        if set_keys:
            warn_once(f"{', '.join(set_keys)} only act with {key}.use_reward_loop=True (veRL's reward loop)")
        return
    if rm.num_workers < 1:
        raise config_error(f"{key}.num_workers={rm.num_workers} must be >= 1")
    if rm.rollout.name not in ("hf", "vllm"):
        raise config_error(
            f"{key}.rollout.name={rm.rollout.name!r}: the reward loop serves the reward model with vllm or hf "
            "(sglang/trtllm reward serving is not available here)"
        )
    slots = config.trainer.nnodes * config.trainer.n_gpus_per_node
    tp = rm.rollout.tensor_model_parallel_size
    if rm.enable and (tp < 1 or slots % tp):
        raise config_error(f"{key}.rollout.tensor_model_parallel_size={tp} must divide the {slots} slots")
    if rm.enable and config.custom_reward_function.path:
        check_genrm(config)


def check_genrm(config: Any) -> None:
    """A generative reward model (reward loop + enable + custom_reward_function.path): checks (genrm.py)."""
    from hybridrl.trainer.ppo.genrm_config import check_genrm_config

    check_genrm_config(config, config_error)


def link_critic_rollout_n(config: Any, explicit_keys) -> None:
    n = config.actor_rollout_ref.rollout.n
    c = config.critic
    if explicit_keys is not None and "critic.rollout_n" in explicit_keys and c.rollout_n != n:
        raise config_error(
            f"critic.rollout_n={c.rollout_n} differs from actor_rollout_ref.rollout.n={n}; leave it unset"
        )
    c.rollout_n = n


def run_config_checks(config: Any, explicit_keys=None) -> None:
    """Apply the small-batch defaults and veRL's legacy spellings to a merged, derived config and check it (mutates it)."""
    explicit = None if explicit_keys is None else set(explicit_keys)
    converted = convert_deprecated_micro_batches(config, explicit)
    if explicit is not None:
        explicit |= converted
    fit_default_micro_batches(config, explicit)
    link_critic_rollout_n(config, explicit)
    check_refused(config)
    check_rollout_correction(config)
    check_reward_side(config, explicit)
    check_profiler_keys(config)
    engine_only_warning(config, explicit)
