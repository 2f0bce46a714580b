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
from dataclasses import dataclass, field
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
    "model_refusal",
    "prefix_grouped",
    "sequence_layout",
]


class LayoutNotPassed(RuntimeError):
    """The model's forward did not pass the layout down to its attention function."""


@dataclass
class PrefixGroupLayout:
    """Where each token of a micro-batch sits in the shared-prompt packed row.

    The row is a sequence of segments: for each group its prompt, then its rows' responses.
    input_ids / position_ids: (1, N) (empty for `sequence_layout`, which reuses a packed row's
    own). lengths: the tokens of each segment, in row order (they sum to N). prompt_of: for each
    segment, -1 for a prompt, else the index of its group's prompt segment. pred / flat (K,):
    packed positions predicting the valid response tokens and their indices in the flattened
    (B, T) response layout (as `forward.response_positions`). num_groups: G.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int]
    prompt_of: list[int]
    pred: torch.Tensor
    flat: torch.Tensor
    num_groups: int
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def response_mask(self, length: int, prompt: int, device: torch.device) -> torch.Tensor:
        """(length, prompt + length) bool: a response token sees the prompt and its own past."""
        key = (length, prompt, str(device))
        if key not in self._masks:
            self._masks[key] = torch.ones(length, prompt + length, dtype=torch.bool, device=device).tril(
                prompt
            )
        return self._masks[key]


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
    groups: dict[int, list[int]] = {}
    for row, key in enumerate(inverse.tolist()):
        groups.setdefault(key, []).append(row)  # dicts keep the order of first appearance

    where = torch.full((b, s), -1, dtype=torch.long, device=dev)  # (row, column) -> packed index
    ids, pos, lengths, prompt_of = [], [], [], []
    cursor = 0
    for rows in groups.values():
        cols = mask[rows[0], :p].nonzero().squeeze(-1)
        lp = cols.numel()
        where[torch.tensor(rows, device=dev)[:, None], cols[None]] = torch.arange(
            cursor, cursor + lp, device=dev
        )
        ids.append(input_ids[rows[0], cols])
        pos.append(torch.arange(lp, device=dev))
        prompt_seg = len(lengths)
        lengths.append(lp)
        prompt_of.append(-1)
        cursor += lp
        for row in rows:
            rcols = mask[row, p:].nonzero().squeeze(-1)
            n = rcols.numel()
            where[row, p + rcols] = torch.arange(cursor, cursor + n, device=dev)
            ids.append(input_ids[row, p + rcols])
            pos.append(lp + torch.arange(n, device=dev))
            lengths.append(n)
            prompt_of.append(prompt_seg)
            cursor += n
    pred = where[:, -t - 1 : -1]
    valid = mask[:, -t:] & (pred >= 0)
    flat = valid.reshape(-1).nonzero().squeeze(-1)
    return PrefixGroupLayout(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        lengths=lengths,
        prompt_of=prompt_of,
        pred=pred.reshape(-1)[flat],
        flat=flat,
        num_groups=len(groups),
    )


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
    """softmax(q k^T * scale) v for q (H, Lq, D), k/v (KV, Lk, D): causal when `mask` is None,
    else the boolean (Lq, Lk) mask; `eager` spells it out (the model's own choice, e.g. bf16 on
    CPU, where PyTorch's SDPA backward is slow), else torch's scaled_dot_product_attention."""
    if not eager:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale, enable_gqa=True
        )
    if k.shape[0] != q.shape[0]:  # grouped-query attention: one K/V head per group of query heads
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    if mask is None:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``ATTN_NAME``: q (1, H, N, D), k/v (1, KV, N, D) of the packed row ->
    (1, N, H, D); the layout comes in ``kwargs[LAYOUT_KWARG]`` (the model's forward passes its
    extra keyword arguments down to attention). Segments are views of the row (`split`), so the
    backward is one concatenation, with no scatter."""
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
    qs, ks, vs = (x[0].split(layout.lengths, dim=1) for x in (query, key, value))
    outs = []
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        p = layout.prompt_of[i]
        if q.shape[1] == 0:
            outs.append(q)
        elif p < 0:  # a prompt (or a whole sequence): causal within itself
            outs.append(_attend(q, k, v, None, drop, scaling, eager))
        else:  # a response: its group's prompt, then causal within itself
            mask = layout.response_mask(q.shape[1], ks[p].shape[1], q.device)
            kk, vv = torch.cat([ks[p], k], dim=1), torch.cat([vs[p], v], dim=1)
            outs.append(_attend(q, kk, vv, mask, drop, scaling, eager))
    return torch.cat(outs, dim=1).transpose(0, 1)[None], None


def model_refusal(hf_config: Any) -> str | None:
    """Why a model cannot take the shared-prompt forward, read from its config (None: it can).

    The two refusals of `grouped_attention`, decided before any weight is loaded: a model class
    whose forward does not pass extra keyword arguments down to its attention function
    (transformers marks the ones that do with `_supports_attention_backend`; a class it cannot
    name from the config counts as not passing them), and sliding-window attention (a layer type
    'sliding_attention' / 'chunked_attention', or a `sliding_window` without `use_sliding_window=False`).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = getattr(hf_config, "model_type", type(hf_config).__name__)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
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
