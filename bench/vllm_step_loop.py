"""VLLMRollout's own step loop vs `LLM.generate` on the same engine, batch and weights.

VLLMRollout runs `LLM.generate`'s loop itself so that partial rollout can abort between engine
steps (rollout/vllm_rollout.py, `_run_requests`). Three ways, alternating in one run
(A B C A B C ...), one engine:

* generate:     `llm.generate(prompts, params)` (what VLLMRollout called before);
* loop:         `rollout.generate_tokens(request)`: the step loop, FINAL_ONLY outputs (the plain
                path: no abort callback);
* loop-abort:   the same with an abort callback that never fires: CUMULATIVE outputs, one
                callback per step (the partial-rollout path).

Prints the median and best seconds per call and the ratios to `generate`.

    VLLM_CPU_KVCACHE_SPACE=1 python bench/vllm_step_loop.py [--sizes tiny] [--batch 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_generation import MODEL_SIZES, build_model_dir, random_prompts, start_engine  # noqa: E402

from hybridrl.rollout import GenerationRequest, SamplingSpec  # noqa: E402


def _request(prompts, args) -> GenerationRequest:
    ids = prompts.batch["input_ids"]
    return GenerationRequest(
        input_ids=ids,
        attention_mask=prompts.batch["attention_mask"],
        prompt_token_ids=ids.tolist(),
        sampling=SamplingSpec(greedy=False, temperature=1.0, top_k=-1, top_p=1.0),
        seeds=list(range(len(ids))),
        max_new_tokens=args.new_tokens,
        want_log_probs=True,
    )


def _ways(rollout, request):
    """name -> a call that generates `request` once and returns the number of tokens."""
    from vllm.inputs import TokensPrompt

    def generate():
        params = rollout._sampling_params(request)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request.prompt_token_ids]
        outs = rollout.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def loop():
        rollout.abort_requested = None
        return sum(len(t) for t in rollout.generate_tokens(request).token_ids)

    def loop_abort():
        rollout.abort_requested = lambda: False
        try:
            return sum(len(t) for t in rollout.generate_tokens(request).token_ids)
        finally:
            rollout.abort_requested = None

    return {"generate": generate, "loop": loop, "loop-abort": loop_abort}


def bench_size(size: str, root: str, args) -> list[dict]:
    path, model = build_model_dir(size, root)
    prompts = random_prompts(args.batch, args.prompt_len, MODEL_SIZES[size]["vocab_size"])
    rollout = start_engine("vllm", path, model, prompts, args)[0]
    ways = _ways(rollout, _request(prompts, args))
    times: dict[str, list[float]] = {w: [] for w in ways}
    tokens: dict[str, int] = {}
    for fn in ways.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t0)
    rollout.shutdown()
    base = statistics.median(times["generate"])
    return [
        {
            "size": size,
            "way": name,
            "tokens": tokens[name],
            "median_s": statistics.median(t),
            "best_s": min(t),
            "ratio": statistics.median(t) / base,
        }
        for name, t in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    args.warmup = 1
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch} x {args.new_tokens} new tokens, {args.dtype}, {args.threads} thread(s), "
          f"{args.repeats} rounds alternating")  # fmt: skip
    print("| size | way | tokens | median s | best s | median / generate |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes.split(","):
            for r in bench_size(size, root, args):
                print(
                    f"| {r['size']} | {r['way']} | {r['tokens']} | {r['median_s']:.4f} | {r['best_s']:.4f} "
                    f"| {r['ratio']:.3f} |"
                )


if __name__ == "__main__":
    main()
