"""Depth-first search for a packing of given replicas under a load cap (identical GPUs).

Given the replica loads of one layer (one replica count per expert already chosen) and a cap
``T``, :func:`pack_under_cap` looks for an assignment of the replicas to ``G`` GPUs of exactly
``k`` slots each with every GPU load ``<= T``. GPUs are filled one at a time, each with the
largest replica still unplaced (the GPUs are identical, so this loses no packing) and ``k - 1``
others in increasing position, kept only when the GPU's load lies in the window
``[R - (G' - 1) T, T]`` (``R``: load still unplaced, ``G'``: GPUs still empty) that the remaining
GPUs can still absorb. Replicas of one expert are interchangeable, so only the first unused one
is tried at a position. The search ends at the first packing found, when the tree is exhausted
(no packing of these replicas meets the cap) or after ``budget`` nodes.
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, stable_argsort

FOUND = 1
EXHAUSTED = 0
OUT_OF_BUDGET = -1


Tree = namedtuple("Tree", ["used", "choice", "partial", "remaining"])
Tree.__doc__ = """The state of :func:`pack_under_cap`'s search over ``n`` replicas and ``G`` GPUs of ``k`` slots:
``used [n]`` bool which replicas are placed, ``choice [G, k]`` int64 the position of each GPU's replicas
(``j = 0`` its largest, ``-1`` none yet), ``partial [G, k + 1]`` float64 the load of each GPU's first ``j``
replicas, ``remaining [G + 1]`` float64 the load not placed before each GPU is filled."""

PackingRules = namedtuple("PackingRules", ["num_gpus", "slots", "spread", "budget"])
PackingRules.__doc__ = """What every packing attempt of :func:`descend` keeps: ``num_gpus`` GPUs of ``slots``
slots each, ``spread`` (no GPU holds two replicas of one expert), at most ``budget`` search nodes."""


@njit(cache=True, nogil=True, error_model="numpy")
def pack_under_cap(loads, experts, num_gpus, slots, cap, spread, budget):
    """Pack ``G k`` replicas onto ``G`` GPUs of ``k`` slots each with every GPU load ``<= cap``.

    Args:
        loads: ``[G k]`` float64 replica loads, non-increasing; replicas of one expert adjacent.
        experts: ``[G k]`` int64 expert of each replica.
        num_gpus: ``G``; slots: ``k``; cap: ``T``.
        spread: if True, no GPU holds two replicas of one expert.
        budget: most search nodes (replica choices) before giving up.
    Returns:
        ``(status, gpu [G k] int64, nodes)``: status :data:`FOUND` (``gpu`` holds the GPU of every
        replica), :data:`EXHAUSTED` (proven: no such packing of these replicas) or
        :data:`OUT_OF_BUDGET`; ``nodes`` the search nodes spent.
    """
    n = loads.shape[0]
    gpu = np.full(n, -1, np.int64)
    if n != num_gpus * slots or slots < 1:
        return EXHAUSTED, gpu, 0
    tree = Tree(np.zeros(n, np.bool_), np.full((num_gpus, slots), -1, np.int64), np.zeros((num_gpus, slots + 1)),
                np.zeros(num_gpus + 1))
    status, nodes = _search_tree(loads, experts, cap, spread, budget, tree)
    if status == FOUND:
        for g in range(num_gpus):
            for j in range(slots):
                gpu[tree.choice[g, j]] = g
    return status, gpu, nodes


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _search_tree(loads, experts, cap, spread, budget, tree):
    """:func:`pack_under_cap`'s depth-first search (module docstring) in the :class:`Tree` ``tree`` (at
    its start: nothing placed). Returns ``(status, nodes)``; with :data:`FOUND`, ``tree.choice`` holds
    the packing."""
    used, choice, partial, remaining = tree
    n = loads.shape[0]
    num_gpus, slots = choice.shape
    total = 0.0
    for i in range(n):
        total += loads[i]
    remaining[0] = total
    tol = 1e-12 * total  # relative: scaling every load by a power of two scales the search exactly
    nodes = 0
    g = 0
    j = 0
    resume = -1  # position after which to look for the next candidate at (g, j); -1: a fresh slot
    while True:
        if nodes >= budget:
            return OUT_OF_BUDGET, nodes
        if g == num_gpus:
            return FOUND, nodes
        low = remaining[g] - (num_gpus - g - 1) * cap - tol
        picked = -1
        if j == 0:
            if resume < 0:  # the largest unplaced replica opens the GPU
                picked = _opening(loads, used, cap, tol)
        else:
            s = partial[g, j]
            need = slots - j  # replicas still to add, this one included
            # the (need - 1) lightest unused replicas: what the rest of the GPU adds at least
            light = 0.0
            taken = 0
            for i in range(n - 1, -1, -1):
                if taken == need - 1:
                    break
                if not used[i]:
                    light += loads[i]
                    taken += 1
            for i in range(choice[g, j - 1] + 1 if resume < 0 else resume + 1, n):
                if used[i] or (resume >= 0 and i <= resume):
                    continue
                if spread:
                    clash = False
                    for jj in range(j):
                        if experts[choice[g, jj]] == experts[i]:
                            clash = True
                            break
                    if clash:
                        continue
                if s + loads[i] + light > cap + tol:  # too heavy: lighter ones come later
                    continue
                # the heaviest completion from here: this replica and the next need - 1 unused ones
                heavy = loads[i]
                taken = 0
                for ii in range(i + 1, n):
                    if taken == need - 1:
                        break
                    if not used[ii]:
                        heavy += loads[ii]
                        taken += 1
                if taken < need - 1 or s + heavy < low:  # too light, and so is every later one
                    break
                picked = i
                break
        nodes += 1
        if picked >= 0:
            choice[g, j] = picked
            used[picked] = True
            partial[g, j + 1] = partial[g, j] + loads[picked]
            resume = -1
            if j + 1 == slots:
                if partial[g, slots] < low:
                    # the GPU is too light: undo and try the next replica at this slot
                    used[picked] = False
                    resume = _skip_twins(picked, experts)
                    continue
                remaining[g + 1] = remaining[g] - partial[g, slots]
                g += 1
                j = 0
            else:
                j += 1
            continue
        # no candidate at (g, j): undo the previous slot, and the one before when that opens a GPU (forced)
        for _ in range(2):
            if j == 0:
                if g == 0:
                    return EXHAUSTED, nodes
                g -= 1
                j = slots - 1
            else:
                j -= 1
            last = choice[g, j]
            used[last] = False
            choice[g, j] = -1
            if j != 0:
                break
        resume = _skip_twins(last, experts)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _opening(loads, used, cap, tol):
    """The position of the largest unplaced replica (``loads [n]``, ``used [n]``), or -1 when it is
    heavier than ``cap``."""
    picked = -1
    for i in range(loads.shape[0]):
        if not used[i]:
            picked = i
            break
    if loads[picked] > cap + tol:
        picked = -1
    return picked


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _skip_twins(position, experts):
    """The last position holding a replica of the same expert as ``position`` (replicas of one
    expert are adjacent and interchangeable: after one fails at a slot, the others fail too)."""
    n = experts.shape[0]
    while position + 1 < n and experts[position + 1] == experts[position]:
        position += 1
    return position


@njit(cache=True, nogil=True, error_model="numpy")
def replicas_of(w, counts):
    """Replica loads ``[S]`` non-increasing (ties by expert id, so replicas of one expert are
    adjacent) and their experts ``[S]`` int64, for loads ``w [E]`` and replica counts ``counts [E]``."""
    num_slots = 0
    for e in range(w.shape[0]):
        num_slots += counts[e]
    loads = np.empty(num_slots)
    experts = np.empty(num_slots, np.int64)
    n = 0
    for e in range(w.shape[0]):
        for _ in range(counts[e]):
            loads[n] = w[e] / counts[e]
            experts[n] = e
            n += 1
    order = stable_argsort(-loads)  # stable: equal loads keep increasing expert ids
    return loads[order], experts[order]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _attempt(w, counts, rules, cap, row, stats):
    """One packing attempt of ``counts`` under ``cap`` and the :class:`PackingRules`; on success writes
    the placement into ``row [S]`` (GPU by GPU, experts increasing) and returns its max load, else ``-1``.
    ``stats [2]``: attempts left, nodes spent (updated)."""
    num_gpus, slots, spread, budget = rules
    if stats[0] <= 0:
        return -1.0
    stats[0] -= 1
    loads, experts = replicas_of(w, counts)
    status, gpu, nodes = pack_under_cap(loads, experts, num_gpus, slots, cap, spread, budget)
    stats[1] += nodes
    if status != FOUND:
        return -1.0
    gpu_load = np.zeros(num_gpus)
    for i in range(loads.shape[0]):
        gpu_load[gpu[i]] += loads[i]
    fill = np.zeros(num_gpus, np.int64)
    for e in range(w.shape[0]):  # experts increasing: each GPU's slots list its experts in order
        for i in range(loads.shape[0]):
            if experts[i] == e:
                g = gpu[i]
                row[g * slots + fill[g]] = e
                fill[g] += 1
    return gpu_load.max()


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _bisect(w, counts, rules, low, high, row, stats, step):
    """Lower the max load ``high`` of the packing in ``row`` (of ``counts``, under the
    :class:`PackingRules`) by bisecting the cap down to ``low``; returns the max load of ``row`` at the end."""
    trial = row.copy()
    while high - low > step * high and stats[0] > 0:
        mid = 0.5 * (low + high)
        if not low < mid < high:  # adjacent floats (denormal loads): no midpoint left
            break
        found = _attempt(w, counts, rules, mid, trial, stats)
        if found < 0.0:
            low = mid
        else:
            high = found
            row[:] = trial
    return high


@njit(cache=True, nogil=True, error_model="numpy")
def descend(w, row, num_gpus, slots, lower, neighbours, spread, budget, max_attempts, step):
    """The lightest placement the capped search finds for one layer, from the placement ``row``.

    Bisects the cap for ``row``'s replica counts, then (``neighbours``) moves one replica from one
    expert to another, keeping the first move whose replicas pack under ``(1 - step)`` times the
    current max load and bisecting again, until no move helps or ``max_attempts`` packing
    attempts are spent.

    Args:
        w: ``[E]`` float64 loads; row: ``[S]`` int64 starting placement (``S = G k``, GPU ``g`` on
            slots ``g k ... g k + k - 1``); num_gpus, slots: ``G``, ``k``; lower: a valid lower
            bound (the bisection stops there); spread: no expert twice on a GPU; budget: search
            nodes per attempt; step: relative precision of the bisection and least gain of a move.
    Returns:
        ``(max load, row [S] int64, nodes)``: ``max load <=`` the start's.
    """
    num_experts = w.shape[0]
    num_slots = row.shape[0]
    counts = np.zeros(num_experts, np.int64)
    for s in range(num_slots):
        counts[row[s]] += 1
    gpu_load = np.zeros(num_gpus)
    for s in range(num_slots):
        gpu_load[s // slots] += w[row[s]] / counts[row[s]]
    best = gpu_load.max()
    out = row.copy()
    stats = np.zeros(2, np.int64)
    stats[0] = max_attempts
    peak = 0.0
    for e in range(num_experts):
        peak = max(peak, w[e])
    if best <= lower or peak <= 0.0:
        return best, out, 0
    rules = PackingRules(num_gpus, slots, spread, budget)
    trial = row.copy()
    found = _attempt(w, counts, rules, best, trial, stats)
    if found >= 0.0 and found <= best:
        out[:] = trial
        best = _bisect(w, counts, rules, lower, found, out, stats, step)
    if not neighbours:
        return best, out, stats[1]
    # moves in order of the experts' loads, heaviest first (ids only break ties): renaming the
    # experts renames the result
    by_load = stable_argsort(-w)
    improved = True
    while improved and best > lower * (1.0 + step) and stats[0] > 0:
        improved = False
        for a in by_load:
            if counts[a] == 1:
                continue
            for b in by_load:
                if b == a:
                    continue
                counts[a] -= 1
                counts[b] += 1
                found = _attempt(w, counts, rules, best * (1.0 - step), trial, stats)
                if found >= 0.0:
                    out[:] = trial
                    best = _bisect(w, counts, rules, lower, found, out, stats, step)
                    improved = True
                    break
                counts[a] += 1
                counts[b] -= 1
            if improved:
                break
    return best, out, stats[1]
