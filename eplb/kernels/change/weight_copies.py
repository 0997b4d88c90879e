"""Kernels of transfer plans: which old slot each new replica's weights are copied from (or host
memory, across a deployment change)."""

import numpy as np
from numba import njit

INTRA_GPU, INTRA_NODE, CROSS_NODE, FROM_HOST = 0, 1, 2, 3


@njit(cache=True, nogil=True, error_model="numpy")
def weight_copies(old, new, gpu_of_slot, node_of_gpu, num_gpus, num_experts):
    """The weight copies that turn placement ``old`` into ``new``.

    A slot whose expert is unchanged needs nothing. Otherwise its expert's weights come from a
    slot holding that expert under ``old``: on the same GPU if there is one, else on the same node,
    else on another node; among candidates of one kind, the GPU that has sent the fewest copies of
    this layer so far (lowest slot first on ties), so that senders share the work.

    Args:
        old, new: ``[L, S]`` int64 placements on one topology.
        gpu_of_slot: ``[S]``; node_of_gpu: ``[G]``.
    Returns:
        ``copies [C, 6]`` int64 rows ``(layer, expert, src_slot, dst_slot, src_gpu, dst_gpu)`` in
        layer then destination-slot order, and ``kind [C]`` int64 (0 intra-GPU, 1 intra-node,
        2 cross-node).
    """
    num_layers, num_slots = old.shape
    width = num_slots - num_experts + 1
    total = 0
    for layer in range(num_layers):
        for s in range(num_slots):
            if old[layer, s] != new[layer, s]:
                total += 1
    copies = np.empty((total, 6), np.int64)
    kind = np.empty(total, np.int64)
    held = np.zeros(num_experts, np.int64)
    slots_of = np.empty((num_experts, width), np.int64)
    sends = np.zeros(num_gpus, np.int64)
    c = 0
    for layer in range(num_layers):
        held[:] = 0
        sends[:] = 0
        for s in range(num_slots):
            e = old[layer, s]
            slots_of[e, held[e]] = s
            held[e] += 1
        for d in range(num_slots):
            e = new[layer, d]
            if e == old[layer, d]:
                continue
            dst_gpu = gpu_of_slot[d]
            dst_node = node_of_gpu[dst_gpu]
            best = -1
            best_kind = 3
            for i in range(held[e]):
                s = slots_of[e, i]
                g = gpu_of_slot[s]
                k = INTRA_GPU if g == dst_gpu else (INTRA_NODE if node_of_gpu[g] == dst_node else CROSS_NODE)
                if k < best_kind or (k == best_kind and k != INTRA_GPU and sends[g] < sends[gpu_of_slot[best]]):
                    best = s
                    best_kind = k
            src_gpu = gpu_of_slot[best]
            if best_kind != INTRA_GPU:
                sends[src_gpu] += 1
            copies[c, 0] = layer
            copies[c, 1] = e
            copies[c, 2] = best
            copies[c, 3] = d
            copies[c, 4] = src_gpu
            copies[c, 5] = dst_gpu
            kind[c] = best_kind
            c += 1
    return copies, kind


@njit(cache=True, nogil=True, error_model="numpy")
def copies_across(carried, new, given_up, given_up_gpu, slot_map, gpu_of_slot, node_of_gpu, num_gpus, num_experts):
    """The weight copies that turn a placement carried across a deployment change into ``new``.

    As :func:`weight_copies`, with ``carried`` holding ``-1`` holes: a slot needs nothing when it
    keeps its carried expert; else its expert comes from a slot of the placement in service holding
    it, a carried slot or one a surviving GPU gives up (same GPU, then node, then another node, the
    least busy sender first; a carried slot on ties); an expert neither holds (an orphan) is loaded
    from host memory into its first new slot (:data:`FROM_HOST`), and its other new slots copy from
    that one, after the load.

    Args:
        carried, new: ``[L, S]`` int64 on the new topology (``carried`` with ``-1`` holes).
        given_up: ``[L, S_old]`` int64, the expert of each old slot a surviving GPU gives up (``-1``
            elsewhere); given_up_gpu: ``[S_old]`` the new GPU of each old slot (``-1``: lost).
        slot_map: ``[S]`` the old slot each new slot keeps (``-1``: none).
        gpu_of_slot: ``[S]``; node_of_gpu: ``[G]`` (new topology).
    Returns:
        ``copies [C, 8]`` int64 rows ``(layer, expert, src_slot, dst_slot, src_gpu, dst_gpu,
        after_load, src_old_slot)`` in layer then destination-slot order: ``src_slot`` the new slot
        read (``-1``: host memory or a given-up slot), ``after_load`` 1 when that slot is filled by a
        load from host of this plan, ``src_old_slot`` the slot of the placement in service read
        (``-1``: host memory or a slot this plan loads); and ``kind [C]`` int64 (0-2 as
        :func:`weight_copies`, 3 from host).
    """
    num_layers, num_slots = carried.shape
    old_slots = given_up.shape[1]
    total = 0
    for layer in range(num_layers):
        for s in range(num_slots):
            if carried[layer, s] != new[layer, s]:
                total += 1
    copies = np.empty((total, 8), np.int64)
    kind = np.empty(total, np.int64)
    held = np.zeros(num_experts, np.int64)
    slots_of = np.empty((num_experts, num_slots + old_slots), np.int64)  # new slots, then num_slots + old slot
    loaded = np.empty(num_experts, np.int64)
    sends = np.zeros(num_gpus, np.int64)
    c = 0
    for layer in range(num_layers):
        held[:] = 0
        sends[:] = 0
        loaded[:] = -1
        for s in range(num_slots):
            e = carried[layer, s]
            if e >= 0:
                slots_of[e, held[e]] = s
                held[e] += 1
        for o in range(old_slots):
            e = given_up[layer, o]
            if e >= 0:
                slots_of[e, held[e]] = num_slots + o
                held[e] += 1
        for d in range(num_slots):
            e = new[layer, d]
            if e == carried[layer, d]:
                continue
            dst_gpu = gpu_of_slot[d]
            dst_node = node_of_gpu[dst_gpu]
            best, best_gpu, best_kind, after = np.int64(-1), np.int64(-1), np.int64(FROM_HOST), 0
            for i in range(held[e]):
                s = slots_of[e, i]
                g = gpu_of_slot[s] if s < num_slots else given_up_gpu[s - num_slots]
                k = INTRA_GPU if g == dst_gpu else (INTRA_NODE if node_of_gpu[g] == dst_node else CROSS_NODE)
                if k < best_kind or (k == best_kind and k != INTRA_GPU and sends[g] < sends[best_gpu]):
                    best, best_gpu, best_kind = s, g, k
            if best < 0 and loaded[e] >= 0:  # an orphan's further replicas: from its loaded slot
                best, after = loaded[e], 1
                best_gpu = gpu_of_slot[best]
                best_kind = INTRA_GPU if best_gpu == dst_gpu else (
                    INTRA_NODE if node_of_gpu[best_gpu] == dst_node else CROSS_NODE)
            elif best < 0:
                loaded[e] = d
            if best_kind == INTRA_NODE or best_kind == CROSS_NODE:
                sends[best_gpu] += 1
            src_new, src_old = np.int64(-1), np.int64(-1)
            if best >= num_slots:
                src_old = best - num_slots
            elif best >= 0:
                src_new = best
                src_old = -1 if after else slot_map[best]
            copies[c, 0], copies[c, 1], copies[c, 2], copies[c, 3] = layer, e, src_new, d
            copies[c, 4], copies[c, 5], copies[c, 6], copies[c, 7] = best_gpu, dst_gpu, after, src_old
            kind[c] = best_kind
            c += 1
    return copies, kind
