"""A format-only supervised warm start for the tiny VLM on the built-in visual task (docs/vlm.md).

A random-initialised model almost never writes ``#### <colour>``, so GRPO would see an all-zero
reward. :func:`format_warm_start` teaches the answer *format* without the answer: every target is
``#### <colour>`` with the colour drawn at random, independently of the picture. The optimum of
that loss ignores the image, so the warm-started model answers one colour greedily (about 25%
accuracy on four balanced colours); reading the colour from the pixels is left to RL.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from hybridrl.data import visual_task
from hybridrl.data.multimodal import process_row

__all__ = ["format_warm_start", "greedy_accuracy", "greedy_answers", "sft_batch"]


def sft_batch(processor: Any, rows: list[dict[str, Any]], answers: list[str]) -> dict[str, torch.Tensor]:
    """Model inputs for prompts `rows` followed by the answer texts, labels on the answers only.

    Returns:
        input_ids, attention_mask, labels: (B, S), right-padded; pixel_values (N, D);
        image_grid_thw (I, 3); mm_token_type_ids (B, S) (1 at image tokens).
    """
    tok = processor.tokenizer
    seqs, labels, pixels, grids = [], [], [], []
    for k, (row, answer) in enumerate(zip(rows, answers)):
        _, ids, mm = process_row(processor, row["prompt"], row["images"], f"row {k}", {}, {})
        resp = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(ids + resp)
        labels.append([-100] * len(ids) + resp)
        pixels.append(mm["pixel_values"])
        grids.append(mm["image_grid_thw"])
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
    mask = (lab != -100) | (torch.arange(width) < torch.tensor([len(s) for s in seqs])[:, None])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {
        "input_ids": ids,
        "attention_mask": mask.long(),
        "labels": lab,
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
        "mm_token_type_ids": (ids == image_id).long(),
    }


def format_warm_start(
    model_dir: str,
    steps: int = 60,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int = 16,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Train `model_dir` in place on ``#### <random colour>`` targets (AdamW), then save it.

    Args:
        model_dir: a folder from :func:`hybridrl.models.vlm.build_tiny_vlm` (overwritten).
        steps, seed, lr, batch_size: the supervised loop (rows from the task's "warm" split).
        num_threads: torch threads meanwhile (restored after; None: as they are). More than one is
            many times slower as soon as anything else runs on the cores (bench/threads.py).

    Returns:
        {"steps", "seconds", "final_loss"}.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or threads)
    try:
        return _train(model_dir, steps, seed, lr, batch_size)
    finally:
        torch.set_num_threads(threads)


def _train(model_dir: str, steps: int, seed: int, lr: float, batch_size: int) -> dict[str, Any]:
    from transformers import AutoModelForImageTextToText

    from hybridrl.models.vlm import load_processor

    torch.manual_seed(seed)
    rng = random.Random(f"warm:{seed}")
    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    rows = visual_task.make_rl_rows(steps * batch_size, seed, split="warm")
    colours = sorted(visual_task.COLOURS)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0, loss = time.perf_counter(), None
    for step in range(steps):
        chunk = rows[step * batch_size : (step + 1) * batch_size]
        batch = sft_batch(processor, chunk, [f"#### {rng.choice(colours)}" for _ in chunk])
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    final = None if loss is None else round(loss.item(), 4)
    return {"steps": steps, "seconds": round(time.perf_counter() - t0, 1), "final_loss": final}


@torch.no_grad()
def greedy_answers(model_dir: str, rows: list[dict[str, Any]], max_new_tokens: int = 12) -> list[str]:
    """The greedy replies (decoded, special tokens dropped) of `model_dir` to task `rows`."""
    from transformers import AutoModelForImageTextToText

    from hybridrl.models.vlm import load_processor

    processor = load_processor(model_dir)
    tok = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    texts = []
    for k, row in enumerate(rows):
        _, ids, mm = process_row(processor, row["prompt"], row["images"], f"row {k}", {}, {})
        input_ids = torch.tensor([ids])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == image_id).long(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **mm,
        )
        texts.append(tok.decode(out[0, len(ids) :], skip_special_tokens=True))
    return texts


def greedy_accuracy(model_dir: str, n: int = 64, seed: int = 0, split: str = "val") -> float:
    """Greedy exact-answer accuracy (visual_task.compute_score) of `model_dir` on `n` task rows."""
    rows = visual_task.make_rl_rows(n, seed, split=split)
    texts = greedy_answers(model_dir, rows)
    return (
        sum(visual_task.compute_score(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows)) / n
    )
