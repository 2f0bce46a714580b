"""Megatron's fused gated-MLP input projection (fc1) <-> Hugging Face's gate and up projections.

Megatron keeps gate and up in one column-parallel weight: with tensor-parallel size tp, rank r
holds `[gate_r; up_r]` (its slice of each), so the full fc1 is that concatenation over ranks and
its layout depends on tp. Used for dense MLPs, shared experts and routed experts alike.
"""

from __future__ import annotations

import torch

__all__ = ["fc1_from_megatron", "fc1_to_megatron"]


def fc1_to_megatron(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    """Fuse HF gate (I, H) and up (I, H) into Megatron's fc1 (2I, H): [gate_r; up_r] for r < tp."""
    parts = []
    for g_r, u_r in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0)):
        parts += [g_r, u_r]
    return torch.cat(parts, dim=0)


def fc1_from_megatron(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fc1_to_megatron`: (gate, up) in HF layout."""
    gates, ups = [], []
    for shard in fc1.chunk(tp, dim=0):
        g_r, u_r = shard.chunk(2, dim=0)
        gates.append(g_r)
        ups.append(u_r)
    return torch.cat(gates, dim=0), torch.cat(ups, dim=0)
