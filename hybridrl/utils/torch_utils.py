"""Small tensor helpers shared by the training engine: dtypes, padding removal, RNG state.

Padding removal ("remove padding"): the valid tokens of a micro-batch are packed into one row
of shape (1, nnz) with position ids that restart at 0 for every sequence. Recent transformers
(masking_utils.find_packed_sequence_indices, >= 4.53) turn such position ids into a
block-diagonal causal mask when attention_mask is None, so no token attends across sequences
and no compute is spent on padding. For older versions `block_causal_mask` builds the 4-D
mask explicitly.

Shapes: B batch, S = P + T sequence length, nnz number of valid tokens in the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def str_to_dtype(name: str | torch.dtype) -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' (or the torch names) -> torch.dtype."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name engines accept: 'bf16' -> 'bfloat16', torch.float32 -> 'float32'."""
    return str(str_to_dtype(dtype)).removeprefix("torch.")


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the valid tokens of its row (0 on left padding).

    Args:
        attention_mask: (B, S) 0/1.

    Returns:
        (B, S) long: cumsum(mask) - 1, clipped at 0.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@dataclass
class PackedBatch:
    """Valid tokens of a padded batch packed into one row.

    input_ids: (1, nnz). position_ids: (1, nnz), restarting at 0 per sequence. indices: (nnz,)
    flat positions in the (B, S) batch. seq_lens: (B,) valid tokens per row. cu_seqlens: (B + 1,)
    int32 cumulative lengths (flash-attention convention).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    indices: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    batch_size: int
    seqlen: int


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Pack the valid tokens (attention_mask == 1) of each row into one row, row after row.

    Position ids are recomputed as 0..len-1 per sequence (rotary attention depends only on
    relative positions, so this equals the padded batch's cumsum(mask) - 1 convention).

    Args:
        input_ids: (B, S).
        attention_mask: (B, S) 0/1; each row's valid tokens are packed in order.
    """
    bsz, seqlen = input_ids.shape
    mask = attention_mask.bool()
    indices = torch.nonzero(mask.reshape(-1), as_tuple=False).squeeze(-1)
    seq_lens = mask.sum(dim=-1)
    if bool((seq_lens == 0).any()):
        raise ValueError("a row has no valid token (attention_mask all 0); drop it before the forward pass")
    cu_seqlens = torch.zeros(bsz + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = seq_lens.cumsum(0)
    packed_ids = input_ids.reshape(-1)[indices].unsqueeze(0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), seq_lens)
    position_ids = (torch.arange(indices.numel(), device=input_ids.device) - starts).unsqueeze(0)
    return PackedBatch(packed_ids, position_ids, indices, seq_lens, cu_seqlens, bsz, seqlen)


def unpack_sequences(values: torch.Tensor, packed: PackedBatch, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-token values of a packed row back to the padded (B, S, ...) layout.

    Args:
        values: (nnz, ...) or (1, nnz, ...) one value per packed token.
        packed: the PackedBatch the values were computed from.
        fill: value at padding positions.

    Returns:
        (B, S, ...) with `fill` where attention_mask was 0. Differentiable w.r.t. `values`.
    """
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.indices.numel():
        values = values.squeeze(0)
    nnz = packed.indices.numel()
    if values.shape[0] != nnz:
        raise ValueError(f"got {values.shape[0]} values for {nnz} packed tokens")
    trailing = values.shape[1:]
    out = values.new_full((packed.batch_size * packed.seqlen, *trailing), fill)
    out = out.index_put((packed.indices,), values)
    return out.view(packed.batch_size, packed.seqlen, *trailing)


def transformers_detects_packed_sequences() -> bool:
    """True when transformers builds a block-diagonal mask from restarting position ids."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def block_causal_mask(seq_lens: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Additive 4-D attention mask for a packed row: causal within each sequence, -inf across.

    Args:
        seq_lens: (B,) lengths of the packed sequences.

    Returns:
        (1, 1, nnz, nnz) with 0 where attention is allowed and the dtype's minimum elsewhere.
    """
    seq_id = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), seq_lens.to(device))
    nnz = seq_id.numel()
    causal = torch.ones(nnz, nnz, dtype=torch.bool, device=device).tril()
    allowed = causal & (seq_id[:, None] == seq_id[None, :])
    mask = torch.zeros(nnz, nnz, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


# ----------------------------------------------------------------------------------------------
# RNG state (checkpoints restore it so that a resumed run continues exactly)
# ----------------------------------------------------------------------------------------------
def get_rng_state() -> dict[str, Any]:
    """torch (CPU and, if present, CUDA), numpy and Python `random` generator states, as tensors and
    plain types only (so a checkpoint holding it loads with `torch.load(weights_only=True)`)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state from `get_rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def set_seed(seed: int) -> None:
    """Seed torch, numpy and Python `random`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
