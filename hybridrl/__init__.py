"""hybridrl: reinforcement learning on language models.

A Ray driver (the single controller) holds the PPO loop and dispatches to worker groups that
switch between FSDP2 training and generation on the same devices (the hybrid engine).
"""

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. Spinning threads made two
# torch threads slower than one on a busy machine, sleeping ones faster (bench/threads.py measures it).
# It matters when the worker runs in this process (trainer.backend=local); a value you set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hybridrl.protocol import DataProto, DataProtoFuture  # noqa: E402

__version__ = "0.1.0"
__all__ = ["DataProto", "DataProtoFuture", "__version__"]
