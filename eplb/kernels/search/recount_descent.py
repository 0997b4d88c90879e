"""A descent that changes replica counts in place, for few slots a GPU.

At 3 or 4 slots a GPU a swap descent stops where no exchange of replicas (one for one, or two for
two) lowers the heaviest GPU: the replica loads are too coarse. Changing one slot's expert moves
load in finer steps: giving an expert of the heaviest GPU one more replica lowers every GPU that
holds it, and taking a replica from an expert of the heaviest GPU for another expert replaces
that replica by a lighter one. Each move turns the replica in one slot of a donor expert (two or
more replicas) into a replica of a receiver expert that its GPU does not hold (so no two replicas
of an expert share a GPU that did not before), and every GPU holding either expert changes load.

The descent (:func:`recount_descent`) ranks the moves by the largest load of a GPU they touch
(before any swap), tries them best first, each followed by a swap descent, and keeps the first
that leaves the heaviest GPU lighter (undoing the others); then again from there, until
``trials`` moves have been tried or none helps. The max load falls at every kept move. No random
numbers: ties go to the lower expert and the lower slot, so a layer's row depends on its loads
and its start alone.

State arrays as in :mod:`eplb.kernels.search.packing`; ``where [S]`` int64 is the GPU of each
replica, ``first [E + 1]`` / ``slots_of [S]`` int64 the replicas of each expert (expert ``e``'s are
``slots_of[first[e]:first[e + 1]]``).
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL
from .local_search import pair_swap_descent, swap_descent
from .packing import PackState, load_state, new_state, recompute_loads, store_state


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _index(item_expert, gpu_items, gpu_fill, where, first, slots_of):
    """Fill ``where [S]`` (the GPU of each replica) and ``first [E + 1]`` / ``slots_of [S]`` (the
    replicas of each expert, in increasing id) from the state; ``first[e + 1] - first[e]`` is then
    expert ``e``'s replica count."""
    first[:] = 0
    for g in range(gpu_fill.shape[0]):
        for j in range(gpu_fill[g]):
            where[gpu_items[g, j]] = g
    for s in range(item_expert.shape[0]):
        first[item_expert[s] + 1] += 1
    for e in range(first.shape[0] - 1):
        first[e + 1] += first[e]
    fill = first[:-1].copy()
    for s in range(item_expert.shape[0]):
        e = item_expert[s]
        slots_of[fill[e]] = s
        fill[e] += 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _offer(score, slot, receiver, best):
    """Insert the move ``(score, slot, receiver)`` into ``best [T, 3]`` float64, kept in increasing
    score (ties: the earlier offered first); a move scoring above the last one is dropped."""
    last = best.shape[0] - 1
    if score >= best[last, 0]:
        return
    i = last
    while i > 0 and best[i - 1, 0] > score:
        best[i, 0], best[i, 1], best[i, 2] = best[i - 1, 0], best[i - 1, 1], best[i - 1, 2]
        i -= 1
    best[i, 0], best[i, 1], best[i, 2] = score, slot, receiver


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _receive(w, h, top, pack, index, best):
    """Offer (:func:`_offer`) every move giving an expert ``e`` of the heaviest GPU ``h`` (load
    ``top``) one more replica, in a slot of a donor expert ``d`` (two or more replicas, none on
    ``h``) on the lightest GPU of ``d``'s that lacks ``e``. ``pack``: the
    :class:`eplb.kernels.search.packing.PackState`; ``index``: ``(where, first, slots_of)`` (module
    docstring); ``best [T, 3]``: ``(score, slot, receiver)``, the score the largest load of a GPU
    the move touches before any swap. Every GPU holding ``e`` falls by ``w_e / (r_e (r_e + 1))``,
    every other GPU of ``d``'s rises by ``w_d / (r_d (r_d - 1))``."""
    gpu_load, holds = pack.gpu_load, pack.holds
    where, first, slots_of = index
    num_experts = w.shape[0]
    for e in range(num_experts):
        if holds[h, e] == 0:
            continue
        r_e = first[e + 1] - first[e]
        fall = w[e] / r_e - w[e] / (r_e + 1)
        if fall <= 0.0:
            continue
        for d in range(num_experts):
            r_d = first[d + 1] - first[d]
            if d == e or r_d < 2 or holds[h, d] > 0:
                continue
            rise = w[d] / (r_d - 1) - w[d] / r_d
            slot = np.int64(-1)
            for p in range(first[d], first[d + 1]):  # the lightest GPU of d's without e takes e's replica
                g = where[slots_of[p]]
                if holds[g, e] == 0 and (slot < 0 or gpu_load[g] < gpu_load[where[slot]]):
                    slot = slots_of[p]
            if slot < 0:
                continue
            score = max(top - fall, gpu_load[where[slot]] - w[d] / r_d + w[e] / (r_e + 1))
            for p in range(first[d], first[d + 1]):
                g = where[slots_of[p]]
                if slots_of[p] != slot:
                    score = max(score, gpu_load[g] + rise - (fall if holds[g, e] > 0 else 0.0))
            _offer(score, slot, e, best)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _give(w, h, top, pack, index, best):
    """Offer every move turning a replica on the heaviest GPU ``h`` (load ``top``) of an expert
    ``d`` with two or more replicas into one of an expert ``e`` that ``h`` lacks, if ``h`` gets
    lighter: ``h`` changes by ``w_e / (r_e + 1) - w_d / r_d``, every other GPU of ``d``'s rises by
    ``w_d / (r_d (r_d - 1))``, every GPU of ``e``'s falls by ``w_e / (r_e (r_e + 1))``. Arguments
    as in :func:`_receive`."""
    item_expert, gpu_items, gpu_fill, gpu_load, holds = (pack.item_expert, pack.gpu_items, pack.gpu_fill,
                                                         pack.gpu_load, pack.holds)
    where, first, slots_of = index
    num_experts = w.shape[0]
    for j in range(gpu_fill[h]):
        slot = gpu_items[h, j]
        d = item_expert[slot]
        r_d = first[d + 1] - first[d]
        if r_d < 2:
            continue
        rise = w[d] / (r_d - 1) - w[d] / r_d
        for e in range(num_experts):
            r_e = first[e + 1] - first[e]
            if e == d or holds[h, e] > 0 or w[e] / (r_e + 1) >= w[d] / r_d:
                continue
            fall = w[e] / r_e - w[e] / (r_e + 1) if r_e > 0 else 0.0
            score = top - w[d] / r_d + w[e] / (r_e + 1)
            for p in range(first[d], first[d + 1]):
                g = where[slots_of[p]]
                if g != h:
                    score = max(score, gpu_load[g] + rise - (fall if holds[g, e] > 0 else 0.0))
            _offer(score, slot, e, best)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _recount(w, slot, receiver, pack, index, gpus):
    """Turn the replica in ``slot`` into one of ``receiver``: the experts' replica loads, the GPU
    loads and ``index`` follow."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    where, first, slots_of = index
    donor = item_expert[slot]
    g = where[slot]
    holds[g, donor] -= 1
    holds[g, receiver] += 1
    item_expert[slot] = receiver
    _index(item_expert, gpu_items, gpu_fill, where, first, slots_of)
    for e in (donor, receiver):
        r = first[e + 1] - first[e]
        for p in range(first[e], first[e + 1]):
            item_load[slots_of[p]] = w[e] / r
    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _restore(w, pack, index, saved_expert, saved_items, gpus):
    """Put back the replicas' experts ``saved_expert [S]`` and the GPUs' replicas ``saved_items [G, K]``
    (each GPU's fill unchanged): ``holds``, the replica loads, the GPU loads and ``index`` follow."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    where, first, slots_of = index
    for g in range(gpu_fill.shape[0]):
        for j in range(gpu_fill[g]):
            holds[g, item_expert[gpu_items[g, j]]] = 0
    item_expert[:] = saved_expert
    gpu_items[:, :] = saved_items
    for g in range(gpu_fill.shape[0]):
        for j in range(gpu_fill[g]):
            holds[g, item_expert[gpu_items[g, j]]] += 1
    _index(item_expert, gpu_items, gpu_fill, where, first, slots_of)
    for s in range(item_expert.shape[0]):
        e = item_expert[s]
        item_load[s] = w[e] / (first[e + 1] - first[e])
    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _swaps(pack, gpus, pair_swaps, max_steps):
    """Swap descent on the state (pair swaps too with ``pair_swaps``), then the GPU loads summed afresh;
    returns the heaviest GPU's load."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    if pair_swaps:
        pair_swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps)
    else:
        swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps)
    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)
    return gpu_load.max()


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _descend_layer(w, pack, index, gpus, pair_swaps, trials, max_steps):
    """Swap descent (pair swaps too with ``pair_swaps``), then rounds while ``trials`` last: the
    best-scoring moves of :func:`_receive` and :func:`_give` in turn, each followed by the swap
    descent and kept if the heaviest GPU ends lighter (else undone), the first kept ending the
    round; every move tried spends a trial. Returns the moves kept."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    best = np.empty((max(trials, 1), 3))
    top = _swaps(pack, gpus, pair_swaps, max_steps)
    moves = 0
    while trials > 0:
        _index(item_expert, gpu_items, gpu_fill, index[0], index[1], index[2])
        h = np.argmax(gpu_load)  # the heaviest GPU, the lowest id on ties
        best[:, 0] = np.inf
        best[:, 1] = -1.0
        _receive(w, h, top, pack, index, best)
        _give(w, h, top, pack, index, best)
        saved_expert = item_expert.copy()
        saved_items = gpu_items.copy()
        kept = False
        for t in range(best.shape[0]):
            if best[t, 1] < 0 or trials == 0:
                break
            trials -= 1
            _recount(w, np.int64(best[t, 1]), np.int64(best[t, 2]), pack, index, gpus)
            after = _swaps(pack, gpus, pair_swaps, max_steps)
            if after < top * (1.0 - 1e-12):
                top = after
                kept = True
                break
            _restore(w, pack, index, saved_expert, saved_items, gpus)
        if not kept:
            break
        moves += 1
    return moves


@njit(cache=True, nogil=True, error_model="numpy")
def recount_descent(weights, phy2log, slot_offsets, layers, pair_swaps, trials, max_steps):
    """Improve the rows ``layers`` of a global placement by :func:`_descend_layer` (module docstring).

    Args:
        weights: ``[L, E]`` float64; phy2log: ``[L, S]`` int64 (not modified); slot_offsets:
            ``[G + 1]`` int64; layers: ``[n]`` int64 the rows to improve.
        pair_swaps: exchange two replicas for two as well (worth it at four or more slots a GPU).
        trials: most moves tried per layer (each with a swap descent); max_steps: most swaps per descent.
    Returns:
        ``(rows [n, S] int64, moves [n] int64)``: the improved rows (max GPU load never above the
        start's) and the slot changes made in each.
    """
    num_experts = weights.shape[1]
    num_slots = phy2log.shape[1]
    num_gpus = slot_offsets.shape[0] - 1
    width = np.int64(1)
    for g in range(num_gpus):
        width = max(width, slot_offsets[g + 1] - slot_offsets[g])
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = new_state(num_slots, num_gpus, width, num_experts)
    pack = PackState(item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)
    index = (np.empty(num_slots, np.int64), np.zeros(num_experts + 1, np.int64), np.empty(num_slots, np.int64))
    gpus = np.arange(num_gpus).astype(np.int64)
    rows = np.empty((layers.shape[0], num_slots), np.int64)
    moves = np.zeros(layers.shape[0], np.int64)
    for i in range(layers.shape[0]):
        layer = layers[i]
        load_state(phy2log[layer], weights[layer], slot_offsets, item_expert, item_load, gpu_items, gpu_fill,
                   gpu_load, holds)
        start = gpu_load.max()
        moves[i] = _descend_layer(weights[layer], pack, index, gpus, pair_swaps, trials, max_steps)
        store_state(item_expert, gpu_items, gpu_fill, slot_offsets, rows[i])
        if gpu_load.max() > start:  # never heavier (the descents only lower the heaviest GPU)
            rows[i] = phy2log[layer]
    return rows, moves
