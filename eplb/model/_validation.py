"""Input checks shared by every public entry point.

Every check raises ``ValueError`` naming the argument and the rule it broke, so a caller
never sees an AssertionError, a Numba typing error or a silent wrong answer.
"""

from __future__ import annotations

import operator

import numpy as np


INT64_MAX = int(np.iinfo(np.int64).max)
"""The largest integer the kernels take (they compute in int64): a larger argument or option is
refused by name instead of overflowing on its way in."""


def as_int(value, name: str, *, minimum: int | None = None, maximum: int = INT64_MAX) -> int:
    """``value`` as a Python int in ``[minimum, maximum]`` (``maximum`` defaults to the int64 limit);
    rejects floats, bools and anything else that is not an integer."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    if result > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {result}")
    return result


def as_fraction(value, name: str) -> float:
    """``value`` as a float in ``[0, 1]``, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    value = float(value)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return value


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
    if array.ndim == 3 and array.shape[0] < 1:
        raise ValueError(f"{name} must have at least one window (first axis of [T, L, E]), got shape {array.shape}")
    if np.isnan(array).any():
        raise ValueError(f"{name} must not contain NaN")
    if np.isinf(array).any():
        raise ValueError(f"{name} must be finite, found an infinite value")
    if (array < 0).any():
        raise ValueError(f"{name} must be non-negative, found {array.min()}")
    check_layer_totals(array, name)
    return array


def validated_counts(counts, name: str = "counts", *, ndims: tuple[int, ...] = (2,)) -> np.ndarray:
    """``counts`` that a public entry already checked with :func:`as_counts`, as C-contiguous
    float64 (no copy when they are): only the rank is checked again, not every value, so
    validated arrays travel down the layers at no cost."""
    array = np.ascontiguousarray(counts, dtype=np.float64)
    if array.ndim not in ndims:
        shapes = " or ".join(_RANK_NAMES.get(d, f"{d}-d") for d in ndims)
        raise ValueError(f"{name} must have shape {shapes}, got shape {array.shape}")
    return array


def check_layer_totals(array: np.ndarray, name: str = "counts") -> None:
    """Refuse ``array [..., E]`` (finite, non-negative) when the total of a row (a layer, or a
    window's layer) overflows float64: no finite GPU load or balancedness could be reported.
    Counts are scale-free, so the caller can divide them by a common factor."""
    if array.size == 0 or array.dtype.kind != "f":
        return
    with np.errstate(over="ignore"):
        totals = array.sum(axis=-1, dtype=np.float64)
    bad = np.argwhere(~np.isfinite(np.atleast_1d(totals)))
    if bad.size:
        where = bad[0]
        place = f"layer {where[-1]}" + (f" of window {where[0]}" if np.ndim(totals) == 2 else "")
        raise ValueError(f"{name}: the total of {place} overflows float64 (max {np.finfo(np.float64).max:.3g}); "
                         "counts are scale-free: divide them by a common factor")


_RANK_NAMES = {1: "[E]", 2: "[L, E]", 3: "[T, L, E]"}


class Option:
    """The rule one method option must follow (see :func:`check_options`).

    Args:
        kind: ``"int"`` (an integer, not a bool), ``"number"`` (a finite int or float, not a bool)
            or ``"bool"``.
        minimum: smallest accepted value (ints and numbers); ``above``: the value must be strictly
            greater than this (numbers); ``maximum``: largest accepted value (ints: at most
            :data:`INT64_MAX`, the default, since the kernels compute in int64).
        allow_none: ``None`` is accepted too (it then means the option's documented default).
    """

    def __init__(self, kind: str, *, minimum=None, above=None, maximum=None, allow_none: bool = False):
        if kind not in ("int", "number", "bool"):
            raise ValueError(f"unknown option kind {kind!r}")
        if kind == "int":
            maximum = INT64_MAX if maximum is None else min(maximum, INT64_MAX)
        self.kind, self.minimum, self.above, self.maximum, self.allow_none = kind, minimum, above, maximum, allow_none

    def rule(self) -> str:
        """The rule in words, for error messages."""
        text = {"int": "an integer", "number": "a finite number", "bool": "True or False"}[self.kind]
        if self.minimum is not None:
            text += f" >= {self.minimum}"
        if self.above is not None:
            text += f" > {self.above}"
        if self.maximum is not None:
            text += f" and <= {self.maximum}" if self.minimum is not None or self.above is not None \
                else f" <= {self.maximum}"
        return text + (" or None" if self.allow_none else "")

    def check(self, name: str, value):
        """``value`` normalised (Python int / float / bool), or ``ValueError`` naming ``name``."""
        if value is None and self.allow_none:
            return None
        bad = ValueError(f"option {name} must be {self.rule()}, got {value!r}")
        if self.kind == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise bad
            return bool(value)
        if isinstance(value, (bool, np.bool_)):
            raise bad
        if self.kind == "int":
            try:
                value = operator.index(value)
            except TypeError:
                raise bad from None
        else:
            if not isinstance(value, (int, float, np.integer, np.floating)):
                raise bad
            value = float(value)
            if not np.isfinite(value):
                raise bad
        if self.minimum is not None and value < self.minimum:
            raise bad
        if self.above is not None and not value > self.above:
            raise bad
        if self.maximum is not None and value > self.maximum:
            raise bad
        return value


def check_options(owner: str, options: dict, schema: dict[str, Option]) -> dict:
    """Validate keyword options against ``schema`` (option name -> :class:`Option`).

    Raises ``ValueError`` naming an unknown option and the accepted ones, or an option whose value
    breaks its rule. Returns the options with normalised values.
    """
    unknown = sorted(set(options) - set(schema))
    if unknown:
        accepted = ", ".join(sorted(schema)) or "none"
        raise ValueError(f"{owner} got unknown option(s) {', '.join(unknown)}; accepted options: {accepted}")
    return {name: schema[name].check(name, value) for name, value in options.items()}


class MissingExtraError(ImportError):
    """An optional dependency is missing; says which ``eplb[extra]`` to install."""

    def __init__(self, module: str, extra: str, purpose: str):
        self.module = module
        self.extra = extra
        super().__init__(
            f"{purpose} needs the Python package '{module}', which is not installed: "
            f"pip install 'eplb[{extra}]'"
        )
