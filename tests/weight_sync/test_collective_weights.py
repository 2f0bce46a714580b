"""The collective weight-update group (hybridrl/weight_sync/collective.py): a real TCPStore and a
real ProcessGroupGloo between threads of this process (each member its own group rank), no Ray."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from hybridrl.weight_sync.buckets import pack_bucket, unpack_bucket
from hybridrl.weight_sync.collective import (
    MODE_KEY,
    TIMEOUT_KEY,
    GroupSpec,
    WeightGroup,
    WeightReceiver,
    open_store,
)


def named_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("layers.0.q.weight", torch.randn(3, 5, generator=g)),
        ("step", torch.tensor(3, dtype=torch.int64)),
        ("mask", torch.rand(4, generator=g) > 0.5),
    ]


def test_pack_and_unpack_are_exact_for_every_dtype_and_shape():
    bucket = named_tensors(0)
    buf, table = pack_bucket(bucket, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and all(off % 64 == 0 for *_, off in table)
    out = unpack_bucket(buf, table)
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def start_group(n_receivers: int, timeout_s: float = 20.0):
    """(sender, [receivers]): group rank 0 in this thread, the others joined from threads."""
    store, host, port = open_store(1 + n_receivers, timeout_s)
    spec = GroupSpec(host, port, 1 + n_receivers, "gloo", timeout_s)
    members: dict[int, WeightGroup] = {}
    threads = [
        threading.Thread(target=lambda r=r: members.__setitem__(r, WeightGroup(spec, r, who=f"receiver {r}")))
        for r in range(1, 1 + n_receivers)
    ]
    for t in threads:
        t.start()
    sender = WeightGroup(spec, 0, store=store, who="trainer rank 0")
    for t in threads:
        t.join()
    return sender, [members[r] for r in sorted(members)]


def test_two_updates_reach_every_receiver_bit_for_bit_in_small_buckets():
    sender, receivers = start_group(2)
    stagers = [WeightReceiver(r) for r in receivers]
    try:
        for version in (3, 4):
            sent = named_tensors(version)
            stats = sender.send(iter(sent), version, bucket_bytes=64)  # several buckets
            assert stats["buckets"] >= 4
            for s in stagers:
                got = list(s.take(version))
                assert [n for n, _ in got] == [n for n, _ in sent]
                for (_, a), (_, b) in zip(sent, got):
                    assert a.dtype == b.dtype and torch.equal(a, b)
    finally:
        for s in stagers:
            s.close()


def test_a_late_load_gets_its_own_version_and_older_ones_are_dropped():
    sender, (receiver,) = start_group(1)
    stager = WeightReceiver(receiver)
    try:
        for version in (1, 2, 3):
            sender.send(iter(named_tensors(version)), version, bucket_bytes=1 << 20)
        deadline = time.monotonic() + 10
        while len(stager._staged) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = dict(stager.take(2))
        assert torch.equal(got["embed.weight"], dict(named_tensors(2))["embed.weight"])
        assert sorted(stager._staged) == [3]  # 1 dropped, 3 kept for the next load
    finally:
        stager.close()


def test_a_version_that_never_comes_times_out_naming_the_key():
    sender, (receiver,) = start_group(1, timeout_s=1.0)
    stager = WeightReceiver(receiver)
    try:
        with pytest.raises(TimeoutError, match=TIMEOUT_KEY):
            stager.take(7)
    finally:
        stager.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_that_cannot_reach_the_group_fails_naming_both_keys():
    spec = GroupSpec("127.0.0.1", free_port(), 2, "gloo", 1.0)  # nobody listens there
    with pytest.raises(RuntimeError, match=f"{MODE_KEY}=collective: rollout worker 0 could not join") as err:
        WeightGroup(spec, 1, who="rollout worker 0")
    assert TIMEOUT_KEY in str(err.value) and f"{MODE_KEY}=object_store" in str(err.value)


def test_a_member_missing_at_the_rendezvous_fails_the_sender_naming_the_key():
    store, host, port = open_store(2, 1.0)
    spec = GroupSpec(host, port, 2, "gloo", 1.0)
    with pytest.raises(RuntimeError, match=TIMEOUT_KEY):
        WeightGroup(spec, 0, store=store, who="trainer rank 0")  # rank 1 never joins


def test_recycled_staging_buffers_carry_the_next_update_exactly():
    sender, (receiver,) = start_group(1)
    stager = WeightReceiver(receiver)
    try:
        sender.send(iter(named_tensors(1)), 1, bucket_bytes=1 << 20)
        first = dict(stager.take(1))
        ptr = first["embed.weight"].untyped_storage().data_ptr()
        stager.recycle(1)  # the engine has copied version 1
        sender.send(iter(named_tensors(2)), 2, bucket_bytes=1 << 20)
        second = dict(stager.take(2))
        assert second["embed.weight"].untyped_storage().data_ptr() == ptr  # the same buffer again
        for name, t in named_tensors(2):
            assert torch.equal(second[name], t), name
    finally:
        stager.close()
