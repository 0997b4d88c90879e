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
           "spread_row"]


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
