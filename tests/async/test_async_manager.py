"""AsyncRolloutManager with real Ray actors: staleness bound, eta=0, worker death, back-pressure.

The rollout workers here are small Ray actors that follow the worker contract (load_weights,
generate_sequences with version tags) and sleep instead of running a model, so completion order
is random; the manager, its queues, Ray scheduling and actor failures are the real ones.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import ray
import torch

from hybridrl.async_rollout.manager import AsyncRolloutManager, RolloutWorkersLostError
from hybridrl.protocol import DataProto

N = 2  # responses per prompt


@ray.remote(num_cpus=0)
class SleepyRolloutWorker:
    """Contract-following worker: the 'response' is the policy version it generated with."""

    def __init__(self, seed: int, delay: tuple[float, float]) -> None:
        self.configure(seed, delay)

    def configure(self, seed: int, delay: tuple[float, float]) -> None:
        self.rng = random.Random(seed)
        self.delay = delay
        self.version = -1
        self.busy_s = 0.0

    def load_weights(self, payload: dict, version: int) -> float:
        assert payload["version"] == version, (payload, version)
        self.version = version
        return 0.0

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        assert self.version >= 0, "generate before load_weights"
        t = self.rng.uniform(*self.delay)
        time.sleep(t)
        self.busy_s += t
        b = len(prompts)
        out = DataProto.from_dict(
            {"responses": torch.full((b, 1), self.version), "prompts": prompts.batch["input_ids"]},
            non_tensors=dict(prompts.non_tensor_batch),
            meta_info={"policy_version": self.version, "worker_busy_s": self.busy_s},
        )
        out.non_tensor_batch["policy_version"] = np.array([self.version] * b, dtype=object)
        return out


@pytest.fixture(scope="module")
def shared(ray_local):
    """Three workers reused by the tests that do not kill them (actor start-up dominates the time)."""
    workers = [SleepyRolloutWorker.remote(i, (0.0, 0.0)) for i in range(3)]
    ray.get([w.configure.remote(i, (0.0, 0.0)) for i, w in enumerate(workers)])
    return workers


def configured(workers, delay, seed=0):
    ray.get([w.configure.remote(seed + i, delay) for i, w in enumerate(workers)])
    return list(workers)


def prompts(start: int, count: int) -> DataProto:
    ids = torch.arange(start, start + count).unsqueeze(-1)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.zeros_like(ids)},
        non_tensors={"uid": np.array([f"p{i}" for i in range(start, start + count)], dtype=object)},
    )


def weights(version: int):
    return ray.put({"version": version, "weights": []})


def make(workers, batch, eta, **kw):
    args = dict(
        rollout_n=N,
        consumer_batch_size=batch,
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=(eta + 1) * batch,
        queue_size=64,
        chunk_size=1,
        poll_s=0.005,
    )
    args.update(kw)
    return AsyncRolloutManager(workers, **args)


def train(manager, batch, eta, steps, submitted, train_s=0.02, on_step=None):
    """Trainer loop: wait for batch k, check it, 'train', publish version k + 1, top up prompts."""
    consumed: list[list[str]] = []
    for k in range(steps):
        got = manager.wait_batch(timeout_s=60)
        data = got.data
        assert len(data) == batch * N
        rows_v = data.non_tensor_batch["policy_version"].tolist()
        assert rows_v == [v for v in got.versions for _ in range(N)]
        assert data.batch["responses"][:, 0].tolist() == rows_v  # generated with that version
        assert all(k - eta <= v <= k for v in got.versions), (k, got.versions)
        uids = data.non_tensor_batch["uid"].tolist()
        consumed.append(uids[::N])
        assert all(uids[i] == uids[i - i % N] for i in range(len(uids)))  # whole groups
        if on_step:
            on_step(k, got)
        time.sleep(train_s)
        manager.publish(k + 1, weights(k + 1))
        while manager.num_unconsumed() < (eta + 2) * batch:
            manager.submit(prompts(submitted[0], batch))
            submitted[0] += batch
    return consumed


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_staleness_bound_with_out_of_order_workers(shared, eta):
    workers = configured(shared, (0.002, 0.04), seed=eta)
    m = make(workers, batch=4, eta=eta)
    m.start(0, weights(0))
    submitted = [0]
    staleness: list[int] = []
    m.submit(prompts(0, (eta + 2) * 4))
    submitted[0] = (eta + 2) * 4
    consumed = train(
        m, 4, eta, steps=8, submitted=submitted, on_step=lambda k, got: staleness.extend(got.staleness)
    )
    m.stop()
    flat = [u for b in consumed for u in b]
    assert len(flat) == len(set(flat)) == 32
    assert max(staleness) <= eta
    if eta == 0:  # synchronous semantics: batch k = the k-th block of prompts, all from version k
        assert [sorted(b) for b in consumed] == [
            sorted(f"p{i}" for i in range(4 * k, 4 * k + 4)) for k in range(8)
        ]
        assert staleness == [0] * 32
    else:
        assert max(staleness) >= 1  # generation really ran ahead of training


def test_killed_worker_is_dropped_and_its_chunk_regenerated(shared):
    # the victim is slow, so it is surely mid-chunk when it is killed
    victim = SleepyRolloutWorker.remote(9, (0.8, 1.0))
    workers = [victim, *configured(shared[:2], (0.01, 0.05))]
    m = make(workers, batch=4, eta=1, chunk_size=2)
    m.start(0, weights(0))
    submitted = [12]
    m.submit(prompts(0, 12))

    killed = threading.Event()

    def kill_when_busy():
        while not killed.is_set():
            with m._lock:
                busy = any(c.worker.handle is victim for c in m._inflight.values())
            if busy:
                time.sleep(0.1)  # well inside its 0.8-1.0 s chunk
                ray.kill(victim, no_restart=True)
                killed.set()
            time.sleep(0.005)

    def start_killer(k, _got):
        if k == 1:
            threading.Thread(target=kill_when_busy, daemon=True).start()

    consumed = train(m, 4, 1, steps=8, submitted=submitted, on_step=start_killer)
    assert killed.is_set()
    stats = m.stats()
    m.stop()
    assert stats["async/worker_failures"] == 1
    assert stats["async/rollout_workers_alive"] == 2
    assert stats["async/requeued_groups"] >= 1
    flat = [u for b in consumed for u in b]
    assert len(flat) == len(set(flat)) == 32  # nothing duplicated
    # nothing lost: every submitted group is either consumed or still queued / generating
    assert len(flat) + m.num_unconsumed() == submitted[0]


def left_padded_prompts(start: int, count: int, width: int) -> DataProto:
    """prompts(start, count) left-padded to `width` columns (pad id -1, mask 0), as a data loader
    pads each batch to its own longest prompt."""
    p = prompts(start, count)
    pad = width - 1
    p.batch["input_ids"] = torch.cat([torch.full((count, pad), -1), p.batch["input_ids"]], dim=-1)
    p.batch["attention_mask"] = torch.cat(
        [torch.zeros(count, pad, dtype=torch.long), torch.ones(count, 1)], -1
    ).long()
    p.batch["position_ids"] = torch.zeros(count, width, dtype=torch.long)
    return p


def test_groups_with_different_prompt_widths_share_chunks_and_batches(shared):
    # chunk_size 3 does not divide the batch of 4: chunks and batches mix groups of two submits,
    # whose prompts are 1, 2 or 3 columns wide (a partial-rollout chunk resumes old groups with new ones)
    m = make(configured(shared[:1], (0.0, 0.01)), batch=4, eta=1, chunk_size=3)
    m.start(0, weights(0))
    submitted = 0
    for _ in range(3):
        m.submit(left_padded_prompts(submitted, 4, 1 + (submitted // 4) % 3))
        submitted += 4
    mixed = 0
    for k in range(6):
        data = m.wait_batch(timeout_s=60).data
        ids = data.batch["prompts"]  # the worker echoes the (padded) input ids it got
        uids = [int(u[1:]) for u in data.non_tensor_batch["uid"]]
        assert ids[:, -1].tolist() == uids  # every prompt still ends at the right edge
        assert ids.shape[1] >= max(1 + (u // 4) % 3 for u in uids)  # padded to the widest (of its chunk)
        # left-padded: the loader's pad id (-1), or 0 where the rows carry no attention mask to find it
        assert ((ids[:, :-1] == -1) | (ids[:, :-1] == 0)).all()
        mixed += ids.shape[1] > max(1 + (u // 4) % 3 for u in uids)  # a chunk held a wider group
        m.publish(k + 1, weights(k + 1))
        m.submit(left_padded_prompts(submitted, 4, 1 + (submitted // 4) % 3))
        submitted += 4
    m.stop()
    assert mixed >= 1  # some chunk really held groups of two widths


def test_all_workers_dead_raises_a_clear_error(ray_local):
    workers = [SleepyRolloutWorker.remote(0, (0.3, 0.4))]
    m = make(workers, batch=2, eta=0)
    m.start(0, weights(0))
    m.submit(prompts(0, 4))
    time.sleep(0.05)
    for w in workers:
        ray.kill(w, no_restart=True)
    with pytest.raises(RolloutWorkersLostError, match="all 1 rollout workers died"):
        m.wait_batch(timeout_s=30)
    m.stop()


def test_full_output_queue_backpressures_without_losing_groups(shared):
    workers = configured(shared[:1], (0.0, 0.002))
    m = make(workers, batch=4, eta=1, queue_size=1, chunk_size=4)
    m.start(0, weights(0))
    m.submit(prompts(0, 12))
    # the trainer is busy: finished groups pile up behind a queue of size 1 (polled with a deadline
    # rather than one fixed sleep, so a loaded machine's slower workers do not fail it)
    deadline = time.monotonic() + 20
    while m.stats()["async/output_backpressure_waits"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.stats()["async/output_backpressure_waits"] > 0
    consumed = train(m, 4, 1, steps=4, submitted=[12], train_s=0.05)
    m.stop()
    flat = [u for b in consumed for u in b]
    assert len(flat) == len(set(flat)) == 16


def test_wait_batch_requires_one_publish_per_step(shared):
    m = make(configured(shared[:1], (0.0, 0.001)), batch=2, eta=1)
    m.start(0, weights(0))
    m.submit(prompts(0, 8))
    m.wait_batch(timeout_s=30)
    with pytest.raises(RuntimeError, match="call publish"):
        m.wait_batch(timeout_s=1)
    m.stop()


def test_postprocess_scores_every_chunk_in_the_background(shared):
    """The hook sees each finished chunk once (whole groups, rows in order); its output reaches the
    trainer; an exception in it surfaces from wait_batch instead of hanging the loop."""
    seen: list[int] = []

    def score(chunk: DataProto) -> DataProto:
        seen.append(len(chunk))
        chunk.batch["token_level_scores"] = chunk.batch["prompts"].float() * 10
        return chunk

    m = make(configured(shared[:2], (0.0, 0.003)), batch=2, eta=1, chunk_size=1, postprocess=score)
    m.start(0, weights(0))
    m.submit(prompts(0, 6))

    def check(k, got):
        b = got.data.batch
        assert torch.equal(b["token_level_scores"], b["prompts"].float() * 10)
        assert got.metrics["async/postprocess_s"] >= 0

    train(m, 2, 1, steps=3, submitted=[6], on_step=check)
    m.stop()
    assert seen and all(n == N for n in seen)  # one call per chunk of one group

    def broken(chunk: DataProto) -> DataProto:
        raise ValueError("reward function crashed on purpose")

    m = make(configured(shared[:1], (0.0, 0.001)), batch=2, eta=1, postprocess=broken)
    m.start(0, weights(0))
    m.submit(prompts(0, 4))
    with pytest.raises(ValueError, match="crashed on purpose"):
        m.wait_batch(timeout_s=30)
    m.stop()


def _drop_every_third(rows: DataProto) -> np.ndarray:
    """DAPO-style group filter: reject the groups whose prompt number is a multiple of 3."""
    return np.array([int(u[1:]) % 3 != 0 for u in rows.non_tensor_batch["uid"]])


@pytest.mark.parametrize("eta", [0, 2])
def test_dynamic_sampling_waits_for_b_kept_groups_within_the_bound(shared, eta):
    workers = configured(shared, (0.002, 0.03), seed=10 + eta)
    m = make(workers, batch=4, eta=eta, group_filter=_drop_every_third)
    m.start(0, weights(0))
    submitted = [0]

    def refill():
        while m.num_unconsumed() < (eta + 2) * 4:
            m.submit(prompts(submitted[0], 4))
            submitted[0] += 4

    refill()
    consumed, dropped = [], 0
    for k in range(6):
        got = m.wait_batch(timeout_s=60, refill=refill)
        assert len(got.data) == 4 * N and all(k - eta <= v <= k for v in got.versions), (k, got.versions)
        consumed += got.data.non_tensor_batch["uid"].tolist()[::N]
        dropped += got.metrics["async/filtered_groups"]
        m.publish(k + 1, weights(k + 1))
    m.stop()
    assert len(consumed) == len(set(consumed)) == 24
    assert all(int(u[1:]) % 3 != 0 for u in consumed)  # no rejected group is trained
    assert dropped >= 24 // 2 - 1  # about one in three prompts was generated and dropped


def test_dynamic_sampling_stops_when_too_many_groups_are_dropped(shared):
    workers = configured(shared, (0.0, 0.005))
    m = make(
        workers, batch=4, eta=0, group_filter=lambda rows: np.zeros(len(rows), bool), max_dropped_per_batch=8
    )
    m.start(0, weights(0))
    submitted = [0]

    def refill():
        while m.num_unconsumed() < 8:
            m.submit(prompts(submitted[0], 4))
            submitted[0] += 4

    with pytest.raises(RuntimeError, match="DAPO dynamic sampling: .* groups were dropped"):
        m.wait_batch(timeout_s=60, refill=refill)
    m.stop()
