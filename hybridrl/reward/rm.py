"""Learned reward model scoring (used by `RewardModelWorker`).

Shapes: B batch, P prompt length, T response length, S = P + T.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.config.roles import ModelConfig, RewardModelConfig
from hybridrl.protocol import DataProto


def model_config_of(config: RewardModelConfig) -> ModelConfig:
    """The `ModelConfig` the FSDP engine builds the reward model from."""
    m = config.model
    if not m.path:
        raise ValueError(
            "reward_model.enable=True needs reward_model.model.path (a sequence-classification model)"
        )
    return ModelConfig(
        path=m.path,
        trust_remote_code=m.trust_remote_code,
        override_config=dict(m.override_config),
        external_lib=m.external_lib,
        use_remove_padding=m.use_remove_padding,
    )


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, T) with each score on the last valid response token."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.long().sum(-1) - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = scores.float().cpu()
    return out * (response_mask.sum(-1, keepdim=True) > 0)


def retemplate(
    data: DataProto, policy_tok: Any, rm_tok: Any, max_length: int | None
) -> dict[str, torch.Tensor]:
    """Decode with the policy tokenizer, re-apply the RM's chat template, re-tokenise (right-padded)."""
    prompts, responses = data.batch["prompts"], data.batch["responses"]
    pmask = data.batch["attention_mask"][:, : prompts.shape[1]].bool()
    rmask = data.batch["response_mask"].bool()
    raw = data.non_tensor_batch.get("raw_prompt")
    texts = []
    for i in range(len(data)):
        response = policy_tok.decode(responses[i][rmask[i]], skip_special_tokens=True)
        if raw is not None and isinstance(raw[i], (list, tuple)):
            chat = [dict(m) for m in raw[i]] + [{"role": "assistant", "content": response}]
        else:
            prompt = policy_tok.decode(prompts[i][pmask[i]], skip_special_tokens=True)
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        if getattr(rm_tok, "chat_template", None):
            texts.append(rm_tok.apply_chat_template(chat, tokenize=False))
        else:
            texts.append("\n".join(m["content"] for m in chat))
    pad_side = rm_tok.padding_side
    rm_tok.padding_side = "right"
    try:
        enc = rm_tok(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=max_length is not None,
            max_length=max_length,
            add_special_tokens=False,
        )
    finally:
        rm_tok.padding_side = pad_side
    mask = enc["attention_mask"]
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }


def rm_inputs(
    data: DataProto, policy_tok: Any, rm_tok: Any, max_length: int | None
) -> dict[str, torch.Tensor]:
    """What the reward model reads, (B, S') tensors: the batch's own input_ids / attention_mask /
    position_ids, or (policy_tok given: the tokenizers differ) the re-templated text."""
    if policy_tok is None:
        return {k: data.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    if rm_tok is None:
        raise ValueError("reward_model.model.path has no tokenizer; re-templating needs one")
    return retemplate(data, policy_tok, rm_tok, max_length)


def token_lists(inputs: dict[str, torch.Tensor]) -> list[list[int]]:
    """(B, S') input_ids / attention_mask -> the B valid token-id sequences."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    return [ids[i][mask[i]].tolist() for i in range(len(ids))]


def right_padded(seqs: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Token-id sequences -> right-padded input_ids / attention_mask / position_ids (B, max len)."""
    width = max((len(x) for x in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def compute_rm_scores(
    engine: Any, config: RewardModelConfig, data: DataProto, policy_tokenizer: Any
) -> torch.Tensor:
    """Score every sample with the reward model; returns (B, T) float32 (score on the last response token)."""
    from tensordict import TensorDict

    from hybridrl.engine.forward import forward_scores
    from hybridrl.utils.device import get_torch_device

    tensors = rm_inputs(data, policy_tokenizer, engine.tokenizer, config.max_length)
    batch = TensorDict(tensors, batch_size=[len(data)]).to(get_torch_device())
    micro = config.micro_batch_size_per_gpu or len(data)
    engine.module.eval()
    scores = []
    with torch.no_grad():
        for start in range(0, len(data), micro):
            scores.append(
                forward_scores(
                    engine.module,
                    batch[start : start + micro],
                    use_remove_padding=config.model.use_remove_padding,
                )
            )
    seq_scores = torch.cat(scores) if scores else torch.zeros(0)
    return place_on_last_token(seq_scores, data.batch["response_mask"])
