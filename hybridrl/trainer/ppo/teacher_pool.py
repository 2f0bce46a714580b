"""A separate teacher pool of on-policy distillation (veRL's `distillation.nnodes > 0`).

The teachers get their own Ray resource pool of `distillation.nnodes x n_gpus_per_node` slots (GPUs,
or CPU slots of `trainer.cpus_per_worker` CPUs each on a machine without one), apart from the actor's.
Teacher `<name>` has `num_replicas` replicas (the single default teacher: pool size /
per-replica size, as veRL derives it); each replica is a worker group of its own worker processes
(a forward-only reference engine, `ActorRolloutRefWorker` role "ref", loaded from the teacher's
`model_path`) on `inference.tensor_model_parallel_size x data_parallel_size x
pipeline_model_parallel_size` slots (the engine shards the teacher over them: FSDP2, or Megatron by
`actor_rollout_ref.ref.strategy`). One request of the step (`TeacherReplicas.compute_ref_log_prob`)
splits the teacher's rows into contiguous parts, one per replica, sent concurrently, and
concatenates the answers in row order, so the result is the colocated teacher's (each row's
log-probs do not depend on which replica computes them).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from hybridrl.protocol import DataProto
from hybridrl.utils.batch_ops import row_parts
from hybridrl.workers.distillation_config import DEFAULT_KEY, DistillationConfig


def replica_counts(dist: DistillationConfig) -> dict[str, int]:
    """{teacher key: replicas}: `num_replicas`, or for the single default teacher the pool size over
    its per-replica size (veRL's rule; the start-up check guarantees it divides)."""
    teachers = dist.teachers()
    pool = dist.nnodes * dist.n_gpus_per_node
    if len(teachers) == 1 and DEFAULT_KEY in teachers:
        return {DEFAULT_KEY: pool // teachers[DEFAULT_KEY].inference.per_replica_world_size}
    return {key: t.num_replicas for key, t in teachers.items()}


class TeacherReplicas:
    """One teacher's replicas: what the teacher step calls, in place of a colocated role's view.

    Args:
        groups: one worker group per replica (each with `compute_ref_log_prob`).
    """

    def __init__(self, groups: list[Any]) -> None:
        if not groups:
            raise ValueError("a teacher needs at least one replica")
        self.groups = list(groups)

    @property
    def world_size(self) -> int:
        return sum(g.world_size for g in self.groups)

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """The teacher's ref_log_prob (B, T) (and with meta_info["topk"] its top-k (B, T, k)) of
        `data`'s rows: part i of the rows on replica i, all replicas at once, results in row order."""
        bounds = row_parts(len(data), len(self.groups))
        if len(bounds) == 1:
            return self.groups[0].compute_ref_log_prob(data)
        parts = [data.slice(lo, hi) for lo, hi in bounds]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(parts)) as pool:
            futures = [pool.submit(g.compute_ref_log_prob, p) for g, p in zip(self.groups, parts)]
            outs = [f.result() for f in futures]
        return DataProto.concat(outs)


class TeacherPool:
    """The teachers' own resource pools and worker groups (one pool per replica, so a replica's
    slots are packed together).

    Args:
        config: the run's config (distillation.*, trainer.cpus_per_worker).
        class_of: (teacher key) -> RayClassWithInitArgs of that teacher's worker.
        use_gpu: one GPU per slot.
    """

    def __init__(self, config: Any, class_of: Any, use_gpu: bool) -> None:
        from hybridrl.single_controller.ray.base import RayResourcePool, RayWorkerGroup

        dist = config.distillation
        teachers = dist.teachers()
        self.pools: list[Any] = []
        self.groups: dict[str, list[Any]] = {}
        try:
            for i, (key, n) in enumerate(sorted(replica_counts(dist).items())):
                size = teachers[key].inference.per_replica_world_size
                for r in range(n):
                    name = f"hybridrl_teacher{i}_r{r}"
                    pool = RayResourcePool(
                        [size],
                        use_gpu=use_gpu,
                        cpus_per_slot=config.trainer.cpus_per_worker,
                        name_prefix=name,
                    )
                    self.pools.append(pool)
                    group = RayWorkerGroup(pool, class_of(key), name_prefix=name)
                    self.groups.setdefault(key, []).append(group)
        except Exception:
            self.shutdown()
            raise

    def init_models(self) -> None:
        """Load every replica's teacher, all replicas at once."""
        from hybridrl.single_controller.ray.base import gather_refs

        groups = [g for gs in self.groups.values() for g in gs]
        refs = [g.execute_all_async("init_model") for g in groups]
        for g, r in zip(groups, refs):
            gather_refs(r, group=g.name, method="init_model", ranks=list(range(g.world_size)))

    def views(self) -> dict[str, TeacherReplicas]:
        """{teacher key: its replicas}, what the teacher step routes rows to."""
        return {key: TeacherReplicas(groups) for key, groups in self.groups.items()}

    def shutdown(self) -> None:
        for groups in self.groups.values():
            for g in groups:
                g.shutdown()
        for pool in self.pools:
            pool.remove()
        self.groups, self.pools = {}, []
