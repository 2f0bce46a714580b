"""Worker base class and the ``@register`` decorator for methods a worker group calls.

A worker is one process per device slot. The worker group that creates it sets the usual
distributed env vars (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
:class:`Worker` exposes them as properties, so ``hybridrl.utils.device.init_process_group()``
can rendezvous from a registered method without further arguments.

``@register(dispatch_mode=..., execute_mode=..., blocking=..., materialize_futures=...)`` keeps
the method an ordinary, IDE-visible method and records how the driver calls it. The worker
group reads that record to build ``wg.<method>(...)`` on the driver.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hybridrl.protocol import DataProtoFuture
from hybridrl.single_controller.batch_ref import BatchShard, by_ref_output
from hybridrl.single_controller.dispatch import (
    Dispatch,
    DispatchMode,
    get_dispatch_mode,
    register_dispatch_mode,
)
from hybridrl.single_controller.mesh import MeshCoord, MeshLayout
from hybridrl.utils import plugins
from hybridrl.utils.device import get_device_name, get_visible_devices_keyword

logger = logging.getLogger(__name__)

# torch's default CPU generator seed in a fresh process; every worker is seeded with it on start
FRESH_PROCESS_SEED = 67280421310721

__all__ = [
    "Dispatch",
    "Execute",
    "RegisterSpec",
    "Worker",
    "get_register_spec",
    "register",
    "register_dispatch_mode",
]

REGISTER_ATTR = "__hybridrl_register__"
F = TypeVar("F", bound=Callable[..., Any])


class Execute(enum.Enum):
    """Which ranks run a registered method: all ranks, or rank 0 only (its raw result is returned)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class RegisterSpec:
    """How the driver calls a registered worker method (see :func:`register`)."""

    dispatch_mode: DispatchMode
    execute_mode: Execute = Execute.ALL
    blocking: bool = True
    materialize_futures: bool = True


def _materialize(value: Any, waiter: str) -> Any:
    """Resolve a DataProtoFuture or a Ray ObjectRef into its value; anything else unchanged.

    The wait has a deadline (``deadlines.nested_timeout``: most of ``trainer.step_timeout_s``), so
    that a hung producer fails this call with an error naming the producer's group, rank and
    method (a WorkerHungError) or the key (a DeadlineError), not after the driver's own deadline.
    ``waiter`` names this worker's group, rank and method in that error.
    """
    if isinstance(value, DataProtoFuture):
        return dataclasses.replace(value, waiter=waiter).get()
    ray = _ray_if_loaded()
    if ray is not None and isinstance(value, ray.ObjectRef):
        from hybridrl.utils import deadlines

        return deadlines.get_refs(value, what=f"{waiter}: an ObjectRef argument")
    return value


def _waiter(worker: Any, method: str) -> str:
    group = os.environ.get("HYBRIDRL_WORKER_GROUP", "")
    return f"worker group {group!r} rank {getattr(worker, 'rank', 0)} in {method!r}"


def _ray_if_loaded() -> Any:
    import sys

    return sys.modules.get("ray")


def register(
    dispatch_mode: DispatchMode | str = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[F], F]:
    """Mark a Worker method as callable from the driver through its worker group.

    Args:
        dispatch_mode: how arguments are split over ranks and results collected (a
            ``Dispatch.*`` mode or its registered name).
        execute_mode: ``Execute.ALL`` runs every rank the dispatch selects; ``Execute.RANK_ZERO``
            runs only rank 0 with its share of the arguments and returns its raw result.
        blocking: True: the driver call returns the collected result. False: it returns a
            future (a DataProtoFuture for DataProto-returning modes, else a WorkerGroupFuture).
        materialize_futures: resolve DataProtoFuture / ObjectRef arguments on the worker before
            the method body runs (False hands the futures themselves to the method).

    The decorated method keeps its name, signature and docstring.
    """
    mode = get_dispatch_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute):
        raise TypeError(
            f"execute_mode must be an Execute member (Execute.ALL / Execute.RANK_ZERO), got {execute_mode!r}"
        )
    spec = RegisterSpec(mode, execute_mode, bool(blocking), bool(materialize_futures))

    def decorator(fn: F) -> F:
        if not callable(fn) or inspect.isclass(fn):
            raise TypeError(f"@register decorates worker methods, got {fn!r}")

        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            by_ref = any(isinstance(v, BatchShard) for v in (*args, *kwargs.values()))
            if materialize_futures:
                waiter = _waiter(self, fn.__name__)
                args = tuple(_materialize(a, waiter) for a in args)
                kwargs = {k: _materialize(v, waiter) for k, v in kwargs.items()}
            out = fn(self, *args, **kwargs)
            if mode.mesh is not None and not self.mesh_coord(mode.mesh).is_collector:
                return None  # the driver keeps the collector's result only: do not ship copies
            return by_ref_output(out) if by_ref else out

        setattr(method, REGISTER_ATTR, spec)
        return method  # type: ignore[return-value]

    return decorator


def get_register_spec(obj: Any) -> RegisterSpec | None:
    """The RegisterSpec recorded by @register on a function / method, or None."""
    return getattr(obj, REGISTER_ATTR, None)


def registered_methods(cls: type) -> dict[str, tuple[Callable[..., Any], RegisterSpec]]:
    """name -> (function, spec) for every @register'ed method of ``cls`` (inherited ones too)."""
    found: dict[str, tuple[Callable[..., Any], RegisterSpec]] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        fn = inspect.getattr_static(cls, name, None)
        spec = get_register_spec(fn)
        if spec is not None:
            found[name] = (fn, spec)
    return found


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(
            f"env var {name}={value!r} is not an integer; the worker group sets it, do not override it"
        ) from e


class Worker:
    """Base class of every remote worker (one process per device slot).

    Rank information comes from env vars set by the worker group; outside a worker group a
    Worker describes a single process (rank 0 of 1). The properties read the environment on
    every access, so a master address set after construction is seen by every role of a
    colocated worker.
    """

    def __init__(self) -> None:
        # The user's `model.external_lib` modules the driver handed over (already imported when the
        # process started, through Ray's setup hook): one that cannot be imported here fails this
        # worker's start, naming the key and the module (hybridrl.utils.plugins).
        plugins.import_worker_libs()
        # Every worker starts from the same torch seed, whatever its process did before (a Ray
        # worker process arrives with a random one): weights that transformers initialises afresh
        # (a critic's value head, init_from_scratch) are then the same on every rank and in every
        # launch of the same command, so runs reproduce and a resumed run can equal its twin.
        torch.manual_seed(FRESH_PROCESS_SEED)
        threads = os.environ.get("HYBRIDRL_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
            _announce_threads(self.rank)
        if get_device_name() == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def rank(self) -> int:
        return _env_int("RANK", 0)

    def close(self) -> None:
        """Release what must go before this process's process group does (e.g. a rollout engine
        that tears down its own distributed state). The in-process backend calls it on shutdown;
        a Ray worker's process simply ends. Default: nothing."""

    # ---- named device meshes -------------------------------------------------------------------
    def set_mesh(self, name: str, layout: MeshLayout) -> MeshCoord:
        """Declare this worker's place in the mesh ``name`` (e.g. "actor", "rollout"); methods
        registered with ``make_mesh_dispatch(name)`` dispatch over it. Every rank of the group
        declares the same layout; returns this rank's coordinates."""
        if not isinstance(layout, MeshLayout):
            raise TypeError(f"set_mesh({name!r}, ...) needs a MeshLayout, got {type(layout).__name__}")
        if layout.world_size != self.world_size:
            raise ValueError(
                f"set_mesh({name!r}): layout {layout} covers {layout.world_size} ranks but the worker group "
                f"has {self.world_size}; build it with MeshLayout.create(world_size={self.world_size}, ...)"
            )
        meshes = self.__dict__.setdefault("_hybridrl_meshes", {})
        meshes[name] = (layout, layout.coord(self.rank))
        return meshes[name][1]

    def mesh_layout(self, name: str) -> MeshLayout:
        """The layout declared under ``name`` (KeyError naming the declared ones otherwise)."""
        return self._mesh_entry(name)[0]

    def mesh_coord(self, name: str) -> MeshCoord:
        """This rank's coordinates in the mesh declared under ``name``."""
        return self._mesh_entry(name)[1]

    def _mesh_entry(self, name: str) -> tuple[MeshLayout, MeshCoord]:
        meshes = self.__dict__.get("_hybridrl_meshes", {})
        if name not in meshes:
            raise KeyError(
                f"{type(self).__name__} (rank {self.rank}) has not declared a mesh {name!r} (declared: "
                f"{sorted(meshes)}); call self.set_mesh({name!r}, MeshLayout.create(...)) before using it"
            )
        return meshes[name]

    def _hybridrl_mesh_info(self, name: str, role: str | None = None) -> MeshCoord | None:
        """This rank's coordinates in mesh ``name`` or None (for the driver's dispatch)."""
        entry = self.__dict__.get("_hybridrl_meshes", {}).get(name)
        return None if entry is None else entry[1]

    @property
    def world_size(self) -> int:
        return _env_int("WORLD_SIZE", 1)

    @property
    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK", 0)

    @property
    def local_world_size(self) -> int:
        return _env_int("LOCAL_WORLD_SIZE", 1)

    @property
    def master_addr(self) -> str | None:
        return os.environ.get("MASTER_ADDR")

    @property
    def master_port(self) -> int | None:
        port = os.environ.get("MASTER_PORT")
        return int(port) if port else None

    @property
    def device(self) -> torch.device:
        """The torch device this worker owns: cpu, or the accelerator its slot was given."""
        name = get_device_name()
        if name == "cpu":
            return torch.device("cpu")
        return torch.device(name, _local_device_index(self.local_rank))

    # ---- used by the worker group ------------------------------------------------------------
    def _hybridrl_pick_master_addr_port(self) -> tuple[str, int]:
        """Rank 0: choose this node's IP and a free port as the rendezvous address (sets env)."""
        addr, port = _node_ip(), _free_port()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        return addr, port

    def _hybridrl_set_master_addr_port(self, addr: str, port: int) -> None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)

    def _hybridrl_env(self) -> dict[str, Any]:
        """Rank info as this process sees it (for checks and debugging)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "pid": os.getpid(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
            "device": str(self.device),
        }


@functools.cache
def _announce_threads(rank: int) -> None:
    """Print (once per process) the torch thread count this worker process computes with."""
    msg = (
        f"[hybridrl] worker rank {rank} (pid {os.getpid()}): {torch.get_num_threads()} torch threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}"
    )
    logger.info(msg)
    print(msg, flush=True)


def _local_device_index(local_rank: int) -> int:
    """Index (among this process's visible accelerators) of the accelerator Ray assigned.

    Ray normally restricts the visible devices to the assigned ones (index 0). When a user
    keeps all devices visible, the assigned id is looked up in the visible list.
    """
    ray = _ray_if_loaded()
    assigned: list[str] = []
    if ray is not None and ray.is_initialized():
        assigned = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    if assigned:
        visible = os.environ.get(get_visible_devices_keyword())
        if visible:
            ids = [v.strip() for v in visible.split(",")]
            if assigned[0] in ids:
                return ids.index(assigned[0])
        return int(assigned[0])
    return local_rank % max(torch.cuda.device_count(), 1)


def _node_ip() -> str:
    ray = _ray_if_loaded()
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
