"""Rule scorers: hand-written responses with known verdicts."""

from __future__ import annotations

import pytest

from hybridrl.reward import scorers
from hybridrl.reward.scorers import default_compute_score, get_scorer, register_scorer
from hybridrl.reward.scorers import math as math_scorer

ARITH = "hybridrl/arith"
GSM = "openai/gsm8k"
MATH = "lighteval/MATH"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("#### 46", "46", 1.0),
        ("####46", "46", 1.0),
        ("#### 45", "46", 0.0),
        ("46", "46", 0.0),  # no marker: the format is part of the task
        ("#### 12 #### 46", "46", 1.0),  # the last answer counts
        ("#### 46 #### 12", "46", 0.0),
        ("#### 466", "46", 0.0),  # a truncated/run-on answer is wrong
        ("#### 046", "46", 0.0),  # exact digits
        ("#### ", "46", 0.0),
        ("", "46", 0.0),
        ("#### 118", "118", 1.0),
    ],
)
def test_builtin_arith(response, truth, expected):
    assert default_compute_score(ARITH, response, truth) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas removed
        ("#### $18", "18", 1.0),  # dollar sign removed
        ("#### 72.00", "72", 1.0),
        ("#### 72.", "72", 1.0),  # sentence-final period
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 71", "72", 0.0),
        ("The answer is 72", "72", 0.0),  # strict: no #### -> 0
        ("#### 10\nwait, #### 72", "72", 1.0),  # last marker wins
        ("#### 72\n#### 10", "72", 0.0),
        ("#### abc", "72", 0.0),
        ("#### 1,000,000", "1,000,000", 1.0),
    ],
)
def test_gsm8k(response, truth, expected):
    assert default_compute_score(GSM, response, truth) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{10}", "10", 1.0),
        ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ],
)
def test_math(response, truth, expected):
    assert default_compute_score(MATH, response, truth) == expected


@pytest.mark.parametrize(
    "answer, truth, expected",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("\\frac12", "\\frac{1}{2}", True),
        ("1/2", "\\frac{1}{2}", True),
        (".5", "0.5", True),
        ("x = 5", "5", True),
        ("90^\\circ", "90", True),
        ("\\text{(B)}", "(B)", True),
        ("\\left( 1, 2 \\right)", "(1,2)", True),
        ("10\\%", "10", True),
        ("-\\frac{3}{4}", "-0.75", True),
        ("3", "4", False),
        ("\\sqrt{2}", "\\sqrt{3}", False),
    ],
)
def test_math_fallback_normalisation(answer, truth, expected):
    """The fallback used without math-verify: normalised strings, plain numbers by value."""
    assert math_scorer.fallback_equal(answer, truth) is expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a \\boxed{x^{2}} b", "x^{2}"),
        ("\\boxed{\\frac{1}{2}} then \\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unbalanced", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert math_scorer.last_boxed(text) == expected


def test_math_dapo_uses_answer_line_and_plus_minus_one():
    good = default_compute_score("math_dapo", "work...\nAnswer: 42", "42")
    assert good == {"score": 1.0, "acc": True, "pred": "42"}
    bad = default_compute_score("math_dapo", "work...\nAnswer: 41", "42")
    assert bad["score"] == -1.0 and bad["acc"] is False
    boxed = default_compute_score("math_dapo", "so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}")
    assert boxed["score"] == 1.0
    missing = default_compute_score("math_dapo", "I don't know", "42")
    assert missing == {"score": -1.0, "acc": False, "pred": ""}


def test_unknown_data_source_names_it_and_the_fix():
    with pytest.raises(NotImplementedError, match="my/dataset") as err:
        default_compute_score("my/dataset", "#### 1", "1")
    assert "custom_reward_function.path" in str(err.value)


def test_register_scorer_adds_and_refuses_silent_overwrite(monkeypatch):
    monkeypatch.setattr(scorers, "_SCORERS", dict(scorers._SCORERS))

    @register_scorer("test/exact", "test/exact2")
    def exact(solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    assert default_compute_score("test/exact", " yes ", "yes") == 1.0
    assert default_compute_score("test/exact2", "no", "yes") == 0.0
    assert get_scorer("test/exact") is exact
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("openai/gsm8k")(exact)
    register_scorer("openai/gsm8k", overwrite=True)(exact)
    assert default_compute_score(GSM, "#### 72", "72") == 0.0  # replaced by the exact-match scorer
    with pytest.raises(ValueError, match="at least one"):
        register_scorer()


def test_extra_info_is_passed_to_the_scorer(monkeypatch):
    monkeypatch.setattr(scorers, "_SCORERS", dict(scorers._SCORERS))
    seen = {}

    @register_scorer("test/info")
    def spy(solution_str, ground_truth, extra_info=None):
        seen.update(extra_info or {})
        return 0.5

    assert default_compute_score("test/info", "x", "y", extra_info={"index": 3}) == 0.5
    assert seen == {"index": 3}
