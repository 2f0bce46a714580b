"""Decode-time linear layers for the HF rollout's private model copy on CPU (float32).

What it does: during `model.generate` decoding every linear layer sees only M = batch rows, and for
x @ W^T at small M MKL's sgemm behind `F.linear` is slow, above all with few threads. Two faster
forms of the same product:

- **oneDNN with a packed weight** (`form="onednn"`, the default where torch has oneDNN): the
  weight is reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
  the op inductor's CPU freezing uses) and every call runs `torch.ops.mkldnn._linear_pointwise`
  on it. The packed copy is made on first use and again whenever the parameter was written in
  place (its version counter moved, e.g. by the weight sync's `copy_`) or replaced; it costs a
  second copy of the weights in memory.
- **weight first** (`form="weight_first"`, where oneDNN is missing): the same product written as
  W @ x^T (weight untransposed, then transposed back).

When it is on: the HF rollout installs it on CPU in float32 when `rollout.hf_decode_gemm_max_rows`
> 0 (default 128; 0 turns it off). Each layer then takes its form only when

- 2 <= rows <= max_rows (M = 1 is a matrix-vector product: no gain), and
- the weight is large enough for the current thread count (`min_weight_numel`): oneDNN >= 2**17
  elements with 2+ threads, >= 2**19 with one (smaller ones lose to F.linear with one thread);
  weight first >= 2**19 with 2+ threads, >= 2**22 with one, and
- no gradient is needed (the oneDNN op has no backward; the weight-first form is autograd-safe).

Otherwise, and on every other device or dtype, the layer runs plain `F.linear`. Same numbers up
to float rounding (~1e-6; tests/cpu/test_decode_gemm.py).

The swap changes only the class of each `nn.Linear` (`DecodeGemmLinear` is a subclass): the
parameters stay the same objects, so tied embeddings, `state_dict` names and in-place weight
sync (`copy_` into the parameters) are untouched.

Measured by: `bench/cpu_gemm.py` (every form over the row count M; `--per-shape` per layer shape,
where the bounds above come from) and `bench/rollout_generation.py --decode-gemm both` (the whole
rollout with and without it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.cpu.linear_class import restore_linear_class
from hybridrl.cpu.onednn import onednn_available, onednn_linear, pack_weight

__all__ = [
    "DECODE_GEMM_FORMS",
    "DEFAULT_DECODE_GEMM_MAX_ROWS",
    "DecodeGemmLinear",
    "decode_gemm_applies",
    "install_decode_gemm",
    "linear_rows",
    "linear_weight_first",
    "min_weight_numel",
    "onednn_available",
    "onednn_linear",
    "pack_weight",
    "resolve_form",
    "uninstall_decode_gemm",
    "use_weight_first",
]

DECODE_GEMM_FORMS = ("auto", "onednn", "weight_first")
DEFAULT_DECODE_GEMM_MAX_ROWS = 128
# smallest weight (out * in elements) for which a form wins, by form and (one thread, 2+ threads)
_MIN_NUMEL = {"weight_first": (1 << 22, 1 << 19), "onednn": (1 << 19, 1 << 17)}
MIN_WEIGHT_NUMEL_MULTI_THREAD = _MIN_NUMEL["weight_first"][1]
MIN_WEIGHT_NUMEL_ONE_THREAD = _MIN_NUMEL["weight_first"][0]


def resolve_form(form: str) -> str:
    """`auto` -> `onednn` where `onednn_available()`, else `weight_first`; the others are checked."""
    if form not in DECODE_GEMM_FORMS:
        raise ValueError(f"decode GEMM form {form!r} is not one of {DECODE_GEMM_FORMS}")
    if form == "auto":
        return "onednn" if onednn_available() else "weight_first"
    if form == "onednn" and not onednn_available():
        raise RuntimeError("decode GEMM form 'onednn': this torch build has no oneDNN linear on CPU")
    return form


def min_weight_numel(threads: int, form: str = "weight_first") -> int:
    """Smallest weight (out * in elements) for which `form` beats F.linear at `threads` threads."""
    one, many = _MIN_NUMEL[form]
    return one if threads <= 1 else many


def use_weight_first(rows: int, weight_numel: int, max_rows: int, min_numel: int) -> bool:
    """The decision rule (both forms): 2 <= rows <= max_rows and weight_numel >= min_numel."""
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
    x: torch.Tensor,
    weight: torch.Tensor,
    max_rows: int,
    min_numel: int | None = None,
    form: str = "weight_first",
) -> bool:
    """True when `form` should run for F.linear(x (..., in), weight (out, in)).

    CPU float32 input and weight, and `use_weight_first` with `min_numel` (None: by the current
    torch thread count and the form, `min_weight_numel`); the oneDNN form also needs no gradient.
    """
    if not (x.is_cpu and weight.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32):
        return False
    if form == "onednn" and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if min_numel is None:
        min_numel = min_weight_numel(torch.get_num_threads(), form)
    return use_weight_first(linear_rows(x, weight.shape[1]), weight.numel(), max_rows, min_numel)


class DecodeGemmLinear(nn.Linear):
    """nn.Linear whose forward uses its decode form (`decode_gemm_form`) when `decode_gemm_applies`.

    Never constructed directly: `install_decode_gemm` swaps the class of existing layers and
    sets `decode_gemm_max_rows` / `decode_gemm_min_numel` / `decode_gemm_form`. Everything else
    (parameters, hooks, state dict) is nn.Linear's. The oneDNN form keeps the packed weight in
    `_decode_packed` with the (storage pointer, version) of the weight it was packed from, and
    packs again when either changed.
    """

    decode_gemm_max_rows: int = DEFAULT_DECODE_GEMM_MAX_ROWS
    decode_gemm_min_numel: int | None = None
    decode_gemm_form: str = "weight_first"
    _decode_packed: torch.Tensor | None = None
    _decode_packed_key: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        form = self.decode_gemm_form
        if decode_gemm_applies(x, self.weight, self.decode_gemm_max_rows, self.decode_gemm_min_numel, form):
            if form == "onednn":
                return onednn_linear(x, self._packed(linear_rows(x, self.in_features)), self.bias)
            return linear_weight_first(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _packed(self, rows: int) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._decode_packed is None or self._decode_packed_key != key:
            self._decode_packed, self._decode_packed_key = pack_weight(w, rows), key
        return self._decode_packed

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, decode_gemm_max_rows={self.decode_gemm_max_rows}, "
            f"decode_gemm_min_numel={self.decode_gemm_min_numel}, decode_gemm_form={self.decode_gemm_form}"
        )


def install_decode_gemm(
    model: nn.Module,
    max_rows: int = DEFAULT_DECODE_GEMM_MAX_ROWS,
    min_numel: int | None = None,
    form: str = "auto",
) -> int:
    """Swap every exact `nn.Linear` in `model` to `DecodeGemmLinear` in place; return how many.

    `max_rows` >= 0 (0: F.linear always); `min_numel`: the weight-size bound of the rule (None:
    by the thread count and form at each call, the measured default; 0: every layer, e.g. in
    tests); `form`: one of DECODE_GEMM_FORMS (`auto`: oneDNN where available, `resolve_form`).
    Subclasses of nn.Linear (quantised, LoRA, ...) keep their own forward and are skipped, and so
    are layers whose weight is below the bound at every thread count (the form could never run
    there, and the per-call check alone costs a small model's generation time).
    """
    if max_rows < 0:
        raise ValueError(f"install_decode_gemm: max_rows must be >= 0, got {max_rows}")
    form = resolve_form(form)
    floor = min(_MIN_NUMEL[form]) if min_numel is None else min_numel
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.numel() < floor:
            continue
        if type(module) is nn.Linear or type(module) is DecodeGemmLinear:
            module.__class__ = DecodeGemmLinear
            module.decode_gemm_max_rows = max_rows
            module.decode_gemm_min_numel = min_numel
            module.decode_gemm_form = form
            module._decode_packed = module._decode_packed_key = None
            count += 1
    return count


def uninstall_decode_gemm(model: nn.Module) -> int:
    """Undo `install_decode_gemm`: every DecodeGemmLinear becomes a plain nn.Linear again."""
    attrs = ("decode_gemm_max_rows", "decode_gemm_min_numel", "decode_gemm_form", "_decode_packed")
    return restore_linear_class(model, DecodeGemmLinear, (*attrs, "_decode_packed_key"))
