"""The Ray workers: role wiring only (the math is in actor.py / critic.py, the engines in engine/ and
rollout/).

* `ActorRolloutRefWorker(config, role)` — role in actor / rollout / ref / actor_rollout /
  actor_rollout_ref. With both actor and rollout it is the *hybrid engine*: it trains with FSDP2
  and, before each generation, streams the gathered weights into its rollout engine on the same
  device (vLLM, SGLang or plain HF generate).
* `CriticWorker(config)` — value model.
* `RewardModelWorker(config)` — learned reward model (sequence classification).

Every remote method is a normal method with `@register(...)`, so IDEs and type checkers see it.
Batch sizes that depend on the number of ranks are computed on the driver and passed in.
"""

from __future__ import annotations

import os
import time

import torch

from hybridrl.models.weight_map import to_torch_dtype
from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Worker, register
from hybridrl.single_controller.dispatch import Dispatch, make_mesh_dispatch
from hybridrl.utils.device import init_process_group
from hybridrl.workers.agent.runner import AgentLoopRunner, uses_agent_loops
from hybridrl.workers.batch_sizes import PerRankBatchSizes
from hybridrl.workers.config import ActorConfig, CriticConfig, ModelConfig, RefConfig, RewardModelConfig
from hybridrl.workers.profiling import StepProfiling
from hybridrl.workers.rollout.config import RolloutConfig
from hybridrl.workers.sequence_parallel import SequenceParallel

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")
# Training calls split over the FSDP mesh (every rank data-parallel), rollout calls over dp x tp.
ON_ACTOR_MESH = make_mesh_dispatch("actor")
ON_ROLLOUT_MESH = make_mesh_dispatch("rollout")
ON_CRITIC_MESH = make_mesh_dispatch("critic")
_PG_TIMEOUT_S = float(os.environ.get("HYBRIDRL_PG_TIMEOUT_S", 600))


def _setup_process(num_threads: int | None, timeout_s: float | None = None) -> None:
    """Join the worker group's process group (once per process) and use the slot's CPU cores.

    timeout_s: collective timeout (`actor_rollout_ref.nccl_timeout`); default $HYBRIDRL_PG_TIMEOUT_S or 600.
    """
    if num_threads:
        torch.set_num_threads(num_threads)
    init_process_group(timeout_s=timeout_s or _PG_TIMEOUT_S)


class ActorRolloutRefWorker(StepProfiling, Worker):
    """Policy training, rollout generation and the frozen reference, colocated on one slot.

    Args:
        model: `actor_rollout_ref.model`.
        actor, ref, rollout: the three sections of `actor_rollout_ref`.
        role: which parts this worker holds (see module docstring).
        actor_batch_sizes: per-rank sizes from `normalize_actor_batch_sizes` (driver-side).
        num_threads: torch threads of this process (the slot's CPU cores).
        pg_timeout_s: process-group timeout in seconds (`actor_rollout_ref.nccl_timeout`).
        peak_flops: one device's peak FLOP/s for `perf/mfu/actor` (None: not reported).
    """

    def __init__(
        self,
        model: ModelConfig,
        actor: ActorConfig,
        ref: RefConfig,
        rollout: RolloutConfig,
        role: str = "actor_rollout_ref",
        actor_batch_sizes: PerRankBatchSizes | None = None,
        num_threads: int | None = None,
        pg_timeout_s: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role={role!r}; expected one of {ROLES}")
        self.model_config, self.actor_config, self.ref_config = model, actor, ref
        self.rollout_config = rollout
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref")
        self.actor_batch_sizes = actor_batch_sizes
        self.num_threads = num_threads
        self.pg_timeout_s = pg_timeout_s
        self.peak_flops = peak_flops
        self.actor_engine = self.actor = self.ref_engine = self.ref_policy = self.rollout = None
        self._weights_stale = True
        self._lora_self_ref = False
        self._agent_runner = None
        self._tp_group = None
        self._relay_group = None  # gloo group of the TP ranks: the agent loops' request relay

    # ------------------------------------------------------------------ build
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the FSDP2 actor / reference and the rollout engine on this rank."""
        from hybridrl.workers.actor import PPOActor
        from hybridrl.workers.engine.fsdp import FSDPEngine, resolve_model_path

        _setup_process(self.num_threads, self.pg_timeout_s)
        self.model_config.validate()
        model_path = resolve_model_path(self.model_config.path, "actor_rollout_ref.model.path")
        self._declare_training_mesh()
        par = self._sequence_parallel(
            "actor_rollout_ref.actor" if self._is_actor else "actor_rollout_ref.ref"
        )
        if self._is_actor:
            self.actor_engine = FSDPEngine.build(
                self.model_config, self.actor_config.fsdp_config, self.actor_config.optim, role="actor"
            )
            par.apply(self.actor_engine)
            self.actor = PPOActor(
                self.actor_config,
                self.actor_engine.module,
                self.actor_engine.optimizer,
                self.actor_engine.lr_scheduler,
                batch_sizes=self.actor_batch_sizes,
                use_remove_padding=self.model_config.use_remove_padding,
                peak_flops=self.peak_flops,
                **par.role_kwargs(self.actor_engine),
                use_fused_kernels=self.model_config.use_fused_kernels,
            )
        if self._is_ref:
            self._lora_self_ref = self._is_actor and (
                self.model_config.lora_rank > 0 or bool(self.model_config.lora_adapter_path)
            )
            if not self._lora_self_ref:
                self.ref_engine = FSDPEngine.build(
                    self.model_config, self.ref_config.fsdp_config, None, role="ref"
                )
                par.apply(self.ref_engine)
                self.ref_policy = PPOActor(
                    self.ref_config.policy_config(),
                    self.ref_engine.module,
                    use_remove_padding=self.model_config.use_remove_padding,
                    **par.role_kwargs(self.ref_engine),
                    use_fused_kernels=self.model_config.use_fused_kernels,
                )
        if self._is_rollout:
            self._build_rollout(model_path)

    def close(self) -> None:
        """Shut the rollout engine down (vLLM/SGLang tear down their distributed state) while
        the process group still exists."""
        rollout, self.rollout = self.rollout, None
        if rollout is not None:
            rollout.shutdown()

    def _declare_training_mesh(self) -> None:
        """The FSDP actor's mesh ("actor", also used by the reference): every rank data-parallel,
        or dp x sp with Ulysses sequence parallelism."""
        from hybridrl.workers.rollout.parallel import training_mesh

        sp = (self.actor_config if self._is_actor else self.ref_config).ulysses_sequence_parallel_size
        self.set_mesh("actor", training_mesh(self.world_size, self.actor_config.fsdp_config.fsdp_size, sp))

    def _sequence_parallel(self, key: str) -> SequenceParallel:
        return SequenceParallel.create(self.mesh_layout("actor"), self.rank, key)

    def _build_rollout(self, model_path: str) -> None:
        from hybridrl.single_controller.mesh import new_subgroups
        from hybridrl.utils.device import get_device_name
        from hybridrl.workers.engine.fsdp import load_tokenizer
        from hybridrl.workers.rollout.base import create_rollout
        from hybridrl.workers.rollout.parallel import bind_cpu_cores, rollout_mesh, weight_loader_for

        rc = self.rollout_config
        self._weight_loader = weight_loader_for(rc.load_format, self.actor_config.strategy)
        self.set_mesh("rollout", rollout_mesh(self.world_size, rc.tensor_model_parallel_size))  # dp x tp
        if rc.tensor_model_parallel_size > 1:
            self._tp_group = new_subgroups(self.mesh_layout("rollout"), ["tp"], self.rank)
            self._relay_group = new_subgroups(self.mesh_layout("rollout"), ["tp"], self.rank, "gloo")
            if get_device_name() == "cpu":  # one core set per rank: TP ranks spin in lockstep
                bind_cpu_cores(self.local_rank, self.local_world_size, self.num_threads or 1)
        tokenizer = (
            self.actor_engine.tokenizer if self.actor_engine is not None else None
        ) or load_tokenizer(self.model_config)
        self.rollout = create_rollout(rc, model_path, tokenizer)
        self._weights_stale = self.actor_engine is not None

    def _sync_rollout_weights(self) -> dict[str, float]:
        """The hybrid-engine switch: gather the FSDP shards into full tensors, one bucket at a time
        (load_format's loader: "dtensor" buckets, or the "hf" full state dict), and let the engine
        of each TP rank load its slice; per-rank bytes and seconds come back as metrics."""
        from hybridrl.workers.engine.full_params import iter_state_dict_params
        from hybridrl.workers.rollout.weight_sync import per_rank_sync_metrics, sync_weights

        if not self._weights_stale or self.actor_engine is None:
            return {}
        self.actor_engine.onload()
        dtype = to_torch_dtype(self.rollout_config.dtype)
        if self._weight_loader == "hf":
            named = iter_state_dict_params(self.actor_engine.module, dtype=dtype)
        else:
            named = self.actor_engine.iter_full_params(dtype=dtype)
        metrics = sync_weights(self.rollout, named)
        self.actor_engine.offload()
        self._weights_stale = False
        return {**metrics, **per_rank_sync_metrics(metrics)}

    # -------------------------------------------------------------- generate
    @register(dispatch_mode=ON_ROLLOUT_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per prompt row (see hybridrl.workers.rollout.base for the contract).

        Dispatched over the rollout mesh: the ranks of one TP engine get the same rows and the
        engine's tp rank 0 returns them. `meta_info["validate"]` selects `rollout.val_kwargs`;
        `meta_info["greedy"]` forces greedy decoding (the ReMax baseline).
        """
        from hybridrl.workers.rollout.parallel import check_same_rows
        from hybridrl.workers.rollout.weight_sync import wake_and_sync

        if self.rollout is None:
            raise RuntimeError(f"generate_sequences called on a worker with role={self.role!r} (no rollout)")
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        sync = wake_and_sync(
            self.rollout, self._sync_rollout_weights, self.rollout_config.multi_stage_wake_up
        )
        timing["update_weights"] = sync.get("timing_s/update_weights", 0.0)
        if self._tp_group is not None:
            check_same_rows(
                prompts.batch["input_ids"],
                prompts.batch["attention_mask"],
                self._tp_group,
                "generate_sequences",
            )
        out = self._rollout_generate(prompts)
        out.meta_info.setdefault("metrics", {}).update(
            {k: v for k, v in sync.items() if k.startswith("weight_sync/")}
        )
        if self.rollout_config.free_cache_engine:
            self.rollout.release_memory()
        timing["generate_sequences_worker"] = time.perf_counter() - t0
        out.meta_info["timing"] = timing
        return out

    def _rollout_generate(self, prompts: DataProto) -> DataProto:
        """Plain single-turn generation, or the agent loops (multi_turn / agent_name rows)."""
        if not uses_agent_loops(self.rollout_config, prompts):
            return self.rollout.generate_sequences(prompts)
        if self._relay_group is None:
            if self._agent_runner is None:
                self._agent_runner = AgentLoopRunner(
                    self.rollout, self.rollout_config, self.rollout.tokenizer
                )
            return self._agent_runner.generate_sequences(prompts)
        return self._tp_agent_generate(prompts)

    def _tp_agent_generate(self, prompts: DataProto) -> DataProto:
        """The agent loops over a TP engine (workers/agent/tp_relay.py): the engine's TP rank 0
        runs them and relays every engine call; the other TP ranks replay the calls and return
        the prompts (dropped: the rollout mesh keeps TP rank 0's result only)."""
        from hybridrl.workers.agent.tp_relay import TPLeaderRollout, follow_leader, lead_rollout

        groups = self.mesh_layout("rollout").groups(["tp"])
        leader = next(g for g in groups if self.rank in g)[0]
        if self.rank != leader:
            follow_leader(self.rollout, self._relay_group, leader)
            return prompts
        if self._agent_runner is None:
            relay = TPLeaderRollout(self.rollout, self._relay_group, leader)
            self._agent_runner = AgentLoopRunner(relay, self.rollout_config, self.rollout.tokenizer)
        return lead_rollout(self._agent_runner, self._agent_runner.rollout, prompts)

    # ------------------------------------------------------------- log-probs
    @register(dispatch_mode=ON_ACTOR_MESH)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Old log-probs and entropy of the responses under the current actor: old_log_probs, entropys (B, T)."""
        if self.actor is None:
            raise RuntimeError(f"compute_log_prob needs the actor; this worker has role={self.role!r}")
        r = self.rollout_config
        self.actor_engine.onload()
        log_probs, entropy, *sps = self.actor.compute_log_prob(
            data,
            calculate_entropy=True,
            micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=r.log_prob_use_dynamic_bsz,
            max_token_len=r.log_prob_max_token_len_per_gpu,
            temperature=r.temperature,
            calculate_sum_pi_squared=self.actor_config.calculate_sum_pi_squared,
        )
        self.actor_engine.offload()
        out = {"old_log_probs": log_probs, "entropys": entropy}
        if sps:  # actor.calculate_sum_pi_squared: the optimal token baseline's sum of pi^2
            out["sum_pi_squared"] = sps[0]
        return DataProto.from_dict(out)

    @register(dispatch_mode=ON_ACTOR_MESH)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs of the responses under the frozen reference policy: ref_log_prob (B, T)."""
        c, r = self.ref_config, self.rollout_config
        kwargs = dict(
            calculate_entropy=False,
            micro_batch_size=c.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=c.log_prob_use_dynamic_bsz,
            max_token_len=c.log_prob_max_token_len_per_gpu,
            temperature=r.temperature,
        )
        if self._lora_self_ref:  # LoRA: the base model without the adapter is the reference
            with self.actor_engine.module.disable_adapter():
                log_probs, _ = self.actor.compute_log_prob(data, **kwargs)
        elif self.ref_policy is not None:
            self.ref_engine.onload()
            log_probs, _ = self.ref_policy.compute_log_prob(data, **kwargs)
            self.ref_engine.offload()
        else:
            raise RuntimeError(
                f"compute_ref_log_prob needs the reference; this worker has role={self.role!r}"
            )
        return DataProto.from_dict({"ref_log_prob": log_probs})

    # ---------------------------------------------------------------- update
    @register(dispatch_mode=ON_ACTOR_MESH)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches over micro-batches; returns meta_info["metrics"]."""
        if self.actor is None:
            raise RuntimeError(f"update_actor needs the actor; this worker has role={self.role!r}")
        self.actor_engine.onload(with_optimizer=True)
        metrics = self.actor.update_policy(data, temperature=self.rollout_config.temperature)
        self.actor_engine.offload()
        self._weights_stale = True
        return DataProto(meta_info={"metrics": metrics})

    # ----------------------------------------------------------- checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0) -> None:
        """Sharded actor checkpoint (model, optimizer, scheduler, RNG, rollout seed counter)."""
        extra = {"rollout_calls": self.rollout.num_generate_calls if self.rollout is not None else 0}
        self.actor_engine.save_checkpoint(
            local_path,
            contents=self.actor_config.checkpoint.save_contents,
            global_step=global_step,
            extra=extra,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        if not os.path.isdir(local_path):
            raise FileNotFoundError(f"actor checkpoint folder {local_path!r} does not exist")
        state = self.actor_engine.load_checkpoint(
            local_path, contents=self.actor_config.checkpoint.load_contents
        )
        extra = (state or {}).get("extra") or {}
        if self.rollout is not None and "rollout_calls" in extra:
            self.rollout.num_generate_calls = int(extra["rollout_calls"])
        self._weights_stale = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, target_dir: str) -> None:
        """Write the full actor as a Hugging Face folder (rank 0 writes)."""
        from hybridrl.workers.engine.checkpoint import export_hf_model

        export_hf_model(self.actor_engine.module, target_dir, tokenizer=self.actor_engine.tokenizer)


class CriticWorker(StepProfiling, Worker):
    """Value model for GAE (`AutoModelForTokenClassification`, one label)."""

    def __init__(
        self,
        config: CriticConfig,
        batch_sizes: PerRankBatchSizes | None = None,
        num_threads: int | None = None,
        pg_timeout_s: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.batch_sizes = batch_sizes
        self.num_threads = num_threads
        self.pg_timeout_s = pg_timeout_s
        self.peak_flops = peak_flops
        self.engine = self.critic = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridrl.workers.critic import PPOCritic
        from hybridrl.workers.engine.fsdp import FSDPEngine
        from hybridrl.workers.rollout.parallel import training_mesh

        _setup_process(self.num_threads, self.pg_timeout_s)
        c = self.config
        layout = training_mesh(
            self.world_size, c.model.fsdp_config.fsdp_size, c.ulysses_sequence_parallel_size
        )
        self.set_mesh("critic", layout)
        par = SequenceParallel.create(layout, self.rank, "critic")
        self.engine = FSDPEngine.build(
            c.model, c.model.fsdp_config, c.optim, role="critic", key="critic.model"
        )
        par.apply(self.engine)
        self.critic = PPOCritic(
            c,
            self.engine.module,
            self.engine.optimizer,
            self.engine.lr_scheduler,
            batch_sizes=self.batch_sizes,
            use_remove_padding=c.model.use_remove_padding,
            peak_flops=self.peak_flops,
            **par.role_kwargs(self.engine),
        )

    @register(dispatch_mode=ON_CRITIC_MESH)
    def compute_values(self, data: DataProto) -> DataProto:
        """values (B, T) of the response tokens."""
        self.engine.onload()
        values = self.critic.compute_values(data)
        self.engine.offload()
        return DataProto.from_dict({"values": values})

    @register(dispatch_mode=ON_CRITIC_MESH)
    def update_critic(self, data: DataProto) -> DataProto:
        self.engine.onload(with_optimizer=True)
        metrics = self.critic.update_critic(data)
        self.engine.offload()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0) -> None:
        self.engine.save_checkpoint(
            local_path, contents=self.config.checkpoint.save_contents, global_step=global_step
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        if not os.path.isdir(local_path):
            raise FileNotFoundError(f"critic checkpoint folder {local_path!r} does not exist")
        self.engine.load_checkpoint(local_path, contents=self.config.checkpoint.load_contents)


class RewardModelWorker(Worker):
    """Learned reward model: one score per sequence, placed on the last valid response token.

    When `reward_model.model.input_tokenizer` (the policy's tokenizer) differs from the reward
    model's own, responses are decoded, re-templated with the RM's chat template and re-tokenised.
    """

    def __init__(
        self,
        config: RewardModelConfig,
        policy_tokenizer_path: str | None = None,
        num_threads: int | None = None,
        pg_timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.policy_tokenizer_path = policy_tokenizer_path
        self.num_threads = num_threads
        self.pg_timeout_s = pg_timeout_s
        self.engine = None
        self.policy_tokenizer = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridrl.workers.engine.fsdp import FSDPEngine, load_tokenizer
        from hybridrl.workers.reward.rm import model_config_of

        _setup_process(self.num_threads, self.pg_timeout_s)
        mc = model_config_of(self.config)
        self.engine = FSDPEngine.build(
            mc, self.config.model.fsdp_config, None, role="reward", key="reward_model.model"
        )
        src = self.config.model.input_tokenizer or self.policy_tokenizer_path
        if src and os.path.abspath(str(src)) != os.path.abspath(str(mc.path)):
            self.policy_tokenizer = load_tokenizer(
                ModelConfig(path=src), key="reward_model.model.input_tokenizer"
            )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """rm_scores (B, T): the RM's score on each sample's last valid response token, 0 elsewhere."""
        from hybridrl.workers.reward.rm import compute_rm_scores

        self.engine.onload()
        scores = compute_rm_scores(self.engine, self.config, data, self.policy_tokenizer)
        self.engine.offload()
        return DataProto.from_dict({"rm_scores": scores})
