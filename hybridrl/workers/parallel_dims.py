"""`ParallelDims`: every parallel size of one training role, validated once, and the meshes built from them.

Built on the driver from the config (`ParallelDims.for_role`) and handed to the workers, so the
driver's batch-size derivation and the workers' dispatch meshes come from the same object.

    world        ranks of the worker group (trainer.nnodes * trainer.n_gpus_per_node)
    tp, pp, vpp  Megatron's tensor / pipeline / virtual pipeline sizes (1 on the HF engines)
    cp           Megatron's context parallelism (`megatron.context_parallel_size`; its ranks share rows)
    sp           Ulysses sequence parallelism (`*.ulysses_sequence_parallel_size`, HF engines)
    fsdp         FSDP2's shard-group size (`fsdp_config.fsdp_size`; -1: every rank)
    rollout_tp   the rollout engine's tensor parallelism (`rollout.tensor_model_parallel_size`)

Derived: `data_ranks` = world / (tp * pp * cp), the ranks that hold distinct data before Ulysses
splits sequences (what the per-rank batch sizes divide by; with SP they divide again by sp);
`dp` = data_ranks / sp, the groups that see distinct rows.

Meshes (single_controller/mesh.MeshLayout; the batch is split over the dp dims, results
collected from one rank of each dp group):
    train_mesh    Megatron: pp x dp x cp x tp (Megatron's rank order tp-cp-ep-dp-pp, TP innermost),
                  collected from the last stage's cp / tp rank 0; Ulysses: dp x sp (sp rank 0);
                  else replicate x shard (`ddp` x `fsdp`), every rank data-parallel
    rollout_mesh  dp x tp (tp innermost: ranks [k*tp, (k+1)*tp) form engine k)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.single_controller.mesh import MeshLayout

__all__ = ["ParallelDims"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel sizes of one role on `world` ranks (see the module docstring).

    Args:
        key: the role's config path, named in every error ("actor_rollout_ref.actor", "critic").
    """

    world: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    sp: int = 1
    fsdp: int = -1
    rollout_tp: int = 1
    model_parallel: bool = False
    key: str = "actor_rollout_ref.actor"

    def __post_init__(self) -> None:
        k = self.key
        if self.world < 1:
            raise ValueError(f"{k}: the worker group needs >= 1 rank, got {self.world}")
        for name, size in (
            ("tensor_model_parallel_size", self.tp),
            ("pipeline_model_parallel_size", self.pp),
            ("context_parallel_size", self.cp),
        ):
            if size < 1:
                raise ValueError(f"{k}.megatron.{name}={size}: use an integer >= 1")
        if not self.model_parallel and (self.tp, self.pp, self.cp) != (1, 1, 1):
            raise ValueError(
                f"{k}: tp={self.tp}, pp={self.pp}, cp={self.cp} need a model-parallel engine (strategy=megatron)"
            )
        if self.world % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"{k}.megatron: tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size "
                f"= {self.tp * self.pp * self.cp} "
                f"must divide the {self.world} ranks (trainer.nnodes * trainer.n_gpus_per_node); use sizes "
                f"whose product is one of {_divisors(self.world)}"
            )
        if self.sp < 1 or self.data_ranks % self.sp:
            raise ValueError(
                f"{k}.ulysses_sequence_parallel_size={self.sp} does not divide the {self.data_ranks} ranks "
                f"(trainer.nnodes * trainer.n_gpus_per_node); use one of {_divisors(self.data_ranks)}"
            )
        if self.fsdp > 0 and self.fsdp < self.world and self.world % self.fsdp:
            raise ValueError(
                f"{k}.fsdp_config.fsdp_size={self.fsdp} must divide the number of ranks ({self.world}); use a "
                "divisor or -1"
            )
        if self.rollout_tp < 1 or self.world % self.rollout_tp:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.rollout_tp} does not divide the "
                f"{self.world} ranks; use one of {_divisors(self.world)}"
            )

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def data_ranks(self) -> int:
        """Ranks that hold distinct data before Ulysses splits sequences: world / (tp * pp * cp)."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def dp(self) -> int:
        """Data-parallel groups (distinct rows): world / (tp * pp * cp * sp)."""
        return self.data_ranks // self.sp

    # -- meshes --------------------------------------------------------------------------------
    def train_mesh(self) -> MeshLayout:
        """The role's dispatch mesh (see the module docstring)."""
        if self.model_parallel:
            return MeshLayout.create(
                self.world,
                {"pp": self.pp, "dp": -1, "cp": self.cp, "tp": self.tp},
                dp_dims=("dp",),
                collect={"pp": -1, "cp": 0, "tp": 0},
            )
        if self.sp > 1:
            return MeshLayout.create(self.world, {"dp": -1, "sp": self.sp})
        shard = self.world if self.fsdp <= 0 or self.fsdp >= self.world else self.fsdp
        return MeshLayout.create(self.world, {"ddp": -1, "fsdp": shard}, dp_dims=("ddp", "fsdp"))

    def rollout_mesh(self) -> MeshLayout:
        """dp x tp over the worker group: world / tp rollout engines of tp ranks each."""
        return MeshLayout.create(self.world, {"dp": -1, "tp": self.rollout_tp})

    # -- from the config -----------------------------------------------------------------------
    @classmethod
    def for_role(cls, world: int, section: Any, key: str, rollout_tp: int = 1) -> ParallelDims:
        """The dims of a role section (ActorConfig, RefConfig, CriticConfig) on `world` ranks.

        The engine comes from the section's `strategy` (model_engine); Megatron sizes from its
        `megatron` section, Ulysses from `ulysses_sequence_parallel_size`, FSDP's shard size from
        its `fsdp_config` (the critic's under `model`).
        """
        from hybridrl.engine.base import get_engine

        entry = get_engine(section.strategy, f"{key}.strategy")
        fsdp_config = getattr(section, "fsdp_config", None) or getattr(section.model, "fsdp_config", None)
        kwargs: dict[str, Any] = {}
        if entry.model_parallel:
            from hybridrl.config.megatron import validate_megatron_config

            m = section.megatron
            validate_megatron_config(m, f"{key}.megatron", world_size=world)
            kwargs = dict(
                tp=m.tensor_model_parallel_size,
                pp=m.pipeline_model_parallel_size,
                vpp=m.virtual_pipeline_model_parallel_size,
                cp=m.context_parallel_size,
            )
        return cls(
            world=world,
            sp=int(getattr(section, "ulysses_sequence_parallel_size", 1) or 1),
            fsdp=int(fsdp_config.fsdp_size) if fsdp_config is not None else -1,
            rollout_tp=rollout_tp,
            model_parallel=entry.model_parallel,
            key=key,
            **kwargs,
        )
