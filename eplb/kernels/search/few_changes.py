"""Kernels of migration-aware planning: improve a previous placement with few slot changes
(relabelling a fresh placement: :mod:`.relabel`; the exhaustive search of small layers:
:mod:`.tiny_changes`).

Shapes: ``L`` layers, ``E`` experts, ``S`` slots, ``G`` GPUs, ``N`` nodes, ``K`` expert groups.
A "change" is a slot whose expert differs from the previous placement.

The search (:func:`search_near_previous`) keeps two groups of arrays that travel together:

- :class:`SearchLayout`, the deployment: which GPU, node and group each slot, GPU and expert
  belongs to, and whether groups must stay on their nodes (built once per plan);
- :class:`LayerState`, one layer's placement and its bookkeeping: per-expert replica counts,
  slot lists and per-replica loads, per-GPU loads and replica counts, per-node group counts
  (allocated once per call, refilled per layer).

Cost: a step scans every slot of the layer (moves (A) and (C) below), and a layer takes about as
many steps as slots it changes, so a layer costs ``O(S * changes)``. Both scans skip, unread, the
candidates whose best possible score (from a bound on the load they leave) cannot beat the best
move so far; that never changes which move is picked (ties keep the first found). The state's
arrays travel in named tuples, and each call of a small function with them costs reference counts
of every array: loading a layer fills its tables in line, and giving slots back skips the slots
already given back before calling. Timed on DeepSeek-V3-sized Balancer decisions (58 layers, the move budget of 2-4
slots per layer, ``bench/rack.py``): a search of 58 layers at 512 slots on 256 GPUs 6.4 -> 1.1 ms
(``perf`` had put 70% of it in :func:`_best_new_replica`), 384 / 128 7.0 -> 1.5 ms. Without a
budget (a plan near the placement in service at 512 / 256, ~150 steps a layer) a step still
costs ~25 us, most of it in :func:`_best_new_replica` and :func:`_best_swap`.

A candidate move is a tuple ``(score, local, kind, a, b)``: its gain per changed slot, the largest
load it leaves on the GPUs it touches, and what it does (:data:`SWAP` slots ``a`` and ``b``,
:data:`REASSIGN` slot ``a`` to expert ``b``; :data:`NO_MOVE` none).
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, shell_sort, stable_argsort
from .relabel import align_slots  # noqa: F401 (eplb.planning.replan imports it from here)

_EPS = 1e-12
NO_MOVE, SWAP, REASSIGN = -1, 0, 1  # kinds of moves; REASSIGN covers moves (B) and (C) below

SearchLayout = namedtuple("SearchLayout", ["gpu_of_slot", "slot_offsets", "node_of_gpu", "group_of_expert",
                                           "keep_groups", "num_groups"])
SearchLayout.__doc__ = """The deployment as the search sees it: ``gpu_of_slot [S]``, ``slot_offsets
[G + 1]``, ``node_of_gpu [G]``, ``group_of_expert [E]`` (int64 arrays), ``keep_groups`` (bool: no move
puts an expert on a node holding no expert of its group) and ``num_groups`` (``K >= 1``)."""

LayerState = namedtuple("LayerState", ["w", "row", "prev", "cnt", "expert_slots", "has", "node_group", "x", "share",
                                       "share_up", "gain_down"])
LayerState.__doc__ = """One layer under search: ``w [E]`` loads, ``row [S]`` the placement (changed in
place), ``prev [S]`` the placement in service, ``cnt [E]`` replicas per expert, ``expert_slots [E, W]``
each expert's slots (first ``cnt[e]``), ``has [G, E]`` replicas per GPU, ``node_group [N, K]`` replicas
per node and group, ``x [G]`` GPU loads, ``share [E]`` ``w / cnt``, ``share_up [E]`` ``w / (cnt + 1)``,
``gain_down [E]`` ``w / (cnt - 1) - w / cnt`` (what each other replica gains if one goes)."""

MoveLimits = namedtuple("MoveLimits", ["peak", "limit", "floor", "budget", "per_change"])
MoveLimits.__doc__ = """What a candidate move is judged against: ``peak`` the heaviest GPU's load,
``limit`` the load no GPU the move touches may reach, ``floor`` the load below which a gain does
not count, ``budget`` the most slots it may change, ``per_change`` (bool) score gain per changed slot."""


@njit(cache=True, nogil=True, error_model="numpy")
def _shares(st, e):
    """Refresh expert ``e``'s entries of the per-replica load tables after its count changed."""
    w, share = st.w, st.share
    c = st.cnt[e]
    share[e] = w[e] / c
    st.share_up[e] = w[e] / (c + 1)
    st.gain_down[e] = w[e] / (c - 1) - share[e] if c > 1 else np.inf


@njit(cache=True, nogil=True, error_model="numpy")
def _refresh_loads(st, gpu_of_slot):
    """Fill ``st.x [G]`` with each GPU's load: the sum of its replicas' shares."""
    x, share, row = st.x, st.share, st.row
    x[:] = 0.0
    for s in range(row.shape[0]):
        x[gpu_of_slot[s]] += share[row[s]]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _refresh_gpu(st, slot_offsets, g):
    """Recompute ``st.x[g]`` from GPU ``g``'s slots, in slot order: bit for bit what
    :func:`_refresh_loads` gives it."""
    total = 0.0
    for s in range(slot_offsets[g], slot_offsets[g + 1]):
        total += st.share[st.row[s]]
    st.x[g] = total
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _refresh_around(st, lay, s, t, e, f):
    """Recompute the loads of the GPUs that a change of slots ``s`` and ``t`` (``-1``: none) between
    experts ``e`` and ``f`` touched: theirs and every holder of ``e`` or ``f`` (whose shares changed).
    The other GPUs' loads are unchanged; the touched ones get what :func:`_refresh_loads` gives
    them, so the search's choices are those of refreshing every GPU, at ``O(replicas)`` a step.
    Returns the largest load of those GPUs."""
    gpu_of_slot, slot_offsets = lay.gpu_of_slot, lay.slot_offsets
    most = _refresh_gpu(st, slot_offsets, gpu_of_slot[s])
    if t >= 0:
        most = max(most, _refresh_gpu(st, slot_offsets, gpu_of_slot[t]))
    for i in range(st.cnt[e]):
        most = max(most, _refresh_gpu(st, slot_offsets, gpu_of_slot[st.expert_slots[e, i]]))
    for i in range(st.cnt[f]):
        most = max(most, _refresh_gpu(st, slot_offsets, gpu_of_slot[st.expert_slots[f, i]]))
    return most


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _remove_slot(expert_slots, cnt, e, s):
    """Drop slot ``s`` from expert ``e``'s slot list (order of the rest is kept)."""
    n = cnt[e]
    j = 0
    while expert_slots[e, j] != s:
        j += 1
    for i in range(j, n - 1):
        expert_slots[e, i] = expert_slots[e, i + 1]
    cnt[e] = n - 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _add_slot(expert_slots, cnt, e, s):
    expert_slots[e, cnt[e]] = s
    cnt[e] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def _set_slot(st, lay, s, f):
    """Put expert ``f`` into slot ``s`` and update the bookkeeping (not the loads)."""
    row, has, node_group, group_of_expert = st.row, st.has, st.node_group, lay.group_of_expert
    e = row[s]
    g = lay.gpu_of_slot[s]
    node = lay.node_of_gpu[g]
    _remove_slot(st.expert_slots, st.cnt, e, s)
    _add_slot(st.expert_slots, st.cnt, f, s)
    has[g, e] -= 1
    has[g, f] += 1
    node_group[node, group_of_expert[e]] -= 1
    node_group[node, group_of_expert[f]] += 1
    row[s] = f


@njit(cache=True, nogil=True, error_model="numpy")
def _load_layer(st, lay):
    """Fill the bookkeeping of ``st`` from ``st.row`` (``has`` and ``node_group`` must be zero);
    returns the slots that differ from ``st.prev``."""
    row, prev, cnt, expert_slots, has, node_group = st.row, st.prev, st.cnt, st.expert_slots, st.has, st.node_group
    gpu_of_slot, node_of_gpu, group_of_expert = lay.gpu_of_slot, lay.node_of_gpu, lay.group_of_expert
    cnt[:] = 0
    for s in range(row.shape[0]):  # in line, not _add_slot and _shares per slot and expert: a call
        e = row[s]                 # passes its arrays' references, most of a layer's load time
        expert_slots[e, cnt[e]] = s
        cnt[e] += 1
        has[gpu_of_slot[s], e] += 1
        node_group[node_of_gpu[gpu_of_slot[s]], group_of_expert[e]] += 1
    w, share, share_up, gain_down = st.w, st.share, st.share_up, st.gain_down
    for e in range(w.shape[0]):  # as _shares(st, e)
        c = cnt[e]
        share[e] = w[e] / c
        share_up[e] = w[e] / (c + 1)
        gain_down[e] = w[e] / (c - 1) - share[e] if c > 1 else np.inf
    _refresh_loads(st, gpu_of_slot)
    changed = 0
    for s in range(row.shape[0]):
        if row[s] != prev[s]:
            changed += 1
    return changed


@njit(cache=True, nogil=True, error_model="numpy")
def _clear_layer(st, lay):
    """Zero ``has`` and ``node_group`` again (only the entries ``st.row`` set)."""
    row, has, node_group = st.row, st.has, st.node_group
    gpu_of_slot, node_of_gpu, group_of_expert = lay.gpu_of_slot, lay.node_of_gpu, lay.group_of_expert
    for s in range(row.shape[0]):
        has[gpu_of_slot[s], row[s]] = 0
        node_group[node_of_gpu[gpu_of_slot[s]], group_of_expert[row[s]]] = 0


@njit(cache=True, nogil=True, error_model="numpy")
def _score(peak, local, floor, cost, per_change):
    """A move's gain (how far the heaviest GPU comes down, not below ``floor``) per changed slot
    (``per_change``; a move that changes no slot counts as a quarter of one), or its gain alone."""
    return (peak - max(local, floor)) / (cost if cost > 0 and per_change else 0.25 if per_change else 1.0)


@njit(cache=True, nogil=True, error_model="numpy")
def search_near_previous(weights, start, previous, layout, target, max_changes, max_steps, per_change=True):
    """Local search from ``start``: lower the heaviest GPU until it is at most ``target``, counting
    changes against ``previous``; then give back every changed slot the target does not need.

    Each step takes the move with the largest reduction of the heaviest GPU's load per slot changed
    (undoing an earlier change is nearly free): swap two slots between the heaviest GPU and another
    one, give a slot of the heaviest GPU to another expert, or give a slot elsewhere to a second
    replica of an expert on the heaviest GPU. No move creates two replicas of one expert on a GPU;
    with ``layout.keep_groups`` no move puts an expert on a node that holds no expert of its group.
    Every step strictly lowers the sorted vector of GPU loads, so the search ends.

    Args:
        weights: ``[L, E]`` float64 loads.
        start: ``[L, S]`` int64, the placement to start from (every expert present).
        previous: ``[L, S]`` int64, the placement in service (a slot differing from it is a change).
        layout: a :class:`SearchLayout`.
        target: ``[L]`` stop once the max GPU load is at most this.
        max_changes: ``[L]`` int64, at most this many slots of a layer may differ from ``previous``.
        max_steps: at most this many moves per layer (0: only give changed slots back).
        per_change: rank moves by gain per changed slot (else by gain alone: steepest descent,
            which escapes some stalls at the price of bigger moves).
    Returns:
        ``phy2log [L, S]`` int64, ``changes [L]`` int64 (slots that differ from ``previous``) and
        ``steps [L]`` int64 (moves made).
    """
    num_layers, num_slots = previous.shape
    num_experts = weights.shape[1]
    num_gpus = layout.slot_offsets.shape[0] - 1
    num_nodes = 0
    for g in range(num_gpus):
        num_nodes = max(num_nodes, layout.node_of_gpu[g] + 1)
    # most replicas of one expert (every other expert keeps one); a swap puts the second expert in
    # before taking it out: room for one replica more
    most = num_slots - num_experts + 1
    out = start.copy()
    changes = np.zeros(num_layers, np.int64)
    steps = np.zeros(num_layers, np.int64)
    cnt = np.zeros(num_experts, np.int64)
    expert_slots = np.empty((num_experts, most + 1), np.int64)
    has = np.zeros((num_gpus, num_experts), np.int64)  # zero between layers: cleared after each
    node_group = np.zeros((num_nodes, layout.num_groups), np.int64)  # likewise
    x = np.zeros(num_gpus)
    share, share_up, gain_down = np.zeros(num_experts), np.zeros(num_experts), np.zeros(num_experts)
    work = (np.zeros(num_slots), np.empty(num_slots, np.int64), np.empty(num_slots, np.int64),
            np.empty(num_slots, np.int64))  # slot_share, spare, undone, held: scratch of the move scans
    for layer in range(num_layers):
        st = LayerState(weights[layer], out[layer], previous[layer], cnt, expert_slots, has, node_group, x, share,
                        share_up, gain_down)
        changed = _load_layer(st, layout)
        for _ in range(max_steps):
            heavy = _heaviest(st.x)
            if st.x[heavy] <= target[layer] or changed >= max_changes[layer]:
                break
            move = _best_move(st, layout, heavy, target[layer], max_changes[layer] - changed, most, per_change, work)
            if move[2] == NO_MOVE:
                break
            changed += _apply_move(st, layout, move)
            steps[layer] += 1
        changed -= _undo_needless(st, layout, target[layer])
        changes[layer] = changed
        _clear_layer(st, layout)
    return out, changes, steps


@njit(cache=True, nogil=True, error_model="numpy")
def _heaviest(x):
    """The first GPU with the largest load."""
    heavy = np.int64(0)  # not a literal 0: _best_move would be compiled for it too
    for g in range(1, x.shape[0]):
        if x[g] > x[heavy]:
            heavy = g
    return heavy


@njit(cache=True, nogil=True, error_model="numpy")
def _better(score, local, best):
    """Whether a move ``(score, local)`` beats the move ``best``: a higher score, then a lower local max."""
    return score > best[0] or (score == best[0] and local < best[1])


@njit(cache=True, nogil=True, error_model="numpy")
def _cannot_beat(score, local, best):
    """Whether a move of at most ``score`` and at least ``local`` cannot be picked over ``best``
    (:func:`_better` is false for every such move)."""
    return score < best[0] or (score == best[0] and local >= best[1])


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _offer(best, limits, local, cost, kind, a, b):
    """The better of the move ``best`` and the move ``(kind, a, b)``, which leaves ``local`` as the
    largest load on the GPUs it touches and changes ``cost`` more slots; the offered move does not
    count if ``local`` reaches ``limits.limit`` or ``cost`` exceeds ``limits.budget`` (a
    :class:`MoveLimits`)."""
    peak, limit, floor, budget, per_change = limits
    if local >= limit or cost > budget:
        return best
    score = _score(peak, local, floor, cost, per_change)
    if _better(score, local, best):
        return (score, local, np.int64(kind), np.int64(a), np.int64(b))
    return best


# _best_move, its three scans and _undo_needless are compiled on their own, not inlined: Numba's IR
# inliner copies a callee's whole IR (with its own inlined callees) per call site, so inlining these
# large functions into search_near_previous cost ~10 s more of first-call compile; each runs once per
# step or layer, where a call costs nothing measurable.
@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _best_move(st, lay, heavy, floor, budget, most, per_change, work):
    """The best move off GPU ``heavy`` that changes at most ``budget`` more slots.

    (B) and (C) are scanned first, then (A) with what they found as a bar to prune pairs against;
    the pick is the same as scanning (A), (B), (C) in that order: the best score, then the lowest
    local max, then the first found.
    """
    slot_share, spare, undone, held = work
    peak = st.x[heavy]
    limit = peak - _EPS * peak
    # int64 sentinels, not literals: one specialization per callee
    best = (0.0, peak, np.int64(NO_MOVE), np.int64(-1), np.int64(-1))
    limits = MoveLimits(peak, limit, floor, budget, per_change)
    best = _best_give_away(st, lay, heavy, limits, held, best)
    best = _best_new_replica(st, lay, heavy, limits, most, spare, best)
    swap = _best_swap(st, lay, heavy, limits, slot_share, undone, best)
    if best[2] >= 0 and (best[0] > swap[0] or (best[0] == swap[0] and best[1] < swap[1])):
        return best
    return swap


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _best_give_away(st, lay, heavy, limits, held, best):
    """Move (B): give slot ``a`` of the heaviest GPU (expert ``e`` with >= 2 replicas) to expert
    ``f``: the best ``f`` is the lightest new replica the GPU may take, or the slot's previous
    expert (cheaper). ``limits``: a :class:`MoveLimits`. Returns the better of ``best`` and the best
    such move."""
    peak, limit = limits.peak, limits.limit
    row, prev, cnt, has, x, expert_slots = st.row, st.prev, st.cnt, st.has, st.x, st.expert_slots
    share, share_up, gain_down, node_group = st.share, st.share_up, st.gain_down, st.node_group
    gpu_of_slot, group_of_expert, keep_groups = lay.gpu_of_slot, lay.group_of_expert, lay.keep_groups
    node_h = lay.node_of_gpu[heavy]
    first = np.int64(-1)
    second = np.int64(-1)
    for f in range(st.w.shape[0]):
        if has[heavy, f] > 0 or (keep_groups and node_group[node_h, group_of_expert[f]] == 0):
            continue
        if first < 0 or share_up[f] < share_up[first]:
            second = first
            first = f
        elif second < 0 or share_up[f] < share_up[second]:
            second = f
    for a in range(lay.slot_offsets[heavy], lay.slot_offsets[heavy + 1]):
        e = row[a]
        if cnt[e] < 2 or first < 0:
            continue
        gain_e = gain_down[e]
        holders = 0.0
        for i in range(cnt[e]):
            g = gpu_of_slot[expert_slots[e, i]]
            if g != heavy:
                holders = max(holders, x[g] + gain_e * has[g, e])
        base = peak - share[e] + (has[heavy, e] - 1) * gain_e
        if holders >= limit:
            best = _give_away_relieving(st, lay, heavy, a, e, base, limits, held, best)
            continue
        for option in range(2):
            if option == 0:
                f = second if first == prev[a] else first
            else:
                f = prev[a]  # -1: a hole of a carried placement (nothing to give back)
                if f < 0 or f == e or has[heavy, f] > 0 or (keep_groups and node_group[node_h, group_of_expert[f]] == 0):
                    continue
            if f < 0:
                continue
            best = _offer(best, limits, max(base + share_up[f], holders), int(f != prev[a]) - int(e != prev[a]),
                          REASSIGN, a, f)
    return best


@njit(cache=True, nogil=True, error_model="numpy")
def _give_away_relieving(st, lay, heavy, a, e, base, limits, held, best):
    """Move (B) when a holder of ``e`` would overload: only a new replica of an expert that holder
    holds can relieve it. Tries those experts ``f`` (in increasing order), each with the exact loads
    of ``e``'s holders (any other ``f`` leaves that holder at its load, >= limit). ``limits``: a
    :class:`MoveLimits`."""
    limit = limits.limit
    row, prev, cnt, has, x, expert_slots = st.row, st.prev, st.cnt, st.has, st.x, st.expert_slots
    share, share_up, node_group = st.share, st.share_up, st.node_group
    gpu_of_slot, group_of_expert, keep_groups = lay.gpu_of_slot, lay.group_of_expert, lay.keep_groups
    gain_e = st.gain_down[e]
    node_h = lay.node_of_gpu[heavy]
    over = np.int64(-1)
    for i in range(cnt[e]):
        g = gpu_of_slot[expert_slots[e, i]]
        if g != heavy and x[g] + gain_e * has[g, e] >= limit:
            over = g
            break
    num_held = 0
    for t in range(lay.slot_offsets[over], lay.slot_offsets[over + 1]):
        held[num_held] = row[t]
        num_held += 1
    shell_sort(held[:num_held])  # not ndarray.sort(): NumPy's quicksort is long to compile
    for i_held in range(num_held):
        f = held[i_held]
        if i_held > 0 and f == held[i_held - 1]:
            continue
        if f == e or has[heavy, f] > 0 or (keep_groups and node_group[node_h, group_of_expert[f]] == 0):
            continue
        local = base + share_up[f]
        relief_f = share[f] - share_up[f]
        for i in range(cnt[e]):
            g = gpu_of_slot[expert_slots[e, i]]
            if g != heavy:
                local = max(local, x[g] + gain_e * has[g, e] - relief_f * has[g, f])
        best = _offer(best, limits, local, int(f != prev[a]) - int(e != prev[a]), REASSIGN, a, f)
    return best


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _best_new_replica(st, lay, heavy, limits, most, spare, best):
    """Move (C): give slot ``b`` elsewhere (expert ``g2`` with >= 2 replicas) to a new replica of an
    expert ``e`` of the heaviest GPU (at most ``most`` replicas). Only the experts whose extra replica
    relieves the heaviest GPU most are tried. ``limits``: a :class:`MoveLimits`. Returns the better of
    ``best`` and the best such move."""
    peak, limit, floor, per_change = limits.peak, limits.limit, limits.floor, limits.per_change
    row, prev, cnt, has, x = st.row, st.prev, st.cnt, st.has, st.x
    share, share_up, gain_down = st.share, st.share_up, st.gain_down
    expert_slots, node_group = st.expert_slots, st.node_group
    gpu_of_slot, slot_offsets, node_of_gpu = lay.gpu_of_slot, lay.slot_offsets, lay.node_of_gpu
    group_of_expert, keep_groups = lay.group_of_expert, lay.keep_groups
    node_h = node_of_gpu[heavy]
    num_spare = 0
    for b in range(row.shape[0]):
        if cnt[row[b]] >= 2 and gpu_of_slot[b] != heavy:
            spare[num_spare] = b
            num_spare += 1
    reliefs = np.empty(slot_offsets[heavy + 1] - slot_offsets[heavy])
    for a in range(slot_offsets[heavy], slot_offsets[heavy + 1]):
        reliefs[a - slot_offsets[heavy]] = share[row[a]] - share_up[row[a]]
    shell_sort(reliefs)
    min_relief = reliefs[max(0, reliefs.shape[0] - 3)] if reliefs.shape[0] > 0 else 0.0
    for a in range(slot_offsets[heavy], slot_offsets[heavy + 1]):
        e = row[a]
        if share[e] - share_up[e] < min_relief:
            continue
        if a > slot_offsets[heavy] and has[heavy, e] > 1:
            seen = False
            for t in range(slot_offsets[heavy], a):
                if row[t] == e:
                    seen = True
            if seen:
                continue
        if cnt[e] >= most:
            continue
        relief = (share[e] - share_up[e]) * has[heavy, e]
        new_share = share_up[e]
        # pruning, which never skips a move that could be picked: every move of e leaves a local
        # max of at least least_local (new_h below, g2 held on the heavy GPU or not), so a slot b
        # whose best score at such a local max cannot beat the best so far is skipped unread
        least_local = peak - relief
        if _cannot_beat(_score(peak, least_local, floor, 0, per_change), least_local, best):
            continue  # (cost 0 scores highest)
        for i_spare in range(num_spare):
            b = spare[i_spare]
            g2 = row[b]
            if g2 == e:
                continue
            cost = int(e != prev[b]) - int(g2 != prev[b])
            gb = gpu_of_slot[b]
            # and b's GPU leaves at least its load with e for g2 (its other replicas of g2 only add)
            least_b = max(least_local, x[gb] - share[g2] + new_share)
            if least_b >= limit or _cannot_beat(_score(peak, least_b, floor, cost, per_change), least_b, best):
                continue
            gain_g = gain_down[g2]
            new_h = peak - relief + gain_g * has[heavy, g2]
            local = max(new_h, x[gb] - share[g2] + new_share + (has[gb, g2] - 1) * gain_g)
            if local >= limit or gb == heavy or has[gb, e] > 0:
                continue
            if keep_groups and node_of_gpu[gb] != node_h:
                if node_group[node_of_gpu[gb], group_of_expert[e]] == 0:
                    continue
            for i in range(cnt[g2]):
                g = gpu_of_slot[expert_slots[g2, i]]
                if g != heavy and g != gb:
                    local = max(local, x[g] + gain_g * has[g, g2])
            best = _offer(best, limits, local, cost, REASSIGN, b, e)
    return best


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _best_swap(st, lay, heavy, limits, slot_share, undone, bar):
    """Move (A): swap slot ``a`` (heaviest GPU) with slot ``b`` (another GPU). The heaviest GPU's
    slots go in decreasing share, so only pairs with ``0 < share(a) - share(b) < room`` are
    visited; a slot ``b`` whose best possible swap cannot beat ``bar`` (the best (B)/(C) move) or an
    earlier swap is skipped. ``limits``: a :class:`MoveLimits`. Returns the best swap (kind
    :data:`NO_MOVE` if none)."""
    peak, limit, floor, per_change = limits.peak, limits.limit, limits.floor, limits.per_change
    row, prev, has, x, share, node_group = st.row, st.prev, st.has, st.x, st.share, st.node_group
    slot_offsets, node_of_gpu, group_of_expert, keep_groups = lay.slot_offsets, lay.node_of_gpu, lay.group_of_expert, \
        lay.keep_groups
    num_gpus = slot_offsets.shape[0] - 1
    node_h = node_of_gpu[heavy]
    best = (0.0, peak, np.int64(NO_MOVE), np.int64(-1), np.int64(-1))
    lo = slot_offsets[heavy]
    for a in range(lo, slot_offsets[heavy + 1]):  # the other slots' shares are read from share
        slot_share[a] = share[row[a]]
    order = stable_argsort(-slot_share[lo:slot_offsets[heavy + 1]]) + lo
    # pruning, which never skips a pair that could be picked: with slot b, a swap lowers the
    # heaviest GPU at most by the largest share difference, leaves a local max at least midway
    # between the two GPUs, and changes at least `fewest` slots (both unchanged: 2)
    pe_max = slot_share[order[0]] if order.shape[0] > 0 else 0.0
    num_undone = 0  # changed slots of the heaviest GPU: their previous experts
    for a in order:
        if row[a] != prev[a]:
            undone[num_undone] = prev[a]
            num_undone += 1
    for gb in range(num_gpus):
        room = limit - x[gb]
        if gb == heavy or room <= 0.0:
            continue
        other_node = keep_groups and node_of_gpu[gb] != node_h
        middle = (peak + x[gb]) * 0.5 * (1.0 - 1e-12)  # rounding slack: local >= middle
        for b in range(slot_offsets[gb], slot_offsets[gb + 1]):
            f = row[b]
            # the tests on slot b alone, before the pairs (every pair with b would fail them)
            if has[heavy, f] > 0 or (other_node and node_group[node_h, group_of_expert[f]] == 0):
                continue
            sb = share[f]
            if pe_max <= sb:
                continue
            divisor = 1.0
            if per_change:
                divisor = 0.25
                if f == prev[b]:
                    fewest = 2 if num_undone == 0 else 1
                    for i in range(num_undone):
                        if undone[i] == f:
                            fewest = 0
                    if fewest > 0:
                        divisor = float(fewest)
            least_local = max(peak - (pe_max - sb), middle)
            bound = (peak - max(least_local, floor)) / divisor
            if bound < bar[0] or (bound == bar[0] and least_local > bar[1]):
                continue  # cannot beat what (B) and (C) found
            if bound < best[0] or (bound == best[0] and least_local >= best[1]):
                continue  # cannot beat an earlier swap
            for a in order:
                pe = slot_share[a]
                if pe <= sb:
                    break
                d = pe - sb
                if d >= room:
                    continue
                local = max(peak - d, x[gb] + d)
                if local >= limit:
                    continue
                e = row[a]
                if has[gb, e] > 0:
                    continue
                if other_node and node_group[node_of_gpu[gb], group_of_expert[e]] == 0:
                    continue
                cost = (int(f != prev[a]) - int(e != prev[a]) + int(e != prev[b]) - int(f != prev[b]))
                best = _offer(best, limits, local, cost, SWAP, a, b)
    return best


@njit(cache=True, nogil=True, error_model="numpy")
def _apply_move(st, lay, move):
    """Make ``move`` on ``st`` (loads refreshed); returns the change in the number of changed slots."""
    row, prev = st.row, st.prev
    if move[2] == SWAP:
        a, b = move[3], move[4]
        e, f = row[a], row[b]
        _set_slot(st, lay, a, f)
        _set_slot(st, lay, b, e)
        delta = int(f != prev[a]) - int(e != prev[a]) + int(e != prev[b]) - int(f != prev[b])
        _refresh_gpu(st, lay.slot_offsets, lay.gpu_of_slot[a])  # a swap changes no share: its two GPUs only
        _refresh_gpu(st, lay.slot_offsets, lay.gpu_of_slot[b])
    else:
        s, f = move[3], move[4]
        e = row[s]
        _set_slot(st, lay, s, f)
        delta = int(f != prev[s]) - int(e != prev[s])
        _shares(st, e)
        _shares(st, f)
        _refresh_around(st, lay, s, np.int64(-1), e, f)
    return delta


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _undo_needless(st, lay, target):
    """Give changed slots back their previous expert (one slot, or two slots that swapped) wherever
    the max GPU load stays at most ``max(target, current max)``. Returns the slots given back."""
    row, prev, x = st.row, st.prev, st.x
    num_slots = row.shape[0]
    cap = target
    for g in range(x.shape[0]):
        cap = max(cap, x[g])
    changed = np.empty(num_slots, np.int64)
    before = 0
    for s in range(num_slots):
        if row[s] != prev[s]:
            changed[before] = s
            before += 1
    if before < 2:  # one changed slot alone cannot be given back without losing its gain
        return 0
    changed = changed[:before]
    progress = True
    while progress:
        progress = False
        for s in changed:
            # a slot given back (or a hole) is skipped here, not in _undo_one: a call passes the
            # state's arrays' references, which was most of this loop's time
            if row[s] != prev[s] and prev[s] >= 0 and _undo_one(st, lay, s, changed, cap):
                progress = True
    after = 0
    for s in changed:
        if row[s] != prev[s]:
            after += 1
    return before - after


@njit(cache=True, nogil=True, error_model="numpy")
def _undo_one(st, lay, s, changed, cap):
    """Give slot ``s`` (and a slot that swapped with it) back its previous expert if the max GPU
    load stays at most ``cap``; True if done. ``changed``: the slots that may differ from ``prev``."""
    row, prev, has, node_group = st.row, st.prev, st.has, st.node_group
    gpu_of_slot, node_of_gpu, group_of_expert, keep_groups = lay.gpu_of_slot, lay.node_of_gpu, lay.group_of_expert, \
        lay.keep_groups
    e = row[s]
    f = prev[s]
    if e == f or f < 0:  # f < 0: a hole of a carried placement, nothing to give back
        return False
    partner = np.int64(-1)  # a slot holding f that previously held e: undo both
    for t in changed:
        if t != s and row[t] == f and prev[t] == e:
            partner = t
            break
    if partner < 0 and st.cnt[e] < 2:
        return False
    # never a second replica of f (or of e, at the partner) on one GPU: moves avoid it, so must undos
    gpu_s = gpu_of_slot[s]
    gpu_p = gpu_of_slot[partner] if partner >= 0 else np.int64(-1)
    if has[gpu_s, f] - int(gpu_p == gpu_s) > 0:
        return False
    if partner >= 0 and has[gpu_p, e] - int(gpu_p == gpu_s) > 0:
        return False
    node_s = node_of_gpu[gpu_s]
    if keep_groups and partner < 0 and node_group[node_s, group_of_expert[f]] == 0:
        return False
    if keep_groups and partner >= 0 and node_of_gpu[gpu_of_slot[partner]] != node_s:
        if node_group[node_s, group_of_expert[f]] == 0:
            return False
        if node_group[node_of_gpu[gpu_of_slot[partner]], group_of_expert[e]] == 0:
            return False
    if _surely_over(st, lay, s, partner, cap):
        # made and taken back, the undo would leave only this changed: s (and the partner) last
        # in their experts' slot lists (which (B) reads in order)
        _remove_slot(st.expert_slots, st.cnt, e, s)
        _add_slot(st.expert_slots, st.cnt, e, s)
        if partner >= 0:
            _remove_slot(st.expert_slots, st.cnt, f, partner)
            _add_slot(st.expert_slots, st.cnt, f, partner)
        return False
    _set_slot(st, lay, s, f)
    if partner >= 0:
        _set_slot(st, lay, partner, e)
    _shares(st, e)
    _shares(st, f)
    # the loads of the GPUs of s and the partner, and of every holder of e and f, recomputed whole
    # (updating the holders' loads by differences gave wrong peaks: tests/model/test_topologies);
    # the other GPUs' loads are unchanged and at most cap (every GPU is, from the first undo on:
    # an undo that breaks it is taken back, its GPUs' loads recomputed bit for bit), so the max
    # GPU load stays at most cap exactly when these GPUs' loads do
    if _refresh_around(st, lay, s, partner, e, f) <= cap:
        return True
    if partner >= 0:
        _set_slot(st, lay, partner, f)
    _set_slot(st, lay, s, e)
    _shares(st, e)
    _shares(st, f)
    _refresh_around(st, lay, s, partner, e, f)
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _surely_over(st, lay, s, partner, cap):
    """Whether giving slot ``s`` back its previous expert (with ``partner``, the slot that swapped
    with it, or ``-1``) surely puts a GPU above ``cap``: its GPU or a holder of the expert leaving
    ``s`` ends above ``cap`` by more than rounding (the loads that undo would recompute, formed from
    the current ones; every GPU is at most ``cap`` now). A cheap test before the undo is made, so
    that most undos that fail are not made and taken back."""
    x, share, w, cnt, has, expert_slots = st.x, st.share, st.w, st.cnt, st.has, st.expert_slots
    gpu_of_slot = lay.gpu_of_slot
    e, f = st.row[s], st.prev[s]
    gpu_s = gpu_of_slot[s]
    bar = cap * (1.0 + 1e-9) + 1e-300  # rounding: loads summed in another order, denormals
    if partner >= 0:  # the two experts trade slots: no replica count changes
        gpu_p = gpu_of_slot[partner]
        if gpu_p == gpu_s:
            return False
        return x[gpu_s] - share[e] + share[f] > bar or x[gpu_p] - share[f] + share[e] > bar
    rise = w[e] / (cnt[e] - 1) - share[e]  # what each other replica of e gains (cnt[e] >= 2 here)
    share_f = w[f] / (cnt[f] + 1)  # and each replica of f, with one more (none on s's GPU)
    if x[gpu_s] - share[e] + share_f + (has[gpu_s, e] - 1) * rise > bar:
        return True
    for i in range(cnt[e]):
        g = gpu_of_slot[expert_slots[e, i]]
        if g != gpu_s and x[g] + has[g, e] * rise - has[g, f] * (share[f] - share_f) > bar:
            return True
    return False
