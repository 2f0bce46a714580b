"""The built-in model's character-level tokenizer, built offline with the ``tokenizers`` library.

Every printable ASCII character and ``"\\n"`` is one token; any other character is one ``<unk>`` per
UTF-8 byte (``Qwen2Tokenizer``, which transformers 5 loads for this folder, drops it instead). Special
tokens: ``<pad>`` (0), ``<s>`` (bos, 1), ``</s>`` (eos, 2), ``<unk>`` (3) and three role markers
``<|system|>``, ``<|user|>``, ``<|assistant|>``, each a single token so chat prompts stay short:
``[{"role": "user", "content": "12+34="}]`` with a generation prompt is
``<s><|user|>12+34=<|assistant|>`` = 9 tokens, and every assistant turn ends with ``</s>``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values()]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]
MODEL_MAX_LENGTH = 256

# Jinja chat template: <s>, then each turn as <|role|>content; assistant turns end with </s>; a tool
# message is a user turn <|user|><tool_response>content</tool_response> (as in Qwen2.5's template).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role ' ~ message['role'] ~ ': use system, user, assistant or tool') }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>' ~ message['content'] ~ '</tool_response>' }}"
    "{% else %}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_char(c: str) -> str:
    """GPT-2's byte-level alphabet for one ASCII character: printable non-space bytes are
    themselves; space is ``"Ġ"`` (U+0120) and newline ``"Ċ"`` (U+010A)."""
    b = ord(c)
    return c if 33 <= b <= 126 else chr(256 + b)


def vocab() -> dict[str, int]:
    """Token -> id: special tokens first, then the characters in byte-level spelling.

    The ids are the characters' positions (``"\n"`` is 7, ``" "`` 8, ...); only the spelling of
    space and newline in the file is byte-level, so that every loader rebuilds the same pipeline:
    transformers 5's ``AutoTokenizer`` reads a folder whose ``config.json`` says ``qwen2`` with its
    own ``Qwen2Tokenizer`` (a byte-level pre-tokenizer over the file's vocabulary), which with
    plain-character keys dropped every space and newline.
    """
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [_byte_char(c) for c in CHARACTERS])}


def build_tokenizer(out_dir: str | os.PathLike | None = None):
    """Build the character-level tokenizer; save it to ``out_dir`` when given.

    Saves ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template, special tokens and
    ``tokenizer_class: PreTrainedTokenizerFast`` so transformers 4.x and 5.x both load it) and
    ``chat_template.jinja``.

    Returns:
        The ``transformers`` fast tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A BPE model without merges splits text into single (byte-level) characters.
    tok = Tokenizer(models.BPE(vocab=vocab(), merges=[], unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=MODEL_MAX_LENGTH,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(str(out))
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return hf_tok
