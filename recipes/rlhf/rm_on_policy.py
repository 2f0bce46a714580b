"""How a reward model ranks a policy's own samples on the built-in task, by kind of answer.

Samples N answers (T=1, as the PPO rollout does) to each of the 200 validation prompts, scores them
with the rule and with the reward model, and prints, for each kind of answer (right, a tens digit off,
off by at most 3, another wrong number, no ``####``), how many there are, their mean reward-model
score, and in the groups that hold a right answer how many of them the reward model scores at or
above the best right one: the answers GRPO would push the policy towards instead of the right one.

Usage: python recipes/rlhf/rm_on_policy.py POLICY RM [N]
  (e.g. builtin:tiny checkpoints/rlhf/rm/reward_model 8)
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hybridrl.data import builtin_task
from hybridrl.data.builtin_score import extract_answer
from hybridrl.models.builtin import resolve_model_path

KINDS = ("right", "tens digit off", "off by <= 3", "other number", "no ####")


def kind_of(response: str, a: int, b: int) -> str:
    """Which kind of answer `response` is to ``a+b=``."""
    found = extract_answer(response)
    if found is None:
        return "no ####"
    diff = int(found) - (a + b)
    if diff == 0:
        return "right"
    if diff % 10 == 0:
        return "tens digit off"
    return "off by <= 3" if abs(diff) <= 3 else "other number"


def sample(policy_path: str, pairs: list[tuple[int, int]], n: int) -> list[str]:
    """n sampled responses (T=1) to each prompt, grouped by prompt: len(pairs) * n strings."""
    tok = AutoTokenizer.from_pretrained(policy_path)
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    chats = [[{"role": "user", "content": builtin_task.format_question(a, b)}] for a, b in pairs]
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=12,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            num_return_sequences=n,
            pad_token_id=tok.pad_token_id,
        )
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def rm_scores(rm_path: str, questions: list[str], responses: list[str]) -> list[float]:
    """The reward model's score of each (question, response), read as main_ppo reads it."""
    tok = AutoTokenizer.from_pretrained(rm_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": r}], tokenize=False
        )
        for q, r in zip(questions, responses)
    ]
    tok.padding_side = "right"
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), 256):
            enc = tok(texts[start : start + 256], return_tensors="pt", padding=True, add_special_tokens=False)
            position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            scores += model(**enc, position_ids=position_ids).logits[:, 0].tolist()
    return scores


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    policy, rm = resolve_model_path(sys.argv[1]), sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    torch.manual_seed(0)
    torch.set_num_threads(1)
    pairs = builtin_task.sample_pairs(200, builtin_task.DEFAULT_VAL_SEED, "val")
    responses = sample(policy, pairs, n)
    questions = [builtin_task.format_question(a, b) for a, b in pairs for _ in range(n)]
    kinds = [kind_of(r, a, b) for r, (a, b) in zip(responses, [p for p in pairs for _ in range(n)])]
    scores = rm_scores(rm, questions, responses)
    by_kind: dict[str, list[float]] = defaultdict(list)
    groups: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for i, (k, s) in enumerate(zip(kinds, scores)):
        by_kind[k].append(s)
        groups[i // n].append((k, s))
    beats, in_mixed = Counter(), Counter()
    for group in groups.values():
        right = [s for k, s in group if k == "right"]
        for k, s in group:
            if right and k != "right":
                in_mixed[k] += 1
                beats[k] += s >= max(right)
    print(f"{len(responses)} samples ({n} per prompt) of {sys.argv[1]}, scored by {rm}")
    print(f"{'kind':16s} {'count':>6s} {'mean RM score':>14s}  scored >= the group's best right answer")
    for k in KINDS:
        if by_kind[k]:
            mean = sum(by_kind[k]) / len(by_kind[k])
            tail = "" if k == "right" else f"{beats[k]} of {in_mixed[k]}"
            print(f"{k:16s} {len(by_kind[k]):6d} {mean:14.2f}  {tail}")


if __name__ == "__main__":
    main()
