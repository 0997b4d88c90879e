"""A series of windows ``[T, L, E]``: their weights, and how each window's peak is scored under
a placement (what the series objectives of :mod:`eplb.planning.objectives` and the search of
:mod:`eplb.planning.robust` compare placements by)."""

from __future__ import annotations

import numpy as np

from .dispatch import optimal_dispatch
from ..engines import SCORING
from .loads import peak_loads

DISPATCH_SCORING = SCORING  # the rules windows are scored by (eplb.engines)


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


def window_peaks(series: np.ndarray, phy2log: np.ndarray, topology, dispatch: str = "uniform") -> np.ndarray:
    """``[T, L]``: each window's max GPU load divided by its mean GPU load (``1 / balancedness``;
    1.0 for an all-zero layer), under uniform split or optimal dispatch.

    Args:
        series: ``[T, L, E]`` float64 counts (validated by the caller); ``phy2log``: ``[L, S]``.
    """
    if dispatch == "optimal":
        peak = optimal_dispatch(series, phy2log, topology)[1]
    elif dispatch == "uniform":
        peak = peak_loads(series, phy2log, topology)
    else:
        raise ValueError(f"dispatch must be one of {DISPATCH_SCORING}, got {dispatch!r}")
    mean = series.sum(axis=-1) / topology.num_gpus
    return np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)
