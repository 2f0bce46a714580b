"""PPO actor and critic over a MegatronEngine, with the FSDP actor's / critic's exact semantics.

`MegatronPPOActor` / `MegatronPPOCritic` subclass `PPOActor` / `PPOCritic` and keep their
public methods (compute_log_prob, update_policy / compute_values, update_critic) and their math:
the same micro-batching, the same global loss normalisation (`global_loss_scale` over the
data-parallel ranks), the same policy / value losses and metrics. What differs is how a
micro-batch is run: through Megatron's pipeline schedule (`MegatronEngine.run`), with log-probs
and entropy computed from vocabulary-parallel logits (`vocab_parallel_logprobs_entropy`), and
one optimizer step by `MegatronEngine.step`. Methods are collectives over all ranks; every rank
of one model replica (TP x PP) passes the same rows (see dispatch.py), and results computed on
the last pipeline stage are broadcast to the others.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridrl.algos.agg import agg_loss
from hybridrl.algos.kl import kl_penalty
from hybridrl.algos.utils import masked_mean
from hybridrl.algos.value import compute_value_loss
from hybridrl.protocol import DataProto
from hybridrl.utils.flops import attention_dims, compute_mfu, estimate_flops
from hybridrl.workers.actor import PPOActor
from hybridrl.workers.critic import PPOCritic
from hybridrl.workers.engine.batching import (
    TokenWeightedMeans,
    append_metrics,
    global_loss_scale,
    mean_over_ranks,
    merge_outputs,
    response_mask_of,
    shuffle_seed,
    split_micro_batches,
)
from hybridrl.workers.engine.megatron.convert import ArchSpec
from hybridrl.workers.engine.megatron.dispatch import broadcast_from_last_stage
from hybridrl.workers.engine.megatron.vocab_parallel import vocab_parallel_logprobs_entropy

__all__ = ["MegatronPPOActor", "MegatronPPOCritic", "num_dense_params"]

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def num_dense_params(spec: ArchSpec) -> int:
    """Non-embedding parameters of the model (the N of the 6N FLOP rule)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    bias = (spec.num_heads + 2 * spec.num_kv_heads) * d if spec.qkv_bias else 0
    return spec.num_layers * (attn + bias + 3 * h * spec.ffn_hidden_size + 2 * h) + h


def _mean_metrics(
    sums: dict[str, float], means: TokenWeightedMeans, dp_group, dp_size: int
) -> dict[str, float]:
    """The mini-batch metrics of the last stage, on every stage, averaged over DP ranks."""
    local = broadcast_from_last_stage({**sums, **means.result()})
    return mean_over_ranks(local, dp_group, dp_size, None)


def _perf(prefix: str, engine, seqlens: list[int], seconds: float, peak_flops) -> dict[str, float]:
    layers, attn_dim = attention_dims(engine.hf_config)
    flops = estimate_flops(num_dense_params(engine.spec), seqlens, layers, attn_dim)
    out = {f"perf/{prefix}/tokens": float(sum(seqlens)), f"perf/{prefix}/update_s": seconds}
    mfu = compute_mfu(flops, seconds, peak_flops)
    if mfu is not None:
        out[f"perf/mfu/{prefix}"] = mfu
    return out


class MegatronPPOActor(PPOActor):
    """PPOActor over a MegatronEngine (actor with optimizer, or forward-only reference)."""

    def __init__(self, config, engine, *, batch_sizes=None, peak_flops=None) -> None:
        super().__init__(
            config,
            engine.chunks[0],
            engine.optimizer,
            engine.lr_scheduler,
            dp_size=engine.dp_size,
            batch_sizes=batch_sizes,
            dp_group=engine.dp_group,
            peak_flops=peak_flops,
        )
        self.engine = engine

    def _log_probs(self, micro: Any, logits: torch.Tensor, temperature: float):
        t = micro["responses"].shape[-1]
        tp_rank, group = self.engine.tp_info()
        sliced = logits[:, -t - 1 : -1].float() / temperature
        return vocab_parallel_logprobs_entropy(
            sliced, micro["responses"], vocab_size=self.engine.spec.vocab_size, tp_rank=tp_rank, group=group
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
        """See PPOActor.compute_log_prob; the same result on every rank of the replica."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to compute log-probs, got {temperature}")
        batch = data.batch.select(*_FORWARD_KEYS).to(self.device)
        micros, indices = split_micro_batches(
            batch,
            micro_batch_size=micro_batch_size or len(data),
            use_dynamic_bsz=use_dynamic_bsz,
            max_token_len=max_token_len,
            dp_group=self.dp_group,
            key="log_prob_max_token_len_per_gpu",
        )

        def loss_fn(micro, logits):
            lp, ent = self._log_probs(micro, logits, temperature)
            return torch.zeros((), device=lp.device), (lp, ent)

        results = self.engine.run(micros, loss_fn, forward_only=True)
        out = None
        if results:
            lp = merge_outputs([r[0] for r in results], indices).cpu()
            ent = merge_outputs([r[1] for r in results], indices).cpu() if calculate_entropy else None
            out = (lp, ent)
        return broadcast_from_last_stage(out)

    def _micro_loss(self, micro, logits, temperature, loss_scale, has_old, stats):
        c = self.config
        m_mask = response_mask_of(micro)
        log_prob, entropy = self._log_probs(micro, logits, temperature)
        pg_loss, pg_metrics = self.policy_loss_fn(
            micro["old_log_probs"] if has_old else log_prob.detach(),
            log_prob,
            micro["advantages"],
            m_mask,
            loss_agg_mode=c.loss_agg_mode,
            loss_scale=loss_scale,
            rollout_is_weights=micro.get("rollout_is_weights", None),
            behave_log_prob=micro.get("rollout_log_probs", None),
            **self._loss_hparams(),
        )
        loss = pg_loss
        sums, means = stats
        sums["actor/pg_loss"] += float(pg_loss.detach())
        if c.entropy_coeff != 0:
            loss = loss - c.entropy_coeff * agg_loss(entropy, m_mask, c.loss_agg_mode, loss_scale=loss_scale)
        if c.entropy_coeff != 0 or not has_old:
            pg_metrics["entropy"] = (entropy.detach() * m_mask).sum() / m_mask.sum().clamp(min=1)
        if c.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_prob"], c.kl_loss_type)
            kl_loss = agg_loss(kld, m_mask, c.loss_agg_mode, loss_scale=loss_scale)
            loss = loss + c.kl_loss_coef * kl_loss
            sums["actor/kl_loss"] = sums.get("actor/kl_loss", 0.0) + float(kl_loss.detach())
        means.add({f"actor/{k}": v for k, v in pg_metrics.items()}, m_mask.sum())
        return loss, None

    def forward_backward(self, mini_batch: DataProto, *, temperature: float = 1.0) -> dict[str, float]:
        """See PPOActor.forward_backward (1F1B over the micro-batches when pipelined)."""
        bs, c = self.batch_sizes, self.config
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
        has_old = "old_log_probs" in batch.keys()
        stats = ({"actor/pg_loss": 0.0}, TokenWeightedMeans(loss_scale))
        self.engine.run(
            micros,
            lambda micro, logits: self._micro_loss(micro, logits, temperature, loss_scale, has_old, stats),
            forward_only=False,
        )
        sums, means = stats
        if c.use_kl_loss:
            sums["actor/kl_coef"] = c.kl_loss_coef
        return _mean_metrics(sums, means, self.dp_group, self.dp_size)

    def update_policy(self, data: DataProto, *, temperature: float = 1.0) -> dict[str, list[float]]:
        """See PPOActor.update_policy; one MegatronEngine.step per mini-batch."""
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
        metrics: dict[str, list] = {}
        start = time.perf_counter()
        for mini in iterator:
            append_metrics(metrics, self.forward_backward(mini, temperature=temperature))
            grad_norm, stepped = self.engine.step()
            append_metrics(metrics, {"actor/grad_norm": grad_norm, "actor/step_skipped": float(not stepped)})
        elapsed = time.perf_counter() - start
        append_metrics(metrics, {"actor/lr": self.lr_scheduler.get_last_lr()[0]})
        self.lr_scheduler.step()
        seqlens = data.batch["attention_mask"].sum(-1).tolist() * bs.epochs
        append_metrics(metrics, _perf("actor", self.engine, seqlens, elapsed, self.peak_flops))
        return metrics


class MegatronPPOCritic(PPOCritic):
    """PPOCritic over a MegatronEngine built with role='critic' (GPT backbone + ValueHead)."""

    def __init__(self, config, engine, *, batch_sizes=None, peak_flops=None) -> None:
        super().__init__(
            config,
            engine.chunks[0],
            engine.optimizer,
            engine.lr_scheduler,
            dp_size=engine.dp_size,
            batch_sizes=batch_sizes,
            dp_group=engine.dp_group,
            peak_flops=peak_flops,
        )
        self.engine = engine

    @staticmethod
    def _values(micro: Any, out: torch.Tensor) -> torch.Tensor:
        t = micro["responses"].shape[-1]
        return out[:, -t - 1 : -1, 0].float()

    def compute_values(
        self, data: DataProto, *, micro_batch_size=None, use_dynamic_bsz=None, max_token_len=None
    ) -> torch.Tensor:
        """See PPOCritic.compute_values; the same result on every rank of the replica."""
        bs = self.batch_sizes
        if use_dynamic_bsz is None:
            use_dynamic_bsz = bs.use_dynamic_bsz if bs else False
        micro_batch_size = micro_batch_size or (bs.forward_micro_batch_size if bs else None) or len(data)
        max_token_len = max_token_len or (bs.forward_max_token_len if bs else None)
        keys = [*_FORWARD_KEYS] + (["response_mask"] if "response_mask" in data.batch.keys() else [])
        batch = data.batch.select(*keys).to(self.device)
        micros, indices = split_micro_batches(
            batch,
            micro_batch_size=micro_batch_size,
            use_dynamic_bsz=use_dynamic_bsz,
            max_token_len=max_token_len,
            dp_group=self.dp_group,
            key="critic.forward_max_token_len_per_gpu",
        )
        results = self.engine.run(
            micros, lambda m, out: (torch.zeros(()), self._values(m, out)), forward_only=True
        )
        values = None
        if results:
            values = (merge_outputs(results, indices) * response_mask_of(batch)).cpu()
        return broadcast_from_last_stage(values)

    def _micro_loss(self, micro, out, loss_scale, stats):
        m_mask = response_mask_of(micro)
        vpreds = self._values(micro, out)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro["returns"],
            micro["values"],
            m_mask,
            cliprange_value=self.config.cliprange_value,
            loss_agg_mode=self.config.loss_agg_mode,
            loss_scale=loss_scale,
        )
        sums, means = stats
        sums["critic/vf_loss"] += float(vf_loss.detach())
        vpred_mean = masked_mean(vpreds.detach(), m_mask)
        means.add({"critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": vpred_mean}, m_mask.sum())
        return vf_loss, None

    def forward_backward(self, mini_batch: DataProto) -> dict[str, float]:
        """See PPOCritic.forward_backward."""
        bs = self.batch_sizes
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
            key="critic.ppo_max_token_len_per_gpu",
        )
        stats = ({"critic/vf_loss": 0.0}, TokenWeightedMeans(loss_scale))
        self.engine.run(
            micros, lambda m, out: self._micro_loss(m, out, loss_scale, stats), forward_only=False
        )
        return _mean_metrics(stats[0], stats[1], self.dp_group, self.dp_size)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """See PPOCritic.update_critic; one MegatronEngine.step per mini-batch."""
        if self.batch_sizes is None:
            raise ValueError(
                "update_critic needs batch_sizes=normalize_critic_batch_sizes(...) at construction"
            )
        bs = self.batch_sizes
        keys = [*_FORWARD_KEYS, "values", "returns"]
        missing = [k for k in keys if k not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_critic: the batch lacks {missing}; it has {sorted(data.batch.keys())}")
        if "response_mask" in data.batch.keys():
            keys.append("response_mask")
        data = DataProto(batch=data.batch.select(*keys), meta_info=dict(data.meta_info))
        seed = shuffle_seed(bs.seed, bs.shuffle, data.meta_info)
        iterator = data.make_iterator(
            mini_batch_size=bs.mini_batch_size,
            epochs=bs.epochs,
            seed=seed,
            dataloader_kwargs={"shuffle": bs.shuffle},
        )
        metrics: dict[str, list] = {}
        start = time.perf_counter()
        for mini in iterator:
            append_metrics(metrics, self.forward_backward(mini))
            grad_norm, stepped = self.engine.step()
            append_metrics(
                metrics, {"critic/grad_norm": grad_norm, "critic/step_skipped": float(not stepped)}
            )
        elapsed = time.perf_counter() - start
        append_metrics(metrics, {"critic/lr": self.lr_scheduler.get_last_lr()[0]})
        self.lr_scheduler.step()
        seqlens = data.batch["attention_mask"].sum(-1).tolist() * bs.epochs
        append_metrics(metrics, _perf("critic", self.engine, seqlens, elapsed, self.peak_flops))
        return metrics
