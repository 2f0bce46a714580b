"""Which preference files, their tokenised datasets, and the model checks, before anything starts."""

from __future__ import annotations

import os
from typing import Any

from hybridrl.data.preference import PreferenceDataConfig, PreferenceDataset, ensure_builtin_preference_data
from hybridrl.data.rl_dataset import DataColumnError
from hybridrl.models.builtin import resolve_model_path
from hybridrl.trainer.sft.config import is_builtin_model
from hybridrl.trainer.sft.engine import sft_model_config
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_model_head", "load_pref_datasets", "resolve_pref_files"]


def resolve_pref_files(config: Any) -> tuple[Any, Any]:
    """(train_files, val_files): the configured files, or the built-in pairs (train_files null)."""
    d = config.data
    if d.train_files is not None:
        return d.train_files, d.val_files
    if not is_builtin_model(config.model.partial_pretrain):
        raise ConfigError("data.train_files is not set; point it at parquet/jsonl file(s)")
    paths = ensure_builtin_preference_data(d.builtin_data_dir)
    return paths["pref_train"], (d.val_files if d.val_files is not None else paths["pref_val"])


def _data_config(config: Any, split: str) -> PreferenceDataConfig:
    d = config.data
    return PreferenceDataConfig(
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        margin_key=d.margin_key,
        max_prompt_length=d.max_prompt_length,
        max_length=d.max_length,
        truncation=d.truncation,
        max_samples=d.train_max_samples if split == "train" else d.val_max_samples,
        use_chat_template=d.use_chat_template,
        apply_chat_template_kwargs=dict(d.apply_chat_template_kwargs),
    )


def load_pref_datasets(config: Any) -> tuple[Any, PreferenceDataset, PreferenceDataset | None, Any]:
    """(tokenizer, train, val or None, val_files): every row read, tokenised and checked.

    Raises:
        ConfigError: a missing file or column, or a bad row (chosen == rejected, a prompt longer
            than data.max_prompt_length, ...), naming the file and row.
    """
    from hybridrl.models.hf import load_tokenizer

    model_config = sft_model_config(config)
    tokenizer = load_tokenizer(model_config, key="model")
    train_files, val_files = resolve_pref_files(config)
    datasets = []
    for split, files in (("train", train_files), ("val", val_files)):
        if files is None:
            datasets.append(None)
            continue
        try:
            datasets.append(
                PreferenceDataset(files, tokenizer, _data_config(config, split), f"data.{split}_files")
            )
        except (FileNotFoundError, DataColumnError, ValueError) as e:
            raise ConfigError(str(e)) from None
    return tokenizer, datasets[0], datasets[1], val_files


def check_model_head(config: Any) -> None:
    """main_rm: the model's architecture must have a sequence-classification form (the exported
    reward model), checked from its config.json before anything is built."""
    from transformers import AutoConfig

    from hybridrl.trainer.pref.export import sequence_classification_class

    m = config.model
    path = resolve_model_path(m.partial_pretrain, key="model.partial_pretrain")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"model.partial_pretrain={m.partial_pretrain!r}: {path} has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.partial_pretrain={m.partial_pretrain!r}: cannot read its config: {e}"
        ) from None
    try:
        sequence_classification_class(hf_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
