"""Reward: managers that turn responses into token-level rewards, rule scorers, custom functions.

Importing this package registers the built-in reward managers (`naive`, `batch`, `dapo`, `prime`).
"""

from hybridrl.reward.custom import load_custom_reward_fn
from hybridrl.reward.manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    RewardManager,
    RewardSample,
    decode_samples,
    get_reward_manager_cls,
    load_reward_manager,
    register_reward_manager,
    reward_manager_names,
)
from hybridrl.reward.prime import PrimeRewardManager  # registers "prime"

__all__ = [
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardManager",
    "RewardSample",
    "decode_samples",
    "get_reward_manager_cls",
    "load_custom_reward_fn",
    "load_reward_manager",
    "register_reward_manager",
    "reward_manager_names",
]
