"""A start for the migration search where it stalls: the placement in service with the replica
counts of a fresh plan (the ``"recount"`` restart of :mod:`eplb.planning.migration`).

Surplus replicas leave the most loaded GPUs first; the freed slots go to the experts short of
replicas, largest per-replica load first, each to the lightest GPU that may take it (no second
replica of an expert on one GPU; with ``hierarchical``, a GPU of the node holding the expert's
group). Ties: the lower slot, the lower expert.

Shapes: ``L`` layers, ``E`` experts, ``S`` slots, ``G`` GPUs, ``N`` nodes.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, stable_argsort


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _free_surplus(row, want, share, gpu_of_slot, loads, free):
    """Take the surplus replicas out of ``row [S]`` (``want [E]`` replicas each): expert by expert
    in increasing order, each one's slots on the most loaded GPUs first (ties: the lower slot;
    ``loads [G]`` as lowered by the experts before it), ``loads`` lowered by ``share [E]`` per slot
    freed. Writes the freed slots, in that order, into ``free [S]``; returns how many."""
    num_slots, num_experts = row.shape[0], want.shape[0]
    have = np.zeros(num_experts, np.int64)
    for s in range(num_slots):
        have[row[s]] += 1
    start = np.zeros(num_experts + 1, np.int64)  # the slots of each expert, increasing (counting sort)
    for e in range(num_experts):
        start[e + 1] = start[e] + have[e]
    by_expert = np.empty(num_slots, np.int64)
    filled = start[:-1].copy()
    for s in range(num_slots):
        by_expert[filled[row[s]]] = s
        filled[row[s]] += 1
    num_free = 0
    for e in range(num_experts):
        surplus = have[e] - want[e]
        if surplus <= 0:
            continue
        mine = by_expert[start[e]:start[e + 1]].copy()
        for i in range(1, mine.shape[0]):  # stable insertion sort by decreasing GPU load
            s = mine[i]
            j = i
            while j > 0 and loads[gpu_of_slot[mine[j - 1]]] < loads[gpu_of_slot[s]]:
                mine[j] = mine[j - 1]
                j -= 1
            mine[j] = s
        for i in range(surplus):
            loads[gpu_of_slot[mine[i]]] -= share[e]
            free[num_free] = mine[i]
            num_free += 1
    return num_free


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _group_nodes(previous, node_of_slot, group_of_expert):
    """``[K]`` the node holding each expert group under ``previous [S]``; ``-1`` everywhere if a
    group is on no node or on more than one (no recounted start then)."""
    num_groups = 0
    for e in range(group_of_expert.shape[0]):
        num_groups = max(num_groups, group_of_expert[e] + 1)
    node = np.full(num_groups, -1, np.int64)
    bad = False
    for s in range(previous.shape[0]):
        k = group_of_expert[previous[s]]
        if node[k] < 0:
            node[k] = node_of_slot[s]
        elif node[k] != node_of_slot[s]:
            bad = True
    for k in range(num_groups):
        bad = bad or node[k] < 0
    if bad:
        node[:] = -1
    return node


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _recount_layer(weights, previous, scratch, layout, row):
    """One layer of :func:`recounted_starts` (``layout``: ``(gpu_of_slot, slot_offsets, node_of_gpu,
    group_of_expert, hierarchical)``), written into ``row [S]``; True if there is a start."""
    gpu_of_slot, slot_offsets, node_of_gpu, group_of_expert, hierarchical = layout
    num_slots, num_experts = previous.shape[0], weights.shape[0]
    have = np.zeros(num_experts, np.int64)
    want = np.zeros(num_experts, np.int64)
    for s in range(num_slots):
        have[previous[s]] += 1
        want[scratch[s]] += 1
    differ = False
    for e in range(num_experts):
        differ = differ or have[e] != want[e]
    if not differ:
        return False
    share = weights / np.maximum(want, 1)
    row[:] = previous
    loads = np.zeros(slot_offsets.shape[0] - 1)
    for s in range(num_slots):  # in slot order, as np.bincount sums
        loads[gpu_of_slot[s]] += share[row[s]]
    free = np.empty(num_slots, np.int64)
    num_free = _free_surplus(row, want, share, gpu_of_slot, loads, free)
    num_needs = 0
    needs = np.empty(num_slots, np.int64)
    for e in range(num_experts):
        for _ in range(want[e] - have[e]):
            needs[num_needs] = e
            num_needs += 1
    needs = needs[:num_needs][stable_argsort(-share[needs[:num_needs]])]  # (-share, expert) increasing
    node_of_slot = node_of_gpu[gpu_of_slot]
    group_node = _group_nodes(previous, node_of_slot, group_of_expert) if hierarchical else np.zeros(1, np.int64)
    if hierarchical and group_node[0] < 0:
        return False
    taken = np.zeros(num_free, np.bool_)
    for e in needs:
        best, best_load, best_slot = -1, 0.0, -1
        for i in range(num_free):
            s = free[i]
            g = gpu_of_slot[s]
            if taken[i] or (hierarchical and node_of_slot[s] != group_node[group_of_expert[e]]):
                continue
            doubled = False
            for t in range(slot_offsets[g], slot_offsets[g + 1]):
                doubled = doubled or row[t] == e
            if doubled:
                continue  # never a second replica of e on one GPU
            if best < 0 or loads[g] < best_load or (loads[g] == best_load and s < best_slot):
                best, best_load, best_slot = i, loads[g], s
        if best < 0:
            return False
        taken[best] = True
        row[free[best]] = e
        loads[gpu_of_slot[free[best]]] += share[e]
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def recounted_starts(weights, previous, scratch, gpu_of_slot, slot_offsets, node_of_gpu, group_of_expert,
                     hierarchical):
    """Per layer, the placement in service ``previous`` with the replica counts of ``scratch`` (the
    module docstring's rule), a start for the search where it stalls.

    Args:
        weights: ``[L, E]`` float64 loads.
        previous, scratch: ``[L, S]`` int64 placements (every expert present).
        gpu_of_slot: ``[S]``; slot_offsets: ``[G + 1]``; node_of_gpu: ``[G]``; group_of_expert:
            ``[E]`` int64 (read only with ``hierarchical``).
        hierarchical: keep every expert on the node of its group (no start where ``previous`` has
            a group on more than one node).
    Returns:
        ``rows [L, S]`` int64 and ``found [L]`` bool: no start (row undefined) where the replica
        counts already agree, or a short expert finds no slot it may take.
    """
    num_layers, num_slots = previous.shape
    rows = np.empty((num_layers, num_slots), np.int64)
    found = np.zeros(num_layers, np.bool_)
    layout = (gpu_of_slot, slot_offsets, node_of_gpu, group_of_expert, hierarchical)
    for layer in range(num_layers):
        found[layer] = _recount_layer(weights[layer], previous[layer], scratch[layer], layout, rows[layer])
    return rows, found
