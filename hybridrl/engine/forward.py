"""Micro-batch forward passes of a (sharded) Hugging Face model: log-probs, values, scores.

Batch layout (veRL): input_ids = [prompt | response] of shape (B, S) with S = P + T, prompts
left-padded and responses right-padded; attention_mask (B, S) marks valid tokens; position_ids
(B, S); responses (B, T) = input_ids[:, -T:]. The logits at position t predict token t + 1, so
the T response tokens are predicted by positions S - T - 1 ... S - 2: `[:, -T - 1 : -1]`.

With `use_remove_padding` the valid tokens are packed into one row (see
`hybridrl.utils.torch_utils.pack_sequences`) and the per-token results are scattered back to
(B, S) before the same slice; padded positions then read 0.

Only what the loss needs is computed: the model's head (lm_head, or the critic's value head)
is swapped for the duration of the forward by one that first selects the response-predicting
positions of the last hidden states and then runs the projection there; for log-probs the
projection, log-softmax, gather and entropy run through `lm_head.linear_log_probs`, a chunk of
positions at a time, so the (B, S, V) logits never exist. This applies when the model's forward
passes the head's output through untouched (`head_is_swappable`: Qwen2, Llama, Mistral, ...);
models that post-process logits (soft-capping, scaling) take the plain path.

Shapes: B batch, P prompt length, T response length, S = P + T, V vocabulary, H hidden size,
K valid response tokens.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridrl.algos.otb import sum_pi_squared_from_logits
from hybridrl.algos.utils import entropy_from_logits, entropy_from_logits_chunked, logprobs_from_logits
from hybridrl.engine.base import LogProbs
from hybridrl.engine.head_swap import head_is_swappable, head_replaced
from hybridrl.engine.last_layer import last_layer_rows
from hybridrl.engine.lm_head import linear_log_probs
from hybridrl.engine.multimodal import (
    grouped_model_inputs,
    has_multimodal,
    model_inputs,
    prompt_media_keys,
    text_tower_on_slice,
)
from hybridrl.engine.prefix_group import (
    LAYOUT_KWARG,
    LayoutNotPassed,
    build_prefix_layout,
    prefix_grouped,
    sequence_layout,
)
from hybridrl.engine.ulysses import SPGroup, gather_seq, padded_length, slice_packed
from hybridrl.utils.flops import grouped_work
from hybridrl.utils.torch_utils import (
    PackedBatch,
    block_causal_mask,
    pack_sequences,
    transformers_detects_packed_sequences,
    unpack_sequences,
)


@functools.cache
def _compiled_entropy():
    return torch.compile(entropy_from_logits, dynamic=True)


def compiled_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """`entropy_from_logits` through torch.compile (built once per process)."""
    return _compiled_entropy()(logits)


_DETECTS_PACKING = transformers_detects_packed_sequences()


def run_model(
    module: nn.Module,
    batch: Any,
    use_remove_padding: bool,
    packed: PackedBatch | None = None,
    sp: SPGroup | None = None,
) -> tuple[Any, PackedBatch | None]:
    """Forward on the padded batch, or on its packed valid tokens; returns (HF output, packing).

    With Ulysses SP (`sp`) the forward runs on this rank's slice of the packed row
    (`ulysses.slice_packed`); the output's per-token tensors are then (1, L, ...) local.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    if has_multimodal(batch):
        return _run_multimodal(module, batch, use_remove_padding, packed, sp)
    if sp is not None:
        if not use_remove_padding:
            raise ValueError("Ulysses sequence parallelism needs use_remove_padding=True (the packed path)")
        packed = packed or pack_sequences(input_ids, attention_mask)
        ids, pos = slice_packed(packed.input_ids, packed.position_ids, sp)
        return module(input_ids=ids, position_ids=pos, use_cache=False), packed
    if not use_remove_padding:
        position_ids = batch["position_ids"] if "position_ids" in batch.keys() else None
        out = module(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out, None
    packed = packed or pack_sequences(input_ids, attention_mask)
    if _sequence_wise(module):
        try:
            with prefix_grouped(module):
                out = module(
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    use_cache=False,
                    **{LAYOUT_KWARG: sequence_layout(packed.seq_lens)},
                )
            return out, packed
        except LayoutNotPassed:  # this model's forward drops extra kwargs: the block mask below
            _NO_SEQUENCE_WISE.add(type(module))
    kwargs: dict[str, Any] = {}
    if not _DETECTS_PACKING:
        dtype = next(module.parameters()).dtype
        kwargs["attention_mask"] = block_causal_mask(packed.seq_lens, dtype, input_ids.device)
    out = module(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **kwargs)
    return out, packed


_NO_SEQUENCE_WISE: set[type] = set()


def _run_multimodal(module, batch, use_remove_padding, packed, sp):
    """`run_model` for a vision-language batch (`engine.multimodal`): pixel inputs and 3-D rotary
    positions; the packed row attends through transformers' packed-sequence detection (the text
    positions in row 0 of the (4, 1, nnz) position ids) or the block-causal mask."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    if sp is not None:  # the vision tower on the whole row, the text tower on this rank's slice
        if not use_remove_padding:
            raise ValueError("Ulysses sequence parallelism needs use_remove_padding=True (the packed path)")
        packed = packed or pack_sequences(input_ids, attention_mask)
        ids, kwargs, feed = model_inputs(module, batch, packed)
        with feed, text_tower_on_slice(module, sp):
            return module(input_ids=ids, use_cache=False, **kwargs), packed
    if not use_remove_padding:
        ids, kwargs, feed = model_inputs(module, batch)
        with feed:
            return module(input_ids=ids, attention_mask=attention_mask, use_cache=False, **kwargs), None
    packed = packed or pack_sequences(input_ids, attention_mask)
    ids, kwargs, feed = model_inputs(module, batch, packed)
    if not _DETECTS_PACKING:
        dtype = next(module.parameters()).dtype
        kwargs["attention_mask"] = block_causal_mask(packed.seq_lens, dtype, input_ids.device)
    with feed:
        return module(input_ids=ids, use_cache=False, **kwargs), packed


def _sequence_wise(module: nn.Module) -> bool:
    """Whether a packed forward attends sequence by sequence (`prefix_group.sequence_layout`)
    instead of through a block-diagonal mask over the whole row, whose cost grows with the square
    of the row's length: for the sdpa and eager implementations (flash-attention finds the
    sequences from the position ids itself) of models that pass their kwargs to attention."""
    if type(module) in _NO_SEQUENCE_WISE:
        return False
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager")  # eager stays eager inside


def response_positions(packed: PackedBatch, attention_mask: torch.Tensor, t: int):
    """Where the valid response tokens are predicted in a packed row.

    Args:
        packed: the packing of the (B, S) batch.
        attention_mask: (B, S); its last T columns mark the valid response tokens.
        t: response length T.

    Returns:
        pred (K,) positions in the packed row that predict the K valid response tokens, and
        flat (K,) their indices in the flattened (B, T) response layout.
    """
    b, s = packed.batch_size, packed.seqlen
    nnz = packed.indices.numel()
    where = torch.full((b * s,), -1, dtype=torch.long, device=packed.indices.device)
    where[packed.indices] = torch.arange(nnz, device=where.device)
    pred = where.view(b, s)[:, -t - 1 : -1]
    valid = attention_mask[:, -t:].bool() & (pred >= 0)
    flat = valid.reshape(-1).nonzero().squeeze(-1)
    return pred.reshape(-1)[flat], flat


def _selector(batch: Any, packed: PackedBatch | None, t: int):
    """(select, scatter): hidden (B, S, H) / (1, nnz, H) -> (N, H) rows; (N, ...) -> (B, T, ...)."""
    b = batch["responses"].shape[0]
    if packed is None:  # every response position, as the plain path

        def select(h: torch.Tensor) -> torch.Tensor:
            return h[:, -t - 1 : -1].reshape(b * t, h.shape[-1])

        return select, (lambda v: v.reshape(b, t, *v.shape[1:])), batch["responses"].reshape(-1)
    pred, flat = response_positions(packed, batch["attention_mask"], t)

    def scatter(v: torch.Tensor) -> torch.Tensor:
        out = v.new_zeros((b * t, *v.shape[1:])).index_put((flat,), v)
        return out.view(b, t, *v.shape[1:])

    return (lambda h: h[0, pred]), scatter, batch["responses"].reshape(-1)[flat]


def _sp_selector(batch: Any, packed: PackedBatch, t: int, sp: SPGroup):
    """Like `_selector` for this rank's slice of the padded packed row (Ulysses SP):
    (select: hidden (1, L, H) -> (n, H) local response-predicting rows; place: (n, ...) -> (L, ...)
    zeros elsewhere; finish: the gathered (padded, ...) row -> (B, T, ...); local labels (n,))."""
    b = batch["responses"].shape[0]
    pred, flat = response_positions(packed, batch["attention_mask"], t)
    padded = padded_length(packed.indices.numel(), sp)
    length = padded // sp.size
    wanted = torch.zeros(padded, dtype=torch.bool, device=pred.device)
    wanted[pred] = True
    labels = torch.zeros(padded, dtype=torch.long, device=pred.device)
    labels[pred] = batch["responses"].reshape(-1)[flat].long()
    lo = sp.rank * length
    local = wanted[lo : lo + length].nonzero().squeeze(-1)

    def place(v: torch.Tensor) -> torch.Tensor:
        return v.new_zeros((length, *v.shape[1:])).index_put((local,), v)

    def finish(full: torch.Tensor) -> torch.Tensor:
        out = full.new_zeros((b * t, *full.shape[1:])).index_put((flat,), full[pred])
        return out.view(b, t, *full.shape[1:])

    return (lambda h: h[0, local]), place, finish, labels[lo : lo + length][local]


def _head_columns(head, labels, temperature, calculate_entropy, entropy_grad, sps, compiled):
    """The swapped head: (n, H) hidden rows -> (n, 1 + entropy + sps) stacked columns
    [log_prob, entropy?, sum_pi_squared?] from the chunked `linear_log_probs`."""

    def columns(h: torch.Tensor) -> torch.Tensor:
        out = linear_log_probs(
            h,
            head.weight,
            labels,
            bias=head.bias,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            entropy_grad=entropy_grad and torch.is_grad_enabled(),
            calculate_sum_pi_squared=sps,
            compiled=compiled,
        )
        return torch.stack([c for c in out if c is not None], dim=-1)

    return columns


def _split_columns(res: torch.Tensor, calculate_entropy: bool, sps: bool):
    """(B, T, C) stacked columns -> (log_probs, entropy or None, sum_pi_squared or None)."""
    ent = res[..., 1] if calculate_entropy else None
    return res[..., 0], ent, (res[..., -1] if sps else None)


def _fused_log_probs_sp(
    module, head, batch, temperature, calculate_entropy, entropy_grad, sps, sp, compiled=False
):
    """`_fused_log_probs` for one rank of a Ulysses group: the head runs on the local slice, the
    stacked [log_prob, entropy?, sum_pi_squared?] columns are gathered along the sequence."""
    t = batch["responses"].shape[-1]
    packed = pack_sequences(batch["input_ids"], batch["attention_mask"])
    select, place, finish, labels = _sp_selector(batch, packed, t, sp)

    columns = _head_columns(head, labels, temperature, calculate_entropy, entropy_grad, sps, compiled)
    with head_replaced(head, lambda h: place(columns(select(h)))):
        out, _ = run_model(module, batch, True, packed, sp)
    return _split_columns(finish(gather_seq(out.logits, sp, dim=0)), calculate_entropy, sps)


def _gathered_logits(out: Any, packed: PackedBatch, sp: SPGroup | None) -> torch.Tensor:
    """The (1, nnz, C) logits of a packed forward (with SP: gathered from the slices, padding dropped)."""
    if sp is None:
        return out.logits
    return gather_seq(out.logits, sp, dim=1)[:, : packed.indices.numel()]


def _fused_log_probs(
    module, head, batch, temperature, use_remove_padding, calculate_entropy, entropy_grad, sps, compiled=False
):
    """(log_probs, entropy or None, sum_pi_squared or None), each (B, T), through the chunked head."""
    t = batch["responses"].shape[-1]
    packed = pack_sequences(batch["input_ids"], batch["attention_mask"]) if use_remove_padding else None
    select, scatter, labels = _selector(batch, packed, t)

    columns = _head_columns(head, labels, temperature, calculate_entropy, entropy_grad, sps, compiled)
    with head_replaced(head, lambda h: columns(select(h))):
        out, _ = run_model(module, batch, use_remove_padding, packed)
    return _split_columns(scatter(out.logits), calculate_entropy, sps)


def _grouped_log_probs(
    module, head, batch, temperature, calculate_entropy, entropy_grad, sps, entropy_fn, compiled=False
):
    """(log_probs, entropy or None, sum_pi_squared or None), each (B, T), and the (tokens, squares)
    computed (utils/flops.grouped_work), through the shared-prompt packed row (`prefix_group`): the
    head at the response-predicting positions, chunked when it can be swapped (`head`), else full
    logits there."""
    t = batch["responses"].shape[-1]
    b = batch["responses"].shape[0]
    mm = has_multimodal(batch)
    keys = prompt_media_keys(module, batch) if mm else None  # equal prompts need equal pixels too
    layout = build_prefix_layout(batch["input_ids"], batch["attention_mask"], t, row_keys=keys)
    labels = batch["responses"].reshape(-1)[layout.flat]
    work = grouped_work(layout.lengths, layout.prompt_of)

    def scatter(v: torch.Tensor) -> torch.Tensor:
        return v.new_zeros((b * t, *v.shape[1:])).index_put((layout.flat,), v).view(b, t, *v.shape[1:])

    def run():
        ids, kwargs, feed = layout.input_ids, {"position_ids": layout.position_ids}, contextlib.nullcontext()
        if mm:  # each group's pixels once, 3-D positions (engine.multimodal)
            ids, kwargs, feed = grouped_model_inputs(module, batch, layout)
        with feed, prefix_grouped(module):
            return module(input_ids=ids, use_cache=False, **kwargs, **{LAYOUT_KWARG: layout})

    if head is not None:
        columns = _head_columns(head, labels, temperature, calculate_entropy, entropy_grad, sps, compiled)
        with head_replaced(head, lambda h: columns(h[0, layout.pred])):
            out = run()
        return (*_split_columns(scatter(out.logits), calculate_entropy, sps), work)
    logits = run().logits[0, layout.pred].float() / temperature  # (K, V)
    log_probs = scatter(logprobs_from_logits(logits, labels))
    entropy = scatter(entropy_fn(logits)) if calculate_entropy else None
    return log_probs, entropy, (scatter(sum_pi_squared_from_logits(logits)) if sps else None), work


def forward_log_probs(
    module: nn.Module,
    batch: Any,
    *,
    temperature: float = 1.0,
    use_remove_padding: bool = False,
    calculate_entropy: bool = False,
    entropy_chunk_size: int | None = None,
    entropy_grad: bool = True,
    fused: bool = True,
    calculate_sum_pi_squared: bool = False,
    sp: SPGroup | None = None,
    compile_kernels: bool = False,
    prefix_group: bool = False,
) -> LogProbs:
    """Log-probs (and entropy) of the response tokens under `module`, logits / temperature.

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S),
            responses (B, T).
        temperature: the rollout's sampling temperature (> 0).
        entropy_chunk_size: plain path only: the entropy this many positions at a time.
        entropy_grad: False computes the entropy without a graph (a metric, not part of a loss).
        fused: compute the head only at the response positions, chunked (see the module
            docstring); False, or a model whose head cannot be swapped, takes the plain path
            (full logits, then the slice).
        calculate_sum_pi_squared: also return sum_v pi(v)^2 (B, T) of each response position
            (no gradient; the optimal token baseline's statistic), chunk-wise like the entropy.
        sp: this rank's Ulysses group (the model went through `ulysses.parallelize_sp`; needs
            use_remove_padding): every rank of the group gets the same batch and returns the
            same full results.
        compile_kernels: the actor's `use_torch_compile` (veRL compiles its entropy / log-prob
            kernels): the chunked head's per-chunk softmax statistics and their backward, or the
            plain path's entropy, run through torch.compile (the first call compiles).
        prefix_group: the actor's `use_prefix_grouper`: rows with the same prompt share one
            forward of it (`engine.prefix_group`; always packed, whatever use_remove_padding);
            not with `sp`.

    Returns:
        LogProbs: log_probs (B, T) float32; entropy (B, T) float32 or None; sum_pi_squared
        (B, T) float32 with calculate_sum_pi_squared, else None. Values at padded response positions are
        meaningless (0 with remove-padding); mask them.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    head = head_is_swappable(module) if fused else None

    def ent_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            if entropy_chunk_size:
                return entropy_from_logits_chunked(x, entropy_chunk_size)
            return compiled_entropy_from_logits(x) if compile_kernels else entropy_from_logits(x)

    if prefix_group:
        if sp is not None:
            raise ValueError("use_prefix_grouper does not combine with Ulysses sequence parallelism")
        lp, ent, sps, work = _grouped_log_probs(
            module, head, batch, temperature, calculate_entropy, entropy_grad, calculate_sum_pi_squared,
            ent_fn, compiled=compile_kernels,
        )  # fmt: skip
        return LogProbs(lp, ent, sps, work=work)
    if head is not None:
        if sp is not None:
            lp, ent, sps = _fused_log_probs_sp(
                module, head, batch, temperature, calculate_entropy, entropy_grad, calculate_sum_pi_squared,
                sp, compiled=compile_kernels,
            )  # fmt: skip
        else:
            lp, ent, sps = _fused_log_probs(
                module, head, batch, temperature, use_remove_padding, calculate_entropy, entropy_grad,
                calculate_sum_pi_squared, compiled=compile_kernels,
            )  # fmt: skip
        return LogProbs(lp, ent, sps)
    return _plain_log_probs(
        module,
        batch,
        temperature,
        use_remove_padding,
        calculate_entropy,
        calculate_sum_pi_squared,
        sp,
        ent_fn,
    )


def _plain_log_probs(
    module: nn.Module,
    batch: Any,
    temperature: float,
    use_remove_padding: bool,
    calculate_entropy: bool,
    sps: bool,
    sp: SPGroup | None,
    ent_fn: Callable[[torch.Tensor], torch.Tensor],
) -> LogProbs:
    """forward_log_probs' plain path: the model's full logits, then the response slice."""
    responses = batch["responses"]
    t = responses.shape[-1]
    out, packed = run_model(module, batch, use_remove_padding, sp=sp)
    if packed is None:
        logits = out.logits[:, -t - 1 : -1].float() / temperature
        entropy = ent_fn(logits) if calculate_entropy else None
        return LogProbs(
            logprobs_from_logits(logits, responses),
            entropy,
            sum_pi_squared_from_logits(logits) if sps else None,
        )
    logits = _gathered_logits(out, packed, sp)[0].float() / temperature  # (nnz, V)
    labels = torch.roll(packed.input_ids[0], shifts=-1)  # token t + 1 (garbage at each sequence end)

    def unpacked(v: torch.Tensor) -> torch.Tensor:
        return unpack_sequences(v, packed)[:, -t - 1 : -1]

    return LogProbs(
        unpacked(logprobs_from_logits(logits, labels)),
        unpacked(ent_fn(logits)) if calculate_entropy else None,
        unpacked(sum_pi_squared_from_logits(logits)) if sps else None,
    )


def forward_values(
    module: nn.Module,
    batch: Any,
    *,
    use_remove_padding: bool = False,
    fused: bool = True,
    sp: SPGroup | None = None,
) -> torch.Tensor:
    """Values of a token-classification critic (num_labels=1) at the response-predicting positions.

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S),
            responses (B, T).
        fused: run the value head only at the response-predicting positions (when the model's
            head can be swapped, see `head_is_swappable`); False: on every position, then slice.
        sp: this rank's Ulysses group (see `forward_log_probs`).

    Returns:
        (B, T) float32: the value of the state before each response token.
    """
    t = batch["responses"].shape[-1]
    head = head_is_swappable(module) if fused else None
    if head is not None and head.out_features != 1:
        raise ValueError(
            f"the critic must output one value per token (num_labels=1), got {head.out_features}"
        )
    if head is not None and sp is not None:
        packed = pack_sequences(batch["input_ids"], batch["attention_mask"])
        select, place, finish, _ = _sp_selector(batch, packed, t, sp)
        with head_replaced(head, lambda h: place(nn.functional.linear(select(h), head.weight, head.bias))):
            out, _ = run_model(module, batch, True, packed, sp)
        return finish(gather_seq(out.logits, sp, dim=0))[..., 0].float()
    if head is not None:
        packed = pack_sequences(batch["input_ids"], batch["attention_mask"]) if use_remove_padding else None
        select, scatter, _ = _selector(batch, packed, t)
        with head_replaced(head, lambda h: nn.functional.linear(select(h), head.weight, head.bias)):
            out, _ = run_model(module, batch, use_remove_padding, packed)
        return scatter(out.logits)[..., 0].float()
    out, packed = run_model(module, batch, use_remove_padding, sp=sp)
    logits = out.logits if packed is None else _gathered_logits(out, packed, sp)
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


def forward_scores(
    module: nn.Module, batch: Any, *, use_remove_padding: bool = False, prefix_group: bool = False
) -> torch.Tensor:
    """Reward-model score of each sequence: the head's output at its last valid token.

    The per-token head output is read with a forward hook, so the result does not depend on how
    the model finds "the last non-pad token" (pad == eos ids, left padding, packing).

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), position_ids (B, S); with
            `prefix_group` also responses (B, T) (the veRL layout, prompts left-padded).
        prefix_group: rows with the same prompt share one forward of it (`engine.prefix_group`,
            always packed): a reward model's chosen and rejected completions of one prompt cost
            the prompt once. Every row needs at least one valid response token.

    Returns:
        (B,) float32 scores.
    """
    captured: list[torch.Tensor] = []
    handle = _score_head(module).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        if prefix_group:
            last = _grouped_last_tokens(module, batch)
        else:
            _, packed = run_model(module, batch, use_remove_padding)
    finally:
        handle.remove()
    per_token = captured[-1][..., 0].float()  # (B, S) or (1, nnz)
    if prefix_group:
        return per_token[0, last]
    if packed is None:
        mask = batch["attention_mask"]
        positions = torch.arange(mask.shape[-1], device=mask.device)
        last = (mask.long() * positions).argmax(dim=-1)
        return per_token.gather(1, last[:, None]).squeeze(1)
    return per_token[0, packed.cu_seqlens[1:].long() - 1]


def _grouped_last_tokens(module: nn.Module, batch: Any) -> torch.Tensor:
    """Run `module` on the shared-prompt packed row of `batch`; (B,) the packed position of each
    row's last valid token (a response token, so it belongs to that row alone)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    b, s = ids.shape
    layout = build_prefix_layout(ids, mask, batch["responses"].shape[-1])
    positions = torch.arange(s, device=ids.device)
    last_col = (mask.long() * positions).argmax(dim=-1)
    if bool((mask[:, -batch["responses"].shape[-1] :].sum(-1) == 0).any()):
        raise ValueError("a row has no valid response token; the shared-prompt score needs one per row")
    where = torch.full((b * s,), -1, dtype=torch.long, device=ids.device)
    where[layout.source] = torch.arange(layout.num_tokens, device=ids.device)
    last = where[torch.arange(b, device=ids.device) * s + last_col]
    with prefix_grouped(module), last_layer_rows(module, last):
        module(
            input_ids=layout.input_ids,
            position_ids=layout.position_ids,
            use_cache=False,
            **{LAYOUT_KWARG: layout},
        )
    return last
