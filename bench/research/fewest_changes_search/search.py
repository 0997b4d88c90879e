"""Proven fewest slot changes within a load cap: an exact combinatorial search (global mode).

Migration-aware planning (:mod:`eplb.planning.migration`) changes few slots of the placement in service;
this module says how few any placement within the cap can change, with a proof, and finds such a
placement. It answers the same question as the CP-SAT model of :mod:`eplb.planning.exact_migration` (same
rules: every expert keeps a replica, no GPU gets a second replica of an expert it held unless
``shared``), by the dedicated search of :mod:`fewest_changes_search.kernels` instead, per layer:

1. refute ``k = 1, 2, ...`` changed slots in turn, exhaustively; every refuted ``k`` is a proof
   that every placement within the cap changes more than ``k`` slots, and the first ``k`` where a
   placement is found is the proven minimum;
2. where the budget of step 1 runs out: the same deepening with every replica count fixed to the
   incumbent's (e.g. eplb's own plan), then to each hint's (e.g. a plan from scratch): a far
   smaller search that finds placements (upper bounds, not proofs).

(Searching directly for fewer changes than a placement in hand, with a loose ``k`` and free
counts, does not work: the bounds then prune little and the first replica counts tried swallow the
budget; the tight ``k`` of the deepening keeps the search focused.)

A budget of search nodes (``work``) bounds the time per layer (about a microsecond per node);
where it runs out the result is the fewest changes found (or the ``incumbent``, e.g. eplb's own
plan) and the proven lower bound. Deterministic: no randomness, no clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from eplb.model._validation import as_int
from eplb import Deployment
from eplb import Topology

from .kernels import FOUND, REFUTED, fewest_changes_exact

MOST_SLOTS_PER_GPU = 16  # the search enumerates subsets of a GPU's slots
DEFAULT_WORK = 5_000_000  # search nodes per layer (~ a few seconds)


@dataclass
class LayerProof:
    """One layer's outcome.

    Attributes:
        slots: ``[S]`` int64 phy2log row within the cap (the incumbent if nothing better was found).
        changes: slots of ``slots`` that differ from the previous row.
        lower_bound: proven: every placement within the cap changes at least this many slots.
        proven: ``changes == lower_bound``.
        nodes: search nodes spent; time_s: wall time of the search.
    """

    slots: np.ndarray
    changes: int
    lower_bound: int
    proven: bool
    nodes: int
    time_s: float


def _peak(row: np.ndarray, w: np.ndarray, topology: Topology) -> float:
    """Max GPU load of ``row [S]`` on ``w [E]`` (as :func:`eplb.analysis.loads.slot_order_peaks`)."""
    counts = np.bincount(row, minlength=len(w))
    return float(np.bincount(topology.gpu_of_slot, weights=w[row] / counts[row], minlength=topology.num_gpus).max())


def follows_rules(row: np.ndarray, previous: np.ndarray, num_experts: int, topology: Topology,
                  shared: bool = False) -> bool:
    """Whether ``row [S]`` holds every expert and (unless ``shared``) gives no GPU more replicas of
    an expert than ``max(1, what it held in previous [S])``: the placements the search covers."""
    if (np.bincount(row, minlength=num_experts) == 0).any():
        return False
    if shared:
        return True
    for g in range(topology.num_gpus):
        lo, hi = topology.slot_offsets[g], topology.slot_offsets[g + 1]
        new = np.bincount(row[lo:hi], minlength=num_experts)
        old = np.bincount(previous[lo:hi], minlength=num_experts)
        if (new > np.maximum(old, 1)).any():
            return False
    return True


def prove_layer(w: np.ndarray, topology: Topology, previous: np.ndarray, *, cap: float,
                incumbent: np.ndarray | None = None, hints: tuple = (), shared: bool = False,
                work: int = DEFAULT_WORK, proof_share: float = 0.6) -> LayerProof:
    """The fewest changed slots of ``previous`` for a placement with max GPU load ``<= cap``.

    Args:
        w: ``[E]`` float64 loads; topology: slots per GPU (at most 16 per GPU); previous: ``[S]``
            int64, the placement in service (every expert present).
        cap: max GPU load allowed (count units).
        incumbent: ``[S]`` a placement in hand (used if within the cap and within the rules).
        hints: ``[S]`` placements (e.g. a plan from scratch) whose replica counts step 2 tries after
            the incumbent's.
        shared: allow several new replicas of an expert on a GPU that keeps all its previous ones.
        work: most search nodes for the layer; proof_share: the part for step 1.
    Returns:
        :class:`LayerProof`.
    """
    start = time.perf_counter()
    num_slots = topology.num_slots
    best_row, best = previous.copy(), num_slots + 1  # num_slots + 1: nothing in hand
    if incumbent is not None and _peak(incumbent, w, topology) <= cap and follows_rules(
            incumbent, previous, len(w), topology, shared):
        best_row, best = incumbent.copy(), int((incumbent != previous).sum())
    if not w.any() or _peak(previous, w, topology) <= cap:  # nothing needs to change
        return LayerProof(previous.copy(), 0, 0, True, 0, time.perf_counter() - start)
    offsets = np.ascontiguousarray(topology.slot_offsets, dtype=np.int64)
    w = np.ascontiguousarray(w, dtype=np.float64)
    previous = np.ascontiguousarray(previous, dtype=np.int64)
    lower = 1  # the previous row exceeds the cap

    def accept(row) -> bool:
        nonlocal best_row, best
        count = int((row != previous).sum())
        # the kernel compares loads with a relative slack of 1e-12: check the true max load
        if count < best and _peak(row, w, topology) <= cap:
            best_row, best = row, count
            return True
        return False

    # refute k = 1, 2, ... up to the best in hand: the first k where a placement is found is the minimum
    # 1. refute k = 1, 2, ... up to the best in hand: the first k where a placement is found is the minimum
    free_lo, free_hi = np.ones(len(w), np.int64), np.full(len(w), num_slots, np.int64)
    status, row, bound, nodes = fewest_changes_exact(w, previous, offsets, float(cap), lower, best, shared,
                                                     max(1, int(work * proof_share)), free_lo, free_hi)
    lower = max(lower, bound)
    if status == FOUND and accept(row):
        lower = best  # every k below the one found was refuted
    elif status == REFUTED:
        lower = best  # nothing with fewer changes than the incumbent
    # 2. out of work: the same deepening with the replica counts fixed to those of the incumbent, then
    # of each hint (a much smaller search: placements, not proofs)
    tried = []
    for row in ([] if incumbent is None else [incumbent]) + list(hints):
        counts = np.bincount(np.asarray(row, dtype=np.int64), minlength=len(w)).astype(np.int64)
        if lower >= best or (counts == 0).any() or any((counts == c).all() for c in tried):
            continue
        tried.append(counts)
    for i, counts in enumerate(tried):
        budget = (work - nodes) // (len(tried) - i)
        if lower >= best or budget <= 0:
            break
        status, row, _, spent = fewest_changes_exact(w, previous, offsets, float(cap), lower, best, shared, budget,
                                                     counts, counts)
        nodes += spent
        if status == FOUND:
            accept(row)
    lower = min(lower, best)
    return LayerProof(best_row, best, lower, best == lower, nodes, time.perf_counter() - start)


def prove_fewest_changes(weights: np.ndarray, deployment: Deployment, previous: np.ndarray,
                         incumbent: np.ndarray | None = None, *, cap: np.ndarray, hints: tuple = (),
                         shared: bool = False, work: int = DEFAULT_WORK) -> tuple[np.ndarray, dict]:
    """:func:`prove_layer` on every layer.

    Args:
        weights: ``[L, E]`` loads; deployment: topology (global mode only: no groups kept on nodes);
        previous: ``[L, S]`` int64 the placement in service; incumbent: ``[L, S]`` or None;
        cap: ``[L]`` max GPU load per layer; hints: ``[L, S]`` placements (see :func:`prove_layer`);
        shared, work: as in :func:`prove_layer`.
    Returns:
        ``phy2log [L, S]`` and info: ``slots_changed [L]``, ``lower_bound [L]`` (proven fewest
        changes), ``proven [L]`` bool, ``nodes [L]``, ``time_s [L]``.
    """
    weights = np.asarray(weights, dtype=np.float64)
    topology = deployment.topology
    if deployment.hierarchical:
        raise ValueError("problem: the exact search covers global mode only (num_groups=None or one node)")
    if weights.ndim != 2:
        raise ValueError(f"weights must be [L, E], got shape {weights.shape}")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("weights must be finite and non-negative")
    num_layers, num_experts = weights.shape
    previous = np.asarray(previous)
    if previous.shape != (num_layers, topology.num_slots):
        raise ValueError(f"previous must be [L, S] = [{num_layers}, {topology.num_slots}], got {previous.shape}")
    if previous.min() < 0 or previous.max() >= num_experts or any(
            (np.bincount(row, minlength=num_experts) == 0).any() for row in previous):
        raise ValueError("previous must hold every expert in every layer (ids in [0, E))")
    if incumbent is not None and np.shape(incumbent) != previous.shape:
        raise ValueError(f"incumbent must have the shape of previous {previous.shape}, got {np.shape(incumbent)}")
    cap = np.broadcast_to(np.asarray(cap, dtype=np.float64), (num_layers,))
    if int(topology.slots_per_gpu.max()) > MOST_SLOTS_PER_GPU:
        raise ValueError(f"topology: at most {MOST_SLOTS_PER_GPU} slots per GPU for the exact search, "
                         f"got {int(topology.slots_per_gpu.max())}")
    work = as_int(work, "work", minimum=1)
    out = np.empty_like(previous, dtype=np.int64)
    info = {key: np.zeros(num_layers, dtype) for key, dtype in (
        ("slots_changed", np.int64), ("lower_bound", np.int64), ("proven", bool), ("nodes", np.int64),
        ("time_s", np.float64))}
    for layer in range(num_layers):
        proof = prove_layer(weights[layer], topology, previous[layer].astype(np.int64), cap=float(cap[layer]),
                            incumbent=None if incumbent is None else np.asarray(incumbent[layer], dtype=np.int64),
                            hints=tuple(np.asarray(h[layer], dtype=np.int64) for h in hints), shared=shared,
                            work=work)
        out[layer] = proof.slots
        for key, value in (("slots_changed", proof.changes), ("lower_bound", proof.lower_bound),
                           ("proven", proof.proven), ("nodes", proof.nodes), ("time_s", proof.time_s)):
            info[key][layer] = value
    return out, info
