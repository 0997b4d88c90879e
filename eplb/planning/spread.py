"""The spread rule every method keeps (docs/methods.md): no two replicas of an expert on one GPU
where the replica and slot counts allow otherwise.

Under an even split, two replicas of an expert on one GPU carry what one replica with twice the
share would: the second costs a slot of expert memory and moves no load off the GPU. The counts
can still force them (a GPU with more slots than there are experts), and on uneven slots some
replica counts fit no other way, so the rule forbids the avoidable ones. A *domain* is where an
expert's replicas may go: every GPU with slots (global placement) or the GPUs of its group's node
(hierarchical); it holds ``m`` experts (all of them, or its groups' experts), ``n`` GPUs with slots
``k [n]`` (all > 0) and ``sum(k)`` slots. In every domain:

1. **cap**: no expert has more replicas than the domain has GPUs, unless ``sum(k) > m * n`` (the
   slots then force some expert beyond it);
2. **spread**: where the replica counts ``r [m]`` of its experts fit on its GPUs with no expert
   twice on one GPU, none is. They fit iff, for every ``j = 1 .. n``, the ``j`` largest slot
   counts sum to at most ``sum_e min(r_e, j)`` (the Gale-Ryser theorem for a 0-1 matrix with row
   sums ``k`` and column sums ``r``).

With the same slots on every GPU and at most as many as experts, the cap makes every count fit:
no expert is ever twice on a GPU.
"""

from __future__ import annotations

import numpy as np

from ..model.deployment import Deployment

__all__ = ["avoidable_doubled", "capped", "counts_allow_spread", "domains", "keeps_rule", "largest_slot_sums",
           "replica_caps", "spread_row", "within_cap"]


def domains(deployment: Deployment) -> list[np.ndarray]:
    """The GPU indices (``int64``, increasing, slots > 0) of each domain: one for a global
    placement, one per node holding slots when hierarchical."""
    topology = deployment.topology
    active = topology.slots_per_gpu > 0
    if not deployment.hierarchical:
        return [np.flatnonzero(active)]
    per_node = [np.flatnonzero(active & (topology.node_of_gpu == n)) for n in range(topology.num_nodes)]
    return [gpus for gpus in per_node if gpus.size]


def largest_slot_sums(slots: np.ndarray) -> np.ndarray:
    """``[n]`` int64: entry ``j - 1`` is the sum of the ``j`` largest of ``slots [n]``."""
    return np.cumsum(np.sort(np.asarray(slots, dtype=np.int64))[::-1])


def counts_allow_spread(replicas: np.ndarray, slots: np.ndarray) -> bool:
    """Whether ``replicas [m]`` (each >= 1) fit on GPUs with ``slots [n]`` (each > 0, the same total)
    with no expert twice on one GPU (the module's condition)."""
    replicas = np.asarray(replicas, dtype=np.int64)
    held = np.minimum(replicas[None, :], np.arange(1, len(slots) + 1)[:, None]).sum(axis=1)  # [n]
    return bool(replicas.sum() == np.sum(slots) and (largest_slot_sums(slots) <= held).all())


def _domain_rows(row: np.ndarray, deployment: Deployment):
    """For each domain of ``row [S]``: ``(gpus, slot mask [S], replica counts of its experts [E])``."""
    gpu_of_slot = deployment.topology.gpu_of_slot
    for gpus in domains(deployment):
        mask = np.isin(gpu_of_slot, gpus)
        yield gpus, mask, np.bincount(row[mask], minlength=deployment.num_experts)


def capped(num_experts: int, slots: np.ndarray) -> bool:
    """Whether the cap applies to a domain of ``num_experts`` experts on GPUs with ``slots [n]``
    (each > 0): its slots are at most its experts times its GPUs."""
    return int(np.sum(slots)) <= num_experts * len(slots)


def replica_caps(deployment: Deployment, expert_node: np.ndarray) -> np.ndarray:
    """``[L, E]`` int64: the most replicas each expert may have under the cap, per layer: the GPUs
    with slots of its domain where the cap applies there, else the domain's slots (no limit).
    ``expert_node [L, E]``: the node of each expert when ``deployment`` is hierarchical (its
    domain is that node, holding the experts given that node); ignored otherwise (one domain)."""
    topology = deployment.topology
    active = topology.slots_per_gpu > 0
    if not deployment.hierarchical:
        gpus, slots = int(active.sum()), int(topology.num_slots)
        limit = gpus if capped(deployment.num_experts, topology.slots_per_gpu[active]) else slots
        return np.full(np.shape(expert_node), limit, np.int64)
    gpus = np.bincount(topology.node_of_gpu[active], minlength=topology.num_nodes)
    slots = np.asarray(topology.slots_per_node, dtype=np.int64)
    out = np.empty(np.shape(expert_node), np.int64)
    for layer, nodes in enumerate(np.asarray(expert_node)):
        experts = np.bincount(nodes, minlength=topology.num_nodes)
        limit = np.where(slots <= experts * gpus, gpus, slots)  # [N]
        out[layer] = limit[nodes]
    return out


def keeps_rule(replicas: np.ndarray, slots: np.ndarray, doubled: int) -> bool:
    """Whether a domain whose experts have ``replicas [m]`` (each >= 1) on GPUs with ``slots [n]``
    (each > 0), ``doubled`` of them a second (third, ...) replica on a GPU, keeps the rule."""
    if capped(len(replicas), slots) and np.max(replicas) > len(slots):
        return False
    return not doubled or not counts_allow_spread(replicas, slots)


def _doubled_slots(row: np.ndarray, mask: np.ndarray, gpu_of_slot: np.ndarray) -> int:
    return int(mask.sum()) - np.unique(np.stack([gpu_of_slot[mask], row[mask]]), axis=1).shape[1]


def avoidable_doubled(phy2log: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``[L]`` int64: slots of ``phy2log [L, S]`` holding a second (third, ...) replica of an expert
    on one GPU, in the domains that break the rule (0: the plan keeps it)."""
    gpu_of_slot, slots = deployment.topology.gpu_of_slot, deployment.topology.slots_per_gpu
    out = np.zeros(phy2log.shape[0], np.int64)
    for layer, row in enumerate(np.asarray(phy2log)):
        for gpus, mask, counts in _domain_rows(row, deployment):
            doubled = _doubled_slots(row, mask, gpu_of_slot)
            if not keeps_rule(counts[counts > 0], slots[gpus], doubled):
                out[layer] += doubled
    return out


def _arranged(counts: np.ndarray, gpus: np.ndarray, slots: np.ndarray) -> dict[int, np.ndarray]:
    """Each GPU's experts for ``counts [E]`` replicas on ``gpus`` (Ryser's construction): GPUs in
    order of decreasing slots (then index), each takes one replica of each of the experts with the
    most replicas left (then the lowest id), and a second one of those only when fewer experts than
    its slots have replicas left. No expert is twice on a GPU whenever the counts fit spread."""
    left, out = counts.copy(), {}
    ids = np.arange(len(left))
    for g in sorted(gpus.tolist(), key=lambda g: (-int(slots[g]), g)):
        taken = []
        while len(taken) < slots[g]:
            order = np.lexsort((ids, -left))[: slots[g] - len(taken)]
            order = order[left[order] > 0]
            left[order] -= 1
            taken.extend(order.tolist())
        out[g] = np.sort(np.asarray(taken, dtype=np.int64))
    return out


def spread_row(row: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``row [S]`` (a valid ``phy2log`` row) with every domain that breaks the rule rearranged to keep
    it, each expert staying in its domain (groups stay on their node); the other domains are kept.

    A domain that breaks only the spread part keeps its replica counts; one that breaks the cap gets
    counts as equal as possible (``floor`` or ``ceil`` of slots / experts, the extra to the lowest
    ids), which keep the cap and fit spread wherever no GPU has more slots than the domain has
    experts. The loads are not balanced: it is a starting point that keeps the rule, not a plan.
    """
    row = np.array(row, dtype=np.int64)
    offsets, slots = deployment.topology.slot_offsets, deployment.topology.slots_per_gpu
    gpu_of_slot = deployment.topology.gpu_of_slot
    for gpus, mask, counts in _domain_rows(row, deployment):
        present = np.flatnonzero(counts)
        if keeps_rule(counts[present], slots[gpus], _doubled_slots(row, mask, gpu_of_slot)):
            continue
        if capped(len(present), slots[gpus]) and counts.max() > len(gpus):
            total, share = int(counts.sum()), np.zeros_like(counts)
            share[present] = total // len(present)
            share[present[: total % len(present)]] += 1
            counts = share
        for g, experts in _arranged(counts, gpus, slots).items():
            row[offsets[g]:offsets[g + 1]] = experts
    return row


def _uniform_peak(w: np.ndarray, row: np.ndarray, counts: np.ndarray, gpu_of_slot: np.ndarray, num_gpus: int) -> float:
    """The max GPU load of ``row [S]`` under an even split (``counts [E]`` its replica counts)."""
    return float(np.bincount(gpu_of_slot, weights=w[row] / counts[row], minlength=num_gpus).max())


def within_cap(row: np.ndarray, weights: np.ndarray, deployment: Deployment, reference: np.ndarray | None = None):
    """``row [S]`` (a valid ``phy2log`` row) with every expert above its domain's cap brought down to
    it, one replica at a time, or ``None`` when the result still breaks the rule.

    An expert above the cap (the most replicas first, then the lowest id) has a second replica on
    some GPU; one such replica becomes a replica of an expert of the same domain below the cap, not
    on that GPU where one is (else any below the cap), the pair (slot, expert) that leaves the
    lowest max GPU load under an even split for ``weights [E]``, then the fewest slots changed
    against ``reference [S]`` (default ``row``), then the lowest slot and id. Each such change moves
    one slot; the other slots are kept. Deterministic."""
    row = np.array(row, dtype=np.int64)
    reference = row.copy() if reference is None else np.asarray(reference)
    w = np.asarray(weights, dtype=np.float64)
    topology = deployment.topology
    gpu_of_slot, slots = topology.gpu_of_slot, topology.slots_per_gpu
    for gpus, mask, counts in list(_domain_rows(row, deployment)):
        present = np.flatnonzero(counts)
        if not capped(len(present), slots[gpus]):
            continue
        while counts.max() > len(gpus):
            e = int(np.argmax(counts))
            held = np.bincount(gpu_of_slot[mask & (row == e)], minlength=topology.num_gpus)
            best = None
            for s in np.flatnonzero(mask & (row == e) & (held[gpu_of_slot] >= 2)).tolist():
                on_gpu = row[gpu_of_slot == gpu_of_slot[s]]
                below = present[counts[present] < len(gpus)]
                absent = below[~np.isin(below, on_gpu)]
                for f in (absent if absent.size else below).tolist():
                    row[s], counts[e], counts[f] = f, counts[e] - 1, counts[f] + 1
                    key = (_uniform_peak(w, row, np.maximum(counts, 1), gpu_of_slot, topology.num_gpus),
                           int((row != reference).sum()), s, f)
                    row[s], counts[e], counts[f] = e, counts[e] + 1, counts[f] - 1
                    best = key if best is None or key < best else best
            _, _, s, f = best
            row[s], counts[e], counts[f] = f, counts[e] - 1, counts[f] + 1
    return None if avoidable_doubled(row[None], deployment)[0] else row
