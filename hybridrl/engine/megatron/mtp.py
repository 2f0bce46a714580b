"""Multi-token prediction (MTP) for the Megatron actor: veRL's `actor_rollout_ref.model.mtp.*`.

A model with MTP layers (DeepSeek-V3's layout: `num_nextn_predict_layers` = D in its config,
layer N + d - 1 of the HF checkpoint is MTP layer d, N = num_hidden_layers) gets megatron-core's
`MultiTokenPredictionBlock` on the last pipeline stage. MTP layer d combines the main model's
hidden state h_i^{d-1} with the embedding of token x_{i+d} (eh_proj of [enorm(e); hnorm(h)]),
runs one transformer layer and a final norm, and predicts x_{i+1+d} with the shared output layer.

Training (`mtp.enable_train`), as veRL (verl/models/mcore/mtp_patch.py) and megatron-core:

    L_MTP = mtp_loss_scaling_factor / D * sum_{d=1..D} mean_{i in M_d} CE(softmax(W h_i^d), x_{i+1+d})

M_d: positions whose target x_{i+1+d} is a response token (`response_mask`) of the same sequence.
The output layer W is detached for this loss (the MTP loss does not move the LM head, as veRL),
and with `mtp.detach_encoder` the main model's hidden states and the token embeddings fed to the
MTP layers are detached too, so the MTP loss trains the MTP layers only. The loss enters the
backward through megatron-core's `MTPLossAutoScaler` (gradient scale 1 / number of
micro-batches, set by Megatron's schedule), so the PPO loss and its logits are unchanged.
The MTP block runs only when targets are given (the update's forward); log-prob passes skip it.

Pipeline parallelism: the MTP block sits on the last stage, which then holds a copy of the word
embedding (megatron-core's layout: GPTModel builds it where `mtp_process`, starts it from the first
stage's by an all-reduce, and sums the two copies' gradients over the embedding group in
finalize_model_grads); the HF weights load into both copies, the export takes the first stage's.

Context parallelism: the labels and loss mask are built for the whole fed row and each CP rank
takes its positions (engine/megatron/forward.py); the MTP layers' one-position roll of the tokens
per depth crosses chunk boundaries, which megatron-core's `roll_tensor` handles (it exchanges the
boundary tokens with the neighbouring CP ranks, for the same load-balanced 2 x CP chunks); the
loss is normalised over the whole micro-batch (`_mtp_loss`).

Shapes: b rows, S (padded) or L (packed) positions, D MTP layers, V_local vocabulary slice.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any

import torch

from hybridrl.engine.batching import response_mask_of
from hybridrl.engine.megatron.convert import ArchSpec, hf_layer_to_megatron
from hybridrl.engine.megatron.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = [
    "add_mtp_metrics",
    "drop_unused_output_weight",
    "mtp_block_spec",
    "mtp_full_tensors",
    "mtp_inputs",
    "mtp_num_layers_of",
    "read_mtp_tensors",
    "resolve_mtp",
    "with_mtp_config",
]

_OWN = {  # DeepSeek-V3 MTP tensor (under model.layers.{N+d-1}.) -> Megatron (under mtp.layers.{d-1}.)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
}


def mtp_num_layers_of(hf_config: Any) -> int:
    """D of a HF config: `num_nextn_predict_layers` (DeepSeek-V3, MiMo) or `mtp_num_hidden_layers`."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
            if cfg is not None and int(getattr(cfg, name, 0) or 0) > 0:
                return int(getattr(cfg, name))
    return 0


def read_mtp_tensors(model_path: str, first_layer: int, n: int, key: str) -> dict[str, torch.Tensor]:
    """The HF tensors `model.layers.{first_layer .. first_layer + n - 1}.*` of the folder's safetensors.

    transformers' model classes drop these layers when loading, so they are read from the files.
    """
    from safetensors import safe_open

    prefixes = tuple(f"model.layers.{first_layer + d}." for d in range(n))
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    out[name] = f.get_tensor(name)
    if not any(name.startswith(f"{prefixes[-1]}eh_proj") for name in out):
        raise ValueError(
            f"{key}.mtp.enable=True: {model_path} declares {n} MTP layer(s) but its safetensors files have no "
            f"{prefixes[-1]}eh_proj.weight (DeepSeek-V3's MTP layout); use a checkpoint with its MTP weights"
        )
    return out


def mtp_full_tensors(hf: dict[str, torch.Tensor], spec: ArchSpec, tp: int, n: int) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (`mtp.layers.{d}.*`) of the n MTP layers in a HF state dict."""
    out = {}
    for d in range(n):
        prefix = f"model.layers.{spec.num_layers + d}."
        layer = {k[len(prefix) :]: v for k, v in hf.items() if k.startswith(prefix)}
        for h, m in _OWN.items():
            out[f"mtp.layers.{d}.{m}"] = layer[h]
        for name, t in hf_layer_to_megatron(layer, spec, tp).items():
            out[f"mtp.layers.{d}.transformer_layer.{name}"] = t
    return out


def mtp_block_spec(layer_spec: Any, norm: type, n: int) -> Any:
    """megatron-core's MTP block spec of n layers, each with the decoder's layer spec and `norm`."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            eh_proj=ColumnParallelLinear,
            transformer_layer=layer_spec,
            layer_norm=norm,
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * n)


def mtp_inputs(micro: Any, packed: Any, n: int) -> dict[str, torch.Tensor]:
    """`labels` / `loss_mask` (n, b, S) (packed: (n, 1, L)) for the model's MTP loss.

    labels[d-1, r, i] = x_{i+1+d}; loss_mask[d-1, r, i] = 1 where position i is a token and
    x_{i+1+d} a response token (`response_mask`) of the same row (the module docstring's M_d).
    """
    ids, valid = micro["input_ids"], micro["attention_mask"].bool()
    b, s = ids.shape
    resp = torch.zeros_like(valid)
    resp[:, -micro["responses"].shape[-1] :] = response_mask_of(micro).bool()
    labels, masks = ids.new_zeros(n, b, s), torch.zeros(n, b, s, dtype=torch.float32, device=ids.device)
    for d in range(1, n + 1):
        shift = 1 + d
        if shift < s:
            labels[d - 1, :, :-shift] = ids[:, shift:]
            masks[d - 1, :, :-shift] = (valid[:, :-shift] & resp[:, shift:]).float()
    length = s if packed is None else packed.input_ids.shape[1]
    if packed is None or not hasattr(packed, "valid"):  # padded rows (right-padded to `length` for SP)
        pad = (0, length - s)
        return {
            "labels": torch.nn.functional.pad(labels, pad),
            "loss_mask": torch.nn.functional.pad(masks, pad),
        }
    flat_l, flat_m = labels[:, packed.valid], masks[:, packed.valid]  # (n, tokens), in packing order
    pad = length - flat_l.shape[1]
    flat_l = torch.cat([flat_l, flat_l.new_zeros(n, pad)], dim=1)
    flat_m = torch.cat([flat_m, flat_m.new_zeros(n, pad)], dim=1)
    return {"labels": flat_l[:, None], "loss_mask": flat_m[:, None]}


def _cp_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """`t` summed over the context-parallel group (a detached copy; `t` itself when group is None)."""
    if group is None:
        return t
    t = t.detach().clone()
    torch.distributed.all_reduce(t, group=group)
    return t


def _mtp_loss(model: Any, hidden: list[torch.Tensor], labels, loss_mask, weight) -> torch.Tensor:
    """L_MTP (0-d) from the MTP layers' hidden states [(S, b, H)] x D (module docstring).

    With context parallelism each CP rank holds some positions of every row (their labels and mask
    sliced alike, engine/megatron/forward.py): it returns CP x (its positions' CE sum) / (the micro-
    batch's mask count over all CP ranks), so the CP ranks' losses sum to CP x the CP=1 mean; Megatron's DDP averages
    the gradients over DP x CP and MTPLossAutoScaler scales by 1 / micro-batches only, which makes
    the gradient the CP=1 one. The reported losses are the whole rows' means (summed over CP).
    """
    from megatron.core import parallel_state as ps

    from hybridrl.engine.megatron.context_parallel import cp_group_info

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    cp, _, cp_group = cp_group_info()
    cfg, losses = model.config, []
    for d, h in enumerate(hidden):
        logits, _ = model.output_layer(h, weight=weight.detach())  # W detached (module docstring)
        lp, _ = vocab_parallel_logprobs_entropy(
            logits.transpose(0, 1).float(), labels[d], vocab_size=model.hybridrl_vocab_size,
            tp_rank=ps.get_tensor_model_parallel_rank(), group=group,
        )  # fmt: skip
        mask = loss_mask[d]
        losses.append(-(lp * mask).sum() / _cp_sum(mask.sum(), cp_group).clamp(min=1))
    model.hybridrl_mtp_losses = [float(x) for x in _cp_sum(torch.stack(losses).detach(), cp_group)]
    return cfg.mtp_loss_scaling_factor / len(hidden) * torch.stack(losses).sum() * cp


def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                 rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, attention_mask=None,
                 runtime_gather_output=None, **_: Any):  # fmt: skip
    """GPTModel._postprocess with hybridrl's MTP loss; always returns the main logits (b, S, V_local)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    if not self.post_process:
        return hidden_states
    weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    if mtp_in_postprocess and labels is not None:
        detach = self.hybridrl_detach_encoder
        embed = self.embedding
        embedding = (lambda **kw: embed(**kw).detach()) if detach else embed
        out = self.mtp(
            input_ids=input_ids, position_ids=position_ids,
            hidden_states=hidden_states.detach() if detach else hidden_states,
            attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, embedding=embedding,
        )  # fmt: skip
        mtp_hidden = list(torch.chunk(out, 1 + self.config.mtp_num_layers, dim=0))[1:]
        w = weight if weight is not None else self.output_layer.weight
        hidden_states = MTPLossAutoScaler.apply(
            hidden_states, _mtp_loss(self, mtp_hidden, labels, loss_mask, w)
        )
    logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1).contiguous()


def drop_unused_output_weight(model: Any) -> None:
    """With tied embeddings, a last PP stage holding the MTP block scores with its embedding copy
    (`shared_embedding_or_output_weight`), so megatron-core 0.16.1's separately allocated output_layer
    weight there is never used, and its sharded_state_dict asserts that this weight does not exist
    (checkpoints failed). Remove it, as megatron-core's own comment says the layout intends."""
    if model.share_embeddings_and_output_weights and model.mtp_process and not model.pre_process:
        model.output_layer.weight = None


@functools.cache
def mtp_gpt_model_class() -> type:
    """megatron-core's GPTModel with `_postprocess` replaced by the one above (MTP loss, logits out)."""
    from megatron.core.models.gpt import GPTModel

    return type("MTPGPTModel", (GPTModel,), {"_postprocess": _postprocess})


def resolve_mtp(model_config: Any, hf_config: Any, mcfg: Any, role: str, model_key: str, key: str) -> int:
    """How many MTP layers this role's engine builds: D of the model for the actor with mtp.enable, else 0.

    The reference, teachers and critic never build them (veRL forces the reference's MTP off).
    """
    mtp = getattr(model_config, "mtp", None)
    if role != "actor" or mtp is None or not mtp.enable:
        return 0
    n = mtp_num_layers_of(hf_config)
    if n == 0:
        raise ValueError(
            f"{model_key}.mtp.enable=True but the model at {model_config.path} has no MTP layers (config "
            f"num_nextn_predict_layers / mtp_num_hidden_layers); use a model with MTP layers or set mtp.enable=False"
        )
    return n


def with_mtp_config(mcfg: Any, n: int, scaling_factor: float) -> Any:
    """`mcfg` with megatron-core's MTP fields in override_transformer_config (as veRL sets them)."""
    import dataclasses

    extra = {"mtp_num_layers": n, "mtp_loss_scaling_factor": float(scaling_factor)}
    return dataclasses.replace(
        mcfg, override_transformer_config={**(mcfg.override_transformer_config or {}), **extra}
    )


def add_mtp_metrics(
    loss_and_aux: tuple[torch.Tensor, Any], chunk: Any, n_micro: int
) -> tuple[torch.Tensor, Any]:
    """A micro-batch's (loss, aux) with its MTP losses (unscaled cross-entropy per depth) added to the
    aux's summed metrics, / n_micro so that the mini-batch's sum is the mean over its micro-batches."""
    loss, aux = loss_and_aux
    inner = getattr(chunk, "module", chunk)
    losses = getattr(inner, "hybridrl_mtp_losses", None)
    if losses is None or not (isinstance(aux, tuple) and aux and isinstance(aux[0], dict)):
        return loss, aux
    for d, value in enumerate(losses):
        aux[0][f"actor/mtp_losses/mtp_{d + 1}_loss"] = value / n_micro
    inner.hybridrl_mtp_losses = None
    return loss, aux
