"""How the windows of a series ``counts [T, L, E]`` combine into a plan.

A placement is made from windows it will not serve. Summing them (``"sum"``) plans for the average
traffic; the other objectives hedge against the windows that differ from it:

- ``"quantile"``: each expert's high quantile (``q``, default 0.9) of its share of the layer's
  tokens over the windows, so an expert that is hot in a tenth of the windows is planned as hot;
- ``"max_share"``: each expert's largest share over the windows;
- ``"expected_peak"``: per layer, among plans made from the estimators above, the one with the
  smallest mean over windows of each window's peak GPU load (the expected step time);
- ``"worst_window"``: likewise, the one whose worst window is best;
- ``"expected_peak_search"`` (the default under uniform split): the plan of the summed counts,
  then a search that lowers the mean over windows of each window's uniform-split peak, kept only
  when cross-validation over the windows says it serves unseen windows better
  (:func:`eplb.planning.robust.improve_expected_peak`).

:func:`combine` turns a series into planning weights ``[L, E]`` (the first three);
:func:`plan_estimated` plans a series from them (the first four objectives), :func:`hedge_windows`
runs the search; :mod:`eplb.planning.pipeline` puts them in order. For an engine that splits tokens
optimally (``dispatch="optimal"``) the plan is *made for dispatch*: each candidate's redundant replicas are also laid out as rings
linking every GPU (:func:`link_replicas`: the heaviest experts get two replicas on neighbouring
GPUs), selections are scored by optimal-dispatch peaks among the plans with and without links,
and a swap search (:func:`made_for_dispatch`, moving only single-replica experts) then lowers the
mean optimal-dispatch peak over the windows. What matters there is how load can flow between GPUs
through replicated experts, which uniform planning ignores; held out, it lifts optimal-dispatch
balancedness a lot (``bench/out_of_sample.py``: the links beat swaps alone on every synthetic
series) and lowers uniform-split balancedness, so it is only for engines that dispatch optimally.
Windows are scaled to the same total before shares and peaks are compared, so a long window
does not outweigh a short one; ``window_weights [T]`` (e.g. :func:`recency_weights`) weigh them.
"""

from __future__ import annotations

import numpy as np

from ..model._validation import as_int, validated_counts
from ..kernels.split.dispatch_swaps import improve_for_dispatch
from ..kernels.search.linked import linked_placement
from .robust import Hedged, gpu_zones, hedge, slot_zones
from ..analysis.windows import DISPATCH_SCORING, check_window_weights, window_peaks

COMBINERS = ("sum", "quantile", "max_share")
SELECTORS = ("expected_peak", "worst_window")
SEARCHES = ("expected_peak_search",)  # uniform split only
SEARCH_WINDOWS = 16  # longer series are searched on this many contiguous blocks of windows
OBJECTIVES = COMBINERS + SELECTORS + SEARCHES
# The objective for a series when none is given, per dispatch mode, from held-out windows in
# bench/out_of_sample.py (results/out_of_sample.md): with optimal dispatch, "expected_peak" (then
# made for dispatch) beat the summed counts on every series and deployment, mean and worst
# window; with uniform split the selections gained on drifting series and real traces but lost
# ~0.003 on synthetic workloads, while "expected_peak_search" was never below the sum (its
# cross-validation keeps the sum plan where windows differ only by noise) and gained 0.02-0.12 on
# drifting series and real traces.
DEFAULT_OBJECTIVE = {"uniform": "expected_peak_search", "optimal": "expected_peak"}
# the estimators a selection objective plans from: (combiner, quantile)
CANDIDATES = (("sum", None), ("quantile", 0.75), ("quantile", 0.9), ("max_share", None))


def recency_weights(num_windows: int, half_life: float) -> np.ndarray:
    """``[T]`` weights ``0.5 ** ((T - 1 - t) / half_life)``: the newest window weighs 1, one
    ``half_life`` of windows earlier weighs 1/2."""
    num_windows = as_int(num_windows, "num_windows", minimum=1)
    if isinstance(half_life, (bool, np.bool_)) or not isinstance(half_life, (int, float, np.integer, np.floating)) \
            or not np.isfinite(half_life) or half_life <= 0:
        raise ValueError(f"half_life must be a positive number of windows, got {half_life!r}")
    return 0.5 ** ((num_windows - 1 - np.arange(num_windows)) / float(half_life))


def _shares(series: np.ndarray) -> np.ndarray:
    """``[T, L, E]`` counts -> each expert's share of its window's layer (all-zero rows stay 0)."""
    totals = series.sum(axis=-1, keepdims=True)
    return np.divide(series, totals, out=np.zeros_like(series), where=totals > 0)


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Quantile ``q`` over axis 0 of ``values [T, ...]`` with window weights ``[T]`` (the smallest
    value whose cumulative weight reaches ``q`` of the total; with equal weights, the
    ``ceil(q * T)``-th smallest)."""
    order = np.argsort(values, axis=0, kind="stable")
    ordered = np.take_along_axis(values, order, axis=0)
    cumulative = np.cumsum(weights[order], axis=0)
    cumulative /= cumulative[-1:]
    index = (cumulative < q - 1e-12).sum(axis=0, keepdims=True)
    return np.take_along_axis(ordered, np.minimum(index, values.shape[0] - 1), axis=0)[0]


def combine(counts, objective: str = "sum", window_weights=None, *, quantile: float = 0.9) -> np.ndarray:
    """Planning weights ``[L, E]`` from a series.

    Args:
        counts: ``[T, L, E]`` tokens per expert per window (``[L, E]`` is returned as float64).
        objective: ``"sum"`` (weighted sum over windows), ``"quantile"`` (each expert's weighted
            ``quantile`` of its share over the windows) or ``"max_share"`` (its largest share over
            the windows of positive weight). The last two are scaled to the weighted total tokens.
        window_weights: ``[T]`` non-negative weights (``None``: equal).
        quantile: in ``(0, 1]``, for ``"quantile"``.
    Returns:
        ``[L, E]`` float64.
    """
    series = validated_counts(counts, "counts", ndims=(2, 3))
    if objective not in COMBINERS:
        raise ValueError(f"objective must be one of {COMBINERS} to combine windows, got {objective!r}")
    if not (isinstance(quantile, (int, float)) and 0.0 < quantile <= 1.0):
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    if series.ndim == 2:
        return series
    weights = check_window_weights(window_weights, series.shape[0])
    if objective == "sum":
        return np.tensordot(weights, series, axes=1)
    total = np.tensordot(weights, series.sum(axis=-1), axes=1)[:, None]  # [L, 1]
    shares = _shares(series)
    if objective == "max_share":
        estimate = shares[weights > 0].max(axis=0)
    else:
        estimate = _weighted_quantile(shares, weights, quantile)
    sums = estimate.sum(axis=-1, keepdims=True)
    return np.divide(estimate, sums, out=np.zeros_like(estimate), where=sums > 0) * total





def score(peaks: np.ndarray, objective: str, window_weights: np.ndarray) -> np.ndarray:
    """``[L]``: the objective of per-window normalised peaks ``[T, L]`` (lower is better)."""
    if objective == "expected_peak":
        return np.tensordot(window_weights / window_weights.sum(), peaks, axes=1)
    if objective == "worst_window":
        return peaks[window_weights > 0].max(axis=0)
    raise ValueError(f"objective must be one of {SELECTORS} to score windows, got {objective!r}")


def select_per_layer(series: np.ndarray, candidates, topology, objective: str, window_weights=None,
                     dispatch: str = "uniform"):
    """Per layer, the candidate placement with the best objective on the windows.

    Args:
        series: ``[T, L, E]`` float64 counts the candidates are judged on.
        candidates: ``C`` placements ``[L, S]`` int64 (a sequence or ``[C, L, S]``).
        objective: one of ``SELECTORS``; dispatch: ``"uniform"`` or ``"optimal"`` peaks.
    Returns:
        ``phy2log [L, S]`` (layer ``l`` from candidate ``chosen[l]``), ``chosen [L]`` int64 (the
        first best on ties) and ``scores [C, L]``.
    """
    weights = check_window_weights(window_weights, series.shape[0])
    candidates = np.asarray(candidates, dtype=np.int64)
    scores = np.stack([score(window_peaks(series, c, topology, dispatch), objective, weights) for c in candidates])
    chosen = np.argmin(scores, axis=0)
    phy2log = candidates[chosen, np.arange(series.shape[1])]
    return np.ascontiguousarray(phy2log), chosen, scores


def _blocks(series: np.ndarray, weights: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``limit`` windows: contiguous blocks of windows summed (weights averaged)."""
    if series.shape[0] <= limit:
        return series, weights
    edges = np.linspace(0, series.shape[0], limit + 1).round().astype(np.int64)
    blocks = np.stack([series[a:b].sum(axis=0) for a, b in zip(edges[:-1], edges[1:])])
    return blocks, np.array([weights[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])


def made_for_dispatch(series: np.ndarray, phy2log: np.ndarray, deployment, window_weights=None, *,
                      iterations: int = 300, max_windows: int = 16, seed: int = 1, keep_replicas: bool = False):
    """Swap slots of ``phy2log`` so that, with optimal dispatch, the weighted mean over windows of
    ``peak / mean load`` drops (:func:`eplb.kernels.split.dispatch_swaps.improve_for_dispatch`).

    Swaps stay on one node when the problem keeps groups on their nodes; replica counts do not
    change, and with ``keep_replicas`` only experts with one replica move (the replicated ones
    keep the GPUs :func:`link_replicas` gave them). Cost: about ``iterations * T`` optimal dispatches of one layer per layer (``T`` at
    most ``max_windows``: longer series are summed in contiguous blocks).

    Args:
        series: ``[T, L, E]`` float64; phy2log: ``[L, S]`` int64; deployment: a ``Deployment``.
    Returns:
        ``phy2log [L, S]`` int64 and ``(before [L], after [L])``, the objective on the windows.
    """
    weights = check_window_weights(window_weights, series.shape[0])
    if not (isinstance(iterations, (int, np.integer)) and iterations >= 0):
        raise ValueError(f"iterations must be a non-negative integer, got {iterations!r}")
    if not (isinstance(max_windows, (int, np.integer)) and max_windows >= 1):
        raise ValueError(f"max_windows must be a positive integer, got {max_windows!r}")
    blocks, block_weights = _blocks(series, weights, int(max_windows))
    topology = deployment.topology
    zone = slot_zones(deployment)
    out, before, after = improve_for_dispatch(
        np.ascontiguousarray(blocks, dtype=np.float64), np.ascontiguousarray(block_weights),
        np.require(phy2log, dtype=np.int64, requirements="C"), topology.gpu_of_slot, topology.slot_offsets,
        zone, int(iterations), int(seed), bool(keep_replicas),
    )
    return out, (before, after)


def link_replicas(weights: np.ndarray, phy2log: np.ndarray, deployment) -> tuple[np.ndarray, np.ndarray]:
    """Lay out the redundant replicas of ``phy2log`` as rings linking the GPUs
    (:func:`eplb.kernels.search.linked.linked_placement`): per zone (node when groups stay on their
    node), the heaviest experts get two replicas each on neighbouring GPUs of a ring through every
    GPU, the others fill the slots left, least loaded GPU first. With optimal dispatch, load can
    then flow around the ring to wherever a window needs it.

    Args:
        weights: ``[L, E]`` float64 planning weights; phy2log: ``[L, S]`` int64 (gives each zone
            its experts); deployment: a ``Deployment``.
    Returns:
        ``phy2log [L, S]`` int64 and ``linked [L]`` bool (``False``: the layer kept ``phy2log``,
        e.g. more redundant slots than experts).
    """
    topology = deployment.topology
    return linked_placement(np.ascontiguousarray(weights, dtype=np.float64),
                            np.require(phy2log, dtype=np.int64, requirements="C"), topology.gpu_of_slot,
                            topology.slot_offsets, gpu_zones(deployment))


def hedge_windows(series: np.ndarray, phy2log: np.ndarray, deployment, window_weights=None, **options) -> Hedged:
    """The search of ``"expected_peak_search"`` (:func:`eplb.planning.robust.hedge`) from ``phy2log [L, S]``
    over the windows of ``series [T, L, E]`` (longer series as ``SEARCH_WINDOWS`` contiguous
    blocks); ``options`` go to the search (``shares``, ``previous``, ``copy_cost``, ...)."""
    weights = check_window_weights(window_weights, series.shape[0])
    blocks, block_weights = _blocks(series, weights, SEARCH_WINDOWS)
    return hedge(blocks, phy2log, deployment, block_weights, **options)


def hedge_info(hedged: Hedged, objective: str = "expected_peak_search") -> dict:
    """The ``info`` entries of a hedged plan: ``objective``, ``uniform_objective_before`` /
    ``_after [L]`` (the mean window ``peak / mean`` searched), ``searched`` and ``hedge_steps [L]``
    (how many of the search's steps each layer kept; 0: the start's row)."""
    return {"objective": objective, "uniform_objective_before": hedged.before,
            "uniform_objective_after": hedged.after, "searched": hedged.searched, "hedge_steps": hedged.steps}


def plan_estimated(counts, deployment, method_fn, objective: str = "sum", window_weights=None, *,
                   dispatch: str = "uniform", quantile: float = 0.9, options=None):
    """Plan a series ``counts [T, L, E]`` from estimates of its windows: one estimate
    (``objective`` of :data:`COMBINERS`) or, per layer, the best of the :data:`CANDIDATES`'
    plans on the windows (``objective`` of :data:`SELECTORS`).

    Args:
        deployment: an :class:`eplb.model.deployment.Deployment`; method_fn: a method ``(weights,
            deployment, **options) -> (phy2log, info)``.
        window_weights: ``[T]`` or ``None``.
        dispatch: how plans are scored on the windows: ``"uniform"``, or ``"optimal"`` (then each
            plan also competes with its replicas linked, :func:`link_replicas`, so that
            :func:`made_for_dispatch` has room to move load).
        quantile: for ``objective="quantile"``.
    Returns:
        ``phy2log [L, S]`` int64 and ``info`` (the method's for a combiner, plus ``objective``; for a
        selector ``candidate_of_layer [L]`` indexing ``CANDIDATES``; with optimal dispatch
        ``linked [L]``).
    """
    options = dict(options or {})
    series = validated_counts(counts, "counts", ndims=(3,))
    if objective not in COMBINERS + SELECTORS:
        raise ValueError(f"objective must be one of {COMBINERS + SELECTORS}, got {objective!r}")
    if dispatch not in DISPATCH_SCORING:
        raise ValueError(f"dispatch must be one of {DISPATCH_SCORING}, got {dispatch!r}")
    weights = check_window_weights(window_weights, series.shape[0])
    optimal = dispatch == "optimal"
    if objective in COMBINERS:
        combined = combine(series, objective, weights, quantile=quantile)
        phy2log, info = method_fn(combined, deployment, **options)
        info = {**info, "objective": objective}
        if optimal:  # per layer, the linked plan unless the method's serves the windows better
            plans = [phy2log, link_replicas(combined, phy2log, deployment)[0]]
            phy2log, chosen, _ = select_per_layer(series, plans, deployment.topology, "expected_peak", weights,
                                                  dispatch)
            info["linked"] = chosen == 1
        return phy2log, info
    estimates = [combine(series, name, weights, quantile=q or 0.9) for name, q in CANDIDATES]
    plans = [method_fn(w, deployment, **options)[0] for w in estimates]
    if optimal:  # candidates C + c: candidate c with its replicas linked
        plans += [link_replicas(w, p, deployment)[0] for w, p in zip(estimates, plans)]
    phy2log, chosen, _ = select_per_layer(series, plans, deployment.topology, objective, weights, dispatch)
    info = {"objective": objective, "candidate_of_layer": chosen % len(CANDIDATES)}
    if optimal:
        info["linked"] = chosen >= len(CANDIDATES)
    return phy2log, info
