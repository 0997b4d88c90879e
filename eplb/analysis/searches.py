"""Searches shared by the bounds, the methods and the certificates (the layer just above the
kernels): the group -> node assignment of hierarchical placement and the capped packing descent.

Both are Python around Numba kernels; they take a :class:`~eplb.model.deployment.Deployment` or plain arrays
and return plain arrays.
"""

from __future__ import annotations

import numpy as np

from ..kernels.search.capped import descend
from ..kernels.bounds.hierarchy import NodeTable, assign_groups
from ..model.deployment import Deployment
from ..model.topology import Topology

SEARCH_BUDGET = 20000
"""Most steps of one group -> node feasibility search before it gives up (undecided)."""

SEARCH_TOL = 1e-6
"""Relative precision of the target max load in the group -> node binary search."""


def node_arrays(topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(slots [N], active GPUs [N], class [N])`` int64; nodes of one class have equal slots per GPU."""
    per_node = topology.slots_per_gpu.reshape(topology.num_nodes, -1)
    slots = per_node.sum(axis=1).astype(np.int64)
    active = (per_node > 0).sum(axis=1).astype(np.int64)
    _, node_class = np.unique(per_node, axis=0, return_inverse=True)
    return slots, active, np.asarray(node_class, dtype=np.int64).ravel()


def check_hierarchical(num_experts: int, deployment: Deployment) -> None:
    """Raise ``ValueError`` when no group -> node assignment fits the slots of the nodes."""
    topology = deployment.topology
    groups = deployment.num_groups
    size = num_experts // groups
    slots, _, _ = node_arrays(topology)
    used = slots[slots > 0]
    if (used < size).any():
        node = int(np.flatnonzero((slots > 0) & (slots < size))[0])
        raise ValueError(
            f"hierarchical placement: node {node} has {int(slots[node])} slots, fewer than the {size} experts "
            "of one group; every node with slots must hold at least one whole group"
        )
    if (used // size).sum() < groups:
        raise ValueError(
            f"hierarchical placement: the nodes hold at most {int((used // size).sum())} whole groups of "
            f"{size} experts, fewer than num_groups ({groups})"
        )
    if used.size > groups:
        raise ValueError(
            f"hierarchical placement: {used.size} nodes have slots but there are only {groups} groups; "
            "every node with slots must hold at least one group"
        )


def group_assignment(weights: np.ndarray, deployment: Deployment, lower: np.ndarray | None = None,
                     budget: int = SEARCH_BUDGET, strong: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Node of every group in every layer, and the proven hierarchical bound.

    Args:
        weights: ``[L, E]`` float64. lower: ``[L]`` valid lower bounds to start from.
        strong: every node of an assignment must also leave its heaviest expert's replicas room for
            the others (:func:`eplb.kernels.bounds.hot_room.hot_room_fits`): a stronger bound, a slower search.
    Returns:
        ``node_of_group [L, K]`` int64 and ``[L]`` float64 lower bound on the max load of any
        placement that keeps every group on one node.
    """
    check_hierarchical(weights.shape[1], deployment)
    slots, active, node_class = node_arrays(deployment.topology)
    if lower is None:
        lower = weights.sum(axis=1) / max(1, int((deployment.topology.slots_per_gpu > 0).sum()))
    node_of_group = np.empty((weights.shape[0], deployment.num_groups), np.int64)
    per_node = deployment.topology.slots_per_gpu.reshape(deployment.topology.num_nodes, -1)
    used = np.where(per_node > 0, per_node, np.iinfo(np.int64).max)
    node_min = np.where(active > 0, used.min(axis=1), 0).astype(np.int64)
    node_max = per_node.max(axis=1).astype(np.int64)
    proven = assign_groups(np.ascontiguousarray(weights), deployment.num_groups,
                           NodeTable(slots, active, node_class, node_min, node_max),
                           np.ascontiguousarray(lower, dtype=np.float64), budget, SEARCH_TOL, node_of_group,
                           bool(strong))
    if (node_of_group < 0).any():  # cannot happen after check_hierarchical; kept as a clear error
        raise ValueError("hierarchical placement: no group -> node assignment fits the slots of the nodes")
    return node_of_group, proven


RELATIVE_STEP = 1e-7
"""The capped search's bisection stops when its interval is this fraction of the cap; a replica
count move must beat the current max load by this fraction."""


def improve_layer(w: np.ndarray, row: np.ndarray, num_gpus: int, slots: int, lower: float, *,
                  neighbours: bool = True, spread: bool = True, budget: int = 20_000,
                  max_attempts: int = 20_000):
    """The lightest placement of one layer the capped search finds from ``row``
    (:func:`eplb.kernels.search.capped.descend`).

    Args:
        w: ``[E]`` float64 expert loads; row: ``[S]`` int64 starting placement (``S = G k``).
        num_gpus, slots: ``G`` identical GPUs of ``k`` slots; lower: a valid lower bound.
        neighbours: also descend over replica counts (one replica moved between two experts).
        spread: no two replicas of one expert on a GPU.
        budget: search nodes per packing attempt (an attempt out of budget counts as failed).
        max_attempts: most packing attempts for the layer (bounds the time on large layers, where
            one pass of the descent tries ``E (E - 1)`` moves).
    Returns:
        ``(max load, row [S] int64, nodes)``.
    """
    upper, out, nodes = descend(np.ascontiguousarray(w, dtype=np.float64), np.require(row, np.int64, "CW").copy(),
                                int(num_gpus), int(slots), float(lower), bool(neighbours), bool(spread), int(budget),
                                int(max_attempts), RELATIVE_STEP)
    return float(upper), out, int(nodes)
