"""Deadlines (issue 30): a hung (alive) worker and a hanging reward function end with a message
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
