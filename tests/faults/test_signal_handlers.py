"""ray.init in the driver installs Ray's own SIGTERM handler (exit 1, no cleanup, no save): the entry
points' start_ray puts the driver's SIGTERM / SIGUSR1 handlers back, so main_ppo, main_async and a
Ray-backed start-up keep saving on preemption."""

from __future__ import annotations

import signal

from hybridrl.trainer.ppo.launch import own_signal_handlers, start_ray


def test_start_ray_keeps_the_drivers_signal_handlers():
    import ray

    if ray.is_initialized():
        ray.shutdown()

    def ours(signum, frame):  # pragma: no cover - never delivered
        raise AssertionError

    kept = {s: signal.signal(s, ours) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with own_signal_handlers():
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
            replaced = signal.getsignal(signal.SIGTERM)
        assert replaced is not ours  # what ray.init does to a driver
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGUSR1) is ours
        ray.shutdown()
        start_ray(1)
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGUSR1) is ours
    finally:
        ray.shutdown()
        for s, handler in kept.items():
            signal.signal(s, handler)
