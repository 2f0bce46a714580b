"""The trained reward model as a Hugging Face sequence-classification folder.

`main_rm` trains a per-token head (the engines' critic model: `AutoModelForTokenClassification`,
num_labels=1) and reads it at each sequence's last token, which is what a sequence-classification
model computes. The export writes `AutoModelForSequenceClassification` (num_labels=1, pad token set)
with the same backbone and head weights, so `reward_model.model.path` of main_ppo loads the folder
as it is. The token head's bias is dropped: the pairwise loss does not depend on it (it adds the
same constant to both scores), so it keeps its initial value 0 and the scores are unchanged.
A LoRA reward model (`model.lora_rank > 0`: the adapter and the head trained) is exported merged:
each adapted weight W + scale * B A under the base name, and the trained head.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["export_reward_model", "sequence_classification_class"]


def sequence_classification_class(hf_config: Any, key: str = "model.partial_pretrain") -> type:
    """The transformers sequence-classification class of `hf_config`'s model type.

    Raises:
        ValueError: transformers has none for this model type (the model cannot carry a reward head).
    """
    from transformers import AutoModelForSequenceClassification

    mapping = AutoModelForSequenceClassification._model_mapping
    try:
        return mapping[type(hf_config)]
    except KeyError:
        raise ValueError(
            f"{key}: model type {hf_config.model_type!r} has no sequence-classification class in transformers, "
            "so no reward head can be put on it; start from a model whose architecture has one "
            "(e.g. Qwen2, Llama, Mistral, Gemma)"
        ) from None


def export_reward_model(engine: Any, out_dir: str, tokenizer: Any = None) -> None:
    """Write the engine's reward model to `out_dir` as a sequence-classification folder (a collective).

    Raises:
        RuntimeError: the head's bias moved away from 0 (the scores would shift if it were dropped).
    """
    from hybridrl.engine.full_params import iter_full_params

    rank = dist.get_rank() if dist.is_initialized() else 0
    module = getattr(engine, "module", None)  # FSDP2; None: the Megatron engine (its HF-named tensors)
    if module is not None:
        tensors = iter_full_params(module, device="cpu")  # LoRA merged into the weights
    else:
        tensors = engine.iter_full_params(device="cpu")
    full: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if rank == 0:
            full[name] = tensor.detach().clone()
    if rank == 0:
        full = _trained_head_names(full)
        bias = full.pop("score.bias", None)
        if bias is not None and bias.abs().max() > 0:
            raise RuntimeError(
                f"reward head bias is {bias.tolist()}, not 0: the sequence-classification export has no bias"
            )
        if module is not None:
            base = module.get_base_model() if hasattr(module, "get_base_model") else module
            source = base.config
        else:
            from transformers import AutoConfig

            source = AutoConfig.from_pretrained(engine.model_config.path)
        config = source.__class__.from_dict(source.to_dict())
        config.num_labels = 1
        config.architectures = None
        if tokenizer is not None and tokenizer.pad_token_id is not None:
            config.pad_token_id = tokenizer.pad_token_id
        cls = sequence_classification_class(config)
        config.architectures = [cls.__name__]
        if module is not None:
            with torch.device("meta"):
                model = cls(config)
        else:  # built for real: its non-persistent buffers (rotary inv_freq) come from the config
            model = cls(config)
        missing, unexpected = model.load_state_dict(full, strict=False, assign=True)
        left = missing if module is None else [n for n, p in model.named_parameters() if p.is_meta]
        if unexpected or left:
            raise RuntimeError(
                f"reward-model export: names that do not fit {cls.__name__}: {unexpected or missing}"
            )
        for name, buf in base.named_buffers() if module is not None else ():  # non-persistent buffers
            owner, _, leaf = name.rpartition(".")
            target = model.get_submodule(owner) if owner else model
            if leaf in target._buffers:
                target._buffers[leaf] = buf.detach().to("cpu").clone()
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()


def _trained_head_names(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA reward model's tensors under the plain model's names: PEFT keeps the head it trains
    beside the adapter (`score.modules_to_save.<adapter>.*`) and the untouched original
    (`score.original_module.*`); the trained copy is the head, the original is dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if ".original_module." in name:
            continue
        if ".modules_to_save." in name:
            head, _, rest = name.partition(".modules_to_save.")
            name = f"{head}.{rest.split('.', 1)[1]}"
        out[name] = tensor
    return out
