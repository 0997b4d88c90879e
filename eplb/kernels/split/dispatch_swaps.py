"""Slot swaps for an engine that dispatches optimally: a hill climb per layer that swaps two slots'
experts when the weighted mean over windows of the optimal-dispatch ``peak / mean load`` drops
(:func:`improve_for_dispatch`), with its window tables (:class:`LayerWindows`) and slot draws. The
dispatch itself is :mod:`eplb.kernels.split.shares`."""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, next_random
from .shares import optimal_shares, share_gpu_loads

LayerWindows = namedtuple("LayerWindows", ["weights", "scale", "tiled", "new_shares"])
LayerWindows.__doc__ = """One layer's windows in :func:`improve_for_dispatch`: ``weights [T, E]`` float64 their
counts, ``scale [T]`` float64 each window's weight over its mean GPU load (0: ignored), ``tiled [T, S]``
int64 the placement tried (one copy a window), ``new_shares [T, S]`` float64 its optimal shares."""


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _load_windows(windows, window_weights, layer, row, num_gpus, lw):
    """Fill the :class:`LayerWindows` ``lw`` with ``layer`` of ``windows [T, L, E]`` (weights
    ``window_weights [T]``) and the placement ``row [S]`` int64. Returns the total weight of the
    windows that carry load."""
    num_windows, _, num_experts = windows.shape
    weights, scale, tiled = lw.weights, lw.scale, lw.tiled
    total_weight = 0.0
    for t in range(num_windows):
        mean = 0.0
        for e in range(num_experts):
            weights[t, e] = windows[t, layer, e]
            mean += windows[t, layer, e]
        mean /= num_gpus
        scale[t] = window_weights[t] / mean if mean > 0.0 and window_weights[t] > 0.0 else 0.0
        total_weight += window_weights[t] if scale[t] > 0.0 else 0.0
        for s in range(row.shape[0]):
            tiled[t, s] = row[s]
    return total_weight


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _slot_on_gpu(state, slot_offsets, gpu, row, count, keep_replicas):
    """A random slot of ``gpu`` (``slot_offsets [G + 1]``) whose expert in ``row [S]`` may move (with
    ``keep_replicas``: one with ``count [E]`` 1), up to 32 draws. Returns ``(slot or -1, state)``."""
    size = slot_offsets[gpu + 1] - slot_offsets[gpu]
    for _ in range(32):
        state = next_random(state)
        candidate = slot_offsets[gpu] + np.int64(state % np.uint64(size))
        if not keep_replicas or count[row[candidate]] == 1:
            return candidate, state
    return -1, state


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _partner_slot(state, row, a, gpu, gpu_of_slot, zone_of_slot, count, keep_replicas):
    """A random slot off ``gpu`` in slot ``a``'s zone (``gpu_of_slot``, ``zone_of_slot [S]`` int64)
    holding another expert than ``a`` in ``row [S]``, one that may move (``count [E]``,
    ``keep_replicas`` as in :func:`_slot_on_gpu`), up to 32 draws. Returns ``(slot or -1, state)``."""
    num_slots = row.shape[0]
    for _ in range(32):
        state = next_random(state)
        candidate = np.int64(state % np.uint64(num_slots))
        if gpu_of_slot[candidate] == gpu or zone_of_slot[candidate] != zone_of_slot[a]:
            continue
        if row[candidate] == row[a] or (keep_replicas and count[row[candidate]] != 1):
            continue
        return candidate, state
    return -1, state


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _set_pair(tiled, a, b, expert_a, expert_b):
    """Put ``expert_a`` in slot ``a`` and ``expert_b`` in slot ``b`` of every window's ``tiled [T, S]``."""
    for r in range(tiled.shape[0]):
        tiled[r, a] = expert_a
        tiled[r, b] = expert_b


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _swapped_value(lw, window_weights, first, target, total_weight, gpu_of_slot, num_gpus):
    """The weighted sum of ``peak / mean`` of the placement ``lw.tiled`` (a :class:`LayerWindows`, its
    optimal shares written to ``lw.new_shares``), windows one at a time from ``first``: stops as soon
    as the windows seen, with every other window at its floor (peak = mean), cannot get below
    ``target``. Returns ``(value, rejected)``."""
    num_windows, num_slots = lw.tiled.shape
    floor = total_weight
    value = 0.0
    for step in range(num_windows):
        r = (first + step) % num_windows
        if lw.scale[r] <= 0.0:
            continue
        one_shares, one_peak = optimal_shares(lw.weights[r : r + 1], lw.tiled[r : r + 1], gpu_of_slot, num_gpus)
        for s in range(num_slots):
            lw.new_shares[r, s] = one_shares[0, s]
        value += lw.scale[r] * one_peak[0]
        floor -= window_weights[r]
        if value + floor >= target:
            return value, True
    return value, False


@njit(cache=True, nogil=True, error_model="numpy")
def improve_for_dispatch(windows, window_weights, phy2log, gpu_of_slot, slot_offsets, zone_of_slot, iterations, seed,
                         keep_replicas):
    """Swap slots to lower the mean over windows of the optimal-dispatch peak (a placement made for
    an engine that splits tokens optimally among replicas).

    Per layer, a hill climb: take a window in turn, a slot on its most loaded GPU (under optimal
    dispatch) and a random slot of another GPU in the same zone (node, when groups must stay on
    their node; else one zone), swap their experts, and keep the swap when the weighted mean of
    ``peak / mean load`` over the windows drops. Replica counts do not change; with
    ``keep_replicas`` only slots of experts with one replica move, so the replicated experts keep
    their GPUs (the links a :func:`eplb.kernels.search.linked.linked_placement` laid out).

    Args:
        windows: ``[T, L, E]`` float64 counts the placement should serve well.
        window_weights: ``[T]`` float64, non-negative (a window of weight 0 is ignored).
        phy2log: ``[L, S]`` int64 starting placement.
        gpu_of_slot: ``[S]`` int64; slot_offsets: ``[G + 1]`` int64 first slot of each GPU.
        zone_of_slot: ``[S]`` int64, swaps stay inside a zone.
        iterations: swaps tried per layer; seed: ``>= 1``, the random stream.
        keep_replicas: bool, swap only slots whose expert has a single replica.
    Returns:
        ``phy2log [L, S]`` int64 (a new array), ``before [L]`` and ``after [L]`` float64 (the
        weighted mean of ``peak / mean`` on the windows).
    """
    num_windows, num_layers, num_experts = windows.shape
    num_slots = phy2log.shape[1]
    num_gpus = slot_offsets.shape[0] - 1
    out = phy2log.copy()
    before = np.ones(num_layers)
    after = np.ones(num_layers)
    lw = LayerWindows(np.empty((num_windows, num_experts)), np.zeros(num_windows),
                      np.empty((num_windows, num_slots), np.int64), np.empty((num_windows, num_slots)))
    weights, scale, tiled, new_shares = lw
    count = np.zeros(num_experts, np.int64)
    state = np.uint64(seed) if seed > 0 else np.uint64(88172645463325252)
    for layer in range(num_layers):
        row = out[layer]
        total_weight = _load_windows(windows, window_weights, layer, row, num_gpus, lw)
        if total_weight <= 0.0:
            continue
        count[:] = 0
        for s in range(num_slots):
            count[row[s]] += 1
        shares, peak = optimal_shares(weights, tiled, gpu_of_slot, num_gpus)
        current = 0.0
        for t in range(num_windows):
            current += scale[t] * peak[t]
        current /= total_weight
        before[layer] = current
        t = -1
        for _ in range(iterations):
            t = (t + 1) % num_windows
            while scale[t] <= 0.0:
                t = (t + 1) % num_windows
            loads = share_gpu_loads(weights[t : t + 1], tiled[t : t + 1], shares[t : t + 1], gpu_of_slot, num_gpus)
            hot = 0
            for g in range(1, num_gpus):
                if loads[0, g] > loads[0, hot]:
                    hot = g
            a, state = _slot_on_gpu(state, slot_offsets, hot, row, count, keep_replicas)
            if a < 0:
                continue
            b, state = _partner_slot(state, row, a, hot, gpu_of_slot, zone_of_slot, count, keep_replicas)
            if b < 0:
                continue
            _set_pair(tiled, a, b, row[b], row[a])
            value, rejected = _swapped_value(lw, window_weights, t, current * (1.0 - 1e-12) * total_weight,
                                             total_weight, gpu_of_slot, num_gpus)
            if not rejected:
                expert = row[a]
                row[a] = row[b]
                row[b] = expert
                for r in range(num_windows):
                    for s in range(num_slots):
                        shares[r, s] = new_shares[r, s]
                current = value / total_weight
            else:
                _set_pair(tiled, a, b, row[a], row[b])
        after[layer] = current
    return out, before, after
