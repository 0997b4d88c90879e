"""Optimal dispatch: kernels that split each expert's tokens among its replicas so the peak GPU load is
least (a max-flow per layer, :func:`optimal_shares`) and sum the GPU loads under any shares
(:func:`share_gpu_loads`). The slot swaps that lower the optimal-dispatch peak are in
:mod:`eplb.kernels.split.dispatch_swaps`."""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, stable_argsort

SlotTables = namedtuple("SlotTables", ["count", "first_gpu", "free", "fixed", "slot_start", "slot_list", "filled"])
SlotTables.__doc__ = """One layer's slots as :func:`optimal_shares` sees them: ``count [E]`` replicas per
expert, ``first_gpu [E]`` the GPU of its first slot, ``free [E]`` bool (replicas on two or more GPUs
and tokens to split), ``fixed [G]`` the load of the experts that are not free, ``slot_start [E + 1]``
and ``slot_list [S]`` each expert's slots (CSR), ``filled [E]`` scratch."""

FlowGraph = namedtuple("FlowGraph", ["experts", "free_weight", "gpus", "gid", "seen_by", "edge_at", "edge_x", "edge_g",
                                     "edge_slots", "flow", "x_start", "g_start", "g_edges", "g_fill", "rem", "slack"])
FlowGraph.__doc__ = """The bipartite graph of one layer's free experts ``x`` and the GPUs they touch:
``experts [E]`` expert of each ``x``, ``free_weight [E]`` its tokens, ``gpus [G]`` GPU of each touched
GPU index (``gid [G]`` the reverse, ``-1`` untouched), ``seen_by [G]`` and ``edge_at [G]`` scratch,
per edge ``k`` (one per expert and GPU, at most ``S``): ``edge_x``, ``edge_g`` (touched index),
``edge_slots`` (the expert's slots on that GPU), ``flow`` (tokens); ``x_start [E + 1]`` each
expert's edges, ``g_start [G + 1]`` and ``g_edges [S]`` each GPU's edges, ``g_fill [G]`` scratch;
``rem [E]`` tokens not placed yet, ``slack [G]`` room left under the target peak."""

FlowSearch = namedtuple("FlowSearch", ["parent", "queue", "mark", "ends", "root", "in_forest", "adj_start",
                                       "adj_edges"])
FlowSearch.__doc__ = """Scratch of the graph searches over ``V = E + G`` nodes (experts first, then
GPUs): ``parent [V]``, ``queue [V]``, ``mark [V]`` (visit stamps), ``ends [G]`` (path ends),
``root [V]`` (union-find), ``in_forest [S]`` bool per edge, ``adj_start [V + 1]`` and
``adj_edges [2 S]`` (the edges carrying flow, per node)."""


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


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _find_paths(graph, search, stamp, num_free, eps):
    """Breadth-first search for augmenting paths: from an expert with tokens left, forward along
    a replica edge to a GPU, backward along an edge that carries flow to another expert, ...,
    to a GPU with room. Every GPU with room reached ends a path (``ends``; the search tree in
    ``parent`` gives the paths). Returns how many; ``mark == stamp`` flags the visited nodes.

    Args:
        graph: a :class:`FlowGraph`; search: a :class:`FlowSearch` (``parent``, ``queue``, ``mark``
        and ``ends`` are written); stamp: int, this search's mark; num_free: free experts; eps: float.
    """
    queue, parent, mark, ends = search.queue, search.parent, search.mark, search.ends
    x_start, edge_g, g_start, g_edges = graph.x_start, graph.edge_g, graph.g_start, graph.g_edges
    edge_x, flow, rem, slack = graph.edge_x, graph.flow, graph.rem, graph.slack
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


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
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


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _cancel_cycles(graph, search, num_nodes, num_free, num_edges, eps):
    """Shift flow around every cycle of the edges that carry flow until they form a forest.

    Around a cycle (expert and GPU nodes alternate) flow goes up on every other edge and down on
    the others, so no expert's or GPU's total changes; it moves until an edge empties. Edges join
    a forest one by one; an edge whose ends the forest already connects closes a cycle with the
    forest path between them, and emptying one edge of that cycle keeps the rest a forest.

    Args:
        graph: a :class:`FlowGraph` (``flow`` changes); search: a :class:`FlowSearch` (scratch);
        num_nodes: ``free experts + touched GPUs``; num_free; num_edges; eps: float.
    """
    edge_x, edge_g, flow = graph.edge_x, graph.edge_g, graph.flow
    root, in_forest, adj_start, adj_edges = search.root, search.in_forest, search.adj_start, search.adj_edges
    queue, parent = search.queue, search.parent
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


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _share_tables(num_experts, num_slots, num_gpus):
    """Fresh :class:`SlotTables`, :class:`FlowGraph` and :class:`FlowSearch` for layers of
    ``num_experts`` experts on ``num_slots`` slots of ``num_gpus`` GPUs."""
    tables = SlotTables(np.zeros(num_experts, np.int64), np.empty(num_experts, np.int64),
                        np.zeros(num_experts, np.bool_), np.zeros(num_gpus), np.zeros(num_experts + 1, np.int64),
                        np.empty(num_slots, np.int64), np.zeros(num_experts, np.int64))
    graph = FlowGraph(np.empty(num_experts, np.int64), np.empty(num_experts), np.empty(num_gpus, np.int64),
                      np.empty(num_gpus, np.int64), np.empty(num_gpus, np.int64), np.empty(num_gpus, np.int64),
                      np.empty(num_slots, np.int64), np.empty(num_slots, np.int64), np.empty(num_slots, np.int64),
                      np.empty(num_slots), np.empty(num_experts + 1, np.int64), np.zeros(num_gpus + 1, np.int64),
                      np.empty(num_slots, np.int64), np.empty(num_gpus, np.int64), np.empty(num_experts),
                      np.empty(num_gpus))
    num_nodes_max = num_experts + num_gpus
    search = FlowSearch(np.empty(num_nodes_max, np.int64), np.empty(num_nodes_max, np.int64),
                        np.zeros(num_nodes_max, np.int64), np.empty(num_gpus, np.int64),
                        np.empty(num_nodes_max, np.int64), np.empty(num_slots, np.bool_),
                        np.empty(num_nodes_max + 1, np.int64), np.empty(2 * num_slots, np.int64))
    return tables, graph, search


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _fixed_loads(w, row, gpu_of_slot, tables):
    """Step 1: replicas per expert; experts on one GPU (or without tokens) are fixed load.

    Args:
        w: ``[E]`` float64 tokens; row: ``[S]`` int64 expert of each slot; gpu_of_slot: ``[S]``;
        tables: a :class:`SlotTables`, filled.
    Returns:
        ``eps``, float: ``1e-13`` of the layer's tokens.
    """
    count, first_gpu, free, fixed = tables.count, tables.first_gpu, tables.free, tables.fixed
    slot_start, slot_list, filled = tables.slot_start, tables.slot_list, tables.filled
    num_slots = row.shape[0]
    num_experts = w.shape[0]
    count[:] = 0
    first_gpu[:] = -1
    free[:] = False
    fixed[:] = 0.0
    total = 0.0
    for s in range(num_slots):
        e = row[s]
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
        e = row[s]
        if not free[e]:
            fixed[gpu_of_slot[s]] += w[e] / count[e]
    for e in range(num_experts):
        slot_start[e + 1] = slot_start[e] + count[e]
    filled[:] = 0
    for s in range(num_slots):
        e = row[s]
        slot_list[slot_start[e] + filled[e]] = s
        filled[e] += 1
    return eps


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _build_graph(w, gpu_of_slot, tables, graph):
    """Step 2: the bipartite graph: free experts ``x``, the GPUs they touch, one edge per (x, GPU).

    Args:
        w: ``[E]`` float64 tokens; gpu_of_slot: ``[S]``; tables: a filled :class:`SlotTables`;
        graph: a :class:`FlowGraph`, filled (flow 0 on every edge).
    Returns:
        ``(num_free, num_touched, num_edges)``; with no free expert ``(0, 0, 0)`` and only
        ``graph.experts`` and ``graph.free_weight`` are written.
    """
    free, slot_start, slot_list = tables.free, tables.slot_start, tables.slot_list
    experts, free_weight, gpus, gid = graph.experts, graph.free_weight, graph.gpus, graph.gid
    seen_by, edge_at, edge_x, edge_g = graph.seen_by, graph.edge_at, graph.edge_x, graph.edge_g
    edge_slots, flow, x_start = graph.edge_slots, graph.flow, graph.x_start
    g_start, g_edges, g_fill = graph.g_start, graph.g_edges, graph.g_fill
    num_free = 0
    for e in range(w.shape[0]):
        if free[e]:
            experts[num_free] = e
            free_weight[num_free] = w[e]
            num_free += 1
    if num_free == 0:
        return 0, 0, 0
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
    return num_free, num_touched, num_edges


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _start_flow(fixed, graph, num_free, num_touched, eps):
    """Steps 3 and 4: the target peak starts at the lower bound of ``X = all free experts`` (or the
    largest fixed load); whole experts, heaviest first, go to the GPU whose room fits best.

    Args:
        fixed: ``[G]`` float64 fixed loads; graph: a built :class:`FlowGraph` (``flow``, ``rem`` and
        ``slack`` are written); num_free, num_touched: as :func:`_build_graph` returns; eps: float.
    Returns:
        the target peak, float.
    """
    free_weight, gpus, rem, slack = graph.free_weight, graph.gpus, graph.rem, graph.slack
    x_start, edge_g, flow = graph.x_start, graph.edge_g, graph.flow
    target = 0.0
    for g in range(fixed.shape[0]):
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
    order = stable_argsort(-free_weight[:num_free])
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
    return target


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _raise_peak(fixed, graph, search, num_free, num_touched, target, stamp, eps):
    """Step 5: Newton on the peak: max flow, then raise the peak to the ratio of the min cut's experts.

    Args:
        fixed: ``[G]`` float64 fixed loads; graph: a started :class:`FlowGraph` (flow changes);
        search: a :class:`FlowSearch`; num_free, num_touched; target: float, the peak so far;
        stamp: int, the last search mark used; eps: float.
    Returns:
        the last search mark used, int.
    """
    rem, slack, free_weight, gpus = graph.rem, graph.slack, graph.free_weight, graph.gpus
    mark, ends = search.mark, search.ends
    for _ in range(2 * (num_free + num_touched) + 8):
        while True:
            stamp += 1
            found = _find_paths(graph, search, stamp, num_free, eps)
            if found == 0:
                break
            for i in range(found):
                _augment(ends[i], search.parent, num_free, graph.edge_x, graph.edge_g, graph.flow, rem, slack)
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
    return stamp


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _layer_shares(w, row, gpu_of_slot, tables, graph, num_free, shares, loads):
    """Step 7: shares: flow over an expert's placed tokens, split evenly among its slots on one GPU.

    Args:
        w: ``[E]`` float64 tokens; row: ``[S]`` int64 expert of each slot; gpu_of_slot: ``[S]``;
        tables: :class:`SlotTables`; graph: :class:`FlowGraph` with its final flow (``num_free``
        free experts, 0 for none); shares: ``[S]`` float64, written; loads: ``[G]`` float64 scratch.
    Returns:
        the layer's max GPU load, float.
    """
    count, free, slot_start, slot_list = tables.count, tables.free, tables.slot_start, tables.slot_list
    experts, x_start, flow, edge_at = graph.experts, graph.x_start, graph.flow, graph.edge_at
    gpus, edge_g, edge_slots = graph.gpus, graph.edge_g, graph.edge_slots
    num_slots = row.shape[0]
    for s in range(num_slots):
        e = row[s]
        if not free[e]:
            shares[s] = 1.0 / count[e]
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
            shares[s] = flow[k] / placed / edge_slots[k] if placed > 0.0 else 1.0 / count[e]
    loads[:] = 0.0
    for s in range(num_slots):
        loads[gpu_of_slot[s]] += w[row[s]] * shares[s]
    top = 0.0
    for g in range(loads.shape[0]):
        top = max(top, loads[g])
    return top


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
    tables, graph, search = _share_tables(num_experts, num_slots, num_gpus)
    loads = np.empty(num_gpus)
    stamp = 0
    for layer in range(num_layers):
        w = weights[layer]
        row = phy2log[layer]
        eps = _fixed_loads(w, row, gpu_of_slot, tables)
        num_free, num_touched, num_edges = _build_graph(w, gpu_of_slot, tables, graph)
        if num_free == 0:
            for s in range(num_slots):
                shares[layer, s] = 1.0 / tables.count[phy2log[layer, s]]
            top = 0.0
            for g in range(num_gpus):
                top = max(top, tables.fixed[g])
            peak[layer] = top
            continue
        target = _start_flow(tables.fixed, graph, num_free, num_touched, eps)
        stamp = _raise_peak(tables.fixed, graph, search, num_free, num_touched, target, stamp, eps)
        # 6. cancel cycles: a forest of split experts
        _cancel_cycles(graph, search, num_free + num_touched, num_free, num_edges, eps)
        peak[layer] = _layer_shares(w, row, gpu_of_slot, tables, graph, num_free, shares[layer], loads)
    return shares, peak
