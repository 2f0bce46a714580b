"""FLOPs of a decoder-only transformer pass and model FLOPs utilisation (MFU).

Estimate (Kaplan et al. 2020, "Scaling laws", sec. 2.1; PaLM appendix B for attention):
a forward pass costs 2 * N FLOPs per token for the N non-embedding parameters plus 4 * L * d * s
per token for the attention scores and weighted sum (L layers, d = heads * head_dim, s the
sequence length; the full s x s product is counted, as in PaLM). Training (forward + backward)
costs three times the forward: 6 * N * tokens + 12 * L * d * sum_i s_i^2.

MFU = achieved FLOPs / (seconds * peak FLOP/s). The peak is the caller's: `get_peak_flops` gives
a table value on known GPUs and, on CPU, measures a large matmul once per machine: the result is
kept in `~/.cache/hybridrl/cpu_peak_flops.json` (`$HYBRIDRL_CACHE_DIR` overrides the folder), keyed
by CPU model, torch version, thread count and dtype, so a run's start-up does not spend ~0.3 s
(x threads of CPU) measuring it again; delete the file to measure anew.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

# dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name()
_GPU_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10", 125e12),
    ("4090", 165e12),
    ("3090", 71e12),
)


def count_params(module: torch.nn.Module, exclude_embeddings: bool = True) -> int:
    """Number of parameters (global numel for sharded DTensors; tied weights counted once).

    With `exclude_embeddings`, nn.Embedding weights are left out (and a head tied to them),
    as in the 6N rule.
    """
    skip: set[int] = set()
    if exclude_embeddings:
        for m in module.modules():
            if isinstance(m, torch.nn.Embedding):
                skip.add(id(m.weight))
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def attention_dims(hf_config) -> tuple[int, int]:
    """(num_layers, heads * head_dim) of a Hugging Face decoder config."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return layers, heads * int(head_dim)


def estimate_flops(
    num_params: int,
    seqlens: Sequence[int],
    num_layers: int,
    attn_dim: int,
    training: bool = True,
) -> float:
    """FLOPs of one pass over sequences of the given lengths.

    Args:
        num_params: non-embedding parameter count N.
        seqlens: tokens of each sequence (padding excluded).
        num_layers: L.
        attn_dim: heads * head_dim.
        training: forward + backward (x3) if True, forward only otherwise.

    Returns:
        (6 or 2) * N * sum(s) + (12 or 4) * L * attn_dim * sum(s^2).
    """
    tokens = sum(int(s) for s in seqlens)
    squares = sum(int(s) ** 2 for s in seqlens)
    return work_flops(num_params, tokens, squares, num_layers, attn_dim, training)


def work_flops(
    num_params: int, tokens: int, squares: int, num_layers: int, attn_dim: int, training: bool = True
) -> float:
    """`estimate_flops` from its two sums: tokens = sum(s) and squares = sum(s^2) (or, for a
    forward that is not one sequence per row, the attention pairs it computes: `grouped_work`)."""
    factor = 3 if training else 1
    return factor * (2.0 * num_params * tokens + 4.0 * num_layers * attn_dim * squares)


def grouped_work(lengths: Sequence[int], prompt_of: Sequence[int]) -> tuple[int, int]:
    """(tokens, squares) of the shared-prompt forward's packed row, for `work_flops`.

    Args:
        lengths: tokens of each segment: a group's prompt, then each of its responses.
        prompt_of: per segment, the index of its prompt segment (-1 for a prompt).

    A prompt of p tokens is computed once; each of its responses of n tokens attends to it and to
    itself, so its sequence p + n counts p^2 + sum over responses of (2 p n + n^2) instead of
    sum (p + n)^2, and p tokens once instead of once per response.
    """
    tokens, squares = 0, 0
    for n, prompt in zip(lengths, prompt_of):
        tokens += n
        p = 0 if prompt < 0 else lengths[prompt]
        squares += 2 * p * n + n * n
    return tokens, squares


@functools.lru_cache(maxsize=8)
def measure_matmul_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.3) -> float:
    """Best FLOP/s of a (size x size) @ (size x size) matmul on CPU over ~`seconds` (cached)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2.0 * size**3 / max(elapsed, 1e-9))
        if time.perf_counter() > deadline:
            return best


def get_peak_flops(device: str | None = None, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak FLOP/s used as the MFU denominator.

    On a CUDA device, the dense bf16 peak of a known GPU (fp32 is taken as half of it), or 0.0
    for an unknown one (MFU is then not reported). On CPU, a measured matmul (cached).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for key, peak in _GPU_PEAK_BF16:
            if key in name:
                return peak if dtype in (torch.bfloat16, torch.float16) else peak / 2
        return 0.0
    return cached_cpu_peak_flops(dtype)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_cache_path() -> Path:
    """Where measured CPU peaks are kept (`$HYBRIDRL_CACHE_DIR`, else ~/.cache/hybridrl)."""
    root = os.environ.get("HYBRIDRL_CACHE_DIR") or str(Path.home() / ".cache" / "hybridrl")
    return Path(root) / "cpu_peak_flops.json"


@functools.lru_cache(maxsize=8)
def cached_cpu_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """`measure_matmul_flops(dtype)` with this process's threads, measured once per machine.

    The key names the CPU model, torch version, thread count and dtype; an unreadable or
    damaged cache file is measured over (and rewritten atomically), never trusted.
    """
    key = f"{_cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}"
    path = peak_cache_path()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    value = table.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = measure_matmul_flops(dtype)
    try:
        table[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only home: measure each run, as before
        pass
    return value


def compute_mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """flops / (seconds * peak); None when the peak is unknown or no time elapsed."""
    if not peak_flops or seconds <= 0:
        return None
    return flops / (seconds * peak_flops)
