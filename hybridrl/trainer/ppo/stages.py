"""The stages of one PPO step, from the prompts to the advantages (a mixin of `RayPPOTrainer`).

Each stage takes the step's batch, a `DataProto` or a `BatchRef` (hybridrl/trainer/ppo/step_data.py),
and returns it with its new columns. With a BatchRef the token-level tensors never pass through
the driver: the rollout's output stays in the object store, the reward manager runs on a worker
(`batch_fns.score`), the per-token half of GRPO on every worker over its rows, whole-batch
computations (the other estimators, GAE's whitening, the KL penalty, the step's metrics) on one
worker. Stages that need the whole batch on the driver pull it there (`StepData.pull`, counted):
ReMax's greedy baseline, DAPO's group filter, the GenRM reward loop, rollout correction and
rollout importance sampling, PF-PPO, on-policy distillation, a `data.sampler` with `update`,
and `trainer.rollout_data_dir`.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from hybridrl import algos
from hybridrl.protocol import DataProto
from hybridrl.single_controller.batch_ref import BatchRef
from hybridrl.trainer.ppo import batch_fns
from hybridrl.trainer.ppo.batch_steps import (
    apply_rollout_correction,
    attach_reward_extra,
    group_metric,
    pf_ppo_resample,
    reward_components,
    rollout_correction_active,
)
from hybridrl.trainer.ppo.metrics import timer
from hybridrl.trainer.ppo.padding import trim_right_padding
from hybridrl.trainer.ppo.step_data import StepBatch, StepData
from hybridrl.utils.seqlen_balancing import get_seqlen_balanced_partitions

_GEN_KEYS = ["input_ids", "attention_mask", "position_ids"]


class PPOStages:
    """The step's stages; the trainer provides config, workers, reward_fn, tokenizer, step counters."""

    data: StepData
    _row_stats: dict[str, Any]
    _reward_on_workers: bool

    BATCH_BY_REFERENCE = True  # a trainer whose loop needs its batch on the driver sets False

    def _start_data_path(self) -> None:
        """Hold the batch by reference on Ray workers; the rule reward runs in the workers then."""
        self._row_stats = {}
        self._reward_on_workers = False
        if not self.BATCH_BY_REFERENCE:
            self.data = StepData(self.workers.actor_rollout, by_reference=False)
            return
        self.data = StepData.for_workers(self.workers.actor_rollout)
        if not self.data.by_reference or self.workers.reward_loop is not None:
            return
        try:
            install = functools.partial(batch_fns.install_reward_fn, self.reward_fn, self.config.trainer)
            self.workers.actor_rollout.run_in_every_process(install)
            self._reward_on_workers = True
        except Exception as e:  # a reward function the workers cannot import: it stays on the driver
            print(f"[hybridrl] the reward manager stays on the driver (the workers cannot load it: {e})")

    def _on_driver(self, batch: StepBatch, why: str) -> DataProto:
        """The batch as a DataProto on the driver (pulled and counted if it was a BatchRef)."""
        out = self.data.pull(batch, why)
        b = out.batch
        if (
            "token_level_scores" in b.keys()
            and "advantages" in b.keys()
            and "token_level_rewards" not in b.keys()
        ):
            b["token_level_rewards"] = b["token_level_scores"]
        return out

    # ---------------------------------------------------------------- rollout and reward
    def _generate(self, prompts: DataProto, timing: dict) -> StepBatch:
        """Repeat each prompt `rollout.n` times and generate one response per row."""
        n = self.config.actor_rollout_ref.rollout.n
        if self.data.by_reference:  # the prompts go into the object store once, repeated by row index
            batch = self.data.hold(prompts).select_idxs(np.repeat(np.arange(len(prompts)), n))
        else:
            batch = prompts.repeat(repeat_times=n, interleave=True)
        gen_in = batch.select(batch_keys=_GEN_KEYS)
        gen_in.meta_info["global_steps"] = self.global_steps
        gen_in.meta_info["seed_index"] = self.global_steps * 1000 + self._gen_batches_this_step
        self._gen_batches_this_step += 1
        with timer("gen", timing):
            out = self.workers.actor_rollout.generate_sequences(gen_in)
        timing.update(out.meta_info.pop("timing", {}))
        batch.pop(batch_keys=_GEN_KEYS)
        batch = batch.union(out)
        if self.config.algorithm.adv_estimator == "remax":
            batch = self._remax_baseline(self._on_driver(batch, "adv_estimator=remax"), timing)
        return batch

    def _remax_baseline(self, batch: DataProto, timing: dict) -> DataProto:
        """ReMax: the greedy response's reward is the baseline of each sampled response."""
        prompts = batch.batch["prompts"]
        mask = (prompts != self.tokenizer.pad_token_id).long()
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
        batch.batch["reward_baselines"] = self.reward_fn(greedy, return_dict=False).sum(-1)
        return batch

    def _compute_reward(self, batch: StepBatch, timing: dict) -> tuple[StepBatch, dict[str, list]]:
        """token_level_scores: the reward model's scores when one is on (the reward manager returns a
        batch's rm_scores as they are, as in veRL), else the rule-based reward manager's."""
        loop_extra: dict[str, list] = {}
        with timer("reward", timing):
            if self.workers.reward_loop is not None:
                batch = self._on_driver(batch, "reward_model.use_reward_loop")
                scored, loop_extra = self.workers.reward_loop.compute_rm_score(batch)
                batch = batch.union(scored)
            elif self.workers.reward_model is not None:
                batch = batch.union(self.workers.reward_model.compute_rm_score(batch))
            if isinstance(batch, BatchRef) and not self._reward_on_workers:
                batch = self._on_driver(batch, "a reward manager the workers cannot load")
            if isinstance(batch, BatchRef):
                batch, self._row_stats = self.data.add(batch, batch_fns.score)
                return batch, {}
            out = self.reward_fn(batch, return_dict=True)
            batch.batch["token_level_scores"] = out["reward_tensor"]
        return batch, {**out.get("reward_extra_info", {}), **loop_extra}

    def _rollout_and_score(self, metrics: dict, timing: dict) -> StepBatch:
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
            batch = self._on_driver(
                self._generate(self._next_prompt_batch(), timing), "algorithm.filter_groups"
            )
            batch, extra = self._compute_reward(batch, timing)
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

    def _trim_padding(self, batch: StepBatch) -> StepBatch:
        """trim_right_padding; for a BatchRef every worker cuts its rows to the batch's width."""
        if isinstance(batch, DataProto):
            return trim_right_padding(batch)
        s, t = self._row_stats["widths"]
        keep = self._row_stats["keep"]
        batch.meta_info.setdefault("max_response_length", t)
        if keep == t:
            return batch
        cut_fn = functools.partial(batch_fns.trim_columns, keep=keep, prompt_and_response=s, response=t)
        cut, _ = self.data.per_rank(batch, cut_fn)
        batch.pop(cut.keys())
        return batch.union(cut)

    def _seq_scores(self, batch: StepBatch) -> torch.Tensor:
        """(B,) sequence scores, or the (B, T) token-level scores of a DataProto."""
        if isinstance(batch, DataProto):
            return batch.batch["token_level_scores"]
        return self._row_stats["seq_scores"]

    def _balance_batch(self, batch: StepBatch, metrics: dict) -> None:
        """Reorder rows so every data-parallel rank gets about the same number of tokens."""
        if not self.config.trainer.balance_batch:
            return
        dp = self.workers.actor_rollout.dp_size("actor")  # the ranks of one model replica share rows
        if dp <= 1:
            return
        if isinstance(batch, DataProto):
            seqlens = batch.batch["attention_mask"].sum(-1).tolist()
        else:
            seqlens = self._row_stats["seqlens"]
        parts = get_seqlen_balanced_partitions(seqlens, k=dp, equal_size=True)
        order = torch.tensor([i for part in parts for i in sorted(part)])
        batch.reorder(order)
        sums = [sum(seqlens[i] for i in p) for p in parts]
        metrics["perf/balance_max_min_ratio"] = max(sums) / max(min(sums), 1)

    # ------------------------------------------------------------ log-probs and values
    def _compute_old_log_prob(self, batch: StepBatch, metrics: dict, timing: dict) -> StepBatch:
        rc, algo = self.config.algorithm.rollout_correction, self.config.algorithm
        if rc.bypass_mode:  # veRL's bypass: the engine's log-probs are the old log-probs; IS weights
            # and rejection are computed in the actor's bypass_mode loss, against the current policy
            batch = self._on_driver(batch, "algorithm.rollout_correction.bypass_mode")
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            return batch
        if old_log_prob_is_redundant(self.config):
            return batch  # the update takes them from its own forward (exactly on-policy)
        if algo.rollout_is or rollout_correction_active(rc):
            batch = self._on_driver(batch, "rollout importance sampling / algorithm.rollout_correction")
        with timer("old_log_prob", timing):
            out = self.workers.actor_rollout.compute_log_prob(batch)
        if "entropys" in (out.keys() if isinstance(out, BatchRef) else out.batch.keys()):
            entropys = out.pop(batch_keys=["entropys"])
            _, values = self.data.whole(
                batch.select(batch_keys=["response_mask"]).union(entropys), batch_fns.entropy_mean
            )
            metrics.update(values)
        batch = batch.union(out)
        if isinstance(batch, BatchRef):
            return batch
        if algo.rollout_is and "rollout_log_probs" in batch.batch.keys():
            weights, is_metrics = algos.compute_rollout_importance_weights(
                batch.batch["old_log_probs"],
                batch.batch["rollout_log_probs"],
                batch.batch["response_mask"],
                rollout_is_level=algo.rollout_is_level,
                rollout_is_mode=algo.rollout_is_mode,
                rollout_is_threshold=algo.rollout_is_threshold,
                rollout_is_threshold_lower=algo.rollout_is_threshold_lower,
                rollout_is_veto_threshold=algo.rollout_is_veto_threshold,
            )
            batch.batch["rollout_is_weights"] = weights
            metrics.update({f"rollout_is/{k}": float(v) for k, v in is_metrics.items()})
        return apply_rollout_correction(rc, batch, metrics)

    def _compute_ref_log_prob(self, batch: StepBatch, timing: dict) -> StepBatch:
        if not self.use_reference_policy:
            return batch
        with timer("ref", timing):
            return batch.union(self.workers.actor_rollout.compute_ref_log_prob(batch))

    def _compute_values(self, batch: StepBatch, timing: dict) -> StepBatch:
        if not self.use_critic:
            return batch
        with timer("values", timing):
            return batch.union(self.workers.critic.compute_values(batch))

    # ------------------------------------------------------------------ advantages
    def _compute_advantage(self, batch: StepBatch, metrics: dict, timing: dict) -> StepBatch:
        algo = self.config.algorithm
        with timer("adv", timing):
            if algo.use_pf_ppo:
                batch = self._on_driver(batch, "algorithm.use_pf_ppo")
            if algo.use_kl_in_reward:
                batch = self._apply_kl_penalty(batch, metrics)
            elif isinstance(batch, DataProto):
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            if isinstance(batch, BatchRef) and algo.adv_estimator == "grpo":
                batch = self._grpo_by_rows(batch)
            else:
                batch = self._advantage_of_batch(batch, metrics)
            if algo.use_pf_ppo:  # veRL: only after GAE (verl_misc.check_pf_ppo)
                batch = pf_ppo_resample(algo.pf_ppo, batch, metrics)
        return batch

    def _advantage_of_batch(self, batch: StepBatch, metrics: dict) -> StepBatch:
        """The registered estimator over the whole batch (on the driver or on one worker)."""
        algo = self.config.algorithm
        fn = functools.partial(
            batch_fns.advantages,
            estimator=algo.adv_estimator,
            options={
                "gamma": algo.gamma,
                "lam": algo.lam,
                "norm_adv_by_std_in_grpo": algo.norm_adv_by_std_in_grpo,
                "epsilon": 1e-6,
                "reward_weights": algo.gdpo_reward_weights,
            },
            reward_components=reward_components(batch, algo.gdpo_reward_keys, metrics),
        )
        if isinstance(batch, DataProto):
            out, _ = self.data.whole(batch, fn)
            return batch.union(out)
        used = [k for k in _ADVANTAGE_INPUTS if k in batch.keys()]
        out, _ = self.data.whole(batch.select(batch_keys=used), fn)
        return batch.union(out)

    def _grpo_by_rows(self, batch: BatchRef) -> BatchRef:
        """GRPO with the batch on the workers: s_i on every worker, A_i of each group here, A_i onto
        the tokens on every worker (equal to the whole-batch estimator, bit for bit)."""
        algo = self.config.algorithm
        rewards = "token_level_rewards" if "token_level_rewards" in batch.keys() else "token_level_scores"
        scores, _ = self.data.per_rank(
            batch.select(batch_keys=[rewards, "response_mask"]), batch_fns.outcome_scores
        )
        per_response = algos.grpo_response_advantages(
            torch.from_numpy(np.asarray(scores.non_tensor_batch["grpo_score"], dtype=np.float32)),
            batch.non_tensor_batch["uid"],
            1e-6,
            algo.norm_adv_by_std_in_grpo,
        )
        adv_in = batch.select(batch_keys=["response_mask"])
        adv_in.non_tensor_batch = {"grpo_adv": per_response.numpy()}
        out, _ = self.data.per_rank(adv_in, batch_fns.broadcast_advantages)
        out.non_tensor_batch = {}
        return batch.union(out)

    def _apply_kl_penalty(self, batch: StepBatch, metrics: dict) -> StepBatch:
        """r_t = score_t - beta * KL_t(pi_old || pi_ref); beta from the KL controller."""
        beta = self.kl_ctrl_in_reward.value
        fn = functools.partial(batch_fns.kl_in_reward, kl_penalty=self.config.algorithm.kl_penalty, beta=beta)
        inputs = batch if isinstance(batch, DataProto) else batch.select(batch_keys=_KL_INPUTS)
        out, values = self.data.whole(inputs, fn)
        current_kl = values["current_kl"]
        self.kl_ctrl_in_reward.update(current_kl=current_kl, n_steps=len(batch))
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta
        return batch.union(out)


_KL_INPUTS = ["old_log_probs", "ref_log_prob", "token_level_scores", "response_mask"]
_ADVANTAGE_INPUTS = (
    "token_level_rewards",
    "token_level_scores",
    "response_mask",
    "values",
    "reward_baselines",
    "old_log_probs",
    "sum_pi_squared",
    "rollout_is_weights",
)


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
