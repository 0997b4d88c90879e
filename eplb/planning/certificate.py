"""Offline certificates: how close to optimal a layer's placement can get, measured.

:func:`certify` brackets the optimum of every layer between the package's lower bound
(:func:`eplb.analysis.bounds.lower_bound`) and the max load of a placement it finds with an exact packing
search under a load cap (:mod:`eplb.kernels.search.capped`):

1. start from a placement (by default ``method="best"``) and its replica counts;
2. bisect the cap between the lower bound and the start's max load: the search packs the replicas
   under the cap (a packing found lowers the cap; a search that exhausts its tree proves no packing
   of *these replicas* meets the cap);
3. then (``neighbours=True``) a descent over the replica counts: move one replica from one expert
   to another, keep the first move whose replicas pack under ``(1 - 1e-7)`` times the current max
   load, bisect again, repeat until no move helps.

Opt-in and offline: with 40 slots (gpt-oss-20b on 8 GPUs) a layer takes ~0.7 s (median) at the
default 20,000 nodes per attempt and lands 0.008% (mean) above the average bound, where ``best``
is at ~0.1%; ``budget=1_000``: ~45 ms and 0.026% (``bench/research/gpt_oss_certificate.py``). It needs
identical GPUs in one domain (global mode, uniform topology) and pays off on small GPUs (a few
slots each; on 144 slots over 8 GPUs it found nothing lighter than ``best``). The search is exact for the replica counts it tries, not over every
replication, so ``upper`` is an achievable max load (a placement holds it) and ``lower`` the
bound: the optimum lies in ``[lower, upper]``; ``optimal`` marks layers where they meet.
Deterministic: node budgets, no clock and no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..analysis.bounds import strongest_bound
from ..analysis.placement import check_placement
from ..kernels.plumbing.layout import replica_counts
from ..analysis.searches import RELATIVE_STEP, improve_layer
from ..model.deployment import Deployment, make_deployment
from ..model.counts import weights_2d
from ..model.topology import Topology
from .api import plan

__all__ = ["Certificate", "certify", "improve_layer", "RELATIVE_STEP"]


@dataclass(frozen=True)
class Certificate:
    """The bracket of the optimal max load of every layer.

    Attributes:
        lower: ``[L]`` float64, :func:`eplb.analysis.bounds.lower_bound` (no placement is lighter).
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


def certify(counts, *, num_slots=None, num_gpus=None, topology: Topology | None = None, start=None,
            neighbours: bool = True, spread: bool = True, budget: int = 20_000,
            max_attempts: int = 20_000) -> Certificate:
    """Bracket the optimal max load of every layer (see the module docstring).

    Args:
        counts: ``[L, E]`` non-negative loads (``[E]`` for one layer).
        num_slots, num_gpus: the deployment, as for :func:`eplb.plan` (one placement domain), or
        topology: identical GPUs (every GPU the same number of slots).
        start: ``[L, S]`` starting placement (``phy2log``) or a :class:`~eplb.Placement`;
            default ``eplb.plan(counts, topology=topology, method="best")``.
        neighbours, spread, budget, max_attempts: see :func:`improve_layer`.
    Returns:
        A :class:`Certificate`.
    """
    weights = weights_2d(counts, "counts")
    topology = make_deployment(weights.shape[1], num_slots, num_gpus, 1, None, topology).topology
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
    lower = strongest_bound(weights, Deployment(weights.shape[1], topology))
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
