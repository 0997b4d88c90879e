"""Lower bounds on the maximum GPU load: numbers no placement can beat (ARCHITECTURE.md section 3).

All functions take ``weights [L, E]`` (non-negative float64) and a :class:`Topology` and return
``[L]`` float64. Only GPUs that hold slots count (a masked GPU carries nothing).
"""

from __future__ import annotations

import numpy as np

from ..kernels.bounds.load_bounds import (min_max_replica_load, pigeonhole_bound, replica_and_pigeonhole_upper, threshold_bound,
                             tier_bound)
from ..kernels.bounds.budget import budget_tier_bound
from ..kernels.bounds.cardinality import head_companion_bound
from ..kernels.bounds.hierarchy import node_load_bound
from ..kernels.bounds.pairs import pair_level_bound
from ..kernels.bounds.pair_weights import pair_weight_bound
from ..kernels.search.tiny import tiny_bound
from ..model.deployment import Deployment, deployment_argument
from ..model.counts import weights_2d
from .searches import group_assignment
from ..model.topology import Topology

TINY_SLOTS = 16
"""Instances with at most this many slots get the exact search's proven optimum as their bound."""

TINY_BUDGET = 50_000
"""Most nodes of that search per layer (Mixtral-8x7b's 8 experts on 12 slots: a few hundred)."""

MEMO_GROUPS = 16
"""Up to this many groups the group -> node search of the hierarchical bound remembers node sets
(:mod:`eplb.kernels.bounds.hierarchy`) and runs with its full budget."""

MANY_GROUPS_BUDGET = 2_000
"""Most steps of one feasibility test of that search with more groups, where no test finishes: at
1024 experts / 32 groups / 16 nodes it proved nothing beyond :func:`~eplb.kernels.bounds.hierarchy.node_load_bound`
with 20,000, 2,000 or 200 steps (8 layers: 48 / 5 / 1 ms lognormal, 66 / 8 / 2 ms Zipf 1.0)."""

BUDGET_TIERS = 4
"""Most tiers of heaviest experts the slot-budget tier bound tries per layer
(:func:`eplb.kernels.bounds.budget.budget_tier_bound`)."""


def average_bound(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """Perfect balance: ``sum(w) / G`` over the GPUs that hold slots."""
    active_gpus = int((topology.slots_per_gpu > 0).sum())
    return weights.sum(axis=-1) / active_gpus


def replica_bound(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """The heaviest replica: ``min over r of max_e w_e / r_e`` with ``S`` replicas in all."""
    return min_max_replica_load(_descending(weights), topology.num_slots)


def _descending(weights: np.ndarray) -> np.ndarray:
    """``[L, E]`` float64 C-contiguous: each row of ``weights`` in decreasing order (the kernels
    work on sorted loads; NumPy's sort is many times faster than a compiled one)."""
    return np.ascontiguousarray(np.sort(np.asarray(weights, dtype=np.float64), axis=-1)[..., ::-1])


def cardinality_bound(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """The GPU holding the heaviest replica also holds ``k - 1`` other replicas.

    Whatever the replication, expert ``e`` has at most ``S - E + 1`` replicas, each carrying at
    least ``w_e / (S - E + 1)``, so the ``k - 1`` lightest other replicas carry at least the
    ``k - 1`` smallest entries of the multiset holding ``S - E + 1`` copies of every
    ``w_e / (S - E + 1)``. ``k`` is the fewest slots any GPU in use holds.
    """
    return _cardinality(np.sort(weights, axis=-1), topology, replica_bound(weights, topology))


def _cardinality(ascending: np.ndarray, topology: Topology, replica: np.ndarray) -> np.ndarray:
    """:func:`cardinality_bound` given ``ascending [L, E]`` (each row of the weights in increasing
    order) and the replica bound ``replica [L]`` (computed once)."""
    num_experts = ascending.shape[-1]
    k = int(topology.slots_per_gpu[topology.slots_per_gpu > 0].min())
    max_copies = topology.num_slots - num_experts + 1
    others = k - 1
    lightest = ascending / max_copies
    # the k - 1 smallest entries: whole blocks of max_copies equal values, then a partial block
    full_blocks, rest = divmod(others, max_copies)
    total = lightest[:, :full_blocks].sum(axis=-1) * max_copies
    if full_blocks < num_experts:
        total = total + rest * lightest[:, full_blocks]
    return replica + total


def pigeonhole(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """Where the largest replicas must go, for every replication
    (:func:`eplb.kernels.bounds.load_bounds.pigeonhole_bound`)."""
    active = topology.slots_per_gpu > 0
    return pigeonhole_bound(_descending(weights), topology.num_slots, int(active.sum()),
                            int(topology.slots_per_gpu[active].min()), np.zeros(weights.shape[0]))


def threshold(weights: np.ndarray, topology: Topology, max_m: int = 3) -> np.ndarray:
    """Binary search on the target max load with necessary conditions that hold for one
    replication at once: no replica above what a GPU can hold, at most ``m`` per GPU above
    ``1 / (m + 1)`` of it (:func:`eplb.kernels.bounds.load_bounds.threshold_bound`), from the other bounds up."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    replica = replica_bound(weights, topology)
    start = np.maximum(np.maximum(average_bound(weights, topology), replica),
                       _cardinality(np.sort(weights, axis=-1), topology, replica))
    return _threshold(weights, topology, start, max_m)


def _threshold(weights: np.ndarray, topology: Topology, start: np.ndarray, max_m: int = 3) -> np.ndarray:
    """:func:`threshold` from ``start [L]``, the largest of the average, replica and cardinality bounds."""
    active = topology.slots_per_gpu > 0
    return threshold_bound(weights, start, topology.num_slots, int(active.sum()),
                           int(topology.slots_per_gpu[active].min()), int(max_m))


def tier(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """The GPUs holding the replicas of the heaviest experts also hold the lightest others
    (:func:`eplb.kernels.bounds.load_bounds.tier_bound`), and those replicas, the other heavy experts' and
    every replica's fillers share the slots (:func:`eplb.kernels.bounds.budget.budget_tier_bound`), from
    the average and replica bounds up."""
    desc = _descending(weights)
    replica = min_max_replica_load(desc, topology.num_slots)
    return _tier(desc, topology, np.maximum(average_bound(weights, topology), replica), replica)


def _tier(desc: np.ndarray, topology: Topology, start: np.ndarray, replica: np.ndarray) -> np.ndarray:
    """:func:`tier` on ``desc [L, E]`` (the weights, each row decreasing) from ``start [L]`` (valid
    bounds: tiers that cannot beat them are skipped)."""
    active = topology.slots_per_gpu[topology.slots_per_gpu > 0]
    args = (topology.num_slots, int(active.size), int(active.min()), int(active.max()))
    tiers = tier_bound(desc, np.ascontiguousarray(start, dtype=np.float64), replica, *args)
    # the same tiers with the slot budget shared by the tier, the other heavy experts and the fillers
    return budget_tier_bound(desc, tiers, replica, *args, BUDGET_TIERS)


def search(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """The optimum itself on tiny instances (at most :data:`TINY_SLOTS` slots) where the exact
    branch and bound (:mod:`eplb.kernels.search.tiny`) finishes within :data:`TINY_BUDGET` nodes; the
    average bound elsewhere."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    return _search(weights, topology, average_bound(weights, topology))


def _search(weights: np.ndarray, topology: Topology, start: np.ndarray) -> np.ndarray:
    """:func:`search` from ``start [L]`` (valid bounds, kept where the search does not finish)."""
    if topology.num_slots > TINY_SLOTS:
        return start
    return tiny_bound(weights, np.require(topology.slots_per_gpu, dtype=np.int64, requirements="CW"),
                      np.ascontiguousarray(start, dtype=np.float64), TINY_BUDGET)


PAIR_BOUND_MULTIPLIERS = (0.25, 1.0)
"""Budget multipliers of the two-slot bound (:data:`eplb.kernels.bounds.pairs.PAIR_MULTIPLIERS` lists more):
on 58 lognormal layers at 288 / 144 all six reach a mean plan-to-bound gap of 1.862%, these two
1.866% in 85% of the time, ``1.0`` alone 1.866%, ``0.5`` alone 3.7%."""

def _from_average_and_replica(weights: np.ndarray, topology: Topology, bound) -> np.ndarray:
    """``bound(desc [L, E], topology, start [L])`` on ``weights [L, E]`` sorted decreasing, from
    the larger of the average and replica bounds."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    desc = _descending(weights)
    start = np.maximum(average_bound(weights, topology), min_max_replica_load(desc, topology.num_slots))
    return bound(desc, topology, start)


def pairs(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """Every GPU holds exactly two replicas: a pairing of the replica loads under a target ``T``
    needs, at each level ``x > T / 2``, as many replicas ``<= T - x`` as ``>= x``
    (:func:`eplb.kernels.bounds.pairs.pair_level_bound`), from the average and replica bounds up; the
    average bound on other topologies."""
    return _from_average_and_replica(weights, topology, _pairs)


def two_slots(topology: Topology) -> bool:
    """Whether every GPU that holds slots holds exactly two (the pair bounds apply)."""
    active = topology.slots_per_gpu[topology.slots_per_gpu > 0]
    return bool(active.size) and int(active.min()) == 2 and int(active.max()) == 2


def _pairs(desc: np.ndarray, topology: Topology, start: np.ndarray) -> np.ndarray:
    """:func:`pairs` on ``desc [L, E]`` (rows decreasing) from ``start [L]`` (valid bounds)."""
    if not two_slots(topology) or not desc.size:
        return start
    # any pairing of D'Hondt's replicas is at most twice the heaviest, the replica bound (<= start):
    # 2 * start is never rejected, so the bisection needs no plan for its upper end
    start = np.ascontiguousarray(start, dtype=np.float64)
    return pair_level_bound(desc, start, 2.0 * start, topology.num_slots,
                            np.asarray(PAIR_BOUND_MULTIPLIERS, dtype=np.float64))


PAIR_WEIGHT_ITERATIONS = 400
"""Most ascent steps of one weighting test (:func:`eplb.kernels.bounds.pair_weights.pair_weight_bound`).
The default's plans at 288 / 144 (lognormal, Zipf 1.0, Zipf 0.5, drift; 58 layers), steps falling
as ``1 / sqrt(t)``: 100, 200, 400 steps leave mean gaps of 0.46 / 0.06 / 1.63 / 0.22%, 0.38 / 0.05 /
1.42 / 0.14%, 0.33 / 0.04 / 1.29 / 0.13% (the one-level bound alone: 1.36 / 0.27 / 2.78 / 0.66%), the
bound taking about 0.1-0.25, 0.1-0.35, 0.15-0.55 s a model; 400 steps falling as in
:data:`eplb.kernels.bounds.pair_weights.STEP_DECAY`: 0.32 / 0.04 / 1.25 / 0.11%."""

PAIR_WEIGHT_STEP = 10.0
"""The ascent's first step (58 lognormal layers at 288 / 144, ``best``'s plans, 300 steps a test:
first steps 3, 10, 30 leave mean gaps of 0.41%, 0.33%, 0.34%)."""

PAIR_WEIGHT_HALVINGS = 5
"""Bisection steps between the bound and the plan's max load where the plan is not proven optimal."""


def pair_weights(weights: np.ndarray, topology: Topology, start: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """Every GPU holds exactly two replicas: the weighting test over every level at once
    (:mod:`eplb.kernels.bounds.pair_weights`) just below ``upper [L]`` (a plan's max loads on
    ``weights [L, E]``: where it proves, the plan is optimal), else bisected between ``start [L]``
    (valid bounds) and ``upper``; ``start`` on other topologies. ``[L]``, never below ``start``."""
    start = np.ascontiguousarray(start, dtype=np.float64)
    if not two_slots(topology) or not weights.size:
        return start
    return pair_weight_bound(_descending(weights), start, np.ascontiguousarray(upper, dtype=np.float64),
                             topology.num_slots, PAIR_WEIGHT_ITERATIONS, PAIR_WEIGHT_STEP, PAIR_WEIGHT_HALVINGS)


HEAD_SLOTS = (3, 4)
"""Slots a GPU (the same on every GPU with slots) where the head-companion bound runs."""

HEAD_GRID = 8
"""Thresholds and companion levels tried per target by the head-companion bound
(:func:`eplb.kernels.bounds.cardinality.head_companion_bound`)."""

HEAD_TOLERANCE = 1e-5
"""Relative precision of the head-companion bound's bisection."""


def heads(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """Every GPU holds exactly ``k`` replicas: the GPUs holding the replicas heavier than half a
    target also hold ``k - 1`` light companions each
    (:func:`eplb.kernels.bounds.cardinality.head_companion_bound`), from the average and replica
    bounds up, at :data:`HEAD_SLOTS` slots a GPU; the average bound on other topologies."""
    return _from_average_and_replica(weights, topology, _heads)


def _heads(desc: np.ndarray, topology: Topology, start: np.ndarray) -> np.ndarray:
    """:func:`heads` on ``desc [L, E]`` (rows decreasing) from ``start [L]`` (valid bounds)."""
    active = topology.slots_per_gpu[topology.slots_per_gpu > 0]
    if active.size == 0 or active.min() != active.max() or int(active.min()) not in HEAD_SLOTS or not desc.size:
        return start
    return head_companion_bound(desc, np.ascontiguousarray(start, dtype=np.float64),
                                min_max_replica_load(desc, topology.num_slots), topology.num_slots,
                                int(active.min()), HEAD_GRID, HEAD_TOLERANCE)


BOUNDS = {
    "average": average_bound,
    "replica": replica_bound,
    "cardinality": cardinality_bound,
    "pigeonhole": pigeonhole,
    "threshold": threshold,
    "tier": tier,
    "search": search,
    "pairs": pairs,
    "heads": heads,
}


def _scaled(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(weights [L, E] * 2**-x, x [L])``: each layer scaled by a power of two to a largest load in
    ``[0.5, 1)`` (0 for all-zero layers). Every bound scales with the loads, and scaling by a power
    of two is exact, so the kernels work near 1 whatever the magnitude (denormal or near the float64
    maximum) and one :func:`np.ldexp` scales their result back."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    peak = weights.max(axis=-1, initial=0.0) if weights.size else np.zeros(weights.shape[:-1])
    _, exponent = np.frexp(np.where(np.isfinite(peak) & (peak > 0), peak, 1.0))
    return np.ascontiguousarray(np.ldexp(weights, -exponent[..., None])), exponent


def bounds_by_name(weights: np.ndarray, topology: Topology) -> dict[str, np.ndarray]:
    """Every bound of :data:`BOUNDS` by name for ``weights [L, E]`` (validated), each ``[L]``
    (computed on each layer scaled near 1, see :func:`_scaled`)."""
    scaled, exponent = _scaled(weights)
    return {name: np.ldexp(bound(scaled, topology), exponent) for name, bound in BOUNDS.items()}


def hierarchical_bound(weights: np.ndarray, topology: Topology, num_groups: int) -> np.ndarray:
    """A bound for placements that keep every group of experts on one node, ``[L]``.

    Every node ``n`` reaching max load ``<= T`` needs the groups it holds to load it by at most
    ``T`` per GPU and to need at most its slots in replicas of ``<= T`` each, and its other experts
    to fit beside its heaviest expert's replicas or on its GPUs without one
    (:mod:`eplb.kernels.bounds.hot_room`); an exhaustive search over group -> node assignments
    (:mod:`eplb.kernels.bounds.hierarchy`) proves the largest ``T`` for which no assignment meets that.
    Where the search runs out of budget (many groups) the bound from the node loads alone stays
    (:func:`eplb.kernels.bounds.hierarchy.node_load_bound`: pigeonhole and heavy-light pairings of the
    groups over the nodes), with the global bound.
    """
    per_node = topology.slots_per_gpu.reshape(topology.num_nodes, -1)
    node_slots = per_node.sum(axis=1).astype(np.int64)
    node_active = (per_node > 0).sum(axis=1).astype(np.int64)
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    base = _strongest(weights, topology)
    deployment = Deployment(weights.shape[1], topology, num_groups, hierarchical=True)
    budget = {} if num_groups <= MEMO_GROUPS else {"budget": MANY_GROUPS_BUDGET}
    _, proven = group_assignment(weights, deployment, lower=base, strong=True, **budget)
    return np.maximum(np.maximum(base, proven), node_load_bound(weights, int(num_groups), node_slots, node_active))


def strongest_bound(weights: np.ndarray, deployment: Deployment) -> np.ndarray:
    """The strongest bound for each layer of ``weights [L, E]`` (validated), ``[L]``: the largest
    of :data:`BOUNDS`, and for a hierarchical ``deployment`` (every group on one node) the
    :func:`hierarchical_bound`.

    Each layer is bounded scaled by a power of two to a largest load near 1 (:func:`_scaled`): the
    same bound for every magnitude of counts, finite for denormal ones and for huge ones (as long
    as the bound itself is below the float64 maximum)."""
    scaled, exponent = _scaled(weights)
    if deployment.hierarchical:
        return np.ldexp(hierarchical_bound(scaled, deployment.topology, deployment.num_groups), exponent)
    return np.ldexp(_strongest(scaled, deployment.topology), exponent)


def lower_bound(counts, deployment: Deployment | None = None, **deployment_keywords) -> np.ndarray:
    """``[L]`` float64: a proven lower bound on the max GPU load any placement of ``counts`` can
    reach in the deployment, per layer (``eplb.plan``'s ``Placement.lower_bound`` is this bound,
    tightened by what an exact method proved and, with two slots on every GPU, by the weighting
    bound aimed at the plan's max load, :func:`pair_weights`, which needs a plan to aim at).

    Args:
        counts: ``[L, E]`` (``[E]`` for one layer; a series ``[T, L, E]`` is summed), non-negative.
        deployment: the :class:`eplb.Deployment` (hierarchical, with a bound for every group on one
            node, when its groups stay on their nodes); its keywords still work in its place,
            deprecated.
    """
    weights = weights_2d(counts, "counts")
    deployment = deployment_argument(deployment, deployment_keywords, "lower_bound", num_experts=weights.shape[1])
    return strongest_bound(weights, deployment)


def lower_bounds(counts, deployment: Deployment | None = None, **deployment_keywords) -> dict[str, np.ndarray]:
    """Every global bound by name (:data:`BOUNDS`), each ``[L]`` float64, for ``counts`` and the
    deployment as :func:`lower_bound` takes them (their maximum is :func:`lower_bound`'s global bound)."""
    weights = weights_2d(counts, "counts")
    deployment = deployment_argument(deployment, deployment_keywords, "lower_bounds", num_experts=weights.shape[1])
    return bounds_by_name(weights, deployment.topology)


def _strongest(weights: np.ndarray, topology: Topology) -> np.ndarray:
    """The largest of :data:`BOUNDS` per layer, ``[L]``: the same values as the maximum over
    :func:`lower_bounds`, faster. The weights are sorted once for every kernel, the replica bound
    comes from the D'Hondt replication that also gives the pigeonhole bound's cheap upper bound
    (:func:`eplb.kernels.bounds.load_bounds.replica_and_pigeonhole_upper`), and the pigeonhole bound (the
    costliest) runs only on the layers where that upper bound (with a margin far above rounding)
    reaches the others: elsewhere it cannot be the largest, so the maximum is unchanged."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    ascending = np.sort(weights, axis=-1)
    desc = np.ascontiguousarray(ascending[:, ::-1])
    active = topology.slots_per_gpu > 0
    args = (topology.num_slots, int(active.sum()), int(topology.slots_per_gpu[active].min()))
    replica, upper = replica_and_pigeonhole_upper(desc, *args)
    others = np.maximum(np.maximum(average_bound(weights, topology), replica),
                        _cardinality(ascending, topology, replica))
    others = np.maximum(others, _threshold(weights, topology, others))
    others = _tier(desc, topology, others, replica)
    others = _search(weights, topology, others)
    others = _pairs(desc, topology, others)
    others = _heads(desc, topology, others)
    needed = ~(upper * (1.0 + 1e-6) < others)
    if needed.any():
        rows = np.flatnonzero(needed)
        others = others.copy()
        others[rows] = np.maximum(others[rows], pigeonhole_bound(np.ascontiguousarray(desc[rows]), *args,
                                                                 np.ascontiguousarray(others[rows])))
    return others
