"""Single-process checks of the forward helpers, padding removal and model building (no FSDP)."""

import os
import sys

import pytest
import torch
from tensordict import TensorDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, make_tiny_model_dir  # noqa: E402

from hybridrl.config.roles import ModelConfig  # noqa: E402
from hybridrl.engine import forward  # noqa: E402
from hybridrl.engine.fsdp import iter_full_params  # noqa: E402
from hybridrl.models.hf import build_hf_model, load_tokenizer  # noqa: E402
from hybridrl.utils.torch_utils import block_causal_mask, pack_sequences, unpack_sequences  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def _td(batch):
    return TensorDict(batch, batch_size=[batch["input_ids"].shape[0]])


def test_pack_unpack_hand_example():
    ids = torch.tensor([[0, 5, 6], [7, 8, 0]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    packed = pack_sequences(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 2, 4]
    back = unpack_sequences(torch.tensor([1.0, 2.0, 3.0, 4.0]), packed)
    assert back.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
    m = block_causal_mask(torch.tensor([2, 1]), torch.float32, "cpu")[0, 0]
    assert (m == 0).tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    with pytest.raises(ValueError, match="no valid token"):
        pack_sequences(ids, torch.tensor([[0, 0, 0], [1, 1, 0]]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_remove_padding_matches_padded_log_probs(model_dir, attn, monkeypatch):
    model = build_hf_model(ModelConfig(path=model_dir, override_config={"attn_implementation": attn}))
    model.eval()
    batch = _td(make_batch(6, seed=1))
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        _res = forward.forward_log_probs(model, batch, temperature=0.7, calculate_entropy=True)
        lp_pad, ent_pad = _res.log_probs, _res.entropy
        _res = forward.forward_log_probs(
            model, batch, temperature=0.7, calculate_entropy=True, use_remove_padding=True
        )
        lp_rm, ent_rm = _res.log_probs, _res.entropy
        # the explicit 4-D block-diagonal mask (used when transformers cannot detect packing)
        monkeypatch.setattr(forward, "_DETECTS_PACKING", False)
        lp_blk = forward.forward_log_probs(model, batch, temperature=0.7, use_remove_padding=True).log_probs
    torch.testing.assert_close(lp_rm[mask], lp_pad[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_rm[mask], ent_pad[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_blk[mask], lp_pad[mask], atol=1e-5, rtol=0)
    # alignment: row 0 alone, unpadded, through a plain forward
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    n_resp = int(batch["response_mask"][0].sum())
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float() / 0.7
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    torch.testing.assert_close(lp_pad[0, :n_resp], ref[-n_resp:], atol=1e-5, rtol=0)


def test_values_and_scores_alignment(model_dir):
    batch = _td(make_batch(5, seed=2))
    critic = build_hf_model(ModelConfig(path=model_dir), role="critic").eval()
    assert critic.config.num_labels == 1 and critic.config.classifier_dropout == 0.0
    with torch.no_grad():
        v_pad = forward.forward_values(critic, batch)
        v_rm = forward.forward_values(critic, batch, use_remove_padding=True)
        per_token = critic(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[..., 0]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(v_rm[mask], v_pad[mask], atol=1e-5, rtol=0)
    t = batch["responses"].shape[1]
    torch.testing.assert_close(v_pad, per_token[:, -t - 1 : -1])  # the state before each response token

    rm = build_hf_model(ModelConfig(path=model_dir), role="reward").eval()
    with torch.no_grad():
        s_pad = forward.forward_scores(rm, batch)
        s_rm = forward.forward_scores(rm, batch, use_remove_padding=True)
        expected = []
        for i in range(5):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
            expected.append(rm.score(rm.model(input_ids=ids[None]).last_hidden_state)[0, -1, 0])
    torch.testing.assert_close(s_pad, torch.stack(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(s_rm, torch.stack(expected), atol=1e-5, rtol=0)


def test_build_errors(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="no such local folder|no such model folder"):
        build_hf_model(ModelConfig(path=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="override_config.not_an_attr"):
        build_hf_model(ModelConfig(path=model_dir, override_config={"not_an_attr": 1}))
    with pytest.raises(ImportError, match="external_lib='no_such_module_xyz'"):
        build_hf_model(ModelConfig(path=model_dir, external_lib="no_such_module_xyz"))
    with pytest.raises(
        ValueError, match="use_liger=True is not implemented"
    ):  # use_fused_kernels is honoured
        build_hf_model(ModelConfig(path=model_dir, use_liger=True))
    triton = ModelConfig(path=model_dir, use_fused_kernels=True)
    triton.fused_kernel_options.impl_backend = "triton"
    with pytest.raises(ValueError, match="impl_backend='triton'"):
        build_hf_model(triton)
    with pytest.raises(
        FileNotFoundError, match="holds no tokenizer files; set actor_rollout_ref.model.tokenizer_path"
    ):
        load_tokenizer(ModelConfig(path=model_dir))


def test_init_from_scratch_and_override(model_dir):
    a = build_hf_model(ModelConfig(path=model_dir, override_config={"attention_dropout": 0.25}))
    b = build_hf_model(ModelConfig(path=model_dir, init_from_scratch=True))
    assert a.config.attention_dropout == 0.25
    wa, wb = a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight
    assert wa.shape == wb.shape and not torch.equal(wa, wb)


def test_iter_full_params_merges_lora(model_dir):
    model = build_hf_model(
        ModelConfig(path=model_dir, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    merged = dict(iter_full_params(model))
    assert not any("lora" in n for n in merged)
    reference = model.merge_and_unload()
    ref = {n: p for n, p in reference.named_parameters()}
    assert set(merged) == set(ref)
    for n in ref:
        torch.testing.assert_close(merged[n], ref[n].detach(), atol=1e-6, rtol=0)


def test_lora_adapter_path_loads_the_saved_adapter(model_dir, tmp_path):
    """veRL's model.lora_adapter_path: training starts from a saved adapter, not a fresh one."""
    first = build_hf_model(ModelConfig(path=model_dir, lora_rank=4, lora_alpha=8, target_modules=["q_proj"]))
    torch.manual_seed(1)
    for name, p in first.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    first.save_pretrained(str(tmp_path / "adapter"))
    loaded = build_hf_model(ModelConfig(path=model_dir, lora_adapter_path=str(tmp_path / "adapter")))
    fresh = build_hf_model(ModelConfig(path=model_dir, lora_rank=4, lora_alpha=8, target_modules=["q_proj"]))
    want = {n: p for n, p in first.named_parameters() if "lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(want) and all(p.requires_grad for p in got.values())
    for n in want:
        torch.testing.assert_close(got[n], want[n])
    assert all(torch.count_nonzero(p) == 0 for n, p in fresh.named_parameters() if "lora_B" in n)
