"""Request-level rollout options on the real HF engine and built-in model: over_sample_rate
(abort the long tail) and sglang_rollout_mode=server's rollout.server.* limits."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_tool_agent import hf_engine, make_runner, prompts, tokenizer  # noqa: F401 (fixtures)

from hybridrl.agent.parser import ToolCall, ToolCallParser, register_tool_parser
from hybridrl.tools.tool import BaseTool, ToolResponse


@register_tool_parser("test_always_nap")
class AlwaysNap(ToolCallParser):
    def parse(self, text):
        return text, [ToolCall("nap", {})]


class NapTool(BaseTool):
    """Sleeps for the row's `execute_kwargs.delay` seconds (extra_info.tools_kwargs)."""

    released: list[str] = []

    def __init__(self):
        super().__init__({}, {"type": "function", "function": {"name": "nap"}})

    async def execute(self, instance_id, parameters, delay=0.0, **kwargs):
        await asyncio.sleep(float(delay))
        return ToolResponse(text="1+1="), 0.0, {}

    async def release(self, instance_id, **kwargs):
        NapTool.released.append(instance_id)
        await super().release(instance_id)


def nap_prompts(tokenizer, delays):  # noqa: F811
    data = prompts(tokenizer, ["12+34="] * len(delays))
    import numpy as np

    data.non_tensor_batch["extra_info"] = np.array(
        [{"tools_kwargs": {"nap": {"execute_kwargs": {"delay": d}}}} for d in delays], dtype=object
    )
    return data


def test_over_sample_rate_aborts_the_slowest_trajectories(hf_engine, tokenizer):  # noqa: F811
    """8 rows, 2 of them with a 60 s tool: over_sample_rate=0.25 waits for 6 and aborts 2."""
    NapTool.released = []
    runner = make_runner(
        hf_engine, tokenizer, [NapTool()], format="test_always_nap", max_assistant_turns=2, tool_timeout_s=300
    )
    runner.config.over_sample_rate = 0.25
    t0 = time.perf_counter()
    out = runner.generate_sequences(nap_prompts(tokenizer, [0, 0, 60, 0, 0, 60, 0, 0]))
    assert time.perf_counter() - t0 < 60  # did not wait for the slow tools
    b = out.batch
    T = b["responses"].shape[1]
    for i in range(8):
        valid = int(b["attention_mask"][i, -T:].sum())
        if i in (2, 5):  # aborted: empty response, every mask 0, nothing to train on
            assert valid == 0 and int(b["response_mask"][i].sum()) == 0
            assert float(b["rollout_log_probs"][i].abs().sum()) == 0.0
        else:
            assert valid > 0 and out.non_tensor_batch["tool_calls"][i] == 1
    assert out.meta_info["metrics"]["agent/aborted/mean"] == 0.25
    assert len(NapTool.released) == 8  # aborted trajectories still release their tools

    # validation batches are never cut
    runner.config.over_sample_rate = 0.5
    data = nap_prompts(tokenizer, [0, 0.5])
    data.meta_info["validate"] = True
    out = runner.generate_sequences(data)
    assert (out.batch["response_mask"].sum(-1) > 0).all()


def test_server_mode_limits_requests(hf_engine, tokenizer):  # noqa: F811
    """max_connections bounds requests in flight (batch size 1); timeout + max_attempts fail the
    request after that many tries, naming the keys."""
    runner = make_runner(hf_engine, tokenizer, [NapTool()], format="test_always_nap", max_assistant_turns=2)
    out = runner.generate_sequences(nap_prompts(tokenizer, [0, 0, 0, 0]))
    assert out.meta_info["metrics"]["agent/engine_mean_batch_size"] > 1.0  # engine mode: batched

    def server_runner(**server):
        r = make_runner(
            hf_engine,
            tokenizer,
            [NapTool()],
            format="test_always_nap",
            max_assistant_turns=2,
        )
        r.config.sglang_rollout_mode = "server"
        for k, v in server.items():
            setattr(r.config.server, k, v)
        from hybridrl.agent.runner import AgentLoopRunner

        return AgentLoopRunner(r.rollout, r.config, tokenizer)

    r = server_runner(max_connections=1)
    r.tools.update({"nap": NapTool()})
    out = r.generate_sequences(nap_prompts(tokenizer, [0, 0, 0, 0]))
    assert out.meta_info["metrics"]["agent/engine_mean_batch_size"] == 1.0
    assert (out.batch["response_mask"].sum(-1) > 0).all()

    r = server_runner(timeout=1e-4, max_attempts=2, retry_delay=0.01)
    r.tools.update({"nap": NapTool()})
    with pytest.raises(TimeoutError, match=r"in 2 attempts \(actor_rollout_ref.rollout.server.timeout"):
        r.generate_sequences(nap_prompts(tokenizer, [0]))
    assert r.engine.num_timeouts == 2


def test_rollout_trace_to_a_local_mlflow_store(hf_engine, tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """rollout.trace.backend=mlflow: one trace per trajectory in a real local MLflow store, tagged
    like veRL's, with generate / tool spans and (token2text) the decoded texts."""
    mlflow = pytest.importorskip("mlflow")
    import numpy as np

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def traced_runner(**trace):
        r = make_runner(hf_engine, tokenizer, [NapTool()], format="test_always_nap", max_assistant_turns=2)
        for k, v in {
            "backend": "mlflow",
            "project_name": "proj_t",
            "experiment_name": "exp_t",
            **trace,
        }.items():
            setattr(r.config.trace, k, v)
        from hybridrl.agent.runner import AgentLoopRunner

        runner = AgentLoopRunner(r.rollout, r.config, tokenizer)
        runner.tools.update({"nap": NapTool()})
        return runner

    def traces(step):
        mlflow.flush_trace_async_logging()
        exp = mlflow.get_experiment_by_name("proj_t")
        found = mlflow.search_traces(locations=[exp.experiment_id], return_type="list")
        return [t for t in found if t.info.tags.get("step") == str(step)]

    data = nap_prompts(tokenizer, [0, 0])
    data.meta_info["global_steps"] = 7
    out = traced_runner(token2text=True).generate_sequences(data)
    got = sorted(traces(7), key=lambda t: t.info.tags["sample_index"])
    assert [t.info.tags["sample_index"] for t in got] == ["0", "1"]
    T = out.batch["responses"].shape[1]
    for i, t in enumerate(got):
        assert t.info.tags["rollout_n"] == "0" and t.info.tags["experiment_name"] == "exp_t"
        names = [s.name for s in t.data.spans]
        assert names.count("generate") == 2 and names.count("tool/nap") == 1, names
        root = next(s for s in t.data.spans if s.name == "agent_loop")
        valid = int(out.batch["attention_mask"][i, -T:].sum())
        assert root.outputs["response_ids"] == out.batch["responses"][i, :valid].tolist()
        assert root.outputs["response_text"] == tokenizer.decode(root.outputs["response_ids"])
        assert "<|assistant|>" in root.inputs["prompt_text"]

    # max_samples_per_step_per_worker=1: every rollout of one sample, nothing of the other
    data = nap_prompts(tokenizer, [0, 0, 0, 0])
    data.non_tensor_batch["extra_info"] = np.array(
        [dict(e, index=k // 2) for k, e in enumerate(data.non_tensor_batch["extra_info"])], dtype=object
    )
    data.meta_info["global_steps"] = 8
    traced_runner(max_samples_per_step_per_worker=1).generate_sequences(data)
    got = traces(8)
    assert len(got) == 2 and len({t.info.tags["sample_index"] for t in got}) == 1
    assert sorted(t.info.tags["rollout_n"] for t in got) == ["0", "1"]
    root = next(s for s in got[0].data.spans if s.name == "agent_loop")
    assert "response_text" not in root.outputs  # token2text off
