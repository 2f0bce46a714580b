"""Prompt groups: the G responses sampled for one prompt share a uid.

Group-relative estimators (GRPO, RLOO, OPO, ...) compare a response with the other responses
to the same prompt. `Groups` turns the uid array into integer group ids once, and gives
per-group sums/means as single scatter-adds, so those estimators need no Python loop.

Shapes: B batch (all responses, any order), n number of distinct uids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Groups:
    """Membership of B responses in n prompt groups.

    Attributes:
        ids: (B,) long, group id in [0, n) of each response.
        sizes: (n,) float, number of responses in each group.
    """

    ids: torch.Tensor
    sizes: torch.Tensor

    @classmethod
    def from_index(cls, index: np.ndarray, device: torch.device | str = "cpu") -> Groups:
        """Group responses by uid.

        Args:
            index: (B,) uids (str, int or any hashable numpy can sort); equal uid = same prompt.
            device: where the id tensors live (that of the scores).
        """
        index = np.asarray(index)
        if index.ndim != 1:
            raise ValueError(f"index must be a 1-d array of uids, got shape {index.shape}")
        _, inverse, counts = np.unique(index, return_inverse=True, return_counts=True)
        ids = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
        sizes = torch.as_tensor(counts, dtype=torch.float32, device=device)
        return cls(ids=ids, sizes=sizes)

    @property
    def num_groups(self) -> int:
        return self.sizes.shape[0]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group sum of x (B,) -> (n,)."""
        return x.new_zeros(self.num_groups).index_add(0, self.ids, x)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group maximum of x (B,) -> (n,)."""
        init = x.new_full((self.num_groups,), -torch.inf)
        return init.scatter_reduce(0, self.ids, x, reduce="amax")

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group mean of x (B,) -> (n,)."""
        return self.sum(x) / self.sizes.to(x.dtype)

    def size_of_each(self) -> torch.Tensor:
        """(B,) size of the group each response belongs to."""
        return self.sizes[self.ids]
