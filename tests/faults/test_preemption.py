"""Save on preemption: SIGTERM / SIGUSR1 mid-step, a checkpoint of the last completed step, exit
128 + signal, and the same command resumes to the numbers of an uninterrupted run.

The runs use the in-process backend (the worker lives in the driver process), so the signal is
delivered to the process that trains; it is sent from inside a chosen stage of step 2 (the reward
stage: before the updates, the step is abandoned; the actor update: the step is finished).
"""

from __future__ import annotations

import os
import signal

import pytest

from hybridrl.trainer.ppo.trainer import RayPPOTrainer
from hybridrl.utils import checkpointing as ck
from tests.faults.test_checkpoint_runs import BASE, _run

ARGS = [*BASE, "trainer.total_training_steps=3", "trainer.save_freq=10"]
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"]


def _signal_in(monkeypatch, stage: str, signum: int, at_step: int = 2) -> None:
    """Send `signum` to this process while `stage` of step `at_step` runs."""
    original = getattr(RayPPOTrainer, stage)

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.global_steps == at_step:
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(RayPPOTrainer, stage, wrapped)


def _by_step(rows):
    return {r["step"]: {k: r[k] for k in COMPARED if k in r} for r in rows}


@pytest.mark.parametrize(
    ("signum", "stage", "saved"),
    [
        (signal.SIGUSR1, "_compute_reward", 1),
        pytest.param(signal.SIGTERM, "_update_actor", 2, marks=pytest.mark.slow),
    ],
    ids=["sigusr1-before-update", "sigterm-during-update"],
)
def test_preempted_run_saves_and_resumes_exactly(tmp_path, monkeypatch, capsys, signum, stage, saved):
    full = _by_step(_run(tmp_path / "a", "logs", ARGS))
    assert sorted(full) == [1, 2, 3]

    with monkeypatch.context() as m:
        _signal_in(m, stage, signum)
        with pytest.raises(SystemExit) as exited:
            _run(tmp_path / "b", "logs", ARGS)
    assert exited.value.code == 128 + signum
    err = capsys.readouterr().err
    root = str(tmp_path / "b" / "ckpt")
    assert ck.list_checkpoints(root) == [saved] and ck.latest_pointer(root) == saved
    assert ck.verify(ck.step_dir(root, saved)) is None
    assert f"saved {ck.step_dir(root, saved)}" in err and "exiting" in err, err[-2000:]
    assert not os.path.exists(os.path.join(root, "run.lock"))  # released on the way out

    resumed = _by_step(_run(tmp_path / "b", "logs_resumed", ARGS))
    assert sorted(resumed) == list(range(saved + 1, 4))
    for step, row in resumed.items():
        assert row == full[step], (step, row, full[step])


def test_grace_zero_exits_at_once_without_saving(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        _signal_in(m, "_update_actor", signal.SIGTERM)
        with pytest.raises(SystemExit) as exited:
            _run(tmp_path, "logs", [*ARGS, "trainer.preemption_grace_s=0"])
    assert exited.value.code == 143
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == []


@pytest.mark.slow
def test_a_save_past_the_grace_period_is_abandoned_and_the_last_good_one_kept(tmp_path, monkeypatch, capsys):
    finalize = ck.finalize

    def slow_finalize(root, step):
        if step == 2:
            import time

            time.sleep(30)  # the alarm ends it first
        return finalize(root, step)

    with monkeypatch.context() as m:
        _signal_in(m, "_update_actor", signal.SIGTERM)
        m.setattr(ck, "finalize", slow_finalize)
        with pytest.raises(SystemExit) as exited:
            _run(tmp_path, "logs", [*ARGS, "trainer.save_freq=1", "trainer.preemption_grace_s=1"])
    assert exited.value.code == 143
    root = str(tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert "grace period" in err and f"Newest checkpoint: {ck.step_dir(root, 1)}" in err, err[-2000:]
    assert ck.list_checkpoints(root) == [1] and ck.verify(ck.step_dir(root, 1)) is None
    rows = _run(tmp_path, "logs_resumed", ARGS)  # the half-written step 2 is cleared, step 1 resumes
    assert [r["step"] for r in rows] == [2, 3]


def test_esi_expiry_close_saves_every_step(tmp_path, monkeypatch, capsys):
    import time

    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 3600))
    _run(tmp_path, "logs", [*ARGS, "trainer.esi_redundant_time=4000"])
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == [1, 2, 3]  # save_freq=10 alone: only step 3
    assert "the instance expires in" in capsys.readouterr().out
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 3600))
    _run(tmp_path / "far", "logs", [*ARGS, "trainer.esi_redundant_time=0"])
    assert ck.list_checkpoints(str(tmp_path / "far" / "ckpt")) == [3]
