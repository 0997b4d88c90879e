"""The head-companion bound: every GPU holds exactly ``k`` replicas, so each replica too heavy to
share its GPU with another heavy one brings ``k - 1`` light companions, and light replicas are few.

For a target max load ``T`` and a threshold ``theta >= T / 2``, call a replica *big* when it weighs
more than ``theta``: no two big replicas share a GPU (their sum exceeds ``T``), and every other
replica on a big one's GPU (a *companion*) weighs less than ``tau = T - theta``. The ``B`` GPUs
holding the big replicas carry them and ``(k - 1) B`` distinct companions, so
``sum(big) + sum((k - 1) B lightest companions) <= B T``. For any ``lam >= 0`` the ``q`` lightest of
a set weigh at least ``q lam - sum over the set of (lam - c)^+``, which makes the condition a sum
over replicas of ``phi(s)``: ``s - T + (k - 1) lam`` for a big replica, ``-(lam - s)^+`` for a
replica lighter than ``tau``, 0 otherwise; it must be ``<= 0``. A replication ``r`` (``sum r = S``)
adds ``r_e phi(w_e / r_e)`` per expert; a price ``mu`` per replica (Lagrange) makes the smallest
sum a minimum per expert, ``L(mu) = sum_e min_r r (phi(w_e / r) + mu) - mu S``, no larger than the
smallest sum over every replication. ``L(mu) > 0`` for some ``mu`` proves no placement reaches ``T``.

``L`` is found at its maximum exactly, with a few operations per expert heavier than ``theta``. For
``mu >= lam`` an expert at most ``theta`` keeps one replica (its ``r phi(w / r) + mu r`` only grows
with ``r``), and a heavier one's cheapest count is one of five (:data:`CANDIDATES`): on the counts
with replicas above ``theta`` the value is linear in ``r``, then ``mu r``, then nondecreasing. As
``mu`` falls, each heavy expert's cheapest count grows at a few prices (the breaks of the lower
envelope of its five lines); ``L`` is concave with slope ``sum r - S``, so it peaks at the highest
price where the counts, sorted by price, reach ``S``. A threshold at or above the heaviest replica of
D'Hondt's replication is skipped: that replication has no big replica, so ``L <= 0`` there (when
``T / 2`` is, no threshold is left: Zipf 0.5 at 288 / 72 and 384 / 128). The same targets are
proven as with a search over ``mu`` (bit-identical bounds on 58-layer synthetic families at 3 and 4
slots a GPU), at ~1 ms per model where nothing is proven and ~30 ms on Zipf 1.0 at 288 / 72.

Where the default placement is far from the other bounds at 4 slots a GPU (one expert with 16% of a
layer's tokens, Zipf 1.0 at 288 slots / 72 GPUs), the heavy replicas outnumber the light experts
that can sit beside them: the bound rises by 5-8% there, to within 0.1-1.5% of ``method="best"``.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL

CANDIDATES = 5
"""Replica counts tried per big expert: 1, the most with replicas above ``theta``, the next one, the
fewest with replicas below ``tau``, and the most replicas (module docstring: the minimum of
``r phi(w / r) + mu r`` over every count, for ``mu >= lam``, is at one of them)."""

MARGIN = 1e-9
"""What ``L(mu)`` must exceed, relative to ``T S``, to prove a target unreachable: far above the
rounding of a sum of ``S`` terms of size ``T``."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _piece_value(w, r, target, theta, tau, lam, k):
    """``r phi(w / r)`` for ``r`` replicas of an expert of load ``w`` (module docstring)."""
    s = w / r
    if s > theta:
        return r * (s - target + (k - 1) * lam)
    if s < tau:
        return -r * max(lam - s, 0.0)
    return 0.0


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _count_above(desc, x, strict):
    """How many of the decreasing loads ``desc [E]`` are ``> x`` (``strict``) or ``>= x``."""
    lo = 0
    hi = desc.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if desc[mid] > x or (not strict and desc[mid] == x):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _candidates(desc, big, most, target, theta, lam, k, reps, values):
    """Fill ``reps [E, CANDIDATES]`` (int64) and ``values [E, CANDIDATES]`` (float64) for the
    ``big`` experts of ``desc [E]`` heavier than ``theta``: the counts of :data:`CANDIDATES` in
    ``[1, most]`` (found with the comparisons :func:`_piece_value` makes) and their values."""
    tau = target - theta
    for e in range(big):
        w = desc[e]
        r1 = int(min(max(np.ceil(w / theta) - 1.0, 1.0), float(most)))  # the most with w / r > theta
        while r1 > 1 and not w / r1 > theta:
            r1 -= 1
        while r1 < most and w / (r1 + 1) > theta:
            r1 += 1
        r2 = int(min(max(np.floor(w / tau), float(r1)), float(most)))  # the most with w / r >= tau
        while r2 > r1 and not w / r2 >= tau:
            r2 -= 1
        while r2 < most and w / (r2 + 1) >= tau:
            r2 += 1
        reps[e, 0] = 1
        reps[e, 1] = r1
        reps[e, 2] = min(r1 + 1, most)
        reps[e, 3] = min(r2 + 1, most)
        reps[e, 4] = most
        for j in range(CANDIDATES):
            values[e, j] = _piece_value(w, float(reps[e, j]), target, theta, tau, lam, k)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _transitions(reps, values, e, lam, moves, count):
    """Append to ``moves [2, n]`` (prices, replicas added) the prices above ``lam`` at which expert
    ``e``'s cheapest count (of ``value + mu r``) grows, as ``mu`` falls; returns the new count."""
    current = 0  # reps[e, 0] = 1, the cheapest for a high price
    while True:
        best = -1
        best_price = lam
        for j in range(CANDIDATES):
            if reps[e, j] <= reps[e, current]:
                continue
            price = (values[e, current] - values[e, j]) / (reps[e, j] - reps[e, current])
            if price > best_price or (price == best_price and best >= 0 and reps[e, j] > reps[e, best]):
                best = j
                best_price = price
        if best < 0:
            return count
        moves[0, count] = best_price
        moves[1, count] = reps[e, best] - reps[e, current]
        count += 1
        current = best


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _best_price(moves, count, need, lam):
    """The ``mu >= lam`` maximizing the concave ``L``: the highest price at which the replicas
    added by the transitions ``moves [2, count]`` at or above it reach ``need``, else ``lam``
    (sorts ``moves[:, :count]`` by decreasing price, in place)."""
    for i in range(1, count):  # insertion sort: a few transitions
        price = moves[0, i]
        step = moves[1, i]
        j = i
        while j > 0 and moves[0, j - 1] < price:
            moves[0, j] = moves[0, j - 1]
            moves[1, j] = moves[1, j - 1]
            j -= 1
        moves[0, j] = price
        moves[1, j] = step
    added = 0.0
    for i in range(count):
        added += moves[1, i]
        if added >= need:
            return moves[0, i]
    return lam


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _proves(desc, suffix, target, theta, lam, k, num_slots, work):
    """Whether ``max over mu >= lam of L(mu) > MARGIN T S`` (ties make ``L`` exactly 0, which
    rounding can turn into a hair above), the maximum found exactly: the experts at most ``theta``
    keep one replica (their cheapest for ``mu >= lam``), each big one's cheapest count falls at a
    few prices, and ``L`` peaks where the replicas reach ``S``. ``suffix [E + 1]``:
    ``suffix[i] = sum(desc[i:])``; ``work``: ``(reps, values, moves)`` scratch."""
    reps, values, moves = work
    num_experts = desc.shape[0]
    big = _count_above(desc, theta, True)
    if big == 0:
        return False
    below = _count_above(desc, lam, False)  # the experts from here on are lighter than lam
    constant = -(lam * (num_experts - below) - suffix[below])
    most = num_slots - num_experts + 1
    _candidates(desc, big, most, target, theta, lam, k, reps, values)
    count = 0
    for e in range(big):
        count = _transitions(reps, values, e, lam, moves, count)
    mu = _best_price(moves, count, float(num_slots - num_experts), lam)
    total = constant + mu * (num_experts - big - num_slots)
    for e in range(big):
        best = np.inf
        for j in range(CANDIDATES):
            best = min(best, values[e, j] + mu * reps[e, j])
        total += best
    return total > MARGIN * target * num_slots


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _infeasible(desc, suffix, target, k, num_slots, grid, replica, work, hint):
    """The pair ``(i, j)`` (as ``i grid + j - 1``) of a threshold ``theta = T / 2 + (T / 2) i / grid``
    and ``lam = tau j / grid`` (``i < grid``, ``1 <= j <= grid``) that proves no placement reaches
    ``target``, or -1; the pairs are tried from ``hint`` on (the last one that proved). Thresholds
    at or above ``replica`` (a replication's heaviest replica, :func:`head_companion_bound`) are
    skipped: that replication has no replica above them, so ``L <= 0``."""
    pairs = grid * grid
    for n in range(pairs):
        index = (hint + n) % pairs
        i = index // grid
        j = index % grid + 1
        theta = 0.5 * target + 0.5 * target * i / grid
        if theta >= replica:
            continue
        tau = target - theta
        if _proves(desc, suffix, target, theta, tau * j / grid, k, num_slots, work):
            return index
    return -1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _no_big_target(desc, num_slots):
    """The smallest ``T`` (to 1e-9) at which some replication keeps every replica ``<= T / 2``:
    there no threshold ``theta >= T / 2`` has a big replica, and the bound cannot prove more."""
    num_experts = desc.shape[0]
    lo = 0.0
    hi = 2.0 * desc[0]
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        need = 0
        for e in range(num_experts):
            need += max(1, int(np.ceil(2.0 * desc[e] / mid))) if mid > 0.0 else num_slots + 1
            if need > num_slots:
                break
        if need <= num_slots:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


@njit(cache=True, nogil=True, error_model="numpy")
def head_companion_bound(sorted_desc, lower, replica, num_slots, slots_per_gpu, grid, tolerance):
    """The largest ``T`` the head-companion condition proves unreachable (module docstring), per
    layer, searched upward from ``lower`` (bisection to ``tolerance`` relative).

    Args:
        sorted_desc: ``[L, E]`` float64, each row in decreasing order; lower: ``[L]`` valid bounds;
        replica: ``[L]`` the heaviest replica of a replication of each layer into ``S`` replicas
        (D'Hondt's: :func:`eplb.kernels.bounds.load_bounds.min_max_replica_load`);
        num_slots: ``S >= E``; slots_per_gpu: ``k >= 2``, the same on every GPU with slots;
        grid: thresholds and ``lam`` values tried per target (``grid`` each); tolerance: relative.
    Returns:
        ``[L]`` float64, never below ``lower``; a proven value, shaded down by 1e-9.
    """
    num_layers, num_experts = sorted_desc.shape
    out = lower.copy()
    work = (np.empty((num_experts, CANDIDATES), np.int64), np.empty((num_experts, CANDIDATES)),
            np.empty((2, num_experts * CANDIDATES)))
    suffix = np.zeros(num_experts + 1)
    for layer in range(num_layers):
        desc = sorted_desc[layer]
        lo = lower[layer]
        if num_experts == 0 or desc[0] <= 0.0 or lo <= 0.0:
            continue
        first = lo * (1.0 + tolerance)
        if 0.5 * first >= replica[layer]:  # every threshold is skipped: nothing to prove
            continue
        for e in range(num_experts - 1, -1, -1):
            suffix[e] = suffix[e + 1] + desc[e]
        hint = _infeasible(desc, suffix, first, slots_per_gpu, num_slots, grid, replica[layer], work, 0)
        if hint < 0:
            continue
        hi = _no_big_target(desc, num_slots)
        if hi <= first:
            continue
        lo = first
        while hi - lo > tolerance * lo:
            mid = 0.5 * (lo + hi)
            proved = _infeasible(desc, suffix, mid, slots_per_gpu, num_slots, grid, replica[layer], work,
                                 hint)
            if proved >= 0:
                lo = mid
                hint = proved
            else:
                hi = mid
        out[layer] = max(lower[layer], lo * (1.0 - 1e-9))
    return out
