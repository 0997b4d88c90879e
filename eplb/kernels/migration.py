"""Kernels of migration-aware planning: improve a previous placement with few slot changes, and
relabel a fresh placement so that it keeps as many experts in place as possible.

Shapes: ``L`` layers, ``E`` experts, ``S`` slots, ``G`` GPUs, ``N`` nodes, ``K`` expert groups.
A "change" is a slot whose expert differs from the previous placement.
"""

import numpy as np
from numba import njit

_EPS = 1e-12


@njit(cache=True, nogil=True, error_model="numpy")
def _shares(w, cnt, e, share, share_up, gain_down):
    """Refresh expert ``e``'s entries of the per-replica load tables after its count changed."""
    c = cnt[e]
    share[e] = w[e] / c
    share_up[e] = w[e] / (c + 1)
    gain_down[e] = w[e] / (c - 1) - share[e] if c > 1 else np.inf


@njit(cache=True, nogil=True, error_model="numpy")
def _loads_from_shares(row, share, gpu_of_slot, x):
    """Fill ``x [G]`` with each GPU's load: the sum of its replicas' shares."""
    x[:] = 0.0
    for s in range(row.shape[0]):
        x[gpu_of_slot[s]] += share[row[s]]


@njit(cache=True, nogil=True, error_model="numpy")
def _remove_slot(expert_slots, cnt, e, s):
    """Drop slot ``s`` from expert ``e``'s slot list (order of the rest is kept)."""
    n = cnt[e]
    j = 0
    while expert_slots[e, j] != s:
        j += 1
    for i in range(j, n - 1):
        expert_slots[e, i] = expert_slots[e, i + 1]
    cnt[e] = n - 1


@njit(cache=True, nogil=True, error_model="numpy")
def _add_slot(expert_slots, cnt, e, s):
    expert_slots[e, cnt[e]] = s
    cnt[e] += 1


@njit(cache=True, nogil=True, error_model="numpy")
def improve_placement(weights, start, previous, gpu_of_slot, slot_offsets, node_of_gpu, group_of_expert,
                      keep_groups, num_groups, target, max_changes, max_steps, per_change=True):
    """Local search from ``start``: lower the heaviest GPU until it is at most ``target``, counting
    changes against ``previous``.

    Each step takes the move with the largest reduction of the heaviest GPU's load per slot changed
    (undoing an earlier change is nearly free): swap two slots between the heaviest GPU and another
    one, give a slot of the heaviest GPU to another expert, or give a slot elsewhere to a second
    replica of an expert on the heaviest GPU. No move creates two replicas of one expert on a GPU;
    with ``keep_groups`` no move puts an expert on a node that holds no expert of its group. Every
    step strictly lowers the sorted vector of GPU loads, so the search ends.

    Args:
        weights: ``[L, E]`` float64 loads.
        start: ``[L, S]`` int64, the placement to start from (every expert present).
        previous: ``[L, S]`` int64, the placement in service (a slot differing from it is a change).
        gpu_of_slot: ``[S]``; slot_offsets: ``[G + 1]``; node_of_gpu: ``[G]``; group_of_expert: ``[E]``.
        keep_groups: bool; num_groups: ``K`` (>= 1).
        target: ``[L]`` stop once the max GPU load is at most this.
        max_changes: ``[L]`` int64, at most this many slots of a layer may differ from ``previous``.
        max_steps: at most this many moves per layer.
        per_change: rank moves by gain per changed slot (else by gain alone: steepest descent,
            which escapes some stalls at the price of bigger moves).
    Returns:
        ``phy2log [L, S]`` int64, ``changes [L]`` int64 (slots that differ from ``previous``) and
        ``steps [L]`` int64 (moves made).
    """
    num_layers, num_slots = previous.shape
    num_experts = weights.shape[1]
    num_gpus = slot_offsets.shape[0] - 1
    num_nodes = 0
    for g in range(num_gpus):
        num_nodes = max(num_nodes, node_of_gpu[g] + 1)
    most = num_slots - num_experts + 1  # most replicas of one expert (every other expert keeps one)
    # a swap puts the second expert in before taking it out: room for one replica more than `most`
    width = most + 1
    out = start.copy()
    changes = np.zeros(num_layers, np.int64)
    steps = np.zeros(num_layers, np.int64)
    cnt = np.zeros(num_experts, np.int64)
    expert_slots = np.empty((num_experts, width), np.int64)
    has = np.zeros((num_gpus, num_experts), np.int64)
    node_group = np.zeros((num_nodes, num_groups), np.int64)
    x = np.zeros(num_gpus)
    share = np.zeros(num_experts)  # w / cnt: load of each replica
    share_up = np.zeros(num_experts)  # w / (cnt + 1): with one replica more
    gain_down = np.zeros(num_experts)  # w / (cnt - 1) - w / cnt: what each other replica gains if one goes
    slot_share = np.zeros(num_slots)  # share of the expert in each slot
    spare = np.empty(num_slots, np.int64)  # slots whose expert has another replica
    undone = np.empty(num_slots, np.int64)  # previous experts of the heaviest GPU's changed slots
    held = np.empty(num_slots, np.int64)  # experts of one GPU
    for layer in range(num_layers):
        w = weights[layer]
        row = out[layer]
        prev = previous[layer]
        cnt[:] = 0  # has and node_group are all zero here: cleared after each layer
        for s in range(num_slots):
            e = row[s]
            _add_slot(expert_slots, cnt, e, s)
            has[gpu_of_slot[s], e] += 1
            node_group[node_of_gpu[gpu_of_slot[s]], group_of_expert[e]] += 1
        for e in range(num_experts):
            _shares(w, cnt, e, share, share_up, gain_down)
        _loads_from_shares(row, share, gpu_of_slot, x)
        changed = 0
        for s in range(num_slots):
            if row[s] != prev[s]:
                changed += 1
        for step in range(max_steps):
            heavy = 0
            for g in range(1, num_gpus):
                if x[g] > x[heavy]:
                    heavy = g
            peak = x[heavy]
            if peak <= target[layer] or changed >= max_changes[layer]:
                break
            budget = max_changes[layer] - changed
            limit = peak - _EPS * peak
            floor = target[layer]
            node_h = node_of_gpu[heavy]
            best_score = 0.0
            best_local = peak
            best_kind = np.int64(-1)  # int64 sentinels, not literals: one specialization per callee
            best_a = np.int64(-1)
            best_b = np.int64(-1)
            # (B) and (C) first, then (A) with what they found as a bar to prune pairs against;
            # the pick is the same as scanning (A), (B), (C) in that order: the best score, then the
            # lowest local max, then the first found
            # (B) give slot a of the heaviest GPU (expert e with >= 2 replicas) to expert f: the best
            # f is the lightest new replica the GPU may take, or the slot's previous expert (cheaper)
            first = np.int64(-1)
            second = np.int64(-1)
            for f in range(num_experts):
                if has[heavy, f] > 0 or (keep_groups and node_group[node_h, group_of_expert[f]] == 0):
                    continue
                if first < 0 or share_up[f] < share_up[first]:
                    second = first
                    first = f
                elif second < 0 or share_up[f] < share_up[second]:
                    second = f
            for a in range(slot_offsets[heavy], slot_offsets[heavy + 1]):
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
                    # a holder of e would overload, unless the new replica relieves an expert it
                    # holds: try those experts f (in increasing order), each with the exact loads of
                    # e's holders (any other f leaves that holder at its load, >= limit)
                    over = np.int64(-1)
                    for i in range(cnt[e]):
                        g = gpu_of_slot[expert_slots[e, i]]
                        if g != heavy and x[g] + gain_e * has[g, e] >= limit:
                            over = g
                            break
                    num_held = 0
                    for t in range(slot_offsets[over], slot_offsets[over + 1]):
                        held[num_held] = row[t]
                        num_held += 1
                    held[:num_held].sort()
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
                        if local >= limit:
                            continue
                        cost = int(f != prev[a]) - int(e != prev[a])
                        if cost > budget:
                            continue
                        score = (peak - max(local, floor)) / (cost if cost > 0 and per_change else 0.25 if per_change else 1.0)
                        if score > best_score or (score == best_score and local < best_local):
                            best_score, best_local, best_kind, best_a, best_b = score, local, 1, a, f
                    continue
                for option in range(2):
                    if option == 0:
                        f = second if first == prev[a] else first
                    else:
                        f = prev[a]
                        if f == e or has[heavy, f] > 0 or (keep_groups and node_group[node_h, group_of_expert[f]] == 0):
                            continue
                    if f < 0:
                        continue
                    local = max(base + share_up[f], holders)
                    if local >= limit:
                        continue
                    cost = int(f != prev[a]) - int(e != prev[a])
                    if cost > budget:
                        continue
                    score = (peak - max(local, floor)) / (cost if cost > 0 and per_change else 0.25 if per_change else 1.0)
                    if score > best_score or (score == best_score and local < best_local):
                        best_score, best_local, best_kind, best_a, best_b = score, local, 1, a, f
            # (C) give slot b elsewhere (expert g with >= 2 replicas) to a new replica of expert e
            num_spare = 0
            for b in range(num_slots):
                if cnt[row[b]] >= 2 and gpu_of_slot[b] != heavy:
                    spare[num_spare] = b
                    num_spare += 1
            # only the experts whose extra replica relieves the heaviest GPU most are worth trying
            reliefs = np.empty(slot_offsets[heavy + 1] - slot_offsets[heavy])
            for a in range(slot_offsets[heavy], slot_offsets[heavy + 1]):
                reliefs[a - slot_offsets[heavy]] = share[row[a]] - share_up[row[a]]
            reliefs.sort()
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
                for i_spare in range(num_spare):
                    b = spare[i_spare]
                    g2 = row[b]
                    if g2 == e:
                        continue
                    gain_g = gain_down[g2]
                    gb = gpu_of_slot[b]
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
                    if local >= limit:
                        continue
                    cost = int(e != prev[b]) - int(g2 != prev[b])
                    if cost > budget:
                        continue
                    score = (peak - max(local, floor)) / (cost if cost > 0 and per_change else 0.25 if per_change else 1.0)
                    if score > best_score or (score == best_score and local < best_local):
                        best_score, best_local, best_kind, best_a, best_b = score, local, 2, b, e
            bc_score, bc_local, bc_kind, bc_a, bc_b = best_score, best_local, best_kind, best_a, best_b
            best_score = 0.0
            best_local = peak
            best_kind = np.int64(-1)
            best_a = np.int64(-1)
            best_b = np.int64(-1)
            # (A) swap slot a (heaviest GPU) with slot b (another GPU): the heaviest GPU's slots in
            # decreasing share, so that only pairs with 0 < share(a) - share(b) < room are visited
            for b in range(num_slots):
                slot_share[b] = share[row[b]]
            lo = slot_offsets[heavy]
            order = np.argsort(-slot_share[lo:slot_offsets[heavy + 1]], kind="mergesort") + lo
            # pruning, which never skips a pair that could be picked: with slot b, a swap lowers the
            # heaviest GPU at most by the largest share difference, leaves a local max at least
            # midway between the two GPUs, and changes at least `fewest` slots (both unchanged: 2)
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
                    sb = slot_share[b]
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
                    if bound < bc_score or (bound == bc_score and least_local > bc_local):
                        continue  # cannot beat what (B) and (C) found
                    if bound < best_score or (bound == best_score and least_local >= best_local):
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
                        if cost > budget:
                            continue
                        score = (peak - max(local, floor)) / (cost if cost > 0 and per_change else 0.25 if per_change else 1.0)
                        if score > best_score or (score == best_score and local < best_local):
                            best_score, best_local, best_kind, best_a, best_b = score, local, 0, a, b
            if bc_kind >= 0 and (bc_score > best_score or (bc_score == best_score and bc_local < best_local)):
                best_score, best_local, best_kind, best_a, best_b = bc_score, bc_local, bc_kind, bc_a, bc_b
            if best_kind < 0:
                break
            # apply the move: slot -> new expert, one or two slots
            if best_kind == 0:
                a, b = best_a, best_b
                e, f = row[a], row[b]
                _set_slot(row, a, f, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
                _set_slot(row, b, e, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
                changed += (int(f != prev[a]) - int(e != prev[a]) + int(e != prev[b]) - int(f != prev[b]))
            else:
                s, f = best_a, best_b
                e = row[s]
                _set_slot(row, s, f, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
                changed += int(f != prev[s]) - int(e != prev[s])
                _shares(w, cnt, e, share, share_up, gain_down)
                _shares(w, cnt, f, share, share_up, gain_down)
            _loads_from_shares(row, share, gpu_of_slot, x)
            steps[layer] += 1
        changed -= _undo_needless(w, row, prev, cnt, expert_slots, has, node_group, gpu_of_slot, node_of_gpu,
                                  group_of_expert, keep_groups, share, share_up, gain_down, x, target[layer])
        changes[layer] = changed
        for s in range(num_slots):
            has[gpu_of_slot[s], row[s]] = 0
            node_group[node_of_gpu[gpu_of_slot[s]], group_of_expert[row[s]]] = 0
    return out, changes, steps


@njit(cache=True, nogil=True, error_model="numpy")
def _undo_needless(w, row, prev, cnt, expert_slots, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert,
                   keep_groups, share, share_up, gain_down, x, target):
    """Give changed slots back their previous expert (one slot, or two slots that swapped) wherever
    the max GPU load stays at most ``max(target, current max)``. Returns the slots given back."""
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
            if _undo_one(s, changed, w, row, prev, cnt, expert_slots, has, node_group, gpu_of_slot, node_of_gpu,
                         group_of_expert, keep_groups, share, share_up, gain_down, x, cap):
                progress = True
    after = 0
    for s in changed:
        if row[s] != prev[s]:
            after += 1
    return before - after


@njit(cache=True, nogil=True, error_model="numpy")
def _undo_one(s, changed, w, row, prev, cnt, expert_slots, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert,
              keep_groups, share, share_up, gain_down, x, cap):
    """Give slot ``s`` (and a slot that swapped with it) back its previous expert if the max GPU
    load stays at most ``cap``; True if done. ``changed``: the slots that may differ from ``prev``."""
    e = row[s]
    f = prev[s]
    if e == f:
        return False
    partner = np.int64(-1)  # a slot holding f that previously held e: undo both
    for t in changed:
        if t != s and row[t] == f and prev[t] == e:
            partner = t
            break
    if partner < 0 and cnt[e] < 2:
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
    _set_slot(row, s, f, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
    if partner >= 0:
        _set_slot(row, partner, e, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
    _shares(w, cnt, e, share, share_up, gain_down)
    _shares(w, cnt, f, share, share_up, gain_down)
    # every GPU's load (refreshing only the holders of e and f gave wrong peaks: tests/test_topologies)
    _loads_from_shares(row, share, gpu_of_slot, x)
    peak = 0.0
    for g in range(x.shape[0]):
        peak = max(peak, x[g])
    if peak <= cap:
        return True
    if partner >= 0:
        _set_slot(row, partner, f, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
    _set_slot(row, s, e, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert)
    _shares(w, cnt, e, share, share_up, gain_down)
    _shares(w, cnt, f, share, share_up, gain_down)
    _loads_from_shares(row, share, gpu_of_slot, x)
    return False


@njit(cache=True, nogil=True, error_model="numpy")
def _set_slot(row, s, f, expert_slots, cnt, has, node_group, gpu_of_slot, node_of_gpu, group_of_expert):
    """Put expert ``f`` into slot ``s`` and update the bookkeeping arrays."""
    e = row[s]
    g = gpu_of_slot[s]
    _remove_slot(expert_slots, cnt, e, s)
    _add_slot(expert_slots, cnt, f, s)
    has[g, e] -= 1
    has[g, f] += 1
    node_group[node_of_gpu[g], group_of_expert[e]] -= 1
    node_group[node_of_gpu[g], group_of_expert[f]] += 1
    row[s] = f


@njit(cache=True, nogil=True, error_model="numpy")
def min_cost_assignment(cost):
    """Optimal assignment of an ``[n, n]`` float64 cost matrix (shortest augmenting paths, O(n^3)).

    Returns:
        ``[n]`` int64: the column assigned to each row, minimising the total cost.
    """
    n = cost.shape[0]
    inf = np.inf
    u = np.zeros(n + 1)
    v = np.zeros(n + 1)
    match_col = np.zeros(n + 1, np.int64)  # row (1-based) matched to each column; 0 = free
    way = np.zeros(n + 1, np.int64)
    min_v = np.empty(n + 1)
    used = np.zeros(n + 1, np.bool_)
    for i in range(1, n + 1):
        match_col[0] = i
        j0 = 0
        min_v[:] = inf
        used[:] = False
        while True:
            used[j0] = True
            i0 = match_col[j0]
            delta = inf
            j1 = 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1, j - 1] - u[i0] - v[j]
                    if cur < min_v[j]:
                        min_v[j] = cur
                        way[j] = j0
                    if min_v[j] < delta:
                        delta = min_v[j]
                        j1 = j
            for j in range(n + 1):
                if used[j]:
                    u[match_col[j]] += delta
                    v[j] -= delta
                else:
                    min_v[j] -= delta
            j0 = j1
            if match_col[j0] == 0:
                break
        while j0 != 0:
            j1 = way[j0]
            match_col[j0] = match_col[j1]
            j0 = j1
    result = np.empty(n, np.int64)
    for j in range(1, n + 1):
        result[match_col[j] - 1] = j - 1
    return result


@njit(cache=True, nogil=True, error_model="numpy")
def _overlap(new_row, prev_row, slot_offsets, num_experts):
    """``[G, G]``: experts GPU ``gn`` holds under ``new_row`` that GPU ``go`` holds under ``prev_row``
    (multiset intersection); ``-1`` where the two GPUs hold different numbers of slots."""
    num_gpus = slot_offsets.shape[0] - 1
    held = np.zeros((num_gpus, num_experts), np.int64)
    for g in range(num_gpus):
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            held[g, prev_row[s]] += 1
    overlap = np.zeros((num_gpus, num_gpus))
    mine = np.zeros(num_experts, np.int64)
    for gn in range(num_gpus):
        size = slot_offsets[gn + 1] - slot_offsets[gn]
        for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
            mine[new_row[s]] += 1
        for go in range(num_gpus):
            if slot_offsets[go + 1] - slot_offsets[go] != size:
                overlap[gn, go] = -1.0
                continue
            total = 0
            for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
                e = new_row[s]
                if mine[e] > 0:  # count each distinct expert once
                    total += min(mine[e], held[go, e])
                    mine[e] = -mine[e]
            for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
                e = new_row[s]
                if mine[e] < 0:
                    mine[e] = -mine[e]
            overlap[gn, go] = total
        for s in range(slot_offsets[gn], slot_offsets[gn + 1]):
            mine[new_row[s]] = 0
    return overlap


@njit(cache=True, nogil=True, error_model="numpy")
def _match_gpus(overlap, gpus_per_node, by_node):
    """GPU relabelling ``[G]`` (new GPU -> position) maximising the kept experts.

    ``by_node``: permute whole nodes, then GPUs inside each node (keeps groups on one node);
    otherwise any GPU may take any position with the same slot count.
    """
    num_gpus = overlap.shape[0]
    big = 1e9
    if not by_node:
        cost = np.empty((num_gpus, num_gpus))
        for i in range(num_gpus):
            for j in range(num_gpus):
                cost[i, j] = big if overlap[i, j] < 0 else -overlap[i, j]
        return min_cost_assignment(cost)
    num_nodes = num_gpus // gpus_per_node
    node_cost = np.empty((num_nodes, num_nodes))
    inner = np.empty((num_nodes, num_nodes, gpus_per_node), np.int64)
    sub = np.empty((gpus_per_node, gpus_per_node))
    for a in range(num_nodes):
        for b in range(num_nodes):
            for i in range(gpus_per_node):
                for j in range(gpus_per_node):
                    o = overlap[a * gpus_per_node + i, b * gpus_per_node + j]
                    sub[i, j] = big if o < 0 else -o
            assignment = min_cost_assignment(sub)
            total = 0.0
            for i in range(gpus_per_node):
                total += sub[i, assignment[i]]
            inner[a, b] = assignment
            node_cost[a, b] = total
    nodes = min_cost_assignment(node_cost)
    result = np.empty(num_gpus, np.int64)
    for a in range(num_nodes):
        for i in range(gpus_per_node):
            result[a * gpus_per_node + i] = nodes[a] * gpus_per_node + inner[a, nodes[a], i]
    return result


@njit(cache=True, nogil=True, error_model="numpy")
def align_slots(row, prev_row, slot_offsets, num_experts, out):
    """Order each GPU's experts so that those it held in a slot under ``prev_row`` stay there."""
    num_gpus = slot_offsets.shape[0] - 1
    want = np.zeros(num_experts, np.int64)
    for g in range(num_gpus):
        lo, hi = slot_offsets[g], slot_offsets[g + 1]
        for s in range(lo, hi):
            want[row[s]] += 1
            out[s] = -1
        for s in range(lo, hi):
            e = prev_row[s]
            if want[e] > 0:
                out[s] = e
                want[e] -= 1
        t = lo
        for s in range(lo, hi):
            e = row[s]
            if want[e] > 0:
                while out[t] >= 0:
                    t += 1
                out[t] = e
                want[e] -= 1


@njit(cache=True, nogil=True, error_model="numpy")
def relabel_like(new, previous, slot_offsets, gpus_per_node, by_node, num_experts):
    """Relabel GPUs (and nodes) of ``new [L, S]``, then slots inside each GPU, to keep the most
    experts where ``previous [L, S]`` had them. GPU loads are only permuted.

    Returns:
        ``phy2log [L, S]`` int64 and ``changes [L]`` int64 (slots that differ from ``previous``).
    """
    num_layers, num_slots = new.shape
    num_gpus = slot_offsets.shape[0] - 1
    out = np.empty_like(new)
    moved = np.empty(num_slots, np.int64)
    changes = np.zeros(num_layers, np.int64)
    for layer in range(num_layers):
        overlap = _overlap(new[layer], previous[layer], slot_offsets, num_experts)
        position = _match_gpus(overlap, gpus_per_node, by_node)
        for gn in range(num_gpus):
            go = position[gn]
            for i in range(slot_offsets[gn + 1] - slot_offsets[gn]):
                moved[slot_offsets[go] + i] = new[layer, slot_offsets[gn] + i]
        align_slots(moved, previous[layer], slot_offsets, num_experts, out[layer])
        for s in range(num_slots):
            if out[layer, s] != previous[layer, s]:
                changes[layer] += 1
    return out, changes


@njit(cache=True, nogil=True, error_model="numpy")
def _fits(w, row, prev, slot_offsets, counts, target, most):
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
                if _fits(w, row, prev, slot_offsets, counts, target, 0):
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
