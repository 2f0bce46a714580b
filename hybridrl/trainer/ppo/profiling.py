"""Driver side of veRL's profiler keys: start/stop the workers' profiler around chosen steps.

`global_profiler.steps` are the steps profiled (when `global_profiler.tool` is set). The actor
worker group takes part when `actor_rollout_ref.actor.profiler.enable` or `.ref.profiler.enable`
(both roles live in the same process), the critic's when `critic.profiler.enable`.
`global_profiler.profile_continuous_steps=True` keeps one session open over consecutive chosen
steps ([1, 2, 5]: one for 1-2, one for 5). Discrete mode (nsys: `global_tool_config.nsys.discrete`,
npu: the role's `tool_config.npu.discrete`) gives every worker call of a chosen step its own
session instead (torch too: the role's `tool_config.torch.discrete`): during the step the group is
replaced by a `DiscreteGroup` that brackets each call.

`actor_rollout_ref.rollout.profiler`: the rollout engine runs in the actor's process, so with the
actor (or ref) profiler on, its generate calls are inside that trace (the rollout's ranks join the
session); alone, each `generate_sequences` call of a chosen step gets its own session (discrete,
as veRL requires for the rollout profiler), traced under `step_<n>_generate_sequences`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridrl.utils.profiler import ProfilerConfig, profiled_steps, request_for
from hybridrl.utils.profiler_tools import npu_options, nsys_options, torch_options

GENERATE_METHODS = ("generate_sequences",)


def _union(a: ProfilerConfig, b: ProfilerConfig) -> ProfilerConfig:
    """One process holds the actor and the ref: profile it where either asks."""
    if not b.enable:
        return a
    if not a.enable:
        return b
    return replace(a, all_ranks=a.all_ranks or b.all_ranks, ranks=sorted(set(a.ranks) | set(b.ranks)))


def session_bounds(steps: set[int], continuous: bool) -> tuple[set[int], set[int]]:
    """(steps where a session starts, steps where it ends)."""
    if not continuous:
        return set(steps), set(steps)
    return {s for s in steps if s - 1 not in steps}, {s for s in steps if s + 1 not in steps}


def is_discrete(glob: Any, cfg: ProfilerConfig) -> bool:
    if glob.tool == "nsys":
        return nsys_options(glob.global_tool_config)["discrete"]
    if glob.tool == "npu":
        return npu_options(cfg.tool_config, "role")["discrete"]
    if glob.tool == "torch":
        return torch_options(cfg.tool_config, "role")["discrete"]
    return False


class DiscreteGroup:
    """A worker group whose every method call (or those named in `only`) runs in its own profiler
    session (discrete mode)."""

    def __init__(
        self,
        group: Any,
        glob: Any,
        cfg: ProfilerConfig,
        step: int,
        traces: list[str],
        only: tuple[str, ...] | None = None,
    ) -> None:
        self._group, self._glob, self._cfg, self._step, self._traces = group, glob, cfg, step, traces
        self._only = only

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        if not callable(attr) or name.startswith("_") or name in ("start_profile", "stop_profile"):
            return attr
        if self._only is not None and name not in self._only:
            return attr

        def bracketed(*args: Any, **kwargs: Any) -> Any:
            self._group.start_profile(request_for(self._glob, self._cfg, self._step, tag=name), self._cfg)
            try:
                return attr(*args, **kwargs)
            finally:
                self._traces += [p for p in self._group.stop_profile() if p]

        return bracketed


class StepProfilerDriver:
    """`begin(step)` / `end(step)` around every training step; does nothing on other steps."""

    ROLES = (("actor_rollout", "actor"), ("critic", "critic"))

    def __init__(self, config: Any, workers: Any) -> None:
        arr = config.actor_rollout_ref
        self.glob = config.global_profiler
        self.workers = workers
        self.steps = profiled_steps(self.glob)
        self.starts, self.ends = session_bounds(self.steps, self.glob.profile_continuous_steps)
        actor = _union(arr.actor.profiler, arr.ref.profiler)
        rollout = arr.rollout.profiler
        cfgs = {
            "actor_rollout": _union(actor, rollout) if actor.enable else actor,
            "critic": config.critic.profiler,
        }
        self.groups = [
            (a, cfgs[a]) for a, _ in self.ROLES if getattr(workers, a, None) is not None and cfgs[a].enable
        ]
        alone = rollout.enable and not actor.enable and getattr(workers, "actor_rollout", None) is not None
        self.rollout = rollout if alone else None
        self.traces: list[str] = []
        self._first: dict[str, int] = {}

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        if self.rollout is not None:
            group = self.workers.actor_rollout
            self.workers.actor_rollout = DiscreteGroup(
                group, self.glob, self.rollout, step, self.traces, only=GENERATE_METHODS
            )
        for attr, cfg in self.groups:
            group = getattr(self.workers, attr)
            if is_discrete(self.glob, cfg):
                setattr(self.workers, attr, DiscreteGroup(group, self.glob, cfg, step, self.traces))
            elif step in self.starts:
                group.start_profile(request_for(self.glob, cfg, step), cfg)

    def end(self, step: int) -> None:
        if step not in self.steps:
            return
        for attr, _ in self.groups:
            group = getattr(self.workers, attr)
            if isinstance(group, DiscreteGroup):
                setattr(self.workers, attr, group._group)
            elif step in self.ends:
                self.traces += [p for p in group.stop_profile() if p]
        if self.rollout is not None:
            self.workers.actor_rollout = self.workers.actor_rollout._group
