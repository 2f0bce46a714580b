"""Device slots for the Ray worker groups: `RayResourcePool` reserves them as placement groups (one per
node, one bundle per slot: ``{"CPU": cpus_per_slot, "GPU": 1 if use_gpu}``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from hybridrl.single_controller.ray.nodes import (
    ResourcesUnavailableError,
)

__all__ = ["RayResourcePool", "Slot"]


# ----------------------------------------------------------------------------------------------
# resource pool
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One device slot: a bundle of a placement group, with its rank position on the node."""

    placement_group: PlacementGroup
    bundle_index: int
    local_rank: int
    local_world_size: int


class RayResourcePool:
    """Device slots reserved as Ray placement groups.

    Args:
        process_on_nodes: slots per node, e.g. [8, 8] for two nodes of 8 GPUs, or [2] for two
            CPU slots on one machine. The world size is the sum.
        use_gpu: reserve one GPU per slot.
        cpus_per_slot: CPUs per slot (fractions allowed, e.g. 0.5 for toy workers). Workers get
            ``max(1, int(cpus_per_slot))`` OpenMP / torch threads.
        max_colocate_count: how many worker groups may share the slots; each of their actors
            asks for 1/max_colocate_count of the slot's CPUs and GPU.
        name_prefix: prefix of the placement group names.
        ready_timeout_s: how long to wait for the cluster to grant the slots.
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool,
        cpus_per_slot: float = 1,
        max_colocate_count: int = 1,
        name_prefix: str = "",
        ready_timeout_s: float = 120.0,
    ) -> None:
        if not process_on_nodes or any(int(n) != n or n <= 0 for n in process_on_nodes):
            raise ValueError(
                f"process_on_nodes must be a non-empty list of positive slot counts per node, got {process_on_nodes!r}"
            )
        if cpus_per_slot <= 0:
            raise ValueError(f"cpus_per_slot must be > 0, got {cpus_per_slot}")
        if int(max_colocate_count) != max_colocate_count or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be an integer >= 1, got {max_colocate_count}")
        self.process_on_nodes = [int(n) for n in process_on_nodes]
        self.use_gpu = bool(use_gpu)
        self.cpus_per_slot = float(cpus_per_slot)
        self.max_colocate_count = int(max_colocate_count)
        self.name_prefix = name_prefix or f"hybridrl_{uuid.uuid4().hex[:6]}"
        self.ready_timeout_s = ready_timeout_s
        self._pgs: list[PlacementGroup] | None = None
        self._lifetime: str | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def num_threads(self) -> int:
        return max(1, int(self.cpus_per_slot))

    def actor_resources(self) -> dict[str, float]:
        """Ray resources one actor of one colocated worker group asks for inside its bundle."""
        res = {"num_cpus": self.cpus_per_slot / self.max_colocate_count}
        if self.use_gpu:
            res["num_gpus"] = 1.0 / self.max_colocate_count
        return res

    def get_placement_groups(self, detached: bool = False) -> list[PlacementGroup]:
        """Create (once) and return the placement groups, one per node, waiting until granted."""
        if self._pgs is not None:
            return self._pgs
        bundle: dict[str, float] = {"CPU": self.cpus_per_slot}
        if self.use_gpu:
            bundle["GPU"] = 1
        self._lifetime = "detached" if detached else None
        pgs = [
            placement_group(
                [dict(bundle) for _ in range(n)],
                strategy="STRICT_PACK",
                name=f"{self.name_prefix}_pg{i}",
                lifetime=self._lifetime,
            )
            for i, n in enumerate(self.process_on_nodes)
        ]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=self.ready_timeout_s)
        except GetTimeoutError:
            for pg in pgs:
                remove_placement_group(pg)
            raise ResourcesUnavailableError(
                f"RayResourcePool {self.name_prefix!r}: the cluster did not grant {self.process_on_nodes} slots of "
                f"{bundle} within {self.ready_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()}, "
                f"available: {ray.available_resources()}). Ask for fewer slots / CPUs per slot, or free resources."
            ) from None
        self._pgs = pgs
        return pgs

    def slots(self, detached: bool = False) -> list[Slot]:
        """All slots in rank order (node by node)."""
        pgs = self.get_placement_groups(detached)
        return [Slot(pg, i, i, n) for pg, n in zip(pgs, self.process_on_nodes) for i in range(n)]

    def remove(self) -> None:
        """Release the placement groups (actors placed in them are killed by Ray)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None
