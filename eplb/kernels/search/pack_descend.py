"""The default placement kernel: replicate, pack spread out, then swap descent, for every layer.

Experts and GPUs are split into *domains* (the whole cluster in global mode, one node per domain
in hierarchical mode); every domain is placed on its own.
"""

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, shared_replicas, stable_argsort
from .local_search import spread_duplicates, swap_descent
from .packing import (PackState, clear_gpus, new_state, pack_spread_by_free_slots, pack_spread_largest_first,
                      recompute_loads, store_state)
from .replication import replicate_capped


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def pack_domain(w, experts, counts, gpus, slots_per_gpu, first_item, pack):
    """Pack ``counts[i]`` replicas of ``experts[i]`` on the slots of ``gpus``: spread largest-first,
    duplicates swapped apart (or, if some remain, a rebuild that spreads every expert whenever the
    counts allow). The caller then runs a descent (:func:`descend`) on the packing.

    Args:
        w: ``[E]`` float64 loads of the layer; experts: ``[n]`` int64; counts: ``[n]`` int64 replicas
            (summing to the slots of ``gpus``); gpus: ``[m]`` int64 GPU ids (with slots).
        slots_per_gpu: ``[G]`` int64; first_item: first free replica id in the item arrays.
        pack: the :class:`eplb.kernels.search.packing.PackState` (``gpu_fill``/``gpu_load``/``holds`` of
            ``gpus`` must be zero on entry).
    Returns:
        the next free replica id.
    """
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    item = first_item
    # heaviest expert first, so that ties below do not depend on how the experts are numbered
    for i in stable_argsort(-w[experts]):
        e = experts[i]
        for _ in range(counts[i]):
            item_expert[item] = e
            item_load[item] = w[e] / counts[i]
            item += 1
    items = first_item + stable_argsort(-item_load[first_item:item])
    pack_spread_largest_first(item_load, item_expert, items, gpus, slots_per_gpu, gpu_items, gpu_fill, gpu_load,
                              holds)
    spread_duplicates(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds)
    if shared_replicas(gpus, gpu_items, gpu_fill, item_expert, holds) > 0:
        # rare (uneven slots, few GPUs): rebuild expert by expert, which spreads whenever possible
        clear_gpus(gpus, item_expert, gpu_items, gpu_fill, gpu_load, holds)
        pack_spread_by_free_slots(item_load, item_expert, first_item + np.arange(item - first_item), gpus,
                                  slots_per_gpu, gpu_items, gpu_fill, gpu_load, holds)
    return item


@njit(cache=True, nogil=True, error_model="numpy")
def descend(pack, gpus, max_steps):
    """Swap descent on a packing of ``gpus`` in the :class:`eplb.kernels.search.packing.PackState` ``pack``
    (:func:`eplb.kernels.search.local_search.swap_descent`, at most ``max_steps`` swaps), then the GPU
    loads summed afresh.

    Kept apart from :func:`pack_domain`: a kernel compiles every kernel its body calls, and the
    pair-swap descent that :mod:`eplb.kernels.search.multistart` runs instead is not compiled on the
    default path.
    """
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps)
    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)


@njit(cache=True, nogil=True, error_model="numpy")
def domain_slots(gpus, slots_per_gpu):
    """Slots of the listed GPUs."""
    total = np.int64(0)  # int64, as the slot counts it sums
    for gi in range(gpus.shape[0]):
        total += slots_per_gpu[gpus[gi]]
    return total


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _layout_state(slots_per_gpu, num_layers, num_experts):
    """``(slot_offsets [G + 1], phy2log [L, S] (unfilled), pack)``: where each GPU's slots start,
    the placement to fill and an empty :class:`eplb.kernels.search.packing.PackState` sized for
    ``slots_per_gpu [G]``."""
    num_gpus = slots_per_gpu.shape[0]
    width = np.int64(1)
    slot_offsets = np.zeros(num_gpus + 1, np.int64)
    for g in range(num_gpus):
        width = max(width, slots_per_gpu[g])
        slot_offsets[g + 1] = slot_offsets[g] + slots_per_gpu[g]
    num_slots = slot_offsets[num_gpus]
    phy2log = np.empty((num_layers, num_slots), np.int64)
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = new_state(num_slots, num_gpus, width, num_experts)
    return slot_offsets, phy2log, PackState(item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)


@njit(cache=True, nogil=True, error_model="numpy")
def balanced_placement(weights, slots_per_gpu, gpu_domain, expert_domain, max_steps):
    """Place every layer, each domain on its own.

    Args:
        weights: ``[L, E]`` float64 loads.
        slots_per_gpu: ``[G]`` int64 (0 = masked GPU).
        gpu_domain: ``[G]`` int64 domain of each GPU.
        expert_domain: ``[L, E]`` int64 domain of each expert in each layer; every domain with
            slots holds at least one expert and at most as many experts as slots.
        max_steps: most swaps of the descent per layer and domain.
    Returns:
        ``phy2log [L, S]`` int64.
    """
    num_layers, num_experts = weights.shape
    num_gpus = slots_per_gpu.shape[0]
    # typed int64 from the start: a literal 0 or 1 here would make the type inference compile the
    # callees once more for the literal while it settles the variable's type
    num_domains = np.int64(0)
    for g in range(num_gpus):
        num_domains = max(num_domains, gpu_domain[g] + 1)
    slot_offsets, phy2log, pack = _layout_state(slots_per_gpu, num_layers, num_experts)
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    domain_gpus = []
    for d in range(num_domains):
        domain_gpus.append(np.where((gpu_domain == d) & (slots_per_gpu > 0))[0].astype(np.int64))
    for layer in range(num_layers):
        gpu_fill[:] = 0
        gpu_load[:] = 0.0
        holds[:, :] = 0
        item = np.int64(0)  # not the literal 0: one compiled specialization of pack_domain
        for d in range(num_domains):
            gpus = domain_gpus[d]
            if gpus.shape[0] == 0:
                continue
            experts = np.where(expert_domain[layer] == d)[0].astype(np.int64)
            # capped D'Hondt replication of the domain's experts over its slots, then pack_domain (called
            # from here, not through a helper: each kernel level re-optimises its callees when compiled)
            counts = np.empty(experts.shape[0], np.int64)
            replicate_capped(weights[layer], experts, domain_slots(gpus, slots_per_gpu), gpus.shape[0], counts)
            item = pack_domain(weights[layer], experts, counts, gpus, slots_per_gpu, item, pack)
            descend(pack, gpus, max_steps)
        store_state(item_expert, gpu_items, gpu_fill, slot_offsets, phy2log[layer])
    return phy2log


@njit(cache=True, nogil=True, error_model="numpy")
def place_node_counts(weights, node_count, slots_per_gpu, gpu_domain, max_steps):
    """Place given replicas node by node: ``node_count [L, N, E]`` int64 replicas of each expert on
    each node (a node's sum is its slots), each carrying ``w / r`` of its expert's tokens, ``r``
    its replicas over all nodes (an even split); every node packed as :func:`balanced_placement`
    packs a domain, then swap descent.

    ``weights [L, E]`` float64, ``slots_per_gpu [G]`` int64, ``gpu_domain [G]`` int64 the node of
    each GPU, ``max_steps`` most swaps per layer and node. Returns ``phy2log [L, S]`` int64.
    """
    num_layers, num_nodes, num_experts = node_count.shape
    num_gpus = slots_per_gpu.shape[0]
    slot_offsets, phy2log, pack = _layout_state(slots_per_gpu, num_layers, num_experts)
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    for layer in range(num_layers):
        gpu_fill[:] = 0
        gpu_load[:] = 0.0
        holds[:, :] = 0
        item = np.int64(0)
        total = np.zeros(num_experts, np.int64)
        for n in range(num_nodes):
            total += node_count[layer, n]
        for n in range(num_nodes):
            gpus = np.where((gpu_domain == n) & (slots_per_gpu > 0))[0].astype(np.int64)
            if gpus.shape[0] == 0:
                continue
            experts = np.where(node_count[layer, n] > 0)[0].astype(np.int64)
            counts = node_count[layer, n][experts].copy()
            # the node's share of each expert's tokens: its replicas then carry w / r each
            share = np.zeros(num_experts)
            for i in range(experts.shape[0]):
                e = experts[i]
                share[e] = weights[layer, e] * counts[i] / total[e]
            item = pack_domain(share, experts, counts, gpus, slots_per_gpu, item, pack)
            descend(pack, gpus, max_steps)
        store_state(item_expert, gpu_items, gpu_fill, slot_offsets, phy2log[layer])
    return phy2log
