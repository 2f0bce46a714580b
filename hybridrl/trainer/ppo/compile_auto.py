"""`actor_rollout_ref.actor.fsdp_config.compile_layers`: true / false as given, null (auto) decided here.

`compile_layers=true` compiles every decoder layer of the actor with `torch.compile(dynamic=True)`
(engine/fsdp.compile_decoder_layers). Whether that pays depends on the model and on the
length of the run, so `null` (hybridrl's default for the actor; veRL has no such key) turns it on
only where it was measured to pay (bench/compile_layers.py and
bench/compare_trl.py --variants compiled, 2 CPU cores, fp32):

- ~100M-parameter Qwen2 (real100m), padded forward: the update 0.79x eager at 48 new tokens,
  0.90x at 256; 16-25 s of compile in the first step, earned back after 15-25 steps;
- the same model with GRPO's shared-prompt forward (4 x 4 rows): 1.03x at 256 (0.85, 1.10,
  1.03): no gain, because its attention runs eagerly between the compiled halves of each layer;
- ~30M Qwen2: no gain (1.02x) for the same 25 s of compile; the built-in 0.5M model: ~20 s per
  graph against 0.55 s steps.

So auto is on for a text-only causal LM of at least `MIN_PARAMS` parameters (estimated from
config.json, embeddings included), trained by the FSDP engine on one CPU rank with the padded
forward (no shared-prompt forward, no remove-padding) for at least `MIN_STEPS` steps, without
LoRA or gradient checkpointing, with a C++ compiler on the PATH (Inductor's CPU backend needs
one). Multi-rank runs, LoRA and checkpointing were not measured compiled; `true` still compiles
them. Otherwise it is off. The decision and its reason are printed once; the config then holds a
plain bool, so the workers see what the driver decided.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from typing import Any

from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.floors import ModelShapes

KEY = "actor_rollout_ref.actor.fsdp_config.compile_layers"
MIN_PARAMS = 80_000_000
MIN_STEPS = 50
FSDP_STRATEGIES = ("fsdp", "fsdp2")


def estimate_params(model_json: dict) -> int | None:
    """Parameters of a decoder-only model from its config.json: the decoder layers' linears
    (`utils/floors.ModelShapes`, the FLOP model's count) plus the embedding (and an untied head).
    Norms and biases are left out (well under 1%). None when the config lacks one of the sizes."""
    try:
        shapes = ModelShapes.of(SimpleNamespace(**model_json))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    tied = bool(model_json.get("tie_word_embeddings", False))
    return shapes.body_params + shapes.head_params * (1 if tied else 2)


def auto_decision(config: Any, model_json: dict | None, on_gpu: bool) -> tuple[bool, str]:
    """(on, reason) of `compile_layers: null` for this run.

    Args:
        config: the PPO config, with `trainer.total_training_steps` already computed.
        model_json: the actor model's config.json, or None when it could not be read.
        on_gpu: whether the workers run on GPUs.
    """
    arr = config.actor_rollout_ref
    steps = config.trainer.total_training_steps
    if arr.actor.strategy not in FSDP_STRATEGIES:
        return False, f"actor.strategy={arr.actor.strategy}: compile_layers is a key of the FSDP engine"
    if on_gpu:
        return False, "on GPUs (not measured there); set it to true to compile"
    ranks = config.trainer.nnodes * config.trainer.n_gpus_per_node
    if ranks > 1:
        return False, f"{ranks} training ranks (measured on one rank only); set it to true to compile"
    if model_json is None:
        return False, f"the model config of {arr.model.path!r} cannot be read here"
    if "vision_config" in model_json or "text_config" in model_json:
        return False, "a vision-language model (not measured compiled)"
    if arr.actor.use_prefix_grouper is True:  # resolved at the config stage (prefix_auto.py)
        return False, (
            "the shared-prompt forward (its attention runs eagerly between the compiled halves of "
            "each layer: measured 1.03x eager at 256 new tokens, no gain)"
        )
    if arr.model.use_remove_padding:
        return False, "the packed forward (use_remove_padding; its attention runs eagerly, not measured)"
    if arr.model.lora_rank > 0 or arr.model.lora_adapter_path:
        return False, "LoRA (not measured compiled)"
    if arr.model.enable_gradient_checkpointing:
        return False, "gradient checkpointing (not measured compiled)"
    params = estimate_params(model_json)
    if params is None or params < MIN_PARAMS:
        size = "an unknown size" if params is None else f"~{params / 1e6:.1f}M parameters"
        return (
            False,
            f"{size}, under {MIN_PARAMS // 1_000_000}M (measured: no gain at 30M, 0.79-0.90x at 100M)",
        )
    if steps is None or steps < MIN_STEPS:
        return False, f"{steps} training steps, under {MIN_STEPS} (the first step compiles: 16-25 s at 100M)"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return False, "no C++ compiler on the PATH (Inductor's CPU backend needs one)"
    return True, f"~{params / 1e6:.0f}M parameters, {steps} steps on CPU (the first step compiles)"


def resolve_compile_layers(config: Any, model_json: dict | None, on_gpu: bool) -> bool:
    """Turn the actor's key into a bool on the driver (mutates `config`); print the decision of
    null (auto) once. The ref, critic and reward model keep theirs (default false).

    Raises:
        ConfigError: a value other than true / false / null.
    """
    fsdp = config.actor_rollout_ref.actor.fsdp_config
    value = fsdp.compile_layers
    if value is True or value is False:
        return value
    if value is not None:
        raise ConfigError(f"{KEY}={value!r}: expected true, false or null (auto, hybridrl's default)")
    on, reason = auto_decision(config, model_json, on_gpu)
    fsdp.compile_layers = on
    print(f"[hybridrl] {KEY}=null (auto) -> {'on' if on else 'off'}: {reason}")
    return on
