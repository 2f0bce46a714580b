"""The top-k forward of on-policy distillation (engine/topk.py): the teacher's top-k, the student's
log-probs at given ids with gradient, against a plain forward of each row alone."""

import os
import sys

import pytest
import torch
from tensordict import TensorDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, make_tiny_model_dir  # noqa: E402

from hybridrl.config.roles import ModelConfig  # noqa: E402
from hybridrl.engine import forward  # noqa: E402
from hybridrl.engine.base import LogProbRequest  # noqa: E402
from hybridrl.engine.topk import TOPK_IDS_KEY, forward_topk_log_probs, wants_topk  # noqa: E402
from hybridrl.models.hf import build_hf_model  # noqa: E402

K, TEMP = 5, 0.7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_hf_model(ModelConfig(path=make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny"))))).eval()


def _td(batch):
    return TensorDict(batch, batch_size=[batch["input_ids"].shape[0]])


def _row_log_probs(model, batch, i):
    """(n_resp, V) log-softmax of row i's response-predicting positions, row alone, unpadded."""
    ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
    n = int(batch["response_mask"][i].sum())
    logits = model(input_ids=ids[None]).logits[0].float() / TEMP
    return torch.log_softmax(logits, -1)[:-1][-n:], n


@pytest.mark.parametrize("remove_padding", [False, True])
def test_teacher_topk_matches_a_plain_forward(model, remove_padding):
    batch = _td(make_batch(4, seed=3))
    with torch.no_grad():
        out = forward_topk_log_probs(
            model, batch, temperature=TEMP, use_remove_padding=remove_padding, topk=K
        )
        ref = forward.forward_log_probs(model, batch, temperature=TEMP)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(out.log_probs[mask], ref.log_probs[mask], atol=1e-5, rtol=0)
        assert out.topk_log_probs.shape == (*mask.shape, K) and out.topk_ids.dtype == torch.long
        for i in range(4):
            full, n = _row_log_probs(model, batch, i)
            values, ids = full.topk(K, dim=-1)
            torch.testing.assert_close(out.topk_log_probs[i, :n], values, atol=1e-5, rtol=0)
            assert out.topk_ids[i, :n].tolist() == ids.tolist()


def test_student_log_probs_at_given_ids_carry_the_gradient(model):
    batch = _td(make_batch(3, seed=4))
    b, t = batch["responses"].shape
    vocab = model.config.vocab_size
    batch[TOPK_IDS_KEY] = torch.randint(0, vocab, (b, t, K), generator=torch.Generator().manual_seed(0))
    out = forward_topk_log_probs(model, batch, temperature=TEMP, gather_ids=True)
    with torch.no_grad():
        for i in range(b):
            full, n = _row_log_probs(model, batch, i)
            expect = full.gather(-1, batch[TOPK_IDS_KEY][i, :n])
            torch.testing.assert_close(out.topk_log_probs[i, :n], expect, atol=1e-5, rtol=0)
    model.zero_grad()
    (out.topk_log_probs * batch["response_mask"][..., None]).sum().backward()
    grad = model.get_output_embeddings().weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad()


def test_requests_and_bad_input(model):
    assert wants_topk(LogProbRequest(topk=3)) and wants_topk(LogProbRequest(topk_ids=True))
    assert not wants_topk(LogProbRequest())
    batch = _td(make_batch(2, seed=5))
    with pytest.raises(ValueError, match="exactly one of topk"):
        forward_topk_log_probs(model, batch)
    with pytest.raises(ValueError, match="topk=100000 exceeds the vocabulary"):
        forward_topk_log_probs(model, batch, topk=100000)
    with pytest.raises(NotImplementedError, match="use_prefix_grouper"):
        forward_topk_log_probs(model, batch, topk=2, prefix_group=True)
