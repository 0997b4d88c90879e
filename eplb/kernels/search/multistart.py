"""Kernels of the ``best`` method: a search over replications, each packed and improved.

From a start placement, every layer and domain first tries the *aligned* replications of
:func:`aligned_counts` (the heavy experts get a multiple of the domain's GPUs in replicas, so every
GPU can carry the same number of heavy replicas) and the :func:`light_split` variants of those
and of the start (the light experts' extra replicas moved to the lightest), then ``num_starts`` seeded ones, each one or a
few replicas moved from one expert to another (a donor with several replicas, a receiver drawn
by load per replica); it packs each with :func:`eplb.kernels.search.pack_descend.pack_domain` and keeps it
when the domain's heaviest GPU gets lighter (and no more replicas share a GPU with their
expert). The best packing then gets a pair-swap descent. The random numbers come from a
fixed-seed generator, so the result is deterministic."""

from collections import namedtuple

import numpy as np
from numba import njit

from ..plumbing.common import INTERNAL, shared_replicas, stable_argsort
from .pack_descend import descend, domain_slots, pack_domain
from .local_search import pair_swap_descent
from .packing import PackState, clear_gpus, load_state, new_state, recompute_loads, store_state

_MASK = (1 << 64) - 1

# Named values of best_placement's arguments, for callers (passed positionally: plain ints and
# bools, so the compiled specializations are the ones literals get)
NO_STARTS = 0  # num_starts: no seeded replications (the aligned and light-split ones only)
SEED = 0  # seed: the generator's stream when the caller has no seed of its own
PAIR_SWAPS, NO_PAIR_SWAPS = True, False  # pair_swaps: finish each domain with pair_swap_descent, or not
NO_MOVES = 0  # MoveSearch's experts and passes: no rounds of replica moves

MoveSearch = namedtuple("MoveSearch", ["experts", "passes", "threshold"])
MoveSearch.__doc__ = """best_placement's replica moves: up to ``passes`` rounds (int) of moves between the
``experts`` (int) heaviest experts of a domain, on the layers whose domain's heaviest GPU is above
``threshold [L]`` float64."""

Domain = namedtuple("Domain", ["gpus", "slots_per_gpu", "slot_offsets", "first_item", "max_steps"])
Domain.__doc__ = """One domain being packed: ``gpus [g]`` int64 its GPUs, ``slots_per_gpu [G]`` and
``slot_offsets [G + 1]`` int64 of every GPU, ``first_item`` the id of the domain's first replica
(int64), ``max_steps`` the most swaps per descent."""

Kept = namedtuple("Kept", ["counts", "expert", "shared"])
Kept.__doc__ = """The best packing of a domain so far: ``counts [n]`` int64 its replication (the
domain's experts heaviest first), ``expert [S]`` int64 the expert of every slot of the domain's GPUs,
``shared`` the replicas it puts on a GPU with another replica of their expert (int64)."""


@njit(cache=True, nogil=True, error_model="numpy")
def _next(state):
    """splitmix64 step: returns a float in [0, 1) and advances ``state[0]``."""
    state[0] = (state[0] + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = state[0]
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True, nogil=True, error_model="numpy")
def _domain_max(gpus, gpu_load):
    top = 0.0
    for gi in range(gpus.shape[0]):
        top = max(top, gpu_load[gpus[gi]])
    return top


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
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


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _apportion(w, experts, first, last, seats, cap, counts):
    """D'Hondt: ``seats`` replicas over ``experts[first:last]`` (one each, then one at a time to the
    largest load per replica, at most ``cap`` each), written to ``counts[first:last]``. Returns False
    when the seats do not fit (fewer than the experts, or more than ``cap`` each)."""
    n = last - first
    if seats < n or seats > cap * n or n <= 0:
        return False
    for i in range(first, last):
        counts[i] = 1
    for _ in range(seats - n):
        best = -1
        best_load = -1.0
        for i in range(first, last):
            if counts[i] < cap:
                load = w[experts[i]] / counts[i]
                if load > best_load:
                    best = i
                    best_load = load
        counts[best] += 1
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def aligned_counts(w, experts, counts, num_slots, num_gpus, cap, wide, candidates):
    """Replications whose heavy replicas spread evenly over the GPUs of a domain.

    A replication that minimises the largest replica (D'Hondt) can leave, say, 11 heavy replicas
    for 8 GPUs: three GPUs then carry two, whatever the packing. Each candidate takes the ``t``
    heaviest experts as the *heavy tier* and gives them exactly ``j * num_gpus`` replicas (D'Hondt
    within the tier, so every GPU can take ``j`` heavy replicas of similar load) and the other
    experts the remaining slots (D'Hondt). The tier: the experts up to the last one with several
    replicas in ``counts``; ``j``: the largest multiple of ``num_gpus`` not above the tier's current
    replica count. Before it, the tier that leaves every other expert one replica
    (``t = j * num_gpus - (num_slots - n)``, the smallest ``j`` that gives a new replication). With
    ``wide`` (more time): the three smallest such ``j``, tiers of two experts fewer to two more than
    the first, and the next multiple.

    Args:
        w: ``[E]`` float64 loads; experts: ``[n]`` int64, heaviest first; counts: ``[n]`` int64 the
            current replication (summing to ``num_slots``); cap: most replicas of one expert.
        wide: try the thirteen tiers and multiples, not only two.
        candidates: ``[c, n]`` int64 output rows (``c >= 13`` for every candidate when ``wide``).
    Returns:
        the number of candidate rows written (each differs from ``counts`` and from the others).
    """
    n = experts.shape[0]
    total = 0.0
    for i in range(n):
        total += w[experts[i]]
    if total <= 0.0 or num_gpus < 2:
        return 0
    heavy = 0  # the experts up to the last one with several replicas
    for i in range(n):
        if counts[i] >= 2:
            heavy = i + 1
    found = np.int64(0)  # not the literal 0: _add_candidate then has one compiled specialization
    row = np.empty(n, np.int64)
    # every expert outside the tier keeps one replica: the tier is then t = j * num_gpus - (num_slots - n)
    # experts for a multiple j (with near-uniform loads, 24 experts x 3 replicas fill 72 GPUs one each,
    # where D'Hondt's 48 x 2 leave 24 GPUs with two)
    spare = num_slots - n
    for j in range(1, num_slots // num_gpus + 1):
        t = j * num_gpus - spare
        if t < 1 or t >= n:
            continue
        found = _add_candidate(w, experts, counts, t, j * num_gpus, num_slots, cap, row, candidates, found)
        if found >= (3 if wide else 1):
            break  # the narrowest tiers only: the heaviest experts take the spare slots
    spread = 2 if wide else 0
    for dt in range(-spread, spread + 1):
        t = heavy + dt
        if t < 1 or t >= n:
            continue
        items = 0
        for i in range(t):
            items += counts[i]
        low = max(1, items // num_gpus)
        for j in range(low, low + (2 if wide else 1)):
            if found >= candidates.shape[0]:
                return found
            found = _add_candidate(w, experts, counts, t, j * num_gpus, num_slots, cap, row, candidates, found)
    return found


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _add_candidate(w, experts, counts, t, seats, num_slots, cap, row, candidates, found):
    """Append the replication giving ``seats`` replicas to the ``t`` heaviest experts and the rest to
    the others (D'Hondt in each) to ``candidates`` unless it does not fit, equals ``counts`` or is
    already there. Returns the new number of candidates."""
    n = experts.shape[0]
    if found >= candidates.shape[0]:
        return found
    if not _apportion(w, experts, np.int64(0), t, seats, cap, row):  # not the literal 0: one specialization
        return found
    if not _apportion(w, experts, t, n, num_slots - seats, cap, row):
        return found
    same = True
    for i in range(n):
        if row[i] != counts[i]:
            same = False
            break
    if same:
        return found
    for c in range(found):
        same = True
        for i in range(n):
            if candidates[c, i] != row[i]:
                same = False
                break
        if same:
            return found
    for i in range(n):
        candidates[found, i] = row[i]
    return found + 1


@njit(cache=True, nogil=True, error_model="numpy")
def light_split(w, experts, counts, level, row):
    """The replication ``counts`` with the extra replicas of the light experts (load ``<= level``,
    the domain's mean GPU load) moved to the lightest experts, one each, written to ``row``.

    The largest-load-per-replica rule splits the heaviest of the light experts first, and their
    halves, kept apart (one replica of an expert per GPU), land on the GPUs of the hot experts'
    replicas, where the room left is smaller than such a half (one hot expert with ~40% of the load:
    ``bench/quality.py``, Zipf 1.5). Splitting the lightest experts instead makes fillers that fit
    anywhere. Args: ``experts [n]`` heaviest first, ``counts [n]``, ``row [n]`` int64.
    Returns: whether ``row`` differs from ``counts``.
    """
    n = experts.shape[0]
    moved = 0
    for i in range(n):
        row[i] = counts[i]
        if counts[i] > 1 and w[experts[i]] <= level:
            moved += counts[i] - 1
            row[i] = 1
    first_light = n  # experts heaviest first: the light ones are the last
    while first_light > 0 and w[experts[first_light - 1]] <= level:
        first_light -= 1
    i = n - 1
    while moved > 0:  # at most as many as the light experts held beyond one: none passes the cap
        row[i] += 1
        moved -= 1
        i = i - 1 if i > first_light else n - 1
    for i in range(n):
        if row[i] != counts[i]:
            return True
    return False


@njit(cache=True, nogil=True, error_model="numpy")
def _is_new(row, n, counts, rows, found):
    """Whether ``row[:n]`` differs from ``counts[:n]`` and from ``rows[:found, :n]``."""
    for c in range(-1, found):
        same = True
        for i in range(n):
            if row[i] != (counts[i] if c < 0 else rows[c, i]):
                same = False
                break
        if same:
            return False
    return True


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pack_and_keep(w, experts, counts, domain, pack, kept, best_max):
    """Pack the replication ``counts`` on the :class:`Domain`'s GPUs (:func:`eplb.kernels.search.pack_descend.pack_domain`,
    in the :class:`eplb.kernels.search.packing.PackState` ``pack``) and keep it in ``kept.counts`` / ``kept.expert`` (a
    :class:`Kept`) when the domain's heaviest GPU is lighter than ``best_max`` and no more replicas
    share a GPU with their expert than ``kept.shared``. Returns the best max load."""
    gpus, slots_per_gpu, slot_offsets, first_item, max_steps = domain
    item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = pack
    best_counts, best_expert, best_shared = kept
    clear_gpus(gpus, item_expert, gpu_items, gpu_fill, gpu_load, holds)
    pack_domain(w, experts, counts, gpus, slots_per_gpu, first_item, pack)
    descend(pack, gpus, max_steps)
    top = _domain_max(gpus, gpu_load)
    if top < best_max * (1.0 - 1e-12) and shared_replicas(gpus, gpu_items, gpu_fill, item_expert, holds) <= best_shared:
        for i in range(counts.shape[0]):  # not best_counts[:] = counts: see hierarchy._copy
            best_counts[i] = counts[i]
        for gi in range(gpus.shape[0]):
            g = gpus[gi]
            for j in range(gpu_fill[g]):
                best_expert[slot_offsets[g] + j] = item_expert[gpu_items[g, j]]
        return top
    return best_max


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _move_descent(w, experts, first_base, domain, pack, kept, best_max, cap, move_experts, move_passes):
    """Up to ``move_passes`` rounds, while a round helps: every move of one replica to one of the
    ``move_experts`` heaviest experts (``experts`` heaviest first) from another of them or from the
    lightest expert with several replicas, and every move of two replicas of one such donor (with
    three or more) to one or two of them, each from the round's replication (``first_base [n]`` in
    the first round, the best so far after it), packed and kept when lighter
    (:func:`_pack_and_keep`; ``domain``, ``pack``, ``kept`` as there). Returns the best max load."""
    best_counts = kept.counts
    n = experts.shape[0]
    top = min(move_experts, n)
    for round_ in range(move_passes):
        before = best_max
        # every move of a round from the same replication (the first round's: first_base, then the best)
        base = first_base.copy() if round_ == 0 else best_counts.copy()
        light_donor = -1
        for i in range(n - 1, top - 1, -1):
            if base[i] >= 2:
                light_donor = i
                break
        for receiver in range(top):
            for donor in range(-1, top):
                d = light_donor if donor < 0 else donor
                if d < 0 or d == receiver or base[d] < 2 or base[receiver] >= cap:
                    continue
                counts = base.copy()
                counts[receiver] += 1
                counts[d] -= 1
                best_max = _pack_and_keep(w, experts, counts, domain, pack, kept, best_max)
        # two replicas of one donor to two of the heaviest experts (or both to one)
        for donor in range(-1, top):
            d = light_donor if donor < 0 else donor
            if d < 0 or base[d] < 3:
                continue
            for first in range(top):
                for second in range(first, top):
                    if first == d or second == d or base[first] + 1 + (first == second) > cap or base[second] >= cap:
                        continue
                    counts = base.copy()
                    counts[first] += 1
                    counts[second] += 1
                    counts[d] -= 2
                    best_max = _pack_and_keep(w, experts, counts, domain, pack, kept, best_max)
        if best_max >= before:
            break
    return best_max


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _layout(slots_per_gpu, gpu_domain):
    """The most slots of a GPU (int64), the number of domains and ``slot_offsets [G + 1]`` int64 (GPU
    ``g``'s slots are ``slot_offsets[g]:slot_offsets[g + 1]``) of ``slots_per_gpu [G]``,
    ``gpu_domain [G]`` int64."""
    num_gpus = slots_per_gpu.shape[0]
    width = np.int64(1)  # not the literal 1: new_state then has one compiled specialization
    num_domains = 0
    for g in range(num_gpus):
        width = max(width, slots_per_gpu[g])
        num_domains = max(num_domains, gpu_domain[g] + 1)
    slot_offsets = np.zeros(num_gpus + 1, np.int64)
    for g in range(num_gpus):
        slot_offsets[g + 1] = slot_offsets[g] + slots_per_gpu[g]
    return width, num_domains, slot_offsets


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _domain_experts(w, row, gpus, slot_offsets, num_experts):
    """The experts in the slots of ``gpus [g]`` in the layer ``row [S]`` int64, heaviest first by
    ``w [E]`` (``[n]`` int64): the search then does not depend on how the experts are numbered."""
    seen = np.zeros(num_experts, np.bool_)
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            seen[row[s]] = True
    experts = np.where(seen)[0].astype(np.int64)
    return experts[stable_argsort(-w[experts])]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _copy_slots(source, target, gpus, slot_offsets):
    """``target[s] = source[s]`` for every slot ``s`` of ``gpus [g]`` (``source``, ``target`` ``[S]``)."""
    for gi in range(gpus.shape[0]):
        g = gpus[gi]
        for s in range(slot_offsets[g], slot_offsets[g + 1]):
            target[s] = source[s]


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _replica_cap(gpus, slot_offsets, num_experts):
    """The most replicas of one of the domain's ``num_experts`` experts: one per GPU of ``gpus [g]``, or
    the smallest multiple of that which lets the experts fill the domain's slots."""
    cap = gpus.shape[0]
    while cap * num_experts < domain_slots(gpus, slot_offsets[1:] - slot_offsets[:-1]):
        cap += gpus.shape[0]
    return cap


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _candidate_rows(w, experts, counts, domain, cap, wide, rows, split):
    """Write the replications to try to ``rows [27, E]`` int64: the :func:`aligned_counts` of ``counts [n]``
    (``wide`` as there), then the :func:`light_split` of ``counts`` and of each aligned one that is new.
    ``split [E]`` int64 is scratch. Returns ``(num_aligned, num_rows)``."""
    gpus = domain.gpus
    n = experts.shape[0]
    num_aligned = aligned_counts(w, experts, counts, domain_slots(gpus, domain.slots_per_gpu), gpus.shape[0], cap,
                                 wide, rows)
    # the light experts' extra replicas moved to the lightest ones, below the domain's mean GPU load
    level = 0.0
    for i in range(n):
        level += w[experts[i]]
    level /= gpus.shape[0]
    num_rows = num_aligned
    for i in range(-1, num_aligned):
        source = counts if i < 0 else rows[i, :n]
        if light_split(w, experts, source, level, split) and _is_new(split, n, counts, rows, num_rows):
            for j in range(n):  # a loop, not a slice assignment: see hierarchy._copy
                rows[num_rows, j] = split[j]
            num_rows += 1
    return num_aligned, num_rows


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _pack_rows(w, experts, rows, first, last, domain, pack, kept, best_max):
    """:func:`_pack_and_keep` every replication ``rows[first:last, :n]`` in turn, except one that cannot
    be kept (:func:`_packing_floor` not below ``best_max``). Returns the best max load."""
    least = np.int64(0)  # the fewest slots of a GPU of the domain (every one has some)
    for gi in range(domain.gpus.shape[0]):
        slots = domain.slots_per_gpu[domain.gpus[gi]]
        if gi == 0 or slots < least:
            least = slots
    for trial in range(first, last):
        counts = rows[trial, :experts.shape[0]]
        if _packing_floor(w, experts, counts, least) >= best_max:
            continue  # every packing of it is at least as heavy: _pack_and_keep would not keep it
        best_max = _pack_and_keep(w, experts, counts.copy(), domain, pack, kept, best_max)
    return best_max


@njit(cache=True, nogil=True, error_model="numpy")
def _packing_floor(w, experts, counts, least):
    """A load no packing of the replication ``counts [n]`` (of ``experts [n]``) on GPUs of at least
    ``least`` slots each, all filled, goes below: the GPU holding the heaviest replica holds
    ``least - 1`` others, each at least the lightest replica."""
    heaviest = 0.0
    lightest = np.inf
    for i in range(experts.shape[0]):
        load = w[experts[i]] / counts[i]
        heaviest = max(heaviest, load)
        lightest = min(lightest, load)
    return heaviest + max(least - 1, 0) * lightest


@njit(cache=True, nogil=True, error_model="numpy", **INTERNAL)
def _seeded_starts(w, experts, domain, pack, kept, best_max, cap, num_starts, state):
    """Up to ``num_starts`` replications, each the best so far (``kept.counts``) with one to three replicas
    moved at random (:func:`_perturb`, generator ``state [1]`` uint64), packed and kept when lighter
    (:func:`_pack_and_keep`). Returns the best max load."""
    for step in range(num_starts):
        counts = kept.counts.copy()
        if step > 0 and not _perturb(w, experts, counts, cap, 1 + step % 3, state):
            break
        best_max = _pack_and_keep(w, experts, counts, domain, pack, kept, best_max)
    return best_max


def _multistart(full, name):
    """The kernel ``name``: :func:`best_placement` (``full``) or :func:`aligned_placement`, which (``full``
    False, a constant of the kernel, its branches pruned before typing) runs the aligned and
    light-split replications only, as if ``num_starts`` and ``moves.passes`` were 0 and ``pair_swaps``
    False, and compiles none of the seeded perturbations, replica moves and pair swaps (the default
    method's aligned pass on a deployment too large for retries needs none)."""

    def improve(weights, slots_per_gpu, gpu_domain, start, num_starts, max_steps, seed, pair_swaps, threshold, moves):
        """Improve ``start`` layer by layer (module docstring).

        Args:
            weights: ``[L, E]`` float64; slots_per_gpu: ``[G]`` int64; gpu_domain: ``[G]`` int64.
            start: ``[L, S]`` int64 placement to improve; each expert's replicas lie in one domain.
            num_starts: replications tried per layer and domain; max_steps: most swaps per descent.
            seed: seed of the generator; pair_swaps: finish with :func:`pair_swap_descent` (slower).
            threshold: ``[L]`` float64; a domain whose heaviest GPU is not above ``threshold[layer]``
                is left as it is (pass a proven bound to skip domains that cannot matter, zeros for all).
            moves: a :class:`MoveSearch`: on the domains whose heaviest GPU is above ``moves.threshold[layer]``,
                from the start's replication and again after the aligned ones, up to ``moves.passes``
                rounds of replica moves between the domain's ``moves.experts`` heaviest experts
                (:func:`_move_descent`); 0 passes: none.
        Returns:
            ``phy2log [L, S]`` int64 whose max load per layer and domain is never above ``start``'s.
        """
        num_layers, num_experts = weights.shape
        num_slots = start.shape[1]
        width, num_domains, slot_offsets = _layout(slots_per_gpu, gpu_domain)
        out = start.copy()
        item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds = new_state(num_slots, slots_per_gpu.shape[0],
                                                                                 width, num_experts)
        pack = PackState(item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)
        best_expert = np.empty(num_slots, np.int64)
        rows = np.empty((27, num_experts), np.int64)  # 13 aligned, then light_split of those and of the start
        split = np.empty(num_experts, np.int64)
        state = np.zeros(1, np.uint64)
        counts_all = np.zeros(num_experts, np.int64)
        for layer in range(num_layers):
            w = weights[layer]
            # the same seed for every layer: a layer's row depends on its own loads, not on where it sits
            state[0] = np.uint64(seed) * np.uint64(1000003)
            counts_all[:] = 0
            for s in range(num_slots):
                counts_all[start[layer, s]] += 1
            loaded = False  # whether the working state holds out[layer] outside the domains already searched
            for d in range(num_domains):
                gpus = np.where((gpu_domain == d) & (slots_per_gpu > 0))[0].astype(np.int64)
                if gpus.shape[0] == 0:
                    continue
                # GPUs in one block (nodes): the domain's replicas keep the ids of its slots, so packing it
                # leaves the other domains' state intact and the layer's state is loaded once
                contiguous = gpus[gpus.shape[0] - 1] - gpus[0] + 1 == gpus.shape[0]
                experts = _domain_experts(w, start[layer], gpus, slot_offsets, num_experts)
                best_counts = counts_all[experts].copy()
                if not (loaded and contiguous):
                    load_state(out[layer], w, slot_offsets, item_expert, item_load, gpu_items, gpu_fill, gpu_load, holds)
                loaded = contiguous
                best_max = _domain_max(gpus, gpu_load)
                if best_max <= threshold[layer]:
                    continue
                kept = Kept(best_counts, best_expert, shared_replicas(gpus, gpu_items, gpu_fill, item_expert, holds))
                domain = Domain(gpus, slots_per_gpu, slot_offsets, slot_offsets[gpus[0]] if contiguous else np.int64(0),
                                max_steps)
                _copy_slots(out[layer], best_expert, gpus, slot_offsets)
                cap = _replica_cap(gpus, slot_offsets, experts.shape[0])
                start_counts = best_counts.copy()
                # the aligned replications (from the start's counts), the seeded perturbations of the best one,
                # the light-split ones, then replica moves from the start's counts and from the best
                num_aligned, num_rows = _candidate_rows(w, experts, best_counts, domain, cap, num_starts > 0, rows,
                                                        split)
                best_max = _pack_rows(w, experts, rows, 0, num_aligned, domain, pack, kept, best_max)
                if full:
                    best_max = _seeded_starts(w, experts, domain, pack, kept, best_max, cap, num_starts, state)
                best_max = _pack_rows(w, experts, rows, num_aligned, num_rows, domain, pack, kept, best_max)
                if full and moves.passes > 0 and best_max > moves.threshold[layer]:
                    for source in range(2):  # the start's replication (the others may lead elsewhere), then the best
                        best_max = _move_descent(w, experts, start_counts if source == 0 else best_counts, domain, pack,
                                                 kept, best_max, cap, moves.experts, moves.passes)
                _copy_slots(best_expert, out[layer], gpus, slot_offsets)
                if full and pair_swaps:  # pair swaps on the best packing found
                    load_state(out[layer], w, slot_offsets, item_expert, item_load, gpu_items, gpu_fill, gpu_load,
                               holds)
                    loaded = True
                    pair_swap_descent(item_load, item_expert, gpus, gpu_items, gpu_fill, gpu_load, holds, max_steps)
                    recompute_loads(item_load, gpus, gpu_items, gpu_fill, gpu_load)
                    if _domain_max(gpus, gpu_load) <= best_max:
                        store_state(item_expert, gpu_items, gpu_fill, slot_offsets, out[layer])
        return out

    improve.__name__ = improve.__qualname__ = name  # its own cache file
    return njit(cache=True, nogil=True, error_model="numpy")(improve)


best_placement = _multistart(True, "best_placement")
aligned_placement = _multistart(False, "aligned_placement")
