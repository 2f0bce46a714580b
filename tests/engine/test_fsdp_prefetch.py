"""`fsdp_config.forward_prefetch`: the explicit next-layer prefetch is registered on every layer and
the log-probs and gradients equal those of the run without it (real FSDP2, 2 CPU ranks, gloo)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402


def _run(model_dir, rank, prefetch):
    from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.engine.fsdp import FSDPEngine

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"), forward_prefetch=prefetch)
    engine = FSDPEngine.build(ModelConfig(path=model_dir), fsdp, None, role="actor", load_tok=False)
    layers = list(engine.module.model.layers)
    links = [[s is nxt._get_fsdp_state() for s in lay._get_fsdp_state()._states_to_forward_prefetch]
             for lay, nxt in zip(layers, layers[1:])]  # fmt: skip
    full = make_batch(4, seed=1)
    batch = {k: v[rank * 2 : (rank + 1) * 2] for k, v in full.items()}
    engine.module.train()
    log_probs = forward_log_probs(engine.module, batch).log_probs
    (log_probs * batch["response_mask"]).sum().backward()
    grads = [p.grad.full_tensor().clone() for p in engine.module.parameters()]
    return links, log_probs.detach(), grads


def _checks(rank, world, model_dir):
    links_on, lp_on, g_on = _run(model_dir, rank, True)
    links_off, lp_off, g_off = _run(model_dir, rank, False)
    assert links_on and all(link == [True] for link in links_on), links_on
    assert all(link == [] for link in links_off), links_off
    torch.testing.assert_close(lp_on, lp_off, rtol=0, atol=0)
    for a, b in zip(g_on, g_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_forward_prefetch_registered_and_same_numbers(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_checks, 2, tmp_path, model_dir)
