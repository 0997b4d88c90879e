"""Placement methods: each is a function from (weights, deployment configuration) to ``phy2log``.

A method module registers itself with :func:`register`; adding a method touches no other method.
Signature of a method::

    method(weights, deployment, **options) -> (phy2log [L, S] int64, info: dict)

where ``weights`` is ``[L, E]`` float64 (validated, non-negative) and ``deployment`` a :class:`Deployment`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...model._validation import Option, check_options
from ...model.deployment import Deployment
from ...model.counts import power_of_two_scale

__all__ = ["DEFAULT_METHOD", "METHODS", "OPTIONS", "Option", "Deployment", "get_method", "register"]


MethodFn = Callable[..., "tuple[np.ndarray, dict]"]
METHODS: dict[str, MethodFn] = {}
"""The registered methods, by name (the raw functions: options are not checked when called directly)."""

OPTIONS: dict[str, dict[str, Option]] = {}
"""Each method's options: name -> :class:`eplb.model._validation.Option` (the rule its value follows)."""

_RESCALED: set[str] = set()


def register(name: str, options: dict[str, Option] | None = None, *, rescale: bool = True):
    """Decorator: make a method available as ``plan(..., method=name)``; ``options`` declares the
    keyword options it accepts (checked by :func:`get_method`). With ``rescale``, :func:`get_method`
    hands the method counts scaled per layer by a power of two
    (:func:`eplb.model.counts.power_of_two_scale`); a method that must see the counts as given (the
    exact solver keeps integer counts integer) handles extreme magnitudes itself."""

    def decorate(fn: MethodFn) -> MethodFn:
        METHODS[name] = fn
        OPTIONS[name] = dict(options or {})
        if rescale:
            _RESCALED.add(name)
        return fn

    return decorate


def get_method(name: str) -> MethodFn:
    """The method ``name`` as ``fn(weights, deployment, **options)``, checking the options first: an
    unknown option or a value breaking its rule raises ``ValueError`` naming it. The placement
    does not change when the counts are multiplied by a power of two (see :func:`register`)."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    method, schema, rescale = METHODS[name], OPTIONS[name], name in _RESCALED

    def run(weights: np.ndarray, deployment: Deployment, **options):
        options = check_options(f"method {name!r}", options, schema)
        if rescale:
            weights, _ = power_of_two_scale(weights)
        return method(weights, deployment, **options)

    return run


DEFAULT_METHOD = "balanced"
"""The method :func:`eplb.plan` and :func:`eplb.rebalance_experts` use when none is named."""

# Importing the modules registers the methods.
from . import greedy  # noqa: E402,F401
from . import balanced, best  # noqa: E402,F401
from . import exact  # noqa: E402,F401

