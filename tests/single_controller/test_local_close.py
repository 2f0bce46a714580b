"""The in-process backend closes its worker (e.g. a vLLM engine) before destroying the process group.

A rollout engine that tears down its own distributed state at exit (vLLM's engine core) must be shut
down while the default process group still exists; otherwise its exit hook fails on a destroyed group.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridrl.single_controller.base import Worker, register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.single_controller.local import LocalWorkerGroup
from hybridrl.single_controller.ray.base import RayClassWithInitArgs
from hybridrl.single_controller.ray.colocate import create_colocated_worker_cls
from hybridrl.utils.device import init_process_group

CLOSED: list[tuple[str, bool]] = []


class Engine(Worker):
    """Joins the group's process group on first use, as the real workers do (fsdp_workers)."""

    def __init__(self, name: str = "engine") -> None:
        super().__init__()
        self.name = name
        init_process_group(timeout_s=60)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return 1

    def close(self) -> None:
        CLOSED.append((self.name, dist.is_initialized()))


def test_shutdown_closes_the_worker_while_the_process_group_lives():
    CLOSED.clear()
    group = LocalWorkerGroup(RayClassWithInitArgs(Engine), name_prefix="close", num_threads=1)
    assert group.ping() == [1]
    group.shutdown()
    assert CLOSED == [("engine", True)]
    assert not dist.is_initialized()


def test_colocated_worker_closes_every_role():
    CLOSED.clear()
    spec = create_colocated_worker_cls(
        {"a": RayClassWithInitArgs(Engine, name="a"), "b": RayClassWithInitArgs(Engine, name="b")}
    )
    group = LocalWorkerGroup(spec, name_prefix="close2", num_threads=1)
    views = group.spawn(["a", "b"])
    assert views["a"].ping() == [1]
    group.shutdown()
    assert sorted(CLOSED) == [("a", True), ("b", True)]
