"""`model.use_fused_kernels` selects the chunked head (lm_head.linear_log_probs) or the full-logits path.

Both give the same log-probs and entropy (and gradients); the flag changes which path runs (counted
through the real function), and `fused_kernel_options.impl_backend` other than torch is refused.
"""

from __future__ import annotations

import pytest
import torch

import hybridrl.engine.forward as forward
from hybridrl.config.roles import ModelConfig
from hybridrl.protocol import DataProto
from hybridrl.workers.actor import PPOActor
from tests.fsdp_testkit import count_calls, make_batch, make_tiny_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the chunked head (the real function runs)."""
    return count_calls(monkeypatch, forward, "linear_log_probs")


def test_use_fused_kernels_selects_the_chunked_head_and_both_paths_agree(model, calls):
    data = DataProto.from_dict(make_batch(4, seed=3))
    out = {}
    for flag in (True, False):
        before = calls["calls"]
        actor = PPOActor(None, model, use_fused_kernels=flag)
        out[flag] = actor.compute_log_prob(data, calculate_entropy=True, temperature=0.7)
        assert (calls["calls"] > before) == flag
    mask = data.batch["response_mask"].bool()
    for name in ("log_probs", "entropy"):
        a, b = getattr(out[True], name), getattr(out[False], name)
        torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=1e-5)


def test_gradients_agree_between_the_two_paths(model):
    batch = make_batch(3, seed=5)
    grads = {}
    for flag in (True, False):
        model.zero_grad()
        _res = forward.forward_log_probs(model, batch, calculate_entropy=True, fused=flag)
        lp, ent = _res.log_probs, _res.entropy
        ((lp + 0.1 * ent) * batch["response_mask"]).sum().backward()
        grads[flag] = model.lm_head.weight.grad.clone()
    torch.testing.assert_close(grads[True], grads[False], atol=1e-5, rtol=1e-4)


def test_impl_backend_other_than_torch_is_refused():
    ModelConfig(use_fused_kernels=True).validate()
    cfg = ModelConfig(use_fused_kernels=True)
    cfg.fused_kernel_options.impl_backend = "triton"
    with pytest.raises(ValueError, match="impl_backend='triton'.*Use impl_backend=torch"):
        cfg.validate()
    cfg.use_fused_kernels = False  # the option of a path that does not run
    cfg.validate()
