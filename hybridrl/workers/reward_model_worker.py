"""`RewardModelWorker(config)`: a learned reward model (sequence classification) scoring PPO samples."""

from __future__ import annotations

import os

from hybridrl.config.roles import ModelConfig, RewardModelConfig
from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Worker, register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.workers.worker_setup import setup_process

__all__ = ["RewardModelWorker"]


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
        from hybridrl.engine.fsdp import FSDPEngine
        from hybridrl.models.hf import load_tokenizer
        from hybridrl.reward.rm import model_config_of

        setup_process(self.num_threads, self.pg_timeout_s)
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
        from hybridrl.reward.rm import compute_rm_scores

        self.engine.onload()
        scores = compute_rm_scores(self.engine, self.config, data, self.policy_tokenizer)
        self.engine.offload()
        return DataProto.from_dict({"rm_scores": scores})
