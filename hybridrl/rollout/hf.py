"""HFRollout: generation with Hugging Face `model.generate` on a private, unsharded model copy.

Why a private copy: with an FSDP-sharded model every forward is a collective, so ranks that
stop generating at different steps (different response lengths) would deadlock. Each rank
keeps a plain model for generation and receives the trained weights via `update_weights`.
This is the reference engine: simple and exact, slower than vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    PretrainedConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from hybridrl.config.rollout import RolloutConfig
from hybridrl.cpu.decode_gemm import install_decode_gemm
from hybridrl.cpu.gqa_attention import install_cpu_gqa_attention
from hybridrl.cpu.kv_cache import growing_cache
from hybridrl.cpu.sampler import InverseCdfSampler, use_inverse_cdf
from hybridrl.models.moe import RouterTap
from hybridrl.models.weight_map import get_weight_name_map, map_named_tensors, to_torch_dtype
from hybridrl.rollout.base import (
    BaseRollout,
    GenerationRequest,
    GenerationResult,
    register_rollout,
    truncate_at_eos,
)
from hybridrl.rollout.hf_prefix import shared_prefill
from hybridrl.utils.device import get_torch_device

__all__ = ["HFRollout"]


class _AbortCriteria(StoppingCriteria):
    """Stops every row of a `generate` call once the rollout's `abort_requested()` is true
    (checked after each decode step; the tokens generated so far are kept)."""

    def __init__(self, rollout: HFRollout) -> None:
        self.rollout = rollout

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        stop = bool(self.rollout.abort_requested())
        if stop:
            self.rollout.last_generate_aborted = True
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@register_rollout("hf")
class HFRollout(BaseRollout):
    """`model.generate` on the rollout's own model copy.

    Args:
        config: rollout section. Uses temperature/top_k/top_p/do_sample, response_length,
            ignore_eos, dtype, load_format, calculate_log_probs, seed, hf_decode_gemm_max_rows
            (CPU float32 only: cpu/decode_gemm.py; text rows decode with a KV cache that grows
            in place, cpu/kv_cache.py), hf_sampler (inverse-CDF sampling for
            large vocabularies: cpu/sampler.py), enable_prefix_caching (one prefill
            per distinct prompt row: rollout/hf_prefix.py), and the micro-batch size
            `log_prob_micro_batch_size_per_gpu` (else max_num_seqs; with log_prob_use_dynamic_bsz
            the rows per micro-batch are log_prob_max_token_len_per_gpu // (P + T)).
        model_path: HF model directory (config always; weights unless load_format is dummy).
        tokenizer: tokenizer of the model.
        model_config: optional HF config to use instead of the one at `model_path`.
        device: where the model lives (default: this rank's accelerator, else CPU).

    Sampling is seeded per micro-batch with the seed of its first row (torch's RNG is forked,
    so the caller's RNG state is untouched): the same seed, weights and batching reproduce.

    Interruptible (partial rollout, hybridrl/rollout/resume.py): when `abort_requested`
    is set (a callable), every decode step asks it; once it returns True the call stops, returns
    the tokens generated so far (later micro-batches: none) and sets `last_generate_aborted`.
    """

    interruptible = True

    def __init__(
        self,
        config: RolloutConfig,
        model_path: str,
        tokenizer: Any,
        *,
        model_config: PretrainedConfig | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if config.tensor_model_parallel_size != 1:
            from hybridrl.rollout.parallel import validate_rollout_parallel

            # the engine has one rank per model copy: refuse with the start-up check's message
            validate_rollout_parallel(
                config.tensor_model_parallel_size, config.tensor_model_parallel_size, "hf"
            )
        super().__init__(config, model_path, tokenizer)
        self.device = torch.device(device) if device is not None else get_torch_device()
        self.dtype = to_torch_dtype(config.dtype)
        hf_config = model_config if model_config is not None else AutoConfig.from_pretrained(model_path)
        auto = AutoModelForCausalLM
        if getattr(hf_config, "vision_config", None) is not None:  # a vision-language model
            from transformers import AutoModelForImageTextToText as auto
        if config.is_dummy_load:
            model = auto.from_config(hf_config)
        else:
            model = auto.from_pretrained(model_path, config=hf_config)
        model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        # A fresh generation config: the checkpoint's defaults (repetition_penalty, top_k=50,
        # temperature, ...) must not leak into RL sampling; everything comes from `config`. No
        # EOS here: every call names its EOS ids, and `generate` would fall back to this default
        # when a call passes none (ignore_eos), stopping at EOS after all.
        model.generation_config = GenerationConfig(
            pad_token_id=self.pad_token_id,
            eos_token_id=None,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
        )
        if self.device.type == "cpu" and self.dtype == torch.float32 and config.hf_decode_gemm_max_rows > 0:
            # decode steps (few rows per linear) as W @ x^T: the parameters stay the same objects
            install_decode_gemm(model, config.hf_decode_gemm_max_rows)
        if self.device.type == "cpu":  # grouped-query heads without copying K/V under a padding mask
            install_cpu_gqa_attention(model)
        self.model = model
        text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.inverse_cdf = use_inverse_cdf(config.hf_sampler, int(text_cfg.vocab_size))
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        self.tied_embeddings = out_emb is not None and out_emb.weight is in_emb.weight
        # name -> tensor to copy into (parameters and persistent buffers, HF names)
        self._targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._name_map = get_weight_name_map("hf")
        # enable_rollout_routing_replay: the experts each token is routed to, recorded per call
        self._router_tap = RouterTap(model) if config.enable_rollout_routing_replay else None

    # ---- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each streamed tensor into the model in place (dtype/device cast inside copy_)."""
        for name, tensor in map_named_tensors(
            named_tensors, self._name_map, tied_lm_head="drop" if self.tied_embeddings else "keep"
        ):
            dst = self._targets.get(name)
            if dst is None:
                known = list(self._targets)[:5]
                raise KeyError(
                    f"HFRollout.update_weights: no weight named {name!r} in the rollout model "
                    f"(names look like {known}); the trainer must send HF parameter names"
                )
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"HFRollout.update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the rollout model expects {tuple(dst.shape)}"
                )
            # through the parameter itself, not `.data`: its version counter moves, which tells the
            # oneDNN decode layers (cpu/decode_gemm.py) to pack the new weight
            dst.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- generation ---------------------------------------------------------------------------
    def _rows_per_micro_batch(self, prompt_len: int) -> int:
        cfg = self.config
        if cfg.log_prob_use_dynamic_bsz:
            return max(1, cfg.log_prob_max_token_len_per_gpu // (prompt_len + cfg.response_length))
        return cfg.log_prob_micro_batch_size_per_gpu or cfg.max_num_seqs

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        bsz, prompt_len = request.input_ids.shape
        step = self._rows_per_micro_batch(prompt_len)
        tokens: list[list[int]] = []
        log_probs: list[list[float]] | None = [] if request.want_log_probs else None
        routed: list[torch.Tensor] = []
        self.last_generate_aborted = False
        for start in range(0, bsz, step):
            rows = slice(start, min(start + step, bsz))
            if self.last_generate_aborted:  # aborted: the later micro-batches generate nothing
                toks, lps = [[] for _ in range(rows.stop - start)], [[] for _ in range(rows.stop - start)]
            else:
                toks, lps = self._generate_micro_batch(request, rows)
            tokens += toks
            if log_probs is not None:
                log_probs += lps
            if self._router_tap is not None:
                routed.append(self._routed_experts(rows.stop - start, prompt_len, request.max_new_tokens))
        return GenerationResult(tokens, log_probs, torch.cat(routed) if routed else None)

    def _routed_experts(self, b: int, prompt_len: int, max_new: int) -> torch.Tensor:
        """(b, P + max_new, L, K) routing of the last `generate` call from its router records: the
        prefill call routes the (b, P) prompt, decode call j the j-th generated token; the last
        generated token is never fed to the model (-1), nor are positions past the end."""
        tap = self._router_tap
        calls = len(tap.records[0])
        num_layers, k = len(tap.records), tap.records[0][0].shape[-1] if calls else 0
        out = torch.full((b, prompt_len + max_new, num_layers, k), -1, dtype=torch.long)
        if calls == 0:
            return out
        per_call = [
            torch.stack([tap.records[layer][c] for layer in range(num_layers)], dim=1) for c in range(calls)
        ]
        out[:, :prompt_len] = per_call[0].view(b, prompt_len, num_layers, k).cpu()
        for j, step in enumerate(per_call[1:]):
            out[:, prompt_len + j] = step.view(b, num_layers, k).cpu()
        tap.clear()
        return out

    def _mm_kwargs(self, request: GenerationRequest, rows: slice, ids: torch.Tensor) -> dict[str, Any]:
        """pixel_values (N, D), image_grid_thw (I, 3) (pixel_values_videos / video_grid_thw for
        videos) and mm_token_type_ids (b, P) (1 image, 2 video) of these rows' images and videos."""
        if request.multi_modal_inputs is None:
            return {}
        mms = [m or {} for m in list(request.multi_modal_inputs)[rows]]
        out: dict[str, Any] = {}
        for pix_key, grid_key in (
            ("pixel_values", "image_grid_thw"),
            ("pixel_values_videos", "video_grid_thw"),
        ):
            have = [m for m in mms if m.get(pix_key) is not None]
            if have:
                out[pix_key] = torch.cat([torch.as_tensor(m[pix_key]) for m in have]).to(
                    self.device, self.dtype
                )
                out[grid_key] = torch.cat([torch.as_tensor(m[grid_key]) for m in have]).to(self.device)
        if not out:
            return {}
        cfg = self.model.config
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == cfg.image_token_id] = 1
        if getattr(cfg, "video_token_id", None) is not None:
            types[ids == cfg.video_token_id] = 2
        out["mm_token_type_ids"] = types
        return out

    @torch.no_grad()
    def _generate_micro_batch(
        self, request: GenerationRequest, rows: slice
    ) -> tuple[list[list[int]], list[list[float]]]:
        spec = request.sampling
        ids = request.input_ids[rows].to(self.device)
        mask = request.attention_mask[rows].to(self.device)
        prompt_len = ids.shape[1]
        top_k = spec.top_k if spec.top_k > 0 else 0
        # inverse-CDF sampling (cpu/sampler.py): the processor draws, generate's argmax takes it
        sampler = None
        if not spec.greedy and self.inverse_cdf:
            sampler = InverseCdfSampler(spec.temperature, top_k, spec.top_p, request.want_log_probs)
        hf_sample = not spec.greedy and sampler is None
        gen_cfg = GenerationConfig(
            max_new_tokens=request.max_new_tokens,
            min_new_tokens=0,
            do_sample=hf_sample,
            temperature=spec.temperature if hf_sample else None,
            top_k=top_k if hf_sample else None,
            top_p=spec.top_p if hf_sample else None,
            pad_token_id=self.pad_token_id,
            eos_token_id=None if self.config.ignore_eos else (self.eos_token_ids or None),
            return_dict_in_generate=True,
            output_scores=request.want_log_probs and sampler is None,
        )
        fork_devices = [self.device.index or 0] if self.device.type == "cuda" else []
        stopping = StoppingCriteriaList([_AbortCriteria(self)]) if self.abort_requested is not None else None
        mm = self._mm_kwargs(request, rows, ids)
        if not mm:  # text: a KV cache that grows in place (cpu/kv_cache.py), one prefill per distinct prompt
            cache = growing_cache(self.model, request.max_new_tokens + 1)
            shared = (  # routing is recorded from generate's own prefill of every row
                shared_prefill(self.model, ids, mask, cache=cache)
                if self.config.enable_prefix_caching and self._router_tap is None
                else None
            )
            cache = shared if shared is not None else cache
            if cache is not None:
                mm = {"past_key_values": cache}
        recording = self._router_tap.appending() if self._router_tap is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=fork_devices), recording:
            torch.manual_seed(request.seeds[rows.start])
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=gen_cfg,
                stopping_criteria=stopping,
                logits_processor=LogitsProcessorList([sampler]) if sampler is not None else None,
                **mm,
            )
        new = out.sequences[:, prompt_len:]
        token_lists = new.tolist()
        if not self.config.ignore_eos:
            token_lists = [truncate_at_eos(t, self.eos_token_ids) for t in token_lists]
        lp_lists: list[list[float]] = []
        if request.want_log_probs and new.shape[1] > 0 and sampler is not None:
            lp = torch.stack(sampler.log_probs, dim=1)  # (b, steps): log p(token), warped
            lp_lists = [row[: len(t)] for row, t in zip(lp.cpu().tolist(), token_lists)]
        elif request.want_log_probs and new.shape[1] > 0:
            # scores[j] (b, V) are the processed logits step j was sampled from (after
            # temperature / top-k / top-p); their log_softmax is the sampling distribution.
            scores = torch.stack(out.scores, dim=1).float()  # (b, steps, V)
            lp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            lp_lists = [row[: len(t)] for row, t in zip(lp.cpu().tolist(), token_lists)]
        elif request.want_log_probs:
            lp_lists = [[] for _ in token_lists]
        return token_lists, lp_lists
