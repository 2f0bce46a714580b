"""`python -m hybridrl.model_merger merge --backend megatron`: a Megatron checkpoint -> a HF folder.

Reads the `dist/` folder a MegatronEngine checkpoint holds (Megatron dist_checkpointing, torch
DCP format) in this one process, without torch.distributed. Its tensors are global (the same for
any TP/PP layout the run used): each decoder tensor is stacked over layers (L, ...), the fused
QKV is group-major and the fused fc1 is [gate; up] (the TP=1 layout); a MoE layer's routed
experts are stacked once more (E, ...), whatever the expert-parallel size of the run. They are converted with
the engine's own mapping (convert.py) and saved with the HF config of `--hf_model_path` (the model
the run started from; default `<local_dir>/huggingface`). Causal-LM checkpoints (actor) only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from hybridrl.engine.megatron.convert import arch_spec, megatron_layer_to_hf
from hybridrl.utils.safe_io import load_state_file

__all__ = ["megatron_to_hf_state_dict", "merge_megatron_checkpoint", "read_dist_checkpoint"]

_LAYER_NAMES = {  # Megatron checkpoint key (layers stacked) -> per-layer name used by convert.py
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
}


def read_dist_checkpoint(local_dir: str) -> dict[str, torch.Tensor]:
    """The model tensors of a Megatron dist checkpoint (`local_dir/dist` or `local_dir`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = Path(local_dir).expanduser()
    folder = root / "dist" if (root / "dist").is_dir() else root
    if not (folder / ".metadata").exists() or not (folder / "metadata.json").exists():
        raise ValueError(
            f"no Megatron dist checkpoint in {local_dir!r} (expected dist/.metadata): point --local_dir at a folder "
            "written by the Megatron engine (e.g. .../global_step_N/actor)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(str(folder), out)
        state = load_state_file(out)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}


def megatron_to_hf_state_dict(state: dict[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """HF causal-LM tensors from global Megatron checkpoint tensors."""
    spec = arch_spec(hf_config)
    if "output_layer.bias" in state:
        raise ValueError(
            "this is a critic (value-head) checkpoint; the merger writes causal-LM (actor) models"
        )
    prefix = "decoder.layers."
    v = spec.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:v]}
    stacked = {k[len(prefix) :]: t for k, t in state.items() if k.startswith(prefix)}
    for i in range(spec.num_layers):
        layer = _merge_lora(_experts_per_name({_LAYER_NAMES.get(k, k): t[i] for k, t in stacked.items()}))
        for name, t in megatron_layer_to_hf(layer, spec, tp=1).items():
            out[f"model.layers.{i}.{name}"] = t.clone()
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"][:v]
    return out


def _merge_lora(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA actor's layer (engine/megatron/lora.py): each adapted weight W + scale * B @ A, factors dropped."""
    for name in [k for k in layer if k.endswith(".lora_A")]:
        base = name[: -len(".lora_A")]
        a, b, scale = layer.pop(name), layer.pop(f"{base}.lora_B"), float(layer.pop(f"{base}.lora_scale"))
        w = layer[f"{base}.weight"]
        layer[f"{base}.weight"] = w + ((b.float() @ a.float()) * scale).to(w.dtype)
    return layer


_EXPERTS = "mlp.experts.experts."  # a MoE layer's routed experts, stacked (E, ...) per layer


def _experts_per_name(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoE layer's stacked expert tensors (E, ...) -> one `mlp.experts.local_experts.{e}.*` each (global e)."""
    out = {}
    for name, t in layer.items():
        if name.startswith(_EXPERTS):
            rest = name[len(_EXPERTS) :]
            out.update({f"mlp.experts.local_experts.{e}.{rest}": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def merge_megatron_checkpoint(
    local_dir: str, target_dir: str, hf_model_path: str | None = None, dtype: str | None = None
) -> str:
    """Write the HF folder of the Megatron checkpoint in `local_dir` to `target_dir`; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.utils.torch_utils import str_to_dtype

    root = Path(local_dir).expanduser().resolve()
    source = hf_model_path or str(root / "huggingface")
    source = resolve_model_path(source, key="--hf_model_path")
    config = AutoConfig.from_pretrained(source)
    hf = megatron_to_hf_state_dict(read_dist_checkpoint(str(root)), config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(hf, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the checkpoint has no value for {missing[:5]}")
    if dtype:
        model = model.to(str_to_dtype(dtype))
    out = Path(target_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(str(out))
    except (OSError, ValueError, TypeError):
        pass  # the source has no tokenizer
    print(f"[hybridrl model_merger] merged Megatron checkpoint {root} into {out}", flush=True)
    return str(out)
