"""Replica counts for GPUs of two slots each (``k = 2``) by bisection on the max GPU load.

For fixed counts the sorted pairing is optimal (:mod:`eplb.kernels.bounds.pairs`), and by Hall's
theorem the replicas pair with every pair ``<= T`` exactly when, for every ``y`` in ``[0, T / 2)``,
at least as many replicas carry ``<= y`` (*light* ones, ``<= T / 2``) as *heavy* ones (``> T / 2``)
carry ``>= T - y``. Each expert is one event on that axis: its light replicas at ``y = w / c``
(``+c``), its heavy ones at ``y = T - w / c`` (``-c``); the condition is that every prefix sum of the
events in increasing ``y`` stays non-negative.

:func:`_cover` builds counts for one target ``T`` in one sweep: every expert starts at its fewest
replicas of ``<= T`` each, and wherever the prefix sum goes negative one replica is added where it
helps most at that ``y`` (the most replicas it brings into the sum; then the most it adds for the
rest of the sweep; then the heavier expert): to a heavy expert already counted, which turns its
replicas light (their demand leaves the sum), or keeps them heavy but moves them past ``y``; or to
a light expert whose replicas then fall to ``<= y`` (the heaviest single replica that does).
Slots left at the end go to light experts (D'Hondt: still light, so the condition holds).
:func:`pair_cover` bisects ``T`` between the average pair ``sum(w) / G`` and a searched plan's peak
and keeps the lightest sorted pairing found whose middle holds one expert twice in at most
:data:`MAX_DOUBLED` pairs; the sweep is a heuristic (a target it misses may be feasible), so a
layer keeps its input counts unless they pair strictly heavier.

Measured (58 layers, 256 experts, 512 slots on 256 GPUs, from the default's 6-donor move search):
mean gap to eplb's bound 3.87% -> 1.63% / 1.55% with 3 / 4 steps (lognormal), 3.16% -> 1.20% /
1.12% (Zipf 0.5), 10.70% -> 7.34% / 6.57% (Zipf 1.0), for 7-8 / 9-10 ms of CPU; from the 24-donor
search with 16 steps 2.79% -> 1.43%, 2.43% -> 1.05%, 3.97% -> 3.29%. At 288 on 144 it finds nothing
lighter (there the average pair is 12-100% below the bound, so its targets all miss).
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, heap_before, heap_sift_down, heapify, stable_argsort

MAX_DOUBLED = 8
"""Most pairs of the sorted pairing's middle that may hold one expert twice in counts
:func:`pair_cover` keeps: the layout trades such a replica away only while the pairs around have
room (at 512 / 256, Zipf 1.0, counts with dozens of them mostly cannot be laid out)."""
_REL = 1e-12  # relative tolerance of the fewest replicas under a load


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _push(heap, size, keys, e):
    """Add expert ``e`` to the min-heap ``heap[:size]`` (by ``keys``); returns the new size."""
    i = size
    heap[i] = e
    while i > 0:
        parent = (i - 1) // 2
        if not heap_before(keys, heap[i], heap[parent]):
            break
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent
    return size + 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pop(heap, size, keys):
    """Remove the top of the min-heap ``heap[:size]``; returns the new size."""
    size -= 1
    heap[0] = heap[size]
    heap_sift_down(heap, size, keys, 0)
    return size


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _drop(items, size, e):
    """Remove ``e`` from ``items[:size]`` (order kept) if there; returns the new size."""
    j = 0
    for i in range(size):
        if items[i] != e:
            items[j] = items[i]
            j += 1
    return j


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _choose(w, counts, target, y, need, fk, lists, ptr, nxt, cap):
    """The expert that gets one more replica at ``y`` with ``need`` replicas missing from the prefix
    sum (module docstring), and its kind: 0 a counted heavy turned light, 1 a counted heavy kept
    heavy past ``y``, 2 an uncounted light one falling to ``<= y``; ``(-1, -1)`` if none.
    ``lists[0, :ptr[5]]`` and ``lists[1, :ptr[6]]`` heaps (by ``fk[1]``: most replicas, then
    heaviest) of the counted heavy experts that one more replica turns light and keeps heavy;
    ``lists[2, :ptr[7]]`` the uncounted light experts of several replicas; ``w [E]`` decreasing;
    ``nxt [E]`` skips experts that can no longer hold a single light replica. Experts that can no
    longer move past ``y`` leave the second heap."""
    half = 0.5 * target
    while ptr[6] > 0 and target - w[lists[1, 0]] / (counts[lists[1, 0]] + 1) <= y:
        ptr[6] = _pop(lists[1], ptr[6], fk[1])
    best, kind, best_gain, best_rest = -1, -1, -1, -(1 << 60)
    for k in range(2):
        if ptr[5 + k] > 0:
            e = lists[k, 0]
            c = counts[e]
            gain = min(c + (c + 1 if k == 0 and w[e] / (c + 1) <= y else 0), need)
            rest = 2 * c + 1 if k == 0 else -1
            if gain > best_gain or (gain == best_gain and (rest > best_rest or (rest == best_rest and e < best))):
                best, kind, best_gain, best_rest = e, k, gain, rest
    n = w.shape[0]
    for i in range(ptr[7] + 1):
        if i < ptr[7]:
            e = lists[2, i]
        else:  # the heaviest single light replica with w in (y, 2 y]; nxt skips the others (compressed)
            lo, hi = 0, n
            while lo < hi:
                mid = (lo + hi) // 2
                if w[mid] > 2.0 * y:
                    lo = mid + 1
                else:
                    hi = mid
            e = lo
            while e < n and not (counts[e] == 1 and w[e] <= half):
                e = nxt[e]
            while lo < e:
                after = nxt[lo]
                nxt[lo] = e
                lo = after
            if e >= n or not w[e] > y:
                continue
        if counts[e] + 1 > cap or w[e] / (counts[e] + 1) > y:
            continue
        gain = min(counts[e] + 1, need)
        if gain > best_gain or (gain == best_gain and (1 > best_rest or (1 == best_rest and e < best))):
            best, kind, best_gain, best_rest = e, 2, gain, 1
    return best, kind


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _start(w, num_slots, cap, target, counts, keys, heap, lists, nxt, ptr):
    """Every expert at its fewest replicas of ``<= target`` each, none counted (``lists[3]`` 0), and
    the events in three streams, each in increasing ``y``: ``ptr[0]`` the next single light replica
    (from the lightest expert up to ``ptr[3]``), ``ptr[1]`` the next single heavy one (from expert
    ``ptr[4]`` on), and the experts of several heavy replicas in ``heap[:ptr[2]]`` (by ``keys [E]``);
    whether the counts fit in ``num_slots`` under ``cap``. ``w [E]`` decreasing."""
    n = w.shape[0]
    half = 0.5 * target
    used = 0
    ptr[:] = 0
    ptr[3], ptr[4] = n, n
    for e in range(n):
        c = max(1, int(np.ceil(w[e] / target * (1.0 - _REL))))
        counts[e] = c
        used += c
        nxt[e] = e + 1
        lists[3, e] = 0
        if c > cap:
            return False
        if c > 1:
            keys[e] = target - w[e] / c
            heap[ptr[2]] = e
            ptr[2] += 1
        elif w[e] > half:
            ptr[4] = min(ptr[4], e)
        else:
            ptr[3] = min(ptr[3], e)
    ptr[0], ptr[1] = n - 1, ptr[4]
    heapify(heap, ptr[2], keys)
    return used <= num_slots


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _cover(w, num_slots, cap, target, counts, fk, heap, lists, nxt, ptr):
    """The sweep of the module docstring for ``target``: counts ``[E]`` summing to ``num_slots``
    whose sorted pairing keeps every pair ``<= target``; whether it found them. ``w [E]``
    non-negative, decreasing; ``fk [2, E]`` float64, ``heap [2 E]``, ``lists [4, E]``, ``nxt [E]``,
    ``ptr [8]`` int64 scratch. Each counted heavy expert joins the heap of :func:`_choose` it
    belongs to (by ``fk[1]``: most replicas, then heaviest)."""
    if not _start(w, num_slots, cap, target, counts, fk[0], heap, lists, nxt, ptr):
        return False
    half = 0.5 * target
    n = w.shape[0]
    used, total, at = counts.sum(), 0, -1.0
    keys, ranks = fk[0], fk[1]
    while True:
        # the next event not counted yet (streams of _start, then the heap); counted ones are passed
        while ptr[0] >= ptr[3] and lists[3, ptr[0]] != 0:
            ptr[0] -= 1
        while ptr[2] > 0 and lists[3, heap[0]] != 0:
            ptr[2] = _pop(heap, ptr[2], keys)
        src, e, y = -1, -1, np.inf
        if ptr[0] >= ptr[3]:
            src, e, y = 0, ptr[0], w[ptr[0]]
        if ptr[1] < ptr[3] and target - w[ptr[1]] < y:
            src, e, y = 1, ptr[1], target - w[ptr[1]]
        if ptr[2] > 0 and keys[heap[0]] < y:
            src, e, y = 2, heap[0], keys[heap[0]]
        if y != at and total < 0:  # every event at ``at`` counted: the check, then look again
            e, kind = _choose(w, counts, target, at, -total, fk, lists, ptr, nxt, cap)
            used += 1
            if e < 0 or used > num_slots:
                return False
            c = counts[e]  # one more replica: the prefix sum at ``at`` rises
            counts[e] = c + 1
            load = w[e] / (c + 1)
            if kind == 2:  # an uncounted light expert, now counted
                lists[3, e] = 1
                if ptr[7] > 0:
                    ptr[7] = _drop(lists[2], ptr[7], e)
                total += c + 1
                continue
            ptr[5 + kind] = _pop(lists[kind], ptr[5 + kind], ranks)
            total += c  # its heavy replicas leave the sum
            if kind == 0 and load <= at:
                total += c + 1
                continue
            keys[e] = load if kind == 0 else target - load  # a later event, light or heavy
            lists[3, e] = 0
            ptr[2] = _push(heap, ptr[2], keys, e)
            if kind == 0:
                lists[2, ptr[7]] = e
                ptr[7] += 1
            continue
        if src < 0:
            break
        at = y
        if src == 2:
            ptr[2] = _pop(heap, ptr[2], keys)
        else:
            ptr[src] += 1 if src == 1 else -1
        c = counts[e]
        lists[3, e] = 1
        if w[e] / c <= half:
            total += c
            if ptr[7] > 0:
                ptr[7] = _drop(lists[2], ptr[7], e)
        else:
            total -= c
            if c < cap:  # else it cannot take one more
                k = 0 if w[e] / (c + 1) <= half else 1
                ranks[e] = -float(c) * (n + 1) + e
                ptr[5 + k] = _push(lists[k], ptr[5 + k], ranks, e)
    return fill_light(w, counts, num_slots - used, cap, half, keys, heap)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def fill_light(w, counts, extra, cap, half, keys, heap):
    """``extra`` more replicas for the light experts (``w / counts <= half``), each to the heaviest
    light replica under ``cap`` (D'Hondt); whether there was room. ``keys [E]``, ``heap [E]`` scratch."""
    size = 0
    for e in range(w.shape[0]):
        if w[e] / counts[e] <= half and counts[e] < cap:
            keys[e] = -w[e] / counts[e]
            heap[size] = e
            size += 1
    heapify(heap, size, keys)
    for _ in range(extra):
        if size == 0:
            return False
        e = heap[0]
        counts[e] += 1
        keys[e] = -w[e] / counts[e]
        if counts[e] >= cap:
            size -= 1
            heap[0] = heap[size]
        heap_sift_down(heap, size, keys, 0)
    return True


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def pairing_peak(w, counts, num_pairs):
    """``(peak, doubled)``: the heaviest pair of the sorted pairing of ``counts [E]`` replicas of
    ``w [E]``, and how many of its middle pairs hold one expert twice with no other expert's replica
    at that load (the layout cannot trade those away at the same loads)."""
    values = w / counts
    order = stable_argsort(-values)
    p, q = 0, order.shape[0] - 1
    left_p, left_q = counts[order[p]], counts[order[q]]
    peak, done, doubled = 0.0, 0, 0
    while done < num_pairs:
        take = min(left_p, left_q, num_pairs - done)
        peak = max(peak, values[order[p]] + values[order[q]])
        done += take
        if done == num_pairs and order[p] == order[q]:
            v = values[order[p]]
            if not ((p > 0 and values[order[p - 1]] == v) or (p + 1 < order.shape[0] and values[order[p + 1]] == v)):
                doubled = take
        left_p -= take
        left_q -= take
        if left_p == 0 and p + 1 < order.shape[0]:
            p += 1
            left_p = counts[order[p]]
        if left_q == 0 and q > 0:
            q -= 1
            left_q = counts[order[q]]
    return peak, doubled


@njit(cache=True, nogil=True, error_model="numpy")
def pair_cover(weights, num_slots, cap, counts, peaks, steps):
    """Lighter replica counts for GPUs of two slots each, per layer, by bisection on the target (module
    docstring), starting from searched ``counts`` and their sorted pairing's ``peaks``.

    Args:
        weights: ``[L, E]`` float64 non-negative loads, each row decreasing; num_slots: ``S`` (even,
            ``>= E``); cap: most replicas an expert may get; counts: ``[L, E]`` int64 counts (each
            ``1 .. cap``, summing to ``S``) and peaks: ``[L]`` float64 their sorted pairing's max
            GPU load (e.g. :func:`eplb.kernels.bounds.pairs.pair_search`'s); steps: bisection steps.
    Returns:
        ``(counts [L, E] int64, peaks [L] float64)``: a layer's counts change only where their
        sorted pairing is strictly lighter (and holds one expert twice in at most
        :data:`MAX_DOUBLED` pairs).
    """
    num_layers, num_experts = weights.shape
    out, out_peaks = counts.copy(), peaks.copy()
    num_pairs = num_slots // 2
    trial = np.empty(num_experts, np.int64)
    fk = np.empty((2, num_experts))
    heap = np.empty(2 * num_experts, np.int64)
    nxt = np.empty(num_experts, np.int64)
    lists = np.empty((4, num_experts), np.int64)
    ptr = np.empty(8, np.int64)
    for layer in range(num_layers):
        w = weights[layer]
        lo, hi = w.sum() / num_pairs, peaks[layer]
        for _ in range(steps):
            if not lo < hi:
                break
            target = 0.5 * (lo + hi)
            if not _cover(w, num_slots, cap, target, trial, fk, heap, lists, nxt, ptr):
                lo = target
                continue
            peak, doubled = pairing_peak(w, trial, num_pairs)
            if doubled <= MAX_DOUBLED and peak < out_peaks[layer] * (1.0 - _REL):
                out_peaks[layer] = peak
                out[layer] = trial
            hi = min(target, peak)
    return out, out_peaks
