"""A user's package outside hybridrl, used from the command line and from the Python API on Ray.

Each run is a real training of the built-in tiny model on Ray workers (main_ppo: two colocated
workers; main_async: a trainer and a rollout pool), started as a subprocess with the user's folder
on PYTHONPATH, two steps:

* `test_main_ppo_runs_user_plugins`: one command line selects four plug-ins of the package written by
  tests/plugins/user_plugins.py (an advantage estimator, a policy loss, a rollout engine and a
  training engine). Each records where it ran: the loss, the rollout and the engine must have run in
  both Ray worker processes (not the driver), the estimator in the driver (the trainer computes
  advantages there), and the package must have been imported in the driver and both workers.
* `test_custom_worker_and_trainer_example`: the `my_algo.py` example of docs/extending.md (a
  subclass of ActorRolloutRefWorker with a new `@register` method, a RayPPOTrainer subclass whose
  extra stage calls it, started with `run_ppo(role_worker_mapping=..., trainer_cls=...)`), taken
  from the page itself. The stage's metric must be the norm of the whole actor (the sum over the two
  FSDP shards equals the norm of the model it started from, to the size of two small updates), and
  the method must have run in two worker processes other than the driver.
* `test_main_async_runs_user_plugins_in_both_pools`: the same package with main_async: the loss and
  the engine ran in the trainer pool's worker, the rollout engine in the rollout pool's worker.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from user_plugins import PACKAGE, read_records, write_package

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "data.train_batch_size=4",
    "data.val_max_samples=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[console,file]",
    "trainer.progress_bar=false",
    "trainer.make_report=false",
    "trainer.cpus_per_worker=1",
    "trainer.n_gpus_per_node=2",
]


def _env(tmp_path: Path, user_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(user_dir), str(REPO)]),
        HYBRIDRL_LOG_DIR=str(tmp_path / "logs"),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("RAY_ADDRESS", None)
    return env


def _run(cmd: list[str], tmp_path: Path, user_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(tmp_path, user_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return proc


def _metrics(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
def test_main_ppo_runs_user_plugins(tmp_path):
    user_dir = tmp_path / "user"
    log = write_package(user_dir)
    cmd = [
        sys.executable,
        "-m",
        "hybridrl.trainer.main_ppo",
        "trainer.backend=ray",
        f"actor_rollout_ref.model.external_lib={PACKAGE}",
        "algorithm.adv_estimator=user_grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=user_pg",
        "actor_rollout_ref.rollout.name=user_hf",
        "actor_rollout_ref.actor.strategy=user_dp",
        f"trainer.default_local_dir={tmp_path}/ckpt",
        *SMALL,
    ]
    driver = _run(cmd, tmp_path, user_dir).pid
    records = read_records(log)
    where = {}
    for r in records:
        where.setdefault(r["what"], set()).add((r["pid"], r["group"]))
    workers = {pid for pid, group in where["engine"]}
    assert len(workers) == 2 and driver not in workers, where
    for what in ("policy_loss", "rollout", "engine"):  # inside both Ray workers of the group
        assert {pid for pid, _ in where[what]} == workers, (what, where)
        assert {group for _, group in where[what]} == {"hybridrl"}, (what, where)
    # the step's batch stays in the object store: a registered estimator runs on the first actor
    # worker (docs/architecture.md, the batch by reference), never on the driver
    assert len(where["adv_estimator"]) == 1 and where["adv_estimator"] <= {(w, "hybridrl") for w in workers}, where
    imported = {pid for pid, _ in where["import"]}
    assert {driver} | workers <= imported, where  # imported by the driver and by each worker
    assert len(_metrics(tmp_path)) == 2


@pytest.mark.slow
def test_main_async_runs_user_plugins_in_both_pools(tmp_path):
    """main_async: the trainer pool ran the loss and the engine, the rollout pool the rollout engine."""
    user_dir = tmp_path / "user"
    log = write_package(user_dir)
    cmd = [
        sys.executable,
        "-m",
        "hybridrl.trainer.main_async",
        "trainer.backend=ray",
        f"actor_rollout_ref.model.external_lib={PACKAGE}",
        "algorithm.adv_estimator=user_grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=user_pg",
        "async_training.use_decoupled_loss=false",  # else the decoupled loss replaces user_pg
        "actor_rollout_ref.rollout.name=user_hf",
        "actor_rollout_ref.actor.strategy=user_dp",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={tmp_path}/ckpt",
        *[o for o in SMALL if not o.startswith("trainer.n_gpus_per_node")],
    ]
    driver = _run(cmd, tmp_path, user_dir).pid
    where = {}
    for r in read_records(log):
        where.setdefault(r["what"], set()).add((r["pid"], r["group"]))
    (train,) = {pid for pid, group in where["import"] if group == "hybridrl_train"}
    (rollout,) = {pid for pid, group in where["import"] if group == "hybridrl_rollout"}
    assert driver not in (train, rollout) and (driver, None) in where["import"], where
    assert where["policy_loss"] == where["engine"] == {(train, "hybridrl_train")}, where
    assert where["rollout"] == {(rollout, "hybridrl_rollout")}, where
    assert where["adv_estimator"] == {(driver, None)}, where
    assert len(_metrics(tmp_path)) == 2


def _doc_example() -> str:
    text = (REPO / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (example,) = [b for b in blocks if b.startswith("# my_algo.py")]
    return example


RECORDING = """
import json, os, sys
import my_algo
from hydra import compose, initialize_config_module
from hybridrl.trainer.main_ppo import run_ppo
from hybridrl.trainer.ppo.roles import Role


class RecordingTrainer(my_algo.NormTrainer):
    def _update_actor(self, batch, metrics, timing):
        super()._update_actor(batch, metrics, timing)
        shards = self.workers.actor_rollout.actor_param_sq_norm()
        with open("shards.jsonl", "a") as f:
            f.write(json.dumps({"driver": os.getpid(), "shards": shards}) + "\\n")


with initialize_config_module("hybridrl.trainer.config", version_base=None):
    config = compose("ppo_trainer", overrides=["trainer.backend=ray", *sys.argv[1:]])
run_ppo(config, role_worker_mapping={Role.ActorRollout: my_algo.NormWorker}, trainer_cls=RecordingTrainer)
"""


def _initial_norm() -> float:
    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.models.hf import build_hf_model

    model = build_hf_model(ModelConfig(path=resolve_model_path("builtin:tiny", "path")))
    return math.sqrt(sum(float(p.detach().float().square().sum()) for p in model.parameters()))


@pytest.mark.slow
def test_custom_worker_and_trainer_example(tmp_path):
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "my_algo.py").write_text(_doc_example())
    (user_dir / "run_recording.py").write_text(RECORDING)
    cmd = [
        sys.executable,
        str(user_dir / "run_recording.py"),
        f"trainer.default_local_dir={tmp_path}/ckpt",
        *SMALL,
    ]
    driver = _run(cmd, tmp_path, user_dir).pid
    calls = [json.loads(line) for line in (tmp_path / "shards.jsonl").read_text().splitlines()]
    assert len(calls) == 2
    for call in calls:
        assert call["driver"] == driver
        assert sorted(s["rank"] for s in call["shards"]) == [0, 1]
        pids = {s["pid"] for s in call["shards"]}
        assert len(pids) == 2 and driver not in pids  # the new method ran in the two Ray workers
    norms = [row["user/actor_param_norm"] for row in _metrics(tmp_path)]
    assert len(norms) == 2 and norms[0] != norms[1]  # the stage ran each step, after the update
    # both shards together are the whole actor: its norm moves by no more than two small updates
    assert norms[0] == pytest.approx(_initial_norm(), rel=1e-4)
