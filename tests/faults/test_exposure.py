"""Exposure: no secret in a logged config, the embedded Ray on 127.0.0.1 only,
SIGTERM runs the driver's cleanup, and the prime pool is not forked from the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from hybridrl.utils.redact import REDACTED, redact_config
from tests.e2e.ppo_runs import compose_config

HF_TOKEN = "hf_" + "Q" * 34
URL_PASSWORD = "pw-5ecret-9"


def test_redact_config_hides_secrets_and_keeps_the_rest():
    cfg = {
        "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {"WANDB_API_KEY": "abc", "N": 3}}}},
        "sandbox": {"url": f"https://bob:{URL_PASSWORD}@sandbox.example/run?token=t0k&x=1"},
        "hf_token": "plain-secret",
        "api_key": "k-123",
        "tokenizer": {"pad_token": "<pad>", "max_tokens": 7, "token2text": True},
        "data": {"prompt_key": "prompt", "reward_fn_key": "data_source", "path": f"/models/{HF_TOKEN}/x"},
    }
    out = redact_config(cfg)
    assert out["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"] == {
        "WANDB_API_KEY": REDACTED,
        "N": REDACTED,
    }
    assert out["sandbox"]["url"] == f"https://{REDACTED}@sandbox.example/run?token={REDACTED}&x=1"
    assert out["hf_token"] == out["api_key"] == REDACTED
    assert out["tokenizer"] == cfg["tokenizer"]  # not secrets
    assert out["data"]["prompt_key"] == "prompt" and out["data"]["reward_fn_key"] == "data_source"
    assert out["data"]["path"] == f"/models/{REDACTED}/x"
    assert cfg["hf_token"] == "plain-secret"  # the input is not modified


def _score_file(tmp_path, body="return 0.0"):
    path = tmp_path / "score.py"
    path.write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n"
    )
    return str(path)


def test_no_secret_reaches_config_json_or_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from hybridrl.trainer.ppo.launch import run_ppo_config

    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / "logs")
    os.environ["TENSORBOARD_DIR"] = str(tmp_path / "tb")
    try:
        run_ppo_config(
            compose_config(
                [
                    "trainer.backend=local",
                    "trainer.total_training_steps=1",
                    "trainer.logger=[console,file,tensorboard]",
                    f"+ray_kwargs.ray_init.runtime_env.env_vars.HF_TOKEN={HF_TOKEN}",
                    # (only code data sources would call it; the built-in task has none)
                    f"reward_model.sandbox_fusion.url=https://bob:{URL_PASSWORD}@sandbox.example/run",
                ],
                tmp_path,
            )
        )
    finally:
        os.environ.pop("TENSORBOARD_DIR")
    text = (tmp_path / "logs" / "config.json").read_text()
    logged = json.loads(text)
    assert logged["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]["HF_TOKEN"] == REDACTED
    assert logged["reward_model"]["sandbox_fusion"]["url"] == f"https://{REDACTED}@sandbox.example/run"
    events = b"".join(p.read_bytes() for p in Path(tmp_path / "tb").rglob("events.*"))
    assert events and REDACTED.encode() in events
    for secret in (HF_TOKEN, URL_PASSWORD):
        assert secret not in text and secret.encode() not in events


def test_the_embedded_ray_listens_on_127_0_0_1():
    import ray

    from hybridrl.trainer.ppo.launch import start_ray

    if ray.is_initialized():
        ray.shutdown()
    start_ray(1)
    try:
        assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        listening = [c for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.pid in ours]
        assert listening  # the GCS and the raylet at least
        assert {c.laddr.ip.removeprefix("::ffff:") for c in listening} == {"127.0.0.1"}, listening
    finally:
        ray.shutdown()


def test_sigterm_runs_the_drivers_cleanup(tmp_path):
    marker = tmp_path / "scoring"
    body = f"open({str(marker)!r}, 'a').close(); import time; time.sleep(120); return 0.0"
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
            os.environ["HYBRIDRL_LOG_DIR"] = {str(tmp_path / "logs")!r}
            from hybridrl.trainer.ppo.launch import run_ppo_config
            from hybridrl.utils import tracking
            from tests.e2e.ppo_runs import compose_config
            finish = tracking.Tracking.finish
            def finish_and_say(self):
                print("TRACKER-FINISHED", flush=True)
                return finish(self)
            tracking.Tracking.finish = finish_and_say
            run_ppo_config(compose_config(["trainer.backend=local", "trainer.total_training_steps=1",
                "custom_reward_function.path={_score_file(tmp_path, body)}"], {str(tmp_path)!r}))
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached the reward function"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert "[hybridrl] SIGTERM: stopping" in err and "TRACKER-FINISHED" in out


def test_the_prime_pool_does_not_fork_the_driver():
    """The prime reward manager's pool processes start from a forkserver (a clean process), not as
    forks of the multi-threaded driver; its start is outside every scoring deadline."""
    from hybridrl.reward.prime import PrimeRewardManager

    # a builtin as the score function: the pool process imports nothing more to unpickle it
    mgr = PrimeRewardManager(None, 0, compute_score=dict, num_workers=1, timeout=1)
    assert mgr.mp_start_method == "forkserver"
    try:
        parent = mgr._get_pool().submit(os.getppid).result(timeout=60)
    finally:
        mgr.close()
    assert parent != os.getpid()  # a fork of this process would report its pid


@pytest.mark.slow
def test_sigterm_runs_the_sft_cleanup(tmp_path):
    """main_sft as well: SIGTERM during a step closes the tracker and exits 143."""
    marker = tmp_path / "training"
    script = tmp_path / "sft.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
            from hybridrl.trainer.sft import launch, trainer
            from hybridrl.utils import tracking
            finish = tracking.Tracking.finish
            def finish_and_say(self):
                print("TRACKER-FINISHED", flush=True)
                return finish(self)
            tracking.Tracking.finish = finish_and_say
            def hanging_step(self, indices):
                open({str(marker)!r}, "a").close()
                time.sleep(120)
            trainer.SFTTrainer.train_step = hanging_step
            launch.run_sft(["trainer.logger=[console,file]", "trainer.log_dir={tmp_path / "logs"}",
                "trainer.total_training_steps=1", "trainer.val_before_train=false"])
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached its first step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert "[hybridrl] SIGTERM: stopping" in err and "TRACKER-FINISHED" in out
