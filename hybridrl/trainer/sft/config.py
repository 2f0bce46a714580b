"""The SFT config schema (veRL's `sft_trainer.yaml` keys), its presets, loading and validation.

`load_sft_config(cfg)` merges schema <- hybridrl/trainer/config/sft_trainer.yaml <- `cfg` through the
shared loader (hybridrl/utils/config_loader.py), fills the keys left null from the presets and
checks the whole; every problem raises ConfigError naming the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hybridrl.config.megatron import MegatronConfig
from hybridrl.config.roles import FSDPConfig
from hybridrl.models.builtin import BUILTIN_MODEL_ALIASES
from hybridrl.utils import plugins
from hybridrl.utils.config_loader import ConfigError, load_structured

CONFIG_DIR = Path(__file__).parent.parent / "config"
LR_SCHEDULERS = ("cosine", "wsd", "constant")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")

# Values used for keys left null, for the built-in tiny model and for any other model.
# (The tiny model needs a much larger learning rate than veRL's 1e-5 to learn in minutes.)
BUILTIN_PRESET = {"optim.lr": 1e-3, "data.train_batch_size": 64, "data.micro_batch_size_per_gpu": 64}
GENERAL_PRESET = {"optim.lr": 1e-5, "data.train_batch_size": 256, "data.micro_batch_size_per_gpu": 4}


SFTConfigError = ConfigError  # the name SFT code used before the loaders were unified


# ----------------------------------------------------------------------------------------------
# schema
# ----------------------------------------------------------------------------------------------
@dataclass
class SFTMultiTurnConfig:
    enable: bool = False
    messages_key: str = "messages"  # column holding the conversation ({role, content} messages)


@dataclass
class SFTDataSection:
    train_files: Any = None  # str | list[str]; None -> the built-in task's SFT train file
    val_files: Any = None  # None -> the built-in task's SFT val file when training on it
    builtin_data_dir: str | None = None  # where the built-in task's files are written when files are null
    prompt_key: str = "prompt"
    response_key: str = "response"
    prompt_dict_keys: list[str] | None = None  # the prompt column holds a dict: the path of keys to the text
    # the response column holds a dict: the path of keys to the text
    response_dict_keys: list[str] | None = None
    multiturn: SFTMultiTurnConfig = field(default_factory=SFTMultiTurnConfig)
    max_length: int = 1024
    truncation: str = "error"
    train_batch_size: int | None = None
    micro_batch_size_per_gpu: int | None = None
    micro_batch_size: int | None = None  # veRL's removed global key: rejected with a hint
    use_chat_template: bool = True  # render the prompt with the tokenizer's chat template
    chat_template: str | None = None  # a chat template that replaces the tokenizer's
    # extra keyword arguments of tokenizer.apply_chat_template
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    train_max_samples: int = -1  # keep only the first N training rows (-1: all)
    val_max_samples: int = -1  # keep only the first N validation rows (-1: all)
    shuffle: bool = True  # shuffle the training rows each epoch (seed: trainer.seed)


@dataclass
class SFTFSDPConfig(FSDPConfig):
    """FSDPConfig plus veRL SFT's names: cpu_offload / offload_params keep shards on the host."""

    cpu_offload: bool = False
    offload_params: bool = False


@dataclass
class SFTModelSection:
    partial_pretrain: str = "builtin:tiny"
    tokenizer_path: str | None = None
    trust_remote_code: bool = False  # allow the model's and tokenizer's remote code
    external_lib: Any = None  # a module name or a list of them (hybridrl.utils.plugins)
    # set on the Hugging Face config before the model is built
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    lora_rank: int = 0
    lora_alpha: int = 16  # LoRA scaling alpha
    target_modules: Any = "all-linear"  # LoRA: modules that get adapters (all-linear or a list of names)
    use_liger: bool = False  # Liger kernels; not implemented here, only false is accepted
    strategy: str = "fsdp2"  # the training engine: fsdp / fsdp2 / dp (FSDP2) or megatron; see model_engine
    fsdp_config: SFTFSDPConfig = field(default_factory=SFTFSDPConfig)
    megatron: MegatronConfig = field(default_factory=lambda: MegatronConfig(dtype="float32"))


@dataclass
class SFTOptimSection:
    optimizer: str = "AdamW"  # AdamW only
    lr: float | None = None
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.01  # AdamW weight decay
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.1  # warm-up as a fraction of the steps (when lr_warmup_steps <= 0)
    clip_grad: float = 1.0  # clip the gradient's global norm to this
    lr_scheduler: str = "cosine"
    min_lr_ratio: float = 0.0  # the schedule's floor: lr * min_lr_ratio
    num_cycles: float = 0.5  # cosine schedule: cosine cycles over the decay
    stable_ratio: float = 0.9


@dataclass
class SFTCheckpointSection:
    # what a checkpoint saves: model, optimizer, extra, hf_model
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra", "hf_model"])
    # what a resume loads from it
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class SFTTrainerSection:
    # the checkpoint root folder
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    project_name: str = "hybridrl-sft"  # project name for the trackers and the checkpoint folder
    experiment_name: str = "sft"  # run name for the trackers and the checkpoint folder
    logger: Any = field(default_factory=lambda: ["console"])
    log_dir: str | None = None
    total_epochs: int = 4  # passes over the training data
    total_training_steps: int | None = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    resume_mode: str = "auto"
    resume_from_path: str | None = None  # the checkpoint to resume from with resume_mode=resume_path
    max_ckpt_to_keep: int | None = None  # keep the newest N checkpoints (null or 0: all)
    checkpoint: SFTCheckpointSection = field(default_factory=SFTCheckpointSection)
    nnodes: int = 1  # machines in the run
    n_gpus_per_node: int | None = None
    seed: int = 1  # random seed (model init, data shuffle)
    device: str = "auto"
    # SIGTERM / SIGUSR1: finish the step, save it and exit within this many seconds
    # (hybridrl.trainer.sft.preemption); 0: exit at once without saving
    preemption_grace_s: float = 25.0


@dataclass
class SFTGenerationEvalSection:
    """Greedy accuracy on the validation prompts (needs data_source and ground-truth columns)."""

    enable: bool = True
    max_samples: int = 200  # validation rows scored at most
    max_new_tokens: int = 32  # tokens generated per prompt
    batch_size: int = 64  # prompts per generation batch
    data_source_key: str = "data_source"  # column naming each row's data source (picks the scorer)
    ground_truth_key: str = "ground_truth"  # a column, or a dotted path such as reward_model.ground_truth


@dataclass
class SFTConfig:
    data: SFTDataSection = field(default_factory=SFTDataSection)
    model: SFTModelSection = field(default_factory=SFTModelSection)
    optim: SFTOptimSection = field(default_factory=SFTOptimSection)
    trainer: SFTTrainerSection = field(default_factory=SFTTrainerSection)
    generation_eval: SFTGenerationEvalSection = field(default_factory=SFTGenerationEvalSection)
    # veRL's newest engine switch ("dp" / "fsdp", "megatron"): sets model.strategy (null: leave it)
    model_engine: str | None = None  # veRL's engine switch: sets model.strategy (fsdp, fsdp2, dp, megatron)


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
SFT_KEYS_DOC = "hybridrl/trainer/config/sft_trainer.yaml"


def load_sft_config(cfg: DictConfig | dict | list[str] | None = None) -> SFTConfig:
    """The typed config: schema <- sft_trainer.yaml <- `cfg`, resolved, preset-filled and validated.

    Args:
        cfg: a DictConfig/dict of overrides, or a list of dotlist strings ("optim.lr=1e-4").

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or an inconsistent setting.
    """
    config: SFTConfig = load_structured(SFTConfig, cfg, SFT_KEYS_DOC, CONFIG_DIR / "sft_trainer.yaml")
    # The user's modules first: model.strategy / model_engine are checked against the engine registry.
    plugins.import_external_libs(plugins.external_lib_entries(config, ["model"]))
    fill_presets(config)
    apply_model_engine(config)
    validate_sft_config(config)
    return config


def is_builtin_model(path: str | None) -> bool:
    return path in BUILTIN_MODEL_ALIASES


def fill_presets(config: SFTConfig) -> None:
    """Fill keys left null from BUILTIN_PRESET (built-in model) or GENERAL_PRESET."""
    preset = BUILTIN_PRESET if is_builtin_model(config.model.partial_pretrain) else GENERAL_PRESET
    for dotted, value in preset.items():
        section, name = dotted.split(".")
        obj = getattr(config, section)
        if getattr(obj, name) is None:
            setattr(obj, name, value)


SFT_DEFAULT_STRATEGY = "fsdp2"


def apply_model_engine(config: SFTConfig) -> None:
    """`model_engine=<name>` (veRL's engine switch) sets `model.strategy`; both must name a
    registered training engine (engine/base.py: dp = fsdp = fsdp2, megatron).

    Raises:
        ConfigError: an unknown engine name, or model.strategy set by the user to another engine.
    """
    from hybridrl.engine.base import get_engine

    m = config.model
    try:
        current = get_engine(m.strategy, "model.strategy")
        chosen = None if config.model_engine is None else get_engine(str(config.model_engine), "model_engine")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if chosen is None or chosen.name == current.name:
        return
    spelling = chosen.aliases[0] if chosen.aliases else chosen.name
    if m.strategy != SFT_DEFAULT_STRATEGY:
        raise ConfigError(
            f"model_engine={config.model_engine} but model.strategy={m.strategy}: both choose the training "
            f"engine; drop one of the two, or set model.strategy={spelling}"
        )
    m.strategy = spelling


def uses_megatron(config: SFTConfig) -> bool:
    """Whether `model.strategy` names the Megatron engine (ConfigError for an unknown engine)."""
    from hybridrl.engine.base import canonical_engine_name

    try:
        return canonical_engine_name(config.model.strategy, "model.strategy") == "megatron"
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_megatron_model(m: SFTModelSection) -> None:
    """What the Megatron engine cannot do for SFT, refused at start-up naming the key."""
    from hybridrl.config.megatron import validate_megatron_config

    if m.lora_rank > 0:
        raise ConfigError(
            f"model.lora_rank={m.lora_rank} with model.strategy=megatron: the Megatron engine's LoRA is built for "
            "the RL actor (main_ppo), not checked with the SFT trainer; set model.lora_rank=0, or model.strategy=fsdp2 "
            "for LoRA"
        )
    if m.enable_gradient_checkpointing:
        raise ConfigError(
            "model.enable_gradient_checkpointing=True is the Hugging Face model's switch, which the Megatron "
            "engine does not build; set it to false (Megatron's activation recomputation is a "
            "model.megatron.override_transformer_config field)"
        )
    f = m.fsdp_config
    for name in ("cpu_offload", "offload_params", "param_offload", "optimizer_offload", "offload_policy"):
        if getattr(f, name):
            raise ConfigError(
                f"model.fsdp_config.{name}=True applies to the FSDP engine only; with model.strategy=megatron "
                "set it to false (model.megatron.param_offload / optimizer_offload are the Megatron keys)"
            )
    if (
        m.megatron.context_parallel_size != 1
    ):  # the RL workers have it (docs/megatron.md); SFT's loop does not
        raise ConfigError(
            f"model.megatron.context_parallel_size={m.megatron.context_parallel_size}: context parallelism is "
            "built for the RL trainers' Megatron workers, not yet for main_sft's data split; set it to 1"
        )
    try:
        validate_megatron_config(m.megatron, "model.megatron")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def _refuse_unsupported_model_keys(m: SFTModelSection) -> None:
    fsdp = m.fsdp_config
    for key, value, default in (
        ("model.fsdp_config.mixed_precision.buffer_dtype", fsdp.mixed_precision.buffer_dtype, "fp32"),
        ("model.fsdp_config.wrap_policy.min_num_params", fsdp.wrap_policy.min_num_params, 0),
    ):
        if value != default:
            raise ConfigError(
                f"{key}={value!r} is accepted for veRL compatibility but not supported here (FSDP2 keeps "
                f"buffers as loaded and shards per decoder layer); leave it at {default!r}"
            )
    if m.use_liger:
        raise ConfigError("model.use_liger=True is not implemented in hybridrl; set it to False")


def _validate_sft_optim(o: SFTOptimSection) -> None:
    if o.optimizer.lower() != "adamw":
        raise ConfigError(
            f"optim.optimizer={o.optimizer!r}: only AdamW is implemented; set optim.optimizer=AdamW"
        )
    if o.lr is None or o.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {o.lr}")
    if len(o.betas) != 2:
        raise ConfigError(f"optim.betas must hold two numbers, got {o.betas}")
    if not 0.0 <= o.lr_warmup_steps_ratio < 1.0:
        raise ConfigError(f"optim.lr_warmup_steps_ratio must be in [0, 1), got {o.lr_warmup_steps_ratio}")
    if not 0.0 <= o.stable_ratio <= 1.0:
        raise ConfigError(f"optim.stable_ratio must be in [0, 1], got {o.stable_ratio}")


def validate_sft_config(config: SFTConfig) -> None:
    """Start-up checks that need no files or processes; each error names the key and the fix."""
    d, m, o, t = config.data, config.model, config.optim, config.trainer
    if d.micro_batch_size is not None:
        raise ConfigError(
            "data.micro_batch_size (a global count) was removed in veRL; set data.micro_batch_size_per_gpu instead"
        )
    _choice("data.truncation", d.truncation, ("error", "left", "right"))
    _choice("optim.lr_scheduler", o.lr_scheduler, LR_SCHEDULERS)
    _choice("trainer.resume_mode", t.resume_mode, ("auto", "disable", "resume_path"))
    _choice("trainer.device", t.device, ("auto", "cpu", "cuda"))
    _refuse_unsupported_model_keys(m)
    if uses_megatron(config):
        _validate_megatron_model(m)
    _validate_sft_optim(o)
    for key, value in (
        ("data.train_batch_size", d.train_batch_size),
        ("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu),
        ("data.max_length", d.max_length),
        ("trainer.nnodes", t.nnodes),
    ):
        if value is None or value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if t.total_epochs < 1 and not t.total_training_steps:
        raise ConfigError("trainer.total_epochs must be >= 1 (or set trainer.total_training_steps)")
    if t.total_training_steps is not None and t.total_training_steps < 1:
        raise ConfigError(f"trainer.total_training_steps must be >= 1 or null, got {t.total_training_steps}")
    if m.lora_rank < 0:
        raise ConfigError(f"model.lora_rank must be >= 0 (0 disables LoRA), got {m.lora_rank}")
    for name in ("save_contents", "load_contents"):
        bad = [c for c in getattr(t.checkpoint, name) if c not in CHECKPOINT_CONTENTS]
        if bad:
            raise ConfigError(
                f"trainer.checkpoint.{name} has unknown entries {bad}; use a subset of {list(CHECKPOINT_CONTENTS)}"
            )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>"
        )
    if d.train_files is None and not is_builtin_model(m.partial_pretrain):
        raise ConfigError(
            "data.train_files is not set; point it at parquet/jsonl file(s) with the "
            f"'{d.prompt_key}'/'{d.response_key}' columns (the built-in task's data only fits model.partial_pretrain="
            "builtin:tiny)"
        )
    from hybridrl.trainer.sft.checks import check_sft_values

    check_sft_values(config)  # the remaining ranges and names (the start-up sweep)
