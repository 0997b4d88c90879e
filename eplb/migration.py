"""Migration-aware planning: a new placement close to the previous one.

Planning from scratch after the loads drift moves almost every expert (greedy changes ~90% of the
slots), and every changed slot is an expert's weights (tens of MiB) copied across GPUs. Here, per
layer:

1. plan from scratch with the chosen method: the reference max GPU load ``M``;
2. improve the previous placement by local search (swap two slots, re-assign one slot to another
   expert), best balance gain per changed slot first, until its max load is at most
   ``(1 + tolerance) * M`` or the budget of changed slots is spent;
3. relabel the fresh plan's GPUs and nodes (assignment matching) and its slots inside each GPU so
   that what stays, stays put;
4. keep whichever of (2) and (3) reaches the tolerance with fewer changed slots (if neither does,
   the one with the lower max load).
"""

from __future__ import annotations

import time

import numpy as np

from ._validation import as_int
from .kernels.layout import replica_counts
from .kernels.migration import improve_placement, relabel_like
from .metrics import gpu_loads
from .methods import Problem, get_method
from .placement import Placement, check_placement


def as_previous(previous, num_experts: int, problem: Problem, num_layers: int) -> np.ndarray:
    """The previous placement as ``phy2log [L, S]`` int64, checked against the new problem."""
    if isinstance(previous, Placement):
        if previous.topology != problem.topology:
            raise ValueError(
                "previous must be planned on the same topology (slots per GPU, nodes) as the new plan; "
                f"got {previous.topology.slots_per_gpu.tolist()} vs {problem.topology.slots_per_gpu.tolist()}"
            )
        if previous.num_experts != num_experts:
            raise ValueError(f"previous has {previous.num_experts} experts, counts have {num_experts}")
        phy2log = previous.phy2log
    else:
        if type(previous).__module__.split(".")[0] == "torch":
            previous = previous.detach().cpu().numpy()
        try:
            phy2log, _ = check_placement(np.asarray(previous), num_experts, problem.topology)
        except ValueError as exc:
            raise ValueError(f"previous: {exc}") from None
    if phy2log.shape[0] != num_layers:
        raise ValueError(f"previous has {phy2log.shape[0]} layers, counts have {num_layers}")
    return np.ascontiguousarray(phy2log, dtype=np.int64)


def migrate(weights: np.ndarray, problem: Problem, previous: np.ndarray, scratch: np.ndarray, *,
            tolerance: float | None = 0.005, max_moves=None) -> tuple[np.ndarray, dict]:
    """Choose, per layer, a placement close to ``previous`` and about as balanced as ``scratch``.

    Args:
        weights: ``[L, E]`` float64 loads to plan for.
        problem: topology and groups (with ``problem.hierarchical`` no move puts an expert on a
            node holding no expert of its group, and nodes are relabelled as a whole).
        previous: ``[L, S]`` int64, the placement in service.
        scratch: ``[L, S]`` int64, a plan from scratch for ``weights`` (the balance reference).
        tolerance: accept a max GPU load up to ``(1 + tolerance)`` times the one of ``scratch``
            (``None``: as balanced as the budget allows).
        max_moves: at most this many slots change per layer (``None``: no limit).
    Returns:
        ``phy2log [L, S]`` and info: ``slots_changed [L]``, ``scratch_max_load [L]``,
        ``from_scratch [L]`` bool (the layer took the relabelled fresh plan: the local search
        missed the target and the fresh plan fits the budget).
    """
    topology = problem.topology
    num_layers, num_experts = weights.shape
    num_slots = topology.num_slots
    if tolerance is not None:
        tolerance = float(tolerance)
        if not np.isfinite(tolerance) or tolerance < 0:
            raise ValueError(f"tolerance must be a non-negative number or None, got {tolerance}")
    budget = num_slots if max_moves is None else as_int(max_moves, "max_moves", minimum=0)
    if tolerance is None and max_moves is None:
        raise ValueError("give tolerance, max_moves or both (else there is no trade-off to make)")

    scratch_peak = _peaks(weights, scratch, topology)
    target = np.full(num_layers, -1.0) if tolerance is None else scratch_peak * (1.0 + tolerance)
    if problem.hierarchical:
        group_of_expert = np.arange(num_experts, dtype=np.int64) // (num_experts // problem.num_groups)
        num_groups = problem.num_groups
    else:
        group_of_expert = np.zeros(num_experts, np.int64)
        num_groups = 1
    local, local_changes, _ = improve_placement(
        weights, previous, topology.gpu_of_slot, topology.slot_offsets, topology.node_of_gpu,
        group_of_expert, problem.hierarchical, num_groups, target, np.full(num_layers, budget, np.int64), 2 * num_slots,
    )
    local_peak = _peaks(weights, local, topology)
    # the relabelled fresh plan is only needed where the local search missed the target
    missed = np.flatnonzero(local_peak > target)
    relabelled = local.copy()
    fresh_changes = np.full(num_layers, num_slots + 1, np.int64)
    fresh_peak = np.full(num_layers, np.inf)
    if missed.size:
        relabelled[missed], fresh_changes[missed] = relabel_like(
            np.ascontiguousarray(scratch[missed], dtype=np.int64), np.ascontiguousarray(previous[missed]),
            topology.slot_offsets, topology.gpus_per_node, problem.hierarchical, num_experts,
        )
        fresh_peak[missed] = _peaks(weights[missed], relabelled[missed], topology)

    use_fresh = np.zeros(num_layers, bool)
    for layer in range(num_layers):
        if fresh_changes[layer] > budget:
            continue
        local_ok = local_peak[layer] <= target[layer]
        fresh_ok = fresh_peak[layer] <= target[layer]
        if fresh_ok and not local_ok:
            use_fresh[layer] = True
        elif fresh_ok == local_ok:
            if local_ok:
                use_fresh[layer] = fresh_changes[layer] < local_changes[layer]
            else:
                use_fresh[layer] = fresh_peak[layer] < local_peak[layer]
    phy2log = np.where(use_fresh[:, None], relabelled, local)
    changes = np.where(use_fresh, fresh_changes, local_changes)
    info = {
        "slots_changed": changes,
        "scratch_max_load": scratch_peak,
        "from_scratch": use_fresh,
        "tolerance": tolerance,
        "max_moves": max_moves,
    }
    return phy2log, info


def plan_near(weights: np.ndarray, problem: Problem, previous: np.ndarray | None, *, method: str,
              tolerance: float | None = 0.005, max_moves=None, options: dict | None = None) -> tuple[np.ndarray, dict]:
    """``phy2log [L, S]`` and info for ``weights [L, E]``: from scratch with ``method``, then (with
    ``previous [L, S]``) close to ``previous`` via :func:`migrate`. No bounds are computed: this is
    the fast path for serving engines (:class:`eplb.Balancer`, the engine adapters)."""
    start = time.perf_counter()
    phy2log, info = get_method(method)(weights, problem, **(options or {}))
    if previous is not None:
        phy2log, moved = migrate(weights, problem, previous, phy2log, tolerance=tolerance, max_moves=max_moves)
        info = {**info, **moved}
    return phy2log, {**info, "time_s": time.perf_counter() - start}


def _peaks(weights: np.ndarray, phy2log: np.ndarray, topology) -> np.ndarray:
    """``[L]`` max GPU load of ``phy2log`` on ``weights``."""
    logcnt = replica_counts(np.ascontiguousarray(phy2log), weights.shape[1])
    return gpu_loads(weights, phy2log, logcnt, topology).max(axis=-1)
