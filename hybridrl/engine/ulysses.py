"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as veRL uses it) for the FSDP engine.

Layout: the ranks of a role are split into groups of ``sp`` consecutive ranks (the mesh
``{"dp": world / sp, "sp": sp}``, sp innermost). The ranks of one group get the same rows; each
holds one contiguous slice of the packed sequence (``use_remove_padding``: all valid tokens of
the micro-batch in one row, padded to a multiple of sp). Every layer except attention is
per-token, so it runs on the local slice unchanged. Attention is wrapped
(:func:`parallelize_sp`, through transformers' attention-function registry): an all-to-all
scatters the heads and gathers the sequence, so each rank attends over the whole sequence with
heads / sp of the heads; the inverse all-to-all brings the output back to the local slice.
Per-token results (log-probs, entropy, values) are computed on the slice and gathered along
the sequence (:func:`gather_seq`), so the loss is the SP=1 loss of the group's rows.

Gradients: :func:`gather_seq`'s backward is the adjoint of an all-gather (a reduce-scatter:
all-reduce, then this rank's slice). Every rank of a group computes the same loss, so the group
contributes sp times its gradient; FSDP averages over all world = dp * sp ranks, which leaves
the average over the dp groups: the SP=1 gradient with world / sp data-parallel ranks. The
loss normalisation uses the dp group (one rank per sp coordinate), as with SP=1.

Shapes: L = local sequence length (packed tokens / sp), S = L * sp, H heads, D head dim.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ATTN_NAME = "hybridrl_ulysses"

__all__ = [
    "apply_sp",
    "ATTN_NAME",
    "SPGroup",
    "all_to_all",
    "build_sp_groups",
    "check_sp_heads",
    "check_sp_layout",
    "gather_seq",
    "padded_length",
    "parallelize_sp",
    "slice_packed",
]


@dataclass(frozen=True)
class SPGroup:
    """One rank's Ulysses group: the process group, this rank's index in it, its size."""

    group: Any
    rank: int
    size: int


# ----------------------------------------------------------------------------------------------
# checks (pure)
# ----------------------------------------------------------------------------------------------
def check_sp_layout(
    key: str, sp: int, ranks: int, *, use_remove_padding: bool, strategy: str = "fsdp"
) -> None:
    """Raise ValueError naming `key` and the fix when `sp` cannot run on `ranks` ranks.

    Args:
        key: the config section (e.g. "actor_rollout_ref.actor").
        sp: its ulysses_sequence_parallel_size.
        ranks: the role's ranks (trainer.nnodes * trainer.n_gpus_per_node).
        use_remove_padding: the role's model.use_remove_padding (veRL requires it with SP > 1).
    """
    name = f"{key}.ulysses_sequence_parallel_size"
    if int(sp) != sp or sp < 1:
        raise ValueError(f"{name}={sp}: use an integer >= 1")
    if sp == 1:
        return
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(
            f"{name}={sp} with {key}.strategy={strategy}: Ulysses SP is an FSDP feature; with Megatron use "
            "megatron.context_parallel_size, or set it to 1"
        )
    if ranks % sp:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ValueError(
            f"{name}={sp} does not divide the {ranks} ranks (trainer.nnodes * trainer.n_gpus_per_node); "
            f"use one of {divisors}"
        )
    if not use_remove_padding:
        raise ValueError(
            f"{name}={sp} needs the packed path: set the role's model.use_remove_padding=True (as veRL requires)"
        )


def check_sp_heads(key: str, sp: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError unless the attention heads split over `sp` ranks (KV heads are repeated
    when they do not, as long as they divide the attention heads)."""
    if sp == 1:
        return
    if num_heads % sp:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"{key}.ulysses_sequence_parallel_size={sp} does not divide the model's {num_heads} attention heads "
            f"(each SP rank attends with heads / sp of them); use one of {divisors}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"the model's {num_heads} attention heads are not a multiple of its {num_kv_heads} KV heads"
        )


# ----------------------------------------------------------------------------------------------
# collectives with autograd
# ----------------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` in `size` chunks along scatter_dim, send chunk j to rank j, concat the received
    chunks along gather_dim."""
    chunks = [c.contiguous() for c in x.chunk(size, dim=scatter_dim)]
    inp = torch.stack(chunks)  # (size, ...) chunk j goes to rank j
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, scatter_dim, gather_dim):
        ctx.args = (group, size, gather_dim, scatter_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.args), None, None, None, None


def all_to_all(x: torch.Tensor, sp: SPGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over the SP group (its backward is the inverse all-to-all).

    E.g. (B, H, L, D) with scatter_dim=1, gather_dim=2 -> (B, H / sp, S, D).
    """
    return _AllToAll.apply(x, sp.group, sp.size, scatter_dim, gather_dim)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.args = (group, size, rank, dim)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, size, rank, dim = ctx.args
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)  # adjoint of all-gather: reduce-scatter
        return grad.chunk(size, dim=dim)[rank].contiguous(), None, None, None, None


def gather_seq(x: torch.Tensor, sp: SPGroup, dim: int = 0) -> torch.Tensor:
    """Concatenate the SP ranks' slices of `x` along `dim` (L -> S); differentiable (see the module
    docstring for what its backward means)."""
    return _GatherSeq.apply(x, sp.group, sp.size, sp.rank, dim)


# ----------------------------------------------------------------------------------------------
# the attention wrapper
# ----------------------------------------------------------------------------------------------
class _KVGroups:
    """Stand-in for an attention module whose KV heads were repeated: reports the new ratio."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner_attention(name: str | None, module: nn.Module) -> Callable:
    """The attention function the model would have used (its own eager one for 'eager')."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name and name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return eager or ALL_ATTENTION_FUNCTIONS["sdpa"]


def _block_causal(full_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, S, S) additive mask of a packed row from its position ids (each restart at 0 opens a
    new sequence): causal within a sequence, the dtype's minimum elsewhere."""
    seq_id = (full_pos[0] == 0).long().cumsum(0)
    n = seq_id.numel()
    allowed = torch.ones(n, n, dtype=torch.bool, device=full_pos.device).tril()
    allowed &= seq_id[:, None] == seq_id[None, :]
    mask = torch.zeros(n, n, dtype=dtype, device=full_pos.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """Registered as ``ATTN_NAME``: q (B, H, L, D), k/v (B, KV, L, D) of the local slice ->
    (B, L, H, D), attending over the whole packed sequence of the SP group.

    Reads the group from ``module.hybridrl_sp`` (set by `parallelize_sp`) and the packed row's
    position ids from ``kwargs["position_ids"]`` (transformers passes them to attention).
    """
    sp: SPGroup = module.hybridrl_sp
    inner = _inner_attention(module.hybridrl_inner_attn, module)
    pos = kwargs.pop("position_ids", None)
    if pos is None:
        raise RuntimeError(
            f"{type(module).__name__} does not pass position_ids to its attention function; Ulysses SP "
            "cannot find the packed sequences (set ulysses_sequence_parallel_size=1 for this model)"
        )
    kv_heads = key.shape[1]
    if kv_heads % sp.size:  # repeat the KV heads so that they split like the query heads
        rep = query.shape[1] // kv_heads
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        module = _KVGroups(module, 1)
    q, k, v = (all_to_all(t, sp, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    full_pos = gather_seq(pos.reshape(1, -1), sp, dim=1)
    if "flash" in (module.hybridrl_inner_attn or ""):  # flash finds the sequences from position ids
        out, weights = inner(module, q, k, v, None, position_ids=full_pos, **kwargs)
    else:
        out, weights = inner(module, q, k, v, _block_causal(full_pos, q.dtype), **kwargs)
    # (B, S, H / sp, D) -> (B, L, H, D)
    return all_to_all(out, sp, scatter_dim=1, gather_dim=2), weights


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "o_proj")]


def parallelize_sp(model: nn.Module, sp: SPGroup, key: str = "actor_rollout_ref.actor") -> nn.Module:
    """Wrap every attention layer of `model` for Ulysses SP over `sp` (in place; returns `model`).

    Registers `ulysses_attention` with transformers and switches the model's attention to it; the
    implementation the model had (sdpa, eager, flash_attention_2) runs inside on the gathered
    sequence. Raises ValueError when the heads do not split (see `check_sp_heads`).
    """
    from transformers import AttentionInterface

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    heads = int(text.num_attention_heads)
    check_sp_heads(key, sp.size, heads, int(getattr(text, "num_key_value_heads", None) or heads))
    layers = _attention_modules(base)
    if not layers:
        raise ValueError(f"{type(base).__name__} has no attention layer with q_proj/o_proj for Ulysses SP")
    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    inner = getattr(text, "_attn_implementation", None)
    if inner == ATTN_NAME:
        raise ValueError("parallelize_sp: the model is already parallelized")
    for layer in layers:
        layer.hybridrl_sp, layer.hybridrl_inner_attn = sp, inner
    # the text tower's configs only: a VLM's top-level config would pass the name on to its vision
    # config (transformers sets sub-configs recursively), whose attention is not split
    configs = [text, *(getattr(layer, "config", text) for layer in layers)]
    for cfg in {id(c): c for c in configs}.values():
        cfg._attn_implementation = ATTN_NAME
    return model


# ----------------------------------------------------------------------------------------------
# the inputs of one SP forward (a packed row)
# ----------------------------------------------------------------------------------------------
def padded_length(nnz: int, sp: SPGroup) -> int:
    """`nnz` packed tokens rounded up to a multiple of the SP size."""
    return nnz + (-nnz) % sp.size


def slice_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, sp: SPGroup):
    """(local input_ids (1, L), local position_ids (1, L)) of a packed row (1, nnz).

    The row is padded to `padded_length` with token 0 at positions 0, 1, ... (a sequence of its
    own, so no real token attends to it; results there are dropped), and this rank takes the
    contiguous slice [rank * L, (rank + 1) * L), L = padded / sp.
    """
    nnz = input_ids.shape[-1]
    pad = padded_length(nnz, sp) - nnz
    ids = F.pad(input_ids, (0, pad), value=0)
    pos = torch.cat(
        [position_ids, torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)[None]], -1
    )
    length = (nnz + pad) // sp.size
    start = sp.rank * length
    return ids[:, start : start + length], pos[:, start : start + length]


def build_sp_groups(layout: Any, rank: int) -> tuple[SPGroup, Any]:
    """(this rank's SPGroup, its dp group or None) of a ``{"dp": ..., "sp": ...}`` MeshLayout.

    Every rank must call this (it creates one process group per sp group and per dp group). The
    dp group (one rank per sp coordinate... i.e. the ranks that differ only in dp) is what loss
    normalisation and metric means all-reduce over; None when there is one dp group.
    """
    from hybridrl.single_controller.mesh import new_subgroups

    group = new_subgroups(layout, ["sp"], rank)
    dp_group = new_subgroups(layout, ["dp"], rank) if layout.size("dp") > 1 else None
    return SPGroup(group, layout.coords(rank)["sp"], layout.size("sp")), dp_group


def apply_sp(engine: Any, layout: Any, rank: int, key: str) -> None:
    """Ulysses SP on an HF engine from its dispatch mesh (``{"dp": world / sp, "sp": sp}``; a mesh
    without an sp dim of size > 1: nothing to do). Every rank calls it: it creates the sp and dp
    groups, wraps the model's attention (`parallelize_sp`) and sets the engine's data-parallel
    layout to the world / sp groups (FSDP still shards over every rank)."""
    if "sp" not in layout.names or layout.size("sp") == 1:
        return
    sp, dp_group = build_sp_groups(layout, rank)
    parallelize_sp(engine.module, sp, key=key)
    engine.set_data_parallel(layout.size("dp"), dp_group, sp)
