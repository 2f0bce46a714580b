"""Top-k log-probs at the response positions (on-policy distillation's `forward_kl_topk`).

Two requests of `LogProbRequest` end here instead of in the fused head of `engine.forward`:

* `topk=k` (the teacher): the k largest log nu(v | s_t) of each response position and their
  token ids;
* `topk_ids=True` (the student): log pi_theta(v | s_t) at the ids in the micro-batch's
  `teacher_topk_ids` (B, T, K), with gradient.

Both need the whole distribution at a position, so the model's full logits at the T
response-predicting positions are formed, (B, T, V) float32 for the micro-batch (as veRL's
non-chunked path): size the micro-batches for it. The sampled token's log-prob (and the entropy
when asked) come from the same logits, so the rest of the actor's loss is unchanged.

Shapes: B batch, S = P + T sequence, T response length, V vocabulary, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridrl.algos.utils import entropy_from_logits
from hybridrl.engine.base import LogProbs
from hybridrl.engine.forward import run_model
from hybridrl.utils.torch_utils import unpack_sequences

TOPK_IDS_KEY = "teacher_topk_ids"  # (B, T, K) long: the teacher's top-k ids, the student's gather index


def wants_topk(request: Any) -> bool:
    """True when a LogProbRequest asks for the teacher's top-k or the student's log-probs at ids."""
    return bool(getattr(request, "topk", 0)) or bool(getattr(request, "topk_ids", False))


def forward_topk_log_probs(
    module: nn.Module,
    batch: Any,
    *,
    temperature: float = 1.0,
    use_remove_padding: bool = False,
    topk: int = 0,
    gather_ids: bool = False,
    calculate_entropy: bool = False,
    entropy_grad: bool = True,
    sp: Any = None,
    prefix_group: bool = False,
) -> LogProbs:
    """Sampled-token log-probs plus top-k log-probs of the response positions, logits / temperature.

    Args:
        module: a causal LM (HF output with `.logits`).
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S),
            responses (B, T), and with `gather_ids` `teacher_topk_ids` (B, T, K) long.
        temperature: the rollout's sampling temperature (> 0).
        use_remove_padding: the forward on the packed valid tokens.
        topk: > 0: also the k largest log-probs and their ids (the teacher's request).
        gather_ids: also the log-probs at `batch["teacher_topk_ids"]` (the student's request).
        calculate_entropy / entropy_grad: the entropy of each position (with / without a graph).
        sp, prefix_group: Ulysses SP and the shared-prompt forward are refused (not implemented).

    Returns:
        LogProbs with log_probs (B, T), entropy (B, T) or None, topk_log_probs (B, T, K) and
        topk_ids (B, T, K) (the teacher's ids, or the ids gathered at).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    if sp is not None or prefix_group:
        raise NotImplementedError(
            "distillation_loss.loss_mode=forward_kl_topk with Ulysses sequence parallelism or "
            "use_prefix_grouper is not implemented; set ulysses_sequence_parallel_size=1 and "
            "use_prefix_grouper=False, or use loss_mode=k3"
        )
    if (topk > 0) == gather_ids:
        raise ValueError("forward_topk_log_probs: give exactly one of topk > 0 and gather_ids=True")
    t = batch["responses"].shape[-1]
    out, packed = run_model(module, batch, use_remove_padding)
    logits = out.logits if packed is None else unpack_sequences(out.logits, packed)
    logits = logits[:, -t - 1 : -1].float() / temperature  # (B, T, V)
    log_probs = torch.log_softmax(logits, dim=-1)
    sampled = log_probs.gather(-1, batch["responses"].long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if calculate_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    if topk > 0:
        if topk > log_probs.shape[-1]:
            raise ValueError(f"distillation_loss.topk={topk} exceeds the vocabulary ({log_probs.shape[-1]})")
        values, ids = log_probs.topk(topk, dim=-1)
        return LogProbs(sampled, entropy, topk_log_probs=values, topk_ids=ids)
    ids = batch[TOPK_IDS_KEY].long()
    if ids.shape[:2] != sampled.shape:
        raise ValueError(
            f"{TOPK_IDS_KEY} has shape {tuple(ids.shape)}, expected (B, T, K) = {tuple(sampled.shape)} x K"
        )
    return LogProbs(sampled, entropy, topk_log_probs=log_probs.gather(-1, ids), topk_ids=ids)
