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

Symmetry breaking: GPUs that are interchangeable (same slot count, and same node in hierarchical
mode) are ordered by non-increasing load; in hierarchical mode with identical nodes, group ``q``
may only use nodes ``0 .. q`` (the first group on node 0, and so on). The warm start (a solution
hint) comes from the default method, relabelled to satisfy the same order.

Time: ``time_limit`` is wall-clock seconds per layer (model building included);
``deterministic_time`` is CP-SAT's deterministic time (a count of work, about one second on one
core per unit). The search runs with a fixed seed: with ``deterministic_time`` alone the same input
gives the same placement on every run; a wall-clock limit can stop it at a different point.
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

# Largest scaled total load of a layer. CP-SAT computes in int64 but multiplies coefficients in places
# (linearisation, cuts): measured on a 24-expert instance, totals of 2**37 gave false INFEASIBLE / OPTIMAL
# answers, 2**34 and below did not; 2**31 keeps a wide margin.
_SCALED_TOTAL = 2**31
OPTIMALITY_TOLERANCE = 1e-6  # relative, only when the loads had to be rounded


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
    Attributes:
        table: ``[E, R]`` int64 per-replica loads ``P[e, r - 1]``; ``scale``: ``P / scale`` is in count
        units; ``exact``: whether ``P`` is exact (else rounded down).
    """

    def __init__(self, w: np.ndarray, deployment: Deployment, levers: Levers, closed_form_bound: float):
        topology = deployment.topology
        self.w, self.deployment, self.levers = w, deployment, levers
        num_experts, slots = len(w), topology.slots_per_gpu
        self.max_count = max_count = topology.num_slots - num_experts + 1
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
        thread.join(0.05)


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


SPREAD_SHARE = 0.25
"""The second stage (spreading replicas among plans of the first stage's max load) may take this
share of the layer's ``time_limit`` and ``deterministic_time`` on top of the first."""


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


def solve_layer(w: np.ndarray, deployment: Deployment, warm: np.ndarray, closed_form_bound: float, *,
                time_limit: float | None, workers: int, levers: Levers = Levers(),
                deterministic_time: float | None = None) -> tuple[LayerResult, bool]:
    """Solve one layer in two stages: the lowest max load, then, keeping it, the fewest replicas
    of an expert sharing a GPU (a GPU holding two replicas of an expert serves both halves, where
    spreading them splits the expert's tokens over two GPUs; the other methods never double
    replicas where they can spread them). Returns ``(result, interrupted)``.

    Args:
        w: ``[E]`` loads; warm: ``[S]`` the warm-start plan (also the fallback).
        closed_form_bound: ``lower_bound`` of the layer.
        time_limit: wall-clock seconds for the first stage, model building included (``None``: none);
            the second takes at most :data:`SPREAD_SHARE` of it more.
        deterministic_time: CP-SAT deterministic time for the first stage (``None``: none); the
            second, at most :data:`SPREAD_SHARE` of it.
    """
    start = time.perf_counter()
    if not w.any():  # a dense layer: every plan is optimal
        return LayerResult(warm.copy(), True, 0.0, 0.0, "TRIVIAL", 0.0), False
    layer_model = LayerModel(w, deployment, levers, closed_form_bound)
    if levers.warm_start:
        layer_model.add_hint(warm)
    wall = None if time_limit is None else max(1e-3, time_limit - (time.perf_counter() - start))
    solver = solver_parameters(deterministic_time, workers, wall_seconds=wall)
    _configure_search(solver, levers)
    status, row, ran, interrupted = _search(layer_model, solver)
    bound = 0.0
    if ran and status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
        bound = solver.best_objective_bound / layer_model.scale
    bound = max(bound, 0.0)
    if row is None or slot_order_peaks(w[None], row[None], deployment.topology)[0] > slot_order_peaks(w[None], warm[None], deployment.topology)[0]:
        row = warm.copy()  # never worse than the warm start (matters only for rounded loads)
    peak = slot_order_peaks(w[None], row[None], deployment.topology)[0]
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
    info = {"exact_arithmetic": layer_model.exact, "doubled_before_spreading": doubled}
    if doubled and not interrupted and consistent:
        row, interrupted = _spread(layer_model, row, doubled, w, deployment, peak, time_limit, deterministic_time,
                                   workers)
    info["doubled"] = _doubled(row, deployment.topology)
    elapsed = time.perf_counter() - start
    return LayerResult(row, bool(optimal), float(min(bound, peak)), elapsed, name, peak, info), interrupted


def _spread(layer_model: LayerModel, row: np.ndarray, doubled: int, w: np.ndarray, deployment: Deployment, peak: float,
            time_limit: float | None, deterministic_time: float | None, workers: int) -> tuple[np.ndarray, bool]:
    """The second stage of :func:`solve_layer` from the first stage's plan ``row [S]`` (max load
    ``peak``, ``doubled`` slots doubling a replica): a plan as light with fewer doubled replicas,
    else ``row``; and whether Ctrl-C came."""
    layer_model.spread_replicas(row)
    solver = solver_parameters(None if deterministic_time is None else SPREAD_SHARE * deterministic_time, workers,
                               wall_seconds=None if time_limit is None else max(1e-3, SPREAD_SHARE * time_limit))
    _, spread, _, interrupted = _search(layer_model, solver)
    if spread is None or slot_order_peaks(w[None], spread[None], deployment.topology)[0] > peak \
            or _doubled(spread, deployment.topology) >= doubled:
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
        ``phy2log [L, S]`` int64 and the diagnostics: ``optimal`` ``[L]`` bool, ``proven_bound`` ``[L]``
        float64 (count units), ``solve_time_s`` ``[L]``, ``status`` (``[L]`` names: OPTIMAL, FEASIBLE,
        UNKNOWN, TRIVIAL, INTERRUPTED, SKIPPED), ``interrupted``, ``exact_arithmetic`` ``[L]``.
        After a Ctrl-C, the interrupted layer keeps its best plan so far and later layers are
        ``SKIPPED`` (the warm-start plan, bound = the closed-form lower bound).
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
    phy2log = warm.copy()
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
            bar.update(1)
            bar.set_postfix(optimal=f"{int(optimal[:layer + 1].sum())}/{layer + 1}")
            if interrupted:
                break
    finally:
        bar.close()
    proven = np.ldexp(proven, -shift)
    info = {"optimal": optimal, "proven_bound": proven, "solve_time_s": times, "status": status,
            "interrupted": interrupted, "exact_arithmetic": exact}
    return phy2log, info
