"""Accuracy and tool use of a model on the built-in tool task, through the real tool agent.

    python recipes/agent/evaluate.py --model /tmp/agent_sft [--temperature 1.0] [--n 200]

Runs HF generation + the tool_agent loop with the calculator (hybridrl.agent) on the
validation prompts of hybridrl.data.agent_task; prints accuracy, tool calls per trajectory and
the tool error rate as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def evaluate(model: str, n: int = 200, temperature: float = 0.0, response_length: int = 128) -> dict:
    from transformers import AutoTokenizer

    from hybridrl.agent.builtin_tools import CalculatorTool
    from hybridrl.agent.runner import AgentLoopRunner, agent_step_metrics
    from hybridrl.config.rollout import RolloutConfig
    from hybridrl.data import agent_task
    from hybridrl.data.builtin_score import compute_score
    from hybridrl.protocol import DataProto
    from hybridrl.rollout.hf import HFRollout

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    cfg = RolloutConfig(
        name="hf",
        dtype="float32",
        load_format="auto",
        prompt_length=16,
        response_length=response_length,
        temperature=max(temperature, 1e-6),
        do_sample=temperature > 0,
        multi_turn={"enable": True, "max_assistant_turns": 3},
        agent={"default_agent_loop": "tool_agent"},
    )
    runner = AgentLoopRunner(HFRollout(cfg, model, tok), cfg, tok)
    runner.tools["calc"] = CalculatorTool()
    rows = agent_task.make_rl_rows(n, 1, "val")
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    batch = DataProto.from_dict(
        {
            "input_ids": enc["input_ids"],
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        },
        {"raw_prompt": np.array([r["prompt"] for r in rows] + [None], dtype=object)[:-1]},
    )
    t0 = time.perf_counter()
    out = runner.generate_sequences(batch)
    T = out.batch["responses"].shape[1]
    correct = 0.0
    for i, r in enumerate(rows):
        valid = out.batch["attention_mask"][i, -T:].bool()
        text = tok.decode(out.batch["responses"][i][valid], skip_special_tokens=True)
        correct += compute_score(text, r["reward_model"]["ground_truth"])
    m = agent_step_metrics(out)
    return {
        "acc": correct / n,
        "tool_calls_per_traj": m["tool/calls_per_traj"],
        "tool_error_rate": m["tool/error_rate"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(evaluate(args.model, args.n, args.temperature)))


if __name__ == "__main__":
    main()
