"""BatchingEngine: many trajectories share one rollout engine through a batching queue.

Agent loops are coroutines; each `await engine.generate(ids, ...)` puts one request in a queue.
A single drain task takes the pending requests (waiting `wait_s` after the first one, so that the
other trajectories' requests of the same round arrive), groups them by sampling parameters, and
runs each group as ONE batched call of the engine (`BaseRollout.generate_tokens`, HF or vLLM) in
a worker thread. The event loop is free meanwhile: tool calls of other trajectories run while
the engine generates, and a slow tool never delays a batch (the batch does not wait for it).

One batch runs at a time (one engine per replica). Requests of one group may ask for different
token budgets: the batch generates up to the largest and each result is cut to its own budget
(the tokens it keeps, and their log-probs, are exactly what it would have got alone: sampling is
causal). Sampling seeds: each request brings its own; the HF engine seeds a micro-batch with its
first row's seed, so HF samples depend on how requests were batched (vLLM honours every seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrl.rollout.base import GenerationRequest, SamplingSpec

__all__ = ["BatchingEngine", "RequestLimits", "TokenGeneration"]


@dataclass
class TokenGeneration:
    """One request's new tokens (EOS included when generated) and their log-probs."""

    token_ids: list[int]
    log_probs: list[float] | None


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits of the queue (`sglang_rollout_mode=server`: `rollout.server.*`).

    Attributes:
        timeout_s: seconds a request may take (queued + generating) per attempt; None: no limit.
        max_attempts: tries per request before TimeoutError.
        retry_delay_s: pause between tries.
        max_in_flight: requests submitted at once (others wait their turn); None: no limit.
    """

    timeout_s: float | None = None
    max_attempts: int = 1
    retry_delay_s: float = 0.0
    max_in_flight: int | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingSpec
    seed: int
    max_new_tokens: int
    want_log_probs: bool
    future: asyncio.Future = field(repr=False, default=None)
    multi_modal_inputs: dict[str, Any] | None = None


class BatchingEngine:
    """Async, batched token-in/token-out access to one rollout engine.

    Args:
        rollout: a BaseRollout (anything with `generate_tokens(GenerationRequest)` and `pad_token_id`).
        max_batch_size: most requests in one engine call (rollout.max_num_seqs).
        wait_s: how long to wait for more requests after the first pending one.
    """

    def __init__(
        self,
        rollout: Any,
        max_batch_size: int,
        wait_s: float = 0.002,
        limits: RequestLimits | None = None,
    ) -> None:
        self.rollout = rollout
        self.max_batch_size = max(1, int(max_batch_size))
        self.wait_s = float(wait_s)
        self.limits = limits or RequestLimits()
        self._slots: asyncio.Semaphore | None = None
        self._pending: list[_Request] = []
        self._drain_task: asyncio.Task | None = None
        # the engine thread uses the caller's intra-op thread count (OpenMP's is per thread; vLLM's
        # CPU attention checks that its metadata and kernels agree on it)
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="hybridrl-engine",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self.num_batches = 0
        self.num_requests = 0
        self.num_timeouts = 0
        self.busy_s = 0.0

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        seed: int,
        max_new_tokens: int,
        want_log_probs: bool,
        multi_modal_inputs: dict[str, Any] | None = None,
    ) -> TokenGeneration:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (queued and batched).

        `multi_modal_inputs`: a VLM request's pixel inputs (pixel_values (N, D), image_grid_thw
        (I, 3)) of the images whose tokens `prompt_ids` holds, in order.

        With RequestLimits: at most `max_in_flight` requests at once; a request not answered within
        `timeout_s` is dropped (its queued entry removed, or its running batch's result for it
        discarded) and retried after `retry_delay_s`, `max_attempts` tries in all."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        lim = self.limits
        if lim.max_in_flight is not None and self._slots is None:
            self._slots = asyncio.Semaphore(lim.max_in_flight)
        args = (list(prompt_ids), sampling, int(seed), int(max_new_tokens), bool(want_log_probs))
        async with self._slots if self._slots is not None else contextlib.nullcontext():
            for attempt in range(1, lim.max_attempts + 1):
                future = self._submit(_Request(*args, multi_modal_inputs=multi_modal_inputs))
                if lim.timeout_s is None:
                    return await future
                try:
                    return await asyncio.wait_for(future, lim.timeout_s)
                except asyncio.TimeoutError:
                    self.num_timeouts += 1
                    if attempt < lim.max_attempts:
                        await asyncio.sleep(lim.retry_delay_s)
        raise TimeoutError(
            f"a generation request got no answer within {lim.timeout_s:g}s in {lim.max_attempts} attempts "
            "(actor_rollout_ref.rollout.server.timeout / max_attempts); raise the timeout, or lower "
            "server.max_connections / rollout.max_num_seqs so that one engine batch finishes in time"
        )

    def _submit(self, req: _Request) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        req.future = loop.create_future()
        self._pending.append(req)
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = loop.create_task(self._drain())
        return req.future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.wait_s)
            batch = self._take_group()
            if not batch:
                break
            try:
                results = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, batch)
            except Exception as e:  # the engine failed: every request of the batch fails with it
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r, res in zip(batch, results):
                if not r.future.done():
                    r.future.set_result(res)

    def _take_group(self) -> list[_Request]:
        """The oldest request and up to max_batch_size - 1 others with the same sampling
        (requests whose caller was cancelled, e.g. aborted by over_sample_rate, are dropped)."""
        self._pending = [r for r in self._pending if not r.future.done()]
        if not self._pending:
            return []
        key = (self._pending[0].sampling, self._pending[0].want_log_probs)
        group, rest = [], []
        for r in self._pending:
            if len(group) < self.max_batch_size and (r.sampling, r.want_log_probs) == key:
                group.append(r)
            else:
                rest.append(r)
        self._pending = rest
        return group

    def _run(self, batch: list[_Request]) -> list[TokenGeneration]:
        """One engine call for `batch` (runs in the engine thread)."""
        t0 = time.perf_counter()
        pad = self.rollout.pad_token_id
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids) :] = torch.as_tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids) :] = 1
        request = GenerationRequest(
            input_ids=ids,
            attention_mask=mask,
            prompt_token_ids=[r.prompt_ids for r in batch],
            sampling=batch[0].sampling,
            seeds=[r.seed for r in batch],
            max_new_tokens=max(r.max_new_tokens for r in batch),
            want_log_probs=batch[0].want_log_probs,
            multi_modal_inputs=(
                [r.multi_modal_inputs or {} for r in batch]
                if any(r.multi_modal_inputs for r in batch)
                else None
            ),
        )
        result = self.rollout.generate_tokens(request)
        out = []
        for i, r in enumerate(batch):
            toks = list(result.token_ids[i])[: r.max_new_tokens]
            lps = list(result.log_probs[i])[: len(toks)] if result.log_probs is not None else None
            out.append(TokenGeneration(toks, lps))
        self.num_batches += 1
        self.num_requests += len(batch)
        self.busy_s += time.perf_counter() - t0
        return out

    def metrics(self) -> dict[str, float]:
        return {
            "agent/engine_batches": float(self.num_batches),
            "agent/engine_mean_batch_size": self.num_requests / max(self.num_batches, 1),
            "agent/engine_busy_s": self.busy_s,
            "agent/engine_request_timeouts": float(self.num_timeouts),
        }

    def reset_metrics(self) -> None:
        self.num_batches = self.num_requests = self.num_timeouts = 0
        self.busy_s = 0.0

    def wait_idle(self) -> None:
        """Block until the engine thread has finished its current batch (if any)."""
        # No deadline here: the batch is this process's own generate call (its requests have
        # rollout.server timeouts where set); if it hangs, the worker method that runs this hangs and
        # the driver's wait on it (trainer.step_timeout_s) names this rank and method.
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)
