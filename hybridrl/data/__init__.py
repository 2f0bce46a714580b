"""Datasets, samplers and preprocessing: RL prompts (RLHFDataset), SFT data, resumable loading."""

from hybridrl.data.rl_dataset import (
    DataColumnError,
    RLDataConfig,
    RLHFDataset,
    collate_fn,
    create_rl_dataset,
)
from hybridrl.data.sampler import ResumableSampler, RLDataLoader
from hybridrl.data.sft_dataset import MultiTurnSFTDataset, SFTDataConfig, SFTDataset

__all__ = [
    "DataColumnError",
    "MultiTurnSFTDataset",
    "RLDataConfig",
    "RLDataLoader",
    "RLHFDataset",
    "ResumableSampler",
    "SFTDataConfig",
    "SFTDataset",
    "collate_fn",
    "create_rl_dataset",
]
