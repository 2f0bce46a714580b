"""Interruptible generation (partial rollout): continue each response from its generated prefix.

At a weight update the asynchronous trainer aborts the generation in flight
(`async_training.partial_rollout=true`, docs/async.md). The engine stops at its next decode step
and returns every row's tokens so far; the unfinished rows come back later, with the new
weights, and continue from ``prompt + prefix``. Every response token carries the policy version
that produced it, so a response can mix versions (the oldest one bounds its staleness).

Input of `generate_resumable` (B rows, the rollout contract of hybridrl.rollout.base plus
four non-tensor columns, object arrays of length B):

    partial_response   list[int] per row: the tokens generated so far ([] for a fresh row)
    partial_log_probs  list[float] per row: their behaviour log-probs ([] without log-probs)
    partial_versions   list[int] per row: the policy version of each prefix token
    partial_done       bool per row: finished rows are passed through, not generated again

Output: the contract's tensors (responses = prefix + continuation), ``rollout_versions`` (B, T)
int64 (the version of each response token, -1 on padding) and the non-tensor ``partial_done``;
the other three partial columns are dropped. A row is done when it ended with EOS, reached the
response budget T, or the call was not aborted.

Exactness: the prefix is appended to the row's original left-padded prompt, so a fresh row sees
exactly the input of a plain `generate_sequences` call (same padding, same seed), and a resumed
greedy row continues the way the uninterrupted one would have (tests/rollout/
test_partial_rollout.py checks it token for token).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.rollout.base import (
    GenerationRequest,
    GenerationResult,
    SamplingSpec,
    build_rollout_output,
    derive_seed,
    resolve_sampling,
)

__all__ = [
    "PartialRollout",
    "PARTIAL_KEYS",
    "chunk_partial_columns",
    "fresh_partial_columns",
    "generate_resumable",
    "unfinished_group_prefixes",
]

PARTIAL_KEYS = ("partial_response", "partial_log_probs", "partial_versions", "partial_done")


def fresh_partial_columns(n: int) -> dict[str, np.ndarray]:
    """The four partial columns for `n` rows that start from nothing."""
    cols = {k: np.empty(n, dtype=object) for k in PARTIAL_KEYS}
    for i in range(n):
        cols["partial_response"][i], cols["partial_log_probs"][i], cols["partial_versions"][i] = [], [], []
        cols["partial_done"][i] = False
    return cols


def _sampling(rollout: Any, meta: dict) -> SamplingSpec:
    force_greedy = bool(meta.get("greedy", False)) or meta.get("do_sample", True) is False
    sampling = resolve_sampling(rollout.config, bool(meta.get("validate", False)), force_greedy)
    if meta.get("greedy", False):
        sampling = SamplingSpec(greedy=True, temperature=1.0, top_k=-1, top_p=1.0)
    return sampling


def _resume_inputs(
    ids: torch.Tensor, mask: torch.Tensor, prefixes: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Left-padded (R, P + L) inputs: each row's original prompt row with its prefix appended.

    Args:
        ids: (R, P) left-padded prompt ids of the rows to run.
        mask: (R, P) their attention mask.
        prefixes: R token lists (L = the longest).
        pad_id: the pad token id.

    Returns:
        input_ids (R, P + L), attention_mask (R, P + L), and the R unpadded token lists.
    """
    longest = max((len(p) for p in prefixes), default=0)
    r, p = ids.shape
    out_ids = torch.full((r, p + longest), pad_id, dtype=ids.dtype)
    out_mask = torch.zeros((r, p + longest), dtype=mask.dtype)
    tokens = []
    for i, prefix in enumerate(prefixes):
        shift = longest - len(prefix)
        out_ids[i, shift : shift + p] = ids[i]
        out_mask[i, shift : shift + p] = mask[i]
        if prefix:
            out_ids[i, shift + p :] = torch.as_tensor(prefix, dtype=ids.dtype)
            out_mask[i, shift + p :] = 1
        tokens.append(ids[i][mask[i].bool()].tolist() + list(prefix))
    return out_ids, out_mask, tokens


def _is_done(tokens: list[int], aborted: bool, budget: int, eos: set[int], ignore_eos: bool) -> bool:
    if not aborted or len(tokens) >= budget:
        return True
    return bool(tokens) and not ignore_eos and tokens[-1] in eos


def generate_resumable(rollout: Any, prompts: DataProto, version: int) -> DataProto:
    """Generate (or continue) one response per row with the engine's current weights.

    Args:
        rollout: a BaseRollout; an interruptible engine (HFRollout, VLLMRollout) sets
            `last_generate_aborted` when its `abort_requested` callback fires.
        prompts: B rows: input_ids / attention_mask / position_ids (B, P), left-padded, and the
            partial columns of the module docstring.
        version: the policy version of the engine's weights (tags the new tokens).

    Returns:
        B rows: the contract's output with responses = prefix + new tokens, rollout_versions
        (B, T) and non-tensor partial_done.
    """
    cfg, nt = rollout.config, prompts.non_tensor_batch
    budget, want_lp = cfg.response_length, cfg.calculate_log_probs
    prefixes = [list(x) for x in nt["partial_response"]]
    prefix_lps = [list(x) for x in nt["partial_log_probs"]]
    prefix_vs = [list(x) for x in nt["partial_versions"]]
    done = [bool(x) for x in nt["partial_done"]]
    run = [i for i in range(len(prompts)) if not done[i] and len(prefixes[i]) < budget]
    call = int(prompts.meta_info.get("seed_index", rollout.num_generate_calls))
    rollout.num_generate_calls += 1
    rollout.last_generate_aborted = False
    t0 = time.perf_counter()
    new_toks: dict[int, list[int]] = {}
    new_lps: dict[int, list[float]] = {}
    if run:
        ids, mask, tokens = _resume_inputs(
            prompts.batch["input_ids"][run].cpu(),
            prompts.batch["attention_mask"][run].cpu(),
            [prefixes[i] for i in run],
            rollout.pad_token_id,
        )
        request = GenerationRequest(
            input_ids=ids,
            attention_mask=mask,
            prompt_token_ids=tokens,
            sampling=_sampling(rollout, prompts.meta_info),
            seeds=[derive_seed(cfg.seed, call, i, rollout.dp_rank) for i in run],
            max_new_tokens=budget - min(len(prefixes[i]) for i in run),
            want_log_probs=want_lp,
        )
        result = rollout.generate_tokens(request)
        for j, i in enumerate(run):
            room = budget - len(prefixes[i])
            new_toks[i] = result.token_ids[j][:room]
            new_lps[i] = result.log_probs[j][:room] if want_lp else []
    aborted = bool(getattr(rollout, "last_generate_aborted", False))
    eos = set(rollout.eos_token_ids)
    toks, lps, vers, finished = [], [], [], []
    for i in range(len(prompts)):
        add = new_toks.get(i, [])
        toks.append(prefixes[i] + add)
        lps.append(prefix_lps[i] + new_lps.get(i, []))
        vers.append(prefix_vs[i] + [int(version)] * len(add))
        finished.append(done[i] or _is_done(toks[-1], aborted, budget, eos, cfg.ignore_eos))
    elapsed = time.perf_counter() - t0
    n_new = sum(len(t) for t in new_toks.values())
    metrics = {
        "timing_s/generate_sequences": elapsed,
        "rollout/num_response_tokens": n_new,
        "rollout/tokens_per_s": n_new / max(elapsed, 1e-9),
    }
    base = prompts.select(non_tensor_batch_keys=[k for k in nt if k not in PARTIAL_KEYS])
    out = build_rollout_output(
        base, GenerationResult(toks, lps if want_lp else None), rollout.pad_token_id, budget, metrics
    )
    versions = torch.full((len(prompts), budget), -1, dtype=torch.int64)
    for i, v in enumerate(vers):
        if v:
            versions[i, : len(v)] = torch.as_tensor(v, dtype=torch.int64)
    out.batch["rollout_versions"] = versions.to(out.batch["responses"].device)
    out.non_tensor_batch["partial_done"] = np.array(finished, dtype=object)
    return out


def chunk_partial_columns(prefixes: list[dict[str, np.ndarray] | None], n: int) -> dict[str, np.ndarray]:
    """The partial columns of a chunk of groups (n rows each): a group's saved prefixes, or fresh.

    Args:
        prefixes: per group, the columns `unfinished_group_prefixes` saved for it, or None.
        n: rows per group (rollout.n).
    """
    cols = fresh_partial_columns(len(prefixes) * n)
    for i, saved in enumerate(prefixes):
        if saved is not None:
            for key in PARTIAL_KEYS:
                cols[key][i * n : (i + 1) * n] = saved[key]
    return cols


def unfinished_group_prefixes(out: DataProto, n: int) -> dict[int, dict[str, np.ndarray] | None]:
    """The groups of a `generate_resumable` output with an unfinished row, and their prefixes.

    Pops the non-tensor ``partial_done`` from `out`.

    Args:
        out: the output (groups of n consecutive rows), with responses / response_mask /
            rollout_versions (B, T), optional rollout_log_probs (B, T), non-tensor partial_done.
        n: rows per group.

    Returns:
        {group index: its n rows' partial columns, or None when no row has a token yet}.
    """
    done = out.non_tensor_batch.pop("partial_done")
    lp = out.batch["rollout_log_probs"] if "rollout_log_probs" in out.batch.keys() else None
    lengths = out.batch["response_mask"].sum(-1).tolist()
    back: dict[int, dict[str, np.ndarray] | None] = {}
    for i in range(len(out) // n):
        rows = range(i * n, (i + 1) * n)
        if all(bool(done[r]) for r in rows):
            continue
        cols = fresh_partial_columns(n)
        for j, r in enumerate(rows):
            m = int(lengths[r])
            cols["partial_response"][j] = out.batch["responses"][r, :m].tolist()
            cols["partial_log_probs"][j] = lp[r, :m].tolist() if lp is not None else []
            cols["partial_versions"][j] = out.batch["rollout_versions"][r, :m].tolist()
            cols["partial_done"][j] = bool(done[r])
        back[i] = cols if any(lengths[r] for r in rows) else None
    return back


class PartialRollout:
    """A rollout engine whose resumable generation a weight update can interrupt: the partial
    rollout mode of a disaggregated rollout worker (workers/engine_workers.py).

    The worker asks `request_abort(v, its version)` from its control thread while `generate` runs
    in its main one; a generation whose version is below v then stops at its next decode step.

    Args:
        rollout: the worker's rollout engine (a BaseRollout with `abort_requested` support).
    """

    def __init__(self, rollout: Any) -> None:
        self.rollout = rollout
        self.abort_below = -1  # abort a generation whose policy version is below this
        self.aborts = 0  # generations that stopped early

    def request_abort(self, version: int, policy_version: int) -> bool:
        """Abort generations older than `version`; True if one may be running now."""
        self.abort_below = max(self.abort_below, int(version))
        return self.abort_below > policy_version

    def generate(self, prompts: DataProto, policy_version: int) -> DataProto:
        """`generate_resumable` with this mode's abort callback; meta_info "worker_aborts" counts
        the generations cut short so far."""
        # the callback is set for this call only: validation and the ReMax baseline run on the same
        # engine and must never be cut short by a pending abort
        self.rollout.abort_requested = lambda: self.abort_below > policy_version
        try:
            out = generate_resumable(self.rollout, prompts, policy_version)
        finally:
            self.rollout.abort_requested = None
        if getattr(self.rollout, "last_generate_aborted", False):
            self.aborts += 1
        out.meta_info["worker_aborts"] = self.aborts
        return out
