"""Locality-aware hierarchical placement: trade a capped share of off-node tokens for balance.

Hierarchical placement (the published rule, ``num_groups % num_nodes == 0``) keeps every expert
group on one node, so no token crosses nodes; on skewed traffic one node then carries far more
than the others while their GPUs idle. Here each group keeps a *home node* and its experts keep at
least one replica there, but a hot expert may also get replicas on other nodes, serving a planned
share of its tokens there, as long as at most a fraction ``max_off_node`` of each layer's tokens is
served off its home node (under the shares the plan returns).

Per layer:

1. the hierarchical plan of ``method`` gives the home node of every group (``max_off_node=0`` is
   exactly that plan);
2. a per-GPU target ``tau`` is the smallest for which the nodes' load above ``tau`` x their GPUs
   fits the cap; each node above its target hands tokens of its heaviest experts (at most
   :data:`MAX_PIECE` of an expert) to the nodes below theirs, one *piece* per (expert, node), each
   piece taking one of the receiving node's redundant slots;
3. every node is then planned as a global placement of its *items* (its experts with the tokens
   they keep, and the pieces it receives) on its own GPUs with ``method``; a slot's share is its
   item's tokens over its expert's tokens, split evenly over the item's replicas;
4. beside it, the global plan's replicas by node (:func:`_replica_plans`): the global plan of
   ``method`` gives every expert's replica count; each node holds one replica of each of its
   experts and as many of their others as its slots take, the rest (the lightest) go to nodes
   with free slots, the nodes' tokens are balanced by exchanging replicas, every node is packed,
   and slots are then exchanged across nodes while that lowers the heaviest GPU within the cap
   (once keeping a replica of every expert at home, once letting an expert's last replica leave).
   With few slots per GPU (2 to 4 on a rack of 36 or 72 GPUs) this is what spends the budget:
   step 2 balances the nodes' tokens only, and a hot expert's piece on one slot of a receiving
   node (up to twice a GPU's mean load at 2 slots a GPU) takes the slot that node's own hot
   experts needed, so the node plan came out worse than keeping every group home (``bench/rack_nodes.py``);
5. the layer keeps whichever is lightest (max GPU load under its shares) of those plans, the
   hierarchical plan and the global plan of ``method``, among those within the cap (within
   :data:`TIE` of the lightest, the fewest off-node tokens).

Engines that split an expert's tokens uniformly over its replicas do not realise the shares: for
them the placement still holds, but the balance and the off-node share differ (see the README).
"""

from __future__ import annotations

import numpy as np

from ..analysis.bounds import average_bound, replica_bound, strongest_bound
from ..analysis.dispatch import optimal_dispatch
from ..kernels.plumbing.layout import replica_counts
from ..kernels.search.off_node import exchange_descent, off_node_pieces, replica_nodes
from ..kernels.search.pack_descend import place_node_counts
from .methods import get_method
from ..analysis.searches import group_assignment
from ..analysis.loads import gpu_loads, slot_loads
from ..analysis.placement import uniform_shares
from ..model.deployment import Deployment
from ..model.topology import Topology

TIE = 1e-3
"""Plans whose max loads differ by less than this (relative) count as equally light."""

REPLAN = 0.01
"""Layers whose node plan is this much above :func:`node_cap_bound` are also planned hierarchically
(a safety net: the node plan is then compared with the plan without off-node tokens)."""

GLOBAL_FROM = 0.5
"""Caps from which the global plan is a candidate (it serves most tokens off their home node)."""

MAX_STEPS = 4096
"""Most swaps per layer and node of the descent that packs the global plan's replicas node by node."""

MAX_PIECE = 0.75
"""Largest fraction of an expert's tokens moved off its home node (the rest stays home)."""


def even_shares(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, S]`` float64: the even split of ``phy2log [L, S]`` (:func:`eplb.analysis.placement.uniform_shares`)."""
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    return uniform_shares(phy2log, replica_counts(phy2log, num_experts))


def home_nodes(phy2log: np.ndarray, num_groups: int, num_experts: int, topology: Topology) -> np.ndarray:
    """``[L, K]`` int64: the node holding the first replica of each group's first expert."""
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    size = num_experts // num_groups
    first = np.argmax(phy2log[:, :, None] == np.arange(0, num_experts, size)[None, None, :], axis=1)
    return node_of_slot[first]


def busiest_nodes(weights: np.ndarray, phy2log: np.ndarray, shares: np.ndarray, num_groups: int,
                  topology: Topology) -> np.ndarray:
    """``[L, K]`` int64: the node serving most of each group's tokens (the home that keeps most at home)."""
    num_layers, num_experts = weights.shape
    size = num_experts // num_groups
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    served = np.zeros((num_layers, num_groups, topology.num_nodes))
    layer = np.repeat(np.arange(num_layers), phy2log.shape[1])
    np.add.at(served, (layer, (phy2log // size).ravel(), np.tile(node_of_slot, num_layers)),
              slot_loads(weights, phy2log, shares=shares).ravel())
    return served.argmax(axis=2)


def off_node_tokens(weights: np.ndarray, phy2log: np.ndarray, shares: np.ndarray, home_node: np.ndarray,
                    topology: Topology) -> np.ndarray:
    """``[..., L]``: tokens served by a replica outside its group's home node."""
    num_groups = home_node.shape[1]
    size = weights.shape[-1] // num_groups
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    home_of_slot = np.take_along_axis(home_node, phy2log // size, axis=1)
    away = node_of_slot[None, :] != home_of_slot
    return (slot_loads(weights, phy2log, shares=shares) * away).sum(axis=-1)


def _place_nodes(weights: np.ndarray, home: np.ndarray, pieces: tuple, deployment: Deployment, method: str,
                 options: dict) -> tuple[np.ndarray, np.ndarray]:
    """Plan every node's items as a global placement on its GPUs (step 3); ``[L, S]`` phy2log and shares.

    ``pieces``: ``(expert [L, P], node [L, P], tokens [L, P], count [L])`` from
    :func:`eplb.kernels.search.off_node.off_node_pieces`. A node's layers are planned in one call of the
    method when they have as many items; to make that so, a layer with fewer pieces than the node's
    most splits its heaviest items in two (an item split in two halves needs two replicas, which
    a heavy item gets anyway).
    """
    topology = deployment.topology
    num_layers, num_experts = weights.shape
    size = num_experts // deployment.num_groups
    piece_expert, piece_node, piece_tokens, piece_count = pieces
    expert_node = np.repeat(home, size, axis=1)
    kept = weights.copy()
    valid = np.arange(piece_expert.shape[1])[None, :] < piece_count[:, None]
    np.subtract.at(kept, (np.nonzero(valid)[0], piece_expert[valid]), piece_tokens[valid])
    np.maximum(kept, 0.0, out=kept)
    gpus_per_node = topology.gpus_per_node
    phy2log = np.empty((num_layers, topology.num_slots), np.int64)
    shares = np.empty((num_layers, topology.num_slots))
    solve = get_method(method)
    # a node is small: the default's replication retries (sized for a whole model) would cost more than they give
    node_options = {"num_starts": 1, **options} if method == "balanced" else options
    for node in range(topology.num_nodes):
        node_slots = topology.slots_per_gpu[node * gpus_per_node:(node + 1) * gpus_per_node]
        first, last = topology.slot_offsets[node * gpus_per_node], topology.slot_offsets[(node + 1) * gpus_per_node]
        if last == first:
            continue
        node_topology = Topology(node_slots.copy(), 1)
        incoming = valid & (piece_node == node)
        own_count = (expert_node == node).sum(axis=1)
        for count in np.unique(own_count):
            layers = np.flatnonzero(own_count == count)
            width = int(count + incoming[layers].sum(axis=1).max())
            ids = np.empty((layers.size, width), np.int64)
            tokens = np.empty((layers.size, width))
            for row, layer in enumerate(layers):
                own = np.flatnonzero(expert_node[layer] == node)
                ids_l = np.concatenate([own, piece_expert[layer, incoming[layer]]])
                tokens_l = np.concatenate([kept[layer, own], piece_tokens[layer, incoming[layer]]])
                used = ids_l.size
                ids[row, :used], tokens[row, :used] = ids_l, tokens_l
                for extra in range(used, width):  # split the heaviest item in two
                    heaviest = int(np.argmax(tokens[row, :extra]))
                    tokens[row, heaviest] *= 0.5
                    ids[row, extra], tokens[row, extra] = ids[row, heaviest], tokens[row, heaviest]
            local, _ = solve(tokens, Deployment(width, node_topology), **node_options)
            replicas = np.stack([np.bincount(r, minlength=width) for r in local])
            experts = np.take_along_axis(ids, local, axis=1)
            total = np.take_along_axis(weights[layers], experts, axis=1)
            item = np.take_along_axis(tokens, local, axis=1)
            phy2log[layers, first:last] = experts
            shares[layers, first:last] = (np.where(total > 0, item / np.where(total > 0, total, 1.0), 0.0)
                                          / np.take_along_axis(replicas, local, axis=1))
    # experts with no tokens: split evenly over their replicas
    idle = np.take_along_axis(weights, phy2log, axis=1) <= 0
    if idle.any():
        even = even_shares(phy2log, num_experts)
        shares[idle] = even[idle]
    _merge_duplicates(weights, phy2log, shares, topology)
    return phy2log, shares


def _merge_duplicates(weights: np.ndarray, phy2log: np.ndarray, shares: np.ndarray, topology: Topology) -> None:
    """In place: where a GPU holds two slots of one expert (two items of it, e.g. halves of a split
    item), merge them into one slot and give the freed slot a replica that takes load off the
    heaviest GPU of the node (half the difference at most, so the node's max load never rises).

    ``weights [L, E]``, ``phy2log [L, S]`` and ``shares [L, S]`` as in :func:`plan_locality`."""
    gpu_of_slot = topology.gpu_of_slot
    node_of_gpu = topology.node_of_gpu
    num_experts = weights.shape[1]
    key = gpu_of_slot[None, :] * num_experts + phy2log                      # [L, S] (GPU, expert)
    order = np.argsort(key, axis=1, kind="stable")
    repeated = np.diff(np.take_along_axis(key, order, axis=1), axis=1) == 0  # [L, S - 1]
    for layer, position in zip(*np.nonzero(repeated)):
        row, share, w = phy2log[layer], shares[layer], weights[layer]
        spare = order[layer, position + 1]
        gpu = gpu_of_slot[spare]
        # the slot kept: another slot of this GPU with the spare's expert (an earlier merge may have
        # given the slot paired with it another expert)
        keep = next(s for s in range(topology.slot_offsets[gpu], topology.slot_offsets[gpu + 1])
                    if s != spare and row[s] == row[spare])
        share[keep] += share[spare]
        loads = np.bincount(gpu_of_slot, weights=w[row] * share, minlength=topology.num_gpus)
        node_gpus = np.flatnonzero((node_of_gpu == node_of_gpu[gpu]) & (np.diff(topology.slot_offsets) > 0))
        here = row[gpu_of_slot == gpu]
        donor = node_gpus[np.argmax(loads[node_gpus])]
        candidates = [s for s in range(topology.slot_offsets[donor], topology.slot_offsets[donor + 1])
                      if row[s] not in here]
        if not candidates:  # no expert to take over there: any slot of the node whose expert this GPU lacks
            candidates = [s for s in np.flatnonzero(np.isin(gpu_of_slot, node_gpus)) if row[s] not in here]
        if not candidates:  # every expert of the node is on this GPU already: nothing better to hold
            share[keep] -= share[spare]
            continue
        source = max(candidates, key=lambda s: (w[row[s]] * share[s], -s))
        moved = max(0.0, min(w[row[source]] * share[source], 0.5 * (loads[gpu_of_slot[source]] - loads[gpu])))
        fraction = moved / w[row[source]] if w[row[source]] > 0 else 0.0
        row[spare] = row[source]
        share[spare] = fraction
        share[source] -= fraction


def _replica_plans(weights: np.ndarray, home: np.ndarray, replicas: np.ndarray, deployment: Deployment,
                   budget: np.ndarray, max_steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global plan's replicas, each node holding what its slots can
    (:func:`eplb.kernels.search.off_node.replica_nodes`) and packing them on its GPUs
    (:func:`eplb.kernels.search.pack_descend.place_node_counts`), then slots exchanged across GPUs and
    nodes while that lowers the heaviest GPU within the cap (:func:`eplb.kernels.search.off_node.exchange_descent`):
    two ``([L, S] phy2log, shares)`` (an even split), the first keeping a replica of every expert
    on its home node, the second letting an expert's last replica leave (its tokens off home).

    ``home [L, K]`` home node of each group, ``replicas [L, E]`` the global plan's replica counts,
    ``budget [L]`` tokens that may leave home. Where the piece step (step 2) balances the nodes'
    tokens alone, a receiving node takes a hot expert's piece on one slot and its own hot experts
    lose the slots they needed (with 2 slots a GPU a piece can weigh twice a GPU's mean load); here
    a node's slots hold whole replicas of the global plan, and the nodes' tokens are balanced by
    exchanging them.
    """
    topology = deployment.topology
    num_layers, num_experts = weights.shape
    size = num_experts // deployment.num_groups
    per_node = topology.slots_per_gpu.reshape(topology.num_nodes, -1)
    gpus = (per_node > 0).sum(axis=1).astype(np.float64)
    node_count = np.zeros((num_layers, topology.num_nodes, num_experts), np.int64)
    replicas = np.array(replicas, dtype=np.int64)  # replica_nodes may move a replica where the budget is short
    replica_nodes(weights, np.ascontiguousarray(np.repeat(home, size, axis=1)), replicas, per_node.sum(axis=1).astype(np.int64),
                  gpus / gpus.sum(), np.ascontiguousarray(budget, dtype=np.float64), node_count)
    node_of_gpu = np.ascontiguousarray(topology.node_of_gpu, dtype=np.int64)
    expert_node = np.ascontiguousarray(np.repeat(home, size, axis=1))
    phy2log = place_node_counts(weights, node_count, np.ascontiguousarray(topology.slots_per_gpu, dtype=np.int64),
                                node_of_gpu, max_steps)
    plans = []
    for keep_home in (True, False):
        exchanged = phy2log.copy()
        exchange_descent(weights, exchanged, replicas, np.ascontiguousarray(topology.gpu_of_slot, dtype=np.int64),
                         node_of_gpu, expert_node, np.ascontiguousarray(budget, dtype=np.float64), max_steps, keep_home)
        plans.append((exchanged, even_shares(exchanged, num_experts)))
    return plans


def plan_locality(weights: np.ndarray, deployment: Deployment, max_off_node: float, method: str = "balanced",
                  **options) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Hierarchical placement with a capped share of off-node tokens (module docstring).

    Args:
        weights: ``[L, E]`` float64 counts (validated). deployment: a hierarchical :class:`Deployment`.
        max_off_node: ``f`` in ``[0, 1]``, most tokens per layer served off their home node, as a fraction.
        method: the method that plans the hierarchical start and every node's items.
    Returns:
        ``phy2log [L, S]`` int64, ``shares [L, S]`` float64, ``home_node [L, K]`` int64 and info
        (``off_node_fraction [L]``, ``off_node_tokens [L]`` (priced on the network by
        :func:`eplb.model.cost.crossing_cost`), ``source [L]``: 0 hierarchical plan, 1 node plan (pieces, or
        the global plan's replicas by node, every expert keeping a replica at home), 2 global
        plan, 3 the global plan's replicas by node where an expert's last replica may leave home).
    """
    if not deployment.hierarchical:
        raise ValueError("max_off_node needs a hierarchical configuration (num_groups a multiple of num_nodes)")
    topology = deployment.topology
    num_layers, num_experts = weights.shape
    size = num_experts // deployment.num_groups
    solve = get_method(method)
    total = weights.sum(axis=1)
    if max_off_node <= 0:
        base, _ = solve(weights, deployment, **options)
        home = home_nodes(base, deployment.num_groups, num_experts, topology)
        return base, even_shares(base, num_experts), home, {
            "off_node_fraction": np.zeros(num_layers), "off_node_tokens": np.zeros(num_layers),
            "source": np.zeros(num_layers, np.int64)}
    home, _ = group_assignment(weights, deployment)
    per_node = topology.slots_per_gpu.reshape(topology.num_nodes, -1)
    gpus = (per_node > 0).sum(axis=1).astype(np.float64)
    free = per_node.sum(axis=1)[None, :] - np.stack([np.bincount(h, minlength=topology.num_nodes) for h in home]) * size
    width = max(1, int(free.sum(axis=1).max()))
    pieces = (np.zeros((num_layers, width), np.int64), np.zeros((num_layers, width), np.int64),
              np.zeros((num_layers, width)))
    count = off_node_pieces(weights, np.ascontiguousarray(np.repeat(home, size, axis=1)), gpus,
                            np.ascontiguousarray(free), np.ascontiguousarray(max_off_node * total), MAX_PIECE, *pieces)
    local = _place_nodes(weights, home, (*pieces, count), deployment, method, options)
    flat = Deployment(num_experts, topology)
    global_plan, _ = solve(weights, flat, **options)
    by_node = _replica_plans(weights, home, replica_counts(global_plan, num_experts), deployment, max_off_node * total,
                             MAX_STEPS)
    candidates = [(*local, home), (*by_node[0], home), (*by_node[1], home)]
    # the hierarchical plan, and with a loose cap the global plan, only where the node plan is not at the bound
    bound = node_cap_bound(weights, deployment, max_off_node)
    peak = np.min([gpu_loads(weights, p, topology, shares=s).max(axis=1) for p, s, _ in candidates], axis=0)
    plans = [(deployment, np.flatnonzero(peak > bound * (1 + REPLAN)))]
    if max_off_node >= GLOBAL_FROM:
        plans.append((flat, np.arange(num_layers)))
    for other, rows in plans:
        phy2log, shares, other_home = local[0].copy(), local[1].copy(), home.copy()
        if rows.size:
            phy2log[rows] = global_plan if other is flat else solve(np.ascontiguousarray(weights[rows]), other,
                                                                     **options)[0]
            shares[rows] = even_shares(phy2log[rows], num_experts)
            other_home[rows] = busiest_nodes(weights[rows], phy2log[rows], shares[rows], deployment.num_groups, topology)
        candidates.append((phy2log, shares, other_home))
    peaks = np.stack([gpu_loads(weights, p, topology, shares=s).max(axis=1) for p, s, _ in candidates])
    away = np.stack([off_node_tokens(weights, p, s, h, topology) for p, s, h in candidates])
    allowed = away <= max_off_node * total[None, :] * (1 + 1e-9)
    allowed[3] = True  # the hierarchical plan has none
    peaks = np.where(allowed, peaks, np.inf)
    # lightest first; among plans within TIE of the lightest, the one with the fewest off-node tokens
    near = peaks <= peaks.min(axis=0) * (1 + TIE)
    source = np.argmin(np.where(near, away, np.inf), axis=0)
    phy2log, shares, home = (np.stack([candidates[c][i][layer] for layer, c in enumerate(source)]) for i in range(3))
    fraction = away[source, np.arange(num_layers)] / np.where(total > 0, total, 1.0)
    return phy2log, shares, home, {"off_node_fraction": fraction, "off_node_tokens": away[source, np.arange(num_layers)],
                                   "source": np.array([1, 1, 3, 0, 2])[source]}


def capped_lower_bound(weights: np.ndarray, deployment: Deployment, max_off_node: float) -> np.ndarray:
    """``[L]`` lower bound on the max GPU load of any placement within the off-node cap.

    With a cap of 0 every token stays home and splits evenly: the hierarchical bound of
    :func:`eplb.analysis.bounds.strongest_bound`. With a cap above 0 a plan may split an expert's tokens unevenly
    among its replicas (its shares), so the bounds built on even splits (heaviest replica,
    cardinality) do not hold; what holds is :func:`node_cap_bound` (the average load, and what the
    heaviest nodes must keep).
    """
    if max_off_node <= 0 and deployment.hierarchical:
        return strongest_bound(weights, deployment)
    return node_cap_bound(weights, deployment, max_off_node)


def node_cap_bound(weights: np.ndarray, deployment: Deployment, max_off_node: float) -> np.ndarray:
    """``[L]``: what the heaviest nodes must keep when at most ``f * total`` tokens leave home.

    A group's home node holds a replica of each of its ``s = E / K`` experts, so node ``n`` is home
    to at most ``c_n = slots[n] // s`` groups. Take ``m`` nodes that include the home nodes of the
    ``m`` heaviest groups: the other ``N - m`` nodes are home to at most the sum of the ``N - m``
    largest ``c``, so the ``m`` nodes are home to at least ``q = max(m, K - that)`` groups and
    carry at least the ``m`` heaviest groups plus the ``q - m`` lightest. At most ``f * total``
    tokens leave them, so one of their GPUs (at most the ``m`` largest GPU counts of nodes)
    carries at least ``(that - f * total) / those GPUs``. The bound is the largest over ``m`` (and
    the average load; only the average elsewhere). With ``K / N`` groups on every node (``c_n =
    K / N``) the ``m`` nodes hold exactly ``m K / N`` groups.
    """
    topology = deployment.topology
    bound = average_bound(weights, topology)
    if max_off_node >= 1 or not deployment.hierarchical:
        return bound
    num_groups, num_nodes = deployment.num_groups, topology.num_nodes
    size = weights.shape[1] // num_groups
    per_node = topology.slots_per_gpu.reshape(num_nodes, -1)
    capacity = np.minimum(per_node.sum(axis=1) // size, num_groups)  # [N] groups a node can be home to
    active = np.sort((per_node > 0).sum(axis=1))[::-1]  # [N] GPUs with slots, most first
    most_capacity = np.concatenate([[0], np.cumsum(np.sort(capacity)[::-1])])  # [N + 1]
    groups = np.sort(weights.reshape(weights.shape[0], num_groups, size).sum(axis=2), axis=1)
    heavy = np.cumsum(groups[:, ::-1], axis=1)
    light = np.concatenate([np.zeros((groups.shape[0], 1)), np.cumsum(groups, axis=1)], axis=1)
    cap = max_off_node * weights.sum(axis=1)
    for m in range(1, min(num_nodes, num_groups) + 1):
        held = max(m, num_groups - int(most_capacity[num_nodes - m]))
        gpus = int(active[:m].sum())
        if gpus == 0 or held > num_groups:
            continue
        carried = heavy[:, m - 1] + light[:, held - m]
        bound = np.maximum(bound, (carried - cap) / gpus * (1.0 - 1e-12))
    return bound


def any_split_bound(weights: np.ndarray, deployment: Deployment, off_node) -> np.ndarray:
    """``[L]`` lower bound on the max GPU load of any placement whose experts' tokens may split
    among their replicas in any proportion (SGLang's rules, a plan's own shares, optimal dispatch),
    where the even-split bounds do not hold: the largest of the heaviest replica (one of an
    expert's ``r`` replicas takes at least ``1 / r`` of its tokens, whatever the split), the
    average load and, hierarchical, what the heaviest nodes keep when at most ``off_node`` (a
    fraction of each layer's tokens: a number or ``[L]``) is served off their home node
    (:func:`node_cap_bound`)."""
    values = replica_bound(weights, deployment.topology)
    away = np.broadcast_to(np.asarray(off_node, dtype=np.float64), (weights.shape[0],))
    for fraction in np.unique(away):
        rows = np.flatnonzero(away == fraction)
        values[rows] = np.maximum(values[rows], node_cap_bound(np.ascontiguousarray(weights[rows]), deployment,
                                                               float(fraction)))
    return values


def _mean_balancedness(loads: np.ndarray) -> float:
    """Mean over MoE layers (some token) of ``mean / max`` GPU load; ``loads [..., L, G]``."""
    peak = loads.max(axis=-1)
    moe = peak > 0
    return float((loads.mean(axis=-1)[moe] / peak[moe]).mean()) if moe.any() else 1.0


def off_node_curve(weights: np.ndarray, deployment: Deployment, fractions, held_out: np.ndarray | None = None,
           method: str = "balanced", **options) -> dict:
    """Balancedness against off-node traffic for a sweep of caps (the curve behind ``eplb.pareto``).

    Args:
        weights: ``[L, E]`` planning counts. deployment: hierarchical. fractions: caps ``f`` in ``[0, 1]``.
        held_out: ``[T, L, E]`` windows the plans did not see (or ``None``).
    Returns:
        A dict of ``[F]`` arrays: ``max_off_node``, ``balancedness`` and ``off_node_fraction`` in
        sample (shares as planned); with ``held_out`` also ``balancedness_held_out`` and
        ``off_node_fraction_held_out`` (the same shares applied to every held-out window), and
        ``balancedness_held_out_optimal`` / ``off_node_fraction_held_out_optimal`` (each window split
        by optimal dispatch, :func:`eplb.analysis.dispatch.optimal_dispatch`, which minimises the max GPU load
        and does not keep to the cap); means over windows and MoE layers.
    """
    topology = deployment.topology
    rows = {"max_off_node": [], "balancedness": [], "off_node_fraction": []}
    if held_out is not None:
        held_out = np.asarray(held_out, dtype=np.float64)
        rows.update(balancedness_held_out=[], off_node_fraction_held_out=[], balancedness_held_out_optimal=[],
                    off_node_fraction_held_out_optimal=[])
    total = weights.sum()
    for fraction in fractions:
        phy2log, shares, home, _ = plan_locality(weights, deployment, float(fraction), method, **options)
        rows["max_off_node"].append(float(fraction))
        rows["balancedness"].append(_mean_balancedness(gpu_loads(weights, phy2log, topology, shares=shares)))
        away = off_node_tokens(weights, phy2log, shares, home, topology).sum()
        rows["off_node_fraction"].append(float(away / total) if total > 0 else 0.0)
        if held_out is not None:
            rows["balancedness_held_out"].append(
                _mean_balancedness(gpu_loads(held_out, phy2log, topology, shares=shares)))
            served = max(float(held_out.sum()), 1e-300)
            away = off_node_tokens(held_out, phy2log, shares, home, topology).sum()
            rows["off_node_fraction_held_out"].append(float(away / served))
            best, _ = optimal_dispatch(held_out, phy2log, topology)
            rows["balancedness_held_out_optimal"].append(
                _mean_balancedness(gpu_loads(held_out, phy2log, topology, shares=best)))
            rows["off_node_fraction_held_out_optimal"].append(
                float(off_node_tokens(held_out, phy2log, best, home, topology).sum() / served))
    return {name: np.asarray(values, dtype=np.float64) for name, values in rows.items()}
