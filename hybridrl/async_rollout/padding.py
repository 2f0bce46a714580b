"""Concatenating groups whose prompts were padded to different widths.

The data loader left-pads each batch's prompts to that batch's longest prompt, so two groups from
different batches can have prompt tensors of different widths: (n, P1) and (n, P2). The manager
puts such groups into one generate call (partial rollout resumes a group together with fresh ones;
a dead worker's groups are requeued) and into one training batch (groups of several chunks), so it
concatenates them with :func:`concat_left_padded`, which left-pads the prompt side to the widest.
The response side is always ``response_length`` wide and is not touched.

Left padding keeps every row's tokens where they were relative to its response: attention masks
are 0 on the new columns, position ids 0 (the data loader's convention:
``clip(cumsum(mask) - 1, 0)``) and input ids the pad token, so a model that masks padding sees the
same sequence.
"""

from __future__ import annotations

import torch

from hybridrl.protocol import DataProto

__all__ = ["LEFT_PADDED_KEYS", "concat_left_padded"]

# Batch keys whose last dimension is [left-padded prompt | response]: padded on the left.
LEFT_PADDED_KEYS = ("prompts", "input_ids", "attention_mask", "position_ids")


def _pad_value(items: list[DataProto]) -> int:
    """The pad token id seen at a masked position of some row (0 when there is none: never attended)."""
    for d in items:
        if "input_ids" not in d.batch.keys() or "attention_mask" not in d.batch.keys():
            continue
        ids, mask = d.batch["input_ids"], d.batch["attention_mask"]
        masked = (mask == 0).nonzero()
        if len(masked):
            return int(ids[tuple(masked[0])])
    return 0


def _left_pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """(..., W) -> (..., width): ``width - W`` columns of ``value`` prepended."""
    extra = width - t.shape[-1]
    if extra == 0:
        return t
    pad = torch.full((*t.shape[:-1], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=-1)


def concat_left_padded(items: list[DataProto]) -> DataProto:
    """``DataProto.concat`` after left-padding LEFT_PADDED_KEYS to their widest width.

    Args:
        items: DataProtos with the same keys; ``input_ids`` / ``attention_mask`` (n_i, W_i) and
            optionally ``prompts`` (n_i, P_i), ``position_ids`` (n_i, W_i) or (n_i, 3, W_i).

    Returns:
        The rows of all items in order; left-padded keys are (sum n_i, max W_i).
    """
    keys = [
        k for k in LEFT_PADDED_KEYS if items and items[0].batch is not None and k in items[0].batch.keys()
    ]
    widths = {k: max(d.batch[k].shape[-1] for d in items) for k in keys}
    if all(d.batch[k].shape[-1] == w for k, w in widths.items() for d in items):
        return DataProto.concat(items)
    pad_id = _pad_value(items)
    fill = {"prompts": pad_id, "input_ids": pad_id, "attention_mask": 0, "position_ids": 0}
    padded = []
    for d in items:
        d = d.select()  # a shallow copy: the caller's groups keep their own tensors
        for k, w in widths.items():
            d.batch[k] = _left_pad(d.batch[k], w, fill[k])
        padded.append(d)
    return DataProto.concat(padded)
