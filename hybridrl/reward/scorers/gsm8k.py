"""GSM8K scorer (``openai/gsm8k``), following the veRL convention users expect.

The response must state its final answer as ``#### <number>`` (strict format: the marker is part of
the task). The number after the last ``####`` is compared with the ground truth after removing ``,``
and ``$``; both are compared as decimals, so ``"72.0"`` equals ``"72"``. 1.0 when equal, else 0.0.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Only the tail is searched: regexes over very long (runaway) generations are slow.
_CLIP_CHARS = 300
_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_answer(solution_str: str) -> str | None:
    """The number after the last ``#### `` with commas removed, or None (no strict-format answer)."""
    found = _ANSWER.findall(solution_str[-_CLIP_CHARS:])
    return found[-1].replace(",", "") if found else None


def _to_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the ``#### <number>`` answer equals ``ground_truth`` numerically, else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    got, want = _to_decimal(answer), _to_decimal(str(ground_truth))
    if got is None or want is None:
        return 0.0
    return 1.0 if got == want else 0.0
