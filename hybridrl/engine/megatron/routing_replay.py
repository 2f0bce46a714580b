"""Routing replay in the Megatron engine: record the experts a forward chose, route later forwards with them.

Built on megatron-core's `RouterReplay` (one per MoE router, created by `moe_enable_routing_replay`):
its RECORD action keeps each router's top-k expert ids, its REPLAY_FORWARD action routes with
given ids (the probabilities are the router's scores at those ids, so the router still trains).

Engine-level contract (the same key and shape as the FSDP engine's):
    routed_experts   (B, S, L_moe, K) integer expert ids, aligned with input_ids (B, S); L_moe the
                     model's MoE layers in order, K = top-k.
A micro-batch carrying `routed_experts` is routed with it (every MoE layer, every token; padded
positions are routed to experts 0..K-1 and never reach a loss). `MegatronEngine.recording_routing()`
records the routing of the forwards run inside it; `take_recorded_routing()` returns one
(b, S, L_moe, K) tensor per micro-batch, in the same layout (zeros at padded positions).

Token order: Megatron's hidden states are (L, rows, H) and a router sees them flattened, so token
l * rows + r of a layer is position l of fed row r. The fed rows are the micro-batch's rows, or
(with `model.use_remove_padding`) one packed row of its valid tokens, possibly right-padded
(sequence parallelism), and each context-parallel rank feeds its own chunks of the positions,
each tensor-parallel rank with sequence parallelism its slice of them: `fed_routing` maps a
micro-batch's ids into exactly that order. Recording is done at PP=1 without context or sequence
parallelism (the records of a rank then cover the whole micro-batch); elsewhere it is refused
with the reason, replay works at every layout.

`routing_replay_plan(mode)` reads veRL's `router_replay.mode` (disabled, R2, R3) as what the
engine does in each pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "ReplayPlan",
    "RoutingReplay",
    "fed_routing",
    "routing_replay_plan",
    "unfed_routing",
]

ROUTED_EXPERTS = "routed_experts"
_MODES = ("disabled", "R2", "R3")


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """What one `router_replay.mode` asks of the training engine.

    record_old_log_prob: record the routing of the old-log-prob forward (R2) and carry it in the
        batch as `routed_experts` for the update.
    replay_update: the update's forwards route with the batch's `routed_experts`.
    replay_log_prob: the log-prob forwards (old and reference) route with it too (R3: the rollout
        recorded it).
    """

    mode: str
    record_old_log_prob: bool = False
    replay_update: bool = False
    replay_log_prob: bool = False


def routing_replay_plan(mode: str, key: str = "actor_rollout_ref.actor.router_replay.mode") -> ReplayPlan:
    """veRL's router_replay.mode -> the engine's plan; a clear error for an unknown mode.

    R2: the experts chosen in the old-log-prob pass are replayed in the update's forwards.
    R3: the rollout's recorded experts (`routed_experts` from the rollout) route every training
    forward of that sample.
    """
    if mode not in _MODES:
        raise ValueError(f"{key}={mode!r} is not one of {_MODES}")
    if mode == "R2":
        return ReplayPlan(mode, record_old_log_prob=True, replay_update=True)
    if mode == "R3":
        return ReplayPlan(mode, replay_update=True, replay_log_prob=True)
    return ReplayPlan(mode)


def _is_packed(feed: Any) -> bool:
    """A packed feed (forward.PackedMicro: one row of the valid tokens) carries `valid` (b, S)."""
    return getattr(feed, "valid", None) is not None


def _fed_positions(feed: Any, seq_len: int) -> int:
    return feed.input_ids.shape[1] if feed is not None else seq_len


def fed_routing(routed: torch.Tensor, feed: Any, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(b, S, L_moe, K) ids of a micro-batch -> (L_moe, positions, rows, K) in the fed layout.

    feed: the packed / padded feed of engine/megatron/forward.py, or None (rows fed as they are).
    Padding added by the feed routes to experts 0..K-1 (any distinct ids do: its outputs are dropped).
    """
    b, s, layers, k = routed.shape
    filler = torch.arange(k, dtype=routed.dtype, device=routed.device)
    length = _fed_positions(feed, s)
    if _is_packed(feed):
        flat = routed[feed.valid]  # (T, L_moe, K)
        out = filler.expand(length, layers, k).clone()
        out[: flat.shape[0]] = flat
        return out.permute(1, 0, 2)[:, :, None, :]  # (L_moe, L, 1, K)
    out = filler.expand(b, length, layers, k).clone()
    out[:, :s] = routed
    return out.permute(2, 1, 0, 3)  # (L_moe, L, b, K)


def unfed_routing(recorded: torch.Tensor, feed: Any, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of `fed_routing`: (L_moe, positions, rows, K) -> (b, S, L_moe, K), zeros at padding."""
    b, s = shape
    layers, _, _, k = recorded.shape
    per_token = recorded.permute(2, 1, 0, 3)  # (rows, positions, L_moe, K)
    if _is_packed(feed):
        out = per_token.new_zeros(b, s, layers, k)
        t = int(feed.valid.sum())
        out[feed.valid] = per_token[0, :t]
        return out
    return per_token[:, :s].contiguous()


class RoutingReplay:
    """The RouterReplay instances of one engine's model chunks, in MoE-layer order (global layers)."""

    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.per_chunk: list[list[tuple[int, Any]]] = []
        self._index: dict[int, int] = {}
        for i, chunk in enumerate(chunks):
            inner = getattr(chunk, "module", chunk)
            self._index[id(chunk)] = self._index[id(inner)] = i
            found = []
            for layer in inner.decoder.layers:
                router = getattr(getattr(layer, "mlp", None), "router", None)
                replay = getattr(router, "router_replay", None)
                if replay is not None:
                    found.append((layer.layer_number - 1, replay))
                    # this engine drives its own instances; megatron's global list would mix engines
                    with contextlib.suppress(ValueError):
                        RouterReplay.global_router_replay_instances.remove(replay)
            self.per_chunk.append(found)
        self.recording = False
        self.recorded: list[torch.Tensor] = []

    def index(self, chunk: Any) -> int:
        """The position of a model chunk (DDP-wrapped or not) among the engine's chunks."""
        return self._index[id(chunk)]

    @property
    def num_layers(self) -> int:
        return sum(len(found) for found in self.per_chunk)

    def before_forward(self, chunk_index: int, fed: torch.Tensor | None) -> None:
        """Set this chunk's routers for one forward: replay `fed` (L_moe, positions, rows, K), record, or route."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, replay in self.per_chunk[chunk_index]:
            replay.clear_indices()
            if fed is not None:
                replay.set_target_indices(fed[layer].reshape(-1, fed.shape[-1]))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif self.recording:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                replay.clear_router_replay_action()

    def after_forward(
        self, chunk_index: int, feed: Any, shape: tuple[int, int], positions: int, rows: int
    ) -> None:
        """Keep what this chunk's routers recorded (as (b, S, L_moe, K)) and reset them."""
        found = self.per_chunk[chunk_index]
        if self.recording and found and found[0][1].recorded_topk_idx is not None:
            rec = torch.stack([replay.recorded_topk_idx for _, replay in found])  # (L_moe, tokens, K)
            rec = rec.reshape(rec.shape[0], positions, rows, rec.shape[-1])
            self.recorded.append(unfed_routing(rec, feed, shape))
        for _, replay in found:
            replay.clear_indices()
            replay.clear_router_replay_action()

    @contextlib.contextmanager
    def record(self, sequence_parallel: bool = False) -> Iterator[None]:
        """Record the routing of the forwards run inside (refused where one rank does not see it all)."""
        check_recordable(sequence_parallel)
        self.recorded = []
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    def take(self) -> list[torch.Tensor]:
        """The recorded (b, S, L_moe, K) tensors, one per micro-batch forward, and forget them."""
        out, self.recorded = self.recorded, []
        return out


def check_recordable(sequence_parallel: bool) -> None:
    """Recording needs every MoE layer and every position of a row on this rank (PP=1, CP=1, no SP)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    if pp > 1 or cp > 1 or sequence_parallel:
        raise ValueError(
            f"recording the routing (router_replay.mode=R2) needs pipeline_model_parallel_size=1, "
            f"context_parallel_size=1 and sequence_parallel=False (got PP={pp}, CP={cp}, SP={sequence_parallel}): "
            "each rank must see every MoE layer and every position; use R3 (the rollout records) or those sizes"
        )


def fed_slice(fed: torch.Tensor, cp_positions: torch.Tensor | None, tp_slice: slice | None) -> torch.Tensor:
    """This rank's positions of a fed routing tensor (context-parallel chunks, then the SP slice)."""
    if cp_positions is not None:
        fed = fed[:, cp_positions]
    if tp_slice is not None:
        fed = fed[:, tp_slice]
    return fed
