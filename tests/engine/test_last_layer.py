"""engine/last_layer.py: the last layer's MLP on the read positions only, against the full forward."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import hybridrl.engine.forward as forward
from hybridrl.engine.last_layer import last_dense_mlp, last_layer_rows
from tests.engine.test_prefix_group import grouped_batch
from tests.fsdp_testkit import VOCAB


def reward_model(layers: int = 2):
    from transformers import AutoModelForTokenClassification, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(3)
    return AutoModelForTokenClassification.from_config(cfg).float().eval()


@pytest.mark.parametrize("layers", [1, 2])
def test_scores_and_gradients_equal_the_full_forward(monkeypatch, layers):
    rm = reward_model(layers)
    batch = grouped_batch(group_sizes=(3, 2, 2), seed=1)
    keep = batch["response_mask"].sum(-1) > 0
    batch = {k: v[keep] for k, v in batch.items()}
    weight = torch.linspace(-1, 1, int(keep.sum()))
    seen: list[int] = []
    rm.model.layers[-1].mlp.down_proj.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].shape[1])
    )
    results = []
    for pruned in (False, True):
        if not pruned:
            monkeypatch.setattr(forward, "last_layer_rows", lambda *_a: contextlib.nullcontext(False))
        else:
            monkeypatch.undo()
        rm.zero_grad()
        scores = forward.forward_scores(rm, batch, prefix_group=True)
        (scores * weight).sum().backward()
        results.append((scores.detach(), {n: p.grad.clone() for n, p in rm.named_parameters()}))
    (full, g_full), (pruned, g_pruned) = results
    assert seen[0] > len(weight) and seen[1] == len(weight)  # every packed position, then one per row
    assert full.std() > 0
    torch.testing.assert_close(pruned, full, atol=1e-5, rtol=1e-5)
    for name, g in g_full.items():
        torch.testing.assert_close(g_pruned[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_the_full_forward_is_kept_where_the_mlp_is_not_a_dense_one():
    rm = reward_model()
    assert last_dense_mlp(rm) is rm.model.layers[-1].mlp

    class SparseMoeBlock(nn.Module):
        def forward(self, x):
            return x, None

    rm.model.layers[-1].mlp = SparseMoeBlock()
    assert last_dense_mlp(rm) is None
    with last_layer_rows(rm, torch.tensor([0])) as applied:
        assert not applied
    compiled = reward_model()
    compiled.model.layers[-1].compile()
    assert last_dense_mlp(compiled) is None
    assert last_dense_mlp(nn.Linear(2, 2)) is None
