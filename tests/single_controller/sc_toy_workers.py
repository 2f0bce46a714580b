"""Toy workers for the single-controller tests (imported by the driver and by the Ray actors)."""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from hybridrl.protocol import DataProto
from hybridrl.single_controller import (
    Dispatch,
    DispatchPlan,
    Execute,
    MeshLayout,
    Worker,
    make_mesh_dispatch,
    register,
    register_dispatch_mode,
)

# Toy actors ask for a quarter CPU each so that all groups of the session fit into num_cpus=4.
TOY_CPUS = 0.25


# A custom mode: item i of a list goes to rank i % world_size; the driver gets the sum of the
# per-rank results and the per-rank results themselves.
def _round_robin_dispatch(world_size: int, items: list[int]) -> DispatchPlan:
    return DispatchPlan([(items[r::world_size],) for r in range(world_size)], [{} for _ in range(world_size)])


def _sum_collect(outputs: list[Any], context: Any) -> dict[str, Any]:
    return {"total": sum(o[1] for o in outputs), "per_rank": outputs}


def _last_rank_dispatch(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return DispatchPlan([args], [kwargs], ranks=[world_size - 1], context="last")


def _tag_collect(outputs: list[Any], context: Any) -> tuple[Any, Any]:
    return context, outputs[0]


if "ROUND_ROBIN_SUM" not in Dispatch.names():
    register_dispatch_mode("ROUND_ROBIN_SUM", _round_robin_dispatch, _sum_collect)
    register_dispatch_mode("LAST_RANK", _last_rank_dispatch, _tag_collect)


class ToyWorker(Worker):
    """One method per dispatch mode, plus failure and collective helpers."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.first_draw = torch.rand(4).tolist()  # what a fresh weight init would see

    @register(Dispatch.ONE_TO_ALL)
    def init_draw(self) -> list[float]:
        return self.first_draw

    @register(Dispatch.ONE_TO_ALL)
    def env(self) -> dict[str, Any]:
        info = self._hybridrl_env()
        info.update({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
        return info

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x: int, y: int = 0) -> tuple[int, int]:
        """Return (rank, x + y + offset)."""
        return self.rank, x + y + self.offset

    @register(Dispatch.ONE_TO_ALL)
    def proto_sum(self, data: DataProto, weights: torch.Tensor) -> tuple[int, int, int]:
        return self.rank, len(data), int((data.batch["x"] * weights).sum())

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, x: int, factor: int) -> tuple[int, int]:
        return self.rank, x * factor

    @register(Dispatch.RANK_ZERO)
    def whoami(self, tag: str) -> tuple[int, str]:
        return self.rank, tag

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def whoami_exec_rank_zero(self, tag: str) -> tuple[int, str]:
        return self.rank, tag

    @register(Dispatch.DP_COMPUTE)
    def sum_list(self, xs: list[int]) -> tuple[int, int]:
        return self.rank, sum(xs)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def mark(self, data: DataProto) -> DataProto:
        """Double `x`, add a `rank` column, keep the non-tensor data."""
        out = DataProto.from_dict(
            {"x": data.batch["x"] * 2, "rank": torch.full((len(data),), self.rank)},
            non_tensors=dict(data.non_tensor_batch),
            meta_info={"rows_seen": len(data)},
        )
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def mark_async(self, data: DataProto) -> DataProto:
        return self.mark(data)

    @register(Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def arg_kind(self, data: Any) -> DataProto:
        kind = type(data).__name__
        data = data.get() if hasattr(data, "get") and not isinstance(data, DataProto) else data
        return DataProto.from_dict({"x": data.batch["x"]}, non_tensors={"arg_kind": [kind] * len(data)})

    @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, func: Any, data: DataProto) -> DataProto:
        return func(data, self.rank)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict[str, Any]:
        return {"rank": self.rank, "rows": len(data), "x_sum": int(data.batch["x"].sum())}

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def add_async(self, x: int) -> tuple[int, int]:
        return self.rank, x + self.offset

    @register("ROUND_ROBIN_SUM")
    def total(self, items: list[int]) -> tuple[list[int], int]:
        return items, sum(items)

    @register("LAST_RANK")
    def rank_of(self) -> int:
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise ValueError(f"boom on rank {bad_rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def nap_or_die(self, rank_to_die: int, nap_s: float) -> int:
        if self.rank == rank_to_die:
            os._exit(3)
        time.sleep(nap_s)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def init_pg(self) -> tuple[int, int]:
        import torch.distributed as dist

        from hybridrl.utils.device import init_process_group

        init_process_group(timeout_s=60)
        return dist.get_rank(), dist.get_world_size()

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor([self.rank + 1.0, 10.0 * self.rank])
        dist.all_reduce(t)
        return t.tolist()

    def plain_method(self, x: int) -> int:
        """Not registered: reachable through execute_all / execute_rank_zero only."""
        return x * 100 + self.rank


class ToyActor(Worker):
    """Colocated role 1."""

    def __init__(self, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Toy log-probs: x * scale."""
        self.calls += 1
        return DataProto.from_dict({"old_log_prob": data.batch["x"].float() * self.scale})

    @register(Dispatch.ONE_TO_ALL)
    def num_calls(self) -> int:
        return self.calls

    @register(Dispatch.ONE_TO_ALL)
    def threads(self) -> tuple[str | None, int, str | None]:
        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), os.environ.get("TOY_FLAG")


class ToyCritic(Worker):
    """Colocated role 2."""

    def __init__(self, bias: float) -> None:
        super().__init__()
        self.bias = bias
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        self.calls += 1
        return DataProto.from_dict({"values": data.batch["x"].float() + self.bias})

    @register(Dispatch.ONE_TO_ALL)
    def num_calls(self) -> int:
        return self.calls


class BrokenInit(Worker):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("cannot load the model")


# ---- mesh-aware dispatch ----------------------------------------------------------------------
MESH_ROWS = make_mesh_dispatch("rows")
MESH_TRAIN = make_mesh_dispatch("train")


class ToyMeshWorker(Worker):
    """Declares a mesh "rows" (dims given to the constructor) and a pure-dp mesh "train"; records
    the rows every rank saw so tests can compare the ranks of one tp/pp group."""

    def __init__(self, dims: dict[str, int], collect: dict[str, int] | None = None, declare: bool = True):
        super().__init__()
        self.seen: list[list[int]] = []
        self.dims, self.collect = dims, collect
        if declare:
            self.declare()

    @register(Dispatch.ONE_TO_ALL)
    def declare(self) -> dict[str, int]:
        self.set_mesh("rows", MeshLayout.create(self.world_size, self.dims, collect=self.collect))
        self.set_mesh("train", MeshLayout.create(self.world_size, {"dp": self.world_size}))
        return self.mesh_coord("rows").coords

    @register(MESH_ROWS)
    def rows(self, data: DataProto) -> DataProto:
        """x + 1000 * dp_rank, and the global rank that produced each row."""
        self.seen.append(data.batch["x"].tolist())
        c = self.mesh_coord("rows")
        return DataProto.from_dict(
            {
                "x": data.batch["x"],
                "y": data.batch["x"] + 1000 * c.dp_rank,
                "rank": torch.full((len(data),), self.rank),
            },
            non_tensors=dict(data.non_tensor_batch),
        )

    @register(MESH_ROWS, blocking=False)
    def rows_async(self, data: DataProto) -> DataProto:
        return self.rows(data)

    @register(MESH_TRAIN)
    def train_rows(self, data: DataProto) -> DataProto:
        self.seen.append(data.batch["x"].tolist())
        return DataProto.from_dict({"x": data.batch["x"] * 10, "rank": torch.full((len(data),), self.rank)})

    @register(make_mesh_dispatch("never_declared"))
    def undeclared(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.ONE_TO_ALL)
    def pop_seen(self) -> list[list[int]]:
        seen, self.seen = self.seen, []
        return seen


class ControlledWorker(Worker):
    """A role with a Ray concurrency group: `release` runs while `block` holds the default group."""

    ray_concurrency_groups = {"control": 1}

    def __init__(self) -> None:
        import threading

        super().__init__()
        self._released = threading.Event()

    @register(Dispatch.ONE_TO_ALL)
    def block(self, timeout_s: float) -> bool:
        """Wait (in the default group) until `release` runs; True if it did within timeout_s."""
        return self._released.wait(timeout_s)

    @ray.method(concurrency_group="control")
    def release(self) -> bool:
        self._released.set()
        return True


# Per-row stage functions for the BatchRef tests: their results do not depend on the rank or the
# split, so the driver path and the by-reference path must agree exactly.
def stage_log_prob(data: DataProto, rank: int) -> DataProto:
    x = data.batch["x"]
    score = x.sum(-1)
    return DataProto.from_dict(
        {"lp": x * score.unsqueeze(-1), "score_tok": score.unsqueeze(-1) * data.batch["m"]},
        non_tensors={"score": score.numpy()},
        meta_info={"metrics": {"stage/rows": [len(data)]}},
    )


def stage_advantage(data: DataProto, rank: int) -> DataProto:
    adv = (data.batch["lp"] - data.batch["score_tok"]) * data.batch["m"]
    return DataProto.from_dict({"adv": adv, "ret": adv + 1.0})
