"""Cut the columns of a batch that are padding in every row: exact, and what keeps every stage lean.

The dataset left-pads prompts to `data.max_prompt_length` and the rollout right-pads responses to
`data.max_response_length`; computing on columns that are padding in every row costs time and
changes nothing (positions travel in `position_ids`). The trainer trims prompts before generation
and responses before the training stages.
"""

from __future__ import annotations

from hybridrl.protocol import DataProto

__all__ = ["trim_left_padding", "trim_right_padding"]


def trim_left_padding(batch: DataProto) -> DataProto:
    """Drop the prompt columns that are padding in every row (the dataset pads to max_prompt_length).

    Exact: positions travel in `position_ids`, so generation, log-probs and updates see the same
    tokens at the same positions, only without the all-padding columns (B, P) -> (B, P').
    """
    mask = batch.batch["attention_mask"]
    used = mask.bool().any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    if first > 0:
        for key in ("input_ids", "attention_mask", "position_ids"):
            batch.batch[key] = batch.batch[key][:, first:].contiguous()
    return batch


def trim_right_padding(batch: DataProto) -> DataProto:
    """Drop the trailing response columns that are padding in every row (rollouts pad to the limit).

    Exact, like `trim_left_padding`: the old-log-prob pass, the critic and the update compute on
    (B, P + T') instead of (B, P + T), T' the longest response of the batch. Every tensor of width
    T (response-aligned: responses, response_mask, scores, rollout log-probs, ...) or P + T
    (input_ids, attention_mask, position_ids) is cut; `prompts` is left alone. The untrimmed
    width, the generation budget, is kept in meta_info["max_response_length"] for the losses that
    divide by it (seq-mean-token-sum-norm).
    """
    b = batch.batch
    t, s = b["responses"].shape[-1], b["attention_mask"].shape[-1]
    batch.meta_info.setdefault("max_response_length", t)
    used = b["attention_mask"][:, s - t :].bool().any(dim=0).nonzero()
    keep = max(int(used[-1]) + 1 if len(used) else 0, 1)
    if keep == t:
        return batch
    for key in list(b.keys()):
        value = b[key]
        if key == "prompts" or value.dim() < 2:
            continue
        if value.shape[1] == s:
            b[key] = value[:, : s - t + keep].contiguous()
        elif value.shape[1] == t:
            b[key] = value[:, :keep].contiguous()
    return batch
