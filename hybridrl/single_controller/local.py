"""LocalWorkerGroup: one worker (rank 0 of 1) inside the driver process, behind the WorkerGroup API.

A single-slot run needs no second process: the worker object is built in the driver and every
group method calls it directly, with the same dispatch and collect functions as the Ray backend
(`WorkerGroup._call`), so trainer code is unchanged. What it saves is the start-up of Ray (its
GCS, raylet and worker processes) and of a worker process that imports torch, transformers and the
engines again (`bench/startup.py` measures both backends). Colocated classes (`create_colocated_worker_cls`)
work as with Ray: `spawn(roles)` gives per-role views.

The worker sees the environment a Ray worker of a one-slot group sees: RANK=0, WORLD_SIZE=1,
LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, a free MASTER_PORT on 127.0.0.1 and HYBRIDRL_NUM_THREADS; the
previous values are restored by `shutdown()`. It also keeps random-number streams of its own, as a
separate process would: the torch generator starts from torch's fresh-process seed, and the
driver's and the worker's generator states (torch, numpy, random) are swapped around every call,
so the driver's use of randomness never shifts the worker's (and a run equals its Ray twin).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.protocol import DataProto, DataProtoFuture
from hybridrl.single_controller.base import FRESH_PROCESS_SEED
from hybridrl.single_controller.worker_group import WorkerGroup, WorkerGroupError
from hybridrl.utils.torch_utils import get_rng_state, set_rng_state

__all__ = ["LocalWorkerGroup"]


@dataclass
class _RNG:
    """The worker's generator states, shared by the role views of one worker."""

    state: dict[str, Any]


@dataclass
class _Done:
    """The outcome of one in-process call: its value, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None
    text: str = ""


class LocalFuture:
    """Result of a non-blocking call on a LocalWorkerGroup (already computed): `get()` returns it."""

    def __init__(self, done: list[_Done], collect: Callable[[list[Any]], Any], group: str, method: str):
        self._done, self._collect, self._group, self._method = done, collect, group, method

    def get(self) -> Any:
        return self._collect(_values(self._done, self._group, self._method))


@dataclass
class LocalDataProtoFuture(DataProtoFuture):
    """DataProtoFuture over in-process results (no Ray object references)."""

    group: str = ""
    method: str = ""

    def get(self) -> DataProto:
        output = self.collect_fn(_values(self.futures, self.group, self.method))
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output


def _values(done: Sequence[_Done], group: str, method: str) -> list[Any]:
    for d in done:
        if d.error is not None:
            raise WorkerGroupError(
                f"worker group {group!r}: rank 0 raised in {method!r}. Traceback:\n{d.text}",
                group=group,
                rank=0,
                method=method,
                cause=d.error,
            ) from d.error
    return [d.value for d in done]


class LocalWorkerGroup(WorkerGroup):
    """A one-worker group whose worker lives in this process.

    Args:
        spec: the worker class and its constructor arguments (a `RayClassWithInitArgs`; its Ray
            actor options are ignored).
        name_prefix: the group's name.
        num_threads: torch threads of the worker (None: leave the process's setting).
    """

    def __init__(self, spec: Any, name_prefix: str = "hybridrl", num_threads: int | None = None) -> None:
        super().__init__(name_prefix, 1)
        self._cls = spec.cls
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        env["HYBRIDRL_WORKER_GROUP"] = name_prefix
        if num_threads:
            env["HYBRIDRL_NUM_THREADS"] = str(num_threads)
        self._saved_env = {k: os.environ.get(k) for k in [*env, "MASTER_ADDR", "MASTER_PORT"]}
        os.environ.update(env)
        driver_rng = get_rng_state()
        torch.manual_seed(FRESH_PROCESS_SEED)
        self._rng = _RNG(get_rng_state())
        try:
            self._worker = spec.cls(*spec.args, **spec.kwargs)
            self.master_addr, self.master_port = self._worker._hybridrl_pick_master_addr_port()
        finally:
            self._rng.state = get_rng_state()
            set_rng_state(driver_rng)
        self._prefix = ""
        self._bind_registered_methods(self._cls)

    # ---- backend hooks -----------------------------------------------------------------------
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict[str, Any]) -> _Done:
        fn = getattr(self._worker, method, None)
        if fn is None:
            raise AttributeError(
                f"worker group {self._name!r}: {self._cls.__name__} has no method {method!r}"
            )
        args = tuple(_resolve(a) for a in args)
        kwargs = {k: _resolve(v) for k, v in kwargs.items()}
        driver_rng = get_rng_state()
        set_rng_state(self._rng.state)
        try:
            return _Done(value=fn(*args, **kwargs))
        except Exception as e:  # reported like a remote failure, with the traceback
            return _Done(error=e, text=traceback.format_exc())
        finally:
            self._rng.state = get_rng_state()
            set_rng_state(driver_rng)

    def _query_mesh(self, mesh: str) -> list[Any]:
        role = self._prefix[:-1] or None
        return [self._worker._hybridrl_mesh_info(mesh, role)]

    def _gather(self, handles: Sequence[Any], method: str, ranks: Sequence[int]) -> list[Any]:
        return _values(handles, self._name, method)

    def _future(
        self,
        handles: list[Any],
        collect: Callable[[list[Any]], Any],
        method: str,
        ranks: list[int],
        returns_data_proto: bool,
    ) -> Any:
        if returns_data_proto:
            return LocalDataProtoFuture(collect_fn=collect, futures=handles, group=self._name, method=method)
        return LocalFuture(handles, collect, self._name, method)

    # ---- public ------------------------------------------------------------------------------
    @property
    def workers(self) -> list[Any]:
        """The worker objects (one), in rank order."""
        return [self._worker]

    @property
    def worker_cls(self) -> type:
        return self._cls

    def _role_view(self, role: str, role_cls: type) -> LocalWorkerGroup:
        view = object.__new__(type(self))
        WorkerGroup.__init__(view, f"{self._name}/{role}", 1)
        view._cls, view._worker, view._saved_env, view._rng = (
            role_cls,
            self._worker,
            self._saved_env,
            self._rng,
        )
        view.master_addr, view.master_port = self.master_addr, self.master_port
        view._prefix = f"{role}_"
        view._bind_registered_methods(role_cls, remote_prefix=view._prefix)
        return view

    def _remote_name(self, method_name: str) -> str:
        return self._prefix + method_name

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return super().execute_all_async(self._prefix + method_name, *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return super().execute_rank_zero_async(self._prefix + method_name, *args, **kwargs)

    def shutdown(self) -> None:
        """Drop the worker, destroy the process group it created and restore the environment."""
        import torch.distributed as dist

        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # its groups die with the process group below
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _resolve(value: Any) -> Any:
    """A future argument (from a non-blocking call on this backend) becomes its value."""
    return value.get() if isinstance(value, (LocalFuture, LocalDataProtoFuture)) else value
