"""Shared-prompt prefill for the HF rollout: each distinct prompt row runs the prefill once.

GRPO-family rollouts repeat every prompt `rollout.n` times, so a micro-batch of B rows holds
only U = B / n distinct (left-padded) prompt rows. `model.generate` would run the prefill (the
forward over all P prompt positions, the most arithmetic of a short generation) B times. Here
the first P - 1 positions of the U distinct rows go through the model once; their key/value
cache, shape (U, kv_heads, P - 1, head_dim) per layer, is gathered to the B rows
(`cache.batch_select_indices(inverse)`, inverse (B,) mapping each row to its distinct row), and
`generate` then starts from that cache: it runs only the last prompt position and the decode
steps, exactly as it would after its own prefill (position ids from the same attention mask).

Equal to the plain prefill up to the floating-point blocking of a GEMM with U instead of B rows
(tests/rollout/test_hf_prefix.py: greedy tokens identical, log-probs within 1e-5).
Sampling draws the same random numbers (the prefill draws none). Used when
`rollout.enable_prefix_caching` (veRL's vLLM key; true by default) and the micro-batch has
repeated rows; never for multimodal rows or one-token prompts.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["distinct_rows", "shared_prefill"]


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (ids, mask) rows of a batch and each row's index among them.

    Args:
        input_ids: (B, P) left-padded prompt ids.
        attention_mask: (B, P) 1 on prompt tokens.

    Returns:
        first: (U,) index of the first row of each distinct row, in order of first appearance.
        inverse: (B,) index into `first` of each row's distinct row.
    """
    key = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    # renumber by first appearance (torch.unique sorts), so the distinct rows keep batch order
    order: dict[int, int] = {}
    first: list[int] = []
    remap = torch.empty_like(inverse)
    for row, u in enumerate(inverse.tolist()):
        if u not in order:
            order[u] = len(first)
            first.append(row)
        remap[row] = order[u]
    return torch.tensor(first, dtype=torch.long, device=input_ids.device), remap


@torch.no_grad()
def shared_prefill(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any | None = None
) -> Any | None:
    """The key/value cache of positions 0..P-2 for every row, computed once per distinct row.

    Args:
        model: a Hugging Face causal LM (`forward(input_ids, attention_mask, position_ids,
            use_cache=True)` returning `past_key_values`, a `transformers.Cache`).
        input_ids: (B, P) left-padded prompt ids.
        attention_mask: (B, P) 1 on prompt tokens.
        cache: an empty `transformers.Cache` to fill (e.g. cpu.kv_cache.growing_cache); None: the
            model's default.

    Returns:
        A cache for the B rows holding P - 1 positions (pass it to `generate` as
        `past_key_values` with the full `input_ids` / `attention_mask`), or None when sharing
        saves nothing (no repeated row, P < 2, or a row whose first P - 1 positions are all
        padding).
    """
    bsz, prompt_len = input_ids.shape
    if prompt_len < 2:
        return None
    first, inverse = distinct_rows(input_ids, attention_mask)
    if len(first) == bsz:
        return None
    ids, mask = input_ids[first, :-1], attention_mask[first, :-1]
    if bool((mask.sum(dim=1) == 0).any()):
        return None
    # the position ids `generate` derives from the attention mask (padding positions: 0)
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    extra = {} if cache is None else {"past_key_values": cache}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )
    cache = out.past_key_values
    cache.batch_select_indices(inverse)
    return cache
