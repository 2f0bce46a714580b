"""The env_agent loop on the real built-in model and HF engine: masks, rewards, faults as data."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import envs_for_tests  # noqa: F401 - registers the test environments
import numpy as np
import pytest
import torch

from hybridrl.agent.runner import AgentLoopRunner, agent_step_metrics
from hybridrl.config.rollout import RolloutConfig
from hybridrl.env.guess_number import GuessNumber, make_rows
from hybridrl.env.host import EnvironmentFault, EpisodeProcess
from hybridrl.protocol import DataProto
from hybridrl.reward.manager import decode_samples
from hybridrl.reward.scorers import default_compute_score


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    tok = AutoTokenizer.from_pretrained(get_builtin_model_path())
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def runner(tokenizer, tmp_path_factory):
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.rollout.hf import HFRollout

    torch.set_num_threads(1)
    loops = tmp_path_factory.mktemp("loops") / "loops.yaml"
    loops.write_text("- {name: env_agent_2s, _target_: hybridrl.env.loop.EnvAgentLoop, timeout_s: 2}\n")
    cfg = RolloutConfig(
        name="hf",
        dtype="float32",
        load_format="auto",
        response_length=96,
        prompt_length=16,
        calculate_log_probs=True,
        temperature=1.0,
        agent={"default_agent_loop": "env_agent", "agent_loop_config_path": str(loops)},
    )
    engine = HFRollout(cfg, get_builtin_model_path(), tokenizer)
    return AgentLoopRunner(engine, cfg, tokenizer)


def batch(tokenizer, envs, agent_name="env_agent_2s"):
    msgs = [[{"role": "user", "content": "go"}] for _ in envs]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    extra = np.empty(len(envs), dtype=object)
    for i, e in enumerate(envs):
        extra[i] = {"env_name": e, "index": i}
    non_tensor = {
        "extra_info": extra,
        "agent_name": np.array([agent_name] * len(envs), dtype=object),
        "data_source": np.array(["hybridrl/env"] * len(envs), dtype=object),
        "reward_model": np.array([{"ground_truth": ""}] * len(envs), dtype=object),
    }
    tensors = {
        "input_ids": enc["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return DataProto.from_dict(tensors, non_tensor, {"seed_index": 1})


def test_turns_masks_and_rewards(runner, tokenizer):
    out = runner.generate_sequences(batch(tokenizer, ["test_counting"] * 4))
    b, T = out.batch, out.batch["responses"].shape[1]
    samples = decode_samples(tokenizer, out)  # what the reward manager gives the score function
    assert any(len(s.extra_info["env_turn_rewards"]) == 3 for s in samples)
    for i in range(len(out)):
        valid = int(b["attention_mask"][i, -T:].sum())
        ids, mask = b["responses"][i, :valid].tolist(), b["response_mask"][i, :valid].tolist()
        env_text = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
        extra = samples[i].extra_info
        assert extra["index"] == i  # the row's own extra_info, with the episode's rewards added
        turns = len(extra["env_turn_rewards"])
        if turns == 3:  # every assistant turn ended with EOS: the episode ran to its end
            assert env_text == "<|user|>step1<|assistant|><|user|>step2<|assistant|>"
            assert extra["env_reward"] == pytest.approx(0.75)
        assert extra["env_reward"] == pytest.approx(0.25 * turns)
        assert default_compute_score("hybridrl/env", "", None, extra)["score"] == pytest.approx(0.25 * turns)
        assert float(b["rollout_log_probs"][i][b["response_mask"][i] == 0].abs().sum()) == 0.0
    assert out.meta_info["metrics"]["agent/env_errors/mean"] == 0.0


def test_faults_become_data_and_are_counted(runner, tokenizer):
    envs = ["test_counting", "test_raising", "test_hanging", "test_malformed", "no_such_env_here"]
    start = time.monotonic()
    with pytest.raises(ValueError, match="unknown environment 'no_such_env_here'"):
        runner.generate_sequences(batch(tokenizer, envs))  # a name no one registered is a config error
    out = runner.generate_sequences(batch(tokenizer, envs[:4]))
    assert time.monotonic() - start < 60  # the hanging one ended at its 2 s deadline
    rewards = list(out.non_tensor_batch["env_reward"])
    assert rewards[1:] == [0.0, 0.0, 0.0]
    m = out.meta_info["metrics"]
    assert m["agent/env_errors/mean"] == pytest.approx(1 / 4)
    assert m["agent/env_timeouts/mean"] == pytest.approx(1 / 4)
    assert m["agent/env_malformed/mean"] == pytest.approx(1 / 4)
    step = agent_step_metrics(out)  # what the trainer logs
    assert (step["env/errors"], step["env/timeouts"], step["env/malformed"]) == (1.0, 1.0, 1.0)


def test_environments_that_speak_token_ids(runner, tokenizer):
    """reset's ids are the prompt, step's ids are appended as they are (mask 0), and step sees the
    tokens the policy generated; ids outside the vocabulary are a malformed step."""
    from envs_for_tests import TokenIds

    out = runner.generate_sequences(
        batch(tokenizer, ["test_token_ids"] * 3 + ["test_token_ids_out_of_vocab"])
    )
    b, T = out.batch, out.batch["responses"].shape[1]
    samples = decode_samples(tokenizer, out)
    full = 0
    for i in range(3):
        prompt = b["prompts"][i][b["attention_mask"][i, :-T].bool()].tolist()
        assert prompt == TokenIds.PROMPT
        valid = int(b["attention_mask"][i, -T:].sum())
        ids, mask = b["responses"][i, :valid].tolist(), b["response_mask"][i, :valid].tolist()
        runs, cur = [], []  # the policy's turns: runs of mask 1
        for t, m in zip(ids, mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        rewards = samples[i].extra_info["env_turn_rewards"]
        assert rewards == [float(len(r)) for r in runs][: len(rewards)]  # each step saw its turn's ids
        if len(rewards) == 2:  # both turns ended with EOS: the observation sits between them, verbatim
            assert [t for t, m in zip(ids, mask) if m == 0] == TokenIds.OBSERVATION
            full += 1
    assert full >= 1, "no episode played both turns: nothing checked the observation's ids"
    assert list(out.non_tensor_batch["env_reward"])[3] == 0.0
    assert agent_step_metrics(out)["env/malformed"] == 1.0


def test_episode_process_deadline_and_errors():
    async def play():
        ep = await EpisodeProcess.start(GuessNumber, {"high": 8, "max_turns": 2}, "guess_number", 5.0)
        obs = await ep.reset({"extra_info": {"secret": 6}})
        steps = [await ep.step("#### 3"), await ep.step("#### 7")]
        await ep.close()
        bad = await EpisodeProcess.start(GuessNumber, {}, "guess_number", 5.0)
        with pytest.raises(EnvironmentFault, match="extra_info.secret") as e:
            await bad.reset({"extra_info": {}})
        await bad.close()
        return obs, steps, e.value.kind

    obs, steps, kind = asyncio.run(play())
    assert obs == "guess 1-8"
    assert steps == [("higher", 0.0, False, {"turns": 1}), ("lower", 0.0, True, {"turns": 2})]
    assert kind == "error"
    rows = make_rows(4, seed=0)
    assert {r["agent_name"] for r in rows} == {"env_agent"} and all(
        1 <= r["extra_info"]["secret"] <= 8 for r in rows
    )


MAIN_MODULE = """
import asyncio
import heavy_for_env_test  # noqa: F401  (stands in for torch and transformers)

from hybridrl.env.guess_number import GuessNumber
from hybridrl.env.host import EpisodeProcess


async def play():
    for _ in range(3):
        ep = await EpisodeProcess.start(GuessNumber, {"high": 8}, "guess_number", 60.0)
        await ep.reset({"extra_info": {"secret": 2}})
        await ep.close()


if __name__ == "__main__":
    asyncio.run(play())
"""


def test_episodes_of_a_python_m_program_do_not_import_its_modules_again(tmp_path):
    """The fork server preloads a `python -m` main module's imports: each import of the heavy module
    appends its process id, so the program and the server write one line each, the episodes none.
    The main module sits in a package, as main_ppo does: no episode prints runpy's warning that the
    module was imported before it ran."""
    (tmp_path / "heavy_for_env_test.py").write_text(
        "import os\nwith open(os.environ['IMPORT_LOG'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"
    )
    (tmp_path / "pkg_for_env_test").mkdir()
    (tmp_path / "pkg_for_env_test" / "__init__.py").write_text("")
    (tmp_path / "pkg_for_env_test" / "main_for_env_test.py").write_text(MAIN_MODULE)
    log = tmp_path / "imports.log"
    env = {**os.environ, "IMPORT_LOG": str(log), "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-m", "pkg_for_env_test.main_for_env_test"],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert "found in sys.modules" not in proc.stderr, proc.stderr[-2000:]
    pids = log.read_text().split()
    assert len(pids) == 2, f"the heavy module was imported by {len(pids)} processes: {pids}"
