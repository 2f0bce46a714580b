"""veRL's newest config layout (August 2026) on hybridrl's typed schema, applied before the merge.

`apply_verl_layout(node, explicit_keys)` runs in `load_config` on the composed config before it
is merged onto the typed schema, so both layouts work:

1. `MOVED`: keys veRL moved (the new `reward.*` section, `critic.fsdp.*`,
   `*.fsdp_config.ulysses_sequence_parallel_size`, ...) are renamed onto the key hybridrl reads
   (the old spelling). Where both spellings are given and differ, a ConfigError names both.
   `reward.reward_model.enable` / `reward.num_workers` act in veRL's reward loop (the only reward
   path of the newest veRL), so given through the new section they turn
   `reward_model.use_reward_loop` on (unless that key is set).
2. `verl_layout_refusals.ACCEPTED`: keys of veRL's yaml that hybridrl has no field for. Each is
   taken at the values that mean what hybridrl does (veRL's default, usually) and dropped;
   any other value is a ConfigError naming the key and why (never silently ignored).
3. `*.optim.min_lr` (an absolute floor) becomes `*.optim.min_lr_ratio` (the same floor over lr).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridrl.compat.user_keys import key_given as _given
from hybridrl.compat.user_keys import node_value as _old_value
from hybridrl.compat.verl_layout_refusals import LEAVES, SECTIONS, check_accepted, drop_key
from hybridrl.utils.config_loader import ConfigError

ARR = "actor_rollout_ref"
FSDP_FIELDS = (
    "param_offload",
    "optimizer_offload",
    "offload_policy",
    "reshard_after_forward",
    "forward_prefetch",
    "fsdp_size",
    "model_dtype",
    "mixed_precision",
    "wrap_policy",
)
REWARD_ROLLOUT_FIELDS = (
    "name",
    "dtype",
    "gpu_memory_utilization",
    "enforce_eager",
    "tensor_model_parallel_size",
    "max_model_len",
    "prompt_length",
    "response_length",
    "temperature",
    "top_k",
    "top_p",
    "do_sample",
    "n",
    "request_timeout_s",
)


def _moved() -> dict[str, str]:
    """{veRL's new key (or subtree): hybridrl's key}; a subtree maps every key below it."""
    moved = {}
    for role in ("actor", "ref"):
        for name in (
            "ulysses_sequence_parallel_size",
            "entropy_from_logits_with_chunking",
            "entropy_checkpointing",
            "use_torch_compile",
        ):
            moved[f"{ARR}.{role}.fsdp_config.{name}"] = f"{ARR}.{role}.{name}"
    for name in FSDP_FIELDS:
        moved[f"critic.fsdp.{name}"] = f"critic.model.fsdp_config.{name}"
    moved["critic.fsdp.ulysses_sequence_parallel_size"] = "critic.ulysses_sequence_parallel_size"
    moved.update(
        {
            "reward.num_workers": "reward_model.num_workers",
            "reward.custom_reward_function": "custom_reward_function",
            "reward.reward_manager.name": "reward_model.reward_manager",  # reward_manager.name follows it
            "reward.reward_manager.source": "reward_manager.source",
            "reward.reward_manager.module": "reward_manager.module",
            "reward.reward_kwargs": "reward_model.reward_kwargs",
            "reward.sandbox_fusion": "reward_model.sandbox_fusion",
            "reward.reward_model.enable": "reward_model.enable",
            "reward.reward_model.model_path": "reward_model.model.path",
            # the newest veRL's legacy spellings (its reward_model section, migrated by veRL itself)
            "sandbox_fusion": "reward_model.sandbox_fusion",
            "reward_model.reward_loop_source": "reward_manager.source",
            "reward_model.reward_loop_module_path": "reward_manager.module.path",
            "reward_model.reward_loop_class_name": "reward_manager.module.name",
        }
    )
    for name in REWARD_ROLLOUT_FIELDS:
        moved[f"reward.reward_model.rollout.{name}"] = f"reward_model.rollout.{name}"
    for optim in (f"{ARR}.actor.optim", "critic.optim"):  # veRL's Megatron optimizer's name of it
        moved[f"{optim}.lr_decay_style"] = f"{optim}.lr_scheduler_type"
    for name, ours in (  # veRL's model.lora (its Megatron LoRA) on the model's LoRA keys
        ("rank", "lora_rank"),
        ("alpha", "lora_alpha"),
        ("target_modules", "target_modules"),
        ("exclude_modules", "exclude_modules"),
        ("lora_A_init_method", "lora_init_a"),
    ):
        moved[f"{ARR}.model.lora.{name}"] = f"{ARR}.model.{ours}"
    for role in ("actor", "ref"):  # veRL's engine-level spelling (its new workers read this one)
        moved[f"{ARR}.{role}.megatron.router_replay"] = f"{ARR}.{role}.router_replay"
    for role, megatron in ((f"{ARR}.actor", f"{ARR}.actor.megatron"), ("critic", "critic.megatron")):
        # megatron-core OptimizerConfig fields: read by the Megatron engine with its other overrides
        moved[f"{role}.optim.override_optimizer_config"] = f"{megatron}.override_optimizer_config"
    return moved


MOVED = _moved()
LOOP_ONLY = ("reward.reward_model.enable", "reward.num_workers")  # act in veRL's reward loop


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    """{dotted key: value} of every leaf under `node` (a plain value is its own leaf)."""
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    out = {}
    for k, v in node.items():
        out.update(_leaves(v, f"{prefix}.{k}"))
    return out


def _pop(node: DictConfig, key: str) -> Any:
    """Remove `key` from `node` and return its value; parents left empty go too."""
    value = OmegaConf.select(node, key)
    value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    drop_key(node, key)
    return value


def _new_leaves(node: DictConfig) -> dict[str, tuple[str, Any]]:
    """{new key given in `node`: (hybridrl's key, value)} for every MOVED leaf present; the
    moved subtrees are removed from `node`."""
    found = {}
    for new in sorted(MOVED, key=len, reverse=True):  # deeper keys first (reward.reward_model.*)
        if OmegaConf.select(node, new, default="__absent__") == "__absent__":
            continue
        value = _pop(node, new)
        for leaf, v in _leaves(value, new).items():
            found[leaf] = (MOVED[new] + leaf[len(new) :], v)
    return found


def apply_moved(node: DictConfig, explicit_keys: set[str] | None, defaults: DictConfig) -> set[str]:
    """Rename veRL's new spellings in `node` onto hybridrl's keys; returns the keys set that way.

    defaults: the schema's defaults (OmegaConf.structured(PPOConfig)), which tell a value the user
    set from the yaml's when explicit_keys is None."""
    found = _new_leaves(node)
    set_here: set[str] = set()
    for new, (old, value) in found.items():
        if _given(old, explicit_keys, node, defaults) and _old_value(node, old) != value:
            raise ConfigError(
                f"{new}={value!r} (veRL's newer spelling) and {old}={_old_value(node, old)!r} disagree; "
                "set one of them"
            )
        if old in set_here:  # two new spellings of one key (e.g. reward.sandbox_fusion and sandbox_fusion)
            if _old_value(node, old) != value:
                raise ConfigError(
                    f"{new}={value!r} disagrees with another spelling of {old}; set one of them"
                )
            continue
        OmegaConf.update(node, old, value, force_add=True, merge=False)
        set_here.add(old)
    loop = "reward_model.use_reward_loop"
    if any(k in found for k in LOOP_ONLY) and not _given(loop, explicit_keys, node, defaults):
        if found.get("reward.reward_model.enable", (None, True))[1] is not False:
            OmegaConf.update(node, loop, True, force_add=True)
            set_here.add(loop)
    return set_here


def apply_min_lr(node: DictConfig, explicit_keys: set[str] | None, defaults: DictConfig) -> set[str]:
    """`*.optim.min_lr` (veRL's Megatron optimizer: the absolute floor of the decayed learning rate)
    -> `min_lr_ratio = min_lr / lr`, the same floor in hybridrl's schedule (engine/optim.py)."""
    set_here = set()
    for optim in (f"{ARR}.actor.optim", "critic.optim"):
        key = f"{optim}.min_lr"
        if OmegaConf.select(node, key, default="__absent__") == "__absent__":
            continue
        min_lr = float(_pop(node, key))
        lr = float(_old_value(node, f"{optim}.lr") or _old_value(defaults, f"{optim}.lr"))
        if lr <= 0 and min_lr != 0:
            raise ConfigError(f"{key}={min_lr} needs {optim}.lr > 0 (it becomes min_lr_ratio = min_lr / lr)")
        ratio, ratio_key = (min_lr / lr if lr > 0 else 0.0), f"{optim}.min_lr_ratio"
        if (
            _given(ratio_key, explicit_keys, node, defaults)
            and abs(_old_value(node, ratio_key) - ratio) > 1e-12
        ):
            raise ConfigError(
                f"{key}={min_lr} (= min_lr_ratio {ratio:g} of lr={lr:g}) and {ratio_key}="
                f"{_old_value(node, ratio_key)} disagree; set one of them"
            )
        OmegaConf.update(node, ratio_key, ratio, force_add=True)
        set_here.add(ratio_key)
    return set_here


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def layout_knows(key: str) -> bool:
    """Whether the config stage takes `key` although the yaml lacks it: a key veRL moved (MOVED, or
    below a moved subtree), or one of `verl_layout_refusals`' accepted leaves and sections (which
    take or refuse its value with a reason). The command line's unknown-key check asks this."""
    from hybridrl.compat.veomni import veomni_knows

    return (
        veomni_knows(key)
        or key in (f"{ARR}.actor.optim.min_lr", "critic.optim.min_lr")  # apply_min_lr
        or any(_under(key, new) for new in MOVED)
        or any(key == leaf.key for leaf in LEAVES)
        or any(_under(key, s.prefix) for s in SECTIONS)
    )


def apply_verl_layout(
    node: DictConfig, explicit_keys: set[str] | None, defaults: DictConfig
) -> set[str] | None:
    """Map veRL's newest layout onto hybridrl's keys in `node` (mutated); returns the explicit
    keys with the renamed ones added (None stays None: every key counts as set)."""
    from hybridrl.compat.veomni import apply_veomni  # model_engine=veomni, *.veomni.*

    veomni = apply_veomni(node, explicit_keys, defaults)  # first: it lands on veRL's FSDP spellings
    set_here = (
        veomni | apply_moved(node, explicit_keys, defaults) | apply_min_lr(node, explicit_keys, defaults)
    )
    check_accepted(node)
    if explicit_keys is None:
        return None
    return set(explicit_keys) | set_here
