"""Re-planning across a deployment change, and hierarchical deployments that degrade instead of refusing.

Across a :class:`~eplb.model.change.DeploymentChange` the placement in service is carried into the
new slots (surviving GPUs keep their weights; holes where nothing is carried; *missing* experts
where no carried slot holds one: every replica lost, or given up by a shrinking GPU), then:

1. :func:`fit_groups`: a hierarchical deployment whose nodes cannot hold every group whole (a node
   lost a GPU) keeps its groups as *units* of half, a quarter, ... of a group, the largest that
   fit, each unit on one node; global only when no unit size fits. The plan says what was relaxed;
2. :func:`unit_nodes` (hierarchical): the node of every unit, where the carried placement has it
   when the node has room, else moved to the node with the most room (units with the most
   missing experts move first: their weights are copied anyway);
3. :func:`carried_across` places every missing expert and fills every hole at the fewest copies, balanced
   (:func:`eplb.kernels.change.repair.repair_carried`);
4. the migration-aware search (:mod:`eplb.planning.migration`) goes on from the repair, counting
   every slot against the carried placement: the plan trades balance against copies across the
   change exactly as it does without one.

Copies are at least :meth:`~eplb.model.change.DeploymentChange.floor` per layer; orphans (missing
experts no surviving GPU holds) come from host memory, once each (:func:`eplb.serving.transfer.transfer_plan`).
"""

from __future__ import annotations

import warnings

import numpy as np

from ..analysis.loads import peak_loads
from ..analysis.searches import check_hierarchical
from ..kernels.search.few_changes import align_slots
from ..kernels.change.repair import repair_carried
from ..model.change import HOLE, DeploymentChange
from ..model.deployment import Deployment
from .migration import Carried
from .spread import replica_caps

RELAXED_WARNING = "hierarchical deployment relaxed"  # opens the warning of fit_groups


def fit_groups(deployment: Deployment, *, spill: bool = False, near: bool = False) -> tuple[Deployment, str | None]:
    """The deployment itself when its groups fit its nodes; else, for a hierarchical deployment
    whose nodes cannot hold every group whole: with ``spill`` (a re-plan across a change), the
    deployment without the rule, the re-plan keeping every group on its home node where it fits and
    spilling the rest (:func:`carried_across`); with ``near`` (a plan from the placement in service
    on that deployment, no change), the deployment without the rule, the plan staying close to the
    placement in service (regrouping it into units would move most slots again); otherwise the
    same with groups split into units
    (half a group, a quarter, ...: the largest size that fits, each unit kept on one node), or
    global when none fits. Returns the deployment to plan on and a note of what was relaxed
    (``None``: nothing)."""
    if not deployment.hierarchical:
        return deployment, None
    try:
        check_hierarchical(deployment.num_experts, deployment)
        return deployment, None
    except ValueError as exc:
        reason = str(exc).removeprefix("hierarchical placement: ")
    experts, nodes = deployment.num_experts, deployment.num_nodes
    flat = Deployment(experts, deployment.topology, None, False, deployment.dispatch)
    if near:
        return flat, f"{RELAXED_WARNING}: {reason}; planned without the groups' rule, close to the placement in service"
    if spill:
        return flat, (f"{RELAXED_WARNING}: {reason}; every group stays on its home node where it fits, the experts "
                      "a node has no room for go to other nodes")
    experts, nodes = deployment.num_experts, deployment.num_nodes
    size = experts // deployment.num_groups
    groups = deployment.num_groups
    while size % 2 == 0:
        size //= 2
        groups *= 2
        units = Deployment(experts, deployment.topology, groups, True, deployment.dispatch)
        if groups % nodes == 0 and _fits(units):
            return units, (f"{RELAXED_WARNING}: {reason}; each group of {experts // deployment.num_groups} experts "
                           f"is kept as units of {size}, each unit on one node")
    return flat, f"{RELAXED_WARNING}: {reason}; no split of the groups fits the nodes, so the placement is global"


def _fits(deployment: Deployment) -> bool:
    try:
        check_hierarchical(deployment.num_experts, deployment)
    except ValueError:
        return False
    return True


def warn_relaxed(note: str | None, stacklevel: int = 4) -> None:
    """One ``RuntimeWarning`` with :func:`fit_groups`' note (nothing when nothing was relaxed)."""
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=stacklevel)


def unit_nodes(weights: np.ndarray, carried: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``[L, E]`` int64: the node every expert must be on (``-1``: any, a global deployment).

    Every node with slots holds a quota of units (:func:`unit_quotas`: as a plan from scratch
    spreads them, so that no node has so many slots for its experts that one expert needs more
    replicas than the node has GPUs). Each unit stays on the node that holds most of its carried
    replicas while that node's quota has room for it; the units beyond a node's quota leave, most
    missing experts first, then the lightest; units with nowhere to stay go, heaviest first, to the
    node with quota left whose load per slot would be lowest (lowest index on ties).
    ``weights [L, E]``, ``carried [L, S]`` with ``-1`` holes."""
    num_layers, num_experts = weights.shape
    if not deployment.hierarchical:
        return np.full((num_layers, num_experts), -1, np.int64)
    topology = deployment.topology
    units, size = deployment.num_groups, num_experts // deployment.num_groups
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    room = topology.slots_per_node
    quota = unit_quotas(deployment)
    out = np.empty((num_layers, num_experts), np.int64)
    for layer in range(num_layers):
        row = carried[layer]
        unit_load = weights[layer].reshape(units, size).sum(axis=1)
        present = np.zeros(num_experts, bool)
        present[row[row >= 0]] = True
        missing = (~present).reshape(units, size).sum(axis=1)
        node = _most_held(row, size, units, node_of_slot, topology.num_nodes)
        for n in range(topology.num_nodes):
            members = np.flatnonzero(node == n)
            # leave: most missing experts first, then the lightest, then the highest index
            for u in sorted(members.tolist(), key=lambda u: (-missing[u], unit_load[u], -u)):
                if (node == n).sum() <= quota[n]:
                    break
                node[u] = -1
        load = np.bincount(node[node >= 0], weights=unit_load[node >= 0], minlength=topology.num_nodes)
        for u in sorted(np.flatnonzero(node < 0).tolist(), key=lambda u: (-unit_load[u], u)):
            left = quota - np.bincount(node[node >= 0], minlength=topology.num_nodes)
            per_slot = np.where(left > 0, (load + unit_load[u]) / np.maximum(room, 1), np.inf)
            node[u] = int(np.argmin(per_slot))  # the quotas sum to the units: one has room
            load[node[u]] += unit_load[u]
        out[layer] = np.repeat(node, size)
    return out


def unit_quotas(deployment: Deployment) -> np.ndarray:
    """``[N]`` int64: how many units (groups of a hierarchical ``deployment``) each node holds.

    One for every node with slots, then one at a time to the node whose experts would otherwise
    have the most replicas per GPU (slots / (experts x GPUs); lowest index on ties) among those with
    room for one more: with equal nodes, ``num_groups / num_nodes`` each, as a plan from scratch
    places them. A node with more slots than its experts times its GPUs forces an expert beyond
    one replica per GPU, so the quotas keep every node below that wherever the units allow."""
    topology = deployment.topology
    size = deployment.num_experts // deployment.num_groups
    room = topology.slots_per_node.astype(np.int64)
    gpus = np.bincount(topology.node_of_gpu[topology.slots_per_gpu > 0], minlength=topology.num_nodes)
    quota = (room > 0).astype(np.int64)
    most = room // size
    for _ in range(deployment.num_groups - int(quota.sum())):
        crowding = np.where(quota < most, room / np.maximum(quota * size * gpus, 1), -np.inf)
        quota[int(np.argmax(crowding))] += 1
    return quota


def home_nodes_of(weights: np.ndarray, carried: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``[L, E]`` int64: the home node of every expert's group in a hierarchical ``deployment`` whose
    groups do not all fit: the node holding most of the group's carried replicas; a group with
    none left goes, heaviest first, to the node with the most room left (lowest index on ties)."""
    num_layers, num_experts = weights.shape
    topology = deployment.topology
    groups, size = deployment.num_groups, num_experts // deployment.num_groups
    node_of_slot = topology.node_of_gpu[topology.gpu_of_slot]
    out = np.empty((num_layers, num_experts), np.int64)
    for layer in range(num_layers):
        node = _most_held(carried[layer], size, groups, node_of_slot, topology.num_nodes)
        load = weights[layer].reshape(groups, size).sum(axis=1)
        for g in sorted(np.flatnonzero(node < 0).tolist(), key=lambda g: (-load[g], g)):
            room = topology.slots_per_node - np.bincount(node[node >= 0], minlength=topology.num_nodes) * size
            node[g] = int(np.argmax(room))
        out[layer] = np.repeat(node, size)
    return out


def _most_held(row: np.ndarray, size: int, units: int, node_of_slot: np.ndarray, num_nodes: int) -> np.ndarray:
    """``[units]`` int64: the node holding most of each unit's (``size`` consecutive experts)
    replicas in ``row [S]`` (``-1`` holes; lowest node on ties), ``-1`` for a unit with none."""
    held = row >= 0
    votes = np.zeros((units, num_nodes), np.int64)
    np.add.at(votes, (row[held] // size, node_of_slot[held]), 1)
    return np.where(votes.max(axis=1) > 0, votes.argmax(axis=1), -1)


def _repair(weights: np.ndarray, carried: np.ndarray, deployment: Deployment, expert_node: np.ndarray, *,
            spill: bool = False) -> np.ndarray:
    """``[L, S]`` int64: ``carried [L, S]`` (``-1`` holes) with every missing expert placed and every hole
    filled (:func:`eplb.kernels.change.repair.repair_carried`), every expert on its node of ``expert_node
    [L, E]`` (or, with ``spill``, any node where its own has no room), no hole bringing an expert
    beyond the spread rule's cap on ``deployment`` (:func:`eplb.planning.spread.replica_caps`): the
    repair keeps the rule, so the search that goes on from it does. ``weights [L, E]`` float64."""
    topology = deployment.topology
    out, ok = repair_carried(np.ascontiguousarray(weights, dtype=np.float64), np.ascontiguousarray(carried),
                             topology.gpu_of_slot, topology.node_of_gpu, topology.num_gpus, expert_node,
                             replica_caps(deployment, expert_node), spill)
    if not ok.all():  # unit_nodes leaves every unit room on its node; kept as a clear error
        raise ValueError(f"the deployment change leaves no slot for some experts in layers "
                         f"{np.flatnonzero(~ok).tolist()}")
    return out


def carried_across(weights: np.ndarray, change: DeploymentChange, previous: np.ndarray,
                   deployment: Deployment) -> tuple[np.ndarray, Carried]:
    """The start of a re-plan across ``change`` from ``previous [L, S_old]`` for ``weights [L, E]``
    on ``deployment`` (``change.new``, or what :func:`fit_groups` relaxed it to): the carried
    placement repaired (``[L, S_new]``, :func:`repaired`) and the :class:`Carried` the search counts
    its copies against, with the peak the placement in service reached scaled to the GPUs that
    serve after the change (``recover_to``). Where ``change.new`` is hierarchical and
    ``deployment`` is not (its groups do not fit), every group keeps a home node and the search
    keeps its experts on the nodes that hold the group (spilled experts included)."""
    carried = change.carry(previous)
    spill = change.new.hierarchical and not deployment.hierarchical
    old_top, new_top = change.old.topology, change.new.topology
    active = lambda topology: max(1, int((topology.slots_per_gpu > 0).sum()))  # noqa: E731
    peak = peak_loads(np.ascontiguousarray(weights, dtype=np.float64), np.ascontiguousarray(previous), old_top)
    recover_to = peak * active(old_top) / active(new_top)
    if spill:
        homes = home_nodes_of(weights, carried, change.new)
        start = _repair(weights, carried, deployment, homes, spill=True)
        return start, Carried(carried, recover_to, change.new.num_groups)
    return _repair(weights, carried, deployment, unit_nodes(weights, carried, deployment)), Carried(carried, recover_to)


def aligned(phy2log: np.ndarray, carried: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``phy2log [L, S]`` with each GPU's experts ordered so that those it kept stay in their
    carried slots (``carried [L, S]``): slot order inside a GPU is free, a copy is not."""
    out = np.empty_like(phy2log)
    offsets, num_experts = deployment.topology.slot_offsets, deployment.num_experts
    for layer in range(phy2log.shape[0]):
        align_slots(phy2log[layer], carried[layer], offsets, num_experts, out[layer])
    return out


def change_info(change: DeploymentChange, in_service: np.ndarray, phy2log: np.ndarray) -> dict:
    """What a re-plan across ``change`` did, from the placement in service (``in_service [L,
    S_old]``) to ``phy2log [L, S]``: ``change`` (one line), ``lost_gpus``, ``added_gpus``, and per
    layer ``orphans [L]`` (experts loaded from host memory: no surviving GPU holds them),
    ``copy_floor [L]`` (the fewest copies any re-plan makes: ``max(missing, holes)``,
    :meth:`~eplb.model.change.DeploymentChange.floor`) and ``copies [L]`` (new slots whose expert
    their GPU did not carry)."""
    return {"change": change.describe(), "lost_gpus": change.lost_gpus.tolist(),
            "added_gpus": change.added_gpus.tolist(), "gpu_map": change.gpu_map.tolist(),
            "orphans": change.orphans(in_service).sum(axis=1),
            "copy_floor": change.floor(in_service), "copies": copies_across(change.carry(in_service), phy2log, change.new)}


def copies_across(carried: np.ndarray, phy2log: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``[L]`` int64: slots of ``phy2log [L, S]`` whose expert their GPU did not hold in
    ``carried [L, S]`` (``-1`` holes): each is one weight copy (from a GPU, or from host memory)."""
    topology = deployment.topology
    num_layers, num_experts = phy2log.shape[0], deployment.num_experts
    gpu = np.broadcast_to(topology.gpu_of_slot, phy2log.shape)
    key = lambda rows: (gpu * (num_experts + 1) + np.where(rows >= 0, rows, num_experts)).reshape(num_layers, -1)  # noqa: E731
    copies = np.zeros(num_layers, np.int64)
    for layer, (before, after) in enumerate(zip(key(carried), key(phy2log))):
        had = np.bincount(before, minlength=topology.num_gpus * (num_experts + 1))
        has = np.bincount(after, minlength=had.size)
        copies[layer] = np.maximum(has - had, 0).sum()
    return copies


__all__ = ["HOLE", "RELAXED_WARNING", "aligned", "carried_across", "change_info", "copies_across", "fit_groups",
           "home_nodes_of", "unit_nodes", "unit_quotas", "warn_relaxed"]
