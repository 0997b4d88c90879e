"""Kernels that split each expert's tokens among its replicas (dispatch) and sum the GPU loads."""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def share_gpu_loads(weights, phy2log, shares, gpu_of_slot, num_gpus):
    """Tokens each GPU processes when slot ``s`` takes ``shares[l, s]`` of its expert's tokens.

    Args:
        weights: ``[L, E]`` float64 tokens per expert.
        phy2log: ``[L, S]`` int64 expert of each slot.
        shares: ``[L, S]`` float64 fraction of its expert's tokens each slot takes.
        gpu_of_slot: ``[S]`` int64 GPU holding each slot.
    Returns:
        ``[L, G]`` float64.
    """
    num_layers, num_slots = phy2log.shape
    loads = np.zeros((num_layers, num_gpus))
    for layer in range(num_layers):
        for slot in range(num_slots):
            loads[layer, gpu_of_slot[slot]] += weights[layer, phy2log[layer, slot]] * shares[layer, slot]
    return loads


@njit(cache=True, nogil=True, error_model="numpy")
def _find_paths(queue, parent, mark, stamp, ends, num_free, x_start, edge_g, g_start, g_edges, edge_x, flow, rem,
                slack, eps):
    """Breadth-first search for augmenting paths: from an expert with tokens left, forward along
    a replica edge to a GPU, backward along an edge that carries flow to another expert, ...,
    to a GPU with room. Every GPU with room reached ends a path (``ends``; the search tree in
    ``parent`` gives the paths). Returns how many; ``mark == stamp`` flags the visited nodes."""
    found = 0
    head = 0
    tail = 0
    for x in range(num_free):
        if rem[x] > eps:
            mark[x] = stamp
            parent[x] = -1
            queue[tail] = x
            tail += 1
    while head < tail:
        node = queue[head]
        head += 1
        if node < num_free:
            for k in range(x_start[node], x_start[node + 1]):
                gpu_node = num_free + edge_g[k]
                if mark[gpu_node] != stamp:
                    mark[gpu_node] = stamp
                    parent[gpu_node] = k
                    if slack[edge_g[k]] > eps:
                        ends[found] = edge_g[k]
                        found += 1
                    else:
                        queue[tail] = gpu_node
                        tail += 1
        else:
            g = node - num_free
            for j in range(g_start[g], g_start[g + 1]):
                k = g_edges[j]
                x = edge_x[k]
                if flow[k] > eps and mark[x] != stamp:
                    mark[x] = stamp
                    parent[x] = k
                    queue[tail] = x
                    tail += 1
    return found


@njit(cache=True, nogil=True, error_model="numpy")
def _augment(end, parent, num_free, edge_x, edge_g, flow, rem, slack):
    """Push the most the path of :func:`_find_paths` ending at GPU ``end`` can still carry (paths
    of one search share edges: each is re-measured, and may carry nothing)."""
    delta = slack[end]
    k = parent[num_free + end]
    x = edge_x[k]
    while parent[x] >= 0:
        back = parent[x]
        delta = min(delta, flow[back])
        k = parent[num_free + edge_g[back]]
        x = edge_x[k]
    delta = min(delta, rem[x])
    slack[end] -= delta
    k = parent[num_free + end]
    flow[k] += delta
    x = edge_x[k]
    while parent[x] >= 0:
        back = parent[x]
        flow[back] -= delta
        k = parent[num_free + edge_g[back]]
        flow[k] += delta
        x = edge_x[k]
    rem[x] -= delta


@njit(cache=True, nogil=True, error_model="numpy")
def _cancel_cycles(num_nodes, num_free, num_edges, edge_x, edge_g, flow, eps, root, in_forest, adj_start, adj_edges,
                   queue, parent):
    """Shift flow around every cycle of the edges that carry flow until they form a forest.

    Around a cycle (expert and GPU nodes alternate) flow goes up on every other edge and down on
    the others, so no expert's or GPU's total changes; it moves until an edge empties. Edges join
    a forest one by one; an edge whose ends the forest already connects closes a cycle with the
    forest path between them, and emptying one edge of that cycle keeps the rest a forest.
    """
    for v in range(num_nodes + 1):
        adj_start[v] = 0
    for k in range(num_edges):
        in_forest[k] = False
        if flow[k] > eps:
            adj_start[edge_x[k] + 1] += 1
            adj_start[num_free + edge_g[k] + 1] += 1
    for v in range(num_nodes):
        adj_start[v + 1] += adj_start[v]
        root[v] = adj_start[v]  # fill pointer while building, union-find below
    for k in range(num_edges):
        if flow[k] > eps:
            adj_edges[root[edge_x[k]]] = k
            root[edge_x[k]] += 1
            adj_edges[root[num_free + edge_g[k]]] = k
            root[num_free + edge_g[k]] += 1
    for v in range(num_nodes):
        root[v] = v
    for k in range(num_edges):
        if flow[k] <= eps:
            continue
        a = edge_x[k]
        b = num_free + edge_g[k]
        ra = a
        while root[ra] != ra:
            ra = root[ra]
        rb = b
        while root[rb] != rb:
            rb = root[rb]
        if ra != rb:
            root[ra] = rb
            in_forest[k] = True
            continue
        # the forest path from GPU b to expert a (union-find only filters: the search decides)
        for v in range(num_nodes):
            parent[v] = -2
        parent[b] = -1
        queue[0] = b
        head = 0
        tail = 1
        while head < tail and parent[a] == -2:
            v = queue[head]
            head += 1
            for i in range(adj_start[v], adj_start[v + 1]):
                f = adj_edges[i]
                if not in_forest[f]:
                    continue
                u = edge_x[f] if edge_x[f] != v else num_free + edge_g[f]
                if parent[u] == -2:
                    parent[u] = f
                    queue[tail] = u
                    tail += 1
        if parent[a] == -2:
            in_forest[k] = True
            continue
        # walk a -> b: edge k loses flow, the path edges from a gain and lose in turn
        delta = flow[k]
        v = a
        position = 0
        while v != b:
            f = parent[v]
            if position % 2 == 1:
                delta = min(delta, flow[f])
            v = edge_x[f] if edge_x[f] != v else num_free + edge_g[f]
            position += 1
        flow[k] -= delta
        v = a
        position = 0
        while v != b:
            f = parent[v]
            if position % 2 == 0:
                flow[f] += delta
            else:
                flow[f] -= delta
                if flow[f] <= eps:
                    flow[f] = 0.0
                    in_forest[f] = False
            v = edge_x[f] if edge_x[f] != v else num_free + edge_g[f]
            position += 1
        if flow[k] > eps:
            in_forest[k] = True
        else:
            flow[k] = 0.0


@njit(cache=True, nogil=True, error_model="numpy")
def optimal_shares(weights, phy2log, gpu_of_slot, num_gpus):
    """Per layer, the split of each expert's tokens among its replicas that minimises the max GPU load.

    Model: GPU ``g`` carries ``fixed[g]`` (experts whose replicas all sit on ``g``) plus the flow
    ``f[e, g] >= 0`` it takes of every *free* expert ``e`` (replicas on two or more GPUs, tokens
    ``w_e > 0``), with ``sum_g f[e, g] = w_e``. Minimise ``T = max_g load_g``: a transportation LP.

    Exactness. By max-flow/min-cut, a peak ``T >= max fixed`` is feasible iff every set ``X`` of
    free experts fits on the GPUs ``N(X)`` holding its replicas: ``w(X) <= sum_{g in N(X)} (T -
    fixed[g])``. So the optimum is ``T* = max(max_g fixed[g], max_X (w(X) + fixed(N(X))) / |N(X)|)``.
    The kernel runs Newton's method on that parametric max flow: start from the lower bound of
    ``X = all free experts``; compute a max flow (augmenting shortest paths, warm-started, since
    raising ``T`` only adds room); if some tokens are left, the experts reachable in the residual
    graph form a set ``X`` whose ratio is a strictly larger lower bound: raise ``T`` to it exactly
    and continue. When the flow places every token, ``T`` is both attained and a lower bound (the
    ratio of a set), hence the LP optimum, up to float rounding (tokens left below ``1e-13`` of the
    layer total are spread by renormalising each expert's shares). Steps are few: the critical set's GPU
    count strictly decreases from step to step (Newton's method for a ratio), so at most one step
    per GPU; in practice one to three.

    Few split experts: the start is a best-fit assignment of whole experts (heaviest first), and at
    the end flow is shifted around every cycle of the expert-GPU edges that carry flow until they
    form a forest (a basic optimal solution): at most ``n - 1`` experts are split in a connected
    group of ``n`` GPUs. It does not minimise that number (deciding the fewest splits is a bin
    packing problem). Hook for home-node preference: each expert's edges are tried in the order
    built in step 2 (increasing slot); ordering them home node first makes the start and the
    searches prefer home-node replicas.

    Args:
        weights: ``[L, E]`` float64 tokens per expert, non-negative.
        phy2log: ``[L, S]`` int64 expert of each slot (every expert has a slot).
        gpu_of_slot: ``[S]`` int64 GPU of each slot, in ``[0, num_gpus)`` (GPUs with no slot are fine).
        num_gpus: ``G``.
    Returns:
        ``shares [L, S]`` float64 (each expert's shares sum to 1; uniform ``1 / replicas`` where the
        split is immaterial: one GPU, or fewer tokens than ``1e-13`` of the layer's) and ``peak [L]`` float64, the max GPU load.
    """
    num_layers, num_slots = phy2log.shape
    num_experts = weights.shape[1]
    shares = np.empty((num_layers, num_slots))
    peak = np.zeros(num_layers)
    count = np.zeros(num_experts, np.int64)
    first_gpu = np.empty(num_experts, np.int64)
    free = np.zeros(num_experts, np.bool_)
    fixed = np.zeros(num_gpus)
    slot_start = np.zeros(num_experts + 1, np.int64)
    slot_list = np.empty(num_slots, np.int64)
    filled = np.zeros(num_experts, np.int64)
    experts = np.empty(num_experts, np.int64)
    gid = np.empty(num_gpus, np.int64)
    gpus = np.empty(num_gpus, np.int64)
    seen_by = np.empty(num_gpus, np.int64)
    edge_at = np.empty(num_gpus, np.int64)
    edge_x = np.empty(num_slots, np.int64)
    edge_g = np.empty(num_slots, np.int64)
    edge_slots = np.empty(num_slots, np.int64)
    flow = np.empty(num_slots)
    x_start = np.empty(num_experts + 1, np.int64)
    g_start = np.zeros(num_gpus + 1, np.int64)
    g_edges = np.empty(num_slots, np.int64)
    g_fill = np.empty(num_gpus, np.int64)
    rem = np.empty(num_experts)
    slack = np.empty(num_gpus)
    free_weight = np.empty(num_experts)
    num_nodes_max = num_experts + num_gpus
    parent = np.empty(num_nodes_max, np.int64)
    queue = np.empty(num_nodes_max, np.int64)
    mark = np.zeros(num_nodes_max, np.int64)
    ends = np.empty(num_gpus, np.int64)
    root = np.empty(num_nodes_max, np.int64)
    in_forest = np.empty(num_slots, np.bool_)
    adj_start = np.empty(num_nodes_max + 1, np.int64)
    adj_edges = np.empty(2 * num_slots, np.int64)
    loads = np.empty(num_gpus)
    stamp = 0
    for layer in range(num_layers):
        w = weights[layer]
        # 1. replicas per expert; experts on one GPU (or without tokens) are fixed load
        count[:] = 0
        first_gpu[:] = -1
        free[:] = False
        fixed[:] = 0.0
        total = 0.0
        for s in range(num_slots):
            e = phy2log[layer, s]
            g = gpu_of_slot[s]
            count[e] += 1
            if first_gpu[e] < 0:
                first_gpu[e] = g
            elif first_gpu[e] != g:
                free[e] = True
        for e in range(num_experts):
            total += w[e]
        eps = 1e-13 * total
        for e in range(num_experts):
            if w[e] <= eps:
                free[e] = False  # no tokens (or below the float resolution of the loads): uniform
        for s in range(num_slots):
            e = phy2log[layer, s]
            if not free[e]:
                fixed[gpu_of_slot[s]] += w[e] / count[e]
        for e in range(num_experts):
            slot_start[e + 1] = slot_start[e] + count[e]
        filled[:] = 0
        for s in range(num_slots):
            e = phy2log[layer, s]
            slot_list[slot_start[e] + filled[e]] = s
            filled[e] += 1
        # 2. the bipartite graph: free experts x, the GPUs they touch, one edge per (x, GPU)
        num_free = 0
        for e in range(num_experts):
            if free[e]:
                experts[num_free] = e
                free_weight[num_free] = w[e]
                num_free += 1
        if num_free == 0:
            for s in range(num_slots):
                shares[layer, s] = 1.0 / count[phy2log[layer, s]]
            top = 0.0
            for g in range(num_gpus):
                top = max(top, fixed[g])
            peak[layer] = top
            continue
        gid[:] = -1
        seen_by[:] = -1
        num_touched = 0
        num_edges = 0
        for x in range(num_free):
            e = experts[x]
            x_start[x] = num_edges
            for i in range(slot_start[e], slot_start[e + 1]):
                g = gpu_of_slot[slot_list[i]]
                if seen_by[g] == x:
                    edge_slots[edge_at[g]] += 1
                    continue
                seen_by[g] = x
                edge_at[g] = num_edges
                if gid[g] < 0:
                    gid[g] = num_touched
                    gpus[num_touched] = g
                    num_touched += 1
                edge_x[num_edges] = x
                edge_g[num_edges] = gid[g]
                edge_slots[num_edges] = 1
                flow[num_edges] = 0.0
                num_edges += 1
        x_start[num_free] = num_edges
        g_start[: num_touched + 1] = 0
        for k in range(num_edges):
            g_start[edge_g[k] + 1] += 1
        for g in range(num_touched):
            g_start[g + 1] += g_start[g]
            g_fill[g] = 0
        for k in range(num_edges):
            g = edge_g[k]
            g_edges[g_start[g] + g_fill[g]] = k
            g_fill[g] += 1
        # 3. the lower bound of X = all free experts, and the largest fixed load
        target = 0.0
        for g in range(num_gpus):
            target = max(target, fixed[g])
        spread = 0.0
        for x in range(num_free):
            spread += free_weight[x]
            rem[x] = free_weight[x]
        for g in range(num_touched):
            spread += fixed[gpus[g]]
        target = max(target, spread / num_touched)
        for g in range(num_touched):
            slack[g] = target - fixed[gpus[g]]
        # 4. start: whole experts, heaviest first, into the GPU whose room fits best
        order = np.argsort(-free_weight[:num_free], kind="mergesort")
        for x in order:
            best = -1
            for k in range(x_start[x], x_start[x + 1]):
                room = slack[edge_g[k]]
                if room >= rem[x] and (best < 0 or room < slack[edge_g[best]]):
                    best = k
            if best >= 0:
                flow[best] += rem[x]
                slack[edge_g[best]] -= rem[x]
                rem[x] = 0.0
                continue
            while rem[x] > eps:
                best = -1
                for k in range(x_start[x], x_start[x + 1]):
                    if slack[edge_g[k]] > eps and (best < 0 or slack[edge_g[k]] > slack[edge_g[best]]):
                        best = k
                if best < 0:
                    break
                amount = min(rem[x], slack[edge_g[best]])
                flow[best] += amount
                slack[edge_g[best]] -= amount
                rem[x] -= amount
        # 5. Newton on the peak: max flow, then raise the peak to the ratio of the min cut's experts
        for _ in range(2 * (num_free + num_touched) + 8):
            while True:
                stamp += 1
                found = _find_paths(queue, parent, mark, stamp, ends, num_free, x_start, edge_g, g_start, g_edges,
                                    edge_x, flow, rem, slack, eps)
                if found == 0:
                    break
                for i in range(found):
                    _augment(ends[i], parent, num_free, edge_x, edge_g, flow, rem, slack)
            left = 0.0
            for x in range(num_free):
                left += rem[x]
            if left <= eps:
                break
            cut_tokens = 0.0
            cut_gpus = 0
            for x in range(num_free):
                if mark[x] == stamp:
                    cut_tokens += free_weight[x]
            for g in range(num_touched):
                if mark[num_free + g] == stamp:
                    cut_tokens += fixed[gpus[g]]
                    cut_gpus += 1
            raised = cut_tokens / cut_gpus
            if raised <= target:
                break  # rounding: what is left is below the float resolution of the loads
            for g in range(num_touched):
                slack[g] += raised - target
            target = raised
        # 6. cancel cycles: a forest of split experts
        _cancel_cycles(num_free + num_touched, num_free, num_edges, edge_x, edge_g, flow, eps, root, in_forest,
                       adj_start, adj_edges, queue, parent)
        # 7. shares: flow over an expert's placed tokens, split evenly among its slots on one GPU
        for s in range(num_slots):
            e = phy2log[layer, s]
            if not free[e]:
                shares[layer, s] = 1.0 / count[e]
        for x in range(num_free):
            e = experts[x]
            placed = 0.0
            for k in range(x_start[x], x_start[x + 1]):
                if flow[k] < 0.0:
                    flow[k] = 0.0
                placed += flow[k]
                edge_at[gpus[edge_g[k]]] = k
            for i in range(slot_start[e], slot_start[e + 1]):
                s = slot_list[i]
                k = edge_at[gpu_of_slot[s]]
                shares[layer, s] = flow[k] / placed / edge_slots[k] if placed > 0.0 else 1.0 / count[e]
        loads[:] = 0.0
        for s in range(num_slots):
            loads[gpu_of_slot[s]] += w[phy2log[layer, s]] * shares[layer, s]
        top = 0.0
        for g in range(num_gpus):
            top = max(top, loads[g])
        peak[layer] = top
    return shares, peak


@njit(cache=True, nogil=True, error_model="numpy")
def _next_random(state):
    """xorshift64: the next state (also the random number); deterministic on every machine."""
    state ^= (state << np.uint64(13)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    state ^= state >> np.uint64(7)
    state ^= (state << np.uint64(17)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    return state


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
    their GPUs (the links a :func:`eplb.kernels.linked.linked_placement` laid out).

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
    tiled = np.empty((num_windows, num_slots), np.int64)
    weights = np.empty((num_windows, num_experts))
    scale = np.zeros(num_windows)
    new_shares = np.empty((num_windows, num_slots))
    count = np.zeros(num_experts, np.int64)
    state = np.uint64(seed) if seed > 0 else np.uint64(88172645463325252)
    for layer in range(num_layers):
        total_weight = 0.0
        for t in range(num_windows):
            mean = 0.0
            for e in range(num_experts):
                weights[t, e] = windows[t, layer, e]
                mean += windows[t, layer, e]
            mean /= num_gpus
            scale[t] = window_weights[t] / mean if mean > 0.0 and window_weights[t] > 0.0 else 0.0
            total_weight += window_weights[t] if scale[t] > 0.0 else 0.0
            for s in range(num_slots):
                tiled[t, s] = out[layer, s]
        if total_weight <= 0.0:
            continue
        count[:] = 0
        for s in range(num_slots):
            count[out[layer, s]] += 1
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
            size = slot_offsets[hot + 1] - slot_offsets[hot]
            a = -1
            for _attempt in range(32):
                state = _next_random(state)
                candidate = slot_offsets[hot] + np.int64(state % np.uint64(size))
                if not keep_replicas or count[out[layer, candidate]] == 1:
                    a = candidate
                    break
            if a < 0:
                continue
            b = -1
            for _attempt in range(32):
                state = _next_random(state)
                candidate = np.int64(state % np.uint64(num_slots))
                if gpu_of_slot[candidate] == hot or zone_of_slot[candidate] != zone_of_slot[a]:
                    continue
                if out[layer, candidate] == out[layer, a] or (keep_replicas and count[out[layer, candidate]] != 1):
                    continue
                b = candidate
                break
            if b < 0:
                continue
            for r in range(num_windows):
                tiled[r, a] = out[layer, b]
                tiled[r, b] = out[layer, a]
            # windows one at a time, the window in turn first: stop as soon as the windows seen,
            # with every other window at its floor (peak = mean), cannot beat the current value
            target = current * (1.0 - 1e-12) * total_weight
            floor = total_weight
            value = 0.0
            rejected = False
            for step in range(num_windows):
                r = (t + step) % num_windows
                if scale[r] <= 0.0:
                    continue
                one_shares, one_peak = optimal_shares(weights[r : r + 1], tiled[r : r + 1], gpu_of_slot, num_gpus)
                for s in range(num_slots):
                    new_shares[r, s] = one_shares[0, s]
                value += scale[r] * one_peak[0]
                floor -= window_weights[r]
                if value + floor >= target:
                    rejected = True
                    break
            if not rejected:
                expert = out[layer, a]
                out[layer, a] = out[layer, b]
                out[layer, b] = expert
                for r in range(num_windows):
                    for s in range(num_slots):
                        shares[r, s] = new_shares[r, s]
                current = value / total_weight
            else:
                for r in range(num_windows):
                    tiled[r, a] = out[layer, a]
                    tiled[r, b] = out[layer, b]
        after[layer] = current
    return out, before, after
