"""Micro-batch forward passes of a (sharded) Hugging Face model: log-probs, values, scores.

Batch layout (veRL): input_ids = [prompt | response] of shape (B, S) with S = P + T, prompts
left-padded and responses right-padded; attention_mask (B, S) marks valid tokens; position_ids
(B, S); responses (B, T) = input_ids[:, -T:]. The logits at position t predict token t + 1, so
the T response tokens are predicted by positions S - T - 1 ... S - 2: `[:, -T - 1 : -1]`.

With `use_remove_padding` the valid tokens are packed into one row (see
`hybridrl.utils.torch_utils.pack_sequences`) and the per-token results are scattered back to
(B, S) before the same slice; padded positions then read 0.

Shapes: B batch, P prompt length, T response length, S = P + T, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridrl.algos.utils import entropy_from_logits, entropy_from_logits_chunked, logprobs_from_logits
from hybridrl.utils.torch_utils import (
    PackedBatch,
    block_causal_mask,
    pack_sequences,
    transformers_detects_packed_sequences,
    unpack_sequences,
)

_DETECTS_PACKING = transformers_detects_packed_sequences()


def _run(module: nn.Module, batch: Any, use_remove_padding: bool) -> tuple[Any, PackedBatch | None]:
    """Forward on the padded batch, or on its packed valid tokens; returns (HF output, packing)."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    if not use_remove_padding:
        position_ids = batch["position_ids"] if "position_ids" in batch.keys() else None
        out = module(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out, None
    packed = pack_sequences(input_ids, attention_mask)
    kwargs: dict[str, Any] = {}
    if not _DETECTS_PACKING:
        dtype = next(module.parameters()).dtype
        kwargs["attention_mask"] = block_causal_mask(packed.seq_lens, dtype, input_ids.device)
    out = module(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **kwargs)
    return out, packed


def forward_log_probs(
    module: nn.Module,
    batch: Any,
    *,
    temperature: float = 1.0,
    use_remove_padding: bool = False,
    calculate_entropy: bool = False,
    entropy_chunk_size: int | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens under `module`, logits / temperature.

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S),
            responses (B, T).
        temperature: the rollout's sampling temperature (> 0).
        entropy_chunk_size: compute the entropy this many positions at a time (bounds memory).
        entropy_grad: False computes the entropy without a graph (a metric, not part of a loss).

    Returns:
        log_probs (B, T) float32; entropy (B, T) float32 or None. Values at padded response
        positions are meaningless (0 with remove-padding); mask them.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    responses = batch["responses"]
    t = responses.shape[-1]
    out, packed = _run(module, batch, use_remove_padding)

    def ent_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            if entropy_chunk_size:
                return entropy_from_logits_chunked(x, entropy_chunk_size)
            return entropy_from_logits(x)

    if packed is None:
        logits = out.logits[:, -t - 1 : -1].float() / temperature
        log_probs = logprobs_from_logits(logits, responses)
        entropy = ent_fn(logits) if calculate_entropy else None
        return log_probs, entropy
    logits = out.logits[0].float() / temperature  # (nnz, V)
    labels = torch.roll(packed.input_ids[0], shifts=-1)  # token t + 1 (garbage at each sequence end)
    log_probs = unpack_sequences(logprobs_from_logits(logits, labels), packed)[:, -t - 1 : -1]
    entropy = None
    if calculate_entropy:
        entropy = unpack_sequences(ent_fn(logits), packed)[:, -t - 1 : -1]
    return log_probs, entropy


def forward_values(module: nn.Module, batch: Any, *, use_remove_padding: bool = False) -> torch.Tensor:
    """Values of a token-classification critic (num_labels=1) at the response-predicting positions.

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S),
            responses (B, T).

    Returns:
        (B, T) float32: the value of the state before each response token.
    """
    t = batch["responses"].shape[-1]
    out, packed = _run(module, batch, use_remove_padding)
    logits = out.logits
    if logits.shape[-1] != 1:
        raise ValueError(f"the critic must output one value per token (num_labels=1), got {logits.shape[-1]}")
    if packed is None:
        return logits[:, -t - 1 : -1, 0].float()
    return unpack_sequences(logits[0, :, 0].float(), packed)[:, -t - 1 : -1]


def _score_head(module: nn.Module) -> nn.Module:
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    for name in ("score", "classifier", "v_head"):
        head = getattr(base, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(
        f"{type(base).__name__} has no 'score'/'classifier' head; the reward model must be an "
        "AutoModelForSequenceClassification with num_labels=1"
    )


def forward_scores(module: nn.Module, batch: Any, *, use_remove_padding: bool = False) -> torch.Tensor:
    """Reward-model score of each sequence: the head's output at its last valid token.

    The per-token head output is read with a forward hook, so the result does not depend on how
    the model finds "the last non-pad token" (pad == eos ids, left padding, packing).

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S).

    Returns:
        (B,) float32 scores.
    """
    captured: list[torch.Tensor] = []
    handle = _score_head(module).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        _, packed = _run(module, batch, use_remove_padding)
    finally:
        handle.remove()
    per_token = captured[-1][..., 0].float()  # (B, S) or (1, nnz)
    if packed is None:
        mask = batch["attention_mask"]
        positions = torch.arange(mask.shape[-1], device=mask.device)
        last = (mask.long() * positions).argmax(dim=-1)
        return per_token.gather(1, last[:, None]).squeeze(1)
    return per_token[0, packed.cu_seqlens[1:].long() - 1]
