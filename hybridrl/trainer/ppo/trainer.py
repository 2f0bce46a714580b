"""The PPO fit loop on the Ray driver: one named call per stage.

    sync weights (once, before the first generation)
    generate -> (ReMax greedy baseline) -> reward -> (DAPO group filter) -> balance -> old log-prob
    -> ref log-prob -> values -> advantage -> critic update -> actor update -> sync weights
    -> validate -> checkpoint -> log

Every stage is a call on a worker group or a pure function from `hybridrl.algos`; the driver never
touches model weights.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from hybridrl import algos
from hybridrl.agent.runner import agent_step_metrics
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.batch_steps import (
    apply_rollout_correction,
    attach_reward_extra,
    decode_samples,
    group_metric,
    pf_ppo_resample,
    reward_components,
    rollout_correction_active,
    write_jsonl,
)
from hybridrl.trainer.ppo.checkpoints import RunCheckpoints
from hybridrl.trainer.ppo.metrics import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    process_validation_metrics,
    reduce_metrics,
    timer,
)
from hybridrl.trainer.ppo.padding import trim_left_padding, trim_right_padding
from hybridrl.trainer.ppo.preemption import StepGuard
from hybridrl.trainer.ppo.profiling import StepProfilerDriver
from hybridrl.trainer.ppo.reward_guard import ConstantRewardGuard
from hybridrl.trainer.ppo.teachers import teacher_step
from hybridrl.trainer.ppo.workers import WorkerGroups
from hybridrl.utils import checkpointing
from hybridrl.utils.safe_dcp import check_dcp_tree
from hybridrl.utils.safe_io import load_state_file
from hybridrl.utils.seqlen_balancing import get_seqlen_balanced_partitions
from hybridrl.utils.shutdown import PREEMPTION
from hybridrl.utils.storage import named_storage_faults
from hybridrl.utils.torch_utils import get_rng_state, set_rng_state
from hybridrl.weight_sync.colocated import weight_sync_step_metrics


def old_log_prob_is_redundant(config: Any) -> bool:
    """True when the separate old-log-prob forward can be skipped without changing any number.

    That is when the actor update is exactly on-policy: one PPO epoch over one mini-batch (the
    whole step's batch), so the old log-probs equal the detached log-probs of the update's own
    forward, and nothing reads them before the update (KL in the reward, rollout importance
    sampling, the optimal token baseline's sum of pi^2). `actor_rollout_ref.actor.skip_on_policy_old_log_prob=false`
    turns the skip off.
    """
    actor = config.actor_rollout_ref.actor
    algo = config.algorithm
    return bool(
        actor.skip_on_policy_old_log_prob
        and actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size >= config.data.train_batch_size
        and not algo.use_kl_in_reward
        and not actor.calculate_sum_pi_squared
        and not algo.rollout_is
        and not rollout_correction_active(algo.rollout_correction)
    )


class RayPPOTrainer:
    """Holds the PPO loop; the workers hold the models.

    Args:
        config: the validated, typed config tree (`hybridrl.trainer.ppo.config.PPOConfig`).
        tokenizer: the policy tokenizer (decoding for rewards and logs).
        workers: the started worker groups (`hybridrl.trainer.ppo.workers.start_workers`).
        train_loader: resumable loader of prompt batches (`hybridrl.data.RLDataLoader`).
        val_loader: loader over the validation set, or None.
        reward_fn: reward manager for training batches.
        val_reward_fn: reward manager for validation batches.
        tracker: `hybridrl.utils.tracking.Tracking`.
    """

    def __init__(
        self,
        config,
        tokenizer,
        workers: WorkerGroups,
        train_loader,
        val_loader,
        reward_fn,
        val_reward_fn,
        tracker,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.workers = workers
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.tracker = tracker
        algo = config.algorithm
        self.use_critic = algos.estimator_needs_critic(algo.adv_estimator)
        self.use_reference_policy = algo.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss
        self.kl_ctrl_in_reward = (
            algos.get_kl_controller(
                algo.kl_ctrl.type,
                kl_coef=algo.kl_ctrl.kl_coef,
                target_kl=algo.kl_ctrl.target_kl,
                horizon=algo.kl_ctrl.horizon,
            )
            if algo.use_kl_in_reward
            else None
        )
        self.total_training_steps = config.trainer.total_training_steps
        self.global_steps = 0
        self._epoch = 0
        self._train_iter = None
        self._gen_batches_this_step = 0
        self.last_val_metrics: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.checkpoints: RunCheckpoints | None = None  # set by setup.build_trainer (checked before Ray)
        self.reward_guard = ConstantRewardGuard(config.trainer.constant_reward_warn_steps, algo.adv_estimator)
        self.step_guard = StepGuard(self)  # SIGTERM / SIGUSR1: finish or abandon the step, save, exit

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train for `total_training_steps`; returns the last validation metrics."""
        cfg = self.config.trainer
        self._warn_if_never_saving()
        self._load_checkpoint()
        self.sync_weights()  # the rollout engines start from the actor's (or the checkpoint's) weights
        self._last_save_time = time.monotonic()
        if self.val_loader is not None and cfg.val_before_train:
            val = self._validate()
            self.tracker.log(val, step=self.global_steps)
            if cfg.val_only:
                return val
        progress = _progress_bar(cfg.progress_bar, self.total_training_steps, self.global_steps)
        profiler = StepProfilerDriver(self.config, self.workers)
        self.step_guard.arm()
        try:
            self._fit_steps(progress, profiler)
        finally:
            self.step_guard.disarm()
        progress.close()
        return self.last_val_metrics

    def _fit_steps(self, progress, profiler) -> None:
        guard = self.step_guard
        while self.global_steps < self.total_training_steps:
            guard.begin_step()
            self.global_steps += 1
            guard.check()
            metrics: dict[str, Any] = {}
            timing: dict[str, float] = {}
            self._gen_batches_this_step = 0
            profiler.begin(self.global_steps)
            with timer("step", timing):
                batch = trim_right_padding(self._rollout_and_score(metrics, timing))
                guard.check()
                self.reward_guard.observe(batch.batch["token_level_scores"])
                self._balance_batch(batch, metrics)
                batch = self._compute_old_log_prob(batch, metrics, timing)
                batch = self._compute_ref_log_prob(batch, timing)
                batch = teacher_step(self, batch, metrics, timing)  # on-policy distillation
                batch = self._compute_values(batch, timing)
                batch = self._compute_advantage(batch, metrics, timing)
                guard.check()  # the last point before the workers' state changes
                self._update_critic(batch, metrics, timing)
                self._update_actor(batch, metrics, timing)
                self.sync_weights(metrics, timing)  # the updated actor into the rollout engines
                self._update_sampler(batch)
                self._dump_rollouts(batch)
            profiler.end(self.global_steps)
            guard.end_step()
            self._maybe_validate(metrics, timing)
            self._maybe_save_checkpoint(timing)
            self._log_step(batch, metrics, timing)
            progress.update(1)
            progress.set_postfix(_postfix(metrics))
            guard.after_step()

    # ---------------------------------------------------------------- stages
    def _next_prompt_batch(self) -> DataProto:
        """Next batch of prompts, cycling epochs; each prompt gets a fresh group id (uid)."""
        while True:
            if self._train_iter is None:
                self._train_iter = iter(self.train_loader)
            try:
                batch_dict = next(self._train_iter)
                break
            except StopIteration:
                self._train_iter = None
                self._epoch += 1
        batch = trim_left_padding(DataProto.from_single_dict(batch_dict))
        batch.non_tensor_batch["uid"] = np.array(
            [str(uuid.UUID(int=random.getrandbits(128))) for _ in range(len(batch))], dtype=object
        )
        return batch

    def _update_sampler(self, batch: DataProto) -> None:
        """veRL's curriculum hook: a `data.sampler` with `update(batch)` sees every trained batch."""
        update = getattr(self.train_loader.sampler, "update", None)
        if update is not None:
            update(batch)

    def _generate(self, prompts: DataProto, timing: dict) -> DataProto:
        """Repeat each prompt `rollout.n` times and generate one response per row."""
        n = self.config.actor_rollout_ref.rollout.n
        batch = prompts.repeat(repeat_times=n, interleave=True)
        gen_in = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
        gen_in.meta_info["global_steps"] = self.global_steps
        gen_in.meta_info["seed_index"] = self.global_steps * 1000 + self._gen_batches_this_step
        self._gen_batches_this_step += 1
        with timer("gen", timing):
            out = self.workers.actor_rollout.generate_sequences(gen_in)
        timing.update(out.meta_info.pop("timing", {}))
        batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
        batch = batch.union(out)
        if self.config.algorithm.adv_estimator == "remax":
            batch = self._remax_baseline(batch, timing)
        return batch

    def _remax_baseline(self, batch: DataProto, timing: dict) -> DataProto:
        """ReMax: the greedy response's reward is the baseline of each sampled response."""
        gen_in = batch.select(batch_keys=["prompts"])
        prompts = gen_in.batch["prompts"]
        pad_id = self.tokenizer.pad_token_id
        mask = (prompts != pad_id).long()
        gen_in = DataProto.from_dict(
            {
                "input_ids": prompts,
                "attention_mask": mask,
                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            },
            meta_info={"greedy": True, "global_steps": self.global_steps},
        )
        with timer("gen_max", timing):
            greedy = self.workers.actor_rollout.generate_sequences(gen_in)
        greedy.meta_info.pop("timing", None)
        greedy.non_tensor_batch.update(batch.non_tensor_batch)
        scores = self.reward_fn(greedy, return_dict=False).sum(-1)
        batch.batch["reward_baselines"] = scores
        return batch

    def _compute_reward(self, batch: DataProto, timing: dict) -> tuple[DataProto, dict[str, list]]:
        """token_level_scores: the reward model's scores when one is on (the reward manager returns a
        batch's rm_scores as they are, as in veRL), else the rule-based reward manager's."""
        loop_extra: dict[str, list] = {}
        with timer("reward", timing):
            if self.workers.reward_loop is not None:
                scored, loop_extra = self.workers.reward_loop.compute_rm_score(batch)
                batch = batch.union(scored)
            elif self.workers.reward_model is not None:
                batch = batch.union(self.workers.reward_model.compute_rm_score(batch))
            out = self.reward_fn(batch, return_dict=True)
            batch.batch["token_level_scores"] = out["reward_tensor"]
        return batch, {**out.get("reward_extra_info", {}), **loop_extra}

    def _rollout_and_score(self, metrics: dict, timing: dict) -> DataProto:
        """Generate and score; with DAPO dynamic sampling keep only groups whose metric varies."""
        fg = self.config.algorithm.filter_groups
        if not fg.enable:
            batch, extra = self._compute_reward(self._generate(self._next_prompt_batch(), timing), timing)
            attach_reward_extra(batch, extra)
            return batch
        want = self.config.data.train_batch_size
        kept: list[DataProto] = []
        n_prompts = num_gen = 0
        while n_prompts < want:
            num_gen += 1
            if 0 < fg.max_num_gen_batches < num_gen:
                raise RuntimeError(
                    f"DAPO dynamic sampling: {num_gen - 1} generation batches gave only {n_prompts}/{want} "
                    "prompts with non-constant "
                    f"'{fg.metric}'. Raise algorithm.filter_groups.max_num_gen_batches, use easier data, "
                    "or disable algorithm.filter_groups.enable."
                )
            batch, extra = self._compute_reward(self._generate(self._next_prompt_batch(), timing), timing)
            attach_reward_extra(batch, extra)
            metric = group_metric(batch, fg.metric)
            keep = algos.filter_groups_by_metric(batch.non_tensor_batch["uid"], metric)
            batch = batch.select_idxs(keep)
            n_prompts += len(set(batch.non_tensor_batch["uid"].tolist()))
            kept.append(batch)
        batch = DataProto.concat(kept)
        n = self.config.actor_rollout_ref.rollout.n
        metrics["train/num_gen_batches"] = num_gen
        return batch[: want * n]

    def _balance_batch(self, batch: DataProto, metrics: dict) -> None:
        """Reorder rows so every data-parallel rank gets about the same number of tokens."""
        if not self.config.trainer.balance_batch:
            return
        dp = self.workers.actor_rollout.dp_size("actor")  # the ranks of one model replica share rows
        if dp <= 1:
            return
        seqlens = batch.batch["attention_mask"].sum(-1).tolist()
        parts = get_seqlen_balanced_partitions(seqlens, k=dp, equal_size=True)
        order = torch.tensor([i for part in parts for i in sorted(part)])
        batch.reorder(order)
        sums = [sum(seqlens[i] for i in p) for p in parts]
        metrics["perf/balance_max_min_ratio"] = max(sums) / max(min(sums), 1)

    def _compute_old_log_prob(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        rc = self.config.algorithm.rollout_correction
        if rc.bypass_mode:  # veRL's bypass: the engine's log-probs are the old log-probs; IS weights
            # and rejection are computed in the actor's bypass_mode loss, against the current policy
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            return batch
        if old_log_prob_is_redundant(self.config):
            return batch  # the update takes them from its own forward (exactly on-policy)
        with timer("old_log_prob", timing):
            out = self.workers.actor_rollout.compute_log_prob(batch)
        entropys = out.batch.pop("entropys", None) if "entropys" in out.batch.keys() else None
        if entropys is not None:
            metrics["actor/entropy"] = float(algos.masked_mean(entropys, batch.batch["response_mask"]))
        batch = batch.union(out)
        if self.config.algorithm.rollout_is and "rollout_log_probs" in batch.batch.keys():
            a = self.config.algorithm
            weights, is_metrics = algos.compute_rollout_importance_weights(
                batch.batch["old_log_probs"],
                batch.batch["rollout_log_probs"],
                batch.batch["response_mask"],
                rollout_is_level=a.rollout_is_level,
                rollout_is_mode=a.rollout_is_mode,
                rollout_is_threshold=a.rollout_is_threshold,
                rollout_is_threshold_lower=a.rollout_is_threshold_lower,
                rollout_is_veto_threshold=a.rollout_is_veto_threshold,
            )
            batch.batch["rollout_is_weights"] = weights
            metrics.update({f"rollout_is/{k}": float(v) for k, v in is_metrics.items()})
        return apply_rollout_correction(rc, batch, metrics)

    def _compute_ref_log_prob(self, batch: DataProto, timing: dict) -> DataProto:
        if not self.use_reference_policy:
            return batch
        with timer("ref", timing):
            return batch.union(self.workers.actor_rollout.compute_ref_log_prob(batch))

    def _compute_values(self, batch: DataProto, timing: dict) -> DataProto:
        if not self.use_critic:
            return batch
        with timer("values", timing):
            return batch.union(self.workers.critic.compute_values(batch))

    def _compute_advantage(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        algo = self.config.algorithm
        with timer("adv", timing):
            if algo.use_kl_in_reward:
                self._apply_kl_penalty(batch, metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            fn = algos.get_adv_estimator_fn(algo.adv_estimator)
            b = batch.batch
            advantages, returns = fn(
                b["token_level_rewards"],
                b["response_mask"],
                index=batch.non_tensor_batch["uid"],
                values=b["values"] if "values" in b.keys() else None,
                gamma=algo.gamma,
                lam=algo.lam,
                norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                epsilon=1e-6,
                reward_baselines=b["reward_baselines"] if "reward_baselines" in b.keys() else None,
                old_log_probs=b["old_log_probs"] if "old_log_probs" in b.keys() else None,
                sum_pi_squared=b["sum_pi_squared"] if "sum_pi_squared" in b.keys() else None,
                rollout_is_weights=b["rollout_is_weights"] if "rollout_is_weights" in b.keys() else None,
                reward_components=reward_components(batch, algo.gdpo_reward_keys, metrics),
                reward_weights=algo.gdpo_reward_weights,
            )
            b["advantages"], b["returns"] = advantages, returns
            if algo.use_pf_ppo:  # veRL: only after GAE (verl_misc.check_pf_ppo)
                batch = pf_ppo_resample(algo.pf_ppo, batch, metrics)
        return batch

    def _apply_kl_penalty(self, batch: DataProto, metrics: dict) -> None:
        """r_t = score_t - beta * KL_t(pi_old || pi_ref); beta from the KL controller."""
        b = batch.batch
        mask = b["response_mask"]
        kld = algos.kl_penalty(b["old_log_probs"], b["ref_log_prob"], self.config.algorithm.kl_penalty) * mask
        beta = self.kl_ctrl_in_reward.value
        b["token_level_rewards"] = b["token_level_scores"] - beta * kld
        current_kl = float(algos.masked_mean(kld, mask, axis=-1).mean())
        self.kl_ctrl_in_reward.update(current_kl=current_kl, n_steps=len(batch))
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta

    def _update_critic(self, batch: DataProto, metrics: dict, timing: dict) -> None:
        if not self.use_critic:
            return
        with timer("update_critic", timing):
            out = self.workers.critic.update_critic(batch)
        metrics.update(reduce_metrics(out.meta_info["metrics"]))

    def _update_actor(self, batch: DataProto, metrics: dict, timing: dict) -> None:
        if self.global_steps <= self.config.trainer.critic_warmup:
            return
        with timer("update_actor", timing):
            out = self.workers.actor_rollout.update_actor(batch)
        metrics.update(reduce_metrics(out.meta_info["metrics"]))

    def sync_weights(self, metrics: dict | None = None, timing: dict | None = None) -> None:
        """Stage: the actor's weights into the rollout engines. In the hybrid engine every rank
        gathers its shards and loads them into the engine of its own process, bucket by bucket
        (hybridrl/weight_sync); nothing moves when the actor did not change since the last sync
        (critic warm-up). fit calls it before the first generation and after every actor update;
        `weight_sync/*` (per-rank bytes and seconds, min / max) go into `metrics`."""
        with timer("update_weights", timing if timing is not None else {}):
            per_rank = self.workers.actor_rollout.sync_rollout_weights()
        if metrics is not None:
            merged: dict[str, list] = defaultdict(list)
            for rank_metrics in per_rank:
                for key, value in rank_metrics.items():
                    merged[key].append(value)
            metrics.update(weight_sync_step_metrics(merged))

    # ------------------------------------------------------------ validation
    def _maybe_validate(self, metrics: dict, timing: dict) -> None:
        freq = self.config.trainer.test_freq
        last = self.global_steps >= self.total_training_steps
        if self.val_loader is None or freq <= 0 and not last or PREEMPTION.requested:
            return
        if last or self.global_steps % freq == 0:
            with timer("testing", timing):
                metrics.update(self._validate())

    def _validate(self) -> dict[str, float]:
        """Generate with `rollout.val_kwargs` (greedy by default), score, report mean/best/maj@N."""
        n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        sources, scores, extras, uids, samples = [], [], defaultdict(list), [], []
        for i, batch_dict in enumerate(self.val_loader):
            prompts = trim_left_padding(DataProto.from_single_dict(batch_dict))
            prompts.non_tensor_batch["uid"] = np.array(
                [str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object
            )
            batch = prompts.repeat(repeat_times=n, interleave=True)
            gen_in = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
            gen_in.meta_info["validate"] = True
            gen_in.meta_info["seed_index"] = 10**9 + self.global_steps * 1000 + i
            out = self.workers.actor_rollout.generate_sequences(gen_in)
            out.meta_info.pop("timing", None)
            batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
            batch = batch.union(out)
            res = self.val_reward_fn(batch, return_dict=True)
            seq_scores = res["reward_tensor"].sum(-1).tolist()
            scores.extend(seq_scores)
            for k, v in res.get("reward_extra_info", {}).items():
                extras[k].extend(v)
            sources.extend(
                batch.non_tensor_batch.get(
                    self.config.data.reward_fn_key, np.array(["unknown"] * len(batch))
                ).tolist()
            )
            uids.extend(batch.non_tensor_batch["uid"].tolist())
            if (
                len(samples) < self.config.trainer.log_val_generations
                or self.config.trainer.validation_data_dir
            ):
                samples.extend(decode_samples(self.tokenizer, batch, seq_scores))
        extras["reward"] = scores
        if "acc" not in extras:
            extras["acc"] = scores
        val = process_validation_metrics(sources, uids, dict(extras))
        self.last_val_metrics = val
        write_jsonl(self.config.trainer.validation_data_dir, self.global_steps, samples)
        if samples:
            self.tracker.log_generations(
                samples[: self.config.trainer.log_val_generations], self.global_steps
            )
        return val

    # ----------------------------------------------------------- checkpoints
    def _maybe_save_checkpoint(self, timing: dict) -> None:
        """Save every `save_freq` steps, once `save_freq_secs` passed since the last save, and at
        the last step when either is set."""
        tr = self.config.trainer
        last = self.global_steps >= self.total_training_steps
        by_steps = tr.save_freq > 0 and self.global_steps % tr.save_freq == 0
        by_time = tr.save_freq_secs > 0 and time.monotonic() - self._last_save_time >= tr.save_freq_secs
        forced = self.step_guard.must_save()  # preempted, or veRL's trainer.esi_redundant_time
        if by_steps or by_time or forced or (last and (tr.save_freq > 0 or tr.save_freq_secs > 0)):
            with timer("save_checkpoint", timing):
                self.save_checkpoint()
            self._last_save_time = time.monotonic()

    def _warn_if_never_saving(self) -> None:
        tr = self.config.trainer
        if tr.save_freq <= 0 and tr.save_freq_secs <= 0 and not tr.val_only:
            print(
                "[hybridrl] warning: trainer.save_freq=-1 and trainer.save_freq_secs=0: this run writes no "
                "checkpoint, a crash loses it; set trainer.save_freq=<steps> or trainer.save_freq_secs=<s>"
            )

    def driver_state(self) -> dict:
        """What a checkpoint holds of the driver: step, data position, RNG states, KL controller."""
        return {
            "global_steps": self.global_steps,
            "epoch": self._epoch,
            "dataloader": self.train_loader.state_dict(),
            "kl_ctrl": self.kl_ctrl_in_reward.state_dict() if self.kl_ctrl_in_reward else None,
            "rng": get_rng_state(),
        }

    def save_checkpoint(self, state: dict | None = None) -> str:
        """Write `global_step_N` (workers' parts + driver state), verified and durable (checkpoints.py).

        Args:
            state: the driver state to write (default: `driver_state()` now).
        """
        started = time.monotonic()
        ckpts = self._checkpoints()
        with ckpts.saving(self.global_steps) as tmp:  # free space checked, storage faults named
            parts = {"actor": self._group_size(self.workers.actor_rollout)}
            self.workers.actor_rollout.save_checkpoint(os.path.join(tmp, "actor"), self.global_steps)
            if self.use_critic:
                parts["critic"] = self._group_size(self.workers.critic)
                self.workers.critic.save_checkpoint(os.path.join(tmp, "critic"), self.global_steps)
            torch.save(state if state is not None else self.driver_state(), os.path.join(tmp, "data.pt"))
            final = ckpts.finish_save(self.global_steps, parts)
        self.step_guard.saved(time.monotonic() - started)
        return final

    @staticmethod
    def _group_size(group) -> int:
        return int(getattr(group, "world_size", 1))

    def _checkpoints(self) -> RunCheckpoints:
        if self.checkpoints is None:
            self.checkpoints = RunCheckpoints(self.config)
        return self.checkpoints

    def _load_checkpoint(self) -> None:
        """Resume from the best loadable checkpoint of this run; an incomplete or unloadable one is
        reported and the next older one is tried."""
        cfg = self.config.trainer
        ckpts = self._checkpoints()
        found = ckpts.plan_resume()
        if cfg.resume_mode == "disable" or not found:
            return
        failures = []
        for path in found:
            reason = checkpointing.verify(path) if checkpointing.read_meta(path) is not None else None
            if reason is None:
                try:
                    check_dcp_tree(path)  # .metadata read without running code, before any worker loads
                    self._load_from(path)
                except (Exception, CheckpointException) as e:  # reported; the next older one is tried
                    reason = f"{type(e).__name__}: {e}"
            if reason is None:
                ckpts.loaded(path)
                return
            failures.append(f"{path}: {reason}")
            print(f"[hybridrl] checkpoint {path} cannot be used ({reason}); trying the next older one")
        raise RuntimeError(
            "no checkpoint could be loaded:\n  " + "\n  ".join(failures) + "\nmove the broken folders away, "
            "or start fresh with a new trainer.default_local_dir"
        )

    def _load_from(self, path: str) -> None:
        self.workers.actor_rollout.load_checkpoint(os.path.join(path, "actor"))
        if self.use_critic:
            self.workers.critic.load_checkpoint(os.path.join(path, "critic"))
        state = load_state_file(os.path.join(path, "data.pt"))
        self.global_steps = state["global_steps"]
        self._epoch = state["epoch"]
        self.train_loader.load_state_dict(state["dataloader"])
        self._train_iter = None
        if self.kl_ctrl_in_reward is not None and state["kl_ctrl"] is not None:
            self.kl_ctrl_in_reward.load_state_dict(state["kl_ctrl"])
        set_rng_state(state["rng"])
        print(f"[hybridrl] resumed from {path} (global step {self.global_steps})")

    # --------------------------------------------------------------- logging
    def _log_step(self, batch: DataProto, metrics: dict, timing: dict) -> None:
        d = self.config.data
        metrics.update(
            compute_data_metrics(
                batch,
                use_critic=self.use_critic,
                max_prompt_length=d.max_prompt_length,
                max_response_length=d.max_response_length,
            )
        )
        metrics.update(agent_step_metrics(batch))
        metrics.update(compute_timing_metrics(batch, timing, getattr(self, "floors", None)))  # log_floors
        metrics.update(compute_throughout_metrics(batch, timing, self.workers.actor_rollout.world_size))
        metrics.update(self.workers.reward_loop.pop_metrics() if self.workers.reward_loop else {})  # GenRM
        metrics["training/global_step"] = self.global_steps
        metrics["training/epoch"] = self._epoch
        clean = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float, np.floating, np.integer)) or (torch.is_tensor(v) and v.numel() == 1)
        }
        self.history.append(clean)
        where = getattr(self.tracker, "log_dir", None) or "the trackers' folders"
        with named_storage_faults(
            "writing the metrics (trainer.logger)", where, last_good=self._checkpoints().last_good()
        ):
            self.tracker.log(clean, step=self.global_steps)

    def _dump_rollouts(self, batch: DataProto) -> None:
        out_dir = self.config.trainer.rollout_data_dir
        if not out_dir:
            return
        rows = decode_samples(self.tokenizer, batch, batch.batch["token_level_scores"].sum(-1).tolist())
        last_good = self._checkpoints().last_good()
        with named_storage_faults(
            "writing the rollout dump (trainer.rollout_data_dir)", out_dir, last_good=last_good
        ):
            write_jsonl(out_dir, self.global_steps, rows)


# ---------------------------------------------------------------- helpers
_POSTFIX_KEYS = {
    "critic/score/mean": "score",
    "actor/pg_loss": "pg",
    "actor/entropy": "ent",
    "response_length/mean": "len",
    "perf/time_per_step": "s/step",
}


def _postfix(metrics: dict) -> dict[str, str]:
    out = {short: f"{float(metrics[k]):.3g}" for k, short in _POSTFIX_KEYS.items() if k in metrics}
    val = [k for k in metrics if k.startswith("val-core/") and "mean@" in k]
    if val:
        out["val"] = f"{float(metrics[val[0]]):.3f}"
    return out


def _progress_bar(enabled: bool, total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", disable=not enabled, dynamic_ncols=True)
