"""Equality with TRL: on the same model and batch, our reward-model loss and DPO / IPO losses and
their gradients equal those of TRL's RewardTrainer and DPOTrainer (`compute_loss` / `_compute_loss`)
to 1e-5. Our side is the path main_rm / main_dpo take: the pairs in the veRL layout
(`pair_batch`), the engines' forward functions (`forward_scores`, `forward_log_probs`), with and
without the shared-prompt forward (`model.use_prefix_grouper`), then algos/preference.py. TRL gets
its own right-padded rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

PAIRS = [
    {"prompt": "12+34=", "chosen": "#### 46", "rejected": "#### 45"},
    {"prompt": "70+19=", "chosen": "#### 89", "rejected": "#### 98"},
    {"prompt": "55+55=", "chosen": "#### 110", "rejected": "110"},
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    return AutoTokenizer.from_pretrained(get_builtin_model_path())


@pytest.fixture(scope="module")
def batch(tok, tmp_path_factory):
    import json

    from hybridrl.data.preference import PreferenceDataConfig, PreferenceDataset, pad_pairs, pair_batch

    path = tmp_path_factory.mktemp("trl") / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in PAIRS))
    ds = PreferenceDataset(str(path), tok, PreferenceDataConfig())
    items = [ds[i] for i in range(len(ds))]
    return {"trl": pad_pairs(items, tok.pad_token_id), "ours": pair_batch(items, tok.pad_token_id)}


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def trl_args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=2, **kw)


@pytest.mark.parametrize("shared_prompt", [False, True], ids=["plain", "shared_prompt"])
def test_reward_loss_and_gradients_equal_trl(tok, batch, tmp_path, shared_prompt):
    pytest.importorskip("datasets", reason="datasets is not installed (pip install -e .[bench])")
    pytest.importorskip("trl", reason="trl is not installed (pip install -e .[bench])")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification
    from trl import RewardConfig, RewardTrainer

    from hybridrl.algos.preference import bradley_terry_loss
    from hybridrl.engine.forward import forward_scores
    from hybridrl.models.builtin import get_builtin_model_path

    torch.manual_seed(0)
    ours = AutoModelForTokenClassification.from_pretrained(get_builtin_model_path(), num_labels=1)
    with torch.no_grad():
        ours.score.bias.zero_()
        ours.score.weight.normal_(0, 0.2)
    theirs = AutoModelForSequenceClassification.from_pretrained(get_builtin_model_path(), num_labels=1)
    theirs.config.pad_token_id = tok.pad_token_id
    theirs.load_state_dict({k: v for k, v in ours.state_dict().items() if k != "score.bias"})
    ours.eval(), theirs.eval()  # dropout off on both sides
    trainer = RewardTrainer(
        model=theirs,
        args=trl_args(RewardConfig, tmp_path, center_rewards_coefficient=0.01),
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=tok,
    )
    n = len(PAIRS)
    margin = torch.tensor([0.0, 0.5, 1.0])
    rows = batch["trl"]
    inputs = {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"], "margin": margin}
    trl_loss = trainer.compute_loss(theirs, dict(inputs))
    trl_loss.backward()
    scores = forward_scores(ours, batch["ours"], prefix_group=shared_prompt)
    loss, _ = bradley_terry_loss(scores[:n], scores[n:], margin=margin, center_rewards_coefficient=0.01)
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) < 1e-5
    g_ours, g_trl = grads(ours), grads(theirs)
    assert set(g_trl) <= set(g_ours)
    for name, g in g_trl.items():
        torch.testing.assert_close(
            g_ours[name], g, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("shared_prompt", [False, True], ids=["plain", "shared_prompt"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_losses_and_gradients_equal_trl(tok, batch, tmp_path, loss_type, shared_prompt):
    pytest.importorskip("datasets", reason="datasets is not installed (pip install -e .[bench])")
    pytest.importorskip("trl", reason="trl is not installed (pip install -e .[bench])")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from hybridrl.algos.preference import dpo_loss, sequence_log_probs
    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.models.builtin import get_builtin_model_path

    # float64: the shared-prompt forward sums a shared prompt token's gradient in another order,
    # which in float32 alone moves IPO's larger gradients by ~1e-5
    ours = AutoModelForCausalLM.from_pretrained(get_builtin_model_path(), dtype=torch.float64)
    theirs = copy.deepcopy(ours)
    ref = copy.deepcopy(ours)
    with torch.no_grad():  # a policy one step away from its reference
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
        theirs.load_state_dict(ours.state_dict())
    beta = 0.2
    trainer = DPOTrainer(
        model=theirs,
        args=trl_args(DPOConfig, tmp_path, loss_type=[loss_type], beta=beta, precompute_ref_log_probs=True),
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=tok,
    )
    n = len(PAIRS)
    mb, mask = batch["ours"], batch["ours"]["response_mask"]
    with torch.no_grad():
        ref_logps, lengths = sequence_log_probs(forward_log_probs(ref, mb, temperature=1.0).log_probs, mask)
    rows = batch["trl"]
    inputs = {
        "input_ids": rows["input_ids"],
        "attention_mask": rows["attention_mask"],
        "completion_mask": rows["loss_mask"],
        "ref_chosen_logps": ref_logps[:n],
        "ref_rejected_logps": ref_logps[n:],
    }
    theirs.eval()
    trl_loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    trl_loss.backward()
    ours.eval()
    out = forward_log_probs(ours, mb, temperature=1.0, prefix_group=shared_prompt)
    logps, _ = sequence_log_probs(out.log_probs, mask)
    loss, _ = dpo_loss(
        logps[:n], logps[n:], ref_logps[:n], ref_logps[n:],
        chosen_lengths=lengths[:n], rejected_lengths=lengths[n:], loss_type=loss_type, beta=beta,
    )  # fmt: skip
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) < 1e-5, (loss.item(), trl_loss.item())
    assert loss.item() > 1e-3  # the policy differs from the reference: a non-trivial value
    g_ours, g_trl = grads(ours), grads(theirs)
    assert g_trl and set(g_trl) == set(g_ours)
    for name, g in g_trl.items():
        torch.testing.assert_close(
            g_ours[name], g, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )
