"""veRL's legacy spellings, applied on the driver after the schema merge.

- deprecated global micro-batch keys (`*.ppo_micro_batch_size`, `*.log_prob_micro_batch_size`,
  `critic.forward_micro_batch_size`, `reward_model.micro_batch_size`) become the per-GPU keys
  (divided by the number of data-parallel ranks, as veRL does) with a deprecation warning;
- `REFUSED`: keys accepted for veRL compatibility but not supported here raise a ConfigError
  naming the key, why, and what to use, when set to anything but their default.

These run on the typed config (they read the merged world size and Ulysses sizes); the caller is
the config stage (`hybridrl.trainer.ppo.config.run_config_stage`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from hybridrl.utils.config_loader import ConfigError, warn_once

__all__ = ["DEPRECATED_MICRO", "REFUSED", "check_refused", "convert_deprecated_micro_batches", "same_value"]


def get(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def put(config: Any, key: str, value: Any) -> None:
    head, _, last = key.rpartition(".")
    setattr(get(config, head) if head else config, last, value)


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
            raise ConfigError(f"{old}={value} is smaller than the {world} ranks; set {new} (per GPU) instead")
        if explicit_keys is not None and new in explicit_keys and get(config, new) != per_gpu:
            raise ConfigError(
                f"both {old}={value} (deprecated, global) and {new}={get(config, new)} are set; keep {new}"
            )
        warn_once(f"{old} is deprecated (global size); using {new}={per_gpu} ({value} / {world} ranks)")
        put(config, new, per_gpu)
        put(config, old, None)
        converted.add(new)
    return converted


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


def same_value(a: Any, b: Any) -> bool:
    if OmegaConf.is_config(a):
        a = OmegaConf.to_container(a)
    return a == b or (isinstance(a, dict) and not a and isinstance(b, dict) and not b)


def check_refused(config: Any) -> None:
    for r in REFUSED:
        value = get(config, r.key)
        if not same_value(value, r.default):
            raise ConfigError(
                f"{r.key}={value!r} is accepted for veRL compatibility but not supported here: "
                f"{r.why}. Leave it at {r.default!r} (docs/config.md lists these keys)"
            )
