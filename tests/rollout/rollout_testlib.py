"""Helpers for the rollout tests: a tiny Qwen2 checkpoint, a char tokenizer, prompt batches."""

from __future__ import annotations

import torch

CHARS = list("0123456789+-=#*/ abcdefghijklmnopqrstuvwxyz.,?")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2


def make_char_tokenizer():
    """Character-level tokenizer: <pad>=0, <eos>=1, <bos>=2, then one id per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    fast.padding_side = "left"
    return fast


def make_tiny_qwen2(path: str, seed: int = 0, init_std: float = 0.2, **shape):
    """Save a Qwen2 (hidden 128, 2 layers, 2 heads of dim 64, tied embeddings) and its tokenizer;
    `shape` overrides config fields (e.g. num_key_value_heads for grouped-query attention).

    A large init std gives peaked next-token distributions, so greedy argmax is far from ties
    and engines with different kernels agree exactly.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = make_char_tokenizer()
    fields = dict(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=init_std,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
    )
    cfg = Qwen2Config(**{**fields, **shape})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def make_prompts(tokenizer, texts, meta_info=None):
    """Left-padded prompt DataProto (input_ids, attention_mask, position_ids) for `texts`."""
    from hybridrl.protocol import DataProto

    enc = tokenizer(texts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return DataProto.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": pos},
        {"raw_prompt": list(texts)},
        meta_info or {},
    )


def plain_generate(model, prompts, max_new_tokens: int, **gen):
    """`model.generate` on a prompt DataProto (no EOS, pad PAD_ID): the new tokens (B, max_new_tokens)."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=PAD_ID,
            eos_token_id=None,
            **gen,
        )
    return out[:, ids.shape[1] :]


# ---- partial rollout (hybridrl/rollout/resume.py) ----------------------------------------
class AbortAfter:
    """abort_requested() that turns true after `steps` calls: HFRollout asks after every decode
    step, VLLMRollout before every engine step (its first step is the prefill)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.calls = steps, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls > self.steps


def with_partial(prompts, cols=None):
    """`prompts` with the four partial columns (fresh ones unless `cols` is given)."""
    from hybridrl.rollout.resume import fresh_partial_columns

    prompts.non_tensor_batch.update(cols or fresh_partial_columns(len(prompts)))
    return prompts


def carry_partial(out):
    """The partial columns of the next call, from an output batch (as the manager builds them)."""
    from hybridrl.rollout.resume import fresh_partial_columns

    cols = fresh_partial_columns(len(out))
    for i in range(len(out)):
        n = int(out.batch["response_mask"][i].sum())
        cols["partial_response"][i] = out.batch["responses"][i, :n].tolist()
        if "rollout_log_probs" in out.batch.keys():
            cols["partial_log_probs"][i] = out.batch["rollout_log_probs"][i, :n].tolist()
        cols["partial_versions"][i] = out.batch["rollout_versions"][i, :n].tolist()
        cols["partial_done"][i] = bool(out.non_tensor_batch["partial_done"][i])
    return cols
