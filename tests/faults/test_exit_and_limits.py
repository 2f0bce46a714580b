"""Mistakes that used to run silently, and a clean exit of the agent loop's tool calls.

* prompt + response longer than the model's positions: refused naming the numbers, or warned once
  when the model's RoPE scaling extends the positions far enough;
* trainer.total_epochs < 1 is refused even when trainer.total_training_steps is set;
* no asyncio task of the tools' event loop is destroyed pending ("Task was destroyed but it is
  pending!") when a blocking tool makes that loop be abandoned: the calls still on it are cancelled
  and end with an error naming why.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from hybridrl.tools.tool_runner import ToolLoop
from hybridrl.trainer.ppo import startup_checks
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config


def test_prompt_plus_response_past_the_positions_is_refused_or_warned_once(tmp_path, capsys):
    config = compose_config(["data.max_prompt_length=100", "data.max_response_length=60"], tmp_path)
    model = {"max_position_embeddings": 128, "rope_theta": 10000.0}
    with pytest.raises(ConfigError) as err:
        startup_checks.check_positions(config, model, "m/config.json")
    msg = str(err.value)
    assert "data.max_prompt_length=100 + data.max_response_length=60 = 160" in msg
    assert "max_position_embeddings=128 (m/config.json)" in msg and "override_config.rope_scaling" in msg
    startup_checks.check_positions(config, {**model, "max_position_embeddings": 160}, "m/config.json")
    scaled = {**model, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    for _ in range(2):
        startup_checks.check_positions(config, scaled, "m/config.json")
    out = capsys.readouterr().out
    assert out.count("warning: data.max_prompt_length=100") == 1 and "extends them to 256" in out
    too_little = {**model, "rope_scaling": {"rope_type": "linear", "factor": 1.1}}
    with pytest.raises(ConfigError, match="160 tokens exceed"):
        startup_checks.check_positions(config, too_little, "m/config.json")


def test_a_run_past_the_builtin_models_positions_is_refused_before_ray(tmp_path):
    from hybridrl.trainer.ppo.launch import run_ppo_config

    config = compose_config(["data.max_response_length=1024", "trainer.backend=local"], tmp_path)
    with pytest.raises(ConfigError, match=r"exceed the model's max_position_embeddings=\d+"):
        run_ppo_config(config)


def test_zero_epochs_is_refused_even_with_a_step_count(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.total_epochs=0 must be an integer >= 1"):
        compose_config(["trainer.total_epochs=0", "trainer.total_training_steps=5"], tmp_path)


async def _blocking():
    time.sleep(1.2)  # holds the tools' loop past the deadline: the loop is abandoned


async def _slow():
    await asyncio.sleep(30)


class _Pending(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "destroyed but it is pending" in record.getMessage():
            self.seen.append(record.getMessage())


def test_an_abandoned_tool_loop_leaves_no_pending_task():
    handler = _Pending()
    logging.getLogger("asyncio").addHandler(handler)
    loop = ToolLoop()

    async def step():
        return await asyncio.gather(
            loop.run(_slow, timeout_s=20, what="tool 'slow' execute"),
            loop.run(_blocking, timeout_s=0.5, what="tool 'blocking' execute"),
            return_exceptions=True,
        )

    try:
        started = time.monotonic()
        slow, blocking = asyncio.run(step())
        assert isinstance(blocking, asyncio.TimeoutError)
        # the call sharing the abandoned loop ends with it, naming why, instead of waiting out its deadline
        assert isinstance(slow, RuntimeError) and "abandoned" in str(slow)
        assert time.monotonic() - started < 10
        time.sleep(0.2)
        gc.collect()
        assert handler.seen == []
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
        loop.close()
