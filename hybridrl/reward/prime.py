"""The `prime` reward manager: rule scoring in a pool of worker processes, with per-sample timeouts.

Named after PRIME (Cui et al. 2025), whose reward scoring runs math verifiers in parallel processes
because a single verifier call can hang. Each sample is scored with
`compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from hybridrl.reward.manager import (
    RewardManager,
    RewardSample,
    describe_sample,
    register_reward_manager,
    reward_fn_error,
)
from hybridrl.utils import plugins

__all__ = ["PrimeRewardManager"]

logger = logging.getLogger(__name__)


class _SampleTimeout(BaseException):
    """Raised by SIGALRM inside a pool worker. BaseException, so `except Exception` can't swallow it."""


_WORKER_FN: Callable | None = None


def _init_worker(payload: bytes, env: dict[str, str] | None = None) -> None:
    import cloudpickle

    os.environ.update(env or {})
    plugins.import_worker_libs()  # the run's model.external_lib modules, before the score function loads
    global _WORKER_FN
    _WORKER_FN = cloudpickle.loads(payload)


def _warm() -> int:
    """A short task (run on every pool process before any scoring): its process id."""
    time.sleep(0.05)
    return os.getpid()


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _SampleTimeout()


def _score_in_worker(kwargs: dict[str, Any], timeout: float | None) -> tuple[str, Any]:
    """Runs in a pool process: ("ok", result) or ("timeout", None)."""
    use_alarm = bool(timeout) and threading.current_thread() is threading.main_thread()
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return "ok", _WORKER_FN(**kwargs)
    except _SampleTimeout:
        return "timeout", None
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@register_reward_manager("prime")
class PrimeRewardManager(RewardManager):
    """Naive scoring spread over `num_workers` processes, each sample limited to `timeout` seconds.

    The pool is created on the first call and reused. The score function travels to the workers
    with cloudpickle, so closures and functions loaded from a file work with any start method.
    A sample that runs past `timeout` is interrupted (SIGALRM in the worker; a worker stuck in C
    code is killed after a batch deadline), scores 0, is logged with its index, and counted:
    extras "reward/timed_out" (per sample) and "reward/timeout_count" (the batch total on every
    row, so a mean over the batch reads as the count).

    Args:
        num_workers: pool processes.
        timeout: seconds per sample; None or 0 disables the limit.
        mp_start_method: "forkserver" (default where available: the pool processes fork from a clean
            server process that has imported this module once, not from the multi-threaded driver)
            | "fork" | "spawn".

    The pool is started (and one process warmed up) before the first batch's deadline begins, so
    the start of a fresh forkserver (it imports torch) never counts against a sample's timeout.
    """

    deadline_grace_s: float = 30.0  # added to the batch deadline before stuck workers are killed
    warmup_timeout_s: float = 300.0  # starting the pool (a fresh forkserver imports torch)

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        num_workers: int = 4,
        timeout: float | None = 30.0,
        mp_start_method: str | None = None,
        **reward_kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **reward_kwargs)
        if int(num_workers) < 1:
            raise ValueError(f"prime reward manager: num_workers must be >= 1, got {num_workers}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"prime reward manager: timeout must be >= 0 seconds (0 = none), got {timeout}")
        methods = multiprocessing.get_all_start_methods()
        default = next(m for m in ("forkserver", "fork", *methods) if m in methods)
        self.mp_start_method = mp_start_method or default
        if self.mp_start_method not in methods:
            raise ValueError(
                f"prime reward manager: mp_start_method {self.mp_start_method!r} not in {methods}"
            )
        self.num_workers = int(num_workers)
        self.timeout = float(timeout) if timeout else None
        self._pool: cf.ProcessPoolExecutor | None = None
        self._timed_out: list[bool] = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None  # a pool cannot travel; the copy makes its own
        return state

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            import cloudpickle

            payload = cloudpickle.dumps(self.compute_score)
            ctx = multiprocessing.get_context(self.mp_start_method)
            if self.mp_start_method == "forkserver":  # the server imports this module (and torch) once
                ctx.set_forkserver_preload([__name__])
            pool = cf.ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=ctx,
                initializer=_init_worker,
                initargs=(payload, plugins.worker_env()),
            )
            self._warm_up(pool)
            self._pool = pool
        return self._pool

    def _warm_up(self, pool: cf.ProcessPoolExecutor) -> None:
        """Run short tasks until every pool process has started and run its initializer."""
        seen: set[int] = set()
        deadline = time.monotonic() + self.warmup_timeout_s
        while len(seen) < self.num_workers:
            left = deadline - time.monotonic()
            done, late = cf.wait([pool.submit(_warm) for _ in range(self.num_workers)], timeout=max(left, 0))
            seen.update(f.result() for f in done)
            if late or time.monotonic() > deadline:
                pool.shutdown(wait=False, cancel_futures=True)
                raise RuntimeError(
                    f"prime reward manager: {self.num_workers} pool processes ({self.mp_start_method}) did not "
                    f"all start within {self.warmup_timeout_s:g} s"
                )

    def close(self) -> None:
        """Stop the worker processes (killing any still busy)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join(timeout=5)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def score_samples(self, samples: list[RewardSample]) -> list[Any]:
        pool = self._get_pool()
        futures = []
        for s in samples:
            kwargs = dict(
                data_source=s.data_source,
                solution_str=s.response,
                ground_truth=s.ground_truth,
                extra_info=s.extra_info,
                **self.reward_kwargs,
            )
            futures.append(pool.submit(_score_in_worker, kwargs, self.timeout))
        deadline = None
        if self.timeout:  # every worker interrupts its own sample; this catches workers stuck in C code
            deadline = self.timeout * math.ceil(len(samples) / self.num_workers) + self.deadline_grace_s
        # timeout=0 / None (no per-sample limit): no deadline here, the caller's
        # trainer.reward_timeout_s (RewardWithDeadline) bounds the whole call
        _, not_done = cf.wait(futures, timeout=deadline)
        if not_done:
            self.close()
        results, timed_out = [], []
        try:
            for sample, future in zip(samples, futures):
                status, value = self._collect(sample, future, future in not_done)
                results.append(value if status == "ok" else 0.0)
                timed_out.append(status == "timeout")
                if status == "timeout":
                    logger.warning(
                        "prime reward: scoring timed out after %.1fs and counts as 0: %s",
                        self.timeout,
                        describe_sample(sample),
                    )
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        self._timed_out = timed_out
        return results

    def _collect(self, sample: RewardSample, future: cf.Future, stuck: bool) -> tuple[str, Any]:
        if stuck:
            return "timeout", None
        try:
            return future.result()
        except _SampleTimeout:
            return "timeout", None
        except cf.BrokenExecutor as e:
            self.close()
            raise RuntimeError(
                f"prime reward: a worker process died or failed to start while scoring ({describe_sample(sample)}); "
                "the score function may crash the interpreter or run out of memory, or (with "
                f"mp_start_method={self.mp_start_method!r}) fail to load in a fresh process"
            ) from e
        except Exception as e:
            raise reward_fn_error(self.compute_score, e, sample) from e

    def batch_extra_info(self, n: int) -> dict[str, list]:
        count = sum(self._timed_out)
        return {"reward/timed_out": list(self._timed_out), "reward/timeout_count": [count] * n}
