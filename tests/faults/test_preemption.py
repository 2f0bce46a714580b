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


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["sigterm", "sigusr1"])
def test_a_signal_from_outside_on_the_ray_backend(tmp_path, signum):
    """`python -m hybridrl.trainer.main_ppo` on the Ray backend, signalled from outside once step 1
    is logged: exit 128 + signal within the grace period, a checkpoint of the last completed step,
    and the same command resumes to the uninterrupted run's numbers."""
    import json
    import time

    from tests.e2e.ppo_runs import SMALL, read_metrics
    from tests.e2e.test_resume import _finish, _launch

    args = [*SMALL, "trainer.total_training_steps=3", "trainer.save_freq=10", "trainer.test_freq=-1"]
    args += ["trainer.backend=ray"]
    _finish(_launch(tmp_path / "a_ckpt", tmp_path / "a_logs", args))
    full = _by_step(r for r in read_metrics(tmp_path / "a_logs" / "metrics.jsonl") if "actor/pg_loss" in r)

    ckpt, logs = tmp_path / "b_ckpt", tmp_path / "b_logs"
    proc = _launch(ckpt, logs, args)
    deadline = time.time() + 400
    while not any("actor/pg_loss" in json.loads(line) for line in _lines(logs / "metrics.jsonl")):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    sent = time.monotonic()
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    text = out.decode(errors="replace")
    print({"signal": signal.Signals(signum).name, "exit_s": round(took, 2), "code": proc.returncode})
    assert proc.returncode == 128 + signum, text[-6000:]
    assert took < 25, text[-3000:]
    saved = ck.latest_pointer(str(ckpt))
    assert saved in (1, 2) and ck.verify(ck.step_dir(str(ckpt), saved)) is None, text[-3000:]
    assert f"saved {ck.step_dir(str(ckpt), saved)}" in text

    _finish(_launch(ckpt, tmp_path / "c_logs", args))
    resumed = _by_step(r for r in read_metrics(tmp_path / "c_logs" / "metrics.jsonl") if "actor/pg_loss" in r)
    assert sorted(resumed) == list(range(saved + 1, 4))
    for step, row in resumed.items():
        assert row == full[step], (step, row, full[step])


def _lines(path):
    try:
        with open(path) as f:
            return [line for line in f if line.strip()]
    except FileNotFoundError:
        return []
