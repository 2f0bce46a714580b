"""Shared-prompt forward (`actor.use_prefix_grouper`): each prompt of a GRPO group computed once.

A GRPO micro-batch holds n responses per prompt, and the plain forward runs every prompt n
times. Here the rows whose prompts are identical form a group, and the micro-batch becomes one
packed row: for each group its prompt's valid tokens once, then each of its rows' valid response
tokens (veRL's PrefixGrouper idea, built on transformers' attention registry):

    packed row:  [ p_1 | r_11 | r_12 | ... | p_2 | r_21 | ... ]      (1, N) tokens
    positions:     0..Lp-1, each response Lp..Lp+L-1 (as in the row it came from)

Every layer but attention is per token, so it runs on the N tokens unchanged. Attention is
replaced, for the duration of the forward, by `grouped_attention`: the prompt tokens attend
causally among themselves (G groups x Pm padded prompt positions), and each response's tokens
attend to its group's prompt and causally to its own tokens (B rows x Tm padded response
positions, keys [prompt | response]). That is exactly the attention pattern of the rows one by
one, so log-probs, entropies and gradients equal the plain forward's (float rounding aside);
the gradient of a shared prompt token is the sum of what its n rows send it, as in the plain
forward where each copy receives its row's share and the copies share the weights.

Savings: linear layers (most of the FLOPs) process N = sum_g Lp_g + sum_b L_b tokens instead of
sum_b (Lp_b + L_b); with n = 4, 60-token prompts and 48-token responses that is 40% fewer tokens.

Shapes: B rows, S = P + T columns (prompt P left-padded, response T right-padded), G groups,
Pm / Tm the longest valid prompt / response, N packed tokens, H heads, KV key/value heads, D
head dim, K valid response tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTN_NAME = "hybridrl_prefix_group"
LAYOUT_KWARG = "hybridrl_prefix_layout"
INNER_ATTR = "_hybridrl_inner_attn"  # set on the model's configs: the implementation it had

__all__ = [
    "ATTN_NAME",
    "LayoutNotPassed",
    "PrefixGroupLayout",
    "build_prefix_layout",
    "grouped_attention",
    "prefix_grouped",
    "sequence_layout",
]


class LayoutNotPassed(RuntimeError):
    """The model's forward did not pass the layout down to its attention function."""


@dataclass
class PrefixGroupLayout:
    """Where each token of a micro-batch sits in the shared-prompt packed row.

    input_ids / position_ids: (1, N). pre_idx (G, Pm) / suf_idx (B, Tm): packed index of each
    group's prompt tokens / each row's response tokens (valid first, 0 where padded, see
    pre_valid / suf_valid); row_group (B,): the group of each row. prefix_mask (G, 1, Pm, Pm) /
    suffix_mask (B, 1, Tm, Pm + Tm): the boolean attention masks (True = attend). order (N,):
    the permutation that puts [prompt outputs; response outputs] back in packed order.
    pred / flat (K,): packed positions predicting the valid response tokens and their indices
    in the flattened (B, T) response layout (as `forward.response_positions`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pre_idx: torch.Tensor
    pre_valid: torch.Tensor
    suf_idx: torch.Tensor
    suf_valid: torch.Tensor
    row_group: torch.Tensor
    prefix_mask: torch.Tensor
    suffix_mask: torch.Tensor
    order: torch.Tensor
    pred: torch.Tensor
    flat: torch.Tensor

    @property
    def num_groups(self) -> int:
        return int(self.pre_idx.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


def _padded(rows: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D index tensors into (len(rows), longest) with zeros after each row, and its mask."""
    width = max(1, max(r.numel() for r in rows))
    out = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
        valid[i, : r.numel()] = True
    return out, valid


def _masks(pre_valid: torch.Tensor, suf_valid: torch.Tensor, row_group: torch.Tensor):
    """(prefix_mask (G, 1, Pm, Pm), suffix_mask (B, 1, Tm, Pm + Tm)): causal over valid keys."""
    pm, tm = pre_valid.shape[1], suf_valid.shape[1]
    causal_p = torch.ones(pm, pm, dtype=torch.bool, device=pre_valid.device).tril()
    prefix = causal_p[None] & pre_valid[:, None, :]
    causal_s = torch.ones(tm, tm, dtype=torch.bool, device=suf_valid.device).tril()
    to_prompt = pre_valid[row_group][:, None, :].expand(-1, tm, -1)
    to_self = causal_s[None] & suf_valid[:, None, :]
    return prefix[:, None], torch.cat([to_prompt, to_self], dim=-1)[:, None]


def build_prefix_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, t: int) -> PrefixGroupLayout:
    """Group the rows of a micro-batch by identical prompt and lay them out in one packed row.

    Args:
        input_ids: (B, S) [prompt | response], prompts left-padded.
        attention_mask: (B, S) 0/1.
        t: response length T (the prompt is the first S - T columns).

    Rows are grouped when their prompt columns (tokens and mask) are equal; groups keep the
    order of their first row, rows keep their order within a group.
    """
    b, s = input_ids.shape
    p = s - t
    dev = input_ids.device
    mask = attention_mask.bool()
    if bool((mask[:, :p].sum(-1) == 0).any()):
        raise ValueError("a row has an empty prompt (attention_mask all 0 over the prompt); drop it first")
    prompt_key = torch.where(mask[:, :p], input_ids[:, :p], -1)
    _, inverse = torch.unique(prompt_key, dim=0, return_inverse=True)
    first: dict[int, int] = {}
    for row, key in enumerate(inverse.tolist()):
        first.setdefault(key, row)
    group_of = {key: g for g, key in enumerate(sorted(first, key=first.get))}
    row_group = torch.tensor([group_of[k] for k in inverse.tolist()], dtype=torch.long, device=dev)

    where = torch.full((b, s), -1, dtype=torch.long, device=dev)  # (row, column) -> packed index
    ids, pos, pre_rows, suf_rows = [], [], [], []
    cursor = 0
    for g in range(len(first)):
        rows = (row_group == g).nonzero().squeeze(-1).tolist()
        cols = mask[rows[0], :p].nonzero().squeeze(-1)
        lp = cols.numel()
        here = torch.arange(cursor, cursor + lp, device=dev)
        pre_rows.append(here)
        ids.append(input_ids[rows[0], cols])
        pos.append(torch.arange(lp, device=dev))
        where[torch.tensor(rows, device=dev)[:, None], cols[None]] = here
        cursor += lp
        for row in rows:
            rcols = mask[row, p:].nonzero().squeeze(-1)
            here = torch.arange(cursor, cursor + rcols.numel(), device=dev)
            suf_rows.append((row, here))
            ids.append(input_ids[row, p + rcols])
            pos.append(lp + torch.arange(rcols.numel(), device=dev))
            where[row, p + rcols] = here
            cursor += rcols.numel()
    suf_rows.sort(key=lambda item: item[0])
    pre_idx, pre_valid = _padded(pre_rows, dev)
    suf_idx, suf_valid = _padded([idx for _, idx in suf_rows], dev)
    prefix_mask, suffix_mask = _masks(pre_valid, suf_valid, row_group)
    order = torch.empty(cursor, dtype=torch.long, device=dev)
    order[torch.cat([pre_idx[pre_valid], suf_idx[suf_valid]])] = torch.arange(cursor, device=dev)
    pred = where[:, -t - 1 : -1]
    valid = mask[:, -t:] & (pred >= 0)
    flat = valid.reshape(-1).nonzero().squeeze(-1)
    return PrefixGroupLayout(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        pre_idx=pre_idx,
        pre_valid=pre_valid,
        suf_idx=suf_idx,
        suf_valid=suf_valid,
        row_group=row_group,
        prefix_mask=prefix_mask,
        suffix_mask=suffix_mask,
        order=order,
        pred=pred.reshape(-1)[flat],
        flat=flat,
    )


def sequence_layout(cu_seqlens: torch.Tensor) -> PrefixGroupLayout:
    """The layout of a plain packed row (`pack_sequences`): every sequence a group of its own with
    no response part, so `grouped_attention` attends within each sequence: B x Lmax^2 work instead
    of the nnz^2 of a block-diagonal mask over the whole row.

    Args:
        cu_seqlens: (B + 1,) cumulative sequence lengths of the packed row.
    """
    dev = cu_seqlens.device
    starts, ends = cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()
    pre_idx, pre_valid = _padded([torch.arange(a, b, device=dev) for a, b in zip(starts, ends)], dev)
    b = len(starts)
    suf_idx = torch.zeros(b, 1, dtype=torch.long, device=dev)
    suf_valid = torch.zeros(b, 1, dtype=torch.bool, device=dev)
    row_group = torch.arange(b, device=dev)
    prefix_mask, suffix_mask = _masks(pre_valid, suf_valid, row_group)
    none = torch.zeros(0, dtype=torch.long, device=dev)
    nnz = int(ends[-1]) if ends else 0
    return PrefixGroupLayout(
        input_ids=none[None],
        position_ids=none[None],
        pre_idx=pre_idx,
        pre_valid=pre_valid,
        suf_idx=suf_idx,
        suf_valid=suf_valid,
        row_group=row_group,
        prefix_mask=prefix_mask,
        suffix_mask=suffix_mask,
        order=torch.arange(nnz, device=dev),
        pred=none,
        flat=none,
    )


def _attend(q, k, v, mask, dropout: float, scale: float | None, eager: bool) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for (R, H, W, D) q and (R, H, W', D) k/v, a boolean
    (R, 1, W, W') mask; `eager` spells it out (the model's own choice, e.g. bf16 on CPU, where
    PyTorch's SDPA backward is slow), else torch's scaled_dot_product_attention."""
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``ATTN_NAME``: q (1, H, N, D), k/v (1, KV, N, D) of the packed row ->
    (1, N, H, D); the layout comes in ``kwargs[LAYOUT_KWARG]`` (the model's forward passes its
    extra keyword arguments down to attention)."""
    layout: PrefixGroupLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise LayoutNotPassed(
            f"{type(module).__name__} did not pass the prefix layout to its attention function (its "
            "forward drops extra keyword arguments); set actor.use_prefix_grouper=false for this model"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            "actor.use_prefix_grouper does not support sliding-window attention; set it to false"
        )
    q, k, v = query[0], key[0], value[0]  # (H, N, D), (KV, N, D)
    if k.shape[0] != q.shape[0]:  # grouped-query attention: one K/V head per group of query heads
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    drop = dropout if module.training else 0.0
    eager = getattr(getattr(module, "config", None), INNER_ATTR, "sdpa") == "eager"

    def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # (H, N, D) -> (R, H, W, D)
        return x[:, idx].transpose(0, 1)

    kp, vp = take(k, layout.pre_idx), take(v, layout.pre_idx)
    out_p = _attend(take(q, layout.pre_idx), kp, vp, layout.prefix_mask, drop, scaling, eager)
    g = layout.row_group
    ks = torch.cat([kp[g], take(k, layout.suf_idx)], dim=2)
    vs = torch.cat([vp[g], take(v, layout.suf_idx)], dim=2)
    out_s = _attend(take(q, layout.suf_idx), ks, vs, layout.suffix_mask, drop, scaling, eager)
    # (R, H, W, D) -> the valid (n, H, D) rows, back in packed order
    rows = torch.cat([out_p.transpose(1, 2)[layout.pre_valid], out_s.transpose(1, 2)[layout.suf_valid]])
    return rows[layout.order][None], None


def _configs(module: nn.Module) -> list[Any]:
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    found = {id(base.config): base.config}
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    found[id(text)] = text
    for m in base.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            found[id(cfg)] = cfg
    return list(found.values())


@contextlib.contextmanager
def prefix_grouped(module: nn.Module) -> Iterator[None]:
    """Inside the block the model's attention is `grouped_attention` (its own one after)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, grouped_attention)
    configs = _configs(module)
    before = [c._attn_implementation for c in configs]
    if ATTN_NAME in before:
        raise RuntimeError("prefix_grouped: the model's attention is already grouped (nested call)")
    for c, name in zip(configs, before):
        setattr(c, INNER_ATTR, name)
        c._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation = name
            delattr(c, INNER_ATTR)
