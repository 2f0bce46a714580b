"""GSM8K preprocessing on hand-written rows in GSM8K's original jsonl/parquet layouts."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from hybridrl.data.preprocess.gsm8k import INSTRUCTION, extract_gsm8k_answer, main, preprocess_gsm8k
from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset

TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {
        "question": "A car costs $1,200 and a bike $300. Total?",
        "answer": "1200+300=<<1200+300=1500>>1500\n#### 1,500",
    },
    {"question": "It is 5 degrees and drops 8. Temperature?", "answer": "5-8=<<5-8=-3>>-3\n#### -3"},
]
TEST = [{"question": "What is 2 times 0.5?", "answer": "2*0.5=<<2*0.5=1>>1\n#### 1.0"}]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_extract_answer():
    assert extract_gsm8k_answer("so 7\n#### 7") == "7"
    assert extract_gsm8k_answer("#### 1,500") == "1500"
    assert extract_gsm8k_answer("#### -3") == "-3"
    with pytest.raises(ValueError, match='no "####"'):
        extract_gsm8k_answer("the answer is 7")


def test_jsonl_to_rl_schema(tmp_path, tokenizer):
    src, out = tmp_path / "gsm8k", tmp_path / "out"
    src.mkdir()
    write_jsonl(src / "train.jsonl", TRAIN)
    write_jsonl(src / "test.jsonl", TEST)
    main(["--local_dir", str(src), "--out_dir", str(out)])

    train = pd.read_parquet(out / "train.parquet")
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert len(train) == 3
    row = train.iloc[1]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert list(row["prompt"]) == [
        {"role": "user", "content": "A car costs $1,200 and a bike $300. Total? " + INSTRUCTION}
    ]
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1500"}
    assert row["extra_info"] == {
        "split": "train",
        "index": 1,
        "answer": TRAIN[1]["answer"],
        "question": TRAIN[1]["question"],
    }
    assert [r["ground_truth"] for r in train["reward_model"]] == ["7", "1500", "-3"]

    test = pd.read_parquet(out / "test.parquet")
    assert test.iloc[0]["reward_model"]["ground_truth"] == "1.0"
    assert test.iloc[0]["extra_info"]["split"] == "test"

    # the output feeds RLHFDataset directly
    ds = RLHFDataset(str(out / "train.parquet"), tokenizer, RLDataConfig(max_prompt_length=128))
    item = ds[2]
    assert item["index"] == 2 and item["reward_model"]["ground_truth"] == "-3"
    # <|user|> ... <|end|><|assistant|> around the question + instruction (one id per character)
    content = TRAIN[2]["question"] + " " + INSTRUCTION
    assert item["raw_prompt_ids"][0] == 3 and item["raw_prompt_ids"][-2:] == [6, 4]
    assert len(item["raw_prompt_ids"]) == len(content) + 3
    assert int(item["attention_mask"].sum()) == len(item["raw_prompt_ids"])


def test_hub_parquet_layout(tmp_path):
    src = tmp_path / "gsm8k" / "main"
    src.mkdir(parents=True)
    pd.DataFrame(TRAIN).to_parquet(src / "train-00000-of-00001.parquet")
    paths = preprocess_gsm8k(tmp_path / "gsm8k", tmp_path / "out", splits=["train"])
    assert len(pd.read_parquet(paths["train"])) == 3


def test_clear_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"no GSM8K 'train' file.*notes.txt"):
        preprocess_gsm8k(empty, tmp_path / "out")
    bad = tmp_path / "bad"
    bad.mkdir()
    write_jsonl(bad / "train.jsonl", [TRAIN[0], {"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"train.jsonl' row 1"):
        preprocess_gsm8k(bad, tmp_path / "out", splits=["train"])
    cols = tmp_path / "cols"
    cols.mkdir()
    write_jsonl(cols / "train.jsonl", [{"problem": "q", "solution": "#### 1"}])
    with pytest.raises(KeyError, match="question"):
        preprocess_gsm8k(cols, tmp_path / "out", splits=["train"])
