"""Driver side of `algorithm.rollout_correction.*` (veRL's spelling of rollout importance sampling).

The weights come from `hybridrl.algos.compute_rollout_correction` (truncated IS x rejection mask)
and ride in the batch as `rollout_is_weights`, which the policy loss multiplies in.
"""

from __future__ import annotations

from hybridrl import algos
from hybridrl.protocol import DataProto


def rollout_correction_active(rc) -> bool:
    return rc.rollout_is is not None or rc.rollout_rs is not None


def apply_rollout_correction(rc, batch: DataProto, metrics: dict) -> DataProto:
    """`algorithm.rollout_correction`: IS weights x rejection mask into `rollout_is_weights`."""
    if not rollout_correction_active(rc):
        return batch
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
