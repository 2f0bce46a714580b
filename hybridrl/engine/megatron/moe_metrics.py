"""`actor/moe/*` metrics of a Megatron MoE model: the FSDP engine's expert-load metrics and aux loss.

A forward hook on every megatron-core router keeps, per MoE layer of a micro-batch's forward, the
router logits (recomputed in fp32 from the router's input and weight) and the experts it routed
each token to (its routing map, replayed experts included). When the micro-batch's output reaches
the engine, the tokens that are padding are dropped (the router sees the fed tokens in (S, b)
order: padded rows, or one packed row) and the same functions as the FSDP engine give

- `moe/aux_loss`: the Switch Transformer load-balancing loss over all MoE layers and valid tokens
  (hybridrl.models.moe.load_balancing_loss, what Hugging Face's forward computes),
- `moe/layer_{l}/load_max_over_mean`, `moe/load_max_over_mean`, `moe/tokens_per_expert/{e}`,
  `moe/tokens` (hybridrl.models.moe.routing_metrics).

The aux loss here is logged only: megatron-core adds its own load-balancing loss in the backward
(`moe_aux_loss_coeff`). Collected when every MoE layer of the micro-batch runs on this rank with
whole sequences: pipeline, context and sequence parallelism off (otherwise no metrics are logged).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hybridrl.models.moe import load_balancing_loss, routing_metrics

__all__ = ["RouterStats", "fed_valid_tokens", "router_stats_for"]


def fed_valid_tokens(micro: Any, packed: Any, fed_length: int) -> torch.Tensor:
    """(N,) bool: which of the N tokens a router saw are real, in the router's (S, b) order.

    packed: a PackedMicro (one row, its real tokens first), a PaddedMicro or None (padded rows).
    """
    if packed is not None and hasattr(packed, "valid"):
        return torch.arange(fed_length, device=packed.valid.device) < int(packed.valid.sum())
    attn = micro["attention_mask"].bool()
    extra = fed_length - attn.shape[1]
    if extra > 0:
        attn = torch.cat([attn, attn.new_zeros(attn.shape[0], extra)], dim=1)
    return attn.t().reshape(-1)


class RouterStats:
    """Per-micro-batch routing records of a Megatron MoE model (module docstring)."""

    def __init__(self, chunks: list[Any], num_experts: int, topk: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_experts, self.topk = num_experts, topk
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.active = False
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.results: list[tuple[torch.Tensor, dict[str, float]]] = []
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, router: Any, inputs: tuple, output: Any) -> None:
        if not self.active:
            return
        with torch.no_grad():
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            bias = None if getattr(router, "bias", None) is None else router.bias.float()
            logits = torch.nn.functional.linear(hidden, router.weight.float(), bias)
        self.records.append((logits, output[1].reshape(logits.shape).bool()))

    @contextlib.contextmanager
    def collecting(self, on: bool):
        """Record the forwards run inside (when `on`); the results are cleared on entry."""
        self.active, self.records, self.results = bool(on), [], []
        try:
            yield self
        finally:
            self.active, self.records = False, []

    def finish(self, valid: torch.Tensor) -> None:
        """Close one micro-batch's forward: its aux loss and metrics over the `valid` tokens."""
        if not self.active:
            return
        records, self.records = self.records, []
        if not records:
            return
        logits = [r[0][valid] for r in records]
        chosen = torch.stack(
            [r[1][valid].float().topk(self.topk, dim=-1).indices for r in records], dim=1
        )  # (N, L, K)
        aux = load_balancing_loss(logits, chosen, self.num_experts)
        self.results.append((aux, routing_metrics(chosen, self.num_experts)))

    def take(self) -> tuple[torch.Tensor, dict[str, float]] | None:
        """The oldest finished micro-batch's (aux loss, metrics), or None."""
        return self.results.pop(0) if self.results else None


def router_stats_for(chunks: list[Any], spec: Any, cfg: Any, role: str) -> RouterStats | None:
    """The `actor/moe/*` metrics of a MoE actor, where every MoE layer sees whole sequences on this rank
    (`spec`: the model's ArchSpec; `cfg`: its MegatronConfig)."""
    if role != "actor" or not spec.num_experts:
        return None
    sp = cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1
    if cfg.pipeline_model_parallel_size > 1 or cfg.context_parallel_size > 1 or sp:
        return None
    return RouterStats(chunks, spec.num_experts, spec.moe_topk)
