"""The few shims megatron-core 0.16 needs to run on CPU over gloo (applied only without CUDA).

megatron-core has no CPU device path: `use_cpu_initialization` covers weight init only. On
CPU machines these shims suffice:

1. `apply_cpu_shims()` (once per process): `torch.cuda.current_device()` returns "cpu". Megatron
   allocates with `device=torch.cuda.current_device()` in the model itself (attention buffers,
   RoPE inv_freq, tensor-parallel all-gathers, DDP grad buffers), so this covers the forward.
2. `cuda_to_cpu()` (a context, wrapped around optimizer build, forward_backward_func, optimizer
   step and checkpoint calls): literal CUDA uses are mapped to CPU: a `device="cuda"` argument of
   any torch call becomes "cpu", `Tensor.cuda()` is a no-op, `Tensor.type()` answers the CUDA
   name megatron asserts on ('torch.cuda.FloatTensor'), `pin_memory` is off, and
   `torch.cuda.synchronize/set_device/empty_cache` do nothing. It costs no measurable time.

3. (MoE) megatron-core's all-to-all token dispatcher copies its split sizes to the host (as
   numpy arrays, which its all-to-all takes) on a side CUDA stream; `apply_cpu_shims` gives the
   dispatcher a placeholder stream and makes that step a plain conversion to numpy.

On a machine with CUDA all three are no-ops: the GPU path is the same engine code over nccl
(untested on GPU). Everything else the CPU path needs is configuration, set by the engine:
`transformer_impl="local"` with RMSNorm, every fusion off, an explicit causal attention mask
(megatron's default mask is built on CUDA), no sequence parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_shims", "cuda_to_cpu", "needs_cpu_shims"]

_APPLIED = False
_NOOP_CUDA = ("synchronize", "set_device", "empty_cache")


def needs_cpu_shims() -> bool:
    """True on a machine without CUDA (the shims are never applied beside a GPU)."""
    return not torch.cuda.is_available()


def _cpu_device() -> str:
    return "cpu"


def apply_cpu_shims() -> None:
    """Make `torch.cuda.current_device()` return "cpu" in this process (idempotent; CPU only)."""
    global _APPLIED
    if _APPLIED or not needs_cpu_shims():
        return
    torch.cuda.current_device = _cpu_device
    _host_token_dispatch()
    _APPLIED = True


def _host_token_dispatch() -> None:
    """The all-to-all dispatcher's device-to-host step on CPU (see the module doc)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = contextlib.nullcontext()  # never used on CPU

    def host_splits(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_splits


def _map_device(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to,) and len(args) > 1:
            args = (args[0], _map_device(args[1]), *args[2:])
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Run megatron code that names CUDA literally on CPU (a no-op when CUDA is available)."""
    if not needs_cpu_shims():
        yield
        return
    apply_cpu_shims()
    saved = {name: getattr(torch.cuda, name) for name in _NOOP_CUDA}
    for name in _NOOP_CUDA:
        setattr(torch.cuda, name, lambda *a, **k: None)
    try:
        with _CudaToCpuMode():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
