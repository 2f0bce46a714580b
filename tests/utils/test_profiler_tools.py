"""Profiler keys that act: continuous steps, discrete sessions, nsys / npu start-up errors on CPU.

The worker is a real StepProfiling worker in this process (local backend) and the torch sessions
are real torch.profiler traces; nsys and npu cannot run here (no CUDA, no torch_npu): their config
stage passes and their sessions fail at worker start with a message naming the tool.
"""

from __future__ import annotations

import os

import pytest
import torch

from hybridrl.single_controller.base import Worker, register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.single_controller.local import LocalWorkerGroup
from hybridrl.single_controller.ray.base import RayClassWithInitArgs
from hybridrl.trainer.ppo.config import PPOConfig
from hybridrl.trainer.ppo.profiling import DiscreteGroup, StepProfilerDriver, session_bounds
from hybridrl.trainer.ppo.workers import WorkerGroups, apply_nsight
from hybridrl.utils.profiler import (
    GlobalProfilerConfig,
    ProfilerConfig,
    ProfileRequest,
    StepProfiler,
    check_profiler,
    request_for,
)
from hybridrl.utils.profiler_tools import npu_options, nsys_options, torch_memory_options
from hybridrl.workers.profiling import StepProfiling


class ProfWorker(StepProfiling, Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def work(self) -> float:
        return float((torch.randn(32, 32) @ torch.randn(32, 32)).sum())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate_sequences(self) -> float:
        return float((torch.randn(16, 16) @ torch.randn(16, 16)).sum())


@pytest.fixture
def group():
    g = LocalWorkerGroup(RayClassWithInitArgs(ProfWorker), name_prefix="prof", num_threads=1)
    yield g
    g.shutdown()


def config_for(tmp_path, tool="torch", steps=(1, 2, 4), continuous=False) -> PPOConfig:
    c = PPOConfig()
    c.global_profiler.tool, c.global_profiler.steps = tool, list(steps)
    c.global_profiler.profile_continuous_steps = continuous
    c.global_profiler.save_path = str(tmp_path)
    c.actor_rollout_ref.actor.profiler.enable = c.actor_rollout_ref.actor.profiler.all_ranks = True
    return c


def run_steps(config, group, n=4, generate=False) -> StepProfilerDriver:
    workers = WorkerGroups(actor_rollout=group)
    driver = StepProfilerDriver(config, workers)
    for step in range(1, n + 1):
        driver.begin(step)
        if generate:
            workers.actor_rollout.generate_sequences()
        workers.actor_rollout.work()
        driver.end(step)
        assert workers.actor_rollout is group  # unwrapped after every step
    return driver


def test_torch_discrete_gives_each_call_of_a_chosen_step_its_own_trace(tmp_path, group):
    c = config_for(tmp_path, steps=(2,))
    c.actor_rollout_ref.actor.profiler.tool_config = {"torch": {"discrete": True, "contents": ["cpu"]}}
    driver = run_steps(c, group, n=3, generate=True)
    assert sorted(os.listdir(tmp_path)) == ["step_2_generate_sequences", "step_2_work"]
    assert len(driver.traces) == 2


def test_rollout_profiler_alone_traces_each_generate_call(tmp_path, group):
    """veRL's rollout.profiler (examples/profile/run_qwen2_5_7b_torch_profile.sh) without the actor's:
    only the generate calls of the chosen steps are traced; with the actor's, they are in its trace."""
    c = config_for(tmp_path, steps=(1, 3))
    c.actor_rollout_ref.actor.profiler.enable = False
    c.actor_rollout_ref.rollout.profiler.enable = c.actor_rollout_ref.rollout.profiler.all_ranks = True
    driver = run_steps(c, group, n=3, generate=True)
    assert sorted(os.listdir(tmp_path)) == ["step_1_generate_sequences", "step_3_generate_sequences"]
    assert len(driver.traces) == 2
    both = config_for(tmp_path / "both", steps=(1,))
    both.actor_rollout_ref.rollout.profiler.enable = True
    run_steps(both, group, n=1, generate=True)
    assert sorted(os.listdir(tmp_path / "both")) == ["step_1"]


def test_torch_tool_config_refuses_what_it_cannot_honour():
    glob = GlobalProfilerConfig(tool="torch")
    for tool_config, match in (
        ({"torch": {"schedule": {"active": 2}}}, "schedule"),
        ({"torch": {"dicsrete": True}}, "unknown keys"),
        ({"torch": {"profile_token_start": 5}}, "token windows"),
    ):
        with pytest.raises(ValueError, match=match):
            check_profiler(
                glob, {"actor_rollout_ref.rollout": ProfilerConfig(enable=True, tool_config=tool_config)}
            )
    ok = {"torch": {"discrete": True, "schedule": {"active": 0, "wait": 0}, "profile_token_end": None}}
    check_profiler(glob, {"actor_rollout_ref.rollout": ProfilerConfig(enable=True, tool_config=ok)})


def test_session_bounds():
    assert session_bounds({1, 2, 5}, True) == ({1, 5}, {2, 5})
    assert session_bounds({1, 2, 5}, False) == ({1, 2, 5}, {1, 2, 5})


@pytest.mark.parametrize("continuous", [False, True])
def test_profile_continuous_steps_joins_consecutive_steps_into_one_trace(tmp_path, group, continuous):
    driver = run_steps(config_for(tmp_path, continuous=continuous), group)
    want = ["step_1", "step_4"] if continuous else ["step_1", "step_2", "step_4"]
    assert sorted(os.listdir(tmp_path)) == want
    assert len(driver.traces) == len(want) and all(os.path.getsize(p) > 0 for p in driver.traces)


def test_discrete_group_gives_each_call_its_own_session(tmp_path, group):
    c = config_for(tmp_path)
    traces: list[str] = []
    dg = DiscreteGroup(group, c.global_profiler, c.actor_rollout_ref.actor.profiler, 3, traces)
    dg.work()
    dg.work()
    assert sorted(os.listdir(tmp_path)) == ["step_3_work"] and len(traces) == 2


def test_nsys_and_npu_pass_the_config_stage_and_fail_at_worker_start_on_cpu(tmp_path):
    roles = {"actor_rollout_ref.actor": ProfilerConfig(enable=True, all_ranks=True)}
    c = config_for(tmp_path, tool="nsys")
    c.global_profiler.global_tool_config = {"nsys": {"discrete": True}}
    check_profiler(c.global_profiler, roles)  # configuration only
    assert nsys_options(c.global_profiler.global_tool_config)["worker_nsight_options"]["capture-range"] == (
        "cudaProfilerApi"
    )
    with pytest.raises(RuntimeError, match="tool=nsys profiles CUDA workers"):
        apply_nsight(c, RayClassWithInitArgs(ProfWorker), gpu=False)
    for tool, match in (("nsys", "needs CUDA"), ("npu", "needs torch_npu")):
        if tool == "npu":
            pytest.importorskip("torch")  # torch_npu absent here: the error path
        with pytest.raises(RuntimeError, match=match):
            StepProfiler().start(ProfileRequest(step=1, save_path=str(tmp_path), tool=tool, options=()), 0)


def test_bad_tool_options_are_config_errors():
    with pytest.raises(ValueError, match="controller_nsight_options"):
        nsys_options({"nsys": {"controller_nsight_options": {"trace": "cuda"}}})
    with pytest.raises(ValueError, match="unknown keys"):
        nsys_options({"nsys": {"dicsrete": True}})
    with pytest.raises(ValueError, match="level"):
        npu_options({"npu": {"level": "level9"}}, "actor_rollout_ref.actor")
    assert npu_options({"npu": {"contents": ["npu", "cpu"], "discrete": True}}, "k")["discrete"] is True
    with pytest.raises(ValueError, match="torch_memory.context='heap'"):
        check_profiler(
            GlobalProfilerConfig(
                tool="torch_memory", global_tool_config={"torch_memory": {"context": "heap"}}
            ),
            {},
        )
    with pytest.raises(ValueError, match="torch_memory has unknown keys"):
        torch_memory_options({"torch_memory": {"max_entries": 5}})


def _torch_memory_config(tmp_path) -> PPOConfig:
    """veRL's example (sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh) options."""
    c = config_for(tmp_path, tool="torch_memory", steps=(1,))
    c.global_profiler.global_tool_config = {
        "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32}
    }
    return c


def test_torch_memory_passes_the_config_stage_and_needs_cuda_in_the_worker(tmp_path):
    c = _torch_memory_config(tmp_path)
    cfg = c.actor_rollout_ref.actor.profiler
    check_profiler(c.global_profiler, {"actor_rollout_ref.actor": cfg})
    request = request_for(c.global_profiler, cfg, 1)
    assert dict(request.options)["trace_alloc_max_entries"] == 100000
    assert dict(request.options)["context"] == "all"  # veRL's default
    if torch.cuda.is_available():
        pytest.skip("the CPU error path")
    with pytest.raises(RuntimeError, match="tool=torch_memory records the CUDA caching allocator"):
        StepProfiler().start(request, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_memory_dumps_a_snapshot_per_step_on_cuda(tmp_path):
    import pickle

    c = _torch_memory_config(tmp_path)
    prof = StepProfiler()
    prof.start(request_for(c.global_profiler, c.actor_rollout_ref.actor.profiler, 1), 0)
    x = torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
    path = prof.stop()
    assert path == os.path.join(str(tmp_path), "step_1", "rank_0.pickle") and x.numel()
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["device_traces"] and any(snap["device_traces"])
