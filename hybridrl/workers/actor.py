"""The PPO actor: log-probs of responses and the clipped policy update over any training engine.

`PPOActor` holds a causal LM behind a `TrainEngine` (engine/base.py: FSDP2, Megatron, or a bare
module). The same class serves the reference policy (no optimizer: `compute_log_prob` only).
Every method is a collective over the engine's ranks, so every rank calls it with its own shard
of the batch (the ranks of one model replica with the same rows), all shards the same length.

Batch keys (veRL names; B rows on this rank, P prompt, T response length):
    input_ids (B, P+T), attention_mask (B, P+T), position_ids (B, P+T), responses (B, T),
    response_mask (B, T) (default: the response part of attention_mask), old_log_probs (B, T)
    (may be left out when the update is exactly on-policy: see `is_on_policy`), advantages (B, T); ref_log_prob (B, T) with use_kl_loss; optional rollout_is_weights (B, T),
    routed_experts (B, P+T, L, K) for routing replay (`router_replay.mode`, docs/moe.md)
    and rollout_log_probs (B, T) (the behaviour policy's, for the 'decoupled' loss).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algos.agg import agg_loss
from hybridrl.algos.kl import kl_penalty
from hybridrl.algos.policy_loss import get_policy_loss_fn
from hybridrl.config.roles import ActorConfig
from hybridrl.engine.base import LogProbRequest, LogProbs
from hybridrl.engine.batching import mean_over_ranks, merge_outputs, response_mask_of
from hybridrl.engine.multimodal import attach_multimodal
from hybridrl.engine.update_loop import MicroBatchedRole, combine_micro_metrics, micro_loss_aux
from hybridrl.protocol import DataProto
from hybridrl.workers.distillation import add_distillation_loss, needs_topk

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
_OPTIONAL_KEYS = (
    "response_mask",
    "ref_log_prob",
    "rollout_is_weights",
    "rollout_log_probs",
    "teacher_log_probs",
    "teacher_topk_log_probs",
    "teacher_topk_ids",
    "routed_experts",
)


class PPOActor(MicroBatchedRole):
    """PPO policy over a TrainEngine.

    Args:
        config: the actor config (None: defaults, enough for a reference policy).
        engine: the engine (FSDPEngine, MegatronEngine, ...), or a bare causal LM with the
            layout keywords of `MicroBatchedRole` (optimizer, lr_scheduler, dp_size, dp_group, sp,
            use_remove_padding, use_fused_kernels: `model.use_fused_kernels`, the chunked head).
        batch_sizes: from `normalize_actor_batch_sizes`; needed by `update_policy`.
        peak_flops: peak FLOP/s of one device for `perf/mfu/actor` (None: not reported).
    """

    role = "actor"

    def __init__(
        self, config: ActorConfig | None, engine: Any, *args: Any, distillation: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(config or ActorConfig(), engine, *args, **kwargs)
        self.distillation = distillation  # distillation.distillation_loss (workers/distillation.py), or None
        self.policy_loss_fn = get_policy_loss_fn(self.config.policy_loss.loss_mode)

    # ------------------------------------------------------------------------------------------
    def _request(
        self,
        temperature: float,
        calculate_entropy: bool,
        entropy_grad: bool = True,
        sps: bool = False,
        topk: int = 0,
        topk_ids: bool = False,
        record_routing: bool = False,
        replay_routing: bool = False,
        router_aux_loss: bool = False,
    ) -> LogProbRequest:
        """What the engine computes from the policy's logits (the actor config's head options)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
        c = self.config
        return LogProbRequest(
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            entropy_grad=entropy_grad,
            sum_pi_squared=sps,
            entropy_chunk_size=2048
            if (c.entropy_from_logits_with_chunking or c.entropy_checkpointing)
            else None,
            compile_kernels=c.use_torch_compile,
            prefix_group=c.use_prefix_grouper is True,  # 'auto' is resolved on the driver (prefix_auto.py)
            topk=topk,
            topk_ids=topk_ids,
            record_routing=record_routing,
            replay_routing=replay_routing,
            router_aux_loss=router_aux_loss,
        )

    @property
    def routing_mode(self) -> str:
        """`router_replay.mode`: disabled, R2 or R3 (config/roles.RouterReplayConfig)."""
        return self.config.router_replay.mode

    def _log_prob_routing(self, data: DataProto) -> tuple[bool, bool]:
        """(record, replay) of a log-prob pass. The actor's old-log-prob pass records under R2 and
        replays the rollout's routing under R3; the reference (no optimizer) replays the batch's
        routing under either mode."""
        mode, has = self.routing_mode, "routed_experts" in data.batch.keys()
        if mode == "disabled":
            return False, False
        if self.engine.optimizer is None:
            return False, has
        return mode == "R2", mode == "R3"

    def compute_log_prob(
        self,
        data: DataProto,
        *,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        use_dynamic_bsz: bool = False,
        max_token_len: int | None = None,
        temperature: float = 1.0,
        calculate_sum_pi_squared: bool = False,
        topk: int = 0,
    ) -> LogProbs:
        """Log-probs (and entropy) of `data`'s responses, in micro-batches, without gradients.

        Args:
            data: batch with input_ids, attention_mask, position_ids, responses.
            micro_batch_size: rows per forward (fixed micro-batching).
            use_dynamic_bsz / max_token_len: token-budget micro-batches instead.
            temperature: the rollout's sampling temperature.
            calculate_sum_pi_squared: also sum_v pi(v)^2 per position (`actor.calculate_sum_pi_squared`).
            topk: > 0: also the k largest log-probs and their ids (B, T, k) (a distillation teacher).

        Returns:
            LogProbs of (B, T) float32 CPU tensors in `data`'s row order: log_probs; entropy with
            calculate_entropy; sum_pi_squared with calculate_sum_pi_squared (else None).
        """
        record, replay = self._log_prob_routing(data)
        request = self._request(
            temperature, calculate_entropy, sps=calculate_sum_pi_squared, topk=topk,
            record_routing=record, replay_routing=replay,
        )  # fmt: skip
        keys = (*_FORWARD_KEYS, "routed_experts") if replay else _FORWARD_KEYS
        batch = attach_multimodal(data.batch.select(*keys).to(self.device), data)
        micros, indices = self.split(
            batch,
            micro_batch_size or len(data),
            use_dynamic_bsz,
            max_token_len,
            "log_prob_max_token_len_per_gpu",
        )
        outs = self.engine.forward(micros, request)

        def merged(name: str, wanted: bool = True) -> torch.Tensor | None:
            return merge_outputs([getattr(o, name) for o in outs], indices).cpu() if wanted else None

        return LogProbs(
            merged("log_probs"),
            merged("entropy", calculate_entropy),
            merged("sum_pi_squared", calculate_sum_pi_squared),
            merged("topk_log_probs", topk > 0),
            merged("topk_ids", topk > 0),
            routed_experts=merged("routed_experts", record),
        )

    # ------------------------------------------------------------------------------------------
    def _loss_hparams(self) -> dict[str, Any]:
        c, pl = self.config, self.config.policy_loss
        tau_pos, tau_neg = c.sapo_taus()
        return {
            "clip_ratio": c.clip_ratio,
            "clip_ratio_low": c.clip_ratio_low,
            "clip_ratio_high": c.clip_ratio_high,
            "clip_ratio_c": c.clip_ratio_c,
            "clip_cov_ratio": pl.clip_cov_ratio,
            "clip_cov_lb": pl.clip_cov_lb,
            "clip_cov_ub": pl.clip_cov_ub,
            "kl_cov_ratio": pl.kl_cov_ratio,
            "ppo_kl_coef": pl.ppo_kl_coef,
            "behave_imp_weight_cap": pl.behave_imp_weight_cap,
            "dro_beta": pl.dro_beta,
            "tau_pos": tau_pos,
            "tau_neg": tau_neg,
            **self._bypass_hparams(),
        }

    def _bypass_hparams(self) -> dict[str, Any]:
        """The `bypass_mode` loss's settings (actor.policy_loss.rollout_correction); its IS-weight
        batch mean is taken over the data-parallel ranks, as veRL does."""
        rc = self.config.policy_loss.rollout_correction
        out = {f"bypass_{k}": getattr(rc, k) for k in (
            "loss_type", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
            "rollout_rs", "rollout_rs_threshold",
        )}  # fmt: skip
        if self.dp_size > 1:
            out["bypass_mean_fn"] = self._masked_mean_over_ranks
        return out

    def _masked_mean_over_ranks(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        both = torch.stack([(values * mask).sum(), mask.sum()]).float()
        dist.all_reduce(both, group=self.dp_group)
        return both[0] / both[1].clamp(min=1)

    def is_on_policy(self, rows: int) -> bool:
        """True when an update over `rows` rows is one optimizer step on data from the current policy.

        Then the old log-probs equal the detached log-probs of the update's own forward, and the
        update may run without them (`actor.skip_on_policy_old_log_prob`).
        """
        bs = self.batch_sizes
        return bs is not None and bs.epochs == 1 and rows <= bs.mini_batch_size

    def _select_train_keys(self, data: DataProto) -> DataProto:
        keys = [*_FORWARD_KEYS, "advantages"]
        if "old_log_probs" in data.batch.keys():
            keys.append("old_log_probs")
        elif not self.is_on_policy(len(data)):
            bs = self.batch_sizes
            raise KeyError(
                "update_policy: the batch lacks 'old_log_probs', and this update is not exactly on-policy "
                f"({len(data)} rows, mini-batch {bs.mini_batch_size if bs else None} rows, "
                f"ppo_epochs {bs.epochs if bs else None}), so they cannot be taken from the update's own "
                "forward: compute them first (compute_log_prob)"
            )
        if self.distillation is not None and "teacher_log_probs" not in data.batch.keys():
            raise KeyError(
                "distillation.enabled=True needs 'teacher_log_probs' in the batch (the teachers' pass)"
            )
        if self.config.use_kl_loss:
            if "ref_log_prob" not in data.batch.keys():
                raise KeyError(
                    "actor.use_kl_loss=True needs 'ref_log_prob' in the batch: compute it with the reference "
                    "policy first, or set actor_rollout_ref.actor.use_kl_loss=False"
                )
        missing = [k for k in keys if k not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_policy: the batch lacks {missing}; it has {sorted(data.batch.keys())}")
        keys += [k for k in _OPTIONAL_KEYS if k in data.batch.keys()]
        return DataProto(
            batch=attach_multimodal(data.batch.select(*keys), data), meta_info=dict(data.meta_info)
        )

    def forward_backward(self, mini_batch: DataProto, *, temperature: float = 1.0) -> dict[str, float]:
        """Accumulate the gradient of one mini-batch (no optimizer step).

        The loss of every micro-batch is normalised by the mini-batch's global token/sequence
        counts, so the accumulated gradient (after the engine's average over ranks) equals the
        gradient of the whole, un-split mini-batch. The returned metrics are the values of the
        whole mini-batch (the same on every rank): pg_loss / kl_loss as optimised, pg_clipfrac,
        ppo_kl, entropy, ... as token means.
        """
        c = self.config
        _, loss_scale, micros = self.prepare(mini_batch, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
        has_old = "old_log_probs" in mini_batch.batch.keys()
        # Without old log-probs (exactly on-policy) the entropy metric the old-log-prob pass would
        # have reported comes from this forward instead (not in the loss unless entropy_coeff != 0).
        request = self._request(
            temperature,
            c.entropy_coeff != 0 or not has_old,
            c.entropy_coeff != 0,
            topk_ids=needs_topk(self.distillation),
            replay_routing=self._update_replays(mini_batch),
            router_aux_loss=True,
        )

        def loss(micro: Any, out: LogProbs):
            self._perf.record(out)  # the shared-prompt forward's own FLOP count (update_loop.UpdatePerf)
            return self._micro_batch_loss(micro, out, loss_scale, has_old)

        auxes = self.engine.forward_backward(micros, request, loss)
        sums, means = combine_micro_metrics(auxes, loss_scale)
        if c.use_kl_loss:
            sums["actor/kl_coef"] = c.kl_loss_coef
        return mean_over_ranks({**sums, **means}, self.dp_group, self.dp_size, self.device)

    def _update_replays(self, mini_batch: DataProto) -> bool:
        """The update routes with the batch's `routed_experts` under R3 (required) and under R2 when
        the old-log-prob pass recorded them (an exactly on-policy update without that pass routes
        as its own forward does, which is the same network)."""
        if self.routing_mode == "R3":
            return True
        return self.routing_mode == "R2" and "routed_experts" in mini_batch.batch.keys()

    def _add_router_loss(self, loss, out: LogProbs, mask, loss_scale, means):
        """+ router_aux_loss_coef * the load-balancing loss (`model.override_config.output_router_logits`,
        Hugging Face's switch, and `router_aux_loss_coef`), weighed like a token mean of the
        mini-batch; the expert-load metrics of a mixture-of-experts model."""
        if out.router_aux_loss is None:
            return loss
        coef = float(getattr(self.engine, "router_aux_loss_coef", 0.0))
        if coef:
            term = agg_loss(out.router_aux_loss.expand_as(mask), mask, "token-mean", loss_scale=loss_scale)
            loss = loss + coef * term
            means["actor/router_aux_loss_coef"] = coef
        means["actor/moe/aux_loss"] = out.router_aux_loss.detach()
        means.update({f"actor/{k}": v for k, v in (out.moe_metrics or {}).items()})
        return loss

    def _micro_batch_loss(self, micro: Any, out: LogProbs, loss_scale: Any, has_old: bool):
        """(policy loss [- entropy bonus] [+ KL loss], micro_loss_aux) of one micro-batch."""
        c = self.config
        mask = response_mask_of(micro)
        log_prob, entropy = out.log_probs, out.entropy
        pg_loss, pg_metrics = self.policy_loss_fn(
            micro["old_log_probs"] if has_old else log_prob.detach(),
            log_prob,
            micro["advantages"],
            mask,
            loss_agg_mode=c.loss_agg_mode,
            loss_scale=loss_scale,
            rollout_is_weights=micro.get("rollout_is_weights", None),
            behave_log_prob=micro.get("rollout_log_probs", None),
            **self._loss_hparams(),
        )
        loss, sums = pg_loss, {"actor/pg_loss": float(pg_loss.detach())}
        if c.entropy_coeff != 0:
            loss = loss - c.entropy_coeff * agg_loss(entropy, mask, c.loss_agg_mode, loss_scale=loss_scale)
        if entropy is not None:
            pg_metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        if c.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_prob"], c.kl_loss_type)
            kl_loss = agg_loss(kld, mask, c.loss_agg_mode, loss_scale=loss_scale)
            loss = loss + c.kl_loss_coef * kl_loss
            sums["actor/kl_loss"] = float(kl_loss.detach())
        means = {f"actor/{k}": v for k, v in pg_metrics.items()}
        if self.distillation is not None:  # on-policy distillation: workers/distillation.py
            loss, d_sums, d_means = add_distillation_loss(
                self.distillation, loss, out, micro, mask, loss_agg_mode=c.loss_agg_mode,
                loss_scale=loss_scale, old_log_prob=micro["old_log_probs"] if has_old else log_prob.detach(),
            )  # fmt: skip
            sums, means = {**sums, **d_sums}, {**means, **d_means}
        loss = self._add_router_loss(loss, out, mask, loss_scale, means)
        return loss, micro_loss_aux(sums, means, mask)

    def update_policy(self, data: DataProto, *, temperature: float = 1.0) -> dict[str, list[float]]:
        """PPO epochs over mini-batches of `data`; one optimizer step per mini-batch.

        The lr scheduler steps once per call (one trainer step), as in veRL.

        Returns:
            metric name -> list (one entry per mini-batch, or per call for lr / perf).
        """
        if self.engine.optimizer is None:
            raise RuntimeError(
                "update_policy needs an optimizer; this actor was built forward-only (reference)"
            )
        if self.batch_sizes is None:
            raise ValueError(
                "update_policy needs batch_sizes=normalize_actor_batch_sizes(...) at construction"
            )
        return self.run_update(
            self._select_train_keys(data), lambda mini: self.forward_backward(mini, temperature=temperature)
        )
