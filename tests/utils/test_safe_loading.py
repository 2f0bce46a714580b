"""Safe loading: checkpoints and DataProto files are read without unpickling arbitrary objects.

Each malicious file below really runs code when unpickled the unsafe way (shown first, with a
marker file), and hybridrl's loader refuses it with a clear message without creating the marker.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from hybridrl.engine.checkpoint import load_checkpoint, save_checkpoint
from hybridrl.protocol import DataProto
from hybridrl.utils.dataproto_io import DataProtoFileError
from hybridrl.utils.safe_io import UnsafeCheckpointError, load_state_file
from hybridrl.utils.torch_utils import get_rng_state, set_rng_state


class Payload:
    """Unpickling this creates the file `marker` (a stand-in for any code an attacker wants run)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_rng_state_is_plain_and_round_trips(tmp_path):
    state = get_rng_state()
    torch.save({"rng": state}, tmp_path / "s.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(load_state_file(tmp_path / "s.pt")["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2]


def test_malicious_checkpoint_is_refused_by_the_engine_loader(tmp_path):
    ckpt = tmp_path / "ckpt"
    module = nn.Linear(2, 2)
    save_checkpoint(str(ckpt), module, contents=["extra"], global_step=3, extra={"rollout_calls": 7})
    assert load_checkpoint(str(ckpt), module, contents=["extra"])["extra"] == {"rollout_calls": 7}

    proof = tmp_path / "proof"
    torch.save({"rng": Payload(str(proof))}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the unsafe way runs the payload
    assert proof.exists()

    marker = tmp_path / "marker"
    torch.save(
        {"rng": Payload(str(marker)), "lr_scheduler": None, "extra": None}, ckpt / "extra_state_rank0.pt"
    )
    with pytest.raises(
        UnsafeCheckpointError, match=r"refusing to load .*extra_state_rank0\.pt.*could run code"
    ):
        load_checkpoint(str(ckpt), module, contents=["extra"])
    assert not marker.exists()


def test_checkpoint_from_before_safe_loading_gets_a_clear_message(tmp_path):
    # megatron.core (imported by other tests in this process) allow-lists numpy's reconstructors for
    # weights_only loads; hybridrl's own loader must refuse the old format without that allow-list.
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        _check_old_checkpoint(tmp_path)
    finally:
        torch.serialization.add_safe_globals(saved)


def _check_old_checkpoint(tmp_path):
    torch.save({"rng": {"numpy": np.random.get_state(), "python": random.getstate()}}, tmp_path / "data.pt")
    with pytest.raises(UnsafeCheckpointError, match="written by hybridrl before safe loading"):
        load_state_file(tmp_path / "data.pt")


def test_dataproto_round_trip_of_rich_non_tensor_data(tmp_path):
    batch = TensorDict(
        {
            "ids": torch.arange(6).reshape(3, 2),
            "f": torch.randn(3, 2).to(torch.bfloat16),
            "m": torch.ones(3).bool(),
        },
        batch_size=[3],
    )
    batch["group"] = TensorDict({"inner": torch.arange(3.0)}, batch_size=[3])
    rows = [{"a": 1, 2: [1, 2]}, None, (np.float32(1.5), b"\x00x")]
    non_tensor = {
        "obj": np.array(rows, dtype=object),
        "text": np.array(["x", "yy", "zzz"], dtype=object),
    }
    non_tensor["nested"] = np.empty(3, dtype=object)
    for i in range(3):
        non_tensor["nested"][i] = np.arange(i + 1)
    meta = {"metrics": {"a": [1.0, float("nan")]}, "t": torch.tensor([1, 2]), "n": np.int64(4), "k": (1, "x")}
    d = DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
    d.save_to_disk(str(tmp_path / "d.st"))
    back = DataProto.load_from_disk(str(tmp_path / "d.st"))
    for key in ("ids", "f", "m", ("group", "inner")):
        assert back.batch[key].dtype == d.batch[key].dtype and torch.equal(back.batch[key], d.batch[key])
    assert back.non_tensor_batch["obj"].dtype == object and list(back.non_tensor_batch["text"]) == [
        "x",
        "yy",
        "zzz",
    ]
    assert back.non_tensor_batch["obj"][0] == {"a": 1, 2: [1, 2]} and back.non_tensor_batch["obj"][1] is None
    scalar, raw = back.non_tensor_batch["obj"][2]
    assert isinstance(scalar, np.float32) and scalar == 1.5 and raw == b"\x00x"
    assert [list(a) for a in back.non_tensor_batch["nested"]] == [[0], [0, 1], [0, 1, 2]]
    assert np.isnan(back.meta_info["metrics"]["a"][1]) and torch.equal(back.meta_info["t"], meta["t"])
    assert (
        back.meta_info["n"] == 4
        and isinstance(back.meta_info["n"], np.int64)
        and back.meta_info["k"] == (1, "x")
    )


def test_dataproto_save_refuses_objects_it_cannot_store_safely(tmp_path):
    # `len`, not `print`: libraries loaded by other tests may replace builtins.print with a function
    d = DataProto(non_tensor_batch={"fn": np.array([len, len], dtype=object)})
    with pytest.raises(
        TypeError, match=r"non_tensor_batch\['fn'\] holds a builtins.builtin_function_or_method"
    ):
        d.save_to_disk(str(tmp_path / "d.st"))


def test_malicious_dataproto_pickle_is_refused(tmp_path):
    proof, marker = tmp_path / "proof", tmp_path / "marker"
    (tmp_path / "proof.pkl").write_bytes(pickle.dumps(Payload(str(proof))))
    pickle.loads((tmp_path / "proof.pkl").read_bytes())  # the unsafe way runs the payload
    assert proof.exists()
    (tmp_path / "batch.pkl").write_bytes(pickle.dumps({"batch": Payload(str(marker))}))
    with pytest.raises(
        DataProtoFileError, match="not a DataProto file.*unpickling a file can run arbitrary code"
    ):
        DataProto.load_from_disk(str(tmp_path / "batch.pkl"))
    assert not marker.exists()
