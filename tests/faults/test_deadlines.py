"""Deadlines: a hung (alive) worker and a hanging reward function end with a message
naming the key, within seconds (small timeouts set here)."""

from __future__ import annotations

import os
import time

import pytest

from hybridrl.single_controller.worker_group import WorkerHungError
from hybridrl.utils import deadlines
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config


@pytest.fixture
def restore_step_timeout():
    before = deadlines.step_timeout()
    yield
    deadlines.set_step_timeout(before)


def test_a_hung_worker_fails_naming_group_rank_method_and_wait(ray_faults, restore_step_timeout):
    from fault_workers import NapWorker

    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=False, cpus_per_slot=0.5, name_prefix="faults_nap")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NapWorker), name_prefix="faults_nap")
    short_step_timeout = 1.5
    deadlines.set_step_timeout(short_step_timeout)  # after the actors started (that takes seconds here)
    try:
        assert wg.nap(-1, 0.0) == [0, 1]  # nobody hangs: a normal call
        assert wg.nap(0, 0.5 * short_step_timeout) == [0, 1]  # slow but within the deadline
        t0 = time.monotonic()
        with pytest.raises(WorkerHungError) as err:
            wg.nap(1, 60.0)
        waited = time.monotonic() - t0
        msg = str(err.value)
        assert err.value.rank == 1 and err.value.method == "nap" and err.value.group == wg.name
        assert "rank 1 is alive but made no progress in 'nap'" in msg
        assert "trainer.step_timeout_s=1.5" in msg and "faults_nap" in msg
        assert short_step_timeout <= waited < short_step_timeout + 3, waited
    finally:
        wg.shutdown()
        pool.remove()


@pytest.fixture(scope="module")
def relay_groups(ray_faults):
    """A producer and a consumer group (one rank each), started while the driver's deadlines are
    distinctive values, so the workers' copies can be told apart from the defaults."""
    from fault_workers import ConsumerWorker, ProducerWorker

    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    before = (deadlines.step_timeout(), deadlines.reward_timeout())
    deadlines.configure(type("T", (), {"step_timeout_s": 1234.5, "reward_timeout_s": 321.0})())
    pools, groups = [], []
    try:
        for name, cls in (("faults_prod", ProducerWorker), ("faults_cons", ConsumerWorker)):
            pools.append(RayResourcePool([1], use_gpu=False, cpus_per_slot=0.5, name_prefix=name))
            groups.append(RayWorkerGroup(pools[-1], RayClassWithInitArgs(cls), name_prefix=name))
    finally:
        deadlines.configure(type("T", (), {"step_timeout_s": before[0], "reward_timeout_s": before[1]})())
    yield groups
    for wg, pool in zip(groups, pools):
        wg.shutdown()
        pool.remove()


def test_workers_get_the_drivers_deadlines(relay_groups):
    _, consumer = relay_groups
    assert consumer.timeouts() == [(1234.5, 321.0)]  # from the driver at start-up, not the defaults


def test_a_worker_waiting_on_a_hung_group_fails_naming_that_group(relay_groups, restore_step_timeout):
    import torch

    from hybridrl.protocol import DataProto

    producer, consumer = relay_groups
    data = DataProto.from_dict({"x": torch.arange(4)})
    assert consumer.consume(producer.produce(data, 0.0)).batch["x"].tolist() == [0, 1, 2, 3]
    step = 4.0
    deadlines.set_step_timeout(step)  # the future carries the driver's value into the consumer
    t0 = time.monotonic()
    with pytest.raises(WorkerHungError) as err:
        consumer.consume(producer.produce(data, 60.0))
    waited = time.monotonic() - t0
    msg = str(err.value)
    # the hung rank is the producer's, named before the driver's own deadline on the consumer
    assert (err.value.group, err.value.rank, err.value.method) == (producer.name, 0, "produce"), msg
    assert f"worker group {consumer.name!r}: rank 0 gave up in 'consume' waiting for its input" in msg
    assert f"worker group {producer.name!r}: rank 0 is alive but made no progress in 'produce'" in msg
    assert "trainer.step_timeout_s=4, of which" in msg and "waits 0.8 (3.2 s) for this input" in msg
    assert 0.8 * step <= waited < step + 3, waited


@pytest.mark.parametrize("how", ["get", "wait"])
def test_a_worker_waiting_on_a_hung_object_ref_fails_naming_the_key(relay_groups, how):
    from hybridrl.single_controller.worker_group import WorkerGroupError

    producer, consumer = relay_groups
    ref = producer.workers[0].nap.remote(60.0)  # a hung remote (queued behind a hung call, or hung itself)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        consumer.wait_for([ref], 1.5, how)
    msg = str(err.value)
    assert "ConsumerWorker.wait_for: " in msg and "did not exist within 1.5 s" in msg, msg
    assert "trainer.step_timeout_s=1.5" in msg and "DeadlineError" in msg
    assert time.monotonic() - t0 < 1.5 + 5


def test_a_future_keeps_its_class_and_deadline_when_chunked():
    from hybridrl.single_controller.ray.base import WorkerGroupDataProtoFuture

    fut = WorkerGroupDataProtoFuture(
        collect_fn=None, futures=[], timeout_s=7.0, group="g", method="m", ranks=[0]
    )
    pieces = fut.chunk(2)  # dispatch hands each rank a chunk: it must still wait with a deadline
    assert all(type(p) is WorkerGroupDataProtoFuture for p in pieces)
    assert [(p.timeout_s, p.group, p.method, p.dispatch_fn.keywords["index"]) for p in pieces] == [
        (7.0, "g", "m", 0),
        (7.0, "g", "m", 1),
    ]


def test_worker_group_errors_survive_pickling():
    import pickle

    from hybridrl.single_controller.worker_group import WorkerDiedError

    for cls in (WorkerHungError, WorkerDiedError):
        err = pickle.loads(pickle.dumps(cls("m", group="g", rank=3, method="f", cause=RuntimeError("x"))))
        assert type(err) is cls and (str(err), err.group, err.rank, err.method) == ("m", "g", 3, "f")
    err = pickle.loads(pickle.dumps(deadlines.DeadlineError("m", key="k", waited_s=2.0)))
    assert type(err) is deadlines.DeadlineError and (str(err), err.key, err.waited_s) == ("m", "k", 2.0)


def _hanging_reward(tmp_path) -> str:
    path = tmp_path / "hang.py"
    path.write_text(
        "import time\n\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    time.sleep(3600)\n    return 0.0\n"
    )
    return str(path)


def test_a_hanging_reward_function_fails_naming_the_key(tmp_path):
    from hybridrl.trainer.ppo.launch import run_ppo_config

    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / "logs")
    config = compose_config(
        [
            "trainer.backend=local",
            "trainer.total_training_steps=1",
            f"custom_reward_function.path={_hanging_reward(tmp_path)}",
            "trainer.reward_timeout_s=1",
        ],
        tmp_path,
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(deadlines.DeadlineError) as err:
            run_ppo_config(config)
    finally:
        deadlines.configure(type("T", (), {"step_timeout_s": 3600.0, "reward_timeout_s": 600.0})())
    msg = str(err.value)
    assert "reward manager 'naive' (compute_score) did not return within 1 s" in msg
    assert "trainer.reward_timeout_s=1" in msg and err.value.key == "trainer.reward_timeout_s"
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.step_timeout_s=0", "trainer.step_timeout_s"),
        ("trainer.reward_timeout_s=-1", "trainer.reward_timeout_s"),
    ],
)
def test_bad_deadlines_are_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"{key}=.* must be a number of seconds"):
        compose_config([override], tmp_path)


def test_call_with_deadline_returns_values_and_raises_errors():
    assert deadlines.call_with_deadline(lambda x: x + 1, 1, timeout_s=5, key="k", what="w") == 2
    with pytest.raises(KeyError):
        deadlines.call_with_deadline({}.__getitem__, "x", timeout_s=5, key="k", what="w")
    with pytest.raises(deadlines.DeadlineError, match=r"w did not return within 0.2 s \(k=0.2\)"):
        deadlines.call_with_deadline(time.sleep, 30, timeout_s=0.2, key="k", what="w")
