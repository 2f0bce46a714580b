"""A generative reward model (GenRM, an LLM judge) served by a rollout engine, and its client.

veRL's reward loop serves the reward model and, when `reward.custom_reward_function.path` is set
beside `reward.reward_model.enable`, calls the custom function with a way to reach the judge; the
function builds the judge prompt, asks, and parses the answer. veRL hands it
`reward_router_address` (an HTTP router to vLLM/SGLang servers) and `reward_model_tokenizer`.
hybridrl hands a function that names `reward_router_address` the address of such a router in front
of these replicas (genrm_router.py), and (to one that names them or takes **kwargs):

* `reward_model_client`: a `GenRMClient` (picklable; usable in any process of the run) whose
  `generate(prompts)` / `chat(conversations)` send one batched request per call to the judge's
  replicas and return the generated texts, failing with a TimeoutError that names
  `reward_model.rollout.request_timeout_s` when the judge does not answer in time;
* `reward_model_tokenizer`: the judge's tokenizer (as veRL).

    def compute_score(data_source, solution_str, ground_truth, extra_info,
                      reward_model_client, reward_model_tokenizer, **kwargs):
        [answer] = reward_model_client.chat([[{"role": "user", "content": extra_info["question"]}]])
        parsed = parse(answer)                     # the function decides what unparsable means
        if parsed is None:
            return {"score": 0.0, "genrm_parse_failure": True}
        return {"score": float(parsed == mine(solution_str)), "genrm_parse_failure": False}

The reward loop sums the per-row extra `genrm_parse_failure` into the metric
`reward/genrm_parse_failures` and logs the mean of every other numeric `genrm_*` extra as
`reward/genrm_<name>/mean` (reward_loop.genrm_metrics). The judge is served, never trained or
checkpointed. Engines (`reward_model.rollout.name`): `hf` (Hugging Face `generate`, left-padded
batches) and `vllm` (`vllm.LLM.generate`; written against vLLM's API, not run here).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import torch

from hybridrl.config.roles import RewardRolloutConfig
from hybridrl.utils.batch_ops import row_parts

ENGINES = ("hf", "vllm")
TIMEOUT_KEY = "reward_model.rollout.request_timeout_s"
SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "do_sample")


def default_sampling(rollout: RewardRolloutConfig) -> dict[str, Any]:
    """The judge's sampling defaults from `reward_model.rollout` (max_tokens = response_length)."""
    return {
        "max_tokens": rollout.response_length,
        "temperature": rollout.temperature,
        "top_k": rollout.top_k,
        "top_p": rollout.top_p,
        "do_sample": rollout.do_sample,
    }


def check_prompts(prompts: list[list[int]], max_tokens: int, rollout: RewardRolloutConfig) -> None:
    """ValueError naming reward_model.rollout.* when a judge prompt (plus its answer) cannot fit."""
    longest = max((len(p) for p in prompts), default=0)
    if longest > rollout.prompt_length:
        raise ValueError(
            f"a GenRM prompt has {longest} tokens, more than reward_model.rollout.prompt_length="
            f"{rollout.prompt_length}; raise it (or shorten the judge prompt in the custom reward function)"
        )
    if longest + max_tokens > rollout.effective_max_model_len:
        raise ValueError(
            f"a GenRM prompt of {longest} tokens + max_tokens={max_tokens} exceeds the judge's max_model_len="
            f"{rollout.effective_max_model_len} (reward_model.rollout.max_model_len, or prompt_length + "
            "response_length); raise it or ask for fewer tokens"
        )


class HFGenerator:
    """Hugging Face `generate` over left-padded batches, no gradients."""

    def __init__(self, model_path: str, rollout: RewardRolloutConfig, trust_remote_code: bool, tokenizer):
        from transformers import AutoModelForCausalLM

        from hybridrl.utils.torch_utils import str_to_dtype

        self.module = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=str_to_dtype(rollout.dtype), trust_remote_code=trust_remote_code
        ).eval()
        self.tok = tokenizer

    def generate(self, prompts: list[list[int]], s: dict[str, Any]) -> list[str]:
        """Texts of the generated tokens (special tokens dropped), one per prompt."""
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        sample = bool(s["do_sample"]) and s["temperature"] > 0
        kwargs = {
            "temperature": s["temperature"],
            "top_p": s["top_p"],
            "top_k": s["top_k"] if s["top_k"] > 0 else 0,
        }
        with torch.no_grad():
            out = self.module.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=int(s["max_tokens"]),
                do_sample=sample,
                pad_token_id=pad,
                eos_token_id=self.tok.eos_token_id,
                **(kwargs if sample else {}),
            )
        return self.tok.batch_decode(out[:, width:], skip_special_tokens=True)


class VLLMGenerator:
    """`vllm.LLM.generate` over the judge (token-id prompts). Written against vLLM's API; untested here."""

    def __init__(self, model_path: str, rollout: RewardRolloutConfig, trust_remote_code: bool):
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            dtype=rollout.dtype,
            max_model_len=rollout.effective_max_model_len,
            tensor_parallel_size=rollout.tensor_model_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            enforce_eager=rollout.enforce_eager,
            trust_remote_code=trust_remote_code,
        )

    def generate(self, prompts: list[list[int]], s: dict[str, Any]) -> list[str]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = not s["do_sample"] or s["temperature"] <= 0
        params = SamplingParams(
            max_tokens=int(s["max_tokens"]),
            temperature=0.0 if greedy else float(s["temperature"]),
            top_p=1.0 if greedy else float(s["top_p"]),
            top_k=-1 if greedy else int(s["top_k"]),
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]


class GenRMServer:
    """One replica of the served judge (the body of a Ray actor, or a plain object).

    Args:
        model_path: the judge's folder (`reward_model.model.path`; `builtin:tiny` works).
        rollout: `reward_model.rollout` (engine, dtype, lengths, sampling defaults).
        trust_remote_code: `reward_model.model.trust_remote_code`.
        num_threads: torch threads of this process (CPU).
    """

    def __init__(
        self,
        model_path: str,
        rollout: RewardRolloutConfig,
        trust_remote_code: bool = False,
        num_threads: int | None = None,
    ) -> None:
        from hybridrl.config.roles import ModelConfig
        from hybridrl.models.builtin import resolve_model_path
        from hybridrl.models.hf import load_tokenizer

        if rollout.name not in ENGINES:
            raise ValueError(
                f"reward_model.rollout.name={rollout.name!r} is not one of {list(ENGINES)} for a GenRM"
            )
        if num_threads:
            torch.set_num_threads(num_threads)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        path = resolve_model_path(model_path, "reward_model.model.path")
        self.rollout = rollout
        self.tok = load_tokenizer(
            ModelConfig(path=path, trust_remote_code=trust_remote_code), key="reward_model.model"
        )
        if rollout.name == "vllm":
            self.engine: Any = VLLMGenerator(path, rollout, trust_remote_code)
        else:
            self.engine = HFGenerator(path, rollout, trust_remote_code, self.tok)

    def generate(self, prompts: list[str] | list[list[int]], sampling: dict[str, Any]) -> list[str]:
        """One generated text per prompt (a string is tokenized as is, without added special tokens)."""
        if not prompts:
            return []
        ids = [
            self.tok.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in prompts
        ]
        if any(len(p) == 0 for p in ids):
            raise ValueError("a GenRM prompt is empty; the custom reward function must send some text")
        check_prompts(ids, int(sampling["max_tokens"]), self.rollout)
        return self.engine.generate(ids, sampling)


class GenRMClient:
    """What the custom reward function receives as `reward_model_client`: batched generate requests.

    Args:
        servers: GenRMServer replicas (Ray actor handles, or plain objects in this process).
        rollout: `reward_model.rollout` (sampling defaults, `request_timeout_s`).
        tokenizer: the judge's tokenizer (its chat template renders `chat` conversations).
    """

    def __init__(self, servers: list[Any], rollout: RewardRolloutConfig, tokenizer: Any) -> None:
        if not servers:
            raise ValueError("GenRMClient needs at least one judge replica")
        self.servers, self.tokenizer = list(servers), tokenizer
        self.defaults = default_sampling(rollout)
        self.timeout = float(rollout.request_timeout_s)

    def _sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"GenRMClient sampling arguments {unknown} are not among {list(SAMPLING_KEYS)}")
        return {**self.defaults, **{k: v for k, v in overrides.items() if v is not None}}

    def generate(self, prompts: list[str] | list[list[int]], **sampling: Any) -> list[str]:
        """One judge answer per prompt (text, or token ids), in order; one request per replica.

        Args:
            prompts: rendered prompt strings or token-id lists (length N).
            **sampling: per-call overrides of max_tokens, temperature, top_k, top_p, do_sample.

        Raises:
            TimeoutError: the judge did not answer within reward_model.rollout.request_timeout_s.
        """
        prompts = list(prompts)
        if not prompts:
            return []
        s = self._sampling(sampling)
        bounds = row_parts(len(prompts), len(self.servers))
        parts = [prompts[lo:hi] for lo, hi in bounds]
        if isinstance(self.servers[0], GenRMServer):
            outs = self._local(parts, s)
        else:
            outs = self._remote(parts, s)
        return [text for part in outs for text in part]

    def chat(self, conversations: list[list[dict[str, str]]], **sampling: Any) -> list[str]:
        """`generate` on conversations rendered with the judge's chat template (generation prompt added)."""
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations
        ]
        return self.generate(prompts, **sampling)

    def _timeout_error(self, n: int) -> TimeoutError:
        return TimeoutError(
            f"the generative reward model did not answer {n} prompt(s) within {TIMEOUT_KEY}={self.timeout:g} s; "
            f"raise {TIMEOUT_KEY}, ask for fewer tokens (max_tokens / reward_model.rollout.response_length), or "
            "check that the judge's engine is alive"
        )

    def _remote(self, parts: list[list], s: dict[str, Any]) -> list[list[str]]:
        import ray

        refs = [server.generate.remote(part, s) for server, part in zip(self.servers, parts)]
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            for ref in refs:
                ray.cancel(ref)
            raise self._timeout_error(sum(map(len, parts))) from None

    def _local(self, parts: list[list], s: dict[str, Any]) -> list[list[str]]:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(parts))
        futures = [pool.submit(server.generate, part, s) for server, part in zip(self.servers, parts)]
        try:
            return [f.result(timeout=self.timeout) for f in futures]
        except concurrent.futures.TimeoutError:
            raise self._timeout_error(sum(map(len, parts))) from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def attach_client(
    reward_fn: Any, client: GenRMClient | None, tokenizer: Any, router_address: str | None = None
) -> None:
    """Give a reward manager's score function the judge: `reward_model_client`, `reward_model_tokenizer`
    and (veRL's) `reward_router_address`, each where the manager holds its placeholder
    (trainer/ppo/genrm_config.genrm_reward_kwargs); client and tokenizer also without one."""
    if reward_fn is None or not hasattr(reward_fn, "reward_kwargs"):
        return
    values = {"reward_model_client": client, "reward_model_tokenizer": tokenizer}
    if "reward_router_address" in reward_fn.reward_kwargs:
        values["reward_router_address"] = router_address
        if "reward_model_client" not in reward_fn.reward_kwargs:  # a veRL-shaped function without **kwargs
            values.pop("reward_model_client")
    reward_fn.reward_kwargs = {**reward_fn.reward_kwargs, **values}


def wants_router(reward_fn: Any) -> bool:
    """Whether a reward manager's score function takes `reward_router_address`."""
    return reward_fn is not None and "reward_router_address" in getattr(reward_fn, "reward_kwargs", {})
