"""The Ray workers, one class per role for every training engine and both trainers: role wiring only
(the math is in actor.py / critic.py, the engines behind engine/base.py, rollout in rollout/).

* `ActorRolloutRefWorker(model, actor, ref, rollout, role)` — role in actor / rollout / ref /
  actor_rollout / actor_rollout_ref. With both actor and rollout it is the *hybrid engine*: it
  trains with its training engine (`*.strategy` / `model_engine`: FSDP2, Megatron, ...) and, at
  the trainer's `sync_rollout_weights` stage, streams the gathered weights into its rollout engine
  on the same device (vLLM, SGLang or plain HF generate). `disaggregated=True` gives the asynchronous trainer's two
  modes: role="rollout", a rollout engine alone on its slot with versioned weights
  (`load_weights`), no process group (with rollout TP > 1 the rollout group's own, for the TP
  engines); an actor role without a rollout engine, whose weights go
  out through `publish_weights` or `broadcast_weights`. `partial_rollout=True` (a disaggregated
  rollout worker) lets a weight update interrupt a running generation (`abort_generation`).
  Every weight movement is the `weights` component's (hybridrl/weight_sync/component.py).
* `CriticWorker(config)` — value model, on the engine of `critic.strategy` (critic_worker.py).
* `RewardModelWorker(config)` — learned reward model, sequence classification (reward_model_worker.py).

Every remote method is a normal method with `@register(...)`, so IDEs and type checkers see it.
Batch sizes and parallel sizes that depend on the number of ranks are computed on the driver
(`ParallelDims`, `PerRankBatchSizes`) and passed in.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray
import torch

from hybridrl.agent.runner import AgentLoopRunner, uses_agent_loops
from hybridrl.config.batch import PerRankBatchSizes
from hybridrl.config.roles import ActorConfig, ModelConfig, RefConfig
from hybridrl.config.rollout import RolloutConfig
from hybridrl.engine.base import canonical_engine_name, get_engine
from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Worker, register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.utils import deadlines
from hybridrl.weight_sync.collective import GroupSpec
from hybridrl.weight_sync.component import WeightSync, rollout_state_copy
from hybridrl.workers.batch_fn_worker import BatchFnWorker
from hybridrl.workers.critic_worker import CriticWorker
from hybridrl.workers.parallel_dims import ParallelDims
from hybridrl.workers.profiling import StepProfiling
from hybridrl.workers.reward_model_worker import RewardModelWorker
from hybridrl.workers.worker_setup import ON_ACTOR_MESH, ON_ROLLOUT_MESH, build_engine, setup_process

__all__ = ["ROLES", "ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker"]

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


class ActorRolloutRefWorker(BatchFnWorker, StepProfiling, Worker):
    """Policy training, rollout generation and the frozen reference, colocated on one slot.

    Args:
        model: `actor_rollout_ref.model`.
        actor, ref, rollout: the three sections of `actor_rollout_ref`.
        role: which parts this worker holds (see module docstring).
        actor_batch_sizes: per-rank sizes from `normalize_actor_batch_sizes` (driver-side).
        num_threads: torch threads of this process (the slot's CPU cores).
        pg_timeout_s: process-group timeout in seconds (`actor_rollout_ref.nccl_timeout`).
        peak_flops: one device's peak FLOP/s for `perf/mfu/actor` (None: not reported).
        dims: the driver's ParallelDims of the actor (None: derived here from the config).
        disaggregated: the asynchronous trainer's modes (see the module docstring).
        partial_rollout: a disaggregated rollout worker whose generation a weight update can
            interrupt (`async_training.partial_rollout`; `abort_generation`).
    """

    # partial rollout's `abort_generation` runs in a concurrency group of its own, i.e. while
    # `generate_sequences` executes; every other call stays in the default group, one at a time
    # and in submission order, so a weight update still lands between two generate calls
    ray_concurrency_groups = {"control": 1}

    def __init__(
        self,
        model: ModelConfig,
        actor: ActorConfig | None = None,
        ref: RefConfig | None = None,
        rollout: RolloutConfig | None = None,
        role: str = "actor_rollout_ref",
        actor_batch_sizes: PerRankBatchSizes | None = None,
        num_threads: int | None = None,
        pg_timeout_s: float | None = None,
        peak_flops: float | None = None,
        dims: ParallelDims | None = None,
        disaggregated: bool = False,
        distillation: Any = None,
        partial_rollout: bool = False,
    ) -> None:
        super().__init__()
        self.distillation = distillation  # distillation.distillation_loss when on (the actor's loss term)
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role={role!r}; expected one of {ROLES}")
        self.model_config = model
        self.actor_config, self.ref_config = actor or ActorConfig(), ref or RefConfig()
        self.rollout_config = rollout or RolloutConfig()
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref")
        self.disaggregated = disaggregated
        self.dims = dims
        if disaggregated and self._is_actor:
            self._is_rollout = False  # the rollout engines live in their own workers
        if partial_rollout and not (disaggregated and role == "rollout"):
            raise ValueError(
                "partial_rollout=True is a mode of the disaggregated rollout worker (role='rollout')"
            )
        # disaggregated rollout: the weights from model.path are version 0 (-1: a dummy load format)
        self.policy_version = -1 if self.rollout_config.is_dummy_load else 0
        self.busy_s = 0.0
        self.actor_batch_sizes = actor_batch_sizes
        self.num_threads = num_threads
        self.pg_timeout_s = pg_timeout_s
        self.peak_flops = peak_flops
        self.actor_engine = self.actor = self.ref_engine = self.ref_policy = self.rollout = None
        self.weights = WeightSync(self.rank, model, self.rollout_config)
        self.partial = None  # rollout/resume.py's PartialRollout once the engine exists (partial_rollout)
        self._partial_rollout = partial_rollout
        self._lora_self_ref = False
        self._agent_runner = None
        self._tp_group = None
        self._relay_group = None  # gloo group of the TP ranks: the agent loops' request relay

    # ------------------------------------------------------------------ build
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the actor / reference on their training engine and the rollout engine on this rank."""
        from hybridrl.models.builtin import resolve_model_path
        from hybridrl.rollout.parallel import weight_loader_for
        from hybridrl.workers.actor import PPOActor

        self.model_config.validate()
        model_path = resolve_model_path(self.model_config.path, key="actor_rollout_ref.model.path")
        if self.disaggregated and self.role == "rollout":
            if self.rollout_config.tensor_model_parallel_size > 1:  # the TP engines' own group (vLLM's world)
                setup_process(self.num_threads, self.pg_timeout_s)
            elif self.num_threads:  # TP = 1: no process group, rollout workers run no collectives
                torch.set_num_threads(self.num_threads)
            self._build_rollout(model_path)
            return
        setup_process(self.num_threads, self.pg_timeout_s)
        self._declare_training_mesh()
        a, r = self.actor_config, self.ref_config
        model_key = "actor_rollout_ref.model"
        if self._is_actor:
            self.actor_engine = build_engine(
                "actor", self.model_config, a, a.optim, "actor_rollout_ref.actor", model_key, self, "actor"
            )
            self.actor = PPOActor(
                a, self.actor_engine, batch_sizes=self.actor_batch_sizes, peak_flops=self.peak_flops,
                distillation=self.distillation,
            )  # fmt: skip
            self.weights.attach_training(
                self.actor_engine, weight_loader_for(self.rollout_config.load_format, a.strategy)
            )
        if self._is_ref:
            self._lora_self_ref = self._is_actor and (
                self.model_config.lora_rank > 0 or bool(self.model_config.lora_adapter_path)
            )
            if not self._lora_self_ref:
                self._check_ref_engine()
                self.ref_engine = build_engine(
                    "ref", self.model_config, r, None, "actor_rollout_ref.ref", model_key, self, "actor"
                )
                self.ref_policy = PPOActor(r.policy_config(), self.ref_engine)
        if self._is_rollout:
            self._build_rollout(model_path)

    def _check_ref_engine(self) -> None:
        """A model-parallel actor's colocated reference shares its process groups: same engine."""
        a, r = self.actor_config, self.ref_config
        if not (self._is_actor and get_engine(a.strategy, "actor_rollout_ref.actor.strategy").model_parallel):
            return
        if canonical_engine_name(r.strategy, "actor_rollout_ref.ref.strategy") != canonical_engine_name(
            a.strategy
        ):
            raise ValueError(
                f"actor_rollout_ref.ref.strategy={r.strategy!r} with actor.strategy={a.strategy}: the reference shares "
                f"the actor's model-parallel process groups; set actor_rollout_ref.ref.strategy={a.strategy}"
            )

    def close(self) -> None:
        """Shut the rollout engine down (vLLM/SGLang tear down their distributed state) while
        the process group still exists."""
        rollout, self.rollout = self.rollout, None
        if rollout is not None:
            rollout.shutdown()

    def _parallel_dims(self) -> ParallelDims:
        """The driver's dims, or the same derivation from the config (a worker built by hand)."""
        if self.dims is not None:
            return self.dims
        section, key = (
            (self.actor_config, "actor_rollout_ref.actor")
            if self._is_actor
            else (self.ref_config, "actor_rollout_ref.ref")
        )
        rollout_tp = self.rollout_config.tensor_model_parallel_size if self._is_rollout else 1
        return ParallelDims.for_role(self.world_size, section, key, rollout_tp)

    def _declare_training_mesh(self) -> None:
        """The "actor" mesh (also the reference's): the training engine's layout (ParallelDims)."""
        self.set_mesh("actor", self._parallel_dims().train_mesh())

    def _build_rollout(self, model_path: str) -> None:
        from hybridrl.models.hf import load_tokenizer
        from hybridrl.rollout.base import create_rollout
        from hybridrl.rollout.parallel import bind_cpu_cores, weight_loader_for
        from hybridrl.single_controller.mesh import new_subgroups
        from hybridrl.utils.device import get_device_name

        rc = self.rollout_config
        weight_loader_for(
            rc.load_format, self.actor_config.strategy
        )  # fails on a format the actor cannot feed
        dims = ParallelDims(
            self.world_size, rollout_tp=rc.tensor_model_parallel_size, key="actor_rollout_ref"
        )
        self.set_mesh("rollout", (self.dims or dims).rollout_mesh())  # dp x tp
        if rc.tensor_model_parallel_size > 1:
            self._tp_group = new_subgroups(self.mesh_layout("rollout"), ["tp"], self.rank)
            self._relay_group = new_subgroups(self.mesh_layout("rollout"), ["tp"], self.rank, "gloo")
            if get_device_name() == "cpu":  # one core set per rank: TP ranks spin in lockstep
                bind_cpu_cores(self.local_rank, self.local_world_size, self.num_threads or 1)
        tokenizer = (
            self.actor_engine.tokenizer if self.actor_engine is not None else None
        ) or load_tokenizer(self.model_config)
        self.rollout = create_rollout(rc, model_path, tokenizer)
        self.weights.attach_rollout(self.rollout)
        if self._partial_rollout:
            from hybridrl.rollout.resume import PartialRollout

            self.partial = PartialRollout(self.rollout)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> dict[str, float]:
        """The hybrid-engine switch, as a stage of its own: if the actor changed since the last
        sync, its training engine gathers its shards into full tensors one bucket at a time (the
        rollout's loader: "dtensor" buckets, the "hf" full state dict, or the "megatron" TP/PP
        gather) and the engine of each TP rank loads its slice (weight_sync/component.py). Every
        rank must call it (the gather is a collective). Returns this rank's `weight_sync/*` metrics
        and `timing_s/update_weights` ({} when nothing changed or there is no rollout engine)."""
        if self.rollout is None:
            return {}
        return self.weights.wake_and_sync()

    # -------------------------------------------------------------- generate
    @register(dispatch_mode=ON_ROLLOUT_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per prompt row (see hybridrl.rollout.base for the contract).

        Dispatched over the rollout mesh: the ranks of one TP engine get the same rows and the
        engine's tp rank 0 returns them. `meta_info["validate"]` selects `rollout.val_kwargs`;
        `meta_info["greedy"]` forces greedy decoding (the ReMax baseline).
        """
        if self.rollout is None:
            raise RuntimeError(f"generate_sequences called on a worker with role={self.role!r} (no rollout)")
        if self.disaggregated:
            return self._versioned_generate(prompts)
        return self._generate(prompts)

    def _generate(self, prompts: DataProto) -> DataProto:
        """generate_sequences' body: wake-up, generation, memory release, timings. The trainers
        sync the weights at a stage of their own (`sync_rollout_weights`); a worker driven by hand
        whose actor changed since is synced here first, so no caller generates with old weights."""
        from hybridrl.rollout.parallel import check_same_rows

        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        sync = self.weights.wake_and_sync()
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

    def _versioned_generate(self, prompts: DataProto) -> DataProto:
        """Disaggregated rollout: the plain contract, plus non-tensor "policy_version" (an int per
        row, object array) and meta_info "policy_version" and "worker_busy_s" (this worker's
        cumulative busy seconds, for idle-time metrics)."""
        if self.policy_version < 0:
            raise RuntimeError(
                "rollout worker: no weights loaded yet (rollout.load_format is dummy); call load_weights first"
            )
        t0 = time.perf_counter()
        out = self._generate(prompts)
        self.busy_s += time.perf_counter() - t0
        out.non_tensor_batch["policy_version"] = np.array([self.policy_version] * len(out), dtype=object)
        out.meta_info["policy_version"] = self.policy_version
        out.meta_info["worker_busy_s"] = self.busy_s
        return out

    def _rollout_generate(self, prompts: DataProto) -> DataProto:
        """Plain single-turn generation, the agent loops (multi_turn / agent_name rows), or partial
        rollout's resumable generation (rows that carry the partial columns, rollout/resume.py)."""
        if self.partial is not None and "partial_done" in prompts.non_tensor_batch:
            return self.partial.generate(prompts, self.policy_version)
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
        """The agent loops over a TP engine (agent/tp_relay.py): the engine's TP rank 0
        runs them and relays every engine call; the other TP ranks replay the calls and return
        the prompts (dropped: the rollout mesh keeps TP rank 0's result only)."""
        from hybridrl.agent.tp_relay import TPLeaderRollout, follow_leader, lead_rollout

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
        res = self.actor.compute_log_prob(
            data,
            calculate_entropy=True,
            micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=r.log_prob_use_dynamic_bsz,
            max_token_len=r.log_prob_max_token_len_per_gpu,
            temperature=r.temperature,
            calculate_sum_pi_squared=self.actor_config.calculate_sum_pi_squared,
        )
        self.actor_engine.offload()
        out = {"old_log_probs": res.log_probs, "entropys": res.entropy}
        if res.sum_pi_squared is not None:  # actor.calculate_sum_pi_squared: the optimal token baseline's
            out["sum_pi_squared"] = res.sum_pi_squared
        if res.routed_experts is not None:  # router_replay.mode=R2: the update replays these
            out["routed_experts"] = res.routed_experts
        return DataProto.from_dict(out)

    @register(dispatch_mode=ON_ACTOR_MESH)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs of the responses under the frozen reference policy: ref_log_prob (B, T); with
        meta_info["topk"] = k > 0 (a distillation teacher) also ref_topk_log_probs / ref_topk_ids (B, T, k)."""
        c, r = self.ref_config, self.rollout_config
        topk = int(data.meta_info.get("topk", 0))
        kwargs = dict(
            topk=topk,
            calculate_entropy=False,
            micro_batch_size=c.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=c.log_prob_use_dynamic_bsz,
            max_token_len=c.log_prob_max_token_len_per_gpu,
            temperature=r.temperature,
        )
        if self._lora_self_ref:  # LoRA: the base model without the adapter is the reference
            with self.actor_engine.disable_adapter():
                out = self.actor.compute_log_prob(data, **kwargs)
        elif self.ref_policy is not None:
            self.ref_engine.onload()
            out = self.ref_policy.compute_log_prob(data, **kwargs)
            self.ref_engine.offload()
        else:
            raise RuntimeError(
                f"compute_ref_log_prob needs the reference; this worker has role={self.role!r}"
            )
        res = {"ref_log_prob": out.log_probs}
        if topk > 0:
            res.update(ref_topk_log_probs=out.topk_log_probs, ref_topk_ids=out.topk_ids)
        return DataProto.from_dict(res)

    # ---------------------------------------------------------------- update
    @register(dispatch_mode=ON_ACTOR_MESH)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches over micro-batches; returns meta_info["metrics"]."""
        if self.actor is None:
            raise RuntimeError(f"update_actor needs the actor; this worker has role={self.role!r}")
        self.actor_engine.onload(with_optimizer=True)
        metrics = self.actor.update_policy(data, temperature=self.rollout_config.temperature)
        self.actor_engine.offload()
        self.weights.mark_changed()
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
        self.weights.mark_changed()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, target_dir: str) -> None:
        """Write the full actor as a Hugging Face folder (rank 0 writes)."""
        self.actor_engine.export_hf(target_dir)

    # ------------------------------------------------------- disaggregated
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def publish_weights(self, version: int) -> dict[str, Any] | None:
        """Disaggregated trainer: gather the full parameters (every rank must call this); rank 0
        returns them. The driver hands the ObjectRef of that return value to every rollout
        worker's `load_weights`, so the weights go trainer rank 0 -> object store -> rollout
        workers without passing through the driver.

        Returns:
            On rank 0: {"version": version, "weights": [(hf_name, cpu tensor in rollout dtype)],
            "gather_s": seconds}; None on the other ranks.
        """
        return self.weights.publish(version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_weight_group(self, world_size: int, timeout_s: float) -> tuple[str, int] | None:
        """Trainer rank 0: host the weight-update group's TCPStore on a free port; returns (host,
        port) there, None on the other ranks."""
        return self.weights.open_group(world_size, timeout_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_group(self, spec: GroupSpec, first_rank: int) -> float | None:
        """Join the weight-update group as group rank `first_rank + self.rank` (every member must
        call this at about the same time: the backend's rendezvous needs all of them).

        Args:
            spec: from the driver (host and port from `open_weight_group`).
            first_rank: 0 on the training group (only its rank 0 joins), 1 on the rollout group.

        Returns:
            Seconds the join took (None on training ranks > 0).
        """
        return self.weights.join_group(spec, first_rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def broadcast_weights(self, version: int, tp_shards: bool = True) -> dict[str, float] | None:
        """Disaggregated trainer: gather the full parameters (every rank must call this, as for
        publish_weights); rank 0 sends them to the rollout workers in buckets of
        rollout.update_weights_bucket_megabytes: to a TP > 1 rollout of a model tp_shards.py knows,
        each TP rank gets only its slices; otherwise (or `tp_shards=False`, the reference path of
        tests and bench/async_weight_update.py) every worker gets the full tensors.

        Returns:
            On rank 0: {"version", "bytes" (all buckets), "rank_bytes" (what one rollout worker
            receives), "buckets", "send_s" (packing + transfers), "total_s" (gather included)};
            None on the other ranks.
        """
        return self.weights.broadcast(version, tp_shards)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, payload: dict[str, Any], version: int) -> float:
        """Disaggregated rollout: load what `publish_weights` returned, or (a collective payload)
        the version the weight-update group delivered; returns the seconds taken, waiting for a
        collective update included."""
        if self.rollout is None:
            raise RuntimeError(f"load_weights called on a worker with role={self.role!r} (no rollout)")
        elapsed = self.weights.load(payload, int(version))
        self.policy_version = int(version)
        self.busy_s += elapsed
        return elapsed

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received_weight_bytes(self) -> dict[int, int]:
        """Rollout worker: the bytes the weight-update group delivered, by version (tests, bench)."""
        return self.weights.received_bytes()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the rollout engine's weights (to check an update: tests, bench)."""
        return rollout_state_copy(self.rollout)

    @ray.method(concurrency_group="control")
    def abort_generation(self, version: int, ready: list[Any] | None = None) -> bool:
        """Partial rollout: stop a generation older than `version` at its next decode step (runs
        in the "control" concurrency group, i.e. while generate_sequences executes).

        At a weight update the manager queues `load_weights(payload, v)` and calls this: once the
        new weights exist (it waits for `ready`, the payload's ObjectRefs, without fetching them)
        a generation running with a version older than v returns its tokens so far; load_weights
        runs next, and the unfinished rows continue in a later call from their prefix. An abort
        that arrives after its generation finished does nothing (the version is then >= v).

        Returns:
            True if a generation older than `version` may be running.
        """
        if self.partial is None:
            raise RuntimeError(
                "abort_generation: this rollout worker was started without partial_rollout=True "
                "(async_training.partial_rollout)"
            )
        if ready:  # bounded: one payload that never comes must not block the one control thread
            what = f"rollout worker {self.rank} abort_generation (version {version}): the weight payload"
            deadlines.wait_refs(list(ready), what=what)
        return self.partial.request_abort(int(version), self.policy_version)
