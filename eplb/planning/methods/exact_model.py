"""The exact solver: one CP-SAT model per layer, with proven bounds (ARCHITECTURE.md sections 1, 3).

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

Time: ``time_limit`` is wall-clock seconds per layer, every stage included (building the model, the
search, the spreading search); ``deterministic_time`` is CP-SAT's deterministic time per layer (a
count of work, about one second on one core per unit), shared the same way. The search runs with a
fixed seed: with ``deterministic_time`` alone the same input gives the same placement on every run;
a wall-clock limit can stop it at a different point.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from ...analysis.bounds import strongest_bound
from ...analysis.loads import slot_order_peaks
from ...model.deployment import Deployment
from ...model.counts import power_of_two_scale
from ...model.topology import Topology
from ..spread import capped, domains, largest_slot_sums, spread_row

# Largest scaled total load of a layer. CP-SAT computes in int64 but multiplies coefficients in places
# (linearisation, cuts): measured on a 24-expert instance, totals of 2**37 gave false INFEASIBLE / OPTIMAL
# answers, 2**34 and below did not; 2**31 keeps a wide margin.
_SCALED_TOTAL = 2**31
OPTIMALITY_TOLERANCE = 1e-6  # relative, only when the loads had to be rounded


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


@dataclass
class LayerResult:
    """The outcome of one layer's solve."""

    slots: np.ndarray  # [S] int64 phy2log row
    optimal: bool
    proven_bound: float  # in the units of the counts
    solve_time_s: float
    status: str
    max_load: float = math.nan  # of the returned plan, in count units
    info: dict = field(default_factory=dict)


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


# -- solving --------------------------------------------------------------------------------------


class _KeepBest(cp_model.CpSolverSolutionCallback):
    """Records the latest (best) solution's plan, so an interrupted solve can still return it."""

    def __init__(self, layer_model: LayerModel):
        super().__init__()
        self.layer_model = layer_model
        self.best: np.ndarray | None = None

    def on_solution_callback(self):
        self.best = self.layer_model.plan_from(self.value)


def _wait(thread: threading.Thread) -> None:
    """Wait for the solver thread; Ctrl-C (KeyboardInterrupt) arrives here, in the main thread."""
    while thread.is_alive():
        thread.join(0.01)


def solver_parameters(time_limit: float | None, workers: int, *, wall_seconds: float | None = None
                      ) -> cp_model.CpSolver:
    """A CpSolver configured for reproducible results.

    ``time_limit`` bounds CP-SAT's deterministic time (a count of work; ``None``: no bound): where
    the search stops then depends only on the input. ``wall_seconds`` bounds the wall clock too
    (``max_time_in_seconds``; CP-SAT measures it as wall time). With several workers,
    ``interleave_search`` runs the portfolio in deterministic batches.
    """
    solver = cp_model.CpSolver()
    params = solver.parameters
    if time_limit is not None:
        params.max_deterministic_time = float(time_limit)
    if wall_seconds is not None:
        params.max_time_in_seconds = float(wall_seconds)
    params.num_workers = int(workers)
    params.random_seed = 0
    params.log_search_progress = False
    params.catch_sigint_signal = False  # Ctrl-C reaches Python (see solve_layer), not CP-SAT's handler
    if workers > 1:
        params.interleave_search = True
    return solver


def _configure_search(solver: cp_model.CpSolver, levers: Levers) -> None:
    """With ``branch_on_counts``, follow the model's decision strategy first (CP-SAT's automatic
    search otherwise ignores it with one worker)."""
    if levers.branch_on_counts:
        solver.parameters.search_branching = cp_model.PARTIAL_FIXED_SEARCH


MIN_STAGE_BUDGET = 0.01
"""The spreading search runs only when at least this much of the layer's budget is left (seconds of
the wall clock, and units of deterministic time)."""


@dataclass
class Budget:
    """What one layer may still spend, every stage included: a wall-clock ``deadline`` (a
    ``time.perf_counter()`` value) and CP-SAT ``deterministic`` time, each ``None`` when unbounded."""

    deadline: float | None
    deterministic: float | None

    def wall_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def left(self) -> bool:
        """Whether enough is left for another search (:data:`MIN_STAGE_BUDGET` of each bound)."""
        wall = self.wall_left()
        return ((wall is None or wall > MIN_STAGE_BUDGET)
                and (self.deterministic is None or self.deterministic > MIN_STAGE_BUDGET))

    def solver(self, workers: int, levers: Levers) -> cp_model.CpSolver:
        """A solver bounded by what is left."""
        wall = self.wall_left()
        solver = solver_parameters(self.deterministic, workers, wall_seconds=None if wall is None else max(1e-3, wall))
        _configure_search(solver, levers)
        return solver

    def spend(self, solver: cp_model.CpSolver) -> None:
        """Count the deterministic time ``solver`` used (the same on every run, unlike the wall clock)."""
        if self.deterministic is not None:
            self.deterministic -= float(solver.response_proto.deterministic_time)


def _search(layer_model: LayerModel, solver: cp_model.CpSolver) -> tuple[int, np.ndarray | None, bool, bool]:
    """Run ``solver`` on the model in a thread (Ctrl-C reaches the main thread). Returns ``(status,
    plan [S] or None, ran, interrupted)``: the solver's status and best plan, whether it answered."""
    keep = _KeepBest(layer_model)
    outcome = {}

    def run():
        try:
            outcome["status"] = solver.solve(layer_model.model, keep)
        except BaseException as exc:  # re-raised in the calling thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="eplb-exact-solve")
    thread.start()
    interrupted = False
    try:
        _wait(thread)
    except KeyboardInterrupt:
        interrupted = True
        while thread.is_alive():  # repeat: the search may not have started when the signal came
            solver.stop_search()
            thread.join(0.05)
    if "error" in outcome and not interrupted:
        raise outcome["error"]
    status = outcome.get("status", cp_model.UNKNOWN)
    has_solution = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    row = layer_model.plan_from(solver.value) if has_solution else keep.best
    return status, row, "status" in outcome, interrupted


def _doubled(row: np.ndarray, topology: Topology) -> int:
    """Slots of the plan ``[S]`` holding a second (third, ...) replica of an expert on one GPU."""
    pairs = np.unique(np.stack([topology.gpu_of_slot, row]), axis=1).shape[1]
    return len(row) - pairs


def _peak(w: np.ndarray, row: np.ndarray, deployment: Deployment) -> float:
    return float(slot_order_peaks(w[None], row[None], deployment.topology)[0])


def solve_layer(w: np.ndarray, deployment: Deployment, warm: np.ndarray, closed_form_bound: float, *,
                time_limit: float | None, workers: int, levers: Levers = Levers(),
                deterministic_time: float | None = None) -> tuple[LayerResult, bool]:
    """Solve one layer: the lowest max load among the placements that keep the spread rule (the
    model's constraint, see the module docstring), then, where the rule lets that plan hold an
    expert twice on a GPU and the layer's budget is not spent, the fewest such replicas among plans
    as light. Returns ``(result, interrupted)``.

    Args:
        w: ``[E]`` loads; warm: ``[S]`` the warm-start plan. Rearranged first where it breaks the
            rule (:func:`eplb.planning.spread.spread_row`), it is the hint and the fallback: the
            returned plan keeps the rule whatever the budget.
        closed_form_bound: ``lower_bound`` of the layer.
        time_limit: wall-clock seconds for the whole layer, every stage included (``None``: none).
        deterministic_time: CP-SAT deterministic time for the whole layer (``None``: none); the
            spreading search gets what the first left.
    """
    start = time.perf_counter()
    budget = Budget(None if time_limit is None else start + time_limit, deterministic_time)
    warm = spread_row(warm, deployment)
    info = {"source": "warm start"}
    if not w.any():  # a dense layer: every plan is optimal
        return LayerResult(warm.copy(), True, 0.0, 0.0, "TRIVIAL", 0.0, {**info, "doubled": 0}), False
    try:
        layer_model = LayerModel(w, deployment, levers, closed_form_bound, deadline=budget.deadline)
        if levers.warm_start:
            layer_model.add_hint(warm)
    except OutOfTime:  # the budget went on building the model: the warm start, nothing proven
        info.update(exact_arithmetic=False, doubled=_doubled(warm, deployment.topology), built=False)
        return LayerResult(warm.copy(), False, 0.0, time.perf_counter() - start, "UNKNOWN", _peak(w, warm, deployment),
                           info), False
    solver = budget.solver(workers, levers)
    status, row, ran, interrupted = _search(layer_model, solver)
    budget.spend(solver)
    bound = 0.0
    if ran and status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
        bound = solver.best_objective_bound / layer_model.scale
    bound = max(bound, 0.0)
    if row is not None and _peak(w, row, deployment) <= _peak(w, warm, deployment):
        info["source"] = "search"
    else:
        row = warm.copy()  # never worse than the warm start (matters only for rounded loads)
    peak = _peak(w, row, deployment)
    # with exact integer loads the model's optimum must be the plan's load, to the unit
    consistent = (status != cp_model.OPTIMAL or not layer_model.exact
                  or abs(solver.objective_value - peak * layer_model.scale) <= 0.5)
    if status == cp_model.OPTIMAL and layer_model.exact and consistent:
        optimal = True
        bound = peak  # exact arithmetic: the model's optimum is the plan's load
    elif not consistent:  # the solver's objective disagrees with the plan it returned: trust neither
        optimal, bound = False, 0.0
    else:
        optimal = peak <= bound * (1.0 + OPTIMALITY_TOLERANCE)
    name = "INTERRUPTED" if interrupted else solver.status_name(status)
    doubled = _doubled(row, deployment.topology)
    info.update(exact_arithmetic=layer_model.exact, doubled_before_spreading=doubled, built=True)
    if doubled and not interrupted and consistent and budget.left():
        row, interrupted = _spread(layer_model, row, doubled, w, deployment, peak, budget, workers)
    info["doubled"] = _doubled(row, deployment.topology)
    elapsed = time.perf_counter() - start
    return LayerResult(row, bool(optimal), float(min(bound, peak)), elapsed, name, peak, info), interrupted


def _spread(layer_model: LayerModel, row: np.ndarray, doubled: int, w: np.ndarray, deployment: Deployment, peak: float,
            budget: Budget, workers: int) -> tuple[np.ndarray, bool]:
    """The second stage of :func:`solve_layer` from the first stage's plan ``row [S]`` (max load
    ``peak``, ``doubled`` slots doubling a replica, as the rule lets it), within what is left of
    ``budget``: a plan as light with fewer doubled replicas, else ``row``; and whether Ctrl-C came."""
    layer_model.spread_replicas(row)
    solver = budget.solver(workers, layer_model.levers)
    _, spread, _, interrupted = _search(layer_model, solver)
    budget.spend(solver)
    if spread is None or _peak(w, spread, deployment) > peak or _doubled(spread, deployment.topology) >= doubled:
        return row, interrupted  # with rounded loads the stage may not keep the true max load: keep row
    return spread, interrupted


def largest_first_plan(w: np.ndarray, topology: Topology) -> np.ndarray:
    """A simple valid plan ``[S]`` for any topology (the warm start when the default method declines):
    one replica at a time to the largest load per replica, then replicas largest-first onto the
    least loaded GPU with a free slot."""
    counts = np.ones(len(w), np.int64)
    for _ in range(topology.num_slots - len(w)):
        counts[int(np.argmax(w / counts))] += 1
    replicas = np.repeat(np.arange(len(w)), counts)
    order = np.argsort(-(w / counts)[replicas], kind="stable")
    free = topology.slots_per_gpu.copy()
    load = np.zeros(topology.num_gpus)
    on_gpu: list[list[int]] = [[] for _ in range(topology.num_gpus)]
    for i in order:
        e = int(replicas[i])
        open_gpus = np.flatnonzero(free > 0)
        g = int(open_gpus[np.argmin(load[open_gpus])])
        on_gpu[g].append(e)
        free[g] -= 1
        load[g] += w[e] / counts[e]
    return np.asarray([e for block in on_gpu for e in sorted(block)], dtype=np.int64)


def solve(weights: np.ndarray, deployment: Deployment, warm: np.ndarray, *, time_limit: float | None, workers: int,
          progress: bool | None = None, levers: Levers = Levers(), deterministic_time: float | None = None
          ) -> tuple[np.ndarray, dict]:
    """Solve every layer independently.

    Args:
        weights: ``[L, E]`` float64 loads; warm: ``[L, S]`` int64 warm-start plans.
        time_limit, deterministic_time: per layer, see :func:`solve_layer`.
        progress: show a per-layer progress bar on stderr (None: only when stderr is a terminal).
    Returns:
        ``phy2log [L, S]`` int64 and the diagnostics: ``optimal`` ``[L]`` bool and ``proven_bound``
        ``[L]`` float64 (count units), both among the placements that keep the spread rule;
        ``solve_time_s`` ``[L]`` (every stage of the layer); ``status`` (``[L]`` names: OPTIMAL,
        FEASIBLE: the budget ended before a proof; UNKNOWN: nothing better than the warm start was
        found, or the budget ended while building the model; TRIVIAL, INTERRUPTED, SKIPPED);
        ``source`` ``[L]`` (``"search"``, or ``"warm start"`` when the plan is the warm start's);
        ``doubled`` ``[L]`` int64 (slots holding a second replica of an expert on one GPU: 0 wherever
        the replica counts allow); ``warm_start_rearranged`` ``[L]`` bool (the warm start broke the
        rule and was rearranged); ``interrupted``; ``exact_arithmetic`` ``[L]``.
        After a Ctrl-C, the interrupted layer keeps its best plan so far and later layers are
        ``SKIPPED`` (the warm-start plan, rearranged to keep the rule; bound = the closed-form lower bound).
    """
    from tqdm import tqdm

    num_layers = weights.shape[0]
    # extreme magnitudes: the model sees such a layer scaled by a power of two (exact); ordinary
    # counts are kept as given, so integer counts keep exact integer arithmetic
    scaled, shift = power_of_two_scale(weights)
    peak = weights.max(axis=1)
    shift = np.where((peak >= 2.0**-60) & (peak <= 2.0**60), 0, shift)
    scaled = np.ldexp(weights, shift[:, None].astype(np.int32))
    bounds = strongest_bound(scaled, deployment)
    phy2log = np.stack([spread_row(row, deployment) for row in warm])  # every layer keeps the rule, solved or not
    rearranged = (phy2log != warm).any(axis=1)
    source = ["warm start"] * num_layers
    optimal = np.zeros(num_layers, bool)
    proven = bounds.astype(np.float64).copy()
    times = np.zeros(num_layers)
    exact = np.zeros(num_layers, bool)
    status = ["SKIPPED"] * num_layers
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = tqdm(total=num_layers, desc="exact", unit="layer", file=sys.stderr, disable=not show)
    interrupted = False
    try:
        for layer in range(num_layers):
            try:
                result, interrupted = solve_layer(scaled[layer], deployment, warm[layer], float(bounds[layer]),
                                                  time_limit=time_limit, workers=workers, levers=levers,
                                                  deterministic_time=deterministic_time)
            except KeyboardInterrupt:  # outside the search (building the model): keep the warm start
                interrupted = True
                status[layer] = "INTERRUPTED"
                break
            phy2log[layer] = result.slots
            optimal[layer] = result.optimal
            proven[layer] = max(result.proven_bound, proven[layer]) if not result.optimal else result.proven_bound
            times[layer] = result.solve_time_s
            exact[layer] = result.info.get("exact_arithmetic", True)
            status[layer] = result.status
            source[layer] = result.info["source"]
            bar.update(1)
            bar.set_postfix(optimal=f"{int(optimal[:layer + 1].sum())}/{layer + 1}")
            if interrupted:
                break
    finally:
        bar.close()
    proven = np.ldexp(proven, -shift)
    doubled = np.asarray([_doubled(row, deployment.topology) for row in phy2log], np.int64)
    info = {"optimal": optimal, "proven_bound": proven, "solve_time_s": times, "status": status,
            "source": source, "doubled": doubled, "warm_start_rearranged": rearranged,
            "interrupted": interrupted, "exact_arithmetic": exact}
    return phy2log, info
