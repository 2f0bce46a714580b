"""Micro-batch forward passes of Megatron GPT chunks through Megatron's pipeline schedules.

`run_schedule` feeds a list of micro-batches (TensorDicts in the veRL batch layout, see
workers/engine/forward.py) through `get_forward_backward_func()` (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages) and returns what `loss_fn` produced for each micro-batch
on the last pipeline stage ([] elsewhere). `loss_fn(micro, output) -> (loss, result)`; the loss
is backpropagated unless `forward_only`. Megatron divides each returned loss by the number of
micro-batches; `run_schedule` multiplies it back, so `loss_fn` returns the loss exactly as the
FSDP actor would call `.backward()` on it (already normalised by the whole mini-batch).

The attention mask is explicit (causal and key padding, True = masked): Megatron's default causal
mask is built on CUDA. RoPE in Megatron ignores position_ids and uses 0..S-1; for left-padded
rows that shifts every valid position by the same amount, which RoPE's relative form cancels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hybridrl.workers.engine.megatron.cpu_shims import cuda_to_cpu

__all__ = ["attention_mask_4d", "run_schedule"]


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) valid-token mask -> (B, 1, S, S) bool, True where query i may NOT attend key j."""
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | pad


def _forward_step(loss_fn: Callable, data_iterator, model):
    micro = next(data_iterator)
    ids = micro["input_ids"]
    positions = micro["position_ids"] if "position_ids" in micro.keys() else None
    if positions is None or positions.dim() != 2:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    out = model(
        input_ids=ids, position_ids=positions, attention_mask=attention_mask_4d(micro["attention_mask"])
    )
    return out, functools.partial(loss_fn, micro)


def run_schedule(
    chunks: list[Any],
    micros: list[Any],
    loss_fn: Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]],
    *,
    forward_only: bool,
) -> list[Any]:
    """Run forward (and backward) of `micros` through the pipeline; results of the last stage.

    Args:
        chunks: this rank's model chunks (DDP-wrapped when training).
        micros: micro-batches, every one with input_ids (b, S) of the same S.
        loss_fn: (micro, logits or values (b, S, ...)) -> (scalar loss, result).

    Returns:
        One `result` per micro-batch on the last pipeline stage, [] on the others.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(micros)
    if len(chunks) > 1:
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        if n % pp:
            raise ValueError(
                f"virtual pipeline stages need a number of micro-batches divisible by pipeline_model_parallel_size={pp}, "
                f"got {n}: choose micro-batch sizes (ppo_micro_batch_size_per_gpu, log_prob_micro_batch_size_per_gpu) "
                "that split each batch into a multiple of it"
            )
    results: list[Any] = []

    def scaled(micro, output):
        loss, result = loss_fn(micro, output)
        results.append(result)
        return loss * n, {}

    iters = [iter(micros) for _ in chunks]
    with cuda_to_cpu():
        get_forward_backward_func()(
            forward_step_func=functools.partial(_forward_step, scaled),
            data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=n,
            seq_length=micros[0]["input_ids"].shape[1],
            micro_batch_size=micros[0]["input_ids"].shape[0],
            forward_only=forward_only,
        )
    return results
