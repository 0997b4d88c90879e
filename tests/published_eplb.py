"""The published greedy EPLB as a user has it in a file: ``rebalance_experts(weight, num_replicas,
num_groups, num_nodes, num_gpus)`` taking and returning torch tensors (int64 CPU), as the published
code does. The arithmetic is the project's NumPy port (``bench/published_greedy.py``); this file
only gives it the published torch interface, for ``eplb compare`` to load by its path."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import published_greedy  # noqa: E402


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """``weight [L, E]`` torch -> ``phy2log [L, S]``, ``log2phy [L, E, R]``, ``logcnt [L, E]`` torch int64."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    arrays = published_greedy.rebalance_experts(weight.float().cpu().numpy(), num_replicas, num_groups, num_nodes,
                                                num_gpus)
    return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays)
