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

from typing import Any

import torch

from hybridrl.algos.utils import masked_mean
from hybridrl.algos.value import compute_value_loss
from hybridrl.protocol import DataProto
from hybridrl.utils.flops import attention_dims, compute_mfu, estimate_flops
from hybridrl.workers.actor import PPOActor
from hybridrl.workers.critic import PPOCritic
from hybridrl.workers.engine.batching import (
    TokenWeightedMeans,
    mean_over_ranks,
    merge_outputs,
    response_mask_of,
    split_micro_batches,
)
from hybridrl.workers.engine.megatron.convert import ArchSpec
from hybridrl.workers.engine.megatron.dispatch import broadcast_from_last_stage
from hybridrl.workers.engine.megatron.vocab_parallel import vocab_parallel_logprobs_entropy
from hybridrl.workers.engine.update_loop import run_update

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


class _Perf:
    """update_loop.UpdatePerf's metrics for a Megatron model (sizes from the HF config)."""

    def __init__(self, role: str, engine, peak_flops) -> None:
        self.role, self.engine, self.peak_flops = role, engine, peak_flops

    def metrics(self, seqlens: list[int], seconds: float) -> dict[str, float]:
        layers, attn_dim = attention_dims(self.engine.hf_config)
        flops = estimate_flops(num_dense_params(self.engine.spec), seqlens, layers, attn_dim)
        out = {f"perf/{self.role}/tokens": float(sum(seqlens)), f"perf/{self.role}/update_s": seconds}
        mfu = compute_mfu(flops, seconds, self.peak_flops)
        if mfu is not None:
            out[f"perf/mfu/{self.role}"] = mfu
        return out


def _run_update(role_obj, data: DataProto, forward_backward) -> dict[str, list[float]]:
    """update_loop.run_update with MegatronEngine.step as the optimizer step."""
    engine = role_obj.engine
    return run_update(
        data,
        role=role_obj.perf.role,
        module=engine.chunks[0],
        batch_sizes=role_obj.batch_sizes,
        forward_backward=forward_backward,
        step=engine.step,
        lr_scheduler=engine.lr_scheduler,
        optimizer=engine.optimizer,
        perf=role_obj.perf,
    )


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
        self.perf = _Perf("actor", engine, peak_flops)
        self._pending_logits = None

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

    def _forward(self, micro: Any, temperature: float, calculate_entropy: bool, entropy_grad: bool = True):
        """PPOActor's hook, fed by the schedule: log-probs / entropy of the logits just computed."""
        return self._log_probs(micro, self._pending_logits, temperature)

    def forward_backward(self, mini_batch: DataProto, *, temperature: float = 1.0) -> dict[str, float]:
        """See PPOActor.forward_backward: the same micro-batch loss (`_micro_batch_loss`), run by
        Megatron's schedule (1F1B when pipelined); metrics from the last stage."""
        _, loss_scale, micros = self.prepare(mini_batch, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
        has_old = "old_log_probs" in mini_batch.batch.keys()
        sums: dict[str, float] = {}
        means = TokenWeightedMeans(loss_scale)

        def loss_fn(micro, logits):
            self._pending_logits = logits
            mask = response_mask_of(micro)
            loss, micro_sums, micro_means = self._micro_batch_loss(
                micro, mask, loss_scale, temperature, has_old
            )
            self._pending_logits = None
            for k, v in micro_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            means.add(micro_means, mask.sum())
            return loss, None

        self.engine.run(micros, loss_fn, forward_only=False)
        if self.config.use_kl_loss:
            sums["actor/kl_coef"] = self.config.kl_loss_coef
        return _mean_metrics(sums, means, self.dp_group, self.dp_size)

    def run_update(self, data: DataProto, forward_backward) -> dict[str, list[float]]:
        return _run_update(self, data, forward_backward)


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
        self.perf = _Perf("critic", engine, peak_flops)

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
        """See PPOCritic.forward_backward (run by Megatron's schedule)."""
        _, loss_scale, micros = self.prepare(mini_batch, "critic.ppo_max_token_len_per_gpu")
        stats = ({"critic/vf_loss": 0.0}, TokenWeightedMeans(loss_scale))
        self.engine.run(
            micros, lambda m, out: self._micro_loss(m, out, loss_scale, stats), forward_only=False
        )
        return _mean_metrics(stats[0], stats[1], self.dp_group, self.dp_size)

    def run_update(self, data: DataProto, forward_backward) -> dict[str, list[float]]:
        return _run_update(self, data, forward_backward)
