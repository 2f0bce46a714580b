"""Undoing a class swap of `nn.Linear` layers (the CPU linears are installed by class assignment).

`cpu/decode_gemm.py` and `cpu/train_linear.py` switch a layer to their path by assigning a
subclass of `nn.Linear` to its `__class__`, so the parameters, their names and checkpoints stay
as they are; `restore_linear_class` switches them back.
"""

from __future__ import annotations

import torch


def restore_linear_class(model: torch.nn.Module, cls: type, attrs: tuple[str, ...]) -> int:
    """Turn every module of exact class `cls` (an nn.Linear subclass swapped in by class
    assignment) back into a plain nn.Linear, dropping its instance attributes `attrs`; return how
    many. The parameters stay the same objects."""
    count = 0
    for module in model.modules():
        if type(module) is cls:
            module.__class__ = torch.nn.Linear
            for attr in attrs:
                module.__dict__.pop(attr, None)
            count += 1
    return count
