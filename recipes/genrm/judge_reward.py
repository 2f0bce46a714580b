"""The GenRM recipe's reward function: an LLM judge answers the same question as the policy.

The judge (the built-in model after `python -m hybridrl.trainer.main_sft`) is asked the row's
question (`extra_info["question"]`, written by prepare_data.py) as a chat turn; a response scores 1
when its answer (the number after its last "####") equals the judge's, else 0. The function never
sees the ground truth's verdict: it uses the ground truth only to report how often the judge's
score agrees with the rule reward (`genrm_agree`) and the rule accuracy (`acc`).

A judge answer without a "####" number (e.g. cut off by max_tokens) is unparsable: the row scores
0.0 and is counted (`genrm_parse_failure` -> the metric reward/genrm_parse_failures).

Used with reward_model.reward_manager=batch: one judge request per batch, one prompt per distinct
question (the n samples of a prompt share the judge's answer). `compute_score_router` is the same
judge in veRL's shape (naive manager): an async function that POSTs to the GenRM router at
`reward_router_address` (docs/genrm.md).
"""

from __future__ import annotations

import re

ANSWER = re.compile(r"####\s*(-?\d+)")


def extract_answer(text: str) -> str | None:
    """The number after the last '####' in `text`, or None."""
    found = ANSWER.findall(text or "")
    return found[-1] if found else None


def judge_answers(questions: list[str], client, max_tokens: int) -> dict[str, str]:
    """{question: the judge's raw answer}, asking each distinct question once (greedy by default)."""
    unique = list(dict.fromkeys(questions))
    texts = client.chat([[{"role": "user", "content": q}] for q in unique], max_tokens=max_tokens)
    return dict(zip(unique, texts))


def compute_score_batch(
    data_sources,
    solution_strs,
    ground_truths,
    extra_infos,
    reward_model_client,
    reward_model_tokenizer=None,
    max_tokens: int = 12,
    **kwargs,
):
    """One result dict per row: score (1.0 when the response's answer equals the judge's), acc (rule
    reward), genrm_agree (score == rule reward), genrm_parse_failure, genrm_response."""
    questions = [info["question"] for info in extra_infos]
    return score_rows(
        questions, solution_strs, ground_truths, judge_answers(questions, reward_model_client, max_tokens)
    )


def score_rows(questions, solution_strs, ground_truths, answers: dict[str, str]) -> list[dict]:
    """The result dicts of rows given the judge's answer to each question."""
    out = []
    for question, solution, truth in zip(questions, solution_strs, ground_truths):
        judged, mine = extract_answer(answers[question]), extract_answer(solution)
        rule = float(mine is not None and mine == str(truth).strip())
        score = 0.0 if judged is None else float(mine is not None and mine == judged)
        out.append(
            {
                "score": score,
                "acc": rule,
                "genrm_agree": float(score == rule),
                "genrm_parse_failure": judged is None,
                "genrm_response": answers[question],
            }
        )
    return out


def compute_score(data_source, solution_str, ground_truth, extra_info, reward_model_client, **kwargs):
    """The per-row form (reward_model.reward_manager=naive): one judge request per row."""
    [result] = compute_score_batch(
        [data_source], [solution_str], [ground_truth], [extra_info], reward_model_client, **kwargs
    )
    return result


async def compute_score_router(
    data_source,
    solution_str,
    ground_truth,
    extra_info,
    reward_router_address,
    reward_model_tokenizer,
    max_tokens=12,
):
    """veRL's shape (reward_model.reward_manager=naive): an async function that asks the judge through
    the GenRM router, `POST http://{reward_router_address}/v1/chat/completions`, one row per request
    (the rows of a batch are awaited together, so their requests overlap)."""
    import aiohttp

    body = {
        "model": "judge",
        "messages": [{"role": "user", "content": extra_info["question"]}],
        "max_tokens": max_tokens,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{reward_router_address}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            answer = (await resp.json())["choices"][0]["message"]["content"]
    return score_rows(
        [extra_info["question"]], [solution_str], [ground_truth], {extra_info["question"]: answer}
    )[0]
