"""Start-up checks and the processor of a vision-language run (docs/vlm.md).

The model's processor is loaded beside the tokenizer when `actor_rollout_ref.model.path` is a
vision-language model (its config has a `vision_config`); the multimodal keys are checked here so a
wrong combination fails before any worker starts.
"""

from __future__ import annotations

from typing import Any

from hybridrl.models.builtin import resolve_model_path
from hybridrl.utils.config_loader import ConfigError

ARR = "actor_rollout_ref"


def load_run_processor(config: Any) -> Any:
    """The processor of the run's model (None for a text model), after the VLM start-up checks.

    Raises:
        ConfigError: Megatron with a VLM, `freeze_vision_tower` on a text model, the prefix grouper
        with a VLM it cannot take, `data.return_multi_modal_inputs=False`, a non-HF rollout or external agents
        (`rollout.mode=server`) with a VLM.
    """
    from hybridrl.models.vlm import load_processor

    arr = config.actor_rollout_ref
    model = arr.model
    path = resolve_model_path(model.tokenizer_path or model.path, f"{ARR}.model.path")
    try:
        processor = load_processor(path, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as exc:
        if "://" in path or not _is_local(path):
            return None  # a hub id this machine cannot reach: the tokenizer load reports it
        raise ConfigError(f"{ARR}.model.path={path!r}: cannot load the model's processor: {exc}") from exc
    if processor is None:
        if arr.actor.freeze_vision_tower:
            raise ConfigError(
                f"{ARR}.actor.freeze_vision_tower=True but {path!r} is a text model (no vision tower); "
                f"set {ARR}.actor.freeze_vision_tower=False"
            )
        return None
    _check_vlm_keys(config, path)
    return processor


def _is_local(path: str) -> bool:
    import os

    return os.path.exists(path)


def _check_grouper(path: str, trust_remote_code: bool) -> None:
    """`actor.use_prefix_grouper=True` with a VLM the shared-prompt forward cannot take (outside
    Qwen2-VL / Qwen2.5-VL / Qwen3-VL, `prefix_group.model_refusal`) fails here, naming the reason."""
    from transformers import AutoConfig

    from hybridrl.engine.prefix_group import model_refusal

    refusal = model_refusal(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    if refusal is not None:
        raise ConfigError(f"{ARR}.actor.use_prefix_grouper=True: {refusal}; set it to False (or auto)")


def _check_vlm_keys(config: Any, path: str) -> None:
    arr = config.actor_rollout_ref
    for role in ("actor", "ref"):
        if getattr(arr, role).strategy == "megatron":
            raise ConfigError(
                f"{ARR}.{role}.strategy=megatron with a vision-language model: the Megatron engine has no "
                f"vision tower here; use {ARR}.{role}.strategy=fsdp (or fsdp2)"
            )
    if arr.actor.use_prefix_grouper is True:
        _check_grouper(path, arr.model.trust_remote_code)
    if not config.data.return_multi_modal_inputs:
        raise ConfigError(
            "data.return_multi_modal_inputs=False: the training forward needs each row's pixel inputs "
            "(regenerating them in the rollout is not supported); set it to True"
        )
    if arr.rollout.mode == "server":
        raise ConfigError(
            f"{ARR}.rollout.mode=server with a vision-language model: external agents send token ids "
            "without pixels; use mode=sync or async (the built-in agent loops take images, docs/vlm.md)"
        )
    if arr.rollout.name == "vllm":
        _refuse_vllm_images()
    if arr.rollout.name != "hf":
        raise ConfigError(
            f"{ARR}.rollout.name={arr.rollout.name!r} with a vision-language model: only the HF rollout "
            f"takes images so far; set {ARR}.rollout.name=hf"
        )


def _refuse_vllm_images() -> None:
    """`rollout.name=vllm` with a VLM: refused with the exact reason (models/vlm.py)."""
    from hybridrl.models.vlm import refuse_vllm_images

    try:
        refuse_vllm_images(f"{ARR}.rollout.name")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
