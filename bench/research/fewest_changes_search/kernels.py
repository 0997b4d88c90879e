"""Exact search for the fewest slot changes under a load cap (one layer, global mode).

Question answered by :func:`fewest_changes_exact`: given the previous placement ``prev [S]`` and
loads ``w [E]``, what is the fewest number of slots whose expert changes in any placement whose
GPU loads are all at most ``cap``? Iterative deepening over ``k = 0, 1, ...``: each ``k`` is either
refuted exhaustively (then ``k + 1`` is a proven lower bound) or a placement with ``k`` changes is
found (the first such ``k`` is the proven minimum). The rules are those of
:class:`eplb.planning.exact_migration.MoveModel`: every expert keeps ``>= 1`` replica, a changed slot of GPU
``g`` gets an expert ``e`` that GPU ``g`` did not hold before (unless ``shared``: then any expert
of which ``g`` keeps every previous replica), so no GPU gets a second replica of an expert it held.

Two nested searches per ``k``:

1. **Replica counts** ``r = p + delta`` (``p``: previous counts), experts in decreasing load. The
   increments ``I = sum delta+`` equal the decrements ``D = sum delta-``; both are at most ``k``
   (every new replica fills a changed slot) and ``D <= sum (p - 1)``. A node is pruned by the
   *GPU bound*: with the counts decided so far (the others at their most favourable count), GPU
   ``g`` keeping its previous experts must change at least ``c_g`` slots to end within
   ``[W - (G' - 1) cap, cap]`` (``W`` the total load, ``G'`` GPUs with slots: the other GPUs carry
   at most ``cap`` each): drop its heaviest slots for the lightest replica there can be, or its
   lightest slots for the heaviest. Every changed slot removes one replica and places one, so
   ``k >= D + max(0, C - sum_e min(delta-_e, h_e))`` and ``k >= I + max(0, C - sum_e min(delta+_e,
   h'_e))`` with ``C = sum c_g``, ``h_e`` the replicas of ``e`` on GPUs with ``c_g > 0`` (removals
   that are decrements) and ``h'_e`` those GPUs without ``e`` (placements that are increments).
2. **Kept slots**, for each full ``r`` within the bound: GPUs in decreasing ``c_g``, each keeps a
   subset of its previous slots (fewest dropped first; duplicates of one expert dropped in slot
   order), pruned by the kept replicas per expert (``<= r_e``), the GPU's load window and
   ``k >= dropped + max(sum of c_g left, removals forced by r, placements forced by r)``; then the
   replicas not kept (``r_e - kept_e`` of each expert) are packed into the dropped slots
   (heaviest first, copies of one expert on increasing GPUs) within every GPU's window.

Both searches are exhaustive under valid bounds, so a refuted ``k`` is a proof. Loads are compared
with a relative slack of ``1e-12`` (a relaxation: the proof stays valid; the caller checks a found
placement against the cap). ``work`` caps the nodes of the whole search; when it runs out, the last
``k`` not refuted is the proven lower bound.
"""

import numpy as np
from numba import njit

FOUND = 1
REFUTED = 0
OUT_OF_WORK = -1
_INF = np.int64(1 << 40)
_SLACK = 1e-12


@njit(cache=True, nogil=True, error_model="numpy")
def _gpu_changes(lo, hi, n, top, bottom, fill_lo, fill_hi, buf):
    """Fewest slots a GPU must change to end within ``[bottom, top]``.

    Args:
        lo, hi: ``[n]`` (prefix of longer buffers) lowest and highest possible load of each of its
            previous slots; fill_lo, fill_hi: lightest and heaviest replica any slot can receive.
        buf: ``[>= n]`` float64 scratch.
    Returns:
        ``c`` (``_INF`` if no number of changes can do it).
    """
    total = 0.0
    for i in range(n):
        total += lo[i]
        buf[i] = lo[i]
    need_over = 0
    if total > top:
        srt = np.sort(buf[:n])
        need_over = _INF
        for c in range(1, n + 1):
            total += fill_lo - srt[n - c]
            if total <= top:
                need_over = c
                break
    total = 0.0
    for i in range(n):
        total += hi[i]
        buf[i] = hi[i]
    need_under = 0
    if total < bottom:
        srt = np.sort(buf[:n])
        need_under = _INF
        for c in range(1, n + 1):
            total += fill_hi - srt[c - 1]
            if total >= bottom:
                need_under = c
                break
    return max(need_over, need_under)


@njit(cache=True, nogil=True, error_model="numpy")
def _count_bound(w, prev, p, r, decided, slot_offsets, top, bottom, inc_left, dec_left, on_gpu, shared, c_g,
                 slot_lo, slot_hi, buf, counts_lo, counts_hi):
    """The GPU bound of the counts search (module docstring, step 1); fills ``c_g [G]``.

    ``r [E]``: counts of decided experts (``decided [E]`` bool); the others may still gain up to
    ``inc_left`` or lose up to ``dec_left`` replicas, within ``[counts_lo, counts_hi]``. ``on_gpu [E, G]``: previous replicas per GPU.
    Returns the lower bound on changes (``_INF``: infeasible).
    """
    num_experts = w.shape[0]
    num_gpus = slot_offsets.shape[0] - 1
    fill_lo = np.inf
    fill_hi = 0.0
    for e in range(num_experts):
        if decided[e]:
            a = w[e] / r[e]
            if a > top:
                return _INF
            fill_lo = min(fill_lo, a)
            fill_hi = max(fill_hi, a)
        else:
            fill_lo = min(fill_lo, w[e] / min(p[e] + inc_left, counts_hi[e]))
            fill_hi = max(fill_hi, w[e] / max(1, p[e] - dec_left, counts_lo[e]))
    total = 0
    for g in range(num_gpus):
        n = 0
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            e = prev[s]
            if decided[e]:
                slot_lo[n] = w[e] / r[e]
                slot_hi[n] = slot_lo[n]
            else:
                slot_lo[n] = w[e] / min(p[e] + inc_left, counts_hi[e])
                slot_hi[n] = w[e] / max(1, p[e] - dec_left, counts_lo[e])
            n += 1
        if n == 0:
            c_g[g] = 0
            continue
        c = _gpu_changes(slot_lo, slot_hi, n, top, bottom, fill_lo, fill_hi, buf)
        if c >= _INF:
            return _INF
        c_g[g] = c
        total += c
    dec = 0
    inc = 0
    free_dec = 0
    free_inc = 0
    for e in range(num_experts):
        if not decided[e]:
            continue
        delta = r[e] - p[e]
        held = 0
        missing = 0
        for g in range(num_gpus):
            if c_g[g] > 0:
                held += on_gpu[e, g]
                if on_gpu[e, g] == 0:
                    missing += 1
        if delta < 0:
            dec -= delta
            free_dec += min(-delta, held)
        elif delta > 0:
            inc += delta
            free_inc += delta if shared else min(delta, missing)
    return max(dec + max(0, total - free_dec), inc + max(0, total - free_inc))


@njit(cache=True, nogil=True, error_model="numpy")
def _pack(items, a, most_new, placed, load, free, top, bottom, gpu_of_item, next_gpu, work):
    """Place ``items [n]`` (expert ids, non-increasing load ``a``, copies of one expert adjacent)
    into the free slots, every GPU ending within ``[bottom, top]``; True if done (``gpu_of_item``).

    ``placed [E, G]``: new replicas per GPU (zero on entry); ``load [G]``, ``free [G]``: load and
    free slots; ``most_new [E, G]``: new replicas of ``e`` GPU ``g`` may take; ``next_gpu [>= n + 1]``
    scratch. ``work[0]`` counts nodes down. Depth-first with an explicit stack (no recursion: Numba
    cannot reload cached recursive functions).
    """
    n = items.shape[0]
    num_gpus = load.shape[0]
    if n == 0:
        return True
    i = 0
    next_gpu[0] = 0
    while True:
        if i == n:
            return True
        work[0] -= 1
        if work[0] < 0:
            return False
        e = items[i]
        ae = a[e]
        chosen = -1
        alive = True
        if next_gpu[i] == 0 or (i > 0 and items[i - 1] == e and next_gpu[i] == gpu_of_item[i - 1]):
            for g in range(num_gpus):  # every item left is at most this heavy
                if free[g] > 0 and load[g] + free[g] * ae < bottom:
                    alive = False
                    break
        if alive:
            for g in range(next_gpu[i], num_gpus):
                if free[g] == 0 or placed[e, g] >= most_new[e, g]:
                    continue
                new_load = load[g] + ae
                # the rest of this GPU's free slots get items no heavier than this one
                if new_load > top or new_load + (free[g] - 1) * ae < bottom:
                    continue
                chosen = g
                break
        if chosen >= 0:
            placed[e, chosen] += 1
            load[chosen] += ae
            free[chosen] -= 1
            gpu_of_item[i] = chosen
            i += 1
            if i < n:  # copies of one expert on non-decreasing GPUs
                next_gpu[i] = chosen if items[i] == e else 0
            continue
        # backtrack: undo item i - 1 and try its next GPU
        i -= 1
        if i < 0:
            return False
        g = gpu_of_item[i]
        e = items[i]
        placed[e, g] -= 1
        load[g] -= a[e]
        free[g] += 1
        next_gpu[i] = g + 1


@njit(cache=True, nogil=True, error_model="numpy")
def _apply_mask(g, mask, sign, prev, slot_offsets, kept, left):
    """Take GPU ``g``'s previous slots out of ``left`` and its kept ones (bits of ``mask`` clear)
    into ``kept`` (``sign = 1``), or undo that (``sign = -1``)."""
    lo = slot_offsets[g]
    for t in range(slot_offsets[g + 1] - lo):
        e = prev[lo + t]
        left[e] -= sign
        if not (mask >> t) & 1:
            kept[e] += sign


@njit(cache=True, nogil=True, error_model="numpy")
def _keep(gpu_order, prev, slot_offsets, r, a, kept, left, c_g, k, masks, mask_start, on_gpu, shared, top, bottom,
          drop_mask, load, free, work, items, gpu_of_item, placed, most_new, next_mask, dropped_at, next_gpu):
    """Step 2 for full counts ``r [E]`` (``a [E]`` per-replica loads): choose the dropped slots of
    every GPU (``drop_mask [G]``), then pack; True if a placement with at most ``k`` changes exists
    (then ``drop_mask``, ``items`` and ``gpu_of_item`` describe it).

    ``kept``, ``left`` ``[E]``: zero and ``p`` on entry (restored on exit); ``c_g [G]``: fewest
    changes of each GPU; ``next_mask``, ``dropped_at`` ``[G + 1]`` scratch. Explicit stack.
    """
    num_experts = r.shape[0]
    num_gpus = slot_offsets.shape[0] - 1
    fill_lo = np.inf
    fill_hi = 0.0
    for e in range(num_experts):
        fill_lo = min(fill_lo, a[e])
        fill_hi = max(fill_hi, a[e])
    rest = np.zeros(num_gpus + 1, np.int64)  # sum of c_g over the GPUs from position j on
    for j in range(num_gpus - 1, -1, -1):
        rest[j] = rest[j + 1] + c_g[gpu_order[j]]
    j = 0
    dropped_at[0] = 0
    g0 = gpu_order[0]
    next_mask[0] = mask_start[slot_offsets[g0 + 1] - slot_offsets[g0]]
    found = False
    while True:
        if j == num_gpus:
            # every expert's replicas not kept go into the dropped slots
            dropped = dropped_at[num_gpus]
            n = 0
            for e in range(num_experts):
                for _ in range(r[e] - kept[e]):
                    items[n] = e
                    n += 1
            if n == dropped:
                srt = items[:n]
                # heaviest first, ties by expert id (copies of one expert adjacent)
                for t in range(1, n):
                    x = srt[t]
                    u = t - 1
                    while u >= 0 and (a[srt[u]] < a[x] or (a[srt[u]] == a[x] and srt[u] > x)):
                        srt[u + 1] = srt[u]
                        u -= 1
                    srt[u + 1] = x
                for g in range(num_gpus):
                    size = slot_offsets[g + 1] - slot_offsets[g]
                    for e in range(num_experts):
                        placed[e, g] = 0
                        most_new[e, g] = size if shared else (1 if on_gpu[e, g] == 0 else 0)
                    for t in range(size):
                        if (drop_mask[g] >> t) & 1:  # no expert dropped here comes back
                            most_new[prev[slot_offsets[g] + t], g] = 0
                if _pack(srt, a, most_new, placed, load, free, top, bottom, gpu_of_item, next_gpu, work):
                    found = True
            if found or work[0] < 0:
                break
            j -= 1  # backtrack into the last GPU
            _apply_mask(gpu_order[j], drop_mask[gpu_order[j]], -1, prev, slot_offsets, kept, left)
            continue
        work[0] -= 1
        if work[0] < 0:
            break
        g = gpu_order[j]
        lo = slot_offsets[g]
        size = slot_offsets[g + 1] - lo
        chosen = -1
        idx = next_mask[j]
        while idx < mask_start[size + 1]:
            mask = masks[idx]
            idx += 1
            m = 0
            for t in range(size):
                m += (mask >> t) & 1
            if dropped_at[j] + m + rest[j + 1] > k:
                idx = mask_start[size + 1]  # masks come in non-decreasing number of dropped slots
                break
            canonical = True  # duplicates of one expert: dropped in slot order
            for t in range(size):
                if not (mask >> t) & 1:
                    for u in range(t + 1, size):
                        if (mask >> u) & 1 and prev[lo + u] == prev[lo + t]:
                            canonical = False
            if not canonical:
                continue
            _apply_mask(g, mask, 1, prev, slot_offsets, kept, left)
            kept_load = 0.0
            fits = True
            for t in range(size):
                if not (mask >> t) & 1:
                    e = prev[lo + t]
                    kept_load += a[e]
                    if kept[e] > r[e]:
                        fits = False
            if fits and size > 0 and (kept_load + m * fill_lo > top or kept_load + m * fill_hi < bottom):
                fits = False
            if fits:
                forced_out = 0  # previous replicas that must still go (their counts fell)
                forced_in = 0  # replicas that must still be placed in dropped slots (counts rose)
                for e in range(num_experts):
                    forced_out += max(0, kept[e] + left[e] - r[e])
                    forced_in += max(0, r[e] - kept[e] - left[e])
                if dropped_at[j] + m + max(rest[j + 1], forced_out) > k or forced_in > k:
                    fits = False
            if fits:
                chosen = mask
                load[g] = kept_load
                free[g] = m
                break
            _apply_mask(g, mask, -1, prev, slot_offsets, kept, left)
        next_mask[j] = idx
        if chosen >= 0:
            drop_mask[g] = chosen
            dropped_at[j + 1] = dropped_at[j] + free[g]
            j += 1
            if j < num_gpus:
                gn = gpu_order[j]
                next_mask[j] = mask_start[slot_offsets[gn + 1] - slot_offsets[gn]]
            continue
        j -= 1
        if j < 0:
            break
        _apply_mask(gpu_order[j], drop_mask[gpu_order[j]], -1, prev, slot_offsets, kept, left)
    if found:  # restore kept and left for the caller
        for t in range(num_gpus - 1, -1, -1):
            _apply_mask(gpu_order[t], drop_mask[gpu_order[t]], -1, prev, slot_offsets, kept, left)
    else:
        while j > 0:  # out of work mid-way
            j -= 1
            _apply_mask(gpu_order[j], drop_mask[gpu_order[j]], -1, prev, slot_offsets, kept, left)
    return found


@njit(cache=True, nogil=True, error_model="numpy")
def _delta(step):
    """The ``step``-th count change tried: 0, +1, -1, +2, -2, ..."""
    return (step + 1) // 2 if step % 2 == 1 else -(step // 2)


@njit(cache=True, nogil=True, error_model="numpy")
def _counts(order, w, prev, p, r, decided, slot_offsets, top, bottom, most_inc, dec_room, k, on_gpu, shared, masks,
            mask_start, work, c_g, slot_lo, slot_hi, buf, a, kept, left, drop_mask, load, free, items, gpu_of_item,
            placed, most_new, gpu_order, next_mask, dropped_at, next_gpu, counts_lo, counts_hi):
    """Step 1: choose the replica count of every expert (``order``: decreasing load), each full
    choice within the bound going to step 2; True if a placement with at most ``k`` changes exists.

    ``r [E]`` equals ``p`` and ``decided [E]`` is False on entry (restored on a refutation); every
    count stays within ``[counts_lo, counts_hi]`` ``[E]``.
    ``most_inc``: most replicas gained (and lost); ``dec_room [E + 1]``: replicas the experts
    ``order[i:]`` could lose. Explicit stack: ``step [E + 1]`` the next change tried per level.
    """
    num_experts = w.shape[0]
    step = np.zeros(num_experts + 1, np.int64)
    inc = np.zeros(num_experts + 1, np.int64)
    dec = np.zeros(num_experts + 1, np.int64)
    i = 0
    enter = True  # a fresh node: check its bound first
    while True:
        if enter:
            enter = False
            work[0] -= 1
            if work[0] < 0:
                return False
            ok = dec[i] + dec_room[i] >= inc[i]
            if ok:
                bound = _count_bound(w, prev, p, r, decided, slot_offsets, top, bottom, most_inc - inc[i],
                                     most_inc - dec[i], on_gpu, shared, c_g, slot_lo, slot_hi, buf,
                                     counts_lo, counts_hi)
                ok = bound <= k
            if ok and i == num_experts:
                if inc[i] == dec[i]:
                    for e in range(num_experts):
                        a[e] = w[e] / r[e]
                        kept[e] = 0
                        left[e] = p[e]
                    gpu_order[:] = np.argsort(-c_g, kind="mergesort")  # GPUs that must change most first
                    if _keep(gpu_order, prev, slot_offsets, r, a, kept, left, c_g.copy(), k, masks, mask_start,
                             on_gpu, shared, top, bottom, drop_mask, load, free, work, items, gpu_of_item, placed,
                             most_new, next_mask, dropped_at, next_gpu):
                        return True
                ok = False
            if not ok:
                if i == 0:
                    return False
                i -= 1  # back to the parent, which tries its next change
                continue
            step[i] = 0
            decided[order[i]] = True
        if work[0] < 0:
            return False
        e = order[i]
        moved = False
        while step[i] <= 2 * most_inc:
            delta = _delta(step[i])
            step[i] += 1
            if delta > 0 and inc[i] + delta > most_inc:
                continue
            if delta < 0 and (dec[i] - delta > most_inc or p[e] + delta < 1):
                continue
            if p[e] + delta < counts_lo[e] or p[e] + delta > counts_hi[e]:
                continue
            r[e] = p[e] + delta
            inc[i + 1] = inc[i] + max(delta, 0)
            dec[i + 1] = dec[i] + max(-delta, 0)
            moved = True
            break
        if moved:
            i += 1
            enter = True
            continue
        r[e] = p[e]
        decided[e] = False
        if i == 0:
            return False
        i -= 1


@njit(cache=True, nogil=True, error_model="numpy")
def _masks_by_size(largest):
    """Subsets of ``n`` slots (bit masks), for every ``n <= largest``, in non-decreasing size.

    Returns ``masks [M]`` and ``start [largest + 2]``: the masks of ``n`` slots are
    ``masks[start[n]:start[n + 1]]``.
    """
    start = np.zeros(largest + 2, np.int64)
    for n in range(largest + 1):
        start[n + 1] = start[n] + (1 << n)
    masks = np.empty(start[largest + 1], np.int64)
    for n in range(largest + 1):
        pos = start[n]
        for size in range(n + 1):
            for mask in range(1 << n):
                bits = 0
                for t in range(n):
                    bits += (mask >> t) & 1
                if bits == size:
                    masks[pos] = mask
                    pos += 1
    return masks, start


@njit(cache=True, nogil=True, error_model="numpy")
def fewest_changes_exact(w, prev, slot_offsets, cap, first, most_changes, shared, work, counts_lo, counts_hi):
    """Search for a placement within ``cap`` with at most ``k`` changed slots of ``prev``, for
    ``k = first, first + 1, ..., most_changes - 1`` in turn (module docstring).

    With ``first = 0`` this is iterative deepening: the first ``k`` that succeeds is the proven
    minimum. With ``first = most_changes - 1`` it is one search for a placement with fewer changes
    than ``most_changes`` (refuting it proves ``most_changes`` is the minimum).

    Args:
        w: ``[E]`` float64 loads; prev: ``[S]`` int64 previous placement (every expert present);
            slot_offsets: ``[G + 1]`` int64 (at most 20 slots per GPU); cap: max GPU load.
        first, most_changes: the range of ``k`` searched.
        shared: allow several new replicas of an expert on a GPU that keeps all its previous ones.
        work: most search nodes in all.
        counts_lo, counts_hi: ``[E]`` int64 range of every expert's replica count (``1`` and ``S``:
            unrestricted, the proof; a narrower range searches only those counts).
    Returns:
        ``(status, row [S] int64, lower_bound, nodes)``: status :data:`FOUND` (``row`` within the
        cap with at most ``k`` changes, the first ``k`` that succeeded), :data:`REFUTED` (every
        ``k`` of the range refuted) or :data:`OUT_OF_WORK`; ``lower_bound``: one more than the
        last ``k`` refuted (every placement within the cap changes at least that many slots; 0 if
        none was); ``nodes``: nodes spent.
    """
    num_experts = w.shape[0]
    num_slots = prev.shape[0]
    num_gpus = slot_offsets.shape[0] - 1
    largest = 0
    active = 0
    for g in range(num_gpus):
        size = slot_offsets[g + 1] - slot_offsets[g]
        largest = max(largest, size)
        if size > 0:
            active += 1
    masks, mask_start = _masks_by_size(largest)
    total = 0.0
    for e in range(num_experts):
        total += w[e]
    top = cap * (1.0 + _SLACK)
    bottom = total - (active - 1) * top - _SLACK * total
    p = np.zeros(num_experts, np.int64)
    on_gpu = np.zeros((num_experts, num_gpus), np.int64)
    for g in range(num_gpus):
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            p[prev[s]] += 1
            on_gpu[prev[s], g] += 1
    order = np.argsort(-w, kind="mergesort")
    dec_room = np.zeros(num_experts + 1, np.int64)
    for i in range(num_experts - 1, -1, -1):
        dec_room[i] = dec_room[i + 1] + max(0, p[order[i]] - max(1, counts_lo[order[i]]))
    r = p.copy()
    decided = np.zeros(num_experts, np.bool_)
    c_g = np.zeros(num_gpus, np.int64)
    slot_lo = np.zeros(largest + 1)
    slot_hi = np.zeros(largest + 1)
    buf = np.zeros(largest + 1)
    a = np.zeros(num_experts)
    kept = np.zeros(num_experts, np.int64)
    left = np.zeros(num_experts, np.int64)
    drop_mask = np.zeros(num_gpus, np.int64)
    load = np.zeros(num_gpus)
    free = np.zeros(num_gpus, np.int64)
    items = np.zeros(num_slots, np.int64)
    gpu_of_item = np.zeros(num_slots, np.int64)
    placed = np.zeros((num_experts, num_gpus), np.int64)
    most_new = np.zeros((num_experts, num_gpus), np.int64)
    gpu_order = np.zeros(num_gpus, np.int64)
    next_mask = np.zeros(num_gpus + 1, np.int64)
    dropped_at = np.zeros(num_gpus + 1, np.int64)
    next_gpu = np.zeros(num_slots + 1, np.int64)
    counter = np.array([work], np.int64)
    row = prev.copy()
    lower_bound = 0
    for k in range(first, most_changes):
        most_inc = min(k, dec_room[0])
        found = _counts(order, w, prev, p, r, decided, slot_offsets, top, bottom, most_inc, dec_room, k, on_gpu,
                        shared, masks, mask_start, counter, c_g, slot_lo, slot_hi, buf, a, kept, left, drop_mask,
                        load, free, items, gpu_of_item, placed, most_new, gpu_order, next_mask, dropped_at, next_gpu,
                        counts_lo, counts_hi)
        if found:
            # kept slots keep their expert; the packed items go into their GPUs' dropped slots
            dropped = 0
            for g in range(num_gpus):
                lo = slot_offsets[g]
                for t in range(slot_offsets[g + 1] - lo):
                    if (drop_mask[g] >> t) & 1:
                        row[lo + t] = -1
                        dropped += 1
            for i in range(dropped):
                g = gpu_of_item[i]
                for s in range(slot_offsets[g], slot_offsets[g + 1]):
                    if row[s] < 0:
                        row[s] = items[i]
                        break
            return FOUND, row, lower_bound, work - counter[0]
        if counter[0] < 0:
            return OUT_OF_WORK, prev.copy(), lower_bound, work - counter[0]
        lower_bound = k + 1
    return REFUTED, prev.copy(), lower_bound, work - counter[0]
