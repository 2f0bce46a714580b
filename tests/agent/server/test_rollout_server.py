"""The rollout server end to end: a real `openai` client in a separate process generates through the
HTTP endpoint; the replica (the real HF engine and the batching queue, in this process) records the
trajectories; their ids, masks and log-probs are checked against what the client received and
against a teacher-forced forward pass of the same model."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrl.agent.parser import ToolCall, ToolCallParser, register_tool_parser
from hybridrl.agent.runner import AgentLoopRunner
from hybridrl.config.rollout import RolloutConfig
from hybridrl.protocol import DataProto

pytest.importorskip("openai")  # the client process uses it
CLIENT = Path(__file__).with_name("openai_client_agent.py")


@register_tool_parser("test_server_calls")
class CallsWhenShort(ToolCallParser):
    """The built-in model writes no tool calls: read a call `calc(len)` out of every answer (a plug point)."""

    def parse(self, text):
        return "", [ToolCall("calc", {"expr": str(len(text))})]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    tok = AutoTokenizer.from_pretrained(get_builtin_model_path())
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def hf_engine(tokenizer):
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.rollout.hf import HFRollout

    torch.set_num_threads(1)
    cfg = RolloutConfig(name="hf", dtype="float32", load_format="auto", response_length=48, prompt_length=16)
    return HFRollout(cfg, get_builtin_model_path(), tokenizer)


def server_config(multi_turn=None, **agent_server) -> RolloutConfig:
    return RolloutConfig(
        name="hf", mode="server", dtype="float32", load_format="auto", response_length=48, prompt_length=16,
        calculate_log_probs=True, temperature=1.0, agent_server={"port": 0, "claim_timeout_s": 120, **agent_server},
        multi_turn=multi_turn or {},
    )  # fmt: skip


def prompts(tokenizer, questions) -> DataProto:
    msgs = [[{"role": "user", "content": q}] for q in questions]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    raw = np.empty(len(msgs), dtype=object)
    raw[:] = msgs
    batch = {
        "input_ids": enc["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return DataProto.from_dict(batch, {"raw_prompt": raw}, {"seed_index": 0})


def serve(runner, batch, client_args, tmp_path):
    """Run the replica's generate_sequences in a thread while the client process plays the agent."""
    from hybridrl.agent.server.gateway import get_gateway, shutdown_gateway

    _, url = get_gateway(runner.config.agent_server, "policy")
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=runner.generate_sequences(batch)))
    thread.start()
    out_file = tmp_path / "client.json"
    proc = subprocess.run([sys.executable, str(CLIENT), url, *client_args[:1], str(out_file), *client_args[1:]], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    thread.join(timeout=120)
    shutdown_gateway()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return box["out"], json.loads(out_file.read_text())


@functools.cache
def reference_model():
    from transformers import AutoModelForCausalLM

    from hybridrl.models.builtin import get_builtin_model_path

    return AutoModelForCausalLM.from_pretrained(get_builtin_model_path(), torch_dtype=torch.float32).eval()


def teacher_forced_log_probs(ids: list[int]) -> torch.Tensor:
    """(L-1,) log p(ids[t] | ids[:t]) of the built-in model at temperature 1."""
    model = reference_model()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize(
    "backend", ["in_process", pytest.param("ray_actor", marks=pytest.mark.slow)]
)  # in_process: the gateway in a thread (a Ray actor if another module left Ray running)
def test_openai_client_trajectories_are_recorded_exactly(backend, hf_engine, tokenizer, tmp_path, request):
    if backend == "ray_actor":
        request.getfixturevalue("ray_local")
    cfg = server_config(reward_source="agent", multi_turn={"format": "test_server_calls"})
    hf_engine.config = cfg
    runner = AgentLoopRunner(hf_engine, cfg, tokenizer)
    batch = prompts(tokenizer, ["12+34=", "56+7=", "8+90="])
    again = tokenizer("<|user|>again 0<|assistant|>", add_special_tokens=False)["input_ids"]
    out, seen = serve(runner, batch, ["3", json.dumps(again)], tmp_path)
    rows = {
        tuple(r[0]["content"] for r in [m]): i for i, m in enumerate(batch.non_tensor_batch["raw_prompt"])
    }
    T = out.batch["responses"].shape[1]
    assert len(seen["trajectories"]) == 3
    for traj in seen["trajectories"]:
        i = rows[(traj["messages"][0]["content"],)]
        t1, t2 = traj["turns"]
        prompt = t1["prompt_token_ids"]
        # the second request's context = prompt + answer 1 + the chat template's ids of the user message
        env = t2["prompt_token_ids"][len(prompt) + len(t1["token_ids"]) :]
        assert t2["prompt_token_ids"][: len(prompt) + len(t1["token_ids"])] == prompt + t1["token_ids"]
        assert env == again
        if traj is not seen["trajectories"][2]:  # chat: every answer carries its parsed call (OpenAI shape)
            for t in traj["turns"]:
                text = tokenizer.decode(t["token_ids"], skip_special_tokens=True)
                assert t["tool_calls"] == [["calc", {"expr": str(len(text))}]] and t["content"] is None
                ended = t["token_ids"][-1] == tokenizer.eos_token_id
                assert t["finish_reason"] == ("tool_calls" if ended else "length")
        want = t1["token_ids"] + env + t2["token_ids"]
        n = len(want)
        assert out.batch["responses"][i, :n].tolist() == want
        assert out.batch["response_mask"][i].tolist() == [1] * len(t1["token_ids"]) + [0] * len(env) + [1] * len(
            t2["token_ids"]) + [0] * (T - n)  # fmt: skip
        lp = out.batch["rollout_log_probs"][i, :n]
        got = t1["logprobs"] + [0.0] * len(env) + t2["logprobs"]
        assert torch.allclose(lp, torch.tensor(got), atol=1e-6)
        # what the engine produced: the log-probs of the sampled tokens under the model (T=1)
        ref = teacher_forced_log_probs(prompt + want)[len(prompt) - 1 :]
        m = out.batch["response_mask"][i, :n].bool()
        assert torch.allclose(lp[m], ref[m], atol=1e-4)
        # the agent's reward sits on the last response token (reward_source=agent)
        assert out.batch["rm_scores"][i].sum().item() == traj["reward"]
        assert out.batch["rm_scores"][i, n - 1].item() == traj["reward"]
        assert traj["finish_status"] == 200
    err = seen["errors"]
    assert err["temperature"][0] == 400 and "temperature" in err["temperature"][1]
    assert err["rewritten_history"][0] == 400 and "repeat the conversation" in err["rewritten_history"][1]
    assert err["stream"][0] == 400 and "stream" in err["stream"][1]
    assert err["after_finish"][0] == 404 and "not open" in err["after_finish"][1]
    assert err["no_trajectory"][0] == 400 and "X-Trajectory-Id" in err["no_trajectory"][1]
    assert out.meta_info["metrics"]["agent/abandoned/mean"] == 0.0
