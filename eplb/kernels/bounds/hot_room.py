"""A necessary condition for a max load ``<= T`` on one domain (a node) whose heaviest expert needs
most of its GPUs: the other experts must fit beside the hot replicas or on the GPUs without one.

Used by the hierarchical bound (:func:`eplb.kernels.bounds.hierarchy.assign_groups` with ``strong``) on
every node of a complete group -> node assignment. With one expert carrying ~40% of a layer's load
(Zipf 1.5), the node holding it is the heaviest, its average load is the old bound, and the optimum
sits 1-4% higher: the next experts of the node are too big for the room the hot replicas leave.
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, fewest_replicas, lightest_items

HotRoomScratch = namedtuple("HotRoomScratch", ["asc", "prefix", "gains", "loads", "keys"])
HotRoomScratch.__doc__ = """Work space of :func:`hot_room_fits`, ``[>= num + 1]`` float64 each: the other
experts' loads increasing (``asc``) and their prefix sums (``prefix``), the replicas each can save on the
GPUs without a hot replica (``gains``) with its load (``loads``), and sort keys (``keys``)."""


@njit(cache=True, nogil=True, error_model="numpy")
def hot_room_fits(desc, num, target, active, slots, min_slots, max_slots, scratch):
    """Whether the experts ``desc[:num]`` (loads, decreasing) may fit ``slots`` slots on ``active``
    GPUs (``min_slots .. max_slots`` slots each) with every GPU ``<= target`` (``T``).

    For each replica count ``r`` of the heaviest expert ``h`` (replicas of ``p = w_h / r``; a GPU
    holds at most ``m = min(floor(T / p), k_max)`` of them, so ``q >= ceil(r / m)`` GPUs hold one
    and at most ``G - q`` none):

    - room: a GPU holding a hot replica keeps ``<= T - p`` for the others; when ``m = 1`` (one hot
      replica per GPU) it also holds ``k_min - 2`` replicas besides the hot one and any other
      replica ``x``, weighing at least the lightest ``k_min - 2`` of the others
      (:func:`eplb.kernels.plumbing.common.lightest_items` with all ``S - r - (n - 1)`` extra replicas
      theirs), so ``x <= room = T - p - lightest``;
    - every other expert either has a replica beside a hot one, so all its replicas (equal loads)
      are ``<= room`` (``fewest(w, room)`` replicas), or sits wholly on the GPUs without one
      (``fewest(w, T)`` replicas), which carry at most ``(G - q) T`` in all and hold at most
      ``(G - q) k_max`` experts;
    - load: the ``q' >= q`` GPUs holding hot replicas carry ``w_h`` and all the others' load but
      what the GPUs without one hold: at most ``(G - q') T`` and the ``(G - q') k_max`` heaviest
      other experts' loads; so ``<= q' T`` for some ``q' <= min(G, r)``;
    - the replicas: ``r + sum of the counts <= S``. The fewest extra replicas is bounded below by
      the counts beside the hot replicas minus the largest saving of the experts moved to the GPUs
      without one, bounded above by the smaller of two relaxations: by load (fractional
      knapsack, capacity ``(G - q) T``) and by number (the ``(G - q) k_max`` largest savings).

    Returns True when some ``r`` passes (``r`` from 1 to ``S - n + 1``).

    Args:
        desc: ``[>= num]`` float64 loads in decreasing order; scratch: a :class:`HotRoomScratch`.
    """
    if num < 2 or desc[0] <= 0.0 or not target < np.inf:
        return True
    asc, prefix = scratch.asc, scratch.prefix
    hot = desc[0]
    others = num - 1
    for i in range(others):  # the other experts, lightest first, for lightest_items
        asc[i] = desc[num - 1 - i]
    prefix[0] = 0.0
    for i in range(others):
        prefix[i + 1] = prefix[i] + asc[i]
    tol = target * (1.0 + 1e-12)
    for r in range(1, slots - num + 2):
        per = hot / r
        if per > tol:
            continue
        m = min(int(np.floor(tol / per)), max_slots)
        q = (r + m - 1) // m
        if q > active:
            continue
        if not _load_fits(hot, prefix, others, q, r, active, max_slots, target):
            continue
        free_gpus = active - q
        capacity = free_gpus * target
        room = target - per
        if m == 1 and min_slots >= 2:
            room -= lightest_items(asc[:others], prefix[: others + 1], slots - r - others, min_slots - 2, 8)
        if room < 0.0:
            continue  # no GPU can hold a hot replica and its k_min - 1 others
        base, num_gains, blocked = _replicas_beside(asc[:others], target, room, capacity, slots, r - 1, scratch)
        if blocked:
            continue
        if base - _largest_saving(scratch, num_gains, free_gpus * max_slots, capacity) <= slots - num + 1e-9:
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _load_fits(hot, prefix, others, q, r, active, max_slots, target):
    """The load condition: the ``q'`` GPUs holding hot replicas (``q <= q' <= min(G, r)``) carry all
    but what the others hold, at most ``(G - q') T`` and the ``(G - q') k_max`` heaviest other experts
    (``prefix [others + 1]`` the prefix sums of their loads, increasing); some ``q'`` must carry at
    most ``q' T``."""
    tol = target * (1.0 + 1e-12)
    for q2 in range(q, min(active, r) + 1):
        apart = min(others, (active - q2) * max_slots)
        carried = hot + prefix[others] - min((active - q2) * target, prefix[others] - prefix[others - apart])
        if carried <= q2 * tol:
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _replicas_beside(asc, target, room, capacity, slots, base, scratch):
    """The replicas beyond one each of the other experts (``asc [n]`` loads) when every one sits
    beside a hot replica (``room`` left there), added to ``base``; and the saving of moving each to
    the GPUs without one (``capacity`` load in all), written to ``scratch.gains`` and
    ``scratch.loads``. Returns ``(replicas, number of savings, blocked)``: blocked when an expert
    fits neither beside a hot replica nor on those GPUs."""
    gains, loads = scratch.gains, scratch.loads
    num_gains = np.int64(0)  # typed: a literal 0 would compile the callee a second time
    blocked = False
    for i in range(asc.shape[0]):
        w = asc[i]
        if w <= 0.0:
            continue  # one replica, anywhere
        apart = fewest_replicas(w, target) - 1
        beside = fewest_replicas(w, room) - 1 if room > 0.0 else slots  # slots: cannot sit beside
        base += beside
        if beside > apart:
            if w <= capacity * (1.0 + 1e-12):
                gains[num_gains] = beside - apart
                loads[num_gains] = w
                num_gains += 1
            elif beside >= slots:
                blocked = True
    return base, num_gains, blocked


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _largest_saving(scratch, num_gains, most_moved, capacity):
    """An upper bound on the replicas saved by moving experts to the GPUs without a hot replica
    (``scratch.gains[:num_gains]``, loads ``scratch.loads``): the smaller of the ``most_moved`` largest
    savings and the fractional knapsack of ``capacity`` load. Sorts the savings."""
    keys, gains, loads = scratch.keys, scratch.gains, scratch.loads
    # by number: the largest savings of at most most_moved experts
    for i in range(num_gains):
        keys[i] = gains[i]
    _sort_together(keys, gains, loads, num_gains)
    by_number = 0.0
    for i in range(min(num_gains, most_moved)):
        by_number += gains[i]
    # by load: fractional knapsack, the best saving per load first
    for i in range(num_gains):
        keys[i] = gains[i] / loads[i] if loads[i] > 0.0 else np.inf
    _sort_together(keys, gains, loads, num_gains)
    left = capacity
    by_load = 0.0
    for i in range(num_gains):
        if left <= 0.0:
            break
        take = min(1.0, left / loads[i]) if loads[i] > 0.0 else 1.0
        by_load += gains[i] * take
        left -= loads[i] * take
    return min(by_number, by_load)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _sort_together(keys, a, b, n):
    """Sort ``keys[:n]`` decreasing, ``a[:n]`` and ``b[:n]`` with it (insertion sort: few items)."""
    for i in range(1, n):
        k = keys[i]
        va = a[i]
        vb = b[i]
        j = i
        while j > 0 and keys[j - 1] < k:
            keys[j] = keys[j - 1]
            a[j] = a[j - 1]
            b[j] = b[j - 1]
            j -= 1
        keys[j] = k
        a[j] = va
        b[j] = vb
