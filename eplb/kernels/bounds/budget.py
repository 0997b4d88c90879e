"""The tier bound with the slot budget: the heavy experts' replicas, the other experts' replicas and
the fillers of the heavy GPUs all come out of the same ``S`` slots.

The tier bound (:func:`eplb.kernels.bounds.load_bounds.tier_bound`) takes the minimum over the tier's replica
count ``R`` of what the GPUs holding the tier must carry, and lets the other experts split into as
many replicas as the remaining slots allow, so that the fillers of those GPUs can be tiny. When one
expert carries a large share of the load (Zipf 1.5: ~40% on one expert), that minimum is reached
at an ``R`` that leaves the other heavy experts too few replicas, or at fillers split with slots
the heavy experts need: the bound then sits ~2% below the optimum. Here, for a target max load
``T``, the tier needs at least ``R_min(T)`` replicas, the other heavy experts need ``need(T)``
extra replicas to keep every replica ``<= T``, and only the slots left over can split fillers.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, fewest_replicas, lightest_items, shell_sort


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _virtual_experts(desc, first, last, target, virtual, prefix):
    """Cut every expert ``desc[first:last]`` of load ``w`` into its fewest parts ``w / b`` of load
    ``<= target``; write the parts in increasing order into ``virtual`` and their prefix sums into
    ``prefix``. Returns the number of parts."""
    n = 0
    for e in range(last - 1, first - 1, -1):
        b = fewest_replicas(desc[e], target)
        for _ in range(b):
            virtual[n] = desc[e] / b
            n += 1
    shell_sort(virtual[:n])
    prefix[0] = 0.0
    for i in range(n):
        prefix[i + 1] = prefix[i] + virtual[i]
    return n


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _budget_feasible(desc, tier, target, num_slots, active_gpus, min_slots, max_slots, virtual, prefix):
    """Necessary conditions for a max load ``<= target`` with the ``tier`` heaviest experts as the tier.

    Lightest replicas: with every replica ``<= T``, expert ``e`` has at least ``b_e`` replicas
    (the fewest of load ``<= T``), leaving ``F = S - E - sum (b_e - 1)`` free. Any ``m`` replicas
    weigh at least the ``m`` lightest of the *virtual* experts (each expert cut into its ``b_e``
    equal parts) replicated with ``F`` extras (:func:`eplb.kernels.plumbing.common.lightest_items`): equal
    replicas are the heaviest way to split an expert, since the ``j`` smallest of ``N`` values
    summing to ``w`` sum to at most ``j w / N``.

    Cardinality: every replica shares its GPU (``>= k`` slots) with ``k - 1`` others weighing at
    least ``L = lightest(k - 1)``, so every replica is ``<= T - L``: expert ``e`` needs
    ``c_e >= b_e`` replicas, the fewest of load ``<= T - L``.

    Budget: the tier needs ``R >= R_min = sum c_e`` replicas, the other experts ``need =
    sum (c_e - 1)`` extra ones, so ``R <= R_max = S - (E - t) - need``, and the other experts have
    ``f = R_max - R`` replicas beyond their ``c_e``. The ``q`` GPUs holding the tier
    (``ceil(R / k_max) <= q <= min(G, R)``) hold ``q k - R`` of their replicas besides the tier's
    load ``W_t``, weighing at least the lightest of the other experts cut into ``c_e`` parts with
    ``f`` extras: some ``R`` and ``q`` must give ``W_t + lightest(q k - R) <= q T``.

    Args:
        desc: ``[E]`` loads in decreasing order; tier: ``t >= 1``; target: ``T > 0``;
        virtual, prefix: scratch ``[S + 2]`` float64.
    """
    num_experts = desc.shape[0]
    cold = num_experts - tier
    extras = 0
    for e in range(num_experts):
        extras += fewest_replicas(desc[e], target) - 1
        if extras > num_slots - num_experts:
            return False
    n = _virtual_experts(desc, 0, num_experts, target, virtual, prefix)
    cap = target - lightest_items(virtual[:n], prefix[: n + 1], num_slots - num_experts - extras, min_slots - 1, 8)
    if cap <= 0.0:
        return False
    r_min = 0
    hot_load = 0.0
    for e in range(tier):
        r_min += fewest_replicas(desc[e], cap)
        hot_load += desc[e]
    need = 0
    for e in range(tier, num_experts):
        need += fewest_replicas(desc[e], cap) - 1
        if r_min + cold + need > num_slots:
            return False
    r_max = num_slots - cold - need
    n = _virtual_experts(desc, tier, num_experts, cap, virtual, prefix)
    values = virtual[:n]
    for r in range(r_min, r_max + 1):
        free = r_max - r
        q_low = (r + max_slots - 1) // max_slots
        for q in range(min(active_gpus, r), q_low - 1, -1):
            if hot_load + lightest_items(values, prefix[: n + 1], free, q * min_slots - r, 8) <= q * target:
                return True
    return False


@njit(cache=True, nogil=True, error_model="numpy")
def budget_tier_bound(sorted_desc, lower, replica, num_slots, active_gpus, min_slots, max_slots, max_tiers):
    """The smallest max load :func:`_budget_feasible` allows for every tier of the heaviest experts
    (the first ``t`` for ``t = 1 ..`` one more than the experts above the replica bound, at most
    ``max_tiers``), searched upward from ``lower``.

    Args:
        sorted_desc: ``[L, E]`` float64, each row in decreasing order; lower: ``[L]`` valid bounds;
        replica: ``[L]`` the replica bound;
        num_slots: ``S``; active_gpus: ``G`` (GPUs with slots); min_slots / max_slots: fewest / most
        slots of a GPU with slots; max_tiers: most tiers tried per layer.
    Returns:
        ``[L]`` float64, never below ``lower``; a value proven infeasible, shaded down by 1e-9.
    """
    num_layers, num_experts = sorted_desc.shape
    out = lower.copy()
    virtual = np.empty(num_slots + 2)
    prefix = np.empty(num_slots + 3)
    for layer in range(num_layers):
        desc = sorted_desc[layer]
        if num_experts < 2 or desc[0] <= 0.0 or out[layer] <= 0.0:
            continue
        several = 0
        while several < num_experts and desc[several] > replica[layer]:
            several += 1
        top = min(num_experts - 1, several + 1, max_tiers)
        for tier in range(1, top + 1):
            lo = out[layer]
            if _budget_feasible(desc, tier, lo, num_slots, active_gpus, min_slots, max_slots, virtual, prefix):
                continue
            hi = 2.0 * lo
            for _ in range(60):
                if _budget_feasible(desc, tier, hi, num_slots, active_gpus, min_slots, max_slots, virtual, prefix):
                    break
                lo = hi
                hi *= 2.0
            while hi - lo > 1e-7 * hi:
                mid = 0.5 * (lo + hi)
                if not lo < mid < hi:  # adjacent floats (denormal loads): no midpoint left
                    break
                if _budget_feasible(desc, tier, mid, num_slots, active_gpus, min_slots, max_slots, virtual, prefix):
                    hi = mid
                else:
                    lo = mid
            out[layer] = max(out[layer], lo * (1.0 - 1e-9))
    return out
