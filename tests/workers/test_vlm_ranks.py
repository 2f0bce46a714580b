"""One GRPO update of a tiny Qwen2-VL / Qwen3-VL on 2 FSDP2 ranks (gloo, real processes) == on 1 rank,
with images.

The rows' pixel inputs ride in the batch's non-tensor part, are split with their rows over the
ranks, and reach the vision tower on each rank: log-probs (padded) and the updated weights (packed
forward, vision tower trained) match the single-rank run.
"""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import spawn  # noqa: E402

pytest.importorskip("PIL")
ROWS, P, T = 8, 40, 6
LR = 1e-2
EPS = 1e-3  # Adam: a large eps makes the first step lr * g / (|g| + eps) smooth in g (see _checks)


def _batch(model_dir):
    """ROWS shape prompts (left-padded to P) + random text responses, GRPO-style advantages."""
    from hybridrl.data import visual_task
    from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset, collate_fn
    from hybridrl.models.vlm import load_processor
    from hybridrl.protocol import DataProto

    processor = load_processor(model_dir)
    files = visual_task.write_rl_parquet(os.path.join(model_dir, "rows.parquet"), ROWS, seed=3)
    cfg = RLDataConfig(max_prompt_length=P, image_patch_size=None)  # the processor's (Qwen3-VL: 16)
    ds = RLHFDataset(files, processor.tokenizer, cfg, processor=processor)
    prompts = collate_fn([ds[i] for i in range(ROWS)])
    g = torch.Generator().manual_seed(4)
    responses = torch.randint(10, 40, (ROWS, T), generator=g)  # text tokens of the character vocab
    r_mask = torch.ones(ROWS, T, dtype=torch.long)
    r_mask[::3, T - 2 :] = 0
    responses = responses * r_mask + processor.tokenizer.pad_token_id * (1 - r_mask)
    attn = torch.cat([prompts["attention_mask"], r_mask], 1)
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, T) * r_mask
    batch = {
        "input_ids": torch.cat([prompts["input_ids"], responses], 1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": r_mask,
        "advantages": adv.contiguous(),
    }
    return DataProto.from_dict(batch, non_tensors={"multi_modal_inputs": prompts["multi_modal_inputs"]})


def _full_params(module):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in module.named_parameters()
    }


def _checks(rank, world, model_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    cfg = ActorConfig(fsdp_config=fsdp, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=LR, eps=EPS, clip_grad=1.0))  # fmt: skip
    model_cfg = dataclasses.replace(ModelConfig(), path=model_dir)
    data = _batch(model_dir)
    one_rank = dist.new_group([0])
    engine2 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, load_tok=False)
    sizes2 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2)
    actor2 = PPOActor(
        cfg, engine2.module, engine2.optimizer, dp_size=2, batch_sizes=sizes2, use_remove_padding=True
    )
    local = data.chunk(2)[rank]
    lp2 = actor2.compute_log_prob(local, micro_batch_size=3).log_probs
    gathered = [torch.empty_like(lp2) for _ in range(2)]
    dist.all_gather(gathered, lp2.contiguous())
    lp2 = torch.cat(gathered)
    data.batch["old_log_probs"] = lp2  # on-policy start
    local = data.chunk(2)[rank]
    before = _full_params(engine2.module)
    m2 = actor2.update_policy(local)
    after2 = _full_params(engine2.module)
    if rank == 0:
        mesh1 = DeviceMesh.from_group(one_rank, "cpu", mesh_dim_names=("fsdp",))
        engine1 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, mesh=mesh1, load_tok=False)
        sizes1 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1)
        actor1 = PPOActor(cfg, engine1.module, engine1.optimizer, dp_size=1, batch_sizes=sizes1)
        lp1 = actor1.compute_log_prob(data, micro_batch_size=ROWS).log_probs  # padded forward
        mask = data.batch["response_mask"].bool()
        torch.testing.assert_close(lp2[mask], lp1[mask], atol=1e-5, rtol=0)
        m1 = actor1.update_policy(data)
        after1 = _full_params(engine1.module)
        assert m2["actor/grad_norm"][0] == pytest.approx(m1["actor/grad_norm"][0], rel=1e-4)
        visual = [n for n in after1 if ".visual." in n or n.startswith("model.visual")]
        assert visual and any(not torch.equal(after1[n], before[n]) for n in visual)  # the tower trained
        # With eps 1e-8, Adam's first step is lr * sign(g): float noise in a gradient near zero flips
        # a weight by 2 lr. With EPS it is smooth in g, so the weights must agree to a small fraction
        # of lr (pixels routed to the wrong rows move weights by ~lr)
        moved = max((after1[n] - before[n]).abs().max().item() for n in visual)
        assert moved > 100 * 1e-3 * LR
        for name, value in after1.items():
            torch.testing.assert_close(
                after2[name], value, atol=1e-3 * LR, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
    dist.barrier()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_grpo_update_two_ranks_equals_one_rank_with_images(tmp_path, family):
    from hybridrl.models.vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "model", family, seed=1)
    spawn(_checks, 2, tmp_path, model_dir)
