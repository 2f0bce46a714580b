"""Keys of veRL's newest yaml that hybridrl's schema has no field for: accepted or refused.

Each `Leaf` lists the values that mean what hybridrl does (usually veRL's default); such a value
is dropped before the schema merge, any other is a ConfigError naming the key and `why`. A
`Section` is a subtree governed by one switch (`*.mtp.enable`, `transfer_queue.enable`, ...): with
the switch off (or not given) every key below it is dropped (veRL reads none of them then); on,
the key is refused. docs/config.md lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from hybridrl.utils.config_loader import ConfigError

ARR = "actor_rollout_ref"
ANY = object()  # every value is accepted (the key has no effect here, said in `why`)


@dataclass(frozen=True)
class Leaf:
    key: str
    ok: tuple
    why: str


@dataclass(frozen=True)
class Section:
    prefix: str
    switch: str | None  # a key under prefix; None: the subtree is accepted whole
    off: tuple
    why: str


FSDP = (f"{ARR}.actor.fsdp_config", f"{ARR}.ref.fsdp_config", "critic.model.fsdp_config", "critic.fsdp")
ROLES = (f"{ARR}.actor", f"{ARR}.ref")
MODELS = (f"{ARR}.model", "critic.model")
OPTIMS = (f"{ARR}.actor.optim", "critic.optim")
MEGATRON = (f"{ARR}.actor.megatron", f"{ARR}.ref.megatron", "critic.megatron")
PROFILERS = (
    "global_profiler",
    f"{ARR}.actor.profiler",
    f"{ARR}.ref.profiler",
    f"{ARR}.rollout.profiler",
    "critic.profiler",
)
ROLLOUT = f"{ARR}.rollout"
VLM = "multimodal data is for vision-language RL (docs/vlm.md); text data does not read it"
NO_ENTROPY = "changes nothing here: that role computes no entropy (as in veRL)"
MEGATRON_FSDP = (  # checked on megatron-core 0.16.1, CPU torch 2.13, 2 gloo ranks
    "Megatron-FSDP is not implemented (Megatron uses its DDP here): megatron-core 0.16.1's FullyShardedDataParallel "
    "is CUDA-only and cannot be tested on the CPU machines (it builds 'cuda:<device>' devices, 'Invalid device string: "
    "cuda:cpu' at megatron_fsdp.py:184, and a device_type='cuda' DeviceMesh, 'Torch not compiled with CUDA enabled' "
    "at param_and_grad_buffer.py:4145)"
)


def _leaves() -> list[Leaf]:
    out = []
    for f in FSDP:
        out += [
            Leaf(
                f"{f}.use_orig_params",
                (False, True),
                "FSDP2 always shards the original parameters (an FSDP1 flag)",
            ),
            Leaf(f"{f}.seed", (42,), "the engine's seed is trainer.seed here"),
            Leaf(f"{f}.full_determinism", (False,), "deterministic kernels are not switched on here"),
            Leaf(
                f"{f}.pad_to_length",
                (False,),
                "sequences are packed (use_remove_padding) or padded per batch",
            ),
            Leaf(f"{f}.pad_to_length_bucket", ANY, "only read with pad_to_length=True"),
            Leaf(
                f"{f}.forward_only", (False,), "set by veRL for forward-only roles; hybridrl knows the role"
            ),
            Leaf(f"{f}.strategy", ("fsdp", "fsdp2"), "hybridrl's FSDP engine is FSDP2"),
            Leaf(
                f"{f}.dtype",
                ("bfloat16", "bf16"),
                "the compute dtype is fsdp_config.mixed_precision.param_dtype",
            ),
            Leaf(f"{f}.entropy_from_logits_chunk_size", (2048,), "the entropy chunk is 2048 positions here"),
        ]
    out += [
        Leaf(f"critic.fsdp.{k}", (False, True), "the critic computes no entropy and is not compiled")
        for k in ("entropy_from_logits_with_chunking", "entropy_checkpointing", "use_torch_compile")
    ]
    for r in ROLES:
        out += [
            Leaf(f"{r}.entropy_from_logits_chunk_size", (2048,), "the entropy chunk is 2048 positions here"),
            Leaf(
                f"{r}.pad_to_length",
                (False,),
                "sequences are packed (use_remove_padding) or padded per batch",
            ),
            Leaf(f"{r}.rollout_n", ANY, "the trainer reads actor_rollout_ref.rollout.n"),
        ]
    out += [
        Leaf(f"{ARR}.ref.entropy_checkpointing", (False, True), f"ref.entropy_checkpointing {NO_ENTROPY}"),
        Leaf(f"{ARR}.actor.loss_scale_factor", (None,), "the loss is scaled by loss_agg_mode only"),
        Leaf("critic.loss_scale_factor", (None,), "the loss is scaled by loss_agg_mode only"),
        Leaf("critic.enable", (None,), "the critic runs when algorithm.adv_estimator needs one (gae)"),
    ]
    for c in (f"{ARR}.actor.checkpoint", "critic.checkpoint"):
        out += [
            Leaf(f"{c}.strict", (True,), "checkpoints load strictly here (every saved tensor must match)"),
            Leaf(f"{c}.async_save", (False,), "checkpoints are written synchronously"),
        ]
    for m in MODELS:
        out += [
            Leaf(f"{m}.hf_config_path", (None,), "the config is read from model.path"),
        ]
    for o in OPTIMS:
        out += [
            Leaf(f"{o}.optimizer", ("AdamW", "adamw"), "the optimizer is torch's AdamW"),
            Leaf(f"{o}.optimizer_impl", ("torch.optim",), "the optimizer is torch.optim.AdamW"),
            Leaf(f"{o}.zero_indexed_step", (True,), "the schedule counts optimizer steps from 0"),
        ]
    for m in MEGATRON:
        out += [
            Leaf(
                f"{m}.vanilla_mbridge",
                (False, True),
                "HF <-> Megatron weights go through hybridrl's own maps",
            ),
            Leaf(f"{m}.use_megatron_fsdp", (False,), MEGATRON_FSDP),
        ]
    no_replay = "the critic's forward has no routing replay (it is the actor's and the reference's)"
    out += [
        Leaf("critic.megatron.router_replay.mode", ("disabled",), no_replay),
        Leaf("critic.megatron.router_replay.record_file", (None,), no_replay),
        Leaf("critic.megatron.router_replay.replay_file", (None,), no_replay),
    ]
    for p in PROFILERS:
        out += [
            Leaf(
                f"{p}.relocate_results",
                (False, True),
                "veRL moves the traces to global_profiler.save_path; hybridrl writes them there",
            ),
            Leaf(f"{p}.finish_hook_cmd", (None,), "no post-profiling hook is run"),
            Leaf(f"{p}.finish_hook_all_ranks", (False,), "no post-profiling hook is run"),
            Leaf(f"{p}.finish_hook_ranks", ([],), "no post-profiling hook is run"),
        ]
    out += _rollout_leaves() + _reward_leaves() + _other_leaves() + _lora_leaves()
    return out


def _rollout_leaves() -> list[Leaf]:
    return [
        Leaf(
            f"{ROLLOUT}.pipeline_model_parallel_size", (1,), "rollout pipeline parallelism is not implemented"
        ),
        Leaf(f"{ROLLOUT}.nnodes", (0,), "the rollout runs on the training slots (hybrid engine)"),
        Leaf(f"{ROLLOUT}.n_gpus_per_node", ANY, "only read with rollout.nnodes > 0"),
        Leaf(f"{ROLLOUT}.full_determinism", (False,), "deterministic sampling kernels are not switched on"),
        Leaf(
            f"{ROLLOUT}.skip_tokenizer_init",
            (True,),
            "the engines take and return token ids (always True here)",
        ),
        Leaf(f"{ROLLOUT}.quantization", (None,), "rollout quantization is not implemented"),
        Leaf(f"{ROLLOUT}.quantization_config_file", (None,), "rollout quantization is not implemented"),
        Leaf(
            f"{ROLLOUT}.moe_load_balance_metrics_interval", (0,), "MoE load-balance metrics are not collected"
        ),
        Leaf(
            f"{ROLLOUT}.multi_turn.use_inference_chat_template",
            (False,),
            "the training chat template is used",
        ),
        Leaf(f"{ROLLOUT}.multi_turn.num_repeat_rollouts", (None,), "use rollout.n"),
        Leaf(f"{ROLLOUT}.agent.custom_async_server.path", (None,), "the rollout server is hybridrl's own"),
        Leaf(f"{ROLLOUT}.agent.custom_async_server.name", (None,), "the rollout server is hybridrl's own"),
        Leaf(
            f"{ROLLOUT}.checkpoint_engine.custom_backend_module", (None,), "weight sync backends: naive only"
        ),
    ]


REWARD_ROLLOUT_DEFAULTS = {  # veRL's reward-model serving keys hybridrl's reward loop has no field for
    "cudagraph_capture_sizes": None,
    "free_cache_engine": True,
    "data_parallel_size": 1,
    "expert_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 1024,
    "load_format": "auto",
    "layered_summon": False,
    "scheduling_policy": "fcfs",
    "full_determinism": False,
    "seed": 42,
    "multi_stage_wake_up": False,
    "engine_kwargs": {},
    "limit_images": None,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "skip_tokenizer_init": False,
    "quantization": None,
    "quantization_config_file": None,
    "mtp": None,
    "ignore_eos": False,  # a GenRM judge stops at its EOS
}


def _reward_leaves() -> list[Leaf]:
    why = "the reward loop's engine is configured by reward_model.rollout.{name,dtype,tensor_model_parallel_size,...}"
    out = []
    for k, v in REWARD_ROLLOUT_DEFAULTS.items():
        out.append(Leaf(f"reward.reward_model.rollout.{k}", (v,), why))
        out.append(Leaf(f"reward_model.rollout.{k}", (None, v), why))
    pool = "the reward model is served on the training slots; a separate resource pool is not implemented"
    for p, unset in (("reward.reward_model", ()), ("reward_model", (None,))):
        out += [
            Leaf(f"{p}.enable_resource_pool", (*unset, False), pool),
            Leaf(f"{p}.nnodes", (*unset, 0), pool),
            Leaf(f"{p}.n_gpus_per_node", ANY, "only read with enable_resource_pool=True"),
        ]
    out.append(
        Leaf("reward.reward_model.rollout.disaggregation.enabled", (False,), "no prefill/decode split")
    )
    return out


def _lora_leaves() -> list[Leaf]:
    """veRL's model.lora keys beside rank / alpha / targets / A's init (those become model.lora_*)."""
    lora = f"{ARR}.model.lora"
    return [
        Leaf(f"{lora}.type", ("lora",), "plain LoRA only (canonical_lora / DoRA are not implemented)"),
        Leaf(
            f"{lora}.merge", ANY, "the weight sync always sends the merged weights W + s*B@A to the rollout"
        ),
        Leaf(f"{lora}.dropout", (0, 0.0), "LoRA dropout is not implemented"),
        Leaf(f"{lora}.dropout_position", ANY, "no LoRA dropout here (dropout=0)"),
        Leaf(
            f"{lora}.lora_B_init_method", ("zero",), "B starts at zero (the adapted model starts as the base)"
        ),
        Leaf(
            f"{lora}.a2a_experimental",
            (False,),
            "Megatron-Bridge's experimental all-to-all LoRA is not implemented",
        ),
        Leaf(f"{lora}.dtype", (None,), "the factors take the model's parameter dtype"),
        Leaf(f"{lora}.adapter_path", (None,), "loading a saved Megatron adapter is not implemented"),
        Leaf(f"{lora}.freeze_vision_model", ANY, "text models only with Megatron LoRA (no vision tower)"),
        Leaf(
            f"{lora}.freeze_vision_projection", ANY, "text models only with Megatron LoRA (no vision tower)"
        ),
    ]


def _other_leaves() -> list[Leaf]:
    return [
        Leaf("data.audio_key", ("audios",), VLM),
        Leaf("data.use_shm", (False,), "data files are read directly"),
        Leaf("data.validation_shuffle", (False,), "validation rows keep their order"),
        Leaf("data.gen_batch_size", (None,), "the generation batch is data.train_batch_size"),
        Leaf("data.tool_config_path", (None,), "use actor_rollout_ref.rollout.multi_turn.tool_config_path"),
        Leaf("data.function_tool_path", (None,), "tools come from rollout.multi_turn.tool_config_path"),
        Leaf(
            "trainer.use_v1",
            (True, False),
            "hybridrl has one synchronous trainer (main_async: the asynchronous one)",
        ),
        Leaf(
            "algorithm.filter_groups.max_inflight_gen_batches", (1,), "generation batches run one at a time"
        ),
    ]


SECTIONS = (
    Section(f"{ARR}.model.lora", None, (), "the other model.lora keys are checked one by one"),
    Section("critic.model.lora", "rank", (0, None), "the critic's LoRA (veRL's model.lora.*) is not implemented "
            "with Megatron; on FSDP use critic.model.lora_rank / lora_alpha / target_modules"),
    Section("critic.model.mtp", "enable", (False,), "multi-token prediction (MTP) trains the Megatron actor only"),
    *(Section(f"{m}.tiled_mlp", "enabled", (False,), "tiled MLP is not implemented") for m in MODELS),
    *(Section(f"{f}.qat", "enable", (False,), "quantization-aware training is not implemented") for f in FSDP),
    *(Section(f"{f}.turbo_config", None, (), "read by veRL's turbo engine only") for f in FSDP),
    Section(f"{ARR}.actor.qat", "enable", (False,), "quantization-aware training is not implemented"),
    Section(f"{ROLLOUT}.qat", "enable", (False,), "quantization-aware training is not implemented"),
    Section(f"{ROLLOUT}.prometheus", "enable", (False,), "the rollout engine exports no Prometheus metrics here; "
            "metrics go to trainer.logger"),
    Section(f"{ROLLOUT}.disaggregation", "enabled", (False,), "prefill/decode disaggregation is not implemented"),
    Section("transfer_queue", "enable", (False,), "there is no transfer queue to turn on: main_ppo on Ray workers "
            "already keeps the step's tensors in the Ray object store and moves them worker to worker "
            "(hybridrl.single_controller.batch_ref.BatchRef; docs/architecture.md, 'The batch by reference'); "
            "main_async keeps its batches on the driver. Drop the key"),
    *(Section(f"skip.{k}", "enable", (False,), "rollout caching (skip.*) is not implemented")
      for k in ("rollout", "rollout_tq", "async_rollout")),
    Section("trainer.v1", "trainer_mode", ("sync",), "main_ppo is synchronous; use main_async for asynchronous training"),
)  # fmt: skip


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _absent(node: DictConfig, key: str) -> bool:
    return OmegaConf.select(node, key, default="__absent__") == "__absent__"


def drop_key(node: DictConfig, key: str) -> None:
    """Remove `key`, then every parent left empty by it (veRL sections hybridrl lacks)."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        head, last = ".".join(parts[: i - 1]), parts[i - 1]
        parent = OmegaConf.select(node, head) if head else node
        child = parent.get(last)
        if i < len(parts) and not (isinstance(child, DictConfig) and len(child) == 0):
            return
        with open_dict(parent):
            parent.pop(last)


def _refuse(key: str, value: Any, ok: tuple, why: str) -> ConfigError:
    keep = " or ".join(repr(v) for v in ok)
    return ConfigError(
        f"{key}={value!r} is a veRL key hybridrl does not implement at this value: {why}. "
        f"Leave it at {keep} (docs/config.md lists these keys)"
    )


def check_accepted(node: DictConfig) -> None:
    """Drop the accepted keys of LEAVES / SECTIONS from `node`; ConfigError on any other value."""
    for leaf in LEAVES:
        if _absent(node, leaf.key):
            continue
        value = _plain(OmegaConf.select(node, leaf.key))
        if leaf.ok is not ANY and value not in leaf.ok:
            raise _refuse(leaf.key, value, leaf.ok, leaf.why)
        drop_key(node, leaf.key)
    for s in SECTIONS:
        if _absent(node, s.prefix):
            continue
        if s.switch is not None and not _absent(node, f"{s.prefix}.{s.switch}"):
            value = _plain(OmegaConf.select(node, f"{s.prefix}.{s.switch}"))
            if value not in s.off:
                raise _refuse(f"{s.prefix}.{s.switch}", value, s.off, s.why)
        drop_key(node, s.prefix)


LEAVES = tuple(_leaves())
