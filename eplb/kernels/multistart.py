"""Kernels of the ``best`` method: a seeded search over replications, each packed and improved.

From a start placement, every layer and domain tries ``num_starts`` replications, each one or a
few replicas moved from one expert to another (a donor with several replicas, a receiver drawn
by load per replica), packs each with :func:`eplb.kernels.balanced.pack_domain` and keeps it when
the domain's heaviest GPU gets lighter
(and no more replicas share a GPU with their expert). The best packing then gets a pair-swap descent. The random
numbers come from a fixed-seed generator, so the result is deterministic.
"""

import numpy as np
from numba import njit

from .balanced import _shared, domain_slots, pack_domain
from .local_search import pair_swap_descent
from .packing import clear_gpus, load_state, new_state, recompute_loads, store_state

_MASK = (1 << 64) - 1


@njit(cache=True, nogil=True)
def _next(state):
    """splitmix64 step: returns a float in [0, 1) and advances ``state[0]``."""
    state[0] = (state[0] + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = state[0]
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True, nogil=True)
def _domain_max(gpus, gpu_load):
    top = 0.0
    for gi in range(gpus.shape[0]):
        top = max(top, gpu_load[gpus[gi]])
    return top


@njit(cache=True, nogil=True)
def _perturb(w, experts, counts, cap, moves, state):
    """Move ``moves`` replicas from donors (``counts >= 2``) to receivers (``counts < cap``, drawn
    with probability proportional to load per replica). Returns False when no move is possible."""
    n = experts.shape[0]
    for _ in range(moves):
        donors = 0
        total = 0.0
        for i in range(n):
            if counts[i] >= 2:
                donors += 1
            if counts[i] < cap:
                total += w[experts[i]] / counts[i]
        if donors == 0 or total <= 0.0:
            return False
        pick = int(_next(state) * donors)
        donor = -1
        for i in range(n):
            if counts[i] >= 2:
                if pick == 0:
                    donor = i
                    break
                pick -= 1
        target = _next(state) * total
        receiver = -1
        for i in range(n):
            if counts[i] < cap and i != donor:
                receiver = i
                target -= w[experts[i]] / counts[i]
                if target <= 0.0:
                    break
        if receiver < 0:
            return False
        counts[donor] -= 1
        counts[receiver] += 1
    return True


@njit(cache=True, nogil=True)
def best_placement(weights, slots_per_gpu, gpu_domain, start, num_starts, max_steps, seed, pair_swaps):
    """Improve ``start`` layer by layer (module docstring).

    Args:
        weights: ``[L, E]`` float64; slots_per_gpu: ``[G]`` int64; gpu_domain: ``[G]`` int64.
        start: ``[L, S]`` int64 placement to improve; each expert's replicas lie in one domain.
        num_starts: replications tried per layer and domain; max_steps: most swaps per descent.
        seed: seed of the generator; pair_swaps: finish with :func:`pair_swap_descent` (slower).
    Returns:
        ``phy2log [L, S]`` int64 whose max load per layer and domain is never above ``start``'s.
    """
    num_layers, num_experts = weights.shape
    num_gpus = slots_per_gpu.shape[0]
    num_slots = start.shape[1]
    width = 1
    num_domains = 0
    for g in range(num_gpus):
        width = max(width, slots_per_gpu[g])
        num_domains = max(num_domains, gpu_domain[g] + 1)
    slot_offsets = np.zeros(num_gpus + 1, np.int64)
    for g in range(num_gpus):
        slot_offsets[g + 1] = slot_offsets[g] + slots_per_gpu[g]
    out = start.copy()
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = new_state(num_slots, num_gpus, width, num_experts)
    best_expert = np.empty(num_slots, np.int64)
    state = np.zeros(1, np.uint64)
    counts_all = np.zeros(num_experts, np.int64)
    for layer in range(num_layers):
        w = weights[layer]
        state[0] = np.uint64(seed) * np.uint64(1000003) + np.uint64(layer)
        counts_all[:] = 0
        for s in range(num_slots):
            counts_all[start[layer, s]] += 1
        for d in range(num_domains):
            gpus = np.where((gpu_domain == d) & (slots_per_gpu > 0))[0].astype(np.int64)
            if gpus.shape[0] == 0:
                continue
            # the domain's experts: those in its slots
            seen = np.zeros(num_experts, np.bool_)
            for gi in range(gpus.shape[0]):
                g = gpus[gi]
                for s in range(slot_offsets[g], slot_offsets[g + 1]):
                    seen[start[layer, s]] = True
            experts = np.where(seen)[0].astype(np.int64)
            # heaviest first: the search then does not depend on how the experts are numbered
            experts = experts[np.argsort(-w[experts], kind="mergesort")]
            best_counts = counts_all[experts].copy()
            load_state(out[layer], w, slot_offsets, item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)
            best_max = _domain_max(gpus, gpu_load)
            best_shared = _shared(gpus, gpu_items, gpu_fill, item_expert, holds)
            for gi in range(gpus.shape[0]):
                g = gpus[gi]
                for s in range(slot_offsets[g], slot_offsets[g + 1]):
                    best_expert[s] = out[layer, s]
            cap = gpus.shape[0]
            while cap * experts.shape[0] < domain_slots(gpus, slot_offsets[1:] - slot_offsets[:-1]):
                cap += gpus.shape[0]
            for trial in range(num_starts):
                counts = best_counts.copy()
                if trial > 0 and not _perturb(w, experts, counts, cap, 1 + trial % 3, state):
                    break
                clear_gpus(gpus, item_expert, gpu_items, gpu_fill, gpu_load, holds)
                # first_item an int64 and pair_swaps=False given as balanced_placement passes them: one
                # compiled specialization of pack_domain
                pack_domain(w, experts, counts, gpus, slots_per_gpu, np.int64(0), item_expert, item_load, gpu_items,
                            gpu_fill, gpu_load, holds, max_steps, False)
                top = _domain_max(gpus, gpu_load)
                if top < best_max * (1.0 - 1e-12) and _shared(gpus, gpu_items, gpu_fill, item_expert,
                                                               holds) <= best_shared:
                    best_max = top
                    for i in range(counts.shape[0]):  # not best_counts[:] = counts: see hierarchy._copy
                        best_counts[i] = counts[i]
                    for gi in range(gpus.shape[0]):
                        g = gpus[gi]
                        for j in range(gpu_fill[g]):
                            best_expert[slot_offsets[g] + j] = item_expert[gpu_items[g, j]]
            # pair swaps on the best packing found
            if not pair_swaps:
                for gi in range(gpus.shape[0]):
                    g = gpus[gi]
                    for s in range(slot_offsets[g], slot_offsets[g + 1]):
                        out[layer, s] = best_expert[s]
                continue
            for gi in range(gpus.shape[0]):
                g = gpus[gi]
                for s in range(slot_offsets[g], slot_offsets[g + 1]):
                    out[layer, s] = best_expert[s]
            load_state(out[layer], w, slot_offsets, item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)
            pair_swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps)
            recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)
            if _domain_max(gpus, gpu_load) <= best_max:
                store_state(item_expert, gpu_items, gpu_fill, slot_offsets, out[layer])
    return out
