"""The PPO step's batch functions run where the tensors are (StepData over a BatchRef) and give
exactly what they give on a DataProto on the driver: GRPO's two halves on the ranks, GAE and the
step's metrics on the first rank, the padding trim on every rank."""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest
import torch

from hybridrl import algos
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Worker
from hybridrl.single_controller.batch_ref import TRANSFER, BatchRef
from hybridrl.trainer.ppo import batch_fns
from hybridrl.trainer.ppo.padding import trim_right_padding
from hybridrl.trainer.ppo.step_data import StepData
from hybridrl.workers.batch_fn_worker import BatchFnWorker


class StepWorker(BatchFnWorker, Worker):
    """A worker with only the batch-function methods."""


@pytest.fixture(scope="module")
def step_group(ray_session):
    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = RayResourcePool([2], use_gpu=False, cpus_per_slot=0.5, name_prefix="step2")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(StepWorker), name_prefix="step2")
    yield wg
    wg.shutdown()
    pool.remove()


def _batch(b: int = 7, p: int = 3, t: int = 6) -> DataProto:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, t - 1, (b,), generator=g)  # the last column is padding in every row
    response_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(b, p, dtype=torch.long), response_mask], dim=1)
    scores = torch.zeros(b, t)
    scores[torch.arange(b), lengths - 1] = torch.rand(b, generator=g)
    return DataProto.from_dict(
        {
            "prompts": torch.randint(3, 9, (b, p), generator=g),
            "responses": torch.randint(3, 9, (b, t), generator=g) * response_mask,
            "input_ids": torch.randint(3, 9, (b, p + t), generator=g) * attention_mask,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "values": torch.randn(b, t, generator=g) * response_mask,
        },
        non_tensors={"uid": np.array([f"u{i // 3}" for i in range(b)], dtype=object)},
    )


def test_grpo_halves_on_the_ranks_equal_the_whole_batch_estimator(step_group):
    batch = _batch()
    want, _ = algos.compute_grpo_outcome_advantage(
        batch.batch["token_level_scores"], batch.batch["response_mask"], batch.non_tensor_batch["uid"]
    )
    data = StepData(step_group, by_reference=True)
    ref = BatchRef.from_proto(batch)
    ref.reorder(torch.tensor([3, 0, 6, 1, 5, 2, 4]))  # rows from other shards, as balancing does
    scores, _ = data.per_rank(ref.select(["token_level_scores", "response_mask"]), batch_fns.outcome_scores)
    per_response = algos.grpo_response_advantages(
        torch.from_numpy(np.asarray(scores.non_tensor_batch["grpo_score"], dtype=np.float32)),
        ref.non_tensor_batch["uid"],
    )
    adv_in = ref.select(["response_mask"])
    adv_in.non_tensor_batch = {"grpo_adv": per_response.numpy()}
    out, _ = data.per_rank(adv_in, batch_fns.broadcast_advantages)
    got = out.pull(["advantages"]).batch["advantages"]
    assert torch.equal(got, want[[3, 0, 6, 1, 5, 2, 4]])


def test_whole_batch_functions_on_a_worker_equal_the_driver(step_group):
    batch = _batch()
    by_ref = StepData(step_group, by_reference=True)
    on_driver = StepData(step_group, by_reference=False)
    gae = functools.partial(
        batch_fns.advantages,
        estimator="gae",
        options={"gamma": 1.0, "lam": 0.95, "norm_adv_by_std_in_grpo": True},
    )
    TRANSFER.clear()
    ref, _ = by_ref.add(BatchRef.from_proto(batch), gae)
    local, _ = on_driver.add(_batch(), gae)
    summary = functools.partial(
        batch_fns.summary, use_critic=True, max_prompt_length=3, max_response_length=6, shared_prompts=False
    )
    _, got = by_ref.whole(ref, summary)
    _, want = on_driver.whole(local, summary)
    assert TRANSFER["pulled"] == 0  # the metrics came back, not the tensors
    assert got == want and "critic/advantages/mean" in got["metrics"]
    assert torch.equal(ref.pull(["advantages"]).batch["advantages"], local.batch["advantages"])


def test_padding_trim_on_the_ranks_equals_the_driver(step_group):
    batch = _batch()
    data = StepData(step_group, by_reference=True)
    held = BatchRef.from_proto(batch)
    held.pop(["token_level_scores"])  # the reward manager's column
    ref, stats = data.add(held, functools.partial(batch_fns.score, reward_fn=_reward))
    s, t = stats["widths"]
    assert stats["keep"] < t and stats["seqlens"] == batch.batch["attention_mask"].sum(-1).tolist()
    cut_fn = functools.partial(batch_fns.trim_columns, keep=stats["keep"], prompt_and_response=s, response=t)
    cut, _ = data.per_rank(ref, cut_fn)
    want = trim_right_padding(_batch())
    got = cut.pull()
    assert sorted(got.batch.keys()) == sorted(k for k in want.batch.keys() if k != "prompts")
    assert torch.equal(got.batch.pop("token_level_scores"), want.batch["values"] * 2)
    for key in got.batch.keys():
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert list(ref.non_tensor_batch["acc"]) == [1.0] * len(batch)  # the reward extras, per sample


def _reward(data: DataProto, return_dict: bool = False):
    return {
        "reward_tensor": data.batch["values"] * 2,
        "reward_extra_info": {"acc": [1.0] * len(data)},
    }
