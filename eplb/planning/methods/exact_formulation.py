"""The CP-SAT model of one layer that the exact solver searches (ARCHITECTURE.md sections 1, 3):

The model, for one layer with loads ``w[E]`` and GPUs ``g`` holding ``k_g`` slots::

    r_e  = sum_r r * y[e, r]              replica count of expert e, one boolean y per possible count
    sum_r y[e, r] = 1,   sum_e r_e = S    every expert >= 1 replica, every slot used
    sum_g x[e, g] = r_e                   x[e, g]: replicas of e on GPU g (integer)
    sum_e x[e, g] = k_g                   exactly k_g slots on GPU g
    y[e, r]  =>  c[e, g] = x[e, g] * P[e, r]     load e brings to g; P[e, r] = w_e * M / r
    sum_g c[e, g] = w_e * M               the load of e is spread over its replicas, whatever r_e
    load_g = sum_e c[e, g] <= T,   T >= P[e, r_e],   T >= lower_bound * M
    minimise T

``M`` is a common multiple of every possible replica count (``lcm(1 .. S - E + 1)``), so with
integer counts every per-replica load ``w_e * M / r`` is an exact integer and the optimum is exact.
The product ``x * w / r`` is linearised by the enforcement literals ``y[e, r]``: no product of
variables appears. When the counts are not integers, or ``sum(w) * M`` would exceed 2**31 (larger
numbers make CP-SAT's internal arithmetic unreliable), the table is ``P[e, r] = floor(w_e * s / r)``
for a scale ``s`` with ``sum(w) * s = 2**31``: every load is then rounded down, so the
proven bound stays a valid lower bound (the plan's true load is recomputed from the counts).

Hierarchical mode (``deployment.hierarchical``) adds a boolean ``a[q, n]`` per group and node: each
group sits on exactly one node, and its experts' replicas only on that node's GPUs.

The spread rule every method keeps (:mod:`eplb.planning.spread`): in each domain ``d`` (every GPU,
or one node when hierarchical) with ``n_d`` GPUs holding slots, whose ``j`` largest slot counts
sum to ``K[d, j]``::

    r_e <= n_d                  the cap, where it applies (global: a bound on r_e; hierarchical:
                                enforced by a[q, n] and cap[n], cap[n] <=> the node's groups are
                                enough experts for it)
    not double[d]  =>  x[e, g] <= 1 for the GPUs g of d
    double[d]      =>  OR_j  sum_{e in d} min(r_e, j) <= K[d, j] - 1

so GPUs of a domain hold an expert twice only where its experts' replica counts cannot be spread
(``min(r_e, j) = sum_r min(r, j) * y[e, r]`` is linear; in hierarchical mode the sum over the
node's experts is ``sum_q`` of the group's sum where ``a[q, n]``, else 0). The optimum, the bound
and "optimal" are then over the placements that keep the rule: the ones every method returns
(the published greedy's may break it, and may then be lighter than that bound).

Symmetry breaking: GPUs that are interchangeable (same slot count, and same node in hierarchical
mode) are ordered by non-increasing load; in hierarchical mode with identical nodes, group ``q``
may only use nodes ``0 .. q`` (the first group on node 0, and so on). The warm start (a solution
hint) comes from the default method, relabelled to satisfy the same order.

What it holds: the model (:class:`LayerModel`), its strengthenings (:class:`Levers`) and its data
(the integer load table :func:`load_table`, the interchangeable GPUs, the largest replica count).
The search, its budget and the per-layer driver are in :mod:`eplb.planning.methods.exact_model`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ...model.deployment import Deployment
from ...model.topology import Topology
from ..spread import capped, domains, largest_slot_sums


# Largest scaled total load of a layer. CP-SAT computes in int64 but multiplies coefficients in places
# (linearisation, cuts): measured on a 24-expert instance, totals of 2**37 gave false INFEASIBLE / OPTIMAL
# answers, 2**34 and below did not; 2**31 keeps a wide margin.
_SCALED_TOTAL = 2**31


class OutOfTime(Exception):
    """The layer's wall-clock budget ran out while the model was being built."""


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


@dataclass(frozen=True)
class Levers:
    """Which strengthenings the model uses (the defaults are the measured best; ``bench/research/exact_gap.py``
    switches each in turn)."""

    exact_loads: bool = True  # integer loads w * lcm(counts) / r (else floor-rounded, total 2**31)
    spread_constraint: bool = True  # sum_g c[e, g] == w_e * M (needs exact loads)
    bound_constraints: bool = True  # T >= lower_bound, T >= per-replica load of every expert
    symmetry_breaking: bool = True
    branch_on_counts: bool = False  # decide replica counts first, heaviest expert first (measured: slower)
    warm_start: bool = True


# -- the data of the model ------------------------------------------------------------------------


def load_table(w: np.ndarray, max_count: int, exact: bool = True) -> tuple[np.ndarray, float, bool]:
    """Integer per-replica loads ``P[e, r - 1]`` for ``r = 1 .. max_count``.

    Args:
        w: ``[E]`` float64 non-negative loads; ``max_count``: largest possible replica count.
        exact: try exact integers ``w * lcm(1..max_count) / r`` first (integer ``w``, small enough).
    Returns:
        ``(P [E, max_count] int64, scale, is_exact)``: ``P / scale`` is the per-replica load, exactly
        when ``is_exact``, else rounded down.
    """
    counts = np.arange(1, max_count + 1, dtype=np.int64)
    total = float(w.sum())
    if exact and np.all(w == np.round(w)):
        multiple = math.lcm(*range(1, max_count + 1))
        if total * multiple <= _SCALED_TOTAL:
            wi = w.astype(np.int64)
            return wi[:, None] * (multiple // counts)[None, :], float(multiple), True
    scale = _SCALED_TOTAL / total if total > 0 else 1.0
    table = np.floor(w[:, None] * scale / counts[None, :]).astype(np.int64)
    return table, scale, False


def interchangeable_gpus(topology: Topology, hierarchical: bool) -> list[list[int]]:
    """Classes of GPUs that a permutation may swap: same slot count (and node, if hierarchical).

    Returns lists of GPU indices in increasing order, each of length >= 2, GPUs with slots only.
    """
    key = {}
    for g, k in enumerate(topology.slots_per_gpu.tolist()):
        if k == 0:
            continue
        node = int(topology.node_of_gpu[g]) if hierarchical else 0
        key.setdefault((node, k), []).append(g)
    return [gpus for gpus in key.values() if len(gpus) >= 2]


def _identical_nodes(topology: Topology) -> bool:
    per_node = topology.slots_per_gpu.reshape(topology.num_nodes, -1)
    return bool((per_node == per_node[0]).all())


def _most_replicas(num_experts: int, deployment: Deployment) -> int:
    """The largest replica count an expert may get: every other expert on one slot, and in a
    global placement where the cap applies, no more than the GPUs with slots."""
    most = deployment.num_slots - num_experts + 1
    if not deployment.hierarchical:
        active = deployment.topology.slots_per_gpu[deployment.topology.slots_per_gpu > 0]
        if capped(num_experts, active):
            most = min(most, len(active))
    return most


def _lower_bound_scaled(bound: float, scale: float, exact: bool, max_slots: int) -> int:
    """A closed-form bound in the model's integer units, rounded so it never cuts the optimum."""
    scaled = math.floor(bound * scale * (1.0 - 1e-9))
    return max(0, scaled if exact else scaled - max_slots)


class LayerModel:
    """The CP-SAT model of one layer; see the module docstring for the formulation.

    Args:
        w: ``[E]`` float64 loads of the layer.
        deployment: topology, groups, hierarchical flag.
        levers: which strengthenings to use.
        closed_form_bound: ``eplb.analysis.bounds.lower_bound`` of the layer (a float in count units).
        deadline: ``time.perf_counter()`` value past which building stops with :class:`OutOfTime`
            (``None``: none).
    Attributes:
        table: ``[E, R]`` int64 per-replica loads ``P[e, r - 1]``; ``scale``: ``P / scale`` is in count
        units; ``exact``: whether ``P`` is exact (else rounded down).
    """

    def __init__(self, w: np.ndarray, deployment: Deployment, levers: Levers, closed_form_bound: float,
                 deadline: float | None = None):
        topology = deployment.topology
        self.w, self.deployment, self.levers = w, deployment, levers
        num_experts, slots = len(w), topology.slots_per_gpu
        self.max_count = max_count = _most_replicas(num_experts, deployment)
        self.table, self.scale, self.exact = load_table(w, max_count, levers.exact_loads)
        table = self.table
        self.gpus = gpus = [g for g in range(topology.num_gpus) if slots[g] > 0]
        experts, counts = range(num_experts), range(1, max_count + 1)
        model = self.model = cp_model.CpModel()

        # replica counts: one boolean per possible count
        self.y = y = [[model.new_bool_var(f"y[{e},{r}]") for r in counts] for e in experts]
        self.r = r = [model.new_int_var(1, max_count, f"r[{e}]") for e in experts]
        for e in experts:
            model.add_exactly_one(y[e])
            model.add(r[e] == sum(n * y[e][n - 1] for n in counts))
        model.add(sum(r) == topology.num_slots)

        # replicas per GPU and the load each expert brings to each GPU
        self.x = x = {}
        c = {}
        for e in experts:
            _check_deadline(deadline)
            for g in gpus:
                most = min(int(slots[g]), max_count)
                x[e, g] = model.new_int_var(0, most, f"x[{e},{g}]")
                c[e, g] = model.new_int_var(0, int(table[e, 0]), f"c[{e},{g}]")  # x <= r: at most w_e
                for n in counts:
                    model.add(c[e, g] == int(table[e, n - 1]) * x[e, g]).only_enforce_if(y[e][n - 1])
            model.add(sum(x[e, g] for g in gpus) == r[e])
            if self.exact and levers.spread_constraint:
                model.add(sum(c[e, g] for g in gpus) == int(table[e, 0]))
        for g in gpus:
            model.add(sum(x[e, g] for e in experts) == int(slots[g]))
        self.c = c

        total = int(table[:, 0].sum())
        self.load = load = {g: model.new_int_var(0, total, f"load[{g}]") for g in gpus}
        for g in gpus:
            model.add(load[g] == sum(c[e, g] for e in experts))
        if self.exact and levers.spread_constraint:
            model.add(sum(load.values()) == total)  # so T close to the mean forces every load close to it
        floor = 0
        if levers.bound_constraints:
            floor = _lower_bound_scaled(closed_form_bound, self.scale, self.exact, int(slots.max()))
        self.peak = peak = model.new_int_var(min(floor, total), total, "T")
        for g in gpus:
            model.add(peak >= load[g])
        if levers.bound_constraints:
            for e in experts:
                if table[e, 0] > 0:
                    model.add(peak >= sum(int(table[e, n - 1]) * y[e][n - 1] for n in counts))

        if deployment.hierarchical:
            self._add_groups_on_nodes()
        _check_deadline(deadline)
        self._add_spread_rule(deadline)
        if levers.symmetry_breaking:
            for same in interchangeable_gpus(topology, deployment.hierarchical):
                for a, b in zip(same, same[1:]):
                    model.add(load[a] >= load[b])
        if levers.branch_on_counts:
            heaviest_first = sorted(experts, key=lambda e: (-w[e], e))
            model.add_decision_strategy([r[e] for e in heaviest_first], cp_model.CHOOSE_FIRST,
                                        cp_model.SELECT_MAX_VALUE)
        model.minimize(peak)

    def _add_groups_on_nodes(self):
        """Each group ``q`` on exactly one node: ``a[q, n]``; its replicas only on that node's GPUs."""
        model, deployment, topology = self.model, self.deployment, self.deployment.topology
        num_groups, num_nodes = deployment.num_groups, topology.num_nodes
        group_size = len(self.w) // num_groups
        node_of_gpu = topology.node_of_gpu
        symmetric = self.levers.symmetry_breaking and _identical_nodes(topology)
        self.a = a = {(q, n): model.new_bool_var(f"a[{q},{n}]") for q in range(num_groups) for n in range(num_nodes)}
        for q in range(num_groups):
            model.add_exactly_one(a[q, n] for n in range(num_nodes))
            if symmetric:  # nodes are interchangeable: group q uses one of the first q + 1 nodes
                for n in range(q + 1, num_nodes):
                    model.add(a[q, n] == 0)
            for e in range(q * group_size, (q + 1) * group_size):
                for g in self.gpus:
                    model.add(self.x[e, g] == 0).only_enforce_if(a[q, int(node_of_gpu[g])].Not())
        for n in range(num_nodes):
            model.add(sum(group_size * a[q, n] for q in range(num_groups)) <= int(topology.slots_per_node[n]))

    def _held_within(self, j: int) -> list:
        """``[E]`` linear expressions ``min(r_e, j)``."""
        return [sum(min(n, j) * var for n, var in enumerate(self.y[e], start=1)) for e in range(len(self.w))]

    def _held_on_node(self, node: int, j: int):
        """``sum_e min(r_e, j)`` over the experts of the groups on ``node``: per group an integer
        variable equal to its experts' sum where ``a[q, node]``, else 0."""
        model, size = self.model, len(self.w) // self.deployment.num_groups
        held = self._held_within(j)
        parts = []
        for q in range(self.deployment.num_groups):
            part = model.new_int_var(0, size * j, f"held[{q},{node},{j}]")
            model.add(part == sum(held[q * size:(q + 1) * size])).only_enforce_if(self.a[q, node])
            model.add(part == 0).only_enforce_if(self.a[q, node].Not())
            self.held_parts[q, node, j] = part
            parts.append(part)
        return sum(parts)

    def _add_spread_rule(self, deadline: float | None) -> None:
        """The spread rule of the module docstring: ``double[d]`` per domain, true only where the
        replica counts of the domain's experts break a condition ``j``. Conditions that no replica
        counts can break are left out: ``j >= max_count`` (then ``min(r_e, j) = r_e`` and the sum is
        the domain's slots) and ``K[d, j]`` at most the experts the domain surely holds."""
        model, slots = self.model, self.deployment.topology.slots_per_gpu
        hierarchical = self.deployment.hierarchical
        fewest_held = len(self.w) // self.deployment.num_groups if hierarchical else len(self.w)
        self.double, self.breaks, self.held_parts, self.node_cap = {}, {}, {}, {}
        for d, domain in enumerate(domains(self.deployment)):
            _check_deadline(deadline)
            node = int(self.deployment.topology.node_of_gpu[domain[0]])
            if hierarchical:
                self._add_node_cap(node, domain)
            conditions = []
            for j, largest in enumerate(largest_slot_sums(slots[domain]).tolist(), start=1):
                if j >= self.max_count or largest <= fewest_held:
                    continue
                held = self._held_on_node(node, j) if hierarchical else sum(self._held_within(j))
                broken = model.new_bool_var(f"breaks[{d},{j}]")
                model.add(held <= largest - 1).only_enforce_if(broken)
                self.breaks[d, j] = broken
                conditions.append(broken)
            double = self.double[d] = model.new_bool_var(f"double[{d}]")
            if conditions:
                model.add_bool_or(conditions).only_enforce_if(double)
            else:
                model.add(double == 0)
            for g in domain.tolist():
                for e in range(len(self.w)):
                    model.add(self.x[e, g] <= 1).only_enforce_if(double.Not())

    def _add_node_cap(self, node: int, domain: np.ndarray) -> None:
        """The cap on ``node`` (GPUs ``domain`` with slots): ``cap[node]`` iff its groups hold enough
        experts for it, and then every expert of a group on it has at most ``len(domain)`` replicas."""
        model, size = self.model, len(self.w) // self.deployment.num_groups
        node_slots = int(self.deployment.topology.slots_per_gpu[domain].sum())
        fewest_groups = -(-node_slots // (size * len(domain)))  # the cap applies from this many groups on
        if len(domain) >= self.max_count:
            return  # no expert can exceed it
        cap = self.node_cap[node] = model.new_bool_var(f"cap[{node}]")
        groups_on = sum(self.a[q, node] for q in range(self.deployment.num_groups))
        model.add(groups_on >= fewest_groups).only_enforce_if(cap)
        model.add(groups_on <= fewest_groups - 1).only_enforce_if(cap.Not())
        for q in range(self.deployment.num_groups):
            for e in range(q * size, (q + 1) * size):
                model.add(self.r[e] <= len(domain)).only_enforce_if([self.a[q, node], cap])

    def _hint_spread_rule(self, counts: np.ndarray, on_gpu: np.ndarray) -> None:
        """Hints for the spread rule's variables from a plan's ``counts [E]`` and ``on_gpu [E, G]``."""
        model, slots = self.model, self.deployment.topology.slots_per_gpu
        size = len(self.w) // self.deployment.num_groups if self.deployment.hierarchical else len(self.w)
        for d, domain in enumerate(domains(self.deployment)):
            present = on_gpu[:, domain].sum(axis=1) > 0  # [E] experts of the domain
            largest = largest_slot_sums(slots[domain])
            for (dd, j), var in self.breaks.items():
                if dd == d:
                    model.add_hint(var, bool(np.minimum(counts[present], j).sum() <= largest[j - 1] - 1))
            model.add_hint(self.double[d], bool((on_gpu[:, domain] > 1).any()))
        for node, var in self.node_cap.items():
            groups_on = sum(on_gpu[q * size, self.deployment.topology.node_of_gpu == node].sum() > 0
                            for q in range(self.deployment.num_groups))
            domain = self.deployment.topology.slots_per_gpu * (self.deployment.topology.node_of_gpu == node)
            model.add_hint(var, bool(capped(groups_on * size, domain[domain > 0])))
        for (q, node, j), var in self.held_parts.items():
            on_node = on_gpu[q * size, self.deployment.topology.node_of_gpu == node].sum() > 0
            model.add_hint(var, int(np.minimum(counts[q * size:(q + 1) * size], j).sum()) if on_node else 0)

    def spread_replicas(self, slots_row: np.ndarray) -> None:
        """Make the model the second stage: every GPU's load at most that of the plan ``[S]`` (the
        first stage's, in the model's integer units), maximise the (expert, GPU) pairs that hold a
        replica, i.e. the fewest slots spent on a second replica of an expert on one GPU; the plan
        is the hint, so the stage never returns a worse one."""
        model = self.model
        model.clear_objective()
        model.clear_hints()
        canonical = self.canonical(slots_row)
        counts = np.bincount(canonical, minlength=len(self.w))
        on_gpu = self.per_gpu_counts(canonical)  # [E, G] replicas of each expert on each GPU
        loads = on_gpu * self.table[np.arange(len(self.w)), counts - 1][:, None]
        model.add(self.peak <= int(loads.sum(axis=0).max()))
        self.add_hint(slots_row)
        held = []
        for (e, g), replicas in self.x.items():
            holds = model.new_bool_var(f"holds[{e},{g}]")
            model.add(replicas >= 1).only_enforce_if(holds)
            model.add(replicas == 0).only_enforce_if(holds.Not())
            model.add_hint(holds, bool(on_gpu[e, g] > 0))
            held.append(holds)
        model.maximize(sum(held))

    # -- plans <-> variable values ----------------------------------------------------------------

    def per_gpu_counts(self, slots_row: np.ndarray) -> np.ndarray:
        """``phy2log`` row ``[S]`` -> ``[E, G]`` int64 replicas of each expert on each GPU."""
        topology = self.deployment.topology
        out = np.zeros((len(self.w), topology.num_gpus), np.int64)
        np.add.at(out, (slots_row, topology.gpu_of_slot), 1)
        return out

    def canonical(self, slots_row: np.ndarray) -> np.ndarray:
        """Relabel a plan ``[S]`` (moving whole GPUs, and whole nodes) to satisfy the symmetry breaking.

        Interchangeable GPUs end up in non-increasing order of the model's integer load; with identical
        nodes in hierarchical mode, nodes are ordered by the first group they hold.
        """
        topology, deployment = self.deployment.topology, self.deployment
        offsets = topology.slot_offsets
        blocks = [slots_row[offsets[g]:offsets[g + 1]] for g in range(topology.num_gpus)]
        if deployment.hierarchical and self.levers.symmetry_breaking and _identical_nodes(topology):
            per_node, group_size = topology.gpus_per_node, len(self.w) // deployment.num_groups
            first = [min((int(e) // group_size for b in blocks[n * per_node:(n + 1) * per_node] for e in b),
                         default=deployment.num_groups) for n in range(topology.num_nodes)]
            order = sorted(range(topology.num_nodes), key=lambda n: (first[n], n))
            blocks = [blocks[n * per_node + j] for n in order for j in range(per_node)]
        if self.levers.symmetry_breaking:
            counts = np.bincount(slots_row, minlength=len(self.w))
            loads = [int(self.table[b, counts[b] - 1].sum()) for b in blocks]
            for same in interchangeable_gpus(topology, deployment.hierarchical):
                ranked = sorted(same, key=lambda g: (-loads[g], g))
                moved = [blocks[g] for g in ranked]
                for g, block in zip(same, moved):
                    blocks[g] = block
        return np.concatenate(blocks)

    def add_hint(self, slots_row: np.ndarray):
        """Warm start: hint every variable with the values of the plan ``[S]`` (made canonical)."""
        slots_row = self.canonical(slots_row)
        on_gpu = self.per_gpu_counts(slots_row)
        counts = on_gpu.sum(axis=1)
        model, table = self.model, self.table
        loads = {g: 0 for g in self.gpus}
        for e in range(len(self.w)):
            n = int(counts[e])
            model.add_hint(self.r[e], n)
            for m, var in enumerate(self.y[e], start=1):
                model.add_hint(var, m == n)
            for g in self.gpus:
                model.add_hint(self.x[e, g], int(on_gpu[e, g]))
                model.add_hint(self.c[e, g], int(on_gpu[e, g] * table[e, n - 1]))
                loads[g] += int(on_gpu[e, g] * table[e, n - 1])
        for g in self.gpus:
            model.add_hint(self.load[g], loads[g])
        model.add_hint(self.peak, max(loads.values()))
        self._hint_spread_rule(counts, on_gpu)
        if self.deployment.hierarchical:
            group_size = len(self.w) // self.deployment.num_groups
            node_of_gpu = self.deployment.topology.node_of_gpu
            for (q, n), var in self.a.items():
                model.add_hint(var, bool(on_gpu[q * group_size, node_of_gpu == n].sum() > 0))

    def plan_from(self, value) -> np.ndarray:
        """A solution as a ``phy2log`` row ``[S]`` (each GPU's experts in increasing order); ``value``
        maps a variable to its value (``solver.value`` or a solution callback's ``value``)."""
        topology = self.deployment.topology
        row = []
        for g in range(topology.num_gpus):
            if topology.slots_per_gpu[g] == 0:
                continue
            for e in range(len(self.w)):
                row.extend([e] * int(value(self.x[e, g])))
        return np.asarray(row, dtype=np.int64)

