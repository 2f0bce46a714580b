"""The PPO step's batch functions: what the fit loop computes from a whole batch or from rows.

Each function takes a `DataProto` and returns a `DataProto` of new columns; the per-sample values
and metrics the driver needs ride in its `meta_info["out"]`. The same function runs on the driver
when the step's batch is a `DataProto` (one-slot runs, and after a stage pulled the batch there),
on the first worker of the actor group when it needs the whole batch (`StepData.whole`), or on
every worker over its own rows (`StepData.per_rank`), so the values are the same wherever it ran.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridrl import algos
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.metrics import compute_data_metrics, step_token_counts
from hybridrl.utils import deadlines

_REWARD: dict[str, Any] = {}  # this process's training reward manager (install_reward_fn)


def columns(
    data: DataProto, tensors: dict[str, torch.Tensor], out: dict | None = None, **non_tensor
) -> DataProto:
    """New columns of `data`'s rows; `out` (per-sample values, metrics) goes to the driver."""
    return DataProto(
        batch=TensorDict(tensors, batch_size=[len(data)]),
        non_tensor_batch=dict(non_tensor),
        meta_info={"out": out or {}},
    )


def install_reward_fn(reward_fn: Any, trainer_config: Any) -> None:
    """Worker side: keep the training reward manager (and `trainer.reward_timeout_s`) in this process."""
    deadlines.configure(trainer_config)
    _REWARD["train"] = reward_fn


def score(data: DataProto, reward_fn: Any = None) -> DataProto:
    """token_level_scores (B, T) from the reward manager, its per-row extras as object columns, and
    for the driver: the (B,) sequence scores, the (B,) sequence lengths and the width the batch's
    right padding can be cut to."""
    fn = reward_fn if reward_fn is not None else _REWARD["train"]
    res = fn(data, return_dict=True)
    scores = res["reward_tensor"]
    extra = {
        k: np.array(v, dtype=object)
        for k, v in res.get("reward_extra_info", {}).items()
        if len(v) == len(data)
    }
    mask = data.batch["attention_mask"]
    t = data.batch["responses"].shape[-1]
    used = mask[:, mask.shape[-1] - t :].bool().any(dim=0).nonzero()
    out = {
        "seq_scores": scores.sum(-1),
        "seqlens": mask.sum(-1).tolist(),
        "keep": max(int(used[-1]) + 1 if len(used) else 0, 1),
        "widths": (mask.shape[-1], t),
    }
    return columns(data, {"token_level_scores": scores}, out, **extra)


def trim_columns(data: DataProto, keep: int, prompt_and_response: int, response: int) -> DataProto:
    """The columns of width T (or P + T) cut to the first `keep` response columns (trim_right_padding)."""
    s, t = prompt_and_response, response
    cut = {}
    for key, value in data.batch.items():
        if key == "prompts" or value.dim() < 2:
            continue
        if value.shape[1] == s:
            cut[key] = value[:, : s - t + keep].contiguous()
        elif value.shape[1] == t:
            cut[key] = value[:, :keep].contiguous()
    return columns(data, cut)


def entropy_mean(data: DataProto) -> DataProto:
    """actor/entropy: the mean entropy over the batch's response tokens."""
    value = float(algos.masked_mean(data.batch["entropys"], data.batch["response_mask"]))
    return columns(data, {}, {"actor/entropy": value})


def kl_in_reward(data: DataProto, kl_penalty: str, beta: float) -> DataProto:
    """r_t = score_t - beta * KL_t(pi_old || pi_ref); the batch's mean KL goes to the KL controller."""
    b = data.batch
    mask = b["response_mask"]
    kld = algos.kl_penalty(b["old_log_probs"], b["ref_log_prob"], kl_penalty) * mask
    rewards = b["token_level_scores"] - beta * kld
    current_kl = float(algos.masked_mean(kld, mask, axis=-1).mean())
    return columns(data, {"token_level_rewards": rewards}, {"current_kl": current_kl})


def advantages(data: DataProto, estimator: str, options: dict, reward_components: Any = None) -> DataProto:
    """advantages, returns (B, T) from the registered estimator over the whole batch."""
    b = data.batch

    def opt(key: str) -> Any:
        return b[key] if key in b.keys() else None

    rewards = b["token_level_rewards"] if "token_level_rewards" in b.keys() else b["token_level_scores"]
    adv, ret = algos.get_adv_estimator_fn(estimator)(
        rewards,
        b["response_mask"],
        index=data.non_tensor_batch["uid"],
        values=opt("values"),
        reward_baselines=opt("reward_baselines"),
        old_log_probs=opt("old_log_probs"),
        sum_pi_squared=opt("sum_pi_squared"),
        rollout_is_weights=opt("rollout_is_weights"),
        reward_components=reward_components,
        **options,
    )
    return columns(data, {"advantages": adv, "returns": ret})


def outcome_scores(data: DataProto) -> DataProto:
    """GRPO, rows: s_i, the sum of each response's rewards over its tokens, as a (B,) column."""
    b = data.batch
    rewards = b["token_level_rewards"] if "token_level_rewards" in b.keys() else b["token_level_scores"]
    return columns(data, {}, grpo_score=algos.outcome_scores(rewards, b["response_mask"]).numpy())


def broadcast_advantages(data: DataProto) -> DataProto:
    """GRPO, rows: the driver's per-response A_i (column grpo_adv) onto the response tokens."""
    per_response = torch.from_numpy(np.asarray(data.non_tensor_batch["grpo_adv"], dtype=np.float32))
    adv = algos.broadcast_to_tokens(per_response, data.batch["response_mask"])
    return columns(data, {"advantages": adv, "returns": adv})


def summary(data: DataProto, use_critic: bool, max_prompt_length: int, max_response_length: int,
            shared_prompts: bool) -> DataProto:  # fmt: skip
    """The step's data metrics (compute_data_metrics) and token counts (compute_timing_metrics)."""
    if "token_level_rewards" not in data.batch.keys() and "token_level_scores" in data.batch.keys():
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # no KL in the reward
    metrics = compute_data_metrics(
        data,
        use_critic=use_critic,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
    )
    return columns(data, {}, {"metrics": metrics, "counts": step_token_counts(data, shared_prompts)})
