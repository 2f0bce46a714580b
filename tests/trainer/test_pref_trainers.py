"""main_rm / main_dpo on the built-in tiny model: short runs, export into main_ppo's reward-model
loader, exact resume, the reference paths of DPO, and the start-up errors.

One process group (gloo, world 1) for the module; each run is a few steps on a handful of pairs.
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from hybridrl.data.builtin_task import write_parquet
from hybridrl.data.preference import make_preference_rows, pad_pairs
from hybridrl.trainer.pref.config import load_pref_config
from hybridrl.trainer.pref.data import check_model_head, load_pref_datasets
from hybridrl.trainer.pref.launch import run_pref_config
from hybridrl.trainer.sft.launch import init_distributed
from hybridrl.utils.config_loader import ConfigError


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    train = write_parquet(make_preference_rows(16, 0, "train"), root / "train.parquet")
    val = write_parquet(make_preference_rows(6, 1, "val"), root / "val.parquet")
    return train, val


def config(kind, pair_files, out, **extra):
    train, val = pair_files
    overrides = {
        "data": {
            "train_files": train,
            "val_files": val,
            "train_batch_size": 8,
            "micro_batch_size_per_gpu": 4,
        },
        "trainer": {"default_local_dir": str(out), "total_epochs": 1, "val_before_train": False, "seed": 3},
    }
    for dotted, value in extra.items():
        section, key = dotted.split("__")
        overrides.setdefault(section, {})[key] = value
    return load_pref_config(kind, overrides)


def make_trainer(cfg):
    from hybridrl.trainer.pref.trainer import DPOTrainer, RewardModelTrainer

    tok, train, val, val_files = load_pref_datasets(cfg)
    init_distributed(cfg)
    cls = RewardModelTrainer if hasattr(cfg, "rm") else DPOTrainer
    return cls(cfg, train, val, tok, val_files)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}


# ----------------------------------------------------------------------------------------------
# main_rm
# ----------------------------------------------------------------------------------------------
def test_rm_run_exports_a_reward_model_main_ppo_loads(pair_files, tmp_path):
    from hybridrl.config.roles import RewardModelConfig, RewardModelModelConfig
    from hybridrl.engine.forward import forward_scores
    from hybridrl.models.hf import build_hf_model
    from hybridrl.reward.rm import model_config_of

    cfg = config("rm", pair_files, tmp_path, trainer__save_freq=2)
    metrics = run_pref_config("rm", cfg)
    assert set(metrics) >= {
        "val/loss",
        "val/accuracy",
        "val/margin",
        "val/chosen_reward",
        "val/rejected_reward",
    }
    assert 0.0 <= metrics["val/accuracy"] <= 1.0 and math.isfinite(metrics["val/loss"])
    assert json.loads((tmp_path / "latest_checkpointed_iteration.txt").read_text() or "0") == 2
    out = tmp_path / "reward_model"
    ckpt_hf = tmp_path / "global_step_2" / "huggingface"
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"
    ]
    # main_ppo's reward-model loader (the RewardModel worker's) takes the folder as it is
    rm_cfg = RewardModelConfig(enable=True, model=RewardModelModelConfig(path=str(out)))
    module = build_hf_model(model_config_of(rm_cfg), role="reward", key="reward_model.model")
    ckpt = build_hf_model(
        model_config_of(RewardModelConfig(model=RewardModelModelConfig(path=str(ckpt_hf)))), role="reward"
    )
    for (name, a), (_, b) in zip(module.state_dict().items(), ckpt.state_dict().items()):
        assert torch.equal(a, b), name
    # its scores are the trainer's validation scores: the pairwise loss / accuracy recomputed from them
    tok, _, val, _ = load_pref_datasets(cfg)
    batch = pad_pairs([val[i] for i in range(len(val))], tok.pad_token_id)
    with torch.no_grad():
        s = forward_scores(module, batch)
        hf = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(s, hf, atol=1e-5, rtol=0)
    n = len(val)
    loss = torch.nn.functional.softplus(-(s[:n] - s[n:])).mean()
    assert loss.item() == pytest.approx(metrics["val/loss"], abs=1e-5)
    assert (s[:n] > s[n:]).float().mean().item() == pytest.approx(metrics["val/accuracy"], abs=1e-6)


def test_rm_resume_is_exact(pair_files, tmp_path):
    full = make_trainer(config("rm", pair_files, tmp_path / "a", trainer__total_epochs=2))
    full.fit()
    expected = weights(full)
    cut = make_trainer(
        config("rm", pair_files, tmp_path / "b", trainer__total_epochs=2, trainer__save_freq=2)
    )
    cut.fit(stop_at_step=2)
    resumed = make_trainer(config("rm", pair_files, tmp_path / "b", trainer__total_epochs=2))
    resumed.fit()
    assert resumed.global_step == full.global_step == 4
    got = weights(resumed)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=0, rtol=0, msg=k)


def test_lora_reward_model_trains_adapter_and_head_and_exports_merged(pair_files, tmp_path):
    """model.lora_rank > 0: the adapter and the head train, the base weights stay; the export (LoRA
    merged) scores the validation pairs exactly as the trainer did."""
    from transformers import AutoModelForSequenceClassification

    t = make_trainer(config("rm", pair_files, tmp_path, model__lora_rank=4, optim__lr=1e-2))
    trained = {n for n, p in t.engine.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or ".modules_to_save." in n for n in trained)
    assert any("score.modules_to_save" in n for n in trained)
    before = weights(t)
    metrics = t.fit()
    after = weights(t)
    for name in before:
        moved = not torch.equal(before[name], after[name])
        assert moved == (".lora_" in name or "score.modules_to_save.default.weight" in name), name
    t.export(str(tmp_path / "rm"))
    module = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    tok, _, val, _ = load_pref_datasets(t.config)
    batch = pad_pairs([val[i] for i in range(len(val))], tok.pad_token_id)
    with torch.no_grad():
        s = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    n = len(val)
    assert torch.nn.functional.softplus(-(s[:n] - s[n:])).mean().item() == pytest.approx(
        metrics["val/loss"], abs=1e-5
    )
    assert (s[:n] - s[n:]).mean().item() == pytest.approx(metrics["val/margin"], abs=1e-5)


@pytest.mark.parametrize("exclude", [None, ["q_proj"], ".*q_proj"])
def test_lora_critic_head_is_trained_whole_not_adapted(exclude):
    """A LoRA value / reward model: every linear but the head gets an adapter (the user's
    exclude_modules, a list or a regular expression, still apply); the head is a trained copy."""
    import dataclasses

    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.models.hf import build_hf_model

    cfg = dataclasses.replace(
        ModelConfig(path=get_builtin_model_path(), lora_rank=4), exclude_modules=exclude
    )
    model = build_hf_model(cfg, role="critic")
    adapted = {n for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}
    assert adapted and not any("score" in n for n in adapted)
    assert any("q_proj" in n for n in adapted) == (exclude is None)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.score.modules_to_save.default.weight" in trained


# ----------------------------------------------------------------------------------------------
# main_dpo
# ----------------------------------------------------------------------------------------------
def test_dpo_first_step_loss_is_log2_and_ref_paths_agree(pair_files, tmp_path):
    """At step 0 the policy is the reference: h = 0, loss = log 2. Precomputed and live reference
    log-probs give the same training, step for step."""
    runs = {}
    for pre in (True, False):
        t = make_trainer(
            config(
                "dpo",
                pair_files,
                tmp_path / str(pre),
                dpo__precompute_ref_log_probs=pre,
                generation_eval__enable=False,
            )
        )
        t.fit()
        runs[pre] = (weights(t), t)
    first = runs[True][1]
    assert first.total_steps == 2
    for k, v in runs[True][0].items():
        torch.testing.assert_close(runs[False][0][k], v, atol=1e-6, rtol=0, msg=k)
    fresh = make_trainer(config("dpo", pair_files, tmp_path / "fresh", generation_eval__enable=False))
    m = fresh._forward_backward(fresh._rank_rows(list(range(8))))
    assert m["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert m["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("kind", ["rm", "dpo"])
def test_shared_prompt_forward_trains_like_the_plain_one(pair_files, tmp_path, kind):
    """model.use_prefix_grouper on (the default here) and off: the same losses and weights, step for step."""
    runs = {}
    for shared in (True, False):
        # Adam eps 1e-3: the two forwards sum in different orders, and Adam with eps 1e-8 turns the float
        # noise of near-zero gradients into steps of up to lr (1.04e-5 apart after 2 steps, seen)
        extra = {"model__use_prefix_grouper": shared, "optim__eps": 1e-3}
        if kind == "dpo":
            extra["generation_eval__enable"] = False
        t = make_trainer(config(kind, pair_files, tmp_path / str(shared), **extra))
        assert t.request.prefix_group is shared
        losses = [t.train_step(t._next_indices())["train/loss"] for _ in range(2)]
        runs[shared] = (losses, weights(t), t.validate())
    assert runs[True][0] == pytest.approx(runs[False][0], abs=1e-5)
    assert runs[True][2] == pytest.approx(runs[False][2], abs=1e-5)
    for k, v in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], v, atol=1e-5, rtol=0, msg=k)


@pytest.mark.parametrize("precompute", [True, False])
def test_dpo_resume_is_exact(pair_files, tmp_path, precompute):
    """Stopped after a checkpoint and resumed, DPO ends with the uninterrupted run's weights (the
    precomputed reference log-probs come back from the checkpoint, not from the trained model)."""

    def run(out, **extra):
        return make_trainer(
            config(
                "dpo", pair_files, tmp_path / out, trainer__total_epochs=2,
                dpo__precompute_ref_log_probs=precompute, generation_eval__enable=False, **extra,
            )
        )  # fmt: skip

    full = run("a")
    full.fit()
    expected = weights(full)
    run("b", trainer__save_freq=2).fit(stop_at_step=2)
    assert (tmp_path / "b" / "global_step_2" / "ref_logps.pt").exists() == precompute
    resumed = run("b")
    resumed.fit()
    assert resumed.global_step == full.global_step == 4
    got = weights(resumed)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=0, rtol=0, msg=k)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["sigterm", "sigusr1"])
def test_preempted_dpo_saves_the_step_and_resumes_exactly(pair_files, tmp_path, monkeypatch, signum):
    """main_dpo shares main_sft's preemption point: a signal during step 2 saves step 2 and exits
    128 + signal; the same command then ends with the uninterrupted run's weights."""
    from hybridrl.trainer.pref.trainer import DPOTrainer
    from hybridrl.utils import checkpointing as ck
    from hybridrl.utils.run_lock import LOCK_FILE

    def cfg(out, **extra):
        return config("dpo", pair_files, tmp_path / out, trainer__total_epochs=2, trainer__save_freq=3,
                      generation_eval__enable=False, **extra)  # fmt: skip

    full = make_trainer(cfg("a"))
    full.fit()
    expected = weights(full)
    original = DPOTrainer.train_step

    def signalled(self, indices):
        if self.global_step + 1 == 2:
            os.kill(os.getpid(), signum)
        return original(self, indices)

    with monkeypatch.context() as m:
        m.setattr(DPOTrainer, "train_step", signalled)
        with pytest.raises(SystemExit) as exited:
            run_pref_config("dpo", cfg("b"))
    assert exited.value.code == 128 + signum
    root = str(tmp_path / "b")
    assert ck.list_checkpoints(root) == [2] and not os.path.exists(os.path.join(root, LOCK_FILE))
    resumed = make_trainer(cfg("b"))
    resumed.fit()
    assert resumed.global_step == full.global_step == 4
    got = weights(resumed)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=0, rtol=0, msg=k)


def test_dpo_lora_reference_is_the_frozen_base(pair_files, tmp_path):
    t = make_trainer(
        config(
            "dpo",
            pair_files,
            tmp_path,
            model__lora_rank=4,
            dpo__loss_type="ipo",
            generation_eval__enable=False,
        )
    )
    table = t.precompute_reference(t.train_dataset)
    t.fit()
    again = t.precompute_reference(t.train_dataset)  # the base, after the adapter trained
    torch.testing.assert_close(again, table, atol=1e-5, rtol=0)


def test_simpo_runs_without_reference(pair_files, tmp_path):
    t = make_trainer(
        config("dpo", pair_files, tmp_path, dpo__loss_type="simpo", generation_eval__enable=False)
    )
    metrics = t.fit()
    assert t.ref_engine is None and not t._ref_cache and math.isfinite(metrics["val/loss"])


# ----------------------------------------------------------------------------------------------
# start-up errors
# ----------------------------------------------------------------------------------------------
def test_bad_pairs_fail_before_anything_starts(tmp_path, pair_files):
    rows = make_preference_rows(8, 0, "train")
    rows[5]["rejected"] = rows[5]["chosen"]
    bad = write_parquet(rows, tmp_path / "bad.parquet")
    cfg = config("rm", (bad, None), tmp_path)
    with pytest.raises(ConfigError, match="row 5: chosen equals rejected"):
        load_pref_datasets(cfg)
    missing = write_parquet([{"prompt": "1+1=", "chosen": "#### 2"}] * 8, tmp_path / "missing.parquet")
    with pytest.raises(ConfigError, match="rejected"):
        load_pref_datasets(config("dpo", (missing, None), tmp_path))


def test_model_without_a_classification_form_is_refused(tmp_path, pair_files):
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit"}))
    cfg = config("rm", pair_files, tmp_path, model__partial_pretrain=str(folder))
    with pytest.raises(ConfigError, match="no sequence-classification class"):
        check_model_head(cfg)


@pytest.mark.parametrize(
    "kind, extra, match",
    [
        ("rm", {"model__strategy": "megatron", "model__lora_rank": 4}, r"model\.lora_rank"),
        ("dpo", {"model__strategy": "megatron", "model__lora_rank": 4}, r"model\.lora_rank"),
        ("dpo", {"dpo__loss_type": "hinge"}, "dpo.loss_type"),
        ("dpo", {"dpo__beta": 0.0}, "dpo.beta"),
        ("dpo", {"dpo__label_smoothing": 0.5}, "label_smoothing"),
        ("dpo", {"data__margin_key": "m"}, "margin"),
        ("dpo", {"data__max_prompt_length": 2048}, "max_prompt_length"),
    ],
)
def test_config_errors(pair_files, tmp_path, kind, extra, match):
    with pytest.raises(ConfigError, match=match):
        config(kind, pair_files, tmp_path, **extra)


def test_no_args_configs_load():
    for kind, model in (("rm", "builtin:tiny-sft"), ("dpo", "builtin:tiny")):
        cfg = load_pref_config(kind, None)
        assert cfg.data.train_files is None and cfg.model.partial_pretrain == model
    assert load_pref_config("rm").trainer.total_epochs == 20 and load_pref_config("rm").optim.lr == 3e-4
    assert os.path.basename(load_pref_config("rm").trainer.default_local_dir) == "rm"
