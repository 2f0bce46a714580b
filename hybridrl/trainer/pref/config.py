"""The configs of `main_rm` (reward-model training) and `main_dpo` (preference optimisation).

Both share SFT's `model`, `optim` and `trainer` sections (veRL's sft_trainer.yaml names, see
trainer/sft/config.py) and a preference `data` section (TRL's column names); `rm.*` and `dpo.*`
hold the loss settings. `load_pref_config(kind, cfg)` merges schema <- rm_trainer.yaml /
dpo_trainer.yaml <- `cfg`, fills the presets and validates; problems raise ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from hybridrl.algos.preference import DPO_LOSS_TYPES
from hybridrl.trainer.sft.config import (
    CONFIG_DIR,
    SFTGenerationEvalSection,
    SFTModelSection,
    SFTOptimSection,
    SFTTrainerSection,
    apply_model_engine,
    is_builtin_model,
    validate_sft_config,
)
from hybridrl.utils.config_loader import ConfigError, load_structured

__all__ = ["DPOConfig", "RMConfig", "load_pref_config"]

KINDS = ("rm", "dpo")
# Values for keys left null: built-in tiny model / any other model (TRL's defaults).
PRESETS = {
    ("rm", True): {
        "optim.lr": 3e-4,
        "data.train_batch_size": 64,
        "data.micro_batch_size_per_gpu": 64,
        "trainer.total_epochs": 20,
    },
    ("rm", False): {
        "optim.lr": 1e-5,
        "data.train_batch_size": 64,
        "data.micro_batch_size_per_gpu": 8,
        "trainer.total_epochs": 1,
    },
    ("dpo", True): {"optim.lr": 2e-4, "data.train_batch_size": 64, "data.micro_batch_size_per_gpu": 64},
    ("dpo", False): {"optim.lr": 1e-6, "data.train_batch_size": 64, "data.micro_batch_size_per_gpu": 8},
}


@dataclass
class PrefDataSection:
    train_files: Any = None  # None -> the built-in preference pairs
    val_files: Any = None  # None -> the built-in held-out pairs when training on the built-in ones
    builtin_data_dir: str | None = None  # where the built-in pairs are written when the files are null
    prompt_key: str = "prompt"  # absent from the files: the implicit-prompt layout
    chosen_key: str = "chosen"  # column of the preferred completion
    rejected_key: str = "rejected"  # column of the rejected completion
    margin_key: str | None = None  # rm only: a numeric column of per-pair margins
    max_prompt_length: int = 512  # longest rendered prompt in tokens (a longer one is an error)
    max_length: int = 1024  # longest prompt + completion + EOS in tokens
    truncation: str = "error"  # error | right
    train_batch_size: int | None = None  # pairs per optimizer step, over all ranks
    micro_batch_size_per_gpu: int | None = None  # pairs per forward/backward on one rank
    use_chat_template: bool = True  # render the prompt with the tokenizer's chat template
    chat_template: str | None = None  # a chat template that replaces the tokenizer's
    # extra keyword arguments of tokenizer.apply_chat_template
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    train_max_samples: int = -1  # keep only the first N training pairs (-1: all)
    val_max_samples: int = -1  # keep only the first N validation pairs (-1: all)
    shuffle: bool = True  # shuffle the training pairs each epoch (seed: trainer.seed)


@dataclass
class PrefModelSection(SFTModelSection):
    # a pair's chosen and rejected completions share one forward of their prompt
    # (engine/prefix_group.py); true / false / auto (on when the model can take it)
    use_prefix_grouper: Any = "auto"


@dataclass
class RMLossSection:
    center_rewards_coefficient: float = 0.0


@dataclass
class DPOLossSection:
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo
    beta: float = 0.1  # the loss's beta (strength of the implicit KL to the reference)
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    precompute_ref_log_probs: bool = True  # false: the reference forward runs beside every step
    ref_model_path: str | None = None  # None: model.partial_pretrain (with LoRA: the frozen base)


@dataclass
class RMTrainerSection(SFTTrainerSection):
    project_name: str = "hybridrl-rm"  # project name for the trackers and the checkpoint folder
    experiment_name: str = "rm"  # run name for the trackers and the checkpoint folder
    total_epochs: int | None = None  # preset: 20 for the built-in model, else 1


@dataclass
class DPOTrainerSection(SFTTrainerSection):
    project_name: str = "hybridrl-dpo"  # project name for the trackers and the checkpoint folder
    experiment_name: str = "dpo"  # run name for the trackers and the checkpoint folder
    total_epochs: int = 1  # passes over the training pairs


@dataclass
class RMConfig:
    data: PrefDataSection = field(default_factory=PrefDataSection)
    model: PrefModelSection = field(default_factory=PrefModelSection)
    optim: SFTOptimSection = field(default_factory=SFTOptimSection)
    trainer: RMTrainerSection = field(default_factory=RMTrainerSection)
    rm: RMLossSection = field(default_factory=RMLossSection)
    model_engine: str | None = None  # veRL's engine switch: sets model.strategy (fsdp, fsdp2, dp, megatron)


@dataclass
class DPOConfig:
    data: PrefDataSection = field(default_factory=PrefDataSection)
    model: PrefModelSection = field(default_factory=PrefModelSection)
    optim: SFTOptimSection = field(default_factory=SFTOptimSection)
    trainer: DPOTrainerSection = field(default_factory=DPOTrainerSection)
    generation_eval: SFTGenerationEvalSection = field(default_factory=SFTGenerationEvalSection)
    dpo: DPOLossSection = field(default_factory=DPOLossSection)
    model_engine: str | None = None  # veRL's engine switch: sets model.strategy (fsdp, fsdp2, dp, megatron)


SCHEMAS = {"rm": (RMConfig, "rm_trainer.yaml"), "dpo": (DPOConfig, "dpo_trainer.yaml")}


def load_pref_config(kind: str, cfg: DictConfig | dict | list[str] | None = None) -> RMConfig | DPOConfig:
    """The typed, preset-filled and validated config of `kind` ("rm" or "dpo")."""
    schema, yaml_name = SCHEMAS[kind]
    config = load_structured(schema, cfg, f"hybridrl/trainer/config/{yaml_name}", CONFIG_DIR / yaml_name)
    preset = PRESETS[(kind, is_builtin_model(config.model.partial_pretrain))]
    for dotted, value in preset.items():
        section, name = dotted.split(".")
        if getattr(getattr(config, section), name) is None:
            setattr(getattr(config, section), name, value)
    validate_pref_config(kind, config)
    return config


class _SFTView:
    """The attributes validate_sft_config reads, from a preference config (shared checks, one place)."""

    def __init__(self, config: Any) -> None:
        from hybridrl.trainer.sft.config import SFTDataSection

        d = config.data
        self.data = SFTDataSection(
            train_files=d.train_files if d.train_files is not None else "builtin",
            max_length=d.max_length,
            train_batch_size=d.train_batch_size,
            micro_batch_size_per_gpu=d.micro_batch_size_per_gpu,
            train_max_samples=d.train_max_samples,
            val_max_samples=d.val_max_samples,
        )
        self.model, self.optim, self.trainer, self.model_engine = (
            config.model,
            config.optim,
            config.trainer,
            config.model_engine,
        )
        self.generation_eval = getattr(config, "generation_eval", SFTGenerationEvalSection(enable=False))


def validate_pref_config(kind: str, config: Any) -> None:
    """Start-up checks that need no files or processes; each error names the key and the fix."""
    d = config.data
    if d.train_files is None and not is_builtin_model(config.model.partial_pretrain):
        raise ConfigError(
            "data.train_files is not set; point it at parquet/jsonl file(s) with the "
            f"'{d.chosen_key}'/'{d.rejected_key}' columns (the built-in pairs only fit model.partial_pretrain=builtin:tiny)"
        )
    if d.truncation not in ("error", "right"):
        raise ConfigError(f"data.truncation={d.truncation!r} is not one of ['error', 'right']")
    if not 1 <= d.max_prompt_length < d.max_length:
        raise ConfigError(
            f"data.max_prompt_length={d.max_prompt_length} must be >= 1 and below data.max_length={d.max_length}"
        )
    apply_model_engine(_SFTView(config))  # model_engine=megatron sets model.strategy, as in main_sft
    validate_sft_config(_SFTView(config))
    if config.model.use_prefix_grouper not in (True, False, "auto"):
        raise ConfigError(
            f"model.use_prefix_grouper={config.model.use_prefix_grouper!r} is not one of [true, false, auto]"
        )
    if kind == "rm":
        if d.margin_key is not None and not d.margin_key:
            raise ConfigError("data.margin_key is empty; name the margin column or leave it null")
        if config.rm.center_rewards_coefficient < 0:
            raise ConfigError(
                f"rm.center_rewards_coefficient must be >= 0, got {config.rm.center_rewards_coefficient}"
            )
        return
    if d.margin_key is not None:
        raise ConfigError("data.margin_key is a reward-model setting; main_dpo has no margin: leave it null")
    p = config.dpo
    if p.loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(f"dpo.loss_type={p.loss_type!r} is not one of {list(DPO_LOSS_TYPES)}")
    if not p.beta > 0:
        raise ConfigError(f"dpo.beta must be > 0, got {p.beta}")
    if not 0 <= p.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {p.label_smoothing}")
    if p.loss_type == "ipo" and p.label_smoothing:
        raise ConfigError("dpo.label_smoothing applies to the sigmoid and simpo losses, not ipo: set it to 0")
    if p.ref_model_path and config.model.lora_rank > 0:
        raise ConfigError(
            "dpo.ref_model_path with model.lora_rank > 0: with LoRA the reference is the frozen base model; "
            "leave dpo.ref_model_path null"
        )
