"""Input checks shared by every public entry point.

Every check raises ``ValueError`` naming the argument and the rule it broke, so a caller
never sees an AssertionError, a Numba typing error or a silent wrong answer.
"""

from __future__ import annotations

import operator

import numpy as np


def as_int(value, name: str, *, minimum: int | None = None) -> int:
    """``value`` as a Python int; rejects floats, bools and anything else that is not an integer."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def as_counts(counts, name: str = "counts", *, ndims: tuple[int, ...] = (2,)) -> np.ndarray:
    """``counts`` as a float64 array with one of the allowed ranks, finite and non-negative.

    Returns a new C-contiguous float64 array (the caller's array is never modified).
    """
    if type(counts).__module__.split(".")[0] == "torch":
        counts = counts.detach().cpu().double().numpy()
    try:
        array = np.array(counts, dtype=np.float64, copy=True, order="C")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a numeric array, could not convert: {exc}") from None
    if array.ndim not in ndims:
        shapes = " or ".join(_RANK_NAMES.get(d, f"{d}-d") for d in ndims)
        raise ValueError(f"{name} must have shape {shapes}, got shape {array.shape}")
    if array.shape[-1] < 1:
        raise ValueError(f"{name} must have at least one expert (last axis), got shape {array.shape}")
    if array.ndim >= 2 and array.shape[-2] < 1:
        raise ValueError(f"{name} must have at least one layer, got shape {array.shape}")
    if np.isnan(array).any():
        raise ValueError(f"{name} must not contain NaN")
    if np.isinf(array).any():
        raise ValueError(f"{name} must be finite, found an infinite value")
    if (array < 0).any():
        raise ValueError(f"{name} must be non-negative, found {array.min()}")
    return array


_RANK_NAMES = {1: "[E]", 2: "[L, E]", 3: "[T, L, E]"}
