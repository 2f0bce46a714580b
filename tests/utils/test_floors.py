"""Per-phase floors (`trainer.log_floors`): the shapes, the fraction math, the step metrics."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.metrics import compute_timing_metrics
from hybridrl.trainer.ppo.step_floors import StepFloors, measure_step_floors
from hybridrl.utils.floors import Floors, ModelShapes, measure_floors, phase_fractions, update_flops

SHAPES = ModelShapes(hidden=4, inter=8, kv=2, vocab=10, layers=1, q=4)
# body = 1 * (2*4*4 + 2*4*2 + 3*4*8) = 32 + 16 + 96 = 144; head = 10 * 4 = 40
FLOORS = Floors(SHAPES, gemm_peak_flops=1e6, decode_rows=8, decode_step_s=0.01, decode_form="linear")


def test_shapes_count_the_linear_parameters_of_a_real_model():
    cfg = Qwen2Config(
        vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    s = ModelShapes.of(cfg)
    assert s.body_params == sum(m.weight.numel() for m in linears)
    assert s.head_params == model.lm_head.weight.numel()
    assert sorted(s.decode_linears()) == sorted([tuple(m.weight.shape) for m in linears] + [(50, 64)])


def test_update_flops_and_fractions_by_hand():
    assert SHAPES.body_params == 144 and SHAPES.head_params == 40
    assert update_flops(SHAPES, all_tokens=100, response_tokens=30) == 6 * (144 * 100 + 40 * 30)  # 93600
    out = phase_fractions(
        FLOORS, all_tokens=100, response_tokens=30, update_s=0.1, gen_s=0.05, ranks=2, epochs=2
    )
    assert out["perf/floor/update_frac_of_gemm_peak"] == pytest.approx(2 * 93600 / (0.1 * 2 * 1e6))  # 0.936
    assert FLOORS.decode_bound_tokens_per_s == pytest.approx(800)
    assert out["perf/floor/gen_frac_of_decode_bound"] == pytest.approx(30 / (0.05 * 2 * 800))  # 0.375
    assert out["perf/floor/gemm_peak_gflops"] == pytest.approx(1e-3)
    none = phase_fractions(FLOORS, all_tokens=100, response_tokens=30, update_s=None, gen_s=0.0)
    assert (
        "perf/floor/update_frac_of_gemm_peak" not in none
        and "perf/floor/gen_frac_of_decode_bound" not in none
    )
    with pytest.raises(ValueError, match="ranks and epochs must be >= 1"):
        phase_fractions(FLOORS, all_tokens=1, response_tokens=1, update_s=1, gen_s=1, ranks=0)


def _batch():
    """2 rows: prompts of 3 and 2 valid tokens, responses of 2 and 4: 5 + 6 = 11 tokens, 6 of them response."""
    attn = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])
    return DataProto.from_dict({"responses": torch.ones(2, 4, dtype=torch.long), "attention_mask": attn,
                                "response_mask": attn[:, -4:]})  # fmt: skip


def test_step_metrics_take_the_weight_sync_out_of_generation():
    step = StepFloors(FLOORS, ranks=1, rollout_ranks=1, epochs=1)
    timing = {"gen": 0.02, "update_weights": 0.01, "update_actor": 0.5, "step": 1.0}
    out = compute_timing_metrics(_batch(), timing, step)
    assert out["perf/floor/gen_frac_of_decode_bound"] == pytest.approx(6 / (0.01 * 800))
    assert out["perf/floor/update_frac_of_gemm_peak"] == pytest.approx(6 * (144 * 11 + 40 * 6) / (0.5 * 1e6))
    assert "timing_s/gen" in out
    assert not any(k.startswith("perf/floor/") for k in compute_timing_metrics(_batch(), timing))


def test_the_shared_prompt_forward_counts_each_distinct_prompt_once():
    """With `actor.use_prefix_grouper` on, the update's FLOPs are those of the tokens its forward
    computes: 4 rows of two prompts (3 and 2 valid tokens, padding differs in id but not in mask),
    each prompt once: 3 + 2 = 5 prompt tokens, not 10; responses 2 + 4 + 1 + 3 = 10."""
    p1, p2 = [0, 7, 8, 9], [0, 0, 5, 6]
    ids = torch.tensor([p1 + [1, 1, 0, 0], p2 + [1, 1, 1, 1], p1 + [2, 0, 0, 0], p2 + [3, 3, 3, 0]])
    p_mask = (torch.tensor([p1, p2, p1, p2]) > 0).long()
    r_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    ids[2, 0] = 4  # another pad id under a 0 mask: still the same prompt
    batch = DataProto.from_dict({"input_ids": ids, "responses": ids[:, 4:],
                                 "attention_mask": torch.cat([p_mask, r_mask], 1), "response_mask": r_mask})  # fmt: skip
    timing = {"gen": 0.02, "update_actor": 0.5}
    shared = StepFloors(FLOORS, ranks=1, rollout_ranks=1, epochs=1, shared_prompts=True)
    plain = StepFloors(FLOORS, ranks=1, rollout_ranks=1, epochs=1)
    got = compute_timing_metrics(batch, timing, shared)["perf/floor/update_frac_of_gemm_peak"]
    assert got == pytest.approx(6 * (144 * (5 + 10) + 40 * 10) / (0.5 * 1e6))
    every_row = compute_timing_metrics(batch, timing, plain)["perf/floor/update_frac_of_gemm_peak"]
    assert every_row == pytest.approx(6 * (144 * (10 + 10) + 40 * 10) / (0.5 * 1e6))
    # the generation fraction does not change: it counts response tokens only
    assert (
        compute_timing_metrics(batch, timing, shared)["perf/floor/gen_frac_of_decode_bound"]
        == compute_timing_metrics(batch, timing, plain)["perf/floor/gen_frac_of_decode_bound"]
    )


def test_measured_floors_are_positive_and_rows_are_checked():
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    f = measure_floors(cfg, decode_rows=4, seconds=0.05)
    assert f.gemm_peak_flops > 1e6 and f.decode_step_s > 0
    assert f.decode_form in ("linear", "onednn", "onednn_packed") and f.gemm_form in ("matmul", "onednn")
    with pytest.raises(ValueError, match="decode_rows must be >= 1"):
        measure_floors(cfg, decode_rows=0)


def test_log_floors_key_off_by_default_and_measured_when_on(capsys):
    from hydra import compose, initialize_config_module

    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.trainer.ppo.config import load_config

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        config = load_config(compose("ppo_trainer"), explicit_keys=set())
    assert config.trainer.log_floors is False and measure_step_floors(config) is None
    config.trainer.log_floors = True
    config.actor_rollout_ref.model.path = resolve_model_path(config.actor_rollout_ref.model.path)
    step = measure_step_floors(config, seconds=0.05)
    assert step.floors.decode_rows == config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    assert step.epochs == config.actor_rollout_ref.actor.ppo_epochs and step.ranks == 1
    assert "trainer.log_floors: GEMM peak" in capsys.readouterr().out


def test_log_floors_takes_a_bool_only():
    from hybridrl.trainer.ppo.config import load_config
    from hybridrl.utils.config_loader import ConfigError

    with pytest.raises(ConfigError, match="trainer.log_floors"):
        load_config(["trainer.log_floors=sometimes"])


def test_main_async_refuses_log_floors():
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.async_ppo.config import load_async_config
    from hybridrl.utils.config_loader import ConfigError

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=["trainer.log_floors=true"])
    with pytest.raises(ConfigError, match="trainer.log_floors=true is not supported by main_async"):
        load_async_config(cfg, explicit_keys={"trainer.log_floors"})
