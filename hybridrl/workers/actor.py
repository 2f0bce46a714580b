"""The PPO actor: log-probs of responses and the clipped policy update over an FSDP2 model.

`PPOActor` wraps a built (sharded) causal LM. The same class serves the reference policy (no
optimizer: `compute_log_prob` only). Every method is a collective over the data-parallel ranks
(FSDP all-gathers parameters in each forward), so every rank calls it with its own shard of the
batch, all shards the same length.

Batch keys (veRL names; B rows on this rank, P prompt, T response length):
    input_ids (B, P+T), attention_mask (B, P+T), position_ids (B, P+T), responses (B, T),
    response_mask (B, T) (default: the response part of attention_mask), old_log_probs (B, T)
    (may be left out when the update is exactly on-policy: see `is_on_policy`), advantages (B, T); ref_log_prob (B, T) with use_kl_loss; optional rollout_is_weights (B, T)
    and rollout_log_probs (B, T) (the behaviour policy's, for the 'decoupled' loss).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hybridrl.algos.agg import agg_loss
from hybridrl.algos.kl import kl_penalty
from hybridrl.algos.policy_loss import get_policy_loss_fn
from hybridrl.protocol import DataProto
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.flops import attention_dims, compute_mfu, count_params, estimate_flops
from hybridrl.workers.config import ActorConfig, PerRankBatchSizes
from hybridrl.workers.engine.batching import (
    TokenWeightedMeans,
    append_metrics,
    default_dp_group,
    global_loss_scale,
    mean_over_ranks,
    merge_outputs,
    optimizer_step,
    response_mask_of,
    shuffle_seed,
    split_micro_batches,
)
from hybridrl.workers.engine.forward import forward_log_probs

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
_OPTIONAL_KEYS = ("response_mask", "ref_log_prob", "rollout_is_weights", "rollout_log_probs")


class PPOActor:
    """PPO policy over an FSDP2-sharded causal LM.

    Args:
        config: the actor config (None: defaults, enough for a reference policy).
        module: the sharded model (FSDPEngine.module).
        optimizer, lr_scheduler: None for a forward-only (reference) policy.
        dp_size: data-parallel ranks (the gradient average FSDP takes).
        batch_sizes: from `normalize_actor_batch_sizes`; needed by `update_policy`.
        use_remove_padding: pack valid tokens into one row (`model.use_remove_padding`).
        dp_group: process group of the data-parallel ranks (default: WORLD when dp_size > 1).
        peak_flops: peak FLOP/s of one device for `perf/mfu/actor` (None: not reported).
    """

    def __init__(
        self,
        config: ActorConfig | None,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        dp_size: int = 1,
        batch_sizes: PerRankBatchSizes | None = None,
        use_remove_padding: bool = False,
        dp_group: Any = None,
        peak_flops: float | None = None,
    ) -> None:
        self.config = config or ActorConfig()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp_size = dp_size
        self.batch_sizes = batch_sizes
        self.use_remove_padding = use_remove_padding
        self.dp_group = default_dp_group(dp_size, dp_group)
        self.peak_flops = peak_flops
        self.device = get_torch_device()
        self.policy_loss_fn = get_policy_loss_fn(self.config.policy_loss.loss_mode)
        self._flops_dims: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------------------------------
    def _forward(self, micro: Any, temperature: float, calculate_entropy: bool, entropy_grad: bool = True):
        c = self.config
        chunk = 2048 if (c.entropy_from_logits_with_chunking or c.entropy_checkpointing) else None
        return forward_log_probs(
            self.module,
            micro,
            temperature=temperature,
            use_remove_padding=self.use_remove_padding,
            calculate_entropy=calculate_entropy,
            entropy_chunk_size=chunk,
            entropy_grad=entropy_grad,
        )

    def compute_log_prob(
        self,
        data: DataProto,
        *,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        use_dynamic_bsz: bool = False,
        max_token_len: int | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of `data`'s responses, in micro-batches, without gradients.

        Args:
            data: batch with input_ids, attention_mask, position_ids, responses.
            micro_batch_size: rows per forward (fixed micro-batching).
            use_dynamic_bsz / max_token_len: token-budget micro-batches instead.
            temperature: the rollout's sampling temperature.

        Returns:
            log_probs (B, T) and entropy (B, T) or None, float32 on CPU, in `data`'s row order.
        """
        batch = data.batch.select(*_FORWARD_KEYS).to(self.device)
        micro_batch_size = micro_batch_size or len(data)
        micros, indices = split_micro_batches(
            batch,
            micro_batch_size=micro_batch_size,
            use_dynamic_bsz=use_dynamic_bsz,
            max_token_len=max_token_len,
            dp_group=self.dp_group,
            key="log_prob_max_token_len_per_gpu",
        )
        was_training = self.module.training
        self.module.eval()
        log_probs, entropies = [], []
        try:
            with torch.no_grad():
                for micro in micros:
                    lp, ent = self._forward(micro, temperature, calculate_entropy)
                    log_probs.append(lp)
                    if ent is not None:
                        entropies.append(ent)
        finally:
            self.module.train(was_training)
        out = merge_outputs(log_probs, indices).cpu()
        ent = merge_outputs(entropies, indices).cpu() if calculate_entropy else None
        return out, ent

    # ------------------------------------------------------------------------------------------
    def _loss_hparams(self) -> dict[str, Any]:
        c, pl = self.config, self.config.policy_loss
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
        }

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
        return DataProto(batch=data.batch.select(*keys), meta_info=dict(data.meta_info))

    def forward_backward(self, mini_batch: DataProto, *, temperature: float = 1.0) -> dict[str, float]:
        """Accumulate the gradient of one mini-batch (no optimizer step).

        The loss of every micro-batch is normalised by the mini-batch's global token/sequence
        counts, so the accumulated gradient (after FSDP's average over ranks) equals the gradient
        of the whole, un-split mini-batch. The returned metrics are the values of the whole
        mini-batch (the same on every rank): pg_loss / kl_loss as optimised, pg_clipfrac, ppo_kl,
        entropy, ... as token means.
        """
        bs = self.batch_sizes
        c = self.config
        batch = mini_batch.batch.to(self.device)
        mask = response_mask_of(batch)
        loss_scale = global_loss_scale(
            mask,
            dp_size=self.dp_size,
            dp_group=self.dp_group,
            max_response_length=mini_batch.meta_info.get("max_response_length", mask.shape[-1]),
        )
        micros, _ = split_micro_batches(
            batch,
            micro_batch_size=bs.micro_batch_size if bs else len(mini_batch),
            use_dynamic_bsz=bs.use_dynamic_bsz if bs else False,
            max_token_len=bs.max_token_len if bs else None,
            dp_group=self.dp_group,
            key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        )
        hparams = self._loss_hparams()
        has_old = "old_log_probs" in batch.keys()
        # Without old log-probs (exactly on-policy) the entropy metric the old-log-prob pass would
        # have reported comes from this forward instead (not in the loss unless entropy_coeff != 0).
        calc_entropy = c.entropy_coeff != 0 or not has_old
        means = TokenWeightedMeans(loss_scale)
        sums = {"actor/pg_loss": 0.0}
        for micro in micros:
            m_mask = response_mask_of(micro)
            log_prob, entropy = self._forward(micro, temperature, calc_entropy, c.entropy_coeff != 0)
            pg_loss, pg_metrics = self.policy_loss_fn(
                micro["old_log_probs"] if has_old else log_prob.detach(),
                log_prob,
                micro["advantages"],
                m_mask,
                loss_agg_mode=c.loss_agg_mode,
                loss_scale=loss_scale,
                rollout_is_weights=micro.get("rollout_is_weights", None),
                behave_log_prob=micro.get("rollout_log_probs", None),
                **hparams,
            )
            loss = pg_loss
            sums["actor/pg_loss"] += float(pg_loss.detach())
            if c.entropy_coeff != 0:
                ent_loss = agg_loss(entropy, m_mask, c.loss_agg_mode, loss_scale=loss_scale)
                loss = loss - c.entropy_coeff * ent_loss
            if calc_entropy:
                pg_metrics["entropy"] = (entropy.detach() * m_mask).sum() / m_mask.sum().clamp(min=1)
            if c.use_kl_loss:
                kld = kl_penalty(log_prob, micro["ref_log_prob"], c.kl_loss_type)
                kl_loss = agg_loss(kld, m_mask, c.loss_agg_mode, loss_scale=loss_scale)
                loss = loss + c.kl_loss_coef * kl_loss
                sums["actor/kl_loss"] = sums.get("actor/kl_loss", 0.0) + float(kl_loss.detach())
            loss.backward()
            means.add({f"actor/{k}": v for k, v in pg_metrics.items()}, m_mask.sum())
        if c.use_kl_loss:
            sums["actor/kl_coef"] = c.kl_loss_coef
        return mean_over_ranks({**sums, **means.result()}, self.dp_group, self.dp_size, self.device)

    def update_policy(self, data: DataProto, *, temperature: float = 1.0) -> dict[str, list[float]]:
        """PPO epochs over mini-batches of `data`; one optimizer step per mini-batch.

        The lr scheduler steps once per call (one trainer step), as in veRL.

        Returns:
            metric name -> list (one entry per mini-batch, or per call for lr / perf).
        """
        if self.optimizer is None:
            raise RuntimeError(
                "update_policy needs an optimizer; this actor was built forward-only (reference)"
            )
        if self.batch_sizes is None:
            raise ValueError(
                "update_policy needs batch_sizes=normalize_actor_batch_sizes(...) at construction"
            )
        bs = self.batch_sizes
        data = self._select_train_keys(data)
        seed = shuffle_seed(bs.seed, bs.shuffle, data.meta_info)
        iterator = data.make_iterator(
            mini_batch_size=bs.mini_batch_size,
            epochs=bs.epochs,
            seed=seed,
            dataloader_kwargs={"shuffle": bs.shuffle},
        )
        self.module.train()
        metrics: dict[str, list] = {}
        start = time.perf_counter()
        for mini in iterator:
            append_metrics(metrics, self.forward_backward(mini, temperature=temperature))
            grad_norm, stepped = optimizer_step(self.module, self.optimizer, self.config.max_grad_norm)
            append_metrics(metrics, {"actor/grad_norm": grad_norm, "actor/step_skipped": float(not stepped)})
        elapsed = time.perf_counter() - start
        if self.lr_scheduler is not None:
            append_metrics(metrics, {"actor/lr": self.lr_scheduler.get_last_lr()[0]})
            self.lr_scheduler.step()
        else:
            append_metrics(metrics, {"actor/lr": self.optimizer.param_groups[0]["lr"]})
        seqlens = data.batch["attention_mask"].sum(-1).tolist() * bs.epochs
        append_metrics(metrics, self._perf_metrics(seqlens, elapsed))
        return metrics

    def _perf_metrics(self, seqlens: list[int], seconds: float) -> dict[str, float]:
        out = {"perf/actor/tokens": float(sum(seqlens)), "perf/actor/update_s": seconds}
        if self._flops_dims is None:
            layers, attn_dim = attention_dims(self.module.config)
            self._flops_dims = (count_params(self.module), layers, attn_dim)
        flops = estimate_flops(self._flops_dims[0], seqlens, self._flops_dims[1], self._flops_dims[2])
        mfu = compute_mfu(flops, seconds, self.peak_flops)
        if mfu is not None:
            out["perf/mfu/actor"] = mfu
        return out
