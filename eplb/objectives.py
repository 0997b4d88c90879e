"""How the windows of a series ``counts [T, L, E]`` combine into a plan.

A placement is made from windows it will not serve. Summing them (``"sum"``) plans for the average
traffic; the other objectives hedge against the windows that differ from it:

- ``"quantile"``: each expert's high quantile (``q``, default 0.9) of its share of the layer's
  tokens over the windows, so an expert that is hot in a tenth of the windows is planned as hot;
- ``"max_share"``: each expert's largest share over the windows;
- ``"expected_peak"``: per layer, among plans made from the estimators above, the one with the
  smallest mean over windows of each window's peak GPU load (the expected step time);
- ``"worst_window"``: likewise, the one whose worst window is best.

:func:`combine` turns a series into planning weights ``[L, E]`` (the first three);
:func:`plan_series` plans a series under any objective, with uniform or optimal dispatch in the
scoring (a placement served with optimal dispatch should be chosen by its optimal-dispatch peaks).
Windows are scaled to the same total before shares and peaks are compared, so a long window
does not outweigh a short one; ``window_weights [T]`` (e.g. :func:`recency_weights`) weigh them.
"""

from __future__ import annotations

import numpy as np

from ._validation import as_counts
from .dispatch import optimal_dispatch
from .kernels.layout import replica_counts
from .metrics import gpu_loads

COMBINERS = ("sum", "quantile", "max_share")
SELECTORS = ("expected_peak", "worst_window")
OBJECTIVES = COMBINERS + SELECTORS
DISPATCH_SCORING = ("uniform", "optimal")
# the estimators a selection objective plans from: (combiner, quantile)
CANDIDATES = (("sum", None), ("quantile", 0.75), ("quantile", 0.9), ("max_share", None))


def check_window_weights(window_weights, num_windows: int) -> np.ndarray:
    """``[T]`` float64 weights of the windows (``None``: all 1); non-negative, finite, not all zero."""
    if window_weights is None:
        return np.ones(num_windows)
    try:
        weights = np.array(window_weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"window_weights must be a numeric array, could not convert: {exc}") from None
    if weights.shape != (num_windows,):
        raise ValueError(f"window_weights must have shape [T] = [{num_windows}], got {weights.shape}")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("window_weights must be finite and non-negative")
    if weights.sum() <= 0:
        raise ValueError("window_weights must not all be zero")
    return weights


def recency_weights(num_windows: int, half_life: float) -> np.ndarray:
    """``[T]`` weights ``0.5 ** ((T - 1 - t) / half_life)``: the newest window weighs 1, one
    ``half_life`` of windows earlier weighs 1/2."""
    if not np.isfinite(half_life) or half_life <= 0:
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
    series = as_counts(counts, "counts", ndims=(2, 3))
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


def window_peaks(series: np.ndarray, phy2log: np.ndarray, topology, dispatch: str = "uniform") -> np.ndarray:
    """``[T, L]``: each window's max GPU load divided by its mean GPU load (``1 / balancedness``;
    1.0 for an all-zero layer), under uniform split or optimal dispatch.

    Args:
        series: ``[T, L, E]`` float64 counts (validated by the caller); ``phy2log``: ``[L, S]``.
    """
    if dispatch == "optimal":
        peak = optimal_dispatch(series, phy2log, topology)[1]
    elif dispatch == "uniform":
        logcnt = replica_counts(np.require(phy2log, dtype=np.int64, requirements="C"), series.shape[-1])
        peak = gpu_loads(series, phy2log, logcnt, topology).max(axis=-1)
    else:
        raise ValueError(f"dispatch must be one of {DISPATCH_SCORING}, got {dispatch!r}")
    mean = series.sum(axis=-1) / topology.num_gpus
    return np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)


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


def plan_series(counts, problem, method_fn, objective: str = "sum", window_weights=None, *,
                dispatch: str = "uniform", quantile: float = 0.9, options=None):
    """Plan a series ``counts [T, L, E]`` under ``objective``.

    Args:
        problem: an :class:`eplb.methods.Problem`; method_fn: a method ``(weights, problem,
            **options) -> (phy2log, info)``.
        objective: one of ``OBJECTIVES``; window_weights: ``[T]`` or ``None``.
        dispatch: how selection objectives score a candidate (``"uniform"`` or ``"optimal"``).
        quantile: for ``objective="quantile"``.
    Returns:
        ``phy2log [L, S]`` int64 and ``info`` (the method's, plus ``objective`` and, for a selection
        objective, ``candidate_of_layer [L]`` indexing ``CANDIDATES``).
    """
    options = dict(options or {})
    series = as_counts(counts, "counts", ndims=(3,))
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if dispatch not in DISPATCH_SCORING:
        raise ValueError(f"dispatch must be one of {DISPATCH_SCORING}, got {dispatch!r}")
    weights = check_window_weights(window_weights, series.shape[0])
    if objective in COMBINERS:
        phy2log, info = method_fn(combine(series, objective, weights, quantile=quantile), problem, **options)
        return phy2log, {**info, "objective": objective}
    plans = [method_fn(combine(series, name, weights, quantile=q or 0.9), problem, **options)[0]
             for name, q in CANDIDATES]
    phy2log, chosen, _ = select_per_layer(series, plans, problem.topology, objective, weights, dispatch)
    return phy2log, {"objective": objective, "candidate_of_layer": chosen}
