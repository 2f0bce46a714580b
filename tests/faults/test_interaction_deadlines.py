"""A hanging interaction (a simulated user) ends its trajectory, never the step.

Real tool agent, real HF engine and the built-in model; the interaction is loaded from a veRL-format
yaml (`multi_turn.interaction_config_path`) and its calls hang: a blocking `time.sleep` inside
`async def generate_response`, a `start_interaction` that awaits forever, a `finalize_interaction`
that awaits forever. `multi_turn.interaction_timeout_s=0.5`.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

# (the module name pytest gives it: tests/faults is on sys.path; "tests.faults..." would import it twice)
from test_tool_deadlines import hf_engine, make_runner, prompts, tokenizer  # noqa: F401

from hybridrl.agent.interaction import BaseInteraction
from hybridrl.config.agent import MultiTurnConfig, validate_multi_turn_config

TIMEOUT = 0.5


class HangingUser(BaseInteraction):
    """Answers "no,again" unless the stage named in `config.hang` hangs."""

    async def _maybe_hang(self, stage: str) -> None:
        if self.config.get("hang") == stage:
            if self.config.get("blocking"):
                time.sleep(30)  # blocks the loop it runs on
            await asyncio.sleep(3600)

    async def start_interaction(self, instance_id=None, **kwargs):
        await self._maybe_hang("start")
        return await super().start_interaction(instance_id)

    async def generate_response(self, instance_id, messages, **kwargs):
        await self._maybe_hang("respond")
        return False, "no,again", 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        await self._maybe_hang("finalize")


def _run(hf_engine, tokenizer, tmp_path, hang: str, blocking: bool = False):  # noqa: F811
    path = tmp_path / "interaction.yaml"
    path.write_text(
        "interaction:\n  - name: user\n"
        f"    class_name: {__name__}.HangingUser\n"
        f"    config: {{hang: {hang}, blocking: {str(blocking).lower()}}}\n"
    )
    runner = make_runner(
        hf_engine,
        tokenizer,
        [],
        response_length=96,
        interaction_config_path=str(path),
        interaction_timeout_s=TIMEOUT,
        max_user_turns=2,
        tokenization_sanity_check_mode="disable",
    )
    data = prompts(tokenizer, ["12+34="])
    data.non_tensor_batch["extra_info"] = np.array([{"interaction_kwargs": {"name": "user"}}], dtype=object)
    data.meta_info["greedy"] = True
    t0 = time.monotonic()
    out = runner.generate_sequences(data)
    return out, time.monotonic() - t0


@pytest.mark.parametrize(("hang", "blocking"), [("respond", True), ("start", False), ("finalize", False)])
def test_a_hanging_interaction_ends_the_trajectory_naming_the_key(
    hf_engine,  # noqa: F811
    tokenizer,  # noqa: F811
    tmp_path,
    caplog,
    hang,
    blocking,
):
    out, took = _run(hf_engine, tokenizer, tmp_path, hang, blocking)
    metrics = out.meta_info["metrics"]
    assert metrics["agent/interaction_timeouts/mean"] == 1.0
    assert took < 20, took  # not the 30 s / hour the interaction hangs
    assert "multi_turn.interaction_timeout_s=0.5" in caplog.text
    stage = {"respond": "generate_response", "start": "start_interaction", "finalize": "finalize_interaction"}
    assert f"interaction 'user' {stage[hang]} did not return" in caplog.text
    # a hung start or response: no user turn; a hung finalize: the user turns all happened
    expected_turns = 2 if hang == "finalize" else 0
    assert metrics["agent/interaction_turns/mean"] == expected_turns
    assert out.non_tensor_batch["num_turns"][0] == 2 + 2 * expected_turns


@pytest.mark.parametrize("bad", [0, -1.0, "soon", True])
def test_interaction_timeout_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match="multi_turn.interaction_timeout_s"):
        validate_multi_turn_config(MultiTurnConfig(interaction_timeout_s=bad))
