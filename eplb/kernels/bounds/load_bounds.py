"""Kernels behind the lower bounds on the maximum GPU load."""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, fewest_replicas, lightest_items, shell_sort

BisectStack = namedtuple("BisectStack", ["lo", "hi", "a", "b", "it"])
BisectStack.__doc__ = """The stack of :func:`_smallest_items_lower`'s bisection tree nodes, one entry a
node: ``lo``, ``hi`` float64 its interval, ``a``, ``b`` int64 its ranks ``ranks[a:b]``, ``it``
int64 the halvings done."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _dhondt(w, num_replicas, counts):
    """Greedy (D'Hondt) replication of the loads ``w [E]`` in decreasing order: one replica at a
    time to the expert with the largest load per replica (the first on ties), ``R`` in all.

    Loads in decreasing order get counts in decreasing order, so the experts with several replicas
    are a prefix and each step compares that prefix with the first expert after it (the same
    choices as a scan over every expert). Writes ``counts [E]``; returns the prefix length ``p``
    (experts ``p ..`` keep one replica) and the largest load per replica, which is
    ``min over r of max_e w_e / r_e``."""
    num_experts = w.shape[0]
    for e in range(num_experts):
        counts[e] = 1
    prefix = 0
    for _ in range(num_replicas - num_experts):
        best = prefix  # the first expert with one replica (if any)
        best_load = w[prefix] if prefix < num_experts else -1.0
        for e in range(prefix):
            load = w[e] / counts[e]
            if load > best_load or (load == best_load and e < best):
                best = e
                best_load = load
        counts[best] += 1
        if best == prefix:
            prefix += 1
    peak = w[prefix] if prefix < num_experts else 0.0
    for e in range(prefix):
        peak = max(peak, w[e] / counts[e])
    return prefix, peak


@njit(cache=True, nogil=True, error_model="numpy")
def min_max_replica_load(desc, num_replicas):
    """``min over replica counts r (sum r = R, r >= 1) of max_e w_e / r_e``, for every layer.

    Greedy replication (one replica at a time to the expert with the largest load per replica)
    attains this minimum exactly (:func:`_dhondt`).

    Args:
        desc: ``[L, E]`` float64, each row in decreasing order; ``num_replicas``: ``R >= E``.
    Returns:
        ``[L]`` float64.
    """
    num_layers, num_experts = desc.shape
    out = np.empty(num_layers)
    counts = np.empty(num_experts, np.int64)
    for layer in range(num_layers):
        _, out[layer] = _dhondt(desc[layer], num_replicas, counts)
    return out


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _fewest_items_at_least(sorted_desc, extra, x):
    """Fewest replicas carrying ``>= x`` over every replication with ``extra`` replicas beyond one each.

    An expert with ``w_e >= x`` either keeps one replica ``>= x`` or takes ``floor(w_e / x)`` extra
    replicas to bring every replica below ``x``; the cheapest experts (the lightest) are pushed
    first. Args: ``sorted_desc`` ``[E]`` loads in decreasing order.
    """
    # n = how many loads are >= x: a binary search over the decreasing loads (the same count as a scan)
    lo = 0
    hi = sorted_desc.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_desc[mid] >= x:
            lo = mid + 1
        else:
            hi = mid
    n = lo
    budget = extra
    pushed = 0
    for i in range(n - 1, -1, -1):
        cost = np.floor(sorted_desc[i] / x)
        if cost > budget:
            break
        budget -= cost
        pushed += 1
    return n - pushed


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _above(x):
    """A value strictly above ``x >= 0`` by a relative hair (1e-12), or the next float when that
    rounds back to ``x`` (denormal ``x``): the bisections' upper end, above every replica load."""
    return max(x * (1.0 + 1e-12), np.nextafter(x, np.inf))


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _smallest_item_lower(sorted_desc, extra, rank):
    """``t_rank``: the smallest possible ``rank``-th largest replica load over every replication
    (``rank`` 1-based), to ~1e-6 relative precision from below."""
    if extra == 0:  # one replica each: the rank-th largest load itself
        return sorted_desc[rank - 1] if rank <= sorted_desc.shape[0] else 0.0
    lo = 0.0
    hi = _above(sorted_desc[0])
    if _fewest_items_at_least(sorted_desc, extra, hi) >= rank:
        return hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _fewest_items_at_least(sorted_desc, extra, mid) >= rank:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-6 * hi:
            break
    return lo


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _settle_or_push(lo, hi, a, b, it, out, out_hi, tol, stack, depth):
    """Bisection step for ``ranks[a:b]`` now known to lie in ``[lo, hi]``: answer ``lo`` (and ``hi``
    in ``out_hi``) when the interval is narrow (``tol`` relative, or after 60 halvings), else push
    it on the :class:`BisectStack`. Returns the new depth."""
    st_lo, st_hi, st_a, st_b, st_it = stack
    if hi - lo <= tol * hi or it >= 60:
        for i in range(a, b):
            out[i] = lo
            out_hi[i] = hi
        return depth
    st_lo[depth] = lo
    st_hi[depth] = hi
    st_a[depth] = a
    st_b[depth] = b
    st_it[depth] = it
    return depth + 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _smallest_items_lower(sorted_desc, extra, ranks, out, out_hi, tol):
    """:func:`_smallest_item_lower` for many ranks at once, the same values bit for bit.

    Every rank's bisection starts from the same interval and takes the same midpoints until the
    test ``fewest(mid) >= rank`` splits them, so the ranks are bisected together: one count per
    node of the shared bisection tree, and at each node the ranks ``<= fewest(mid)`` go up, the
    others down (the same decisions, midpoints and stopping rule as one rank at a time).

    Args:
        sorted_desc: ``[E]`` loads in decreasing order; ranks: ``[R]`` increasing ranks (1-based).
        out: ``[R]`` float64, written with ``t_rank`` for each rank (from below); out_hi: ``[R]``
        float64, written with the upper end of each rank's last interval (``>= t_rank``).
        tol: relative width at which an interval is settled (1e-6: :func:`_smallest_item_lower`).
    """
    num = ranks.shape[0]
    if num == 0:
        return
    if extra == 0:
        for i in range(num):
            out[i] = _smallest_item_lower(sorted_desc, extra, ranks[i])
            out_hi[i] = out[i]
        return
    hi0 = _above(sorted_desc[0])
    top = _fewest_items_at_least(sorted_desc, extra, hi0)
    first = 0  # ranks answered by the first test take hi0
    while first < num and top >= ranks[first]:
        out[first] = hi0
        out_hi[first] = hi0
        first += 1
    if first == num:
        return
    # a stack of tree nodes: (lo, hi, ranks[a:b], iterations done)
    size = 64 * (num + 1)
    st_lo = np.empty(size)
    st_hi = np.empty(size)
    st_a = np.empty(size, np.int64)
    st_b = np.empty(size, np.int64)
    st_it = np.empty(size, np.int64)
    stack = BisectStack(st_lo, st_hi, st_a, st_b, st_it)
    st_lo[0] = 0.0
    st_hi[0] = hi0
    st_a[0] = first
    st_b[0] = num
    st_it[0] = 0
    depth = 1
    while depth > 0:
        depth -= 1
        lo = st_lo[depth]
        hi = st_hi[depth]
        a = st_a[depth]
        b = st_b[depth]
        it = st_it[depth] + 1
        mid = 0.5 * (lo + hi)
        count = _fewest_items_at_least(sorted_desc, extra, mid)
        split = a  # ranks[a:split] have fewest(mid) >= rank: lo = mid; ranks[split:b]: hi = mid
        while split < b and count >= ranks[split]:
            split += 1
        if split > a:  # lo = mid
            depth = _settle_or_push(mid, hi, a, split, it, out, out_hi, tol, stack, depth)
        if split < b:  # hi = mid
            depth = _settle_or_push(lo, mid, split, b, it, out, out_hi, tol, stack, depth)


@njit(cache=True, nogil=True, error_model="numpy")
def pigeonhole_bound(desc, num_slots, active_gpus, min_slots, floor):
    """A bound that holds for every replication, from where the largest replicas must go.

    With ``t_i`` the smallest possible ``i``-th largest replica load over every replication and
    ``small(q)`` a lower bound on the sum of any ``q`` replicas (the ``q`` smallest entries of the
    multiset holding ``S - E + 1`` copies of each ``w_e / (S - E + 1)``), every placement on
    ``G`` GPUs holding ``>= k`` slots each has a GPU of load at least:

    - ``j <= G``: either the ``j`` largest replicas sit on ``j`` distinct GPUs, whose mean load is
      ``>= (t_1 + ... + t_j + small(j (k - 1))) / j``, or two share a GPU, of load
      ``>= t_{j-1} + t_j + small(k - 2)``; the smaller of the two holds;
    - ``m >= 1``: some GPU holds ``m + 1`` of the ``m G + 1`` largest replicas, so its load is
      ``>= t_{mG-m+1} + ... + t_{mG+1} + small(k - m - 1)``.

    Args:
        desc: ``[L, E]`` float64, each row in decreasing order; num_slots: ``S``; active_gpus: ``G``
        (GPUs with slots); min_slots: ``k``, fewest slots of an active GPU.
        floor: ``[L]`` float64, values the caller already has: a layer whose bound, evaluated first
            with the ``t_i`` bisected to 1e-3 and taken from above, cannot exceed its floor gets 0
            (pass zeros for every layer's bound).
    Returns:
        ``[L]`` float64: the bound, or 0 on layers where it is at most ``floor``.
    """
    num_layers, num_experts = desc.shape
    out = np.zeros(num_layers)
    extra = num_slots - num_experts
    copies = extra + 1
    top = min(num_experts, active_gpus + 1)
    for layer in range(num_layers):
        w = desc[layer]
        if w[0] <= 0.0:
            continue
        # t[i] for every rank used below (1..top and the windows of the m loop), bisected together
        wanted = np.zeros(num_experts + 2, np.bool_)
        for i in range(1, top + 1):
            wanted[i] = True
        m = 1
        while m < min_slots and m * active_gpus + 1 <= num_experts:
            for i in range(m * active_gpus - m + 1, m * active_gpus + 2):
                wanted[i] = True
            m += 1
        num_ranks = 0
        for i in range(num_experts + 2):
            if wanted[i]:
                num_ranks += 1
        ranks = np.empty(num_ranks, np.int64)
        num_ranks = 0
        for i in range(num_experts + 2):
            if wanted[i]:
                ranks[num_ranks] = i
                num_ranks += 1
        values = np.empty(num_ranks)
        upper = np.empty(num_ranks)
        t = np.zeros(num_experts + 2)
        asc = w[::-1].copy()  # for _small: the q smallest of copies x (w_e / copies)
        if floor[layer] > 0.0:  # a coarse pass from above first: can the bound beat the floor at all?
            _smallest_items_lower(w, extra, ranks, values, upper, 1e-3)
            for i in range(num_ranks):
                t[ranks[i]] = upper[i]
            if _pigeonhole_value(t, asc, copies, num_experts, active_gpus, min_slots) <= floor[layer]:
                continue
        _smallest_items_lower(w, extra, ranks, values, upper, 1e-6)
        for i in range(num_ranks):
            t[ranks[i]] = values[i]
        out[layer] = _pigeonhole_value(t, asc, copies, num_experts, active_gpus, min_slots)
    return out


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pigeonhole_value(t, asc, copies, num_experts, active_gpus, min_slots):
    """The formulas of :func:`pigeonhole_bound` for ``t [E + 2]`` (``t[i]``: the ``i``-th largest
    replica load or a bound on it; every formula grows with each ``t[i]``), ``asc [E]`` the loads
    increasing."""
    best = 0.0
    prefix = 0.0
    for j in range(1, min(active_gpus, num_experts) + 1):
        prefix += t[j]
        spread = (prefix + _small(asc, copies, j * (min_slots - 1))) / j
        if j >= 2 and min_slots >= 2:
            spread = min(spread, t[j - 1] + t[j] + _small(asc, copies, min_slots - 2))
        best = max(best, spread)
    m = 1
    while m < min_slots and m * active_gpus + 1 <= num_experts:
        total = 0.0
        for i in range(m * active_gpus - m + 1, m * active_gpus + 2):
            total += t[i]
        best = max(best, total + _small(asc, copies, min_slots - m - 1))
        m += 1
    return best


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _small(asc, copies, q):
    """The ``q`` smallest entries of the multiset holding ``copies`` copies of each
    ``asc[e] / copies`` (``asc [E]`` increasing): the ``small(q)`` of :func:`pigeonhole_bound`."""
    if q <= 0:
        return 0.0
    num_experts = asc.shape[0]
    full = q // copies
    rest = q - full * copies
    total = 0.0
    for i in range(min(full, num_experts)):
        total += asc[i]
    if full < num_experts:
        total += rest * asc[full] / copies
    return total


@njit(cache=True, nogil=True, error_model="numpy")
def replica_and_pigeonhole_upper(desc, num_slots, active_gpus, min_slots):
    """The replica bound and an upper bound on :func:`pigeonhole_bound`, per layer, from one
    D'Hondt replication (:func:`_dhondt`).

    ``t_i`` (the smallest possible ``i``-th largest replica load over every replication) is at
    most the ``i``-th largest replica load of any one replication; the upper bound evaluates the
    pigeonhole formulas with the D'Hondt replica loads in place of ``t_i`` (every formula grows
    with the ``t_i``). :func:`eplb.analysis.bounds.lower_bound` uses it to skip the exact pigeonhole bound
    on layers where it cannot be the largest.

    Args:
        desc: ``[L, E]`` float64, each row in decreasing order; num_slots: ``S``; active_gpus: ``G``;
        min_slots: ``k``.
    Returns:
        ``(replica [L], upper [L])`` float64: :func:`min_max_replica_load` and a value ``>=``
        :func:`pigeonhole_bound` up to rounding (compare with a margin).
    """
    num_layers, num_experts = desc.shape
    replica = np.zeros(num_layers)
    out = np.zeros(num_layers)
    extra = num_slots - num_experts
    copies = extra + 1
    counts = np.empty(num_experts, np.int64)
    heads = np.empty(num_slots)
    asc = np.empty(num_experts)
    u = np.zeros(num_experts + 2)
    for layer in range(num_layers):
        row = desc[layer]
        prefix, replica[layer] = _dhondt(row, num_slots, counts)
        if row[0] <= 0.0:
            continue
        for e in range(num_experts):
            asc[e] = row[num_experts - 1 - e]
        # the replica loads in decreasing order: the prefix's replicas (sorted) merged with the
        # experts that keep one replica (already decreasing)
        n = 0
        for e in range(prefix):
            for _ in range(counts[e]):
                heads[n] = row[e] / counts[e]
                n += 1
        shell_sort(heads[:n])
        i = n - 1
        j = prefix
        for rank in range(1, num_experts + 2):
            if i >= 0 and (j >= num_experts or heads[i] >= row[j]):
                u[rank] = heads[i]
                i -= 1
            elif j < num_experts:
                u[rank] = row[j]
                j += 1
            else:
                u[rank] = 0.0
        out[layer] = _pigeonhole_value(u, asc, copies, num_experts, active_gpus, min_slots)
    return replica, out


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _threshold_feasible(w, target, num_slots, active_gpus, min_slots, filler, max_m):
    """Necessary conditions for a max load ``<= target``, for one replication chosen for all at once.

    With every replica carrying at least ``filler``, a GPU with ``k`` slots and load ``<= T`` holds
    no replica above ``x_0 = T - (k - 1) filler`` and at most ``m`` replicas above
    ``x_m = (T - (k - m - 1) filler) / (m + 1)``. So some replication ``r`` (``sum r <= S``) must
    keep every replica ``<= x_0`` and at most ``m G`` replicas above ``x_m``: for each ``m``, a
    dynamic program over the experts (each either has its fewest replicas below ``x_0``, counted
    when above ``x_m``, or its fewest below ``x_m``) finds the fewest slots that achieves it.
    """
    num_experts = w.shape[0]
    x0 = target - (min_slots - 1) * filler
    if x0 <= 0.0:
        return False
    need = 0
    for e in range(num_experts):
        need += fewest_replicas(w[e], x0) if w[e] > 0.0 else 1
    if need > num_slots:
        return False
    big = num_slots + 1
    for m in range(1, min(min_slots - 1, max_m) + 1):
        xm = (target - max(0, min_slots - m - 1) * filler) / (m + 1)
        if xm <= 0.0:
            return False
        cap = m * active_gpus
        dp = np.empty(cap + 1, np.int64)  # np.full and .min() cost extra compile time; loops do not
        dp[:] = big
        dp[0] = 0
        for e in range(num_experts):
            if w[e] <= xm:
                for n in range(cap + 1):
                    if dp[n] < big:
                        dp[n] += 1
                continue
            ra = fewest_replicas(w[e], x0)
            ca = ra if w[e] / ra > xm else 0
            rb = fewest_replicas(w[e], xm)
            for n in range(cap, -1, -1):
                best = big
                if dp[n] < big:
                    best = dp[n] + rb
                if n >= ca and dp[n - ca] < big:
                    best = min(best, dp[n - ca] + ra)
                dp[n] = min(best, big)
        fits = False
        for n in range(cap + 1):
            if dp[n] <= num_slots:
                fits = True
                break
        if not fits:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def threshold_bound(weights, lower, num_slots, active_gpus, min_slots, max_m):
    """The smallest max load that :func:`_threshold_feasible` allows, searched upward from ``lower``.

    Args:
        weights: ``[L, E]`` float64; lower: ``[L]`` valid lower bounds (the search starts there);
        num_slots, active_gpus, min_slots: ``S``, GPUs with slots, fewest slots of such a GPU;
        max_m: most replicas per GPU considered by the conditions.
    Returns:
        ``[L]`` float64, never below ``lower``; a target proven infeasible, shaded down by 1e-9.
    """
    num_layers, num_experts = weights.shape
    out = lower.copy()
    copies = num_slots - num_experts + 1
    for layer in range(num_layers):
        w = weights[layer]
        lo = lower[layer]
        if lo <= 0.0:
            continue
        lightest = w[0]  # w.min() (NaN first wins, as NumPy), as a loop: shorter to compile
        for e in range(1, num_experts):
            if lightest != lightest:
                break
            if w[e] < lightest or w[e] != w[e]:
                lightest = w[e]
        filler = lightest / copies
        if _threshold_feasible(w, lo, num_slots, active_gpus, min_slots, filler, max_m):
            continue
        hi = 2.0 * lo
        for _ in range(60):
            if _threshold_feasible(w, hi, num_slots, active_gpus, min_slots, filler, max_m):
                break
            lo = hi
            hi *= 2.0
        while hi - lo > 1e-7 * hi:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:  # adjacent floats (denormal loads): no midpoint left
                break
            if _threshold_feasible(w, mid, num_slots, active_gpus, min_slots, filler, max_m):
                hi = mid
            else:
                lo = mid
        out[layer] = max(lower[layer], lo * (1.0 - 1e-9))
    return out


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _tier_value(hot_load, asc, prefix, num_hot, num_slots, num_experts, active_gpus, min_slots, max_slots, floor):
    """:func:`tier_bound` for one heavy tier of ``num_hot`` experts of total load ``hot_load``: the
    minimum over its replica count ``R`` and the number ``q`` of GPUs holding its replicas, or the
    first value found ``<= floor`` (the tier then cannot raise the bound: the search stops)."""
    cold = num_experts - num_hot
    value = np.inf
    # q = min(G, R) first for every R (where the minimum usually is): a value <= floor ends it early
    for sweep in range(2):
        for hot in range(num_hot, num_slots - cold + 1):
            extra = num_slots - hot - cold
            q_top = min(active_gpus, hot)
            q_low = q_top if sweep == 0 else (hot + max_slots - 1) // max_slots
            q_high = q_top if sweep == 0 else q_top - 1
            for q in range(q_low, q_high + 1):
                load = (hot_load + lightest_items(asc, prefix, extra, q * min_slots - hot, 8)) / q
                value = min(value, load)
                if value <= floor:
                    return value
    return value


@njit(cache=True, nogil=True, error_model="numpy")
def tier_bound(sorted_desc, lower, replica, num_slots, active_gpus, min_slots, max_slots):
    """A bound from the GPUs that carry the heavy experts, for every replication.

    Take the ``t`` heaviest experts (the *tier*, total load ``W_t``). Whatever the placement, their
    replicas (``R`` of them, ``t <= R <= S - (E - t)``) lie on some ``q`` GPUs
    (``ceil(R / k_max) <= q <= min(G, R)``), which hold at least ``q k - R`` other replicas, of the
    other experts replicated with ``S - R - (E - t)`` extra slots: the heaviest of those GPUs
    carries at least ``(W_t + lightest(q k - R)) / q`` (:func:`lightest_items`). The minimum over
    ``R`` and ``q`` is a bound for each ``t``; tiers tried: the experts above the replica bound
    (those the D'Hondt replication gives several replicas), one fewer and one more, and those up to the largest relative drop
    between consecutive loads. It sees what the average misses when a few very hot experts must
    share GPUs with the lightest ones (every GPU holding a hot replica also holds ``k - 1`` others).

    Args:
        sorted_desc: ``[L, E]`` float64, each row in decreasing order; lower: ``[L]`` valid bounds
            (tiers that cannot beat them are skipped); replica: ``[L]`` the replica bound (:func:`min_max_replica_load`);
        num_slots: ``S``; active_gpus: ``G``; min_slots / max_slots: ``k`` / ``k_max``, fewest /
            most slots of a GPU with slots.
    Returns:
        ``[L]`` float64, never below ``lower``.
    """
    num_layers, num_experts = sorted_desc.shape
    out = lower.copy()
    asc = np.empty(num_experts)
    prefix = np.zeros(num_experts + 1)
    tiers = np.empty(4, np.int64)
    for layer in range(num_layers):
        desc = sorted_desc[layer]
        for e in range(num_experts):
            asc[e] = desc[num_experts - 1 - e]
        if desc[0] <= 0.0 or num_experts < 2:
            continue
        several = 0  # the experts with several replicas in the D'Hondt replication: above its peak
        while several < num_experts and desc[several] > replica[layer]:
            several += 1
        drop = 1
        for e in range(1, num_experts):
            if desc[e] * desc[drop - 1] < desc[drop] * desc[e - 1]:  # desc[e] / desc[e-1] smallest
                drop = e
        tiers[0] = several - 1
        tiers[1] = several
        tiers[2] = several + 1
        tiers[3] = drop
        for i in range(4):
            t = tiers[i]
            if t < 1 or t >= num_experts:
                continue
            seen = False
            for j in range(i):
                if tiers[j] == t:
                    seen = True
            if seen:
                continue
            hot_load = 0.0
            for e in range(t):
                hot_load += desc[e]
            # the other experts, lightest first, and their prefix sums
            cold = num_experts - t
            for e in range(cold):
                prefix[e + 1] = prefix[e] + asc[e]
            cold_asc = asc[:cold]
            value = _tier_value(hot_load, cold_asc, prefix, t, num_slots, num_experts, active_gpus, min_slots,
                                max_slots, out[layer])
            if value > out[layer]:
                out[layer] = value * (1.0 - 1e-9)  # shaded far above the rounding of the sums
    return out
