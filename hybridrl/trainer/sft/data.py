"""SFT data: which files, the tokenised datasets, and this rank's rows as micro-batches.

Every dataset item is one sample padded on the right to `data.max_length`: input_ids,
attention_mask, position_ids and loss_mask, each (L,). A micro-batch is a stack of items cut to
its longest row (`micro_batches`), plus `responses = input_ids[:, 1:]`: the tokens the model predicts,
which is what the training engines compute log-probs of (algos/sft.py).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algos.sft import next_token_targets
from hybridrl.data.builtin_task import ensure_builtin_data
from hybridrl.data.sft_dataset import MultiTurnSFTDataset, SFTDataConfig, SFTDataset
from hybridrl.trainer.sft.config import SFTConfig, is_builtin_model
from hybridrl.utils.config_loader import ConfigError

__all__ = [
    "CachedItems",
    "IndexDataset",
    "build_dataset",
    "micro_batches",
    "resolve_data_files",
    "stack_rows",
]


def resolve_data_files(config: SFTConfig) -> tuple[Any, Any]:
    """(train_files, val_files): the configured files, or the built-in task's SFT files.

    The built-in files are used only when `data.train_files` is null (then `data.val_files`
    null means the built-in val file as well).
    """
    d = config.data
    if d.train_files is not None:
        return d.train_files, d.val_files
    if not is_builtin_model(config.model.partial_pretrain):
        raise ConfigError("data.train_files is not set; point it at parquet/jsonl file(s)")

    paths = ensure_builtin_data(d.builtin_data_dir)
    return paths["sft_train"], (d.val_files if d.val_files is not None else paths["sft_val"])


class IndexDataset:
    """Yields row indices, so each rank tokenises only the rows it trains on."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class CachedItems:
    """A view of an SFT dataset that tokenises each row once.

    With `check_all`, every row is tokenised at construction, so an over-long sample
    (data.truncation=error) fails at start-up with the dataset's message naming file and row.
    """

    MAX_CACHED_TOKENS = 1 << 24

    def __init__(self, dataset, check_all: bool) -> None:
        self.dataset = dataset
        self.cache_enabled = len(dataset) * dataset.config.max_length <= self.MAX_CACHED_TOKENS
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        if check_all:
            for i in range(len(dataset)):
                self[i]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self._cache.get(i)
        if item is None:
            item = self.dataset[i]
            if self.cache_enabled:
                self._cache[i] = item
        return item


def build_dataset(config: SFTConfig, files: Any, split: str, tokenizer: Any) -> CachedItems:
    """The tokenised single- or multi-turn dataset of `files` (`split`: "train" or "val")."""
    d = config.data
    data_config = SFTDataConfig(
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        prompt_dict_keys=tuple(d.prompt_dict_keys) if d.prompt_dict_keys else None,
        response_dict_keys=tuple(d.response_dict_keys) if d.response_dict_keys else None,
        messages_key=d.multiturn.messages_key,
        max_length=d.max_length,
        truncation=d.truncation,
        max_samples=d.train_max_samples if split == "train" else d.val_max_samples,
        use_chat_template=d.use_chat_template,
        apply_chat_template_kwargs=dict(d.apply_chat_template_kwargs),
    )
    cls = MultiTurnSFTDataset if d.multiturn.enable else SFTDataset
    dataset = cls(files, tokenizer, data_config, files_key=f"data.{split}_files")
    return CachedItems(dataset, check_all=d.truncation == "error")


def stack_rows(rows: list[int | None], dataset) -> dict[str, torch.Tensor]:
    """The items of `rows` stacked, each (len(rows), L); None is a padding row (row 0 with an
    all-zero loss mask, so that every rank runs the same number of forwards)."""
    items = []
    for i in rows:
        item = dataset[0 if i is None else i]
        if i is None:
            item = {**item, "loss_mask": torch.zeros_like(item["loss_mask"])}
        items.append(item)
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _width(batch: Any) -> int:
    return max(1, int(batch["attention_mask"].sum(-1).max()))


def micro_batches(
    batch: Any, size: int, device: Any, same_width: bool = False
) -> list[dict[str, torch.Tensor]]:
    """`batch` (B, L) tensors in micro-batches of `size` rows, each cut to its longest row, with
    `responses` (the predicted tokens), on `device`.

    Args:
        batch: a dict or TensorDict of (B, L) tensors (input_ids, attention_mask, position_ids, loss_mask).
        same_width: cut every micro-batch to the longest row of the whole batch (a pipelined model
            passes activations of one shape between its stages).
    """
    keys = list(batch.keys())
    n = batch["input_ids"].shape[0]
    width = _width(batch) if same_width else None
    out = []
    for start in range(0, n, size):
        part = {k: batch[k][start : start + size] for k in keys}
        w = width or _width(part)
        mb = {k: v[:, :w].to(device) for k, v in part.items()}
        mb["responses"] = next_token_targets(mb["input_ids"])
        out.append(mb)
    return out
