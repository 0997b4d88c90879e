"""Kernels that assign expert groups to nodes (hierarchical placement).

A node ``n`` with ``slots[n]`` slots on ``active[n]`` GPUs can only reach a max GPU load ``<= T``
if the groups it holds satisfy two necessary conditions:

- load: ``sum of their loads <= T * active[n]``;
- replicas: ``sum over their experts of max(1, ceil(w_e / T)) <= slots[n]`` (a replica carries
  ``w_e / r_e``, so each expert needs that many replicas to keep every replica ``<= T``);
- hot expert: if an expert ``h`` of the node has ``w_h > (active[n] - 1) T``, every GPU of the node
  holds a replica of it (a GPU without one leaves its ``r_h`` replicas to ``active[n] - 1`` GPUs,
  one of which then carries ``>= w_h / (active[n] - 1) > T``), so ``r_h >= active[n]`` and every
  other expert's replicas sit beside one of load ``w_h / r_h``: some ``r_h`` with
  ``ceil(r_h / active[n]) w_h / r_h <= T`` (the GPU holding the most of them) must satisfy
  ``r_h + sum over the other experts of max(1, ceil(w_e / (T - w_h / r_h))) <= slots[n]``.
  Adding groups to a node only adds terms, so a node that fails stays failed.

With ``strong`` (the bound), every node of a complete assignment must also pass the hot-room
condition (:func:`eplb.kernels.bounds.hot_room.hot_room_fits`: the node's other experts fit beside its
heaviest expert's replicas or on its GPUs without one), after a first bisection without it.

A depth-first search over group -> node assignments (heaviest group first, nodes tried from the
least loaded, identical empty nodes tried once) decides whether some assignment meets them for
every node; a binary search on ``T`` finds the smallest such ``T``. When the search is exhaustive,
a ``T`` with no assignment is a proven lower bound on the max load of every hierarchical
placement; the assignment found at the smallest feasible ``T`` is the one used.
"""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, fewest_replicas, shell_sort, stable_argsort
from .hot_room import HotRoomScratch, hot_room_fits

GroupTable = namedtuple("GroupTable", ["weights", "size", "load", "need", "heaviest"])
GroupTable.__doc__ = """One layer's expert groups: ``weights [E]`` float64 the experts' loads (group ``k``
holds experts ``k * size ... (k + 1) * size - 1``), ``size`` experts per group (int64), ``load [K]``
float64 each group's load, ``need [K]`` int64 the replicas each needs at the target, ``heaviest [K]``
float64 each group's heaviest expert."""

NodeTable = namedtuple("NodeTable", ["slots", "active", "kind", "min_slots", "max_slots"])
NodeTable.__doc__ = """The nodes, ``[N]`` int64 each: ``slots``, ``active`` GPUs, ``kind`` (equal for
interchangeable nodes), ``min_slots`` / ``max_slots`` (fewest / most slots of an active GPU)."""

# status codes of _search
FEASIBLE = 1
INFEASIBLE = 0
UNDECIDED = -1


@njit(cache=True, nogil=True, error_model="numpy")
def _copy(src, dst):
    """``dst[:] = src`` for two ``[n]`` int64 arrays, element by element: a slice assignment from an
    array compiles Numba's shape-mismatch error message (string formatting), a second or more of
    first-call compile time."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, nogil=True, error_model="numpy")
def _replicas_needed(weights, group_size, num_groups, target, need):
    """``need [K]``: replicas each group needs so that every replica carries ``<= target``."""
    for k in range(num_groups):
        total = 0
        for j in range(group_size):
            w = weights[k * group_size + j]
            if target > 0.0 and w > target:
                total += fewest_replicas(w, target)  # guarded against rounding
            else:
                total += 1
        need[k] = total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _hot_expert_fits(groups, order, chosen, depth, group, node, active, slots, target):
    """The hot-expert condition for ``node`` holding the groups ``order[i]`` (``i < depth``,
    ``chosen[i] == node``) and ``group`` (module docstring); ``groups`` a :class:`GroupTable`.
    Returns False only when no placement of those groups on the node's ``active`` GPUs and
    ``slots`` slots keeps every GPU ``<= target``."""
    weights, group_size, group_max = groups.weights, groups.size, groups.heaviest
    if active < 2:
        return True
    tol = target * (1.0 + 1e-12)
    hot_group = group
    held = 1
    for i in range(depth):
        if chosen[i] == node:
            held += 1
            if group_max[order[i]] > group_max[hot_group]:
                hot_group = order[i]
    hot_load = group_max[hot_group]
    if hot_load <= (active - 1) * tol:
        return True
    hot = hot_group * group_size
    for j in range(group_size):
        if weights[hot_group * group_size + j] == hot_load:
            hot = hot_group * group_size + j
            break
    num_experts = held * group_size
    for r in range(active, slots - num_experts + 2):
        if ((r + active - 1) // active) * (hot_load / r) > tol:
            continue  # some GPU holds ceil(r / active) replicas of the hot expert
        room = tol - hot_load / r  # what every GPU has left beside its replica of the hot expert
        if room <= 0.0:
            continue
        total = r
        for i in range(depth + 1):
            q = group if i == depth else order[i]
            if i < depth and chosen[i] != node:
                continue
            for j in range(group_size):
                e = q * group_size + j
                if e == hot:
                    continue
                total += 1 if weights[e] <= room else fewest_replicas(weights[e], room)
            if total > slots:
                break
        if total <= slots:
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _nodes_fit(target, order, chosen, held, groups, nodes, memo, scratch):
    """Whether every node holding groups (``chosen[i]``: node of group ``order[i]``) passes
    :func:`eplb.kernels.bounds.hot_room.hot_room_fits` at ``target``; ``groups`` a :class:`GroupTable`,
    ``nodes`` a :class:`NodeTable`; ``memo [kinds, 2^K]`` int8 remembers, for each kind of node,
    whether a set of groups fits it (``[1, 1]`` when ``K > 16``: no memo); ``scratch [6, E + 1]``
    float64 work space."""
    weights, group_size = groups.weights, groups.size
    node_slots, node_active, node_min, node_max = nodes.slots, nodes.active, nodes.min_slots, nodes.max_slots
    num_groups = order.shape[0]
    loads = scratch[0]
    hot_room_scratch = HotRoomScratch(scratch[1], scratch[2], scratch[3], scratch[4], scratch[5])
    for n in range(node_slots.shape[0]):
        if held[n] == 0:
            continue
        mask = 0
        for i in range(num_groups):
            if chosen[i] == n:
                mask |= 1 << order[i]
        kind = nodes.kind[n]
        if memo.shape[1] > 1 and memo[kind, mask] != 0:
            if memo[kind, mask] < 0:
                return False
            continue
        count = np.int64(0)  # typed: a literal 0 would compile the hot-room callee a second time
        for i in range(num_groups):
            if chosen[i] == n:
                for j in range(group_size):
                    loads[count] = weights[order[i] * group_size + j]
                    count += 1
        shell_sort(loads[:count])
        for j in range(count // 2):  # decreasing
            loads[j], loads[count - 1 - j] = loads[count - 1 - j], loads[j]
        fits = hot_room_fits(loads, count, target, node_active[n], node_slots[n], node_min[n], node_max[n],
                             hot_room_scratch)
        if memo.shape[1] > 1:
            memo[kind, mask] = 1 if fits else -1
        if not fits:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def _put_on(t, n, order, chosen, group_load, need, load, used, held):
    """Put the group of search depth ``t`` on node ``n`` (its load, replica needs and count);
    returns 1 if that node held no group before, else 0."""
    g = order[t]
    was_empty = 1 if held[n] == 0 else 0
    load[n] += group_load[g]
    used[n] += need[g]
    held[n] += 1
    chosen[t] = n
    return was_empty


@njit(cache=True, nogil=True, error_model="numpy")
def _take_off(t, order, chosen, group_load, need, load, used, held):
    """Take the group placed at search depth ``t`` off its node (its load, replica needs and count);
    returns 1 if that node holds no group now, else 0."""
    g = order[t]
    n = chosen[t]
    load[n] -= group_load[g]
    used[n] -= need[g]
    held[n] -= 1
    return 1 if held[n] == 0 else 0


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _hot_possible(group_max, node_active, target):
    """Whether the hot-expert condition can bind at ``target``: some group's heaviest expert
    (``group_max [K]``) exceeds ``(active - 1) * target`` on a node with two or more active GPUs
    (``node_active [N]``)."""
    heaviest = 0.0
    for k in range(group_max.shape[0]):
        heaviest = max(heaviest, group_max[k])
    hot_possible = False
    for n in range(node_active.shape[0]):
        if node_active[n] >= 2 and heaviest > (node_active[n] - 1) * target * (1.0 + 1e-12):
            hot_possible = True
    return hot_possible


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _nodes_with_slots(node_slots):
    """How many nodes of ``node_slots [N]`` have slots."""
    count = 0
    for n in range(node_slots.shape[0]):
        if node_slots[n] > 0:
            count += 1
    return count


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _like_empty_node_before(n, held, node_kind, node_slots):
    """Whether an empty node before ``n`` (``held [N]`` groups each) has slots (``node_slots [N]``) and
    ``n``'s kind (``node_kind [N]``): trying the empty node ``n`` too would repeat that search."""
    for n2 in range(n):
        if held[n2] == 0 and node_kind[n2] == node_kind[n] and node_slots[n2] > 0:
            return True
    return False


def _searcher(hot_room, name):
    """The kernel ``name`` (:func:`_search`); with ``hot_room`` False (a constant of the kernel, its
    branch pruned before typing) it never checks :func:`_nodes_fit`, whatever ``strong`` says, and
    does not compile it and its callees (the placement's assignment, the default path, is weak)."""

    def search(target, order, groups, nodes, budget, assign, strong, memo, scratch):
        """Depth-first search for a group -> node assignment meeting both conditions at ``target``.

        Args:
            order: ``[K]`` int64 groups in the order they are assigned (heaviest first).
            groups: a :class:`GroupTable` (the layer's loads, group loads, replicas each group needs,
                heaviest expert of each group).
            nodes: a :class:`NodeTable` (slots, active GPUs, kinds; fewest / most slots of an active GPU).
            budget: most search steps; assign: ``[K]`` int64 output, node of each group when feasible.
            strong: also require every node of a complete assignment to pass
                :func:`eplb.kernels.bounds.hot_room.hot_room_fits`; checked on complete assignments only, where a
                node's experts are known (the condition need not hold for a part of them). memo:
                ``[kinds, 2^K]`` int8 scratch (``[1, 1]``: no memo); scratch: ``[6, E + 1]`` float64 work space.
        Returns:
            FEASIBLE, INFEASIBLE (proven: no assignment exists) or UNDECIDED (budget ran out).
        """
        group_load, need, group_max = groups.load, groups.need, groups.heaviest
        node_slots, node_active, node_class = nodes.slots, nodes.active, nodes.kind
        num_groups = order.shape[0]
        num_nodes = node_slots.shape[0]
        load = np.zeros(num_nodes)
        used = np.zeros(num_nodes, np.int64)
        held = np.zeros(num_nodes, np.int64)
        cand = np.empty((num_groups, num_nodes), np.int64)
        key = np.empty(num_nodes)
        ncand = np.zeros(num_groups, np.int64)
        pos = np.zeros(num_groups, np.int64)
        chosen = np.empty(num_groups, np.int64)
        empty_nodes = _nodes_with_slots(node_slots)
        hot_possible = _hot_possible(group_max, node_active, target)
        if hot_room and strong:  # the nodes' expert sets checked at this target: 1 fits, -1 does not, 0 unknown
            memo[:] = 0
        t = np.int64(0)  # typed, like count above
        steps = 0
        building = True
        while True:
            if building:
                if t == num_groups:
                    if hot_room and strong and not _nodes_fit(target, order, chosen, held, groups, nodes, memo, scratch):
                        t -= 1  # a dead end: undo the last group and try its next node
                        empty_nodes += _take_off(t, order, chosen, group_load, need, load, used, held)
                        building = False
                        continue
                    for i in range(num_groups):
                        assign[order[i]] = chosen[i]
                    return FEASIBLE
                g = order[t]
                m = 0
                for n in range(num_nodes):
                    if node_slots[n] == 0 or used[n] + need[g] > node_slots[n]:
                        continue
                    if load[n] + group_load[g] > target * node_active[n] * (1.0 + 1e-12):
                        continue
                    if hot_possible and not _hot_expert_fits(groups, order, chosen, t, g, n, node_active[n], node_slots[n],
                                                             target):
                        continue
                    if held[n] == 0:
                        if _like_empty_node_before(n, held, node_class, node_slots):
                            continue  # the same search as from that node
                        if empty_nodes - 1 > num_groups - t - 1:
                            continue
                    elif empty_nodes > num_groups - t - 1:
                        continue
                    # insertion sort by the node's load per GPU after taking the group
                    value = (load[n] + group_load[g]) / node_active[n]
                    i = m
                    while i > 0 and key[cand[t, i - 1]] > value:
                        cand[t, i] = cand[t, i - 1]
                        i -= 1
                    cand[t, i] = n
                    key[n] = value
                    m += 1
                ncand[t] = m
                pos[t] = 0
                building = False
            if pos[t] < ncand[t]:
                steps += 1
                if steps > budget:
                    return UNDECIDED
                n = cand[t, pos[t]]
                pos[t] += 1
                empty_nodes -= _put_on(t, n, order, chosen, group_load, need, load, used, held)
                t += 1
                building = True
            else:
                t -= 1
                if t < 0:
                    return INFEASIBLE
                empty_nodes += _take_off(t, order, chosen, group_load, need, load, used, held)

    search.__name__ = search.__qualname__ = name  # its own cache file
    return njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)(search)


_search = _searcher(False, "_search")
_search_strong = _searcher(True, "_search_strong")


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _group_loads(w, group_size, group_load, group_max):
    """Write each group's load to ``group_load [K]`` and its heaviest expert's to ``group_max [K]``
    (``w [E]`` float64, ``group_size`` experts a group). Returns the layer's total load."""
    total = 0.0
    for k in range(group_load.shape[0]):
        s = 0.0
        top = 0.0
        for j in range(group_size):
            s += w[k * group_size + j]
            top = max(top, w[k * group_size + j])
        group_load[k] = s
        group_max[k] = top
        total += s
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _upper_end(w, node_of_group, group_load, node_active):
    """A max load the bisection can start from above: the heaviest load per GPU of a node under the
    assignment ``node_of_group [K]`` int64 (``group_load [K]``, ``node_active [N]``), or the heaviest
    expert of ``w [E]`` when larger."""
    hi = 0.0
    for n in range(node_active.shape[0]):
        s = 0.0
        for k in range(group_load.shape[0]):
            if node_of_group[k] == n:
                s += group_load[k]
        if node_active[n] > 0:
            hi = max(hi, s / node_active[n])
    heaviest = w[0]  # w.max() (a NaN wins, as NumPy), as a loop: shorter to compile
    for e in range(1, w.shape[0]):
        if heaviest != heaviest:
            break
        if w[e] > heaviest or w[e] != w[e]:
            heaviest = w[e]
    return max(hi, heaviest)


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _load_assignment(node_of_group, order, chosen, held):
    """The search's view of the assignment ``node_of_group [K]`` int64: ``chosen [K]`` the node of each
    group of ``order [K]``, ``held [N]`` the groups on each node."""
    for i in range(order.shape[0]):
        chosen[i] = node_of_group[order[i]]
    held[:] = 0
    for k in range(node_of_group.shape[0]):
        held[node_of_group[k]] += 1


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _new_memo(node_kind, num_groups, strong):
    """The search's memo (:func:`_nodes_fit`): ``[kinds, 2^K]`` int8 zeros, one row a kind of node
    (``node_kind [N]`` int64), when ``strong`` and ``K <= 16``, else ``[1, 1]`` (no memo). A set of groups
    fits one kind of node or not: nodes of another kind have other slots."""
    num_kinds = 1
    for n in range(node_kind.shape[0]):
        num_kinds = max(num_kinds, node_kind[n] + 1)
    return np.zeros((num_kinds, 1 << num_groups) if strong and num_groups <= 16 else (1, 1), np.int8)


def _assigner(hot_room, name):
    """The kernel ``name`` (:func:`assign_groups`); with ``hot_room`` False (a constant of the kernel)
    it ignores ``strong`` and compiles neither :func:`_nodes_fit` nor :func:`_search_strong`."""

    def assign(weights, num_groups, nodes, lower, budget, rel_tol, node_of_group, strong):
        """Assign the groups of every layer to nodes, minimising the smallest ``T`` both conditions allow.

        Args:
            weights: ``[L, E]`` float64; experts ``k*E/K ... (k+1)*E/K - 1`` form group ``k``.
            nodes: a :class:`NodeTable`, ``[N]`` int64 arrays (``min_slots`` and ``max_slots`` serve the
                bound, with ``strong``; the placement's assignment does not read them).
            lower: ``[L]`` float64 valid lower bounds on the max load to start the search from.
            budget: most search steps per feasibility test; rel_tol: relative precision of ``T``.
            node_of_group: ``[L, K]`` int64 output.
            strong: see :func:`_search`.
        Returns:
            ``[L]`` float64: the largest ``T`` proven infeasible for every assignment (a lower bound on
            the max load of every hierarchical placement), or ``lower`` where nothing was proven.
        """
        num_layers, num_experts = weights.shape
        group_size = num_experts // num_groups
        num_nodes = nodes.slots.shape[0]
        proven = lower.copy()
        group_load = np.empty(num_groups)
        group_max = np.empty(num_groups)
        need = np.empty(num_groups, np.int64)
        assign = np.empty(num_groups, np.int64)
        best = np.empty(num_groups, np.int64)
        chosen = np.empty(num_groups, np.int64)
        held = np.zeros(num_nodes, np.int64)
        no_memo = np.zeros((1, 1), np.int8)
        scratch = np.empty((6, num_experts + 1))  # _nodes_fit's work space, allocated once
        memo = _new_memo(nodes.kind, num_groups, strong)
        unchecked = num_nodes < 0  # False as a run-time bool (a literal False would compile _search twice)
        for layer in range(num_layers):
            w = weights[layer]
            total = _group_loads(w, group_size, group_load, group_max)
            order = stable_argsort(-group_load)
            groups = GroupTable(w, group_size, group_load, need, group_max)
            # a feasible start: capacity only (T = infinity)
            _replicas_needed(w, group_size, num_groups, 0.0, need)
            if hot_room:
                status = _search_strong(np.inf, order, groups, nodes, budget, best, unchecked, memo, scratch)
            else:
                status = _search(np.inf, order, groups, nodes, budget, best, unchecked, memo, scratch)
            if status != FEASIBLE:
                node_of_group[layer, :] = -1  # no assignment fits the slots (the caller raises)
                continue
            if total <= 0.0:
                _copy(best, node_of_group[layer])
                continue
            lo = lower[layer]
            hi = _upper_end(w, best, group_load, nodes.active)  # the loads of the capacity-only assignment
            if hi < lo:
                hi = lo
            # the bisection without, then (strong, where the assignment found fails it) with the hot-room condition
            for phase in range(2):
                checked = phase == 1
                if checked:
                    _load_assignment(best, order, chosen, held)
                    if not hot_room or not strong or _nodes_fit(hi, order, chosen, held, groups, nodes, no_memo,
                                                                 scratch):
                        break
                    lo = max(lo, proven[layer])
                # check the upper end holds the conditions; raise it until it does
                for _ in range(64):
                    _replicas_needed(w, group_size, num_groups, hi, need)
                    if hot_room:
                        status = _search_strong(hi, order, groups, nodes, budget, assign, checked, memo, scratch)
                    else:
                        status = _search(hi, order, groups, nodes, budget, assign, checked, memo, scratch)
                    if status == FEASIBLE:
                        if not checked:
                            _copy(assign, best)
                        break
                    if checked:
                        lo = max(lo, hi)
                    hi *= 2.0
                while hi - lo > rel_tol * hi:
                    mid = 0.5 * (lo + hi)
                    if not lo < mid < hi:  # adjacent floats (denormal loads): no midpoint left
                        break
                    _replicas_needed(w, group_size, num_groups, mid, need)
                    if hot_room:
                        status = _search_strong(mid, order, groups, nodes, budget, assign, checked, memo, scratch)
                    else:
                        status = _search(mid, order, groups, nodes, budget, assign, checked, memo, scratch)
                    if status == FEASIBLE:
                        hi = mid
                        if not checked:  # the placement's assignment: the conditions without the hot-room one
                            _copy(assign, best)
                    else:
                        if status == INFEASIBLE and mid > proven[layer]:
                            proven[layer] = mid
                        lo = mid
            _copy(best, node_of_group[layer])
        return proven

    assign.__name__ = assign.__qualname__ = name  # its own cache file
    return njit(cache=True, nogil=True, error_model="numpy")(assign)


_assign_groups = _assigner(False, "_assign_groups")
_assign_groups_strong = _assigner(True, "_assign_groups_strong")


def assign_groups(weights, num_groups, nodes, lower, budget, rel_tol, node_of_group, strong):
    """Assign the groups of every layer to nodes (:func:`_assigner`'s kernel, the one ``strong``
    needs: the placement's assignment compiles no hot-room check); ``nodes`` a :class:`NodeTable`."""
    kernel = _assign_groups_strong if strong else _assign_groups
    return kernel(weights, num_groups, nodes, lower, budget, rel_tol, node_of_group, bool(strong))


@njit(cache=True, nogil=True, error_model="numpy")
def _lightest_sum(asc, count, skip):
    """Sum of the ``count`` smallest of ``asc [K]`` (increasing) after the first ``skip``: the
    lightest groups that are not among the ``skip`` lightest already counted."""
    total = 0.0
    for i in range(skip, min(asc.shape[0], skip + max(count, 0))):
        total += asc[i]
    return total


@njit(cache=True, nogil=True, error_model="numpy")
def node_load_bound(weights, num_groups, node_slots, node_active):
    """A bound on the max GPU load of every placement that keeps each group on one node, from the
    node loads alone, for every number of groups and nodes (the exhaustive search in
    :func:`assign_groups` gives up on many groups).

    Group ``k`` (experts ``k E/K ... (k+1) E/K - 1``, ``s = E / K`` of them) loads its node with
    ``p_k``; with ``p_1 >= p_2 >= ... >= p_K``. A node with ``slots[n]`` slots holds at most
    ``c_n = floor(slots[n] / s)`` groups and, as every slot holds an expert of one of its groups,
    at least one; with ``m`` nodes holding slots, each node holds at least
    ``a = max(1, K - (sum c - min c))`` groups. A node of load ``P`` on ``active[n]`` GPUs has a
    GPU of load ``>= P / A`` (``A``: most active GPUs of a node). Some node carries at least:

    - pigeonhole: ``t + 1`` of the ``t m + 1`` heaviest groups (the lightest ``t + 1`` of them)
      and ``a - t - 1`` more (the lightest others);
    - heavy and light, for each ``i``: either the ``i`` heaviest groups sit on ``i`` distinct
      nodes, each of which holds ``a - 1`` groups from outside them, so some node holds
      ``p_i`` + the heaviest of those ``i (a - 1)`` partners (at least ``p_{K - i(a-1) + 1}``) +
      ``a - 2`` light groups, and the mean of those nodes is at least their total over ``i``; or
      two of them share a node: ``p_{i-1} + p_i`` + ``a - 2`` light groups. With two groups per
      node (``K = 2m``) this is ``max_i p_i + p_{K+1-i}``, the optimal pairing.

    Args:
        weights: ``[L, E]`` float64, ``E`` a multiple of ``num_groups``.
        node_slots, node_active: ``[N]`` int64 slots and GPUs with slots of each node.
    Returns:
        ``[L]`` float64 (0 where the layer carries no load), shaded down by 1e-12 for the sums' rounding.
    """
    num_layers, num_experts = weights.shape
    out = np.zeros(num_layers)
    size = num_experts // num_groups
    num_nodes = 0
    sum_c = 0
    min_c = num_groups
    most_active = 1
    for n in range(node_slots.shape[0]):
        if node_slots[n] > 0 and node_active[n] > 0:
            c = min(node_slots[n] // size, num_groups)
            num_nodes += 1
            sum_c += c
            min_c = min(min_c, c)
            most_active = max(most_active, node_active[n])
    if num_nodes == 0 or size == 0:
        return out
    least = max(1, num_groups - (sum_c - min_c))
    asc = np.empty(num_groups)
    for layer in range(num_layers):
        for k in range(num_groups):
            total = 0.0
            for j in range(size):
                total += weights[layer, k * size + j]
            asc[k] = total
        shell_sort(asc)
        if asc[num_groups - 1] <= 0.0:
            continue
        best = 0.0
        # pigeonhole: some node holds t + 1 of the t m + 1 heaviest groups
        t = 1
        while t * num_nodes + 1 <= num_groups:
            top = t * num_nodes + 1
            value = 0.0
            for r in range(top - t, top + 1):  # ranks top - t .. top (1-based, decreasing loads)
                value += asc[num_groups - r]
            value += _lightest_sum(asc, least - t - 1, 0) if num_groups - top >= least - t - 1 else 0.0
            best = max(best, value)
            t += 1
        # heavy and light
        for i in range(1, num_groups + 1):
            p_i = asc[num_groups - i]
            outside = num_groups - i  # groups lighter than the i heaviest
            spread = np.inf  # the i heaviest on i distinct nodes
            if i <= num_nodes:
                partners = i * (least - 1)
                if partners <= outside:
                    spread = p_i
                    if partners > 0:
                        # the heaviest partner: at least the partners-th lightest outside group
                        spread += asc[partners - 1] + _lightest_sum(asc, least - 2, 0)
                    heavy = 0.0
                    for r in range(1, i + 1):
                        heavy += asc[num_groups - r]
                    spread = max(spread, (heavy + _lightest_sum(asc, partners, 0)) / i)
            shared = np.inf  # two of them on one node
            if i >= 2:
                shared = asc[num_groups - i + 1] + p_i
                if least - 2 > 0 and outside >= least - 2:
                    shared += _lightest_sum(asc, least - 2, 0)
            value = min(spread, shared)
            if value < np.inf:
                best = max(best, value)
        out[layer] = best / most_active * (1.0 - 1e-12)
    return out
