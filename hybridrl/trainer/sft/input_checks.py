"""`main_sft`'s input checks before the process group and the model are built: the model folder
and its config.json, the tokenizer folder, and every row of the train/val files (the columns the
dataset reads: ``data.prompt_key`` / ``data.response_key``, or ``data.multiturn.messages_key``).
Each problem raises a ConfigError naming the key and the fix.
"""

from __future__ import annotations

import os
from typing import Any

from hybridrl.models.builtin import resolve_model_path
from hybridrl.trainer.ppo.data_checks import check_messages, read_columns
from hybridrl.trainer.ppo.startup_checks import read_model_json
from hybridrl.trainer.sft.data import resolve_data_files
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_sft_inputs"]


def check_sft_inputs(config: Any) -> None:
    """The model folder, the tokenizer folder and every used row of the data files (before any
    process group or model is built)."""
    m = config.model
    try:
        read_model_json(
            resolve_model_path(m.partial_pretrain, key="model.partial_pretrain"), "model.partial_pretrain"
        )
        if m.tokenizer_path:
            resolve_model_path(m.tokenizer_path, key="model.tokenizer_path")
    except (FileNotFoundError, ValueError) as e:
        raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from None
    train, val = resolve_data_files(config)
    d = config.data
    for key, files, limit in (
        ("data.train_files", train, d.train_max_samples),
        ("data.val_files", val, d.val_max_samples),
    ):
        for path in [files] if isinstance(files, (str, os.PathLike)) else list(files or []):
            _check_sft_file(os.path.expanduser(os.fspath(path)), key, config, limit)


def _check_sft_file(path: str, key: str, config: Any, limit: int) -> None:
    d = config.data
    if not os.path.isfile(path):
        raise ConfigError(
            f"{key}: data file not found: {path!r}; point {key} at existing parquet/jsonl file(s)"
        )
    if d.multiturn.enable:
        needed = {d.multiturn.messages_key: "set data.multiturn.messages_key to the conversation column"}
    else:
        needed = {
            d.prompt_key: "set data.prompt_key to the prompt column",
            d.response_key: "set data.response_key to the response column",
        }
    columns = read_columns(path, key, list(needed), needed)
    if columns is None:
        return  # unreadable / another type: the dataset loader names it
    where = f"{key}: file {path!r}"
    for col, values in columns.items():
        values = values[:limit] if limit > 0 else values
        if d.multiturn.enable:
            check_messages(values, where, col, "data.multiturn.messages_key", allow_str=False)
            continue
        ck = "data.prompt_key" if col == d.prompt_key else "data.response_key"
        bad = next((i for i, v in enumerate(values) if v is None), None)
        if bad is not None:
            raise ConfigError(
                f"{where} row {bad}: column {col!r} ({ck}) is {values[bad]!r}; every row needs a {col}: fix or drop the row"
            )
