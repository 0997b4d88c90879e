"""Placements for GPUs of one or two slots each, global placement (ARCHITECTURE.md section 3).

With one slot a GPU, D'Hondt replication is optimal: the max GPU load is the heaviest replica and
the replica bound (:func:`eplb.analysis.bounds.replica_bound`) equals it. With two, a GPU is a
pair: for fixed replica counts the sorted pairing (heaviest replica with the lightest) is optimal,
and :func:`eplb.kernels.bounds.pairs.pair_search` searches the counts (single replica moves), then
:func:`eplb.kernels.bounds.pair_cover.pair_cover` bisects on the max load from there. :func:`pair_rows` turns counts
into ``phy2log`` rows that keep the spread rule (:mod:`eplb.planning.spread`): replicas of equal
load are interleaved across experts, and a pair holding one expert twice trades one of them for a
replica of equal load elsewhere (same pair loads), or for any replica that keeps both pairs under
the peak; a layer where neither works gets no row (the caller keeps its own).
"""

from __future__ import annotations

import numpy as np

from ...analysis.loads import slot_order_peaks
from ...analysis.bounds import PAIR_WEIGHT_ITERATIONS, PAIR_WEIGHT_STEP, strongest_bound
from ...kernels.bounds.pair_cover import pair_cover
from ...kernels.bounds.pair_starts import price_search
from ...kernels.bounds.pairs import capped_counts, pair_search, sorted_pairings
from ...model.deployment import Deployment

PAIR_MOVES = 256
"""Most rounds of single replica moves per layer in :func:`eplb.kernels.bounds.pairs.pair_search`."""

PAIR_DONORS = 24
"""Experts tried as the donor of a replica in each round of that search, for ``method="best"`` and
``method="exact"`` (58 lognormal layers at 512 / 256: 6, 12, 24 donors reach a mean gap of 3.87%,
3.45%, 2.79% to the bound, the search taking 9, 15, 28 ms of CPU; the bisection after it,
:data:`PAIR_STEPS`, takes 24 donors to 1.43%)."""

DEFAULT_PAIR_DONORS = 6
"""Donors for the default method (step 9 of :mod:`eplb.planning.methods.balanced`): the most that
keeps its plan within 20 ms at 288 / 144 and 40 ms at 512 / 256 (58 layers, `bench/rack.py`)."""

PAIR_STEPS = 16
"""Bisection steps of :func:`eplb.kernels.bounds.pair_cover.pair_cover` after the move search, for
``method="best"`` and ``method="exact"`` (at 512 / 256 with 24 donors: mean gap 2.79% -> 1.43%
lognormal, 2.43% -> 1.05% Zipf 0.5, 3.97% -> 3.29% Zipf 1.0, for about 20 ms of CPU more)."""

DEFAULT_PAIR_STEPS = 0
"""Bisection steps for the default method (step 9 of :mod:`eplb.planning.methods.balanced`): none,
the move search alone. Measured at 512 / 256 (58 layers, side by side): 3 steps take the default's
mean gap from 3.89% to 1.63% (lognormal) and 3.17% to 1.20% (Zipf 0.5) for 8-10 ms of CPU more
(about 29 -> 38-40 ms on a shared machine), but its plans do worse out of sample: leave one workload
out (`bench/rack.py`'s 12 workloads, 58 layers) 0.6245 -> 0.6189 balancedness (worst fold 0.572 ->
0.560), 0.5633 -> 0.5429 in `--quick`; 1 step: 2.18% in sample, 0.6199 held out. At 288 / 144 it
changes nothing. Tighter pairings fit the window they were planned on more closely."""


PRICE_FRACTIONS = (0.5, 0.85)
"""Targets of :func:`eplb.kernels.bounds.pair_starts.price_search` for ``method="best"`` and
``method="exact"``, as the share of the way from the plan-free bound to the plan's peak. From
:func:`eplb.kernels.bounds.pairs.pair_search`'s counts (58 layers at 288 / 144, lognormal / Zipf 0.5 /
drift): mean gap 0.312 / 1.033 / 0.111% -> 0.222 / 0.697 / 0.054%, 3.4 / 9.2 / 1.8 ms a layer;
targets at 0.3 / 0.5 / 0.7 / 0.85: 0.218 / 0.689 / 0.054% for twice the time; 0.3 / 0.6: 0.247 /
0.710 / 0.078%. At 512 / 256 (12 layers) 2.99 / 2.43 / 3.66% -> 1.44 / 1.50 / 1.50%, 18-65 ms a layer."""

PRICE_EVERY = 40
"""Ascent steps between two starts of that search (10 a target; every 80: 0.234% instead of 0.218%
lognormal at 288 / 144, 5.0 instead of 6.3 ms a layer, four targets)."""

DEFAULT_PRICES = False
"""The default method does not run the price search: it takes 0.1-0.6 s a model at 288 / 144 and
1.1-3.8 s at 512 / 256 (`bench/rack_bounds.py`), against the default's 20 and 40 ms."""


def slots_per_gpu(deployment: Deployment) -> int | None:
    """``k`` when the placement is global and every GPU holds exactly ``k`` slots, else ``None``."""
    topology = deployment.topology
    if deployment.hierarchical or not topology.is_uniform:
        return None
    return int(topology.slots_per_gpu[0])


def spread_cap(num_experts: int, num_slots: int, num_gpus: int) -> int:
    """Most replicas an expert may get under the spread rule's cap (the GPUs, unless the slots
    exceed experts times GPUs)."""
    return num_gpus if num_slots <= num_experts * num_gpus else num_slots


def pair_candidates(weights: np.ndarray, deployment: Deployment, donors: int = PAIR_DONORS,
                    steps: int = PAIR_STEPS, prices: bool = True, lower: np.ndarray | None = None
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(counts [L, E] int64, peaks [L] float64)]``, lightest first: replica counts for ``weights
    [L, E]`` on GPUs of two slots and their sorted pairing's max GPU load. Last, those
    :func:`eplb.kernels.bounds.pairs.pair_search` finds (``donors`` tried a round); before them (with
    ``steps > 0``) those of :func:`eplb.kernels.bounds.pair_cover.pair_cover` (``steps`` bisection
    steps from there), and first (with ``prices``) those of
    :func:`eplb.kernels.bounds.pair_starts.price_search` from the lightest so far (its lower end
    ``lower [L]``, by default :func:`eplb.analysis.bounds.strongest_bound`). Each is never heavier
    than the one after it, and where its counts cannot be laid out without an expert twice on a GPU
    the next ones still may."""
    topology = deployment.topology
    num_experts = weights.shape[1]
    order = np.argsort(-weights, axis=1, kind="stable")
    desc = np.ascontiguousarray(np.take_along_axis(weights, order, axis=1), dtype=np.float64)
    cap = spread_cap(num_experts, topology.num_slots, topology.num_gpus)
    found = [pair_search(desc, topology.num_slots, cap, PAIR_MOVES, donors)]
    if steps > 0:
        found.insert(0, pair_cover(desc, topology.num_slots, cap, found[0][0], found[0][1], int(steps)))
    if prices:
        if lower is None:
            lower = strongest_bound(weights, deployment)
        lower = np.ascontiguousarray(lower, dtype=np.float64)
        found.insert(0, price_search(desc, found[0][0], found[0][1], lower, topology.num_slots, cap,
                                     np.array(PRICE_FRACTIONS), (PAIR_WEIGHT_ITERATIONS, PAIR_WEIGHT_STEP, PRICE_EVERY),
                                     PAIR_MOVES, donors))
    out = []
    for sorted_counts, peaks in found:
        counts = np.empty_like(sorted_counts)
        np.put_along_axis(counts, order, sorted_counts, axis=1)
        out.append((counts, peaks))
    return out


def pair_counts(weights: np.ndarray, deployment: Deployment, donors: int = PAIR_DONORS,
                steps: int = PAIR_STEPS, prices: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(counts [L, E] int64, peaks [L] float64)``: the lightest of :func:`pair_candidates`."""
    return pair_candidates(weights, deployment, donors, steps, prices)[0]


def _undouble(pairs: np.ndarray, load: np.ndarray, peak: float) -> bool:
    """Rearrange ``pairs [G, 2]`` (experts; ``load [E]`` per replica) in place so that no pair holds
    one expert twice, each pair staying ``<= peak``; whether it succeeded. Each doubled pair ``g``
    trades one replica with a side of another pair ``h``: a replica of equal load first, then the
    trade that raises the heavier of the two pairs least, the first such ``(h, side)`` on ties."""
    for g in np.flatnonzero(pairs[:, 0] == pairs[:, 1]):
        e = pairs[g, 1]
        sums = load[pairs].sum(axis=1)
        f, other = pairs.reshape(-1), pairs[:, ::-1].reshape(-1)  # candidate (h, side) in order
        h = np.repeat(np.arange(len(pairs)), 2)
        new_g, new_h = load[e] + load[f], load[other] + load[e]
        ok = (h != g) & (f != e) & (other != e) & (np.maximum(new_g, new_h) <= peak)
        if not ok.any():
            return False
        unequal = (load[f] != load[e]).astype(np.int64)
        rise = np.maximum(new_g, new_h) - np.maximum(sums[g], sums[h])
        candidates = np.flatnonzero(ok)
        pick = candidates[np.lexsort((candidates, rise[candidates], unequal[candidates]))[0]]
        pairs[g, 1], pairs[h[pick], pick % 2] = pairs[h[pick], pick % 2], e
    return True


def pair_rows(weights: np.ndarray, counts: np.ndarray, num_gpus: int) -> list[np.ndarray | None]:
    """For each layer of ``weights [L, E]`` with replica counts ``counts [L, E]`` (summing to
    ``2 num_gpus``): the sorted pairing as a ``phy2log`` row ``[S]`` (GPU ``g`` holds slots
    ``2g, 2g + 1``, :func:`eplb.kernels.bounds.pairs.sorted_pairings`) with no expert twice on a GPU
    at the same max load, or ``None`` where that needs a heavier pair (see the module docstring)."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    rows, doubled = sorted_pairings(weights, np.ascontiguousarray(counts, dtype=np.int64), int(num_gpus))
    out: list[np.ndarray | None] = list(rows)
    for layer in np.flatnonzero(doubled):
        pairs = rows[layer].reshape(-1, 2).copy()
        load = weights[layer] / counts[layer]
        peak = float(load[pairs].sum(axis=1).max())
        out[layer] = pairs.reshape(-1) if _undouble(pairs, load, peak) else None
    return out


def one_slot_rows(weights: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L, S]`` with one slot a GPU (``S = num_gpus``): D'Hondt replication, one replica a GPU in
    order of expert; optimal (its max load is the replica bound)."""
    desc_order = np.argsort(-weights, axis=1, kind="stable")
    desc = np.ascontiguousarray(np.take_along_axis(weights, desc_order, axis=1), dtype=np.float64)
    sorted_counts = capped_counts(desc, num_gpus, num_gpus)
    counts = np.empty_like(sorted_counts)
    np.put_along_axis(counts, desc_order, sorted_counts, axis=1)
    return np.stack([np.repeat(np.arange(weights.shape[1]), row) for row in counts]).astype(np.int64)


def few_slot_plans(weights: np.ndarray, deployment: Deployment, donors: int = PAIR_DONORS,
                   steps: int = PAIR_STEPS, prices: bool = True, lower: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(rows [L, S] int64, made [L] bool)``: the one-slot or two-slot construction for every layer
    of ``weights [L, E]`` (``made`` False where :func:`pair_rows` gave none: the row is then
    unset); ``None`` where it does not apply (hierarchical, uneven slots, or more than two a GPU).
    ``donors``, ``steps``, ``prices``, ``lower``: see :func:`pair_candidates`."""
    k = slots_per_gpu(deployment)
    topology = deployment.topology
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if k == 1:
        return one_slot_rows(weights, topology.num_gpus), np.ones(weights.shape[0], bool)
    if k != 2:
        return None
    out = np.zeros((weights.shape[0], topology.num_slots), np.int64)
    made = np.zeros(weights.shape[0], bool)
    for counts, _ in pair_candidates(weights, deployment, donors, steps, prices, lower):
        layers = np.flatnonzero(~made)
        for layer, row in zip(layers, pair_rows(weights[layers], counts[layers], topology.num_gpus)):
            if row is not None:
                out[layer], made[layer] = row, True
    return out, made


def keep_lighter(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray, donors: int = PAIR_DONORS,
                 slots: tuple[int, ...] = (1, 2), steps: int = PAIR_STEPS, prices: bool = True,
                 lower: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """``(phy2log [L, S], layers replaced)``: every layer replaced by the one- or two-slot
    construction (:func:`few_slot_plans`) where that is strictly lighter (global placement with
    ``k`` slots on every GPU, ``k`` in ``slots``; unchanged elsewhere). At two slots the rows are
    laid out only for the layers whose searched counts pair lighter (:func:`pair_candidates`, the
    lightest that lays out). The rows keep the spread rule, so the result keeps it wherever
    ``phy2log`` did. ``lower [L]``: the caller's :func:`eplb.analysis.bounds.strongest_bound`, if it
    has it (:func:`pair_candidates`)."""
    k = slots_per_gpu(deployment)
    if k not in slots:
        return phy2log, 0
    topology = deployment.topology
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    current = slot_order_peaks(weights, phy2log, topology)
    if k == 1:
        layers, rows = np.arange(weights.shape[0]), list(one_slot_rows(weights, topology.num_gpus))
    else:
        candidates = pair_candidates(weights, deployment, donors, steps, prices, lower)
        return _keep_lighter_pairs(weights, deployment, phy2log, current, candidates)
    phy2log = phy2log.copy()
    replaced = 0
    for layer, row in zip(layers, rows):
        if row is not None and slot_order_peaks(weights[layer][None], row[None], topology)[0] < current[layer]:
            phy2log[layer] = row
            replaced += 1
    return phy2log, replaced


def _keep_lighter_pairs(weights: np.ndarray, deployment: Deployment, phy2log: np.ndarray, current: np.ndarray,
                        candidates: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, int]:
    """:func:`keep_lighter` at two slots: each layer takes the first of ``candidates`` (lightest
    first) whose counts pair strictly lighter than ``current [L]`` and lay out without an expert
    twice on a GPU (counts equal to the previous candidate's are not laid out again)."""
    topology = deployment.topology
    phy2log = phy2log.copy()
    current = current.copy()
    replaced = np.zeros(weights.shape[0], bool)
    tried = None
    for counts, peaks in candidates:
        fresh = np.ones(len(counts), bool) if tried is None else (counts != tried).any(axis=1)
        layers = np.flatnonzero((peaks < current) & ~replaced & fresh)
        tried = counts
        rows = pair_rows(weights[layers], counts[layers], topology.num_gpus)
        made = [i for i, row in enumerate(rows) if row is not None]
        if not made:
            continue
        layers = layers[made]
        rows = np.stack([rows[i] for i in made])
        lighter = slot_order_peaks(weights[layers], rows, topology) < current[layers]
        layers, rows = layers[lighter], rows[lighter]
        phy2log[layers], replaced[layers] = rows, True
        current[layers] = slot_order_peaks(weights[layers], rows, topology)
    return phy2log, int(replaced.sum())
