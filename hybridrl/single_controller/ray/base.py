"""Ray backend of the single controller: resource pools, worker groups, futures.

* :class:`RayResourcePool` (resource_pool.py) reserves device slots as placement groups (one per
  node, one bundle per slot: ``{"CPU": cpus_per_slot, "GPU": 1 if use_gpu}``).
* :class:`RayClassWithInitArgs` is a worker class plus its constructor arguments and actor options.
* :class:`RayWorkerGroup` starts one actor per slot, sets the rendezvous env (RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, thread counts) and exposes the
  class's @register'ed methods as methods of the group.

Colocating several roles in one process: see ``colocate.py``.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Worker
from hybridrl.single_controller.ray.fanout import DISPATCHER_GRACE_S, FANOUT_MIN_RANKS, NodeDispatcher
from hybridrl.single_controller.ray.gather import (
    WorkerGroupDataProtoFuture,
    WorkerGroupFuture,
    gather_refs,
    get_one,
    hung_error,
)
from hybridrl.single_controller.ray.nodes import (
    forget_actors,
    record_actors,
    record_dispatcher,
)
from hybridrl.single_controller.ray.resource_pool import RayResourcePool
from hybridrl.single_controller.worker_group import (
    WorkerGroup,
    WorkerGroupError,
)
from hybridrl.utils import deadlines, plugins
from hybridrl.utils.cpus import thread_env

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerGroupDataProtoFuture",
    "WorkerGroupFuture",
    "gather_refs",
]


# ----------------------------------------------------------------------------------------------
# class + init args
# ----------------------------------------------------------------------------------------------
def unwrap_actor_class(cls: Any) -> type:
    """The plain class behind ``cls`` (accepts a class or a ``ray.remote(cls)`` actor class)."""
    inner = getattr(cls, "__ray_actor_class__", None)
    return inner if inner is not None else cls


class RayClassWithInitArgs:
    """A Worker subclass, its constructor arguments and extra Ray actor options."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.cls = unwrap_actor_class(cls)
        if not (isinstance(self.cls, type) and issubclass(self.cls, Worker)):
            raise TypeError(
                f"{cls!r} is not a subclass of hybridrl.single_controller.base.Worker; worker classes must "
                "inherit from Worker so the group can set up ranks and the rendezvous address."
            )
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> RayClassWithInitArgs:
        """Merge Ray actor options (e.g. runtime_env, max_concurrency) into the ones used; returns self."""
        for key, value in options.items():
            if key == "runtime_env" and "runtime_env" in self.options:
                merged = dict(self.options["runtime_env"])
                env = {**merged.get("env_vars", {}), **value.get("env_vars", {})}
                merged.update(value)
                if env:
                    merged["env_vars"] = env
                self.options["runtime_env"] = merged
            else:
                self.options[key] = value
        return self

    def __repr__(self) -> str:
        return f"RayClassWithInitArgs({self.cls.__name__}, args={self.args}, kwargs={list(self.kwargs)})"


_ACTOR_CLASSES: dict[type, Any] = {}
_SHARED_TYPES = (DataProto, torch.Tensor, np.ndarray)


def _actor_class(cls: type) -> Any:
    """ray.remote(cls); a class attribute `ray_concurrency_groups` ({name: threads}) declares Ray
    concurrency groups (e.g. a control method that runs while another call is executing)."""
    if cls not in _ACTOR_CLASSES:
        groups = getattr(cls, "ray_concurrency_groups", None)
        _ACTOR_CLASSES[cls] = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    return _ACTOR_CLASSES[cls]


# ----------------------------------------------------------------------------------------------
# fan-out state
# ----------------------------------------------------------------------------------------------
_DISPATCHER_CLS: Any = None
_DISPATCHER_CONCURRENCY = 32  # blocking calls one dispatcher runs at once (driver threads, role views)


@dataclass
class _FanOut:
    """A group's fan-out: on or off, the node of each rank, the dispatchers' runtime env and actors
    (shared by the group's role views)."""

    on: bool = False
    every_call: bool = False  # False: calls that send tensors (DataProto, tensor, array) go direct
    nodes: list[str | None] = field(default_factory=list)
    runtime_env: dict[str, Any] = field(default_factory=dict)
    dispatchers: dict[str, Any] = field(default_factory=dict)

    def dispatcher_ids(self) -> set[str]:
        return {a._actor_id.hex() for a in self.dispatchers.values()}


def _sends_tensors(rank_args: list[tuple], rank_kwargs: list[dict[str, Any]]) -> bool:
    """A DataProto / tensor / array argument (or one _share_args already put into the store)."""
    kinds = (*_SHARED_TYPES, ray.ObjectRef)
    return any(isinstance(v, kinds) for args in rank_args for v in args) or any(
        isinstance(v, kinds) for kwargs in rank_kwargs for v in kwargs.values()
    )


def _put_values(rank_args: list[tuple], rank_kwargs: list[dict[str, Any]]) -> tuple[list, list]:
    """Put each DataProto / tensor / array argument into the object store (once per object): the
    dispatcher then forwards a reference, not a copy (Ray resolves it before the method runs)."""
    refs: dict[int, ray.ObjectRef] = {}

    def put(value: Any) -> Any:
        if not isinstance(value, _SHARED_TYPES):
            return value
        if id(value) not in refs:
            refs[id(value)] = ray.put(value)
        return refs[id(value)]

    return (
        [tuple(put(v) for v in args) for args in rank_args],
        [{k: put(v) for k, v in kwargs.items()} for kwargs in rank_kwargs],
    )


# ----------------------------------------------------------------------------------------------
# worker group
# ----------------------------------------------------------------------------------------------
class RayWorkerGroup(WorkerGroup):
    """One Ray actor per slot of a resource pool, all of one Worker class.

    Every @register'ed method of the class becomes a method of the group with the same name,
    signature and docstring: ``wg.compute_log_prob(data)``.

    Args:
        resource_pool: the slots to place the actors in (not needed with ``worker_names``).
        ray_cls_with_init: the worker class and its constructor arguments.
        name_prefix: prefix of actor / group names (random when None).
        detached: start named, detached actors that outlive this driver.
        worker_names: attach to existing (detached) actors with these names instead of starting
            new ones; ``ray_cls_with_init`` then only supplies the class.
        fanout: send blocking calls through one dispatcher actor per node (ray/fanout.py), so the
            driver's work per call grows with the nodes, not the ranks. True: every blocking call.
            None (the default): when the group has at least ``FANOUT_MIN_RANKS`` ranks, the calls
            that send no DataProto, tensor or array (a batch held by reference, control calls);
            calls that send the batch through the driver get their results directly.
            Needs the ranks' nodes, which a group attached by ``worker_names`` does not know (it
            calls the ranks directly).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        fanout: bool | None = None,
    ) -> None:
        if ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init=RayClassWithInitArgs(WorkerClass, ...)")
        if not ray.is_initialized():
            raise RuntimeError("RayWorkerGroup: call ray.init(...) before creating worker groups")
        self._cls = ray_cls_with_init.cls
        self._pool = resource_pool
        prefix = name_prefix or f"{self._cls.__name__}_{uuid.uuid4().hex[:6]}"
        self._fan = _FanOut()
        if worker_names:
            if fanout:
                raise ValueError(
                    "RayWorkerGroup(fanout=True) needs the nodes of the ranks, which a group attached by "
                    "worker_names does not know; leave fanout unset"
                )
            actors = [ray.get_actor(n) for n in worker_names]
            names = list(worker_names)
        else:
            if resource_pool is None:
                raise ValueError("RayWorkerGroup needs a resource_pool (or worker_names of existing actors)")
            actors, names = self._start_actors(resource_pool, ray_cls_with_init, prefix, detached)
        super().__init__(prefix, len(actors))
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self._actors = actors
        self._worker_names = names
        if worker_names:
            self._check_attached()
        else:
            self._setup_rendezvous()
            known = all(self._fan.nodes)
            if fanout and not known:
                raise ValueError(
                    f"RayWorkerGroup {prefix!r}: fanout=True, but the cluster did not say the ranks' nodes"
                )
            self._fan.on = known and (len(actors) >= FANOUT_MIN_RANKS if fanout is None else bool(fanout))
            self._fan.every_call = bool(fanout)
        self._bind_registered_methods(self._cls)

    # ---- construction ------------------------------------------------------------------------
    def _start_actors(
        self, pool: RayResourcePool, spec: RayClassWithInitArgs, prefix: str, detached: bool
    ) -> tuple[list[Any], list[str]]:
        actor_cls = _actor_class(spec.cls)
        slots = pool.slots(detached)
        world_size = len(slots)
        user_options = dict(spec.options)
        user_env = dict(user_options.pop("runtime_env", {}))
        user_env_vars = dict(user_env.pop("env_vars", {}))
        actors, names = [], []
        # Ray sets OMP_NUM_THREADS from the actor's (fractional) CPU share unless given: give the
        # slot's thread count (a user's own OMP_NUM_THREADS wins).
        # More than one thread also gets OMP_WAIT_POLICY=PASSIVE (hybridrl.utils.cpus.thread_env).
        threads = str(user_env_vars.get("OMP_NUM_THREADS", pool.num_threads))
        omp_env = {k: v for k, v in thread_env(int(threads)).items() if k not in user_env_vars}
        for rank, slot in enumerate(slots):
            env_vars = {
                **omp_env,
                **deadlines.worker_env(),  # trainer.step_timeout_s / reward_timeout_s in the worker
                **plugins.worker_env(),  # the driver's model.external_lib modules, imported by the worker
                **user_env_vars,
                "OMP_NUM_THREADS": threads,
                "HYBRIDRL_NUM_THREADS": threads,
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(slot.local_rank),
                "LOCAL_WORLD_SIZE": str(slot.local_world_size),
                "HYBRIDRL_WORKER_GROUP": prefix,
            }
            options: dict[str, Any] = {
                **pool.actor_resources(),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
                ),
                "runtime_env": {**user_env, "env_vars": env_vars},
                **user_options,
            }
            name = f"{prefix}_rank{rank}"
            if detached:
                options.update(name=name, lifetime="detached")
            actors.append(actor_cls.options(**options).remote(*spec.args, **spec.kwargs))
            names.append(name)
        self._fan.nodes = record_actors(prefix, actors, slots)  # a lost node's error names its ranks
        self._fan.runtime_env = {
            **user_env,
            "env_vars": {
                **thread_env(1),
                **deadlines.worker_env(),
                **plugins.worker_env(),
                **user_env_vars,
                "OMP_NUM_THREADS": "1",
            },
        }
        return actors, names

    def _setup_rendezvous(self) -> None:
        """Rank 0 picks MASTER_ADDR / MASTER_PORT on its node; the other ranks get them.

        This also waits until every actor is constructed, so a failing constructor surfaces
        here (named by rank) and not at the first call.
        """
        try:
            ref = self._actors[0]._hybridrl_pick_master_addr_port.remote()
            addr, port = gather_refs([ref], group=self._name, method="__init__", ranks=[0])[0]
            refs = [a._hybridrl_set_master_addr_port.remote(addr, port) for a in self._actors[1:]]
            gather_refs(refs, group=self._name, method="__init__", ranks=list(range(1, self._world_size)))
        except WorkerGroupError:
            self.shutdown()
            raise
        self.master_addr, self.master_port = addr, port

    def _check_attached(self) -> None:
        """Attached actors must form a whole group, in rank order; read its rendezvous address."""
        refs = [a._hybridrl_env.remote() for a in self._actors]
        infos = gather_refs(
            refs, group=self._name, method="_hybridrl_env", ranks=list(range(self._world_size))
        )
        ranks = [(i["rank"], i["world_size"]) for i in infos]
        if ranks != [(r, self._world_size) for r in range(self._world_size)]:
            raise ValueError(
                f"worker_names must list every worker of one group in rank order; the actors report "
                f"(rank, world_size) = {ranks}"
            )
        self.master_addr, self.master_port = infos[0]["master_addr"], infos[0]["master_port"]

    # ---- backend hooks -----------------------------------------------------------------------
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict[str, Any]) -> ray.ObjectRef:
        try:
            remote_method = getattr(self._actors[rank], method)
        except AttributeError:
            raise AttributeError(
                f"worker group {self._name!r}: {self._cls.__name__} has no method {method!r}"
            ) from None
        return remote_method.remote(*args, **kwargs)

    def _query_mesh(self, mesh: str) -> list[Any]:
        role = getattr(self, "_prefix", "")[:-1] or None
        refs = [a._hybridrl_mesh_info.remote(mesh, role) for a in self._actors]
        return gather_refs(
            refs, group=self._name, method="_hybridrl_mesh_info", ranks=list(range(self._world_size))
        )

    def _share_args(self, rank_args: list[tuple], rank_kwargs: list[dict[str, Any]]) -> tuple[list, list]:
        """Put a DataProto / tensor / array that goes to several ranks into the object store once.

        Ray would serialise it again for every ``.remote()`` call; a top-level ObjectRef
        argument is resolved by Ray before the method runs, so the worker sees the value.
        """
        if len(rank_args) < 2:
            return rank_args, rank_kwargs
        counts = Counter(id(v) for args in rank_args for v in args)
        counts.update(id(v) for kwargs in rank_kwargs for v in kwargs.values())
        shared: dict[int, ray.ObjectRef] = {}

        def share(value: Any) -> Any:
            if counts[id(value)] < 2 or not isinstance(value, _SHARED_TYPES):
                return value
            if id(value) not in shared:
                shared[id(value)] = ray.put(value)
            return shared[id(value)]

        if not any(c > 1 for c in counts.values()):
            return rank_args, rank_kwargs
        new_args = [tuple(share(v) for v in args) for args in rank_args]
        new_kwargs = [{k: share(v) for k, v in kwargs.items()} for kwargs in rank_kwargs]
        return new_args, new_kwargs

    def _gather(self, handles: Sequence[Any], method: str, ranks: Sequence[int]) -> list[Any]:
        return gather_refs(handles, group=self._name, method=method, ranks=ranks)

    # ---- fan-out through one dispatcher per node (ray/fanout.py) ----------------------------
    @property
    def fanout(self) -> bool:
        """Whether blocking calls go through one dispatcher actor per node. Set True (every blocking
        call), False (none) or None (the default: from FANOUT_MIN_RANKS ranks, calls that send no
        DataProto, tensor or array: their results would pass through the dispatcher as well)."""
        return self._fan.on

    @fanout.setter
    def fanout(self, on: bool | None) -> None:
        known = bool(self._fan.nodes) and all(self._fan.nodes)
        if on and not known:
            raise ValueError(
                f"worker group {self._name!r}: fan-out needs the ranks' nodes, which it does not know"
            )
        self._fan.on = known and (self._world_size >= FANOUT_MIN_RANKS if on is None else bool(on))
        self._fan.every_call = bool(on)

    def _call_blocking(
        self, method: str, ranks: list[int], rank_args: list[tuple], rank_kwargs: list[dict[str, Any]]
    ) -> list[Any]:
        if (
            not self._fan.on
            or len(ranks) < 2
            or (not self._fan.every_call and _sends_tensors(rank_args, rank_kwargs))
        ):
            return super()._call_blocking(method, ranks, rank_args, rank_kwargs)
        if not hasattr(self._actors[ranks[0]], method):
            raise AttributeError(
                f"worker group {self._name!r}: {self._cls.__name__} has no method {method!r}"
            )
        rank_args, rank_kwargs = _put_values(rank_args, rank_kwargs)
        by_node: dict[str, list[int]] = {}  # node -> positions in `ranks`
        for i, r in enumerate(ranks):
            by_node.setdefault(self._fan.nodes[r], []).append(i)
        dispatchers = self._dispatchers()
        limit = deadlines.step_timeout()
        refs = [
            dispatchers[node].call.remote(
                method,
                [ranks[i] for i in at],
                [rank_args[i] for i in at],
                [rank_kwargs[i] for i in at],
                limit,
            )
            for node, at in by_node.items()
        ]

        def inspect(_: int, outcome: tuple) -> None:
            if outcome[0] == "failed":  # the rank's own error, raised as a direct call raises it
                get_one(outcome[2], self._name, outcome[1], method)
            elif outcome[0] == "hung":
                label = f"{deadlines.STEP_KEY}={limit:g}"
                raise hung_error(
                    self._name, outcome[1], method, outcome[2], outcome[3], label, deadlines.STEP_KEY
                )

        firsts = [ranks[at[0]] for at in by_node.values()]
        try:
            outcomes = gather_refs(
                refs,
                group=self._name,
                method=method,
                ranks=firsts,
                timeout_s=limit + DISPATCHER_GRACE_S,
                inspect=inspect,
            )
        except WorkerGroupError as err:
            if isinstance(err.cause, RayActorError) and err.cause.actor_id in self._fan.dispatcher_ids():
                self._drop_dispatchers()  # a dispatcher died: start new ones on the next call
            raise
        out: list[Any] = [None] * len(ranks)
        for at, (_, values) in zip(by_node.values(), outcomes):
            for i, value in zip(at, values):
                out[i] = value
        return out

    def _dispatchers(self) -> dict[str, Any]:
        """The group's dispatcher of each node, started (and waited for) on first use."""
        fan = self._fan
        if fan.dispatchers:
            return fan.dispatchers
        global _DISPATCHER_CLS
        if _DISPATCHER_CLS is None:
            _DISPATCHER_CLS = ray.remote(NodeDispatcher)
        ranks_on: dict[str, list[int]] = {}
        for rank, node in enumerate(fan.nodes):
            ranks_on.setdefault(node, []).append(rank)
        for node, ranks in ranks_on.items():
            actor = _DISPATCHER_CLS.options(
                num_cpus=0,
                max_concurrency=_DISPATCHER_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env=fan.runtime_env,
            ).remote({r: self._actors[r] for r in ranks})
            record_dispatcher(self._name, actor, ranks[0], node)
            fan.dispatchers[node] = actor
        try:
            gather_refs(
                [a.ready.remote() for a in fan.dispatchers.values()],
                group=self._name,
                method="(the dispatcher of the node)",
                ranks=[r[0] for r in ranks_on.values()],
            )
        except WorkerGroupError:
            self._drop_dispatchers()
            raise
        return fan.dispatchers

    def _drop_dispatchers(self) -> None:
        actors = list(self._fan.dispatchers.values())
        self._fan.dispatchers.clear()
        forget_actors(actors)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass

    def _future(
        self,
        handles: list[Any],
        collect: Callable[[list[Any]], Any],
        method: str,
        ranks: list[int],
        returns_data_proto: bool,
    ) -> Any:
        if returns_data_proto:
            return WorkerGroupDataProtoFuture(
                collect_fn=collect,
                futures=handles,
                timeout_s=deadlines.step_timeout(),  # the driver's, when this future is resolved in a worker
                group=self._name,
                method=method,
                ranks=ranks,
            )
        return WorkerGroupFuture(handles, collect, self._name, method, ranks)

    # ---- public ------------------------------------------------------------------------------
    @property
    def workers(self) -> list[Any]:
        """The actor handles, in rank order."""
        return list(self._actors)

    @property
    def worker_names(self) -> list[str]:
        return list(self._worker_names)

    @property
    def worker_cls(self) -> type:
        return self._cls

    @property
    def resource_pool(self) -> RayResourcePool | None:
        return self._pool

    def _role_view(self, role: str, role_cls: type) -> RayWorkerGroup:
        view = object.__new__(type(self))
        WorkerGroup.__init__(view, f"{self._name}/{role}", self._world_size)  # own mesh cache per role
        view._cls, view._pool, view._actors, view._worker_names = (
            role_cls,
            self._pool,
            self._actors,
            self._worker_names,
        )
        view._prefix = f"{role}_"
        view._fan = self._fan  # the same dispatchers
        view.master_addr, view.master_port = (
            getattr(self, "master_addr", None),
            getattr(self, "master_port", None),
        )
        view._bind_registered_methods(role_cls, remote_prefix=view._prefix)
        return view

    def _remote_name(self, method_name: str) -> str:
        return getattr(self, "_prefix", "") + method_name

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return super().execute_all_async(self._remote_name(method_name), *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return super().execute_rank_zero_async(self._remote_name(method_name), *args, **kwargs)

    def shutdown(self) -> None:
        """Kill the actors (also detached ones) and the group's dispatchers. The resource pool stays reserved."""
        self._drop_dispatchers()
        forget_actors(self._actors)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead or never started
                pass
