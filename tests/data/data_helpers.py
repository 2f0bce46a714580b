"""Helpers for the data tests: a character-level tokenizer with a delimited chat template.

Ids: <pad>=0 <eos>=1 <unk>=2 <|user|>=3 <|assistant|>=4 <|system|>=5 <|end|>=6, then one id per
character of CHARS starting at 7 ('a'=7, 'b'=8, ..., 'z'=32, '0'=33, ..., '9'=42, ' '=43).
"""

from __future__ import annotations

import pandas as pd
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-=#?.,:'\"\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_id(c: str) -> int:
    return len(SPECIALS) + CHARS.index(c)


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[3:],
    )
    tok.chat_template = chat_template
    return tok


def write_parquet(path, rows: list[dict]) -> str:
    pd.DataFrame(rows).to_parquet(path, index=False)
    return str(path)
