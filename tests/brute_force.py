"""Exhaustive search for tiny instances: the optimum max GPU load, in exact rational arithmetic.

Used only by the tests, to check the CP-SAT model of :mod:`eplb.planning.methods.exact_formulation` against an independent
definition of the problem (ARCHITECTURE.md section 1): choose replica counts ``r_e >= 1`` summing
to the slots, then put the replicas of each expert on GPUs (several may share a GPU) so that every
GPU ``g`` holds exactly ``k_g`` of them; a GPU's load is ``sum_e x[e, g] * w_e / r_e``. With
``num_groups`` in hierarchical mode, all replicas of a group's experts sit on one node.

With ``spread_rule=True`` only the placements that keep the spread rule of docs/methods.md count,
checked here from its words by enumeration (no theorem): in each domain (all GPUs, or a node when
hierarchical) no expert has more replicas than the domain's GPUs with slots unless its slots exceed
its experts times those GPUs, and no expert sits twice on a GPU if its replica counts could sit on
its GPUs with none twice.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations
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


def _fits_spread(replicas: list[int], free: list[int]) -> bool:
    """Whether ``replicas`` (one count per expert) can sit on GPUs with ``free`` slots, no expert twice
    on one GPU and every slot used: tried one expert at a time over every set of GPUs."""
    if not replicas:
        return not any(free)
    first, rest = replicas[0], replicas[1:]
    for gpus in combinations(range(len(free)), first):
        if all(free[g] > 0 for g in gpus):
            if _fits_spread(rest, [f - (g in gpus) for g, f in enumerate(free)]):
                return True
    return False


def keeps_spread_rule(xs: list[tuple[int, ...]], slots: list[int], domains: list[list[int]]) -> bool:
    """``xs[e][g]``: replicas of expert ``e`` on GPU ``g``; ``domains``: GPU lists (global: one)."""
    for gpus in domains:
        gpus = [g for g in gpus if slots[g] > 0]
        held = [[x[g] for g in gpus] for x in xs if any(x[g] for g in gpus)]
        if not held:
            continue
        counts = [sum(h) for h in held]
        if sum(slots[g] for g in gpus) <= len(held) * len(gpus) and max(counts) > len(gpus):
            return False
        if any(v > 1 for h in held for v in h) and _fits_spread(counts, [slots[g] for g in gpus]):
            return False
    return True


def optimum(w, slots_per_gpu, num_nodes: int = 1, num_groups: int | None = None, *,
            spread_rule: bool = False) -> Fraction:
    """The smallest achievable max GPU load.

    Args:
        w: ``[E]`` non-negative loads (floats are taken exactly).
        slots_per_gpu: ``[G]`` slots of each GPU (GPUs ``n*G/N ...`` on node ``n``).
        num_groups: with it, every group of ``E / num_groups`` consecutive experts on one node.
        spread_rule: only placements keeping the spread rule (module docstring).
    Returns:
        The optimum as an exact fraction.
    """
    w = [Fraction(float(v)) for v in np.asarray(w, dtype=np.float64)]  # exact, also for floats
    slots = [int(k) for k in slots_per_gpu]
    num_experts, num_gpus = len(w), len(slots)
    per_node = num_gpus // num_nodes
    group_size = num_experts // num_groups if num_groups else num_experts
    node_choices = list(range(num_nodes)) if num_groups else [None]
    domains = ([list(range(n * per_node, (n + 1) * per_node)) for n in range(num_nodes)] if num_groups
               else [list(range(num_gpus))])
    best = [None]

    def place(e: int, free: list[int], load: list[Fraction], r: tuple[int, ...], node_of_group: dict, xs=(),
              single: bool = False):
        if best[0] is not None and max(load) >= best[0]:
            return  # loads only grow from here
        if e == num_experts:
            if not spread_rule or keeps_spread_rule(list(xs), slots, domains):
                best[0] = max(load)
            return
        group = e // group_size
        nodes = [node_of_group[group]] if group in node_of_group else node_choices
        for node in nodes:
            allowed = [node is None or g // per_node == node for g in range(num_gpus)]
            caps = [min(free[g], 1) if single else free[g] if allowed[g] else 0 for g in range(num_gpus)]
            for x in _compositions(r[e], num_gpus, caps):
                piece = w[e] / r[e]
                place(e + 1, [f - xi for f, xi in zip(free, x)], [lo + xi * piece for lo, xi in zip(load, x)], r,
                      {**node_of_group, group: node}, (*xs, x), single)

    active = [k for k in slots if k > 0]
    for r in _replica_counts(num_experts, sum(slots)):
        # global placements under the rule: skip counts over the cap, and where the counts fit
        # spread, try only spread placements (the rule's own words; the leaf check stays)
        single = spread_rule and not num_groups and _fits_spread(list(r), active)
        if spread_rule and not num_groups and sum(active) <= num_experts * len(active) and max(r) > len(active):
            continue
        place(0, list(slots), [Fraction(0)] * num_gpus, r, {}, (), single)
    if best[0] is None:
        raise ValueError("no placement satisfies the constraints")
    return best[0]


def fewest_doubled(w, slots_per_gpu, peak, *, spread_rule: bool = False) -> int:
    """The fewest slots holding a second (third, ...) replica of an expert on one GPU among the
    plans (global, no groups) whose max GPU load is at most ``peak`` (a float: to a relative 1e-9),
    keeping the spread rule with ``spread_rule``."""
    w = [Fraction(float(v)) for v in np.asarray(w, dtype=np.float64)]
    slots = [int(k) for k in slots_per_gpu]
    limit = Fraction(float(peak)) * (1 + Fraction(1, 10**9))
    num_experts, num_gpus = len(w), len(slots)
    best = [None]

    def place(e: int, free: list[int], load: list[Fraction], r: tuple[int, ...], doubled: int, xs=()):
        if best[0] is not None and doubled >= best[0]:
            return
        if e == num_experts:
            if not spread_rule or keeps_spread_rule(list(xs), slots, [list(range(num_gpus))]):
                best[0] = doubled
            return
        piece = w[e] / r[e]
        for x in _compositions(r[e], num_gpus, free):
            new_load = [lo + xi * piece for lo, xi in zip(load, x)]
            if max(new_load) <= limit:
                place(e + 1, [f - xi for f, xi in zip(free, x)], new_load, r,
                      doubled + sum(xi - 1 for xi in x if xi > 1), (*xs, x))

    for r in _replica_counts(num_experts, sum(slots)):
        place(0, list(slots), [Fraction(0)] * num_gpus, r, 0)
    if best[0] is None:
        raise ValueError(f"no placement has a max load of at most {peak}")
    return best[0]
