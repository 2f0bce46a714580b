"""trainer.cpus_per_worker: the automatic share of the CPUs, explicit values, the thread env."""

import pytest

from hybridrl.trainer.ppo.config import ConfigError, load_config
from hybridrl.utils.cpus import auto_cpus_per_worker, available_cpus, resolve_cpus_per_worker, thread_env


@pytest.mark.parametrize(
    "cpus, slots, expected",
    [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 3), (8, 1, 7), (8, 2, 3), (8, 4, 2), (8, 8, 1), (3, 4, 1)],
)
def test_auto_shares_the_cpus_and_leaves_the_driver_a_core_when_there_is_room(cpus, slots, expected):
    assert auto_cpus_per_worker(cpus, slots) == expected


def test_resolve_explicit_values_win_and_bad_values_fail():
    assert resolve_cpus_per_worker("auto", slots=1, cpus=8) == 7
    assert resolve_cpus_per_worker(None, slots=2, cpus=8) == 3
    assert resolve_cpus_per_worker(3, slots=1, cpus=8) == 3
    assert resolve_cpus_per_worker("2", slots=1, cpus=8) == 2
    for bad in (0, -1, 1.5, "many"):
        with pytest.raises(ValueError, match="trainer.cpus_per_worker=.*'auto' or a positive integer"):
            resolve_cpus_per_worker(bad, slots=1, cpus=8)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        auto_cpus_per_worker(4, 0)


def test_thread_env_passive_wait_for_more_than_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert thread_env(1) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert thread_env(3)["OMP_WAIT_POLICY"] == "PASSIVE" and thread_env(3)["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert thread_env(2)["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice wins


def test_config_resolves_auto_once_on_the_driver():
    assert load_config({}).trainer.cpus_per_worker == auto_cpus_per_worker(available_cpus(), 1)
    two = load_config({"trainer": {"n_gpus_per_node": 2, "cpus_per_worker": "auto"}})
    assert two.trainer.cpus_per_worker == auto_cpus_per_worker(available_cpus(), 2)
    assert load_config({"trainer": {"cpus_per_worker": 5}}).trainer.cpus_per_worker == 5
    with pytest.raises(ConfigError, match="trainer.cpus_per_worker=0"):
        load_config({"trainer": {"cpus_per_worker": 0}})
