"""`CriticWorker(config)`: the value model for GAE, on the engine of `critic.strategy`."""

from __future__ import annotations

import os

from hybridrl.config.batch import PerRankBatchSizes
from hybridrl.config.roles import CriticConfig
from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Worker, register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.workers.parallel_dims import ParallelDims
from hybridrl.workers.profiling import StepProfiling
from hybridrl.workers.worker_setup import ON_CRITIC_MESH, build_engine, setup_process

__all__ = ["CriticWorker"]


class CriticWorker(StepProfiling, Worker):
    """Value model for GAE, on the engine of `critic.strategy` (dims: the driver's ParallelDims)."""

    def __init__(
        self,
        config: CriticConfig,
        batch_sizes: PerRankBatchSizes | None = None,
        num_threads: int | None = None,
        pg_timeout_s: float | None = None,
        peak_flops: float | None = None,
        dims: ParallelDims | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dims = dims
        self.batch_sizes = batch_sizes
        self.num_threads = num_threads
        self.pg_timeout_s = pg_timeout_s
        self.peak_flops = peak_flops
        self.engine = self.critic = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the value model on the engine of `critic.strategy`."""
        from hybridrl.workers.critic import PPOCritic

        setup_process(self.num_threads, self.pg_timeout_s)
        c = self.config
        dims = self.dims or ParallelDims.for_role(self.world_size, c, "critic")
        self.set_mesh("critic", dims.train_mesh())
        self.engine = build_engine("critic", c.model, c, c.optim, "critic", "critic.model", self, "critic")
        self.critic = PPOCritic(c, self.engine, batch_sizes=self.batch_sizes, peak_flops=self.peak_flops)

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
