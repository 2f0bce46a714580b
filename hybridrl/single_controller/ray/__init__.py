"""Ray backend: resource pools, RayWorkerGroup and colocated worker classes."""

from hybridrl.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupDataProtoFuture,
    WorkerGroupFuture,
    gather_refs,
)
from hybridrl.single_controller.ray.colocate import ColocatedWorker, create_colocated_worker_cls

__all__ = [
    "ColocatedWorker",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerGroupDataProtoFuture",
    "WorkerGroupFuture",
    "create_colocated_worker_cls",
    "gather_refs",
]
