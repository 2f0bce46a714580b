"""Decode-time linear layers for the HF rollout's private model copy on CPU (float32).

During `model.generate` decoding every linear layer sees only M = batch rows. For x @ W^T at
small M, MKL's sgemm behind `F.linear` (weight passed transposed) is slow, above all with two
threads; the same product written as W @ x^T (weight untransposed, then transposed back) runs
1.1-2.8x faster for large weights on the 2-core CPU machines. Measured per layer shape
(bench/cpu_gemm.py, docs/performance.md), the weight-first form is used when

- 2 <= rows <= max_rows (M = 1 is a matrix-vector product: no gain; above ~128 rows the two tie
  and prefill is far above), and
- the weight has >= 2**19 elements with 2+ torch threads (768x768 and larger; smaller ones lose
  up to 20%), >= 2**22 with one thread (only head-sized weights still win there).

Otherwise, and on every other device or dtype, the layer runs plain `F.linear`.

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
    "min_weight_numel",
    "uninstall_decode_gemm",
    "use_weight_first",
]

DEFAULT_DECODE_GEMM_MAX_ROWS = 128
MIN_WEIGHT_NUMEL_MULTI_THREAD = 1 << 19
MIN_WEIGHT_NUMEL_ONE_THREAD = 1 << 22


def min_weight_numel(threads: int) -> int:
    """Smallest weight (out * in elements) for which the weight-first form wins at `threads`."""
    return MIN_WEIGHT_NUMEL_ONE_THREAD if threads <= 1 else MIN_WEIGHT_NUMEL_MULTI_THREAD


def use_weight_first(rows: int, weight_numel: int, max_rows: int, min_numel: int) -> bool:
    """The decision rule: 2 <= rows <= max_rows and weight_numel >= min_numel."""
    return 2 <= rows <= max_rows and weight_numel >= min_numel


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


def decode_gemm_applies(
    x: torch.Tensor, weight: torch.Tensor, max_rows: int, min_numel: int | None = None
) -> bool:
    """True when the weight-first form should run for F.linear(x (..., in), weight (out, in)).

    CPU float32 input and weight, and `use_weight_first` with `min_numel` (None: by the current
    torch thread count, `min_weight_numel`).
    """
    if not (x.is_cpu and weight.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32):
        return False
    if min_numel is None:
        min_numel = min_weight_numel(torch.get_num_threads())
    return use_weight_first(linear_rows(x, weight.shape[1]), weight.numel(), max_rows, min_numel)


class DecodeGemmLinear(nn.Linear):
    """nn.Linear whose forward uses `linear_weight_first` when `decode_gemm_applies`.

    Never constructed directly: `install_decode_gemm` swaps the class of existing layers and
    sets `decode_gemm_max_rows` / `decode_gemm_min_numel`. Everything else (parameters, hooks,
    state dict) is nn.Linear's.
    """

    decode_gemm_max_rows: int = DEFAULT_DECODE_GEMM_MAX_ROWS
    decode_gemm_min_numel: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if decode_gemm_applies(x, self.weight, self.decode_gemm_max_rows, self.decode_gemm_min_numel):
            return linear_weight_first(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, decode_gemm_max_rows={self.decode_gemm_max_rows}, "
            f"decode_gemm_min_numel={self.decode_gemm_min_numel}"
        )


def install_decode_gemm(
    model: nn.Module, max_rows: int = DEFAULT_DECODE_GEMM_MAX_ROWS, min_numel: int | None = None
) -> int:
    """Swap every exact `nn.Linear` in `model` to `DecodeGemmLinear` in place; return how many.

    `max_rows` >= 0 (0: F.linear always); `min_numel`: the weight-size bound of the rule (None:
    by the thread count at each call, the measured default; 0: every layer, e.g. in tests).
    Subclasses of nn.Linear (quantised, LoRA, ...) keep their own forward and are skipped.
    """
    if max_rows < 0:
        raise ValueError(f"install_decode_gemm: max_rows must be >= 0, got {max_rows}")
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear or type(module) is DecodeGemmLinear:
            module.__class__ = DecodeGemmLinear
            module.decode_gemm_max_rows = max_rows
            module.decode_gemm_min_numel = min_numel
            count += 1
    return count


def uninstall_decode_gemm(model: nn.Module) -> int:
    """Undo `install_decode_gemm`: every DecodeGemmLinear becomes a plain nn.Linear again."""
    count = 0
    for module in model.modules():
        if type(module) is DecodeGemmLinear:
            module.__class__ = nn.Linear
            del module.decode_gemm_max_rows, module.decode_gemm_min_numel
            count += 1
    return count
