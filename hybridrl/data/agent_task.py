"""The built-in tool task: 3-digit by 2-digit products, with a calculator tool.

A question is ``"a*b="`` with ``a`` in ``[100, 999]`` and ``b`` in ``[10, 99]`` and a five-digit product
(``a*b >= 10000``: every copy the model makes is then at a fixed distance); the answer is the
product after ``####`` (scored like the built-in task: the integer after the last ``####``). The
built-in 0.5M-parameter model cannot multiply, but it can learn to call the calculator and copy
its result. A tool-using trajectory (hermes format, the tool ``calc`` of
:mod:`hybridrl.agent.builtin_tools`)::

    user:       123*45=
    assistant:  <tool_call>{"name":"calc","arguments":{"expr":"123*45"}}</tool_call>
    tool:       5535
    assistant:  #### 5535

Splits: every pair belongs to one split by a fixed hash (about 10% validation), as in
:mod:`hybridrl.data.builtin_task`. RL rows carry ``agent_name`` (``tool_agent``) and
``extra_info.tools_kwargs`` (veRL's per-row tool arguments), so they exercise the routing and the
tool life cycle.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

AGENT_DATA_SOURCE = "hybridrl/arith_tool"
TOOL_NAME = "calc"
A_RANGE = (100, 999)
B_RANGE = (10, 99)
VAL_BUCKETS = 10
MIN_PRODUCT = 10000
TASK_VERSION = 2

__all__ = [
    "AGENT_DATA_SOURCE",
    "direct_conversation",
    "ensure_agent_data",
    "make_rl_rows",
    "pair_split",
    "sample_pairs",
    "tool_call_text",
    "tool_conversation",
]


def pair_split(a: int, b: int) -> str:
    return "val" if zlib.crc32(f"{a}*{b}".encode()) % VAL_BUCKETS == 0 else "train"


def iter_pairs(seed: int, split: str) -> Iterator[tuple[int, int]]:
    """Endless pairs of ``split`` with a five-digit product, drawn by rejection from a seeded RNG.

    ``sample_pairs(n, seed, split)`` is the first ``n`` of them.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    rng = random.Random(f"agent:{split}:{seed}")
    while True:
        a, b = rng.randint(*A_RANGE), rng.randint(*B_RANGE)
        if a * b >= MIN_PRODUCT and pair_split(a, b) == split:
            yield a, b


def sample_pairs(n: int, seed: int, split: str) -> list[tuple[int, int]]:
    """``n`` pairs of ``split`` with a five-digit product, drawn by rejection from a seeded RNG."""
    return list(itertools.islice(iter_pairs(seed, split), n))


def question(a: int, b: int) -> str:
    return f"{a}*{b}="


def tool_call_text(a: int, b: int) -> str:
    """The assistant turn that calls the calculator (compact hermes JSON)."""
    call = {"name": TOOL_NAME, "arguments": {"expr": f"{a}*{b}"}}
    return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"


def tool_conversation(a: int, b: int) -> list[dict[str, str]]:
    """The full tool-using conversation (user, assistant call, tool result, assistant answer)."""
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": tool_call_text(a, b)},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"#### {a * b}"},
    ]


def direct_conversation(a: int, b: int) -> list[dict[str, str]]:
    """Answering without the tool (what the model would have to compute in its head)."""
    return [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": f"#### {a * b}"}]


def make_rl_rows(n: int, seed: int, split: str, agent_name: str = "tool_agent") -> list[dict[str, Any]]:
    """RL prompts in veRL's schema plus ``agent_name`` and ``extra_info.tools_kwargs``."""
    rows = []
    for i, (a, b) in enumerate(sample_pairs(n, seed, split)):
        rows.append(
            {
                "data_source": AGENT_DATA_SOURCE,
                "agent_name": agent_name,
                "prompt": [{"role": "user", "content": question(a, b)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": str(a * b)}}},
                },
            }
        )
    return rows


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> str:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return str(path)


def ensure_agent_data(data_dir: str | os.PathLike, n_train: int = 8192, n_val: int = 200) -> dict[str, str]:
    """Write the RL train/val parquet files once (rewritten when sizes or the version change)."""
    root = Path(data_dir).expanduser().resolve()
    spec = {"version": TASK_VERSION, "n_train": n_train, "n_val": n_val}
    paths = {"train": root / "train.parquet", "val": root / "val.parquet"}
    manifest = root / "manifest.json"
    if manifest.exists() and all(p.exists() for p in paths.values()):
        try:
            if json.loads(manifest.read_text()) == spec:
                return {k: str(p) for k, p in paths.items()}
        except json.JSONDecodeError:
            pass
    _write_parquet(make_rl_rows(n_train, 0, "train"), paths["train"])
    _write_parquet(make_rl_rows(n_val, 1, "val"), paths["val"])
    manifest.write_text(json.dumps(spec))
    return {k: str(p) for k, p in paths.items()}
