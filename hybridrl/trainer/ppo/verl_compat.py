"""veRL spellings and defaults, applied once on the driver after the schema merge.

`apply_verl_compat(config, explicit_keys)` (called by `load_config`, before validation):
1. deprecated global micro-batch keys (`*.ppo_micro_batch_size`, `*.log_prob_micro_batch_size`,
   `critic.forward_micro_batch_size`, `reward_model.micro_batch_size`) become the per-GPU keys
   (divided by the number of ranks, as veRL does) with a deprecation warning;
2. a default micro-batch size the user did not set that does not fit the per-rank mini-batch is
   replaced by the largest size that does (said once); an explicit one is left to the check;
3. `REFUSED`: keys accepted for compatibility but not supported here raise a ConfigError naming
   the key, why, and what to use, when set to anything but their default;
4. engine-only rollout keys set with `rollout.name=hf` are listed in one warning.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from hybridrl import algos
from hybridrl.config.rollout import RolloutConfig
from hybridrl.trainer.ppo.reward_kwargs import link_reward_manager, reward_manager_kwargs
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.profiler import check_profiler

WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Print a hybridrl warning to stderr, once per process and message."""
    if message not in WARNED:
        WARNED.add(message)
        print(f"hybridrl: {message}", file=sys.stderr)


def config_error(message: str) -> Exception:
    return ConfigError(message)


def get(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def put(config: Any, key: str, value: Any) -> None:
    head, _, last = key.rpartition(".")
    setattr(get(config, head) if head else config, last, value)


def is_explicit(key: str, explicit_keys) -> bool:
    """Whether the user set `key` (None: everything counts as set)."""
    return explicit_keys is None or key in explicit_keys


# ---------------------------------------------------------------- deprecated global micro-batches
DEPRECATED_MICRO = (
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    ),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ),
    ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
    ("critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu"),
    ("reward_model.micro_batch_size", "reward_model.micro_batch_size_per_gpu"),
)


def data_parallel_ranks(config: Any, key: str) -> int:
    """Ranks that see distinct rows for the section holding `key`: world / its Ulysses SP size
    (veRL divides global sizes by the same; the rollout's log-prob pass runs on the actor)."""
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    section = {"actor_rollout_ref.rollout": "actor_rollout_ref.actor"}.get(
        key.rpartition(".")[0], key.rpartition(".")[0]
    )
    sp = getattr(get(config, section), "ulysses_sequence_parallel_size", 1) or 1
    return max(1, world // sp) if world % sp == 0 else world


def convert_deprecated_micro_batches(config: Any, explicit_keys) -> set[str]:
    """Global sizes -> per-GPU sizes (floor division by the data-parallel ranks, >= 1); returns
    the keys set."""
    converted = set()
    for old, new in DEPRECATED_MICRO:
        value = get(config, old)
        if value is None:
            continue
        world = data_parallel_ranks(config, old)
        per_gpu = value // world
        if per_gpu < 1:
            raise config_error(
                f"{old}={value} is smaller than the {world} ranks; set {new} (per GPU) instead"
            )
        if explicit_keys is not None and new in explicit_keys and get(config, new) != per_gpu:
            raise config_error(
                f"both {old}={value} (deprecated, global) and {new}={get(config, new)} are set; keep {new}"
            )
        warn_once(f"{old} is deprecated (global size); using {new}={per_gpu} ({value} / {world} ranks)")
        put(config, new, per_gpu)
        put(config, old, None)
        converted.add(new)
    return converted


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


# ---------------------------------------------------------------- accepted here, not supported
@dataclass(frozen=True)
class Refused:
    key: str
    default: Any
    why: str


REFUSED: tuple[Refused, ...] = (
    Refused(
        "actor_rollout_ref.hybrid_engine",
        True,
        "hybridrl always colocates training and rollout (hybrid engine)",
    ),
    Refused(
        "data.return_raw_input_ids",
        False,
        "the RL dataset does not return raw input ids; the reward model "
        "re-tokenizes the decoded text with its own tokenizer, which covers what they are used for in veRL",
    ),
    Refused("reward_model.strategy", "fsdp", "the reward model always runs on the FSDP engine"),
    Refused(
        "reward_model.use_dynamic_bsz", False, "the reward model uses reward_model.micro_batch_size_per_gpu"
    ),
    Refused(
        "reward_model.forward_max_token_len_per_gpu",
        32768,
        "only used with dynamic batch size, not supported for the reward model",
    ),
    Refused(
        "reward_model.launch_reward_fn_async",
        False,
        "rule rewards are scored on the driver (reward_manager=prime scores them in parallel)",
    ),
    Refused(
        "reward_model.ulysses_sequence_parallel_size",
        1,
        "Ulysses sequence parallelism is implemented for the actor, reference and critic, not for the reward model",
    ),
    Refused("reward_model.model.use_shm", False, "load the reward model from a local folder"),
    Refused(
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype",
        "fp32",
        "FSDP2 keeps buffers as loaded",
    ),
    Refused(
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.buffer_dtype",
        "fp32",
        "FSDP2 keeps buffers as loaded",
    ),
    Refused("critic.model.fsdp_config.mixed_precision.buffer_dtype", "fp32", "FSDP2 keeps buffers as loaded"),
    Refused(
        "reward_model.model.fsdp_config.mixed_precision.buffer_dtype", "fp32", "FSDP2 keeps buffers as loaded"
    ),
    Refused(
        "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params",
        0,
        "FSDP2 shards per decoder layer; use wrap_policy.transformer_layer_cls_to_wrap",
    ),
    Refused(
        "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params",
        0,
        "FSDP2 shards per decoder layer; use wrap_policy.transformer_layer_cls_to_wrap",
    ),
    Refused(
        "critic.model.fsdp_config.wrap_policy.min_num_params",
        0,
        "FSDP2 shards per decoder layer; use wrap_policy.transformer_layer_cls_to_wrap",
    ),
    Refused(
        "reward_model.model.fsdp_config.wrap_policy.min_num_params",
        0,
        "FSDP2 shards per decoder layer; use wrap_policy.transformer_layer_cls_to_wrap",
    ),
    Refused("trainer.default_hdfs_dir", None, "no HDFS client here; copy trainer.default_local_dir yourself"),
    Refused(
        "trainer.ray_wait_register_center_timeout",
        300,
        "workers start through Ray directly (no register center)",
    ),
    Refused("ray_kwargs.timeline_json_file", None, "use global_profiler.tool=torch for traces"),
)


def _same(a: Any, b: Any) -> bool:
    if OmegaConf.is_config(a):
        a = OmegaConf.to_container(a)
    return a == b or (isinstance(a, dict) and not a and isinstance(b, dict) and not b)


def check_refused(config: Any) -> None:
    for r in REFUSED:
        value = get(config, r.key)
        if not _same(value, r.default):
            raise config_error(
                f"{r.key}={value!r} is accepted for veRL compatibility but not supported here: "
                f"{r.why}. Leave it at {r.default!r} (docs/config.md lists these keys)"
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
        and not _same(getattr(rollout, k), getattr(default, k))
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


def apply_verl_compat(config: Any, explicit_keys=None) -> None:
    """Apply the veRL spellings and defaults to a merged, derived config (mutates it)."""
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
