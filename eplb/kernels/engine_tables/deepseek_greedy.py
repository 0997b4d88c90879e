"""Kernels of the published greedy algorithm (DeepSeek EPLB): replicate, then pack largest-first.

Arithmetic is float32 on purpose: the published implementation works on ``weight.float()``, and
doing the same keeps every tie between equal per-replica loads broken the same way, so the
per-GPU loads agree exactly.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, heap_sift_down, heapify

TOP = np.int64(0)
"""The heap's root position, as a typed int64: a literal ``0`` argument makes Numba compile a
second specialization of the sift for the constant."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def replicate_greedy(weights, num_replicas, phy2expert, replica_counts):
    """Give one extra replica at a time to the expert with the largest load per replica (the first
    such expert on ties, as torch.max picks), via a heap: O(R log E) instead of O(R E).

    Args:
        weights: ``[E]`` float32 loads.
        num_replicas: ``R >= E`` replicas in total.
        phy2expert: ``[R]`` int64 output: replica ``i < E`` is expert ``i``, later ones in creation order.
        replica_counts: ``[E]`` int64 output: replicas per expert.
    """
    num_experts = weights.shape[0]
    minus_load = np.empty(num_experts, np.float32)  # min-heap keys: the largest load first
    heap = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        phy2expert[e] = e
        replica_counts[e] = 1
        minus_load[e] = -weights[e]
        heap[e] = e
    heapify(heap, num_experts, minus_load)
    for i in range(num_experts, num_replicas):
        best = heap[0]
        phy2expert[i] = best
        replica_counts[best] += 1
        minus_load[best] = -(weights[best] / np.float32(replica_counts[best]))
        heap_sift_down(heap, num_experts, minus_load, TOP)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def pack_largest_first(weights, num_packs, capacity, pack_of_item, rank_in_pack):
    """Balanced packing: items in decreasing weight, each into the lightest pack with room (the
    first such pack on ties), the packs with room kept in a heap.

    Args:
        weights: ``[n]`` float32 item weights, ``n == num_packs * capacity``.
        pack_of_item: ``[n]`` int64 output: the pack each item goes to.
        rank_in_pack: ``[n]`` int64 output: the item's position inside its pack.
    """
    n = weights.shape[0]
    if capacity == 1:  # the published code keeps items in place when each pack takes one
        for i in range(n):
            pack_of_item[i] = i
            rank_in_pack[i] = 0
        return
    # items by decreasing weight, the smaller id first on ties (a stable sort): popped from a heap
    # keyed by minus the weight, whose order breaks ties by id (a sort kernel costs seconds to compile)
    minus_weight = np.empty(n, np.float32)
    items = np.empty(n, np.int64)
    for i in range(n):
        minus_weight[i] = -weights[i]
        items[i] = i
    heapify(items, n, minus_weight)
    pack_load = np.zeros(num_packs, np.float32)
    pack_size = np.zeros(num_packs, np.int64)
    heap = np.empty(num_packs, np.int64)  # packs with room; all loads 0: already a heap
    for p in range(num_packs):
        heap[p] = p
    open_packs = num_packs
    for remaining in range(n, 0, -1):
        item = items[0]
        items[0] = items[remaining - 1]
        heap_sift_down(items, remaining - 1, minus_weight, TOP)
        best = heap[0]
        pack_of_item[item] = best
        rank_in_pack[item] = pack_size[best]
        pack_load[best] += weights[item]
        pack_size[best] += 1
        if pack_size[best] == capacity:  # full: leaves the heap
            open_packs -= 1
            heap[0] = heap[open_packs]
        heap_sift_down(heap, open_packs, pack_load, TOP)


@njit(cache=True, nogil=True, error_model="numpy")
def greedy_placement(weights, num_slots, num_groups, num_nodes, num_gpus):
    """The published hierarchical greedy placement for every layer.

    Groups of experts are packed onto nodes, experts are replicated within each node, and the
    node's replicas are packed onto its GPUs. ``num_groups = num_nodes = 1`` gives the global policy.

    Args:
        weights: ``[L, E]`` float32 loads; ``E % num_groups == 0``, ``num_groups % num_nodes == 0``.
        num_slots: ``S``, a multiple of ``num_gpus``; ``num_gpus`` a multiple of ``num_nodes``.
    Returns:
        ``phy2log [L, S]`` and ``logcnt [L, E]``, int64.
    """
    num_layers, num_experts = weights.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_slots // num_gpus

    phy2log = np.empty((num_layers, num_slots), np.int64)
    logcnt = np.empty((num_layers, num_experts), np.int64)
    group_weights = np.empty(num_groups, np.float32)
    node_of_group = np.empty(num_groups, np.int64)
    rank_of_group = np.empty(num_groups, np.int64)
    node_expert = np.empty(num_experts, np.int64)  # node-major order -> logical expert
    node_weights = np.empty(experts_per_node, np.float32)
    phy2node_expert = np.empty(slots_per_node, np.int64)
    node_counts = np.empty(experts_per_node, np.int64)
    replica_weights = np.empty(slots_per_node, np.float32)
    gpu_of_replica = np.empty(slots_per_node, np.int64)
    rank_on_gpu = np.empty(slots_per_node, np.int64)

    for layer in range(num_layers):
        w = weights[layer]
        for g in range(num_groups):
            total = np.float32(0.0)
            for j in range(group_size):
                total += w[g * group_size + j]
            group_weights[g] = total
        pack_largest_first(group_weights, num_nodes, groups_per_node, node_of_group, rank_of_group)
        for g in range(num_groups):
            first = (node_of_group[g] * groups_per_node + rank_of_group[g]) * group_size
            for j in range(group_size):
                node_expert[first + j] = g * group_size + j

        for node in range(num_nodes):
            base = node * experts_per_node
            for j in range(experts_per_node):
                node_weights[j] = w[node_expert[base + j]]
            replicate_greedy(node_weights, slots_per_node, phy2node_expert, node_counts)
            for i in range(slots_per_node):
                e = phy2node_expert[i]
                replica_weights[i] = node_weights[e] / np.float32(node_counts[e])
            pack_largest_first(replica_weights, gpus_per_node, slots_per_gpu, gpu_of_replica, rank_on_gpu)
            for i in range(slots_per_node):
                slot = node * slots_per_node + gpu_of_replica[i] * slots_per_gpu + rank_on_gpu[i]
                phy2log[layer, slot] = node_expert[base + phy2node_expert[i]]
            for j in range(experts_per_node):
                logcnt[layer, node_expert[base + j]] = node_counts[j]
    return phy2log, logcnt
