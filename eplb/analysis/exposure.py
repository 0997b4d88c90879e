"""Exposure to a lost GPU or node: the tokens whose expert would lose every replica.

When a GPU (or a whole node) fails, an expert with a replica elsewhere keeps serving; an expert
whose every replica was on it is *orphaned* until its weights come back (from host memory, a
re-plan: :mod:`eplb.planning.replan`). The tokens routed to orphaned experts are what one loss
exposes. A GPU loss takes that GPU out of every layer at once, so a domain's exposure sums its
orphaned tokens over the layers.

Shapes: ``L`` layers, ``E`` logical experts, ``S`` slots, ``G`` GPUs, ``N`` nodes, ``D`` failure
domains (GPUs or nodes). One pass of a small kernel over ``phy2log``
(:func:`eplb.kernels.change.failure_domains.orphaned_per_domain`): a fraction of a
millisecond at DeepSeek-V3 size, so every plan reports it (``bench/survive.py`` measures it).
"""

from __future__ import annotations

import numpy as np

from ..kernels.change.failure_domains import domain_range, orphaned_per_domain, orphaned_per_gpu_and_node
from ..model.topology import Topology

__all__ = ["loss_shares", "orphaned_tokens", "sole_domain", "worst_loss"]


def sole_domain(phy2log: np.ndarray, domain_of_slot: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E]`` int64: the one domain holding every replica of each expert, ``-1`` when its
    replicas span two or more domains (or it has none).

    Args:
        phy2log: ``[L, S]`` int64 expert of each slot.
        domain_of_slot: ``[S]`` int64 domain of each slot (its GPU, or its GPU's node), ``>= 0``.
        num_experts: ``E``.
    """
    lowest, highest = domain_range(np.ascontiguousarray(phy2log, dtype=np.int64),
                                   np.ascontiguousarray(domain_of_slot, dtype=np.int64), int(num_experts))
    return np.where(lowest == highest, lowest, -1)


def orphaned_tokens(weights: np.ndarray, phy2log: np.ndarray, domain_of_slot: np.ndarray, num_domains: int
                    ) -> np.ndarray:
    """``[L, D]`` float64: per layer, the tokens of ``weights [L, E]`` whose expert has every
    replica in domain ``d`` (what losing ``d`` orphans in that layer). ``phy2log [L, S]``,
    ``domain_of_slot [S]`` int64 in ``[0, D)``."""
    return orphaned_per_domain(np.ascontiguousarray(weights, dtype=np.float64),
                               np.ascontiguousarray(phy2log, dtype=np.int64),
                               np.ascontiguousarray(domain_of_slot, dtype=np.int64), int(num_domains))


def loss_shares(weights: np.ndarray, phy2log: np.ndarray, domain_of_slot: np.ndarray, num_domains: int
                ) -> np.ndarray:
    """``[D]`` float64: the share of all tokens of ``weights [L, E]`` (every layer) that losing
    each domain orphans; zeros when there are no tokens. Counts are divided by their largest first,
    so huge counts cannot overflow the sums."""
    weights = np.asarray(weights, dtype=np.float64)
    top = float(weights.max(initial=0.0))
    if top <= 0.0:
        return np.zeros(num_domains)
    scaled = weights / top
    per_domain = orphaned_tokens(scaled, phy2log, domain_of_slot, num_domains).sum(axis=0)
    return np.minimum(per_domain / scaled.sum(), 1.0)  # rounding never reports more than everything


def worst_loss(weights: np.ndarray, phy2log: np.ndarray, topology: Topology) -> dict:
    """The exposure every plan reports: ``{"worst_gpu_loss": float, "worst_node_loss": float}``,
    the largest share of the tokens of ``weights [L, E]`` (all layers) that losing one GPU / one
    node orphans under ``phy2log [L, S]`` (0.0: no single loss orphans anything; 1.0 with one GPU
    or one node: everything; 0.0 for both without tokens). One kernel pass for both
    (:func:`eplb.kernels.change.failure_domains.orphaned_per_gpu_and_node`)."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    total = float(weights.sum())
    if not np.isfinite(total):  # huge counts: their shares, from counts divided by the largest
        weights = weights / weights.max()
        total = float(weights.sum())
    if total <= 0.0:
        return {"worst_gpu_loss": 0.0, "worst_node_loss": 0.0}
    gpu, node = orphaned_per_gpu_and_node(weights, np.ascontiguousarray(phy2log, dtype=np.int64),
                                          topology.gpu_of_slot, topology.node_of_gpu, topology.num_nodes)
    return {"worst_gpu_loss": min(float(gpu.max()) / total, 1.0), "worst_node_loss": min(float(node.max()) / total, 1.0)}
