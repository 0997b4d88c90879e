"""Local searches that lower the expected step time of a placement over a series of windows when
tokens are split uniformly among replicas (``1 / logcnt``): :func:`pair_descent` (the best swap
between a window's most loaded GPU and a light GPU, the fast default) and
:func:`improve_expected_peak` (random swaps and replica moves).

Per layer, each window ``t`` is scaled so its mean GPU load is ``window_weights[t]``; the objective
is then ``sum_t max_g load[t, g] / sum_t window_weights[t]``, the weighted mean over windows of
``peak / mean`` (the expected step time of the layer, in units of a perfectly balanced step).
The loads ``[T, G]`` are kept up to date, with each window's ``TOP`` most loaded GPUs, so scoring
a move touches only the GPUs it changes: ``O(T)`` for a swap, ``O(T * replicas)`` for a replica move.
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, max_untouched, next_random, rank_window

TOP = 4  # most loaded GPUs remembered per window

PeakState = namedtuple("PeakState", ["scale", "share", "count", "loads", "peak", "top", "mark", "touched", "coef_x",
                                     "coef_f", "new_peak", "rest", "slack_of"])
PeakState.__doc__ = """One layer under :func:`improve_expected_peak`: ``scale [T]`` each window's
scale (0: ignored), ``share [T, E]`` an expert's scaled tokens per window, ``count [E]`` replicas
per expert, ``loads [T, G]`` GPU loads, ``peak [T]``, ``top [T, TOP]`` each window's most loaded
GPUs; scratch of a move: ``mark [G]`` (stamps of the GPUs it touches), ``touched [G]`` (those GPUs),
``coef_x [G]`` and ``coef_f [G]`` (their load change per token of the expert leaving and of the
expert arriving), ``new_peak [T]``; what a move can gain in the windows from ``r`` on (:func:`_gain_tables`):
``rest [T + 1]`` the sum of their peaks, ``slack_of [G, T + 1]`` the sum of ``peak - mean`` over
those whose most loaded GPU is ``g``."""

PairWork = namedtuple("PairWork", ["excl", "suffix", "hot_load", "cold_load", "hot_replica", "cold_replica",
                                   "held_by_hot", "held_by_cold"])
PairWork.__doc__ = """The GPU pair :func:`pair_descent` scores swaps between (``T`` windows, ``k`` slots a GPU at
most): ``excl [T]`` each active window's largest load
outside the pair, ``suffix [T + 1]`` the sums of ``excl`` from each window on, ``hot_load`` /
``cold_load [T]`` the pair's loads, ``hot_replica`` / ``cold_replica [k, T]`` each slot's replica load
per active window, ``held_by_hot`` / ``held_by_cold [E]`` int64 the experts each holds (stamped)."""

InService = namedtuple("InService", ["placement", "copy_cost"])
InService.__doc__ = """The placement in service (``placement [L, S]`` int64) and what one slot changed
from it costs (``copy_cost``, float, ``>= 0``; 0: it is ignored)."""

SWAP, GIVE, TAKE = 0, 1, 2  # the kinds of moves of improve_expected_peak


@njit(cache=True, nogil=True, error_model="numpy")
def _holds(row, slot_offsets, gpu, expert, skip):
    """Whether a slot of ``gpu`` other than ``skip`` holds ``expert``."""
    for s in range(slot_offsets[gpu], slot_offsets[gpu + 1]):
        if s != skip and row[s] == expert:
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _window_scales(windows, window_weights, layer, num_gpus, scale, active):
    """Scale window ``t`` of ``layer`` so its mean GPU load is ``window_weights[t]``: fills
    ``scale [T]`` (0: the window does not count) and ``active [T]`` (the windows that count, first
    ``n`` entries). Returns ``(n, total weight of the active windows)``."""
    num_windows, _, num_experts = windows.shape
    total = 0.0
    n = 0
    for t in range(num_windows):
        mean = 0.0
        for e in range(num_experts):
            mean += windows[t, layer, e]
        mean /= num_gpus
        scale[t] = window_weights[t] / mean if mean > 0.0 and window_weights[t] > 0.0 else 0.0
        if scale[t] > 0.0:
            total += window_weights[t]
            active[n] = t
            n += 1
    return n, total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _scaled_layer(windows, window_weights, layer, num_gpus, scale, share, active):
    """:func:`_window_scales`, and ``share [T, E]``, an expert's scaled tokens per window.
    Returns ``(n, total weight of the active windows)``."""
    n, total = _window_scales(windows, window_weights, layer, num_gpus, scale, active)
    for t in range(windows.shape[0]):
        for e in range(windows.shape[2]):
            share[t, e] = windows[t, layer, e] * scale[t]
    return n, total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _active_shares(windows, layer, scale, active, n, share):
    """``share [E, T]``: ``share[e, j]`` is expert ``e``'s scaled tokens in the ``j``-th active
    window ``active[j]`` (``j < n``; an expert's windows side by side, as :func:`pair_descent` reads them)."""
    for j in range(n):
        t = active[j]
        for e in range(windows.shape[2]):
            share[e, j] = windows[t, layer, e] * scale[t]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _start_layer(windows, window_weights, layer, row, gpu_of_slot, st):
    """Fill ``st`` (a :class:`PeakState`) for ``layer`` of ``windows [T, L, E]`` placed as ``row [S]``.

    Returns ``(total_weight, current)``: the weight of the windows that count and the sum of their
    peaks (``current`` is 0.0 when ``total_weight <= 0``, and the loads are then not filled)."""
    scale, share, count, loads, peak, top = st.scale, st.share, st.count, st.loads, st.peak, st.top
    num_windows = windows.shape[0]
    num_gpus = loads.shape[1]
    num_slots = row.shape[0]
    _, total_weight = _scaled_layer(windows, window_weights, layer, num_gpus, scale, share,
                                    np.empty(num_windows, np.int64))
    if total_weight <= 0.0:
        return total_weight, 0.0
    count[:] = 0
    for s in range(num_slots):
        count[row[s]] += 1
    current = 0.0
    for t in range(num_windows):
        for g in range(num_gpus):
            loads[t, g] = 0.0
        for s in range(num_slots):
            e = row[s]
            loads[t, gpu_of_slot[s]] += share[t, e] / count[e]
        rank_window(loads, t, top)
        peak[t] = loads[t, top[t, 0]] if scale[t] > 0.0 else 0.0
        current += peak[t]
    _gain_tables(st, window_weights)
    return total_weight, current


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _gain_tables(st, window_weights):
    """Fill ``st.rest`` and ``st.slack_of`` (:class:`PeakState`) from ``st.peak`` and ``st.top``: a
    move leaves the peak of a window whose most loaded GPU it does not touch, and lowers any other
    at most to its mean (its weight), so ``rest[r] - sum over touched g of slack_of[g, r]`` bounds
    the sum of the peaks of the windows from ``r`` on after it."""
    scale, peak, top, rest, slack_of = st.scale, st.peak, st.top, st.rest, st.slack_of
    num_windows = scale.shape[0]
    rest[num_windows] = 0.0
    slack_of[:, num_windows] = 0.0
    for r in range(num_windows - 1, -1, -1):
        rest[r] = rest[r + 1]
        slack_of[:, r] = slack_of[:, r + 1]
        if scale[r] > 0.0:
            rest[r] += peak[r]
            slack_of[top[r, 0], r] += peak[r] - window_weights[r]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pick_move(kind, hot, row, count, gpu_of_slot, slot_offsets, zone_of_slot, state):
    """Draw a move of ``kind`` (:data:`SWAP`, :data:`GIVE` or :data:`TAKE`) from GPU ``hot``: slot
    ``a`` changes to expert ``f`` and, for a swap, slot ``b`` to the expert ``a`` held.

    Args:
        row: ``[S]`` int64 the layer's placement; count: ``[E]`` replicas per expert; gpu_of_slot,
        slot_offsets, zone_of_slot: as :func:`improve_expected_peak`; state: the random stream.
    Returns:
        ``(a, b, f, state)``; ``a < 0`` or ``f < 0`` when no move was found (``b`` is ``-1`` unless
        a swap).
    """
    num_slots = row.shape[0]
    size_hot = slot_offsets[hot + 1] - slot_offsets[hot]
    a = -1
    b = -1
    f = -1
    if kind == SWAP:
        state = next_random(state)
        a = slot_offsets[hot] + np.int64(state % np.uint64(size_hot))
        x = row[a]
        for _attempt in range(16):
            state = next_random(state)
            c = np.int64(state % np.uint64(num_slots))
            if gpu_of_slot[c] == hot or zone_of_slot[c] != zone_of_slot[a] or row[c] == x:
                continue
            if _holds(row, slot_offsets, hot, row[c], a) or _holds(row, slot_offsets, gpu_of_slot[c], x, c):
                continue
            b = c
            f = row[c]
            break
    elif kind == GIVE:  # a replica on hot goes to another expert
        for _attempt in range(16):
            state = next_random(state)
            c = slot_offsets[hot] + np.int64(state % np.uint64(size_hot))
            if count[row[c]] >= 2:
                a = c
                break
        if a < 0:
            return a, b, f, state
        for _attempt in range(16):
            state = next_random(state)
            c = np.int64(state % np.uint64(num_slots))
            if zone_of_slot[c] != zone_of_slot[a] or row[c] == row[a]:
                continue
            if _holds(row, slot_offsets, hot, row[c], a):
                continue
            f = row[c]
            break
    else:  # take: a redundant replica elsewhere becomes one more replica of an expert of hot
        state = next_random(state)
        c = slot_offsets[hot] + np.int64(state % np.uint64(size_hot))
        f = row[c]
        for _attempt in range(16):
            state = next_random(state)
            c2 = np.int64(state % np.uint64(num_slots))
            if gpu_of_slot[c2] == hot or zone_of_slot[c2] != zone_of_slot[c] or count[row[c2]] < 2:
                continue
            if row[c2] == f or _holds(row, slot_offsets, gpu_of_slot[c2], f, c2):
                continue
            a = c2
            break
    return a, b, f, state


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _touch_gpus(kind, a, b, f, row, gpu_of_slot, st, stamp):
    """Mark (with ``stamp``) and list in ``st.touched`` the GPUs the move ``(kind, a, b, f)`` of
    :func:`_pick_move` changes, with the change of their load per token of the expert leaving slot
    ``a`` (``st.coef_x``) and of ``f`` (``st.coef_f``). Returns how many GPUs."""
    count, mark, touched, coef_x, coef_f = st.count, st.mark, st.touched, st.coef_x, st.coef_f
    x = row[a]
    gpu_a = gpu_of_slot[a]
    num_touched = 0
    if kind == SWAP:
        gpu_b = gpu_of_slot[b]
        touched[0] = gpu_a
        touched[1] = gpu_b
        num_touched = 2
        mark[gpu_a] = stamp
        mark[gpu_b] = stamp
        coef_x[gpu_a] = -1.0 / count[x]
        coef_f[gpu_a] = 1.0 / count[f]
        coef_x[gpu_b] = 1.0 / count[x]
        coef_f[gpu_b] = -1.0 / count[f]
    else:
        cx = count[x]
        cf = count[f]
        for s in range(row.shape[0]):
            e = row[s]
            if e != x and e != f:
                continue
            g = gpu_of_slot[s]
            if mark[g] != stamp:
                mark[g] = stamp
                touched[num_touched] = g
                num_touched += 1
                coef_x[g] = 0.0
                coef_f[g] = 0.0
            if s == a:
                coef_x[g] -= 1.0 / cx
                coef_f[g] += 1.0 / (cf + 1)
            elif e == x:
                coef_x[g] += 1.0 / (cx - 1) - 1.0 / cx
            else:
                coef_f[g] += 1.0 / (cf + 1) - 1.0 / cf
    return num_touched


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _beats(st, x, f, num_touched, stamp, window_weights, target, total_weight):
    """Whether the move touching ``st.touched[:num_touched]`` (marked ``stamp``) brings the sum of
    the windows' peaks below ``target``: scored window by window, stopping once even the best case
    for the rest (each window at its mean, its weight) cannot win, or once the bound of
    :func:`_gain_tables` on the rest exceeds it by a margin no rounding reaches (so the answer is
    the one scoring every window would give)."""
    scale, share, loads, top = st.scale, st.share, st.loads, st.top
    mark, touched, coef_x, coef_f, new_peak = st.mark, st.touched, st.coef_x, st.coef_f, st.new_peak
    rest, slack_of = st.rest, st.slack_of
    beyond = target + 1e-9 * abs(target)
    value = 0.0
    floor = total_weight  # a window's peak is at least its mean, its weight
    for r in range(scale.shape[0]):
        if scale[r] <= 0.0:
            continue
        best = max_untouched(loads, r, top, mark, stamp)
        for k in range(num_touched):
            g = touched[k]
            load = loads[r, g] + coef_x[g] * share[r, x] + coef_f[g] * share[r, f]
            if load > best:
                best = load
        new_peak[r] = best
        value += best
        floor -= window_weights[r]
        if value + floor >= target:
            return False
        bound = rest[r + 1]
        for k in range(num_touched):
            bound -= slack_of[touched[k], r + 1]
        if value + bound >= beyond:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _keep_move(kind, a, b, f, row, st, num_touched, window_weights):
    """Apply the move ``(kind, a, b, f)`` to ``row`` and ``st``; returns the new sum of the peaks."""
    scale, share, count, loads, peak, top = st.scale, st.share, st.count, st.loads, st.peak, st.top
    touched, coef_x, coef_f = st.touched, st.coef_x, st.coef_f
    x = row[a]
    row[a] = f
    if kind == SWAP:
        row[b] = x
    else:
        count[x] -= 1
        count[f] += 1
    num_windows = scale.shape[0]
    for r in range(num_windows):
        if scale[r] <= 0.0:
            continue
        for k in range(num_touched):
            g = touched[k]
            loads[r, g] += coef_x[g] * share[r, x] + coef_f[g] * share[r, f]
        rank_window(loads, r, top)
        peak[r] = loads[r, top[r, 0]]
    current = 0.0
    for r in range(num_windows):
        current += peak[r]
    _gain_tables(st, window_weights)
    return current


@njit(cache=True, nogil=True, error_model="numpy")
def improve_expected_peak(windows, window_weights, phy2log, gpu_of_slot, slot_offsets, zone_of_slot, iterations,
                          seed, replica_moves):
    """Lower, per layer, the weighted mean over windows of the uniform-split ``peak / mean``.

    A first-improvement hill climb. Iteration ``i`` takes window ``i mod T`` (windows of weight 0
    are skipped) and its most loaded GPU ``hot``, and tries one move:

    - swap: a random slot of ``hot`` and a random slot of another GPU in the same zone exchange
      experts;
    - give (``replica_moves``): a random slot of ``hot`` whose expert has two or more replicas
      takes a random other expert of the zone;
    - take (``replica_moves``): a random slot elsewhere in the zone whose expert has two or more
      replicas takes an expert of ``hot`` (one more replica for it, lighter ones on ``hot``).

    Swaps and replica moves alternate (swaps first, one replica move every other iteration when
    allowed). A move is kept when the objective drops. Every expert keeps at least one replica,
    every GPU its slot count, a move never puts a second replica of an expert on a GPU that
    already holds it, and the expert a slot receives always has a replica in the slot's zone
    already, so every expert stays inside the zones it started in (with zones = nodes, groups stay
    on their node).

    Args:
        windows: ``[T, L, E]`` float64 non-negative counts the placement should serve well.
        window_weights: ``[T]`` float64, non-negative (a window of weight 0, or with no tokens in
            a layer, is ignored for that layer).
        phy2log: ``[L, S]`` int64 starting placement (every expert has a slot).
        gpu_of_slot: ``[S]`` int64 GPU of each slot; slot_offsets: ``[G + 1]`` int64, GPU ``g``
            holds slots ``slot_offsets[g] : slot_offsets[g + 1]``.
        zone_of_slot: ``[S]`` int64, moves stay inside a zone.
        iterations: moves tried per layer; seed: the random stream (``0`` picks a fixed one).
        replica_moves: bool, also move redundant replicas between experts (else swaps only, and
            replica counts do not change).
    Returns:
        ``phy2log [L, S]`` int64 (a new array), ``before [L]`` and ``after [L]`` float64: the
        objective on the windows at the start and at the end (1.0 for a layer with no tokens).
    """
    num_windows, num_layers, num_experts = windows.shape
    num_gpus = slot_offsets.shape[0] - 1
    out = phy2log.copy()
    before = np.ones(num_layers)
    after = np.ones(num_layers)
    st = PeakState(np.zeros(num_windows), np.empty((num_windows, num_experts)), np.zeros(num_experts, np.int64),
                   np.zeros((num_windows, num_gpus)), np.zeros(num_windows), np.empty((num_windows, TOP), np.int64),
                   np.zeros(num_gpus, np.int64), np.empty(num_gpus, np.int64), np.zeros(num_gpus), np.zeros(num_gpus),
                   np.empty(num_windows), np.zeros(num_windows + 1), np.zeros((num_gpus, num_windows + 1)))
    scale = st.scale
    stamp = 0
    state = np.uint64(seed) if seed > 0 else np.uint64(88172645463325252)
    for layer in range(num_layers):
        row = out[layer]
        total_weight, current = _start_layer(windows, window_weights, layer, row, gpu_of_slot, st)
        if total_weight <= 0.0:
            continue
        before[layer] = current / total_weight
        t = -1
        for it in range(iterations):
            t = (t + 1) % num_windows
            while scale[t] <= 0.0:
                t = (t + 1) % num_windows
            kind = SWAP
            if replica_moves and it % 2 == 1:
                kind = GIVE if (it // 2) % 2 == 0 else TAKE
            # slot a on gpu_a changes from expert x to expert f; for a swap slot b changes from f to x
            a, b, f, state = _pick_move(kind, st.top[t, 0], row, st.count, gpu_of_slot, slot_offsets, zone_of_slot,
                                        state)
            if a < 0 or f < 0:
                continue
            stamp += 1
            num_touched = _touch_gpus(kind, a, b, f, row, gpu_of_slot, st, stamp)
            if not _beats(st, row[a], f, num_touched, stamp, window_weights, current * (1.0 - 1e-12), total_weight):
                continue
            current = _keep_move(kind, a, b, f, row, st, num_touched, window_weights)
        after[layer] = current / total_weight
    return out, before, after


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _window_loads(row, fraction, share, gpu_of_slot, active, n, loads, top):
    """Per active window, GPU loads ``loads [T, G]`` of ``row [S]`` with slot ``s`` taking
    ``fraction[s]`` of its expert's tokens (``share [E, T]`` as :func:`_active_shares` fills it), and
    the ``TOP`` most loaded GPUs; returns the sum over active windows of the peaks."""
    total = 0.0
    for j in range(n):
        t = active[j]
        loads[t, :] = 0.0
        for s in range(row.shape[0]):
            loads[t, gpu_of_slot[s]] += share[row[s], j] * fraction[s]
        rank_window(loads, t, top)
        total += loads[t, top[t, 0]]
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _partner(loads, t, hot, zone_of_gpu, slot_offsets, state, lightest):
    """A GPU of ``hot``'s zone to swap with: the lightest of window ``t`` when ``lightest``, else a
    random one (``-1`` if none found). Returns ``(gpu, state)``."""
    num_gpus = loads.shape[1]
    zone = zone_of_gpu[hot]
    best = -1
    if lightest:
        low = np.inf
        for g in range(num_gpus):
            if g != hot and zone_of_gpu[g] == zone and slot_offsets[g + 1] > slot_offsets[g] and loads[t, g] < low:
                low = loads[t, g]
                best = g
        return best, state
    for _attempt in range(16):
        state = next_random(state)
        g = np.int64(state % np.uint64(num_gpus))
        if g != hot and zone_of_gpu[g] == zone and slot_offsets[g + 1] > slot_offsets[g]:
            return g, state
    return best, state


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _best_swap(row, work, hot, cold, slot_offsets, j, limit):
    """The swap of a slot of ``hot`` with a slot of ``cold`` that lowers the sum of window peaks
    most (below ``limit``), scoring each pair in ``O(T)`` with early exit.

    ``work`` bundles the per-GPU-pair state :func:`pair_descent` fills (:class:`PairWork`): ``excl [T]`` (each
    active window's largest load outside the pair), ``suffix [T + 1]`` (sums of ``excl`` from
    window ``j`` on: a floor for the windows not yet scored), ``hot_load``/``cold_load [T]``,
    ``hot_replica``/``cold_replica [k, T]`` (each slot's replica load per active window),
    ``held_by_hot``/``held_by_cold [E]`` stamped with ``stamp``, ``n`` active windows, and
    ``previous [S]`` with ``copy_cost``: a swap is charged ``copy_cost`` per slot it makes differ
    from ``previous`` (and credited per slot it gives back). ``j`` is the active window whose peak
    is ``hot``: a swap must lower it. Returns ``(slot on hot, slot on cold, new sum)``, slots ``-1``
    when no swap beats ``limit``.
    """
    excl, suffix, hot_load, cold_load, hot_replica, cold_replica, held_by_hot, held_by_cold, stamp, n = work[:10]
    previous, copy_cost = work[10:]
    best_a = -1
    best_b = -1
    for i in range(slot_offsets[hot + 1] - slot_offsets[hot]):
        x = row[slot_offsets[hot] + i]
        if held_by_cold[x] == stamp:
            continue
        for k in range(slot_offsets[cold + 1] - slot_offsets[cold]):
            f = row[slot_offsets[cold] + k]
            if held_by_hot[f] == stamp or cold_replica[k, j] >= hot_replica[i, j]:
                continue
            value = 0.0
            if copy_cost > 0.0:
                a = slot_offsets[hot] + i
                b = slot_offsets[cold] + k
                changed = (f != previous[a]) + (x != previous[b]) - (x != previous[a]) - (f != previous[b])
                value = copy_cost * changed
            for r in range(n):
                delta = cold_replica[k, r] - hot_replica[i, r]
                value += max(excl[r], hot_load[r] + delta, cold_load[r] - delta)
                if value + suffix[r + 1] >= limit:
                    value = np.inf
                    break
            if value < limit:
                limit = value
                best_a = slot_offsets[hot] + i
                best_b = slot_offsets[cold] + k
    return best_a, best_b, limit


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pair_windows(pair, loads, top, active, n, hot, cold):
    """Fill the :class:`PairWork` ``pair`` for the GPUs ``hot`` and ``cold`` on the ``n`` active
    windows (``active [T]``): each window's largest load outside the pair (``loads [T, G]``, ``top
    [T, TOP]``; 0.0 if none), its suffix sums (``suffix[n] = 0``: a layer with fewer active windows
    than the one before must not count that layer's windows) and the pair's loads."""
    excl, suffix, hot_load, cold_load = pair.excl, pair.suffix, pair.hot_load, pair.cold_load
    for r in range(n):
        t = active[r]
        # common.max_untouched's search with the pair compared instead of stamped: stamping and
        # reading marks cost 4% of a global hedge's time at DeepSeek-V3 size and 12% of a hierarchical one's
        best = 0.0
        found = False  # among the top GPUs (or fewer GPUs than TOP, all seen)
        for k in range(top.shape[1]):
            g = top[t, k]
            if g < 0:
                found = True
                break
            if g != hot and g != cold:
                best = loads[t, g]
                found = True
                break
        if not found:
            for g in range(loads.shape[1]):
                if g != hot and g != cold and loads[t, g] > best:
                    best = loads[t, g]
        excl[r] = best
        hot_load[r] = loads[t, hot]
        cold_load[r] = loads[t, cold]
    suffix[n] = 0.0
    for r in range(n - 1, -1, -1):
        suffix[r] = suffix[r + 1] + excl[r]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pair_replicas(pair, row, fraction, share, n, hot, cold, slot_offsets, stamp):
    """Fill ``pair``'s replica loads of the slots of ``hot`` and ``cold`` per active window (``row [S]``
    int64 experts, ``fraction [S]`` their shares of their experts' tokens, ``share [E, T]`` as
    :func:`_active_shares` fills it) and stamp the experts each holds."""
    for gpu, replica, held in ((hot, pair.hot_replica, pair.held_by_hot), (cold, pair.cold_replica,
                                                                          pair.held_by_cold)):
        for i in range(slot_offsets[gpu + 1] - slot_offsets[gpu]):
            slot = slot_offsets[gpu] + i
            expert = row[slot]
            held[expert] = stamp
            part = fraction[slot]
            for r in range(n):
                replica[i, r] = share[expert, r] * part


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _rerank_pair(loads, t, top, first, second):
    """Update ``top[t, :]`` (as :func:`rank_window` fills it) after the loads of GPUs ``first`` and
    ``second`` changed: unchanged when neither is among the top GPUs nor now ranks above the last of
    them (heavier, or as heavy with a lower index), else ranked again."""
    width = top.shape[1]
    last = top[t, width - 1]
    if last >= 0:
        bar = loads[t, last]
        x, y = loads[t, first], loads[t, second]
        still = not (x > bar or (x == bar and first < last) or y > bar or (y == bar and second < last))
        for k in range(width):
            if top[t, k] == first or top[t, k] == second:
                still = False
        if still:
            return
    rank_window(loads, t, top)


@njit(cache=True, nogil=True, error_model="numpy")
def pair_descent(windows, window_weights, phy2log, fractions, gpu_of_slot, slot_offsets, zone_of_gpu, iterations,
                 seed, in_service):
    """Lower, per layer, the weighted mean over windows of ``peak / mean`` GPU load by
    best-improvement swaps between two GPUs, each slot taking a fixed fraction of its expert's
    tokens (``1 / logcnt`` for an even split, or a capped plan's shares).

    Iteration ``i`` takes the next window ``t`` (cyclically, skipping windows without weight or
    tokens), its most loaded GPU ``hot`` and a partner GPU of the same zone (every other iteration
    the lightest of window ``t``, else a random one), scores every swap of a slot of ``hot`` with
    a slot of the partner that lowers window ``t``'s peak (``O(T)`` each, with early exit) and
    applies the best one if the objective drops. A swap exchanges two slots' experts together
    with their fractions, so replica counts and every expert's split stay; no GPU gets a second
    replica of an expert; slots stay in their zones (so with zones = nodes, no token changes node).
    Deterministic for a ``seed``.

    Args:
        windows: ``[T, L, E]`` float64 non-negative counts; window_weights: ``[T]`` float64 >= 0.
        phy2log: ``[L, S]`` int64 starting placement (every expert has a slot).
        fractions: ``[L, S]`` float64, the fraction of its expert's tokens each slot takes.
        gpu_of_slot: ``[S]`` int64; slot_offsets: ``[G + 1]`` int64 (GPU ``g`` holds slots
            ``slot_offsets[g] : slot_offsets[g + 1]``); zone_of_gpu: ``[G]`` int64, swaps stay in a zone.
        iterations: swaps tried per layer; seed: ``>= 1``, the random stream.
        in_service: an :class:`InService`: ``placement [L, S]`` int64, the placement in service, and
            ``copy_cost >= 0``, what one slot changed from it costs, in units of the objective (a
            weighted mean of ``peak / mean``): a swap is kept only if it lowers the objective by more
            than the copies it adds cost (``0``: the placement in service is ignored).
    Returns:
        ``phy2log [L, S]`` int64 and ``fractions [L, S]`` float64 (new arrays), ``before [L]`` and
        ``after [L]`` float64: the objective at the start and the end (1.0 for a layer with no tokens).
    """
    num_windows, num_layers, num_experts = windows.shape
    num_gpus = slot_offsets.shape[0] - 1
    width = 0
    for g in range(num_gpus):
        width = max(width, slot_offsets[g + 1] - slot_offsets[g])
    out = phy2log.copy()
    out_fractions = fractions.copy()
    before = np.ones(num_layers)
    after = np.ones(num_layers)
    scale = np.zeros(num_windows)
    share = np.empty((num_experts, num_windows))  # [E, T], the active windows first
    active = np.empty(num_windows, np.int64)
    loads = np.zeros((num_windows, num_gpus))
    top = np.empty((num_windows, TOP), np.int64)
    pair = PairWork(np.empty(num_windows), np.zeros(num_windows + 1),
                    np.empty(num_windows), np.empty(num_windows), np.empty((width, num_windows)),
                    np.empty((width, num_windows)), np.zeros(num_experts, np.int64), np.zeros(num_experts, np.int64))
    stamp = 0
    state = np.uint64(seed)
    for layer in range(num_layers):
        row = out[layer]
        fraction = out_fractions[layer]
        n, total_weight = _window_scales(windows, window_weights, layer, num_gpus, scale, active)
        if total_weight <= 0.0:
            continue
        _active_shares(windows, layer, scale, active, n, share)
        current = _window_loads(row, fraction, share, gpu_of_slot, active, n, loads, top)
        before[layer] = current / total_weight
        for it in range(iterations):
            j = it % n
            t = active[j]
            hot = top[t, 0]
            cold, state = _partner(loads, t, hot, zone_of_gpu, slot_offsets, state, it % 2 == 0)
            if cold < 0:
                continue
            stamp += 1
            _pair_windows(pair, loads, top, active, n, hot, cold)
            _pair_replicas(pair, row, fraction, share, n, hot, cold, slot_offsets, stamp)
            work = (pair.excl, pair.suffix, pair.hot_load, pair.cold_load, pair.hot_replica, pair.cold_replica,
                    pair.held_by_hot, pair.held_by_cold, stamp, n, in_service.placement[layer],
                    in_service.copy_cost * total_weight)
            a, b, _ = _best_swap(row, work, hot, cold, slot_offsets, j, current * (1.0 - 1e-12))
            if a < 0:
                continue
            x, fraction_x = row[a], fraction[a]
            f, fraction_f = row[b], fraction[b]
            row[a], fraction[a] = f, fraction_f
            row[b], fraction[b] = x, fraction_x
            current = 0.0
            for r in range(n):
                t = active[r]
                delta = share[f, r] * fraction_f - share[x, r] * fraction_x
                loads[t, hot] += delta
                loads[t, cold] -= delta
                _rerank_pair(loads, t, top, hot, cold)
                current += loads[t, top[t, 0]]
        after[layer] = current / total_weight
    return out, out_fractions, before, after
