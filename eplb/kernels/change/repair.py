"""Kernel of re-planning across a deployment change: make a carried placement whole again.

A carried placement (:meth:`eplb.model.change.DeploymentChange.carry`) has holes (``-1``, new slots
that hold nothing yet) and may miss experts (called orphans here: no carried slot holds them). :func:`repair_carried`
places every orphan and fills every hole, one weight copy each, choosing where by the GPU loads
they leave, so the search that follows starts from a valid, already fairly balanced placement
with the fewest copies a re-plan can make.

Shapes: ``L`` layers, ``E`` experts, ``S`` slots, ``G`` GPUs.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, stable_argsort


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _loads(w, row, cnt, gpu_of_slot, x):
    """``x [G]``: each GPU's load, every replica of ``e`` carrying ``w[e] / cnt[e]`` (holes nothing)."""
    x[:] = 0.0
    for s in range(row.shape[0]):
        e = row[s]
        if e >= 0:
            x[gpu_of_slot[s]] += w[e] / cnt[e]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _place_orphan(w, row, e, cnt, x, lay, allowed):
    """The slot for orphan ``e``: a hole, or a slot of an expert with two or more replicas (its
    donor), whichever leaves the lowest load on the GPUs it touches (holes first on ties, then the
    lowest slot). ``lay``: ``(gpu_of_slot, node_of_gpu)``; ``allowed``: the node ``e`` must be on
    (``-1``: any). Returns the slot, ``-1`` if there is none."""
    gpu_of_slot, node_of_gpu = lay
    num_slots = row.shape[0]
    # the two heaviest holders of each expert, to price a donor's other replicas
    num_experts = cnt.shape[0]
    top = np.full((num_experts, 2), -1.0)
    top_gpu = np.full(num_experts, -1, np.int64)
    for s in range(num_slots):
        f = row[s]
        if f < 0:
            continue
        load = x[gpu_of_slot[s]]
        if load > top[f, 0]:
            top[f, 1] = top[f, 0]
            top[f, 0] = load
            top_gpu[f] = gpu_of_slot[s]
        elif load > top[f, 1]:
            top[f, 1] = load
    best, best_value, best_hole = np.int64(-1), np.inf, False
    for s in range(num_slots):
        g = gpu_of_slot[s]
        if allowed >= 0 and node_of_gpu[g] != allowed:
            continue
        f = row[s]
        if f < 0:
            value, hole = x[g] + w[e], True
        elif cnt[f] >= 2:
            others = top[f, 1] if top_gpu[f] == g else top[f, 0]
            gain = w[f] / (cnt[f] - 1) - w[f] / cnt[f]
            value, hole = max(x[g] - w[f] / cnt[f] + w[e], others + gain), False
        else:
            continue
        if value < best_value or (value == best_value and hole and not best_hole):
            best, best_value, best_hole = s, value, hole
    return best


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _fill_hole(w, row, cnt, has, x, lay, expert_node, cap, double):
    """Fill one hole, on the lightest GPU that has one, with a replica of the expert of the
    largest per-replica load it may take (on its node, fewer than ``cap[f]`` replicas, not yet on
    that GPU; with ``double``, a second replica on the GPU when every such expert is there
    already); ``x [G]`` updated. Returns False if no expert may go."""
    gpu_of_slot, node_of_gpu = lay
    hole = np.int64(-1)
    for s in range(row.shape[0]):
        if row[s] < 0 and (hole < 0 or x[gpu_of_slot[s]] < x[gpu_of_slot[hole]]):
            hole = s
    g = gpu_of_slot[hole]
    best, doubled = np.int64(-1), np.int64(-1)
    for f in range(w.shape[0]):
        if (expert_node[f] >= 0 and expert_node[f] != node_of_gpu[g]) or cnt[f] >= cap[f]:
            continue
        # per-replica loads compared as w[f] / cnt[f] > w[b] / cnt[b], without a division per expert
        if has[g, f] == 0 and (best < 0 or w[f] * cnt[best] > w[best] * cnt[f]):
            best = f
        if doubled < 0 or w[f] * cnt[doubled] > w[doubled] * cnt[f]:
            doubled = f
    f = best if best >= 0 else (doubled if double else np.int64(-1))
    if f < 0:
        return False
    row[hole] = f
    before, after = w[f] / cnt[f], w[f] / (cnt[f] + 1)
    cnt[f] += 1
    has[g, f] += 1
    for s in range(row.shape[0]):  # the loads, updated: f's holders give up a share to the new replica
        if row[s] == f:
            x[gpu_of_slot[s]] += after - (before if s != hole else 0.0)
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def repair_carried(weights, carried, gpu_of_slot, node_of_gpu, num_gpus, expert_node, cap, spill):
    """Every orphan placed and every hole filled, per layer.

    Orphans go heaviest first, each to the slot that leaves the lowest load (a hole, or a replica
    of an expert that keeps another); then each remaining hole takes a replica of the expert with
    the largest per-replica load. A slot of ``carried`` holding an expert that ``expert_node`` puts
    on another node becomes a hole first, unless ``spill``: then ``expert_node`` is where an orphan
    goes when that node has room, and an orphan it has no room for goes anywhere (so does a hole
    on a node that is no expert's home). A second replica of
    an expert on one GPU becomes a hole too (the hole is filled with another expert where one may go,
    else with a replica again). A hole never takes an expert that has ``cap`` replicas already (the
    spread rule's cap, :mod:`eplb.planning.spread`: a GPU with more slots than its domain has
    experts must double one, and the expert it doubles must not then take a replica on every other
    GPU too).

    Args:
        weights: ``[L, E]`` float64 loads; carried: ``[L, S]`` int64 with ``-1`` holes.
        gpu_of_slot: ``[S]``; node_of_gpu: ``[G]``; num_gpus: ``G``.
        expert_node: ``[L, E]`` int64, the node each expert must be on (``-1``: any).
        cap: ``[L, E]`` int64, the most replicas a hole may bring each expert to (the GPUs of its
            domain where the rule's cap applies, else the slots).
        spill: bool, orphans may leave their node when it has no room (and carried slots stay).
    Returns:
        ``phy2log [L, S]`` int64 (every expert present) and ``ok [L]`` bool (False: a layer where an
        orphan had no slot on its node; its row is left incomplete).
    """
    num_layers, num_slots = carried.shape
    num_experts = weights.shape[1]
    out = carried.copy()
    ok = np.ones(num_layers, np.bool_)
    cnt = np.zeros(num_experts, np.int64)
    has = np.zeros((num_gpus, num_experts), np.int64)
    x = np.zeros(num_gpus)
    lay = (gpu_of_slot, node_of_gpu)
    anywhere = np.full(num_experts, -1, np.int64)
    for layer in range(num_layers):
        w, row, allowed, most = weights[layer], out[layer], expert_node[layer], cap[layer]
        cnt[:] = 0
        has[:, :] = 0
        for s in range(num_slots):
            e = row[s]
            if e >= 0 and not spill and allowed[e] >= 0 and node_of_gpu[gpu_of_slot[s]] != allowed[e]:
                row[s] = -1
            elif e >= 0 and has[gpu_of_slot[s], e] > 0:
                row[s] = -1  # a second replica on one GPU (a rule the new deployment drops): a hole to fill
            elif e >= 0:
                cnt[e] += 1
                has[gpu_of_slot[s], e] += 1
        _loads(w, row, cnt, gpu_of_slot, x)
        for e in stable_argsort(-w):
            if cnt[e] > 0:
                continue
            s = _place_orphan(w, row, e, cnt, x, lay, allowed[e])
            if s < 0 and spill:
                s = _place_orphan(w, row, e, cnt, x, lay, np.int64(-1))
            if s < 0:
                ok[layer] = False
                break
            f = row[s]
            if f >= 0:
                cnt[f] -= 1
                has[gpu_of_slot[s], f] -= 1
            row[s] = e
            cnt[e] = 1
            has[gpu_of_slot[s], e] = 1
            _loads(w, row, cnt, gpu_of_slot, x)
        if not ok[layer]:
            continue
        holes = 0
        for s in range(num_slots):
            holes += row[s] < 0
        for _ in range(holes):
            # spilled: a hole whose node's experts are all on its GPU takes an expert of another node
            # before a second replica of one on the GPU (issue 47 item 12)
            if not (_fill_hole(w, row, cnt, has, x, lay, allowed, most, False)
                    or (spill and _fill_hole(w, row, cnt, has, x, lay, anywhere, most, False))
                    or _fill_hole(w, row, cnt, has, x, lay, allowed, most, True)
                    or (spill and _fill_hole(w, row, cnt, has, x, lay, anywhere, most, True))):
                ok[layer] = False
                break
    return out, ok
