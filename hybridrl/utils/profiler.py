"""veRL's profiler keys (`global_profiler.*`, `<role>.profiler.*`) backed by torch.profiler.

`global_profiler.tool=torch` and `global_profiler.steps=[2,4]` choose the tool and the training
steps; a role (`actor_rollout_ref.actor`, `.ref`, `critic`) takes part when its
`profiler.enable` is true, on every rank (`all_ranks`) or on the ranks listed in `ranks`.
Each taking part process writes one Chrome trace per chosen step,
`<save_path>/step_<step>/rank_<rank>.json` (open it in chrome://tracing or Perfetto). The roles
of one slot share a process, so they share its trace. `tool_config.torch.contents` may hold
`cpu`, `cuda`, `memory`, `shapes`, `stack` (default: the activities of the device).

`global_profiler.tool=nsys` (NVIDIA Nsight Systems) and `npu` (Ascend, torch_npu) are in
`hybridrl.utils.profiler_tools` (untested on GPU / NPU; a missing device or tool fails when the
workers start, not in the config stage, which checks configuration only). `torch_memory` records
the CUDA caching allocator's history over each chosen step and dumps a snapshot,
`<save_path>/step_<step>/rank_<rank>.pickle` (global_tool_config.torch_memory; CUDA only, untested on GPU).
`profile_continuous_steps=True` joins consecutive chosen steps into one session (trace
`step_<first>`); False gives each step its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

TOOLS = ("torch", "nsys", "npu", "torch_memory")
CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")


@dataclass
class ProfilerConfig:
    """`<role>.profiler`: whether this role is profiled, on which ranks (tool/save_path: global)."""

    tool: str | None = None  # null, or the same as global_profiler.tool
    enable: bool = False  # profile this role at global_profiler.steps
    all_ranks: bool = False  # profile every rank of the role
    ranks: list[int] = field(default_factory=list)  # ranks to profile when all_ranks is false
    save_path: str | None = None  # trace folder (null: global_profiler.save_path)
    # per-tool options (torch.contents: cpu, cuda, memory, shapes, stack)
    tool_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class GlobalProfilerConfig:
    """`global_profiler`: the tool, the steps to profile and where the traces go."""

    tool: str | None = None  # torch, nsys, npu or torch_memory (null: off)
    steps: list[int] | None = None  # training steps to profile
    profile_continuous_steps: bool = False  # one session over consecutive chosen steps
    save_path: str = "outputs/profile"  # where the traces are written
    # options of the nsys / torch_memory tools
    global_tool_config: dict[str, Any] = field(default_factory=dict)


def check_profiler(glob: GlobalProfilerConfig, roles: dict[str, ProfilerConfig]) -> None:
    """Raise ValueError naming the key when a profiler setting cannot be honoured here (configuration
    only: devices and vendor tools are checked when the workers start)."""
    from hybridrl.utils.profiler_tools import npu_options, nsys_options, torch_memory_options, torch_options

    for key, tool in [("global_profiler.tool", glob.tool)] + [
        (f"{k}.profiler.tool", r.tool) for k, r in roles.items()
    ]:
        if tool is not None and tool not in TOOLS:
            raise ValueError(f"{key}={tool!r} is not one of {list(TOOLS)}")
        if tool is not None and glob.tool is not None and tool != glob.tool:
            raise ValueError(
                f"{key}={tool!r} differs from global_profiler.tool={glob.tool!r}; leave it unset"
            )
    unknown = sorted(set(glob.global_tool_config or {}) - {"nsys", "npu", "torch", "torch_memory"})
    if unknown:
        raise ValueError(f"global_profiler.global_tool_config has unknown tools {unknown}")
    if glob.tool == "nsys":
        nsys_options(glob.global_tool_config)
    if glob.tool == "torch_memory":
        torch_memory_options(glob.global_tool_config)
    for key, r in roles.items():
        contents = (r.tool_config or {}).get("torch", {}).get("contents", []) or []
        bad = [c for c in contents if c not in CONTENTS]
        if bad:
            raise ValueError(
                f"{key}.profiler.tool_config.torch.contents has unknown entries {bad}; use {CONTENTS}"
            )
        if glob.tool == "npu":
            npu_options(r.tool_config, key)
        if glob.tool == "torch":
            torch_options(r.tool_config, key)
    if any(r.enable for r in roles.values()) and glob.tool is None:
        raise ValueError(
            "a role has profiler.enable=True but global_profiler.tool is null; set global_profiler.tool=torch"
        )


def profiled_steps(glob: GlobalProfilerConfig) -> set[int]:
    return set(glob.steps or []) if glob.tool else set()


@dataclass(frozen=True)
class ProfileRequest:
    """What the driver sends a worker when a chosen step begins (plain data, picklable)."""

    step: int
    save_path: str
    contents: tuple[str, ...] = ()
    tool: str = "torch"
    options: tuple[tuple[str, Any], ...] = ()  # npu: the role's tool_config.npu (profiler_tools.npu_options)
    tag: str = ""  # discrete sessions: the worker call they cover


def wants_rank(cfg: ProfilerConfig, rank: int) -> bool:
    return cfg.enable and (cfg.all_ranks or rank in (cfg.ranks or []))


def request_for(glob: GlobalProfilerConfig, cfg: ProfilerConfig, step: int, tag: str = "") -> ProfileRequest:
    from hybridrl.utils.profiler_tools import npu_options, torch_memory_options

    contents = tuple((cfg.tool_config or {}).get("torch", {}).get("contents", []) or ())
    tool = glob.tool or "torch"
    options: tuple = ()
    if tool == "npu":
        options = tuple(npu_options(cfg.tool_config, "role").items())
    elif tool == "torch_memory":
        options = tuple(torch_memory_options(glob.global_tool_config).items())
    return ProfileRequest(
        step=step,
        save_path=cfg.save_path or glob.save_path,
        contents=contents,
        tool=tool,
        options=options,
        tag=tag,
    )


def _device_session(request: ProfileRequest, rank: int) -> Any:
    from hybridrl.utils.profiler_tools import NpuSession, NsysSession, TorchMemorySession

    if request.tool == "nsys":
        return NsysSession(request.step, request.tag)
    sub = f"step_{request.step}" + (f"_{request.tag}" if request.tag else "")
    if request.tool == "torch_memory":
        path = os.path.join(request.save_path, sub, f"rank_{rank}.pickle")
        return TorchMemorySession(dict(request.options), path)
    return NpuSession(dict(request.options), os.path.join(request.save_path, sub, f"rank_{rank}"))


class StepProfiler:
    """One torch.profiler session per process and step; started by the first role, ended by the last."""

    def __init__(self) -> None:
        self._prof = None
        self._users = 0
        self._path = ""

    def start(self, request: ProfileRequest, rank: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._users += 1
        if self._prof is not None:
            return
        if request.tool != "torch":  # nsys / npu / torch_memory: the session writes its own output
            self._prof = _device_session(request, rank)
            self._prof.start()
            self._path = ""
            return
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and (not request.contents or "cuda" in request.contents):
            acts.append(ProfilerActivity.CUDA)
        c = set(request.contents)
        self._prof = profile(
            activities=acts,
            record_shapes="shapes" in c,
            profile_memory="memory" in c,
            with_stack="stack" in c,
        )
        self._prof.__enter__()
        sub = f"step_{request.step}" + (f"_{request.tag}" if request.tag else "")
        self._path = os.path.join(request.save_path, sub, f"rank_{rank}.json")

    def stop(self) -> str | None:
        """End the session when its last role stops; returns the trace file written (or None)."""
        if self._prof is None:
            return None
        self._users -= 1
        if self._users > 0:
            return None
        prof, self._prof = self._prof, None
        if not self._path:  # a device session (nsys / npu / torch_memory)
            prof.stop()
            return getattr(prof, "path", None)
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        prof.export_chrome_trace(self._path)
        return self._path


PROCESS_PROFILER = StepProfiler()
