"""Kernels that pack replicas onto GPUs.

Working state of one layer, shared with :mod:`eplb.kernels.search.local_search`:

- ``item_expert [S]`` int64 and ``item_load [S]`` float64: the expert of each replica and the load
  it carries (``w_e / r_e``);
- ``gpu_items [G, K]`` int64: the replicas on each GPU, ``K`` = most slots of any GPU; entry
  ``j < gpu_fill[g]`` sits in slot ``slot_offsets[g] + j``;
- ``gpu_fill [G]`` int64, ``gpu_load [G]`` float64: replicas on and load of each GPU;
- ``holds [G, E]`` int64: replicas of each expert on each GPU.

Kernels that take the whole state take it as one :class:`PackState`.
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, heap_sift_down, heapify, stable_argsort

PackState = namedtuple("PackState", ["item_expert", "item_load", "gpu_items", "gpu_fill", "gpu_load", "holds"])
PackState.__doc__ = """The working state of one layer (module docstring), as :func:`new_state` returns it."""


@njit(cache=True, nogil=True, error_model="numpy")
def new_state(num_slots, num_gpus, width, num_experts):
    """Empty working state (module docstring) for ``num_slots`` replicas on ``num_gpus`` GPUs of at
    most ``width`` slots: ``(item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)``."""
    return (np.empty(num_slots, np.int64), np.empty(num_slots), np.empty((num_gpus, width), np.int64),
            np.zeros(num_gpus, np.int64), np.zeros(num_gpus), np.zeros((num_gpus, num_experts), np.int64))


@njit(cache=True, nogil=True, error_model="numpy")
def clear_gpus(gpus, item_expert, gpu_items, gpu_fill, gpu_load, holds):
    """Take every replica off the GPUs ``gpus [m]``."""
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        for j in range(gpu_fill[g]):
            holds[g, item_expert[gpu_items[g, j]]] = 0
        gpu_fill[g] = 0
        gpu_load[g] = 0.0


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _free_gpu_heap(gpus, slots_per_gpu, gpu_fill, gpu_load, key, heap):
    """Fill ``heap`` with the positions in ``gpus [m]`` of the GPUs with a free slot, as a min-heap
    keyed by ``key [m]`` (set here to their loads); returns the heap's size."""
    size = np.int64(0)
    for gi in range(gpus.shape[0]):
        key[gi] = gpu_load[gpus[gi]]
        if gpu_fill[gpus[gi]] < slots_per_gpu[gpus[gi]]:
            heap[size] = gi
            size += 1
    heapify(heap, size, key)
    return size


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def pack_spread_largest_first(item_load, item_expert, items, gpus, slots_per_gpu, gpu_items, gpu_fill,
                              gpu_load, holds):
    """Place replicas in decreasing load, each on the lightest GPU with a free slot that does not
    already hold its expert (the lightest GPU with a free slot if every such GPU holds it).

    Args:
        items: ``[n]`` int64 replica ids in decreasing load; ``n`` = free slots of ``gpus``.
        gpus: ``[m]`` int64 GPU ids to fill (in tie-breaking order).
        slots_per_gpu: ``[G]`` int64.
        The working-state arrays (module docstring) are updated in place.
    """
    # the GPUs with a free slot in a min-heap of their positions in ``gpus``, keyed by load (the
    # lighter first, the earlier position on ties): O(n log m) per domain, not O(n m)
    m = gpus.shape[0]
    key = np.empty(m)
    heap = np.empty(m, np.int64)
    size = _free_gpu_heap(gpus, slots_per_gpu, gpu_fill, gpu_load, key, heap)
    top = np.int64(0)  # typed, not the literal: one specialization of the sift
    for t in range(items.shape[0]):
        item = items[t]
        e = item_expert[item]
        best = gpus[heap[0]]
        if holds[best, e] > 0:  # rare: look for the lightest GPU with room that lacks the expert
            for gi in range(m):
                g = gpus[gi]
                if gpu_fill[g] < slots_per_gpu[g] and holds[g, e] == 0 and (
                    holds[best, e] > 0 or gpu_load[g] < gpu_load[best]
                ):
                    best = g
        gpu_items[best, gpu_fill[best]] = item
        gpu_fill[best] += 1
        gpu_load[best] += item_load[item]
        holds[best, e] += 1
        if best == gpus[heap[0]]:  # the root's load rose (or it is full: it leaves the heap)
            key[heap[0]] = gpu_load[best]
            if gpu_fill[best] == slots_per_gpu[best]:
                size -= 1
                heap[0] = heap[size]
            heap_sift_down(heap, size, key, top)
        else:  # another GPU changed: rebuild the heap (rare)
            size = _free_gpu_heap(gpus, slots_per_gpu, gpu_fill, gpu_load, key, heap)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def load_state(phy2log_row, weights_row, slot_offsets, item_expert, item_load, gpu_items, gpu_fill,
               gpu_load, holds):
    """Build the working state of one layer from a placement.

    Args:
        phy2log_row: ``[S]`` int64 expert of each slot; ``weights_row``: ``[E]`` float64.
        slot_offsets: ``[G + 1]`` int64. Item ``s`` is the replica in slot ``s``.
    """
    num_gpus = slot_offsets.shape[0] - 1
    num_experts = weights_row.shape[0]
    counts = np.zeros(num_experts, np.int64)
    for s in range(phy2log_row.shape[0]):
        counts[phy2log_row[s]] += 1
    holds[:, :] = 0
    for g in range(num_gpus):
        gpu_fill[g] = 0
        gpu_load[g] = 0.0
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            e = phy2log_row[s]
            item_expert[s] = e
            item_load[s] = weights_row[e] / counts[e]
            gpu_items[g, gpu_fill[g]] = s
            gpu_fill[g] += 1
            gpu_load[g] += item_load[s]
            holds[g, e] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def store_state(item_expert, gpu_items, gpu_fill, slot_offsets, phy2log_row):
    """Write the working state of one layer back as ``phy2log_row [S]``."""
    num_gpus = slot_offsets.shape[0] - 1
    for g in range(num_gpus):
        for j in range(gpu_fill[g]):
            phy2log_row[slot_offsets[g] + j] = item_expert[gpu_items[g, j]]


@njit(cache=True, nogil=True, error_model="numpy")
def recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load):
    """Sum every listed GPU's load afresh (removes rounding drift of incremental updates)."""
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        total = 0.0
        for j in range(gpu_fill[g]):
            total += item_load[gpu_items[g, j]]
        gpu_load[g] = total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def pack_spread_by_free_slots(item_load, item_expert, items, gpus, slots_per_gpu, gpu_items, gpu_fill, gpu_load,
                              holds):
    """Place the replicas of one expert after another (most replicas first), each on a different
    GPU: the GPUs with the most free slots, the lightest among equals.

    This is the Havel-Hakimi construction: it puts no two replicas of an expert on one GPU
    whenever the replica counts and slot counts allow it (Gale-Ryser), at the price of balance
    (the swap descent restores it). Arguments as :func:`pack_spread_largest_first`; ``items``
    holds each expert's replicas next to each other.
    """
    n = items.shape[0]
    # runs of one expert in `items`
    starts = np.empty(n + 1, np.int64)
    runs = 0
    for t in range(n):
        if t == 0 or item_expert[items[t]] != item_expert[items[t - 1]]:
            starts[runs] = t
            runs += 1
    starts[runs] = n
    sizes = np.empty(runs, np.int64)
    for i in range(runs):
        sizes[i] = starts[i + 1] - starts[i]
    # sorted as float64 (exact for these counts, same stable order): the float64 stable sort is
    # compiled anyway, an int64 one would be a second specialization
    order = stable_argsort(-sizes.astype(np.float64))
    for oi in range(runs):
        run = order[oi]
        for t in range(starts[run], starts[run + 1]):
            item = items[t]
            e = item_expert[item]
            best = -1
            for gi in range(gpus.shape[0]):
                g = gpus[gi]
                free = slots_per_gpu[g] - gpu_fill[g]
                if free <= 0:
                    continue
                if best < 0:
                    best = g
                    continue
                shared, best_shared = holds[g, e] > 0, holds[best, e] > 0
                best_free = slots_per_gpu[best] - gpu_fill[best]
                if (best_shared and not shared) or (shared == best_shared and (
                        free > best_free or (free == best_free and gpu_load[g] < gpu_load[best]))):
                    best = g
            gpu_items[best, gpu_fill[best]] = item
            gpu_fill[best] += 1
            gpu_load[best] += item_load[item]
            holds[best, e] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def max_gpu_loads(weights, phy2log, slot_offsets):
    """``[L]`` float64: the max GPU load of a placement ``phy2log [L, S]`` for ``weights [L, E]``."""
    num_layers, num_experts = weights.shape
    num_gpus = slot_offsets.shape[0] - 1
    out = np.zeros(num_layers)
    counts = np.zeros(num_experts, np.int64)
    for layer in range(num_layers):
        counts[:] = 0
        for s in range(phy2log.shape[1]):
            counts[phy2log[layer, s]] += 1
        for g in range(num_gpus):
            total = 0.0
            for s in range(slot_offsets[g], slot_offsets[g + 1]):
                e = phy2log[layer, s]
                total += weights[layer, e] / counts[e]
            out[layer] = max(out[layer], total)
    return out
