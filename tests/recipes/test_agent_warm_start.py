"""recipes/agent/warm_start.py stops at its loss target or at the step cap, and says which."""

from __future__ import annotations

import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "agent" / "warm_start.py"


@pytest.fixture(scope="module")
def ws():
    spec = importlib.util.spec_from_file_location("agent_warm_start", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_target_is_the_choice_entropy_plus_margin(ws):
    assert ws.choice_entropy(0.5) == pytest.approx(math.log(2))
    assert ws.choice_entropy(0.3) == pytest.approx(0.6109, abs=1e-4)
    assert ws.parse_args(["--out", "x"]).target_loss == pytest.approx(0.6109 + 0.015, abs=1e-4)
    assert ws.parse_args(["--out", "x", "--target-loss", "0.7"]).target_loss == 0.7
    with pytest.raises(SystemExit):
        ws.parse_args(["--out", "x", "--tool-fraction", "1"])


def _train(ws, target: float, steps: int = 3):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.agent.tokenization import ToolTurnRenderer
    from hybridrl.models.builtin import get_builtin_model_path

    torch.manual_seed(0)
    src = get_builtin_model_path()
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = ws.parse_args(
        [
            "--out",
            "x",
            "--steps",
            str(steps),
            "--window",
            "2",
            "--batch-size",
            "3",
            "--target-loss",
            str(target),
        ]
    )
    log = io.StringIO()
    result = ws.train(model, tok, ToolTurnRenderer(tok), args, log)
    return result, [json.loads(x) for x in log.getvalue().splitlines()]


def test_stops_at_the_target_or_at_the_cap(ws):
    # the built-in model starts near loss 15: a target of 1000 is met as soon as the window is full
    result, rows = _train(ws, target=1000.0)
    assert result["reached_target"] and result["stop_step"] == 2 and len(rows) == 2
    assert rows[-1]["window_loss"] == pytest.approx((rows[0]["loss"] + rows[1]["loss"]) / 2, abs=1e-4)
    assert rows[0]["loss"] == pytest.approx(rows[0]["choice"] + rows[0]["path"], abs=1e-4)
    # an unreachable target runs to the cap and says it was not reached
    result, rows = _train(ws, target=0.01)
    assert not result["reached_target"] and result["stop_step"] == 3 and len(rows) == 3


def _run_sh(tmp_path, info: dict | None):
    import os
    import subprocess

    ws_dir = tmp_path / "warm_start"
    ws_dir.mkdir()
    if info is not None:
        (ws_dir / "warm_start.json").write_text(json.dumps(info))
    env = {**os.environ, "AGENT_OUT": str(tmp_path), "AGENT_SFT_STEPS": "0"}
    return subprocess.run(
        ["bash", str(SCRIPT.parent / "run.sh")], env=env, capture_output=True, text=True, timeout=120
    )


def test_run_sh_stops_before_grpo_when_the_target_was_not_reached(tmp_path):
    info = {"reached_target": False, "window_loss": 0.7038, "stop_step": 1500, "target_loss": 0.6259}
    done = _run_sh(tmp_path, info)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "stopping before GRPO" in done.stderr and "0.7038 after 1500 steps, target 0.6259" in done.stderr
    assert "AGENT_SFT_STEPS" in done.stderr and not (tmp_path / "data").exists()  # GRPO never began
