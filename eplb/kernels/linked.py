"""Kernel that lays out replicas as links between GPUs, for engines that dispatch optimally."""

import numpy as np
from numba import njit

from .common import stable_argsort


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
    num_layers, num_slots = start.shape
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
        zone_of_expert[:] = -1
        ok = True
        for s in range(num_slots):
            e = start[layer, s]
            z = zone_of_gpu[gpu_of_slot[s]]
            if zone_of_expert[e] < 0:
                zone_of_expert[e] = z
            elif zone_of_expert[e] != z:
                ok = False
        for zone in range(num_zones):
            num_members = 0
            for e in range(num_experts):
                if zone_of_expert[e] == zone:
                    members[num_members] = e
                    num_members += 1
            room = 0
            for g in range(num_gpus):
                if zone_of_gpu[g] == zone:
                    room += slot_offsets[g + 1] - slot_offsets[g]
            if room > 2 * num_members:
                ok = False
        if not ok:
            continue
        fill[:] = 0
        load[:] = 0.0
        row = out[layer]
        for zone in range(num_zones):
            num_zone_gpus = 0
            room = 0
            for g in range(num_gpus):
                if zone_of_gpu[g] == zone and slot_offsets[g + 1] > slot_offsets[g]:
                    gpus[num_zone_gpus] = g
                    num_zone_gpus += 1
                    room += slot_offsets[g + 1] - slot_offsets[g]
            num_members = 0
            for e in range(num_experts):
                if zone_of_expert[e] == zone:
                    members[num_members] = e
                    member_weight[num_members] = -w[e]
                    num_members += 1
            if num_members == 0:
                continue
            order = stable_argsort(member_weight[:num_members])  # heaviest first, ties by index
            num_linked = room - num_members
            for j in range(num_linked):
                e = members[order[j]]
                first = -1
                for step in range(2):
                    position = j if step == 0 else j + 1 + j // num_zone_gpus
                    for hop in range(num_zone_gpus):
                        g = gpus[(position + hop) % num_zone_gpus]
                        if fill[g] < slot_offsets[g + 1] - slot_offsets[g] and (g != first or hop == num_zone_gpus - 1):
                            break
                    if fill[g] >= slot_offsets[g + 1] - slot_offsets[g]:  # the replica's own GPU is the only room
                        g = first
                    row[slot_offsets[g] + fill[g]] = e
                    fill[g] += 1
                    load[g] += 0.5 * w[e]
                    first = g
            for j in range(num_linked, num_members):
                e = members[order[j]]
                best = -1
                for i in range(num_zone_gpus):
                    g = gpus[i]
                    if fill[g] < slot_offsets[g + 1] - slot_offsets[g] and (best < 0 or load[g] < load[best]):
                        best = g
                row[slot_offsets[best] + fill[best]] = e
                fill[best] += 1
                load[best] += w[e]
        linked[layer] = True
    return out, linked
