"""LoRA with `model.exclude_modules` (veRL's key): the excluded modules get no adapter, on a tiny
Qwen2-VL (the vision tower) and on the built-in text model (the MLPs); bad values are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.config.roles import ModelConfig
from hybridrl.models.hf import build_hf_model


def _adapted(model) -> set[str]:
    """Names of the modules that carry a LoRA adapter."""
    return {n for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def vlm_dir(request, tmp_path_factory):
    pytest.importorskip("PIL")
    from hybridrl.models.vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("lora_vlm") / "model", request.param, seed=0)


def test_exclude_the_vision_tower_of_a_vlm(vlm_dir):
    cfg = dataclasses.replace(ModelConfig(), path=vlm_dir, lora_rank=4, target_modules="all-linear")
    every = _adapted(build_hf_model(cfg))
    assert any(".visual." in n for n in every), sorted(every)[:8]  # all-linear reaches the tower
    kept = _adapted(build_hf_model(dataclasses.replace(cfg, exclude_modules=".*visual.*")))
    assert kept and not any(".visual." in n for n in kept)
    assert kept == {n for n in every if ".visual." not in n}  # nothing else was dropped


def test_exclude_a_list_of_names_on_the_text_model():
    cfg = dataclasses.replace(ModelConfig(), lora_rank=4, target_modules="all-linear")  # builtin:tiny
    every = _adapted(build_hf_model(cfg))
    model = build_hf_model(dataclasses.replace(cfg, exclude_modules=["gate_proj", "up_proj", "down_proj"]))
    kept = _adapted(model)
    assert any(n.endswith("mlp.up_proj") for n in every)
    assert kept == {n for n in every if ".mlp." not in n} and kept
    # the excluded layers train nothing; the adapters do
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and not any(".mlp." in n for n in trainable)


def test_a_lora_vlm_without_the_tower_adapters_runs_the_forward(vlm_dir):
    """Log-probs through the PEFT-wrapped VLM (the vision tower unadapted) with images."""
    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.engine.multimodal import attach_multimodal
    from hybridrl.models.vlm import load_processor
    from tests.workers.test_vlm_forward import T, _batch

    cfg = dataclasses.replace(ModelConfig(), path=vlm_dir, lora_rank=4, exclude_modules=".*visual.*")
    model = build_hf_model(cfg).eval()
    data, *_ = _batch(load_processor(vlm_dir))
    batch = attach_multimodal(data.batch.clone(), data)
    with torch.no_grad():
        out = forward_log_probs(model, batch, use_remove_padding=True)
    mask = data.batch["attention_mask"][:, -T:].bool()
    assert torch.isfinite(out.log_probs[mask]).all()


@pytest.mark.parametrize(
    "value, lora_adapter_path, match",
    [
        (3, None, "use a regex string"),
        ([], None, "use a regex string"),
        (["q_proj", 1], None, "use a regex string"),
        (".*visual.*", "/some/adapter", "the saved adapter's own targets apply"),
    ],
)
def test_bad_exclude_modules_are_refused(value, lora_adapter_path, match):
    cfg = dataclasses.replace(
        ModelConfig(), lora_rank=4, exclude_modules=value, lora_adapter_path=lora_adapter_path
    )
    with pytest.raises(ValueError, match=match) as info:
        cfg.validate()
    assert "actor_rollout_ref.model.exclude_modules" in str(info.value)


def test_exclude_modules_is_a_config_key_checked_at_start_up(tmp_path):
    from hybridrl.utils.config_loader import ConfigError
    from tests.e2e.ppo_runs import compose_config

    key = "actor_rollout_ref.model"
    config = compose_config([f"{key}.lora_rank=4", f"{key}.exclude_modules=[up_proj,down_proj]"], tmp_path)
    assert list(config.actor_rollout_ref.model.exclude_modules) == ["up_proj", "down_proj"]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.exclude_modules=3: use a regex"):
        compose_config([f"{key}.lora_rank=4", f"{key}.exclude_modules=3"], tmp_path)
