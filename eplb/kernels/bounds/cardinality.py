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

Where the default placement is far from the other bounds at 4 slots a GPU (one expert with 16% of a
layer's tokens, Zipf 1.0 at 288 slots / 72 GPUs), the heavy replicas outnumber the light experts
that can sit beside them: the bound rises by 5-8% there, to within 0.1-1.5% of ``method="best"``.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL

CANDIDATES = 14
"""Replica counts tried per heavy expert: the ends of the pieces on which ``r phi(w / r)`` is linear
in ``r`` (each with its neighbours, against rounding), 1 and the most replicas."""

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
def _candidates(desc, heavy, most, target, theta, lam, k, reps, values):
    """Fill ``reps [H, CANDIDATES]`` (int64) and ``values [H, CANDIDATES]`` (float64) for the
    ``heavy`` heaviest experts of ``desc [E]``: replica counts in ``[1, most]`` holding every end of
    the linear pieces of ``r phi(w / r)``, and their values, so that the minimum over them of
    ``value + mu r`` is the minimum over every count."""
    tau = target - theta
    for e in range(heavy):
        w = desc[e]
        ends = (np.ceil(w / theta) - 1.0, np.floor(w / tau), np.floor(w / lam) if lam > 0.0 else 0.0)
        reps[e, 0] = 1
        reps[e, 1] = most
        n = 2
        for x in ends:
            base = int(min(max(x, -2.0), float(most)))
            for d in range(-1, 3):
                reps[e, n] = min(max(base + d, 1), most)
                n += 1
        for j in range(CANDIDATES):
            values[e, j] = _piece_value(w, float(reps[e, j]), target, theta, tau, lam, k)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _lagrangian(reps, values, heavy, light_count, light_value, mu, num_slots):
    """``L(mu)``: the heavy experts' smallest ``value + mu r`` each, the light ones at one replica
    each (``light_value + mu light_count``, their minimum when ``mu >= lam``), minus ``mu S``."""
    total = light_value + mu * light_count - mu * num_slots
    for e in range(heavy):
        best = np.inf
        for j in range(CANDIDATES):
            best = min(best, values[e, j] + mu * reps[e, j])
        total += best
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _proves(desc, suffix, target, theta, lam, k, num_slots, reps, values):
    """Whether ``L(mu) > 0`` for some ``mu`` in ``[lam, target]`` (golden-section search: ``L`` is
    concave), by more than :data:`MARGIN` ``T S`` (ties make ``L`` exactly 0, which rounding can
    turn into a hair above). ``suffix [E + 1]``: ``suffix[i] = sum(desc[i:])``."""
    num_experts = desc.shape[0]
    tau = target - theta
    heavy = 0  # experts of load >= tau: the others are companions at one replica
    while heavy < num_experts and desc[heavy] >= tau:
        heavy += 1
    below = heavy  # the light experts lighter than lam
    while below < num_experts and desc[below] >= lam:
        below += 1
    light_value = -(lam * (num_experts - below) - suffix[below])
    most = num_slots - num_experts + 1
    _candidates(desc, heavy, most, target, theta, lam, k, reps, values)
    light_count = num_experts - heavy
    lo = lam
    hi = max(lam, target)
    ratio = 0.5 * (np.sqrt(5.0) - 1.0)
    a = hi - ratio * (hi - lo)
    b = lo + ratio * (hi - lo)
    fa = _lagrangian(reps, values, heavy, light_count, light_value, a, num_slots)
    fb = _lagrangian(reps, values, heavy, light_count, light_value, b, num_slots)
    margin = MARGIN * target * num_slots
    for _ in range(40):
        if fa > margin or fb > margin:
            return True
        if fa < fb:
            lo = a
            a = b
            fa = fb
            b = lo + ratio * (hi - lo)
            fb = _lagrangian(reps, values, heavy, light_count, light_value, b, num_slots)
        else:
            hi = b
            b = a
            fb = fa
            a = hi - ratio * (hi - lo)
            fa = _lagrangian(reps, values, heavy, light_count, light_value, a, num_slots)
    return fa > margin or fb > margin


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _infeasible(desc, suffix, target, k, num_slots, grid, reps, values, hint):
    """The pair ``(i, j)`` (as ``i grid + j - 1``) of a threshold ``theta = T / 2 + (T / 2) i / grid``
    and ``lam = tau j / grid`` (``i < grid``, ``1 <= j <= grid``) that proves no placement reaches
    ``target``, or -1; the pairs are tried from ``hint`` on (the last one that proved)."""
    pairs = grid * grid
    for n in range(pairs):
        index = (hint + n) % pairs
        i = index // grid
        j = index % grid + 1
        theta = 0.5 * target + 0.5 * target * i / grid
        tau = target - theta
        if _proves(desc, suffix, target, theta, tau * j / grid, k, num_slots, reps, values):
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
def head_companion_bound(sorted_desc, lower, num_slots, slots_per_gpu, grid, tolerance):
    """The largest ``T`` the head-companion condition proves unreachable (module docstring), per
    layer, searched upward from ``lower`` (bisection to ``tolerance`` relative).

    Args:
        sorted_desc: ``[L, E]`` float64, each row in decreasing order; lower: ``[L]`` valid bounds;
        num_slots: ``S >= E``; slots_per_gpu: ``k >= 2``, the same on every GPU with slots;
        grid: thresholds and ``lam`` values tried per target (``grid`` each); tolerance: relative.
    Returns:
        ``[L]`` float64, never below ``lower``; a proven value, shaded down by 1e-9.
    """
    num_layers, num_experts = sorted_desc.shape
    out = lower.copy()
    reps = np.empty((num_experts, CANDIDATES), np.int64)
    values = np.empty((num_experts, CANDIDATES))
    suffix = np.zeros(num_experts + 1)
    for layer in range(num_layers):
        desc = sorted_desc[layer]
        lo = lower[layer]
        if num_experts == 0 or desc[0] <= 0.0 or lo <= 0.0:
            continue
        for e in range(num_experts - 1, -1, -1):
            suffix[e] = suffix[e + 1] + desc[e]
        hi = _no_big_target(desc, num_slots)
        first = lo * (1.0 + tolerance)
        if hi <= first:
            continue
        hint = _infeasible(desc, suffix, first, slots_per_gpu, num_slots, grid, reps, values, 0)
        if hint < 0:
            continue
        lo = first
        while hi - lo > tolerance * lo:
            mid = 0.5 * (lo + hi)
            proved = _infeasible(desc, suffix, mid, slots_per_gpu, num_slots, grid, reps, values, hint)
            if proved >= 0:
                lo = mid
                hint = proved
            else:
                hi = mid
        out[layer] = max(lower[layer], lo * (1.0 - 1e-9))
    return out
