"""Activation offload (veRL's `model.enable_activation_offload`): the tensors a training forward
saves for backward are kept in CPU memory and copied back when backward needs them.

Mechanism: `torch.autograd.graph.saved_tensors_hooks` around the training module's forward. The
pack hook copies each saved accelerator tensor into pinned CPU memory (non-blocking) and the
unpack hook moves it back; parameters (FSDP's unsharded weights among them) are not copied, they
are alive anyway. Combined with gradient checkpointing only the checkpointed blocks' inputs are
saved, which is the case veRL targets. Costs one host round trip per saved tensor.

On a CPU device activations already live in CPU memory: the hooks run but move nothing (counted
as `kept`), so the setting changes no numbers and saves no memory there. On GPU: untested here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = ["OffloadStats", "enable_activation_offload", "offload_saved_tensors"]


class OffloadStats:
    """Counts of the saved tensors the hooks saw: moved to CPU, or kept where they were."""

    def __init__(self) -> None:
        self.offloaded = 0
        self.offloaded_bytes = 0
        self.kept = 0


def offload_saved_tensors(stats: OffloadStats | None = None):
    """Context manager: saved-for-backward tensors not on the CPU go to (pinned) CPU memory."""
    stats = stats if stats is not None else OffloadStats()

    def pack(t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        if t.device.type == "cpu" or isinstance(t, nn.Parameter):
            stats.kept += 1
            return None, t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=torch.cuda.is_available())
        host.copy_(t, non_blocking=True)
        stats.offloaded += 1
        stats.offloaded_bytes += t.numel() * t.element_size()
        return t.device, host

    def unpack(packed: tuple[Any, torch.Tensor]) -> torch.Tensor:
        device, t = packed
        return t if device is None else t.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def enable_activation_offload(module: nn.Module) -> OffloadStats:
    """Run `module`'s forward under `offload_saved_tensors` whenever gradients are recorded
    (training micro-batches; no-grad log-prob passes are untouched). Returns the live counters."""
    stats = OffloadStats()
    forward = module.forward

    @functools.wraps(forward)
    def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with offload_saved_tensors(stats):
            return forward(*args, **kwargs)

    module.forward = offloaded_forward
    module.activation_offload_stats = stats
    return stats
