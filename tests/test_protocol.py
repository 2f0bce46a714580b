"""Tests for hybridrl.protocol (DataProto, DataProtoFuture). Fast, CPU only."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridrl.protocol import (
    DataProto,
    DataProtoFuture,
    DataProtoItem,
    collate_fn,
    pad_dataproto_to_divisor,
    union_tensor_dict,
    unpad_dataproto,
)


def make(n: int = 4, meta: dict | None = None) -> DataProto:
    """Row i has obs = [10i, 10i+1], act = i, prompt = 'p{i}', uid = i (as object)."""
    return DataProto.from_dict(
        tensors={
            "obs": torch.stack([torch.arange(10 * i, 10 * i + 2) for i in range(n)]),
            "act": torch.arange(n),
        },
        non_tensors={"prompt": [f"p{i}" for i in range(n)], "uid": np.arange(n)},
        meta_info=meta if meta is not None else {"temperature": 1.0},
    )


def rows(data: DataProto) -> list[int]:
    """The row identities (the `act` column) in order."""
    return data.batch["act"].tolist()


def assert_object_arrays(data: DataProto) -> None:
    for key, value in data.non_tensor_batch.items():
        assert isinstance(value, np.ndarray) and value.dtype == object, key
        assert value.shape[0] == len(data), key


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    keys = set(a.batch.keys(include_nested=True, leaves_only=True))
    assert keys == set(b.batch.keys(include_nested=True, leaves_only=True))
    for key in keys:
        assert a.batch[key].dtype == b.batch[key].dtype
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key
    assert_object_arrays(a)
    assert_object_arrays(b)


# ---- construction ----------------------------------------------------------------------------
def test_from_dict_and_len():
    d = make(3)
    assert len(d) == 3
    assert d.batch.batch_size == torch.Size([3])
    assert d.non_tensor_batch["prompt"].tolist() == ["p0", "p1", "p2"]
    assert_object_arrays(d)  # uid was an int64 numpy array, stored as object
    assert d.meta_info == {"temperature": 1.0}


def test_from_dict_without_tensors_and_empty():
    d = DataProto.from_dict(non_tensors={"x": ["a", "b"]})
    assert d.batch is None and len(d) == 2
    assert len(DataProto()) == 0


def test_list_of_equal_length_lists_stays_one_dim():
    d = DataProto.from_dict(non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]]})
    assert d.non_tensor_batch["pairs"].shape == (3,)
    assert d.non_tensor_batch["pairs"][1] == [3, 4]


def test_from_dict_rejects_mismatched_batch_sizes():
    with pytest.raises(ValueError, match="dim 0"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"\['s'\] has 2 rows but the batch has 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"s": ["x", "y"]})
    with pytest.raises(TypeError, match="non_tensors"):
        DataProto.from_dict({"a": [1, 2]})


def test_from_single_dict_splits_tensors_and_others():
    d = DataProto.from_single_dict(
        {"ids": torch.ones(2, 3), "text": np.array(["a", "b"]), "gt": ["1", "2"]}, meta_info={"k": 1}
    )
    assert list(d.batch.keys()) == ["ids"]
    assert set(d.non_tensor_batch) == {"text", "gt"}
    assert d.non_tensor_batch["text"].tolist() == ["a", "b"]
    assert_object_arrays(d)
    assert d.meta_info == {"k": 1}


def test_check_consistency_catches_bad_direct_construction():
    td = TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3])
    with pytest.raises(ValueError, match="one batch dim"):
        DataProto(batch=td)
    with pytest.raises(TypeError, match="meta_info"):
        DataProto(non_tensor_batch={"s": ["x"]}, meta_info=1.0)


# ---- key operations --------------------------------------------------------------------------
def test_select_keys_and_deepcopy():
    d = make(3, meta={"m": [1], "n": 2})
    s = d.select(batch_keys=["act"], non_tensor_batch_keys=["prompt"], meta_info_keys=["m"])
    assert list(s.batch.keys()) == ["act"]
    assert list(s.non_tensor_batch) == ["prompt"]
    assert s.meta_info == {"m": [1]}
    assert s.batch["act"].data_ptr() == d.batch["act"].data_ptr()  # tensors are shared
    assert s.meta_info["m"] is d.meta_info["m"]
    deep = d.select(meta_info_keys=["m"], deepcopy=True)
    assert deep.meta_info["m"] == [1] and deep.meta_info["m"] is not d.meta_info["m"]
    assert set(d.select().batch.keys()) == {"obs", "act"}
    with pytest.raises(KeyError, match="nope"):
        d.select(non_tensor_batch_keys=["nope"])


def test_pop_removes_and_returns():
    d = make(3, meta={"a": 1, "b": 2})
    p = d.pop(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(p.batch.keys()) == ["obs"] and len(p) == 3
    assert list(p.non_tensor_batch) == ["uid"] and p.meta_info == {"a": 1}
    assert list(d.batch.keys()) == ["act"]
    assert list(d.non_tensor_batch) == ["prompt"] and d.meta_info == {"b": 2}
    with pytest.raises(KeyError, match="obs"):
        d.pop(batch_keys=["obs"])


def test_rename_batch_and_non_tensor_keys():
    d = make(2)
    out = d.rename(["obs", "prompt"], ["observation", "raw_prompt"])
    assert out is d
    assert set(d.batch.keys()) == {"observation", "act"}
    assert set(d.non_tensor_batch) == {"raw_prompt", "uid"}
    d.rename("act", "action")
    assert "action" in d.batch.keys()
    with pytest.raises(KeyError, match="missing"):
        d.rename("missing", "x")


def test_union_merges_and_accepts_equal_overlap():
    d = make(3)
    other = DataProto.from_dict(
        {"act": torch.arange(3), "reward": torch.tensor([0.5, 1.0, 0.0])},
        {"gt": ["a", "b", "c"], "prompt": ["p0", "p1", "p2"]},
        {"temperature": 1.0, "step": 7},
    )
    out = d.union(other)
    assert out is d
    assert set(d.batch.keys()) == {"obs", "act", "reward"}
    assert d.non_tensor_batch["gt"].tolist() == ["a", "b", "c"]
    assert d.meta_info == {"temperature": 1.0, "step": 7}
    assert_object_arrays(d)


@pytest.mark.parametrize(
    "other, key",
    [
        (DataProto.from_dict({"act": torch.tensor([0, 1, 9])}), "act"),
        (DataProto.from_dict(non_tensors={"prompt": ["p0", "p1", "X"]}), "prompt"),
        (DataProto.from_dict(meta_info={"temperature": 0.5}), "temperature"),
    ],
)
def test_union_conflict_raises_naming_key(other, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        make(3).union(other)


def test_union_length_mismatch_and_union_tensor_dict():
    with pytest.raises(ValueError, match="lengths differ"):
        make(3).union(make(2))
    a = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    b = TensorDict({"y": torch.zeros(2)}, batch_size=[2])
    assert set(union_tensor_dict(a, b).keys()) == {"x", "y"}
    with pytest.raises(ValueError, match="batch sizes differ"):
        union_tensor_dict(a, TensorDict({"z": torch.zeros(3)}, batch_size=[3]))


# ---- row operations --------------------------------------------------------------------------
def test_select_idxs_variants():
    d = make(5)
    assert rows(d.select_idxs([4, 0, 2])) == [4, 0, 2]
    assert rows(d.select_idxs(np.array([1, 3]))) == [1, 3]
    assert rows(d.select_idxs(torch.tensor([3, 3]))) == [3, 3]
    mask = np.array([True, False, True, False, True])
    m = d.select_idxs(mask)
    assert rows(m) == [0, 2, 4]
    assert m.non_tensor_batch["prompt"].tolist() == ["p0", "p2", "p4"]
    assert rows(d.select_idxs(torch.from_numpy(mask))) == [0, 2, 4]
    assert_object_arrays(m)
    assert len(d.select_idxs([])) == 0
    with pytest.raises(IndexError, match="mask has length 2"):
        d.select_idxs([True, False])
    with pytest.raises(IndexError, match="out of range"):
        d.select_idxs([5])


def test_slice_and_getitem_variants():
    d = make(6)
    assert rows(d.slice(1, 5, 2)) == [1, 3]
    assert rows(d[2:4]) == [2, 3]
    assert rows(d[::-1]) == [5, 4, 3, 2, 1, 0]
    assert rows(d[[5, 1]]) == [5, 1]
    assert rows(d[np.array([0, 0])]) == [0, 0]
    assert rows(d[torch.tensor([2])]) == [2]
    item = d[3]
    assert isinstance(item, DataProtoItem)
    assert item.batch.batch_size == torch.Size([])
    assert item.batch["obs"].tolist() == [30, 31]
    assert item.non_tensor_batch == {"prompt": "p3", "uid": 3}
    assert d[-1].non_tensor_batch["prompt"] == "p5"
    assert d[np.int64(2)].batch["act"].item() == 2
    with pytest.raises(IndexError):
        d[6]
    assert [it.non_tensor_batch["prompt"] for it in d] == [f"p{i}" for i in range(6)]


def test_chunk_concat_round_trip_and_indivisible_error():
    d = make(6)
    pieces = d.chunk(3)
    assert [rows(p) for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert all(p.meta_info == d.meta_info for p in pieces)
    assert_same(DataProto.concat(pieces), d)
    with pytest.raises(ValueError, match="not divisible by chunks=4.*pad_dataproto_to_divisor"):
        d.chunk(4)


def test_split_last_piece_smaller_and_round_trip():
    d = make(7)
    pieces = d.split(3)
    assert [rows(p) for p in pieces] == [[0, 1, 2], [3, 4, 5], [6]]
    assert_same(DataProto.concat(pieces), d)


def test_chunk_and_concat_without_tensor_batch():
    d = DataProto.from_dict(non_tensors={"s": list("abcd")})
    pieces = d.chunk(2)
    assert [p.non_tensor_batch["s"].tolist() for p in pieces] == [["a", "b"], ["c", "d"]]
    back = DataProto.concat(pieces)
    assert back.batch is None and back.non_tensor_batch["s"].tolist() == list("abcd")


def test_concat_merges_metrics_into_dict_of_lists():
    a = make(2, meta={"metrics": {"loss": 1.0, "kl": 0.1}, "step": 3})
    b = make(2, meta={"metrics": [{"loss": 2.0}, {"loss": 3.0, "kl": 0.2}], "step": 99})
    c = make(2, meta={"metrics": {"loss": [4.0, 5.0]}, "extra": True})
    out = DataProto.concat([a, b, c])
    assert out.meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0, 4.0, 5.0], "kl": [0.1, 0.2]}
    assert out.meta_info["step"] == 3  # non-metric meta_info from the first piece
    assert out.meta_info["extra"] is True
    assert len(out) == 6


def test_concat_errors():
    with pytest.raises(ValueError, match="empty"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="keys differ"):
        DataProto.concat([make(2), make(2).select(non_tensor_batch_keys=["uid"])])


def test_repeat_interleave_and_tile():
    d = make(3)
    inter = d.repeat(2, interleave=True)
    assert rows(inter) == [0, 0, 1, 1, 2, 2]
    assert inter.non_tensor_batch["prompt"].tolist() == ["p0", "p0", "p1", "p1", "p2", "p2"]
    tiled = d.repeat(3, interleave=False)
    assert rows(tiled) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert tiled.non_tensor_batch["prompt"].tolist() == ["p0", "p1", "p2"] * 3
    assert tiled.batch["obs"][4].tolist() == [10, 11]
    assert_object_arrays(inter)
    assert_object_arrays(tiled)


def test_reorder_in_place():
    d = make(4)
    assert d.reorder(torch.tensor([2, 0, 3, 1])) is None
    assert rows(d) == [2, 0, 3, 1]
    assert d.non_tensor_batch["prompt"].tolist() == ["p2", "p0", "p3", "p1"]
    assert_object_arrays(d)


def test_make_iterator_order_without_shuffle():
    d = make(5)
    got = [rows(mb) for mb in d.make_iterator(mini_batch_size=2, epochs=2)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    dropped = [rows(mb) for mb in d.make_iterator(2, 1, dataloader_kwargs={"drop_last": True})]
    assert dropped == [[0, 1], [2, 3]]


def test_make_iterator_shuffle_is_deterministic_with_seed():
    d = make(8, meta={"epoch_tag": "x"})
    kw = {"shuffle": True}
    first = [rows(mb) for mb in d.make_iterator(4, epochs=3, seed=1, dataloader_kwargs=kw)]
    again = [rows(mb) for mb in d.make_iterator(4, epochs=3, seed=1, dataloader_kwargs=kw)]
    other = [rows(mb) for mb in d.make_iterator(4, epochs=3, seed=2, dataloader_kwargs=kw)]
    assert first == again
    assert first != other
    assert len(first) == 6
    for epoch in range(3):  # each epoch is a permutation of all rows
        assert sorted(first[2 * epoch] + first[2 * epoch + 1]) == list(range(8))
    assert first[0:2] != first[2:4]  # a fresh permutation per epoch
    mb = next(d.make_iterator(4, 1, seed=1, dataloader_kwargs=kw))
    assert mb.meta_info == {"epoch_tag": "x"}
    assert mb.non_tensor_batch["prompt"].tolist() == [f"p{i}" for i in rows(mb)]
    with pytest.raises(ValueError, match="num_workers"):
        d.make_iterator(4, 1, dataloader_kwargs={"num_workers": 2})


# ---- padding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n, pad, expected_rows", [(2, 2, [0, 1, 0, 1]), (3, 1, [0, 1, 2, 0]), (7, 1, None)])
def test_pad_and_unpad(n, pad, expected_rows):
    d = make(n)
    padded, pad_size = pad_dataproto_to_divisor(d, 4)
    assert pad_size == pad
    assert len(padded) % 4 == 0
    if expected_rows is not None:
        assert rows(padded) == expected_rows
    else:
        assert rows(padded) == list(range(7)) + [0]
    assert_object_arrays(padded)
    assert len(padded.chunk(4)) == 4
    assert_same(unpad_dataproto(padded, pad_size), d)


def test_pad_cycles_when_pad_longer_than_data_and_no_pad_needed():
    padded, pad_size = pad_dataproto_to_divisor(make(1), 4)
    assert pad_size == 3 and rows(padded) == [0, 0, 0, 0]
    d = make(8)
    same, zero = pad_dataproto_to_divisor(d, 4)
    assert zero == 0 and same is d
    assert unpad_dataproto(d, 0) is d


# ---- devices, persistence, pickling ----------------------------------------------------------
def test_to_device_returns_self():
    d = make(2)
    assert d.to("cpu") is d
    assert d.batch["obs"].device.type == "cpu"


def test_save_and_load_round_trip(tmp_path):
    d = make(5, meta={"metrics": {"a": [1.0]}})
    d.batch["f"] = torch.randn(5, 3).to(torch.bfloat16)
    d.batch["mask"] = torch.tensor([True, False, True, True, False])
    path = str(tmp_path / "batch.pkl")
    d.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    assert_same(back, d)
    assert back.meta_info == d.meta_info


def test_pickle_round_trip_keeps_dtypes_and_views_are_packed():
    d = make(4)
    d.batch["bf16"] = torch.randn(4, 2, 3).to(torch.bfloat16)
    d.batch["f32_view"] = torch.randn(4, 6)[:, ::2]  # non-contiguous view
    nested = TensorDict({"inner": torch.arange(4.0)}, batch_size=[4])
    d.batch["group"] = nested
    back = pickle.loads(pickle.dumps(d))
    assert_same(back, d)
    assert torch.equal(back.batch["group", "inner"], torch.arange(4.0))
    back.batch["act"][0] = 100  # unpickled tensors are writable and independent
    assert d.batch["act"][0] == 0


def test_pickle_carries_tensors_as_few_large_buffers():
    d = DataProto.from_dict({"ids": torch.randint(0, 1000, (256, 1024))}, {"p": ["x"] * 256})
    buffers: list = []
    payload = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1  # one out-of-band buffer for the one tensor
    assert buffers[0].raw().nbytes == 256 * 1024 * 8
    assert len(payload) < 10_000  # no per-row Python objects for the tensor data
    back = pickle.loads(payload, buffers=buffers)
    assert torch.equal(back.batch["ids"], d.batch["ids"])


def test_collate_fn_stacks_items():
    d = make(3, meta={"k": 1})
    out = collate_fn([d[2], d[0]])
    assert rows(out) == [2, 0]
    assert out.batch["obs"].tolist() == [[20, 21], [0, 1]]
    assert out.non_tensor_batch["prompt"].tolist() == ["p2", "p0"]
    assert out.meta_info == {"k": 1}
    assert_object_arrays(out)


def test_size_report():
    d = make(4)
    tensor_bytes, non_tensor_bytes = d.get_size_bytes()
    assert tensor_bytes == 4 * 2 * 8 + 4 * 8
    assert non_tensor_bytes > 0
    assert "4 rows" in d.print_size()


def test_module_executes_with_ray_unimportable(monkeypatch):
    # Run a fresh copy of the module while `import ray` would fail: any top-level ray import raises.
    import hybridrl.protocol as protocol

    monkeypatch.setitem(sys.modules, "ray", None)
    spec = importlib.util.spec_from_file_location("_protocol_without_ray", protocol.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up here
    spec.loader.exec_module(module)
    assert len(module.DataProto.concat(module.DataProto.from_dict({"a": torch.ones(2)}).chunk(2))) == 2
    with pytest.raises(ImportError):
        module.DataProtoFuture.concat([]).get()  # ray is imported only here


# ---- DataProtoFuture -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = pytest.importorskip("ray")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if ray.is_initialized():  # left running by another test module
        ray.shutdown()
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": repo}},
    )
    yield ray
    ray.shutdown()


def test_data_proto_future_concat_chunk_and_remote_consumer(ray_local):
    ray = ray_local

    # remote functions use only hybridrl names: the test module itself is not importable on workers
    @ray.remote(num_cpus=1)
    def produce(start: int, n: int) -> DataProto:
        return DataProto.from_dict(
            {"act": torch.arange(start, start + n)},
            {"prompt": [f"p{i}" for i in range(start, start + n)]},
            {"metrics": {"rows": n}},
        )

    @ray.remote(num_cpus=1)
    def consume(future: DataProtoFuture) -> list[int]:
        # the worker resolves only its own chunk; the driver never holds the data
        data = future.get()
        return data.batch["act"].tolist() + [len(data.non_tensor_batch["prompt"])]

    refs = [produce.remote(0, 4), produce.remote(4, 2)]
    future = DataProtoFuture.concat(refs)
    whole = future.get()
    assert rows(whole) == list(range(6))
    assert whole.non_tensor_batch["prompt"].tolist() == [f"p{i}" for i in range(6)]
    assert whole.meta_info["metrics"] == {"rows": [4, 2]}
    assert_object_arrays(whole)

    parts = future.chunk(3)
    assert len(parts) == 3
    assert [rows(p.get()) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert ray.get([consume.remote(p) for p in parts]) == [[0, 1, 2], [2, 3, 2], [4, 5, 2]]
    with pytest.raises(ValueError, match="already a chunk"):
        parts[0].chunk(2)

    # a 2 MiB batch goes through the shared-memory object store; the result must be writable
    big = DataProto.from_dict({"ids": torch.arange(256 * 1024).reshape(256, 1024)})
    back = ray.get(ray.put(big))
    back.batch["ids"][0, 0] = -1
    assert back.batch["ids"][0, 0] == -1 and big.batch["ids"][0, 0] == 0
    assert torch.equal(back.batch["ids"][1:], big.batch["ids"][1:])
