"""The two entry points: :func:`plan` (a :class:`Placement` with diagnostics) and
:func:`rebalance_experts` (DeepSeek EPLB's signature, arrays out)."""

from __future__ import annotations

import time

import numpy as np

from ._validation import as_counts, as_int
from .bounds import lower_bound
from .methods import DEFAULT_METHOD, Problem, get_method
from .kernels.layout import replica_counts, slots_of_experts
from .placement import Placement
from .topology import Topology


def make_problem(num_experts: int, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None,
                 topology: Topology | None = None) -> Problem:
    """Validate a configuration and resolve whether placement is hierarchical."""
    if topology is None:
        if num_slots is None or num_gpus is None:
            raise ValueError("num_slots and num_gpus are required (or pass topology=)")
        topology = Topology.uniform(num_slots, num_gpus, num_nodes)
    elif not isinstance(topology, Topology):
        raise ValueError(f"topology must be an eplb.Topology, got {type(topology).__name__}")
    if topology.num_slots < num_experts:
        raise ValueError(
            f"num_slots ({topology.num_slots}) must be >= the number of experts ({num_experts}): "
            "every expert needs a slot"
        )
    hierarchical = False
    if num_groups is not None:
        num_groups = as_int(num_groups, "num_groups", minimum=1)
        if num_experts % num_groups:
            raise ValueError(f"the number of experts ({num_experts}) must be divisible by num_groups ({num_groups})")
        hierarchical = num_groups % topology.num_nodes == 0
    return Problem(topology=topology, num_groups=num_groups, hierarchical=hierarchical)


def _weights_2d(counts, name: str) -> np.ndarray:
    """``[E]`` -> ``[1, E]``, ``[L, E]`` as is, ``[T, L, E]`` summed over windows."""
    weights = as_counts(counts, name, ndims=(1, 2, 3))
    if weights.ndim == 1:
        return weights[None, :]
    if weights.ndim == 3:
        return weights.sum(axis=0)
    return weights


def plan(counts, *, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None,
         method: str = DEFAULT_METHOD, topology: Topology | None = None, previous=None,
         tolerance: float | None = 0.005, max_moves=None, **options) -> Placement:
    """Plan a replicated expert placement for every layer.

    Args:
        counts: ``[L, E]`` tokens routed to each logical expert (``[E]`` for one layer; a series
            ``[T, L, E]`` is summed over windows). Non-negative and finite.
        num_slots: ``S``, physical expert slots in all (``S >= E``, a multiple of ``num_gpus``).
        num_gpus: ``G``, GPUs (ranks); ``num_nodes``: ``N``, nodes (``G % N == 0``).
        num_groups: expert groups; with ``num_groups % num_nodes == 0`` every group stays on one node.
        method: one of ``eplb.METHODS``.
        topology: instead of ``num_slots/num_gpus/num_nodes``, an explicit :class:`Topology`
            (uneven slots per GPU, masked GPUs).
        previous: the placement in service (a :class:`Placement` or ``phy2log [L, S]``). Then the
            plan stays close to it (see :mod:`eplb.migration`): experts keep their slots where that
            costs little balance; ``info["slots_changed"]`` gives the changed slots per layer.
        tolerance: with ``previous``, accept a max GPU load up to ``(1 + tolerance)`` times the one
            of planning from scratch with ``method`` (``None``: as balanced as ``max_moves`` allows).
        max_moves: with ``previous``, at most this many slots change per layer (``None``: no limit).
            With ``method="exact"`` and ``previous``, the fewest changed slots within the tolerance
            (and budget), from a CP-SAT model (:mod:`eplb.exact_migration`); ``info`` then has
            ``fewest_changes_proven [L]`` and ``fewest_changes_bound [L]``.
        **options: passed to the method.
    Returns:
        A :class:`Placement` with its lower bound, max load and gap on ``counts``.
    """
    weights = _weights_2d(counts, "counts")
    problem = make_problem(weights.shape[1], num_slots, num_gpus, num_nodes, num_groups, topology)
    start = time.perf_counter()
    if previous is None:
        phy2log, info = get_method(method)(weights, problem, **options)
    else:
        from .migration import as_previous, plan_near

        old = as_previous(previous, weights.shape[1], problem, weights.shape[0])
        phy2log, info = plan_near(weights, problem, old, method=method, tolerance=tolerance, max_moves=max_moves,
                                  options=options)
    elapsed = time.perf_counter() - start
    placement = Placement(
        phy2log=phy2log, num_experts=weights.shape[1], topology=problem.topology,
        num_groups=problem.num_groups, method=method, info={**info, "time_s": elapsed},
    )
    bound = lower_bound(weights, problem.topology, problem.num_groups, problem.hierarchical)
    peak = placement.gpu_loads(weights).max(axis=-1)
    # the bound can only tighten with what the method proved (the exact solver reports one)
    if "proven_bound" in info:
        bound = np.maximum(bound, np.minimum(np.asarray(info["proven_bound"], dtype=np.float64), peak))
    object.__setattr__(placement, "lower_bound", bound)
    object.__setattr__(placement, "max_load", peak)
    placement.lower_bound.setflags(write=False)
    placement.max_load.setflags(write=False)
    return placement


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, *, method: str = DEFAULT_METHOD,
                      **options):
    """Drop-in replacement for DeepSeek EPLB's ``rebalance_experts``.

    Args:
        weight: ``[L, E]`` (or ``[E]``) load statistics of the logical experts; numpy or torch.
        num_replicas: physical experts ``S``, a multiple of ``num_gpus``.
        num_groups: expert groups; hierarchical placement when ``num_groups % num_nodes == 0``.
        num_nodes: server nodes; ``num_gpus``: GPUs, a multiple of ``num_nodes``.
    Returns:
        ``phy2log [L, S]``, ``log2phy [L, E, R]`` (slots of each expert in increasing order, ``-1``
        padded) and ``logcnt [L, E]``, int64; torch CPU tensors when ``weight`` is a torch tensor
        (``[E]`` input gives ``[S]``, ``[E, R]``, ``[E]``).
    """
    is_torch = type(weight).__module__.split(".")[0] == "torch"
    one_layer = np.ndim(weight) == 1 if not is_torch else weight.dim() == 1
    weights = as_counts(weight, "weight", ndims=(1, 2))
    if weights.ndim == 1:
        weights = weights[None, :]
    problem = make_problem(weights.shape[1], num_replicas, num_gpus, num_nodes, num_groups)
    phy2log, _ = get_method(method)(weights, problem, **options)
    logcnt = replica_counts(phy2log, weights.shape[1])
    log2phy = slots_of_experts(phy2log, weights.shape[1], int(logcnt.max()))
    result = (phy2log, log2phy, logcnt)
    if one_layer:
        result = tuple(a[0] for a in result)
    if is_torch:
        import torch

        result = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in result)
    return result
