"""Loading Hugging Face models, configs and tokenizers for every role and engine.

Roles and the model class each builds (all from `model.path`, a local Hugging Face folder, a
hub id or 'builtin:tiny'):
    actor / ref   AutoModelForCausalLM
    critic        AutoModelForTokenClassification, num_labels=1: a linear value head on every
                  position of the backbone (the backbone weights load from a causal-LM
                  checkpoint; the head starts fresh). Classifier dropout is set to 0.
    reward        AutoModelForSequenceClassification, num_labels=1 (scores are read per token by
                  `engine.forward.forward_scores`, so padding conventions do not matter).

The FSDP engine shards what `build_hf_model` builds; the Megatron engine converts its weights; the
rollout engines, SFT, generation and the reward model load their tokenizer with `load_tokenizer`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hybridrl.config.roles import ModelConfig
from hybridrl.models.builtin import resolve_model_path
from hybridrl.utils import plugins
from hybridrl.utils.torch_utils import str_to_dtype

__all__ = [
    "ROLES",
    "build_hf_model",
    "import_external_libs",
    "load_hf_config",
    "check_whitespace",
    "load_tokenizer",
]

ROLES = ("actor", "ref", "critic", "reward")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


def import_external_libs(external_lib, key: str = "model.external_lib") -> None:
    """Import `external_lib` (one module or a list: modules that register models/tokenizers with
    transformers, or hybridrl plug-ins); see hybridrl.utils.plugins."""
    plugins.import_external_libs((key, name) for name in plugins.module_names(external_lib, key))


def load_hf_config(model_config: ModelConfig, role: str = "actor", key: str = "actor_rollout_ref.model"):
    """The Hugging Face config of `model_config.path` with `override_config` applied.

    Critic / reward configs get num_labels=1; the critic's classifier dropout is set to 0.
    """
    from transformers import AutoConfig

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    import_external_libs(model_config.external_lib)
    path = resolve_model_path(model_config.path, f"{key}.path")
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    if role in ("critic", "reward"):
        hf_config.num_labels = 1
    if role == "critic":
        hf_config.classifier_dropout = 0.0
    overrides = dict(model_config.override_config or {})
    attn = overrides.pop("attn_implementation", None)
    overrides.pop("model_config", None)
    overrides.pop("moe_config", None)
    for name, value in overrides.items():
        # the router-loss switches of Hugging Face's MoE configs, also for a family without them
        # (DeepSeek-V3 balances without an auxiliary loss): read by the FSDP actor (docs/moe.md)
        if not hasattr(hf_config, name) and name not in ("output_router_logits", "router_aux_loss_coef"):
            raise ValueError(
                f"{key}.override_config.{name}: the {type(hf_config).__name__} has no attribute {name!r}; "
                "remove it or check the spelling"
            )
        setattr(hf_config, name, value)
    if attn is not None:
        hf_config._attn_implementation = attn
    return hf_config


def load_tokenizer(model_config: ModelConfig, key: str = "actor_rollout_ref.model"):
    """The tokenizer of `tokenizer_path` (default: `path`), with a pad token (eos when missing)."""
    from transformers import AutoTokenizer

    import_external_libs(model_config.external_lib)
    path = model_config.tokenizer_path or model_config.path
    path_key = f"{key}.tokenizer_path" if model_config.tokenizer_path else f"{key}.path"
    path = resolve_model_path(path, path_key)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # recent transformers would build an empty tokenizer from a folder without one
        raise FileNotFoundError(f"{path_key}={path!r} holds no tokenizer files; set {key}.tokenizer_path")
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    check_whitespace(tok, f"{path_key}={path!r}")
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    if model_config.custom_chat_template:
        tok.chat_template = model_config.custom_chat_template
    return tok


def check_whitespace(tok, where: str) -> None:
    """Refuse a tokenizer that drops spaces and newlines (it would train on text that is not the data).

    transformers 5 loads a folder whose config.json names a model type it has a tokenizer class for
    (qwen2, llama, ...) with that class, which rebuilds the pipeline from the vocabulary; a character
    vocabulary spelt with plain ``" "``/``"\\n"`` keys (the built-in model's before 2026-12-02) then
    loses every space and newline.
    """
    text = "a b\nc"
    decoded = tok.decode(tok(text, add_special_tokens=False)["input_ids"])
    if decoded != text and decoded.strip() == "abc":
        raise ValueError(
            f"the tokenizer of {where} ({type(tok).__name__}) drops whitespace: {text!r} decodes as "
            f"{decoded!r}. Rebuild its files (a character vocabulary: hybridrl.models.tokenizer_builder"
            ".build_tokenizer(folder) spells space and newline byte-level) or point tokenizer_path at "
            "a tokenizer that round-trips text"
        )


def _auto_class(role: str):
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    return {
        "actor": AutoModelForCausalLM,
        "ref": AutoModelForCausalLM,
        "critic": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }[role]


def _dtype_kwarg() -> str:
    """transformers >= 4.56 calls the load dtype `dtype`; older versions `torch_dtype`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def build_hf_model(
    model_config: ModelConfig,
    *,
    role: str = "actor",
    dtype: torch.dtype | str = torch.float32,
    key: str = "actor_rollout_ref.model",
    default_attn: str | None = None,
) -> nn.Module:
    """Build the role's Hugging Face model on CPU in `dtype` (weights from `path`, or random).

    Applies gradient checkpointing (non-reentrant) and LoRA (peft) when configured. The model is
    in train mode with `use_cache` off. `default_attn` is the attention implementation used when
    `override_config` names none (None: transformers' default).
    """
    model_config.validate(key)
    hf_config = load_hf_config(model_config, role, key)
    dtype = str_to_dtype(dtype)
    cls = _auto_class(role)
    if role in ("actor", "ref") and getattr(hf_config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText as cls  # a vision-language model
    attn = getattr(hf_config, "_attn_implementation", None) or default_attn
    kwargs: dict[str, Any] = {"trust_remote_code": model_config.trust_remote_code}
    if attn:
        kwargs["attn_implementation"] = attn
    kwargs[_dtype_kwarg()] = dtype
    if model_config.init_from_scratch:
        model = cls.from_config(hf_config, **kwargs)
    else:
        path = resolve_model_path(model_config.path, f"{key}.path")
        model = cls.from_pretrained(path, config=hf_config, **kwargs)
    model = model.to(dtype)
    model.config.use_cache = False
    if model_config.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_config.enable_activation_offload and role in ("actor", "critic"):
        from hybridrl.models.activation_offload import enable_activation_offload

        enable_activation_offload(model)
    if model_config.lora_rank > 0 or model_config.lora_adapter_path:
        model = _apply_lora(model, model_config, role)
    if role in ("ref", "reward"):
        model.requires_grad_(False)
    model.train(role in ("actor", "critic"))
    return model


HEAD_NAMES = ("score", "classifier")


def _without_head(exclude: list[str] | str | None) -> list[str] | str:
    """PEFT's exclude_modules plus the value / reward head: the head is trained whole beside the
    adapter (PEFT's token-classification task keeps a trainable copy), so it gets no LoRA."""
    if isinstance(exclude, str):  # a regular expression, matched against the full module name
        return f"(?:{exclude})|(?:.*\\.)?(?:{'|'.join(HEAD_NAMES)})"
    return list(exclude or []) + list(HEAD_NAMES)


def _apply_lora(model: nn.Module, model_config: ModelConfig, role: str) -> nn.Module:
    """Wrap `model` with a new LoRA adapter, or load the trained one at `lora_adapter_path`
    (veRL's key; trainable for the actor/critic, frozen for the ref)."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    if model_config.enable_gradient_checkpointing:
        model.enable_input_require_grads()
    if model_config.lora_adapter_path:
        return PeftModel.from_pretrained(
            model, model_config.lora_adapter_path, is_trainable=role in ("actor", "critic")
        )
    task = TaskType.CAUSAL_LM if role in ("actor", "ref") else TaskType.TOKEN_CLS
    target = model_config.target_modules
    target = list(target) if isinstance(target, (list, tuple)) else target
    exclude = model_config.exclude_modules
    exclude = list(exclude) if isinstance(exclude, (list, tuple)) else exclude
    if task == TaskType.TOKEN_CLS:
        exclude = _without_head(exclude)
    lora = LoraConfig(
        task_type=task,
        r=model_config.lora_rank,
        lora_alpha=model_config.lora_alpha,
        target_modules=target,
        exclude_modules=exclude,  # veRL's model.exclude_modules (PEFT's matching)
        bias="none",
    )
    return get_peft_model(model, lora)
