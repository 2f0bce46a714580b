"""main_sft: SIGTERM / SIGUSR1 mid-step saves that step and exits 128 + signal; the same command
resumes to the uninterrupted run's weights. One writer per run folder: a second live run is refused
at once, a killed run's lock is taken over."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hybridrl.trainer.sft.config import load_sft_config
from hybridrl.trainer.sft.launch import run_sft_config
from hybridrl.trainer.sft.trainer import SFTTrainer
from hybridrl.utils import checkpointing as ck
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.run_lock import LOCK_FILE, RunFolderBusy
from tests.faults.test_run_lock import _hold
from tests.trainer.test_sft import make_trainer, overrides, params, tiny  # noqa: F401 (fixture)

COMMON = {
    "trainer__total_training_steps": 4,
    "optim__lr_warmup_steps_ratio": 0.25,
    "data__train_batch_size": 32,
    "trainer__save_freq": 3,  # step 2 is saved only because of the signal
}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _signal_in_step(monkeypatch, signum: int, at_step: int = 2) -> None:
    """Send `signum` to this process while the optimizer step of `at_step` runs."""
    original = SFTTrainer.train_step

    def wrapped(self, indices):
        if self.global_step + 1 == at_step:
            os.kill(os.getpid(), signum)
        return original(self, indices)

    monkeypatch.setattr(SFTTrainer, "train_step", wrapped)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["sigterm", "sigusr1"])
def test_preempted_sft_saves_the_step_and_resumes_exactly(tiny, tmp_path, monkeypatch, capsys, signum):  # noqa: F811
    straight = make_trainer(overrides(tiny, tmp_path / "a", trainer__resume_mode="disable", **COMMON))
    straight.fit()
    expected = params(straight)
    straight.close()

    config = load_sft_config(overrides(tiny, tmp_path / "b", **COMMON))
    with monkeypatch.context() as m:
        _signal_in_step(m, signum)
        with pytest.raises(SystemExit) as exited:
            run_sft_config(config)
    assert exited.value.code == 128 + signum
    root = str(tmp_path / "b" / "ckpt")
    assert ck.list_checkpoints(root) == [2] and ck.latest_pointer(root) == 2
    err = capsys.readouterr().err
    assert f"{signal.Signals(signum).name}: saved {ck.step_dir(root, 2)}" in err, err[-2000:]
    assert not os.path.exists(os.path.join(root, LOCK_FILE))  # released on the way out

    resumed = make_trainer(overrides(tiny, tmp_path / "b", **COMMON))
    resumed.fit()
    assert resumed.global_step == 4
    got = params(resumed)
    resumed.close()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_sft_without_saves_or_grace_exits_at_once(tiny, tmp_path, monkeypatch):  # noqa: F811
    for extra in ({"trainer__save_freq": -1}, {"trainer__preemption_grace_s": 0}):
        config = load_sft_config(overrides(tiny, tmp_path / str(len(extra)), **{**COMMON, **extra}))
        with monkeypatch.context() as m:
            _signal_in_step(m, signal.SIGTERM)
            with pytest.raises(SystemExit) as exited:
                run_sft_config(config)
        assert exited.value.code == 143
        assert ck.list_checkpoints(str(tmp_path / str(len(extra)) / "ckpt")) == []
    with pytest.raises(ConfigError, match="trainer.preemption_grace_s"):
        load_sft_config(overrides(tiny, tmp_path, trainer__preemption_grace_s=-1))


def test_a_second_sft_run_on_a_live_runs_folder_is_refused(tiny, tmp_path, capsys):  # noqa: F811
    root = tmp_path / "ckpt"
    holder = _hold(root)
    try:
        started = time.monotonic()
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} on host"):
            run_sft_config(load_sft_config(overrides(tiny, tmp_path, **COMMON)))
        assert time.monotonic() - started < 5
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_sft_config(load_sft_config(overrides(tiny, tmp_path, trainer__total_training_steps=1)))
    assert "taking over the lock" in capsys.readouterr().err
    assert ck.list_checkpoints(str(root)) == [] and not (root / LOCK_FILE).exists()
