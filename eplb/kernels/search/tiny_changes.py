"""The exhaustive search of a small layer for a placement within a load target that changes the
fewest slots of the placement in service (:func:`fewest_changes_search`).

Shapes: ``E`` experts, ``S`` slots, ``G`` GPUs.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _fits(w, row, prev, slot_offsets, counts, target):
    """Whether ``row [S]`` holds every expert, gives no GPU more replicas of an expert than
    ``max(1, what it held in prev)``, and keeps every GPU at most ``target``."""
    num_experts = w.shape[0]
    counts[:] = 0
    for s in range(row.shape[0]):
        counts[row[s]] += 1
    for e in range(num_experts):
        if counts[e] == 0:
            return False
    for g in range(slot_offsets.shape[0] - 1):
        total = 0.0
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            e = row[s]
            total += w[e] / counts[e]
            if e != prev[s]:  # a new replica: at most max(1, previous count) of e on this GPU
                on_gpu = 0
                before = 0
                for t in range(slot_offsets[g], slot_offsets[g + 1]):
                    on_gpu += row[t] == e
                    before += prev[t] == e
                if on_gpu > max(1, before):
                    return False
        if total > target:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def fewest_changes_search(w, prev, slot_offsets, target, most_changes, work):
    """Exhaustive search of one small layer for a placement within ``target`` that changes fewer
    than ``most_changes`` slots of ``prev``: every set of 1, 2, ... changed slots in increasing
    order, each with every other expert, until one fits (:func:`_fits`) or ``work`` leaf checks are
    spent. Deterministic (the first fit in that order).

    Args:
        w: ``[E]`` float64 loads; prev: ``[S]`` int64; slot_offsets: ``[G + 1]``; target: max load.
        most_changes: search only fewer changes than this; work: most placements checked.
    Returns:
        ``(row [S] int64, changes)``: the fit, or ``prev`` and ``-1`` if none was found.
    """
    num_slots = prev.shape[0]
    num_experts = w.shape[0]
    row = prev.copy()
    counts = np.zeros(num_experts, np.int64)
    chosen = np.zeros(num_slots, np.int64)  # the changed slots, increasing
    pick = np.zeros(num_slots, np.int64)  # the expert index tried in each changed slot
    checked = 0
    for c in range(1, most_changes):
        if c > num_slots:
            break
        # odometer over (slots s_1 < ... < s_c) and (experts != prev) for each
        for i in range(c):
            chosen[i] = i
        while True:
            for i in range(c):
                pick[i] = 0
            while True:
                for i in range(c):
                    s = chosen[i]
                    e = pick[i]
                    row[s] = e if e < prev[s] else e + 1  # the (pick)-th expert other than prev[s]
                checked += 1
                if _fits(w, row, prev, slot_offsets, counts, target):
                    return row, c
                if checked >= work:
                    return prev.copy(), np.int64(-1)
                i = c - 1
                while i >= 0 and pick[i] == num_experts - 2:
                    pick[i] = 0
                    i -= 1
                if i < 0:
                    break
                pick[i] += 1
            for i in range(c):
                row[chosen[i]] = prev[chosen[i]]
            i = c - 1
            while i >= 0 and chosen[i] == num_slots - c + i:
                i -= 1
            if i < 0:
                break
            chosen[i] += 1
            for j in range(i + 1, c):
                chosen[j] = chosen[j - 1] + 1
    return prev.copy(), np.int64(-1)
