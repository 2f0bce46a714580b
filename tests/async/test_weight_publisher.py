"""The collective weight update's failure when a rollout worker died during the broadcast: the
driver names the dead worker with a restartable error (real Ray actors, a real dead process)."""

from __future__ import annotations

import pytest

from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerGroupError
from hybridrl.weight_sync.publisher import WeightPublisher

pytestmark = pytest.mark.usefixtures("ray_local")


class _Future:
    def __init__(self, refs):
        self.refs = refs


def _publisher(ray, rollout_actors):
    @ray.remote
    def broadcast():
        raise RuntimeError("the transfer of bucket 0 failed: a member of the group died")

    class Train:
        def broadcast_weights(self, version):
            return _Future([broadcast.remote()])

    class Rollout:
        workers = rollout_actors
        world_size = len(rollout_actors)

    pub = WeightPublisher(Train(), Rollout(), "collective", timeout_s=30)
    pub._joined = True  # the group exists; this test is about a member lost after it formed
    return pub


def _members(ray, n):
    """n rollout workers stand-ins: real actors, each a process of its own, started."""

    @ray.remote(num_cpus=0)
    class Member:
        def ping(self):
            return 1

    actors = [Member.remote() for _ in range(n)]
    ray.get([a.ping.remote() for a in actors])
    return actors


def test_a_broadcast_that_failed_because_a_rollout_worker_died_names_it(ray_local):
    ray = ray_local
    alive, dead = _members(ray, 2)
    ray.kill(dead)
    pub = _publisher(ray, [alive, dead])
    pub.publish(1)
    with pytest.raises(
        WorkerDiedError, match="rollout worker 1 died during the collective weight update"
    ) as e:
        pub.publish(2)  # checks the previous update
    assert (e.value.group, e.value.rank) == ("rollout", 1)
    assert "the transfer of bucket 0 failed" in str(e.value.__cause__)


def test_a_broadcast_that_failed_with_every_member_alive_keeps_its_own_error(ray_local):
    pub = _publisher(ray_local, _members(ray_local, 2))
    pub.publish(1)
    with pytest.raises(WorkerGroupError, match="the transfer of bucket 0 failed") as e:
        pub.publish(2)
    assert not isinstance(e.value, WorkerDiedError)
