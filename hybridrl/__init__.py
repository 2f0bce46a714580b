"""hybridrl: reinforcement learning on language models.

A Ray driver (the single controller) holds the PPO loop and dispatches to worker groups that
switch between FSDP2 training and generation on the same devices (the hybrid engine).
"""

from hybridrl.protocol import DataProto, DataProtoFuture

__version__ = "0.1.0"
__all__ = ["DataProto", "DataProtoFuture", "__version__"]
