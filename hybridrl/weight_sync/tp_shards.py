"""Which slice of each Hugging Face tensor a tensor-parallel vLLM rank keeps (the collective weight
update sends each TP rank only that slice; collective.py).

vLLM's loaders (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py, checked against
vLLM 0.32) narrow every full checkpoint tensor to the rank's part; `shard_of` names the same part
per HF name, for the decoder families it knows (`KNOWN_ARCHITECTURES`), with TP size t, TP rank r:

    q_proj  (weight, bias)       dim 0, rows [r n_q, (r+1) n_q),      n_q = (heads / t) * head_dim
    k_proj, v_proj               dim 0, rows [s n_kv, (s+1) n_kv),    n_kv = max(1, kv / t) * head_dim,
                                 s = r // max(1, t / kv)  (KV heads replicated when kv < t)
    gate_proj, up_proj           dim 0, rows [r I/t, (r+1) I/t)
    o_proj, down_proj (weight)   dim 1, columns [r K/t, (r+1) K/t)
    embed_tokens, lm_head        dim 0, rows [min(r p, V), min((r+1) p, V)),  p = ceil(V / 64) * 64 / t
                                 (vLLM pads the vocabulary to a multiple of 64, then splits it evenly)
    anything else                the full tensor (norms, the row layers' biases)

The receiving rank places its slice into an uninitialised tensor of the full shape and hands that
to vLLM, whose loader reads exactly the slice back (the other elements are never read), so the
engine ends up with the same bits as after a full update (tests/async/test_tp_shards.py).
A model outside the known families, a quantized one, or sizes t does not divide get None and the
reason: the update then sends the full tensors to every rank, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.models.weight_map import strip_wrapper_prefixes

__all__ = ["KNOWN_ARCHITECTURES", "VOCAB_PADDING", "TPLayout", "Shard", "shard_of", "tp_layout", "unshard"]

KNOWN_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

_COLUMN = re.compile(r"\.(self_attn\.(?P<attn>[qkv])_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TPLayout:
    """The sizes `shard_of` needs (from the HF config).

    Attributes:
        tp: the rollout's tensor_model_parallel_size (t).
        heads, kv_heads, head_dim: attention heads, KV heads, width of one head.
        intermediate: the MLP's inner width (I).
        vocab: the vocabulary (V, unpadded).
    """

    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Shard:
    """Rank r's part of a tensor: `full.narrow(dim, start, length)`."""

    dim: int
    start: int
    length: int


def tp_layout(hf_config: Any, tp: int) -> tuple[TPLayout | None, str]:
    """(layout, "") when this rank-sliced update applies to `hf_config` at TP size `tp`, else
    (None, the reason the full tensors go to every rank)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if tp <= 1:
        return None, "rollout tensor_model_parallel_size is 1"
    if len(archs) != 1 or archs[0] not in KNOWN_ARCHITECTURES:
        return None, f"architecture {archs or '(none)'} is not one of {list(KNOWN_ARCHITECTURES)}"
    if getattr(hf_config, "quantization_config", None):
        return None, "the model is quantized"
    heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    layout = TPLayout(
        tp=tp,
        heads=heads,
        kv_heads=kv,
        head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
        intermediate=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
    )
    if heads % tp or layout.intermediate % tp or (kv % tp and tp % kv):
        return (
            None,
            f"TP {tp} does not split heads {heads} / KV heads {kv} / intermediate {layout.intermediate}",
        )
    return layout, ""


def shard_of(name: str, shape: tuple[int, ...], layout: TPLayout, rank: int) -> Shard | None:
    """The part of HF tensor `name` (full `shape`) that TP rank `rank` keeps; None: all of it."""
    name = strip_wrapper_prefixes(name)
    t = layout.tp
    if name in _VOCAB:
        per = -(-layout.vocab // VOCAB_PADDING) * VOCAB_PADDING // t
        start, end = min(rank * per, layout.vocab), min((rank + 1) * per, layout.vocab)
        return Shard(0, start, end - start)
    m = _COLUMN.search(name)
    if m:
        attn = m.group("attn")
        if attn in ("k", "v"):
            n = max(1, layout.kv_heads // t) * layout.head_dim
            return Shard(0, (rank // max(1, t // layout.kv_heads)) * n, n)
        n = shape[0] // t
        return Shard(0, rank * n, n)
    if _ROW.search(name):
        n = shape[1] // t
        return Shard(1, rank * n, n)
    return None


def unshard(
    piece: torch.Tensor, full_shape: tuple[int, ...], shard: Shard, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A tensor of `full_shape` (`out` when given, else a new one) whose `narrow(shard.dim,
    shard.start, shard.length)` is `piece`; the rest is left as it was (never read by vLLM)."""
    full = torch.empty(full_shape, dtype=piece.dtype, device=piece.device) if out is None else out
    full.narrow(shard.dim, shard.start, shard.length).copy_(piece)
    return full
