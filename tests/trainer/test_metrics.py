"""Step metrics and validation metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo import metrics as M


def test_timer_accumulates(monkeypatch):
    clock = iter([10.0, 11.5, 20.0, 22.0])
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    timing: dict[str, float] = {}
    with M.timer("gen", timing):
        pass
    with M.timer("gen", timing):
        pass
    assert timing == {"gen": 3.5}


def test_timer_records_even_on_error(monkeypatch):
    clock = iter([1.0, 3.0])
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    timing: dict[str, float] = {}
    with pytest.raises(ZeroDivisionError), M.timer("x", timing):
        raise ZeroDivisionError
    assert timing == {"x": 2.0}


def test_reduce_metrics_means():
    out = M.reduce_metrics(
        {"a": [1.0, 2.0, 6.0], "b": 4, "c": [torch.tensor(1.0), torch.tensor(0.0)], "d": []}
    )
    assert out == {"a": 3.0, "b": 4.0, "c": 0.5}


def hand_batch() -> DataProto:
    """B=2, P=3, T=4. Prompt lengths 2, 3 (full); response lengths 2, 4 (full)."""
    attn = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    resp_mask = attn[:, 3:].clone()
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    rewards = scores - 0.1 * resp_mask
    return DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(2, 3, dtype=torch.long),
            "responses": torch.zeros(2, 4, dtype=torch.long),
            "attention_mask": attn,
            "response_mask": resp_mask,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": torch.tensor([[1.0, 2.0, 99.0, 99.0], [-1.0, -1.0, -1.0, -1.0]]),
            "returns": torch.tensor([[1.0, 1.0, 7.0, 7.0], [0.0, 0.0, 0.0, 0.0]]),
            "values": torch.tensor([[1.0, 1.0, 5.0, 5.0], [0.0, 0.0, 0.0, 1.0]]),
        }
    )


def test_data_metrics_hand_values():
    m = M.compute_data_metrics(hand_batch(), use_critic=True)
    expected = {
        "critic/score/mean": 0.75, "critic/score/max": 1.0, "critic/score/min": 0.5,
        "critic/rewards/mean": 0.45, "critic/rewards/max": 0.8, "critic/rewards/min": 0.1,
        "critic/advantages/mean": -1 / 6, "critic/advantages/max": 2.0, "critic/advantages/min": -1.0,
        "critic/returns/mean": 1 / 3, "critic/returns/max": 1.0, "critic/returns/min": 0.0,
        "critic/values/mean": 0.5, "critic/values/max": 1.0, "critic/values/min": 0.0,
        # Var(returns - values) = 1/6, Var(returns) = 4/15 (unbiased, over the 6 valid tokens)
        "critic/vf_explained_var": 1 - (1 / 6) / (4 / 15 + 1e-5),
        "response_length/mean": 3.0, "response_length/max": 4.0, "response_length/min": 2.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 2.5, "prompt_length/max": 3.0, "prompt_length/min": 2.0,
        "prompt_length/clip_ratio": 0.5,
    }  # fmt: skip
    assert m.keys() == expected.keys()
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, abs=1e-6), k


def test_data_metrics_without_critic_and_missing_values():
    batch = hand_batch()
    m = M.compute_data_metrics(batch, use_critic=False)
    assert not any(k.startswith("critic/values") for k in m) and "critic/vf_explained_var" not in m
    batch.pop(batch_keys=["values"])
    with pytest.raises(KeyError, match="use_critic=True.*values"):
        M.compute_data_metrics(batch, use_critic=True)


def test_timing_metrics_per_token():
    timing = {"gen": 0.6, "update_actor": 1.1, "step": 3.0, "testing": 1.0}
    m = M.compute_timing_metrics(hand_batch(), timing)
    # 6 response tokens, 5 prompt tokens
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(100.0)
    assert m["timing_s/step"] == 3.0 and m["timing_s/testing"] == 1.0
    assert "timing_per_token_ms/step" not in m and "timing_per_token_ms/testing" not in m


def test_throughput():
    batch = hand_batch()
    m = M.compute_throughout_metrics(batch, {"step": 3.0}, n_workers=2)
    assert m == {
        "perf/total_num_tokens": 11,
        "perf/time_per_step": 3.0,
        "perf/throughput": pytest.approx(11 / 6),
    }
    batch.meta_info["global_token_num"] = [5, 7]
    assert M.compute_throughout_metrics(batch, {"step": 3.0}, 2)["perf/throughput"] == pytest.approx(2.0)
    with pytest.raises(KeyError, match="timer\\('step'"):
        M.compute_throughout_metrics(batch, {}, 2)


@pytest.mark.parametrize(
    "values, k, expected",
    [
        ([1, 0, 0, 1], 2, 5 / 6),
        ([1, 0, 0, 0], 2, 0.5),
        ([0, 0, 0], 2, 0.0),
        ([0.5, 1.5], 2, 1.5),
        ([3, 1, 2], 1, 2.0),
    ],
)
def test_expected_best_of_k(values, k, expected):
    assert M.expected_best_of_k(values, k) == pytest.approx(expected)


def test_expected_best_of_k_matches_enumeration():
    from itertools import combinations

    rng = np.random.default_rng(0)
    v = rng.normal(size=7).tolist()
    for k in range(1, 8):
        brute = np.mean([max(c) for c in combinations(v, k)])
        assert M.expected_best_of_k(v, k) == pytest.approx(brute)


def test_validation_metrics_hand_values():
    sources = ["a"] * 8 + ["b"] * 2
    uids = ["p1"] * 4 + ["p2"] * 4 + ["p3"] * 2
    reward = [1, 0, 0, 0, 1, 1, 0, 1, 0.5, 1.5]
    pred = ["4", "5", "5", "5", "7", "7", "3", "7", "x", "y"]
    acc = [r == 1 for r in reward]
    m = M.process_validation_metrics(sources, uids, {"reward": reward, "acc": acc, "pred": pred})
    # p1: mean .25, best@2 = 1 - C(3,2)/C(4,2) = .5, maj "5" -> 0;  p2: mean .75, best@2 = 1, maj "7" -> 1
    assert m["val-core/a/reward/mean@4"] == pytest.approx(0.5)
    assert m["val-core/a/reward/best@4"] == pytest.approx(1.0)
    assert m["val-aux/a/reward/best@2"] == pytest.approx(0.75)
    assert m["val-core/a/reward/maj@4"] == pytest.approx(0.5)
    assert m["val-aux/a/reward/worst@4"] == pytest.approx(0.0)
    assert m["val-aux/a/reward/std@4"] == pytest.approx(math.sqrt(3 / 16))
    assert m["val-core/a/acc/mean@4"] == pytest.approx(0.5)
    # p3: tie between "x" and "y" -> the earlier "x" (0.5)
    assert m["val-core/b/reward/mean@2"] == pytest.approx(1.0)
    assert m["val-core/b/reward/best@2"] == pytest.approx(1.5)
    assert m["val-core/b/reward/maj@2"] == pytest.approx(0.5)
    assert not any("/pred/" in k for k in m)


def test_validation_metrics_single_response():
    m = M.process_validation_metrics(
        ["s", "s", "t"], None, {"reward": [1.0, 0.0, 0.5], "note": ["a", "b", "c"]}
    )
    assert m == {"val-core/s/reward/mean@1": 0.5, "val-core/t/reward/mean@1": 0.5}


def test_validation_metrics_errors():
    with pytest.raises(KeyError, match="'reward'"):
        M.process_validation_metrics(["s"], None, {"acc": [1]})
    with pytest.raises(ValueError, match="infos\\['acc'\\] has 1 values for 2 samples"):
        M.process_validation_metrics(["s", "s"], None, {"reward": [1, 0], "acc": [1]})
