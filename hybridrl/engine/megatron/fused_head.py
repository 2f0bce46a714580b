"""`model.use_fused_kernels=True` with Megatron: log-probs and entropy from the last hidden states, chunk by chunk.

veRL's fused Megatron path computes the log-probs and the entropy from the final hidden states and
the output layer's weight (linear and cross-entropy in one kernel), so the (tokens, V / TP) logits
of a micro-batch are never kept for the backward. This engine does the same in torch:

- the output layer of the last stage returns its input instead of the logits: the hidden states,
  gathered over the sequence with sequence parallelism and copied into the tensor-parallel region
  otherwise (the communication `ColumnParallelLinear` does, so the hidden-state gradient is summed
  over the TP ranks as before); the weight it would have used (its own, or the tied embedding) is
  kept on the layer;
- for every chunk of `CHUNK` positions the engine computes that chunk's logits (b, chunk, V / TP),
  their log-prob and entropy over the vocabulary-parallel slice (vocab_parallel.py), and drops the
  logits; the backward recomputes them one chunk at a time (activation checkpointing);
- only the positions whose log-probs are used (the response) reach the output weight.

The log-probs and entropy are those of the unfused path (a test compares them at 1e-5).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hybridrl.engine.megatron.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = [
    "CHUNK",
    "fused_logprobs_entropy",
    "head_logits",
    "head_weight",
    "use_fused_head",
    "use_hidden_head",
]

CHUNK = 1024  # positions per chunk of logits


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the TP group. (megatron-core's
    copy_to_tensor_model_parallel_region all-reduces a contiguous copy of a non-contiguous gradient
    and returns the original; the gradient arriving here is a transposed one.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _hidden_forward(
    self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None
):
    """ColumnParallelLinear.forward without the matmul: (S, b, H) hidden states in the TP region."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    # a plain attribute: nn.Module.__setattr__ would register the Parameter under a second name, and the
    # optimizer's checkpoint would then name its state after it (a fresh engine, before any forward, has not)
    self.__dict__["fused_weight"] = self.weight if weight is None else weight
    if self.sequence_parallel:  # all-gather over the sequence; the backward reduce-scatters
        return gather_from_sequence_parallel_region(input_, group=self.tp_group), None
    return _SumGradOverTP.apply(input_, self.tp_group), None


def _heads(chunks: list[Any]) -> list[Any]:
    out = []
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        head = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
        if head is not None:
            out.append(head)
    return out


def use_hidden_head(chunks: list[Any]) -> None:
    """Make the output layer of the last stage return the hidden states (module docstring)."""
    for head in _heads(chunks):
        if getattr(head, "bias", None) is not None:
            raise ValueError("use_fused_kernels: an output layer with a bias is not supported")
        head.forward = types.MethodType(_hidden_forward, head)


def use_fused_head(chunks: list[Any], enabled: bool, role: str, n_mtp: int, model_key: str) -> bool:
    """`model.use_fused_kernels=True` on the actor / reference: the output layer returns hidden states."""
    if not enabled or role not in ("actor", "ref"):
        return False
    if n_mtp:
        raise ValueError(
            f"{model_key}.use_fused_kernels=True with model.mtp: the MTP loss runs the output layer inside "
            "megatron-core's model; set use_fused_kernels=false with MTP"
        )
    use_hidden_head(chunks)
    return True


def head_weight(chunks: list[Any]) -> torch.Tensor:
    """The (V / TP, H) weight the output layer received in the last forward."""
    heads = _heads(chunks)
    if not heads or getattr(heads[-1], "fused_weight", None) is None:
        raise RuntimeError("use_fused_kernels: the output layer has not run a forward on this rank")
    return heads[-1].fused_weight


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(..., H) hidden states -> (..., V / TP) logits of this rank's vocabulary slice."""
    return torch.nn.functional.linear(hidden, weight)


def _chunk_logprobs_entropy(hidden, weight, targets, temperature, vocab_size, tp_rank, group):
    logits = head_logits(hidden, weight).float() / temperature
    lp, ent = vocab_parallel_logprobs_entropy(
        logits, targets, vocab_size=vocab_size, tp_rank=tp_rank, group=group
    )
    return torch.stack([lp, ent], dim=-1)


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    vocab_size: int,
    tp_rank: int,
    group: Any,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy, (b, T) each, from hidden states (b, T, H), chunk by chunk.

    Args:
        hidden: (b, T, H) final hidden states of the positions scored.
        weight: (V / TP, H) this rank's slice of the output layer.
        targets: (b, T) the token id each position is scored against.
    """
    parts = []
    for start in range(0, hidden.shape[1], chunk):
        args = (hidden[:, start : start + chunk], weight, targets[:, start : start + chunk])
        extra = (temperature, vocab_size, tp_rank, group)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_chunk_logprobs_entropy, *args, *extra, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs_entropy(*args, *extra))
    out = torch.cat(parts, dim=1)
    return out[..., 0], out[..., 1]
