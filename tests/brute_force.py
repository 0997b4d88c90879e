"""Exhaustive search for tiny instances: the optimum max GPU load, in exact rational arithmetic.

Used only by the tests, to check the CP-SAT model of :mod:`eplb.planning.methods.exact_model` against an independent
definition of the problem (ARCHITECTURE.md section 1): choose replica counts ``r_e >= 1`` summing
to the slots, then put the replicas of each expert on GPUs (several may share a GPU) so that every
GPU ``g`` holds exactly ``k_g`` of them; a GPU's load is ``sum_e x[e, g] * w_e / r_e``. With
``num_groups`` in hierarchical mode, all replicas of a group's experts sit on one node.
"""

from __future__ import annotations

from fractions import Fraction
import numpy as np


def _compositions(total: int, parts: int, caps: list[int]):
    """Every ``x`` with ``sum(x) == total``, ``0 <= x[i] <= caps[i]``."""
    if parts == 0:
        if total == 0:
            yield ()
        return
    for first in range(min(total, caps[0]) + 1):
        for rest in _compositions(total - first, parts - 1, caps[1:]):
            yield (first, *rest)


def _replica_counts(num_experts: int, num_slots: int):
    """Every ``r`` with ``r_e >= 1`` and ``sum(r) == num_slots``."""
    extra = num_slots - num_experts
    for spare in _compositions(extra, num_experts, [extra] * num_experts):
        yield tuple(1 + s for s in spare)


def optimum(w, slots_per_gpu, num_nodes: int = 1, num_groups: int | None = None) -> Fraction:
    """The smallest achievable max GPU load.

    Args:
        w: ``[E]`` non-negative loads (floats are taken exactly).
        slots_per_gpu: ``[G]`` slots of each GPU (GPUs ``n*G/N ...`` on node ``n``).
        num_groups: with it, every group of ``E / num_groups`` consecutive experts on one node.
    Returns:
        The optimum as an exact fraction.
    """
    w = [Fraction(float(v)) for v in np.asarray(w, dtype=np.float64)]  # exact, also for floats
    slots = [int(k) for k in slots_per_gpu]
    num_experts, num_gpus = len(w), len(slots)
    per_node = num_gpus // num_nodes
    group_size = num_experts // num_groups if num_groups else num_experts
    node_choices = list(range(num_nodes)) if num_groups else [None]
    best = [None]

    def place(e: int, free: list[int], load: list[Fraction], r: tuple[int, ...], node_of_group: dict):
        if best[0] is not None and max(load) >= best[0]:
            return  # loads only grow from here
        if e == num_experts:
            best[0] = max(load)
            return
        group = e // group_size
        nodes = [node_of_group[group]] if group in node_of_group else node_choices
        for node in nodes:
            allowed = [node is None or g // per_node == node for g in range(num_gpus)]
            caps = [free[g] if allowed[g] else 0 for g in range(num_gpus)]
            for x in _compositions(r[e], num_gpus, caps):
                piece = w[e] / r[e]
                place(e + 1, [f - xi for f, xi in zip(free, x)], [lo + xi * piece for lo, xi in zip(load, x)], r,
                      {**node_of_group, group: node})

    for r in _replica_counts(num_experts, sum(slots)):
        place(0, list(slots), [Fraction(0)] * num_gpus, r, {})
    if best[0] is None:
        raise ValueError("no placement satisfies the constraints")
    return best[0]


def fewest_doubled(w, slots_per_gpu, peak) -> int:
    """The fewest slots holding a second (third, ...) replica of an expert on one GPU among the
    plans (global, no groups) whose max GPU load is at most ``peak`` (a float: to a relative 1e-9)."""
    w = [Fraction(float(v)) for v in np.asarray(w, dtype=np.float64)]
    slots = [int(k) for k in slots_per_gpu]
    limit = Fraction(float(peak)) * (1 + Fraction(1, 10**9))
    num_experts, num_gpus = len(w), len(slots)
    best = [None]

    def place(e: int, free: list[int], load: list[Fraction], r: tuple[int, ...], doubled: int):
        if best[0] is not None and doubled >= best[0]:
            return
        if e == num_experts:
            best[0] = doubled
            return
        piece = w[e] / r[e]
        for x in _compositions(r[e], num_gpus, free):
            new_load = [lo + xi * piece for lo, xi in zip(load, x)]
            if max(new_load) <= limit:
                place(e + 1, [f - xi for f, xi in zip(free, x)], new_load, r,
                      doubled + sum(xi - 1 for xi in x if xi > 1))

    for r in _replica_counts(num_experts, sum(slots)):
        place(0, list(slots), [Fraction(0)] * num_gpus, r, 0)
    if best[0] is None:
        raise ValueError(f"no placement has a max load of at most {peak}")
    return best[0]
