"""The planning modes :func:`eplb.plan` dispatches over, and the request they share.

:func:`make_request` validates everything a caller asked once, at the public entry, into a
:class:`Request` (typed arrays and resolved choices); :func:`run` picks the first mode of
:data:`MODES` that applies to it and builds the :class:`Placement`. A mode is a pair of functions
over a request: whether it applies, and how it plans (``phy2log`` with its diagnostics). Adding a
mode is one entry here; the Balancer plans through the same :func:`run`.

Modes, in the order they are tried:

- ``engine``: the plan for an engine's own dispatch rule (SGLang): the even-split plan of the same
  request, made for the rule's shares (:mod:`eplb.planning.engine_planning`);
- ``capped``: ``max_off_node``: hierarchical with a capped share of off-node tokens
  (:mod:`eplb.planning.locality`), hedged over a series by swaps inside nodes;
- ``near``: ``previous``: close to the placement in service (:mod:`eplb.planning.migration`), and
  for a series hedged from it with a cost per copied slot (:func:`hedge_near`);
- ``series``: windows ``[T, L, E]`` under a series objective (:mod:`eplb.planning.objectives`);
- ``scratch``: one window with the method.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..model.defaults import PLAN_TOLERANCE
from ..analysis.bounds import strongest_bound
from ..analysis.loads import peak_loads
from ..analysis.placement import Placement
from ..analysis.windows import check_window_weights
from ..model._validation import as_fraction, validated_counts
from ..engines import dispatch_rule
from ..model.problem import Problem, power_of_two_scale, summed_2d
from .engine_planning import plan_for_engine
from .locality import capped_lower_bound, home_nodes, plan_locality
from .methods import get_method
from .migration import as_previous, check_trade_off, groups_spread, plan_near
from .objectives import DEFAULT_OBJECTIVE, SEARCHES, combine, hedge_info, hedge_windows, plan_series

__all__ = ["MODES", "Mode", "Planned", "Request", "hedge_near", "make_request", "mode_of", "run"]


@dataclass(frozen=True)
class Request:
    """What a caller asked for, validated.

    Attributes:
        windows: ``[T, L, E]`` float64 counts, validated (``T = 1`` for ``[L, E]`` input).
        weights: ``[L, E]`` float64: what one plan is made for: the windows' (weighted) sum, or
            the Balancer's forecast of them.
        problem: the deployment (topology, groups, hierarchical).
        method: a name of :data:`eplb.METHODS`; options: its keyword options.
        dispatch: the dispatch rule's name as given (:data:`eplb.engines.DISPATCH_RULES`).
        objective: how the windows combine (resolved: never ``None``).
        series: plan the windows as windows (hedged, selected, ...), not their sum alone.
        window_weights: ``[T]`` float64 weights, the largest 1, or ``None`` (equal).
        previous: ``[L, S]`` int64 placement in service, or ``None``.
        tolerance, max_moves: the near mode's trade-off (:func:`eplb.planning.migration.plan_near`).
        max_off_node: the capped mode's fraction in ``[0, 1]``, or ``None``.
        copy_cost: the hedged near mode's cost per changed slot.
        threads: threads the near mode plans chunks of layers on.
        given_window_weights: the caller's ``window_weights`` untouched (the engine mode passes them on).
    """

    windows: np.ndarray
    weights: np.ndarray
    problem: Problem
    method: str
    dispatch: str
    objective: str
    series: bool
    window_weights: np.ndarray | None = None
    previous: np.ndarray | None = None
    tolerance: float | None = PLAN_TOLERANCE
    max_moves: int | None = None
    max_off_node: float | None = None
    copy_cost: float = 0.0
    threads: int = 1
    options: dict = field(default_factory=dict)
    given_window_weights: object = None

    @property
    def hedged(self) -> bool:
        """Whether the plan is searched for a lower mean window peak (a series, a search objective)."""
        return self.series and self.objective in SEARCHES


@dataclass
class Planned:
    """A mode's answer: ``phy2log [L, S]`` int64, ``info`` diagnostics, and for the capped mode
    ``shares [L, S]`` and ``home [L, K]`` (else ``None``)."""

    phy2log: np.ndarray
    info: dict
    shares: np.ndarray | None = None
    home: np.ndarray | None = None


def make_request(counts, problem: Problem, *, method: str, dispatch: str = "uniform", objective: str | None = None,
                 window_weights=None, previous=None, tolerance: float | None = PLAN_TOLERANCE, max_moves=None,
                 max_off_node=None, copy_cost: float = 0.0, threads: int = 1, options: dict | None = None,
                 weights: np.ndarray | None = None) -> Request:
    """Validate :func:`eplb.plan`'s other arguments once and resolve its choices: whether the windows
    are planned as a series, the objective, relative window weights, the previous placement, the
    cap and the combinations the modes refuse. ``counts``: ``[E]``, ``[L, E]`` or ``[T, L, E]``,
    already checked by :func:`eplb.model._validation.as_counts` (the public entry's one check).
    ``weights``: ``[L, E]`` float64 to plan for instead of the windows' sum (the Balancer's forecast)."""
    windows = validated_counts(counts, "counts", ndims=(1, 2, 3))
    summed = summed_2d(windows, "counts")
    windows = windows.reshape((-1,) + summed.shape)
    kind = dispatch_rule(dispatch).kind
    given_window_weights = window_weights
    # a series of windows is planned as windows (hedged) unless objective="sum"
    series = (windows.shape[0] > 1 or objective is not None or window_weights is not None
              or kind not in ("uniform", "engine"))
    objective = objective or (DEFAULT_OBJECTIVE["optimal" if kind == "optimal" else "uniform"] if series else "sum")
    if window_weights is not None:  # relative: the largest is 1, so huge or denormal weights plan alike
        window_weights = check_window_weights(window_weights, windows.shape[0])
        window_weights = window_weights / window_weights.max()
    if weights is not None:
        weights = validated_counts(weights, "weights")
        if weights.shape != summed.shape:
            raise ValueError(f"weights must have the windows' shape [L, E] = {list(summed.shape)}, got {weights.shape}")
    elif series:
        weights = combine(windows, "sum", window_weights)
    else:
        weights = summed
    if kind == "engine" and (previous is not None or max_off_node is not None):
        raise ValueError(f"dispatch={dispatch!r} plans from scratch: not with previous= or max_off_node=")
    if (previous is not None or max_off_node is not None) and series and not (
            (objective in SEARCHES and kind == "uniform") or objective == "sum"):
        allowed = " or ".join(repr(name) for name in ("sum",) + SEARCHES)
        raise ValueError(f"previous= and max_off_node= combine with objective {allowed} under an even split, "
                         f"not objective={objective!r} with dispatch={dispatch!r}")
    if max_off_node is not None:
        max_off_node = as_fraction(max_off_node, "max_off_node")
        if not problem.hierarchical:
            raise ValueError("max_off_node needs a hierarchical configuration: num_groups a multiple of num_nodes")
        if previous is not None:
            raise ValueError("max_off_node cannot be combined with previous= (plan the capped layout from scratch)")
    if previous is not None:
        previous = as_previous(previous, weights.shape[1], problem, weights.shape[0])
    if tolerance is not None or max_moves is not None:  # checked even where unused (no previous=)
        tolerance, _ = check_trade_off(tolerance, max_moves, problem.topology.num_slots)
    return Request(windows=windows, weights=weights, problem=problem, method=method, dispatch=dispatch,
                   objective=objective, series=series, window_weights=window_weights, previous=previous,
                   tolerance=tolerance, max_moves=max_moves, max_off_node=max_off_node, copy_cost=copy_cost,
                   threads=threads, options=dict(options or {}), given_window_weights=given_window_weights)


# -- the modes --------------------------------------------------------------------------------------
def _engine_applies(request: Request) -> bool:
    return dispatch_rule(request.dispatch).kind == "engine"


def _capped_applies(request: Request) -> bool:
    return request.max_off_node is not None


def _near_applies(request: Request) -> bool:
    return request.previous is not None


def _series_applies(request: Request) -> bool:
    return request.series


def _scratch_applies(request: Request) -> bool:
    return True


def _plan_capped(request: Request) -> Planned:
    """Hierarchical with at most ``max_off_node`` of each layer's tokens off their home node; for a
    series, hedged by swaps inside nodes (shares move with their slots: the cap holds)."""
    problem = request.problem
    phy2log, shares, home, info = plan_locality(request.weights, problem, request.max_off_node, request.method,
                                                **request.options)
    if request.max_off_node == 0:
        shares = None  # the hierarchical plan: an even split
    if request.hedged:  # each cross-validation fold's start is capped alike, without the fold's windows
        start_of = lambda summed, layers: plan_locality(summed, problem, request.max_off_node,  # noqa: E731
                                                        request.method, **request.options)[:2]
        result = hedge_windows(request.windows, phy2log, problem, request.window_weights, shares=shares,
                               start_of=start_of)
        phy2log, shares = result.phy2log, (None if shares is None else result.shares)
        info = {**info, **hedge_info(result, request.objective)}
    return Planned(phy2log, info, shares, home)


def _plan_near(request: Request) -> Planned:
    """Close to ``previous``; for a series without a move budget, hedged over the windows from it."""
    phy2log, info = plan_near(request.weights, request.problem, request.previous, method=request.method,
                              tolerance=request.tolerance, max_moves=request.max_moves, options=request.options,
                              threads=request.threads)
    if request.hedged and request.max_moves is None:  # a move budget is plan_near's to keep
        # each cross-validation fold's start is planned near previous alike, without the fold's windows
        near_of = lambda summed, layers: plan_near(  # noqa: E731
            summed, request.problem, request.previous[layers], method=request.method, tolerance=request.tolerance,
            options=request.options)[0]
        phy2log, hedged = hedge_near(request.windows, request.window_weights, request.problem, request.previous,
                                     phy2log, request.copy_cost, near_of)
        info = {**info, **hedged, "objective": request.objective}
    return Planned(phy2log, info)


def _plan_series(request: Request) -> Planned:
    dispatch = dispatch_rule(request.dispatch).kind
    phy2log, info = plan_series(request.windows, request.problem, get_method(request.method), request.objective,
                                request.window_weights, dispatch=dispatch, options=request.options)
    return Planned(phy2log, info)


def _plan_scratch(request: Request) -> Planned:
    phy2log, info = get_method(request.method)(request.weights, request.problem, **request.options)
    return Planned(phy2log, info)


@dataclass(frozen=True)
class Mode:
    """A planning mode: ``applies(request) -> bool`` and ``plan(request) -> Planned`` (the engine
    mode's ``plan`` is ``None``: it wraps another mode's placement, :func:`run`)."""

    applies: Callable[[Request], bool]
    plan: Callable[[Request], Planned] | None
    summary: str


MODES: dict[str, Mode] = {
    "engine": Mode(_engine_applies, None, "made for an engine's dispatch rule from the even-split plan"),
    "capped": Mode(_capped_applies, _plan_capped, "hierarchical with capped off-node tokens (max_off_node)"),
    "near": Mode(_near_applies, _plan_near, "close to the placement in service (previous)"),
    "series": Mode(_series_applies, _plan_series, "windows under a series objective"),
    "scratch": Mode(_scratch_applies, _plan_scratch, "one window, from scratch"),
}
"""Name -> :class:`Mode`, in the order :func:`mode_of` tries them."""


def mode_of(request: Request) -> str:
    """The name of the first mode of :data:`MODES` that applies to ``request``."""
    return next(name for name, mode in MODES.items() if mode.applies(request))


def run(request: Request) -> Placement:
    """Plan ``request`` with its mode; a :class:`Placement` (with ``home_node`` when hierarchical)
    whose ``max_load``, ``lower_bound`` and ``gap`` on ``request.weights`` are computed on first
    access, and ``info["mode"]`` naming the mode."""
    name = mode_of(request)
    if name == "engine":  # the plan for an even split, made for the engine's shares
        even = run(_even_split(request))
        return plan_for_engine(request.windows, even, request.problem, request.dispatch,
                               request.given_window_weights)
    start = time.perf_counter()
    planned = MODES[name].plan(request)
    problem, weights = request.problem, request.weights
    home = planned.home
    if problem.hierarchical and home is None:
        home = home_nodes(planned.phy2log, problem.num_groups, weights.shape[1], problem.topology)
    elapsed = time.perf_counter() - start
    phy2log, shares = planned.phy2log, planned.shares
    if shares is None:
        peaks = lambda: _peaks(weights, phy2log, problem)  # noqa: E731
        bound = lambda: _bound(weights, phy2log, problem, planned.info.get("proven_bound"))  # noqa: E731
    else:
        peaks = lambda: _peaks(weights, phy2log, problem, shares)  # noqa: E731
        bound = lambda: _capped_bound(weights, problem, request.max_off_node)  # noqa: E731
    return Placement(
        phy2log=phy2log, num_experts=weights.shape[1], topology=problem.topology,
        num_groups=problem.num_groups, method=request.method, info={**planned.info, "time_s": elapsed, "mode": name},
        max_load=peaks, lower_bound=bound, shares=shares, home_node=home,
    )


def _even_split(request: Request) -> Request:
    """The engine mode's base: the same request under an even split (its series and objective were
    resolved as for ``dispatch="uniform"``)."""
    return replace(request, dispatch="uniform")


def hedge_near(windows: np.ndarray, window_weights, problem: Problem, previous: np.ndarray, near: np.ndarray,
               copy_cost: float, near_of=None) -> tuple[np.ndarray, dict]:
    """Per layer, the better of two hedged searches charged ``copy_cost`` per slot changed from
    ``previous [L, S]``: one from ``previous`` itself (its replica counts, few copies) and one from
    ``near [L, S]`` (the plan near it for the summed windows, whose replica counts fit the new
    traffic); better = lower mean window ``peak / mean`` plus ``copy_cost`` per changed slot (in a
    hierarchical deployment, a layer whose placement in service spreads a group over nodes takes the
    second). ``windows``: ``[T, L, E]`` float64, validated. ``near_of(summed [C, E], layers [C])``:
    how ``near`` was made, for the search's cross-validation folds (:func:`eplb.planning.robust.hedge`'s
    ``start_of``; ``None``: each fold starts from ``near`` itself).
    Returns ``phy2log [L, S]`` and info entries (``slots_changed [L]``, ``uniform_objective_*``)."""
    candidates = [hedge_windows(windows, start, problem, window_weights, previous=previous, copy_cost=copy_cost,
                                start_of=start_of) for start, start_of in ((previous, None), (near, near_of))]
    changed = np.stack([(c.phy2log != previous).sum(axis=1) for c in candidates])  # [2, L]
    cost = np.stack([c.after for c in candidates]) + copy_cost * changed
    # a layer whose placement in service spreads a group over nodes cannot be kept (hierarchical)
    cost[0, groups_spread(previous, problem, windows.shape[2])] = np.inf
    pick = np.argmin(cost, axis=0)
    layers = np.arange(previous.shape[0])
    phy2log = np.ascontiguousarray(np.stack([c.phy2log for c in candidates])[pick, layers])
    before = np.stack([c.before for c in candidates])[pick, layers]
    after = np.stack([c.after for c in candidates])[pick, layers]
    return phy2log, {"slots_changed": changed[pick, layers].astype(np.int64), "uniform_objective_before": before,
                     "uniform_objective_after": after, "searched": any(c.searched for c in candidates),
                     "hedged_from_previous": pick == 0,
                     "hedge_steps": np.stack([c.steps for c in candidates])[pick, layers]}


# -- what a placement is judged by on the counts it was made for --------------------------------------
def _peaks(weights: np.ndarray, phy2log: np.ndarray, problem: Problem, shares: np.ndarray | None = None
           ) -> np.ndarray:
    """``[L]`` max GPU load of ``phy2log [L, S]`` on ``weights [L, E]``, split evenly or by
    ``shares [L, S]`` (computed on the counts scaled by a power of two per layer, then scaled back:
    finite, and ordered like the bound)."""
    scaled, shift = power_of_two_scale(weights)
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    return np.ldexp(peak_loads(scaled, phy2log, problem.topology, shares=shares), -shift)


def _capped_bound(weights: np.ndarray, problem: Problem, max_off_node: float) -> np.ndarray:
    """``[L]`` :func:`eplb.planning.locality.capped_lower_bound` on scaled counts, scaled back."""
    scaled, shift = power_of_two_scale(weights)
    return np.ldexp(capped_lower_bound(scaled, problem, max_off_node), -shift)


def _bound(weights: np.ndarray, phy2log: np.ndarray, problem: Problem, proven) -> np.ndarray:
    """``[L]`` the package's lower bound (computed on scaled counts like :func:`_peaks`),
    tightened by the bound a method proved (``proven [L]``, e.g. the exact solver's), never above
    the plan's own max load."""
    scaled, shift = power_of_two_scale(weights)
    bound = np.ldexp(strongest_bound(scaled, problem), -shift)
    if proven is not None:
        peak = _peaks(weights, phy2log, problem)
        bound = np.maximum(bound, np.minimum(np.asarray(proven, dtype=np.float64), peak))
    return bound
