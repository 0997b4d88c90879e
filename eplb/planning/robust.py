"""Placements for a series of windows under uniform split: lower the expected step time.

An engine that splits each expert's tokens evenly among its replicas (vLLM, TensorRT-LLM) waits,
in every window, for its most loaded GPU. :func:`improve_expected_peak` takes a placement (e.g.
the plan of the summed counts) and searches, per layer, for one whose weighted mean over the
windows of ``peak / mean`` GPU load is lower: it swaps experts between GPUs and moves redundant
replicas from one expert to another (:func:`eplb.kernels.expected_peak.improve_expected_peak`).

Held out (leave one workload out, next window), the search serves windows whose hot experts differ
in structure (workloads of real traces, drifting popularity) much better than the plan of the
summed counts. When windows differ only by independent noise around one popularity, no fixed
placement can do much better than the summed counts and the search only fits the noise; ``folds``
checks by cross-validation over the windows which case a series is, and keeps the start when the
search does not pay on windows it has not seen.
"""

from __future__ import annotations

import numpy as np

from ..model._validation import as_counts
from ..kernels.expected_peak import improve_expected_peak as _improve
from ..analysis.windows import check_window_weights, window_peaks

DEFAULT_ITERATIONS = 20000
DEFAULT_ANCHOR = 0.25
DEFAULT_FOLDS = 4


def _zones(problem) -> np.ndarray:
    """``[S]`` int64 zone of each slot: its node when groups stay on their node, else 0."""
    topology = problem.topology
    if problem.hierarchical:
        return np.ascontiguousarray(topology.node_of_gpu[topology.gpu_of_slot], dtype=np.int64)
    return np.zeros(topology.num_slots, np.int64)


def improve_expected_peak(series, phy2log, problem, window_weights=None, *, iterations: int = DEFAULT_ITERATIONS,
                          replica_moves: bool = True, seed: int = 1, anchor: float = DEFAULT_ANCHOR,
                          folds: int = DEFAULT_FOLDS):
    """Search from ``phy2log`` for a placement with a lower expected uniform-split peak on ``series``.

    Per layer, the objective is the weighted mean over windows of ``max GPU load / mean GPU load``
    with each replica taking ``1 / logcnt`` of its expert's tokens (windows are compared at the same
    total, so a long window does not outweigh a short one). Moves: swap the experts of two slots on
    different GPUs; with ``replica_moves``, give a redundant replica of one expert to another.
    Every expert keeps at least one replica, every GPU its slot count, no GPU gets a second replica
    of an expert it already holds, and with a hierarchical ``problem`` every expert stays on its
    node. The result is never worse than ``phy2log`` on the objective searched, and the same input
    always gives the same output (``seed`` fixes the random stream). Cost: about ``iterations``
    moves of ``O(T)`` each per layer, ``1 + folds`` times with the cross-validation check.

    ``anchor`` guards against fitting the windows at the expense of the average traffic: the
    weighted sum of the windows joins them as one more window, weighing ``anchor`` times all the
    others together (``0``: the windows alone), so the plan keeps most of the balance of the summed
    counts while it serves the windows better.

    Args:
        series: ``[T, L, E]`` non-negative counts (``[L, E]`` is one window).
        phy2log: ``[L, S]`` integer starting placement for ``problem`` (every expert has a slot).
        problem: an :class:`eplb.model.problem.Problem` (its topology and whether groups stay on nodes).
        window_weights: ``[T]`` non-negative weights of the windows (``None``: equal).
        iterations: moves tried per layer (``>= 0``); replica_moves: also change replica counts.
        seed: ``>= 1``, the random stream; anchor: ``>= 0``, the weight of the summed window.
        folds: ``>= 2``: first check by cross-validation over the windows (``folds`` searches
            from the start, each on the windows outside one fold, judged on that fold, pooled over
            layers) that the search serves unseen windows better than the start; if it does not,
            return the start unchanged (``after == before``). ``0`` or ``1``: no check.
    Returns:
        ``phy2log [L, S]`` int64 (a new array) and ``(before [L], after [L])`` float64, the
        objective searched (with the anchor window) before and after.
    """
    windows = as_counts(series, "series", ndims=(2, 3))
    if windows.ndim == 2:
        windows = windows[None]
    weights = check_window_weights(window_weights, windows.shape[0])
    if not (isinstance(iterations, (int, np.integer)) and not isinstance(iterations, bool) and iterations >= 0):
        raise ValueError(f"iterations must be a non-negative integer, got {iterations!r}")
    if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 1):
        raise ValueError(f"seed must be a positive integer, got {seed!r}")
    if not (isinstance(anchor, (int, float, np.integer, np.floating)) and np.isfinite(anchor) and anchor >= 0):
        raise ValueError(f"anchor must be a non-negative number, got {anchor!r}")
    topology = problem.topology
    num_layers, num_experts = windows.shape[1:]
    placement = np.asarray(phy2log)
    if placement.shape != (num_layers, topology.num_slots):
        raise ValueError(f"phy2log must have shape [L, S] = [{num_layers}, {topology.num_slots}], "
                         f"got {placement.shape}")
    if not np.issubdtype(placement.dtype, np.integer):
        raise ValueError(f"phy2log must hold integer expert ids, got dtype {placement.dtype}")
    placement = np.ascontiguousarray(placement, dtype=np.int64)
    if placement.size and (placement.min() < 0 or placement.max() >= num_experts):
        raise ValueError(f"phy2log must hold expert ids in [0, {num_experts})")
    for layer in range(num_layers):
        if np.bincount(placement[layer], minlength=num_experts).min() < 1:
            raise ValueError(f"phy2log must give every expert a slot (layer {layer} misses one)")
    if not (isinstance(folds, (int, np.integer)) and not isinstance(folds, bool) and folds >= 0):
        raise ValueError(f"folds must be a non-negative integer, got {folds!r}")
    options = dict(iterations=int(iterations), replica_moves=bool(replica_moves), seed=int(seed), anchor=float(anchor))
    out, before, after = _search(windows, weights, placement, problem, **options)
    if folds >= 2 and _validated_gain(windows, weights, placement, problem, int(folds), options) <= 0.0:
        return placement.copy(), (before, before.copy())
    return out, (before, after)


def _search(windows, weights, placement, problem, *, iterations, replica_moves, seed, anchor):
    """The kernel on validated arrays, with the anchor window appended."""
    if anchor > 0:  # the weighted sum of the windows as one more window, of weight anchor * sum(weights)
        windows = np.concatenate([windows, np.tensordot(weights, windows, axes=1)[None]])
        weights = np.append(weights, anchor * weights.sum())
    topology = problem.topology
    return _improve(np.ascontiguousarray(windows), np.ascontiguousarray(weights, dtype=np.float64), placement,
                    np.ascontiguousarray(topology.gpu_of_slot, dtype=np.int64),
                    np.ascontiguousarray(topology.slot_offsets, dtype=np.int64), _zones(problem), iterations, seed,
                    replica_moves)


def _validated_gain(windows, weights, placement, problem, folds, options) -> float:
    """Cross-validation over windows: window ``t`` is in fold ``t % folds``; each fold is served by
    the search made from the other windows. Returns the weighted sum over held-out windows and all
    layers of ``peak / mean`` of the start minus that of the search (``> 0``: the search serves
    windows it has not seen better). The start was made from every window, held-out ones included,
    so the comparison leans towards the start."""
    num_windows = windows.shape[0]
    folds = min(folds, num_windows)
    fold_of = np.arange(num_windows) % folds
    gain = 0.0
    for k in range(folds):
        held, kept = fold_of == k, fold_of != k
        if weights[kept].sum() <= 0 or weights[held].sum() <= 0:
            continue
        searched = _search(windows[kept], weights[kept], placement, problem, **options)[0]
        start_peaks = window_peaks(windows[held], placement, problem.topology, "uniform")
        search_peaks = window_peaks(windows[held], searched, problem.topology, "uniform")
        gain += float(np.tensordot(weights[held], start_peaks - search_peaks, axes=1).sum())
    return gain
