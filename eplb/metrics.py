"""Quality metrics of placements, with explicit axes.

Shapes: ``L`` layers, ``E`` logical experts, ``S`` slots, ``G`` GPUs, ``T`` windows. Functions that
take counts accept ``[L, E]`` or a series ``[T, L, E]`` and keep the leading axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .topology import Topology


def slot_loads(counts: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """Load carried by each physical slot under uniform routing over replicas.

    Args:
        counts: ``[L, E]`` or ``[T, L, E]`` tokens per logical expert.
        phy2log: ``[L, S]`` expert held by each slot.
        logcnt: ``[L, E]`` replica count of each expert.
    Returns:
        ``[L, S]`` or ``[T, L, S]`` float64: ``counts[e] / logcnt[e]`` for the expert ``e`` in each slot.
    """
    counts = np.asarray(counts, dtype=np.float64)
    per_replica = counts / logcnt  # broadcasts over a leading T axis
    index = np.broadcast_to(phy2log, counts.shape[:-1] + phy2log.shape[-1:])
    return np.take_along_axis(per_replica, index, axis=-1)


def sum_per_gpu(per_slot: np.ndarray, topology: Topology) -> np.ndarray:
    """Sum a per-slot quantity ``[..., S]`` over each GPU's slots: ``[..., G]``."""
    if topology.is_uniform:
        return per_slot.reshape(per_slot.shape[:-1] + (topology.num_gpus, -1)).sum(axis=-1)
    cumulative = np.zeros(per_slot.shape[:-1] + (per_slot.shape[-1] + 1,))
    np.cumsum(per_slot, axis=-1, out=cumulative[..., 1:])
    offsets = topology.slot_offsets
    return cumulative[..., offsets[1:]] - cumulative[..., offsets[:-1]]


def gpu_loads(counts, phy2log, logcnt, topology: Topology) -> np.ndarray:
    """Tokens processed by each GPU: ``[L, G]`` (or ``[T, L, G]`` for a series of counts)."""
    return sum_per_gpu(slot_loads(counts, phy2log, logcnt), topology)


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


def balancedness(loads: np.ndarray) -> np.ndarray:
    """``mean / max`` over the last (GPU) axis; 1.0 is perfect, and an all-zero layer counts as 1.0."""
    loads = np.asarray(loads, dtype=np.float64)
    peak = loads.max(axis=-1)
    mean = loads.mean(axis=-1)
    return np.divide(mean, peak, out=np.ones_like(peak), where=peak > 0)


def imbalance(loads: np.ndarray) -> np.ndarray:
    """``(max - mean) / mean`` over the last (GPU) axis; 0.0 is perfect (and for all-zero layers)."""
    loads = np.asarray(loads, dtype=np.float64)
    peak = loads.max(axis=-1)
    mean = loads.mean(axis=-1)
    return np.divide(peak - mean, mean, out=np.zeros_like(peak), where=mean > 0)


def gap(max_load: np.ndarray, lower_bound: np.ndarray) -> np.ndarray:
    """``max_load / lower_bound - 1``: how far above provably optimal (0.0 when both are zero)."""
    max_load = np.asarray(max_load, dtype=np.float64)
    lower_bound = np.asarray(lower_bound, dtype=np.float64)
    out = np.where(max_load > 0, np.inf, 0.0)
    return np.divide(max_load, lower_bound, out=out, where=lower_bound > 0) - np.where(lower_bound > 0, 1.0, 0.0)


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
