"""SFTDataset / MultiTurnSFTDataset on the character tokenizer (ids in data_helpers)."""

from __future__ import annotations

import pandas as pd
import pytest
from data_helpers import CHAT_TEMPLATE, make_char_tokenizer, write_parquet

from hybridrl.data.sft_dataset import MultiTurnSFTDataset, SFTDataConfig, SFTDataset

U, A, S, END, EOS = 3, 4, 5, 6, 1  # <|user|> <|assistant|> <|system|> <|end|> <eos>
a, b, c, d, e, f = 7, 8, 9, 10, 11, 12


def test_single_turn_chat_prompt_response_eos(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "sft.parquet", [{"prompt": "ab", "response": "c"}])
    item = SFTDataset(path, tokenizer, SFTDataConfig(max_length=10))[0]
    # "<|user|>ab<|end|><|assistant|>" then "c" + <eos>, right-padded with <pad>=0
    assert item["input_ids"].tolist() == [U, a, b, END, A, c, EOS, 0, 0, 0]
    assert item["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert item["attention_mask"].tolist() == [1] * 7 + [0] * 3
    assert item["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 6, 6]


def test_single_turn_raw_text_and_dict_keys(tmp_path, tokenizer):
    rows = [{"extra_info": {"question": "ab", "answer": "cd"}}]
    path = write_parquet(tmp_path / "sft.parquet", rows)
    cfg = SFTDataConfig(
        prompt_key="extra_info",
        response_key="extra_info",
        prompt_dict_keys=("question",),
        response_dict_keys=("answer",),
        max_length=5,
        use_chat_template=False,
    )
    item = SFTDataset(path, tokenizer, cfg)[0]
    assert item["input_ids"].tolist() == [a, b, c, d, EOS]
    assert item["loss_mask"].tolist() == [0, 0, 1, 1, 1]
    cfg2 = SFTDataConfig.from_verl(
        {"prompt_key": "extra_info", "prompt_dict_keys": ["question"], "multiturn": {"messages_key": "conv"}}
    )
    assert cfg2.prompt_dict_keys == ("question",) and cfg2.messages_key == "conv"


def test_single_turn_truncation(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "sft.parquet", [{"prompt": "abc", "response": "def"}])
    raw = dict(max_length=4, use_chat_template=False)
    with pytest.raises(ValueError) as err:
        SFTDataset(path, tokenizer, SFTDataConfig(**raw))[0]
    msg = str(err.value)
    for part in (
        "sft.parquet",
        "row 0",
        "7 tokens",
        "max_length=4",
        "'prompt'",
        "'response'",
        "data.truncation",
    ):
        assert part in msg
    left = SFTDataset(path, tokenizer, SFTDataConfig(truncation="left", **raw))[0]
    assert left["input_ids"].tolist() == [d, e, f, EOS] and left["loss_mask"].tolist() == [1, 1, 1, 1]
    right = SFTDataset(path, tokenizer, SFTDataConfig(truncation="right", **raw))[0]
    assert right["input_ids"].tolist() == [a, b, c, d] and right["loss_mask"].tolist() == [0, 0, 0, 1]


def test_missing_column_and_empty_file(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "sft.parquet", [{"prompt": "ab", "answer": "c"}])
    with pytest.raises(KeyError) as err:
        SFTDataset(path, tokenizer, SFTDataConfig())
    assert "sft.parquet" in str(err.value) and "'response'" in str(err.value)
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"messages": pd.Series([], dtype=object)}).to_parquet(empty)
    with pytest.raises(ValueError, match="empty.parquet"):
        MultiTurnSFTDataset(str(empty), tokenizer, SFTDataConfig())


CONVERSATION = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "ab"},
    {"role": "assistant", "content": "c"},
    {"role": "user", "content": "d"},
    {"role": "assistant", "content": "ef"},
]


def test_multi_turn_loss_only_on_assistant_tokens(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "chat.parquet", [{"messages": CONVERSATION}])
    item = MultiTurnSFTDataset(path, tokenizer, SFTDataConfig(max_length=20))[0]
    s_ = 7 + 18  # 's'
    expected_ids = [S, s_, END, U, a, b, END, A, c, END, U, d, END, A, e, f, END]
    assert item["input_ids"].tolist() == expected_ids + [0, 0, 0]
    # the assistant header is prompt (0); content and its <|end|> are learned (1)
    mask = item["loss_mask"].tolist()
    assert [i for i, m in enumerate(mask) if m] == [8, 9, 14, 15, 16]
    assert item["attention_mask"].tolist() == [1] * 17 + [0] * 3
    # the pieces tokenised one by one equal the whole rendering tokenised at once
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected_ids


def test_multi_turn_truncation_and_errors(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "chat.parquet", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=r"chat.parquet' row 0.*17 tokens.*\['messages'\]"):
        MultiTurnSFTDataset(path, tokenizer, SFTDataConfig(max_length=5))[0]
    left = MultiTurnSFTDataset(path, tokenizer, SFTDataConfig(max_length=5, truncation="left"))[0]
    assert left["input_ids"].tolist() == [END, A, e, f, END] and left["loss_mask"].tolist() == [0, 0, 1, 1, 1]

    no_assistant = write_parquet(tmp_path / "u.parquet", [{"messages": CONVERSATION[:2]}])
    with pytest.raises(ValueError, match="no assistant message"):
        MultiTurnSFTDataset(no_assistant, tokenizer, SFTDataConfig())[0]
    with pytest.raises(ValueError, match="chat_template"):
        MultiTurnSFTDataset(path, make_char_tokenizer(chat_template=None), SFTDataConfig())


def test_multi_turn_rejects_non_prefix_template(tmp_path):
    # earlier assistant turns are rendered as "x": the rendering of a prefix is not a text prefix
    template = CHAT_TEMPLATE.replace(
        "{{ m['content'] }}",
        "{% if m['role'] == 'assistant' and not loop.last %}x{% else %}{{ m['content'] }}{% endif %}",
    )
    path = write_parquet(tmp_path / "chat.parquet", [{"messages": CONVERSATION}])
    ds = MultiTurnSFTDataset(path, make_char_tokenizer(template), SFTDataConfig(max_length=20))
    with pytest.raises(ValueError, match="row 0.*message 3"):
        ds[0]
