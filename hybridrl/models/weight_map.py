"""Weight names and dtypes between the training model (HF names) and inference engines.

The trainer streams `(hf_name, full_tensor)` pairs (e.g. from the FSDP engine's
`iter_full_params`). Before an engine loads them, each pair goes through a *name map* and a
dtype cast:

- wrapper prefixes that training adds are stripped (`_orig_mod.` from torch.compile,
  `_checkpoint_wrapped_module.` from activation checkpointing, `_fsdp_wrapped_module.` from
  FSDP1; and a leading `module.` from DDP);
- the per-engine map renames what is left. HF `generate` and vLLM / SGLang both load HF
  checkpoint names themselves (their `load_weights` fuses q/k/v and gate/up), so their maps
  are the identity. An engine whose parameter names differ registers its own map with
  `register_weight_name_map(engine, fn)`; `fn(name) -> new name | None` (None drops the tensor);
- tied output embeddings (`tie_word_embeddings`): sources differ (`named_parameters()` yields
  only the input embedding, `state_dict()` yields both names), so `tied_lm_head` normalises
  them: "drop" removes `lm_head.weight` (engines whose LM head shares the embedding storage,
  e.g. HF), "mirror" removes it and re-emits the input embedding under `lm_head.weight`
  right after it (vLLM, whose LM head is a layer of its own with a kernel-format copy on CPU
  that must be rebuilt on every update), "keep" passes names through;
- floating-point tensors are cast to the engine dtype; integer buffers keep their dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from hybridrl.utils.torch_utils import dtype_name, str_to_dtype

__all__ = [
    "dtype_name",
    "WRAPPER_PREFIXES",
    "get_weight_name_map",
    "map_named_tensors",
    "register_weight_name_map",
    "split_fused_experts",
    "strip_wrapper_prefixes",
    "to_torch_dtype",
]

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
LEADING_PREFIXES = ("module.",)  # DDP; stripped only at the start of a name

LM_HEAD = "lm_head.weight"
NameMap = Callable[[str], "str | None"]
_NAME_MAPS: dict[str, NameMap] = {}

to_torch_dtype = str_to_dtype  # the name the rollout engines use; one table: utils.torch_utils


def strip_wrapper_prefixes(name: str) -> str:
    """Remove wrapper prefixes anywhere in a dotted name ('a._orig_mod.b' -> 'a.b')."""
    for prefix in LEADING_PREFIXES:
        name = name.removeprefix(prefix)
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
        name = name.replace("." + prefix, ".")
    return name


def register_weight_name_map(engine: str, fn: NameMap) -> None:
    """Install the HF-name -> engine-name map of `engine` (replaces an earlier one)."""
    _NAME_MAPS[engine] = fn


def get_weight_name_map(engine: str) -> NameMap:
    """The name map of `engine`; identity for engines that load HF names (hf, vllm, sglang)."""
    return _NAME_MAPS.get(engine, _identity)


def _identity(name: str) -> str:
    return name


def map_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    name_map: NameMap | None = None,
    dtype: torch.dtype | None = None,
    tied_lm_head: str = "keep",
    embed_name: str = "model.embed_tokens.weight",
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily rename, filter and cast a stream of `(hf_name, tensor)` pairs.

    Args:
        named_tensors: pairs from the training side; consumed one at a time.
        name_map: engine map applied after the wrapper prefixes are stripped.
        dtype: cast floating-point tensors to it (None keeps their dtype).
        tied_lm_head: "keep", "drop" or "mirror" (see the module docstring).
        embed_name: the input-embedding weight that "mirror" re-emits as `lm_head.weight`.
        device: move tensors there (None keeps them where they are).

    Yields:
        `(engine_name, tensor)`; the tensor is detached, and a copy only when a cast or move
        was needed.
    """
    if tied_lm_head not in ("keep", "drop", "mirror"):
        raise ValueError(f"tied_lm_head must be 'keep', 'drop' or 'mirror', got {tied_lm_head!r}")
    name_map = name_map or _identity
    for name, tensor in named_tensors:
        name = strip_wrapper_prefixes(name)
        if tied_lm_head != "keep" and name == LM_HEAD:
            continue
        names = [name, LM_HEAD] if tied_lm_head == "mirror" and name == embed_name else [name]
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        for n in names:
            mapped = name_map(n)
            if mapped is not None:
                yield mapped, t


_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def split_fused_experts(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face's fused expert tensors as the per-expert checkpoint names engines load.

    transformers 5 keeps a mixture-of-experts layer's routed experts fused: `...experts.gate_up_proj`
    (E, 2 I, H), gate rows first, and `...experts.down_proj` (E, H, I). Checkpoints, and the
    loaders of engines such as vLLM's DeepSeek-V2/V3, name each expert's projections on their own:
    `...experts.{e}.gate_proj.weight` (I, H), `...experts.{e}.up_proj.weight` (I, H) and
    `...experts.{e}.down_proj.weight` (H, I). Other tensors pass through; the slices are views.
    """
    for name, tensor in named_tensors:
        if not (name.endswith(_FUSED_EXPERTS) and tensor.dim() == 3):
            yield name, tensor
            continue
        prefix, kind = name.rsplit(".", 1)
        for e, weight in enumerate(tensor.unbind(0)):
            if kind == "gate_up_proj":
                gate, up = weight.chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.down_proj.weight", weight
