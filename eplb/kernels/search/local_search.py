"""Local search on a packing: swap replicas between the heaviest GPU and the others.

The working state of a layer is described in :mod:`eplb.kernels.search.packing`. Every move keeps the
replica counts and the number of replicas on each GPU, and never puts a second replica of an
expert on a GPU that did not already hold one.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, stable_argsort

from .packing import load_state, new_state, recompute_loads, store_state


@njit(cache=True, nogil=True, error_model="numpy")
def _swap(h, i, g, j, item_load, item_expert, gpu_items, gpu_load, holds):
    """Exchange replica ``gpu_items[h, i]`` with ``gpu_items[g, j]``."""
    a = gpu_items[h, i]
    b = gpu_items[g, j]
    gpu_items[h, i] = b
    gpu_items[g, j] = a
    d = item_load[a] - item_load[b]
    gpu_load[h] -= d
    gpu_load[g] += d
    holds[h, item_expert[a]] -= 1
    holds[g, item_expert[a]] += 1
    holds[g, item_expert[b]] -= 1
    holds[h, item_expert[b]] += 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def spread_duplicates(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds):
    """Swap every second replica of an expert on one GPU with a replica on another GPU of ``gpus``
    that does not hold that expert (and whose expert the first GPU lacks), choosing the swap that
    keeps the larger of the two loads smallest. Replicas with no such partner stay.

    Args:
        gpus: ``[m]`` int64 GPU ids the swaps may use. State arrays: :mod:`eplb.kernels.search.packing`.
    Returns:
        the number of swaps made.
    """
    swaps = 0
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        for i in range(gpu_fill[g]):
            a = gpu_items[g, i]
            ea = item_expert[a]
            if holds[g, ea] < 2:
                continue
            best_g = np.int64(-1)  # int64 sentinels, not literals: one specialization of _swap
            best_j = np.int64(-1)
            best_score = np.inf
            for gj in range(gpus.shape[0]):
                g2 = gpus[gj]
                if g2 == g or holds[g2, ea] > 0:
                    continue
                for j in range(gpu_fill[g2]):
                    b = gpu_items[g2, j]
                    if holds[g, item_expert[b]] > 0:
                        continue
                    d = item_load[a] - item_load[b]
                    score = max(gpu_load[g] - d, gpu_load[g2] + d)
                    if score < best_score:
                        best_score = score
                        best_g = g2
                        best_j = j
            if best_g >= 0:
                _swap(g, i, best_g, best_j, item_load, item_expert, gpu_items, gpu_load, holds)
                swaps += 1
    return swaps


@njit(cache=True, nogil=True, error_model="numpy")
def _order_by_load(gpus, gpu_load, gpu_fill, order):
    """Insertion-sort ``gpus [n]`` by load into ``order [n]`` (lightest first); return the heaviest
    GPU that holds a replica, or -1."""
    h = np.int64(-1)
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        i = gi
        while i > 0 and gpu_load[order[i - 1]] > gpu_load[g]:
            order[i] = order[i - 1]
            i -= 1
        order[i] = g
        if gpu_fill[g] > 0 and (h < 0 or gpu_load[g] > gpu_load[h]):
            h = g
    return h


@njit(cache=True, nogil=True, error_model="numpy")
def _lighter(gpus, gpu_load, a, b):
    """Whether position ``a`` of ``gpus`` comes before position ``b`` in load order (the lighter
    GPU first, the earlier position on ties)."""
    la, lb = gpu_load[gpus[a]], gpu_load[gpus[b]]
    return la < lb or (la == lb and a < b)


@njit(cache=True, nogil=True, error_model="numpy")
def _reposition(gpus, gpu_load, order, rank, a):
    """Move position ``a`` of ``gpus`` to its place in ``order [m]`` (positions in load order,
    :func:`_lighter`) after its GPU's load changed; ``rank [m]`` is each position's index in ``order``."""
    i = rank[a]
    while i > 0 and _lighter(gpus, gpu_load, a, order[i - 1]):
        order[i] = order[i - 1]
        rank[order[i]] = i
        i -= 1
    while i + 1 < order.shape[0] and _lighter(gpus, gpu_load, order[i + 1], a):
        order[i] = order[i + 1]
        rank[order[i]] = i
        i += 1
    order[i] = a
    rank[a] = i


@njit(cache=True, nogil=True, error_model="numpy")
def _heaviest(gpus, gpu_load, gpu_fill, order):
    """The earliest position of ``gpus`` among the heaviest GPUs that hold a replica (``order`` in
    load order, :func:`_lighter`), or -1."""
    h = np.int64(-1)
    for i in range(order.shape[0] - 1, -1, -1):
        p = order[i]
        if gpu_fill[gpus[p]] == 0:
            continue
        if h >= 0 and gpu_load[gpus[p]] < gpu_load[gpus[h]]:
            break
        h = p  # equal loads run in increasing position: the last one met is the earliest
    return h


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps):
    """Lower the heaviest GPU by swaps until no single swap lowers it.

    Each step takes the heaviest GPU ``h`` of ``gpus`` and, over the other GPUs ``g`` from the
    lightest (the 4 lightest when one of them helps, else all) and every pair (replica on ``h``,
    lighter replica on ``g``), applies the swap that makes ``max(load_h, load_g)`` smallest, if that
    is below the old ``load_h``; it stops when no GPU offers such a swap. The sum of squared
    loads falls at every step, so the search ends; ``max_steps`` bounds it. The GPUs are kept in
    load order across steps (a swap moves two of them: O(m) a step, not a sort), ties in the order
    of ``gpus`` (the earliest heaviest GPU is ``h``).

    Args:
        gpus: ``[m]`` int64 GPU ids the search may use. State arrays: :mod:`eplb.kernels.search.packing`.
        max_steps: most swaps.
    Returns:
        the number of swaps made.
    """
    steps = 0
    m = gpus.shape[0]
    keys = np.empty(m)
    for p in range(m):
        keys[p] = gpu_load[gpus[p]]
    order = stable_argsort(keys)  # positions of gpus, lightest first, earlier position on ties
    rank = np.empty(m, np.int64)
    for i in range(m):
        rank[order[i]] = i
    while steps < max_steps:
        hp = _heaviest(gpus, gpu_load, gpu_fill, order)
        if hp < 0:
            break
        h = gpus[hp]
        top = gpu_load[h]
        best_score = top - 1e-12 * top
        best_p = np.int64(-1)
        best_i = np.int64(-1)
        best_j = np.int64(-1)
        # lightest partners first: a swap with g leaves max(load_h, load_g) >= (load_h + load_g) / 2,
        # so once that reaches the best score found no heavier partner can do better
        scanned = 0
        for oi in range(m):
            p = order[oi]
            g = gpus[p]
            if g == h or gpu_fill[g] == 0:
                continue
            low = gpu_load[g]
            if 0.5 * (top + low) >= best_score:
                break
            if scanned >= 4 and best_p >= 0:
                break  # an improving swap with one of the 4 lightest GPUs will do
            scanned += 1
            for i in range(gpu_fill[h]):
                a = gpu_items[h, i]
                la = item_load[a]
                if holds[g, item_expert[a]] > 0:
                    continue
                for j in range(gpu_fill[g]):
                    b = gpu_items[g, j]
                    d = la - item_load[b]
                    if d <= 0.0:
                        continue
                    score = max(top - d, low + d)
                    if score < best_score and holds[h, item_expert[b]] == 0:
                        best_score = score
                        best_p = p
                        best_i = i
                        best_j = j
        if best_p < 0:
            break
        _swap(h, best_i, gpus[best_p], best_j, item_load, item_expert, gpu_items, gpu_load, holds)
        _reposition(gpus, gpu_load, order, rank, hp)
        _reposition(gpus, gpu_load, order, rank, best_p)
        steps += 1
    return steps


@njit(cache=True, nogil=True, error_model="numpy")
def improve_placement(weights, phy2log, slot_offsets, gpu_domain, max_swaps):
    """Improve a given placement with few changes: swap descent on every layer.

    Replica counts stay; only the slots of swapped replicas change (each swap rewrites two slots),
    and swaps stay inside a domain (pass the node of each GPU to keep every expert group on its
    node, or zeros for a global placement). The max GPU load of every layer never rises.

    Args:
        weights: ``[L, E]`` float64 expert loads.
        phy2log: ``[L, S]`` int64 placement to start from (not modified).
        slot_offsets: ``[G + 1]`` int64 (``Topology.slot_offsets``).
        gpu_domain: ``[G]`` int64 domain of each GPU; swaps only between GPUs of one domain.
        max_swaps: most swaps per layer and domain (each changes two slots).
    Returns:
        ``(phy2log [L, S] int64, swaps [L] int64)``: the improved placement and swaps per layer.
    """
    num_layers, num_experts = weights.shape
    num_slots = phy2log.shape[1]
    num_gpus = slot_offsets.shape[0] - 1
    width = np.int64(1)  # not the literal 1: new_state then has one compiled specialization
    for g in range(num_gpus):
        width = max(width, slot_offsets[g + 1] - slot_offsets[g])
    out = phy2log.copy()
    swaps = np.zeros(num_layers, np.int64)
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = new_state(num_slots, num_gpus, width, num_experts)
    num_domains = 0
    for g in range(num_gpus):
        num_domains = max(num_domains, gpu_domain[g] + 1)
    for layer in range(num_layers):
        load_state(phy2log[layer], weights[layer], slot_offsets, item_expert, item_load, gpu_items, gpu_fill,
                   gpu_load, holds)
        for d in range(num_domains):
            gpus = np.where(gpu_domain == d)[0].astype(np.int64)
            swaps[layer] += swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds,
                                         max_swaps)
            recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)
        store_state(item_expert, gpu_items, gpu_fill, slot_offsets, out[layer])
    return out, swaps


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pairs(g, other, item_load, item_expert, gpu_items, gpu_fill, holds, sums, first, second):
    """Pairs of replicas on ``g`` of two different experts that ``other`` lacks: their load sums
    in increasing order in ``sums[:n]`` with their positions ``first``/``second``. Returns ``n``."""
    n = 0
    for i1 in range(gpu_fill[g]):
        a1 = gpu_items[g, i1]
        if holds[other, item_expert[a1]] > 0:
            continue
        for i2 in range(i1 + 1, gpu_fill[g]):
            a2 = gpu_items[g, i2]
            if holds[other, item_expert[a2]] > 0 or item_expert[a2] == item_expert[a1]:
                continue
            value = item_load[a1] + item_load[a2]
            j = n  # insertion sort
            while j > 0 and sums[j - 1] > value:
                sums[j] = sums[j - 1]
                first[j] = first[j - 1]
                second[j] = second[j - 1]
                j -= 1
            sums[j] = value
            first[j] = i1
            second[j] = i2
            n += 1
    return n


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def pair_swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps):
    """Like :func:`swap_descent`, but also exchanges two replicas of the heaviest GPU for two of
    another GPU (the lightest first, as in :func:`swap_descent`) when no single swap helps. The
    pair sums of both GPUs are sorted, so the best exchange is found by a merge-like scan.

    Returns:
        the number of moves made.
    """
    width = gpu_items.shape[1]
    size = max(1, width * (width - 1) // 2)
    h_sums = np.empty(size)
    h_first = np.empty(size, np.int64)
    h_second = np.empty(size, np.int64)
    g_sums = np.empty(size)
    g_first = np.empty(size, np.int64)
    g_second = np.empty(size, np.int64)
    order = np.empty(gpus.shape[0], np.int64)
    steps = 0
    while steps < max_steps:
        steps += swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps - steps)
        if steps >= max_steps:
            break
        h = _order_by_load(gpus, gpu_load, gpu_fill, order)
        if h < 0:
            break
        top = gpu_load[h]
        best_score = top - 1e-12 * top
        best_g = np.int64(-1)
        bi1 = bi2 = bj1 = bj2 = np.int64(-1)
        scanned = 0
        for gi in range(gpus.shape[0]):
            g = order[gi]
            low = gpu_load[g]
            if g == h or gpu_fill[g] < 2:
                continue
            if 0.5 * (top + low) >= best_score or (scanned >= 4 and best_g >= 0):
                break  # lightest partners first; one of the 4 lightest that helps will do
            scanned += 1
            nh = _pairs(h, g, item_load, item_expert, gpu_items, gpu_fill, holds, h_sums, h_first, h_second)
            ng = _pairs(g, h, item_load, item_expert, gpu_items, gpu_fill, holds, g_sums, g_first, g_second)
            if nh == 0 or ng == 0:
                continue
            half = 0.5 * (top - low)
            # for each pair of h (increasing), the best pair of g has sum closest to h_sum - half,
            # which only increases: one pointer walks g's sorted sums
            j = 0
            for p in range(nh):
                want = h_sums[p] - half
                while j + 1 < ng and g_sums[j + 1] <= want:
                    j += 1
                for q in (j, j + 1):
                    if q >= ng:
                        continue
                    d = h_sums[p] - g_sums[q]
                    if d <= 0.0:
                        continue
                    score = max(top - d, low + d)
                    if score < best_score:
                        best_score = score
                        best_g = g
                        bi1, bi2, bj1, bj2 = h_first[p], h_second[p], g_first[q], g_second[q]
        if best_g < 0:
            break
        _swap(h, bi1, best_g, bj1, item_load, item_expert, gpu_items, gpu_load, holds)
        _swap(h, bi2, best_g, bj2, item_load, item_expert, gpu_items, gpu_load, holds)
        steps += 1
    return steps
