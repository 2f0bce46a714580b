"""A run whose workers fail while they start (here: a model file that does not load) releases its
actors and placement groups before the error reaches the user, so the Ray session is left as it
was and the next run in it starts at once instead of waiting for resources that are still held."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.e2e.ppo_runs import compose_config


def _pg_states(ray) -> dict[str, str]:
    return {pg_id: entry["state"] for pg_id, entry in ray.util.placement_group_table().items()}


def test_a_failed_start_leaves_no_placement_group_or_worker(ray_faults, tmp_path):
    ray = ray_faults
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.single_controller.worker_group import WorkerGroupError
    from hybridrl.trainer.ppo.launch import run_ppo_config

    bad = tmp_path / "model"
    shutil.copytree(get_builtin_model_path(), bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # truncated: the header parses, the tensors do not
    before = _pg_states(ray)
    config = compose_config(
        ["trainer.backend=ray", "trainer.n_gpus_per_node=2", f"actor_rollout_ref.model.path={bad}"], tmp_path
    )
    with pytest.raises(WorkerGroupError) as info:
        run_ppo_config(config)
    assert "init_model" in str(info.value)
    new = {pg: state for pg, state in _pg_states(ray).items() if pg not in before}
    assert new, "the run reserved no placement group: it failed before its workers started"
    assert set(new.values()) == {"REMOVED"}, new
    # the CPUs the workers held come back (Ray frees a removed group's bundles asynchronously)
    deadline = time.monotonic() + 30
    while (
        ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
