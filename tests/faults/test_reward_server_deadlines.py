"""A served reward model that never answers ends the call naming the key.

The reward loop's call of a reward-model replica (`reward_loop._call`, what `RewardLoopWorker`
runs for every chunk) waits `reward_model.rollout.request_timeout_s`: a real Ray actor whose
`score` sleeps an hour, and the same replica object in this process, fail within seconds.
"""

from __future__ import annotations

import time

import pytest

from hybridrl.reward import reward_loop
from hybridrl.single_controller.worker_group import WorkerHungError
from hybridrl.utils.deadlines import DeadlineError

KEY = "reward_model.rollout.request_timeout_s"


def test_a_replica_actor_that_never_answers_fails_naming_the_key(ray_faults):
    from fault_workers import HangingScorer

    ray = ray_faults
    actor = ray.remote(HangingScorer).options(num_cpus=0).remote(3600.0)
    try:
        ray.get(actor.__ray_ready__.remote())
        t0 = time.monotonic()
        with pytest.raises(WorkerHungError) as err:
            reward_loop._call(actor, [[1, 2, 3]], 1.0)
        assert time.monotonic() - t0 < 15
        msg = str(err.value)
        assert f"{KEY}=1" in msg and "'reward_model_server'" in msg and "'score'" in msg
    finally:
        ray.kill(actor)


def test_an_in_process_replica_that_never_answers_fails_naming_the_key():
    from fault_workers import HangingScorer

    t0 = time.monotonic()
    with pytest.raises(DeadlineError) as err:
        reward_loop._call(HangingScorer(3600.0), [[1, 2, 3]], 0.5)
    assert time.monotonic() - t0 < 10 and err.value.key == KEY
    assert f"{KEY}=0.5" in str(err.value)
    assert reward_loop._call(HangingScorer(0.0), [[1], [2]], 5.0) == [0.0, 0.0]  # answers in time
