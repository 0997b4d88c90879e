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


@njit(cache=True, nogil=True, error_model="numpy")
def orphaned_per_gpu_and_node(weights, phy2log, gpu_of_slot, node_of_gpu, num_nodes):
    """``(gpu [G], node [N])`` float64: the summed ``weights [L, E]`` over all layers of the experts
    whose every replica sits on GPU ``g`` / node ``n`` under ``phy2log [L, S]``, in one pass.
    ``gpu_of_slot [S]``, ``node_of_gpu [G]`` int64 (nodes are contiguous blocks of GPUs, so an
    expert's lowest and highest GPU on one node puts all its GPUs there)."""
    num_layers, num_experts = weights.shape
    gpu = np.zeros(node_of_gpu.shape[0])
    node = np.zeros(num_nodes)
    lowest = np.empty(num_experts, np.int64)
    highest = np.empty(num_experts, np.int64)
    for layer in range(num_layers):
        lowest[:] = node_of_gpu.shape[0]
        highest[:] = -1
        for s in range(phy2log.shape[1]):
            e = phy2log[layer, s]
            lowest[e] = min(lowest[e], gpu_of_slot[s])
            highest[e] = max(highest[e], gpu_of_slot[s])
        for e in range(num_experts):
            if highest[e] < 0:
                continue
            if lowest[e] == highest[e]:
                gpu[lowest[e]] += weights[layer, e]
            if node_of_gpu[lowest[e]] == node_of_gpu[highest[e]]:
                node[node_of_gpu[lowest[e]]] += weights[layer, e]
    return gpu, node
