"""The built-in tiny model, its tokenizer and the built-in task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from hybridrl.data import builtin_task
from hybridrl.models import builtin
from hybridrl.models.tokenizer_builder import CHAT_TEMPLATE, build_tokenizer


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny-model generate is several times faster on one thread when the 2 cores are shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_one_token_per_character(tokenizer):
    text = "12+34= #### 46\nHello, World! ~{}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids[:3]) == ["1", "2", "+"]


def test_tokenizer_special_tokens(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids("<unk>") == tokenizer.unk_token_id == 3
    # one <unk> per UTF-8 byte (the vocabulary is byte-level; "é" is two bytes)
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [3, 3]
    assert tokenizer.decode([1, 5, 25, 2], skip_special_tokens=True) == "1"


def test_chat_template_prompt_and_assistant_turn(tokenizer):
    msgs = [{"role": "user", "content": "12+34="}]
    prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|user|>12+34=<|assistant|>"
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) == 9 and ids[0] == tokenizer.bos_token_id
    full = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, *msgs, {"role": "assistant", "content": "#### 46"}],
        tokenize=False,
    )
    assert full == "<s><|system|>s<|user|>12+34=<|assistant|>#### 46</s>"
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert full_ids[-1] == tokenizer.eos_token_id


def test_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(Exception, match="unsupported chat role function"):
        tokenizer.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_chat_template_tool_message_is_a_user_turn(tokenizer):
    msgs = [
        {"role": "user", "content": "1*2="},
        {"role": "assistant", "content": "c"},
        {"role": "tool", "content": "2"},
    ]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>1*2=<|assistant|>c</s><|user|><tool_response>2</tool_response><|assistant|>"


def test_tokenizer_saved_folder_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.eos_token == "</s>" and loaded.pad_token == "<pad>"
    assert loaded.decode(loaded("7+8=")["input_ids"]) == "7+8="


@pytest.mark.parametrize("folder", ["fresh", "shipped"])
def test_auto_tokenizer_keeps_spaces_and_newlines_next_to_a_qwen2_config(tmp_path, tokenizer, folder):
    """transformers 5 loads a folder whose config.json says qwen2 with Qwen2Tokenizer, rebuilt from
    the vocabulary: with plain " "/"\\n" keys it dropped every space and newline (SFT, agent turns)."""
    import shutil

    from transformers import AutoTokenizer

    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.hf import load_tokenizer

    shipped = builtin.get_builtin_model_path()
    path = shipped
    if folder == "fresh":
        build_tokenizer(tmp_path)
        shutil.copy(os.path.join(shipped, "config.json"), tmp_path)
        path = str(tmp_path)
    text = "<|user|>12 + 34 =\n<|assistant|>#### 46\nok"
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    for tok in (AutoTokenizer.from_pretrained(path), load_tokenizer(ModelConfig(path=path))):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == want and tok.decode(ids) == text


def test_load_tokenizer_refuses_a_tokenizer_that_drops_whitespace(tmp_path):
    """A character vocabulary spelt with plain keys (the built-in folder before 2026-12-02)."""
    import json
    import shutil

    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.hf import load_tokenizer

    build_tokenizer(tmp_path)
    shutil.copy(os.path.join(builtin.get_builtin_model_path(), "config.json"), tmp_path)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab[" "], vocab["\n"] = vocab.pop("\u0120"), vocab.pop("\u010a")
    tj["pre_tokenizer"], tj["decoder"] = None, {"type": "Fuse"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="drops whitespace"):
        load_tokenizer(ModelConfig(path=str(tmp_path)))


# ---------------------------------------------------------------- shipped model


@pytest.fixture(scope="module")
def shipped():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = builtin.get_builtin_model_path()
    return (
        path,
        AutoTokenizer.from_pretrained(path),
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
    )


def test_shipped_model_loads_and_is_tiny_qwen2(shipped):
    path, tok, model = shipped
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads == 64 and getattr(cfg, "head_dim", 64) == 64
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < n_params < 1_000_000
    assert os.path.getsize(Path(path) / "model.safetensors") < 10 * 2**20
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(path) / name).exists(), name


def test_shipped_model_forward_shapes(shipped):
    import torch

    _, tok, model = shipped
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 9, len(tok))
    assert torch.isfinite(logits).all()


def test_shipped_model_accuracy_leaves_room_for_rl():
    """Greedy exact match on the 200 validation prompts: learned something, far from solved."""
    acc = builtin.evaluate_greedy_accuracy(builtin.BUILTIN_MODEL_NAME, n=200)
    assert 0.15 <= acc <= 0.5, acc


def test_resolve_model_path(tmp_path):
    assert builtin.resolve_model_path("builtin:tiny") == builtin.get_builtin_model_path()
    assert builtin.resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert builtin.resolve_model_path("hdfs://ns/models/m") == "hdfs://ns/models/m"
    assert builtin.resolve_model_path(str(tmp_path)) == str(tmp_path)
    for missing in (str(tmp_path / "nope"), "./no/such/model", "~/no-such-model-dir", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="actor_rollout_ref.model.path"):
            builtin.resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="critic.model.path"):
        builtin.resolve_model_path("/no/such", key="critic.model.path")


def test_model_config_requires_head_dim_64():
    cfg = builtin.build_model_config(vocab_size=103, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert cfg.head_dim == 64 and cfg.num_attention_heads == 2
    with pytest.raises(ValueError, match="head_dim 64"):
        builtin.build_model_config(103, 1, 2, 0, hidden_size=128, num_attention_heads=4)


def test_build_builtin_model_writes_a_loadable_deterministic_folder(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info_a = builtin.build_builtin_model(tmp_path / "a", seed=3, sft_steps=2, batch_size=8, num_threads=1)
    builtin.build_builtin_model(tmp_path / "b", seed=3, sft_steps=2, batch_size=8, num_threads=1)
    assert info_a["sft_steps"] == 2 and info_a["params"] > 0
    AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(v.dtype == torch.float32 for v in wa.values())


# ---------------------------------------------------------------- task


def test_pairs_partition_all_operands_without_overlap():
    train, val = set(builtin_task.split_pool("train")), set(builtin_task.split_pool("val"))
    assert not train & val
    assert len(train) + len(val) == 90 * 90
    assert 0.05 < len(val) / 8100 < 0.15


def test_generator_is_deterministic_and_seeded():
    assert builtin_task.make_rl_rows(50, 7, "train") == builtin_task.make_rl_rows(50, 7, "train")
    assert builtin_task.make_rl_rows(50, 7, "train") != builtin_task.make_rl_rows(50, 8, "train")
    pairs = builtin_task.sample_pairs(500, 0, "val")
    n_val = len(builtin_task.split_pool("val"))
    assert len(set(pairs[:n_val])) == min(500, n_val)  # no repeats before the pool is used up


def test_train_and_val_rows_are_disjoint_for_any_seeds():
    train = {r["prompt"][0]["content"] for r in builtin_task.make_rl_rows(3000, 0, "train")}
    val = {r["prompt"][0]["content"] for r in builtin_task.make_rl_rows(800, 0, "val")}
    val_other_seed = {r["prompt"][0]["content"] for r in builtin_task.make_rl_rows(800, 5, "val")}
    assert not train & val and not train & val_other_seed


def test_rl_row_schema_and_ground_truth():
    row = builtin_task.make_rl_rows(3, 0, "val")[2]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == builtin_task.BUILTIN_DATA_SOURCE == "hybridrl/arith"
    assert row["ability"] == "math"
    assert row["extra_info"] == {"split": "val", "index": 2}
    (msg,) = row["prompt"]
    assert msg["role"] == "user" and msg["content"].endswith("=")
    a, b = (int(x) for x in msg["content"][:-1].split("+"))
    assert 10 <= a <= 99 and 10 <= b <= 99
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}


def test_rl_and_sft_parquet_round_trip(tmp_path):
    from hybridrl.reward.scorers import default_compute_score

    path = builtin_task.write_rl_parquet(tmp_path / "rl.parquet", 20, 0, "train")
    df = pd.read_parquet(path)
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert len(df) == 20
    assert df.iloc[0]["prompt"][0]["role"] == "user"
    sft = pd.read_parquet(builtin_task.write_sft_parquet(tmp_path / "sft.parquet", 10, 0))
    assert {"prompt", "response", "messages"} <= set(sft.columns)
    row = sft.iloc[4]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert row["messages"][0]["content"] == row["prompt"] and row["messages"][1]["content"] == row["response"]
    assert row["messages"][2]["content"] == sft.iloc[5]["prompt"]
    # The reference response earns full reward from the task's scorer.
    assert default_compute_score(row["data_source"], row["response"], row["ground_truth"]) == 1.0


def test_ensure_builtin_data_caches_and_regenerates(tmp_path):
    paths = builtin_task.ensure_builtin_data(tmp_path, n_train=30, n_val=10, n_sft_train=8, n_sft_val=4)
    assert set(paths) == {"train", "val", "sft_train", "sft_val"}
    assert len(pd.read_parquet(paths["train"])) == 30 and len(pd.read_parquet(paths["sft_val"])) == 4
    mtime = os.path.getmtime(paths["train"])
    again = builtin_task.ensure_builtin_data(tmp_path, n_train=30, n_val=10, n_sft_train=8, n_sft_val=4)
    assert again == paths and os.path.getmtime(paths["train"]) == mtime
    builtin_task.ensure_builtin_data(tmp_path, n_train=40, n_val=10, n_sft_train=8, n_sft_val=4)
    assert len(pd.read_parquet(paths["train"])) == 40


# ---------------------------------------------------------------- the MoE variant


def test_shipped_moe_model_is_a_tiny_qwen3_moe_that_the_engine_routes():
    import torch
    from transformers import AutoModelForCausalLM

    from hybridrl.models.moe import moe_shape

    path = builtin.resolve_model_path(builtin.BUILTIN_MOE_NAME)
    assert (
        path == builtin.get_builtin_model_path(builtin.BUILTIN_MOE_NAME) != builtin.get_builtin_model_path()
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe"
    assert moe_shape(model) == (2, 4, 2)  # 2 MoE layers, 4 experts, top-2
    info = json.loads((Path(path) / "build_info.json").read_text())
    assert info["arch"] == "moe" and info["sft_steps"] == builtin.DEFAULT_MOE_SFT_STEPS


def test_moe_model_config_is_sparse_in_every_layer():
    cfg = builtin.build_moe_model_config(vocab_size=103, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.decoder_sparse_step) == (4, 2, 1)
    assert cfg.mlp_only_layers == [] and cfg.head_dim == 64


def test_task_sft_model_is_built_once_cached_and_rebuilt_for_another_build(tmp_path, monkeypatch):
    """builtin:tiny-sft: the built-in model plus supervised steps, cached with the build's spec; a
    second call reuses the folder, a changed build (here the step count) replaces it."""
    import torch
    from safetensors.torch import load_file

    monkeypatch.setattr(builtin, "TASK_SFT_STEPS", 3)
    path = Path(builtin.task_sft_model_path(tmp_path))
    assert json.loads((path / "task_sft.json").read_text())["steps"] == 3
    trained = load_file(str(path / "model.safetensors"))
    base = load_file(str(Path(builtin.get_builtin_model_path()) / "model.safetensors"))
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the steps changed the weights
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert builtin.task_sft_model_path(tmp_path) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # cached: not rebuilt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(path)).chat_template
    AutoModelForCausalLM.from_pretrained(str(path))
    monkeypatch.setattr(builtin, "TASK_SFT_STEPS", 4)
    builtin.task_sft_model_path(tmp_path)
    assert json.loads((path / "task_sft.json").read_text())["steps"] == 4
    monkeypatch.setenv("HYBRIDRL_DATA_DIR", str(tmp_path / "data"))
    assert builtin.resolve_model_path(builtin.BUILTIN_SFT_NAME) == str(tmp_path / "builtin_tiny_sft")
