"""actor.use_prefix_grouper with images: one forward+backward of recipes/vlm/run.sh's batch shape.

The tiny random Qwen2-VL of `hybridrl.models.vlm` (fp32), 16 pictures of the built-in visual task
x 8 responses (GRPO n = 8, as the recipe), responses of 3-12 random tokens. Layouts: `padded`
(the recipe's use_remove_padding=false), `packed` and `grouped` (use_prefix_grouper). Prints
each layout's seconds per round (the minimum is the figure in docs/vlm.md) and the largest
log-prob difference grouped vs padded.

    python bench/vlm_prefix_grouper.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

P, T, PROMPTS, N = 40, 12, 16, 8


def make_batch(processor):
    from tensordict import NonTensorStack, TensorDict

    from hybridrl.data import visual_task
    from hybridrl.data.multimodal import process_row
    from hybridrl.engine.multimodal import MM_KEY

    g = torch.Generator().manual_seed(0)
    prompts = [
        process_row(processor, r["prompt"], r["images"], "row", {}, {})[1:]
        for r in visual_task.make_rl_rows(PROMPTS, seed=0)
    ]
    rows = [p for p in prompts for _ in range(N)]
    input_ids = torch.full((len(rows), P + T), processor.tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), P + T, dtype=torch.long)
    for i, (ids, _) in enumerate(rows):
        n = int(torch.randint(3, T + 1, (1,), generator=g))
        input_ids[i, P - len(ids) : P] = torch.tensor(ids)
        input_ids[i, P : P + n] = torch.randint(10, 90, (n,), generator=g)
        mask[i, P - len(ids) : P + n] = 1
    td = TensorDict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
         "responses": input_ids[:, P:]}, batch_size=[len(rows)],
    )  # fmt: skip
    td[MM_KEY] = NonTensorStack(*[mm for _, mm in rows])
    return td


def main() -> None:
    from transformers import AutoModelForImageTextToText

    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.models.vlm import build_tiny_vlm, load_processor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = build_tiny_vlm(Path(tempfile.mkdtemp()) / "model", "qwen2_vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    batch = make_batch(load_processor(path))
    resp_mask = batch["attention_mask"][:, P:]
    layouts = {
        "padded": {"use_remove_padding": False},
        "packed": {"use_remove_padding": True},
        "grouped": {"use_remove_padding": False, "prefix_group": True},
    }
    log_probs = {}
    for name, kw in layouts.items():
        times = []
        for _ in range(args.rounds):
            model.zero_grad()
            t0 = time.perf_counter()
            out = forward_log_probs(model, batch, calculate_entropy=True, **kw)
            (out.log_probs * resp_mask).sum().backward()
            times.append(time.perf_counter() - t0)
        log_probs[name] = out.log_probs.detach()
        print(f"{name:8s} " + " ".join(f"{x:.2f}" for x in times) + f"  (min {min(times):.2f} s)", flush=True)
    diff = (log_probs["grouped"] - log_probs["padded"])[resp_mask.bool()].abs().max()
    print(f"max |grouped - padded| log-prob: {float(diff):.2e}")


if __name__ == "__main__":
    main()
