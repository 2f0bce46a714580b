"""Scorer of the built-in task (``hybridrl/arith``): exact match of the integer after the last ``####``."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"####\s*(-?\d+)")


def extract_answer(solution_str: str) -> str | None:
    """The integer after the last ``####`` (spaces allowed between), or None when there is none.

    >>> extract_answer("#### 46")
    '46'
    """
    found = _ANSWER.findall(solution_str)
    return found[-1] if found else None


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the extracted answer equals ``ground_truth`` digit for digit, else 0.0.

    ``"#### 046"`` does not match ``"46"``: the task asks for the plain sum.
    """
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == str(ground_truth).strip() else 0.0
