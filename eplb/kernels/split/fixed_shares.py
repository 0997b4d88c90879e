"""Balance one layer whose slots carry fixed loads: swaps of slots between GPUs that keep every
slot's share, and the move that spreads an expert's replicas over distinct nodes.

Used to plan for an engine's dispatch rule (:mod:`eplb.planning.engine_planning`): a swap that keeps the
rule's structure (which ranks pick which replica) keeps each slot's share of its expert, so the
per-window loads of a slot travel with it and a swap is scored in ``O(T)``.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, max_untouched, rank_window, stable_argsort

ANYWHERE = -2  # region of a slot that may go to any node
FIXED = -1  # region of a slot that must stay where it is


@njit(cache=True, nogil=True, error_model="numpy")
def _objective(loads, weights):
    """``sum_t weights[t] * max_g loads[t, g]`` of ``loads [T, G]``."""
    total = 0.0
    for t in range(loads.shape[0]):
        peak = 0.0
        for g in range(loads.shape[1]):
            if loads[t, g] > peak:
                peak = loads[t, g]
        total += weights[t] * peak
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _partners(mean_load, a, gpus_per_node, partners, out):
    """Write into ``out`` the ``partners`` least loaded GPUs of ``a``'s node, then the ``partners``
    least loaded GPUs overall not already listed (never ``a``); return how many were written."""
    order = stable_argsort(mean_load)
    count = 0
    node = a // gpus_per_node
    for pass_ in range(2):
        taken = 0
        for g in order:
            if taken == partners:
                break
            if g == a or (pass_ == 0 and g // gpus_per_node != node):
                continue
            listed = False
            for i in range(count):
                if out[i] == g:
                    listed = True
            if listed:
                continue
            out[count] = g
            count += 1
            taken += 1
    return count


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _allowed(region, node_of_slot, s, destination):
    """Whether slot ``s`` may move to slot ``destination``'s node."""
    return region[s] == ANYWHERE or (region[s] != FIXED and region[s] == node_of_slot[destination])


@njit(cache=True, nogil=True, error_model="numpy")
def balance_fixed_loads(slot_loads, weights, row, region, node_of_slot, slots_per_gpu, gpus_per_node, max_swaps,
                        partners):
    """Swap slots between GPUs, best swap first, while the weighted sum of window peaks drops.

    A swap exchanges two slots on different GPUs (their experts and their loads). A slot of region
    ``ANYWHERE`` may go to any node, one of region ``n >= 0`` only to node ``n``, one ``FIXED``
    nowhere. Each round takes the GPU that is the peak of the largest weight of windows and
    applies its best improving swap with a slot of the ``partners`` GPUs of least weighted mean
    load on its node or anywhere (the next peak GPU when it has none).

    Args:
        slot_loads: ``[T, S]`` float64 load of each slot in each window (swapped in place).
        weights: ``[T]`` float64 window weights.
        row: ``[S]`` int64 expert of each slot (swapped in place).
        region: ``[S]`` int64 (swapped in place, with the slots); node_of_slot: ``[S]`` int64.
        slots_per_gpu, gpus_per_node: the layout (contiguous slots per GPU, GPUs per node);
        max_swaps: at most this many swaps; partners: ``>= 1``.
    Returns:
        ``(before, after)``: the objective before and after.
    """
    num_windows, num_slots = slot_loads.shape
    num_gpus = num_slots // slots_per_gpu
    loads = np.zeros((num_windows, num_gpus))
    for t in range(num_windows):
        for s in range(num_slots):
            loads[t, s // slots_per_gpu] += slot_loads[t, s]
    top = np.full((num_windows, 4), -1, np.int64)
    for t in range(num_windows):
        rank_window(loads, t, top)
    before = _objective(loads, weights)
    mark = np.zeros(num_gpus, np.int64)
    mass = np.zeros(num_gpus)
    tried = np.zeros(num_gpus, np.bool_)
    mean_load = np.zeros(num_gpus)
    others = np.zeros(num_windows)
    rest = np.zeros(num_windows + 1)
    light = np.zeros(2 * partners, np.int64)
    for stamp in range(1, max_swaps + 1):
        mass[:] = 0.0
        mean_load[:] = 0.0
        for t in range(num_windows):
            mass[top[t, 0]] += weights[t]
            for g in range(num_gpus):
                mean_load[g] += weights[t] * loads[t, g]
        tried[:] = False
        best_delta, best_a, best_b = -1e-12, -1, -1
        while best_a < 0:
            a, heaviest = -1, 0.0
            for g in range(num_gpus):
                if not tried[g] and mass[g] > heaviest:
                    a, heaviest = g, mass[g]
            if a < 0:
                break
            tried[a] = True
            for i in range(_partners(mean_load, a, gpus_per_node, partners, light)):
                b = light[i]
                mark[a] = stamp * num_gpus + b
                mark[b] = stamp * num_gpus + b
                # rest[t]: the least windows t.. can add to a swap's delta (a and b at best level
                # out at their mean), so that a swap is dropped as soon as it cannot beat the best
                rest[num_windows] = 0.0
                for t in range(num_windows - 1, -1, -1):
                    others[t] = max_untouched(loads, t, top, mark, stamp * num_gpus + b)
                    level = max(others[t], 0.5 * (loads[t, a] + loads[t, b]))
                    rest[t] = rest[t + 1] + weights[t] * (level - loads[t, top[t, 0]])
                if rest[0] >= best_delta:
                    continue
                for s1 in range(a * slots_per_gpu, (a + 1) * slots_per_gpu):
                    for s2 in range(b * slots_per_gpu, (b + 1) * slots_per_gpu):
                        if row[s1] == row[s2] or not _allowed(region, node_of_slot, s1, s2) \
                                or not _allowed(region, node_of_slot, s2, s1):
                            continue
                        delta = 0.0
                        for t in range(num_windows):
                            moved = slot_loads[t, s2] - slot_loads[t, s1]
                            peak = max(others[t], loads[t, a] + moved, loads[t, b] - moved)
                            delta += weights[t] * (peak - loads[t, top[t, 0]])
                            if delta + rest[t + 1] >= best_delta:
                                delta = best_delta  # cannot beat the best: dropped
                                break
                        if delta < best_delta:
                            best_delta, best_a, best_b = delta, s1, s2
        if best_a < 0:
            break
        a, b = best_a // slots_per_gpu, best_b // slots_per_gpu
        for t in range(num_windows):
            moved = slot_loads[t, best_b] - slot_loads[t, best_a]
            loads[t, a] += moved
            loads[t, b] -= moved
            value = slot_loads[t, best_a]
            slot_loads[t, best_a] = slot_loads[t, best_b]
            slot_loads[t, best_b] = value
            rank_window(loads, t, top)
        row[best_a], row[best_b] = row[best_b], row[best_a]
        region[best_a], region[best_b] = region[best_b], region[best_a]
    return before, _objective(loads, weights)


@njit(cache=True, nogil=True, error_model="numpy")
def spread_over_nodes(row, weights, logcnt, slots_per_gpu, gpus_per_node):
    """Move replicas so that each replicated expert's replicas spread over the nodes as evenly as
    they can (at most ``ceil(r / N)`` on a node), heaviest expert first, in place.

    A replica leaves the node holding the most replicas of its expert by swapping with a
    single-replica expert on a node holding the fewest, on a GPU without the expert, the one
    whose load is closest to the replica's (``weights[e] / r``). Single-replica experts already
    moved to make room are not moved again.

    Args:
        row: ``[S]`` int64 expert of each slot; weights: ``[E]`` float64 planning load;
        logcnt: ``[E]`` int64 replicas; slots_per_gpu, gpus_per_node: the layout.
    Returns:
        Number of replicas moved.
    """
    num_slots = row.shape[0]
    num_experts = logcnt.shape[0]
    per_node = slots_per_gpu * gpus_per_node
    num_nodes = num_slots // per_node
    order = stable_argsort(-weights)
    moved_slot = np.zeros(num_slots, np.bool_)
    moves = 0
    for e in order:
        replicas = logcnt[e]
        if replicas < 2:
            continue
        ceiling = (replicas + num_nodes - 1) // num_nodes
        floor = replicas // num_nodes
        while True:
            count = np.zeros(num_nodes, np.int64)
            for s in range(num_slots):
                if row[s] == e:
                    count[s // per_node] += 1
            src = np.argmax(count)
            dst = np.argmin(count)
            if count[src] <= ceiling and count[dst] >= floor:
                break
            if count[src] - count[dst] < 2:
                break
            from_slot = -1
            for s in range(src * per_node, (src + 1) * per_node):
                if row[s] == e and not moved_slot[s]:
                    from_slot = s
            if from_slot < 0:
                break
            target = weights[e] / replicas
            best, best_gap = -1, np.inf
            for s in range(dst * per_node, (dst + 1) * per_node):
                f = row[s]
                if logcnt[f] != 1 or moved_slot[s]:
                    continue
                gpu = s // slots_per_gpu
                holds = False
                for x in range(gpu * slots_per_gpu, (gpu + 1) * slots_per_gpu):
                    if row[x] == e:
                        holds = True
                if holds:
                    continue
                gap = abs(weights[f] - target)
                if gap < best_gap:
                    best, best_gap = s, gap
            if best < 0:
                break
            row[from_slot], row[best] = row[best], row[from_slot]
            moved_slot[from_slot] = True
            moved_slot[best] = True
            moves += 1
    return moves
