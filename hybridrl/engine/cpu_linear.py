"""Training linears on CPU in float32 through oneDNN (`fsdp_config.onednn_linear`).

On CPU, `F.linear` runs MKL's sgemm. torch also ships oneDNN, whose linear
(`torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU path emits) runs the same float32
products faster at training sizes on the machines measured: on the 2-core AVX-512 EPYC, at
4,944 rows (16 x 309 tokens) of the ~100M bench model, the forward of a 768 x 768 layer at 207
vs 169 GFLOP/s, 2048 x 768 at 174 vs 145, and the input gradient dY @ W at 214-216 vs 165-195.

`OneDnnLinear` is y = x W^T + b as an autograd function (shapes: x (..., in), W (out, in),
b (out,)):

    forward       y  = oneDNN(x, W) + b
    input grad    dX = oneDNN(dY, W^T)          (W^T made contiguous once per call)
    weight grad   dW = dY^T X                   (torch.mm: MKL is as fast there)
    bias grad     db = sum over rows of dY

Equal to F.linear up to float rounding (~1e-6 relative; tests/engine/test_cpu_linear.py).
`bench/cpu_gemm.py --train` measures it against F.linear (the model's linear shapes, and the
padded forward + backward with the head); docs/benchmarks.md has the current numbers. `install_onednn_linear` swaps the class of each exact `nn.Linear`
to `OneDnnTrainLinear`, which takes this path only where it applies (CPU, float32 input and
weight, plain tensors, a product of >= 2**25 multiply-adds and a weight of >= 2**17 elements,
where the call overhead no longer loses, not inside torch.compile) and F.linear elsewhere; the
parameters, their names and checkpoints are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.utils.onednn import onednn_available, onednn_linear
from hybridrl.utils.torch_utils import restore_linear_class

__all__ = [
    "OneDnnLinear",
    "OneDnnTrainLinear",
    "MIN_MACS",
    "install_onednn_linear",
    "onednn_linear_applies",
    "resolve_onednn_linear",
    "uninstall_onednn_linear",
]


class OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b with oneDNN's forward and input gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # (..., out)
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_out = grad_out.contiguous()
        dy = grad_out.reshape(-1, weight.shape[0])  # (M, out)
        dx = onednn_linear(grad_out, weight.t().contiguous(), None) if need_x else None  # (..., in)
        dw = dy.t().mm(x.reshape(-1, weight.shape[1])) if need_w else None  # (out, in)
        db = dy.sum(0) if need_b and ctx.has_bias else None
        return dx, dw, db


# the smallest product (rows * in * out multiply-adds) oneDNN is given: below it the call overhead
# loses to F.linear (1.1-2x slower for 128 x 128 layers at 64-256 rows; 0.88-0.95x from 2**25 up)
MIN_MACS = 1 << 25
# and the smallest weight: the built-in tiny model's layers (128 x 512 at most) stay plain nn.Linear
# (its update measured 1.07-1.11x slower with the swapped class, bench/regress.py, 3 rounds each)
MIN_WEIGHT_NUMEL = 1 << 17


def onednn_linear_applies(x: torch.Tensor, weight: torch.Tensor, min_macs: int = MIN_MACS) -> bool:
    """Whether `OneDnnLinear` runs for F.linear(x (..., in), weight (out, in)): CPU float32 plain
    tensors (no DTensor), a product of >= `min_macs` multiply-adds and a weight of >=
    MIN_WEIGHT_NUMEL elements (unless `min_macs` is 0, as in tests), outside torch.compile (inductor
    lowers F.linear itself)."""
    return (
        x.is_cpu
        and weight.is_cpu
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and x.numel() * weight.shape[0] >= min_macs
        and (min_macs == 0 or weight.numel() >= MIN_WEIGHT_NUMEL)
        and not torch.compiler.is_compiling()
    )


class OneDnnTrainLinear(nn.Linear):
    """nn.Linear whose forward is `OneDnnLinear` where `onednn_linear_applies`, else F.linear.

    Never constructed directly: `install_onednn_linear` swaps the class of existing layers and
    sets `onednn_min_macs`.
    """

    onednn_min_macs: int = MIN_MACS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if onednn_linear_applies(x, self.weight, self.onednn_min_macs):
            return OneDnnLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def resolve_onednn_linear(value: bool | None, device_type: str, key: str) -> bool:
    """`fsdp_config.onednn_linear`: None (auto) -> on for CPU training where torch has oneDNN;
    True needs both (refused with the reason otherwise); False -> off."""
    if value is None:
        return device_type == "cpu" and onednn_available()
    if value not in (True, False):
        raise ValueError(f"{key}.onednn_linear must be true, false or null (auto), got {value!r}")
    if value and device_type != "cpu":
        raise ValueError(f"{key}.onednn_linear=true is for CPU training; this engine runs on {device_type}")
    if value and not onednn_available():
        raise ValueError(
            f"{key}.onednn_linear=true: this torch build has no oneDNN linear; set it to null or false"
        )
    return bool(value)


def _output_heads(model: nn.Module) -> set[int]:
    """ids of the vocabulary heads of `model` and its submodules (`get_output_embeddings`)."""
    heads = set()
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except (AttributeError, NotImplementedError, TypeError):
                continue
            if head is not None:
                heads.add(id(head))
    return heads


def module_weight_numel(module: nn.Module) -> int:
    """Elements of a module's `weight` (0 when it has none)."""
    weight = getattr(module, "weight", None)
    return weight.numel() if isinstance(weight, torch.Tensor) else 0


def install_onednn_linear(model: nn.Module, min_macs: int = MIN_MACS) -> int:
    """Swap every exact `nn.Linear` of `model` to `OneDnnTrainLinear` in place; return how many.

    `min_macs`: the smallest product given to oneDNN (0: every one, e.g. in tests). The vocabulary
    head stays a plain nn.Linear: the fused log-prob head (engine/lm_head.py) replaces its forward
    only on an exact nn.Linear (forward.head_is_swappable), and through the module a 32k head
    measured slower on oneDNN (its input gradient needs the transposed 32k x H weight). Layers
    whose weight is below MIN_WEIGHT_NUMEL stay plain too (unless `min_macs` is 0): the per-call
    check alone cost the tiny model's update 7-11% (bench/regress.py). Subclasses of nn.Linear
    (quantised, LoRA wrappers, ...) keep their own forward."""
    heads = _output_heads(model)
    count = 0
    for module in model.modules():
        if id(module) in heads:
            continue
        if min_macs and module_weight_numel(module) < MIN_WEIGHT_NUMEL:
            continue  # never given to oneDNN: stays a plain nn.Linear (no per-call check)
        if type(module) in (nn.Linear, OneDnnTrainLinear):
            module.__class__ = OneDnnTrainLinear
            module.onednn_min_macs = min_macs
            count += 1
    return count


def uninstall_onednn_linear(model: nn.Module) -> int:
    """Undo `install_onednn_linear`: every OneDnnTrainLinear becomes a plain nn.Linear again."""
    return restore_linear_class(model, OneDnnTrainLinear, ("onednn_min_macs",))
