"""Ulysses SP=2 with a vision-language model on 2 real FSDP2 ranks (gloo): SP=2 == packed == padded.

Tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL from configs. Every rank of the SP group runs the vision
tower and the embedding on the whole packed row; the text tower runs on each rank's slice of the
embedded row and of the (4, 1, nnz) 3-D rotary positions (`multimodal.text_tower_on_slice`; for
Qwen3-VL also of its deepstack image-token mask and features). The
rows: two images of different sizes (so the image tokens straddle the slice boundary), a text-only
row, and a response that sampled an image token (fed as text). Checked: log-probs and entropy
(fp32, 1e-5) against the padded and the packed forward, and the gradient of one mini-batch (every
parameter, the vision tower's included) against SP=1 over 2 data-parallel ranks.
"""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import spawn  # noqa: E402

pytest.importorskip("PIL")
ROWS, P, T = 4, 40, 6
TOL = dict(atol=1e-5, rtol=1e-5)


def _batch(model_dir):
    """ROWS rows: images 56x56 (two) and 84x56, one text-only prompt; random text responses, one of
    which holds a sampled <|image_pad|>; GRPO-style advantages."""
    from PIL import Image

    from hybridrl.data import visual_task
    from hybridrl.data.multimodal import process_row
    from hybridrl.models.vlm import IMAGE_PAD, load_processor
    from hybridrl.protocol import DataProto

    processor = load_processor(model_dir)
    tok = processor.tokenizer
    rows = visual_task.make_rl_rows(3, seed=3)
    rows[1]["images"] = [Image.new("RGB", (84, 56), (0, 200, 0))]
    ids, mms = [], []
    for r in rows:
        _, row_ids, mm = process_row(processor, r["prompt"], r["images"], "row", {}, {})
        ids.append(row_ids)
        mms.append(mm)
    text = [{"role": "user", "content": "no picture"}]
    ids.append(tok.apply_chat_template(text, add_generation_prompt=True, tokenize=True, return_dict=False))
    mms.append({})
    g = torch.Generator().manual_seed(4)
    input_ids = torch.full((ROWS, P + T), tok.pad_token_id)
    mask = torch.zeros(ROWS, P + T, dtype=torch.long)
    for i, (row, n) in enumerate(zip(ids, [T, 3, 5, 4])):
        assert len(row) <= P, len(row)
        input_ids[i, P - len(row) : P] = torch.tensor(row)
        mask[i, P - len(row) : P + n] = 1
        input_ids[i, P : P + n] = torch.randint(10, 40, (n,), generator=g)
    input_ids[0, P + 2] = tok.convert_tokens_to_ids(IMAGE_PAD)  # sampled by the policy: a text token
    r_mask = mask[:, P:]
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, P:].contiguous(),
        "response_mask": r_mask.contiguous(),
        "advantages": (torch.randn(ROWS, 1, generator=g).expand(ROWS, T) * r_mask).contiguous(),
    }
    import numpy as np

    return DataProto.from_dict(batch, non_tensors={"multi_modal_inputs": np.array(mms, dtype=object)})


def _grads(module):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in module.named_parameters()
        if p.grad is not None
    }


def _checks(rank, world, model_dir):
    import torch.distributed as dist

    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.ulysses import SPGroup, parallelize_sp
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    model = dataclasses.replace(ModelConfig(), path=model_dir, use_remove_padding=True)
    cfg = ActorConfig(fsdp_config=fsdp, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2,
                      optim=OptimConfig(lr=1e-2, eps=1e-3, clip_grad=0.0),
                      ulysses_sequence_parallel_size=2)  # fmt: skip
    e1 = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    e2 = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    sp = SPGroup(dist.group.WORLD, rank, world)
    parallelize_sp(e2.module, sp)
    s1 = normalize_actor_batch_sizes(
        dataclasses.replace(cfg, ulysses_sequence_parallel_size=1), rollout_n=1, dp_size=2
    )
    a1 = PPOActor(cfg, e1.module, e1.optimizer, dp_size=2, batch_sizes=s1, use_remove_padding=True)
    s2 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2)
    a2 = PPOActor(cfg, e2.module, e2.optimizer, dp_size=1, batch_sizes=s2, use_remove_padding=True, sp=sp)
    data = _batch(model_dir)
    mask = data.batch["response_mask"].bool()
    padded = PPOActor(None, e1.module, dp_size=1, use_remove_padding=False)
    ref = padded.compute_log_prob(data, calculate_entropy=True, micro_batch_size=ROWS)
    packed = a1.compute_log_prob(data, calculate_entropy=True, micro_batch_size=ROWS)
    torch.testing.assert_close(packed.log_probs[mask], ref.log_probs[mask], **TOL)
    torch.testing.assert_close(packed.entropy[mask], ref.entropy[mask], **TOL)
    for micro in (ROWS, 1):  # one packed row of every sequence; one sequence a row
        res = a2.compute_log_prob(data, calculate_entropy=True, micro_batch_size=micro)
        torch.testing.assert_close(res.log_probs[mask], ref.log_probs[mask], **TOL)
        torch.testing.assert_close(res.entropy[mask], ref.entropy[mask], **TOL)
    data.batch["old_log_probs"] = ref.log_probs
    # the actor's own mini-batch preparation (it attaches the rows' pixel inputs)
    a1.forward_backward(a1._select_train_keys(data.chunk(2)[rank]))
    g1 = _grads(e1.module)
    a2.forward_backward(a2._select_train_keys(data))
    g2 = _grads(e2.module)
    visual = [n for n in g1 if "visual" in n]
    assert visual and set(g2) == set(g1)
    assert max(float(g1[n].abs().max()) for n in visual) > 1e-6  # the vision tower gets a gradient
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
    dist.barrier()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_ulysses_sp2_equals_packed_equals_padded_with_images(tmp_path, family):
    from hybridrl.models.vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "model", family, seed=1)
    spawn(_checks, 2, tmp_path, model_dir)
