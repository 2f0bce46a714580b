"""WorkerGroup: the driver-side handle on a set of workers, independent of the backend.

It turns every ``@register``'ed method of the worker class into a method of the group
(``wg.compute_log_prob(data)``) that dispatches the arguments over ranks, runs the method on the
selected ranks and collects the results. A backend (``ray/base.py``) supplies how one rank is
called (``_submit``), how results are waited for (``_gather``) and what a non-blocking call
returns (``_future``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from hybridrl.single_controller.base import Execute, RegisterSpec, registered_methods
from hybridrl.single_controller.batch_ref import BatchRef
from hybridrl.single_controller.dispatch import (
    DispatchPlan,
    MeshDispatchInfo,
    collect_batch_ref,
    proto_collect_fn,
)

__all__ = ["WorkerDiedError", "WorkerGroup", "WorkerGroupError", "WorkerHungError"]


class WorkerGroupError(RuntimeError):
    """A worker failed during a call. The message names the group, rank and method and holds the
    remote traceback; ``cause`` is the backend's original exception."""

    def __init__(
        self, message: str, *, group: str, rank: int, method: str, cause: BaseException | None = None
    ):
        super().__init__(message)
        self.group, self.rank, self.method, self.cause = group, rank, method, cause

    def __reduce__(self) -> tuple:
        # picklable (raised inside a worker, it travels to the driver); the cause stays behind
        return _rebuild_error, (type(self), str(self), self.group, self.rank, self.method)


def _rebuild_error(cls: type, message: str, group: str, rank: int, method: str) -> WorkerGroupError:
    return cls(message, group=group, rank=rank, method=method)


class WorkerDiedError(WorkerGroupError):
    """The process of a worker died (killed, crashed, out of memory) during or before a call."""


class WorkerHungError(WorkerGroupError):
    """A worker is alive but made no progress in a call for ``trainer.step_timeout_s``."""


def _signature_without_self(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    # Ray's tracing hook adds a `_ray_trace_ctx` keyword to the signatures of actor classes.
    params = [p for p in sig.parameters.values() if p.name != "_ray_trace_ctx"]
    if params and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        params = params[1:]
    return sig.replace(parameters=params)


class WorkerGroup:
    """Driver-side handle on ``world_size`` workers of one class.

    Subclasses implement ``_submit``, ``_gather`` and ``_future`` and call
    ``_bind_registered_methods(cls)`` once the workers exist.
    """

    def __init__(self, name: str, world_size: int) -> None:
        if world_size <= 0:
            raise ValueError(f"a worker group needs at least one worker, got world_size={world_size}")
        self._name = name
        self._world_size = world_size
        self._method_names: list[str] = []
        self._mesh_infos: dict[str, MeshDispatchInfo] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def method_names(self) -> list[str]:
        """Names of the registered worker methods bound on this group."""
        return list(self._method_names)

    # ---- backend hooks -----------------------------------------------------------------------
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _gather(self, handles: Sequence[Any], method: str, ranks: Sequence[int]) -> list[Any]:
        raise NotImplementedError

    def _query_mesh(self, mesh: str) -> list[Any]:
        """Every rank's MeshCoord for ``mesh`` (None where a rank has not declared it)."""
        raise NotImplementedError

    def _share_args(self, rank_args: list[tuple], rank_kwargs: list[dict[str, Any]]) -> tuple[list, list]:
        """Hook: replace big values sent to several ranks by one shared handle (default: no-op)."""
        return rank_args, rank_kwargs

    def _future(
        self,
        handles: list[Any],
        collect: Callable[[list[Any]], Any],
        method: str,
        ranks: list[int],
        returns_data_proto: bool,
    ) -> Any:
        raise NotImplementedError

    # ---- colocated roles ---------------------------------------------------------------------
    def spawn(self, prefix_set: Sequence[str]) -> dict[str, WorkerGroup]:
        """Per-role views of a colocated group (see create_colocated_worker_cls).

        ``spawn({"actor_rollout", "critic"})["critic"].compute_values(data)`` calls the remote
        ``critic_compute_values`` on the shared workers.
        """
        cls = self.worker_cls
        roles: dict[str, type] | None = getattr(cls, "_hybridrl_role_classes", None)
        if roles is None:
            raise TypeError(
                f"spawn() needs a group of a colocated class (create_colocated_worker_cls); {cls.__name__} is not one"
            )
        unknown = sorted(set(prefix_set) - set(roles))
        if unknown:
            raise ValueError(f"spawn: unknown roles {unknown}; this colocated class has {sorted(roles)}")
        return {role: self._role_view(role, roles[role]) for role in prefix_set}

    @property
    def worker_cls(self) -> type:
        """The worker class the group runs."""
        raise NotImplementedError

    def _role_view(self, role: str, role_cls: type) -> WorkerGroup:
        """Hook: a view of this group whose methods are `role_cls`'s, called as ``{role}_<name>``."""
        raise NotImplementedError

    # ---- binding -----------------------------------------------------------------------------
    def _bind_registered_methods(self, cls: type, remote_prefix: str = "") -> None:
        """Add ``self.<name>`` for every @register'ed method of ``cls``; the remote method called is
        ``remote_prefix + name`` (colocated role views use the role prefix)."""
        for name, (fn, spec) in sorted(registered_methods(cls).items()):
            if hasattr(type(self), name) or name in self.__dict__:
                raise ValueError(
                    f"{cls.__name__}.{name} is registered but {type(self).__name__} already has an attribute "
                    f"{name!r}; rename the worker method."
                )
            setattr(self, name, self._make_method(name, remote_prefix + name, fn, spec))
            self._method_names.append(name)

    def _make_method(
        self, name: str, remote_name: str, fn: Callable[..., Any], spec: RegisterSpec
    ) -> Callable:
        def method(*args: Any, **kwargs: Any) -> Any:
            return self._call(remote_name, spec, args, kwargs)

        functools.update_wrapper(method, fn)
        sig = _signature_without_self(fn)
        if sig is not None:
            method.__signature__ = sig  # type: ignore[attr-defined]
        method.__hybridrl_register__ = spec  # type: ignore[attr-defined]
        return method

    # ---- meshes ------------------------------------------------------------------------------
    def mesh_coords(self, mesh: str) -> list[Any]:
        """Every rank's MeshCoord in the mesh the workers declared as ``mesh`` (rank order)."""
        coords = self._query_mesh(mesh)
        missing = [r for r, c in enumerate(coords) if c is None]
        if missing:
            raise RuntimeError(
                f"worker group {self._name!r}: ranks {missing} have not declared mesh {mesh!r}; the worker must "
                f"call self.set_mesh({mesh!r}, MeshLayout.create(...)) (e.g. in init_model) before a method "
                f"registered with make_mesh_dispatch({mesh!r}) is called"
            )
        return coords

    def mesh_info(self, mesh: str) -> MeshDispatchInfo:
        """Dispatch view of a mesh (dp group of each rank, collecting rank of each dp group),
        read from the workers on first use and cached."""
        if mesh not in self._mesh_infos:
            self._mesh_infos[mesh] = MeshDispatchInfo.from_coords(mesh, self.mesh_coords(mesh))
        return self._mesh_infos[mesh]

    def dp_size(self, mesh: str) -> int:
        """Number of data-parallel groups of ``mesh`` (a batch for it must be a multiple to avoid padding)."""
        return self.mesh_info(mesh).dp_size

    # ---- calling -----------------------------------------------------------------------------
    def _call(self, method: str, spec: RegisterSpec, args: tuple, kwargs: dict[str, Any]) -> Any:
        mode = spec.dispatch_mode
        if mode.mesh is not None:
            plan = mode.dispatch_fn(self.mesh_info(mode.mesh), *args, **kwargs)
        else:
            plan = mode.dispatch_fn(self._world_size, *args, **kwargs)
        if not isinstance(plan, DispatchPlan):
            raise TypeError(
                f"dispatch function of {mode!r} returned {type(plan).__name__}, expected a DispatchPlan"
            )
        ranks = list(range(self._world_size)) if plan.ranks is None else list(plan.ranks)
        bad = [r for r in ranks if not 0 <= r < self._world_size]
        if bad:
            raise ValueError(
                f"{mode!r} selected ranks {bad} outside 0..{self._world_size - 1} of group {self._name!r}"
            )
        rank_args, rank_kwargs = plan.rank_args, plan.rank_kwargs
        returns_data_proto = mode.returns_data_proto
        if spec.execute_mode is Execute.RANK_ZERO:
            if 0 not in ranks:
                raise ValueError(f"Execute.RANK_ZERO with {mode!r}: the dispatch did not select rank 0")
            i = ranks.index(0)
            ranks, rank_args, rank_kwargs = [0], [rank_args[i]], [rank_kwargs[i]]
            collect: Callable[[list[Any]], Any] = _first
            returns_data_proto = False
        elif _carries_batch_ref(args, kwargs):
            collect = self._by_ref(mode, plan)
        else:
            collect = proto_collect_fn(mode, plan.context)
        rank_args, rank_kwargs = self._share_args(rank_args, rank_kwargs)
        if spec.blocking:
            return collect(self._call_blocking(method, ranks, rank_args, rank_kwargs))
        handles = [self._submit(r, method, a, k) for r, a, k in zip(ranks, rank_args, rank_kwargs)]
        return self._future(handles, collect, method, ranks, returns_data_proto)

    def _call_blocking(
        self, method: str, ranks: list[int], rank_args: list[tuple], rank_kwargs: list[dict[str, Any]]
    ) -> list[Any]:
        """Hook: run ``method`` on ``ranks`` with their arguments and wait; results in rank order
        (default: submit to each rank, then gather; the Ray backend may fan out through nodes)."""
        handles = [self._submit(r, method, a, k) for r, a, k in zip(ranks, rank_args, rank_kwargs)]
        return self._gather(handles, method, ranks)

    def _by_ref(self, mode: Any, plan: DispatchPlan) -> Callable:
        """A call given a BatchRef: every rank keeps its result in the object store and returns a
        handle; the driver gets a BatchRef of the new columns."""
        if not mode.returns_data_proto:
            raise TypeError(
                f"{mode!r} does not return a DataProto, so it cannot take a BatchRef; pull the columns the "
                "method needs first (batch_ref.pull([...])) or register it with Dispatch.DP_COMPUTE_PROTO"
            )
        return functools.partial(collect_batch_ref, context=plan.context, mode=mode)

    def _remote_name(self, method_name: str) -> str:
        """Hook: the remote method a call of ``method_name`` runs (role views add their prefix)."""
        return method_name

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name`` with the same arguments on every rank; per-rank handles."""
        return [self._submit(r, method_name, args, kwargs) for r in range(self._world_size)]

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name`` with the same arguments on every rank and wait: per-rank results."""
        n = self._world_size
        return self._call_blocking(self._remote_name(method_name), list(range(n)), [args] * n, [kwargs] * n)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self._submit(0, method_name, args, kwargs)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on rank 0 only and return its result."""
        return self._gather([self.execute_rank_zero_async(method_name, *args, **kwargs)], method_name, [0])[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, world_size={self._world_size}, methods={self._method_names})"


def _carries_batch_ref(args: tuple, kwargs: dict[str, Any]) -> bool:
    return any(isinstance(v, BatchRef) for v in (*args, *kwargs.values()))


def _first(outputs: list[Any]) -> Any:
    return outputs[0]
