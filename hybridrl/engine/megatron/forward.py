"""Micro-batch forward passes of Megatron GPT chunks through Megatron's pipeline schedules.

`run_schedule` feeds a list of micro-batches (TensorDicts in the veRL batch layout, see
engine/forward.py) through `get_forward_backward_func()` (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages) and returns what `loss_fn` produced for each micro-batch
on the last pipeline stage ([] elsewhere). `loss_fn(micro, output) -> (loss, result)`; the loss
is backpropagated unless `forward_only`. Megatron divides each returned loss by the number of
micro-batches; `run_schedule` multiplies it back, so `loss_fn` returns the loss exactly as the
FSDP actor would call `.backward()` on it (already normalised by the whole mini-batch).

The attention mask is explicit (causal and key padding, True = masked): Megatron's default causal
mask is built on CUDA. RoPE in Megatron ignores position_ids and uses 0..S-1; for left-padded
rows that shifts every valid position by the same amount, which RoPE's relative form cancels.

Packed micro-batches (`model.use_remove_padding=True`): the valid tokens of the b rows are
concatenated into one row of T = sum of lengths (padded to a length L shared by the call's
micro-batches, a multiple of the tensor-parallel size for sequence parallelism), with a
block-diagonal causal mask, so no padding goes through the linear layers and the MLP. veRL packs
into THD sequences with PackedSeqParams, which need Transformer Engine's varlen attention; the
local attention here takes the (1, 1, L, L) mask instead. Each sequence's RoPE positions are
shifted by its offset in the row, which the relative form cancels, as for left padding; the
outputs are scattered back to the padded (b, S, ...) layout before the loss sees them.

Sequence parallelism (`megatron.sequence_parallel` at TP > 1) splits the sequence dimension over
the tensor-parallel ranks between the linear layers, so every fed row must be a multiple of TP
long: packed rows already are; padded micro-batches get right padding (masked keys) up to the next
multiple (`seq_multiple`), cropped off the outputs before the loss.

Context parallelism (`megatron.context_parallel_size` > 1, engine/megatron/context_parallel.py):
every fed row (padded or packed) is a multiple of 2 * CP long; each CP rank feeds its two
load-balanced chunks of the tokens and the matching rows of the mask. `position_fn` turns this
rank's outputs into small per-position results (log-prob and entropy, or values) against the next
token of each position, those are gathered over CP into the whole row, unpacked, and handed to
`loss_fn`; Megatron's schedule multiplies the loss by CP (its DDP averages the gradients over
DP x CP, and each CP rank's gradient is the part from its own positions).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from hybridrl.engine.megatron.context_parallel import cp_group_info, cp_positions, gather_positions
from hybridrl.engine.megatron.cpu_shims import cuda_to_cpu

__all__ = ["PackedMicro", "PaddedMicro", "attention_mask_4d", "pack_micro", "pad_micro", "run_schedule"]


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) valid-token mask -> (B, 1, S, S) bool, True where query i may NOT attend key j."""
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | pad


@dataclasses.dataclass
class PackedMicro:
    """One micro-batch's rows packed into a single row (see the module docstring).

    Attributes:
        input_ids: (1, L) the valid tokens of every row, then padding.
        mask: (1, 1, L, L) bool, True where query i may NOT attend key j (block-diagonal causal).
        valid: (b, S) bool, where each packed token came from in the padded layout.
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    position_ids = None  # RoPE uses 0..L-1 (module docstring)

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """(1, L, ...) outputs -> (b, S, ...), zeros at padded positions (differentiable)."""
        t = int(self.valid.sum())
        full = out.new_zeros((*self.valid.shape, *out.shape[2:]))
        full[self.valid] = out[0, :t]
        return full


@dataclasses.dataclass
class PaddedMicro:
    """A padded micro-batch with right padding up to a multiple of TP (sequence parallelism).

    Attributes:
        input_ids: (b, L) the micro-batch's ids, then zeros.
        mask: (b, 1, L, L) bool, True where query i may NOT attend key j (the padding is masked).
        position_ids: (b, L) the micro-batch's positions, continued over the padding.
        length: S, the micro-batch's own length.
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    length: int

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """(b, L, ...) outputs -> (b, S, ...)."""
        return out[:, : self.length]


def pad_micro(micro: Any, multiple: int) -> PaddedMicro | None:
    """`micro` (input_ids / attention_mask (b, S)) right-padded to a multiple of `multiple`; None if S is one."""
    ids, attn = micro["input_ids"], micro["attention_mask"]
    b, s = ids.shape
    extra = -s % multiple
    if not extra:
        return None
    positions = micro["position_ids"] if "position_ids" in micro.keys() else None
    if positions is None or positions.dim() != 2:
        positions = torch.arange(s, device=ids.device).expand(b, s)
    more = positions[:, -1:] + torch.arange(1, extra + 1, device=ids.device)
    return PaddedMicro(
        input_ids=torch.cat([ids, ids.new_zeros(b, extra)], dim=1),
        mask=attention_mask_4d(torch.cat([attn, attn.new_zeros(b, extra)], dim=1)),
        position_ids=torch.cat([positions, more], dim=1),
        length=s,
    )


def packed_length(micros: list[Any], multiple: int) -> int:
    """The row length L shared by the packed micro-batches: the longest, rounded up to `multiple`."""
    longest = max(int(m["attention_mask"].sum()) for m in micros)
    return -(-longest // multiple) * multiple


def pack_micro(micro: Any, length: int) -> PackedMicro:
    """Pack the valid tokens of `micro` (input_ids / attention_mask (b, S)) into one row of `length`."""
    valid = micro["attention_mask"].bool()
    ids = micro["input_ids"][valid]
    lengths = valid.sum(-1)
    segment = torch.repeat_interleave(torch.arange(valid.shape[0], device=ids.device), lengths)
    pad = length - ids.shape[0]
    if pad < 0:
        raise ValueError(f"packed length {length} is shorter than the micro-batch's {ids.shape[0]} tokens")
    ids = torch.cat([ids, ids.new_zeros(pad)])
    segment = torch.cat([segment, segment.new_full((pad,), -1)])  # padding: a block of its own
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)
    mask = causal | (segment[:, None] != segment[None, :])
    return PackedMicro(ids[None], mask[None, None], valid)


def next_token_targets(micro: Any, packed: Any) -> torch.Tensor:
    """(rows, L) the id after each fed position (the id a position's logits are scored against).

    In the padded (b, S) layout position i is scored against input_ids[i + 1] (the prompt's last
    position against the first response token, ...); the last position against 0. Mapped to the
    fed layout: packed rows take the valid positions' targets, padded feeds add right padding."""
    ids = micro["input_ids"]
    targets = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)
    if isinstance(packed, PackedMicro):
        flat = targets[packed.valid]
        return torch.cat([flat, flat.new_zeros(packed.input_ids.shape[1] - flat.shape[0])])[None]
    if isinstance(packed, PaddedMicro):
        return torch.cat(
            [targets, targets.new_zeros(ids.shape[0], packed.input_ids.shape[1] - ids.shape[1])], 1
        )
    return targets


def _model_inputs(micro: Any, packed: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (rows, L), mask (rows, 1, L, L), position ids (rows, L)) of one fed micro-batch."""
    if packed is not None:
        ids, mask, positions = packed.input_ids, packed.mask, packed.position_ids
    else:
        ids, mask = micro["input_ids"], attention_mask_4d(micro["attention_mask"])
        positions = micro["position_ids"] if "position_ids" in micro.keys() else None
    if positions is None or positions.dim() != 2:  # RoPE ignores them (module docstring)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return ids, mask, positions


def _forward_step(loss_fn: Callable, extra_inputs: Callable | None, routing: Any, data_iterator, model):
    micro, packed = next(data_iterator)
    ids, mask, positions = _model_inputs(micro, packed)
    extra = extra_inputs(micro, packed) if extra_inputs is not None else {}
    cp, cp_rank, _ = cp_group_info()
    mine = None
    if cp > 1:  # this rank's two chunks of the tokens, its query rows of the mask (context_parallel.py)
        mine = cp_positions(ids.shape[1], cp, cp_rank, ids.device)
        ids, positions, mask = ids[:, mine], positions[:, mine], mask[:, :, mine]
        extra = {k: v[..., mine] for k, v in extra.items()}  # per-position inputs: the MTP labels and mask
    if routing is None:
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, **extra)
    else:  # a MoE model: replay the micro-batch's routed_experts, or record (routing_replay.py)
        chunk = routing.index(model)
        routing.before_forward(chunk, _fed_routes(micro, packed, mine, ids.shape[1], model))
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, **extra)
        routing.after_forward(chunk, packed, tuple(micro["input_ids"].shape), ids.shape[1], ids.shape[0])
    return out, functools.partial(loss_fn, micro, packed)


def _fed_routes(micro: Any, packed: Any, cp_mine: Any, fed_len: int, model: Any) -> torch.Tensor | None:
    """This rank's (L_moe, positions, rows, K) expert ids of the micro-batch's `routed_experts`, or None."""
    from hybridrl.engine.megatron.routing_replay import ROUTED_EXPERTS, fed_routing, fed_slice

    if ROUTED_EXPERTS not in micro.keys():
        return None
    tp_slice = None
    config = getattr(model, "config", None) or model.module.config
    if config.sequence_parallel:  # each TP rank routes its slice of the positions
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        per = fed_len // tp
        tp_slice = slice(rank * per, (rank + 1) * per)
    return fed_slice(fed_routing(_fill_unrouted(micro[ROUTED_EXPERTS].long()), packed), cp_mine, tp_slice)


def _fill_unrouted(routes: torch.Tensor) -> torch.Tensor:
    """Tokens with nothing recorded (-1: padding, or a response's last token, which the rollout never
    fed) get experts 0..K-1: megatron-core's replay needs a valid choice for every fed token, and no
    kept log-prob depends on these (padding is masked out; nothing is predicted after the last token)."""
    missing = (routes < 0).any(dim=-1, keepdim=True)
    if not bool(missing.any()):
        return routes
    filler = torch.arange(routes.shape[-1], device=routes.device).expand_as(routes)
    return torch.where(missing, filler, routes)


def _lcm(a: int | None, b: int) -> int:
    return math.lcm(a or 1, b)


def run_schedule(
    chunks: list[Any],
    micros: list[Any],
    loss_fn: Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]],
    *,
    forward_only: bool,
    pack_multiple: int | None = None,
    seq_multiple: int | None = None,
    extra_inputs: Callable[[Any, Any], dict[str, torch.Tensor]] | None = None,
    position_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    routing: Any = None,
    router_stats: Any = None,
) -> list[Any]:
    """Run forward (and backward) of `micros` through the pipeline; results of the last stage.

    Args:
        chunks: this rank's model chunks (DDP-wrapped when training).
        micros: micro-batches, every one with input_ids (b, S) of the same S.
        loss_fn: (micro, logits or values (b, S, ...)) -> (scalar loss, result).
        pack_multiple: pack each micro-batch into one row whose length is a multiple of this
            (`model.use_remove_padding`); None feeds the padded rows.
        seq_multiple: padded rows are right-padded to a multiple of this (sequence parallelism:
            the TP size); None feeds them as they are.
        extra_inputs: (micro, packed or padded feed or None) -> more keyword inputs of the model
            (the MTP loss's labels / loss_mask, engine/megatron/mtp.py), per position of the fed row
            along their last dim (with context parallelism each CP rank gets its positions); None: none.
        position_fn: with context parallelism, (this rank's outputs (rows, L / CP, ...), their
            next-token ids (rows, L / CP)) -> per-position results (rows, L / CP, k), gathered
            over CP before `loss_fn` sees them; None passes the outputs themselves (the critic's
            values). Unused without CP.
        routing: a MoE model's RoutingReplay (engine/megatron/routing_replay.py): micro-batches
            carrying `routed_experts` route with them, and routing is recorded while it records.
        router_stats: a MoE model's RouterStats (engine/megatron/moe_metrics.py): each micro-batch's
            routing metrics are finished, padding excluded, before `loss_fn` sees its output.

    Returns:
        One `result` per micro-batch on the last pipeline stage, [] on the others.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hybridrl.engine.megatron.moe_metrics import fed_valid_tokens

    n = len(micros)
    if len(chunks) > 1:
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        if n % pp:
            raise ValueError(
                f"virtual pipeline stages need a number of micro-batches divisible by pipeline_model_parallel_size={pp}, "
                f"got {n}: choose micro-batch sizes (ppo_micro_batch_size_per_gpu, log_prob_micro_batch_size_per_gpu) "
                "that split each batch into a multiple of it"
            )
    results: list[Any] = []

    cp, cp_rank, _ = cp_group_info()

    def scaled(micro, packed, output):
        if router_stats is not None:
            router_stats.finish(fed_valid_tokens(micro, packed, output.shape[1]))
        if cp > 1:
            if position_fn is not None:
                targets = next_token_targets(micro, packed)
                output = position_fn(output, targets[:, cp_positions(targets.shape[1], cp, cp_rank)])
            output = gather_positions(output)
        loss, result = loss_fn(micro, output if packed is None else packed.unpack(output))
        results.append(result)
        # (Megatron's schedule multiplies the loss by CP itself: its DDP averages the grads over DP x CP)
        return loss * n, {}

    if cp > 1:  # every fed row a multiple of 2 CP (and of TP for sequence parallelism)
        pack_multiple = None if pack_multiple is None else _lcm(pack_multiple, 2 * cp)
        seq_multiple = _lcm(seq_multiple, 2 * cp)
    feeds = [None] * n
    if pack_multiple is not None:
        length = packed_length(micros, pack_multiple)
        feeds = [pack_micro(m, length) for m in micros]
    elif seq_multiple is not None and seq_multiple > 1:
        feeds = [pad_micro(m, seq_multiple) for m in micros]
    # (every feed has the first's shape: one packed length, and one padded length per call)
    first = feeds[0].input_ids if feeds[0] is not None else micros[0]["input_ids"]
    iters = [iter(list(zip(micros, feeds))) for _ in chunks]
    with cuda_to_cpu():
        get_forward_backward_func()(
            forward_step_func=functools.partial(_forward_step, scaled, extra_inputs, routing),
            data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=n,
            seq_length=first.shape[1],
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
        )
    return results
