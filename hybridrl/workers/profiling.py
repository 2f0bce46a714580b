"""Remote start/stop of the per-step torch.profiler session, mixed into the role workers.

The driver calls `start_profile(request, cfg)` on a role's worker group when a chosen step
begins (`global_profiler.steps`) and `stop_profile()` when it ends; a rank takes part when the
role's `profiler` section selects it (`all_ranks` or `ranks`). Roles sharing a process share one
session (see `hybridrl.utils.profiler.StepProfiler`).
"""

from __future__ import annotations

from hybridrl.single_controller.base import register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.utils.profiler import PROCESS_PROFILER, ProfilerConfig, ProfileRequest, wants_rank


class StepProfiling:
    """Mixin for Worker subclasses: `start_profile` / `stop_profile` on every rank."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, request: ProfileRequest, cfg: ProfilerConfig) -> bool:
        """Start (or join) this process's session if `cfg` selects this rank; True if it did."""
        if not wants_rank(cfg, self.rank):
            return False
        PROCESS_PROFILER.start(request, self.rank)
        self._hybridrl_profiling = True
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> str | None:
        """Leave the session; the last role out writes the trace; returns its path (or None)."""
        if not getattr(self, "_hybridrl_profiling", False):
            return None
        self._hybridrl_profiling = False
        return PROCESS_PROFILER.stop()
