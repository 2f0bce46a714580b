import copy
import math

import pytest
import torch

from hybridrl.config.roles import OptimConfig
from hybridrl.engine.optim import build_lr_scheduler, build_optimizer, lr_factor, num_warmup_steps
from hybridrl.utils.flops import compute_mfu, count_params, estimate_flops, get_peak_flops


def _lrs(cfg, steps):
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_constant_with_warmup():
    lrs = _lrs(OptimConfig(lr=1.0, lr_warmup_steps=4), 6)
    assert lrs == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_with_ratio_warmup():
    cfg = OptimConfig(
        lr=1.0,
        lr_warmup_steps_ratio=0.2,
        lr_scheduler_type="cosine",
        total_training_steps=10,
        min_lr_ratio=0.1,
    )
    assert num_warmup_steps(cfg) == 2
    lrs = _lrs(cfg, 11)
    assert lrs[:3] == [0.0, 0.5, 1.0]
    # step 6: progress (6-2)/8 = 0.5 -> cos(pi * 0.5) = 0 -> 0.1 + 0.9 * 0.5
    assert lrs[6] == pytest.approx(0.55)
    assert lrs[10] == pytest.approx(0.1)
    assert lr_factor(
        5, warmup_steps=0, scheduler_type="cosine", total_steps=10, min_lr_ratio=0.0, num_cycles=0.5
    ) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_warmup_style_alias_and_errors():
    assert OptimConfig(warmup_style="cosine").scheduler_type == "cosine"
    with pytest.raises(ValueError, match="optim.total_training_steps"):
        _lrs(OptimConfig(lr_scheduler_type="cosine"), 1)
    with pytest.raises(ValueError, match="lr_warmup_steps_ratio"):
        _lrs(OptimConfig(lr_warmup_steps_ratio=0.1), 1)


def test_adamw_settings():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.05, betas=[0.8, 0.9]))
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["betas"]) == (0.1, 0.05, (0.8, 0.9))


def test_adamw_is_fused_on_cpu_and_steps_like_the_per_parameter_loop():
    """CPU parameters take torch's fused AdamW kernel; its steps equal the per-parameter loop's
    (torch's CPU default) up to float rounding, and a module with a non-CPU-or-integer tensor
    would keep the default (use_fused_adamw)."""
    from hybridrl.cpu.adamw import use_fused_adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.05, betas=[0.8, 0.9])
    opt = build_optimizer(model, cfg)
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.8, 0.9), foreach=False)
    for i in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b, w0 in zip(model.parameters(), ref.parameters(), init.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert (a - w0).abs().max() > 1e-3  # the steps moved the weights
    assert not use_fused_adamw([torch.zeros(3, dtype=torch.long)])
    assert use_fused_adamw([torch.zeros(3)])


def test_a_checkpoint_of_the_unfused_optimizer_resumes_fused(tmp_path):
    """A checkpoint written before AdamW was fused on CPU (param groups with fused=None) loads into
    the fused optimizer: its moments and step come across and the run keeps the fused kernel (the
    loaded param groups would otherwise set it back to the per-parameter loop)."""
    from hybridrl.engine.checkpoint import load_checkpoint, save_checkpoint

    def batch(i):
        return torch.randn(5, 8, generator=torch.Generator().manual_seed(i))

    def step(m, o, i):
        o.zero_grad()
        m(batch(i)).square().mean().backward()
        o.step()

    torch.manual_seed(0)
    old = torch.nn.Linear(8, 4)
    old_opt = torch.optim.AdamW(old.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    assert old_opt.param_groups[0]["fused"] is None
    for i in range(2):
        step(old, old_opt, i)
    save_checkpoint(str(tmp_path / "ckpt"), old, old_opt, contents=["model", "optimizer"], global_step=2)
    new = torch.nn.Linear(8, 4)
    new_opt = build_optimizer(new, OptimConfig(lr=1e-2, weight_decay=0.05))
    load_checkpoint(str(tmp_path / "ckpt"), new, new_opt, contents=["model", "optimizer"])
    assert new_opt.param_groups[0]["fused"] is True and new_opt.param_groups[0]["foreach"] is None
    for p_old, p_new in zip(old.parameters(), new.parameters()):
        assert torch.equal(p_old, p_new)
        assert torch.equal(old_opt.state[p_old]["exp_avg_sq"], new_opt.state[p_new]["exp_avg_sq"])
        assert float(new_opt.state[p_new]["step"]) == 2.0
    step(old, old_opt, 2)
    step(new, new_opt, 2)
    for p_old, p_new in zip(old.parameters(), new.parameters()):
        torch.testing.assert_close(p_new, p_old, atol=1e-6, rtol=1e-5)


def test_flops_hand_derived():
    # N = 10, sequences of 2 and 3 tokens, 1 layer, attention dim 4
    # training: 6 * 10 * 5 + 12 * 1 * 4 * (4 + 9) = 300 + 624
    assert estimate_flops(10, [2, 3], 1, 4) == 924.0
    assert estimate_flops(10, [2, 3], 1, 4, training=False) == 308.0
    assert compute_mfu(924.0, 2.0, 462.0) == 1.0
    assert compute_mfu(1.0, 1.0, None) is None


def test_count_params_excludes_tied_embeddings():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, torch.nn.Linear(3, 3), head)
    assert count_params(model) == 12
    assert count_params(model, exclude_embeddings=False) == 27


def test_cpu_peak_is_measured_once():
    first = get_peak_flops("cpu", torch.float32)
    assert first > 1e8
    assert get_peak_flops("cpu", torch.float32) == first


def test_clip_and_skip_non_finite_step():
    from hybridrl.engine.batching import optimizer_step
    from hybridrl.engine.fsdp import clip_grad_norm

    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.data = torch.tensor([[1.0, 1.0]])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    assert clip_grad_norm(model, 1.0) == pytest.approx(5.0)  # the norm before clipping
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.8]]), atol=1e-5, rtol=0)
    grad_norm, stepped = optimizer_step(model, opt, max_norm=1.0)
    assert stepped and grad_norm == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(model.weight.data, torch.tensor([[0.4, 0.2]]), atol=1e-5, rtol=0)
    model.weight.grad = torch.tensor([[float("nan"), 1.0]])
    grad_norm, stepped = optimizer_step(model, opt, max_norm=1.0)
    assert not stepped and math.isnan(grad_norm)
    torch.testing.assert_close(model.weight.data, torch.tensor([[0.4, 0.2]]), atol=1e-5, rtol=0)
    assert model.weight.grad is None


def test_cpu_peak_is_kept_per_machine_and_a_damaged_cache_is_measured_over(tmp_path, monkeypatch):
    import json

    from hybridrl.utils import flops

    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    flops.cached_cpu_peak_flops.cache_clear()
    path = flops.peak_cache_path()
    assert path.parent == tmp_path
    path.write_text("{not json")  # damaged: measured over, rewritten
    first = flops.cached_cpu_peak_flops(torch.float32)
    table = json.loads(path.read_text())
    assert list(table.values()) == [first] and first > 1e8
    # a later process reads the kept value instead of measuring (a planted value proves it)
    (key,) = table
    path.write_text(json.dumps({key: 123.0, "other machine": 5.0}))
    flops.cached_cpu_peak_flops.cache_clear()
    assert flops.cached_cpu_peak_flops(torch.float32) == 123.0
    # another dtype is another key: measured and added beside the others
    flops.cached_cpu_peak_flops.cache_clear()
    flops.cached_cpu_peak_flops(torch.bfloat16)
    assert len(json.loads(path.read_text())) == 3
    flops.cached_cpu_peak_flops.cache_clear()
