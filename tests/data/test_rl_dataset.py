"""RLHFDataset, collate_fn and create_rl_dataset on a character-level tokenizer (ids in data_helpers)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest
import torch
from data_helpers import make_char_tokenizer, write_parquet

from hybridrl.data.rl_dataset import (
    DataColumnError,
    RLDataConfig,
    RLHFDataset,
    collate_fn,
    create_rl_dataset,
    truncate_ids,
)
from hybridrl.protocol import DataProto

# "<|user|>ab<|end|><|assistant|>" -> [<|user|>, a, b, <|end|>, <|assistant|>]
AB_CHAT_IDS = [3, 7, 8, 6, 4]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def gsm_row(prompt, gt: str, index: int | None = None) -> dict:
    extra = {"split": "train"} if index is None else {"split": "train", "index": index}
    return {
        "data_source": "toy",
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": extra,
    }


def test_left_padding_mask_and_position_ids(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "a.parquet", [gsm_row(chat("ab"), "7", index=41)])
    ds = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=8))
    item = ds[0]
    assert item["input_ids"].tolist() == [0, 0, 0] + AB_CHAT_IDS
    assert item["attention_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert item["position_ids"].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    assert item["input_ids"].dtype == torch.long and item["attention_mask"].dtype == torch.long
    assert item["raw_prompt_ids"] == AB_CHAT_IDS
    # other columns pass through; the prompt column does not (unless return_raw_chat)
    assert item["reward_model"] == {"style": "rule", "ground_truth": "7"}
    assert item["data_source"] == "toy" and item["ability"] == "math"
    assert item["extra_info"]["split"] == "train"
    assert item["index"] == 41
    assert "prompt" not in item and "raw_prompt" not in item and "full_prompts" not in item


def test_exact_fit_has_no_padding_and_string_prompt_is_raw(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "a.parquet", [{"prompt": "abc"}])
    item = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=3))[0]
    assert item["input_ids"].tolist() == [7, 8, 9]  # no chat template, no special tokens
    assert item["attention_mask"].tolist() == [1, 1, 1]
    assert item["position_ids"].tolist() == [0, 1, 2]
    assert item["index"] == 0  # no extra_info.index: row position


def test_raw_chat_and_full_prompt(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "a.parquet", [gsm_row(chat("ab"), "1")])
    cfg = RLDataConfig(max_prompt_length=6, return_raw_chat=True, return_full_prompt=True)
    item = RLHFDataset(path, tokenizer, cfg)[0]
    assert list(item["raw_prompt"]) == [{"role": "user", "content": "ab"}]
    assert item["full_prompts"] == "<|user|>ab<|end|><|assistant|>"


@pytest.mark.parametrize(
    "mode,max_len,expected",
    [
        ("left", 4, [11, 12, 13, 14]),  # e f g h
        ("right", 4, [7, 8, 9, 10]),  # a b c d
        ("middle", 4, [7, 8, 13, 14]),  # a b | g h
        ("middle", 5, [7, 8, 12, 13, 14]),  # a b | f g h (head 5//2=2, tail 3)
    ],
)
def test_truncation_modes(tmp_path, tokenizer, mode, max_len, expected):
    path = write_parquet(tmp_path / "a.parquet", [{"prompt": "abcdefgh"}])
    item = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=max_len, truncation=mode))[0]
    assert item["input_ids"].tolist() == expected
    assert item["raw_prompt_ids"] == expected
    assert item["attention_mask"].tolist() == [1] * max_len
    assert truncate_ids(list(range(8)), 8, mode) == list(range(8))  # short enough: unchanged


def test_truncation_error_names_file_row_length_and_fix(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "long.parquet", [{"prompt": "ab"}, {"prompt": "abcdefgh"}])
    ds = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=4), files_key="data.val_files")
    assert ds[0]["input_ids"].tolist() == [0, 0, 7, 8]
    with pytest.raises(ValueError) as err:
        ds[1]
    msg = str(err.value)
    for part in (
        "long.parquet",
        "row 1",
        "8 tokens",
        "max_prompt_length=4",
        "data.truncation=left|right|middle",
    ):
        assert part in msg
    assert "filter_overlong_prompts=True" in msg and "data.val_files" in msg


def test_filter_overlong_prompts_drops_and_logs(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "abc"}, {"prompt": "abcdefgh"}, {"prompt": "ab"}]
    path = write_parquet(tmp_path / "a.parquet", rows)
    with caplog.at_level(logging.INFO, logger="hybridrl.data.rl_dataset"):
        ds = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=4, filter_overlong_prompts=True))
    assert len(ds) == 2
    assert [ds[i]["raw_prompt_ids"] for i in range(2)] == [[7, 8, 9], [7, 8]]
    assert [ds[i]["index"] for i in range(2)] == [0, 2]  # original row positions
    assert "dropped 1 of 3" in caplog.text
    with pytest.raises(ValueError, match="every prompt is longer"):
        RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=1, filter_overlong_prompts=True))


def test_multiple_files_and_max_samples(tmp_path, tokenizer):
    a = write_parquet(tmp_path / "a.parquet", [{"prompt": "a", "tag": 0}, {"prompt": "b", "tag": 1}])
    b_rows = [{"prompt": "c", "tag": 2, "only_b": "x"}, {"prompt": "abcdef", "tag": 3, "only_b": "y"}]
    b = write_parquet(tmp_path / "b.parquet", b_rows)
    ds = RLHFDataset([a, b], tokenizer, RLDataConfig(max_prompt_length=3))
    assert len(ds) == 4
    assert ds[0]["only_b"] is None and ds[2]["only_b"] == "x"  # a column missing from a file reads None
    assert [ds[i]["tag"] for i in range(3)] == [0, 1, 2]
    assert [ds[i]["raw_prompt_ids"] for i in range(3)] == [[7], [8], [9]]
    with pytest.raises(ValueError, match=r"b\.parquet' row 1"):  # row numbering is per file
        ds[3]
    assert len(RLHFDataset([a, b], tokenizer, RLDataConfig(max_prompt_length=3, max_samples=3))) == 3


def test_missing_file_names_file_and_key(tmp_path, tokenizer):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError) as err:
        RLHFDataset(str(missing), tokenizer, RLDataConfig(), files_key="data.val_files")
    assert "nope.parquet" in str(err.value) and "data.val_files" in str(err.value)


def test_missing_prompt_column_lists_columns(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "q.parquet", [{"question": "ab", "answer": "1"}])
    with pytest.raises(DataColumnError) as err:
        RLHFDataset(path, tokenizer, RLDataConfig())
    assert isinstance(err.value, KeyError)
    msg = str(err.value)
    assert "q.parquet" in msg and "'prompt'" in msg and "['question', 'answer']" in msg


def test_empty_file_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(path)
    with pytest.raises(ValueError, match="empty.parquet.*no rows"):
        RLHFDataset(str(path), tokenizer, RLDataConfig())
    zero_bytes = tmp_path / "zero.parquet"
    zero_bytes.write_bytes(b"")
    with pytest.raises(ValueError, match="zero.parquet"):
        RLHFDataset(str(zero_bytes), tokenizer, RLDataConfig())


def test_chat_prompt_needs_chat_template(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", [{"prompt": chat("ab")}])
    ds = RLHFDataset(path, make_char_tokenizer(chat_template=None), RLDataConfig(max_prompt_length=8))
    with pytest.raises(ValueError, match="no chat_template"):
        ds[0]


def test_config_validation_and_from_verl():
    with pytest.raises(ValueError, match="data.truncation"):
        RLDataConfig(truncation="both")
    with pytest.raises(ValueError, match="max_prompt_length"):
        RLDataConfig(max_prompt_length=0)
    cfg = RLDataConfig.from_verl(
        {"prompt_key": "q", "max_prompt_length": 64, "train_batch_size": 8, "val_max_samples": 5}, split="val"
    )
    assert (cfg.prompt_key, cfg.max_prompt_length, cfg.max_samples) == ("q", 64, 5)


def test_collate_stacks_tensors_and_keeps_objects_1d(tmp_path, tokenizer):
    rows = [gsm_row(chat("ab"), "1", 0), gsm_row("abc", "2", 1), gsm_row(chat("a"), "3", 2)]
    path = tmp_path / "mixed.jsonl"  # parquet cannot hold string and list prompts in one column
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=6, return_raw_chat=True))
    batch = collate_fn([ds[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 6) and batch["attention_mask"].shape == (3, 6)
    assert batch["input_ids"][1].tolist() == [0, 0, 0, 7, 8, 9]
    for key in ("raw_prompt_ids", "raw_prompt", "reward_model", "index"):
        assert isinstance(batch[key], np.ndarray) and batch[key].dtype == object and batch[key].shape == (3,)
    assert batch["raw_prompt_ids"][2] == [3, 7, 6, 4]
    assert [r["ground_truth"] for r in batch["reward_model"]] == ["1", "2", "3"]
    proto = DataProto.from_single_dict(batch)
    assert len(proto) == 3 and proto.batch["position_ids"].shape == (3, 6)
    with pytest.raises(ValueError, match="different shapes"):
        collate_fn([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}])


def test_reserved_column_is_rejected(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "a.parquet", [{"prompt": "a", "input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="input_ids"):
        RLHFDataset(path, tokenizer, RLDataConfig())


CUSTOM_CLS = """
from torch.utils.data import Dataset

class TinyDataset(Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None):
        self.files = data_files
        self.n = config.max_prompt_length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i}

class NotADataset:
    pass
"""


def test_create_rl_dataset_custom_class(tmp_path, tokenizer):
    module = tmp_path / "my_data.py"
    module.write_text(CUSTOM_CLS)
    cfg = RLDataConfig(max_prompt_length=3)
    ds = create_rl_dataset(
        "x.parquet", tokenizer, cfg, custom_cls_path=str(module), custom_cls_name="TinyDataset"
    )
    assert type(ds).__name__ == "TinyDataset" and len(ds) == 3 and ds.files == "x.parquet"
    with pytest.raises(FileNotFoundError, match="data.custom_cls.path"):
        create_rl_dataset("x", tokenizer, cfg, custom_cls_path=str(tmp_path / "none.py"), custom_cls_name="A")
    with pytest.raises(AttributeError, match=r"no 'Missing'.*TinyDataset"):
        create_rl_dataset("x", tokenizer, cfg, custom_cls_path=str(module), custom_cls_name="Missing")
    with pytest.raises(TypeError, match="subclass"):
        create_rl_dataset("x", tokenizer, cfg, custom_cls_path=str(module), custom_cls_name="NotADataset")
    with pytest.raises(ValueError, match="data.custom_cls.name"):
        create_rl_dataset("x", tokenizer, cfg, custom_cls_path=str(module))
    path = write_parquet(tmp_path / "a.parquet", [{"prompt": "a"}])
    assert isinstance(create_rl_dataset(path, tokenizer, cfg), RLHFDataset)


def test_filter_overlong_prompts_workers_keep_the_same_rows(tmp_path, tokenizer):
    """data.filter_overlong_prompts_workers=2 measures the prompts in two spawned processes; the rows
    kept (and their order) equal the in-process filter's."""
    rows = [{"prompt": "abcdefgh"[: 1 + (i * 5) % 8]} for i in range(12)]  # lengths 1..8, some > 4
    path = write_parquet(tmp_path / "a.parquet", rows)

    def kept(workers):
        ds = RLHFDataset(
            path,
            tokenizer,
            RLDataConfig(
                max_prompt_length=4, filter_overlong_prompts=True, filter_overlong_prompts_workers=workers
            ),
        )
        return [ds[i]["index"] for i in range(len(ds))]

    one = kept(1)
    assert one == [i for i in range(12) if 1 + (i * 5) % 8 <= 4] and 0 < len(one) < 12
    assert kept(2) == one
    with pytest.raises(ValueError, match="filter_overlong_prompts_workers must be an int >= 1"):
        RLDataConfig(filter_overlong_prompts_workers=0)
