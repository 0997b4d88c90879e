"""Kernels that spread each expert's replicas over failure domains (GPUs or nodes), so that losing
one domain orphans as few tokens as possible, while keeping the GPU loads balanced.

They work on the packing state of one layer (:mod:`eplb.kernels.search.packing`, a ``PackState``) plus a
:class:`SpreadState`:

- ``gpu_domain [G]`` int64: the failure domain of each GPU (the GPU itself, or its node);
- ``dholds [D, E]`` int64: replicas of each expert in each domain;
- ``span [E]`` int64: domains holding each expert;
- ``need [E]`` int64: domains each expert must span (2: it survives one loss; 1: no rule);
- ``counts [E]`` int64: replicas of each expert.

No move ever adds a doubled replica (a second replica of an expert on a GPU), or leaves an
expert spanning fewer domains than ``min(its span before, its need)``.
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL
from ..search.packing import load_state, recompute_loads

SpreadState = namedtuple("SpreadState", ["gpu_domain", "dholds", "span", "need", "counts"])
SpreadState.__doc__ = """The failure-domain state of one layer (module docstring)."""


@njit(cache=True, nogil=True, error_model="numpy")
def load_spread(row, w, slot_offsets, pack, spread):
    """Fill ``pack`` and ``spread`` (``need`` is the caller's) from one layer's placement ``row [S]``
    for loads ``w [E]``; ``slot_offsets [G + 1]``."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    gpu_domain, dholds, span, need, counts = spread
    load_state(row, w, slot_offsets, item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)
    dholds[:, :] = 0
    span[:] = 0
    counts[:] = 0
    for g in range(slot_offsets.shape[0] - 1):
        d = gpu_domain[g]
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            e = row[s]
            counts[e] += 1
            span[e] += 1 if dholds[d, e] == 0 else 0
            dholds[d, e] += 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def span_after(e, source, target, spread):
    """Domains expert ``e`` spans once one of its replicas moves from domain ``source`` to ``target``."""
    dholds, span = spread.dholds, spread.span
    if source == target:
        return span[e]
    return span[e] - (1 if dholds[source, e] == 1 else 0) + (1 if dholds[target, e] == 0 else 0)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def may_swap(a, h, b, g, pack, spread):
    """Whether replica ``a`` on GPU ``h`` and replica ``b`` on GPU ``g`` may change places: no more
    replicas doubled on a GPU than before (where a GPU has more slots than there are experts some
    must be), no expert's span below ``min(span, need)``."""
    item_expert, holds = pack.item_expert, pack.holds
    ea, eb = item_expert[a], item_expert[b]
    if ea == eb:
        return False
    doubled = ((1 if holds[h, eb] > 0 else 0) + (1 if holds[g, ea] > 0 else 0)
               - (1 if holds[h, ea] > 1 else 0) - (1 if holds[g, eb] > 1 else 0))
    if doubled > 0:
        return False
    dh, dg = spread.gpu_domain[h], spread.gpu_domain[g]
    if dh == dg:
        return True
    span, need = spread.span, spread.need
    return (span_after(ea, dh, dg, spread) >= min(span[ea], need[ea])
            and span_after(eb, dg, dh, spread) >= min(span[eb], need[eb]))


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def exchange(h, i, g, j, pack, spread):
    """Swap replica ``gpu_items[h, i]`` with ``gpu_items[g, j]``, updating every count."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    gpu_domain, dholds, span = spread.gpu_domain, spread.dholds, spread.span
    a, b = gpu_items[h, i], gpu_items[g, j]
    ea, eb = item_expert[a], item_expert[b]
    dh, dg = gpu_domain[h], gpu_domain[g]
    if dh != dg:
        span[ea] = span_after(ea, dh, dg, spread)
        span[eb] = span_after(eb, dg, dh, spread)
        dholds[dh, ea] -= 1
        dholds[dg, ea] += 1
        dholds[dg, eb] -= 1
        dholds[dh, eb] += 1
    gpu_items[h, i], gpu_items[g, j] = b, a
    delta = item_load[a] - item_load[b]
    gpu_load[h] -= delta
    gpu_load[g] += delta
    holds[h, ea] -= 1
    holds[g, ea] += 1
    holds[g, eb] -= 1
    holds[h, eb] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def spread_descent(pack, spread, gpus, max_steps, floor):
    """Lower the heaviest of ``gpus [m]`` by swaps that keep the spread (:func:`may_swap`), each
    step the swap with the lightest resulting pair, until none lowers it, it is at most ``floor``
    (``0.0``: as low as swaps go) or ``max_steps`` swaps. Returns the number of swaps."""
    item_load, gpu_items, gpu_fill, gpu_load = pack.item_load, pack.gpu_items, pack.gpu_fill, pack.gpu_load
    steps = 0
    while steps < max_steps:
        h = np.int64(-1)
        for gi in range(gpus.shape[0]):
            if gpu_fill[gpus[gi]] > 0 and (h < 0 or gpu_load[gpus[gi]] > gpu_load[h]):
                h = gpus[gi]
        if h < 0 or gpu_load[h] <= floor:
            break
        top = gpu_load[h]
        best_score = top - 1e-12 * top
        best_g, best_i, best_j = np.int64(-1), np.int64(-1), np.int64(-1)
        for gi in range(gpus.shape[0]):
            g = gpus[gi]
            low = gpu_load[g]
            if g == h or 0.5 * (top + low) >= best_score:
                continue
            for i in range(gpu_fill[h]):
                a = gpu_items[h, i]
                for j in range(gpu_fill[g]):
                    b = gpu_items[g, j]
                    d = item_load[a] - item_load[b]
                    if d > 0.0 and max(top - d, low + d) < best_score and may_swap(a, h, b, g, pack, spread):
                        best_score = max(top - d, low + d)
                        best_g, best_i, best_j = g, np.int64(i), np.int64(j)
        if best_g < 0:
            break
        exchange(h, best_i, best_g, best_j, pack, spread)
        steps += 1
    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)
    return steps


@njit(cache=True, nogil=True, error_model="numpy")
def fix_spans(pack, spread, gpus):
    """For every expert spanning fewer domains than it needs (and has replicas for), swap one of its
    replicas with a replica in another domain (:func:`may_swap` for the partner; the pair's larger
    load after the swap smallest). Returns the experts still short (no such swap)."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    gpu_domain, span, need, counts = spread.gpu_domain, spread.span, spread.need, spread.counts
    short = 0
    for e in range(counts.shape[0]):
        while span[e] < min(need[e], counts[e]):
            best_score = np.inf
            best_h, best_i, best_g, best_j = np.int64(-1), np.int64(-1), np.int64(-1), np.int64(-1)
            for hi in range(gpus.shape[0]):
                h = gpus[hi]
                for i in range(gpu_fill[h]):
                    a = gpu_items[h, i]
                    if item_expert[a] != e:
                        continue
                    for gi in range(gpus.shape[0]):
                        g = gpus[gi]
                        if spread.dholds[gpu_domain[g], e] > 0:
                            continue
                        for j in range(gpu_fill[g]):
                            b = gpu_items[g, j]
                            d = item_load[a] - item_load[b]
                            score = max(gpu_load[h] - d, gpu_load[g] + d)
                            if score < best_score and may_swap(a, h, b, g, pack, spread):
                                best_score = score
                                best_h, best_i, best_g, best_j = h, np.int64(i), g, np.int64(j)
            if best_h < 0:
                short += 1
                break
            exchange(best_h, best_i, best_g, best_j, pack, spread)
    return short


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def donor_slot(e, w, pack, spread, gpus):
    """``(h, i)``: the replica to give to expert ``e``: of the donor whose load per replica stays
    lowest once it gives one (among experts with 3 or more replicas, none giving its last replica
    in a domain it needs), the one on the lightest GPU
    that lacks ``e``, in a domain without ``e`` when there is one; ``(-1, -1)`` when none."""
    item_expert, gpu_items, gpu_fill, gpu_load, holds = (pack.item_expert, pack.gpu_items, pack.gpu_fill,
                                                         pack.gpu_load, pack.holds)
    counts, dholds, gpu_domain = spread.counts, spread.dholds, spread.gpu_domain
    best_h, best_i = np.int64(-1), np.int64(-1)
    # ordered by: the donor's load per replica after, then a domain without e, then the GPU's load
    best_piece, best_shared, best_load = np.inf, True, np.inf
    for hi in range(gpus.shape[0]):
        h = gpus[hi]
        if holds[h, e] > 0:
            continue
        shared = dholds[gpu_domain[h], e] > 0
        for i in range(gpu_fill[h]):
            d = item_expert[gpu_items[h, i]]
            if counts[d] < 3 or (dholds[gpu_domain[h], d] == 1 and spread.span[d] <= spread.need[d]):
                continue  # a donor keeps two replicas, and the domains it needs
            piece = w[d] / (counts[d] - 1)
            if piece < best_piece or (piece == best_piece and (
                    (best_shared and not shared) or (shared == best_shared and gpu_load[h] < best_load))):
                best_piece, best_shared, best_load = piece, shared, gpu_load[h]
                best_h, best_i = h, np.int64(i)
    return best_h, best_i


@njit(cache=True, nogil=True, error_model="numpy")
def give_replica(e, w, pack, spread, gpus):
    """Turn one donor replica (:func:`donor_slot`) into a replica of expert ``e`` and set every
    replica's load of ``e`` and the donor afresh. Returns whether a donor was found."""
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    gpu_domain, dholds, span, counts = spread.gpu_domain, spread.dholds, spread.span, spread.counts
    h, i = donor_slot(e, w, pack, spread, gpus)
    if h < 0:
        return False
    item = gpu_items[h, i]
    d, dom = item_expert[item], gpu_domain[h]
    holds[h, d] -= 1
    holds[h, e] += 1
    dholds[dom, d] -= 1
    span[d] -= 1 if dholds[dom, d] == 0 else 0
    span[e] += 1 if dholds[dom, e] == 0 else 0
    dholds[dom, e] += 1
    counts[d] -= 1
    counts[e] += 1
    item_expert[item] = e
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        for j in range(gpu_fill[g]):
            x = item_expert[gpu_items[g, j]]
            if x == e or x == d:
                item_load[gpu_items[g, j]] = w[x] / counts[x]
    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)
    return True


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def copy_state(pack, spread, into_pack, into_spread):
    """Copy every array of ``pack`` and ``spread`` into ``into_pack`` and ``into_spread`` (same shapes)."""
    into_pack.item_expert[...] = pack.item_expert
    into_pack.item_load[...] = pack.item_load
    into_pack.gpu_items[...] = pack.gpu_items
    into_pack.gpu_fill[...] = pack.gpu_fill
    into_pack.gpu_load[...] = pack.gpu_load
    into_pack.holds[...] = pack.holds
    into_spread.dholds[...] = spread.dholds
    into_spread.span[...] = spread.span
    into_spread.need[...] = spread.need
    into_spread.counts[...] = spread.counts


@njit(cache=True, nogil=True, error_model="numpy")
def spread_layer(w, order, gpus, pack, spread, backup, cap, max_steps, floor):
    """Make the experts of ``order [n]`` (heaviest first) span two domains, one at a time: a second
    replica from a donor (:func:`give_replica`) when the expert has one, then a swap into another
    domain (:func:`fix_spans`). With a finite ``cap``, each expert is followed by a descent
    (:func:`spread_descent`) and undone (from ``backup``, a ``(PackState, SpreadState)`` of the same
    shapes) when it leaves no way to keep the heaviest of ``gpus`` at most ``cap``, or cannot be
    spread; with ``cap = inf`` every expert that can be is spread and one descent ends. Descents
    stop once the heaviest GPU is at most ``floor`` (near a placement in service: its own peak,
    so that no slot changes for balance it already had). Returns the experts of ``order`` left
    spanning one domain."""
    bounded = cap < np.inf
    left = 0
    for t in range(order.shape[0]):
        e = order[t]
        if spread.span[e] >= 2:  # spread meanwhile, as another expert's swap partner: keep it so
            spread.need[e] = 2
            continue
        if bounded:
            copy_state(pack, spread, backup[0], backup[1])
        spread.need[e] = 2
        done = spread.counts[e] >= 2 or give_replica(e, w, pack, spread, gpus)
        done = done and fix_spans(pack, spread, gpus) == 0
        if bounded and done:
            spread_descent(pack, spread, gpus, max_steps, floor)
            for gi in range(gpus.shape[0]):
                done = done and pack.gpu_load[gpus[gi]] <= cap
        if not done:
            left += 1
            if bounded:
                copy_state(backup[0], backup[1], pack, spread)
            else:
                spread.need[e] = 1
    spread_descent(pack, spread, gpus, max_steps, floor)
    return left
