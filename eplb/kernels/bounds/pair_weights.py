"""The weighting bound for GPUs of exactly two replicas each (``k = 2``): one price per level, all
levels at once.

A GPU is a pair of replicas. For a target ``T`` and any level ``x > 0`` give a replica of load
``v`` the weight ``g_x(v) = [v > T - x] + [v >= x]`` (0, 1 or 2). A pair ``a + b <= T`` weighs at
most 2: if ``a >= x`` then ``b <= T - x`` weighs 0, and otherwise both weigh at most 1. So does any
mixture ``phi = sum_x mu_x g_x`` with ``mu >= 0, sum mu = 1``, and the ``S = 2 G`` replicas of a
placement under ``T`` weigh at most ``S`` in all. A replication ``r`` (``r_e >= 1``, ``sum r = S``)
weighs ``sum_e r_e phi(w_e / r_e)``; a price ``lam >= 0`` per replica (Lagrange) makes the lightest
replication a minimum per expert:

    F(mu, lam) = sum_e min_r r (phi(w_e / r) + lam) - S (1 + lam) <= (lightest weight) - S.

``F > 0`` for some ``(mu, lam)`` proves that no placement reaches ``T``. The best ``(mu, lam)`` is
the dual of the linear relaxation of the replica-count problem (Hall's condition at every level,
:mod:`eplb.planning.methods.exact_pair_counts`), which is within 0.01% of the optimum on most layers
of DeepSeek's decode unit (288 slots / 144 GPUs) where the one-level test of
:mod:`eplb.kernels.bounds.pairs` is about 1% below it. ``F`` is concave; an exponentiated
subgradient ascent over the levels and the price (:func:`_ascend`, the subgradient of a level is
how much the cheapest replication breaks Hall's condition there) finds a proof in a few hundred
steps on those layers. Any ``(mu, lam)`` it stops at is a valid certificate, converged or not.
The cheapest replication at each step's prices (:func:`ascent_step`) is also a start for the count
search of :mod:`eplb.kernels.bounds.pair_starts`.

The levels are the replica loads ``w_e / r`` in ``(T / 2, T]`` (where Hall's condition can bind);
an expert's cheapest count is the fewest of each run of counts with the same weight, so its
candidates are its fewest feasible count and the counts where ``w / r`` crosses a level ``x``
or ``T - x`` (:func:`_options`).
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL

MARGIN = 1e-12
"""Relative slack on every rounding-sensitive comparison, always toward a weaker test."""

STEP_DECAY = 20.0
"""The ascent's step halves after this many steps, thirds after twice as many, ... (best's plans at
288 / 144, the first 16 layers, 400 steps a test: lognormal / Zipf 0.5 mean gaps 0.345 / 0.936% with
steps falling as ``1 / sqrt(t)``, 0.336 / 0.809% with this, 0.315 / 0.678% with 3,000 steps)."""

GIVE_UP = 0.01
"""A test stops after a quarter of its steps when the best ``F`` so far is below ``-GIVE_UP S``
(six lognormal layers, a quarter of 400 steps: ``F / S`` above -0.003 at 288 / 144 on every target
that was later proven or came close, below -0.025 at 512 / 256, where nothing is ever proven)."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _levels(desc, target, out):
    """The replica loads ``w / r`` in ``(T / 2, T]`` of the experts ``desc [E']`` (decreasing),
    increasing, into ``out`` (at most its length); returns how many."""
    n = 0
    for e in range(desc.shape[0]):
        w = desc[e]
        if w <= 0.5 * target:
            break
        r = max(1.0, np.ceil(w / target * (1.0 - MARGIN)))
        while w / r > 0.5 * target and n < out.shape[0]:
            if w / r <= target:
                out[n] = w / r
                n += 1
            r += 1.0
    out[:n].sort()
    return n


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _options(desc, most, target, levels, counts, above, below, first):
    """Each expert's candidate counts for :func:`_ascend`: ``counts [n]`` (the fewest with every
    replica ``<= T``, then each count where ``w / r`` drops below a level ``x`` or to ``T - x``, up
    to ``most``), ``above [n]`` the levels ``<= w / r`` and ``below [n]`` the levels
    ``<= T - w / r`` (so ``phi = P[above] + 1 - P[below]`` with ``P`` the prefix sums of ``mu``),
    ``first [E' + 1]`` where each expert's run starts. Returns the number of candidates, or -1
    when some expert cannot stay under ``T`` with ``most`` replicas (``T`` is then unreachable)."""
    num_levels = levels.shape[0]
    marks = np.empty(2 * num_levels + 1)
    n = 0
    for e in range(desc.shape[0]):
        w = desc[e]
        first[e] = n
        fewest = max(1.0, np.ceil(w / target * (1.0 - MARGIN)))
        if w / fewest > target * (1.0 + MARGIN):
            fewest += 1.0
        if fewest > most:
            return -1
        m = 0
        marks[m] = fewest
        m += 1
        for j in range(num_levels):
            drop = np.floor(w / levels[j]) + 1.0  # the fewest with w / r < x
            if fewest < drop <= most:
                marks[m] = drop
                m += 1
            room = target - levels[j]
            if room > 0.0:
                under = np.ceil(w / room * (1.0 - MARGIN))  # the fewest with w / r <= T - x
                if fewest < under <= most:
                    marks[m] = under
                    m += 1
        marks[:m].sort()
        for i in range(m):
            if i > 0 and marks[i] == marks[i - 1]:
                continue
            v = w / marks[i]
            counts[n] = int(marks[i])
            above[n] = np.searchsorted(levels, v, side="right")
            below[n] = np.searchsorted(levels, target * (1.0 + MARGIN) - v, side="right")
            n += 1
    first[desc.shape[0]] = n
    return n


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def candidates(desc, idle, num_slots, target, levels):
    """:func:`_levels` and :func:`_options` for ``desc [E']`` (positive loads, decreasing; ``idle``
    zero loads besides) under ``target``: ``(num_levels, counts, above, below, first)``, the
    candidate arrays cut to their length; ``num_levels`` is 0 where no level exists and -1 where
    ``target`` is out of reach whatever the counts. ``levels [M]`` scratch (``M >= G + E``)."""
    num_levels = _levels(desc, target, levels)
    size = desc.shape[0] * (2 * num_levels + 1)
    counts = np.empty(size, np.int64)
    above = np.empty(size, np.int64)
    below = np.empty(size, np.int64)
    first = np.empty(desc.shape[0] + 1, np.int64)
    if num_levels == 0:
        return 0, counts, above, below, first
    most = num_slots - desc.shape[0] - idle + 1
    n = _options(desc, most, target, levels[:num_levels], counts, above, below, first)
    if n < 0:
        return -1, counts, above, below, first
    return num_levels, counts[:n], above[:n], below[:n], first


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def start_weights(num_levels):
    """The ascent's first ``(mu [levels], lam)``: the levels share half, ``lam`` the other."""
    weights = np.full(num_levels + 1, 0.5 / num_levels)
    weights[num_levels] = 0.5
    return weights


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def ascent_step(t, weights, options, idle, num_slots, step, picks, work):
    """Step ``t`` of the ascent of :func:`_ascend` at ``weights [levels + 1]`` (``mu``, then ``lam``;
    moved in place along the subgradient) over the candidates ``options = (counts, above, below,
    first)`` of :func:`candidates`: returns ``(F, replicas used)`` there and puts each expert's
    cheapest candidate (an index into ``counts``) in ``picks [E']``. ``work [3, levels + 1]``
    scratch."""
    counts, above, below, first = options
    prefix, spread, grad = work[0], work[1], work[2]
    num_levels = weights.shape[0] - 1
    prefix[0] = 0.0
    for j in range(num_levels):
        prefix[j + 1] = prefix[j] + weights[j]
    lam, total = weights[num_levels], prefix[num_levels]
    value, used = idle * lam - num_slots * (total + lam), idle
    spread[:] = 0.0
    for e in range(first.shape[0] - 1):
        cheapest, pick = np.inf, first[e]
        for i in range(first[e], first[e + 1]):
            cost = counts[i] * (prefix[above[i]] + total - prefix[below[i]] + lam)
            if cost < cheapest:
                cheapest, pick = cost, i
        picks[e] = pick
        value += cheapest
        r = counts[pick]
        used += r
        spread[0] += r  # r replicas weigh 1 at the levels below `above` and those from `below` on
        spread[above[pick]] -= r
        spread[below[pick]] += r
        spread[num_levels] -= r
    running, scale = 0.0, 0.0
    for j in range(num_levels):
        running += spread[j]
        grad[j] = running - num_slots  # how far the cheapest replication breaks level j
        scale = max(scale, abs(grad[j]))
    grad[num_levels] = used - num_slots
    scale = max(scale, abs(grad[num_levels]), 1.0)
    rate = step / (1.0 + t / STEP_DECAY) / scale
    for j in range(num_levels + 1):
        weights[j] = max(weights[j] * np.exp(rate * grad[j]), 1e-12)
    weights /= weights.sum()
    return value, used


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _ascend(counts, above, below, first, idle, num_slots, num_levels, iterations, step):
    """Whether some ``(mu, lam)`` makes ``F > 0`` (module docstring) for the candidates of
    :func:`_options`; ``idle`` experts carry nothing (one replica each, weight 0). Exponentiated
    subgradient ascent on the simplex of ``(mu [levels], lam)`` (``F`` is homogeneous), the
    subgradient scaled by its largest entry, step ``step / (1 + t / STEP_DECAY)``, at most
    ``iterations`` steps (:data:`GIVE_UP`)."""
    weights = start_weights(num_levels)
    work = np.empty((3, num_levels + 1))
    picks = np.empty(first.shape[0] - 1, np.int64)
    best = -np.inf
    for t in range(iterations):
        value, _ = ascent_step(t, weights, (counts, above, below, first), idle, num_slots, step, picks, work)
        if value > 1e-9 * num_slots:
            return True
        best = max(best, value)
        if t == iterations // 4 and best < -GIVE_UP * num_slots:
            return False
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _unreachable(desc, idle, num_slots, target, iterations, step, levels):
    """Whether the weighting test proves no placement of ``desc [E']`` (positive loads, decreasing;
    ``idle`` zero loads besides) on ``S = num_slots`` slots, two a GPU, reaches ``target``;
    ``levels [M]`` scratch (``M >= G + E`` holds every level: ``T`` is at least the average load)."""
    num_levels, counts, above, below, first = candidates(desc, idle, num_slots, target, levels)
    if num_levels <= 0:
        return num_levels < 0
    return _ascend(counts, above, below, first, idle, num_slots, num_levels, iterations, step)


@njit(cache=True, nogil=True, error_model="numpy")
def pair_weight_bound(desc, lower, upper, num_slots, iterations, step, halvings):
    """A lower bound on the max GPU load when every GPU holds exactly two replicas, per layer: the
    weighting test (module docstring) just above ``lower`` (a quarter of the steps; where it fails
    the layer keeps ``lower``), then just below ``upper`` (a plan's max load: proving it proves the
    plan optimal), then bisection to ``(upper - lower) / 2**halvings``.

    Args:
        desc: ``[L, E]`` float64 non-negative loads, each row decreasing; lower: ``[L]`` valid
            bounds; upper: ``[L]`` achievable max loads; num_slots: ``S = 2 G``; iterations: most
            ascent steps per test; step: the ascent's first step; halvings: bisection steps.
    Returns:
        ``[L]`` float64, never below ``lower``: the largest target proven unreachable.
    """
    num_layers, num_experts = desc.shape
    out = lower.copy()
    levels = np.empty(4 * num_slots)
    for layer in range(num_layers):
        lo, hi = lower[layer], upper[layer]
        if not lo > 0.0 or not hi > lo * (1.0 + 1e-10):
            continue
        n = 0
        while n < num_experts and desc[layer, n] > 0.0:
            n += 1
        positive = desc[layer, :n]
        # a target just above the bound first, with a quarter of the steps: where even that is out
        # of reach (the relaxation is no stronger than the bound: every layer at 512 / 256), stop
        first = lo + (hi - lo) / (1 << halvings)
        if not _unreachable(positive, num_experts - n, num_slots, first, iterations, step, levels):
            continue
        top = hi * (1.0 - 1e-10)  # just below the plan: proving it proves the plan optimal
        if _unreachable(positive, num_experts - n, num_slots, top, iterations, step, levels):
            out[layer] = top
            continue
        lo = first
        for _ in range(halvings - 1):
            mid = 0.5 * (lo + hi)
            if _unreachable(positive, num_experts - n, num_slots, mid, iterations, step, levels):
                lo = mid
            else:
                hi = mid
        out[layer] = max(lower[layer], lo)
    return out
