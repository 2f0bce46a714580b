"""SFT trainer: loss function, lr schedules, config errors, and short runs on a tiny Qwen2 model.

The tiny model (hidden 128, 2 layers, 2 heads of dim 64, character tokenizer) is built in the
test with random weights; runs are single-process FSDP2 over gloo.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from hybridrl.engine.optim import lr_factor
from hybridrl.trainer.sft.config import load_sft_config
from hybridrl.trainer.sft.launch import init_distributed
from hybridrl.trainer.sft.trainer import SFTTrainer, sft_token_loss
from hybridrl.utils.config_loader import ConfigError


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One torch thread: the test machines are shared, and tiny ops gain nothing from more."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def build_tiny_model(path: str, seed: int = 0) -> str:
    from transformers import Qwen2ForCausalLM

    from hybridrl.models.builtin import build_model_config
    from hybridrl.models.tokenizer_builder import build_tokenizer

    tok = build_tokenizer(path)
    cfg = build_model_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybridrl.data.builtin_task import make_sft_rows

    root = tmp_path_factory.mktemp("sft")
    model = build_tiny_model(str(root / "model"))
    train, val = str(root / "train.parquet"), str(root / "val.parquet")
    pd.DataFrame(make_sft_rows(64, seed=0, split="train")).to_parquet(train)
    pd.DataFrame(make_sft_rows(16, seed=1, split="val")).to_parquet(val)
    return {"root": root, "model": model, "train": train, "val": val}


def overrides(tiny, tmp_path, **extra) -> dict:
    cfg = {
        "model": {"partial_pretrain": tiny["model"]},
        "data": {
            "train_files": tiny["train"],
            "val_files": tiny["val"],
            "train_batch_size": 16,
            "micro_batch_size_per_gpu": 8,
            "max_length": 32,
        },
        "optim": {"lr": 1e-3, "lr_warmup_steps_ratio": 0.0},
        "trainer": {"total_training_steps": 2, "default_local_dir": str(tmp_path / "ckpt"), "logger": []},
        "generation_eval": {"enable": False},
    }
    for dotted, value in extra.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def make_trainer(cfg: dict) -> SFTTrainer:
    config = load_sft_config(cfg)
    init_distributed(config)
    return SFTTrainer(config)


def params(trainer: SFTTrainer) -> dict[str, torch.Tensor]:
    from hybridrl.engine.fsdp import iter_full_params

    return {k: v.clone() for k, v in iter_full_params(trainer.engine.module, device="cpu")}


# ----------------------------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------------------------
def test_token_loss_uniform_logits_is_log_vocab():
    v = 7
    logits = torch.zeros(2, 5, v)
    ids = torch.randint(0, v, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    # loss tokens are t >= 1 with mask 1: 3 + 2 = 5, each -log(1/7)
    assert sft_token_loss(logits, ids, mask).item() == pytest.approx(5 * math.log(v), rel=1e-6)


def test_token_loss_uses_shifted_targets():
    logits = torch.full((1, 3, 4), -1e4)
    logits[0, 0, 2] = 0.0  # position 0 predicts token 2 with probability 1
    logits[0, 1, 3] = 0.0  # position 1 predicts token 3
    ids = torch.tensor([[0, 2, 1]])
    # token 1 (=2) is predicted perfectly, token 2 (=1) has log-prob -1e4
    assert sft_token_loss(logits, ids, torch.tensor([[0, 1, 0]])).item() == pytest.approx(0.0, abs=1e-4)
    assert sft_token_loss(logits, ids, torch.tensor([[0, 0, 1]])).item() == pytest.approx(1e4, rel=1e-4)


def test_prompt_token_labels_do_not_change_the_loss(tiny):
    """With the real dataset mask and model logits: rewriting prompt-position targets changes nothing."""
    from transformers import AutoModelForCausalLM

    from hybridrl.config.roles import ModelConfig
    from hybridrl.data.sft_dataset import SFTDataConfig, SFTDataset
    from hybridrl.models.hf import load_tokenizer

    tok = load_tokenizer(ModelConfig(path=tiny["model"]))
    ds = SFTDataset(tiny["train"], tok, SFTDataConfig(max_length=32))
    item = ds[0]
    ids, mask = item["input_ids"][None], item["loss_mask"][None]
    model = AutoModelForCausalLM.from_pretrained(tiny["model"]).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=item["attention_mask"][None]).logits
    base = sft_token_loss(logits, ids, mask)
    assert mask[0, :3].sum() == 0 and mask.sum() > 0
    changed = ids.clone()
    changed[mask == 0] = (changed[mask == 0] + 5) % len(tok)
    assert torch.equal(sft_token_loss(logits, changed, mask), base)
    first_response = int((mask[0] == 1).nonzero()[0].item())
    changed = ids.clone()
    changed[0, first_response] = (changed[0, first_response] + 5) % len(tok)
    assert not torch.equal(sft_token_loss(logits, changed, mask), base)


def test_lr_schedules_hand_values():
    common = {"warmup_steps": 2, "total_steps": 12, "min_lr_ratio": 0.0, "num_cycles": 0.5}
    assert lr_factor(0, scheduler_type="cosine", **common) == 0.0
    assert lr_factor(1, scheduler_type="cosine", **common) == 0.5
    assert lr_factor(2, scheduler_type="cosine", **common) == pytest.approx(1.0)
    assert lr_factor(7, scheduler_type="cosine", **common) == pytest.approx(
        0.5
    )  # half-way: (1 + cos(pi/2)) / 2
    assert lr_factor(12, scheduler_type="cosine", **common) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(9, scheduler_type="constant", **common) == 1.0
    # wsd: stable for int(0.5 * 10) = 5 steps after warm-up (steps 2..6), then cosine over steps 7..12
    wsd = {"scheduler_type": "wsd", "stable_ratio": 0.5, **common}
    assert lr_factor(6, **wsd) == 1.0
    assert lr_factor(7, **wsd) == pytest.approx(1.0)
    assert lr_factor(10, **wsd) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 5)))
    assert lr_factor(12, **{**wsd, "min_lr_ratio": 0.1}) == pytest.approx(0.1)
    # Megatron's lr_decay_style schedules: linear from 1 to min over steps 2..12; 1/sqrt after warm-up
    assert lr_factor(7, scheduler_type="linear", **common) == pytest.approx(0.5)
    assert lr_factor(12, scheduler_type="linear", **{**common, "min_lr_ratio": 0.1}) == pytest.approx(0.1)
    assert lr_factor(20, scheduler_type="linear", **common) == pytest.approx(0.0)
    assert lr_factor(2, scheduler_type="inverse_square_root", **common) == pytest.approx(1.0)
    assert lr_factor(8, scheduler_type="inverse_square_root", **common) == pytest.approx(0.5)  # sqrt(2/8)
    assert lr_factor(200, scheduler_type="inverse_square_root", **{**common, "min_lr_ratio": 0.2}) == 0.2
    with pytest.raises(ValueError, match="lr_scheduler"):
        lr_factor(5, scheduler_type="polynomial", **common)


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"data\.trian_files.*data\.train_files"):
        load_sft_config(["data.trian_files=x.parquet"])
    with pytest.raises(ConfigError, match="optim.lr_scheduler='linear'"):
        load_sft_config(["optim.lr_scheduler=linear"])
    with pytest.raises(ConfigError, match="micro_batch_size_per_gpu"):
        load_sft_config(["data.micro_batch_size=8"])


def test_command_line_keys_are_checked_before_hydra():
    from hybridrl.trainer.sft.config import SFTConfig
    from hybridrl.utils.config_loader import check_override_keys

    ok = [
        "model.override_config.attn_implementation=eager",
        "trainer.logger=[console]",
        "hydra.run.dir=.",
        "+data.multiturn.enable=true",
        "--config-name=sft_trainer",
    ]
    check_override_keys(ok, SFTConfig, "sft_trainer")
    with pytest.raises(ConfigError, match=r"'optim\.lrr'.*Did you mean optim\.lr"):
        check_override_keys(["optim.lrr=1"], SFTConfig, "sft_trainer")


def test_presets_follow_the_model(tiny):
    builtin = load_sft_config([])
    assert (builtin.optim.lr, builtin.data.train_batch_size) == (1e-3, 64)
    other = load_sft_config([f"model.partial_pretrain={tiny['model']}", f"data.train_files={tiny['train']}"])
    assert (other.optim.lr, other.data.train_batch_size, other.data.micro_batch_size_per_gpu) == (
        1e-5,
        256,
        4,
    )
    explicit = load_sft_config(["optim.lr=3e-4"])
    assert explicit.optim.lr == 3e-4
    with pytest.raises(ConfigError, match="data.train_files is not set"):
        load_sft_config([f"model.partial_pretrain={tiny['model']}"])


# ----------------------------------------------------------------------------------------------
# training runs
# ----------------------------------------------------------------------------------------------
def test_loss_decreases(tiny, tmp_path):
    trainer = make_trainer(
        overrides(tiny, tmp_path, trainer__total_training_steps=6, trainer__resume_mode="disable")
    )
    before = trainer.validation_loss()
    losses = [trainer.train_step(trainer._next_indices())["train/loss"] for _ in range(6)]
    after = trainer.validation_loss()
    assert after < before - 0.3, (before, after)
    assert losses[-1] < losses[0]


def test_gradient_accumulation_is_exact(tiny, tmp_path):
    """Micro-batches of 16 (no accumulation) and of 4 (4-way accumulation) give the same gradient."""
    from hybridrl.engine.full_params import gather_full

    results = []
    for micro in (16, 4):
        cfg = overrides(
            tiny, tmp_path / str(micro), data__micro_batch_size_per_gpu=micro, trainer__resume_mode="disable"
        )
        trainer = make_trainer(cfg)
        out = trainer.accumulate_gradients(trainer._next_indices())
        grads = {
            n: gather_full(p.grad, torch.device("cpu")).clone()
            for n, p in trainer.engine.module.named_parameters()
        }
        results.append((out, grads))
    (out_a, ga), (out_b, gb) = results
    assert out_a["train/loss_tokens"] == out_b["train/loss_tokens"] > 0
    assert out_a["train/loss"] == pytest.approx(out_b["train/loss"], rel=1e-6)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7)


def test_resume_continues_exactly(tiny, tmp_path):
    """4 steps in one run == 2 steps, checkpoint, fresh trainer resumes and runs 2 more."""
    common = {
        "trainer__total_training_steps": 4,
        "optim__lr_warmup_steps_ratio": 0.25,
        "data__train_batch_size": 32,
    }
    straight = make_trainer(overrides(tiny, tmp_path / "a", trainer__resume_mode="disable", **common))
    straight.fit()
    expected = params(straight)

    first = make_trainer(overrides(tiny, tmp_path / "b", trainer__save_freq=2, **common))
    first.fit(stop_at_step=2)
    root = tmp_path / "b" / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    step_dir = root / "global_step_2"
    for name in ("model/.metadata", "optimizer/.metadata", "data.pt", "huggingface/config.json", "meta.json"):
        assert (step_dir / name).exists(), name
    assert not list(root.glob("*.tmp"))

    second = make_trainer(overrides(tiny, tmp_path / "b", trainer__save_freq=2, **common))
    assert second.global_step == 0
    second.fit()
    assert second.global_step == 4
    got = params(second)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # 64 rows in batches of 32: 4 steps end epoch 1, so the restored sampler now points at epoch 2
    assert second.loader.sampler.state_dict()["epoch"] == 2
    # a finished run resumes at its last step, trains nothing and reports validation
    third = make_trainer(overrides(tiny, tmp_path / "b", trainer__save_freq=2, **common))
    final = third.fit()
    assert third.global_step == 4 and set(final) == {"val/loss"}
    assert torch.equal(params(third)[next(iter(expected))], next(iter(expected.values())))


def test_lora_trains_and_exports_a_merged_model(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = overrides(
        tiny,
        tmp_path,
        model__lora_rank=4,
        model__lora_alpha=8,
        trainer__save_freq=2,
        optim__lr=1e-2,
        trainer__resume_mode="disable",
    )
    trainer = make_trainer(cfg)
    assert hasattr(trainer.engine.module, "peft_config")
    trainable = [n for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.fit()
    step = tmp_path / "ckpt" / "global_step_2"
    assert (step / "lora_adapter" / "adapter_config.json").exists()
    merged = dict(params(trainer))
    base = AutoModelForCausalLM.from_pretrained(tiny["model"]).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(str(step / "huggingface")).state_dict()
    assert not any("lora" in k for k in exported)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(exported[q], base[q])  # the adapter moved the merged weight
    torch.testing.assert_close(exported[q], merged[q])
    torch.testing.assert_close(exported["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


@pytest.mark.parametrize("multiturn", [False, True])
def test_loss_tokens_are_the_assistant_tokens(tiny, tmp_path, multiturn):
    """The loss covers exactly each response's (each assistant turn's) tokens plus its EOS."""
    rows = pd.read_parquet(tiny["train"]).to_dict("records")
    trainer = make_trainer(
        overrides(
            tiny,
            tmp_path,
            data__multiturn={"enable": multiturn},
            data__max_length=40,
            trainer__resume_mode="disable",
        )
    )
    n_tokens = lambda text: len(trainer.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # noqa: E731
    indices = list(range(16))
    out = trainer.accumulate_gradients(indices)
    if multiturn:
        expected = sum(
            n_tokens(m["content"]) for i in indices for m in rows[i]["messages"] if m["role"] == "assistant"
        )
    else:
        expected = sum(n_tokens(rows[i]["response"]) for i in indices)
    assert out["train/loss_tokens"] == expected


def test_validation_reports_greedy_accuracy(tiny, tmp_path):
    trainer = make_trainer(
        overrides(
            tiny,
            tmp_path,
            generation_eval__enable=True,
            generation_eval__max_samples=4,
            generation_eval__max_new_tokens=4,
            trainer__resume_mode="disable",
        )
    )
    metrics = trainer.validate()
    assert set(metrics) >= {"val/loss", "val/greedy_acc", "val-core/hybridrl/arith/reward/mean@1"}
    assert metrics["val/greedy_acc"] == 0.0  # a random model cannot write "#### <sum>" in 4 tokens
    assert len(trainer._greedy_eval().rows) == 4


def test_same_seed_same_run(tiny, tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(
            overrides(tiny, tmp_path / name, model__lora_rank=2, trainer__resume_mode="disable")
        )
        runs.append(trainer.fit()["val/loss"])
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
def test_missing_column_names_file_and_column(tiny, tmp_path):
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"question": ["1+1="], "response": ["#### 2"]}).to_parquet(bad)
    with pytest.raises(KeyError, match=r"bad\.parquet.*no column 'prompt'"):
        make_trainer(overrides(tiny, tmp_path, data__train_files=str(bad)))


def test_empty_file_names_it(tiny, tmp_path):
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str), "response": pd.Series([], dtype=str)}).to_parquet(empty)
    with pytest.raises(ValueError, match=r"data\.train_files.*empty\.parquet.*no rows"):
        make_trainer(overrides(tiny, tmp_path, data__train_files=str(empty)))


def test_overlong_response_fails_at_start_naming_row(tiny, tmp_path):
    rows = pd.read_parquet(tiny["train"]).head(20)
    rows.loc[7, "response"] = "#### " + "9" * 60
    long_file = tmp_path / "long.parquet"
    rows.to_parquet(long_file)
    with pytest.raises(ValueError, match=r"long\.parquet' row 7.*data\.max_length=32.*truncation"):
        make_trainer(overrides(tiny, tmp_path, data__train_files=str(long_file)))
    trainer = make_trainer(
        overrides(tiny, tmp_path, data__train_files=str(long_file), data__truncation="right")
    )
    assert trainer.train_dataset[7]["attention_mask"].sum() == 32


def test_batch_larger_than_data(tiny, tmp_path):
    with pytest.raises(ConfigError, match="fewer than one batch"):
        make_trainer(overrides(tiny, tmp_path, data__train_batch_size=128))


# ----------------------------------------------------------------------------------------------
# entry points (slow: fresh interpreters)
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_match_one_rank(tiny, tmp_path):
    """torchrun with 2 gloo ranks and the single-process run take the same steps."""
    args = [
        f"model.partial_pretrain={tiny['model']}",
        f"data.train_files={tiny['train']}",
        "data.val_files=null",
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=4",
        "data.max_length=32",
        "optim.lr=1e-3",
        # eps 1e-3: gradients that are 0 in exact arithmetic are float noise whose value depends on the
        # order of the 2-rank reduction; Adam with eps 1e-8 divides such noise by its own size and moves
        # the weight by up to lr (test_sft_megatron.py compares engines the same way)
        "optim.eps=1e-3",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.logger=[]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, launcher in (
        ("one", [sys.executable, "-m"]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m"]),
    ):
        cmd = launcher + ["hybridrl.trainer.main_sft", *args, f"trainer.default_local_dir={tmp_path / name}"]
        subprocess.run(cmd, check=True, env=env, cwd=tmp_path, timeout=600)
    from transformers import AutoModelForCausalLM

    one = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "one" / "global_step_2" / "huggingface")
    ).state_dict()
    two = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "two" / "global_step_2" / "huggingface")
    ).state_dict()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-6)
    # the 2-rank shards merge (in one process, no process group) into the same weights
    from hybridrl.trainer.offline.model_merger import merge_checkpoint

    merged_dir = merge_checkpoint(str(tmp_path / "two" / "global_step_2"), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    for name in two:
        assert torch.equal(merged[name], two[name]), name


@pytest.mark.slow
def test_no_argument_run(tmp_path):
    """`python -m hybridrl.trainer.main_sft` trains the built-in model and reports loss and accuracy."""
    from hybridrl.models.builtin import get_builtin_model_path

    try:
        get_builtin_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.trainer.main_sft"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "HYBRIDRL_DATA_DIR": str(tmp_path / "data")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "val/greedy_acc" in out.stdout and "val/loss" in out.stdout
