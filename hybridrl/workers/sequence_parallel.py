"""A role's Ulysses sequence parallelism inside a worker: its groups, and applying it to an engine.

`SequenceParallel.create(layout, rank, key)` reads the sp size from the role's dispatch mesh
(`rollout.parallel.training_mesh`: ``{"dp": world / sp, "sp": sp}`` with SP, every rank
data-parallel without), creates the sp and dp process groups once (every rank calls it), and
`apply(engine)` wraps the engine's attention (`engine.ulysses.parallelize_sp`).
`role_kwargs(engine)` gives the actor / critic their data-parallel size and group and the sp
group: world / sp groups of sp ranks that see the same rows; FSDP still shards over all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.single_controller.mesh import MeshLayout
from hybridrl.workers.engine.ulysses import SPGroup, build_sp_groups, parallelize_sp


@dataclass(frozen=True)
class SequenceParallel:
    """sp: this rank's group (None without SP); dp_group: the all-reduce group of the dp ranks
    (None: one dp group, or no SP, where the roles default to WORLD); key: config section."""

    sp: SPGroup | None
    dp_size: int | None
    dp_group: Any
    key: str

    @classmethod
    def create(cls, layout: MeshLayout, rank: int, key: str) -> SequenceParallel:
        if layout.size("sp") == 1:
            return cls(None, None, None, key)
        sp, dp_group = build_sp_groups(layout, rank)
        return cls(sp, layout.size("dp"), dp_group, key)

    def apply(self, engine: Any) -> None:
        """Wrap the engine's attention for Ulysses SP (no-op without SP)."""
        if self.sp is not None:
            parallelize_sp(engine.module, self.sp, key=self.key)

    def role_kwargs(self, engine: Any) -> dict[str, Any]:
        """dp_size / dp_group / sp for `PPOActor` / `PPOCritic` over `engine`."""
        if self.sp is None:
            return {"dp_size": engine.dp_size}
        return {"dp_size": self.dp_size, "dp_group": self.dp_group, "sp": self.sp}
