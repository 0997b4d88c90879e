"""The exact solver: one CP-SAT model per layer (:mod:`eplb.planning.methods.exact_formulation`, the
formulation, the spread rule and the symmetry breaking), searched with proven bounds (ARCHITECTURE.md
sections 1, 3): the solver's settings, each layer's budget, the search in a thread that Ctrl-C can
stop, the spreading second stage, and :func:`solve` over the layers.

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
from ..spread import spread_row
from .exact_formulation import LayerModel, Levers, OutOfTime


OPTIMALITY_TOLERANCE = 1e-6  # relative, only when the loads had to be rounded


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
