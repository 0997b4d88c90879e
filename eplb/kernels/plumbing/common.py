"""Small kernels several kernel files share: a random stream, a sort, a binary heap, replica counts
under a cap, the lightest replicas of a set, and duplicate replicas on a GPU. Each file imports them from here
(no kernel file imports another file's private helpers)."""

import numpy as np
from numba import njit

INTERNAL = {"no_cpython_wrapper": True, "no_cfunc_wrapper": True}
"""``@njit`` options of a kernel that only other kernels call (never Python): no wrapper from and to
Python objects is generated, which for arguments such as named tuples of arrays is a good part of a
small kernel's first-call compile time (such a kernel cannot be called from Python)."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def next_random(state):
    """xorshift64: the next state (also the random number); deterministic on every machine."""
    state ^= (state << np.uint64(13)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    state ^= state >> np.uint64(7)
    state ^= (state << np.uint64(17)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    return state


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def shell_sort(values):
    """Sort ``values [n]`` (float64 without NaN, or int64) in place, increasing (Shell sort with Ciura's gaps: a few simple
    loops, fast on the few hundred values of a layer and cheap to compile)."""
    n = values.shape[0]
    gaps = (701, 301, 132, 57, 23, 10, 4, 1)
    for gap in gaps:
        for i in range(gap, n):
            value = values[i]
            j = i
            while j >= gap and values[j - gap] > value:
                values[j] = values[j - gap]
                j -= gap
            values[j] = value


@njit(cache=True, nogil=True, error_model="numpy")
def heap_before(keys, a, b):
    """Heap order of ids ``a`` and ``b``: the smaller ``keys[id]`` first, the smaller id on ties (the
    first index among equal values, as an argmin scanning ids in increasing order picks)."""
    return keys[a] < keys[b] or (keys[a] == keys[b] and a < b)


@njit(cache=True, nogil=True, error_model="numpy")
def heap_sift_down(heap, size, keys, i):
    """Restore the min-heap ``heap[:size]`` (ids ordered by :func:`heap_before` on ``keys``) below
    position ``i``."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and heap_before(keys, heap[child + 1], heap[child]):
            child += 1
        if not heap_before(keys, heap[child], heap[i]):
            return
        heap[i], heap[child] = heap[child], heap[i]
        i = child


@njit(cache=True, nogil=True, error_model="numpy")
def heapify(heap, size, keys):
    """Make ``heap[:size]`` (ids into ``keys``) a min-heap in the order of :func:`heap_before`."""
    for i in range(size // 2 - 1, -1, -1):
        heap_sift_down(heap, size, keys, i)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def stable_argsort(keys):
    """``np.argsort(keys, kind="mergesort")`` for ``keys [n]`` float64: the indices by increasing key,
    equal keys in increasing index, NaN last (the same order, index for index). A bottom-up merge
    sort in a few loops: NumPy's merge sort compiles in Numba for a second or two, this in a tenth."""
    n = keys.shape[0]
    order = np.empty(n, np.int64)
    for i in range(n):
        order[i] = i
    buf = np.empty(n, np.int64)
    width = 1
    while width < n:
        lo = 0
        while lo < n:
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                a, b = keys[order[j]], keys[order[i]]
                if a < b or (b != b and a == a):  # the right run's key strictly first: stable
                    buf[k] = order[j]
                    j += 1
                else:
                    buf[k] = order[i]
                    i += 1
                k += 1
            while i < mid:
                buf[k] = order[i]
                i += 1
                k += 1
            while j < hi:
                buf[k] = order[j]
                j += 1
                k += 1
            lo = hi
        order, buf = buf, order
        width *= 2
    return order


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def fewest_replicas(w, x):
    """Fewest replicas of an expert of load ``w`` that keep each replica ``<= x`` (``x > 0``)."""
    if w <= x:
        return 1
    r = int(np.ceil(w / x))
    while w / r > x:
        r += 1
    while r > 1 and w / (r - 1) <= x:
        r -= 1
    return r


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def unused_savings(asc, prefix, n, unused):
    """Most load that ``unused`` replicas left out of a set can save on the ``n`` lightest experts.

    An expert of load ``w`` split into ``j + u`` replicas of which a set takes ``j`` contributes
    ``j w / (j + u) >= w - w u / (1 + u)`` to it, and ``w u / (1 + u) <= min(u / 2, 1) w``: so the
    savings are at most the ``unused`` largest entries of the multiset holding every ``w / 2``
    twice. Args: ``asc [n0]`` increasing loads, ``prefix [n0 + 1]`` their prefix sums.
    """
    if unused <= 0 or n <= 0:
        return 0.0
    full = min(unused // 2, n)
    total = prefix[n] - prefix[n - full]
    if unused % 2 == 1 and n - full - 1 >= 0:
        total += 0.5 * asc[n - full - 1]
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def lightest_items(asc, prefix, extra, m, exact_extra):
    """A lower bound on the sum of any ``m`` replicas of the experts ``asc [n0]`` (increasing loads,
    ``prefix`` their prefix sums) over every replication with ``extra`` replicas beyond one each.

    The ``m`` replicas come from ``n`` distinct experts and take ``m - n`` of the extra replicas
    (so ``n >= m - extra``); the other extras, left out, save at most :func:`unused_savings`; the
    ``n`` lightest experts are the cheapest. Every ``n`` is tried when ``extra <= exact_extra``,
    else one cruder bound (the fewest experts, the most savings).
    """
    if m <= 0:
        return 0.0
    num = asc.shape[0]
    if m > num + extra:
        m = num + extra
    if extra <= exact_extra:
        best = np.inf
        for n in range(max(1, m - extra), min(m, num) + 1):
            best = min(best, prefix[n] - unused_savings(asc, prefix, n, extra - (m - n)))
        return max(best, 0.0)
    return max(0.0, prefix[max(0, min(num, m - extra))] - unused_savings(asc, prefix, min(m, num), extra))


@njit(cache=True, nogil=True, error_model="numpy")
def shared_replicas(gpus, gpu_items, gpu_fill, item_expert, holds):
    """Replicas on the listed GPUs that share the GPU with another replica of their expert."""
    total = 0
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        for j in range(gpu_fill[g]):
            if holds[g, item_expert[gpu_items[g, j]]] > 1:
                total += 1
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def rank_window(loads, t, top):
    """Fill ``top[t, :]`` with the ``TOP`` most loaded GPUs of window ``t`` (``-1`` pads when
    there are fewer GPUs), heaviest first, the lower index first on ties."""
    num_gpus = loads.shape[1]
    width = top.shape[1]
    for k in range(width):
        top[t, k] = -1
    for g in range(num_gpus):
        x = loads[t, g]
        k = width - 1
        if top[t, k] >= 0 and loads[t, top[t, k]] >= x:
            continue
        while k > 0 and (top[t, k - 1] < 0 or loads[t, top[t, k - 1]] < x):
            top[t, k] = top[t, k - 1]
            k -= 1
        top[t, k] = g


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def max_untouched(loads, t, top, mark, stamp):
    """The largest load of window ``t`` over the GPUs not marked with ``stamp`` (0.0 if none)."""
    for k in range(top.shape[1]):
        g = top[t, k]
        if g < 0:
            return 0.0
        if mark[g] != stamp:
            return loads[t, g]
    best = 0.0
    for g in range(loads.shape[1]):
        if mark[g] != stamp and loads[t, g] > best:
            best = loads[t, g]
    return best
