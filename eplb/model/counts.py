"""Counts as every layer reads them: validated ``[L, E]`` float64 weights, and the power-of-two
scale plans are made at (model layer)."""

from __future__ import annotations

import numpy as np

from ._validation import as_counts


def weights_2d(counts, name: str = "counts") -> np.ndarray:
    """Validated float64 weights: ``[E]`` -> ``[1, E]``, ``[L, E]`` as is, ``[T, L, E]`` summed over
    windows. Refuses a layer whose total overflows float64 (no finite max load could be reported)."""
    return summed_2d(as_counts(counts, name, ndims=(1, 2, 3)), name)


def summed_2d(counts: np.ndarray, name: str = "counts") -> np.ndarray:
    """:func:`weights_2d` of counts already validated (``[E]``, ``[L, E]`` or ``[T, L, E]`` float64)."""
    weights = counts
    if weights.ndim == 1:
        weights = weights[None, :]
    elif weights.ndim == 3:
        with np.errstate(over="ignore"):
            weights = weights.sum(axis=0)
    with np.errstate(over="ignore"):
        totals = weights.sum(axis=1)
    if not np.isfinite(totals).all() or not np.isfinite(weights).all():
        layer = int(np.flatnonzero(~np.isfinite(totals))[0])
        raise ValueError(f"{name}: the total of layer {layer} overflows float64 (max {np.finfo(np.float64).max:.3g}); "
                         "counts are scale-free: divide them by a common factor")
    return weights


SCALE_EXPONENT = 20
"""Every non-zero layer is planned with its largest count in ``[2**20, 2**21)`` (see
:func:`power_of_two_scale`)."""


def power_of_two_scale(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale every layer by a power of two so its largest count lies in ``[2**20, 2**21)``.

    Multiplying by a power of two is exact in binary floating point (short of overflow and
    underflow), and it keeps float32 ties (the published greedy's arithmetic): a method sees
    the same numbers whatever power of two the counts were multiplied by, and never works near
    the ends of the float32 or float64 ranges.

    Args:
        weights: ``[L, E]`` float64, finite and non-negative.
    Returns:
        ``(scaled [L, E] float64, shift [L] int64)`` with ``scaled = weights * 2**shift`` per layer
        (``shift = 0`` on all-zero layers); ``np.ldexp(x, -shift)`` maps loads back.
    """
    weights = np.asarray(weights, dtype=np.float64)
    peak = weights.max(axis=1)
    _, exponent = np.frexp(peak)  # peak = m * 2**exponent, 0.5 <= m < 1
    shift = np.where(peak > 0, SCALE_EXPONENT + 1 - exponent, 0).astype(np.int64)
    return np.ldexp(weights, shift[:, None].astype(np.int32)), shift
