"""Log-probs and entropy through the vocabulary projection, a chunk of positions at a time.

`linear_log_probs(hidden, weight, labels)` equals

    logits = (hidden @ weight.T + bias).float() / temperature          # (N, V)
    log_probs = log_softmax(logits)[labels];  entropy = H(softmax(logits))

but never materialises more than one chunk of logits at a time for the softmax statistics: the
forward keeps the per-position log-sum-exp, and the backward either reuses the logits (when all
N x V of them fit in `KEEP_LOGITS_BYTES`, 1 GiB) or recomputes each chunk's logits from `hidden`
and `weight` (the memory of the head is then O(chunk_rows x V) instead of O(N x V), at the price
of one more chunk matmul in the backward). The matmul runs in the dtype of `hidden` / `weight` (bf16 under FSDP
mixed precision) and everything after it in float32, exactly as the plain path does; the weight
gradient is accumulated over chunks in float32 and cast to the weight's dtype once.

Shapes: N positions (only the response-predicting ones: the caller slices them before the head),
H hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Budget of one chunk's float32 logits; the backward holds ~3 tensors of this size at once.
CHUNK_BYTES = 64 * 2**20
# When all N x V float32 logits fit in this, the forward keeps them and the backward skips its
# recompute matmul (2 N H V FLOPs, a quarter of the head's forward + backward; the gradients are
# bit-identical); above it, each chunk is recomputed and the head's memory stays O(chunk_rows x V).
# Measured (bench/lm_head.py --variants fused,keep, real100m, 16 x (53 + 48) tokens): 8-10% less CPU
# for the whole forward + backward; at most 1 GiB more memory (512 MiB at 16 x 256 response tokens).
KEEP_LOGITS_BYTES = 2**30


def default_chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that one (chunk, V) float32 tensor fits in `chunk_bytes` (>= 16)."""
    return max(16, chunk_bytes // (4 * max(1, vocab_size)))


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """(c, H) hidden -> (c, V) float32 logits / temperature (the matmul in the inputs' dtype)."""
    return F.linear(h, weight, bias).float() / temperature


def chunk_stats(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool, with_sps: bool):
    """Per-row statistics of one chunk of float32 logits z (c, V) and its labels (c,):
    (log p(label), log-sum-exp, entropy -sum p log p or None, sum p^2 or None), each (c,)."""
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(1, labels[:, None])[:, 0] - lse
    entropy = sum_pi_sq = None
    if with_entropy or with_sps:
        logp_all = z - lse[:, None]
        if with_entropy:  # -sum p log p (no cancellation for peaked distributions)
            entropy = -(torch.exp(logp_all) * logp_all).sum(dim=-1)
        if with_sps:  # sum_v p_v^2 (no gradient: a statistic of the old policy)
            sum_pi_sq = torch.exp(2 * logp_all).sum(dim=-1)
    return log_probs, lse, entropy, sum_pi_sq


def chunk_grad(z, lse, labels, g_logp, g_ent, entropy, temperature: float) -> torch.Tensor:
    """d loss / d hidden-logits of one chunk (c, V) float32, from the upstream gradients of the
    log-probs g_logp (c,) and of the entropy g_ent (c,) (either may be None):
    d log p(label)/dz = onehot(label) - p;  dH/dz = -p (log p + H); then / temperature."""
    logp_all = z - lse[:, None]
    p = torch.exp(logp_all)
    gz = torch.zeros_like(z)
    if g_logp is not None:
        gz = gz - p * g_logp[:, None]
        gz = gz.scatter_add(1, labels[:, None], g_logp[:, None])
    if g_ent is not None:
        gz = gz - p * (logp_all + entropy[:, None]) * g_ent[:, None]
    return gz / temperature


_COMPILED: dict[str, Any] = {}


def _kernels(compiled: bool):
    """(chunk_stats, chunk_grad), eager or through torch.compile (built once per process; the
    actor's `use_torch_compile`, as veRL compiles its entropy/log-prob kernels): inductor fuses the
    exp / sum / gather passes over each (c, V) chunk into one loop."""
    if not compiled:
        return chunk_stats, chunk_grad
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(chunk_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(chunk_grad, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """Autograd function behind `linear_log_probs` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        temperature,
        chunk_rows,
        with_entropy,
        entropy_grad,
        with_sps,
        compiled,
        keep_logits,
    ):
        n = hidden.shape[0]
        kept = torch.empty(0, dtype=torch.float32, device=hidden.device)
        if keep_logits:
            kept = torch.empty(n, weight.shape[0], dtype=torch.float32, device=hidden.device)
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        sum_pi_sq = torch.empty(n if with_sps else 0, dtype=torch.float32, device=hidden.device)
        chunk_stats, _ = _kernels(compiled)
        for lo in range(0, n, chunk_rows):
            hi = min(n, lo + chunk_rows)
            z = _chunk_logits(hidden[lo:hi], weight, bias, temperature)
            if keep_logits:
                kept[lo:hi] = z
            lp_c, lse_c, ent_c, sps_c = chunk_stats(z, labels[lo:hi], with_entropy, with_sps)
            log_probs[lo:hi], lse[lo:hi] = lp_c, lse_c
            if with_entropy:
                entropy[lo:hi] = ent_c
            if with_sps:
                sum_pi_sq[lo:hi] = sps_c
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, kept)
        ctx.temperature, ctx.chunk_rows, ctx.compiled = temperature, chunk_rows, compiled
        ctx.keep_logits = keep_logits
        ctx.entropy_grad = with_entropy and entropy_grad
        # one call: a second mark_non_differentiable replaces the first one's set
        ctx.mark_non_differentiable(sum_pi_sq, *([] if ctx.entropy_grad else [entropy]))
        ctx.set_materialize_grads(False)
        return log_probs, entropy, sum_pi_sq

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_sps):
        hidden, weight, bias, labels, lse, entropy, kept = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not ctx.entropy_grad:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 11
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        t, n = ctx.temperature, hidden.shape[0]
        _, chunk_grad = _kernels(ctx.compiled)
        for lo in range(0, n, ctx.chunk_rows):
            hi = min(n, lo + ctx.chunk_rows)
            h = hidden[lo:hi]
            z = kept[lo:hi] if ctx.keep_logits else _chunk_logits(h, weight, bias, t)
            gz = chunk_grad(
                z,
                lse[lo:hi],
                labels[lo:hi],
                None if g_logp is None else g_logp[lo:hi].float(),
                None if g_ent is None else g_ent[lo:hi].float(),
                entropy[lo:hi] if g_ent is not None else None,
                t,
            ).to(weight.dtype)
            if need_h:
                grad_h[lo:hi] = gz @ weight
            if need_w:
                grad_w += (gz.t() @ h).float()
            if need_b:
                grad_b += gz.float().sum(dim=0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_rows: int | None = None,
    calculate_sum_pi_squared: bool = False,
    compiled: bool = False,
    keep_logits_bytes: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """log softmax((hidden @ weight.T + bias) / temperature)[labels] (and the entropy), chunked.

    Args:
        hidden: (N, H) hidden states of the positions that predict `labels`.
        weight: (V, H) the output projection (lm_head / tied embedding).
        labels: (N,) integer token ids.
        bias: (V,) or None.
        temperature: > 0; the logits are divided by it (the rollout's sampling temperature).
        calculate_entropy: also return the entropy of each position's distribution.
        entropy_grad: False returns the entropy without a gradient (a metric, not in the loss).
        chunk_rows: positions per chunk (default: `default_chunk_rows(V)`).
        calculate_sum_pi_squared: also return sum_v p_v^2 of each position (no gradient; the
            optimal-token-baseline estimator's statistic), from the same chunk of logits.
        compiled: run the per-chunk softmax statistics and their backward through torch.compile
            (the first call compiles: seconds on CPU; needs a C++ compiler there).
        keep_logits_bytes: keep all N x V float32 logits for the backward when they fit in this
            many bytes (default `KEEP_LOGITS_BYTES`), instead of recomputing them per chunk.

    Returns:
        log_probs (N,) float32; entropy (N,) float32 or None; with calculate_sum_pi_squared a
        third (N,) float32 sum_pi_squared. Differentiable w.r.t. hidden, weight and bias; the
        backward recomputes one chunk of logits at a time.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be (N,) = ({hidden.shape[0]},), got {tuple(labels.shape)}")
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    budget = KEEP_LOGITS_BYTES if keep_logits_bytes is None else keep_logits_bytes
    grad_wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = grad_wanted and hidden.shape[0] * weight.shape[0] * 4 <= budget
    log_probs, entropy, sum_pi_sq = _ChunkedLinearLogProbs.apply(
        hidden,
        weight,
        bias,
        labels.long(),
        float(temperature),
        int(rows),
        calculate_entropy,
        entropy_grad,
        calculate_sum_pi_squared,
        bool(compiled),
        keep,
    )
    entropy = entropy if calculate_entropy else None
    return (log_probs, entropy, sum_pi_sq) if calculate_sum_pi_squared else (log_probs, entropy)
