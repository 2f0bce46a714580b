"""The batch as the score functions see it: one decoded `RewardSample` per row.

`decode_samples(tokenizer, data)` reads a DataProto (batch keys `responses` (B, T) and
`attention_mask` (B, P+T) or `response_mask` (B, T), optionally `prompts` (B, P); non-tensor keys
the `reward_fn_key` column, `reward_model` (`{"ground_truth": ...}` per row), optionally
`extra_info`) and returns each row's prompt and response text (valid tokens only, special tokens
skipped), its ground truth and the position that receives its score.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto

__all__ = ["RewardSample", "decode_samples", "describe_sample"]

_RESPONSE_PREVIEW = 200


@dataclass
class RewardSample:
    """One decoded row of the batch, as the score function sees it."""

    index: int
    data_source: Any
    prompt: str
    response: str
    ground_truth: Any
    extra_info: Any
    response_length: int  # valid response tokens
    last_index: int  # position in [0, T) that receives the score (0 for an empty response)


def _valid_masks(data: DataProto) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(response validity (B, T), prompt validity (B, P) or None)."""
    batch = data.batch
    if batch is None or "responses" not in batch.keys():
        raise KeyError("reward manager: data.batch needs 'responses' (B, T); got " + repr(data))
    t = batch["responses"].shape[-1]
    prompt_valid = None
    if "attention_mask" in batch.keys():
        attn = batch["attention_mask"]
        if "prompts" in batch.keys() and attn.shape[-1] != batch["prompts"].shape[-1] + t:
            raise ValueError(
                f"reward manager: attention_mask has {attn.shape[-1]} columns but prompts + responses "
                f"have {batch['prompts'].shape[-1]} + {t}; attention_mask must cover both (B, P+T)"
            )
        resp_valid = attn[:, -t:]
        prompt_valid = attn[:, :-t]
    elif "response_mask" in batch.keys():
        resp_valid = batch["response_mask"]
    else:
        raise KeyError("reward manager: data.batch needs 'attention_mask' (B, P+T) or 'response_mask' (B, T)")
    return resp_valid.bool().cpu(), None if prompt_valid is None else prompt_valid.bool().cpu()


def _column(data: DataProto, key: str, config_key: str) -> np.ndarray:
    if key not in data.non_tensor_batch:
        raise KeyError(
            f"reward manager: non_tensor_batch has no {key!r} ({config_key}); it has "
            f"{sorted(data.non_tensor_batch)}. The dataset must provide it for every row."
        )
    return data.non_tensor_batch[key]


def _valid_ids(ids: torch.Tensor, valid: torch.Tensor) -> list[list[int]]:
    """The token ids of each row (B, L) where `valid` (B, L) is true, as Python lists (one
    conversion of the whole batch instead of one masked index per row)."""
    return [
        [t for t, v in zip(row, keep) if v] for row, keep in zip(ids.cpu().tolist(), valid.cpu().tolist())
    ]


def _extra_info(data: DataProto, extra: Any, env_reward: Any, i: int) -> Any:
    """Row i's extra_info; for a row that played an environment, a copy with `env_reward` and
    `env_turn_rewards` (its step rewards) added."""
    info = None if extra is None else extra[i]
    if env_reward is None or env_reward[i] is None:
        return info
    turns = data.non_tensor_batch.get("turn_scores")
    return {
        **(dict(info) if isinstance(info, Mapping) else {}),
        "env_reward": float(env_reward[i]),
        "env_turn_rewards": [] if turns is None else list(turns[i]),
    }


def decode_samples(tokenizer: Any, data: DataProto, reward_fn_key: str = "data_source") -> list[RewardSample]:
    """Decode prompts and responses (valid tokens only, special tokens skipped) into RewardSamples.

    Response tokens are valid where `attention_mask[:, P:]` is 1 (falling back to `response_mask`).
    The score goes on the last valid token; an empty response puts it on position 0.
    """
    resp_valid, prompt_valid = _valid_masks(data)
    n, t = resp_valid.shape
    resp_ids = _valid_ids(data.batch["responses"], resp_valid)
    response_strs = tokenizer.batch_decode(resp_ids, skip_special_tokens=True) if n else []
    if prompt_valid is not None and "prompts" in data.batch.keys():
        # a prompt repeats rollout.n times in a row: each distinct one is decoded once
        prompt_ids = [tuple(ids) for ids in _valid_ids(data.batch["prompts"], prompt_valid)]
        distinct = list(dict.fromkeys(prompt_ids))
        text = dict(
            zip(distinct, tokenizer.batch_decode([list(d) for d in distinct], skip_special_tokens=True))
        )
        prompt_strs = [text[ids] for ids in prompt_ids]
    else:
        prompt_strs = [""] * n
    lengths = resp_valid.sum(-1)
    positions = torch.arange(t).expand(n, t)
    last = torch.where(resp_valid, positions, torch.full_like(positions, -1)).max(-1).values.clamp(min=0)
    sources = _column(data, reward_fn_key, "data.reward_fn_key")
    reward_model = _column(data, "reward_model", "reward_model.ground_truth from preprocessing")
    extra = data.non_tensor_batch.get("extra_info")
    env_reward = data.non_tensor_batch.get("env_reward")  # rows that played an environment (hybridrl.env)
    samples = []
    for i in range(n):
        rm = reward_model[i]
        if not isinstance(rm, Mapping) or "ground_truth" not in rm:
            raise KeyError(
                f"reward manager: row {i} reward_model={rm!r} has no 'ground_truth'; each row needs "
                "reward_model={'ground_truth': ...} (set by the data preprocessing)"
            )
        samples.append(
            RewardSample(
                index=i,
                data_source=sources[i],
                prompt=prompt_strs[i],
                response=response_strs[i],
                ground_truth=rm["ground_truth"],
                extra_info=_extra_info(data, extra, env_reward, i),
                response_length=int(lengths[i]),
                last_index=int(last[i]),
            )
        )
    return samples


def describe_sample(sample: RewardSample) -> str:
    """Data source, index, response start and ground truth: what every scoring error names."""
    return (
        f"data_source={sample.data_source!r}, sample index {sample.index}, "
        f"response[:{_RESPONSE_PREVIEW}]={sample.response[:_RESPONSE_PREVIEW]!r}, "
        f"ground_truth={sample.ground_truth!r}"
    )
