"""Dispatch: how each expert's tokens are split among its replicas, and the GPU loads that follow.

A placement fixes which slots hold which expert; the serving engine then sends each token routed
to expert ``e`` to one of its replicas. *Shares* ``[L, S]`` give the fraction of its expert's tokens
each slot takes (summing to 1 over an expert's replicas). Engines split uniformly (``1 / logcnt``)
unless told otherwise; :func:`dispatch` gives the split that minimises the max GPU load for
given counts (exact; a transportation LP per layer, solved by :mod:`eplb.kernels.split.shares`).
"""

from __future__ import annotations

import numpy as np

from ..model._validation import as_counts
from ..kernels.split.shares import optimal_shares
from .placement import Placement, check_placement, check_shares, uniform_shares  # noqa: F401  (re-exported)
from ..model.topology import Topology

def _flat(weights: np.ndarray, phy2log: np.ndarray):
    """``[T, L, E]`` counts and ``[L, S]`` placement as ``T * L`` layers (a series is per window)."""
    if weights.ndim == 2:
        return weights, phy2log
    windows = weights.shape[0]
    flat_weights = np.ascontiguousarray(weights.reshape(-1, weights.shape[-1]))
    return flat_weights, np.ascontiguousarray(np.tile(phy2log, (windows, 1)))


def optimal_dispatch(weights: np.ndarray, phy2log: np.ndarray, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Optimal shares and the max GPU load they reach, without input checks (callers validated).

    Args:
        weights: ``[L, E]`` or ``[T, L, E]`` float64 counts, non-negative.
        phy2log: ``[L, S]`` int64 placement on ``topology``.
    Returns:
        ``shares [L, S]`` (``[T, L, S]``) float64 and ``peak [L]`` (``[T, L]``) float64.
    """
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    phy2log = np.require(phy2log, dtype=np.int64, requirements="C")
    flat_weights, flat_phy2log = _flat(weights, phy2log)
    shares, peak = optimal_shares(flat_weights, flat_phy2log, topology.gpu_of_slot, topology.num_gpus)
    if weights.ndim == 3:
        return shares.reshape(weights.shape[0], *phy2log.shape), peak.reshape(weights.shape[:2])
    return shares, peak


def _check_placement_arg(placement) -> Placement:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be an eplb.Placement, got {type(placement).__name__}")
    return placement


def _check_counts_for(counts, num_layers: int, num_experts: int) -> np.ndarray:
    weights = as_counts(counts, "counts", ndims=(2, 3))
    if weights.shape[-2:] != (num_layers, num_experts):
        raise ValueError(
            f"counts must have shape [L, E] = [{num_layers}, {num_experts}] (or [T, L, E]), got {weights.shape}"
        )
    return weights


def dispatch(counts, placement: Placement) -> np.ndarray:
    """The shares that minimise each layer's max GPU load for ``counts`` on ``placement``.

    Only experts with replicas on two or more GPUs have a choice; the others keep ``1 / logcnt``.
    Among optimal splits the kernel keeps few experts split (see
    :func:`eplb.kernels.split.shares.optimal_shares` for the method and why it is exact).

    Args:
        counts: ``[L, E]`` tokens per expert (or a series ``[T, L, E]``: shares per window).
        placement: an :class:`eplb.Placement` with ``L`` layers and ``E`` experts.
    Returns:
        ``[L, S]`` (``[T, L, S]``) float64; each expert's shares sum to 1.
    """
    placement = _check_placement_arg(placement)
    weights = _check_counts_for(counts, placement.num_layers, placement.num_experts)
    return optimal_dispatch(weights, placement.phy2log, placement.topology)[0]
