"""Batch-level steps of the PPO fit loop that need no trainer state: rollout correction, PF-PPO
resampling, reward extras and GDPO's reward components, the DAPO group metric, and decoded-sample dumps."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from hybridrl import algos
from hybridrl.protocol import DataProto


def write_jsonl(out_dir: str | None, step: int, rows: list[dict]) -> None:
    """`out_dir/<step>.jsonl`, one decoded sample per line (rollout_data_dir, validation_data_dir)."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{step}.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def rollout_correction_active(rc) -> bool:
    """Whether `algorithm.rollout_correction` asks for IS weights or rejection sampling."""
    return rc.rollout_is is not None or rc.rollout_rs is not None


def apply_rollout_correction(rc, batch: DataProto, metrics: dict) -> DataProto:
    """`algorithm.rollout_correction`: IS weights x rejection mask into `rollout_is_weights`.

    With veRL's estimator options (rollout_rs=token_k1,seq_max_k2, ...) the rejected tokens leave
    `response_mask` instead (as veRL does), and the IS weights are computed before that.
    """
    if not rollout_correction_active(rc):
        return batch
    if algos.is_kl_rs(rc.rollout_rs):
        return _reject_by_kl_estimators(rc, batch, metrics)
    lower, upper = algos.parse_rs_threshold(rc.rollout_rs_threshold, rc.rollout_is_threshold)
    weights, rc_metrics = algos.compute_rollout_correction(
        batch.batch["old_log_probs"],
        batch.batch["rollout_log_probs"],
        batch.batch["response_mask"],
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs,
        rollout_rs_lower=lower,
        rollout_rs_upper=upper,
    )
    batch.batch["rollout_is_weights"] = weights
    metrics.update({f"rollout_corr/{k}": float(v) for k, v in rc_metrics.items()})
    return batch


def _reject_by_kl_estimators(rc, batch: DataProto, metrics: dict) -> DataProto:
    b = batch.batch
    if rc.rollout_is is not None:
        weights, is_metrics = algos.compute_rollout_correction(
            b["old_log_probs"], b["rollout_log_probs"], b["response_mask"],
            rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=None,
            rollout_rs_lower=0.0, rollout_rs_upper=float("inf"),
        )  # fmt: skip
        b["rollout_is_weights"] = weights
        metrics.update({f"rollout_corr/{k}": float(v) for k, v in is_metrics.items()})
    log_ratio = (b["old_log_probs"] - b["rollout_log_probs"]) * b["response_mask"]
    keep, rs_metrics = algos.compute_rollout_rejection_mask(
        log_ratio, b["response_mask"], rc.rollout_rs, rc.rollout_rs_threshold
    )
    b["response_mask"] = (b["response_mask"] * keep).to(b["response_mask"].dtype)
    metrics.update({f"rollout_corr/{k}": float(v) for k, v in rs_metrics.items()})
    return batch


def pf_ppo_resample(pf, batch: DataProto, metrics: dict) -> DataProto:
    """`algorithm.use_pf_ppo`: the batch redrawn (same size, with replacement) by reward weights."""
    idx = algos.pf_ppo_resample_indices(
        batch.batch["token_level_scores"], reweight_method=pf.reweight_method, weight_pow=pf.weight_pow
    )
    metrics["pf_ppo/unique_frac"] = float(idx.unique().numel() / max(1, len(batch)))
    return batch.select_idxs(idx)


def attach_reward_extra(batch: DataProto, extra: dict[str, list]) -> None:
    """Store the reward function's per-row extras (lists of len(batch)) as object columns of `batch`."""
    for k, v in extra.items():
        if len(v) == len(batch):
            batch.non_tensor_batch[k] = np.array(v, dtype=object)


def reward_components(batch: DataProto, keys: list[str] | None, metrics: dict) -> torch.Tensor | None:
    """(K, B) float32 scores of the reward components `keys` (algorithm.gdpo_reward_keys), read from
    the reward function's per-row extras; None without keys. Logs gdpo/<key>/{mean,std,max,min}."""
    if not keys:
        return None
    rows = []
    for key in keys:
        if key not in batch.non_tensor_batch:
            raise KeyError(
                f"algorithm.gdpo_reward_keys names {key!r}, but the reward function returned no such per-row "
                f"value; it returned {sorted(batch.non_tensor_batch.keys())}. Return a dict from compute_score "
                f"with a {key!r} entry (and 'score'), or fix algorithm.gdpo_reward_keys"
            )
        try:
            values = np.asarray(batch.non_tensor_batch[key], dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(
                f"reward component {key!r} (algorithm.gdpo_reward_keys) must be a number per row"
            ) from None
        metrics.update(
            {f"gdpo/{key}/{s}": float(getattr(np, s)(values)) for s in ("mean", "std", "max", "min")}
        )
        rows.append(torch.from_numpy(values))
    return torch.stack(rows)


def group_metric(batch: DataProto, name: str) -> np.ndarray:
    """Per-row values of `algorithm.filter_groups.metric` (DAPO dynamic sampling)."""
    if name in ("seq_reward", "score"):
        return batch.batch["token_level_scores"].sum(-1).numpy()
    if name in batch.non_tensor_batch:
        return np.array(batch.non_tensor_batch[name], dtype=np.float64)
    raise KeyError(
        f"algorithm.filter_groups.metric={name!r} is not produced by the reward function; use 'score' or one "
        f"of {sorted(batch.non_tensor_batch.keys())}"
    )


def decode_samples(tokenizer, batch: DataProto, scores: list[float]) -> list[dict]:
    """Prompt, response, ground truth and score of every row, decoded (rollout / validation dumps)."""
    rows = []
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    mask = batch.batch["response_mask"].bool()
    pad = tokenizer.pad_token_id
    for i in range(len(batch)):
        p = prompts[i][prompts[i] != pad]
        r = responses[i][mask[i]]
        gt = batch.non_tensor_batch.get("reward_model", [None] * len(batch))[i]
        rows.append(
            {
                "prompt": tokenizer.decode(p, skip_special_tokens=True),
                "response": tokenizer.decode(r, skip_special_tokens=True),
                "ground_truth": gt.get("ground_truth") if isinstance(gt, dict) else None,
                "score": scores[i],
            }
        )
    return rows
