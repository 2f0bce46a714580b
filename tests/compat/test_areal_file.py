"""AReaL's gsm8k GRPO experiment file on main_async (`--config`): every key is translated, a
documented no-op, or refused with its reason; the file trains on CPU with only the model path,
the datasets and allocation_mode changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridrl.compat.areal_file import leaves, load_areal_file, split_config_flag
from hybridrl.compat.areal_rules import RULES, rule_for
from hybridrl.utils.config_loader import ConfigError

AREAL_FILE = Path(__file__).parent / "areal_gsm8k_grpo.yaml"
KINDS = ("translated", "no-op", "refused")


def _leaves() -> dict:
    cfg = OmegaConf.load(AREAL_FILE)
    OmegaConf.resolve(cfg)
    return leaves(cfg)


def _local_file(tmp_path, **changes) -> str:
    """The AReaL file with `changes` (dotted keys) applied, links kept, written to tmp_path."""
    cfg = OmegaConf.load(AREAL_FILE)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    out = tmp_path / "areal.yaml"
    OmegaConf.save(cfg, out)
    return str(out)


def _translate(tmp_path, *overrides, **changes) -> dict[str, str]:
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")  # only its row count is read for freq_epochs: give steps instead
    path = _local_file(tmp_path, **{"train_dataset.path": str(data), **changes})
    args = ["saver.freq_epochs=null", "evaluator.freq_epochs=null", *overrides]
    return dict(o.lstrip("+").split("=", 1) for o in load_areal_file(path, args))


def test_every_key_of_the_file_is_in_exactly_one_category():
    keys = _leaves()
    assert len(keys) > 100  # the whole example, not a sample
    for key in keys:
        matches = rule_for(key)
        assert len(matches) == 1, (key, [m[0] for m in matches])
        assert matches[0][1].kind in KINDS, key
    for name, rule in RULES.items():
        assert rule.kind in KINDS, name
        assert (rule.translate is not None) == (rule.kind == "translated"), name
        assert rule.kind == "translated" or rule.why, name
    by_kind = {k: sorted(n for n in keys if rule_for(n)[0][1].kind == k) for k in KINDS}
    assert by_kind["translated"] and by_kind["no-op"] and by_kind["refused"]


def test_translation_of_the_example(tmp_path):
    got = _translate(tmp_path)
    assert got["trainer.project_name"] == "gsm8k-grpo" and got["trainer.experiment_name"] == "trial0"
    assert got["actor_rollout_ref.model.path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert got["actor_rollout_ref.rollout.name"] == "sglang"
    assert got["async_training.rollout_n_gpus_per_node"] == "4" and got["trainer.n_gpus_per_node"] == "4"
    assert got["actor_rollout_ref.rollout.n"] == "4"
    assert got["actor_rollout_ref.rollout.response_length"] == "1024"
    assert got["async_training.max_head_offpolicyness"] == "2"
    assert got["async_training.consumer_batch_size"] == "256"  # ${train_dataset.batch_size}, resolved
    assert (
        got["data.train_batch_size"] == "256" and got["actor_rollout_ref.actor.ppo_mini_batch_size"] == "256"
    )
    assert got["actor_rollout_ref.actor.optim.lr"] == "1.7e-05"
    assert got["actor_rollout_ref.actor.optim.betas"] == "[0.9,0.999]"
    assert got["actor_rollout_ref.actor.clip_ratio"] == "0.4"
    assert got["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "10240"
    assert got["algorithm.adv_estimator"] == "grpo_batch_whitened"
    assert got["async_training.weight_update_mode"] == "collective"  # xccl
    assert (
        got["actor_rollout_ref.rollout.max_model_len"] == "32768"
    )  # sglang.context_length (sglang selected)
    assert got["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.8"
    assert got["trainer.default_local_dir"] == "/tmp/areal/experiments/checkpoints/gsm8k-grpo/trial0"
    assert got["trainer.resume_mode"] == "disable" and got["trainer.logger"] == "[console]"
    assert got["data.max_prompt_length"] == "1024" and got["data.filter_overlong_prompts"] == "true"


def test_file_overrides_change_the_file_before_its_links_and_hybridrl_keys_pass_through(tmp_path):
    got = _translate(
        tmp_path, "actor.path=/models/mine", "gconfig.n_samples=8", "trainer.total_training_steps=2"
    )
    assert got["actor_rollout_ref.model.path"] == "/models/mine"
    assert got["actor_rollout_ref.model.tokenizer_path"] == "/models/mine"  # tokenizer_path: ${actor.path}
    assert got["actor_rollout_ref.rollout.n"] == "8"
    assert got["trainer.total_training_steps"] == "2"
    # ref.path and reward_norm.group_size follow the overridden links, so their checks pass
    got = _translate(tmp_path, "allocation_mode=vllm:d1p1t1+d1p1t1")
    assert got["actor_rollout_ref.rollout.name"] == "vllm"
    assert got["actor_rollout_ref.rollout.max_model_len"] == "32768"  # now vllm.max_model_len
    assert got["actor_rollout_ref.rollout.dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "change, key, reason",
    [
        ({"perf_tracer.enabled": True}, "perf_tracer.enabled", "perf tracer is not available"),
        (
            {"rollout.enable_rollout_tracing": True},
            "rollout.enable_rollout_tracing",
            "rollout traces are not recorded",
        ),
        ({"gconfig.greedy": True}, "gconfig.greedy", "every answer of a group the same"),
        ({"gconfig.min_new_tokens": 4}, "gconfig.min_new_tokens", "not given a minimum length"),
        ({"evaluator.freq_secs": 600}, "evaluator.freq_secs", "not on a timer"),
        ({"ref.path": "other/model"}, "ref.path", "the actor's starting point"),
        (
            {"actor.adv_norm.mean_level": "group"},
            "actor.reward_norm.mean_level",
            "adv_norm mean_level='group'",
        ),
        ({"actor.optimizer.type": "sgd"}, "actor.optimizer.type", "only AdamW"),
        ({"scheduler.type": "slurm"}, "scheduler.type", "ray job submit"),
        ({"cluster.n_gpus_per_node": 4}, "cluster.n_gpus_per_node", "more than n_gpus_per_node=4"),
        ({"recover.mode": "auto"}, "recover.freq_epochs", "one checkpoint"),
        (
            {"stats_logger.tensorboard.path": "/tmp/tb"},
            "stats_logger.tensorboard.path",
            "not a key hybridrl translates",
        ),
    ],
)
def test_refused_values_say_why(tmp_path, change, key, reason):
    with pytest.raises(ConfigError) as e:
        _translate(tmp_path, **change)
    assert str(e.value).startswith(key) and reason in str(e.value), str(e.value)


def test_freq_epochs_counts_the_parquet_rows(tmp_path):
    from hybridrl.data.builtin_task import write_rl_parquet

    train = write_rl_parquet(tmp_path / "train.parquet", 40, seed=0, split="train")
    path = _local_file(tmp_path, **{"train_dataset.path": train, "train_dataset.batch_size": 8})
    got = dict(o.lstrip("+").split("=", 1) for o in load_areal_file(path, ["saver.freq_epochs=2"]))
    assert got["trainer.save_freq"] == "10" and got["trainer.test_freq"] == "5"  # 40 // 8 = 5 steps an epoch


def test_config_flag_spellings():
    assert split_config_flag(["--config", "a.yaml", "x=1"]) == ("a.yaml", ["x=1"])
    assert split_config_flag(["--config=a.yaml"]) == ("a.yaml", [])
    assert split_config_flag(["x=1"]) == (None, ["x=1"])
    with pytest.raises(ConfigError, match="needs a file"):
        split_config_flag(["--config"])


def _cpu_model(tmp_path) -> str:
    """The built-in tiny model in a folder of its own, with room for the file's 32768-token context."""
    from hybridrl.models.builtin import get_builtin_model_path

    out = tmp_path / "tiny"
    shutil.copytree(get_builtin_model_path(), out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.slow
def test_the_areal_file_trains_two_steps_on_cpu(tmp_path):
    from hybridrl.data.builtin_task import write_rl_parquet

    train = write_rl_parquet(tmp_path / "train.parquet", 16, seed=0, split="train")
    val = write_rl_parquet(tmp_path / "val.parquet", 8, seed=1, split="val")
    path = _local_file(
        tmp_path,
        **{
            "actor.path": _cpu_model(tmp_path),
            "train_dataset.path": train,
            "train_dataset.batch_size": 4,
            "valid_dataset.path": val,
            "valid_dataset.batch_size": 8,
            "allocation_mode": "vllm:d1p1t1+d1p1t1",
        },
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [
        sys.executable, "-m", "hybridrl.trainer.main_async", "--config", path,
        f"cluster.fileroot={tmp_path}/areal",  # an AReaL key: the file's links follow it
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.make_report=false",
        "trainer.progress_bar=false",
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "AReaL config file" in run.stdout
    assert "step 2 |" in run.stdout, run.stdout[-2000:]
    run_dir = ("gsm8k-grpo", "trial0")  # experiment_name / trial_name under cluster.fileroot
    samples = tmp_path.joinpath("areal", "rollouts", *run_dir)
    assert sorted(p.name for p in samples.glob("*.jsonl")) == ["1.jsonl", "2.jsonl"]  # rollout.dump_to_file
    assert tmp_path.joinpath("areal", "checkpoints", *run_dir, "global_step_2").is_dir()  # saver.fileroot
