"""Preference pairs (data/preference.py): TRL's layouts, tokenisation, start-up row checks, built-in pairs."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from transformers import AutoTokenizer

from hybridrl.data.builtin_score import compute_score
from hybridrl.data.preference import (
    PreferenceDataConfig,
    PreferenceDataset,
    ensure_builtin_preference_data,
    make_preference_rows,
    pad_pairs,
)
from hybridrl.models.builtin import get_builtin_model_path


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(get_builtin_model_path())


def write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_explicit_text_pair_is_tokenised_like_sft(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "12+34=", "chosen": "#### 46", "rejected": "#### 45"}])
    ds = PreferenceDataset(path, tok, PreferenceDataConfig())
    item = ds[0]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, tokenize=False
    )
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    assert item["chosen_ids"].tolist() == p + tok("#### 46", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id
    ]
    assert item["chosen_mask"].tolist() == [0] * len(p) + [1] * (len(item["chosen_ids"]) - len(p))
    assert item["rejected_ids"][: len(p)].tolist() == p and item["margin"] == 0.0


def test_conversational_and_implicit_layouts_agree(tmp_path, tok):
    explicit = write(tmp_path, [{"prompt": "12+34=", "chosen": "#### 46", "rejected": "#### 45"}], "a.jsonl")
    conv = write(
        tmp_path,
        [{
            "prompt": [{"role": "user", "content": "12+34="}],
            "chosen": [{"role": "assistant", "content": "#### 46"}],
            "rejected": [{"role": "assistant", "content": "#### 45"}],
        }],
        "b.parquet",
    )  # fmt: skip
    implicit = write(
        tmp_path,
        [{
            "chosen": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "#### 46"}],
            "rejected": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "#### 45"}],
        }],
        "c.jsonl",
    )  # fmt: skip
    items = [PreferenceDataset(p, tok, PreferenceDataConfig())[0] for p in (explicit, conv, implicit)]
    for it in items[1:]:
        assert it["chosen_ids"].tolist() == items[0]["chosen_ids"].tolist()
        assert it["rejected_ids"].tolist() == items[0]["rejected_ids"].tolist()


def test_implicit_text_prompt_is_the_common_prefix(tmp_path, tok):
    path = write(tmp_path, [{"chosen": "Q: 1+1? A: two", "rejected": "Q: 1+1? A: three"}])
    ds = PreferenceDataset(path, tok, PreferenceDataConfig(use_chat_template=False))
    assert ds.split_row(0, ds.rows[0]) == ("Q: 1+1? A: ", "two", "three")


def test_margin_column(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3", "score_gap": 1.5}])
    ds = PreferenceDataset(path, tok, PreferenceDataConfig(margin_key="score_gap"))
    assert ds[0]["margin"] == 1.5
    batch = pad_pairs([ds[0], None], tok.pad_token_id, extra_column=True)
    assert batch["input_ids"].shape[0] == 4 and batch["valid"].tolist() == [1, 0, 1, 0]
    assert batch["margin"].tolist() == [1.5, 0.0]
    assert int(batch["attention_mask"].sum(-1).max()) == batch["input_ids"].shape[1] - 1


@pytest.mark.parametrize(
    "row, config, match",
    [
        ({"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 2"}, {}, "chosen equals rejected"),
        ({"prompt": "1+1=", "chosen": "#### 2"}, {}, "rejected"),
        (
            {"prompt": "1+1=" * 40, "chosen": "#### 2", "rejected": "#### 3"},
            {"max_prompt_length": 50},
            "max_prompt_length",
        ),
        (
            {"prompt": "1+1=", "chosen": "#### 2" * 50, "rejected": "#### 3"},
            {"max_length": 100, "max_prompt_length": 50},
            "data.max_length=",
        ),
        ({"prompt": "1+1=", "chosen": "  ", "rejected": "#### 3"}, {}, "empty completion"),
        (
            {"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3", "m": "x"},
            {"margin_key": "m"},
            "number",
        ),
    ],
)
def test_bad_rows_fail_naming_file_and_row(tmp_path, tok, row, config, match):
    good = {"prompt": "2+2=", "chosen": "#### 4", "rejected": "#### 5", "m": 1.0}
    if "rejected" not in row:
        good.pop("rejected")
    path = write(tmp_path, [good, row])
    with pytest.raises(Exception, match=match) as err:
        PreferenceDataset(path, tok, PreferenceDataConfig(**config))
    if "rejected" in row:
        assert "row 1" in str(err.value)


def test_builtin_pairs(tmp_path):
    rows = make_preference_rows(300, seed=0, split="val")
    for r in rows:
        assert r["chosen"] != r["rejected"]
        assert compute_score(r["chosen"], r["ground_truth"]) == 1.0
        assert compute_score(r["rejected"], r["ground_truth"]) == 0.0
    paths = ensure_builtin_preference_data(tmp_path, n_train=64, n_val=16)
    train = pd.read_parquet(paths["pref_train"])
    val = pd.read_parquet(paths["pref_val"])
    assert len(train) == 64 and len(val) == 16
    assert not set(train["prompt"]) & set(val["prompt"])  # held-out prompts
