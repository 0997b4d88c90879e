"""The one place that computes the loads of a placement: per slot under a split, then per GPU and
per node.

Shapes: ``L`` layers, ``E`` logical experts, ``S`` slots, ``G`` GPUs, ``N`` nodes, ``T`` windows
(or steps). Counts are ``[L, E]`` or a series ``[T, L, E]``; the placement ``phy2log [L, S]`` is the
same for every window. A *split* says which fraction of its expert's tokens each slot takes:

- the even split (``shares=None``): every replica of expert ``e`` takes ``1 / logcnt[l, e]`` (what
  the engines do with random replica choice);
- given shares: ``shares [L, S]`` (one split for every window) or ``[T, L, S]`` (one a window),
  e.g. from :func:`eplb.analysis.dispatch.dispatch`, an engine's rule or a locality plan.

Summation order is part of the contract (outputs are compared byte for byte): the even split sums
each GPU's slots with NumPy after scaling each layer by a power of two (:func:`gpu_loads`, exact
scaling keeps denormal and huge counts finite); given shares are summed slot by slot in slot order
by the kernel :func:`eplb.kernels.split.shares.share_gpu_loads`. :func:`gpu_work` adds the activated slots
(expected under random choice, or at least half a token under a fixed split) that the cost model
prices, with the kernel :func:`eplb.kernels.split.gpu_work.gpu_work`.

This module is the only one that turns a placement and counts into GPU loads; metrics, dispatch,
placements, planning, the Balancer and the simulator call it.
"""

from __future__ import annotations

import numpy as np

from ..kernels.split.gpu_work import FIXED_SPLIT, RANDOM_SPLIT, gpu_work as _gpu_work_kernel
from ..kernels.plumbing.layout import replica_counts
from ..kernels.search.packing import max_gpu_loads
from ..kernels.split.shares import share_gpu_loads
from ..model.topology import Topology

__all__ = ["slot_loads", "sum_per_gpu", "gpu_loads", "peak_loads", "node_loads", "gpu_work",
           "RANDOM_SPLIT", "FIXED_SPLIT"]


def slot_loads(counts, phy2log: np.ndarray, *, logcnt: np.ndarray | None = None,
               shares: np.ndarray | None = None) -> np.ndarray:
    """Tokens each physical slot serves.

    Args:
        counts: ``[L, E]`` or ``[..., L, E]`` tokens per logical expert.
        phy2log: ``[L, S]`` expert held by each slot.
        logcnt: ``[L, E]`` replica count of each expert: the even split, ``counts[e] / logcnt[e]``.
        shares: ``[L, S]`` (or ``[..., L, S]``) fraction of its expert's tokens each slot takes:
            ``counts[e] * shares[s]``. Exactly one of ``logcnt`` and ``shares`` is given.
    Returns:
        ``[..., L, S]`` float64.
    """
    if (logcnt is None) == (shares is None):
        raise ValueError("slot_loads needs exactly one of logcnt (even split) and shares")
    counts = np.asarray(counts, dtype=np.float64)
    index = np.broadcast_to(phy2log, counts.shape[:-1] + phy2log.shape[-1:])
    if shares is None:
        return np.take_along_axis(counts / logcnt, index, axis=-1)  # broadcasts over leading axes
    return np.take_along_axis(counts, index, axis=-1) * shares


def _layer_scale(values: np.ndarray) -> np.ndarray:
    """``[..., 1]`` int exponents ``x`` with ``values * 2**-x`` at most 1 in each row of ``values [..., n]``
    (0 for all-zero rows): scaling by a power of two is exact, so sums of denormal or huge values can
    be formed near 1 and scaled back with one rounding."""
    peak = np.max(values, axis=-1, keepdims=True) if values.shape[-1] else np.zeros(values.shape[:-1] + (1,))
    _, exponent = np.frexp(np.where(np.isfinite(peak) & (peak > 0), peak, 1.0))
    return exponent


def sum_per_gpu(per_slot: np.ndarray, topology: Topology) -> np.ndarray:
    """Sum a per-slot quantity ``[..., S]`` over each GPU's slots: ``[..., G]`` (0 on a GPU with none).

    On a uniform topology the sums are NumPy's over each GPU's slots; otherwise each is the
    difference of the running sum over all slots (slot order) at the GPU's last and first slot.
    """
    if topology.is_uniform:
        return per_slot.reshape(per_slot.shape[:-1] + (topology.num_gpus, -1)).sum(axis=-1)
    cumulative = np.zeros(per_slot.shape[:-1] + (per_slot.shape[-1] + 1,))
    np.cumsum(per_slot, axis=-1, out=cumulative[..., 1:])
    offsets = topology.slot_offsets
    return cumulative[..., offsets[1:]] - cumulative[..., offsets[:-1]]


def _even_gpu_loads(counts: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, topology: Topology) -> np.ndarray:
    """Even split: each layer's sums formed on counts scaled by a power of two, then scaled back."""
    exponent = _layer_scale(counts)
    per_slot = slot_loads(np.ldexp(counts, -exponent), phy2log, logcnt=logcnt)
    return np.ldexp(sum_per_gpu(per_slot, topology), exponent)


def _share_gpu_loads(counts: np.ndarray, phy2log: np.ndarray, shares: np.ndarray, topology: Topology) -> np.ndarray:
    """Given shares: the kernel over the ``T * L`` layers of a series (slot order within a GPU)."""
    flat = np.ascontiguousarray(counts.reshape(-1, counts.shape[-1]))
    windows = flat.shape[0] // phy2log.shape[0]
    num_slots = phy2log.shape[1]
    flat_shares = np.broadcast_to(shares, counts.shape[:-1] + (num_slots,)).reshape(-1, num_slots)
    tiled = phy2log if windows == 1 else np.tile(phy2log, (windows, 1))
    loads = share_gpu_loads(flat, np.ascontiguousarray(tiled, dtype=np.int64),
                            np.ascontiguousarray(flat_shares, dtype=np.float64), topology.gpu_of_slot,
                            topology.num_gpus)
    return loads.reshape(counts.shape[:-1] + (topology.num_gpus,))


def gpu_loads(counts, phy2log: np.ndarray, topology: Topology, *, logcnt: np.ndarray | None = None,
              shares: np.ndarray | None = None) -> np.ndarray:
    """Tokens each GPU processes, under the even split or given shares (no input checks: callers
    validated).

    Args:
        counts: ``[L, E]`` or ``[T, L, E]`` float64 tokens per expert, finite and non-negative.
        phy2log: ``[L, S]`` int64 placement on ``topology``.
        topology: the deployment's :class:`eplb.Topology`.
        logcnt: ``[L, E]`` replica counts for the even split (computed from ``phy2log`` if omitted).
        shares: ``[L, S]`` or ``[T, L, S]`` split; ``None`` is the even split.
    Returns:
        ``[L, G]`` (``[T, L, G]``) float64; a GPU with no slots carries 0. Under the even split a load
        above the float64 maximum is ``inf`` (rescale such counts before planning).
    """
    counts = np.asarray(counts, dtype=np.float64)
    if shares is not None:
        return _share_gpu_loads(counts, phy2log, np.asarray(shares), topology)
    if logcnt is None:
        logcnt = replica_counts(np.require(phy2log, dtype=np.int64, requirements="CW"), counts.shape[-1])
    return _even_gpu_loads(counts, phy2log, logcnt, topology)


def slot_order_peaks(weights: np.ndarray, phy2log: np.ndarray, topology: Topology) -> np.ndarray:
    """``[L]`` each layer's max GPU load under the even split, every GPU's load summed in slot order
    (``weights [L, E]`` float64, ``phy2log [L, S]``): the arithmetic the planners compare their
    candidates in (one compiled pass, no rescaling); metrics use :func:`gpu_loads`, whose sums round
    differently in the last bit."""
    return max_gpu_loads(np.ascontiguousarray(weights, dtype=np.float64),
                         np.ascontiguousarray(phy2log, dtype=np.int64), topology.slot_offsets)


def peak_loads(counts, phy2log: np.ndarray, topology: Topology, *, shares: np.ndarray | None = None) -> np.ndarray:
    """``[L]`` (``[T, L]``): each layer's max GPU load, :func:`gpu_loads` under the same split."""
    return gpu_loads(counts, phy2log, topology, shares=shares).max(axis=-1)


def node_loads(loads: np.ndarray, topology: Topology) -> np.ndarray:
    """Sum GPU loads ``[..., G]`` over each node's GPUs: ``[..., N]`` (GPUs in node order)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.shape[-1] != topology.num_gpus:
        raise ValueError(f"loads must have one column per GPU ({topology.num_gpus}), got shape {loads.shape}")
    return loads.reshape(loads.shape[:-1] + (topology.num_nodes, topology.gpus_per_node)).sum(axis=-1)


def gpu_work(counts: np.ndarray, phy2log: np.ndarray, topology: Topology, shares: np.ndarray,
             random_split: bool) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and activated slots of every GPU of many steps, what :class:`eplb.CostModel` prices.

    Args:
        counts: ``[B, L, E]`` tokens per expert of ``B`` steps.
        phy2log: ``[L, S]`` int64 placement on ``topology``.
        shares: ``[1, L, S]`` (one split for every step) or ``[B, L, S]`` float64.
        random_split: :data:`RANDOM_SPLIT` (each token picks a replica at random: a slot is
            activated with probability ``1 - (1 - share)^c``, counted as its expectation) or
            :data:`FIXED_SPLIT` (activated when it takes at least half a token).
    Returns:
        ``tokens [B, L, G]`` and ``active [B, L, G]`` float64 (tokens summed in slot order, as
        :func:`gpu_loads` with shares).
    """
    return _gpu_work_kernel(np.ascontiguousarray(counts, dtype=np.float64), np.ascontiguousarray(phy2log),
                            np.ascontiguousarray(shares), topology.gpu_of_slot, topology.num_gpus,
                            bool(random_split))
