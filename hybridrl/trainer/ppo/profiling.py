"""Driver side of veRL's profiler keys: start/stop the workers' torch.profiler around chosen steps.

`global_profiler.steps` are the steps profiled (when `global_profiler.tool` is set). The actor
worker group takes part when `actor_rollout_ref.actor.profiler.enable` or `.ref.profiler.enable`
(both roles live in the same process), the critic's when `critic.profiler.enable`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridrl.utils.profiler import ProfilerConfig, profiled_steps, request_for


def _union(a: ProfilerConfig, b: ProfilerConfig) -> ProfilerConfig:
    """One process holds the actor and the ref: profile it where either asks."""
    if not b.enable:
        return a
    if not a.enable:
        return b
    return replace(a, all_ranks=a.all_ranks or b.all_ranks, ranks=sorted(set(a.ranks) | set(b.ranks)))


class StepProfilerDriver:
    """`begin(step)` / `end(step)` around every training step; does nothing on other steps."""

    def __init__(self, config: Any, workers: Any) -> None:
        arr = config.actor_rollout_ref
        self.glob = config.global_profiler
        self.steps = profiled_steps(self.glob)
        self.groups = [(workers.actor_rollout, _union(arr.actor.profiler, arr.ref.profiler))]
        if workers.critic is not None:
            self.groups.append((workers.critic, config.critic.profiler))
        self.groups = [(g, c) for g, c in self.groups if c.enable]
        self.traces: list[str] = []

    def begin(self, step: int) -> None:
        if step in self.steps:
            for group, cfg in self.groups:
                group.start_profile(request_for(self.glob, cfg, step), cfg)

    def end(self, step: int) -> None:
        if step in self.steps:
            for group, _ in self.groups:
                self.traces += [p for p in group.stop_profile() if p]
