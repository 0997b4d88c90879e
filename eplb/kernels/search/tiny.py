"""Exact branch and bound for tiny instances (a few experts and slots, e.g. Mixtral's 8 experts on
12 slots): the optimum max GPU load over every replication and packing, within a node budget.

The search enumerates replica counts (heaviest expert first) and, for each, packs the replicas
largest-first into GPUs by depth-first search, looking only for packings strictly below the best
max load found so far. Symmetries are broken exactly: GPUs are opened in order (an empty GPU is
tried only if no earlier GPU of the same slot count is empty) and the replicas of one expert go to
GPUs in non-decreasing order (increasing when spread). A branch is cut when a GPU's load plus the
lightest replicas that must still fill its slots reaches the best max load, or when filling a GPU
leaves the open GPUs more load than they can take below it. When the search ends
within its budget, the best value found is the proven optimum.
"""

import numpy as np
from numba import njit

from ..plumbing.common import stable_argsort

SPREAD = True  # tiny_optimum's spread argument, named for callers: no two replicas of an expert on one GPU


@njit(cache=True, nogil=True, error_model="numpy")
def _pack(item_load, item_expert, num_items, caps, spread, best, num_experts, nodes, budget, out_bin):
    """Depth-first packing of ``num_items`` replicas (largest first, one expert's replicas next to
    each other) into GPUs of ``caps [G]`` slots (summing to ``num_items``), strictly below ``best``.

    Returns ``(value, nodes, aborted)``: ``value`` the best max load found below ``best`` (or
    ``best`` if none; ``out_bin [n]`` then holds its GPU of every replica), ``aborted`` when the
    node budget ran out.
    """
    num_bins = caps.shape[0]
    load = np.zeros(num_bins)
    fill = np.zeros(num_bins, np.int64)
    holds = np.zeros((num_bins, num_experts), np.int64)
    choice = np.full(num_items, -1, np.int64)
    tail = np.zeros(num_items + 1)  # tail[j]: the j lightest replicas (the last j items)
    for j in range(1, num_items + 1):
        tail[j] = tail[j - 1] + item_load[num_items - j]
    limit = best  # packings strictly below it only
    total = 0.0
    for j in range(num_items):
        total += item_load[j]
    full_load = 0.0  # load of the GPUs whose slots are all taken, and their number
    full = 0
    i = 0
    while i >= 0:
        e = item_expert[i]
        b = choice[i]
        if b >= 0:  # undo the previous choice of item i
            if fill[b] == caps[b]:
                full -= 1
                full_load -= load[b]
            load[b] -= item_load[i]
            fill[b] -= 1
            holds[b, e] -= 1
            b += 1
        else:
            b = 0
            if i > 0 and item_expert[i - 1] == e:
                b = choice[i - 1] + (1 if spread else 0)
        placed = False
        while b < num_bins:
            ok = fill[b] < caps[b] and load[b] + item_load[i] < limit
            if ok and spread and holds[b, e] > 0:
                ok = False
            if ok and fill[b] == 0:
                for b2 in range(b):
                    if fill[b2] == 0 and caps[b2] == caps[b]:
                        ok = False  # an identical empty GPU came first
                        break
            if ok:
                need = caps[b] - fill[b] - 1
                remaining = num_items - 1 - i
                if need > remaining or load[b] + item_load[i] + tail[need] >= limit:
                    ok = False
            if ok and fill[b] + 1 == caps[b]:
                # the GPUs left open must take the rest, each strictly below the limit
                if total - full_load - load[b] - item_load[i] >= (num_bins - full - 1) * limit and full + 1 < num_bins:
                    ok = False
            if ok:
                placed = True
                break
            b += 1
        if not placed:
            choice[i] = -1
            i -= 1
            continue
        load[b] += item_load[i]
        fill[b] += 1
        holds[b, e] += 1
        choice[i] = b
        if fill[b] == caps[b]:
            full += 1
            full_load += load[b]
        nodes += 1
        if nodes > budget:
            return limit, nodes, True
        if i == num_items - 1:
            top = 0.0
            for g in range(num_bins):
                top = max(top, load[g])
            if top < limit:
                limit = top
                for j in range(num_items):
                    out_bin[j] = choice[j]
            continue  # look for a strictly better packing
        i += 1
        choice[i] = -1
    return limit, nodes, False


@njit(cache=True, nogil=True, error_model="numpy")
def tiny_optimum(w, slots_per_gpu, spread, best, budget, out_row):
    """The lowest max GPU load of one layer below ``best``, over every replication and packing.

    Args:
        w: ``[E]`` float64 loads; slots_per_gpu: ``[G]`` int64 (0 = masked GPU).
        spread: only placements with no two replicas of an expert on one GPU (then an expert has
            at most as many replicas as GPUs with slots).
        best: the search looks for max loads strictly below this (``np.inf`` for any).
        budget: most search nodes (replications plus packing steps).
        out_row: ``[S]`` int64, written with the best placement found (slot -> expert, GPU by GPU).
    Returns:
        ``(value, found, proven)``: the best max load found below ``best`` (else ``best``), whether
        one was found (``out_row`` written), and whether the search finished: then no placement
        (under ``spread``, if set) has a max load below ``value``.
    """
    num_experts = w.shape[0]
    caps = slots_per_gpu[slots_per_gpu > 0].copy()
    gpu_ids = np.where(slots_per_gpu > 0)[0]
    num_slots = 0
    for g in range(caps.shape[0]):
        num_slots += caps[g]
    cap = num_slots - num_experts + 1
    if spread:
        cap = min(cap, caps.shape[0])
    offsets = np.zeros(slots_per_gpu.shape[0] + 1, np.int64)
    for g in range(slots_per_gpu.shape[0]):
        offsets[g + 1] = offsets[g] + slots_per_gpu[g]
    order = stable_argsort(-w)
    smallest_k = caps[0]
    for g in range(caps.shape[0]):
        smallest_k = min(smallest_k, caps[g])
    counts = np.zeros(num_experts, np.int64)  # replicas of order[j]
    item_load = np.empty(num_slots)
    item_expert = np.empty(num_slots, np.int64)
    item_order = np.empty(num_slots, np.int64)
    keys = np.empty(num_experts)
    bins = np.empty(num_slots, np.int64)
    value = best
    found = False
    nodes = 0
    # replica counts by depth-first search over the experts (heaviest first): counts[j] from high to low
    j = 0
    left = num_slots
    counts[0] = 0
    while j >= 0:
        rest = num_experts - 1 - j  # experts after j, each needs >= 1
        if counts[j] == 0:
            top = min(cap, left - rest)
            if j == num_experts - 1:
                top = left if left <= cap else 0
            counts[j] = top + 1
        counts[j] -= 1
        if counts[j] < 1 or (j == num_experts - 1 and counts[j] != left):
            counts[j] = 0
            j -= 1
            if j >= 0:
                left += counts[j]
            continue
        # the heaviest replica of order[j] with its GPU's lightest possible company already too heavy
        if w[order[j]] / counts[j] >= value:
            counts[j] = 0
            j -= 1
            if j >= 0:
                left += counts[j]
            continue
        nodes += 1
        if nodes > budget:
            return value, found, False
        if j < num_experts - 1:
            left -= counts[j]
            j += 1
            counts[j] = 0
            continue
        # a full replication: replicas largest first, one expert's next to each other
        for x in range(num_experts):
            keys[x] = -w[order[x]] / counts[x]
        by_load = stable_argsort(keys)
        n = 0
        for x in by_load:
            for _ in range(counts[x]):
                item_load[n] = w[order[x]] / counts[x]
                item_expert[n] = order[x]
                n += 1
        if item_load[0] + (smallest_k - 1) * item_load[n - 1] >= value:
            continue
        new_value, nodes, aborted = _pack(item_load, item_expert, n, caps, spread, value, num_experts, nodes,
                                          budget, bins)
        if new_value < value:
            value = new_value
            found = True
            fill = np.zeros(caps.shape[0], np.int64)
            for x in range(n):
                g = gpu_ids[bins[x]]
                out_row[offsets[g] + fill[bins[x]]] = item_expert[x]
                fill[bins[x]] += 1
        if aborted:
            return value, found, False
    return value, found, True


@njit(cache=True, nogil=True, error_model="numpy")
def tiny_bound(weights, slots_per_gpu, lower, budget):
    """Per layer, the proven optimum (shaded by 1e-9) where the search finishes within ``budget``
    nodes, else ``lower``. Args: ``weights [L, E]`` float64, ``slots_per_gpu [G]`` int64, ``lower
    [L]`` valid bounds. Returns ``[L]`` float64, never below ``lower``."""
    out = lower.copy()
    num_slots = 0
    for g in range(slots_per_gpu.shape[0]):
        num_slots += slots_per_gpu[g]
    row = np.empty(num_slots, np.int64)
    for layer in range(weights.shape[0]):
        value, found, proven = tiny_optimum(weights[layer], slots_per_gpu, False, np.inf, budget, row)
        if proven and found:
            out[layer] = max(lower[layer], value * (1.0 - 1e-9))
    return out
