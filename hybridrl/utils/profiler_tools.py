"""The device profilers behind `global_profiler.tool=nsys`, `=npu` and `=torch_memory` (untested on GPU / NPU).

nsys (NVIDIA Nsight Systems), as veRL does it: Ray starts each worker process under `nsys profile`
(the actor's runtime_env `nsight` option, from `global_tool_config.nsys.worker_nsight_options`,
with `capture-range=cudaProfilerApi`), and the worker opens a capture range with
`torch.cuda.profiler.start()` (cudaProfilerStart) at a chosen step, inside an NVTX range named after
the step, and closes it with `torch.cuda.profiler.stop()`. `discrete=True` gives each worker call of
the step its own range (the driver brackets the calls, see trainer/ppo/profiling.py).
Nsight writes the reports (`worker_process_<pid>.nsys-rep` under Ray's session log folder).

npu (Ascend): `torch_npu.profiler.profile` with the role's `tool_config.npu` (contents: npu, cpu,
memory, shapes, module, stack; level: level_none, level0, level1, level2; analysis), traces under
`<save_path>/step_<step>/rank_<rank>` (tensorboard_trace_handler).

Everything imports without CUDA or torch_npu; a missing device, `nsys` or `torch_npu` fails when
the workers start (`check_nsys_available`) or when the first session starts, naming the key.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

NSYS_KEYS = ("discrete", "controller_nsight_options", "worker_nsight_options")
TORCH_KEYS = ("contents", "discrete", "schedule", "profile_token_start", "profile_token_end")
NPU_KEYS = ("discrete", "contents", "level", "analysis")
NPU_CONTENTS = ("npu", "cpu", "memory", "shapes", "module", "stack")
NPU_LEVELS = ("level_none", "level0", "level1", "level2")
TORCH_MEMORY_DEFAULTS = {
    "trace_alloc_max_entries": 100_000,
    "stack_depth": 32,
    "context": "all",
    "stacks": "all",
    "kw_args": {},
}
# What Ray needs to start a worker under Nsight so that cudaProfilerStart/Stop delimit the capture.
NSYS_WORKER_DEFAULTS = {
    "trace": "cuda,nvtx,cublas,ucx",
    "cuda-memory-usage": "true",
    "cuda-graph-trace": "graph",
    "capture-range": "cudaProfilerApi",
    "capture-range-end": "repeat-shutdown:1000",
    "kill": "none",
}


def torch_options(tool_config: dict[str, Any], key: str) -> dict[str, Any]:
    """A role's `tool_config.torch` for `global_profiler.tool=torch`: {"discrete": bool}.

    `discrete=True` gives every worker call of a chosen step its own trace (as nsys / npu);
    `schedule.*` (veRL's torch.profiler schedule over the update loop's mini-batches) and the
    rollout's `profile_token_start/end` (vLLM engine-side token windows) are accepted at their
    off values (0 / null) only. ValueError naming the key otherwise.
    """
    torch_cfg = dict((tool_config or {}).get("torch") or {})
    bad = sorted(set(torch_cfg) - set(TORCH_KEYS))
    if bad:
        raise ValueError(
            f"{key}.profiler.tool_config.torch has unknown keys {bad}; known: {list(TORCH_KEYS)}"
        )
    busy = {k: v for k, v in dict(torch_cfg.get("schedule") or {}).items() if v not in (0, None)}
    if busy:
        raise ValueError(
            f"{key}.profiler.tool_config.torch.schedule={busy}: a torch.profiler schedule over mini-batches is "
            "not implemented; a chosen step is traced whole (or per worker call with discrete=True). Leave "
            "schedule.* at 0"
        )
    for k in ("profile_token_start", "profile_token_end"):
        if torch_cfg.get(k) is not None:
            raise ValueError(
                f"{key}.profiler.tool_config.torch.{k}={torch_cfg[k]!r}: token windows are a vLLM engine "
                "option; the rollout is traced over each whole generate call here. Leave it null"
            )
    return {"discrete": bool(torch_cfg.get("discrete", False))}


def nsys_options(global_tool_config: dict[str, Any]) -> dict[str, Any]:
    """`global_tool_config.nsys` with its defaults; ValueError for keys this tool does not have."""
    nsys = dict((global_tool_config or {}).get("nsys") or {})
    bad = sorted(set(nsys) - set(NSYS_KEYS))
    if bad:
        raise ValueError(
            f"global_profiler.global_tool_config.nsys has unknown keys {bad}; known: {list(NSYS_KEYS)}"
        )
    if nsys.get("controller_nsight_options"):
        raise ValueError(
            "global_profiler.global_tool_config.nsys.controller_nsight_options: the driver is the process you "
            "started; run it under Nsight yourself (nsys profile python -m hybridrl.trainer.main_ppo ...) and "
            "leave the key unset"
        )
    workers = {**NSYS_WORKER_DEFAULTS, **dict(nsys.get("worker_nsight_options") or {})}
    return {"discrete": bool(nsys.get("discrete", False)), "worker_nsight_options": workers}


def npu_options(tool_config: dict[str, Any], key: str) -> dict[str, Any]:
    """A role's `tool_config.npu` with its defaults; ValueError naming `key` for a bad entry."""
    npu = dict((tool_config or {}).get("npu") or {})
    bad = sorted(set(npu) - set(NPU_KEYS))
    if bad:
        raise ValueError(f"{key}.profiler.tool_config.npu has unknown keys {bad}; known: {list(NPU_KEYS)}")
    contents = list(npu.get("contents") or ["npu", "cpu"])
    wrong = [c for c in contents if c not in NPU_CONTENTS]
    if wrong:
        raise ValueError(
            f"{key}.profiler.tool_config.npu.contents has unknown entries {wrong}; use {NPU_CONTENTS}"
        )
    level = npu.get("level", "level0")
    if level not in NPU_LEVELS:
        raise ValueError(f"{key}.profiler.tool_config.npu.level={level!r} is not one of {NPU_LEVELS}")
    return {
        "discrete": bool(npu.get("discrete", False)),
        "contents": contents,
        "level": level,
        "analysis": bool(npu.get("analysis", True)),
    }


def check_nsys_available(uses_gpu: bool) -> None:
    """At worker start: nsys needs CUDA workers and the `nsys` executable (Ray's nsight plugin runs it)."""
    if not uses_gpu:
        raise RuntimeError(
            "global_profiler.tool=nsys profiles CUDA workers, but this run's workers use no GPU "
            "(trainer.device / no CUDA device); use global_profiler.tool=torch on CPU"
        )
    if shutil.which("nsys") is None:
        raise RuntimeError(
            "global_profiler.tool=nsys: Nsight Systems (`nsys`) is not on PATH; Ray starts the workers under it "
            "(runtime_env nsight). Install Nsight Systems or use global_profiler.tool=torch"
        )


class NsysSession:
    """A cudaProfilerStart/Stop capture range inside an NVTX range (the worker runs under nsys)."""

    def __init__(self, step: int, tag: str = "") -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "global_profiler.tool=nsys needs CUDA in the worker (torch.cuda.is_available() is False)"
            )
        self.name = f"step_{step}" + (f"/{tag}" if tag else "")

    def start(self) -> None:
        import torch

        torch.cuda.nvtx.range_push(self.name)
        torch.cuda.profiler.start()

    def stop(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()


class NpuSession:
    """torch_npu.profiler over one step (or one call with discrete), written under `out_dir`."""

    def __init__(self, options: dict[str, Any], out_dir: str) -> None:
        try:
            import torch_npu
        except ImportError:
            raise RuntimeError(
                "global_profiler.tool=npu needs torch_npu (Ascend) in the worker; it is not installed. "
                "Use global_profiler.tool=torch"
            ) from None
        prof = torch_npu.profiler
        c = set(options["contents"])
        acts = [
            a
            for name, a in (("cpu", prof.ProfilerActivity.CPU), ("npu", prof.ProfilerActivity.NPU))
            if name in c
        ]
        level = getattr(
            prof.ProfilerLevel, {"level_none": "Level_none"}.get(options["level"], options["level"].title())
        )
        experimental = prof._ExperimentalConfig(profiler_level=level)  # torch_npu's documented name
        self.prof = prof.profile(
            activities=acts,
            record_shapes="shapes" in c,
            profile_memory="memory" in c,
            with_stack="stack" in c,
            with_modules="module" in c,
            experimental_config=experimental,
            on_trace_ready=prof.tensorboard_trace_handler(out_dir, analyse_flag=options["analysis"]),
        )
        self.out_dir = out_dir

    def start(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        self.prof.start()

    def stop(self) -> None:
        self.prof.stop()


def torch_memory_options(global_tool_config: dict[str, Any]) -> dict[str, Any]:
    """`global_tool_config.torch_memory` with veRL's defaults; ValueError for a bad entry."""
    opts = dict((global_tool_config or {}).get("torch_memory") or {})
    bad = sorted(set(opts) - set(TORCH_MEMORY_DEFAULTS))
    if bad:
        raise ValueError(
            f"global_profiler.global_tool_config.torch_memory has unknown keys {bad}; "
            f"known: {list(TORCH_MEMORY_DEFAULTS)}"
        )
    opts = {**TORCH_MEMORY_DEFAULTS, **opts}
    for name, allowed in (("context", ("alloc", "state", "all")), ("stacks", ("python", "cpp", "all"))):
        if opts[name] not in allowed:
            raise ValueError(
                f"global_profiler.global_tool_config.torch_memory.{name}={opts[name]!r} is not one of {allowed}"
            )
    opts["kw_args"] = dict(opts["kw_args"] or {})
    return opts


class TorchMemorySession:
    """CUDA caching-allocator history over one step: `torch.cuda.memory._record_memory_history`
    at start, `_dump_snapshot` to `path` (a pickle for pytorch.org/memory_viz) at stop. Options
    the installed torch does not take (torch 2.13 has no `stack_depth`) are left out, as veRL does."""

    def __init__(self, options: dict[str, Any], path: str) -> None:
        import inspect

        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "global_profiler.tool=torch_memory records the CUDA caching allocator, but this worker has no "
                "CUDA device; use global_profiler.tool=torch (tool_config.torch.contents=[memory]) on CPU"
            )
        self._record = torch.cuda.memory._record_memory_history
        params = set(inspect.signature(self._record).parameters)
        kwargs = {
            "context": options["context"],
            "stacks": options["stacks"],
            "max_entries": options["trace_alloc_max_entries"],
            "stack_depth": options["stack_depth"],
            **options["kw_args"],
        }
        self.kwargs = {k: v for k, v in kwargs.items() if k in params}
        self.path = path

    def start(self) -> None:
        self._record(enabled="all", **self.kwargs)

    def stop(self) -> None:
        import torch

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(self.path)
        self._record(enabled=None)
