"""AReaL's and veRL v1's asynchronous-training keys on main_async's command line.

`translate_argv(argv)` rewrites the keys AReaL users write (its gsm8k GRPO config:
`allocation_mode`, `rollout.*`, `actor.*`, `weight_update_mode`, ...) and veRL's newest async
trainer selects (`trainer.use_v1`, `trainer.v1.trainer_mode=separate_async|colocate_async`,
`trainer.v1.*`, docs/advance/v1_async_trainer.md in veRL's tree) into hybridrl keys, prints the
translation once, and refuses, with the reason, what hybridrl cannot do. The table is in
docs/async.md ("AReaL keys" and "veRL v1 keys").
"""

from __future__ import annotations

import re
from collections.abc import Callable

from hybridrl.utils.config_loader import ConfigError

__all__ = ["AT", "allocation_overrides", "selects_v1_async", "translate_argv", "weight_update_overrides"]

AT = "async_training"

# AReaL key -> hybridrl key (same value)
RENAMES = {
    "rollout.max_concurrent_rollouts": f"{AT}.max_concurrent_rollouts",
    "rollout.queue_size": f"{AT}.queue_size",
    "rollout.consumer_batch_size": f"{AT}.consumer_batch_size",
    "rollout.max_head_offpolicyness": f"{AT}.max_head_offpolicyness",
    "actor.recompute_logprob": f"{AT}.recompute_logprob",
    "actor.use_decoupled_loss": f"{AT}.use_decoupled_loss",
    "actor.behave_imp_weight_cap": f"{AT}.behave_imp_weight_cap",
    "gconfig.n_samples": "actor_rollout_ref.rollout.n",
    "gconfig.max_new_tokens": "actor_rollout_ref.rollout.response_length",
    "gconfig.temperature": "actor_rollout_ref.rollout.temperature",
    "train_dataset.batch_size": "data.train_batch_size",
    "actor.path": "actor_rollout_ref.model.path",
    "actor.eps_clip": "actor_rollout_ref.actor.clip_ratio",
    "actor.optimizer.lr": "actor_rollout_ref.actor.optim.lr",
    # veRL v1
    "trainer.v1.sampler.max_off_policy_threshold": f"{AT}.max_head_offpolicyness",
}
V1_MODES = ("separate_async", "colocate_async")
_PART = re.compile(r"^d(\d+)p(\d+)t(\d+)$")
_printed = False


def _split(arg: str) -> tuple[str, str, str] | None:
    """('+' or '', key, value) of a `key=value` override, None for anything else."""
    if "=" not in arg or arg.startswith("-"):
        return None
    key, value = arg.split("=", 1)
    plus = "+" if key.startswith("+") and not key.startswith("++") else ""
    return plus, key.lstrip("+"), value


def _bool(key: str, value: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ConfigError(f"{key}={value!r} must be true or false")


def allocation_overrides(value: str) -> list[str]:
    """AReaL's `allocation_mode` (`<engine>:d{D}p{P}t{T}+d{D}p{P}t{T}`, rollout first) as hybridrl keys.

    The rollout part is D engines of T TP ranks each: D x T rollout slots (one worker per TP rank)
    and rollout.tensor_model_parallel_size = T (vLLM only; rollout_tp.py says why not SGLang).
    """
    fix = "write it as <sglang|vllm>:d<D>p1t<T>+d<D>p1t1 (rollout engines x TP + training devices)"
    engine, _, parts = value.partition(":") if ":" in value else value.partition(".")
    halves = parts.split("+")
    if engine not in ("sglang", "vllm") or len(halves) != 2:
        raise ConfigError(f"allocation_mode={value!r}: main_async needs a rollout and a training part; {fix}")
    (rd, rp, rt), (td, tp, tt) = (_parse_part(value, h, fix) for h in halves)
    if rp != 1 or tp != 1:
        raise ConfigError(f"allocation_mode={value!r}: pipeline parallelism (p > 1) is not translated; {fix}")
    if rt != 1 and engine != "vllm":
        raise ConfigError(
            f"allocation_mode={value!r}: rollout tensor parallelism (t > 1) in asynchronous mode is checked with "
            f"vllm only (SGLang's TP engine is one process driving t devices; untested); write vllm:d{rd}p1t{rt}+... "
            f"or {fix}"
        )
    if tt != 1:
        raise ConfigError(
            f"allocation_mode={value!r}: training tensor parallelism is Megatron's; set "
            "actor_rollout_ref.actor.strategy=megatron and its megatron.tensor_model_parallel_size yourself, "
            f"or {fix}"
        )
    return [
        f"actor_rollout_ref.rollout.name={engine}",
        f"{AT}.rollout_n_gpus_per_node={rd * rt}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rt}",
        f"trainer.n_gpus_per_node={td}",
    ]


def _parse_part(value: str, part: str, fix: str) -> tuple[int, int, int]:
    m = _PART.match(part)
    if not m:
        raise ConfigError(f"allocation_mode={value!r}: cannot read {part!r}; {fix}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def weight_update_overrides(value: str) -> list[str]:
    """AReaL's weight_update_mode: xccl (a collective broadcast) or disk (a copy through storage)."""
    modes = {"xccl": "collective", "disk": "object_store"}
    if value not in modes:
        raise ConfigError(
            f"weight_update_mode={value!r}: use xccl ({AT}.weight_update_mode=collective) or disk "
            f"({AT}.weight_update_mode=object_store, the Ray object store stands in for the disk)"
        )
    return [f"{AT}.weight_update_mode={modes[value]}"]


def _checkpoint_engine(value: str) -> list[str] | None:
    """veRL's rollout.checkpoint_engine.backend on main_async: nccl is the collective path; naive
    (and anything else) stays the rollout key it is (naive: the object-store path in async mode)."""
    if value == "nccl":
        return [f"{AT}.weight_update_mode=collective"]
    return None


def selects_v1_async(argv: list[str]) -> bool:
    """Whether a (main_ppo) command line selects veRL's v1 asynchronous trainers."""
    keys = {s[1]: s[2] for s in map(_split, argv) if s is not None}
    return (
        _bool("trainer.use_v1", keys.get("trainer.use_v1", "false"))
        and keys.get("trainer.v1.trainer_mode", "sync") in V1_MODES
    )


def _v1(keys: dict[str, str], gpu: Callable[[], bool]) -> list[str]:
    """veRL v1's mode and placement as hybridrl keys (veRL runs partial rollout in both modes)."""
    mode = keys.pop("trainer.v1.trainer_mode", "sync")
    use_v1 = _bool("trainer.use_v1", keys.pop("trainer.use_v1", "false"))
    if not use_v1:
        if any(k.startswith("trainer.v1.") for k in keys) or mode != "sync":
            raise ConfigError("trainer.v1.* is read with trainer.use_v1=true only; set trainer.use_v1=true")
        return []
    if mode not in V1_MODES:
        raise ConfigError(
            f"trainer.v1.trainer_mode={mode!r} on main_async: use separate_async or colocate_async "
            "(sync is main_ppo, the synchronous trainer)"
        )
    out = [f"{AT}.partial_rollout=true"]
    if mode == "separate_async":
        out += [
            f"{AT}.rollout_nnodes={keys.pop('actor_rollout_ref.rollout.nnodes', '1')}",
            f"{AT}.rollout_n_gpus_per_node={keys.pop('actor_rollout_ref.rollout.n_gpus_per_node', '1')}",
        ]
    elif gpu():
        raise ConfigError(
            "trainer.v1.trainer_mode=colocate_async: rollout and training sharing the same GPUs in asynchronous "
            "mode is not implemented; use separate_async (own rollout GPUs) or main_ppo"
        )
    else:  # CPU: the rollout pool has the training pool's shape, on the same machine
        out += [
            f"{AT}.rollout_nnodes={keys.get('trainer.nnodes', '1')}",
            f"{AT}.rollout_n_gpus_per_node={keys.get('trainer.n_gpus_per_node', '1')}",
        ]
    return out + _v1_options(keys, mode)


def _v1_options(keys: dict[str, str], mode: str) -> list[str]:
    strategy = keys.pop("trainer.v1.sampler.max_off_policy_strategy", "wait")
    if strategy != "wait":
        raise ConfigError(
            f"trainer.v1.sampler.max_off_policy_strategy={strategy!r}: hybridrl never drops groups; its producer "
            "gate stops generating before a group could pass the threshold and the consumer waits for it. "
            "Use wait"
        )
    if _bool("switch", keys.pop("trainer.v1.separate_async.hybrid_rollout.enable_switch", "false")):
        raise ConfigError(
            "trainer.v1.separate_async.hybrid_rollout.enable_switch=true: lending trainer devices to rollout "
            "between steps is not implemented; set it false"
        )
    for key in [k for k in keys if k.startswith("trainer.v1.separate_async.hybrid_rollout.")]:
        keys.pop(key)  # veRL: ignored unless enable_switch=true
    sync_step = keys.pop("trainer.v1.separate_async.parameter_sync_step", None)
    if sync_step is not None:
        b = keys.get("data.train_batch_size")
        mb = keys.get("actor_rollout_ref.actor.ppo_mini_batch_size")
        if b is None or mb is None or int(b) != int(sync_step) * int(mb):
            raise ConfigError(
                f"trainer.v1.separate_async.parameter_sync_step={sync_step} needs data.train_batch_size = "
                "parameter_sync_step x actor_rollout_ref.actor.ppo_mini_batch_size on the same command line "
                f"(got {b} and {mb}); hybridrl publishes the weights once per training batch"
            )
    eta = int(keys.get(f"{AT}.max_head_offpolicyness", 1))
    for m in V1_MODES:
        warm = keys.pop(f"trainer.v1.{m}.num_warmup_batches", None)
        if warm is not None and not 0 <= int(warm) <= eta + 1:
            raise ConfigError(
                f"trainer.v1.{m}.num_warmup_batches={warm}: generation starts before the first step and runs at "
                f"most max_head_offpolicyness + 1 = {eta + 1} batches ahead; use a value in 0..{eta + 1}"
            )
    left = [k for k in keys if k.startswith("trainer.v1.")]
    if left:
        raise ConfigError(
            f"{left[0]} is a veRL v1 key hybridrl does not translate (docs/async.md lists them)"
        )
    return []


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _translate_one(key: str, value: str) -> list[str] | None:
    """The hybridrl overrides of one AReaL key, None when `key` is not one."""
    if key in RENAMES:
        return [f"{RENAMES[key]}={value}"]
    if key == "allocation_mode":
        return allocation_overrides(value)
    if key in ("weight_update_mode", "actor.weight_update_mode"):
        return weight_update_overrides(value)
    if key == "actor_rollout_ref.rollout.checkpoint_engine.backend":
        return _checkpoint_engine(value)
    return None


def _refuse_conflicts(arg: str, new: list[str], produced: dict[str, tuple[str, str]]) -> None:
    """Refuse a foreign argument whose translation sets a hybridrl key an earlier foreign argument
    set to another value (`allocation_mode` twice, `weight_update_mode` beside veRL's
    `checkpoint_engine.backend`, ...): a translation sets several keys, so "the last one wins"
    would mix the two."""
    for item in new:
        key, value = item.split("=", 1)  # translations are plain `key=value`
        if key in produced and produced[key][1] != value:
            raise ConfigError(
                f"{produced[key][0]} and {arg} disagree ({key}={produced[key][1]} vs {value}); "
                "give one of them"
            )
        produced[key] = (arg, value)


def translate_argv(argv: list[str], gpu: Callable[[], bool] = _has_gpu) -> list[str]:
    """main_async's command line with AReaL's and veRL v1's keys turned into hybridrl keys.

    Args:
        argv: `key=value` overrides (other arguments pass through).
        gpu: whether GPUs are used (colocate_async is refused on GPUs).

    Returns:
        The overrides, translated; the translation is printed the first time one happens.

    Raises:
        ConfigError: a key hybridrl cannot honour, with the reason and the fix.
    """
    global _printed
    kept: list[str] = []
    notes: list[str] = []
    v1: dict[str, str] = {}
    produced: dict[str, tuple[str, str]] = {}  # hybridrl key -> (the foreign argument, its value)
    for arg in argv:
        parts = _split(arg)
        if parts is None:
            kept.append(arg)
            continue
        _, key, value = parts
        if key not in RENAMES and (key == "trainer.use_v1" or key.startswith("trainer.v1.")):
            v1[key] = value
            continue
        new = _translate_one(key, value)
        if new is None:
            kept.append(arg)
            continue
        _refuse_conflicts(arg, new, produced)
        kept += new
        notes.append(f"{arg} -> {' '.join(new)}")
    if v1:
        everything = {p[1]: p[2] for p in map(_split, kept) if p is not None}
        keys = {**everything, **v1}
        new = _v1(keys, gpu)
        consumed = {k for k in everything if k not in keys}
        kept = [a for a in kept if (_split(a) or ("", a, ""))[1] not in consumed] + new
        notes.append(f"{' '.join(f'{k}={v}' for k, v in v1.items())} -> {' '.join(new) or '(nothing)'}")
    if notes and not _printed:
        _printed = True
        print("[hybridrl.async] AReaL / veRL v1 keys translated:\n  " + "\n  ".join(notes))
    return kept
