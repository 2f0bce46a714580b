"""rollout.multi_stage_wake_up: the order of wake-ups around the weight sync, on the real HF engine
(which has no sleep mode: its wake-ups are no-ops, so the order is what can be observed here;
vLLM / SGLang on GPU free and re-allocate memory at these calls, untested on GPU), and the
sleep-state bookkeeping the GPU engines use."""

from __future__ import annotations

import torch

from hybridrl.config.rollout import RolloutConfig
from hybridrl.rollout.base import SleepTracker
from hybridrl.rollout.hf import HFRollout
from hybridrl.weight_sync.colocated import sync_weights, wake_and_sync


class RecordingHF(HFRollout):
    """The HF engine, with its memory and weight calls recorded in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def resume_memory(self, tags=None):
        self.calls.append(("resume", None if tags is None else tuple(tags)))
        super().resume_memory(tags)

    def update_weights(self, named_tensors):
        self.calls.append(("update_weights",))
        super().update_weights(named_tensors)


def test_multi_stage_wake_up_order_and_weights(tiny_model_dir, tokenizer, source_model):
    for multi_stage, want in (
        (True, [("resume", ("weights",)), ("update_weights",), ("resume", ("kv_cache",))]),
        (False, [("resume", None), ("update_weights",)]),
    ):
        cfg = RolloutConfig(name="hf", dtype="float32", load_format="auto", multi_stage_wake_up=multi_stage)
        rollout = RecordingHF(cfg, tiny_model_dir, tokenizer)
        named = ((n, p.detach()) for n, p in source_model.named_parameters())
        metrics = wake_and_sync(rollout, lambda r=rollout, n=named: sync_weights(r, n), multi_stage)
        assert rollout.calls == want
        assert metrics["weight_sync/num_tensors"] > 0
        for (name, got), src in zip(rollout.model.named_parameters(), source_model.parameters()):
            assert torch.equal(got, src), name


def test_sleep_tracker_wakes_each_tag_once():
    t = SleepTracker()
    assert t.wake(None) == []  # never released: nothing to wake
    t.release()
    assert t.wake(["weights"]) == ["weights"]
    assert t.wake(["weights"]) == []
    assert t.wake(None) == ["kv_cache"]  # the rest
    assert t.released == set()
    t.release()
    assert t.wake(None) == ["weights", "kv_cache"]
