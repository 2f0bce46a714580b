"""oneDNN training linears (cpu/train_linear.py): forward and every gradient equal
F.linear's, the layer falls back where oneDNN does not apply, and an FSDP engine's updates with it
equal the updates without it (one rank, plain module and FSDP2)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.cpu.onednn import onednn_available
from hybridrl.cpu.train_linear import (
    MIN_MACS,
    OneDnnLinear,
    OneDnnTrainLinear,
    install_onednn_linear,
    onednn_linear_applies,
    resolve_onednn_linear,
    uninstall_onednn_linear,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 24), (3, 5, 24), (2, 1, 24)])
def test_forward_and_every_gradient_equal_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    w0, x0 = torch.randn(40, 24, generator=gen), torch.randn(shape, generator=gen)
    b0 = torch.randn(40, generator=gen) if bias else None
    dy = torch.randn(*shape[:-1], 40, generator=gen)
    grads = []
    for fn in (F.linear, OneDnnLinear.apply):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        y = fn(x, w, b)
        y.backward(dy)
        grads.append((y.detach(), x.grad, w.grad, b.grad if bias else None))
    for want, got in zip(*grads):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_only_the_needed_gradients_are_computed():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8)  # a frozen weight
    OneDnnLinear.apply(x, w, None).sum().backward()
    assert w.grad is None
    torch.testing.assert_close(x.grad, torch.ones(4, 6) @ w)
    x2 = torch.randn(8, 5).t()  # a strided (5, 8) input that needs no gradient
    w2, w3 = torch.randn(6, 8, requires_grad=True), None
    OneDnnLinear.apply(x2, w2, None).sum().backward()
    w3 = w2.detach().clone().requires_grad_()
    F.linear(x2, w3).sum().backward()
    torch.testing.assert_close(w2.grad, w3.grad, atol=1e-5, rtol=1e-5)


def test_applies_only_on_cpu_float32_above_the_size_bound():
    w = torch.zeros(16, 32)
    assert onednn_linear_applies(torch.zeros(4, 32), w, min_macs=0)
    big, x = torch.zeros(512, 256), torch.zeros(4, 256)  # 2**17 elements: the weight bound
    assert onednn_linear_applies(x, nn.Parameter(big), min_macs=4 * 256 * 512)
    assert not onednn_linear_applies(x, big, min_macs=4 * 256 * 512 + 1)
    assert not onednn_linear_applies(x, big[:-1], min_macs=1)  # one row short of the weight bound
    assert not onednn_linear_applies(torch.zeros(4, 32, dtype=torch.bfloat16), w.bfloat16(), 0)
    assert not onednn_linear_applies(torch.zeros(4, 32, device="meta"), w.to("meta"), 0)
    assert not onednn_linear_applies(torch.zeros(64, 128), torch.zeros(128, 128))  # tiny: F.linear
    assert not onednn_linear_applies(torch.zeros(4096, 128), torch.zeros(512, 128))  # a small weight
    assert onednn_linear_applies(torch.zeros(4944, 768), torch.zeros(256, 768))  # the bench model
    assert MIN_MACS == 1 << 25


def test_install_swaps_exact_linears_and_can_be_undone():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), MyLinear(8, 8), nn.Sequential(nn.Linear(8, 2)))
    names = list(model.state_dict())
    assert install_onednn_linear(model, min_macs=0) == 2
    assert [type(m).__name__ for m in model.modules()][1:] == [
        "OneDnnTrainLinear",
        "MyLinear",
        "Sequential",
        "OneDnnTrainLinear",
    ]
    assert list(model.state_dict()) == names  # checkpoints keep their names
    x = torch.randn(5, 8)
    got = model(x)
    assert uninstall_onednn_linear(model) == 2
    assert not any(type(m) is OneDnnTrainLinear for m in model.modules())
    assert "onednn_min_macs" not in vars(model[0])
    torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)


def test_the_key_resolves_and_bad_values_are_refused():
    assert resolve_onednn_linear(None, "cpu", "k") is True
    assert resolve_onednn_linear(None, "cuda", "k") is False
    assert resolve_onednn_linear(False, "cpu", "k") is False
    assert resolve_onednn_linear(True, "cpu", "k") is True
    with pytest.raises(ValueError, match=r"k.onednn_linear=true is for CPU training; .* cuda"):
        resolve_onednn_linear(True, "cuda", "k")
    with pytest.raises(ValueError, match="must be true, false or null"):
        resolve_onednn_linear("yes", "cpu", "k")


def _engine_checks(rank, world, model_dir):
    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.engine.forward import head_is_swappable
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    def build(onednn, **kw):
        fsdp = FSDPConfig(
            mixed_precision=MixedPrecisionConfig(param_dtype="fp32"), onednn_linear=onednn, **kw
        )
        cfg = ActorConfig(
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=2,
            optim=OptimConfig(lr=1e-3),
            fsdp_config=fsdp,
        )
        engine = FSDPEngine.build(ModelConfig(path=model_dir), fsdp, cfg.optim, role="actor", load_tok=False)
        if onednn:  # the tiny model's products are below the size bound: give oneDNN every one
            assert install_onednn_linear(engine.module, min_macs=0) == 14  # 2 layers x 7; not the head
        sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1)
        return engine, PPOActor(cfg, engine.module, engine.optimizer, engine.lr_scheduler, batch_sizes=sizes)

    off, off_actor = build(False)
    assert not any(type(m) is OneDnnTrainLinear for m in off.module.modules())
    auto, _ = build(None)  # auto on CPU: the tiny model's weights are all below the size bound,
    assert not any(type(m) is OneDnnTrainLinear for m in auto.module.modules())  # so none swapped
    big = nn.Sequential(nn.Linear(512, 256), nn.Linear(8, 8))
    assert install_onednn_linear(big) == 1 and big[0].onednn_min_macs == MIN_MACS
    # the vocabulary head stays a plain nn.Linear, so the fused log-prob head still replaces it
    assert type(auto.module.lm_head) is nn.Linear
    assert head_is_swappable(auto.module) is auto.module.lm_head
    runs = {"plain": build(True), "fsdp2": build(True, shard_one_rank=True)}
    calls = []
    hook = (
        runs["plain"][0]
        .module.model.layers[0]
        .mlp.up_proj.register_forward_pre_hook(
            lambda m, args: calls.append(onednn_linear_applies(args[0], m.weight, m.onednn_min_macs))
        )
    )
    data = DataProto.from_dict(dict(make_batch(4, seed=3)))
    data.batch["old_log_probs"] = off_actor.compute_log_prob(data, micro_batch_size=2).log_probs
    data.batch["advantages"] = torch.linspace(-1, 1, 4)[:, None].expand(4, 5).clone()
    for name, (_, actor) in runs.items():
        got_lp = actor.compute_log_prob(data, micro_batch_size=2).log_probs
        torch.testing.assert_close(got_lp, data.batch["old_log_probs"], atol=1e-5, rtol=1e-5, msg=name)
    expected = [off_actor.update_policy(data) for _ in range(2)]
    weights = dict(off.iter_full_params())
    for name, (engine, actor) in runs.items():
        for want in expected:
            got = actor.update_policy(data)
            for key in ("actor/pg_loss", "actor/grad_norm"):
                torch.testing.assert_close(
                    torch.tensor(got[key]), torch.tensor(want[key]), atol=1e-5, rtol=1e-5, msg=f"{name} {key}"
                )
        params = dict(engine.iter_full_params())
        assert params.keys() == weights.keys(), name
        for key, tensor in params.items():  # Adam's normalised step (lr 1e-3) amplifies ~1e-7
            torch.testing.assert_close(tensor, weights[key], atol=5e-5, rtol=0, msg=f"{name} {key}")
    hook.remove()
    assert calls and all(calls)  # the plain module's layer took oneDNN in every forward


def test_engine_updates_with_onednn_equal_f_linear(tmp_path):
    """`fsdp_config.onednn_linear`: log-probs, two updates' losses and grad norms, and the weights
    equal those of F.linear, on the plain one-rank module and under FSDP2; auto installs it on CPU."""
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_engine_checks, 1, tmp_path, model_dir)
