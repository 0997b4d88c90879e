"""Kernels for GPUs that hold exactly two replicas each (``k = 2``): a GPU is a pair.

For fixed replica counts the replica loads form a multiset of ``S = 2 G`` values, a placement is a
perfect pairing of it, and pairing the ``i``-th heaviest replica with the ``i``-th lightest
(*sorted pairing*) minimises the heaviest pair. So the optimum is the minimum over replica counts
of the sorted pairing's peak: :func:`pair_search` searches the counts, :func:`pair_level_bound`
bounds that minimum from below.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL

PAIR_MULTIPLIERS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
"""The multipliers ``mu`` of the slot budget tried at each level by :func:`pair_level_bound`."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _level_infeasible(desc, zeros, num_slots, target, x, mus, totals):
    """Whether no replica counts meet the pairing condition at level ``x`` under ``target`` ``T``.

    The condition (Hall's, for a pairing with every pair ``<= T``; ``x > T / 2``): at least as
    many replicas carry ``<= t = T - x`` as carry ``>= x``. Each expert either supplies (all its
    replicas ``<= t``: ``c = max(a, ceil(w / t))`` of them), stays neutral (its fewest replicas
    ``n`` below ``x``) or demands (its fewest replicas ``a = ceil(w / T)``, all ``>= x``). With
    ``S`` replicas in all, supplies minus demands is ``S - (neutral replicas + 2 demands)``, so
    feasible counts need ``sum obj <= S`` and ``sum use <= S``; both hold only if
    ``sum min(obj + mu use) <= S (1 + mu)`` for every ``mu >= 0`` of ``mus [M]``, which the experts
    minimise one at a time. Every count is rounded to the cheaper side, so a feasible target is
    never rejected. ``desc [E']`` the positive loads, decreasing; ``zeros`` the number of zero
    loads; ``totals [M]`` scratch."""
    t = target - x
    for m in range(mus.shape[0]):
        totals[m] = 0.0
    e = 0
    while e < desc.shape[0] and desc[e] > t:
        w = desc[e]
        a = max(1.0, np.ceil(w / target * (1.0 - 1e-12)))
        sup = max(a, np.ceil(w / t * (1.0 - 1e-12))) if t > 0.0 else np.inf
        n = max(a, np.floor(w / x) + 1.0)
        for m in range(mus.shape[0]):
            mu = mus[m]
            best = mu * sup
            if n < sup:
                best = min(best, n * (1.0 + mu))
            if a < n:
                best = min(best, a * (2.0 + mu))
            totals[m] += best
        e += 1
    suppliers = desc.shape[0] - e + zeros  # one replica each, already <= t
    for m in range(mus.shape[0]):
        if totals[m] + suppliers * mus[m] > num_slots * (1.0 + mus[m]) * (1.0 + 1e-12):
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pairs_infeasible(desc, zeros, num_slots, target, mus, totals):
    """Whether some level ``x`` (a replica load ``w_e / r`` in ``(T / 2, T]``) proves that no
    replica counts pair under ``target`` (:func:`_level_infeasible`); ``desc [E']`` decreasing."""
    e = 0
    while e < desc.shape[0] and desc[e] > 0.5 * target:
        r = max(1.0, np.ceil(desc[e] / target * (1.0 - 1e-12)))
        while desc[e] / r > 0.5 * target:
            x = desc[e] / r
            if x <= target and _level_infeasible(desc, zeros, num_slots, target, x, mus, totals):
                return True
            r += 1.0
        e += 1
    return False


@njit(cache=True, nogil=True, error_model="numpy")
def pair_level_bound(desc, lower, upper, num_slots, mus):
    """A lower bound on the max GPU load when every GPU holds exactly two replicas, per layer.

    The smallest target ``T`` that no level's test (:func:`_pairs_infeasible`) rejects, bisected
    between ``lower`` and ``upper``: below it no replica counts can be paired with every pair
    ``<= T``. It holds for every placement (two replicas of an expert on one GPU included), so
    for hierarchical ones too.

    Args:
        desc: ``[L, E]`` float64 non-negative loads, each row decreasing; lower: ``[L]`` valid
            bounds (the search starts there); upper: ``[L]`` achievable max loads (e.g. a plan's);
            num_slots: ``S = 2 G``; mus: ``[M]`` float64 multipliers (:data:`PAIR_MULTIPLIERS`).
    Returns:
        ``[L]`` float64, never below ``lower``; a target proven infeasible, shaded down by 1e-9.
    """
    num_layers, num_experts = desc.shape
    out = lower.copy()
    totals = np.empty(mus.shape[0])
    for layer in range(num_layers):
        lo, hi = lower[layer], upper[layer]
        if not lo > 0.0 or not hi > lo:
            continue
        n = 0
        while n < num_experts and desc[layer, n] > 0.0:
            n += 1
        positive = desc[layer, :n]
        zeros = num_experts - n
        if not _pairs_infeasible(positive, zeros, num_slots, lo, mus, totals):
            continue
        while hi - lo > 1e-7 * hi:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if _pairs_infeasible(positive, zeros, num_slots, mid, mus, totals):
                lo = mid
            else:
                hi = mid
        out[layer] = max(lower[layer], lo * (1.0 - 1e-9))
    return out


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _sorted_peak(values, counts, order, num_pairs):
    """The sorted pairing's heaviest pair for experts ``order [E]`` (by decreasing ``values [E]``,
    ``counts [E]`` replicas each): ``(peak, heavy expert, light expert, pairs at the peak)`` of the
    first heaviest pair (pairs within a relative 1e-12 of the peak count as at it)."""
    p, q = 0, order.shape[0] - 1
    left_p, left_q = counts[order[p]], counts[order[q]]
    peak, heavy, light, at_peak = -1.0, -1, -1, 0
    done = 0
    while done < num_pairs:
        take = min(left_p, left_q, num_pairs - done)
        pair = values[order[p]] + values[order[q]]
        if pair > peak * (1.0 + 1e-12):
            peak, heavy, light, at_peak = pair, order[p], order[q], take
        elif pair >= peak * (1.0 - 1e-12):
            at_peak += take
        done += take
        left_p -= take
        left_q -= take
        if left_p == 0 and p + 1 < order.shape[0]:
            p += 1
            left_p = counts[order[p]]
        if left_q == 0 and q > 0:
            q -= 1
            left_q = counts[order[q]]
    return peak, heavy, light, at_peak


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _reorder(order, values, moved, out):
    """``out [E]``: ``order [E]`` (decreasing ``values``, ties by expert id) with expert ``moved``
    taken out and put back where its (new) value belongs."""
    n = 0
    placed = False
    v = values[moved]
    for i in range(order.shape[0]):
        e = order[i]
        if e == moved:
            continue
        if not placed and (values[e] < v or (values[e] == v and e > moved)):
            out[n] = moved
            n += 1
            placed = True
        out[n] = e
        n += 1
    if not placed:
        out[n] = moved


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _capped_counts(w, num_slots, cap, counts):
    """D'Hondt replication of ``w [E]`` with at most ``cap`` replicas an expert, into ``counts [E]``
    (the first expert on ties)."""
    num_experts = w.shape[0]
    for e in range(num_experts):
        counts[e] = 1
    for _ in range(num_slots - num_experts):
        best, best_load = -1, -1.0
        for e in range(num_experts):
            if counts[e] < cap and w[e] / counts[e] > best_load:
                best, best_load = e, w[e] / counts[e]
        if best < 0:
            break
        counts[best] += 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _removal_candidates(w, counts, skip, out):
    """``out [m]``: the experts other than ``skip`` with several replicas whose replica load grows
    least when one is taken away (smallest ``w / (count - 1)``), fewest first; -1 where none."""
    m = out.shape[0]
    keys = np.full(m, np.inf)
    out[:] = -1
    for e in range(w.shape[0]):
        if e == skip or counts[e] < 2:
            continue
        key = w[e] / (counts[e] - 1)
        if key >= keys[m - 1]:
            continue
        i = m - 1
        while i > 0 and keys[i - 1] > key:
            keys[i] = keys[i - 1]
            out[i] = out[i - 1]
            i -= 1
        keys[i] = key
        out[i] = e


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _try_move(w, counts, values, order, add, remove, scratch, num_pairs):
    """The sorted pairing's peak and pairs at it once one replica moves from ``remove`` to ``add``; the counts,
    values and ``order`` are left as they were (``scratch [2, E]`` int64 is overwritten)."""
    counts[add] += 1
    counts[remove] -= 1
    values[add] = w[add] / counts[add]
    values[remove] = w[remove] / counts[remove]
    _reorder(order, values, add, scratch[0])
    _reorder(scratch[0], values, remove, scratch[1])
    peak, _, _, at_peak = _sorted_peak(values, counts, scratch[1], num_pairs)
    counts[add] -= 1
    counts[remove] += 1
    values[add] = w[add] / counts[add]
    values[remove] = w[remove] / counts[remove]
    return peak, at_peak


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def descend_counts(w, counts, cap, max_moves, removals):
    """Move single replicas between experts while the sorted pairing's peak drops (or stays, with
    fewer pairs at it: a plateau of equal pairs is left one pair at a time): each round,
    one more replica for an expert of the heaviest pair (its heavy or its light side), one fewer
    for one of ``removals`` experts that lose least; the best move, until none helps or
    ``max_moves`` rounds. ``counts [E]`` is updated; returns the peak."""
    num_experts = w.shape[0]
    num_pairs = int(counts.sum()) // 2
    values = w / counts
    order = np.argsort(-values, kind="mergesort")
    peak, heavy, light, at_peak = _sorted_peak(values, counts, order, num_pairs)
    scratch = np.empty((2, num_experts), np.int64)
    candidates = np.empty(removals, np.int64)
    sides = np.empty(2, np.int64)
    for _ in range(max_moves):
        best, best_count, best_add, best_remove = peak, at_peak, -1, -1
        sides[0], sides[1] = heavy, light
        for s in range(2):
            add = sides[s]
            if counts[add] >= cap or (s == 1 and light == heavy):
                continue
            _removal_candidates(w, counts, add, candidates)
            for c in range(removals):
                if candidates[c] < 0:
                    break
                moved, count = _try_move(w, counts, values, order, add, candidates[c], scratch, num_pairs)
                if moved < best * (1.0 - 1e-12) or (moved <= best * (1.0 + 1e-12) and count < best_count):
                    best, best_count, best_add, best_remove = moved, count, add, candidates[c]
        if best_add < 0:
            break
        counts[best_add] += 1
        counts[best_remove] -= 1
        values[best_add] = w[best_add] / counts[best_add]
        values[best_remove] = w[best_remove] / counts[best_remove]
        _reorder(order, values, best_add, scratch[0])  # the argsort's order (ties by id), kept
        _reorder(scratch[0], values, best_remove, order)
        peak, heavy, light, at_peak = _sorted_peak(values, counts, order, num_pairs)
    return peak


@njit(cache=True, nogil=True, error_model="numpy")
def pair_search(weights, num_slots, cap, max_moves, removals):
    """Replica counts for GPUs of two slots each, per layer: D'Hondt's capped at ``cap`` replicas an
    expert, then single replica moves while the sorted pairing's peak drops (:func:`descend_counts`).

    Args:
        weights: ``[L, E]`` float64 non-negative loads; num_slots: ``S`` (even, ``>= E``);
        cap: most replicas an expert may get; max_moves: most rounds of moves per layer;
        removals: experts tried as the donor of a move each round.
    Returns:
        ``(counts [L, E] int64, peaks [L] float64)``: the counts and their sorted pairing's peak.
    """
    num_layers, num_experts = weights.shape
    counts = np.empty((num_layers, num_experts), np.int64)
    peaks = np.zeros(num_layers)
    for layer in range(num_layers):
        w = weights[layer]
        _capped_counts(w, num_slots, cap, counts[layer])
        peaks[layer] = descend_counts(w, counts[layer], cap, max_moves, removals)
    return counts, peaks


@njit(cache=True, nogil=True, error_model="numpy")
def capped_counts(desc, num_slots, cap):
    """D'Hondt replication with at most ``cap`` replicas an expert, per layer.

    Args:
        desc: ``[L, E]`` float64 non-negative loads, each row decreasing; num_slots: ``S >= E``
            (at most ``E cap``); cap: most replicas an expert may get.
    Returns:
        ``[L, E]`` int64 replica counts summing to ``S`` per layer.
    """
    num_layers, num_experts = desc.shape
    counts = np.empty((num_layers, num_experts), np.int64)
    for layer in range(num_layers):
        _capped_counts(desc[layer], num_slots, cap, counts[layer])
    return counts


@njit(cache=True, nogil=True, error_model="numpy")
def sorted_pairings(weights, counts, num_gpus):
    """The sorted pairing of each layer's replicas as ``phy2log`` rows (GPU ``g`` holds slots
    ``2g, 2g + 1``: the ``g``-th heaviest replica and the ``g``-th lightest). Replicas are ordered
    by decreasing load, then by copy number, then by expert, so a block of equal loads alternates
    experts.

    Args:
        weights: ``[L, E]`` float64 non-negative loads; counts: ``[L, E]`` int64 replica counts,
            each row summing to ``2 num_gpus``.
    Returns:
        ``(rows [L, 2 G] int64, doubled [L] bool)``: whether some GPU of the row holds one expert twice.
    """
    num_layers, num_experts = weights.shape
    num_slots = 2 * num_gpus
    rows = np.empty((num_layers, num_slots), np.int64)
    doubled = np.zeros(num_layers, np.bool_)
    experts = np.empty(num_slots, np.int64)
    keys = np.empty(num_slots)
    for layer in range(num_layers):
        n = 0
        copy = 0
        while n < num_slots:  # (copy, expert) order; the stable sort below keeps it among equal loads
            for e in range(num_experts):
                if counts[layer, e] > copy and n < num_slots:
                    experts[n] = e
                    keys[n] = -weights[layer, e] / counts[layer, e]
                    n += 1
            copy += 1
        order = np.argsort(keys, kind="mergesort")
        for g in range(num_gpus):
            heavy, light = experts[order[g]], experts[order[num_slots - 1 - g]]
            rows[layer, 2 * g], rows[layer, 2 * g + 1] = heavy, light
            if heavy == light:
                doubled[layer] = True
    return rows, doubled
