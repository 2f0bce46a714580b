"""The weight-update group's metadata cannot carry code: a real TCPStore and real group members
(threads of this process); values written into the store by someone other than trainer rank 0
are refused with an error naming the store, and nothing in them runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hybridrl.weight_sync import wire
from hybridrl.weight_sync.buckets import pack_bucket
from hybridrl.weight_sync.collective import MODE_KEY, WeightReceiver
from tests.weight_sync.test_collective_weights import named_tensors, start_group


class _Touch:
    """A pickle that creates a file when it is loaded (what an attacker's value would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _crafted(path) -> bytes:
    return pickle.dumps(_Touch(str(path)))


def test_the_crafted_value_runs_code_when_unpickled(tmp_path):
    """The payload the next tests write is live: pickle.loads (what the store's reader used to
    do) runs it."""
    pickle.loads(_crafted(tmp_path / "ran"))
    assert (tmp_path / "ran").is_dir()


def test_a_pickle_in_place_of_an_update_head_is_refused_not_run(tmp_path):
    sender, (receiver,) = start_group(1)
    marker = tmp_path / "ran"
    sender.meta.set("0/head", _crafted(marker))
    with pytest.raises(wire.WeightMetadataError) as err:
        receiver.receive()
    msg = str(err.value)
    assert f"{MODE_KEY}=collective: receiver 1 refused the weight metadata" in msg
    assert f"{receiver.spec.host}:{receiver.spec.port}" in msg and "0/head: not JSON" in msg
    assert not marker.exists()


def test_a_pickle_in_place_of_a_bucket_table_fails_the_load_with_the_refusal(tmp_path):
    """A forged table after a genuine head: the receiver thread stops, and the worker's load of
    that version raises the refusal (the engine never sees a tensor)."""
    sender, (receiver,) = start_group(1)
    stager = WeightReceiver(receiver)
    marker = tmp_path / "ran"
    try:
        sender.meta.set("0/0", _crafted(marker))  # the table is read before any transfer
        sender.meta.set("0/head", wire.encode_head(5, 1, False))
        with pytest.raises(
            RuntimeError, match="receiving version 5 failed.*refused the weight metadata.*0/0: not JSON"
        ):
            stager.take(5)
        assert not marker.exists()
    finally:
        stager.close()


@pytest.mark.parametrize(
    "value, why",
    [
        ({"version": 1, "tp": 1}, "fields"),
        ({"version": "1", "tp": 1, "sharded": False}, "version must be an integer"),
        ({"version": 1, "tp": 0, "sharded": False}, "tp must be an integer in"),
        ({"version": 1, "tp": 1, "sharded": 1}, "sharded must be true or false"),
        ({"version": True, "tp": 1, "sharded": False}, "version must be an integer"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_heads_of_the_wrong_shape_are_refused(value, why):
    import json

    with pytest.raises(wire.WeightMetadataError, match=why):
        wire.decode_head(json.dumps(value).encode(), "0/head")


@pytest.mark.parametrize(
    "row, nbytes, why",
    [
        (["w", "load", [2], 0], 64, "dtype 'load' is not one of"),  # a torch attribute that is not a dtype
        (["w", "float32", [4], 0], 8, "does not fit"),  # 16 bytes in an 8-byte bucket
        (["w", "float32", [1], 8], 64, "does not fit an aligned place"),  # misaligned
        (["w", "float32", [-1], 0], 64, "must be an integer"),
        ([7, "float32", [1], 0], 64, "the name must be a string"),
        (["w", "float32", [1]], 64, r"must be \[name, dtype, shape, offset\]"),
    ],
)
def test_bucket_tables_that_do_not_describe_the_bucket_are_refused(row, nbytes, why):
    import json

    raw = json.dumps({"table": [row], "nbytes": nbytes}).encode()
    with pytest.raises(wire.WeightMetadataError, match=why):
        wire.decode_bucket(raw, "0/0")


def test_a_table_round_trips_with_its_tp_places():
    bucket = [(n, t) for n, t in named_tensors(0)]
    buf, table = pack_bucket(bucket, torch.device("cpu"))
    places = {0: ((14, 5), 0, 7)}  # row 0 is rows [7, 14) of a (14, 5) tensor
    got = wire.decode_bucket(wire.encode_bucket(table, buf.numel(), places), "0/0")
    assert got == {"table": table, "nbytes": buf.numel(), "places": places}
    assert wire.decode_bucket(wire.encode_end(), "0/1") is None
    with pytest.raises(wire.WeightMetadataError, match="does not fit"):
        wire.decode_bucket(wire.encode_bucket(table, buf.numel(), {0: ((10, 5), 0, 7)}), "0/0")
