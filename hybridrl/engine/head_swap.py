"""Swapping a Hugging Face model's output head, so that it runs only where its output is needed.

`head_is_swappable(module)` finds the head (lm_head, a critic's value head) whose output the model's
forward returns as logits untouched (read from the forward's syntax tree: Qwen2, Llama, Mistral, ...;
models that soft-cap or scale their logits are not swappable), and `head_replaced(head, fn)` runs
`fn(hidden)` in its place for the duration of a block: the callers select the response-predicting
positions of the last hidden states first, then project only those.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["head_is_swappable", "head_replaced"]


@functools.cache
def _untouched_head_name(cls: type) -> str | None:
    """Name of the head whose output `cls.forward` returns as logits unchanged, else None.

    Read from the forward's syntax tree: exactly one assignment to `logits`, and it is
    `logits = self.<head>(...)` (no soft-capping, scaling or upcast afterwards).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    assigns = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        if any(isinstance(n, ast.Name) and n.id == "logits" for t in targets for n in ast.walk(t)):
            assigns.append(node)
    if len(assigns) != 1 or not isinstance(assigns[0], ast.Assign):
        return None
    call = assigns[0].value
    func = call.func if isinstance(call, ast.Call) else None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return None


def head_is_swappable(module: nn.Module) -> nn.Linear | None:
    """The model's output head (an nn.Linear) when its forward returns the head output untouched.

    `module` may be a PEFT model (its base model is inspected) or FSDP-wrapped. None: the model
    post-processes its logits or its head is not a plain linear layer (e.g. a LoRA-wrapped
    lm_head); callers then take the plain path.
    """
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    name = _untouched_head_name(type(base))
    head = getattr(base, name, None) if name else None
    return head if type(head) is nn.Linear else None


@contextlib.contextmanager
def head_replaced(head: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Run `fn(hidden)` instead of `head.forward` inside the block."""
    head.forward = fn
    try:
        yield
    finally:
        del head.forward
