"""Tracking backends, for real: console output, JSONL read back, TensorBoard events read back.

The TensorBoard tests need the `tensorboard` extra and skip without it (the README's test command
does not install it; CI's second stage does).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import numpy as np
import pytest
import torch

from hybridrl.utils.tracking import SUPPORTED_BACKENDS, Tracking, sanitize_metrics

STEP1 = {
    "critic/score/mean": torch.tensor(0.5),
    "actor/ppo_kl": np.float32(0.25),
    "actor/entropy": 1.5,
    "response_length/mean": 12,
    "val-core/openai/gsm8k/reward/mean@4": 0.75,
    "train/converged": True,
    "note": "not a number",
    "hist": [1, 2, 3],
    "loss": float("nan"),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("HYBRIDRL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)


def test_sanitize_keeps_numbers_only():
    clean = sanitize_metrics(STEP1)
    assert clean["critic/score/mean"] == 0.5 and clean["actor/ppo_kl"] == 0.25
    assert clean["response_length/mean"] == 12.0 and clean["train/converged"] == 1.0
    assert math.isnan(clean["loss"])
    assert "note" not in clean and "hist" not in clean
    assert all(type(v) is float for v in clean.values())


def test_file_backend_writes_jsonl_config_and_generations(tmp_path):
    tracker = Tracking(
        "proj", "exp", ["file"], config={"lr": 1e-6, "nested": {"n": 8}}, log_dir=str(tmp_path)
    )
    tracker.log(STEP1, step=1)
    tracker.log({"critic/score/mean": 0.75}, step=2)
    tracker.log_generations([{"prompt": "1+1=", "response": "2", "score": 1.0}], step=2)
    tracker.finish()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert rows[0]["step"] == 1 and rows[0]["critic/score/mean"] == 0.5 and rows[0]["actor/ppo_kl"] == 0.25
    assert rows[0]["loss"] is None  # NaN -> null keeps the file strict JSON
    assert "note" not in rows[0]
    assert rows[1] == {"step": 2, "critic/score/mean": 0.75}
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-6, "nested": {"n": 8}}
    gen = json.loads((tmp_path / "generations.jsonl").read_text())
    assert gen == {"step": 2, "prompt": "1+1=", "response": "2", "score": 1.0}
    assert tracker.metrics_path == str(tmp_path / "metrics.jsonl")


def test_file_backend_appends_across_runs(tmp_path):
    for step in (1, 2):
        with Tracking("p", "e", "file", log_dir=str(tmp_path)) as t:
            t.log({"x": step}, step=step)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_log_dir_from_env_or_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = Tracking("proj", "exp", "file")
    t.log({"x": 1.0}, step=0)
    t.finish()
    assert (tmp_path / "outputs" / "proj" / "exp" / "metrics.jsonl").exists()
    monkeypatch.setenv("HYBRIDRL_FILE_LOGGER_PATH", str(tmp_path / "envdir"))
    t = Tracking("proj", "exp", "file")
    t.log({"x": 1.0}, step=0)
    t.finish()
    assert t.log_dir == str(tmp_path / "envdir") and (tmp_path / "envdir" / "metrics.jsonl").exists()
    monkeypatch.setenv("HYBRIDRL_FILE_LOGGER_PATH", str(tmp_path / "other" / "run.jsonl"))
    t = Tracking("proj", "exp", "file")
    t.log({"x": 1.0}, step=0)
    t.finish()
    assert (tmp_path / "other" / "run.jsonl").exists()


def test_console_prints_one_compact_line(capsys, caplog):
    t = Tracking("p", "e", "console")
    with caplog.at_level(logging.DEBUG, logger="hybridrl.utils.tracking"):
        t.log(STEP1, step=3)
    t.finish()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        "step 3 | score 0.5 | kl 0.25 | entropy 1.5 | resp_len 12 | val[openai/gsm8k:reward@4] 0.75"
    ]
    debug = " ".join(r.getMessage() for r in caplog.records)
    assert "train/converged=1" in debug and "loss=nan" in debug


def test_console_without_known_keys_shows_first_metrics(capsys):
    t = Tracking("p", "e", "console")
    t.log({"custom/a": 1.0, "custom/b": 2.0}, step=0)
    assert capsys.readouterr().out.strip() == "step 0 | custom/a 1 | custom/b 2"


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracking("p", "e", ["tensorboard", "file"], config={"a": 1}, log_dir=str(tmp_path))
    for step in range(3):
        t.log({"critic/score/mean": 0.1 * step, "actor/entropy": torch.tensor(2.0 - step)}, step=step)
    t.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"critic/score/mean", "actor/entropy"}
    score = acc.Scalars("critic/score/mean")
    assert [e.step for e in score] == [0, 1, 2]
    assert [e.value for e in score] == pytest.approx([0.0, 0.1, 0.2])
    assert [e.value for e in acc.Scalars("actor/entropy")] == pytest.approx([2.0, 1.0, 0.0])


def test_tensorboard_dir_from_env(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    t = Tracking("p", "e", "tensorboard", log_dir=str(tmp_path / "logs"))
    t.log({"x": 1.0}, step=1)
    t.finish()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


@pytest.mark.parametrize("package", ["wandb", "mlflow", "tensorboard"])
def test_missing_tracker_package_gives_pip_command(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed, whatever this machine has
    if package == "tensorboard":  # the backend imports torch's SummaryWriter, which needs tensorboard
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=rf"pip install {package} .*pip install 'hybridrl\[trackers\]'"):
        Tracking("p", "e", ["file", package], log_dir=str(tmp_path))


def test_unknown_backend_names_config_key():
    with pytest.raises(ValueError, match=r"\['swanlab'\] in trainer.logger; known: \['console'"):
        Tracking("p", "e", ["console", "swanlab"])
    assert SUPPORTED_BACKENDS == ("console", "file", "tensorboard", "wandb", "mlflow")


def test_misuse_is_an_error(tmp_path):
    t = Tracking("p", "e", "file", log_dir=str(tmp_path))
    with pytest.raises(TypeError, match="step must be an int"):
        t.log({"x": 1.0}, step=1.5)
    t.finish()
    t.finish()  # twice is fine
    with pytest.raises(RuntimeError, match="after finish"):
        t.log({"x": 1.0}, step=2)


def test_omegaconf_config_and_list_backend(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {"trainer": {"logger": ["file"], "name": "${data.name}"}, "data": {"name": "gsm8k"}}
    )
    t = Tracking("p", "e", cfg.trainer.logger, config=cfg, log_dir=str(tmp_path))
    t.finish()
    assert json.loads((tmp_path / "config.json").read_text())["trainer"]["name"] == "gsm8k"


def test_console_prints_every_log_freq_steps_and_at_validation(capsys, tmp_path):
    from hybridrl.utils.tracking import Tracking

    t = Tracking("p", "e", ["console"], log_dir=str(tmp_path), console_every=3)
    for step in range(1, 8):
        metrics = {"critic/score/mean": 0.5}
        if step == 5:
            metrics["val-core/arith/acc/mean@1"] = 0.25
        t.log(metrics, step=step)
    t.finish()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [line.split(" |")[0] for line in lines] == ["step 3", "step 5", "step 6"]
    assert "val[arith:acc@1] 0.25" in lines[1]
