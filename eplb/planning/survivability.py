"""Placements that survive a lost GPU or node (``eplb.plan(..., survive="gpu" | "node")``).

A *failure domain* is what one failure takes out: a GPU (``survive="gpu"``) or a node with its GPUs
(``"node"``). An expert whose every replica sits in one domain is orphaned when that domain is lost:
its tokens cannot be served until its weights come back (:mod:`eplb.analysis.exposure` measures the
share). The survive stage of :func:`eplb.plan` (:mod:`eplb.planning.pipeline`) takes the plan made
so far and, per layer and per *zone* (the whole cluster, or each node of a hierarchical deployment,
whose groups stay on their node):

1. **spreads** replicas over domains (:func:`eplb.kernels.change.domain_spread.spread_layer`): heaviest
   first, each expert that sits in one domain gets a second replica from a *donor* (the expert with
   three or more replicas whose load per replica stays lowest once it gives one) and, if needed, a
   swap that takes one replica into another domain; moves never double an expert on a GPU nor
   shrink an expert's domains below two once it has two. Then a swap descent lowers the heaviest
   GPU without breaking the spread.

   - When the zone's slots allow every expert two domains (``sum over domains of min(slots, E)
     >= 2 E``: in a uniform deployment, ``S >= 2 E``), every expert is spread, whatever the
     balance costs (the rule the user asked for).
   - Otherwise the heaviest experts are spread while the heaviest GPU of the zone stays within
     :data:`SURVIVE_TOLERANCE` of the plan's (each expert undone when it would not): the tokens
     left exposed are those of the experts with one replica, at least ``2 E - S`` of them, so the
     worst loss is at least the lightest ``2 E - S`` experts' tokens over the domains
     (:func:`exposure_floor`).

2. **renumbers** (from scratch only; near the placement in service a GPU keeps its weights): the
   GPUs of a layer are interchangeable (same slots; a node's GPUs as a block), and a loss takes one
   GPU out of every layer, so each layer's domains are numbered to even out the orphaned tokens
   summed over the layers (heaviest layer first, its most exposed domain on the position least
   exposed so far: :func:`balanced_numbering`). Loads and balance do not change.

What combines with what is stated in :func:`eplb.planning.pipeline.combination_error`.
"""

from __future__ import annotations

import numpy as np

from ..analysis.exposure import loss_shares, orphaned_tokens
from ..kernels.change.domain_spread import SpreadState, load_spread, spread_layer
from ..kernels.search.pack_descend import balanced_placement
from ..kernels.search.packing import PackState, new_state, store_state
from ..model.deployment import Deployment

__all__ = ["SURVIVE", "SURVIVE_TOLERANCE", "balanced_numbering", "check_survive", "exposure_floor",
           "failure_domains", "survivable", "survivable_slots"]

SURVIVE = ("gpu", "node")
"""The accepted values of ``survive=`` (``None``: no survive stage)."""

SURVIVE_TOLERANCE = 0.005
"""Where the slots cannot give every expert two domains, an expert is spread only while the zone's
heaviest GPU stays within this fraction above the plan's (``bench/survive.py``)."""

SPREAD_STEPS = 4096
"""Most swaps of each descent of the spread (per expert spread, and the final one)."""


def check_survive(survive, deployment: Deployment) -> str | None:
    """``survive`` checked against ``deployment``: ``None`` or one of :data:`SURVIVE`; ``ValueError``
    naming the rule otherwise (a value not accepted, a single GPU or node with slots)."""
    if survive is None:
        return None
    if not isinstance(survive, str) or survive not in SURVIVE:
        raise ValueError(f"survive must be None, 'gpu' or 'node' (the failure a plan should survive), got {survive!r}")
    domains = failure_domains(deployment, survive)
    used = np.unique(domains[deployment.topology.slots_per_gpu > 0]).size
    if used < 2:
        what = "GPUs" if survive == "gpu" else "nodes"
        raise ValueError(f"survive={survive!r} needs at least 2 {what} with slots, got {used}: "
                         f"with one, its loss loses every expert")
    return survive


def failure_domains(deployment: Deployment, survive: str) -> np.ndarray:
    """``[G]`` int64: the failure domain of each GPU: itself (``"gpu"``) or its node (``"node"``)."""
    topology = deployment.topology
    return np.arange(topology.num_gpus, dtype=np.int64) if survive == "gpu" else topology.node_of_gpu.astype(np.int64)


def survivable_slots(num_experts: int, domain_slots: np.ndarray) -> bool:
    """Whether ``domain_slots [D]`` (slots per failure domain) can hold two replicas of each of
    ``num_experts`` experts in two different domains: ``sum(min(slots_d, E)) >= 2 E`` (each domain
    holds an expert at most once in such a pairing, and any pairing with those degrees exists)."""
    return int(np.minimum(np.asarray(domain_slots, np.int64), num_experts).sum()) >= 2 * num_experts


def exposure_floor(weights: np.ndarray, num_slots: int, num_domains: int) -> float:
    """A lower bound on the worst single-domain loss share of any placement of ``weights [L, E]``
    on ``num_slots`` slots (global, every expert present): at most ``S - E`` experts per layer have
    a second replica, so at least the lightest ``2 E - S`` experts' tokens have every replica in
    one domain, and some domain holds at least ``1 / D`` of them (summed over the layers)."""
    weights = np.asarray(weights, dtype=np.float64)
    single = max(0, 2 * weights.shape[1] - num_slots)
    total = weights.sum()
    if total <= 0 or single == 0:
        return 0.0
    lightest = np.sort(weights, axis=1)[:, :single].sum()
    return float(lightest / total / num_domains)


def _zones(deployment: Deployment) -> list[np.ndarray]:
    """The GPUs (with slots) each zone plans over: one zone, or one per node (hierarchical)."""
    topology = deployment.topology
    active = topology.slots_per_gpu > 0
    if not deployment.hierarchical:
        return [np.flatnonzero(active).astype(np.int64)]
    node = topology.node_of_gpu
    return [np.flatnonzero(active & (node == n)).astype(np.int64) for n in range(topology.num_nodes)]


def _spread_order(w: np.ndarray, spread: SpreadState, pack: PackState, gpus: np.ndarray) -> np.ndarray:
    """``[n]`` int64: the zone's experts to spread, heaviest first: every one with replicas in one
    domain and two or more replicas, and as many one-replica experts as donors can give replicas."""
    experts = np.flatnonzero(pack.holds[gpus].sum(axis=0) > 0)
    counts = spread.counts[experts]
    donors = int(np.maximum(counts - 2, 0).sum())
    order = experts[np.argsort(-w[experts], kind="stable")]
    narrow = order[spread.span[order] < 2]
    singles = narrow[spread.counts[narrow] < 2][:donors]
    keep = np.isin(narrow, singles) | (spread.counts[narrow] >= 2)
    return np.ascontiguousarray(narrow[keep])


def survivable(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment, survive: str, *,
               renumber: bool = True, tolerance: float = SURVIVE_TOLERANCE, max_steps: int = SPREAD_STEPS,
               hedge_of=None) -> tuple[np.ndarray, dict]:
    """The plan ``phy2log [L, S]`` for ``weights [L, E]`` spread over the failure domains of
    ``survive`` and, with ``renumber``, its GPUs numbered to even out the exposure (module notes).

    Without ``renumber`` (near a placement in service) each zone's descents stop at the plan's own
    peak. ``hedge_of(phy2log, spread_of) -> phy2log``, if given (a series), searches the spread plan
    over the windows keeping its replica counts (:meth:`eplb.planning.pipeline.Survive`;
    ``spread_of(weights [C, E], phy2log [C, S])`` spreads another plan the same way, for the
    search's cross-validation starts); the searched plan is spread again with descents that stop
    at its own peak (so the descent on the summed counts does not undo the search) and a layer
    keeps it where no more of its tokens sit in one domain than before (``survive_hedged [L]``).
    The plan given is returned instead when the spread one would leave a single loss more
    exposed (``survive_kept_plan``), so the exposure is never worse than the plan's. Returns
    ``phy2log [L, S]`` int64 and info: ``survive`` (the domain), ``survive_short [L]`` (experts per
    layer the spread left in one domain although the zone's slots could spread every expert; 0 on
    uniform deployments), ``survive_kept_plan`` and, hierarchical, ``survive_regrouped`` (layers re-placed with the
    groups spread evenly over the nodes, :func:`even_groups`)."""
    topology = deployment.topology
    domain = failure_domains(deployment, survive)
    num_domains = int(domain.max()) + 1
    domain_of_slot = domain[topology.gpu_of_slot]
    given, regrouped = phy2log, 0
    if renumber and deployment.hierarchical and survive == "gpu":
        phy2log, regrouped = even_groups(weights, phy2log, deployment)
    spread = lambda w, rows, descend: _spread_rows(w, rows, deployment, survive, tolerance, max_steps, descend)  # noqa: E731
    out, short = spread(weights, phy2log, renumber)
    hedged = None
    if hedge_of is not None:
        searched, searched_short = spread(weights, hedge_of(out, lambda w, rows: spread(w, rows, renumber)[0]), False)
        sole = lambda rows: orphaned_tokens(weights, rows, domain_of_slot, num_domains).sum(axis=1)  # noqa: E731
        hedged = (searched_short <= short) & (sole(searched) <= sole(out))
        out = np.where(hedged[:, None], searched, out)
        short = np.where(hedged, searched_short, short)
    if renumber:
        out = renumbered(weights, out, deployment, survive)
    # never more exposed than the plan given (a move can leave another domain holding a lone expert)
    worst = lambda rows: loss_shares(weights, rows, domain_of_slot, num_domains).max()  # noqa: E731
    kept = bool(worst(out) > worst(given))
    if kept:
        out = given
    info = {"survive": survive, "survive_short": short, "survive_kept_plan": kept}
    if hedged is not None:
        info["survive_hedged"] = hedged
    return out, {**info, "survive_regrouped": regrouped} if deployment.hierarchical else info


def _spread_rows(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment, survive: str, tolerance: float,
                 max_steps: int, descend: bool) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 of the module notes on every layer of ``phy2log [L, S]`` (``weights [L, E]``):
    ``(phy2log [L, S], short [L])``. With ``descend`` the descents lower each zone's heaviest GPU
    as far as swaps go, else they stop at the plan's own peak."""
    topology = deployment.topology
    num_layers, num_experts = weights.shape
    domain = failure_domains(deployment, survive)
    num_domains = int(domain.max()) + 1
    width = max(1, int(topology.slots_per_gpu.max()))
    make = lambda: (PackState(*new_state(topology.num_slots, topology.num_gpus, width, num_experts)),  # noqa: E731
                    SpreadState(domain, np.zeros((num_domains, num_experts), np.int64),
                                *(np.zeros(num_experts, np.int64) for _ in range(3))))
    (pack, spread), backup = make(), make()
    offsets = np.ascontiguousarray(topology.slot_offsets)
    zones = _zones(deployment)
    out = np.empty_like(phy2log)
    short = np.zeros(num_layers, np.int64)
    for layer in range(num_layers):
        w = np.ascontiguousarray(weights[layer], dtype=np.float64)
        load_spread(np.ascontiguousarray(phy2log[layer]), w, offsets, pack, spread)
        spread.need[:] = np.where(spread.span >= 2, 2, 1)
        for gpus in zones:
            experts = np.flatnonzero(pack.holds[gpus].sum(axis=0) > 0)
            room = np.bincount(domain[gpus], weights=topology.slots_per_gpu[gpus], minlength=num_domains)
            every = survivable_slots(experts.size, room[room > 0])
            peak = float(pack.gpu_load[gpus].max())
            cap = np.inf if every else peak * (1 + tolerance)
            left = spread_layer(w, _spread_order(w, spread, pack, gpus), gpus, pack, spread, backup, cap,
                                int(max_steps), 0.0 if descend else peak)
            short[layer] += left if every else 0
        store_state(pack.item_expert, pack.gpu_items, pack.gpu_fill, offsets, out[layer])
    return out, short


def even_groups(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment) -> tuple[np.ndarray, int]:
    """A hierarchical plan ``phy2log [L, S]`` whose layers each leave every node room for two
    replicas of its experts on two GPUs where the nodes allow it: a layer whose group -> node
    assignment crowds a node (its experts cannot all be on two GPUs) while another assignment
    would not is re-placed by the default method's kernel
    (:func:`eplb.kernels.search.pack_descend.balanced_placement`) with the groups, heaviest first, each on
    the lightest node that still has that room. Returns the plan and the number of layers re-placed."""
    topology = deployment.topology
    num_layers, num_experts = weights.shape
    size = num_experts // deployment.num_groups
    node_of_gpu = topology.node_of_gpu
    gpu_slots = [topology.slots_per_gpu[node_of_gpu == n] for n in range(topology.num_nodes)]
    node_of_slot = node_of_gpu[topology.gpu_of_slot]
    expert_node = np.full((num_layers, num_experts), -1, np.int64)
    crowded = np.zeros(num_layers, bool)
    for layer in range(num_layers):
        held = np.zeros(topology.num_nodes, np.int64)
        np.add.at(held, node_of_slot[np.unique(phy2log[layer], return_index=True)[1]], 1)
        crowded[layer] = not all(survivable_slots(int(held[n]), gpu_slots[n]) for n in range(topology.num_nodes))
        if crowded[layer]:
            expert_node[layer] = _even_assignment(weights[layer], size, gpu_slots)
    layers = np.flatnonzero(crowded & (expert_node[:, 0] >= 0))
    if layers.size == 0:
        return phy2log, 0
    out = phy2log.copy()
    out[layers] = balanced_placement(np.ascontiguousarray(weights[layers], dtype=np.float64),
                                     np.require(topology.slots_per_gpu, requirements="CW"),
                                     np.ascontiguousarray(node_of_gpu, dtype=np.int64),
                                     np.ascontiguousarray(expert_node[layers]), SPREAD_STEPS)
    return out, int(layers.size)


def _even_assignment(w: np.ndarray, size: int, gpu_slots: list[np.ndarray]) -> np.ndarray:
    """``[E]`` int64 node of each expert: groups of ``size`` experts, heaviest first, each on the
    lightest node (fewest experts, then lowest index, on ties) that is below its fair share of the
    groups (in proportion to its slots, rounded up) and whose GPUs (``gpu_slots[n]``: their slots)
    can still hold two replicas of all its experts on two GPUs, else on any node with that room;
    all ``-1`` when a group finds no such node or a node with slots is left without a group."""
    group_load = w.reshape(-1, size).sum(axis=1)
    nodes, groups = len(gpu_slots), group_load.size
    slots = np.array([g.sum() for g in gpu_slots], np.int64)
    fair = -(-groups * slots // max(1, int(slots.sum()))) * size
    load, held = np.zeros(nodes), np.zeros(nodes, np.int64)
    node_of_group = np.empty(groups, np.int64)
    for g in np.argsort(-group_load, kind="stable"):
        room = [n for n in range(nodes) if survivable_slots(int(held[n]) + size, gpu_slots[n])]
        room = [n for n in room if held[n] < fair[n]] or room
        if not room:
            return np.full(w.size, -1, np.int64)
        n = min(room, key=lambda n: (load[n], held[n], n))
        node_of_group[g] = n
        load[n] += group_load[g]
        held[n] += size
    if ((held == 0) & (slots > 0)).any():
        return np.full(w.size, -1, np.int64)
    return np.repeat(node_of_group, size)


def balanced_numbering(exposure: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """``[L, D]`` int64: for each layer, the domain to put at each position (``perm[l, p]``), only
    among positions of one class (``classes [D]``: interchangeable domains), so that the columns of
    ``exposure [L, D]`` (tokens orphaned per layer and domain) summed over the layers are even:
    layers by decreasing largest exposure, each layer's most exposed domain onto the position least
    exposed so far (ties by index: deterministic)."""
    num_layers, num_domains = exposure.shape
    perm = np.tile(np.arange(num_domains, dtype=np.int64), (num_layers, 1))
    total = np.zeros(num_domains)
    members = [np.flatnonzero(classes == c) for c in np.unique(classes)]
    for layer in np.argsort(-exposure.max(axis=1, initial=0.0), kind="stable"):
        for group in members:
            exposed = group[np.argsort(-exposure[layer, group], kind="stable")]
            lightest = group[np.argsort(total[group], kind="stable")]
            perm[layer, lightest] = exposed
        total += exposure[layer, perm[layer]]
    return perm


def _slot_order(perm: np.ndarray, offsets: np.ndarray, gpus_of: list[np.ndarray]) -> np.ndarray:
    """``[L, S]`` int64: the old slot each new slot takes when position ``p`` (a block of GPUs
    ``gpus_of[p]``) takes the GPUs of block ``perm[l, p]`` (blocks of one class hold equal slots)."""
    index = np.empty((perm.shape[0], int(offsets[-1])), np.int64)
    for layer in range(perm.shape[0]):
        index[layer] = np.concatenate([np.arange(offsets[g], offsets[g + 1])
                                       for p in perm[layer] for g in gpus_of[p]])
    return index


def renumbered(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment, survive: str) -> np.ndarray:
    """``phy2log [L, S]`` with each layer's GPUs renumbered to even out the tokens one loss orphans
    over the layers (:func:`balanced_numbering`): where a GPU must keep its node's company
    (hierarchical groups, or ``survive="node"``), first the nodes (as blocks of GPUs with the same
    slots) by what a node loss orphans, then each node's GPUs with the same slots; otherwise any
    GPUs with the same slots. Every GPU's experts move together: loads, balance and the spread
    over domains are unchanged."""
    topology = deployment.topology
    offsets, gpus, nodes = topology.slot_offsets, topology.num_gpus, topology.num_nodes
    rows = np.arange(phy2log.shape[0])[:, None]
    node_of_gpu = topology.node_of_gpu
    keep_node = deployment.hierarchical or survive == "node"
    if keep_node and nodes > 1:
        classes = np.unique(topology.slots_per_gpu.reshape(nodes, -1), axis=0, return_inverse=True)[1].ravel()
        exposure = orphaned_tokens(weights, phy2log, node_of_gpu[topology.gpu_of_slot], nodes)
        blocks = [np.flatnonzero(node_of_gpu == n) for n in range(nodes)]
        phy2log = phy2log[rows, _slot_order(balanced_numbering(exposure, classes), offsets, blocks)]
    classes = (node_of_gpu if keep_node else 0) * (int(topology.slots_per_gpu.max()) + 1) + topology.slots_per_gpu
    exposure = orphaned_tokens(weights, phy2log, topology.gpu_of_slot, gpus)
    single = [np.array([g]) for g in range(gpus)]
    return np.ascontiguousarray(phy2log[rows, _slot_order(balanced_numbering(exposure, classes), offsets, single)])
