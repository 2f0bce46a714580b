"""The tool agent on the real built-in model with the real HF engine (in-process, one thread).

The built-in model never writes tool calls by itself, so these tests register tool-call formats
(`multi_turn.format`, a public plug point) that read a call out of every assistant turn: the loop,
the tools, the batching engine and the tokenisation are the real ones. A custom chat template
(a supported user setting) renders a tool message as a new user question, so the built-in model
keeps answering short "#### N" turns and trajectories get several assistant turns.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from hybridrl.agent.parser import ToolCall, ToolCallParser, parse_call_json, register_tool_parser
from hybridrl.agent.runner import AgentLoopRunner, agent_step_metrics
from hybridrl.config.rollout import RolloutConfig
from hybridrl.protocol import DataProto
from hybridrl.tools.tool import BaseTool, ToolResponse

QUESTION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|user|>' ~ message['content'] }}"
    "{% else %}{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Script:
    """Tool-call bodies handed out turn by turn (one trajectory at a time in the tests using it)."""

    bodies: list[str] = []


@register_tool_parser("test_always_ask")
class AlwaysAsk(ToolCallParser):
    """Every assistant turn calls `ask` (returns a new question)."""

    def parse(self, text):
        return text, [ToolCall("ask", {})]


@register_tool_parser("test_scripted")
class Scripted(ToolCallParser):
    """Turn k calls the k-th body of Script.bodies (a JSON call, maybe malformed); none when empty."""

    def parse(self, text):
        if not Script.bodies:
            return text, []
        bodies = Script.bodies.pop(0)
        return text, [parse_call_json(b) for b in (bodies if isinstance(bodies, list) else [bodies])]


class AskTool(BaseTool):
    """Returns a fresh addition question; records when each call started and ended."""

    events: list[tuple[str, float]] = []

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config or {}, tool_schema or {"type": "function", "function": {"name": "ask"}})
        self.count = 0

    async def execute(self, instance_id, parameters, **kwargs):
        self.count += 1
        return ToolResponse(text=f"{10 + self.count}+{20 + self.count}="), 0.0, {}


class SlowTool(BaseTool):
    def __init__(self, config=None, tool_schema=None):
        super().__init__(config or {}, tool_schema or {"type": "function", "function": {"name": "slow"}})

    async def execute(self, instance_id, parameters, **kwargs):
        AskTool.events.append(("slow_start", time.perf_counter()))
        await asyncio.sleep(float(parameters.get("s", 0.0)))
        AskTool.events.append(("slow_end", time.perf_counter()))
        return ToolResponse(text="11+22="), 0.0, {}


class RaisingTool(BaseTool):
    def __init__(self, config=None, tool_schema=None):
        super().__init__(config or {}, tool_schema or {"type": "function", "function": {"name": "fail"}})

    async def execute(self, instance_id, parameters, **kwargs):
        raise KeyError("missing_field")


class LongTool(BaseTool):
    def __init__(self, config=None, tool_schema=None):
        super().__init__(config or {}, tool_schema or {"type": "function", "function": {"name": "long"}})

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="9" * 500), 0.0, {}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    tok = AutoTokenizer.from_pretrained(get_builtin_model_path())
    tok.padding_side = "left"
    tok.chat_template = QUESTION_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def hf_engine(tokenizer):
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.rollout.hf import HFRollout

    torch.set_num_threads(1)
    cfg = RolloutConfig(name="hf", dtype="float32", load_format="auto", response_length=64, prompt_length=16)
    return HFRollout(cfg, get_builtin_model_path(), tokenizer)


def make_runner(hf_engine, tokenizer, tools, response_length=64, calculate_log_probs=True, **multi_turn):
    cfg = RolloutConfig(
        name="hf",
        dtype="float32",
        load_format="auto",
        response_length=response_length,
        prompt_length=16,
        calculate_log_probs=calculate_log_probs,
        temperature=1.0,
        multi_turn={"enable": True, **multi_turn},
        agent={"default_agent_loop": "tool_agent"},
    )
    hf_engine.config = cfg
    runner = AgentLoopRunner(hf_engine, cfg, tokenizer)
    runner.tools.update({t.name: t for t in tools})
    return runner


def prompts(tokenizer, questions, agent_names=None):
    msgs = [[{"role": "user", "content": q}] for q in questions]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    non_tensor = {"raw_prompt": np.array(msgs + [None], dtype=object)[:-1]}
    if agent_names is not None:
        non_tensor["agent_name"] = np.array(agent_names, dtype=object)
    return DataProto.from_dict(
        {
            "input_ids": enc["input_ids"],
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        },
        non_tensor,
        {"seed_index": 3},
    )


def spans(mask_row):
    """[(start, end, flag)] runs of equal flags."""
    out, start = [], 0
    for j in range(1, len(mask_row) + 1):
        if j == len(mask_row) or mask_row[j] != mask_row[start]:
            out.append((start, j, mask_row[start]))
            start = j
    return out


def test_mask_is_exactly_the_policy_tokens(hf_engine, tokenizer):
    ask = AskTool()
    # The built-in tokenizer drops spaces when it encodes text, while the model can generate a space
    # token: `strict` would flag every "#### 46" turn; ignore_strippable compares up to whitespace.
    runner = make_runner(
        hf_engine,
        tokenizer,
        [ask],
        format="test_always_ask",
        max_assistant_turns=3,
        tokenization_sanity_check_mode="ignore_strippable",
    )
    out = runner.generate_sequences(prompts(tokenizer, ["12+34=", "56+10=", "20+30=", "44+44="]))
    b = out.batch
    T = b["responses"].shape[1]
    assert torch.equal(
        b["attention_mask"][:, -T:] * b["response_mask"], b["response_mask"]
    )  # mask within valid
    tool_texts = {f"<|user|>{10 + k}+{20 + k}=<|assistant|>" for k in range(1, 20)}
    n_tool_spans = 0
    for i in range(len(out)):
        valid = int(b["attention_mask"][i, -T:].sum())
        ids = b["responses"][i, :valid].tolist()
        mask = b["response_mask"][i, :valid].tolist()
        for s, e, flag in spans(mask):
            text = tokenizer.decode(ids[s:e])
            if flag == 0:  # a tool response with its template, nothing else
                assert text in tool_texts, text
                n_tool_spans += 1
            else:  # a generated turn: ends with EOS unless cut by the budget
                assert e == valid or ids[e - 1] == tokenizer.eos_token_id
        assert float(b["rollout_log_probs"][i][b["response_mask"][i] == 0].abs().sum()) == 0.0
    assert n_tool_spans >= 4
    assert all(out.non_tensor_batch["tool_calls"] >= 1)
    m = agent_step_metrics(out)
    assert m["tool/calls_per_traj"] >= 1 and m["tool/errors"] == 0 and m["tool/error_rate"] == 0
    # many trajectories share each engine call
    assert out.meta_info["metrics"]["agent/engine_mean_batch_size"] > 1.5
    assert out.meta_info["metrics"]["agent/tokenization_mismatch/mean"] == 0.0


def test_tokenization_sanity_check_modes(tokenizer):
    from hybridrl.agent.tokenization import check_tokenization, conversation_ids

    generated = tokenizer("#### 5", add_special_tokens=False)["input_ids"]
    # the re-tokenized conversation lost the space (a chat template that strips whitespace, say)
    whole = conversation_ids(tokenizer, [{"role": "assistant", "content": "####5"}], False, None)[2:-1]
    assert check_tokenization(tokenizer, generated, generated, "strict")
    assert not check_tokenization(tokenizer, generated, whole, "strict")
    assert check_tokenization(tokenizer, generated, whole, "ignore_strippable")
    other = conversation_ids(tokenizer, [{"role": "assistant", "content": "#### 6"}], False, None)[2:-1]
    assert not check_tokenization(tokenizer, generated, other, "ignore_strippable")
    assert check_tokenization(tokenizer, generated, [], "disable")


def test_turn_limits_and_parallel_calls(hf_engine, tokenizer):
    ask = AskTool()
    runner = make_runner(hf_engine, tokenizer, [ask], format="test_always_ask", max_assistant_turns=2)
    out = runner.generate_sequences(prompts(tokenizer, ["12+34=", "56+10="]))
    complete = out.non_tensor_batch["agent_truncated"] == 0
    assert complete.any()
    assert out.meta_info["metrics"]["agent/assistant_turns/mean"] <= 2.0
    for i in np.flatnonzero(complete):
        assert out.non_tensor_batch["num_turns"][i] == 4  # prompt, assistant, tool, assistant

    runner = make_runner(hf_engine, tokenizer, [ask], format="test_always_ask", max_user_turns=1)
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    assert out.non_tensor_batch["tool_calls"][0] == 1

    Script.bodies = [['{"name": "ask", "arguments": {}}'] * 3]
    ask.count = 0
    runner = make_runner(hf_engine, tokenizer, [ask], format="test_scripted", max_parallel_calls=2)
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    assert out.non_tensor_batch["tool_calls"][0] == 2 and ask.count == 2


@pytest.mark.parametrize(
    "body,expected,counter",
    [
        ("{bad json", "Error: the tool call is not valid JSON", "tool_errors"),
        ('{"name": "nope", "arguments": {}}', "Error: unknown tool 'nope'", "tool_errors"),
        ('{"name": "fail", "arguments": {}}', "Error: tool 'fail' raised KeyError", "tool_errors"),
        (
            '{"name": "slow", "arguments": {"s": 5}}',
            "Error: tool 'slow' timed out after 0.3s",
            "tool_timeouts",
        ),
    ],
)
def test_failures_become_error_responses(hf_engine, tokenizer, body, expected, counter):
    Script.bodies = [body]
    runner = make_runner(
        hf_engine,
        tokenizer,
        [RaisingTool(), SlowTool()],
        response_length=160,
        format="test_scripted",
        tool_timeout_s=0.3,
    )
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    b = out.batch
    T = b["responses"].shape[1]
    ids = b["responses"][0][(b["attention_mask"][0, -T:] == 1) & (b["response_mask"][0] == 0)]
    assert expected in tokenizer.decode(ids)
    assert out.non_tensor_batch[counter][0] == 1
    m = agent_step_metrics(out)
    assert m[f"tool/{counter.split('_')[1]}"] == 1 and m["tool/error_rate"] == 1.0


def test_over_budget_trajectory_is_truncated_and_masked(hf_engine, tokenizer):
    Script.bodies = ['{"name": "long", "arguments": {}}']
    runner = make_runner(
        hf_engine,
        tokenizer,
        [LongTool()],
        response_length=40,
        format="test_scripted",
        max_tool_response_length=1000,
    )
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    b = out.batch
    assert out.non_tensor_batch["agent_truncated"][0] == 1
    assert int(b["attention_mask"][0, -40:].sum()) == 40  # the budget is full
    assert b["response_mask"][0, -1] == 0  # the cut tool response is not trained on
    assert agent_step_metrics(out)["agent/truncated_ratio"] == 1.0


def test_tool_response_length_is_capped(hf_engine, tokenizer):
    Script.bodies = ['{"name": "long", "arguments": {}}']
    runner = make_runner(
        hf_engine,
        tokenizer,
        [LongTool()],
        format="test_scripted",
        max_tool_response_length=6,
        tool_response_truncate_side="left",
    )
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    b = out.batch
    T = b["responses"].shape[1]
    ids = b["responses"][0][(b["attention_mask"][0, -T:] == 1) & (b["response_mask"][0] == 0)]
    assert tokenizer.decode(ids).startswith("<|user|>999999...(truncated)<|assistant|>")


def test_agent_name_routes_each_row(hf_engine, tokenizer):
    ask = AskTool()
    runner = make_runner(hf_engine, tokenizer, [ask], format="test_always_ask", max_assistant_turns=2)
    names = ["single_turn_agent", "tool_agent", "single_turn_agent", "tool_agent"]
    out = runner.generate_sequences(prompts(tokenizer, ["12+34=", "56+10=", "20+30=", "44+44="], names))
    b = out.batch
    T = b["responses"].shape[1]
    for i, name in enumerate(names):
        if name == "single_turn_agent":
            assert out.non_tensor_batch["num_turns"][i] == 2 and out.non_tensor_batch["tool_calls"][i] == 0
            assert torch.equal(b["response_mask"][i], b["attention_mask"][i, -T:])
        else:
            assert out.non_tensor_batch["tool_calls"][i] >= 1
            assert (b["response_mask"][i] != b["attention_mask"][i, -T:]).any()
    with pytest.raises(ValueError, match="unknown agent loop 'nope'"):
        runner.generate_sequences(prompts(tokenizer, ["12+34="], ["nope"]))


def test_slow_tool_does_not_block_other_trajectories(hf_engine, tokenizer):
    """One trajectory's tool sleeps 1.5 s; the other trajectories keep generating meanwhile."""
    AskTool.events = []
    Script.bodies = []

    @register_tool_parser("test_row_dependent")
    class RowDependent(ToolCallParser):
        def parse(self, text):
            return text, [ToolCall("slow", {"s": 1.5})]

    class TimedAsk(AskTool):
        async def execute(self, instance_id, parameters, **kwargs):
            AskTool.events.append(("ask", time.perf_counter()))
            return await super().execute(instance_id, parameters)

    runner = make_runner(
        hf_engine, tokenizer, [SlowTool(), TimedAsk()], format="test_always_ask", max_assistant_turns=3
    )
    names = ["tool_agent"] * 3
    # row 0 calls the slow tool (its own loop with its own parser), rows 1-2 call `ask`
    slow_loop = type(runner._loop("tool_agent"))(runner.context)
    slow_loop.parser = RowDependent()
    from hybridrl.agent.loop import register_agent_loop

    register_agent_loop("test_slow_agent")(type("SlowAgent", (type(slow_loop),), {}))
    runner._loops["test_slow_agent"] = slow_loop
    names[0] = "test_slow_agent"
    runner.generate_sequences(prompts(tokenizer, ["12+34=", "56+10=", "20+30="], names))
    start = next(t for k, t in AskTool.events if k == "slow_start")
    end = next(t for k, t in AskTool.events if k == "slow_end")
    asks_during = [t for k, t in AskTool.events if k == "ask" and start < t < end]
    assert len(asks_during) >= 2  # the other rows went through turns while the slow tool slept


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_rollout_log_probs_of_a_3_turn_trajectory_equal_the_fsdp_recompute(
    hf_engine, tokenizer, use_remove_padding
):
    """Sampled at temperature 0.7 over 3 assistant turns; the FSDP actor's recompute over the whole
    multi-turn sequence must give the same log-probs on every policy token."""
    import os
    import sys

    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fsdp_testkit import free_port, init_dist

    from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.workers.actor import PPOActor

    runner = make_runner(hf_engine, tokenizer, [AskTool()], format="test_always_ask", max_assistant_turns=3)
    runner.config.temperature = 0.7
    out = runner.generate_sequences(prompts(tokenizer, ["12+34=", "56+10=", "20+30=", "44+44="]))
    turns = out.meta_info["metrics"]["agent/assistant_turns/mean"]
    assert (out.non_tensor_batch["num_turns"] == 6).any(), turns  # at least one full 3-turn trajectory
    if not dist.is_initialized():
        init_dist(0, 1, free_port())
    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    model_cfg = ModelConfig(path=get_builtin_model_path(), use_remove_padding=use_remove_padding)
    engine = FSDPEngine.build(model_cfg, fsdp, None, role="ref", load_tok=False)
    actor = PPOActor(None, engine.module, dp_size=1, use_remove_padding=use_remove_padding)
    recomputed = actor.compute_log_prob(out, micro_batch_size=2, temperature=0.7).log_probs
    mask = out.batch["response_mask"].bool()
    assert int(mask.sum()) > 20
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], recomputed[mask], atol=1e-4, rtol=0)


# ---------------------------------------------------------------- interactions (a simulated user)
VERL_INTERACTION_YAML = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""
# the built-in model's context is 256 characters: short texts for the user turns
# (no space in the reply: the tiny model's greedy continuation after "no, again" never stops)
SHORT_INTERACTION_YAML = VERL_INTERACTION_YAML.replace(
    "config: {}", "config: {correct_response: 'ok', incorrect_response: 'no,again'}"
)


def interaction_prompts(tokenizer, questions, ground_truths):
    data = prompts(tokenizer, questions)
    data.non_tensor_batch["extra_info"] = np.array(
        [{"interaction_kwargs": {"name": "gsm8k", "ground_truth": g}} for g in ground_truths], dtype=object
    )
    data.meta_info["greedy"] = True
    return data


def test_interaction_user_turns_are_masked_scored_and_limited(hf_engine, tokenizer, tmp_path):
    """veRL's gsm8k interaction (short texts): a wrong answer gets "try again" user turns (mask 0,
    score 0) until max_user_turns; a right one gets "correct" and ends the trajectory."""
    path = tmp_path / "gsm8k_interaction_config.yaml"
    path.write_text(SHORT_INTERACTION_YAML)
    runner = make_runner(
        hf_engine,
        tokenizer,
        [],
        response_length=96,
        interaction_config_path=str(path),
        max_user_turns=2,
        tokenization_sanity_check_mode="ignore_strippable",
    )
    out = runner.generate_sequences(interaction_prompts(tokenizer, ["12+34=", "20+30="], ["-1", "-1"]))
    b, nt = out.batch, out.non_tensor_batch
    T = b["responses"].shape[1]
    again = "<|user|>no,again<|assistant|>"
    first_answers = []
    for i in range(2):
        assert nt["agent_truncated"][i] == 0
        assert nt["num_turns"][i] == 6  # prompt, 3 assistant turns, 2 user turns (max_user_turns=2)
        assert nt["turn_scores"][i] == [0.0, 0.0]
        valid = int(b["attention_mask"][i, -T:].sum())
        ids, mask = b["responses"][i, :valid].tolist(), b["response_mask"][i, :valid].tolist()
        runs = spans(mask)
        assert [f for _, _, f in runs] == [1, 0, 1, 0, 1]
        assert all(tokenizer.decode(ids[s:e]) == again for s, e, f in runs if f == 0)
        first_answers.append(tokenizer.decode(ids[runs[0][0] : runs[0][1]], skip_special_tokens=True))
    assert out.meta_info["metrics"]["agent/interaction_turns/mean"] == 2.0

    # the model's own first answers as ground truth: one "correct" user turn, then the end
    truths = [a.split("####")[-1].strip() for a in first_answers]
    out = runner.generate_sequences(interaction_prompts(tokenizer, ["12+34=", "20+30="], truths))
    for i in range(2):
        assert out.non_tensor_batch["turn_scores"][i] == [1.0], (first_answers, truths)
        assert out.non_tensor_batch["num_turns"][i] == 3
        valid = int(out.batch["attention_mask"][i, -T:].sum())
        ids = out.batch["responses"][i, :valid].tolist()
        s, e, flag = spans(out.batch["response_mask"][i, :valid].tolist())[-1]
        assert flag == 0 and tokenizer.decode(ids[s:e]) == "<|user|>ok<|assistant|>"

    bad = prompts(tokenizer, ["12+34="])
    with pytest.raises(ValueError, match="interaction_kwargs with a 'name'"):
        runner.generate_sequences(bad)


def test_interaction_yaml_errors_name_the_cause(tmp_path):
    from hybridrl.agent.interaction import Gsm8kInteraction, load_interactions

    path = tmp_path / "i.yaml"
    path.write_text("interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n")
    ((name, inter),) = load_interactions(str(path)).items()
    assert name == "gsm8k" and isinstance(inter, Gsm8kInteraction)  # veRL's default name

    async def turns():
        iid = await inter.start_interaction("r0", name="gsm8k", ground_truth="72")
        wrong = await inter.generate_response(
            iid, [{"role": "assistant", "content": "#### 71"}], name="gsm8k"
        )
        right = await inter.generate_response(iid, [{"role": "assistant", "content": "so #### 72"}])
        await inter.finalize_interaction(iid)
        return wrong, right

    wrong, right = asyncio.run(turns())
    assert wrong == (False, Gsm8kInteraction.INCORRECT, 0.0, {}) and "try again" in wrong[1]
    assert right == (True, "Your response is correct!", 1.0, {})
    path.write_text(
        VERL_INTERACTION_YAML
        + '  - name: "gsm8k"\n    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n'
    )
    with pytest.raises(ValueError, match="duplicate interaction name 'gsm8k'"):
        load_interactions(str(path))
    path.write_text("interaction:\n  - class_name: hybridrl.tools.tool.BaseTool\n")
    with pytest.raises(TypeError, match="not a hybridrl BaseInteraction"):
        load_interactions(str(path))
    path.write_text("tools: []\n")
    with pytest.raises(ValueError, match="top-level `interaction:` list"):
        load_interactions(str(path))
