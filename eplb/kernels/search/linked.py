"""Kernel that lays out replicas as links between GPUs, for engines that dispatch optimally."""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, stable_argsort


@njit(cache=True, nogil=True, error_model="numpy")
def linked_placement(weights, start, gpu_of_slot, slot_offsets, zone_of_gpu):
    """A placement whose redundant replicas link the GPUs of each zone in rings.

    With optimal dispatch, a replicated expert lets load flow between the GPUs holding it, so a
    window whose hot experts differ from the planned ones is served as well as the links allow.
    Per layer and zone (a node when groups stay on their node, else the whole cluster), with
    ``n`` experts and ``m`` slots:

    - the ``m - n`` heaviest experts get two replicas each, on GPUs ``j`` and ``j + 1 + j // Z``
      (mod ``Z``, the zone's GPUs in order): the first ``Z`` form a ring through every GPU, the
      next ``Z`` a ring with stride 2, and so on; a GPU without room passes the replica on to the
      next GPU of the ring;
    - the other experts, heaviest first, go to the least loaded GPU with a free slot (a replica
      counting half its expert's weight).

    A zone's experts are those ``start`` holds there. A layer keeps ``start`` when an expert is in
    two zones or a zone has fewer experts than redundant slots (``m > 2 n``).

    Args:
        weights: ``[L, E]`` float64 planning weights, non-negative.
        start: ``[L, S]`` int64 placement giving each zone its experts.
        gpu_of_slot: ``[S]`` int64; slot_offsets: ``[G + 1]`` int64 first slot of each GPU.
        zone_of_gpu: ``[G]`` int64 zone of each GPU.
    Returns:
        ``phy2log [L, S]`` int64 and ``linked [L]`` bool (whether the layer was laid out).
    """
    num_layers = start.shape[0]
    num_experts = weights.shape[1]
    num_gpus = slot_offsets.shape[0] - 1
    num_zones = 0
    for g in range(num_gpus):
        num_zones = max(num_zones, zone_of_gpu[g] + 1)
    out = start.copy()
    linked = np.zeros(num_layers, np.bool_)
    zone_of_expert = np.empty(num_experts, np.int64)
    fill = np.empty(num_gpus, np.int64)
    load = np.empty(num_gpus)
    gpus = np.empty(num_gpus, np.int64)
    members = np.empty(num_experts, np.int64)
    member_weight = np.empty(num_experts)
    for layer in range(num_layers):
        w = weights[layer]
        one_zone = _zones_of_experts(start[layer], gpu_of_slot, zone_of_gpu, zone_of_expert)
        if not (one_zone and _room_for_links(zone_of_expert, zone_of_gpu, slot_offsets, num_zones)):
            continue
        fill[:] = 0
        load[:] = 0.0
        row = out[layer]
        for zone in range(num_zones):
            num_zone_gpus, room = _zone_gpus(zone, zone_of_gpu, slot_offsets, gpus)
            num_members = _zone_members(zone, zone_of_expert, w, members, member_weight)
            if num_members == 0:
                continue
            order = stable_argsort(member_weight[:num_members])  # heaviest first, ties by index
            num_linked = room - num_members
            for j in range(num_linked):
                e = members[order[j]]
                first = -1
                for step in range(2):
                    position = j if step == 0 else j + 1 + j // num_zone_gpus
                    g = _ring_gpu(gpus, num_zone_gpus, position, first, fill, slot_offsets)
                    row[slot_offsets[g] + fill[g]] = e
                    fill[g] += 1
                    load[g] += 0.5 * w[e]
                    first = g
            for j in range(num_linked, num_members):
                e = members[order[j]]
                best = _least_loaded_gpu(gpus, num_zone_gpus, fill, load, slot_offsets)
                row[slot_offsets[best] + fill[best]] = e
                fill[best] += 1
                load[best] += w[e]
        linked[layer] = True
    return out, linked


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _zones_of_experts(row, gpu_of_slot, zone_of_gpu, zone_of_expert):
    """Write the zone of every expert of the placement ``row [S]`` int64 to ``zone_of_expert [E]``
    (-1: not placed; ``gpu_of_slot [S]``, ``zone_of_gpu [G]`` int64). Returns whether every expert
    lies in one zone."""
    zone_of_expert[:] = -1
    one_zone = True
    for s in range(row.shape[0]):
        e = row[s]
        z = zone_of_gpu[gpu_of_slot[s]]
        if zone_of_expert[e] < 0:
            zone_of_expert[e] = z
        elif zone_of_expert[e] != z:
            one_zone = False
    return one_zone


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _room_for_links(zone_of_expert, zone_of_gpu, slot_offsets, num_zones):
    """Whether every zone has at least as many experts (``zone_of_expert [E]``) as redundant slots:
    its slots (``zone_of_gpu [G]``, ``slot_offsets [G + 1]``) at most twice its experts."""
    for zone in range(num_zones):
        num_members = 0
        for e in range(zone_of_expert.shape[0]):
            if zone_of_expert[e] == zone:
                num_members += 1
        room = 0
        for g in range(slot_offsets.shape[0] - 1):
            if zone_of_gpu[g] == zone:
                room += slot_offsets[g + 1] - slot_offsets[g]
        if room > 2 * num_members:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _zone_gpus(zone, zone_of_gpu, slot_offsets, gpus):
    """Write the GPUs of ``zone`` that have slots to ``gpus[:count]``, in order. Returns ``(count,
    their slots)``."""
    count = 0
    room = 0
    for g in range(slot_offsets.shape[0] - 1):
        if zone_of_gpu[g] == zone and slot_offsets[g + 1] > slot_offsets[g]:
            gpus[count] = g
            count += 1
            room += slot_offsets[g + 1] - slot_offsets[g]
    return count, room


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _zone_members(zone, zone_of_expert, w, members, member_weight):
    """Write the experts of ``zone`` to ``members[:count]`` (increasing) and minus their loads
    (``w [E]``) to ``member_weight[:count]``. Returns ``count``."""
    count = 0
    for e in range(zone_of_expert.shape[0]):
        if zone_of_expert[e] == zone:
            members[count] = e
            member_weight[count] = -w[e]
            count += 1
    return count


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _ring_gpu(gpus, count, position, first, fill, slot_offsets):
    """The GPU of a linked replica at ``position`` of the ring ``gpus[:count]``: the first from there
    with a free slot (``fill [G]`` slots used) other than ``first`` (the GPU of the expert's other
    replica, -1: none), or ``first`` when it is the only one with room."""
    g = first  # every ring has a GPU: the loop sets it
    for hop in range(count):
        g = gpus[(position + hop) % count]
        if fill[g] < slot_offsets[g + 1] - slot_offsets[g] and (g != first or hop == count - 1):
            break
    if fill[g] >= slot_offsets[g + 1] - slot_offsets[g]:  # the replica's own GPU is the only room
        g = first
    return g


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _least_loaded_gpu(gpus, count, fill, load, slot_offsets):
    """The GPU of ``gpus[:count]`` with a free slot (``fill [G]`` slots used) and the least ``load [G]``
    (the first of equals)."""
    best = -1
    for i in range(count):
        g = gpus[i]
        if fill[g] < slot_offsets[g + 1] - slot_offsets[g] and (best < 0 or load[g] < load[best]):
            best = g
    return best
