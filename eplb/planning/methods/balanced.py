"""``method="balanced"`` (the default): replication and packing that close the greedy's gap.

Per layer, and per node in hierarchical mode:

1. hierarchical only: assign the expert groups to nodes with the smallest target max load that
   the node's load and replica needs allow (exhaustive search when the number of groups is small,
   see :mod:`eplb.kernels.bounds.hierarchy`); a node's replica count is then its slot count;
2. replicate by the D'Hondt rule capped at one replica per GPU, so that no two replicas of an
   expert need to share a GPU;
3. pack replicas largest-first onto the lightest GPU that does not yet hold the expert;
4. swap replicas between the heaviest GPU and the others while that lowers the heaviest GPU
   (:func:`eplb.kernels.search.local_search.swap_descent`);
5. on domains more than 0.2% above the bounds, try the aligned replication (the heavy experts get
   a multiple of the domain's GPUs in replicas, so that every GPU can carry as many heavy
   replicas: :func:`eplb.kernels.search.multistart.aligned_counts`), and each of those and the start with
   the light experts' extra replicas moved to the lightest experts
   (:func:`eplb.kernels.search.multistart.light_split`), and keep the one that packs best;
6. on layers still above the simple bounds, try other replications (a replica or three moved
   between experts, each packed again: the seeded search of ``method="best"``), as many as a
   per-layer work budget affords (many on small models, none at DeepSeek-V3 size), and keep the
   best; every layer is searched on its own, so a layer's row never depends on the other layers
   planned with it; then, with ``recount=True`` (off by default: :data:`RECOUNT`), at 3 or 4
   slots a GPU (global), on layers still above those bounds, a pair-swap descent and a few moves
   of one replica from one expert to another, each followed by the descent and kept when the
   heaviest GPU gets lighter (:func:`recount_layers`);
7. on tiny global instances (at most 16 slots, e.g. Mixtral's 8 experts on 12), replace every
   layer by the optimum over spread placements when the exact branch and bound
   (:mod:`eplb.kernels.search.tiny`) finds one lighter within its node budget;
8. on every layer keep the published greedy's placement instead if it has a strictly lower max
   load once its doubled replicas (two of an expert on one GPU, which the published greedy allows)
   are spread by swaps (a greedy layer that cannot be spread is not taken), so no layer taken from
   greedy has two replicas of an expert on one GPU.

The name says what it optimises for: balanced GPU loads at serving-loop speed.
"""

from __future__ import annotations

import numpy as np

from ...kernels.search.pack_descend import balanced_placement
from ...kernels.engine_tables.deepseek_greedy import greedy_placement
from ...kernels.search.multistart import (NO_MOVES, NO_PAIR_SWAPS, NO_STARTS, SEED, MoveSearch, aligned_placement,
                                   best_placement)
from ...kernels.search.recount_descent import recount_descent
from ...kernels.search.tiny import SPREAD, tiny_optimum
from ...analysis.bounds import TINY_BUDGET, TINY_SLOTS, average_bound
from ...analysis.loads import slot_order_peaks
from ...analysis.searches import group_assignment
from ...model.topology import Topology
from .exact_pairs import DEFAULT_PAIR_DONORS, DEFAULT_PAIR_STEPS, DEFAULT_PRICES, keep_lighter
from . import Option, Deployment, register

def writable(array: np.ndarray) -> np.ndarray:
    """``array`` as a writable C-contiguous array (a copy if it is read-only, as a Topology's are).

    Kernels get a compiled specialization per argument type and read-only is a type of its own:
    passing every array writable keeps one per kernel (a shorter first, compiling call).
    """
    return np.require(array, requirements="CW")


def domains(weights: np.ndarray, deployment: Deployment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gpu_domain [G], expert_domain [L, E], bound [L])``: nodes in hierarchical mode, one domain
    otherwise; ``bound`` is the hierarchical bound the group search proved (zeros when global)."""
    topology = deployment.topology
    num_layers, num_experts = weights.shape
    if not deployment.hierarchical:
        return (np.zeros(topology.num_gpus, np.int64), np.zeros((num_layers, num_experts), np.int64),
                np.zeros(num_layers))
    node_of_group, proven = group_assignment(weights, deployment)
    size = num_experts // deployment.num_groups
    return topology.node_of_gpu.astype(np.int64), np.repeat(node_of_group, size, axis=1), proven


def spread_layer(weights: np.ndarray, row: np.ndarray, topology: Topology, gpu_domain: np.ndarray
                 ) -> np.ndarray | None:
    """``row [S]`` (one layer's placement on ``weights [E]``) with no two replicas of an expert on
    one GPU, by swapping a doubled replica with a slot of another GPU of its domain (``gpu_domain
    [G]``; each time the swap that leaves the two GPUs lightest); the same row when nothing is
    doubled; ``None`` when no swap spreads it (e.g. an expert with more replicas than its domain
    has GPUs)."""
    gpu = topology.gpu_of_slot
    row = row.copy()
    counts = np.bincount(row, minlength=weights.shape[0])
    per_replica = weights / np.maximum(counts, 1)
    loads = np.bincount(gpu, weights=per_replica[row], minlength=topology.num_gpus)
    for _ in range(row.shape[0]):
        holds = [set() for _ in range(topology.num_gpus)]
        doubled = None
        for s in range(row.shape[0]):
            e = int(row[s])
            if e in holds[gpu[s]] and doubled is None:
                doubled = s
            holds[gpu[s]].add(e)
        if doubled is None:
            return row
        g, e = gpu[doubled], int(row[doubled])
        best, best_value = None, np.inf
        for t in range(row.shape[0]):
            h, f = gpu[t], int(row[t])
            if h == g or gpu_domain[h] != gpu_domain[g] or f == e or f in holds[g] or e in holds[h]:
                continue
            delta = per_replica[e] - per_replica[f]
            value = max(loads[g] - delta, loads[h] + delta)
            if value < best_value:
                best, best_value = t, value
        if best is None:
            return None
        h, f = gpu[best], int(row[best])
        delta = per_replica[e] - per_replica[f]
        loads[g] -= delta
        loads[h] += delta
        row[doubled], row[best] = f, e
    return None


def keep_better_than_greedy(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray) -> tuple[np.ndarray, int]:
    """Replace the layers where the published greedy has a strictly lower max load. The published
    greedy may put two replicas of an expert on one GPU; those are spread first over other GPUs of
    their domain (:func:`spread_layer`), and the greedy layer is taken only if it is still strictly
    lighter, so the method never keeps a layer of greedy's with two replicas of an expert on a GPU.

    Returns the placement and the number of layers taken from greedy (greedy needs equal slots per GPU).
    """
    topology = deployment.topology
    if not topology.is_uniform:
        return phy2log, 0
    groups, nodes = (deployment.num_groups, topology.num_nodes) if deployment.hierarchical else (1, 1)
    greedy, _ = greedy_placement(np.ascontiguousarray(weights, dtype=np.float32), topology.num_slots, groups,
                                 nodes, topology.num_gpus)
    own = slot_order_peaks(weights, phy2log, topology)
    worse = slot_order_peaks(weights, greedy, topology) < own
    if not worse.any():
        return phy2log, 0
    domain = topology.node_of_gpu if deployment.hierarchical else np.zeros(topology.num_gpus, np.int64)
    phy2log = phy2log.copy()
    taken = 0
    for layer in np.flatnonzero(worse):
        row = spread_layer(weights[layer], greedy[layer], topology, domain)
        if row is not None and slot_order_peaks(weights[layer:layer + 1], row[None, :], topology)[0] < own[layer]:
            phy2log[layer] = row
            taken += 1
    return phy2log, taken


RETRY_WORK = 16_384
"""Work budget of the replication retries of one layer, in (slot x GPU) units: a layer gets
``RETRY_WORK // (its slots x all GPUs)`` starts, in hierarchical mode too (at most 64; none when
that is below 2: a DeepSeek-V3-sized layer, 288 x 32, gets none)."""


def retry_starts(deployment: Deployment, num_starts: int, work: int = RETRY_WORK) -> int:
    """Starts :func:`retry_replication` gives a layer of this deployment (0: it retries none)."""
    if num_starts <= 1:
        return 0
    # a hierarchical layer costs as much as a global one: DeepSeek-V3 size (288 x 32) gets no retries either
    starts = min(64, int(work) // max(1, deployment.topology.num_slots * deployment.topology.num_gpus))
    return 0 if starts < 2 else max(starts, int(num_starts))


def retry_replication(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray, gpu_domain: np.ndarray,
                      bound: np.ndarray, num_starts: int, max_steps: int, tolerance: float = 2e-4,
                      work: int = RETRY_WORK) -> tuple[np.ndarray, int]:
    """Try other replications (:func:`eplb.kernels.search.multistart.best_placement`) on the layers whose
    max load is more than ``tolerance`` above the average and heaviest-replica bounds (and
    ``bound [L]``, a valid bound the caller has): each such layer gets the starts its own work
    budget affords (``work // (domain slots x domain GPUs)``, at most 64, at least ``num_starts``
    when it gets any), and a pair-swap descent when a GPU holds few slots.

    Every decision is per layer and every layer is searched on its own (its own seed), so a layer's
    row is the same whether it is planned alone or with other layers.

    Returns the placement and the number of layers retried.
    """
    topology = deployment.topology
    starts = retry_starts(deployment, num_starts, work)
    if starts == 0:
        return phy2log, 0
    domains_count = topology.num_nodes if deployment.hierarchical else 1
    domain_gpus = topology.num_gpus // domains_count
    cheap = np.maximum(average_bound(weights, topology), weights.max(axis=1) / topology.num_gpus)
    cheap = np.maximum(cheap, bound)
    excess = slot_order_peaks(weights, phy2log, topology) / np.where(cheap > 0, cheap, 1.0)
    layers = np.flatnonzero(excess > 1 + tolerance)
    if layers.size == 0:
        return phy2log, 0
    k = int(topology.slots_per_gpu.max())
    pair_swaps = domain_gpus * (k * (k - 1) // 2) ** 2 <= 2000
    slots_per_gpu = writable(topology.slots_per_gpu)
    no_threshold = np.zeros(1)
    phy2log = phy2log.copy()
    for layer in layers:  # one call per layer: the search's seed then depends on that layer alone
        rows = slice(int(layer), int(layer) + 1)
        phy2log[rows] = best_placement(np.ascontiguousarray(weights[rows]), slots_per_gpu, gpu_domain,
                                       np.ascontiguousarray(phy2log[rows]), starts, int(max_steps), SEED, pair_swaps,
                                       no_threshold, MoveSearch(NO_MOVES, NO_MOVES, no_threshold))
    return phy2log, int(layers.size)


RECOUNT = False
"""Whether the default runs step 6b (:func:`recount_layers`) unless told (option ``recount``). Off: it
lowers the in-sample gap at 288 / 72 and 384 / 128 (:data:`RECOUNT_TRIALS`) but held out it loses
(``bench/rack.py``'s workloads, 58 layers, 12 folds, two draws of workloads and windows): plans of the
summed windows 0.7160 -> 0.7153 and 0.6880 -> 0.6859 at 288 / 72, 0.6863 -> 0.6873 and 0.6601 -> 0.6591
at 384 / 128; the default series objective (``expected_peak_search``, whose hedge starts from this plan)
0.7691 -> 0.7653, 0.7396 -> 0.7359, 0.7454 -> 0.7421, 0.7116 -> 0.7032. The pair swaps alone (same
replica counts) lose as much there at 288 / 72 (series 0.7396 -> 0.7346): the tighter in-sample fit,
not the replica moves, is what the series plan loses on."""

RECOUNT_SLOTS = (3, 4)
"""Slots a GPU (global placement, every GPU alike) where :func:`recount_layers` runs: there a swap descent
stops on coarse replica loads. At 2 slots a GPU the pairing construction of step 9 decides, and at 9
(288 / 32) the swaps already land within 0.02% of the bound."""

RECOUNT_TRIALS = {3: 8, 4: 2}
"""Moves tried per layer by :func:`recount_layers` at 3 and 4 slots a GPU (each a slot's expert changed,
then a swap descent, about 20-40 us at 72-128 GPUs). DeepSeek-V3 size, 58 layers, ``bench/rack_bounds.py``'s
four families (lognormal 0.7, Zipf 1.0, Zipf 0.5, drift), mean gap to the bound, and plan time (median of 20
warm plans, one run, load average 2.2 on 2 cores): at 288 / 72 0.198 / 1.242 / 0.150 / 0.269% -> 0.082 /
1.198 / 0.082 / 0.178%, 10.5 -> 19.1 ms (the pair swaps alone: 0.106 / 1.234 / 0.089 / 0.196%; 4 trials:
0.074 / 1.164 / 0.080 / 0.171% for about 8 ms more); at 384 / 128 0.229 / 0.681 / 0.193 / 0.318% -> 0.151 /
0.591 / 0.114 / 0.219%, 18.9 -> 36.1 ms (16 trials: 0.142 / 0.568 / 0.107 / 0.207%). The targets of 20 and
40 ms a model set the budgets."""


def recount_layers(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray, bound: np.ndarray,
                   max_steps: int, trials: int | None = None, tolerance: float = 2e-4) -> tuple[np.ndarray, int]:
    """At 3 or 4 slots a GPU (:data:`RECOUNT_SLOTS`, global, every GPU alike), on the layers more than
    ``tolerance`` above the average and heaviest-replica bounds and ``bound [L]``: a swap descent
    (pair swaps too at 4), then up to ``trials`` moves of one replica from one expert to another,
    each followed by the descent and kept when the heaviest GPU gets lighter
    (:func:`eplb.kernels.search.recount_descent.recount_descent`). Each layer on its own, no random
    numbers; a layer is changed only when its max load falls. Returns the placement and the number of
    layers made lighter."""
    topology = deployment.topology
    if deployment.hierarchical or not topology.is_uniform or int(topology.slots_per_gpu[0]) not in RECOUNT_SLOTS:
        return phy2log, 0
    cheap = np.maximum(np.maximum(average_bound(weights, topology), weights.max(axis=1) / topology.num_gpus), bound)
    own = slot_order_peaks(weights, phy2log, topology)
    layers = np.flatnonzero(own > cheap * (1 + tolerance)).astype(np.int64)
    if layers.size == 0:
        return phy2log, 0
    slots = int(topology.slots_per_gpu[0])
    trials = RECOUNT_TRIALS[slots] if trials is None else trials
    rows, _ = recount_descent(weights, phy2log, writable(topology.slot_offsets).astype(np.int64), layers,
                              slots >= 4, int(trials), int(max_steps))
    lighter = slot_order_peaks(weights[layers], rows, topology) < own[layers]
    phy2log = phy2log.copy()
    phy2log[layers[lighter]] = rows[lighter]
    return phy2log, int(lighter.sum())


def align_replication(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray, gpu_domain: np.ndarray,
                      bound: np.ndarray, max_steps: int, tolerance: float = 2e-3,
                      retries: bool = True) -> tuple[np.ndarray, int]:
    """Try the aligned replications (:func:`eplb.kernels.search.multistart.aligned_counts`: the heavy experts
    of a domain get a multiple of its GPUs in replicas) on every domain whose heaviest GPU is more
    than ``tolerance`` above the average and heaviest-replica bounds and ``bound [L]``.

    ``retries``: whether :func:`retry_replication` may run on this deployment; if not, the search
    runs in :func:`eplb.kernels.search.multistart.aligned_placement` (same result, less to compile), else in
    the kernel the retries use too (one compile for both, whichever loads call it first).

    Returns the placement and the number of layers tried.
    """
    topology = deployment.topology
    cheap = np.maximum(average_bound(weights, topology), weights.max(axis=1) / topology.num_gpus)
    threshold = np.maximum(cheap, bound) * (1 + tolerance)
    rows = slot_order_peaks(weights, phy2log, topology) > threshold
    if rows.any():
        phy2log = phy2log.copy()
        search = best_placement if retries else aligned_placement
        phy2log[rows] = search(np.ascontiguousarray(weights[rows]), writable(topology.slots_per_gpu), gpu_domain,
                               np.ascontiguousarray(phy2log[rows]), NO_STARTS, int(max_steps), SEED, NO_PAIR_SWAPS,
                               np.ascontiguousarray(threshold[rows]),
                               MoveSearch(NO_MOVES, NO_MOVES, np.ascontiguousarray(threshold[rows])))
    return phy2log, int(rows.sum())


def solve_tiny(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray) -> tuple[np.ndarray, int]:
    """On tiny global instances (at most :data:`eplb.analysis.bounds.TINY_SLOTS` slots), replace every layer
    by the best placement with no two replicas of an expert on one GPU, when the exact branch and
    bound (:func:`eplb.kernels.search.tiny.tiny_optimum`, :data:`eplb.analysis.bounds.TINY_BUDGET` nodes) finds one
    strictly lighter. Returns the placement and the number of layers replaced."""
    topology = deployment.topology
    if deployment.hierarchical or topology.num_slots > TINY_SLOTS:
        return phy2log, 0
    peaks = slot_order_peaks(weights, phy2log, topology)
    slots_per_gpu = writable(topology.slots_per_gpu)
    phy2log = phy2log.copy()
    row = np.empty(topology.num_slots, np.int64)
    replaced = 0
    for layer in range(weights.shape[0]):
        _, found, _ = tiny_optimum(weights[layer], slots_per_gpu, SPREAD, float(peaks[layer]), TINY_BUDGET, row)
        if found:
            phy2log[layer] = row
            replaced += 1
    return phy2log, replaced


@register("balanced", options={"max_steps": Option("int", minimum=0), "num_starts": Option("int", minimum=1),
                               "greedy_fallback": Option("bool"), "recount": Option("bool")})
def balanced(weights: np.ndarray, deployment: Deployment, max_steps: int = 4096, num_starts: int = 4,
             greedy_fallback: bool = True, recount: bool = RECOUNT) -> tuple[np.ndarray, dict]:
    """The default method (module docstring). ``max_steps``: most swaps per layer and node;
    ``num_starts``: replications tried on layers left above the simple bounds (1 = none);
    ``greedy_fallback``: step 8 (keep greedy's layer where it is lighter); ``False`` shows the
    method's own placements (``bench/greedy_net.py`` counts how often step 8 fires); ``recount``:
    step 6b at 3 or 4 slots a GPU (:func:`recount_layers`; off by default, see :data:`RECOUNT`)."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    topology = deployment.topology
    gpu_domain, expert_domain, bound = domains(weights, deployment)
    phy2log = balanced_placement(weights, writable(topology.slots_per_gpu), gpu_domain, expert_domain,
                                 int(max_steps))
    phy2log, aligned = align_replication(weights, deployment, phy2log, gpu_domain, bound, max_steps,
                                         retries=retry_starts(deployment, num_starts) > 0)
    phy2log, retried = retry_replication(weights, deployment, phy2log, gpu_domain, bound, num_starts, max_steps)
    recounted = 0
    if recount:
        phy2log, recounted = recount_layers(weights, deployment, phy2log, bound, max_steps)
    phy2log, solved = solve_tiny(weights, deployment, phy2log)
    from_greedy = 0
    if greedy_fallback:
        phy2log, from_greedy = keep_better_than_greedy(weights, deployment, phy2log)
    phy2log, paired = keep_lighter(weights, deployment, phy2log, DEFAULT_PAIR_DONORS, slots=(2,),
                                   steps=DEFAULT_PAIR_STEPS, prices=DEFAULT_PRICES)
    return phy2log, {"hierarchical": deployment.hierarchical, "layers_aligned": aligned, "layers_retried": retried,
                     "layers_recounted": recounted,
                     "layers_solved_exactly": solved, "layers_from_greedy": from_greedy, "layers_paired": paired}
