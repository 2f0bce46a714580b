"""torch's fused AdamW kernel for parameters that live in CPU memory.

What it does: `torch.optim.AdamW(fused=True)` runs each step as one pass over every tensor instead
of a dozen elementwise ops per parameter (the default per-parameter loop on CPU); the same update
up to float rounding (tests/engine/test_engine_optim_flops.py).

When it is on: the engines' `build_optimizer` asks `use_fused_adamw` and passes `fused=True` when
every trainable parameter is a CPU floating-point tensor and this torch build lists CPU among the
fused optimizers' devices (no switch); elsewhere torch picks its default.

Measured by: `bench/optim_step.py` (one optimizer step, fused vs the per-parameter loop).
"""

from __future__ import annotations

import torch

__all__ = ["use_fused_adamw"]


def use_fused_adamw(params: list[torch.Tensor]) -> bool:
    """True when torch's fused AdamW runs these parameters on CPU: all CPU, floating point, and
    this torch build lists CPU among the fused optimizers' devices."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        cpu_ok = "cpu" in _get_fused_kernels_supported_devices()
    except ImportError:  # an older torch: no fused CPU kernel
        return False
    return cpu_ok and all(p.device.type == "cpu" and torch.is_floating_point(p) for p in params)
