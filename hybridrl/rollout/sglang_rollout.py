"""SGLangRollout: SGLang's offline `sglang.Engine` as the rollout engine (GPU only).

UNTESTED ON GPU: written against SGLang's public offline-engine API (`sglang.Engine(**server
args)`, `engine.generate(input_ids=..., sampling_params=..., return_logprob=...)`,
`engine.update_weights_from_tensor(named_tensors, flush_cache=...)`,
`engine.release_memory_occupation()` / `resume_memory_occupation()`, `engine.shutdown()`);
SGLang is CUDA-only, so none of this ran on the CPU machines. The tests
skip cleanly without sglang.

Differences from VLLMRollout worth knowing:
* The engine runs its scheduler in a subprocess; tensors cross by CUDA IPC, so weights
  should be on the GPU when synced. Each `update_weights_from_tensor` call runs the model's
  `load_weights` on its list directly (no layer-wise reload), so per-bucket calls are fine;
  the KV cache is flushed once at the end.
* Per-request seeds use SamplingParams' `sampling_seed` where the installed SGLang has it.
* `rollout_log_probs` are SGLang's `output_token_logprobs`; check that your SGLang version
  reports them after temperature scaling (the contract in base.py) before relying on them.
* Tensor parallelism (tensor_model_parallel_size = TP > 1; untested on GPU): SGLang's Engine runs
  its own TP scheduler processes, so only the first rank of each TP group of the worker group
  (rank % TP == 0, the rollout mesh's collecting rank) builds an Engine with tp_size=TP on GPUs
  base_gpu_id .. base_gpu_id + TP - 1; that rank's process must see those GPUs. The other ranks
  of the group hold no engine: they take part in the weight gather (a collective) and drop the
  tensors, and their generate results are discarded by the mesh dispatch. The owner passes full
  tensors to `update_weights_from_tensor`; SGLang's weight loaders keep each TP worker's slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hybridrl.config.rollout import RolloutConfig
from hybridrl.models.weight_map import dtype_name, get_weight_name_map, map_named_tensors
from hybridrl.rollout.base import (
    BaseRollout,
    GenerationRequest,
    GenerationResult,
    SleepTracker,
    register_rollout,
)
from hybridrl.weight_sync.buckets import iter_buckets

__all__ = ["SGLangRollout"]


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            "actor_rollout_ref.rollout.name=sglang needs SGLang (CUDA only): `pip install 'hybridrl[sglang]'` "
            f"on a GPU machine, or use rollout.name=vllm / hf. Import error: {e}"
        ) from e
    return sglang


def _supports_sampling_seed() -> bool:
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams
    except ImportError:
        return False
    fields = getattr(SamplingParams, "__struct_fields__", None)
    if fields is not None:
        return "sampling_seed" in fields
    import inspect

    return "sampling_seed" in inspect.signature(SamplingParams).parameters


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@register_rollout("sglang")
class SGLangRollout(BaseRollout):
    """Generation with SGLang's offline engine (untested on GPU; see the module docstring).

    Args:
        config: rollout section; engine_kwargs.sglang is passed to `sglang.Engine` last.
        model_path: HF model directory.
        tokenizer: its tokenizer (pad / EOS ids; the engine runs without one).
    """

    def __init__(self, config: RolloutConfig, model_path: str, tokenizer: Any) -> None:
        super().__init__(config, model_path, tokenizer)
        sglang = _import_sglang()
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._name_map = get_weight_name_map("sglang")
        self._memory_saver = bool(config.free_cache_engine)
        self._sleep = SleepTracker()
        self._seeded = _supports_sampling_seed()
        tp = config.tensor_model_parallel_size
        self.owns_engine = _global_rank() % tp == 0
        self.engine = None
        if not self.owns_engine:
            return
        kwargs: dict[str, Any] = {
            "model_path": model_path,
            "skip_tokenizer_init": True,
            "dtype": dtype_name(config.dtype),
            "random_seed": config.seed,
            "load_format": "dummy" if config.is_dummy_load else "auto",
            "mem_fraction_static": config.gpu_memory_utilization,
            "tp_size": config.tensor_model_parallel_size,
            "ep_size": config.expert_parallel_size,  # MoE experts over the engine's TP ranks (EP = TP)
            "max_running_requests": config.max_num_seqs,
            "chunked_prefill_size": config.max_num_batched_tokens,
            "context_length": config.effective_max_model_len,
            "disable_cuda_graph": config.enforce_eager,
            "enable_memory_saver": self._memory_saver,
            "log_level": "error",
        }
        if torch.cuda.is_available():
            kwargs["base_gpu_id"] = torch.cuda.current_device()
        kwargs.update(dict(config.engine_kwargs.sglang))
        self.engine = sglang.Engine(**kwargs)

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        if self.engine is None:  # a non-first TP rank: the group's first rank answers for it
            empty = [[] for _ in request.prompt_token_ids]
            return GenerationResult(empty, [[] for _ in empty] if request.want_log_probs else None)
        spec, cfg = request.sampling, self.config
        params = []
        for seed in request.seeds:
            p: dict[str, Any] = {
                "max_new_tokens": request.max_new_tokens,
                "temperature": 0.0 if spec.greedy else spec.temperature,
                "top_p": 1.0 if spec.greedy else spec.top_p,
                "top_k": -1 if spec.greedy or spec.top_k <= 0 else spec.top_k,
                "ignore_eos": cfg.ignore_eos,
                "stop_token_ids": [] if cfg.ignore_eos else list(self.eos_token_ids),
                "no_stop_trim": True,  # keep the EOS token in output_ids
                "skip_special_tokens": False,
            }
            if self._seeded:
                p["sampling_seed"] = seed
            params.append(p)
        self.resume_memory()
        outputs = self.engine.generate(
            input_ids=request.prompt_token_ids, sampling_params=params, return_logprob=request.want_log_probs
        )
        tokens = [list(o["output_ids"]) for o in outputs]
        log_probs = None
        if request.want_log_probs:
            log_probs = [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] for o in outputs]
        return GenerationResult(tokens, log_probs)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Per-bucket `update_weights_from_tensor` calls, then one KV-cache flush."""
        if self.engine is None:  # consume the stream: producing it is a collective over all ranks
            for _ in named_tensors:
                pass
            return
        self.resume_memory(tags=["weights"])
        stream = map_named_tensors(
            named_tensors, self._name_map, tied_lm_head="drop" if self.tied_embeddings else "keep"
        )
        bucket_bytes = self.config.update_weights_bucket_megabytes * 2**20
        for bucket in iter_buckets(stream, bucket_bytes):
            self.engine.update_weights_from_tensor(bucket, flush_cache=False)
        self.engine.flush_cache()

    def release_memory(self) -> None:
        if self.engine is not None and self._memory_saver and not self._sleep.released:
            self.engine.release_memory_occupation()
            self._sleep.release()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Wake all, or only `tags` ("weights", "kv_cache": veRL's multi_stage_wake_up order)."""
        if self.engine is not None and self._memory_saver:
            todo = self._sleep.wake(tags)
            if todo:
                self.engine.resume_memory_occupation(tags=todo)

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
