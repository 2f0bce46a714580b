"""`trainer.max_restarts`: a worker process killed mid-run (a real SIGKILL of the Ray
actor's process), the driver tears the worker groups down, starts them again and resumes from the
last checkpoint; the run ends with the same final step count and a final model that loads.
"""

from __future__ import annotations

import os
import uuid

import psutil
import pytest
from transformers import AutoModelForCausalLM

from hybridrl.models.builtin import get_builtin_model_path
from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerHungError
from hybridrl.trainer.offline.model_merger import merge_checkpoint
from hybridrl.trainer.ppo.restarts import run_with_restarts
from hybridrl.utils import checkpointing as ck
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config, read_metrics

_TAG = f"faults-{uuid.uuid4().hex[:8]}"
os.environ["HYBRIDRL_FAULT_TAG"] = _TAG  # inherited by the Ray started for this module: finds our actors only

KILLER = '''
import os, signal, psutil

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores 0; on the first sample of training step {step} SIGKILLs a worker of this run (once): the
    worker it runs in (the reward manager runs on the first actor worker), else, called in the
    driver, the run's worker actors."""
    d = "{fault_dir}"
    calls = os.path.join(d, "calls")
    with open(calls, "a") as f:
        f.write("x")
    n = os.path.getsize(calls)
    marker = os.path.join(d, "killed")
    if n == {first_call} and not os.path.exists(marker):
        if os.environ.get("HYBRIDRL_WORKER_GROUP"):
            open(marker, "a").write(str(os.getpid()) + "\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        for p in psutil.process_iter():
            try:
                env = p.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("HYBRIDRL_FAULT_TAG") == "{tag}" and env.get("HYBRIDRL_WORKER_GROUP"):
                open(marker, "a").write(str(p.pid) + "\\n")
                os.kill(p.pid, signal.SIGKILL)
    return 0.0
'''


def _restart_run(tmp_path, extra):
    """3 steps of 4 prompts x 4 answers on Ray, a checkpoint every step, killed in step 2."""
    fn = tmp_path / "killer.py"
    # 16 scored samples per step: the first call of step 2 is the 17th
    fn.write_text(KILLER.format(step=2, first_call=17, tag=_TAG, fault_dir=tmp_path))
    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / "logs")
    overrides = [
        "trainer.backend=ray",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.reward_timeout_s=0",  # score in the calling thread (the first actor worker's)
        f"custom_reward_function.path={fn}",
        *extra,
    ]
    return compose_config(overrides, tmp_path)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes(ray_faults, tmp_path, capfd):
    from hybridrl.trainer.ppo.launch import run_ppo_config

    run_ppo_config(_restart_run(tmp_path, ["trainer.max_restarts=1"]))
    killed = (tmp_path / "killed").read_text().split()
    assert len(killed) == 1 and not psutil.pid_exists(int(killed[0]))  # one real actor process, dead
    err = capfd.readouterr().err
    assert "restart 1/1 (trainer.max_restarts): WorkerDiedError" in err
    root = str(tmp_path / "ckpt")
    assert ck.list_checkpoints(root)[-1] == 3 and ck.read_meta(ck.step_dir(root, 3))["global_step"] == 3
    steps = sorted(
        {r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if "actor/pg_loss" in r}
    )
    assert steps == [1, 2, 3]
    actor = os.path.join(ck.step_dir(root, 3), "actor")
    out = merge_checkpoint(actor, str(tmp_path / "hf"), hf_model_path=get_builtin_model_path())
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters()) > 0


@pytest.mark.slow
def test_without_restarts_a_killed_worker_ends_the_run_naming_it(ray_faults, tmp_path):
    from hybridrl.trainer.ppo.launch import run_ppo_config

    with pytest.raises(WorkerDiedError, match="died before or while running"):
        run_ppo_config(_restart_run(tmp_path, []))


def test_restart_policy_only_retries_dead_or_hung_workers(tmp_path):
    """The loop itself (fast): which errors restart, how often, and on what config."""
    config = compose_config(["trainer.max_restarts=2", "trainer.resume_mode=disable"], tmp_path)
    seen = []

    def attempt(cfg):
        seen.append(cfg.trainer.resume_mode)
        if len(seen) == 1:
            raise WorkerDiedError("died", group="g", rank=0, method="m")
        if len(seen) == 2:
            raise WorkerHungError("hung", group="g", rank=1, method="m")
        return {"done": 1.0}

    assert run_with_restarts(config, attempt) == {"done": 1.0}
    assert seen == ["disable", "auto", "auto"] and config.trainer.resume_mode == "disable"
    seen.clear()
    config.trainer.max_restarts = 0
    with pytest.raises(WorkerDiedError):
        run_with_restarts(config, attempt)
    config.trainer.max_restarts = 2

    def bug(cfg):
        seen.append(1)
        raise KeyError("a bug is not restarted")

    seen.clear()
    with pytest.raises(KeyError):
        run_with_restarts(config, bug)
    assert seen == [1]
    with pytest.raises(ConfigError, match=r"trainer.max_restarts=-1 must be an integer >= 0"):
        compose_config(["trainer.max_restarts=-1"], tmp_path)


def test_a_lost_node_restarts_and_stops_naming_it_when_the_slots_do_not_come_back(tmp_path, capfd):
    """The loop after a NodeLostError (fast): the restart names the node; a restart whose pools are
    not granted stops with the node, the key and the newest checkpoint; an entry point's own
    restartable error (main_async: every rollout worker lost) restarts too."""
    from hybridrl.async_rollout.records import RolloutWorkersLostError
    from hybridrl.single_controller.ray.nodes import NodeLostError, ResourcesUnavailableError
    from hybridrl.trainer.ppo.restarts import RESTARTABLE

    config = compose_config(["trainer.max_restarts=2", "trainer.resources_timeout_s=7"], tmp_path)
    root = config.trainer.default_local_dir
    os.makedirs(root)
    with open(os.path.join(root, ck.LATEST_FILE), "w") as f:
        f.write("4")
    lost = NodeLostError("node gone", group="hybridrl/actor_rollout", rank=1, method="update_actor")
    lost.node_id, lost.node_ip, lost.lost = "abcdef0123456789", "10.0.0.7", {"hybridrl": [1, 2]}
    seen = []

    def attempt(cfg):
        seen.append(cfg.trainer.resume_mode)
        if len(seen) == 1:
            raise lost
        raise ResourcesUnavailableError("the cluster did not grant [1, 1, 1] slots")

    with pytest.raises(ResourcesUnavailableError) as err:
        run_with_restarts(config, attempt)
    msg = str(err.value)
    assert "node abcdef012345 (10.0.0.7) left the Ray cluster" in msg
    assert "trainer.resources_timeout_s=7" in msg and f"Newest checkpoint: {ck.step_dir(root, 4)}" in msg
    assert "did not grant [1, 1, 1] slots" in msg and seen == ["auto", "auto"]
    assert (
        "node abcdef012345 (10.0.0.7) left the cluster (group 'hybridrl' ranks [1, 2])"
        in capfd.readouterr().err
    )

    seen.clear()

    def rollout_lost(cfg):
        seen.append(1)
        if len(seen) == 1:
            raise RolloutWorkersLostError("all 2 rollout workers died")
        return {"done": 1.0}

    assert run_with_restarts(config, rollout_lost, restartable=(*RESTARTABLE, RolloutWorkersLostError)) == {
        "done": 1.0
    }
    with pytest.raises(RolloutWorkersLostError):
        seen.clear()
        run_with_restarts(config, rollout_lost)  # main_ppo's set does not include it
