"""Relabel a fresh placement so that it keeps as many experts as possible where the placement in
service had them: match GPUs (and nodes) by the experts they share (an optimal assignment), then
order each GPU's slots (:func:`align_slots`).

Shapes: ``L`` layers, ``E`` experts, ``S`` slots, ``G`` GPUs.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL


@njit(cache=True, error_model="numpy")  # keeps the GIL: see below
def min_cost_assignment(cost):
    """Optimal assignment of an ``[n, n]`` float64 cost matrix (shortest augmenting paths, O(n^3)).

    Returns:
        ``[n]`` int64: the column assigned to each row, minimising the total cost.

    Called from Python on node-sized matrices (one call per layer of the regroup restart), it keeps
    the GIL: releasing it for microseconds of work made a planning thread wait up to a switch
    interval (5 ms) per call to get the GIL back from a busy Python thread. Called from the
    kernels that release the GIL (:func:`relabel_like`), it runs without it like they do.
    """
    n = cost.shape[0]
    inf = np.inf
    u = np.zeros(n + 1)
    v = np.zeros(n + 1)
    match_col = np.zeros(n + 1, np.int64)  # row (1-based) matched to each column; 0 = free
    way = np.zeros(n + 1, np.int64)
    min_v = np.empty(n + 1)
    used = np.zeros(n + 1, np.bool_)
    for i in range(1, n + 1):
        match_col[0] = i
        j0 = 0
        min_v[:] = inf
        used[:] = False
        while True:
            used[j0] = True
            i0 = match_col[j0]
            delta = inf
            j1 = 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1, j - 1] - u[i0] - v[j]
                    if cur < min_v[j]:
                        min_v[j] = cur
                        way[j] = j0
                    if min_v[j] < delta:
                        delta = min_v[j]
                        j1 = j
            for j in range(n + 1):
                if used[j]:
                    u[match_col[j]] += delta
                    v[j] -= delta
                else:
                    min_v[j] -= delta
            j0 = j1
            if match_col[j0] == 0:
                break
        while j0 != 0:
            j1 = way[j0]
            match_col[j0] = match_col[j1]
            j0 = j1
    result = np.empty(n, np.int64)
    for j in range(1, n + 1):
        result[match_col[j] - 1] = j - 1
    return result


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _overlap(new_row, prev_row, slot_offsets, num_experts):
    """``[G, G]``: experts GPU ``gn`` holds under ``new_row`` that GPU ``go`` holds under ``prev_row``
    (multiset intersection); ``-1`` where the two GPUs hold different numbers of slots."""
    num_gpus = slot_offsets.shape[0] - 1
    held = np.zeros((num_gpus, num_experts), np.int64)
    for g in range(num_gpus):
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            held[g, prev_row[s]] += 1
    overlap = np.zeros((num_gpus, num_gpus))
    mine = np.zeros(num_experts, np.int64)
    for gn in range(num_gpus):
        size = slot_offsets[gn + 1] - slot_offsets[gn]
        for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
            mine[new_row[s]] += 1
        for go in range(num_gpus):
            if slot_offsets[go + 1] - slot_offsets[go] != size:
                overlap[gn, go] = -1.0
                continue
            total = 0
            for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
                e = new_row[s]
                if mine[e] > 0:  # count each distinct expert once
                    total += min(mine[e], held[go, e])
                    mine[e] = -mine[e]
            for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
                e = new_row[s]
                if mine[e] < 0:
                    mine[e] = -mine[e]
            overlap[gn, go] = total
        for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
            mine[new_row[s]] = 0
    return overlap


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _match_gpus(overlap, gpus_per_node, by_node):
    """GPU relabelling ``[G]`` (new GPU -> position) maximising the kept experts.

    ``by_node``: permute whole nodes, then GPUs inside each node (keeps groups on one node);
    otherwise any GPU may take any position with the same slot count.
    """
    num_gpus = overlap.shape[0]
    big = 1e9
    if not by_node:
        cost = np.empty((num_gpus, num_gpus))
        for i in range(num_gpus):
            for j in range(num_gpus):
                cost[i, j] = big if overlap[i, j] < 0 else -overlap[i, j]
        return min_cost_assignment(cost)
    num_nodes = num_gpus // gpus_per_node
    node_cost = np.empty((num_nodes, num_nodes))
    inner = np.empty((num_nodes, num_nodes, gpus_per_node), np.int64)
    sub = np.empty((gpus_per_node, gpus_per_node))
    for a in range(num_nodes):
        for b in range(num_nodes):
            for i in range(gpus_per_node):
                for j in range(gpus_per_node):
                    o = overlap[a * gpus_per_node + i, b * gpus_per_node + j]
                    sub[i, j] = big if o < 0 else -o
            assignment = min_cost_assignment(sub)
            total = 0.0
            for i in range(gpus_per_node):
                total += sub[i, assignment[i]]
                inner[a, b, i] = assignment[i]  # not inner[a, b] = assignment: see hierarchy._copy
            node_cost[a, b] = total
    nodes = min_cost_assignment(node_cost)
    result = np.empty(num_gpus, np.int64)
    for a in range(num_nodes):
        for i in range(gpus_per_node):
            result[a * gpus_per_node + i] = nodes[a] * gpus_per_node + inner[a, nodes[a], i]
    return result


@njit(cache=True, nogil=True, error_model="numpy")
def align_slots(row, prev_row, slot_offsets, num_experts, out):
    """Order each GPU's experts so that those it held in a slot under ``prev_row`` stay there."""
    num_gpus = slot_offsets.shape[0] - 1
    want = np.zeros(num_experts, np.int64)
    for g in range(num_gpus):
        lo, hi = slot_offsets[g], slot_offsets[g + 1]
        for s in range(lo, hi):
            want[row[s]] += 1
            out[s] = -1
        for s in range(lo, hi):
            e = prev_row[s]
            if e >= 0 and want[e] > 0:  # e < 0: a hole of a carried placement
                out[s] = e
                want[e] -= 1
        t = lo
        for s in range(lo, hi):
            e = row[s]
            if want[e] > 0:
                while out[t] >= 0:
                    t += 1
                out[t] = e
                want[e] -= 1


@njit(cache=True, nogil=True, error_model="numpy")
def relabel_like(new, previous, slot_offsets, gpus_per_node, by_node, num_experts):
    """Relabel GPUs (and nodes) of ``new [L, S]``, then slots inside each GPU, to keep the most
    experts where ``previous [L, S]`` had them. GPU loads are only permuted.

    Returns:
        ``phy2log [L, S]`` int64 and ``changes [L]`` int64 (slots that differ from ``previous``).
    """
    num_layers, num_slots = new.shape
    num_gpus = slot_offsets.shape[0] - 1
    out = np.empty_like(new)
    moved = np.empty(num_slots, np.int64)
    changes = np.zeros(num_layers, np.int64)
    for layer in range(num_layers):
        overlap = _overlap(new[layer], previous[layer], slot_offsets, num_experts)
        position = _match_gpus(overlap, gpus_per_node, by_node)
        for gn in range(num_gpus):
            go = position[gn]
            for i in range(slot_offsets[gn + 1] - slot_offsets[gn]):
                moved[slot_offsets[go] + i] = new[layer, slot_offsets[gn] + i]
        align_slots(moved, previous[layer], slot_offsets, num_experts, out[layer])
        for s in range(num_slots):
            if out[layer, s] != previous[layer, s]:
                changes[layer] += 1
    return out, changes
