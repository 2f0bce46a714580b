"""Routing of a mixture-of-experts model inside an engine forward: replay the batch's recorded
experts, record the experts chosen, and the router's load-balancing loss and load metrics.

The batch carries routing under `routed_experts`: (B, S, L, K) integers aligned with input_ids
(L MoE layers, K experts per token), -1 where nothing was recorded (padding, or a token the
rollout never fed to the model, such as the last generated one); a -1 token routes as the router
chooses. A forward lays the batch's tokens out in its own order (the padded (B, S) batch, the packed
valid tokens, or the shared-prompt row); `token_source` gives, for each token of that order, its
index in the flattened (B * S) batch, so routing moves between the two layouts by a gather and a
scatter.

Ulysses sequence parallelism: each rank of an SP group runs its slice of the packed row
(`ulysses.slice_packed`), and routing is per token, so the routers run on the slice unchanged. The
replayed routing is sliced the same way (the row's padding routes freely); the chosen experts and
the router logits are gathered along the sequence (`ulysses.gather_seq`), so every rank of the group
records the whole row's routing and computes the load-balancing loss and metrics of all its tokens,
exactly as with SP=1. The loss then follows the log-probs' gradient convention (engine/ulysses.py):
every rank computes the same loss, and the gather's backward hands each rank the gradient of its
slice.

Shapes: B batch, S sequence, N tokens of the forward, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridrl.engine.multimodal import has_multimodal
from hybridrl.engine.prefix_group import build_prefix_layout
from hybridrl.engine.ulysses import SPGroup, gather_seq, padded_length
from hybridrl.models.moe import RouterTap, load_balancing_loss, moe_shape, routing_metrics
from hybridrl.utils.torch_utils import pack_sequences

__all__ = [
    "MoEForward",
    "RoutingRequest",
    "routed_in_forward_order",
    "scatter_routed",
    "supports_routing",
    "token_source",
]

ROUTED_EXPERTS = "routed_experts"


@dataclass(frozen=True)
class RoutingRequest:
    """What a forward does with a MoE model's routing.

    record: return the experts chosen, (B, S, L, K). replay: route with the micro-batch's
    `routed_experts`. aux_loss: compute the load-balancing loss (differentiable) and load metrics.
    """

    record: bool = False
    replay: bool = False
    aux_loss: bool = False

    def __bool__(self) -> bool:
        return self.record or self.replay or self.aux_loss


def token_source(batch: Any, use_remove_padding: bool, prefix_group: bool) -> torch.Tensor:
    """(N,) long: for each token of the forward, its index in the flattened (B * S) batch.

    Padded forward: every position (N = B * S); packed: the valid tokens (`pack_sequences`);
    shared-prompt: the grouped row (`prefix_group.build_prefix_layout`, a shared prompt read from its
    group's first row).
    """
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    if prefix_group:
        t = batch["responses"].shape[-1]
        return build_prefix_layout(input_ids, mask, t).source
    if use_remove_padding:
        return pack_sequences(input_ids, mask).indices
    return torch.arange(input_ids.numel(), device=input_ids.device)


def routed_in_forward_order(routed: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """(B, S, L, K) batch routing -> (N, L, K) in the forward's token order."""
    b, s, num_layers, k = routed.shape
    return routed.reshape(b * s, num_layers, k)[source.to(routed.device)]


def scatter_routed(chosen: torch.Tensor, source: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, L, K) chosen in the forward's order -> (B, S, L, K) aligned with the batch (mask (B, S)),
    -1 at padding."""
    b, s = mask.shape
    out = torch.full((b * s, *chosen.shape[1:]), -1, dtype=chosen.dtype, device=chosen.device)
    out[source.to(chosen.device)] = chosen
    out = out.view(b, s, *chosen.shape[1:])
    return out.masked_fill(~mask.bool().to(out.device)[..., None, None], -1)


@dataclass(frozen=True)
class _SPSlice:
    """This rank's slice of a packed row of `nnz` tokens under Ulysses SP (`ulysses.slice_packed`)."""

    sp: SPGroup
    nnz: int

    def local(self, x: torch.Tensor, fill: int) -> torch.Tensor:
        """(nnz, ...) in the packed order -> (L, ...) of this rank (the row padded with `fill`)."""
        padded = padded_length(self.nnz, self.sp)
        x = torch.cat([x, x.new_full((padded - self.nnz, *x.shape[1:]), fill)])
        length = padded // self.sp.size
        return x[self.sp.rank * length : (self.sp.rank + 1) * length]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(L, ...) of this rank -> (nnz, ...) of the whole row; differentiable (`ulysses.gather_seq`)."""
        return gather_seq(x, self.sp, dim=0)[: self.nnz]


def _sp_slice(source: torch.Tensor, sp: SPGroup | None, use_remove_padding: bool) -> _SPSlice | None:
    if sp is None or sp.size == 1:
        return None
    if not use_remove_padding:
        raise ValueError("Ulysses sequence parallelism needs use_remove_padding=True (the packed path)")
    return _SPSlice(sp, source.numel())


@dataclass
class RoutingResult:
    """What one forward's routing gave: routed (B, S, L, K) with `record`; aux_loss (scalar,
    differentiable) and metrics with `aux_loss`."""

    routed: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class MoEForward:
    """The routers of one engine's model, hooked once (`models.moe.RouterTap`)."""

    def __init__(self, module: nn.Module) -> None:
        self.tap = RouterTap(module)
        self.num_layers, self.num_experts, self.top_k = moe_shape(module)

    @contextlib.contextmanager
    def forward(
        self,
        micro: Any,
        request: RoutingRequest,
        *,
        use_remove_padding: bool,
        prefix_group: bool,
        sp: SPGroup | None = None,
    ) -> Iterator[RoutingResult]:
        """Around one forward of `micro`: replay / record / aux loss as `request` asks."""
        result = RoutingResult()
        if not request:
            yield result
            return
        _refuse_unsupported(micro)
        source = token_source(micro, use_remove_padding, prefix_group)
        sliced = _sp_slice(source, sp, use_remove_padding)
        replay = None
        if request.replay:
            replay = routed_in_forward_order(self._batch_routing(micro), source)
            replay = sliced.local(replay, fill=-1) if sliced else replay
        self.tap.keep_logits = request.aux_loss
        try:
            with self.tap.replaying(replay):
                yield result
            chosen, logits = self.tap.chosen(), self.tap.logits
            if sliced:
                chosen = sliced.gather(chosen)
                logits = [sliced.gather(x) for x in logits] if request.aux_loss else logits
            valid = micro["attention_mask"].reshape(-1).bool()[source.to(micro["attention_mask"].device)]
            if request.record:
                result.routed = scatter_routed(chosen, source, micro["attention_mask"])
            if request.aux_loss:
                valid = valid.to(chosen.device)
                result.aux_loss = load_balancing_loss(logits, chosen, self.num_experts, valid)
                result.metrics = routing_metrics(chosen, self.num_experts, valid)
        finally:
            self.tap.keep_logits = False
            self.tap.clear()

    def _batch_routing(self, micro: Any) -> torch.Tensor:
        if ROUTED_EXPERTS not in micro.keys():
            raise KeyError(
                "routing replay is on but the batch has no 'routed_experts': with router_replay.mode=R3 "
                "the rollout must record them (actor_rollout_ref.rollout.enable_rollout_routing_replay=true); "
                "with R2 the old-log-prob pass records them"
            )
        routed = micro[ROUTED_EXPERTS]
        want = (*micro["input_ids"].shape, self.num_layers, self.top_k)
        if tuple(routed.shape) != want:
            raise ValueError(
                f"'routed_experts' has shape {tuple(routed.shape)}, the model routes {want} "
                "(batch, seq_len, MoE layers, top_k): it was recorded with another model or batch layout"
            )
        return routed


def supports_routing(micro: Any) -> bool:
    """Whether routing can be recorded, replayed and measured in this forward (text batches, with
    or without Ulysses SP; not with images or video)."""
    return not has_multimodal(micro)


def _refuse_unsupported(micro: Any) -> None:
    if has_multimodal(micro):
        raise NotImplementedError(
            "routing replay and the router load-balancing loss are for text-only batches; this batch has "
            "images or video"
        )
