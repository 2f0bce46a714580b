"""Tensor-parallel rollout engines in asynchronous mode: the start-up check of their placement.

`async_training.rollout_nnodes x rollout_n_gpus_per_node` are rollout *slots* (devices; CPU slots on
CPU), one rollout worker process each, as veRL's and AReaL's device counts. With
`actor_rollout_ref.rollout.tensor_model_parallel_size = N`, every N consecutive slots of a node
form one engine (vLLM's `external_launcher` grouping, as in main_ppo), so there are
slots / N engines and N must divide the slots of a node: an engine's TP ranks share a node (NVLink
on GPUs, shared memory on CPU). AReaL's `allocation_mode=vllm:d2t2+...` is 2 engines x 2 = 4 slots.

The engine itself is checked as in main_ppo (rollout/parallel.py: an engine with TP
support, N divides the model's attention and KV heads) by the whole-tree validation, against one
node's rollout slots. In asynchronous mode the TP path (async_rollout/tp_engine.py) is checked
end to end with vLLM (tests/async/test_async_tp.py); SGLang with N > 1 is refused here (its TP
engine is one process driving N devices from the engine's first rank, a path not checked in
asynchronous mode; SGLang is CUDA only). Partial rollout works with N > 1: the engine's TP ranks
agree on the decode step at which a weight update interrupts them (rollout/vllm_rollout.py,
`_agreed_over_tp`), and the abort reaches every rank through the engine's handle (tp_engine.py).
"""

from __future__ import annotations

from typing import Any

from hybridrl.utils.config_loader import ConfigError

__all__ = ["validate_rollout_tp"]

KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
SLOTS_KEY = "async_training.rollout_n_gpus_per_node"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_rollout_tp(config: Any) -> None:
    """Raise ConfigError (with the numbers and the fix) when rollout TP cannot be placed.

    Checks: N >= 1; N divides rollout_n_gpus_per_node; the engine is not SGLang with N > 1 (the
    whole-tree validation refuses engines without TP).
    """
    at = config.async_training
    tp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    if tp < 1:
        raise ConfigError(f"{KEY}={tp}: use an integer >= 1")
    if tp == 1:
        return
    slots = at.rollout_n_gpus_per_node
    if slots % tp:
        raise ConfigError(
            f"{KEY}={tp} does not divide {SLOTS_KEY}={slots}: every engine takes {tp} rollout slots of one node "
            f"({at.rollout_nnodes} node(s) x {slots} slots = {at.rollout_nnodes * slots} slots); set {SLOTS_KEY} "
            f"to a multiple of {tp} (e.g. {tp * max(1, slots // tp)} or {tp * (slots // tp + 1)}) or {KEY} to one "
            f"of {_divisors(slots)}"
        )
    name = config.actor_rollout_ref.rollout.name
    if name == "sglang":
        raise ConfigError(
            f"{KEY}={tp} with actor_rollout_ref.rollout.name=sglang in asynchronous mode: SGLang's TP engine is one "
            f"process driving {tp} devices from the engine's first rank, a path not checked in asynchronous mode "
            f"(SGLang is CUDA only, untested); use rollout.name=vllm (one rollout worker per TP rank, checked), or "
            f"{KEY}=1 with more rollout slots ({SLOTS_KEY})"
        )
