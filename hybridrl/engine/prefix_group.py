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

Vision-language models (Qwen2-VL, Qwen2.5-VL; `engine.multimodal.grouped_model_inputs`): rows
share a prompt only when its pixels are equal too (`build_prefix_layout(row_keys=...)`: equal
image tokens can hold different pictures); the vision tower runs on each group's prompt images
and videos once (plus any tool images of the responses), the 3-D rotary positions of every packed
token are its row's own (`PrefixGroupLayout.source`), and only the text tower's attention is
grouped (the vision tower's patches keep attending per image).

Savings: linear layers (most of the FLOPs) process N = sum_g Lp_g + sum_b L_b tokens instead of
sum_b (Lp_b + L_b); with n = 4, 60-token prompts and 48-token responses that is 40% fewer tokens.

Shapes: B rows, S = P + T columns (prompt P left-padded, response T right-padded), G groups,
Pm / Tm the longest valid prompt / response, N packed tokens, H heads, KV key/value heads, D
head dim, K valid response tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTN_NAME = "hybridrl_prefix_group"
LAYOUT_KWARG = "hybridrl_prefix_layout"
INNER_ATTR = "_hybridrl_inner_attn"  # set on the model's configs: the implementation it had
GROUPED_VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # vision-language models the grouper takes

__all__ = [
    "ATTN_NAME",
    "LayoutNotPassed",
    "PrefixGroupLayout",
    "build_prefix_layout",
    "grouped_attention",
    "model_refusal",
    "prefix_grouped",
    "sequence_layout",
]


class LayoutNotPassed(RuntimeError):
    """The model's forward did not pass the layout down to its attention function."""


class _PlanCache:
    """The layout's attention plans by device. Not a dict on purpose: FSDP2 rebuilds dataclass
    arguments before each wrapped layer (`dataclasses.replace` over its fields, dicts copied), and
    an opaque object is passed through as it is, so every layer's copy shares one cache."""

    __slots__ = ("by_device",)

    def __init__(self) -> None:
        self.by_device: dict[str, AttentionPlan] = {}


@dataclass
class PrefixGroupLayout:
    """Where each token of a micro-batch sits in the shared-prompt packed row.

    The row is a sequence of segments: for each group its prompt, then its rows' responses.
    input_ids / position_ids: (1, N) (empty for `sequence_layout`, which reuses a packed row's
    own). lengths: the tokens of each segment, in row order (they sum to N). prompt_of: for each
    segment, -1 for a prompt, else the index of its group's prompt segment. pred / flat (K,):
    packed positions predicting the valid response tokens and their indices in the flattened
    (B, T) response layout (as `forward.response_positions`). num_groups: G. rows: for each
    segment, the batch row it was read from (a prompt: its group's first row). source (N,): where
    each packed token was read from, as an index into the flattened (B, S) batch (per-token
    inputs such as a VLM's 3-D rotary positions are gathered with it).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int]
    prompt_of: list[int]
    pred: torch.Tensor
    flat: torch.Tensor
    num_groups: int
    rows: list[int] = field(default_factory=list)
    source: torch.Tensor | None = None
    _plans: _PlanCache = field(default_factory=lambda: _PlanCache(), repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def plan(self, device: torch.device) -> AttentionPlan:
        """The batched attention plan of this layout on `device` (built once, shared by every layer)."""
        plans, key = self._plans.by_device, str(device)
        if key not in plans:
            plans[key] = _build_plan(self.lengths, self.prompt_of, device)
        return plans[key]


@dataclass
class AttentionPlan:
    """Index tensors that turn the packed row's segments into two padded attention batches.

    Prompts (G of them, every segment with prompt_of == -1): p_idx (G, Pm) packed positions
    (clamped where padded), p_valid (G, Pm). Responses (R segments): r_idx / r_valid (R, Tm),
    r_group (R,) the prompt batch row each attends to, r_mask (R, 1, Tm, Pm + Tm) bool: the
    valid prompt keys, then causal within the response. order (N,): where each packed token's
    output sits in cat(prompt outputs[p_valid], response outputs[r_valid]).
    """

    p_idx: torch.Tensor
    p_valid: torch.Tensor
    r_idx: torch.Tensor | None
    r_valid: torch.Tensor | None
    r_group: torch.Tensor | None
    r_mask: torch.Tensor | None
    order: torch.Tensor


def _padded_index(
    starts: list[int], lengths: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, Lm) packed positions of S segments padded to the longest (Lm >= 1), and their validity."""
    lm = max(max(lengths, default=1), 1)
    ar = torch.arange(lm, device=device)
    start = torch.tensor(starts, dtype=torch.long, device=device)[:, None]
    n = torch.tensor(lengths, dtype=torch.long, device=device)[:, None]
    valid = ar[None] < n
    return torch.where(valid, start + ar[None], 0), valid  # padded slots read token 0 (dropped later)


def _build_plan(lengths: list[int], prompt_of: list[int], device: torch.device) -> AttentionPlan:
    starts, cursor = [], 0
    for n in lengths:
        starts.append(cursor)
        cursor += n
    prompts = [i for i, p in enumerate(prompt_of) if p < 0]
    row_of = {seg: g for g, seg in enumerate(prompts)}
    responses = [i for i, p in enumerate(prompt_of) if p >= 0]
    p_idx, p_valid = _padded_index([starts[i] for i in prompts], [lengths[i] for i in prompts], device)
    out_pos = [p_idx[p_valid]]
    r_idx = r_valid = r_group = r_mask = None
    if responses:
        r_idx, r_valid = _padded_index(
            [starts[i] for i in responses], [lengths[i] for i in responses], device
        )
        r_group = torch.tensor([row_of[prompt_of[i]] for i in responses], dtype=torch.long, device=device)
        tm, pm = r_idx.shape[1], p_idx.shape[1]
        causal = torch.ones(tm, tm, dtype=torch.bool, device=device).tril()
        r_mask = torch.cat(
            [p_valid[r_group][:, None, :].expand(-1, tm, pm), causal.expand(len(responses), tm, tm)], dim=-1
        )[:, None]
        out_pos.append(r_idx[r_valid])
    order = torch.empty(cursor, dtype=torch.long, device=device)
    pos = torch.cat(out_pos)
    order[pos] = torch.arange(pos.numel(), device=device)
    return AttentionPlan(p_idx, p_valid, r_idx, r_valid, r_group, r_mask, order)


def build_prefix_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, t: int, row_keys: list[Any] | None = None
) -> PrefixGroupLayout:
    """Group the rows of a micro-batch by identical prompt and lay them out in one packed row.

    Args:
        input_ids: (B, S) [prompt | response], prompts left-padded.
        attention_mask: (B, S) 0/1.
        t: response length T (the prompt is the first S - T columns).
        row_keys: B hashables that must be equal too for two rows to share their prompt (a
            VLM's digest of the prompt's pixels: equal image tokens can hold different images).

    Rows are grouped when their prompt columns (tokens and mask) and their `row_keys` are equal;
    groups keep the order of their first row, rows keep their order within a group.
    """
    b, s = input_ids.shape
    p = s - t
    dev = input_ids.device
    mask = attention_mask.bool()
    if bool((mask[:, :p].sum(-1) == 0).any()):
        raise ValueError("a row has an empty prompt (attention_mask all 0 over the prompt); drop it first")
    prompt_key = torch.where(mask[:, :p], input_ids[:, :p], -1)
    _, inverse = torch.unique(prompt_key, dim=0, return_inverse=True)
    if row_keys is not None:  # equal prompts with unequal keys are different groups
        pairs = list(zip(inverse.tolist(), row_keys))
        ids_of = {key: i for i, key in enumerate(dict.fromkeys(pairs))}
        inverse = torch.tensor([ids_of[key] for key in pairs], dtype=torch.long, device=dev)
    rows_arange = torch.arange(b, device=dev)
    n_ids = int(inverse.max()) + 1
    first = torch.full((n_ids,), b, dtype=torch.long, device=dev).scatter_reduce(
        0, inverse, rows_arange, "amin"
    )
    group_rank = torch.empty_like(first)
    group_rank[torch.argsort(first)] = torch.arange(n_ids, device=dev)  # groups in order of first row
    g_of_row = group_rank[inverse]  # (B,) each row's group, numbered by first appearance
    num_groups = n_ids
    order = torch.argsort(g_of_row * b + rows_arange)  # rows grouped, each group's rows in order
    group_first = first[torch.argsort(first)]  # (G,) the row each group's prompt is read from

    # valid columns of each row, in order: (B, p) prompt and (B, t) response, valid ones first
    p_cols, p_len = _valid_columns(mask[:, :p])
    r_cols, r_len = _valid_columns(mask[:, p:])
    r_cols = r_cols + p

    # segments: for each group its prompt, then its rows' responses (in `order`)
    counts = torch.bincount(g_of_row, minlength=num_groups)  # (G,) rows per group
    seg_of_prompt = torch.cumsum(counts + 1, 0) - (counts + 1)  # (G,) segment index of each prompt
    n_seg = num_groups + b
    seg_row = torch.empty(n_seg, dtype=torch.long, device=dev)
    seg_is_prompt = torch.zeros(n_seg, dtype=torch.bool, device=dev)
    seg_is_prompt[seg_of_prompt] = True
    seg_row[seg_of_prompt] = group_first
    seg_row[~seg_is_prompt] = order
    seg_len = torch.where(seg_is_prompt, p_len[seg_row], r_len[seg_row])
    seg_group = torch.cumsum(seg_is_prompt.long(), 0) - 1
    prompt_of = torch.where(seg_is_prompt, -1, seg_of_prompt[seg_group])

    # tokens: segment, offset in it, the (row, column) it is read from
    starts = torch.cumsum(seg_len, 0) - seg_len
    tok_seg = torch.repeat_interleave(torch.arange(n_seg, device=dev), seg_len)
    offset = torch.arange(tok_seg.numel(), device=dev) - starts[tok_seg]
    tok_row = seg_row[tok_seg]
    tok_prompt = seg_is_prompt[tok_seg]
    col = torch.where(
        tok_prompt,
        p_cols[tok_row, offset.clamp(max=p - 1)],
        r_cols[tok_row, offset.clamp(max=max(t - 1, 0))] if t > 0 else offset,
    )
    source = tok_row * s + col
    pos = torch.where(tok_prompt, offset, p_len[tok_row] + offset)

    # (row, column) -> packed index: response tokens, and every row's copy of its group's prompt
    where = torch.full((b, s), -1, dtype=torch.long, device=dev)
    packed_idx = torch.arange(tok_seg.numel(), device=dev)
    resp = ~tok_prompt
    where[tok_row[resp], col[resp]] = packed_idx[resp]
    prompt_start = starts[seg_of_prompt][g_of_row]  # (B,) where each row's group prompt starts
    k = torch.arange(p, device=dev)
    has = k[None] < p_len[:, None]
    where_rows = rows_arange[:, None].expand(b, p)[has]
    where[where_rows, p_cols[has]] = (prompt_start[:, None] + k[None]).expand(b, p)[has]

    pred = where[:, -t - 1 : -1]
    valid = mask[:, -t:] & (pred >= 0)
    flat = valid.reshape(-1).nonzero().squeeze(-1)
    return PrefixGroupLayout(
        input_ids=input_ids.reshape(-1)[source][None],
        position_ids=pos[None],
        lengths=seg_len.tolist(),
        prompt_of=prompt_of.tolist(),
        pred=pred.reshape(-1)[flat],
        flat=flat,
        num_groups=num_groups,
        rows=seg_row.tolist(),
        source=source,
    )


def _valid_columns(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, L) 0/1 -> ((rows, L) the valid columns of each row in order, then the others; (rows,) counts)."""
    width = mask.shape[-1]
    cols = torch.arange(width, device=mask.device)
    key = torch.where(mask, cols, width + cols)
    return torch.sort(key, dim=-1).values % width, mask.sum(-1)


def sequence_layout(seq_lens: torch.Tensor) -> PrefixGroupLayout:
    """The layout of a plain packed row (`pack_sequences`): every sequence a prompt segment with
    no response, so `grouped_attention` attends within each sequence (causal), B x L^2 work
    instead of the nnz^2 of a block-diagonal mask over the whole row.

    Args:
        seq_lens: (B,) the packed row's sequence lengths.
    """
    lengths = [int(n) for n in seq_lens.tolist()]
    none = torch.zeros(0, dtype=torch.long, device=seq_lens.device)
    return PrefixGroupLayout(none[None], none[None], lengths, [-1] * len(lengths), none, none, len(lengths))


def _attend(q, k, v, mask, dropout: float, scale: float | None, eager: bool) -> torch.Tensor:
    """softmax(q k^T * scale) v for q (S, H, Lq, D), k/v (S, KV, Lk, D): causal when `mask` is None,
    else the boolean (S, 1, Lq, Lk) mask; `eager` spells it out (the model's own choice, e.g. bf16
    on CPU, where PyTorch's SDPA backward is slow), else torch's scaled_dot_product_attention."""
    if not eager:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale, enable_gqa=True
        )
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: one K/V head per group of query heads
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


@torch.compiler.disable
def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``ATTN_NAME``: q (1, H, N, D), k/v (1, KV, N, D) of the packed row ->
    (1, N, H, D); the layout comes in ``kwargs[LAYOUT_KWARG]`` (the model's forward passes its
    extra keyword arguments down to attention). Two batched attention calls per layer, whatever
    the number of segments: the G prompts padded to Pm (causal; padded queries are dropped), and
    the R responses padded to Tm with keys [their prompt | themselves] (`AttentionPlan`).

    Never traced by torch.compile: a decoder layer compiled by `fsdp_config.compile_layers` calls
    it eagerly between its two compiled halves. Traced, its layout-dependent indexing broke the
    graph in three places and recompiled for every new layout until dynamo's recompile limit
    (8) sent the whole layer back to eager, so compiling gained nothing (46 graphs for 5 layouts
    instead of 8; tests/engine/test_prefix_group.py)."""
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
    drop = dropout if module.training else 0.0
    eager = getattr(getattr(module, "config", None), INNER_ATTR, "sdpa") == "eager"
    plan = layout.plan(query.device)
    q, k, v = query[0], key[0], value[0]  # (H, N, D), (KV, N, D)

    def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # (heads, N, D) -> (S, heads, L, D)
        return x[:, idx].transpose(0, 1)

    kp, vp = gather(k, plan.p_idx), gather(v, plan.p_idx)
    out_p = _attend(gather(q, plan.p_idx), kp, vp, None, drop, scaling, eager)  # (G, H, Pm, D)
    outs = [out_p.transpose(1, 2)[plan.p_valid]]  # (prompt tokens, H, D)
    if plan.r_idx is not None:
        kk = torch.cat([kp[plan.r_group], gather(k, plan.r_idx)], dim=2)  # (R, KV, Pm + Tm, D)
        vv = torch.cat([vp[plan.r_group], gather(v, plan.r_idx)], dim=2)
        out_r = _attend(gather(q, plan.r_idx), kk, vv, plan.r_mask, drop, scaling, eager)  # (R, H, Tm, D)
        outs.append(out_r.transpose(1, 2)[plan.r_valid])
    return torch.cat(outs)[plan.order][None], None


def model_refusal(hf_config: Any) -> str | None:
    """Why a model cannot take the shared-prompt forward, read from its config (None: it can).

    The refusals of `grouped_attention`, decided before any weight is loaded: a vision-language
    model outside `GROUPED_VLM_FAMILIES` (`engine.multimodal.grouped_model_inputs` lays out
    Qwen2-VL's pixels and 3-D positions; Qwen3-VL's deepstack features follow its image tokens), a model class
    whose forward does not pass extra keyword arguments down to its attention function
    (transformers marks the ones that do with `_supports_attention_backend`; a class it cannot
    name from the config counts as not passing them), and sliding-window attention (a layer type
    'sliding_attention' / 'chunked_attention', or a `sliding_window` without `use_sliding_window=False`).
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = getattr(hf_config, "model_type", type(hf_config).__name__)
    vlm = getattr(hf_config, "vision_config", None) is not None
    if vlm and kind not in GROUPED_VLM_FAMILIES:
        return (
            f"a vision-language model of model_type={kind!r}: the shared-prompt forward with images is "
            f"built for {'/'.join(GROUPED_VLM_FAMILIES)} (3-D rotary positions, pixels once per group)"
        )
    mapping = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if vlm else MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        cls = mapping[type(hf_config)]
    except KeyError:
        return (
            f"transformers has no causal-LM class for model_type={kind!r} to check that it passes the layout"
        )
    if not getattr(cls, "_supports_attention_backend", False):
        return f"{cls.__name__}'s forward does not pass extra keyword arguments down to its attention"
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        windowed = sorted({t for t in layer_types if t in ("sliding_attention", "chunked_attention")})
        if windowed:
            return f"{kind} has {'/'.join(windowed)} layers (sliding-window attention)"
    elif getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        return f"{kind} uses sliding-window attention (sliding_window={text.sliding_window})"
    return None


def _configs(module: nn.Module) -> list[Any]:
    """The configs whose attention implementation the grouped forward switches: the model's and
    its text tower's. A vision-language model's vision tower keeps its own attention (its patches
    attend per image, without the layout), so its config is left alone, and so is the composite
    top-level config, whose setter would pass the name on to the vision config."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    top = base.config
    text = top.get_text_config() if hasattr(top, "get_text_config") else top
    vision = getattr(top, "vision_config", None)
    skip = {id(top), id(vision)} if vision is not None else set()
    found = {id(text): text} if skip else {id(top): top, id(text): text}
    for m in base.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in skip:
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
