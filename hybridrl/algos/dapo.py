"""DAPO reward shaping and dynamic sampling.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv 2503.14476).

Shapes: B batch.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_overlong_penalty(
    scores: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """Soft overlong punishment, DAPO §3.4, eq. 13, scaled by `penalty_factor`.

    With L_max = max_response_length and L_cache = overlong_buffer_len, a response of length |y|
    gets
        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
        -1                                 if |y| > L_max
    times penalty_factor, added to its score.

    Args:
        scores: (B,) task scores.
        response_lengths: (B,) number of response tokens.
        max_response_length: L_max.
        overlong_buffer_len: L_cache, in (0, L_max].
        penalty_factor: weight of the punishment (1.0 in the paper).

    Returns:
        (B,) shaped scores.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    expected_length = max_response_length - overlong_buffer_len
    exceed = response_lengths.to(scores.dtype) - expected_length
    penalty = (-exceed / overlong_buffer_len).clamp(min=-1.0, max=0.0)
    return scores + penalty_factor * penalty


def filter_groups_by_metric(index: np.ndarray, metric: np.ndarray | torch.Tensor) -> np.ndarray:
    """Dynamic sampling, DAPO §3.2 (the constraint 0 < |{correct}| < G): keep groups whose metric
    is not constant.

    A group whose responses all score the same has zero advantage under GRPO and only dilutes
    the batch. Groups of one response are KEPT: they cannot be "all equal" in a meaningful
    sense, estimators give them a non-zero advantage (baseline 0), and dropping them would
    empty every batch when rollout.n = 1.

    Args:
        index: (B,) prompt uid of each response.
        metric: (B,) the per-response metric (e.g. accuracy or score).

    Returns:
        (B,) bool numpy mask of responses to keep.
    """
    metric = metric.detach().cpu().numpy() if isinstance(metric, torch.Tensor) else np.asarray(metric)
    _, group_ids, sizes = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    group_ids = group_ids.reshape(-1)
    group_max = np.full(len(sizes), -np.inf)
    group_min = np.full(len(sizes), np.inf)
    np.maximum.at(group_max, group_ids, metric)
    np.minimum.at(group_min, group_ids, metric)
    keep_group = (group_max > group_min) | (sizes == 1)
    return keep_group[group_ids]
