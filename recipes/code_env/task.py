"""The code task of the recipe: write a Python function for a linear formula, judged by unit tests.

A spec is `f(x)=3x+2` (plain) or `f(x)=3(x+2)` (a bracket); the program that solves it is

    ```python
    def f(x):
        return 3*(x+2)
    ```

and the row's ground truth is test code (`assert f(0)==6` ...) that the unit-test reward
(`hybridrl/reward/scorers/code_tests.py`) runs after the program in the local sandbox. Every
(kind, a, op, b) belongs to the training or the validation split by a fixed hash, so the splits
never share a spec.

The warm start's weaker teacher writes the classic precedence bug for bracketed specs
(`return 3*x+2` for `3(x+2)`), which fails every test; the stronger teacher writes the bracket.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

DATA_SOURCE = "hybridrl/code_env"
KINDS = ("plain", "bracket")
TEST_POINTS = (-3, 0, 1, 4, 7)


def all_specs() -> list[tuple[str, int, str, int]]:
    return [(k, a, op, b) for k in KINDS for a in range(2, 10) for op in "+-" for b in range(1, 10)]


def spec_split(spec: tuple[str, int, str, int]) -> str:
    """'val' for about one spec in four (fixed by a hash of the spec), else 'train'."""
    return "val" if zlib.crc32(repr(spec).encode()) % 4 == 0 else "train"


def prompt_text(spec: tuple[str, int, str, int]) -> str:
    kind, a, op, b = spec
    return f"f(x)={a}x{op}{b}" if kind == "plain" else f"f(x)={a}(x{op}{b})"


def value(spec: tuple[str, int, str, int], x: int) -> int:
    kind, a, op, b = spec
    sb = b if op == "+" else -b
    return a * x + sb if kind == "plain" else a * (x + sb)


def program(spec: tuple[str, int, str, int], bracket: bool) -> str:
    """The response of a teacher: a ```python block defining f. bracket=False drops the bracket."""
    kind, a, op, b = spec
    body = f"{a}*(x{op}{b})" if kind == "bracket" and bracket else f"{a}*x{op}{b}"
    return f"```python\ndef f(x):\n    return {body}\n```"


def tests(spec: tuple[str, int, str, int]) -> str:
    return "\n".join(f"assert f({x})=={value(spec, x)}" for x in TEST_POINTS) + "\n"


def make_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n RL rows (veRL's schema) of one split, drawn with repetition from its specs by `seed`."""
    pool = [s for s in all_specs() if spec_split(s) == split]
    rng = random.Random(f"{split}:{seed}")
    specs = pool if n <= 0 else [rng.choice(pool) for _ in range(n)]
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(spec)}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": tests(spec)},
            "extra_info": {"split": split, "index": i, "kind": spec[0]},
        }
        for i, spec in enumerate(specs)
    ]
