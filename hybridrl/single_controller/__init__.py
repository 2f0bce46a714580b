"""Single controller: one driver process calls worker groups (one worker per device slot).

``Worker`` + ``@register(dispatch_mode=...)`` on the worker side; ``RayWorkerGroup`` on the
driver side (``hybridrl.single_controller.ray``).
"""

from hybridrl.single_controller.base import Execute, RegisterSpec, Worker, get_register_spec, register
from hybridrl.single_controller.dispatch import (
    Dispatch,
    DispatchMode,
    DispatchPlan,
    MeshDispatchInfo,
    get_dispatch_mode,
    make_mesh_dispatch,
    register_dispatch_mode,
)
from hybridrl.single_controller.mesh import MeshCoord, MeshLayout, new_subgroups
from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerGroup, WorkerGroupError

__all__ = [
    "Dispatch",
    "DispatchMode",
    "DispatchPlan",
    "Execute",
    "MeshCoord",
    "MeshDispatchInfo",
    "MeshLayout",
    "RegisterSpec",
    "Worker",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerGroupError",
    "get_dispatch_mode",
    "get_register_spec",
    "make_mesh_dispatch",
    "new_subgroups",
    "register",
    "register_dispatch_mode",
]
