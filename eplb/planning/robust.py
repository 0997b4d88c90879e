"""Placements for a series of windows under uniform split: lower the expected step time.

An engine that splits each expert's tokens evenly among its replicas (vLLM, TensorRT-LLM) waits,
in every window, for its most loaded GPU. :func:`improve_expected_peak` takes a placement (e.g.
the plan of the summed counts) and searches, per layer, for one whose weighted mean over the
windows of ``peak / mean`` GPU load is lower: first the best swaps between each window's most
loaded GPU and a light one (:func:`eplb.kernels.expected_peak.pair_descent`, the bulk of the gain in
milliseconds), then random swaps and redundant replicas moved from one expert to another
(:func:`eplb.kernels.expected_peak.improve_expected_peak`).

Held out (leave one workload out, next window), the search serves windows whose hot experts differ
in structure (workloads of real traces, drifting popularity) much better than the plan of the
summed counts. When windows differ only by independent noise around one popularity, no fixed
placement can do much better than the summed counts and the search only fits the noise; ``folds``
checks by cross-validation over the windows which case a series is, and keeps the start when the
search does not pay on windows it has not seen.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..model._validation import as_counts, validated_counts
from ..kernels.expected_peak import improve_expected_peak as _improve
from ..kernels.expected_peak import pair_descent
from ..kernels.layout import replica_counts
from ..analysis.loads import peak_loads
from ..analysis.placement import uniform_shares
from ..analysis.windows import check_window_weights

DEFAULT_SWAPS = 200  # best-swap iterations per layer (pair descent)
DEFAULT_ITERATIONS = 800  # random moves per layer after it (swaps and replica moves)
DEFAULT_ANCHOR = 0.25
DEFAULT_FOLDS = 4
DEFAULT_COPY_COST = 0.0005  # per changed slot, in mean peak / mean: see plan(previous=, series)
CHECK_LAYERS = 6  # the cross-validation check searches at most this many layers (evenly spread)


def gpu_zones(problem) -> np.ndarray:
    """``[G]`` int64 zone of each GPU, which moves stay inside: its node when groups stay on their
    node, else 0."""
    topology = problem.topology
    if problem.hierarchical:
        return np.ascontiguousarray(topology.node_of_gpu, dtype=np.int64)
    return np.zeros(topology.num_gpus, np.int64)


def slot_zones(problem) -> np.ndarray:
    """``[S]`` int64 zone of each slot (:func:`gpu_zones` of its GPU)."""
    return np.ascontiguousarray(gpu_zones(problem)[problem.topology.gpu_of_slot])


class Hedged(NamedTuple):
    """The result of :func:`hedge`: ``phy2log [L, S]`` int64, ``shares [L, S]`` float64 (the
    fraction of its expert's tokens each slot takes), the objective ``before [L]`` / ``after [L]``
    (with the anchor window) and ``searched`` (False: cross-validation kept the start)."""

    phy2log: np.ndarray
    shares: np.ndarray
    before: np.ndarray
    after: np.ndarray
    searched: bool


def improve_expected_peak(series, phy2log, problem, window_weights=None, *, swaps: int = DEFAULT_SWAPS,
                          iterations: int = DEFAULT_ITERATIONS, replica_moves: bool = True, seed: int = 1,
                          anchor: float = DEFAULT_ANCHOR, folds: int = DEFAULT_FOLDS):
    """Search from ``phy2log`` for a placement with a lower expected uniform-split peak on ``series``
    (:func:`hedge` with an even split and no placement in service).

    Returns:
        ``phy2log [L, S]`` int64 (a new array) and ``(before [L], after [L])`` float64, the
        objective searched (with the anchor window) before and after.
    """
    result = hedge(as_counts(series, "series", ndims=(2, 3)), phy2log, problem, window_weights, swaps=swaps, iterations=iterations,
                   replica_moves=replica_moves, seed=seed, anchor=anchor, folds=folds)
    return result.phy2log, (result.before, result.after)


def hedge(series, phy2log, problem, window_weights=None, *, shares=None, previous=None, copy_cost: float = 0.0,
          swaps: int = DEFAULT_SWAPS, iterations: int = DEFAULT_ITERATIONS, replica_moves: bool = True,
          seed: int = 1, anchor: float = DEFAULT_ANCHOR, folds: int = DEFAULT_FOLDS) -> Hedged:
    """Search from ``phy2log`` for a placement with a lower expected peak over the windows of ``series``.

    Per layer, the objective is the weighted mean over windows of ``max GPU load / mean GPU load``,
    each slot taking a fixed fraction of its expert's tokens (``1 / logcnt``, an even split, or the
    given ``shares``); windows are compared at the same total, so a long window does not outweigh a
    short one. Moves: first ``swaps`` best swaps between a window's most loaded GPU and a light GPU
    (:func:`eplb.kernels.expected_peak.pair_descent`; a slot's share moves with its expert); then, under
    an even split and with no ``previous``, ``iterations`` random moves: swaps and, with
    ``replica_moves``, a redundant replica given from one expert to another
    (:func:`eplb.kernels.expected_peak.improve_expected_peak`). Every expert keeps at least one replica,
    every GPU its slot count, no GPU gets a second replica of an expert it already holds, and with
    a hierarchical ``problem`` every slot stays on its node (so no token changes node: a capped
    plan keeps its off-node traffic). The result is never worse than ``phy2log`` on the objective
    searched, and the same input always gives the same output (``seed`` fixes the random stream).
    Cost per layer: ``swaps`` times ``k^2`` swaps scored in ``O(T)`` (``k`` slots per GPU) plus
    ``iterations`` moves of ``O(T)``; the cross-validation check adds ``folds`` searches of at most
    ``CHECK_LAYERS`` layers.

    ``anchor`` guards against fitting the windows at the expense of the average traffic: the
    weighted sum of the windows joins them as one more window, weighing ``anchor`` times all the
    others together (``0``: the windows alone).

    Args:
        series: ``[T, L, E]`` float64 non-negative counts, validated by the caller (``[L, E]`` is one window).
        phy2log: ``[L, S]`` integer starting placement for ``problem`` (every expert has a slot).
        problem: an :class:`eplb.model.problem.Problem` (its topology and whether groups stay on nodes).
        window_weights: ``[T]`` non-negative weights of the windows (``None``: equal).
        shares: ``[L, S]`` fraction of its expert's tokens each slot takes (``None``: ``1 / logcnt``).
        previous: ``[L, S]`` int64, the placement in service; with ``copy_cost > 0`` a swap must
            lower the objective by more than ``copy_cost`` per slot it makes differ from it.
        copy_cost: ``>= 0``, in units of the objective (mean ``peak / mean``) per changed slot.
        swaps: best-swap iterations per layer (``>= 0``); iterations: random moves after them
            (``>= 0``); replica_moves: also change replica counts there.
        seed: ``>= 1``, the random stream; anchor: ``>= 0``, the weight of the summed window.
        folds: ``>= 2``: first check by cross-validation over the windows (``folds`` searches
            from the start, each on the windows outside one fold, judged on that fold, pooled over
            up to ``CHECK_LAYERS`` evenly spread layers) that the search serves unseen windows
            better than the start; if it does not, return the start unchanged (``after ==
            before``). ``0`` or ``1``: no check.
    """
    windows = validated_counts(series, "series", ndims=(2, 3))
    if windows.ndim == 2:
        windows = windows[None]
    weights = check_window_weights(window_weights, windows.shape[0])
    for name, value in (("swaps", swaps), ("iterations", iterations), ("folds", folds)):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 1):
        raise ValueError(f"seed must be a positive integer, got {seed!r}")
    for name, value in (("anchor", anchor), ("copy_cost", copy_cost)):
        if not (isinstance(value, (int, float, np.integer, np.floating)) and np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    num_layers, num_experts = windows.shape[1:]
    placement = _checked_placement(phy2log, "phy2log", num_layers, num_experts, problem.topology.num_slots)
    if shares is None:
        fractions = uniform_shares(placement, replica_counts(placement, num_experts))
    else:
        fractions = np.ascontiguousarray(shares, dtype=np.float64)
        if fractions.shape != placement.shape or not np.isfinite(fractions).all() or (fractions < 0).any():
            raise ValueError(f"shares must be finite, non-negative, of shape [L, S] = {list(placement.shape)}")
    in_service = placement if previous is None else _checked_placement(previous, "previous", num_layers, num_experts,
                                                                       problem.topology.num_slots, complete=False)
    random_moves = int(iterations) if shares is None and previous is None else 0
    options = dict(swaps=int(swaps), iterations=random_moves, replica_moves=bool(replica_moves), seed=int(seed),
                   anchor=float(anchor), previous=in_service, copy_cost=float(copy_cost) if previous is not None else 0.0)
    out, out_fractions, before, after = _search(windows, weights, placement, fractions, problem, **options)
    if folds >= 2 and _validated_gain(windows, weights, placement, fractions, problem, int(folds), options) <= 0.0:
        return Hedged(placement.copy(), fractions, before, before.copy(), False)
    return Hedged(out, out_fractions, before, after, bool((out != placement).any()))


def _checked_placement(phy2log, name: str, num_layers: int, num_experts: int, num_slots: int, *,
                       complete: bool = True) -> np.ndarray:
    """``phy2log [L, S]`` as C-contiguous int64, checked (with ``complete``: every expert has a slot)."""
    placement = np.asarray(phy2log)
    if placement.shape != (num_layers, num_slots):
        raise ValueError(f"{name} must have shape [L, S] = [{num_layers}, {num_slots}], got {placement.shape}")
    if not np.issubdtype(placement.dtype, np.integer):
        raise ValueError(f"{name} must hold integer expert ids, got dtype {placement.dtype}")
    placement = np.ascontiguousarray(placement, dtype=np.int64)
    if placement.size and (placement.min() < 0 or placement.max() >= num_experts):
        raise ValueError(f"{name} must hold expert ids in [0, {num_experts})")
    if complete:
        for layer in range(num_layers):
            if np.bincount(placement[layer], minlength=num_experts).min() < 1:
                raise ValueError(f"{name} must give every expert a slot (layer {layer} misses one)")
    return placement


def _search(windows, weights, placement, fractions, problem, *, swaps, iterations, replica_moves, seed, anchor,
            previous, copy_cost):
    """The kernels on validated arrays, with the anchor window appended: pair descent, then
    random moves. Returns ``(phy2log [L, S], fractions [L, S], before [L], after [L])``."""
    if anchor > 0:  # the weighted sum of the windows as one more window, of weight anchor * sum(weights)
        windows = np.concatenate([windows, np.tensordot(weights, windows, axes=1)[None]])
        weights = np.append(weights, anchor * weights.sum())
    topology = problem.topology
    windows = np.ascontiguousarray(windows, dtype=np.float64)
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    gpu_of_slot = np.ascontiguousarray(topology.gpu_of_slot, dtype=np.int64)
    slot_offsets = np.ascontiguousarray(topology.slot_offsets, dtype=np.int64)
    # every array writable int64 / float64 and scalars as Python numbers: one compiled specialization
    # (a read-only placement, as a Placement's, is a type of its own)
    out, fractions, before, after = pair_descent(windows, weights, np.require(placement, np.int64, "CW"),
                                                 np.require(fractions, np.float64, "CW"), gpu_of_slot, slot_offsets,
                                                 np.require(gpu_zones(problem), np.int64, "CW"), int(swaps), int(seed),
                                                 np.require(previous, np.int64, "CW"), float(copy_cost))
    if iterations > 0:  # even split only: the random moves recount replicas
        out, _, after = _improve(windows, weights, out, gpu_of_slot, slot_offsets, slot_zones(problem), iterations, seed,
                                 replica_moves)
        fractions = uniform_shares(out, replica_counts(out, windows.shape[2]))
    return out, fractions, before, after


def window_share_peaks(windows: np.ndarray, phy2log: np.ndarray, fractions: np.ndarray, topology) -> np.ndarray:
    """``[T, L]`` each window's max GPU load over its mean (1.0 for an all-zero layer), slot ``s``
    taking ``fractions[l, s]`` of its expert's tokens (``windows [T, L, E]``, ``phy2log`` and
    ``fractions`` ``[L, S]``)."""
    peak = peak_loads(windows, phy2log, topology, shares=fractions)
    mean = windows.sum(axis=-1) / topology.num_gpus
    return np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)


def _validated_gain(windows, weights, placement, fractions, problem, folds, options) -> float:
    """Cross-validation over windows: window ``t`` is in fold ``t % folds``; each fold is served by
    the search made from the other windows. Returns the weighted sum over held-out windows and the
    checked layers of ``peak / mean`` of the start minus that of the search (``> 0``: the search
    serves windows it has not seen better). The start was made from every window, held-out ones
    included, so the comparison leans towards the start."""
    num_windows = windows.shape[0]
    folds = min(folds, num_windows)
    fold_of = np.arange(num_windows) % folds
    layers = np.unique(np.linspace(0, windows.shape[1] - 1, min(CHECK_LAYERS, windows.shape[1])).round().astype(np.int64))
    windows, placement, fractions = windows[:, layers], placement[layers], fractions[layers]
    options = {**options, "previous": options["previous"][layers]}
    topology = problem.topology
    gain = 0.0
    for k in range(folds):
        held, kept = fold_of == k, fold_of != k
        if weights[kept].sum() <= 0 or weights[held].sum() <= 0:
            continue
        searched, searched_fractions, _, _ = _search(windows[kept], weights[kept], placement, fractions, problem,
                                                     **options)
        start_peaks = window_share_peaks(windows[held], placement, fractions, topology)
        search_peaks = window_share_peaks(windows[held], searched, searched_fractions, topology)
        gain += float(np.tensordot(weights[held], start_peaks - search_peaks, axes=1).sum())
    return gain
