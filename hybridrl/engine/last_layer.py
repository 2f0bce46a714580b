"""The last decoder layer's MLP on the positions that are read, and no others.

A reward model reads its head at one position per sequence (the last token). Below the last
decoder layer every position feeds the attention of later ones, but in the last layer a
position's MLP output reaches nothing except that position's head output. `last_layer_rows`
makes the last layer's MLP run on the read positions only (and zeros elsewhere, whose outputs
nobody reads): on short sequences the MLP is most of a layer's work, so a 2-layer model's
forward and backward do a third less. Scores and their gradients are those of the full forward
(tests/engine/test_prefix_group.py compares them). `bench/pref_vs_trl.py` measures the step.

Applied where the last layer is a plain decoder layer with a dense `mlp` submodule called on the
hidden states (Llama, Qwen2/3, Mistral and the like); a mixture-of-experts block (its router
statistics would change) or a compiled layer keeps the full forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def last_dense_mlp(module: nn.Module) -> nn.Module | None:
    """The dense MLP of `module`'s last decoder layer, or None where the layers are not found,
    the MLP is not a dense one, or the layer is compiled."""
    base = getattr(module, getattr(module, "base_model_prefix", ""), None) or module
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    layer = layers[-1]
    if getattr(layer, "_compiled_call_impl", None) is not None:
        return None
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module) or not type(mlp).__name__.endswith("MLP"):
        return None
    return mlp


@contextlib.contextmanager
def last_layer_rows(module: nn.Module, positions: torch.Tensor) -> Iterator[bool]:
    """Within the block, the last layer's MLP of `module` computes only `positions` (distinct
    indices into dim 1 of its (1, N, H) input) and returns zeros at the others.

    Yields whether it applies (False: `last_dense_mlp` found none, the forward is the full one).
    """
    mlp = last_dense_mlp(module)
    if mlp is None:
        yield False
        return
    shapes: list[torch.Size] = []

    def select(_m: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        shapes.append(hidden.shape)
        return (hidden[:, positions], *args[1:])

    def scatter(_m: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(out):
            raise TypeError(f"{type(mlp).__name__} returned {type(out).__name__}, not a tensor")
        return out.new_zeros(shapes.pop()).index_copy(1, positions, out)

    handles = [mlp.register_forward_pre_hook(select), mlp.register_forward_hook(scatter)]
    try:
        yield True
    finally:
        for handle in handles:
            handle.remove()
