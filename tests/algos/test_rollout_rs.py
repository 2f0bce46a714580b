"""veRL's rejection options (token_k1, seq_max_k2, ...) and the bypass-mode loss, hand-derived."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl import algos
from hybridrl.algos.rollout_rs import bypass_is_weights, compute_policy_loss_bypass_mode, parse_kl_rs


def test_parse_specs_per_option_and_shared():
    assert parse_kl_rs("token_k1,seq_max_k2", "0.6_1.6,2.5") == [
        ("token_k1", 0.6, 1.6),
        ("seq_max_k2", None, 2.5),
    ]
    assert parse_kl_rs("token_k1,token_k1", "2") == [("token_k1", 0.5, 2.0)]  # duplicates once; U -> 1/U_U
    assert parse_kl_rs("token_k3,seq_mean_k2", "0.1") == [("token_k3", None, 0.1), ("seq_mean_k2", None, 0.1)]
    for rs, thr, msg in [
        ("token_k9", "1", "not among"),
        ("token_k1", None, "required"),
        ("token_k1,token_k2", "1,2,3", "3 specs for 2"),
        ("seq_max_k2", "0.5_2", "no '_'"),
        ("token_k1", "0_2", "> 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_kl_rs(rs, thr)
    assert algos.is_kl_rs("token_k1, seq_max_k2") and not algos.is_kl_rs("token") and not algos.is_kl_rs(None)


def test_rejection_mask_by_hand():
    # log pi - log mu per token; response 1 has 3 tokens, response 2 has 2
    lr = torch.tensor([[0.0, math.log(2.0), 0.1], [0.2, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # token_k1 = -lr must lie in [log 0.6, log 1.6] = [-0.511, 0.470]: -log 2 = -0.693 is rejected
    keep, m = algos.compute_rollout_rejection_mask(lr, mask, "token_k1", "0.6_1.6")
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]))
    torch.testing.assert_close(m["rollout_rs_masked_fraction"], torch.tensor(1 / 5))
    # seq_max_k2: max 0.5 lr^2 = 0.5 (log 2)^2 = 0.240 for response 1, 0.02 for response 2
    keep, _ = algos.compute_rollout_rejection_mask(lr, mask, "seq_max_k2", "0.1")
    torch.testing.assert_close(keep, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    # both options: the AND of the two
    keep, m = algos.compute_rollout_rejection_mask(lr, mask, "token_k1,seq_max_k2", "0.6_1.6,2.5")
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]))
    assert "rollout_rs_token_k1_mean" in m and "rollout_rs_seq_max_k2_masked_fraction" in m
    # seq_sum_k1 over response 1: -(0 + log 2 + 0.1) = -0.793 < log 0.6: rejected; response 2: -0.1 kept
    keep, _ = algos.compute_rollout_rejection_mask(lr, mask, "seq_sum_k1", "0.6_1.6")
    torch.testing.assert_close(keep, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_bypass_is_weights_sequence_and_batch_normalised():
    lr = torch.tensor([[0.1, 0.2], [math.log(5.0), 0.0]])
    mask = torch.ones(2, 2)
    w = bypass_is_weights(lr, mask, "sequence", 2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.3)] * 2, [2.0, 2.0]]))  # truncated at 2
    wn = bypass_is_weights(lr, mask, "sequence", 2.0, batch_normalize=True)
    torch.testing.assert_close(wn, w / ((math.exp(0.3) + 2.0) / 2))


def test_bypass_reinforce_and_ppo_clip():
    g = torch.Generator().manual_seed(0)
    rollout_lp = -torch.rand(3, 4, generator=g)
    log_prob = (rollout_lp + 0.2 * torch.randn(3, 4, generator=g)).requires_grad_()
    adv = torch.randn(3, 4, generator=g)
    mask = torch.ones(3, 4)
    mask[2, 3] = 0
    kw = dict(bypass_rollout_rs="token_k1", bypass_rollout_rs_threshold="0.9_1.1")
    keep, _ = algos.compute_rollout_rejection_mask(
        (log_prob.detach() - rollout_lp) * mask, mask, "token_k1", "0.9_1.1"
    )
    assert 0 < keep.sum() < mask.sum()  # some tokens rejected
    loss, m = compute_policy_loss_bypass_mode(
        rollout_lp, log_prob, adv, mask, bypass_loss_type="reinforce", bypass_rollout_is="token", **kw
    )
    w = (log_prob.detach() - rollout_lp).exp().clamp(max=2.0)
    want = (-(adv * log_prob * w) * keep).sum() / keep.sum()  # token-mean over the kept tokens
    torch.testing.assert_close(loss, want)
    assert "bypass_is_mean" in m and "rollout_rs_masked_fraction" in m
    loss_clip, _ = compute_policy_loss_bypass_mode(
        rollout_lp,
        log_prob,
        adv,
        mask,
        bypass_loss_type="ppo_clip",
        rollout_is_weights=torch.zeros(3, 4),
        **kw,
    )
    want_clip, _ = algos.compute_policy_loss_vanilla(rollout_lp, log_prob, adv, keep)
    torch.testing.assert_close(loss_clip, want_clip)  # the ratio is the correction; no IS weight applied
    with pytest.raises(ValueError, match="loss_type"):
        compute_policy_loss_bypass_mode(rollout_lp, log_prob, adv, mask, bypass_loss_type="x")
