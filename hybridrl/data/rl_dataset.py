"""RLHFDataset: prompts for RL training, read from parquet files (veRL `data.*` semantics).

Each row of the input files holds a prompt (a chat message list, or a plain string) under
`data.prompt_key` plus any other columns (`data_source`, `reward_model`, `extra_info`, `ability`,
...). An item is the prompt tokenised and LEFT-padded to `data.max_prompt_length`, with every
other column passed through untouched so that reward functions can read them.

`collate_fn` turns a list of items into one dict (stacked tensors + numpy object arrays) that
`DataProto.from_single_dict` accepts. `create_rl_dataset` builds this class or a user class
named by `data.custom_cls.path` / `data.custom_cls.name`.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hybridrl.data.multimodal import as_media_list, process_row, validate_row_images
from hybridrl.data.video import refuse_qwen3_vl_videos
from hybridrl.utils.import_utils import import_user_file

__all__ = [
    "DataColumnError",
    "as_messages",
    "RLDataConfig",
    "RLHFDataset",
    "TRUNCATION_MODES",
    "collate_fn",
    "compute_position_ids",
    "create_rl_dataset",
    "load_custom_class",
    "read_rows",
    "render_prompt",
    "truncate_ids",
]

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
# Keys an RLHFDataset item produces itself; a data column with one of these names would be shadowed.
_RESERVED_COLUMNS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "raw_prompt_ids",
    "raw_prompt",
    "full_prompts",
    "multi_modal_inputs",
)


class DataColumnError(KeyError):
    """A required column is missing from a data file (a KeyError with a readable message)."""

    def __str__(self) -> str:  # KeyError would print the message wrapped in quotes
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class RLDataConfig:
    """The `data.*` keys RLHFDataset reads (veRL names; shuffle/seed belong to the sampler).

    Attributes:
        prompt_key: column holding the prompt (chat message list or string).
        max_prompt_length: P, the length every prompt is left-padded to.
        truncation: what to do with a prompt longer than P: "error", "left" (keep the tail),
            "right" (keep the head) or "middle" (keep head and tail halves).
        filter_overlong_prompts: drop prompts longer than P when the dataset is built.
        filter_overlong_prompts_workers: processes measuring the prompts for that (veRL's
            `datasets.filter(num_proc=...)`; hybridrl.data.overlong); 1 measures in this process.
        return_raw_chat: add the message list as `raw_prompt` to each item.
        return_full_prompt: add the rendered prompt text as `full_prompts` to each item.
        max_samples: if > 0 keep only the first `max_samples` rows (applied before filtering).
        apply_chat_template_kwargs: extra keyword arguments for `tokenizer.apply_chat_template`.
        trust_remote_code: recorded for tokenizer/processor loading by the caller.
        image_key / video_key: the multimodal columns (veRL's `data.image_key` / `data.video_key`;
            read only with a processor, see hybridrl.data.multimodal).
        image_patch_size: veRL's `data.image_patch_size`; must equal the processor's patch size.
        return_multi_modal_inputs: put the processor's model inputs (pixel_values, image_grid_thw)
            in each item as `multi_modal_inputs`.
        mm_processor_kwargs: extra keyword arguments for the processor call.
    """

    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    return_raw_chat: bool = False
    return_full_prompt: bool = False
    max_samples: int = -1
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    image_key: str = "images"
    video_key: str = "videos"
    image_patch_size: int | None = 14
    return_multi_modal_inputs: bool = True
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={self.truncation!r} is not one of {TRUNCATION_MODES}; "
                "set data.truncation=error|left|right|middle."
            )
        if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
            raise ValueError(
                f"data.max_prompt_length must be a positive int, got {self.max_prompt_length!r}."
            )
        if (
            not isinstance(self.filter_overlong_prompts_workers, int)
            or self.filter_overlong_prompts_workers < 1
        ):
            raise ValueError(
                "data.filter_overlong_prompts_workers must be an int >= 1 (processes measuring prompt lengths), "
                f"got {self.filter_overlong_prompts_workers!r}."
            )
        if not isinstance(self.max_samples, int):
            raise ValueError(f"data.max_samples must be an int (-1 for all rows), got {self.max_samples!r}.")
        if not isinstance(self.apply_chat_template_kwargs, Mapping):
            raise ValueError(
                "data.apply_chat_template_kwargs must be a mapping, got "
                f"{type(self.apply_chat_template_kwargs).__name__}."
            )

    @classmethod
    def from_verl(cls, data_cfg: Mapping[str, Any], split: str = "train") -> RLDataConfig:
        """Build from a plain `data` dict with veRL key names.

        `max_samples` is read from `{split}_max_samples` (veRL's `train_max_samples` /
        `val_max_samples`), else `max_samples`. Keys this class does not use (train_batch_size,
        shuffle, ...) are ignored: they belong to other consumers of `data.*`.
        """
        names = {f.name for f in fields(cls)} - {"max_samples"}
        kwargs = {k: data_cfg[k] for k in names if k in data_cfg and data_cfg[k] is not None}
        for key in (f"{split}_max_samples", "max_samples"):
            if data_cfg.get(key) is not None:
                kwargs["max_samples"] = int(data_cfg[key])
                break
        for key in ("apply_chat_template_kwargs", "mm_processor_kwargs"):
            if key in kwargs:
                kwargs[key] = dict(kwargs[key])
        return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# reading files
# ----------------------------------------------------------------------------------------------
def _as_file_list(data_files: str | os.PathLike | Sequence[str | os.PathLike], files_key: str) -> list[str]:
    if isinstance(data_files, (str, os.PathLike)):
        data_files = [data_files]
    files = [os.path.expanduser(os.fspath(f)) for f in data_files]
    if not files:
        raise ValueError(f"{files_key} is empty; give one parquet file or a list of them.")
    return files


def _read_one_file(path: str, files_key: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows (plain Python dicts) and column names of one parquet or jsonl file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{files_key}: data file not found: {path!r}. Point {files_key} at existing parquet file(s) "
            "(for GSM8K: python -m hybridrl.data.preprocess.gsm8k --local_dir IN --out_dir OUT)."
        )
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:  # ParquetFile.read, not read_table: one file needs neither pyarrow.dataset nor pandas
            table = pq.ParquetFile(path).read()
        except Exception as exc:  # pyarrow raises several types for empty/corrupt files
            raise ValueError(
                f"{files_key}: cannot read parquet file {path!r} (empty or corrupt?): {exc}"
            ) from exc
        rows, columns = table.to_pylist(), list(table.column_names)
    elif suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{files_key}: {path!r} line {lineno} is not valid JSON: {exc}") from exc
        columns = list(dict.fromkeys(k for r in rows for k in r))
    else:
        raise ValueError(
            f"{files_key}: unsupported file type {suffix!r} for {path!r}; use .parquet or .jsonl."
        )
    if not rows:
        raise ValueError(
            f"{files_key}: data file {path!r} has no rows; remove it from {files_key} or refill it."
        )
    return rows, columns


def read_rows(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    files_key: str,
    required_columns: Sequence[str],
) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """Read and concatenate the rows of one or many parquet/jsonl files, in order.

    Args:
        data_files: one path or a list of paths (`~` is expanded).
        files_key: the config key the paths came from, quoted in errors (e.g. "data.train_files").
        required_columns: columns every file must have.

    Returns:
        (rows, sources): rows as plain dicts, and for each row its (file, row-in-file).

    Raises:
        FileNotFoundError: a file is missing. DataColumnError: a required column is missing.
        ValueError: a file is empty, unreadable or of an unknown type.
    """
    all_rows: list[dict[str, Any]] = []
    sources: list[tuple[str, int]] = []
    for path in _as_file_list(data_files, files_key):
        rows, columns = _read_one_file(path, files_key)
        for col in required_columns:
            if col not in columns:
                raise DataColumnError(
                    f"{files_key}: file {path!r} has no column {col!r}; columns present: {columns}. "
                    "Set the matching data.*_key to one of them, or regenerate the file."
                )
        all_rows.extend(rows)
        sources.extend((path, i) for i in range(len(rows)))
    return all_rows, sources


# ----------------------------------------------------------------------------------------------
# prompt helpers (pure)
# ----------------------------------------------------------------------------------------------
def as_messages(prompt: Any, where: str) -> list[dict[str, Any]] | None:
    """The prompt as a list of message dicts, or None if it is a plain string (errors name `where`)."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(
            f"{where}: prompt must be a string or a non-empty list of {{'role', 'content'}} messages, "
            f"got {type(prompt).__name__}: {prompt!r:.200}"
        )
    for msg in prompt:
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{where}: every chat message needs 'role' and 'content' keys, got {msg!r:.200}")
    return [dict(m) for m in prompt]


def render_prompt(tokenizer: Any, prompt: Any, where: str, chat_template_kwargs: Mapping[str, Any]) -> str:
    """Prompt text: a chat message list rendered with the generation prompt, or a string as-is.

    Args:
        tokenizer: a Hugging Face tokenizer (needs `chat_template` for message lists).
        prompt: list of {"role", "content"} dicts, or a string.
        where: "file row n", used in error messages.
        chat_template_kwargs: extra keyword arguments for `apply_chat_template`.
    """
    messages = as_messages(prompt, where)
    if messages is None:
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{where}: the prompt is a chat message list but the tokenizer has no chat_template; "
            "use a tokenizer with a chat template (or set tokenizer.chat_template), or store plain "
            "string prompts."
        )
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **dict(chat_template_kwargs)
    )


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut `ids` to at most `max_length` tokens.

    "left" keeps the last `max_length` tokens, "right" the first, "middle" the first
    `max_length // 2` and the last `max_length - max_length // 2`. "error" returns ids unchanged
    (the caller raises).
    """
    if len(ids) <= max_length or mode == "error":
        return list(ids)
    if mode == "left":
        return list(ids[len(ids) - max_length :])
    if mode == "right":
        return list(ids[:max_length])
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        return list(ids[:head]) + (list(ids[len(ids) - tail :]) if tail else [])
    raise ValueError(f"unknown truncation mode {mode!r}; use one of {TRUNCATION_MODES}")


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids from a 0/1 mask: cumsum(mask) - 1, clipped at 0.

    Args:
        attention_mask: (..., L) 0/1 tensor.

    Returns:
        (..., L) long tensor; left padding gets 0, right padding repeats the last position.
    """
    return torch.clamp(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0)


def check_processor(processor: Any, config: RLDataConfig) -> None:
    """Refuse a `data.image_patch_size` that differs from the processor's patch size."""
    patch = getattr(getattr(processor, "image_processor", None), "patch_size", None)
    if config.image_patch_size is not None and patch is not None and config.image_patch_size != patch:
        raise ValueError(
            f"data.image_patch_size={config.image_patch_size} but the model's image processor uses patch "
            f"size {patch}; set data.image_patch_size={patch} (or null to take the processor's)."
        )


# ----------------------------------------------------------------------------------------------
# the dataset
# ----------------------------------------------------------------------------------------------
class RLHFDataset(Dataset):
    """Prompts for RL, tokenised and left-padded to `config.max_prompt_length`.

    Item keys: `input_ids` (P,), `attention_mask` (P,), `position_ids` (P,) (long tensors),
    `raw_prompt_ids` (list[int], truncated but unpadded: what a rollout engine consumes),
    `raw_prompt` (messages, if return_raw_chat), `full_prompts` (str, if return_full_prompt),
    `index` (extra_info["index"] if present, else an `index` column, else the row's position in
    the concatenated files) and every other column of the row, passed through unchanged (a column
    missing from some files reads None). Trainers add uids themselves.

    Prompts are tokenised lazily in `__getitem__`, so with truncation="error" an over-long
    prompt fails when it is first read; `filter_overlong_prompts=True` tokenises every prompt at
    construction and drops the long ones.

    Args:
        data_files: one parquet (or jsonl) path or a list of them; rows are concatenated in order.
        tokenizer: a Hugging Face tokenizer with a pad token.
        config: the `data.*` settings.
        processor: the model's multimodal processor (`AutoProcessor`) or None for text; with one,
            rows take their images from `config.image_key` (hybridrl.data.multimodal), every image
            is checked at construction, and items carry `multi_modal_inputs`.
        files_key: config key the files came from, quoted in errors.
    """

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: RLDataConfig,
        processor: Any = None,
        files_key: str = "data.train_files",
    ) -> None:
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError(
                "the tokenizer has no pad token; set one before building the dataset "
                "(e.g. tokenizer.pad_token = tokenizer.eos_token)."
            )
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        self.files_key = files_key
        rows, sources = read_rows(data_files, files_key, [config.prompt_key])
        self._rows = rows
        self._sources = sources
        media = (config.image_key, config.video_key) if processor is not None else ()
        skip = (config.prompt_key, *media)
        self._columns = list(dict.fromkeys(k for r in rows for k in r if k not in skip))
        clash = [c for c in self._columns if c in _RESERVED_COLUMNS]
        if clash:
            raise ValueError(
                f"{files_key}: the data has column(s) {clash}, which the dataset produces itself; "
                "rename those columns."
            )
        keep = list(range(len(rows)))
        if config.max_samples > 0:
            keep = keep[: config.max_samples]
        if processor is not None:
            check_processor(processor, config)
            for r in keep:  # a bad image fails here, with its row, not hours into a run
                messages = as_messages(rows[r][config.prompt_key], self._where(r)) or []
                validate_row_images(messages, rows[r], config.image_key, config.video_key, self._where(r))
                if as_media_list(rows[r].get(config.video_key)):
                    refuse_qwen3_vl_videos(processor, f"{self._where(r)} ({config.video_key!r})")
        if config.filter_overlong_prompts:
            keep = self._drop_overlong(keep)
        self._keep = keep

    def _where(self, row: int) -> str:
        path, row_in_file = self._sources[row]
        return f"{self.files_key} file {path!r} row {row_in_file}"

    def _prompt_text(self, row: int) -> str:
        prompt = self._rows[row][self.config.prompt_key]
        return render_prompt(self.tokenizer, prompt, self._where(row), self.config.apply_chat_template_kwargs)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _multimodal(self, row: int) -> tuple[str, list[int], dict[str, Any]] | None:
        """(text, ids with image tokens expanded, multi_modal_inputs) of a row with images, else None."""
        record, cfg = self._rows[row], self.config
        if self.processor is None:
            return None
        images, videos = as_media_list(record.get(cfg.image_key)), as_media_list(record.get(cfg.video_key))
        if not images and not videos:
            return None
        messages = as_messages(record[cfg.prompt_key], self._where(row)) or []
        return process_row(
            self.processor, messages, images, self._where(row), cfg.apply_chat_template_kwargs,
            cfg.mm_processor_kwargs, videos,
        )  # fmt: skip

    def _row_ids(self, row: int) -> tuple[str, list[int], dict[str, Any] | None]:
        mm = self._multimodal(row)
        if mm is not None:
            return mm
        text = self._prompt_text(row)
        return text, self._encode([text])[0], None

    def prompt_lengths(self, rows: list[int]) -> list[int]:
        """Tokens of each row's prompt as the model sees it (image tokens expanded with a processor)."""
        if self.processor is not None:
            return [len(self._row_ids(r)[1]) for r in rows]
        return [len(ids) for ids in self._encode([self._prompt_text(r) for r in rows])]

    def _drop_overlong(self, keep: list[int]) -> list[int]:
        from hybridrl.data.overlong import parallel_prompt_lengths

        lengths = parallel_prompt_lengths(self, keep, self.config.filter_overlong_prompts_workers)
        kept = [r for r, n in zip(keep, lengths) if n <= self.config.max_prompt_length]
        dropped = len(keep) - len(kept)
        logger.info(
            "%s: filter_overlong_prompts dropped %d of %d prompts longer than max_prompt_length=%d",
            self.files_key,
            dropped,
            len(keep),
            self.config.max_prompt_length,
        )
        if not kept:
            raise ValueError(
                f"{self.files_key}: every prompt is longer than data.max_prompt_length="
                f"{self.config.max_prompt_length}; raise data.max_prompt_length."
            )
        return kept

    def __len__(self) -> int:
        return len(self._keep)

    def __getitem__(self, item: int) -> dict[str, Any]:
        cfg = self.config
        row = self._keep[item]
        text, ids, mm_inputs = self._row_ids(row)
        if len(ids) > cfg.max_prompt_length:
            if cfg.truncation == "error" or mm_inputs is not None:  # cutting image tokens breaks the image
                raise ValueError(
                    f"{self._where(row)}: prompt is {len(ids)} tokens, longer than data.max_prompt_length="
                    f"{cfg.max_prompt_length}. "
                    + (
                        "A prompt with images is never truncated (its image tokens would be cut): "
                        if mm_inputs is not None
                        else "Set data.truncation=left|right|middle, or "
                    )
                    + "data.filter_overlong_prompts=True, or raise data.max_prompt_length."
                )
            ids = truncate_ids(ids, cfg.max_prompt_length, cfg.truncation)
        pad = cfg.max_prompt_length - len(ids)
        input_ids = torch.tensor([self.tokenizer.pad_token_id] * pad + ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * pad + [1] * len(ids), dtype=torch.long)
        record = self._rows[row]
        out: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask),
            "raw_prompt_ids": list(ids),
        }
        if cfg.return_raw_chat:
            out["raw_prompt"] = record[cfg.prompt_key]
        if cfg.return_full_prompt:
            out["full_prompts"] = text
        if self.processor is not None and cfg.return_multi_modal_inputs:
            out["multi_modal_inputs"] = mm_inputs or {}
        for col in self._columns:
            out[col] = record.get(col)
        extra = record.get("extra_info")
        if isinstance(extra, Mapping) and extra.get("index") is not None:
            out["index"] = extra["index"]
        elif record.get("index") is None:
            out["index"] = row
        return out


# ----------------------------------------------------------------------------------------------
# collate
# ----------------------------------------------------------------------------------------------
def collate_fn(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Batch dataset items: tensors are stacked, everything else becomes a numpy object array.

    Args:
        items: B dicts as returned by a dataset's `__getitem__`.

    Returns:
        dict of (B, ...) tensors and (B,) numpy object arrays (a key missing from an item reads
        None), ready for `DataProto.from_single_dict`.
    """
    if not items:
        raise ValueError("collate_fn got an empty list of items")
    keys = list(dict.fromkeys(k for it in items for k in it))
    out: dict[str, Any] = {}
    for key in keys:
        values = [it.get(key) for it in items]
        if any(isinstance(v, torch.Tensor) for v in values):
            if not all(isinstance(v, torch.Tensor) for v in values):
                raise TypeError(f"collate_fn: key {key!r} is a tensor in some items and not in others")
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"collate_fn: tensors under {key!r} have different shapes {sorted(shapes)}")
            out[key] = torch.stack(values)
        else:
            arr = np.empty(len(values), dtype=object)
            for i, v in enumerate(values):
                arr[i] = v
            out[key] = arr
    return out


# ----------------------------------------------------------------------------------------------
# custom dataset classes
# ----------------------------------------------------------------------------------------------
def load_custom_class(path: str, name: str | None, base: type, key: str = "data.custom_cls") -> type:
    """Import class `name` from the Python file `path` and check it subclasses `base`.

    Raises:
        FileNotFoundError / ImportError / ValueError / AttributeError / TypeError with the config key and fix.
    """
    path = os.path.expanduser(path)
    if not name:
        raise ValueError(
            f"{key}.path is set to {path!r} but {key}.name is empty; set {key}.name to the class name."
        )
    module = import_user_file(path, f"{key}.path", prefix="hybridrl_custom")
    cls = getattr(module, name, None)
    if cls is None:
        found = sorted(
            n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__
        )
        raise AttributeError(f"{key}.name: {path!r} defines no {name!r}; classes defined there: {found}.")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(
            f"{key}.name: {name!r} in {path!r} must be a subclass of {base.__module__}.{base.__qualname__}."
        )
    return cls


def create_rl_dataset(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    config: RLDataConfig,
    processor: Any = None,
    custom_cls_path: str | None = None,
    custom_cls_name: str | None = None,
    files_key: str = "data.train_files",
) -> Dataset:
    """Build RLHFDataset, or the user class named by `data.custom_cls.path` / `.name`.

    A custom class is called as `cls(data_files=..., tokenizer=..., config=..., processor=...)`,
    plus `files_key=...` when its `__init__` accepts that argument, and must subclass
    `torch.utils.data.Dataset`.
    """
    if not custom_cls_path:
        return RLHFDataset(data_files, tokenizer, config, processor=processor, files_key=files_key)
    cls = load_custom_class(custom_cls_path, custom_cls_name, Dataset)
    kwargs: dict[str, Any] = {
        "data_files": data_files,
        "tokenizer": tokenizer,
        "config": config,
        "processor": processor,
    }
    params = inspect.signature(cls.__init__).parameters
    if "files_key" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["files_key"] = files_key
    return cls(**kwargs)
