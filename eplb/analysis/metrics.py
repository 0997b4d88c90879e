"""Quality metrics of placements, with explicit axes.

Shapes: ``L`` layers, ``E`` logical experts, ``S`` slots, ``G`` GPUs, ``T`` windows. Functions that
take counts accept ``[L, E]`` or a series ``[T, L, E]`` and keep the leading axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.topology import Topology


def static_gpu_loads(counts, num_gpus: int) -> np.ndarray:
    """GPU loads with no rebalancing: expert ``e`` alone on GPU ``e * G // E``, no replicas.

    Args:
        counts: ``[..., E]``. Returns ``[..., G]``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    num_experts = counts.shape[-1]
    gpu_of_expert = np.arange(num_experts) * num_gpus // num_experts
    one_hot = np.zeros((num_experts, num_gpus))
    one_hot[np.arange(num_experts), gpu_of_expert] = 1.0
    return counts @ one_hot


def _active(loads: np.ndarray, topology: Topology | None) -> np.ndarray:
    """``loads [..., G]`` restricted to the GPUs that hold slots (all of them without a topology)."""
    if topology is None:
        return loads
    if loads.shape[-1] != topology.num_gpus:
        raise ValueError(f"loads must have one column per GPU ({topology.num_gpus}), got shape {loads.shape}")
    return loads[..., topology.slots_per_gpu > 0]


def balancedness(loads: np.ndarray, topology: Topology | None = None) -> np.ndarray:
    """``mean / max`` over the last (GPU) axis; 1.0 is perfect.

    Args:
        loads: ``[..., G]`` GPU loads (e.g. ``[L, G]`` or ``[T, L, G]``).
        topology: when given, the mean is over the GPUs that hold slots (a masked GPU carries
            nothing and does not count, as in the lower bounds); without it, over all ``G``.
    Returns:
        ``[...]`` float64. Computed as the mean of ``load / max`` (finite for denormal and huge
        loads). An all-zero row (a dense layer) gives 1.0, so per-layer arrays keep their shape and
        sums; means over layers should skip those rows: :func:`mean_balancedness`, :func:`moe_mean`.
    """
    loads = _active(np.asarray(loads, dtype=np.float64), topology)
    peak = loads.max(axis=-1)
    positive = peak > 0
    ratio = np.divide(loads, peak[..., None], out=np.ones_like(loads), where=positive[..., None])
    return np.where(positive, ratio.mean(axis=-1), 1.0)


def imbalance(loads: np.ndarray, topology: Topology | None = None) -> np.ndarray:
    """``(max - mean) / mean`` over the last (GPU) axis; 0.0 is perfect (and for all-zero rows).

    ``loads [..., G]``; ``topology`` as in :func:`balancedness` (the mean over the GPUs that hold
    slots). Returns ``[...]`` float64; means over layers should skip all-zero rows (:func:`moe_mean`).
    """
    ratio = balancedness(loads, topology)
    return (1.0 - ratio) / ratio


def moe_layers(loads: np.ndarray) -> np.ndarray:
    """``[...]`` bool: the rows of ``loads [..., G]`` (or counts ``[..., E]``) that carry any load.

    An all-zero row is a dense layer (no experts routed): any placement is optimal there, so it
    says nothing about a plan and must not count as perfectly balanced in means over layers."""
    return np.asarray(loads, dtype=np.float64).max(axis=-1, initial=0.0) > 0


def moe_mean(per_layer: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Mean over the layer axis of a per-layer metric, skipping dense (all-zero) layers.

    Args:
        per_layer: ``[L]`` or ``[T, L]`` values (e.g. :func:`balancedness`, :func:`imbalance`,
            :func:`gap`).
        loads: ``[L, G]`` or ``[T, L, G]`` the loads (or ``[.., E]`` counts) they were measured on.
    Returns:
        float64 scalar (``[L]`` in) or ``[T]``: the mean over the layers of :func:`moe_layers`; NaN
        where no layer carries load (nothing to measure).
    """
    per_layer = np.asarray(per_layer, dtype=np.float64)
    mask = moe_layers(loads)
    if mask.shape != per_layer.shape:
        raise ValueError(f"per_layer has shape {per_layer.shape}, the loads give layers of shape {mask.shape}")
    count = mask.sum(axis=-1)
    total = np.where(mask, per_layer, 0.0).sum(axis=-1)
    return np.divide(total, count, out=np.full(np.shape(total), np.nan), where=count > 0)


def mean_balancedness(loads: np.ndarray, topology: Topology | None = None) -> np.ndarray:
    """Mean balancedness over the MoE layers: :func:`balancedness` averaged by :func:`moe_mean`.

    ``loads [L, G]`` gives a float64 scalar, ``[T, L, G]`` gives ``[T]``; NaN when every layer is
    dense. This is the figure vLLM and SGLang report, without dense layers counting as 1.0."""
    return moe_mean(balancedness(loads, topology), loads)


ROUNDING = 1e-12
"""Relative rounding allowed between a max load and its lower bound (sums of up to a few thousand
float64 terms): a max load below its bound by less than this is equality, not a bound error."""


def gap(max_load: np.ndarray, lower_bound: np.ndarray) -> np.ndarray:
    """``max_load / lower_bound - 1``: how far above provably optimal (0.0 when both are zero).

    A max load below its bound by rounding only (relative :data:`ROUNDING`, or a few units of the
    smallest denormal) gives 0.0; a larger shortfall stays negative: it is a bound error and is
    never hidden. ``inf`` when the bound is 0 and the load is not.
    """
    max_load = np.asarray(max_load, dtype=np.float64)
    lower_bound = np.asarray(lower_bound, dtype=np.float64)
    out = np.where(max_load > 0, np.inf, 0.0)
    ratio = np.divide(max_load, lower_bound, out=out, where=lower_bound > 0) - np.where(lower_bound > 0, 1.0, 0.0)
    slack = ROUNDING * lower_bound + 4 * np.finfo(np.float64).smallest_subnormal
    rounding = (ratio < 0) & (lower_bound - max_load <= slack)
    return np.where(rounding, 0.0, ratio)


def mean_peak(loads: np.ndarray) -> np.ndarray:
    """For a series ``[T, L, G]``: the mean over windows of each window's peak GPU load, ``[L]``."""
    return np.asarray(loads, dtype=np.float64).max(axis=-1).mean(axis=0)


def replicas_sharing_a_gpu(phy2log: np.ndarray, topology: Topology) -> np.ndarray:
    """``[L]`` int64: slots wasted by holding a second (third, ...) replica of an expert on one GPU."""
    wasted = np.zeros(phy2log.shape[0], np.int64)
    offsets = topology.slot_offsets
    for g in range(topology.num_gpus):
        block = np.sort(phy2log[:, offsets[g] : offsets[g + 1]], axis=1)
        wasted += (block[:, 1:] == block[:, :-1]).sum(axis=1)
    return wasted


@dataclass(frozen=True)
class Moves:
    """What it costs to go from placement A to placement B (totals over layers).

    Attributes:
        slots_changed: (layer, slot) pairs whose expert differs.
        gpu_copies: expert weights a GPU needs under B that it does not hold under A.
        cross_node_copies: those of ``gpu_copies`` that no GPU of the same node holds under A.
        per_layer_slots_changed: ``[L]``.
    """

    slots_changed: int
    gpu_copies: int
    cross_node_copies: int
    per_layer_slots_changed: np.ndarray


def moves(phy2log_a: np.ndarray, phy2log_b: np.ndarray, topology: Topology) -> Moves:
    """Count the slot changes and weight copies from placement A to B (both ``[L, S]``, one topology)."""
    phy2log_a = np.asarray(phy2log_a)
    phy2log_b = np.asarray(phy2log_b)
    if phy2log_a.shape != phy2log_b.shape:
        raise ValueError(f"placements differ in shape: {phy2log_a.shape} vs {phy2log_b.shape}")
    num_experts = int(max(phy2log_a.max(), phy2log_b.max())) + 1
    num_layers = phy2log_a.shape[0]
    gpu = topology.gpu_of_slot
    node = topology.node_of_gpu[gpu]
    layer = np.arange(num_layers)[:, None]

    def holds(keys, size):
        table = np.zeros((num_layers, size, num_experts), bool)
        table[np.broadcast_to(layer, phy2log_a.shape), np.broadcast_to(keys, phy2log_a.shape), phy2log_a] = True
        return table

    gpu_holds = holds(gpu, topology.num_gpus)
    node_holds = holds(node, topology.num_nodes)
    # Each GPU needs one copy per distinct expert it holds under B and lacks under A.
    needed = np.zeros((num_layers, topology.num_gpus, num_experts), bool)
    needed[np.broadcast_to(layer, phy2log_b.shape), np.broadcast_to(gpu, phy2log_b.shape), phy2log_b] = True
    gpu_missing = needed & ~gpu_holds
    node_of_gpu = topology.node_of_gpu
    cross_node = gpu_missing & ~node_holds[:, node_of_gpu, :]
    changed = (phy2log_a != phy2log_b).sum(axis=1)
    return Moves(int(changed.sum()), int(gpu_missing.sum()), int(cross_node.sum()), changed)
