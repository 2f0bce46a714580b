"""BatchRef: a batch whose tensors stay in the object store and move worker to worker.

The equivalence test runs the same stages twice, once through the driver (DataProto) and once
by reference (BatchRef), across groups that split the batch differently (2 ranks, then 3 with
padding) and after a driver-side reorder, and asserts identical columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sc_toy_workers import stage_advantage, stage_log_prob

from hybridrl.protocol import DataProto
from hybridrl.single_controller.batch_ref import TRANSFER, BatchRef


def _batch(n: int = 7) -> DataProto:
    g = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        {"x": torch.randn(n, 5, generator=g), "m": (torch.rand(n, 5, generator=g) > 0.3).float()},
        non_tensors={"uid": np.array([f"u{i // 2}" for i in range(n)], dtype=object)},
    )


def _flow(first, second, batch, order):
    batch = batch.union(first.apply(stage_log_prob, batch))
    batch.reorder(order)
    return batch.union(second.apply(stage_advantage, batch))


def test_by_reference_equals_through_the_driver(group2, group3):
    order = torch.tensor([6, 0, 5, 1, 4, 2, 3])
    want = _flow(group2, group3, _batch(), order)
    before = TRANSFER["pulled"]
    ref = _flow(group2, group3, BatchRef.from_proto(_batch()), order)
    assert isinstance(ref, BatchRef) and sorted(ref.keys()) == sorted(want.batch.keys())
    assert TRANSFER["pulled"] == before  # nothing came back to the driver but per-sample columns
    got = ref.pull()
    assert TRANSFER["pulled"] > before
    for k in want.batch.keys():
        assert torch.equal(got.batch[k], want.batch[k]), k
    for k in ("uid", "score"):
        np.testing.assert_array_equal(ref.non_tensor_batch[k], want.non_tensor_batch[k])
    assert ref.meta_info["metrics"] == want.meta_info["metrics"]


def test_select_pop_and_pull_columns(group2):
    ref = BatchRef.from_proto(_batch())
    ref = ref.union(group2.apply(stage_log_prob, ref))
    popped = ref.pop(["score_tok"])
    assert popped.keys() == ["score_tok"] and "score_tok" not in ref.keys()
    got = ref.select(["lp"]).pull()
    assert list(got.batch.keys()) == ["lp"] and len(got) == 7


def test_clear_errors(group2):
    ref = BatchRef.from_proto(_batch())
    with pytest.raises(ValueError, match="pop them from one first"):
        ref.union(BatchRef.from_proto(_batch().select(batch_keys=["x"])))
    with pytest.raises(TypeError, match="cannot take a BatchRef"):
        group2.metric(BatchRef.from_proto(_batch(8)))
    with pytest.raises(KeyError, match="no columns"):
        ref.select(["nope"])
