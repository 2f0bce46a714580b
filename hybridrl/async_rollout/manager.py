"""AsyncRolloutManager: feeds rollout workers from a prompt queue while the trainer trains.

The flow (AReaL's rollout controller, docs/async.md draws it)::

    submit(prompts) -> pending deque (unbounded, never blocks)
        -> commit: staleness gate (StalenessManager.capacity) -> input queue (bounded, queue_size)
        -> dispatch: chunks of whole groups to idle rollout workers (generation runs concurrently
           on every worker)
        -> collect: finished groups -> output queue (bounded, queue_size). A full output queue
           never drops or raises: finished groups wait in a small spill list and no new chunk is
           dispatched until they fit (back-pressure on generation).
        -> wait_batch(): drains the output queue into the results dict and returns a batch
           chosen by the consumer rule (`select_batch`), so the staleness bound is hard.

One background thread runs commit / dispatch / collect; the trainer's thread calls `submit`,
`publish`, `wait_batch` and `generate_now`. Weights: `publish(version, ref)` sends
`load_weights(ref, version)` to every live worker at once; Ray runs an actor's calls in order,
so a chunk already generating finishes with its old weights and the next chunk uses the new
ones ("finish the chunk, then update": no generation is aborted). Every group is tagged with the
version its chunk was generated with.

Partial rollout (`partial_rollout=True`) and DAPO dynamic sampling (`group_filter`): see
docs/async.md. In short, `publish` also aborts older generations; unfinished groups return to the
front of the queue with their prefixes and keep their first (oldest-token) version; rejected
groups are dropped and un-committed, and `wait_batch(refill=...)` lets the trainer replace them.

An optional `postprocess(chunk) -> chunk` runs on every finished chunk in the background thread,
before its groups are queued: the trainer scores rule-based rewards there, so reward computation
overlaps training instead of sitting on the trainer's path (AReaL scores inside its rollout
workflow). An exception there stops the loop and is raised by the next `wait_batch`.

A worker that dies (RayActorError) is dropped; the groups of its unfinished chunk go back to the
front of the queue and are generated again by the live workers, with their original uids. Results
already collected are never lost, and a chunk's results are taken at most once, so no group is
duplicated. When no worker is left, `wait_batch` raises a RuntimeError naming the cause.

Worker contract (hybridrl.workers.engine_workers.ActorRolloutRefWorker(role='rollout', disaggregated=True) implements it):
``load_weights(payload, version) -> float`` and ``generate_sequences(prompts) -> DataProto`` whose
rows keep the input order and non-tensor data and carry ``meta_info["policy_version"]`` and
``meta_info["worker_busy_s"]`` (cumulative busy seconds).

Its records (groups, workers, chunks, the batch) are in records.py, the splitting of a finished
chunk in chunks.py, the weight loads in flight in weight_loads.py.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from hybridrl.async_rollout.chunks import keep_groups, split_unfinished
from hybridrl.async_rollout.padding import concat_left_padded
from hybridrl.async_rollout.records import (
    GEN_KEYS,
    AsyncBatch,
    Chunk,
    Group,
    RolloutWorkersLostError,
    WorkerState,
    hung_error,
)
from hybridrl.async_rollout.staleness import (
    StalenessManager,
    select_batch,
    staleness_metrics,
    token_version_metrics,
)
from hybridrl.async_rollout.tp_engine import EngineHandle, call_failure, worker_label
from hybridrl.async_rollout.weight_loads import WeightLoads
from hybridrl.protocol import DataProto
from hybridrl.rollout.resume import chunk_partial_columns
from hybridrl.utils import deadlines

__all__ = ["AsyncBatch", "AsyncRolloutManager", "RolloutWorkersLostError"]


class AsyncRolloutManager:
    """Drive rollout workers asynchronously under a staleness bound.

    Args:
        workers: rollout actor handles (see the worker contract in the module docstring).
        rollout_n: responses per prompt (the group size).
        consumer_batch_size: B, groups per trainer batch.
        max_head_offpolicyness: eta >= 0; 0 is synchronous training.
        max_concurrent_rollouts: most groups committed but not finished.
        queue_size: bound of the input and output queues (in groups).
        chunk_size: groups per generate call on one worker.
        poll_s: how long the background loop waits for results in one round.
        postprocess: applied to each finished chunk (all its rows, prompt data included) in the
            background thread, e.g. reward scoring; must keep the rows and their order.
        partial_rollout: abort generations at a weight update and continue them from their
            prefix (the workers must have `abort_generation`, see the module docstring).
        group_filter: DAPO dynamic sampling: (rows of a postprocessed chunk) -> (rows,) bool keep
            mask, whole groups kept or dropped.
        max_dropped_per_batch: with group_filter, raise when more groups than this were dropped
            while one batch was being formed (None: no limit).
    """

    def __init__(
        self,
        workers: list[Any],
        *,
        rollout_n: int,
        consumer_batch_size: int,
        max_head_offpolicyness: int,
        max_concurrent_rollouts: int,
        queue_size: int,
        chunk_size: int,
        poll_s: float = 0.02,
        postprocess: Callable[[DataProto], DataProto] | None = None,
        partial_rollout: bool = False,
        group_filter: Callable[[DataProto], Any] | None = None,
        max_dropped_per_batch: int | None = None,
    ) -> None:
        if not workers:
            raise ValueError("AsyncRolloutManager needs at least one rollout worker")
        for name, value in (("rollout_n", rollout_n), ("queue_size", queue_size), ("chunk_size", chunk_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.rollout_n = rollout_n
        self.batch_size = consumer_batch_size
        self.eta = max_head_offpolicyness
        self.max_concurrent = max_concurrent_rollouts
        self.chunk_size = chunk_size
        self.poll_s = poll_s
        self.postprocess = postprocess
        self.partial_rollout = partial_rollout
        self.group_filter = group_filter
        self.max_dropped_per_batch = max_dropped_per_batch
        self._dropped_since_batch = 0
        self._dropped_total = 0
        self._aborts_sent = 0
        self._resumed_groups = 0  # groups sent back to the queue with a prefix
        self._postprocess_s = 0.0  # seconds spent in postprocess since the last batch
        self._workers = [WorkerState(rank, h) for rank, h in enumerate(workers)]
        self._pending: collections.deque[Group] = collections.deque()
        self._input: queue.Queue[Group] = queue.Queue(maxsize=queue_size)
        self._retry: collections.deque[Group] = collections.deque()  # groups of dead workers' chunks
        self._inflight: dict[Any, Chunk] = {}
        self._spill: collections.deque[Group] = collections.deque()
        self._output: queue.Queue[Group] = queue.Queue(maxsize=queue_size)
        self._results: dict[int, Group] = {}
        self._outstanding: dict[int, Group] = {}  # committed, not consumed
        self._loads = WeightLoads()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._seq = 0
        self._version = -1
        self._weights: Any = None
        self.staleness: StalenessManager | None = None
        self._last_batch_time = 0.0
        self._worker_failures = 0
        self._requeued_groups = 0
        self._backpressure_waits = 0  # rounds in which finished groups found the output queue full
        self._dispatched_chunks = 0

    # ------------------------------------------------------------------ trainer API
    def start(self, version: int, weights: Any) -> None:
        """Load `weights` (an ObjectRef of the publish payload) of `version` and start the loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncRolloutManager.start called twice")
        self.staleness = StalenessManager(
            self.batch_size, self.eta, self.max_concurrent, start_version=version
        )
        self._seq = version * self.batch_size  # group numbers continue across a resume
        self.publish(version, weights)
        self._last_batch_time = time.perf_counter()
        for w in self._workers:
            w.busy_s_at_batch = w.busy_s
        self._thread = threading.Thread(target=self._run, name="hybridrl-async-rollout", daemon=True)
        self._thread.start()

    def submit(self, prompts: DataProto) -> None:
        """Queue prompts (one group each); rows need a unique non-tensor "uid". Never blocks."""
        self._require_started()
        if "uid" not in prompts.non_tensor_batch:
            raise KeyError(
                "AsyncRolloutManager.submit: prompts need a non-tensor 'uid' per row (the group id)"
            )
        with self._lock:
            for i in range(len(prompts)):
                row = prompts.slice(i, i + 1)
                self._pending.append(Group(self._seq, str(row.non_tensor_batch["uid"][0]), row))
                self._seq += 1
        self._wake.set()

    def publish(self, version: int, weights: Any) -> None:
        """New policy weights: every live worker loads them after its current chunk."""
        with self._lock:
            if version < self._version:
                raise ValueError(f"publish: version {version} is older than the current {self._version}")
            self._version, self._weights = version, weights
            for w in self._workers:
                if w.alive:
                    self._send_weights(w)
            if self.partial_rollout:
                self._abort_older(version)
        self._wake.set()

    def wait_batch(
        self, timeout_s: float | None = None, refill: Callable[[], None] | None = None
    ) -> AsyncBatch:
        """Block until batch k (k = the published version) can be formed; return it.

        `refill` is called on every round of the wait (the trainer's thread): with a group filter
        dropped groups must be replaced by new prompts."""
        self._require_started()
        t0 = time.perf_counter()
        k = self.staleness.batch_index
        if k != self._version:
            raise RuntimeError(
                f"wait_batch: batch {k} is trained at version {k}, but the published version is {self._version}; "
                "call publish(version=k) after every update (one publish per trainer step)"
            )
        while True:
            self._raise_if_failed()
            self._check_dropped(k)
            if refill is not None:
                refill()
            self._drain_output()
            with self._lock:
                picked = self._try_select(k)
            if picked is not None:
                break
            if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(
                    f"wait_batch: batch {k} not ready after {timeout_s:.1f} s ({self.stats()})"
                )
            try:
                g = self._output.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            with self._lock:
                self._results[g.seq] = g
        wait_s = time.perf_counter() - t0
        return self._make_batch(k, picked, wait_s)

    def generate_now(self, prompts: DataProto) -> DataProto:
        """Generate `prompts` on a live worker with the latest published weights (validation)."""
        self._require_started()
        while True:
            self._raise_if_failed()
            with self._lock:
                alive = [w for w in self._workers if w.alive]
                if not alive:
                    raise RolloutWorkersLostError("generate_now: no rollout worker is alive")
                w = min(alive, key=lambda x: (x.busy, x.rank))
                ref = w.handle.generate_sequences.remote(prompts)
            try:
                out = ray.get(ref, timeout=deadlines.step_timeout())
            except GetTimeoutError:
                raise hung_error(
                    w.rank, "generate_sequences (generate_now)", deadlines.step_timeout()
                ) from None
            except RayError as err:
                dead, why = call_failure(w.handle, err)
                if dead:
                    self._mark_dead(w, why, "the request goes to another worker")
                    continue
                raise RuntimeError(
                    f"{worker_label(w.handle, w.rank)} failed in generate_now: {why}"
                ) from None
            out.meta_info.pop("worker_busy_s", None)
            return out

    def num_unconsumed(self) -> int:
        """Groups submitted but not yet handed to the trainer (pending + committed)."""
        with self._lock:
            return len(self._pending) + len(self._outstanding)

    def stats(self) -> dict[str, float]:
        """Queue depths and counters (async/queue/*, async/*)."""
        with self._lock:
            alive = [w for w in self._workers if w.alive]
            return {
                "async/queue/pending": float(len(self._pending)),
                "async/queue/input": float(self._input.qsize() + len(self._retry)),
                "async/queue/output": float(self._output.qsize() + len(self._spill)),
                "async/queue/results": float(len(self._results)),
                "async/running": float(self.staleness.running if self.staleness else 0),
                "async/inflight_chunks": float(len(self._inflight)),
                "async/dispatched_chunks": float(self._dispatched_chunks),
                "async/rollout_workers_alive": float(len(alive)),
                "async/worker_failures": float(self._worker_failures),
                "async/requeued_groups": float(self._requeued_groups),
                **(
                    {
                        "async/partial/aborts_sent": float(self._aborts_sent),
                        "async/partial/resumed_groups": float(self._resumed_groups),
                    }
                    if self.partial_rollout
                    else {}
                ),
                "async/output_backpressure_waits": float(self._backpressure_waits),
                "async/version": float(self._version),
                "async/version_lag": float(
                    self._version - min((c.version for c in self._inflight.values()), default=self._version)
                ),
            }

    def stop(self) -> None:
        """Stop the background loop (in-flight generations are left to finish or die with the workers)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def seed_index(self, seq: int) -> int:
        """Sampling seed index of a chunk starting at group `seq`: the synchronous trainer's
        `step * 1000 + i` when chunks are whole batches (seq // B is the batch it belongs to in
        commit order), unique per chunk, and the same after a resume."""
        b = self.batch_size
        return (seq // b + 1) * 1000 + seq % b if b < 1000 else 10**8 + seq

    # ------------------------------------------------------------------ consumer helpers
    def _require_started(self) -> None:
        if self._thread is None or self.staleness is None:
            raise RuntimeError("AsyncRolloutManager: call start(version, weights) first")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain_output(self) -> None:
        while True:
            try:
                g = self._output.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._results[g.seq] = g

    def _deadline(self, g: Group) -> int:
        return (g.version if g.version >= 0 else g.commit_version) + self.eta

    def _try_select(self, k: int) -> list[Group] | None:
        finished = [(seq, self._deadline(g)) for seq, g in self._results.items()]
        unfinished = [self._deadline(g) for seq, g in self._outstanding.items() if seq not in self._results]
        keys = select_batch(finished, unfinished, k, self.batch_size)
        if keys is None:
            return None
        picked = [self._results.pop(seq) for seq in keys]
        for g in picked:
            del self._outstanding[g.seq]
        self.staleness.on_consume(len(picked))
        return picked

    def _make_batch(self, k: int, picked: list[Group], wait_s: float) -> AsyncBatch:
        versions = [g.version for g in picked]
        staleness = [k - v for v in versions]
        data = concat_left_padded([g.result for g in picked])
        metrics = staleness_metrics(staleness, self.eta)
        if "rollout_versions" in data.batch.keys():
            metrics.update(token_version_metrics(data.batch["rollout_versions"], k))
        metrics.update(self.stats())
        now = time.perf_counter()
        with self._lock:
            alive = [w for w in self._workers if w.alive]
            busy = sum(w.busy_s - w.busy_s_at_batch for w in alive)
            for w in self._workers:
                w.busy_s_at_batch = w.busy_s
        span = max(now - self._last_batch_time, 1e-9) * max(len(alive), 1)
        self._last_batch_time = now
        metrics["async/rollout_idle_frac"] = min(max(1.0 - busy / span, 0.0), 1.0)
        metrics["async/rollout_busy_s"] = busy
        metrics["async/train_wait_s"] = wait_s
        loads = self._loads.take_seconds()  # load_weights calls finished since the last batch
        if loads:
            metrics["async/weight_update/load_s"] = max(loads)
        if self.group_filter is not None:
            with self._lock:
                metrics["async/filtered_groups"], self._dropped_since_batch = self._dropped_since_batch, 0
        if self.postprocess is not None:
            with self._lock:
                metrics["async/postprocess_s"], self._postprocess_s = self._postprocess_s, 0.0
        return AsyncBatch(data, versions, staleness, metrics)

    # ------------------------------------------------------------------ background loop
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._check_weight_loads()
                self._commit()
                self._flush_spill()
                self._dispatch()
                self._collect()
        except BaseException as err:  # surfaced to the trainer by wait_batch / generate_now
            self._error = err

    def _commit(self) -> None:
        """Pending deque -> input queue, as far as the staleness gate and the queue allow."""
        with self._lock:
            cap = self.staleness.capacity(self._version)
            while cap > 0 and self._pending:
                g = self._pending[0]
                try:
                    self._input.put_nowait(g)
                except queue.Full:
                    return
                self._pending.popleft()
                g.commit_version = self._version
                self._outstanding[g.seq] = g
                self.staleness.on_commit(1)
                cap -= 1

    def _take_chunk(self) -> list[Group]:
        groups: list[Group] = []
        while self._retry and len(groups) < self.chunk_size:
            groups.append(self._retry.popleft())
        while len(groups) < self.chunk_size:
            try:
                groups.append(self._input.get_nowait())
            except queue.Empty:
                break
        return groups

    def _dispatch(self) -> None:
        """Input queue -> idle workers, one chunk each (none while finished groups wait for room)."""
        with self._lock:
            if self._spill:
                return
            for w in self._workers:
                if not w.alive or w.busy:
                    continue
                groups = self._take_chunk()
                if not groups:
                    return
                if w.version != self._version:
                    self._send_weights(w)
                batch = concat_left_padded([g.prompt for g in groups]).repeat(self.rollout_n, interleave=True)
                gen_in = batch.select(batch_keys=list(GEN_KEYS))
                gen_in.meta_info["seed_index"] = self.seed_index(groups[0].seq)
                if self.partial_rollout:
                    self._add_partial_columns(gen_in, groups)
                batch.pop(batch_keys=list(GEN_KEYS))
                for g in groups:
                    if g.partial is None:  # a resumed group keeps the version of its oldest token
                        g.version = self._version
                ref = w.handle.generate_sequences.remote(gen_in)
                self._inflight[ref] = Chunk(w, groups, batch, self._version)
                w.busy = True
                self._dispatched_chunks += 1

    def _collect(self) -> None:
        """Finished chunks -> spill -> output queue; failed chunks -> retry queue."""
        refs = list(self._inflight)
        if not refs:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            return
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.poll_s)
        if ready and len(refs) > 1:  # take every chunk that is done, not only the first
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        self._check_deadline(set(ready))
        for ref in ready:
            with self._lock:
                chunk = self._inflight.pop(ref)
                chunk.worker.busy = False
            try:
                out = ray.get(ref)  # ready (ray.wait above): does not wait
            except RayError as err:  # a TP engine's failure is its first failing rank's (tp_engine.py)
                dead, why = call_failure(chunk.worker.handle, err)
                if dead:
                    self._requeue(chunk)
                    self._mark_dead(chunk.worker, why, "its chunk is re-queued")
                    continue
                raise RuntimeError(
                    f"{worker_label(chunk.worker.handle, chunk.worker.rank)} raised in generate_sequences "
                    f"(version {chunk.version}):\n{why}"
                ) from None
            self._finish(chunk, out)

    def _check_deadline(self, ready: set) -> None:
        """A chunk in flight for longer than trainer.step_timeout_s: its worker is hung."""
        limit, now = deadlines.step_timeout(), time.monotonic()
        with self._lock:
            late = [c for r, c in self._inflight.items() if r not in ready and now - c.started >= limit]
        if late:
            raise hung_error(
                late[0].worker.rank, f"generate_sequences (version {late[0].version})", now - late[0].started
            )

    def _finish(self, chunk: Chunk, out: DataProto) -> None:
        got = out.meta_info.get("policy_version")
        if got != chunk.version:
            raise RuntimeError(
                f"rollout worker {chunk.worker.rank} generated with version {got}, expected {chunk.version}: "
                "a weight update was lost or reordered"
            )
        busy = out.meta_info.get("worker_busy_s")
        out.meta_info = {}
        if self.partial_rollout:
            chunk, out = self._split_unfinished(chunk, out)
            if not chunk.groups:
                with self._lock:
                    if busy is not None:
                        chunk.worker.busy_s = float(busy)
                return
        full = chunk.rest.union(out)
        if self.postprocess is not None:
            t0 = time.perf_counter()
            full = self.postprocess(full)
            if len(full) != len(chunk.groups) * self.rollout_n:
                raise RuntimeError(
                    f"postprocess returned {len(full)} rows for a chunk of {len(chunk.groups) * self.rollout_n}; "
                    "it must keep every row in order"
                )
            with self._lock:
                self._postprocess_s += time.perf_counter() - t0
        if self.group_filter is not None:
            chunk, full = self._drop_filtered(chunk, full)
        n = self.rollout_n
        with self._lock:
            if busy is not None:
                chunk.worker.busy_s = float(busy)
            for i, g in enumerate(chunk.groups):
                rows = full.slice(i * n, (i + 1) * n)
                uids = set(rows.non_tensor_batch["uid"].tolist())
                if uids != {g.uid}:
                    raise RuntimeError(
                        f"rows {i * n}..{(i + 1) * n} of a chunk carry uids {uids}, expected {g.uid}"
                    )
                g.result = rows
                self._spill.append(g)
            self.staleness.on_finish(len(chunk.groups))

    def _flush_spill(self) -> None:
        with self._lock:
            while self._spill:
                try:
                    self._output.put_nowait(self._spill[0])
                except queue.Full:
                    self._backpressure_waits += 1
                    return
                self._spill.popleft()

    def _requeue(self, chunk: Chunk) -> None:
        with self._lock:
            self._retry.extendleft(reversed(chunk.groups))
            self._requeued_groups += len(chunk.groups)

    # ------------------------------------------------------------------ workers
    def _abort_older(self, version: int) -> None:
        """Ask every worker generating with a version < `version` to stop once the weights exist."""
        ready = [self._weights] if isinstance(self._weights, ray.ObjectRef) else None
        for chunk in self._inflight.values():
            if chunk.version < version and chunk.worker.alive:
                chunk.worker.handle.abort_generation.remote(version, ready)
                self._aborts_sent += 1

    def _send_weights(self, w: WorkerState) -> None:
        self._loads.send(w, self._weights, self._version)

    def _check_weight_loads(self) -> None:
        for w, err in self._loads.poll():
            self._mark_dead(w, err, "it failed loading the new weights")

    def _mark_dead(self, w: WorkerState, err: BaseException | str, then: str) -> None:
        """Take `w` out of the pool; `then` says what happens to its work (printed)."""
        with self._lock:
            if not w.alive:
                return
            w.alive = False
            w.busy = False
            self._worker_failures += 1
            self._loads.drop(w)
            alive = sum(x.alive for x in self._workers)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        who, what = (
            worker_label(w.handle, w.rank),
            "engines" if isinstance(w.handle, EngineHandle) else "workers",
        )
        print(f"[hybridrl.async] {who} died ({first}); {alive} left; {then}")
        if alive == 0:
            self._error = RolloutWorkersLostError(
                f"all {len(self._workers)} rollout {what} died (last: {who}: {first}). Finished groups "
                "were kept but no generation is possible; restart the run (it resumes from the last checkpoint)."
            )

    # ------------------------------------------------------------------ partial rollout
    def _add_partial_columns(self, gen_in: DataProto, groups: list[Group]) -> None:
        """The resume.PARTIAL_KEYS columns of a chunk: each group's prefixes, or empty ones."""
        gen_in.non_tensor_batch.update(chunk_partial_columns([g.partial for g in groups], self.rollout_n))
        if any(g.partial is not None for g in groups):
            gen_in.meta_info["seed_index"] = 10**9 + self._dispatched_chunks  # a fresh stream

    def _split_unfinished(self, chunk: Chunk, out: DataProto) -> tuple[Chunk, DataProto]:
        """Partial rollout: groups with an unfinished row go back to the front of the queue with
        their prefixes; returns the chunk and output rows of the finished groups."""
        chunk, out, back = split_unfinished(chunk, out, self.rollout_n)
        with self._lock:
            self._retry.extendleft(reversed(back))
            self._resumed_groups += len(back)
        return chunk, out

    # ------------------------------------------------------------------ DAPO dynamic sampling
    def _drop_filtered(self, chunk: Chunk, full: DataProto) -> tuple[Chunk, DataProto]:
        """Drop the groups `group_filter` rejects: they finish and are un-committed (the gate then
        admits a replacement; the bound's invariant counts only groups that can still be trained)."""
        keep = [bool(x) for x in self.group_filter(full)]
        chunk, full, dropped = keep_groups(chunk, full, keep, self.rollout_n)
        if dropped:
            with self._lock:
                for g in dropped:
                    self._outstanding.pop(g.seq, None)
                self.staleness.on_finish(len(dropped))
                self.staleness.on_drop(len(dropped))
                self._dropped_since_batch += len(dropped)
                self._dropped_total += len(dropped)
        return chunk, full

    def _check_dropped(self, k: int) -> None:
        limit = self.max_dropped_per_batch
        if self.group_filter is not None and limit is not None and self._dropped_since_batch > limit:
            raise RuntimeError(
                f"DAPO dynamic sampling: {self._dropped_since_batch} groups were dropped (constant metric) while "
                f"batch {k} was being formed, more than {limit}. Raise algorithm.filter_groups.max_num_gen_batches, "
                "use easier data, or disable algorithm.filter_groups.enable"
            )
