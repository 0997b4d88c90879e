"""Placement methods: each is a function from (weights, problem configuration) to ``phy2log``.

A method module registers itself with :func:`register`; adding a method touches no other method.
Signature of a method::

    method(weights, problem, **options) -> (phy2log [L, S] int64, info: dict)

where ``weights`` is ``[L, E]`` float64 (validated, non-negative) and ``problem`` a :class:`Problem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..topology import Topology


@dataclass(frozen=True)
class Problem:
    """The configuration a method places experts under.

    Attributes:
        topology: slots per GPU, GPUs per node.
        num_groups: expert groups (experts ``g*E/K ... (g+1)*E/K - 1`` form group ``g``), or None.
        hierarchical: keep every group (and its replicas) on one node; set when ``num_groups`` is a
            multiple of ``num_nodes`` (the published rule), else the placement is global.
    """

    topology: Topology
    num_groups: int | None
    hierarchical: bool


MethodFn = Callable[..., "tuple[np.ndarray, dict]"]
METHODS: dict[str, MethodFn] = {}


def register(name: str):
    """Decorator: make a method available as ``plan(..., method=name)``."""

    def decorate(fn: MethodFn) -> MethodFn:
        METHODS[name] = fn
        return fn

    return decorate


def get_method(name: str) -> MethodFn:
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    return METHODS[name]


# Importing the modules registers the methods.
from . import greedy  # noqa: E402,F401
from . import balanced, best  # noqa: E402,F401
from . import exact  # noqa: E402,F401

DEFAULT_METHOD = "balanced"
