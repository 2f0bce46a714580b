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

The eager per-chunk kernels (`stats_inplace`, `grad_inplace`) work in place: the chunk's logits
become log p in the forward and the gradient in the backward, with one reused (c, V) scratch
buffer, and the matmuls write into their outputs (`out=`, `addmm_`). At 16 x 256 response tokens
of a 32k vocabulary this took the head's forward + backward from 14.7 to 6.2 s (2 threads;
`chunk_stats` / `chunk_grad` are the out-of-place reference, and what `compiled` compiles).

Shapes: N positions (only the response-predicting ones: the caller slices them before the head),
H hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Budget of one chunk's float32 logits; the forward and the backward hold 2 buffers of this size.
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


def _chunk_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(c, H) hidden -> (c, V) float32 logits / temperature (the matmul in the inputs' dtype),
    written into `out` (c, V) float32 when given (the matmul's own output when it is float32)."""
    if (
        out is not None
        and h.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
    ):
        if bias is None:
            torch.mm(h, weight.t(), out=out)
        else:
            torch.addmm(bias, h, weight.t(), out=out)
    else:
        z = F.linear(h, weight, bias).float()
        if out is None:
            return z / temperature if temperature != 1.0 else z
        out.copy_(z)
    if temperature != 1.0:
        out.div_(temperature)
    return out


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


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] * b[i, v] for each row i of two (c, V) tensors, without a (c, V) temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def stats_inplace(
    z: torch.Tensor,
    labels: torch.Tensor,
    with_entropy: bool,
    with_sps: bool,
    scratch: torch.Tensor | None = None,
):
    """`chunk_stats` with fewer passes over the (c, V) chunk, which it overwrites with log p.

    With m = max_v z and e = exp(z - m), s = sum_v e:  log p = (z - m) - log s,
    H = log s - sum_v e (z - m) / s,  sum_v p^2 = sum_v e^2 / s^2. One (c, V) temporary (e);
    z is shifted in place twice, the row sums are batched dot products.

    `scratch`: a float32 buffer of at least z's size for e (mapped pages of the previous chunk).
    Returns (log p(label), (m, log s), entropy or None, sum p^2 or None), each (c,); the pair
    (m, log s) turns a recomputed chunk of logits into the same log p bits (`grad_inplace`).
    """
    m = z.amax(dim=-1)
    z.sub_(m[:, None])
    e = torch.exp(z) if scratch is None else torch.exp(z, out=scratch[: z.numel()].view(z.shape))
    s = e.sum(dim=-1)
    log_s = torch.log(s)
    entropy = log_s - _rowdot(e, z) / s if with_entropy else None
    sum_pi_sq = _rowdot(e, e) / (s * s) if with_sps else None
    del e
    z.sub_(log_s[:, None])
    return z.gather(1, labels[:, None])[:, 0], (m, log_s), entropy, sum_pi_sq


def grad_inplace(
    logp, shift, labels, g_logp, g_ent, entropy, temperature: float, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """`chunk_grad` computed in the (c, V) buffer `logp`, which it overwrites and returns.

    `logp` holds log p (a kept chunk) or, with `shift` = (m, log s), the chunk's logits z, shifted
    here into log p. d/dz of g_logp * log p(label) + g_ent * H, divided by the temperature:
    -p (g_logp + g_ent (log p + H)) + onehot(label) g_logp, as two in-place row scalings
    (one without the entropy term) and one scatter; `scratch` as in `stats_inplace` (for p).
    """
    if shift is not None:
        logp.sub_(shift[0][:, None]).sub_(shift[1][:, None])
    g_logp = None if g_logp is None else g_logp / temperature
    if g_ent is None:
        if g_logp is None:
            return logp.zero_()
        logp.exp_().mul_(-g_logp[:, None])
    else:
        g_ent = g_ent / temperature
        p = (
            torch.exp(logp)
            if scratch is None
            else torch.exp(logp, out=scratch[: logp.numel()].view(logp.shape))
        )
        b = g_ent * entropy if g_logp is None else g_logp + g_ent * entropy
        logp.mul_(g_ent[:, None]).add_(b[:, None]).mul_(p).neg_()
        del p
    if g_logp is not None:
        logp.scatter_add_(1, labels[:, None], g_logp[:, None])
    return logp


_COMPILED: dict[str, Any] = {}


def _kernels(compiled: bool):
    """The per-chunk (statistics, gradient) kernels: eager, the in-place `stats_inplace` /
    `grad_inplace`; compiled, `chunk_stats` / `chunk_grad` through torch.compile (built once per
    process; the actor's `use_torch_compile`, as veRL compiles its entropy/log-prob kernels):
    inductor fuses the exp / sum / gather passes over each (c, V) chunk into one loop."""
    if not compiled:
        return stats_inplace, grad_inplace
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
        dev = hidden.device
        kept = torch.empty(0, dtype=torch.float32, device=dev)
        if keep_logits:
            kept = torch.empty(n, weight.shape[0], dtype=torch.float32, device=dev)
        log_probs = torch.empty(n, dtype=torch.float32, device=dev)
        # eager: the row max and log of the exp-sum of each position (log p = z - m - log s);
        # compiled: the log-sum-exp in shift[0], shift[1] = 0
        shift = torch.zeros(2, n, dtype=torch.float32, device=dev)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
        sum_pi_sq = torch.empty(n if with_sps else 0, dtype=torch.float32, device=dev)
        stats, _ = _kernels(compiled)
        rows = min(n, chunk_rows)
        extra = {} if compiled else {"scratch": torch.empty(rows * weight.shape[0], device=dev)}
        zbuf = None if keep_logits or compiled else torch.empty(rows, weight.shape[0], device=dev)
        for lo in range(0, n, chunk_rows):
            hi = min(n, lo + chunk_rows)
            out = kept[lo:hi] if keep_logits else (None if zbuf is None else zbuf[: hi - lo])
            z = _chunk_logits(hidden[lo:hi], weight, bias, temperature, out)
            lp_c, sh_c, ent_c, sps_c = stats(z, labels[lo:hi], with_entropy, with_sps, **extra)
            log_probs[lo:hi] = lp_c
            if compiled:
                shift[0, lo:hi] = sh_c
            else:
                shift[0, lo:hi], shift[1, lo:hi] = sh_c
            if with_entropy:
                entropy[lo:hi] = ent_c
            if with_sps:
                sum_pi_sq[lo:hi] = sps_c
        ctx.save_for_backward(hidden, weight, bias, labels, shift, entropy)
        # Kept logits: log p (eager kernels, in place) or z (compiled). Not a saved tensor: the eager
        # backward overwrites it with its gradient and drops it; a second backward through this
        # graph (retain_graph) recomputes the logits instead.
        ctx.kept = kept if keep_logits else None
        ctx.temperature, ctx.chunk_rows, ctx.compiled = temperature, chunk_rows, compiled
        ctx.keep_logits = keep_logits
        ctx.entropy_grad = with_entropy and entropy_grad
        # one call: a second mark_non_differentiable replaces the first one's set
        ctx.mark_non_differentiable(sum_pi_sq, *([] if ctx.entropy_grad else [entropy]))
        ctx.set_materialize_grads(False)
        return log_probs, entropy, sum_pi_sq

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_sps):
        hidden, weight, bias, labels, shift, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not ctx.entropy_grad:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 11
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        t, n = ctx.temperature, hidden.shape[0]
        _, grad_kernel = _kernels(ctx.compiled)
        kept = ctx.kept
        kept_ok = kept is not None
        if not ctx.compiled:
            ctx.kept = None  # becomes this backward's gradient buffer
        rows = min(n, ctx.chunk_rows)
        # the eager kernel's buffers, reused chunk after chunk: p, and the recomputed logits
        scratch = (
            None
            if ctx.compiled or g_ent is None
            else torch.empty(rows * weight.shape[0], device=hidden.device)
        )
        zbuf = None if ctx.compiled or kept_ok else torch.empty(rows, weight.shape[0], device=hidden.device)
        for lo in range(0, n, ctx.chunk_rows):
            hi = min(n, lo + ctx.chunk_rows)
            h = hidden[lo:hi]
            if kept_ok:
                z = kept[lo:hi]
            else:
                z = _chunk_logits(h, weight, bias, t, None if zbuf is None else zbuf[: hi - lo])
            args = (
                labels[lo:hi],
                None if g_logp is None else g_logp[lo:hi].float(),
                None if g_ent is None else g_ent[lo:hi].float(),
                entropy[lo:hi] if g_ent is not None else None,
                t,
            )
            if ctx.compiled:
                gz = grad_kernel(z, shift[0, lo:hi], *args)
            else:
                sh = None if kept_ok else (shift[0, lo:hi], shift[1, lo:hi])
                gz = grad_kernel(z, sh, *args, scratch=scratch)
            gz = gz.to(weight.dtype)
            if need_h:
                if grad_h.dtype == gz.dtype:
                    torch.mm(gz, weight, out=grad_h[lo:hi])
                else:
                    grad_h[lo:hi] = gz @ weight
            if need_w:
                if h.dtype == torch.float32 and gz.dtype == torch.float32:
                    grad_w.addmm_(gz.t(), h)
                else:
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
