"""Tensor-parallel rollout engines in asynchronous mode: the start-up check of their placement.

`async_training.rollout_nnodes x rollout_n_gpus_per_node` are rollout *slots* (devices; CPU slots on
CPU), one rollout worker process each, as veRL's and AReaL's device counts. With
`actor_rollout_ref.rollout.tensor_model_parallel_size = N`, every N consecutive slots of a node
form one engine (vLLM's `external_launcher` grouping, as in main_ppo), so there are
slots / N engines and N must divide the slots of a node: an engine's TP ranks share a node (NVLink
on GPUs, shared memory on CPU). AReaL's `allocation_mode=vllm:d2t2+...` is 2 engines x 2 = 4 slots.

The engine itself is checked as in main_ppo (workers/rollout/parallel.py: an engine with TP
support, N divides the model's attention and KV heads) by the whole-tree validation, against one
node's rollout slots.
"""

from __future__ import annotations

from typing import Any

from hybridrl.utils.config_loader import ConfigError

__all__ = ["validate_rollout_tp"]

KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
SLOTS_KEY = "async_training.rollout_n_gpus_per_node"
_TP_ENABLED = False  # the TP path (tp_engine.py) stays refused until its equivalence test runs


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_rollout_tp(config: Any) -> None:
    """Raise ConfigError (with the numbers and the fix) when rollout TP cannot be placed.

    Checks: N >= 1; N divides rollout_n_gpus_per_node; partial rollout is off with N > 1 (an abort
    would have to reach every TP rank of an engine at once; not built).
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
    if not _TP_ENABLED:
        raise ConfigError(
            f"{KEY}={tp}: tensor-parallel rollout engines in asynchronous mode are built but not yet checked "
            f"end to end (issue 26); use {KEY}=1 with more rollout slots ({SLOTS_KEY}) instead"
        )
    if at.partial_rollout:
        raise ConfigError(
            f"async_training.partial_rollout=true with {KEY}={tp}: interrupting a tensor-parallel engine is not "
            f"supported yet; set async_training.partial_rollout=false or {KEY}=1"
        )
