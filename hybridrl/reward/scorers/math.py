"""MATH-style scorers (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``math_dapo``, ...).

Equivalence check, in order of preference:

1. ``math-verify`` (``pip install hybridrl[math]``) when importable: the ground truth is parsed as
   ``\\boxed{<ground_truth>}``, the answer from the whole response, and ``math_verify.verify`` decides
   (symbolic: ``0.5`` equals ``\\frac{1}{2}``).
2. Otherwise (or when math-verify fails on an input) the fallback: take the last ``\\boxed{...}``
   (or ``\\fbox{...}``) of the response, normalise both strings (:func:`normalize_answer`: drops
   spaces, ``\\left``/``\\right``, ``$``, ``\\text{}``, degree signs, a trailing period; rewrites
   ``\\dfrac``/``\\tfrac`` to ``\\frac``, ``\\frac12`` to ``\\frac{1}{2}``, ``a/b`` to ``\\frac{a}{b}``,
   ``.5`` to ``0.5``; strips a short ``x =`` prefix) and compare; plain numbers compare by value.
   The fallback is stricter than math-verify (no algebra), never more lenient.

``compute_score`` (MATH) returns 1.0 / 0.0. ``compute_score_dapo`` follows DAPO's convention: the answer
is read from the last ``Answer: ...`` line (else the last ``\\boxed{}``), and the result is a dict
``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``.
"""

from __future__ import annotations

import re
import threading

try:  # optional dependency: the `math` extra
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify

    HAVE_MATH_VERIFY = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_MATH_VERIFY = False

_MV_TIMEOUT_S = 5
_CLIP_CHARS = 2000  # only the tail of a response is searched (runaway generations are long)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or None.

    Also accepts the brace-less form ``\\boxed 5``.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":
        end = i + 1
        while end < len(text) and text[end] not in " $\n":
            end += 1
        return text[i + 1 : end] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: truncated generation


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            return s  # malformed: leave untouched
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + rest
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def _unwrap_text(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: str) -> str:
    """Canonical string of a final answer for the fallback comparison (see the module docstring)."""
    s = answer.strip()
    s = _unwrap_text(s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "\\%", "%"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace(" ", "").replace("\n", "")
    s = s.rstrip(".")
    # "x=5" / "k = 3": drop a short variable on the left.
    m = re.fullmatch(r"[a-zA-Z]{1,2}=(.+)", s)
    if m:
        s = m.group(1)
    s = re.sub(r"(?<![0-9])\.([0-9])", r"0.\1", s)  # .5 -> 0.5
    s = _fix_fracs(s)
    m = re.fullmatch(r"(-?[0-9]+)/([0-9]+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?", s):
        s = s.replace(",", "")  # 1,000 -> 1000
    return s


def _as_number(s: str) -> float | None:
    """Value of a plain number or of ``\\frac{p}{q}`` with integers p, q; None otherwise."""
    m = re.fullmatch(r"(-?)\\frac\{(-?[0-9]+)\}\{([0-9]+)\}", s)
    if m:
        q = int(m.group(3))
        return None if q == 0 else (-1 if m.group(1) else 1) * int(m.group(2)) / q
    try:
        return float(s)
    except ValueError:
        return None


def fallback_equal(prediction: str, ground_truth: str) -> bool:
    """Normalised-string equality (plain numbers by value)."""
    a, b = normalize_answer(prediction), normalize_answer(ground_truth)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-9 * max(1.0, abs(y))


def _math_verify_equal(response: str, ground_truth: str) -> bool | None:
    """math-verify's verdict, or None when it is unavailable or fails on the input."""
    if not HAVE_MATH_VERIFY:
        return None
    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = _mv_parse("\\boxed{" + ground_truth + "}", parsing_timeout=timeout)
        if not gold:
            return None
        pred = _mv_parse(response, parsing_timeout=timeout)
        return bool(pred) and bool(_mv_verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # math-verify raises on odd LaTeX: use the fallback instead
        return None


def is_equiv(response: str, ground_truth: str) -> bool:
    """Whether ``response`` (a full response or an answer) states ``ground_truth``."""
    boxed = last_boxed(response)
    # math-verify sees only the final boxed answer when there is one (it may otherwise pick an earlier one).
    verdict = _math_verify_equal(response if boxed is None else "\\boxed{" + boxed + "}", ground_truth)
    if verdict is not None:
        return verdict
    return boxed is not None and fallback_equal(boxed, ground_truth)


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """MATH: 1.0 when the response's final (boxed) answer equals ``ground_truth``, else 0.0."""
    return 1.0 if is_equiv(solution_str[-_CLIP_CHARS:], str(ground_truth)) else 0.0


_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_dapo_answer(solution_str: str) -> str | None:
    """DAPO's answer: the text after the last ``Answer:``, else the last ``\\boxed{}``."""
    found = _ANSWER_LINE.findall(solution_str)
    if found:
        answer = found[-1].strip()
        boxed = last_boxed(answer)
        return boxed if boxed is not None else answer
    return last_boxed(solution_str)


def compute_score_dapo(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """DAPO convention: ``{"score": 1.0 if correct else -1.0, "acc": bool, "pred": str}``."""
    pred = extract_dapo_answer(solution_str[-_CLIP_CHARS:])
    correct = False
    if pred is not None:
        verdict = _math_verify_equal("\\boxed{" + pred + "}", str(ground_truth))
        correct = verdict if verdict is not None else fallback_equal(pred, str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred or ""}
