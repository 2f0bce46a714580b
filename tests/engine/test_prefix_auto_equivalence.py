"""`use_prefix_grouper: auto` switched on by the config stage computes what the plain forward computes.

The yaml defaults (GRPO, rollout.n=8, the built-in model, FSDP) turn auto on; the PPO actor on a
real FSDP2 engine of the built-in model (fp32, one gloo rank) then gives the same log-probs and
entropy, and one update the same losses, gradient norm and new weights as with the key false
(1e-5), while only the auto-on actor takes the grouped path.
"""

from __future__ import annotations

import dataclasses

import torch
from hydra import compose, initialize_config_module

from tests.fsdp_testkit import spawn

PROMPTS, N, P, T = 2, 4, 7, 6  # 2 prompts x 4 responses; prompt / response columns
PEAK = 1e9  # FLOP/s the MFU metric is taken against


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """veRL layout, rows p0 p0 p1 p1 p0 p0 p1 p1: left-padded prompts (group 1 padded by 2),
    right-padded responses of lengths 1..T."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, vocab, (PROMPTS, P), generator=g)
    p_mask = torch.ones(PROMPTS, P, dtype=torch.long)
    p_mask[1, :2] = 0
    order = [0, 0, 1, 1, 0, 0, 1, 1]
    rows, masks = [], []
    for i, p in enumerate(order):
        length = 1 + (i * 5) % T
        r_mask = (torch.arange(T) < length).long()
        resp = torch.randint(3, vocab, (T,), generator=g) * r_mask
        rows.append(torch.cat([prompts[p] * p_mask[p], resp]))
        masks.append(torch.cat([p_mask[p], r_mask]))
    input_ids, attention_mask = torch.stack(rows), torch.stack(masks)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, P:],
        "response_mask": attention_mask[:, P:],
    }


def _run(actor_cfg, model_dir: str, vocab: int) -> dict:
    """Log-probs, one update's metrics and the log-probs after it; whether the grouped path ran."""
    import hybridrl.engine.forward as fw
    from hybridrl.config.roles import ModelConfig
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    calls = []
    inner = fw._grouped_log_probs
    fw._grouped_log_probs = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    try:
        engine = FSDPEngine.build(
            ModelConfig(path=model_dir), actor_cfg.fsdp_config, actor_cfg.optim, load_tok=False
        )
        sizes = normalize_actor_batch_sizes(actor_cfg, rollout_n=N, dp_size=1)
        actor = PPOActor(
            actor_cfg, engine.module, engine.optimizer, engine.lr_scheduler, dp_size=1, batch_sizes=sizes,
            peak_flops=PEAK,
        )  # fmt: skip
        data = DataProto.from_dict(_batch(vocab))
        first = actor.compute_log_prob(data, calculate_entropy=True, micro_batch_size=4)
        g = torch.Generator().manual_seed(5)
        data.batch["old_log_probs"] = first.log_probs + 0.2 * torch.randn(first.log_probs.shape, generator=g)
        data.batch["ref_log_prob"] = first.log_probs + 0.1 * torch.randn(first.log_probs.shape, generator=g)
        data.batch["advantages"] = torch.randn(PROMPTS * N, T, generator=g)
        data.meta_info["global_steps"] = 0
        metrics = actor.update_policy(data)
        after = actor.compute_log_prob(data, micro_batch_size=4).log_probs
    finally:
        fw._grouped_log_probs = inner
    return {
        "lp": first.log_probs,
        "ent": first.entropy,
        "metrics": metrics,
        "after": after,
        "grouped": len(calls),
        "perf_model": engine.perf_model(),
    }


def _check(rank, world, on_cfg, model_dir, vocab):
    off_cfg = dataclasses.replace(on_cfg, use_prefix_grouper=False)
    on, off = _run(on_cfg, model_dir, vocab), _run(off_cfg, model_dir, vocab)
    assert on["grouped"] > 0 and off["grouped"] == 0, (on["grouped"], off["grouped"])
    mask = _batch(vocab)["response_mask"].bool()
    for key in ("lp", "ent", "after"):
        torch.testing.assert_close(
            on[key][mask], off[key][mask], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert (on["after"][mask] - on["lp"][mask]).abs().max() > 1e-3  # the update moved the policy
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/ppo_kl",
        "actor/pg_clipfrac",
    ):
        a, b = on["metrics"][key], off["metrics"][key]
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5), (key, a, b)
    assert 0 < on["metrics"]["actor/pg_clipfrac"][0] < 1
    # perf/mfu/actor counts what each forward computed: every row's sequence with the plain one,
    # each prompt once per group (in each micro-batch of 4 rows) with the shared-prompt one
    from hybridrl.engine.prefix_group import build_prefix_layout
    from hybridrl.utils.flops import estimate_flops, grouped_work, work_flops

    pm, batch = on["perf_model"], _batch(vocab)
    flops = {
        k: r["metrics"]["perf/mfu/actor"][0] * r["metrics"]["perf/actor/update_s"][0] * PEAK
        for k, r in (("on", on), ("off", off))
    }
    rows = batch["attention_mask"].sum(-1).tolist()
    want_off = estimate_flops(pm.num_params, rows, pm.num_layers, pm.attn_dim)
    tokens = squares = 0
    for lo in (0, 4):  # the two micro-batches, in order (actor.shuffle is false)
        layout = build_prefix_layout(batch["input_ids"][lo : lo + 4], batch["attention_mask"][lo : lo + 4], T)
        tok, sq = grouped_work(layout.lengths, layout.prompt_of)
        tokens, squares = tokens + tok, squares + sq
    want_on = work_flops(pm.num_params, tokens, squares, pm.num_layers, pm.attn_dim)
    assert want_on < want_off
    assert abs(flops["off"] / want_off - 1) < 1e-6 and abs(flops["on"] / want_on - 1) < 1e-6, (
        flops,
        want_on,
        want_off,
    )


def test_auto_on_trains_like_the_plain_forward_on_the_builtin_model(tmp_path):
    from transformers import AutoConfig

    from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig, OptimConfig
    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.trainer.ppo.config import load_config

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        config = load_config(compose("ppo_trainer"), explicit_keys=set())
    resolved = config.actor_rollout_ref.actor.use_prefix_grouper
    assert resolved is True  # the default run: auto -> on
    model_dir = resolve_model_path(config.actor_rollout_ref.model.path)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    on_cfg = dataclasses.replace(
        config.actor_rollout_ref.actor,
        use_prefix_grouper=resolved,
        fsdp_config=fsdp,
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=4,
        use_dynamic_bsz=False,
        use_kl_loss=True,
        kl_loss_coef=0.5,
        entropy_coeff=0.01,
        optim=OptimConfig(lr=5e-3, clip_grad=1.0),
    )
    spawn(_check, 1, tmp_path, on_cfg, model_dir, vocab)
