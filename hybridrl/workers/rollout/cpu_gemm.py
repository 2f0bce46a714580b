"""Decode-time linear layers for the HF rollout's private model copy on CPU (float32).

During `model.generate` decoding every linear layer sees only M = batch rows. For x @ W^T at
small M, MKL's sgemm behind `F.linear` (weight passed transposed) barely uses a second thread;
the same product written as W @ x^T (weight untransposed, then transposed back) runs up to ~2x
faster on the 2-core CPU machines at M <= 16 and is no slower up to a few hundred rows
(bench/cpu_gemm.py prints the table). Above `max_rows` (prefill, log-prob passes) and on every
other device or dtype the layer is plain `F.linear`.

The swap changes only the class of each `nn.Linear` (`DecodeGemmLinear` is a subclass): the
parameters stay the same objects, so tied embeddings, `state_dict` names and in-place weight
sync (`copy_` into the parameters) are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_DECODE_GEMM_MAX_ROWS",
    "DecodeGemmLinear",
    "decode_gemm_applies",
    "install_decode_gemm",
    "linear_rows",
    "linear_weight_first",
    "uninstall_decode_gemm",
]

# From bench/cpu_gemm.py on the 2-core EPYC (see docs/performance.md): the weight-first form wins
# clearly up to M = 64 rows and ties F.linear by M = 256-512; prefill (batch x prompt) is far above.
DEFAULT_DECODE_GEMM_MAX_ROWS = 128


def linear_rows(x: torch.Tensor, in_features: int) -> int:
    """Rows of the GEMM a linear layer runs on input x (..., in_features): prod(x.shape[:-1])."""
    return x.numel() // in_features if in_features else 0


def linear_weight_first(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x2d^T)^T, returned contiguous.

    Args:
        x: (..., in) input.
        weight: (out, in).
        bias: (out,) or None.
    Returns:
        (..., out), equal to F.linear up to float rounding.
    """
    x2d = x.reshape(-1, weight.shape[1])  # (M, in)
    if bias is None:
        out_t = torch.mm(weight, x2d.t())  # (out, M)
    else:
        out_t = torch.addmm(bias.unsqueeze(1), weight, x2d.t())  # (out, M)
    return out_t.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


def decode_gemm_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """True when the weight-first form should run: CPU float32 input and weight, rows <= max_rows."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() >= 1
        and linear_rows(x, weight.shape[1]) <= max_rows
    )


class DecodeGemmLinear(nn.Linear):
    """nn.Linear whose forward uses `linear_weight_first` for small CPU float32 inputs.

    Never constructed directly: `install_decode_gemm` swaps the class of existing layers and
    sets `decode_gemm_max_rows`. Everything else (parameters, hooks, state dict) is nn.Linear's.
    """

    decode_gemm_max_rows: int = DEFAULT_DECODE_GEMM_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if decode_gemm_applies(x, self.weight, self.decode_gemm_max_rows):
            return linear_weight_first(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, decode_gemm_max_rows={self.decode_gemm_max_rows}"


def install_decode_gemm(model: nn.Module, max_rows: int = DEFAULT_DECODE_GEMM_MAX_ROWS) -> int:
    """Swap every exact `nn.Linear` in `model` to `DecodeGemmLinear` in place; return how many.

    Subclasses of nn.Linear (quantised, LoRA, ...) keep their own forward and are skipped.
    `max_rows` must be >= 0 (0 leaves the layers on F.linear for every input with rows > 0).
    """
    if max_rows < 0:
        raise ValueError(f"install_decode_gemm: max_rows must be >= 0, got {max_rows}")
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear or type(module) is DecodeGemmLinear:
            module.__class__ = DecodeGemmLinear
            module.decode_gemm_max_rows = max_rows
            count += 1
    return count


def uninstall_decode_gemm(model: nn.Module) -> int:
    """Undo `install_decode_gemm`: every DecodeGemmLinear becomes a plain nn.Linear again."""
    count = 0
    for module in model.modules():
        if type(module) is DecodeGemmLinear:
            module.__class__ = nn.Linear
            del module.decode_gemm_max_rows
            count += 1
    return count
