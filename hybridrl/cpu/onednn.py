"""torch's own oneDNN linear on CPU: the op, its packed weights, and whether this build has it.

What it does: `torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")` is x @ w^T + b by
oneDNN (the op inductor's CPU path emits); `w` is the dense (out, in) weight or its packed copy
made once by `torch.ops.mkldnn._reorder_linear_weight(w, rows)` (oneDNN's blocked layout for
inputs of about `rows` rows).

When it is on: wherever `onednn_available()` says this torch build has the op; used by the HF
rollout's decode layers (cpu/decode_gemm.py), the training linears (cpu/train_linear.py) and
the floors' probes (utils/floors.py).

Measured by: `bench/cpu_gemm.py` (F.linear vs oneDNN on the dense and on the packed weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["onednn_available", "onednn_linear", "pack_weight"]

_AVAILABLE: bool | None = None  # onednn_available's answer, found once


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x (..., in), weight, bias) by oneDNN; `weight` dense (out, in) or `pack_weight`'s
    copy. No autograd (cpu/train_linear.OneDnnLinear has one)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's packed copy of a float32 (out, in) weight, laid out for inputs of ~`rows` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(1, rows))


def onednn_available() -> bool:
    """Whether this torch build runs `onednn_linear` on CPU float32, dense and packed (tried once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            w, x = torch.ones(4, 8), torch.ones(2, 8)
            _AVAILABLE = (
                bool(torch.backends.mkldnn.is_available())
                and torch.equal(onednn_linear(x, w), F.linear(x, w))
                and torch.equal(onednn_linear(x, pack_weight(w, 2)), F.linear(x, w))
            )
        except (RuntimeError, AttributeError, NotImplementedError):
            _AVAILABLE = False
    return _AVAILABLE
