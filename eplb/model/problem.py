"""The problem configuration a method places experts under (model layer).

:func:`make_problem` validates a configuration and applies the published group rule: placement is
hierarchical (every expert group on one node) when ``num_groups`` is a multiple of ``num_nodes``;
otherwise it is global and the groups are ignored, as in DeepSeek's published ``rebalance_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validation import as_counts, as_int
from .topology import Topology


@dataclass(frozen=True)
class Problem:
    """The configuration a method places experts under.

    Attributes:
        topology: slots per GPU, GPUs per node.
        num_groups: expert groups (experts ``g*E/K ... (g+1)*E/K - 1`` form group ``g``), or None
            (no groups, or groups ignored because ``num_groups % num_nodes != 0``).
        hierarchical: keep every group (and its replicas) on one node; set when ``num_groups`` is a
            multiple of ``num_nodes`` (the published rule), else the placement is global.
    """

    topology: Topology
    num_groups: int | None = None
    hierarchical: bool = False


def make_problem(num_experts: int, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None,
                 topology: Topology | None = None, *, ignore_nodes_when_global: bool = False) -> Problem:
    """Validate a configuration and resolve whether placement is hierarchical.

    Args:
        num_experts: ``E``. num_slots: ``S >= E``, a multiple of ``num_gpus``.
        num_gpus: ``G``; num_nodes: ``N`` (``G % N == 0``, unless ignored, below).
        num_groups: expert groups. With ``num_groups % num_nodes == 0`` the placement is
            hierarchical and ``E % num_groups == 0`` is required; otherwise the placement is global
            and the groups are ignored (the published rule), so ``E`` need not be divisible.
        topology: an explicit :class:`Topology` instead of ``num_slots/num_gpus/num_nodes``.
        ignore_nodes_when_global: when the placement falls back to global, also ignore
            ``num_nodes`` (one node), as the published ``rebalance_experts`` does: then
            ``num_gpus`` need not be a multiple of ``num_nodes``.
    """
    groups = None if num_groups is None else as_int(num_groups, "num_groups", minimum=1)
    if topology is None:
        if num_slots is None or num_gpus is None:
            raise ValueError("num_slots and num_gpus are required (or pass topology=)")
        nodes = as_int(num_nodes, "num_nodes", minimum=1)
        if groups is not None and groups % nodes:
            groups = None  # the published rule: global placement, groups ignored
        if ignore_nodes_when_global and groups is None:
            nodes = 1
        topology = Topology.uniform(num_slots, num_gpus, nodes)
    elif not isinstance(topology, Topology):
        raise ValueError(f"topology must be an eplb.Topology, got {type(topology).__name__}")
    if topology.num_slots < num_experts:
        raise ValueError(
            f"num_slots ({topology.num_slots}) must be >= the number of experts ({num_experts}): "
            "every expert needs a slot"
        )
    if groups is None or groups % topology.num_nodes:
        return Problem(topology=topology, num_groups=None, hierarchical=False)
    if num_experts % groups:
        raise ValueError(f"the number of experts ({num_experts}) must be divisible by num_groups ({groups})")
    return Problem(topology=topology, num_groups=groups, hierarchical=True)


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
