"""main_async: SIGTERM during step 2's actor update finishes and saves step 2 (its numbers those of
an uninterrupted run), exits 143, and the same command resumes at step 3. A second live run on the
same folder is refused before Ray work starts.

Slow (two runs of both worker pools): `python -m pytest tests/async/test_async_preemption.py -m slow`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config, run_async_config
from hybridrl.trainer.async_ppo.trainer import AsyncPPOTrainer
from hybridrl.utils import checkpointing as ck
from hybridrl.utils.run_lock import LOCK_FILE, RunFolderBusy
from tests.e2e.ppo_runs import read_metrics
from tests.faults.test_run_lock import _hold

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("ray_local")]

ARGS = [  # test_async_e2e's small runs, with the file logger and checkpoints
    "data.train_batch_size=4",
    "data.val_max_samples=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "trainer.total_training_steps=3",
    "trainer.val_before_train=false",
    "trainer.progress_bar=false",
    "trainer.make_report=false",
    "trainer.cpus_per_worker=1",
    "trainer.logger=[console,file]",
    "trainer.save_freq=10",  # step 2 is saved only because of the signal
    "trainer.test_freq=-1",
    "async_training.max_head_offpolicyness=0",
]
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"]


def _config(folder):
    os.environ["HYBRIDRL_LOG_DIR"] = str(folder / "logs")
    return load_async_config(compose_async_config([*ARGS, f"trainer.default_local_dir={folder}/ckpt"]))


def _rows(folder) -> dict[int, dict]:
    rows = read_metrics(folder / "logs" / "metrics.jsonl")
    return {r["step"]: {k: r[k] for k in COMPARED if k in r} for r in rows if "actor/pg_loss" in r}


def test_preempted_async_run_saves_and_resumes(tmp_path, monkeypatch, capsys):
    run_async_config(_config(tmp_path / "a"))
    full = _rows(tmp_path / "a")
    assert sorted(full) == [1, 2, 3]

    original = AsyncPPOTrainer._update_actor

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.global_steps == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    with monkeypatch.context() as m:
        m.setattr(AsyncPPOTrainer, "_update_actor", wrapped)
        with pytest.raises(SystemExit) as exited:
            run_async_config(_config(tmp_path / "b"))
    assert exited.value.code == 143
    before = _rows(tmp_path / "b")
    assert sorted(before) == [1, 2] and all(before[k] == full[k] for k in (1, 2)), (before, full)
    root = str(tmp_path / "b" / "ckpt")
    assert ck.list_checkpoints(root) == [2] and ck.verify(ck.step_dir(root, 2)) is None
    assert f"SIGTERM: saved {ck.step_dir(root, 2)}" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(root, LOCK_FILE))

    (tmp_path / "b" / "logs" / "metrics.jsonl").unlink()
    run_async_config(_config(tmp_path / "b"))
    resumed = _rows(tmp_path / "b")
    assert sorted(resumed) == [3]  # resumed from step 2: only step 3 is trained again
    # steps 1-2 before the signal equal the uninterrupted run's (the signal changed nothing); step 3
    # after the resume is not compared: the rollout pool's sampling is not replayed exactly
    assert set(resumed[3]) == set(full[3])


def test_a_second_async_run_on_a_live_runs_folder_is_refused(tmp_path):
    holder = _hold(tmp_path / "ckpt")
    try:
        started = time.monotonic()
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} on host"):
            run_async_config(_config(tmp_path))
        assert time.monotonic() - started < 5
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
