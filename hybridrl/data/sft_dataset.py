"""Supervised fine-tuning datasets: single-turn prompt/response and multi-turn chat.

Items are right-padded to `data.max_length`:
`input_ids`, `attention_mask`, `position_ids`, `loss_mask`, each an (L,) long tensor.
`loss_mask[t] == 1` when token t is a token the model must learn to produce (response /
assistant tokens, including the end-of-turn or EOS token). The loss for token t is predicted
from position t-1, so a trainer uses `loss_mask[:, 1:]` against `logits[:, :-1]`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridrl.data.rl_dataset import DataColumnError, as_messages, compute_position_ids, read_rows

__all__ = ["MultiTurnSFTDataset", "SFTDataConfig", "SFTDataset", "assistant_token_mask"]

SFT_TRUNCATION_MODES = ("error", "left", "right")


@dataclass(frozen=True)
class SFTDataConfig:
    """The `data.*` keys of supervised fine-tuning (veRL SFT names).

    Attributes:
        prompt_key / response_key: single-turn columns.
        prompt_dict_keys / response_dict_keys: when the column holds a dict, the path of keys to
            the text (e.g. prompt_key="extra_info", prompt_dict_keys=("question",)).
        messages_key: multi-turn column with a list of {"role", "content"} messages.
        max_length: L, every item is right-padded to it.
        truncation: "error", "left" (keep the tail) or "right" (keep the head).
        max_samples: if > 0 keep only the first `max_samples` rows.
        use_chat_template: single-turn: render the prompt as a user message with the tokenizer's
            chat template (False: use a string prompt as raw text).
        apply_chat_template_kwargs: extra keyword arguments for `apply_chat_template`.
    """

    prompt_key: str = "prompt"
    response_key: str = "response"
    prompt_dict_keys: tuple[str, ...] | None = None
    response_dict_keys: tuple[str, ...] | None = None
    messages_key: str = "messages"
    max_length: int = 1024
    truncation: str = "error"
    max_samples: int = -1
    use_chat_template: bool = True
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_verl(cls, data_cfg: Mapping[str, Any], split: str = "train") -> SFTDataConfig:
        """Build from a plain veRL SFT `data` dict (`multiturn.messages_key`, `{split}_max_samples`, ...).

        Keys this class does not use (train_batch_size, micro_batch_size_per_gpu, ...) are ignored.
        """
        names = {f.name for f in fields(cls)} - {"max_samples"}
        kwargs = {k: data_cfg[k] for k in names if k in data_cfg and data_cfg[k] is not None}
        multiturn = data_cfg.get("multiturn") or {}
        if multiturn.get("messages_key"):
            kwargs["messages_key"] = multiturn["messages_key"]
        for key in (f"{split}_max_samples", "max_samples"):
            if data_cfg.get(key) is not None:
                kwargs["max_samples"] = int(data_cfg[key])
                break
        for key in ("prompt_dict_keys", "response_dict_keys"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        if "apply_chat_template_kwargs" in kwargs:
            kwargs["apply_chat_template_kwargs"] = dict(kwargs["apply_chat_template_kwargs"])
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={self.truncation!r} is not one of {SFT_TRUNCATION_MODES} for SFT; "
                "set data.truncation=error|left|right."
            )
        if not isinstance(self.max_length, int) or self.max_length < 1:
            raise ValueError(f"data.max_length must be a positive int, got {self.max_length!r}.")


def _dig(value: Any, keys: Sequence[str] | None, where: str, key_name: str) -> Any:
    for k in keys or ():
        if not isinstance(value, Mapping) or k not in value:
            raise DataColumnError(
                f"{where}: cannot read key {k!r} of {value!r:.120} (from {key_name}); check the dict keys"
            )
        value = value[k]
    return value


def _pack(ids: list[int], mask: list[int], pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Right-pad ids/mask (already <= max_length) into the four (L,) item tensors."""
    pad = max_length - len(ids)
    attention_mask = torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long)
    return {
        "input_ids": torch.tensor(list(ids) + [pad_id] * pad, dtype=torch.long),
        "attention_mask": attention_mask,
        "position_ids": compute_position_ids(attention_mask),
        "loss_mask": torch.tensor(list(mask) + [0] * pad, dtype=torch.long),
    }


class _SFTBase(Dataset):
    """Shared loading, truncation and padding; subclasses build (ids, loss_mask) per row."""

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: SFTDataConfig,
        files_key: str = "data.train_files",
    ) -> None:
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "the tokenizer has no pad token; set one first (e.g. tokenizer.pad_token = tokenizer.eos_token)."
            )
        self.tokenizer = tokenizer
        self.config = config
        self.files_key = files_key
        self._rows, self._sources = read_rows(data_files, files_key, self._required_columns())
        if config.max_samples > 0:
            self._rows = self._rows[: config.max_samples]
            self._sources = self._sources[: config.max_samples]

    def _required_columns(self) -> list[str]:
        raise NotImplementedError

    def _where(self, row: int) -> str:
        path, row_in_file = self._sources[row]
        return f"{self.files_key} file {path!r} row {row_in_file}"

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _ids_and_mask(self, row: int) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        ids, mask = self._ids_and_mask(item)
        if len(ids) > cfg.max_length:
            if cfg.truncation == "error":
                raise ValueError(
                    f"{self._where(item)}: sample is {len(ids)} tokens, longer than data.max_length="
                    f"{cfg.max_length} (columns {self._required_columns()}). Set data.truncation=left|right "
                    "or raise data.max_length."
                )
            cut = (
                slice(len(ids) - cfg.max_length, None)
                if cfg.truncation == "left"
                else slice(0, cfg.max_length)
            )
            ids, mask = ids[cut], mask[cut]
        return _pack(ids, mask, self.tokenizer.pad_token_id, cfg.max_length)


class SFTDataset(_SFTBase):
    """Single-turn SFT: prompt tokens (loss 0) followed by response tokens + EOS (loss 1).

    The prompt is a string or a chat message list. With `use_chat_template` a string becomes one
    user message; message lists are rendered with the generation prompt, like RLHFDataset does,
    so SFT and RL see the same prompt text. The response is a string, tokenised without special
    tokens and followed by `tokenizer.eos_token_id`.

    Args:
        data_files: parquet/jsonl path(s) with `prompt_key` and `response_key` columns.
        tokenizer: Hugging Face tokenizer with pad and eos tokens.
        config: SFTDataConfig.
        files_key: config key the files came from, quoted in errors.
    """

    def __init__(
        self, data_files, tokenizer, config: SFTDataConfig, files_key: str = "data.train_files"
    ) -> None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("SFTDataset appends EOS to every response, but the tokenizer has no eos token.")
        super().__init__(data_files, tokenizer, config, files_key)

    def _required_columns(self) -> list[str]:
        return list(dict.fromkeys([self.config.prompt_key, self.config.response_key]))

    def _prompt_text(self, row: int) -> str:
        cfg, where = self.config, self._where(row)
        prompt = _dig(self._rows[row][cfg.prompt_key], cfg.prompt_dict_keys, where, "data.prompt_dict_keys")
        messages = as_messages(prompt, where)
        if not cfg.use_chat_template:
            if messages is not None:
                raise ValueError(
                    f"{where}: prompt is a chat message list but data.use_chat_template=False; "
                    "set data.use_chat_template=True or store string prompts."
                )
            return prompt
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{where}: the tokenizer has no chat_template; set data.use_chat_template=False to use "
                "string prompts as raw text, or use a tokenizer with a chat template."
            )
        messages = messages if messages is not None else [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(cfg.apply_chat_template_kwargs)
        )

    def _ids_and_mask(self, row: int) -> tuple[list[int], list[int]]:
        cfg, where = self.config, self._where(row)
        response = _dig(
            self._rows[row][cfg.response_key], cfg.response_dict_keys, where, "data.response_dict_keys"
        )
        if not isinstance(response, str):
            raise ValueError(
                f"{where}: column {cfg.response_key!r} must hold a string response, got {type(response).__name__}"
            )
        prompt_ids = self._encode(self._prompt_text(row))
        response_ids = self._encode(response) + [self.tokenizer.eos_token_id]
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def assistant_token_mask(
    tokenizer: Any, messages: list[dict[str, Any]], where: str, chat_template_kwargs: Mapping[str, Any]
) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a mask that is 1 on assistant tokens only.

    The conversation is rendered incrementally: message i contributes the text that
    `render(messages[:i+1])` adds to `render(messages[:i])`. For an assistant message that text
    is split into the generation prompt (the header `render(messages[:i], add_generation_prompt=True)`
    adds; mask 0) and the rest: the content and the end-of-turn delimiter (mask 1). Each piece is
    tokenised on its own, which is how prompt and generated tokens are split at inference.

    Raises:
        ValueError: the template does not render conversations as growing prefixes (then no
            per-turn mask can be derived; the message names `where`).
    """
    kwargs = dict(chat_template_kwargs)

    def render(msgs: list[dict[str, Any]], gen: bool) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False, **kwargs)

    def suffix(text: str, prefix: str, what: str) -> str:
        if not text.startswith(prefix):
            raise ValueError(
                f"{where}: the chat template does not render {what} as an extension of the shorter "
                "conversation, so assistant tokens cannot be located; use a template whose rendering "
                "of a conversation prefix is a text prefix."
            )
        return text[len(prefix) :]

    ids: list[int] = []
    mask: list[int] = []
    prev = ""
    for i, msg in enumerate(messages):
        full = render(messages[: i + 1], gen=False)
        if msg["role"] == "assistant":
            with_header = render(messages[:i], gen=True) if i else ""
            header = suffix(with_header, prev, f"the generation prompt before message {i}") if i else ""
            body = suffix(full, with_header, f"assistant message {i}")
            pieces = [(header, 0), (body, 1)]
        else:
            pieces = [(suffix(full, prev, f"message {i}"), 0)]
        for text, flag in pieces:
            if text:
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids.extend(piece)
                mask.extend([flag] * len(piece))
        prev = full
    return ids, mask


class MultiTurnSFTDataset(_SFTBase):
    """Multi-turn SFT from a `messages_key` column: loss only on assistant tokens.

    Args:
        data_files: parquet/jsonl path(s) with a `messages_key` column of message lists.
        tokenizer: Hugging Face tokenizer with a chat template and a pad token.
        config: SFTDataConfig.
        files_key: config key the files came from, quoted in errors.
    """

    def __init__(
        self, data_files, tokenizer, config: SFTDataConfig, files_key: str = "data.train_files"
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "MultiTurnSFTDataset needs a tokenizer with a chat_template (tokenizer.chat_template)."
            )
        super().__init__(data_files, tokenizer, config, files_key)

    def _required_columns(self) -> list[str]:
        return [self.config.messages_key]

    def _ids_and_mask(self, row: int) -> tuple[list[int], list[int]]:
        where = self._where(row)
        messages = as_messages(self._rows[row][self.config.messages_key], where)
        if messages is None:
            raise ValueError(
                f"{where}: column {self.config.messages_key!r} must hold a list of chat messages"
            )
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: conversation has no assistant message, so there is nothing to learn")
        return assistant_token_mask(self.tokenizer, messages, where, self.config.apply_chat_template_kwargs)
