"""Committing a plan a few layers at a time: which layers a commit switches (:func:`commit_range`,
``layers`` checked) and the placement in service once they are switched (:func:`merged_placement`,
a ``"mixed"`` one until every layer is the plan's). The :class:`~eplb.serving.balancer.Balancer` and
the background balancer commit through them."""

from __future__ import annotations

import numpy as np

from ..analysis.placement import Placement
from ..model._validation import as_int


def commit_range(layers, num_layers: int) -> tuple[int, int]:
    """The ``(start, stop)`` layers a commit switches: ``layers`` checked (``None``: every layer)."""
    if layers is None:
        return 0, num_layers
    try:
        start, stop = (as_int(v, "layers entry") for v in layers)
    except (TypeError, ValueError):
        raise ValueError(f"layers must be None or a (start, stop) pair of integer layer indices, "
                         f"got {layers!r}") from None
    if not 0 <= start < stop <= num_layers:
        raise ValueError(f"layers must satisfy 0 <= start < stop <= {num_layers}, got {layers!r}")
    return start, stop


def merged_placement(in_service: Placement, placement: Placement, start: int, stop: int, num_groups) -> Placement:
    """The placement in service once layers ``start <= l < stop`` of ``placement`` are committed:
    ``placement`` itself when that makes every layer its own, else a ``"mixed"`` one (of the
    balancer's ``num_groups``)."""
    if (start, stop) == (0, in_service.num_layers):
        return placement
    mixed = in_service.phy2log.copy()
    mixed[start:stop] = placement.phy2log[start:stop]
    if np.array_equal(mixed, placement.phy2log):
        return placement
    return Placement(mixed, in_service.num_experts, in_service.topology, num_groups, method="mixed")
