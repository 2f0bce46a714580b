"""Mixture-of-experts routers of Hugging Face models: find them, record and replay their choices,
and the load-balancing loss and load statistics of a forward.

A router here is the top-k gate module of a sparse MoE block: it maps the block's hidden states
(N, H) (N tokens, in the order the forward laid them out) to `(router_logits (N, E), weights (N, K),
indices (N, K))`. Two families are known:

- softmax routers (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`, `MixtralTopKRouter`, `OlmoeTopKRouter`):
  weights = softmax(logits) at the chosen experts, renormalised over the top k when the config's
  `norm_topk_prob` is set;
- sigmoid routers with a score-correction bias and a routed scaling factor (`DeepseekV3TopkRouter`,
  Moonlight / Kimi and GLM-4 MoE use the same gate): weights = sigmoid(logits) at the chosen
  experts, renormalised when `norm_topk_prob`, times `routed_scaling_factor`.

`RouterTap` hooks every router of a model. Recording keeps each layer's chosen experts (N, K);
replaying replaces the router's choice by given experts (rows of -1 route as the router chooses)
and recomputes the gating weights from the router's own logits at those experts, so the weights
stay differentiable: only the discrete choice is fixed. Shapes: N tokens, H hidden, E experts,
K experts per token (top-k), L MoE layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "RouterTap",
    "find_routers",
    "is_moe",
    "load_balancing_loss",
    "moe_shape",
    "routing_metrics",
]

_SOFTMAX = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter")
_SIGMOID = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter")


def _router_kind(module: nn.Module) -> str | None:
    name = type(module).__name__
    if name in _SOFTMAX:
        return "softmax"
    if name in _SIGMOID:
        return "sigmoid"
    return None


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if _router_kind(m) is not None]


def _looks_moe(model: nn.Module) -> bool:
    return any(type(m).__name__.endswith(("TopKRouter", "TopkRouter")) for m in model.modules())


def is_moe(model: nn.Module) -> bool:
    """Whether the model has routers this module knows.

    Raises:
        NotImplementedError: the model has a top-k router of an unknown family (its replay weights
            and load statistics cannot be computed here).
    """
    if find_routers(model):
        return True
    if _looks_moe(model):
        names = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Router")})
        raise NotImplementedError(
            f"{type(model).__name__} routes with {names}, which hybridrl cannot record or replay; "
            f"the known routers are {list(_SOFTMAX + _SIGMOID)}"
        )
    return False


def moe_shape(model: nn.Module) -> tuple[int, int, int]:
    """(L MoE layers, E experts, K experts per token) of a model with known routers."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router")
    return len(routers), int(routers[0].num_experts), int(routers[0].top_k)


def replay_weights(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The gating weights (N, K) the router gives experts `indices` (N, K) from its logits (N, E).

    Computed as the router computes them for its own choice (see the module docstring), so
    replaying the router's own choice gives its own weights.
    """
    if _router_kind(router) == "sigmoid":
        w = logits.float().sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


@dataclass
class _Replay:
    indices: torch.Tensor  # (N, L, K) long, -1 rows route freely


class RouterTap:
    """Forward hooks on every router of `model`: record the chosen experts, replay given ones, and
    keep the router logits of the last forward for the load-balancing loss.

    Usage::

        tap = RouterTap(model)
        with tap.replaying(routed):         # routed: (N, L, K) in the forward's token order
            out = model(...)
        chosen = tap.chosen()               # (N, L, K): what each layer routed to
        tap.close()

    Each layer's record is overwritten by each call of its router, so a recomputed forward
    (activation checkpointing) leaves the same record; `appending()` keeps every call instead
    (generation, one call per decoding step).
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to record or replay")
        self._layer = {id(r): i for i, r in enumerate(self.routers)}
        self._replay: _Replay | None = None
        self._append = False
        self.keep_logits = False
        self.records: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.logits: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def clear(self) -> None:
        self.records = [[] for _ in self.routers]
        self.logits = [None] * len(self.routers)

    def _hook(self, router: nn.Module, _inputs, output):
        logits, weights, indices = output
        layer = self._layer[id(router)]
        if self._replay is not None:
            wanted = self._replay.indices[:, layer].to(indices.device)
            if wanted.shape != indices.shape:
                raise ValueError(
                    f"routing replay: layer {layer} routes {tuple(indices.shape)} (tokens, top_k) but "
                    f"{tuple(wanted.shape)} were given; the recorded routing must match the batch"
                )
            free = (wanted < 0).any(dim=-1, keepdim=True)
            indices = torch.where(free, indices, wanted)
            weights = torch.where(free, weights, replay_weights(router, logits, indices).to(weights.dtype))
        if self._append:
            self.records[layer].append(indices.detach())
        else:
            self.records[layer] = [indices.detach()]
        if self.keep_logits:
            self.logits[layer] = logits
        return logits, weights, indices

    @contextlib.contextmanager
    def replaying(self, routed: torch.Tensor | None) -> Iterator[RouterTap]:
        """Inside the block the routers take the experts `routed` (N, L, K) (None: their own)."""
        if routed is not None and routed.shape[1] != len(self.routers):
            raise ValueError(
                f"routing replay: the recorded routing has {routed.shape[1]} MoE layers, the model "
                f"{len(self.routers)}; it was recorded with another model"
            )
        self.clear()
        self._replay = _Replay(routed.long()) if routed is not None else None
        try:
            yield self
        finally:
            self._replay = None

    @contextlib.contextmanager
    def appending(self) -> Iterator[RouterTap]:
        """Keep every router call's choice (one per decoding step) instead of the last one."""
        self.clear()
        self._append = True
        try:
            yield self
        finally:
            self._append = False

    def chosen(self) -> torch.Tensor:
        """(N, L, K) long: the experts each layer chose (or replayed) in the last forward."""
        return torch.stack([torch.cat(r) for r in self.records], dim=1)


def load_balancing_loss(
    logits: list[torch.Tensor], indices: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4), over all MoE layers:

        loss = E * sum_e f_e * P_e,   f_e = (1/(N L)) sum_{n,l} 1[e in topk(n, l)] / 1 per k slot,
                                      P_e = (1/(N L)) sum_{n,l} softmax(logits_{n,l})_e

    pooled over layers and tokens as Hugging Face's `load_balancing_loss_func` does (f is kept per
    top-k slot, so a uniform router gives K).

    Args:
        logits: L tensors (N, E), the router logits of each layer.
        indices: (N, L, K) the experts chosen.
        num_experts: E.
        valid: (N,) bool, the tokens to count (padding excluded); None counts all.

    Returns:
        scalar float32 loss, differentiable through the logits.
    """
    probs = torch.softmax(torch.stack(logits, dim=1).float(), dim=-1)  # (N, L, E)
    chosen = nn.functional.one_hot(indices, num_experts).float()  # (N, L, K, E)
    if valid is not None:
        probs, chosen = probs[valid], chosen[valid]
    f = chosen.flatten(0, 1).mean(dim=0)  # (K, E)
    p = probs.flatten(0, 1).mean(dim=0)  # (E,)
    return (f * p[None]).sum() * num_experts


def routing_metrics(
    indices: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None
) -> dict[str, float]:
    """Per-step expert-load statistics of the chosen experts.

    Args:
        indices: (N, L, K) the experts chosen by each MoE layer.
        num_experts: E.
        valid: (N,) bool tokens to count.

    Returns:
        `moe/layer_{l}/load_max_over_mean` (1.0 is perfectly balanced) for each layer,
        `moe/load_max_over_mean` (the worst layer), `moe/tokens_per_expert/{e}` (token-slots routed
        to expert e, mean over layers) for E <= 64, `moe/tokens` counted.
    """
    if valid is not None:
        indices = indices[valid]
    n, num_layers, _ = indices.shape
    counts = torch.stack(
        [torch.bincount(indices[:, layer].reshape(-1), minlength=num_experts) for layer in range(num_layers)]
    ).float()  # (L, E)
    ratio = counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)
    out = {f"moe/layer_{layer}/load_max_over_mean": float(ratio[layer]) for layer in range(num_layers)}
    out["moe/load_max_over_mean"] = float(ratio.max()) if num_layers else 0.0
    if num_experts <= 64:
        per_expert = counts.mean(dim=0)
        out.update({f"moe/tokens_per_expert/{e}": float(per_expert[e]) for e in range(num_experts)})
    out["moe/tokens"] = float(n)
    return out
