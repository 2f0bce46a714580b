"""Start-up checks of `main_sft` beyond `validate_sft_config`: ranges of the remaining keys, and the
input files before the process group and the model are built (the SFT trainer used to load the
model first and read the data after it). Each problem raises a ConfigError naming the key and the fix.

* :func:`check_sft_values` (from ``validate_sft_config``): the config alone;
* :func:`check_sft_inputs` (from ``run_sft_config``, before ``init_distributed``): the model folder
  and its config.json, the tokenizer folder, and every row of the train/val files (the columns
  the dataset reads: ``data.prompt_key`` / ``data.response_key``, or ``data.multiturn.messages_key``).
"""

from __future__ import annotations

import os
from typing import Any

from hybridrl.trainer.ppo.data_checks import check_messages, read_columns
from hybridrl.trainer.ppo.startup_checks import _at_least_one, _check_dtypes, _in_range, read_model_json
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_sft_inputs", "check_sft_values"]


def _int_at_least(key: str, value: Any, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r} must be an integer >= {low} ({what})")


def check_sft_values(config: Any) -> None:
    """Ranges and names of the SFT keys `validate_sft_config` does not cover."""
    d, m, o, t, g = config.data, config.model, config.optim, config.trainer, config.generation_eval
    _in_range("optim.weight_decay", o.weight_decay, 0, None, "AdamW weight decay")
    _in_range("optim.eps", o.eps, 0, None, "AdamW epsilon")
    _in_range("optim.clip_grad", o.clip_grad, 0, None, "gradient norm clip")
    _in_range("optim.min_lr_ratio", o.min_lr_ratio, 0, 1, "floor of the schedule")
    _in_range("optim.num_cycles", o.num_cycles, 0, None, "cosine cycles")
    _int_at_least("optim.lr_warmup_steps", o.lr_warmup_steps, -1, "-1: use optim.lr_warmup_steps_ratio")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)!r} must be two numbers in [0, 1), e.g. [0.9,0.95]")
    for name in ("save_freq", "test_freq"):
        _int_at_least(f"trainer.{name}", getattr(t, name), -1, "N > 0: every N steps, -1: never")
    if t.max_ckpt_to_keep is not None:
        _int_at_least("trainer.max_ckpt_to_keep", t.max_ckpt_to_keep, 0, "null / 0: keep all")
    if t.n_gpus_per_node is not None:
        _at_least_one("trainer.n_gpus_per_node", t.n_gpus_per_node, "processes per node")
    _int_at_least("trainer.seed", t.seed, 0, "the random seed")
    from hybridrl.utils.tracking import SUPPORTED_BACKENDS

    loggers = [t.logger] if isinstance(t.logger, str) else list(t.logger or [])
    bad = [name for name in loggers if name not in SUPPORTED_BACKENDS]
    if bad:
        raise ConfigError(f"trainer.logger has {bad}: use names from {list(SUPPORTED_BACKENDS)}")
    for name in ("train_max_samples", "val_max_samples"):
        _int_at_least(f"data.{name}", getattr(d, name), -1, "-1: all rows, N > 0: the first N")
    if m.lora_rank > 0 and not (isinstance(m.lora_alpha, (int, float)) and m.lora_alpha > 0):
        raise ConfigError(f"model.lora_alpha={m.lora_alpha!r} must be > 0 with model.lora_rank > 0; e.g. 16")
    _check_dtypes(m.fsdp_config, "model.fsdp_config")
    if g.enable:
        for name, what in (
            ("max_samples", "prompts"),
            ("max_new_tokens", "tokens"),
            ("batch_size", "prompts"),
        ):
            _at_least_one(f"generation_eval.{name}", getattr(g, name), what)


def check_sft_inputs(config: Any) -> None:
    """The model folder, the tokenizer folder and every used row of the data files (before any
    process group or model is built)."""
    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.trainer.sft.data import resolve_data_files

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
