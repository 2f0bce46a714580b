"""Which node each worker runs on, and the error a lost node gives.

When a node of a Ray cluster goes away (a crash, a spot instance reclaimed, ``ray stop`` on it, a
removed ``ray.cluster_utils.Cluster`` node) every actor on it dies at once. Ray reports each dead
actor separately; the driver's first failed call would name one rank of one group. This module
records, when a worker group starts, the node of every rank (from its placement group's bundle
table, no call to the actor), so that a dead actor whose node is no longer alive becomes a
``NodeLostError`` naming the node (id and address) and every rank of every group that was on it.

``NodeLostError`` is a ``WorkerDiedError``: ``trainer.max_restarts`` restarts after it, and the
restarted run waits up to ``trainer.resources_timeout_s`` for the cluster to grant the workers'
slots again (``ResourcesUnavailableError`` when it does not).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from hybridrl.single_controller.worker_group import WorkerDiedError

__all__ = [
    "NodeLostError",
    "ResourcesUnavailableError",
    "forget_actors",
    "node_lost_error",
    "ranks_by_node",
    "record_actors",
    "record_dispatcher",
]

# actor id (hex) -> (group name, rank, node id)
_WHERE: dict[str, tuple[str, int, str]] = {}
ADVICE = (
    " With trainer.max_restarts > 0 the run restarts from its latest checkpoint once the cluster has the "
    "slots again (it waits trainer.resources_timeout_s); otherwise add the node back (or start the run "
    "with fewer nodes) and run the same command to resume."
)
NODE_DEATH_WAIT_S = 5.0  # how long a dead actor's node may still be listed alive (health checks)


class NodeLostError(WorkerDiedError):
    """A node of the cluster left while its workers ran: every actor on it is gone.

    ``node_id``, ``node_ip`` and ``lost`` ({group: [ranks]}) say which; they are empty after the
    error was pickled (the message keeps them).
    """

    node_id: str = ""
    node_ip: str = ""
    lost: dict[str, list[int]] = {}  # noqa: RUF012 (replaced per instance)


class ResourcesUnavailableError(RuntimeError):
    """The cluster did not grant a resource pool's slots in time."""


def record_actors(group: str, actors: Sequence[Any], slots: Sequence[Any]) -> list[str | None]:
    """Remember the node of each rank of ``group`` (``slots``: the pool's Slots, in rank order);
    returns the node id of each rank (None where the cluster did not say)."""
    tables: dict[str, dict] = {}
    nodes: list[str | None] = []
    for rank, (actor, slot) in enumerate(zip(actors, slots)):
        pg = slot.placement_group
        key = pg.id.hex()
        if key not in tables:
            tables[key] = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        node = tables[key].get(slot.bundle_index)
        nodes.append(node or None)
        if node:
            _WHERE[actor._actor_id.hex()] = (group, rank, node)
    return nodes


def record_dispatcher(group: str, actor: Any, first_rank: int, node: str) -> None:
    """Remember a group's dispatcher actor on ``node`` (ray/fanout.py): if it dies with its node,
    the error names the node and its ranks as a worker's would (``first_rank``: its first rank)."""
    _WHERE[actor._actor_id.hex()] = (group, first_rank, node)


def forget_actors(actors: Sequence[Any]) -> None:
    for actor in actors:
        _WHERE.pop(actor._actor_id.hex(), None)


def ranks_by_node(node_id: str) -> dict[str, list[int]]:
    """{group: sorted ranks} of the recorded actors on ``node_id``."""
    out: dict[str, list[int]] = {}
    for group, rank, node in _WHERE.values():
        if node == node_id:
            out.setdefault(group, []).append(rank)
    return {g: sorted(set(r)) for g, r in sorted(out.items())}


def _node_state(node_id: str) -> tuple[bool, str]:
    """(alive, address) of a node as the cluster's control store lists it (alive if unknown)."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return bool(node.get("Alive")), str(node.get("NodeManagerAddress", ""))
    return True, ""


def _dead_node(node_id: str, died_with_node: bool) -> tuple[bool, str]:
    """(dead, address): polls a little when Ray's message says the node died (its health check lags)."""
    deadline = time.monotonic() + (NODE_DEATH_WAIT_S if died_with_node else 0.0)
    while True:
        alive, ip = _node_state(node_id)
        if not alive or time.monotonic() >= deadline:
            return not alive, ip
        time.sleep(0.2)


def node_lost_error(
    err: BaseException, group: str, rank: int, method: str, advice: bool = True
) -> NodeLostError | None:
    """A NodeLostError for a dead actor whose node is gone; None for any other failure.

    advice: end the message with what the run does next (trainer.max_restarts) and what to do.
    """
    if not isinstance(err, RayActorError) or not err.actor_id or not ray.is_initialized():
        return None
    where = _WHERE.get(err.actor_id)
    if where is None:
        return None
    node_id = where[2]
    dead, ip = _dead_node(node_id, "node has died" in str(err))
    if not dead:
        return None
    lost = ranks_by_node(node_id)
    ranks = "; ".join(f"group {g!r} ranks {r}" for g, r in lost.items())
    out = NodeLostError(
        f"node {node_id[:12]} ({ip or 'address unknown'}) left the Ray cluster while worker group {group!r} "
        f"ran {method!r}: every worker on it is gone ({ranks})." + (ADVICE if advice else ""),
        group=group,
        rank=rank,
        method=method,
        cause=err,
    )
    out.node_id, out.node_ip, out.lost = node_id, ip, lost
    return out
