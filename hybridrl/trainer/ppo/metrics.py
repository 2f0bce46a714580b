"""Step metrics with veRL's names: data statistics, timing, throughput, validation mean/best/maj@N.

All functions read a DataProto whose batch holds `responses` (B, T) and `attention_mask`
(B, P+T) (or only `response_mask` (B, T)), plus whatever the step has produced so far:
`token_level_scores`, `token_level_rewards`, `advantages`, `returns`, `values` (all (B, T)).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto

__all__ = [
    "compute_data_metrics",
    "compute_throughout_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "step_token_counts",
    "expected_best_of_k",
    "process_validation_metrics",
    "reduce_metrics",
    "timer",
]

# timing sections whose cost scales with every token (the rest scale with response tokens: "gen")
_ALL_TOKEN_SECTIONS = ("ref", "old_log_prob", "values", "adv", "update_critic", "update_actor")
_CORE_VARS = ("reward", "acc")


@contextmanager
def timer(name: str, timing_raw: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to `timing_raw[name]` (time.perf_counter; accumulates)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Mean of each metric's values (lists of numbers/tensors, or single numbers); empty lists are dropped."""
    out = {}
    for key, value in metrics.items():
        values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
        if values:
            out[key] = float(np.mean([_to_float(v) for v in values]))
    return out


# ----------------------------------------------------------------------------------------------
# batch statistics
# ----------------------------------------------------------------------------------------------
def _masks(batch: DataProto) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(prompt validity (B, P) or None, response validity (B, T), loss mask (B, T)), all bool.

    Lengths come from the attention mask (every non-pad token, tool output included); the loss
    mask (`response_mask`) selects the tokens that advantages and returns are averaged over.
    """
    b = batch.batch
    if b is None or "responses" not in b.keys():
        raise KeyError("metrics: batch needs 'responses' (B, T)")
    t = b["responses"].shape[-1]
    if "attention_mask" in b.keys():
        attn = b["attention_mask"].bool()
        prompt, response = attn[:, :-t], attn[:, -t:]
    elif "response_mask" in b.keys():
        prompt, response = None, b["response_mask"].bool()
    else:
        raise KeyError("metrics: batch needs 'attention_mask' (B, P+T) or 'response_mask' (B, T)")
    loss_mask = b["response_mask"].bool() if "response_mask" in b.keys() else response
    return prompt, response, loss_mask


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.detach().float()
    if values.numel() == 0:
        return {f"{prefix}/mean": math.nan, f"{prefix}/max": math.nan, f"{prefix}/min": math.nan}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def compute_data_metrics(
    batch: DataProto,
    use_critic: bool,
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, float]:
    """veRL's data metrics for one training batch.

    critic/score/* and critic/rewards/* are per-sequence sums of `token_level_scores` /
    `token_level_rewards`; critic/advantages|returns|values/* are over valid response tokens;
    critic/vf_explained_var = 1 - Var(returns - values) / (Var(returns) + 1e-5) with a critic.
    response_length/* and prompt_length/* count non-pad tokens; clip_ratio is the fraction of
    samples that hit the maximum (`max_response_length` / `max_prompt_length`, by default the
    tensor widths T and P; the trainer passes the configured limits, since it trims all-padding
    columns). Groups whose batch key is missing are left out, except
    `values` when `use_critic` (KeyError).
    """
    b = batch.batch
    prompt_valid, response_valid, loss_mask = _masks(batch)
    out: dict[str, float] = {}
    for key, name in (("token_level_scores", "score"), ("token_level_rewards", "rewards")):
        if key in b.keys():
            out.update(_stats(f"critic/{name}", b[key].sum(-1)))
    for key in ("advantages", "returns"):
        if key in b.keys():
            out.update(_stats(f"critic/{key}", torch.masked_select(b[key], loss_mask)))
    if use_critic:
        if "values" not in b.keys():
            raise KeyError(
                "metrics: use_critic=True but the batch has no 'values' (critic.compute_values output)"
            )
        values = torch.masked_select(b["values"], loss_mask).float()
        out.update(_stats("critic/values", values))
        if "returns" in b.keys() and values.numel() > 1:
            returns = torch.masked_select(b["returns"], loss_mask).float()
            out["critic/vf_explained_var"] = float(1.0 - (returns - values).var() / (returns.var() + 1e-5))
    response_length = response_valid.sum(-1).float()
    out.update(_stats("response_length", response_length))
    t_max = max_response_length or response_valid.shape[-1]
    out["response_length/clip_ratio"] = float((response_length >= t_max).float().mean())
    if prompt_valid is not None and prompt_valid.shape[-1] > 0:
        prompt_length = prompt_valid.sum(-1).float()
        out.update(_stats("prompt_length", prompt_length))
        p_max = max_prompt_length or prompt_valid.shape[-1]
        out["prompt_length/clip_ratio"] = float((prompt_length >= p_max).float().mean())
    return out


def step_token_counts(batch: DataProto, shared_prompts: bool = False) -> dict[str, Any]:
    """The token counts the timing and throughput metrics divide by: response tokens, all tokens,
    `global_token_num` when the rollout reported it, and with `shared_prompts` (trainer.log_floors)
    the tokens of the shared-prompt update (None where it does not apply)."""
    prompt_valid, response_valid, _ = _masks(batch)
    n_response = int(response_valid.sum())
    n_all = n_response + (0 if prompt_valid is None else int(prompt_valid.sum()))
    update_tokens = None
    text_only = "multi_modal_inputs" not in batch.non_tensor_batch  # images: equal ids may differ
    if shared_prompts and prompt_valid is not None and text_only:
        update_tokens = n_response + distinct_prompt_tokens(batch.batch["input_ids"], prompt_valid)
    global_num = batch.meta_info.get("global_token_num")
    return {
        "n_response": n_response,
        "n_all": n_all,
        "update_tokens": update_tokens,
        "global_token_num": None if global_num is None else int(sum(global_num)),
    }


def compute_timing_metrics(
    batch: DataProto | Mapping[str, Any], timing_raw: Mapping[str, float], floors: Any = None
) -> dict[str, float]:
    """timing_s/{section} for every timed section, and timing_per_token_ms/{section} where the
    token count is known: response tokens for "gen", prompt + response tokens for ref,
    old_log_prob, values, adv, update_critic and update_actor. With `floors`
    (`trainer.log_floors`, trainer/ppo/step_floors.StepFloors) also its `perf/floor/*`.
    `batch` may be the batch or its `step_token_counts`."""
    shared = floors is not None and floors.shared_prompts
    counts = batch if isinstance(batch, Mapping) else step_token_counts(batch, shared)
    n_response, n_all = counts["n_response"], counts["n_all"]
    tokens = {"gen": n_response, **dict.fromkeys(_ALL_TOKEN_SECTIONS, n_all)}
    out = {f"timing_s/{name}": float(seconds) for name, seconds in timing_raw.items()}
    for name, seconds in timing_raw.items():
        if name in tokens and tokens[name] > 0:
            out[f"timing_per_token_ms/{name}"] = float(seconds) * 1000.0 / tokens[name]
    if floors is not None:
        update_tokens = counts["update_tokens"] if shared else None
        out.update(floors.metrics(n_all, n_response, timing_raw, update_tokens=update_tokens))
    return out


def distinct_prompt_tokens(input_ids: torch.Tensor, prompt_valid: torch.Tensor) -> int:
    """Valid prompt tokens counted once per distinct prompt: what the shared-prompt forward computes.

    Args:
        input_ids: (B, P + T) ids.
        prompt_valid: (B, P) bool, the prompt part of the attention mask.
    """
    prompts = torch.where(prompt_valid, input_ids[:, : prompt_valid.shape[1]], -1)
    distinct = torch.unique(prompts, dim=0)
    return int((distinct >= 0).sum())


def compute_throughout_metrics(
    batch: DataProto | Mapping[str, Any], timing_raw: Mapping[str, float], n_workers: int
) -> dict[str, float]:
    """perf/total_num_tokens, perf/time_per_step and perf/throughput (tokens / s / worker).

    Tokens are `meta_info["global_token_num"]` (per-sample lengths) when present, else the number
    of ones in the attention mask (prompt + response); `batch` may be its `step_token_counts`.
    (The name keeps veRL's spelling.)
    """
    if n_workers < 1:
        raise ValueError(f"compute_throughout_metrics: n_workers must be >= 1, got {n_workers}")
    if "step" not in timing_raw:
        raise KeyError(
            "compute_throughout_metrics: timing_raw has no 'step'; wrap the step in timer('step', ...)"
        )
    counts = batch if isinstance(batch, Mapping) else step_token_counts(batch)
    total = counts["global_token_num"]
    if total is None:
        total = counts["n_all"]
    seconds = float(timing_raw["step"])
    throughput = total / (seconds * n_workers) if seconds > 0 else math.nan
    return {"perf/total_num_tokens": total, "perf/time_per_step": seconds, "perf/throughput": throughput}


compute_throughput_metrics = compute_throughout_metrics


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def expected_best_of_k(values: Sequence[float], k: int) -> float:
    """E[max of k values drawn without replacement from `values`] (exact; pass@k for 0/1 values).

    With v sorted ascending, E = sum_i v_i * C(i-1, k-1) / C(n, k) (i = 1..n): v_i is the maximum
    of exactly C(i-1, k-1) of the C(n, k) subsets.
    """
    v = sorted(float(x) for x in values)
    n = len(v)
    if not 1 <= k <= n:
        raise ValueError(f"expected_best_of_k: need 1 <= k <= {n}, got k={k}")
    total = math.comb(n, k)
    return sum(v[i] * math.comb(i, k - 1) for i in range(k - 1, n)) / total


def _majority_value(values: list[float], preds: list[Any]) -> float:
    """Mean value of the samples whose `pred` is the most common (ties: the earliest pred)."""
    keys = [p if isinstance(p, (str, int, float, bool, type(None))) else repr(p) for p in preds]
    counts = Counter(keys)
    top = max(counts.values())
    winner = next(k for k in keys if counts[k] == top)
    chosen = [v for v, k in zip(values, keys) if k == winner]
    return float(np.mean(chosen))


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating))


def _group_metrics(values: list[float], preds: list[Any] | None) -> dict[str, float]:
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n > 1:
        out[f"std@{n}"] = float(np.std(values))
        ks = sorted({2**i for i in range(1, n.bit_length()) if 2**i < n} | {n})
        for k in ks:
            out[f"best@{k}"] = expected_best_of_k(values, k)
            out[f"worst@{k}"] = -expected_best_of_k([-v for v in values], k)
        if preds is not None:
            out[f"maj@{n}"] = _majority_value(values, preds)
    return out


def process_validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Any] | None,
    infos: Mapping[str, Sequence[Any]],
) -> dict[str, float]:
    """Validation metrics per data source, from N responses per prompt.

    Args:
        data_sources: (B,) data source of each response.
        uids: (B,) prompt id of each response (responses with equal uid answer the same prompt);
            None treats every response as its own prompt (N = 1).
        infos: per-response lists of length B: "reward" (required), "acc", "pred" (the extracted
            answer, used for majority voting) and any other numeric values.

    Returns:
        For every numeric info var: mean@N (mean over a prompt's N responses), std@N, best@k and
        worst@k (exact expected max/min of k of the N responses, k = 2, 4, ... and N), maj@N (the
        value of the majority-voted `pred`), each averaged over prompts. Keys are
        `val-core/{data_source}/{var}/{metric}` for var "reward"/"acc" with mean/best/maj at the
        largest N, and `val-aux/...` otherwise.
    """
    n = len(data_sources)
    if "reward" not in infos:
        raise KeyError(f"process_validation_metrics: infos needs 'reward'; it has {sorted(infos)}")
    for key, values in infos.items():
        if len(values) != n:
            raise ValueError(
                f"process_validation_metrics: infos[{key!r}] has {len(values)} values for {n} samples"
            )
    if uids is not None and len(uids) != n:
        raise ValueError(f"process_validation_metrics: {len(uids)} uids for {n} samples")
    uids = list(range(n)) if uids is None else list(uids)
    preds = list(infos["pred"]) if "pred" in infos else None
    numeric = [k for k, vals in infos.items() if k != "pred" and all(_is_number(v) for v in vals)]
    groups: dict[Any, dict[Any, list[int]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        groups.setdefault(source, {}).setdefault(uid, []).append(i)
    out: dict[str, float] = {}
    for source, prompts in groups.items():
        n_max = max(len(idx) for idx in prompts.values())
        for var in numeric:
            collected: dict[str, list[float]] = {}
            for idx in prompts.values():
                values = [float(infos[var][i]) for i in idx]
                group_preds = None if preds is None else [preds[i] for i in idx]
                for name, value in _group_metrics(values, group_preds).items():
                    collected.setdefault(name, []).append(value)
            for name, per_prompt in collected.items():
                kind, _, k = name.partition("@")
                core = var in _CORE_VARS and kind in ("mean", "best", "maj") and int(k) == n_max
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(np.mean(per_prompt))
    return out
