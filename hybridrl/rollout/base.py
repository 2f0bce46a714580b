"""The rollout-engine interface, its registry, and the batch contract every engine shares.

Contract of `BaseRollout.generate_sequences(prompts) -> DataProto`:

Input `prompts` (B rows):
    input_ids       (B, P) int64, LEFT-padded with the pad id.
    attention_mask  (B, P) 1 on prompt tokens, 0 on padding; every row ends with a 1.
    position_ids    (B, P) positions of the prompt tokens (0 on padding).
    non_tensor_batch is passed through unchanged.
    meta_info["validate"] (optional bool) selects `config.val_kwargs` for sampling;
    meta_info["greedy"] (optional bool) forces greedy decoding (the ReMax baseline);
    meta_info["seed_index"] (optional int) names the call in the per-row seeds (default: a counter).
An engine generates exactly ONE response per row; the trainer repeats prompts n times first.

Output (same B rows, same order), T = config.response_length:
    prompts         (B, P)   the input_ids as given.
    responses       (B, T)   generated ids, right-padded with the pad id.
    response_mask   (B, T)   1 on generated tokens up to and including the first EOS (or all
                             generated tokens when ignore_eos / the length limit stops it).
    input_ids       (B, P+T) cat(prompts, responses).
    attention_mask  (B, P+T) cat(prompt attention_mask, response_mask).
    position_ids    (B, P+T) prompt positions, then last prompt position + 1 .. + T.
    rollout_log_probs (B, T) float32, only when config.calculate_log_probs: the log-probability
                             of each sampled token under the distribution it was drawn from,
                             i.e. log_softmax(filter(logits / temperature))[token] where
                             filter applies top-k / top-p (renormalised). With the RL defaults
                             (top_k <= 0, top_p = 1) this is log_softmax(logits / temperature),
                             the quantity the actor recomputes. Greedy rows use temperature 1:
                             log_softmax(logits)[token]. 0 on padding.
    meta_info: the input's meta_info plus "metrics" (timing and token counts).

Sampling is seeded: row r of call c on data-parallel rank d gets the seed
`derive_seed(config.seed, c, r, d)`, so the same seed, weights and prompts give the same samples
(per engine; engines differ in kernels), and ranks never share a seed.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrl.config.rollout import RolloutConfig
from hybridrl.protocol import DataProto

__all__ = [
    "BaseRollout",
    "GenerationRequest",
    "GenerationResult",
    "SamplingSpec",
    "build_rollout_output",
    "create_rollout",
    "derive_seed",
    "get_rollout_class",
    "list_rollouts",
    "register_rollout",
    "resolve_sampling",
]

# Built-in engines are named by "module:Class" and imported only when asked for, so that
# `import hybridrl` never imports vllm or sglang.
_LAZY_ROLLOUTS: dict[str, str] = {
    "hf": "hybridrl.rollout.hf:HFRollout",
    "vllm": "hybridrl.rollout.vllm_rollout:VLLMRollout",
    "sglang": "hybridrl.rollout.sglang_rollout:SGLangRollout",
}
_ROLLOUTS: dict[str, type[BaseRollout]] = {}


def register_rollout(name: str) -> Callable[[type[BaseRollout]], type[BaseRollout]]:
    """Class decorator: make an engine available as `actor_rollout_ref.rollout.name=<name>`."""

    def deco(cls: type[BaseRollout]) -> type[BaseRollout]:
        if not (isinstance(cls, type) and issubclass(cls, BaseRollout)):
            raise TypeError(f"register_rollout({name!r}): {cls!r} is not a BaseRollout subclass")
        known = _ROLLOUTS.get(name)
        builtin = _LAZY_ROLLOUTS.get(name)
        if (known is not None and known is not cls) or (
            builtin and builtin != f"{cls.__module__}:{cls.__qualname__}"
        ):
            owner = known.__qualname__ if known is not None else builtin
            raise ValueError(f"rollout name {name!r} is already registered to {owner}; pick another name")
        _ROLLOUTS[name] = cls
        cls.name = name
        return cls

    return deco


def list_rollouts() -> list[str]:
    """Names accepted by `actor_rollout_ref.rollout.name`."""
    return sorted(set(_ROLLOUTS) | set(_LAZY_ROLLOUTS))


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The engine class for `name`, importing built-in engines on first use.

    Importing the engine's module does not need the engine package (vllm, sglang); the class
    raises an ImportError with the install command when it is constructed without it.
    """
    if name not in _ROLLOUTS and name in _LAZY_ROLLOUTS:
        module, _, _attr = _LAZY_ROLLOUTS[name].partition(":")
        importlib.import_module(module)  # its @register_rollout fills _ROLLOUTS
    if name not in _ROLLOUTS:
        raise ValueError(
            f"unknown rollout engine actor_rollout_ref.rollout.name={name!r}; "
            f"known engines: {list_rollouts()}. Register a new one with @register_rollout(name)."
        )
    return _ROLLOUTS[name]


def create_rollout(config: RolloutConfig, model_path: str, tokenizer: Any, **kwargs: Any) -> BaseRollout:
    """Build the engine named by `config.name` (extra kwargs go to its constructor)."""
    return get_rollout_class(config.name)(config, model_path, tokenizer, **kwargs)


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingSpec:
    """Resolved sampling for one call. top_k == -1 means disabled; greedy ignores the rest."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float


def resolve_sampling(config: RolloutConfig, validate: bool, force_greedy: bool = False) -> SamplingSpec:
    """Training sampling from the config's top level, validation sampling from val_kwargs.

    Greedy when do_sample is False, temperature is 0, or `force_greedy` (a greedy baseline
    pass such as ReMax's).
    """
    src = config.val_kwargs if validate else config
    greedy = force_greedy or (not src.do_sample) or src.temperature == 0
    top_k = int(src.top_k) if src.top_k > 0 else -1
    return SamplingSpec(
        greedy=greedy,
        temperature=1.0 if greedy else float(src.temperature),
        top_k=top_k,
        top_p=float(src.top_p),
    )


def derive_seed(seed: int, call_index: int, row: int, dp_rank: int = 0) -> int:
    """A well-mixed 31-bit seed for row `row` of generate call `call_index` on data-parallel
    rank `dp_rank` (deterministic). The rank matters: the same prompt often lands on several
    ranks (GRPO groups split across ranks) and must not get the same samples there."""
    entropy = [seed & 0xFFFFFFFF, call_index, row, dp_rank]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def data_parallel_rank(tensor_parallel_size: int = 1) -> int:
    """This process's rank among engines: global rank // TP size (0 without torch.distributed).

    Ranks of one tensor-parallel engine share it, so they draw identical samples.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() // max(tensor_parallel_size, 1)
    return 0


# ---------------------------------------------------------------------------------------------
# engine hook types and output assembly
# ---------------------------------------------------------------------------------------------
@dataclass
class GenerationRequest:
    """What an engine's `_generate` receives (B rows).

    Attributes:
        input_ids: (B, P) left-padded prompt ids.
        attention_mask: (B, P) prompt mask.
        prompt_token_ids: the B prompts without padding.
        sampling: resolved sampling parameters.
        seeds: one seed per row.
        max_new_tokens: T, the response budget.
        want_log_probs: whether to return the sampled tokens' log-probs.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_token_ids: list[list[int]]
    sampling: SamplingSpec
    seeds: list[int]
    max_new_tokens: int
    want_log_probs: bool
    multi_modal_inputs: Any = None  # (B,) per-row processor inputs of a vision-language batch, or None


@dataclass
class GenerationResult:
    """B token lists (each <= T, EOS included when generated) and optional per-token log-probs;
    with `rollout.enable_rollout_routing_replay`, routed_experts (B, P + T, L, K): the experts each
    token was routed to in each MoE layer, aligned with [prompt | response], -1 where none was."""

    token_ids: list[list[int]]
    log_probs: list[list[float]] | None = None
    routed_experts: torch.Tensor | None = None


def _check_prompts(prompts: DataProto, config: RolloutConfig) -> None:
    if prompts.batch is None:
        raise ValueError(
            "generate_sequences: `prompts.batch` is None; it needs input_ids/attention_mask/position_ids"
        )
    missing = [k for k in ("input_ids", "attention_mask", "position_ids") if k not in prompts.batch.keys()]
    if missing:
        raise ValueError(f"generate_sequences: prompts lack {missing}; build them with the RLHF dataset")
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    if ids.dim() != 2 or mask.shape != ids.shape or prompts.batch["position_ids"].shape != ids.shape:
        raise ValueError(
            "generate_sequences: input_ids, attention_mask and position_ids must all be (B, P); got "
            f"{tuple(ids.shape)}, {tuple(mask.shape)}, {tuple(prompts.batch['position_ids'].shape)}"
        )
    if ids.shape[0] and not bool(mask[:, -1].bool().all()):
        raise ValueError(
            "generate_sequences: prompts must be LEFT-padded (attention_mask[:, -1] == 1 on every row); "
            "set tokenizer.padding_side = 'left' when building the batch"
        )
    total = ids.shape[1] + config.response_length
    if total > config.effective_max_model_len:
        raise ValueError(
            f"prompt length {ids.shape[1]} + response_length {config.response_length} = {total} exceeds "
            f"actor_rollout_ref.rollout.max_model_len={config.effective_max_model_len}; raise max_model_len "
            "or shorten data.max_prompt_length"
        )


def build_rollout_output(
    prompts: DataProto,
    result: GenerationResult,
    pad_token_id: int,
    response_length: int,
    metrics: dict[str, Any] | None = None,
) -> DataProto:
    """Assemble the output batch of the contract above from per-row token lists.

    Args:
        prompts: the input batch (input_ids / attention_mask / position_ids of shape (B, P)).
        result: B token lists of length <= T (and optional log-probs of the same lengths).
        pad_token_id: id used to right-pad `responses`.
        response_length: T.
        metrics: added to meta_info["metrics"].

    Returns:
        DataProto with prompts, responses, response_mask, input_ids, attention_mask,
        position_ids (and rollout_log_probs when result.log_probs is given).
    """
    ids = prompts.batch["input_ids"]
    mask = prompts.batch["attention_mask"]
    pos = prompts.batch["position_ids"]
    bsz, dev = ids.shape[0], ids.device
    if len(result.token_ids) != bsz:
        raise ValueError(f"engine returned {len(result.token_ids)} responses for {bsz} prompts")
    responses = torch.full((bsz, response_length), pad_token_id, dtype=ids.dtype)
    response_mask = torch.zeros((bsz, response_length), dtype=mask.dtype)
    log_probs = (
        torch.zeros((bsz, response_length), dtype=torch.float32) if result.log_probs is not None else None
    )
    for i, toks in enumerate(result.token_ids):
        n = len(toks)
        if n > response_length:
            raise ValueError(
                f"engine returned {n} tokens for row {i}, more than response_length={response_length}"
            )
        if n:
            responses[i, :n] = torch.as_tensor(toks, dtype=ids.dtype)
            response_mask[i, :n] = 1
            if log_probs is not None:
                if len(result.log_probs[i]) != n:
                    raise ValueError(f"row {i}: {len(result.log_probs[i])} log-probs for {n} tokens")
                log_probs[i, :n] = torch.as_tensor(result.log_probs[i], dtype=torch.float32)
    responses, response_mask = responses.to(dev), response_mask.to(dev)
    delta = torch.arange(1, response_length + 1, device=dev, dtype=pos.dtype)
    tensors = {
        "prompts": ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([ids, responses], dim=1),
        "attention_mask": torch.cat([mask, response_mask], dim=1),
        "position_ids": torch.cat([pos, pos[:, -1:] + delta], dim=1),
    }
    if log_probs is not None:
        tensors["rollout_log_probs"] = log_probs.to(dev)
    if result.routed_experts is not None:  # MoE routing recorded by the engine (R3), -1 at padding
        routed = result.routed_experts.to(dev)
        tensors["routed_experts"] = routed.masked_fill(~tensors["attention_mask"].bool()[..., None, None], -1)
    meta = dict(prompts.meta_info)
    if metrics:
        meta["metrics"] = {**meta.get("metrics", {}), **metrics}
    return DataProto.from_dict(tensors, dict(prompts.non_tensor_batch), meta)


MEMORY_TAGS = ("weights", "kv_cache")


class SleepTracker:
    """Which parts of a sleeping engine's memory are still released (vLLM / SGLang tags)."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def release(self) -> None:
        self.released = set(MEMORY_TAGS)

    def wake(self, tags: list[str] | None) -> list[str]:
        """The tags of `tags` (None: all) still released, now marked awake (in MEMORY_TAGS order)."""
        want = set(MEMORY_TAGS if tags is None else tags) & self.released
        self.released -= want
        return [t for t in MEMORY_TAGS if t in want]


def truncate_at_eos(tokens: list[int], eos_token_ids: Iterable[int]) -> list[int]:
    """`tokens` up to and including the first EOS."""
    eos = set(eos_token_ids)
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


def get_eos_token_ids(tokenizer: Any, model_path: str | None) -> list[int]:
    """EOS ids from the tokenizer and, when present, the model's generation_config.json."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    if model_path:
        try:
            from transformers import GenerationConfig

            gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except (OSError, ValueError):
            gen_eos = None
        if gen_eos is not None:
            ids += [int(x) for x in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])]
    return list(dict.fromkeys(ids))


# ---------------------------------------------------------------------------------------------
# the interface
# ---------------------------------------------------------------------------------------------
class BaseRollout(ABC):
    """A generation engine colocated with the trainer (one per rank).

    Subclasses implement `_generate` (token lists in, token lists out), `update_weights`, and
    optionally `release_memory` / `resume_memory` / `shutdown`.

    Args:
        config: the rollout section.
        model_path: HF model directory (architecture, and weights unless load_format is dummy).
        tokenizer: its tokenizer; gives the pad and EOS ids.
    """

    name: str = "base"
    # Interruptible generation (partial rollout, resume.py): an engine whose `interruptible` is
    # True asks `abort_requested()` (when set) between decode steps; once it returns True the call
    # stops, returns every row's tokens so far and sets `last_generate_aborted`. Others ignore it,
    # so the asynchronous trainer refuses partial rollout with them at start-up.
    interruptible: bool = False
    abort_requested: Callable[[], bool] | None = None
    last_generate_aborted: bool = False

    def __init__(self, config: RolloutConfig, model_path: str, tokenizer: Any) -> None:
        self.config = config
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = get_eos_token_ids(tokenizer, model_path)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            if not self.eos_token_ids:
                raise ValueError("the tokenizer has neither a pad_token_id nor an eos_token_id; set one")
            pad = self.eos_token_ids[0]
        self.pad_token_id = int(pad)
        self.num_generate_calls = 0
        self.dp_rank = data_parallel_rank(config.tensor_model_parallel_size)

    # ---- generation ---------------------------------------------------------------------------
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per row; see the module docstring for the exact contract."""
        _check_prompts(prompts, self.config)
        meta = prompts.meta_info
        force_greedy = bool(meta.get("greedy", False)) or meta.get("do_sample", True) is False
        sampling = resolve_sampling(self.config, bool(meta.get("validate", False)), force_greedy)
        if prompts.meta_info.get("greedy", False):  # e.g. the ReMax baseline
            sampling = SamplingSpec(greedy=True, temperature=1.0, top_k=-1, top_p=1.0)
        ids = prompts.batch["input_ids"]
        mask = prompts.batch["attention_mask"].bool()
        prompt_lists = [row[m].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
        # The trainer names each call (step, batch) so seeds survive a resume; else count calls.
        call = int(prompts.meta_info.get("seed_index", self.num_generate_calls))
        self.num_generate_calls += 1
        request = GenerationRequest(
            input_ids=ids,
            attention_mask=prompts.batch["attention_mask"],
            prompt_token_ids=prompt_lists,
            sampling=sampling,
            seeds=[derive_seed(self.config.seed, call, r, self.dp_rank) for r in range(len(prompt_lists))],
            max_new_tokens=self.config.response_length,
            want_log_probs=self.config.calculate_log_probs,
            multi_modal_inputs=prompts.non_tensor_batch.get("multi_modal_inputs"),
        )
        t0 = time.perf_counter()
        result = (
            self._generate(request)
            if prompt_lists
            else GenerationResult([], [] if request.want_log_probs else None)
        )
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(t) for t in result.token_ids)
        metrics = {
            "timing_s/generate_sequences": elapsed,
            "rollout/num_response_tokens": n_tokens,
            "rollout/tokens_per_s": n_tokens / max(elapsed, 1e-9),
        }
        return build_rollout_output(prompts, result, self.pad_token_id, self.config.response_length, metrics)

    def generate_tokens(self, request: GenerationRequest) -> GenerationResult:
        """Token lists in, token lists out, without the batch contract (the agent loops' entry:
        hybridrl.agent.engine batches many trajectories' requests into one call)."""
        if not request.prompt_token_ids:
            return GenerationResult([], [] if request.want_log_probs else None)
        return self._generate(request)

    @abstractmethod
    def _generate(self, request: GenerationRequest) -> GenerationResult:
        """Engine-specific generation of one response per prompt."""

    # ---- weights and memory -------------------------------------------------------------------
    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, consuming `(hf_name, tensor)` pairs as a stream (one pass).

        Names are HF training names; the engine maps and casts them (models/weight_map.py).
        A partial stream updates only the named tensors.
        """

    def release_memory(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Free generation memory (KV cache, and weights where supported) before training."""

    def resume_memory(self, tags: list[str] | None = None) -> None:  # noqa: B027
        """Re-allocate what `release_memory` freed (`tags` as in vLLM: "weights", "kv_cache")."""

    def shutdown(self) -> None:  # noqa: B027
        """Tear the engine down. Leaves the caller's torch.distributed process group intact."""
