"""`model_engine=veomni` and `*.veomni.*`: veRL's VeOmni engine on hybridrl's FSDP2 engine.

VeOmni is veRL's FSDP2-based training engine (verl/trainer/config/engine/veomni.yaml). Here
`model_engine=veomni` (and `*.strategy=veomni`) runs hybridrl's FSDP2 engine, and each
`<role>.veomni.<key>` (role: actor_rollout_ref.actor, actor_rollout_ref.ref, critic) is either

1. translated onto the veRL FSDP spelling that does the same (`veomni.param_offload` ->
   `fsdp_config.param_offload`, `veomni.ulysses_parallel_size` ->
   `fsdp_config.ulysses_sequence_parallel_size`, ...), which `verl_layout` then maps onto
   hybridrl's keys (or takes / refuses like any FSDP key);
2. accepted at the values that mean what hybridrl's FSDP engine does (VeOmni's default, mostly);
3. or refused with a one-line reason naming the key (expert parallelism, kernel backends other
   than `eager`, routing replay, ...).

A `veomni.*` key without `model_engine=veomni` (or that role's `strategy=veomni`) is refused. The
optimizer of a VeOmni role takes veRL's optim/veomni.yaml defaults where the user set none (cosine
schedule, lr 1e-3: they differ from veRL's FSDP optimizer); its `lr_min` becomes `min_lr`.
`apply_veomni` runs first in `verl_layout.apply_verl_layout`, on the composed config.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridrl.compat.user_keys import key_given
from hybridrl.compat.verl_layout_refusals import ANY, drop_key
from hybridrl.utils.config_loader import ConfigError

__all__ = ["ROLES", "apply_veomni", "veomni_knows"]

ARR = "actor_rollout_ref"
# {role section: the veRL FSDP engine section of that role, where the translations land}
ROLES = {
    f"{ARR}.actor": f"{ARR}.actor.fsdp_config",
    f"{ARR}.ref": f"{ARR}.ref.fsdp_config",
    "critic": "critic.fsdp",
}
# {veomni key: veRL's FSDP engine key doing the same}
TO_FSDP = {
    name: name
    for name in (
        "param_offload",
        "optimizer_offload",
        "fsdp_size",
        "forward_prefetch",
        "seed",
        "full_determinism",
        "use_torch_compile",
        "entropy_from_logits_with_chunking",
        "entropy_checkpointing",
        "forward_only",
        "pad_to_length",
        "pad_to_length_bucket",
    )
}
TO_FSDP["ulysses_parallel_size"] = "ulysses_sequence_parallel_size"
_PRINTED: set[str] = set()  # each translation message once per process

_KERNEL = (
    "VeOmni's {} kernel backends are not available; hybridrl runs the Hugging Face model's own (eager) ops"
)
_KERNELS = (
    "cross_entropy_loss",
    "rms_norm",
    "swiglu_mlp",
    "rotary_pos_emb",
    "rms_norm_gated",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "load_balancing_loss",
    "dsa_indexer",
    "dsa_attention",
    "mhc",
)
# {veomni key: (accepted values, why)}; any other value is refused with `why`
ACCEPTED: dict[str, tuple[Any, str]] = {
    "_target_": (ANY, "veRL's dataclass name"),
    "strategy": (("veomni",), "the engine is chosen by model_engine / <role>.strategy"),
    "expert_parallel_size": (
        (1,),
        "expert parallelism is not in hybridrl's FSDP engine (use model_engine=megatron with "
        "megatron.expert_model_parallel_size)",
    ),
    "mixed_precision": (
        (True,),
        "compute and master dtypes are fsdp_config.mixed_precision.* / model_dtype here (docs/config.md); "
        "set those instead of veomni.mixed_precision=False",
    ),
    "init_device": (ANY, "where weights are first built; the loaded model is the same"),
    "enable_full_shard": (
        (True,),
        "hybridrl's FSDP2 engine shards parameters, gradients and optimizer states (ZeRO-3); "
        "use fsdp_config.reshard_after_forward for ZeRO-2-like behaviour",
    ),
    "ckpt_manager": (("dcp",), "checkpoints are written by hybridrl's FSDP checkpoint manager"),
    "load_checkpoint_path": ((None,), "resume with trainer.resume_mode / trainer.resume_from_path"),
    "enable_fsdp_offload": ((False,), "use veomni.param_offload / veomni.optimizer_offload"),
    "enable_reentrant": (ANY, "only how activations are recomputed; the gradients are the same"),
    "attn_implementation": (
        ("flash_attention_2", "veomni_flash_attention_2_with_sp"),
        "hybridrl's FSDP path treats it like veRL's FSDP default (flash_attention_2, Ulysses SP wraps it): the "
        "model's attention is chosen as for any FSDP run; set <model>.override_config.attn_implementation "
        "to pick another",
    ),
    "moe_implementation": (
        ("fused", "eager"),
        "only the Hugging Face model's own MoE forward runs here (fused_triton and other kernels are not available)",
    ),
    "force_use_huggingface": (ANY, "hybridrl always builds the Hugging Face model"),
    "activation_gpu_limit": ((0.0, 0), "activation offloading is not implemented"),
    "basic_modules": (([],), "FSDP wraps the decoder layers (fsdp_config.wrap_policy)"),
    "router_replay._target_": (ANY, "veRL's dataclass name"),
    "router_replay.mode": (
        ("disabled",),
        "the VeOmni engine's routing replay is not read; the FSDP engine replays routing with "
        "actor_rollout_ref.actor.router_replay.mode (docs/moe.md)",
    ),
}
for _k in _KERNELS:
    ACCEPTED[f"{_k}_implementation"] = (("eager",), _KERNEL.format(_k))


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _given(node: DictConfig, key: str) -> Any:
    value = OmegaConf.select(node, key, default="__absent__")
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _set_by_user(key: str, explicit_keys: set[str] | None, node: DictConfig, defaults: DictConfig) -> bool:
    return key_given(key, explicit_keys, node, defaults)  # the layout's notion of "set"


def _uses_veomni(node: DictConfig, role: str) -> bool:
    return _given(node, "model_engine") == "veomni" or _given(node, f"{role}.strategy") == "veomni"


def _translate_role(
    node: DictConfig, role: str, explicit_keys: set[str] | None, defaults: DictConfig
) -> list[str]:
    """Move `<role>.veomni.*` onto the FSDP spelling (or take / refuse it); returns 'a -> b' lines."""
    section = _given(node, f"{role}.veomni")
    if section == "__absent__" or section is None:
        return []
    if not _uses_veomni(node, role):
        first = (
            sorted(_leaves(section, f"{role}.veomni"))[0] if isinstance(section, dict) and section else role
        )
        raise ConfigError(
            f"{first}: {role}.veomni.* configures veRL's VeOmni engine; set model_engine=veomni, or use the "
            f"FSDP spelling ({ROLES[role]}.*)"
        )
    drop_key(node, f"{role}.veomni")
    lines = []
    for name, value in _leaves(section, "").items():
        key = f"{role}.veomni.{name}"
        if name in TO_FSDP:
            target = f"{ROLES[role]}.{TO_FSDP[name]}"
            if _set_by_user(target, explicit_keys, node, defaults) and _given(node, target) != value:
                raise ConfigError(
                    f"{key}={value!r} and {target}={_given(node, target)!r} disagree; set one of them"
                )
            OmegaConf.update(node, target, value, force_add=True, merge=False)
            lines.append(f"{key} -> {target}")
            continue
        if name not in ACCEPTED:
            raise ConfigError(
                f"{key}: not a key of veRL's VeOmni engine config (engine/veomni.yaml); remove it"
            )
        ok, why = ACCEPTED[name]
        if ok is not ANY and value not in ok:
            raise ConfigError(f"{key}={value!r} is not supported: {why}")
    return lines


# veRL's optim/veomni.yaml defaults that differ from its FSDP optimizer's (the schema's defaults here)
OPTIM_DEFAULTS = {"lr": 1e-3, "lr_scheduler_type": "cosine"}
# {veomni optimizer key: (accepted values, why)}; lr_min becomes the FSDP spelling's min_lr
OPTIM_ACCEPTED = {
    "lr_start": ((0.0, 0), "the warmup starts from 0 here"),
    "lr_decay_ratio": ((1.0, 1), "the schedule decays over all training steps here"),
}
_OPTIMS = {f"{ARR}.actor": f"{ARR}.actor.optim", "critic": "critic.optim"}


def _veomni_optim(
    node: DictConfig, role: str, explicit_keys: set[str] | None, defaults: DictConfig
) -> list[str]:
    """The optimizer of a VeOmni role: veRL's optim/veomni.yaml defaults where the user set none,
    `lr_min` -> `min_lr` (verl_layout turns it into min_lr_ratio), the rest accepted or refused."""
    optim, lines = _OPTIMS[role], []
    for name, value in OPTIM_DEFAULTS.items():
        if not _set_by_user(f"{optim}.{name}", explicit_keys, node, defaults):
            OmegaConf.update(node, f"{optim}.{name}", value, force_add=True)
            lines.append(f"{optim}.{name}={value} (veRL's optim/veomni.yaml default)")
    if _given(node, f"{optim}.lr_min") != "__absent__":
        value = _given(node, f"{optim}.lr_min")
        drop_key(node, f"{optim}.lr_min")
        OmegaConf.update(node, f"{optim}.min_lr", value, force_add=True)
        lines.append(f"{optim}.lr_min -> {optim}.min_lr")
    for name, (ok, why) in OPTIM_ACCEPTED.items():
        value = _given(node, f"{optim}.{name}")
        if value == "__absent__":
            continue
        if value not in ok:
            raise ConfigError(f"{optim}.{name}={value!r} is not supported: {why}")
        drop_key(node, f"{optim}.{name}")
    return lines


def apply_veomni(node: DictConfig, explicit_keys: set[str] | None, defaults: DictConfig) -> set[str]:
    """Translate `model_engine=veomni`, `<role>.strategy=veomni` and `<role>.veomni.*` in `node`
    (mutated) onto hybridrl's FSDP2 engine; returns the keys it set.

    Args:
        explicit_keys: the keys the user set (None: a value other than the schema's counts as set).
        defaults: the schema's defaults (as in `verl_layout.apply_verl_layout`).

    Raises:
        ConfigError: a veomni key at a value the FSDP engine cannot honour (the message names it),
            or veomni keys without model_engine=veomni.
    """
    set_here: set[str] = set()
    lines = []
    for role in ROLES:
        for line in _translate_role(node, role, explicit_keys, defaults):
            lines.append(line)
            set_here.add(line.split(" -> ")[1])
    for role in _OPTIMS:
        if _uses_veomni(node, role):
            optim_lines = _veomni_optim(node, role, explicit_keys, defaults)
            lines += optim_lines
            set_here |= {line.split("=")[0] for line in optim_lines if " -> " not in line}
    for role in ROLES:
        if _given(node, f"{role}.strategy") == "veomni":
            OmegaConf.update(node, f"{role}.strategy", "fsdp", force_add=True)
            lines.append(f"{role}.strategy=veomni -> fsdp")
            set_here.add(f"{role}.strategy")
    if _given(node, "model_engine") == "veomni":
        OmegaConf.update(node, "model_engine", "dp", force_add=True)
        lines.insert(0, "model_engine=veomni -> dp")
        set_here.add("model_engine")
    if lines:
        message = (
            "[hybridrl] VeOmni is veRL's FSDP2-based engine; hybridrl runs its FSDP2 engine with these "
            "translations: " + "; ".join(lines)
        )
        if message not in _PRINTED:
            _PRINTED.add(message)
            print(message)
    return set_here


def veomni_knows(key: str) -> bool:
    """Whether `key` is a `<role>.veomni.*` key the config stage takes (or refuses with a reason)."""
    return any(key.startswith(f"{role}.veomni.") or key == f"{role}.veomni" for role in ROLES)
