"""Offline certificates: how close to optimal a layer's placement can get, measured.

:func:`certify` brackets the optimum of every layer between the package's lower bound
(:func:`eplb.bounds.lower_bound`) and the max load of a placement it finds with an exact packing
search under a load cap (:mod:`eplb.kernels.capped`):

1. start from a placement (by default ``method="best"``) and its replica counts;
2. bisect the cap between the lower bound and the start's max load: the search packs the replicas
   under the cap (a packing found lowers the cap; a search that exhausts its tree proves no packing
   of *these replicas* meets the cap);
3. then (``neighbours=True``) a descent over the replica counts: move one replica from one expert
   to another, keep the first move whose replicas pack under ``(1 - 1e-7)`` times the current max
   load, bisect again, repeat until no move helps.

Opt-in and offline: it costs about a second per layer with 40 slots (see
``bench/gpt_oss_certificate.py``), and it needs identical GPUs in one domain (global mode,
uniform topology). The search is exact for the replica counts it tries, not over every
replication, so ``upper`` is an achievable max load (a placement holds it) and ``lower`` the
bound: the optimum lies in ``[lower, upper]``; ``optimal`` marks layers where they meet.
Deterministic: node budgets, no clock and no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bounds import lower_bound
from .kernels.capped import FOUND, pack_under_cap
from .kernels.layout import replica_counts
from .topology import Topology

RELATIVE_STEP = 1e-7
"""The bisection stops when its interval is this fraction of the cap; a count move must beat the
current max load by this fraction."""


@dataclass(frozen=True)
class Certificate:
    """The bracket of the optimal max load of every layer.

    Attributes:
        lower: ``[L]`` float64, :func:`eplb.bounds.lower_bound` (no placement is lighter).
        upper: ``[L]`` float64, max GPU load of ``phy2log`` (achieved).
        start: ``[L]`` float64, max GPU load of the starting placement (``upper <= start``).
        phy2log: ``[L, S]`` int64, the lightest placement found (no two replicas of one expert on a
            GPU when ``spread``).
        optimal: ``[L]`` bool, ``upper`` equals ``lower`` up to rounding: proven optimal.
        nodes: ``[L]`` int64, search nodes spent.
    """

    lower: np.ndarray
    upper: np.ndarray
    start: np.ndarray
    phy2log: np.ndarray
    optimal: np.ndarray
    nodes: np.ndarray

    @property
    def gap(self) -> np.ndarray:
        """``upper / lower - 1`` per layer, ``[L]`` (0 on all-zero layers): the most any better
        bound or placement can still gain."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.lower > 0, self.upper / np.where(self.lower > 0, self.lower, 1.0) - 1.0, 0.0)


def _replicas(w: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replica loads ``[S]`` non-increasing (ties by expert id, replicas of one expert adjacent)
    and their experts ``[S]`` int64, for loads ``w [E]`` and replica counts ``counts [E]``."""
    experts = np.repeat(np.arange(w.shape[0], dtype=np.int64), counts)
    loads = w[experts] / counts[experts]
    order = np.lexsort((experts, -loads))
    return np.ascontiguousarray(loads[order]), np.ascontiguousarray(experts[order])


class _Layer:
    """The packing search of one layer: ``try_cap`` packs given counts under a cap."""

    def __init__(self, w: np.ndarray, num_gpus: int, slots: int, spread: bool, budget: int, max_attempts: int):
        self.w, self.num_gpus, self.slots, self.spread, self.budget = w, num_gpus, slots, spread, budget
        self.nodes = 0
        self.attempts = max_attempts

    def try_cap(self, counts: np.ndarray, cap: float):
        """``(max load, phy2log row [S])`` of a packing of ``counts`` under ``cap``, or ``None``
        (also once the layer's attempts are spent)."""
        if self.attempts <= 0:
            return None
        self.attempts -= 1
        loads, experts = _replicas(self.w, counts)
        status, gpu, nodes = pack_under_cap(loads, experts, self.num_gpus, self.slots, float(cap), self.spread,
                                            self.budget)
        self.nodes += int(nodes)
        if status != FOUND:
            return None
        gpu_loads = np.bincount(gpu, weights=loads, minlength=self.num_gpus)
        order = np.lexsort((experts, gpu))  # GPU by GPU, experts in increasing id
        return float(gpu_loads.max()), experts[order]

    def bisect(self, counts: np.ndarray, low: float, found):
        """Lower ``found = (max load, row)`` for ``counts`` by bisection down to ``low``."""
        high = found[0]
        while high - low > RELATIVE_STEP * high and self.attempts > 0:
            mid = 0.5 * (low + high)
            better = self.try_cap(counts, mid)
            if better is None:
                low = mid
            else:
                found = better
                high = better[0]
        return found


def improve_layer(w: np.ndarray, row: np.ndarray, num_gpus: int, slots: int, lower: float, *,
                  neighbours: bool = True, spread: bool = True, budget: int = 20_000,
                  max_attempts: int = 20_000):
    """The lightest placement of one layer the capped search finds from ``row``.

    Args:
        w: ``[E]`` float64 expert loads; row: ``[S]`` int64 starting placement (``S = G k``).
        num_gpus, slots: ``G`` identical GPUs of ``k`` slots; lower: a valid lower bound.
        neighbours: also descend over replica counts (one replica moved between two experts).
        spread: no two replicas of one expert on a GPU.
        budget: search nodes per packing attempt (an attempt out of budget counts as failed).
        max_attempts: most packing attempts for the layer (bounds the time on large layers, where
            one pass of the descent tries ``E (E - 1)`` moves).
    Returns:
        ``(max load, row [S] int64, nodes)``.
    """
    counts = np.bincount(row, minlength=w.shape[0]).astype(np.int64)
    start = float(np.bincount(np.arange(row.shape[0]) // slots, weights=w[row] / counts[row], minlength=num_gpus).max())
    search = _Layer(w, num_gpus, slots, spread, budget, max_attempts)
    best = (start, np.asarray(row, dtype=np.int64))
    if start <= lower or w.max() <= 0.0:
        return best[0], best[1], 0
    found = search.try_cap(counts, start)
    if found is not None and found[0] <= best[0]:
        best = search.bisect(counts, lower, found)
    if neighbours:
        improved = True
        while improved and best[0] > lower * (1.0 + RELATIVE_STEP) and search.attempts > 0:
            improved = False
            for a in range(w.shape[0]):
                if counts[a] == 1:
                    continue
                for b in range(w.shape[0]):
                    if b == a:
                        continue
                    moved = counts.copy()
                    moved[a] -= 1
                    moved[b] += 1
                    found = search.try_cap(moved, best[0] * (1.0 - RELATIVE_STEP))
                    if found is not None:
                        counts = moved
                        best = search.bisect(counts, lower, found)
                        improved = True
                        break
                if improved:
                    break
    return best[0], best[1], search.nodes


def certify(counts, topology: Topology, start=None, *, neighbours: bool = True, spread: bool = True,
            budget: int = 20_000, max_attempts: int = 20_000) -> Certificate:
    """Bracket the optimal max load of every layer (see the module docstring).

    Args:
        counts: ``[L, E]`` non-negative loads (``[E]`` for one layer).
        topology: identical GPUs (every GPU the same number of slots), one placement domain.
        start: ``[L, S]`` starting placement (``phy2log``) or a :class:`~eplb.Placement`;
            default ``eplb.plan(counts, topology=topology, method="best")``.
        neighbours, spread, budget, max_attempts: see :func:`improve_layer`.
    Returns:
        A :class:`Certificate`.
    """
    from .api import _weights_2d, plan
    from .placement import check_placement

    weights = _weights_2d(counts, "counts")
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be an eplb.Topology, got {type(topology).__name__}")
    if not topology.is_uniform or int(topology.slots_per_gpu.min()) < 1:
        raise ValueError("topology must give every GPU the same number of slots (>= 1) for certify")
    for name, value in (("budget", budget), ("max_attempts", max_attempts)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if start is None:
        start = plan(weights, topology=topology, method="best")
    start = getattr(start, "phy2log", start)
    start, _ = check_placement(start, weights.shape[1], topology)
    if start.shape[0] != weights.shape[0]:
        raise ValueError(f"start must have {weights.shape[0]} layers, got {start.shape[0]}")
    lower = lower_bound(weights, topology)
    num_gpus, slots = topology.num_gpus, int(topology.slots_per_gpu[0])
    num_layers = weights.shape[0]
    upper, first = np.empty(num_layers), np.empty(num_layers)
    phy2log = start.copy()
    nodes = np.zeros(num_layers, np.int64)
    for layer in range(num_layers):
        w = weights[layer]
        counts_row = replica_counts(np.ascontiguousarray(start[layer:layer + 1]), w.shape[0])[0]
        first[layer] = np.bincount(np.arange(start.shape[1]) // slots,
                                   weights=w[start[layer]] / counts_row[start[layer]], minlength=num_gpus).max()
        upper[layer], phy2log[layer], nodes[layer] = improve_layer(
            w, start[layer], num_gpus, slots, float(lower[layer]), neighbours=neighbours, spread=spread,
            budget=int(budget), max_attempts=int(max_attempts))
    optimal = upper <= lower * (1.0 + 1e-9)
    return Certificate(lower=lower, upper=upper, start=first, phy2log=phy2log, optimal=optimal, nodes=nodes)
