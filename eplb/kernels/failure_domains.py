"""Kernels about failure domains (GPUs or nodes): which domain alone holds an expert.

A *failure domain* is what one failure takes out: a GPU, or a node with all its GPUs. An expert
whose every replica sits in one domain is lost with it.
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def domain_range(phy2log, domain_of_slot, num_experts):
    """``(lowest [L, E], highest [L, E])`` int64: the lowest and highest domain holding a replica of
    each expert (``lowest == highest``: one domain holds them all; an expert without replicas gets
    ``lowest = 2**63 - 1``, ``highest = -1``).

    Args:
        phy2log: ``[L, S]`` int64 expert of each slot.
        domain_of_slot: ``[S]`` int64 domain of each slot.
        num_experts: ``E``.
    """
    num_layers, num_slots = phy2log.shape
    lowest = np.empty((num_layers, num_experts), np.int64)
    highest = np.empty((num_layers, num_experts), np.int64)
    lowest[:, :] = np.iinfo(np.int64).max
    highest[:, :] = -1
    for layer in range(num_layers):
        for s in range(num_slots):
            e = phy2log[layer, s]
            d = domain_of_slot[s]
            if d < lowest[layer, e]:
                lowest[layer, e] = d
            if d > highest[layer, e]:
                highest[layer, e] = d
    return lowest, highest


@njit(cache=True, nogil=True, error_model="numpy")
def orphaned_per_domain(weights, phy2log, domain_of_slot, num_domains):
    """``[L, D]`` float64: per layer, the summed ``weights`` of the experts whose every replica sits
    in domain ``d`` (what losing ``d`` orphans).

    Args:
        weights: ``[L, E]`` float64; phy2log: ``[L, S]`` int64.
        domain_of_slot: ``[S]`` int64 in ``[0, D)``; num_domains: ``D``.
    """
    num_layers, num_experts = weights.shape
    out = np.zeros((num_layers, num_domains))
    lowest = np.empty(num_experts, np.int64)
    highest = np.empty(num_experts, np.int64)
    for layer in range(num_layers):
        lowest[:] = num_domains
        highest[:] = -1
        for s in range(phy2log.shape[1]):
            e = phy2log[layer, s]
            d = domain_of_slot[s]
            lowest[e] = min(lowest[e], d)
            highest[e] = max(highest[e], d)
        for e in range(num_experts):
            if lowest[e] == highest[e]:
                out[layer, lowest[e]] += weights[layer, e]
    return out
