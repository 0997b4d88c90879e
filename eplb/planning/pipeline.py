""":func:`eplb.plan` as a pipeline of stages.

Every stage has one signature, ``stage(windows, deployment, planned) -> planned``: the counts the
plan is made from (:class:`Windows`), the :class:`~eplb.model.deployment.Deployment`, and the plan
so far (:class:`Planned`, ``None`` before the first stage). :func:`build` chooses the stages of a
call once, in this order, and that order is what decides what combines with what:

1. **start**, exactly one, the first that applies:

   - :class:`Near` (``previous=``): close to the placement in service
     (:mod:`eplb.planning.migration`);
   - :class:`Capped` (``max_off_node=``): hierarchical, with at most that share of each layer's
     tokens off their home node (:mod:`eplb.planning.locality`);
   - :class:`Estimated` (a series with an estimator objective: ``"sum"`` given, ``"quantile"``,
     ``"max_share"``, ``"expected_peak"``, ``"worst_window"``): from estimates of the windows
     (:func:`eplb.planning.objectives.plan_estimated`);
   - :class:`FromScratch`: the method on the windows' (weighted) sum.

2. **hedge** (:class:`Hedge`), for a series under the search objective
   (``"expected_peak_search"``, the default for an even split): the start searched for a lower mean
   window peak, kept per layer where cross-validation says it pays. Each fold's start is the start
   stage run again without the fold (:meth:`FromScratch.refit`), so start and search are judged
   alike. Near the placement in service, each changed slot is charged ``copy_cost`` and a move
   budget (``max_moves``) is the start's to keep (no hedge).

3. **survive** (:class:`Survive`, ``survive="gpu" | "node"``): the plan so far with its replicas
   spread over failure domains, so that one lost GPU (node) orphans as few tokens as possible
   (:mod:`eplb.planning.survivability`: every expert on two domains when the slots allow it, else
   the heaviest while balance stays within its tolerance; from scratch, each layer's GPUs
   renumbered to even out the exposure). It follows the start and the hedge (series, estimates,
   the placement in service: there GPUs keep their numbers and each slot changed is counted in
   ``slots_changed``), and precedes the rule's stage, which moves only single replicas or a
   replica alone on its node within that node, so the spread stays. Not with ``max_off_node=``
   (its shares and home nodes are planned for the replicas it placed), not with ``max_moves=`` (the
   spread is not held to a move budget), and ``"node"`` not on a hierarchical deployment (every
   group on one node is the opposite rule).

4. **for the deployment's rule**: :class:`ForOptimalDispatch` after an :class:`Estimated` start
   (the plan made for the split of each batch), :class:`ForEngineRule` for an engine's fixed
   shares (SGLang: the even-split plan of stages 1-3, made for the rule's shares). Engine rules
   plan from scratch: not with ``previous=`` or ``max_off_node=``.

:func:`run` runs the stages and builds the :class:`~eplb.Placement`; :func:`plan_arrays` returns
the placement alone (the published entry point's arrays). The Balancer plans through the same
:func:`build` and :func:`run`.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..analysis.bounds import pair_weights, strongest_bound, two_slots
from ..analysis.exposure import worst_loss
from ..analysis.loads import peak_loads
from ..analysis.placement import Placement
from ..analysis.windows import check_window_weights
from ..model._validation import as_fraction, validated_counts
from ..model.counts import power_of_two_scale, summed_2d
from ..model.defaults import PLAN_TOLERANCE
from ..model.change import DeploymentChange
from ..model.deployment import Deployment
from ..engines import dispatch_rule, rule_shares
from .engine_planning import plan_for_rule
from .locality import any_split_bound, capped_lower_bound, home_nodes, plan_locality
from .methods import get_method
from .migration import Carried, as_previous, check_trade_off, groups_spread, plan_near
from .replan import aligned, carried_across, change_info
from .survivability import check_survive, survivable
from .objectives import (DEFAULT_OBJECTIVE, SEARCHES, combine, hedge_info, hedge_windows, made_for_dispatch,
                         plan_estimated)

__all__ = ["Capped", "Estimated", "ForEngineRule", "ForOptimalDispatch", "FromScratch", "Hedge", "Near", "Planned",
           "Survive", "Windows", "build", "hedge_near", "plan_arrays", "run", "windows_of"]

OPTIMAL_ITERATIONS = 300  # swaps tried per layer when a plan is made for optimal dispatch


@dataclass(frozen=True)
class Windows:
    """The counts a plan is made from.

    Attributes:
        series: ``[T, L, E]`` float64, validated (``T = 1`` for ``[L, E]`` input).
        weights: ``[L, E]`` float64, what one plan is made for: the windows' (weighted) sum, or
            the Balancer's forecast of them.
        window_weights: ``[T]`` float64 relative weights (the largest 1), or ``None`` (equal).
        is_series: the windows are planned as windows (hedged, estimated, made for a rule), not
            as their sum alone.
    """

    series: np.ndarray
    weights: np.ndarray
    window_weights: np.ndarray | None = None
    is_series: bool = False


@dataclass
class Planned:
    """The plan so far: ``phy2log [L, S]`` int64 and ``info`` diagnostics; a capped plan's
    ``shares [L, S]`` and ``home [L, K]``; and, once made for an engine's rule, ``peaks`` (``() ->
    [L]`` its max GPU loads under the rule) (else ``None``)."""

    phy2log: np.ndarray
    info: dict
    shares: np.ndarray | None = None
    home: np.ndarray | None = None
    peaks: Callable[[], np.ndarray] | None = None


def windows_of(counts, dispatch: str = "uniform", objective: str | None = None, window_weights=None,
               weights: np.ndarray | None = None) -> tuple[Windows, str]:
    """``counts`` (``[E]``, ``[L, E]`` or ``[T, L, E]``, checked by the public entry) as
    :class:`Windows`, and the objective resolved: a series (several windows, an objective or window
    weights given, or optimal dispatch) is planned as windows under ``objective`` or the default
    for the rule's kind; one window is planned on its counts (``"sum"``). ``weights``: ``[L, E]`` to
    plan for instead of the windows' sum (the Balancer's forecast)."""
    series = validated_counts(counts, "counts", ndims=(1, 2, 3))
    summed = summed_2d(series, "counts")
    series = series.reshape((-1,) + summed.shape)
    kind = dispatch_rule(dispatch).kind
    is_series = (series.shape[0] > 1 or objective is not None or window_weights is not None
                 or kind not in ("uniform", "engine"))
    objective = objective or (DEFAULT_OBJECTIVE["optimal" if kind == "optimal" else "uniform"]
                              if is_series else "sum")
    if window_weights is not None:  # relative: the largest is 1, so huge or denormal weights plan alike
        window_weights = check_window_weights(window_weights, series.shape[0])
        window_weights = window_weights / window_weights.max()
    if weights is not None:
        weights = validated_counts(weights, "weights")
        if weights.shape != summed.shape:
            raise ValueError(f"weights must have the windows' shape [L, E] = {list(summed.shape)}, got {weights.shape}")
    elif is_series:
        weights = combine(series, "sum", window_weights)
    else:
        weights = summed
    return Windows(series, weights, window_weights, is_series), objective


# -- stage 1: the start ----------------------------------------------------------------------------
@dataclass(frozen=True)
class FromScratch:
    """The method on the windows' weights."""

    method: str
    options: dict = field(default_factory=dict)
    name = "method"

    def __call__(self, windows: Windows, deployment: Deployment, planned=None) -> Planned:
        return Planned(*get_method(self.method)(windows.weights, deployment, **self.options))

    def refit(self, deployment: Deployment, summed: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """The same start for ``summed [C, E]``, the counts of ``layers [C]`` without a fold."""
        return get_method(self.method)(summed, deployment, **self.options)[0]


@dataclass(frozen=True)
class Estimated:
    """Per layer, the plan of an estimate of the windows (``objective``), scored under the
    deployment's rule (optimal dispatch, or an even split)."""

    method: str
    objective: str
    options: dict = field(default_factory=dict)
    name = "estimate"

    def __call__(self, windows: Windows, deployment: Deployment, planned=None) -> Planned:
        scoring = "optimal" if dispatch_rule(deployment.dispatch).kind == "optimal" else "uniform"
        return Planned(*plan_estimated(windows.series, deployment, get_method(self.method), self.objective,
                                       windows.window_weights, dispatch=scoring, options=self.options))


@dataclass(frozen=True)
class Capped:
    """Hierarchical with at most ``max_off_node`` of each layer's tokens off their home node."""

    max_off_node: float
    method: str
    options: dict = field(default_factory=dict)
    name = "capped"

    def __call__(self, windows: Windows, deployment: Deployment, planned=None) -> Planned:
        phy2log, shares, home, info = plan_locality(windows.weights, deployment, self.max_off_node, self.method,
                                                    **self.options)
        return Planned(phy2log, info, None if self.max_off_node == 0 else shares, home)  # 0: an even split

    def refit(self, deployment: Deployment, summed: np.ndarray, layers: np.ndarray):
        """``(phy2log, shares)`` of the same start for ``summed [C, E]`` (the cap holds in each fold)."""
        return plan_locality(summed, deployment, self.max_off_node, self.method, **self.options)[:2]


@dataclass(frozen=True)
class Near:
    """Close to ``previous [L, S]``, the placement in service: within ``tolerance`` of planning from
    scratch, at most ``max_moves`` changed slots per layer. Across a deployment change
    (:mod:`eplb.planning.replan`), ``previous`` is the carried placement repaired, ``carried``
    the carried one with its holes, what changed slots are counted against, and ``in_service``
    the placement in service on the old deployment."""

    previous: np.ndarray
    method: str
    tolerance: float | None = PLAN_TOLERANCE
    max_moves: int | None = None
    threads: int = 1
    options: dict = field(default_factory=dict)
    carried: Carried | None = None
    change: DeploymentChange | None = None
    in_service: np.ndarray | None = None
    name = "near"

    def __call__(self, windows: Windows, deployment: Deployment, planned=None) -> Planned:
        return Planned(*plan_near(windows.weights, deployment, self.previous, method=self.method,
                                  tolerance=self.tolerance, max_moves=self.max_moves, options=self.options,
                                  threads=self.threads, carried=self.carried))

    def refit(self, deployment: Deployment, summed: np.ndarray, layers: np.ndarray) -> np.ndarray:
        carried = None if self.carried is None else self.carried.rows(layers)
        return plan_near(summed, deployment, self.previous[layers], method=self.method, tolerance=self.tolerance,
                         options=self.options, carried=carried)[0]


# -- stage 2: the hedge ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Hedge:
    """The start searched for a lower mean window peak over the series, kept per layer where
    cross-validation (each fold's start made by ``start.refit``) says it serves unseen windows
    better; near the placement in service, ``copy_cost`` per changed slot (:func:`hedge_near`)."""

    start: FromScratch | Capped | Near
    objective: str
    copy_cost: float = 0.0
    name = "hedge"

    def __call__(self, windows: Windows, deployment: Deployment, planned: Planned) -> Planned:
        refit = lambda summed, layers: self.start.refit(deployment, summed, layers)  # noqa: E731
        if isinstance(self.start, Near):
            phy2log, hedged = hedge_near(windows.series, windows.window_weights, deployment, self.start.previous,
                                         planned.phy2log, self.copy_cost, refit)
            return replace(planned, phy2log=phy2log, info={**planned.info, **hedged, "objective": self.objective})
        result = hedge_windows(windows.series, planned.phy2log, deployment, windows.window_weights,
                               shares=planned.shares, start_of=refit)
        return replace(planned, phy2log=result.phy2log, shares=None if planned.shares is None else result.shares,
                       info={**planned.info, **hedge_info(result, self.objective)})


def hedge_near(windows: np.ndarray, window_weights, deployment: Deployment, previous: np.ndarray, near: np.ndarray,
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
    candidates = [hedge_windows(windows, start, deployment, window_weights, previous=previous, copy_cost=copy_cost,
                                start_of=start_of) for start, start_of in ((previous, None), (near, near_of))]
    changed = np.stack([(c.phy2log != previous).sum(axis=1) for c in candidates])  # [2, L]
    cost = np.stack([c.after for c in candidates]) + copy_cost * changed
    # a layer whose placement in service spreads a group over nodes cannot be kept (hierarchical)
    cost[0, groups_spread(previous, deployment, windows.shape[2])] = np.inf
    pick = np.argmin(cost, axis=0)
    layers = np.arange(previous.shape[0])
    phy2log = np.ascontiguousarray(np.stack([c.phy2log for c in candidates])[pick, layers])
    before = np.stack([c.before for c in candidates])[pick, layers]
    after = np.stack([c.after for c in candidates])[pick, layers]
    return phy2log, {"slots_changed": changed[pick, layers].astype(np.int64), "uniform_objective_before": before,
                     "uniform_objective_after": after, "searched": any(c.searched for c in candidates),
                     "hedged_from_previous": pick == 0,
                     "hedge_steps": np.stack([c.steps for c in candidates])[pick, layers]}


# -- stage 3: survive a lost GPU or node -------------------------------------------------------------
@dataclass(frozen=True)
class Survive:
    """Replicas spread over the failure domains of ``domain`` (``"gpu"`` or ``"node"``,
    :func:`eplb.planning.survivability.survivable`); near the placement in service (``previous [L,
    S]`` given) the GPUs keep their numbers and ``info["slots_changed"]`` counts against it.

    After a :class:`Hedge` from scratch (``hedge``), the spread plan is searched over the windows
    as the hedge searches (cross-validated, each fold's start the hedge's start refitted and
    spread), with its replica counts kept, then spread again without a descent on the summed
    counts below its own peak: the spread's descent alone would fit the windows' sum and undo the
    hedge (``info["survive_hedge_steps"] [L]``: the search's steps each layer kept)."""

    domain: str
    previous: np.ndarray | None = None
    hedge: Hedge | None = None
    name = "survive"

    def __call__(self, windows: Windows, deployment: Deployment, planned: Planned) -> Planned:
        hedge_of, steps = None, {}
        if self.hedge is not None and self.previous is None and windows.is_series:
            start = self.hedge.start

            def hedge_of(rows, spread_of):
                refit = lambda summed, layers: spread_of(summed, start.refit(deployment, summed, layers))  # noqa: E731
                result = hedge_windows(windows.series, rows, deployment, windows.window_weights, start_of=refit,
                                       replica_moves=False)
                steps["survive_hedge_steps"] = result.steps
                return result.phy2log

        phy2log, info = survivable(windows.weights, planned.phy2log, deployment, self.domain,
                                   renumber=self.previous is None, hedge_of=hedge_of)
        if self.previous is not None:
            info["slots_changed"] = (phy2log != self.previous).sum(axis=1)
        return replace(planned, phy2log=phy2log, info={**planned.info, **info, **steps})


# -- stage 4: for the deployment's rule --------------------------------------------------------------
@dataclass(frozen=True)
class ForOptimalDispatch:
    """Swaps of single-replica experts that lower the mean optimal-dispatch peak over the windows
    (:func:`eplb.planning.objectives.made_for_dispatch`)."""

    iterations: int = OPTIMAL_ITERATIONS
    name = "for optimal dispatch"

    def __call__(self, windows: Windows, deployment: Deployment, planned: Planned) -> Planned:
        phy2log, (before, after) = made_for_dispatch(windows.series, planned.phy2log, deployment,
                                                     windows.window_weights, iterations=self.iterations,
                                                     keep_replicas=True)
        return replace(planned, phy2log=phy2log, info={**planned.info, "dispatch_objective_before": before,
                                                       "dispatch_objective_after": after})


@dataclass(frozen=True)
class ForEngineRule:
    """The even-split plan made for an engine's fixed shares (:func:`eplb.planning.engine_planning.plan_for_rule`):
    its max loads are then under the rule."""

    rule: str
    name = "for the engine's rule"

    def __call__(self, windows: Windows, deployment: Deployment, planned: Planned) -> Planned:
        start = time.perf_counter()
        phy2log, info = plan_for_rule(windows.series, planned.phy2log, deployment, self.rule, windows.window_weights)
        weights = check_window_weights(windows.window_weights, windows.series.shape[0])
        summed = np.tensordot(weights, windows.series, axes=1)  # [L, E]
        topology, rule = deployment.topology, self.rule

        def peaks():  # [L] max GPU load on the summed counts under the rule
            shares = rule_shares(phy2log, deployment.num_experts, topology, rule)
            served = summed[np.arange(summed.shape[0])[:, None], phy2log] * shares
            return served.reshape(served.shape[0], topology.num_gpus, -1).sum(axis=-1).max(axis=-1)

        info = {**planned.info, **info, "engine_planning_time_s": time.perf_counter() - start}
        return replace(planned, phy2log=phy2log, info=info, peaks=peaks)


# -- building and running ----------------------------------------------------------------------------
KEYWORDS = {"previous": "previous=", "max_off_node": "max_off_node=", "dispatch": "dispatch=", "objective": "objective=",
            "num_groups": "num_groups", "num_nodes": "num_nodes", "survive": "survive=", "max_moves": "max_moves="}
# a name ending in "=" is followed by the value (dispatch='sglang-static'); a flag by a space
"""How :func:`combination_error` names the options (the CLI passes its flags instead)."""


def combination_error(dispatch: str, *, objective: str | None, previous: bool, max_off_node: bool,
                      hierarchical: bool, is_series: bool | None, names: dict = KEYWORDS, survive: str | None = None,
                      max_moves: bool = False) -> str | None:
    """Which options of one plan combine, stated once: ``None`` when they do, else why not.

    ``dispatch``: the rule's name; ``objective``: how a series combines (``None``: the default);
    ``previous`` / ``max_off_node`` / ``max_moves``: whether those are given; ``is_series``: whether
    the counts are a series (``None``: not known yet, so the rules that depend on it are not
    checked); ``survive``: the failure domain to survive (``None``: none). ``names``: what to call
    the options in the message (keyword -> name; :data:`KEYWORDS` for a name missing there)."""
    kind = dispatch_rule(dispatch).kind
    names = {**KEYWORDS, **names}
    if survive is not None:
        spelled = f"{names['survive']}{survive!r}" if names["survive"].endswith("=") else f"{names['survive']} {survive}"
        if max_off_node:
            return (f"{spelled} cannot be combined with {names['max_off_node']} (the capped plan's shares and home "
                    "nodes are made for the replicas it placed)")
        if max_moves:
            return f"{spelled} cannot be combined with {names['max_moves']} (the spread over domains has no move budget)"
        if survive == "node" and hierarchical:
            return (f"{spelled} needs replicas on two nodes, but {names['num_groups']} a multiple of "
                    f"{names['num_nodes']} keeps every group on one node: plan global (no groups) to survive a node")
    searched = bool(is_series) and objective in SEARCHES
    spell = {k: v if v.endswith("=") else v + " " for k, v in names.items()}  # before a value
    start = " or ".join(names[k] for k, given in (("previous", previous), ("max_off_node", max_off_node)) if given)
    if kind == "engine" and start:
        return f"{spell['dispatch']}{dispatch!r} plans from scratch: not with {start}"
    if max_off_node and not hierarchical:
        return (f"{names['max_off_node']} needs a hierarchical configuration: {names['num_groups']} a multiple of "
                f"{names['num_nodes']}")
    if max_off_node and previous:
        return f"{names['max_off_node']} cannot be combined with {names['previous']} (plan the capped layout from scratch)"
    if start and is_series and not ((searched and kind == "uniform") or objective == "sum"):
        allowed = " or ".join(repr(name) for name in ("sum",) + SEARCHES)
        return (f"{start} combines with {spell['objective']}{allowed} under an even split, not "
                f"{spell['objective']}{objective!r} with {spell['dispatch']}{dispatch!r}")
    if searched and kind == "optimal":
        return f"{spell['objective']}{objective!r} is for {spell['dispatch']}'uniform' (an even split among replicas)"
    return None


MAX_MOVES_WARNING = "move budget below the copy floor"
"""Opens the ``RuntimeWarning`` (and ``info["max_moves_exceeded"]``) of a re-plan across a change
whose ``max_moves`` is below the copies the change forces."""


def build(windows: Windows, deployment: Deployment, *, method: str, objective: str, previous=None,
          tolerance: float | None = PLAN_TOLERANCE, max_moves=None, max_off_node=None, copy_cost: float = 0.0,
          threads: int = 1, options: dict | None = None, change: DeploymentChange | None = None,
          survive: str | None = None) -> list:
    """The stages of one call, in order (module notes), after checking that its options combine.

    ``windows`` and ``objective`` as :func:`windows_of` gives them; ``previous``: a placement in
    service (``Placement`` or ``phy2log [L, S]``), on ``change.old`` when ``change`` (a
    :class:`~eplb.model.change.DeploymentChange` to ``deployment``) is given: then the start is the
    re-plan across the change (:mod:`eplb.planning.replan`); ``survive``: ``"gpu"``, ``"node"``
    or ``None`` (:class:`Survive`); the rest as :func:`eplb.plan`."""
    options = dict(options or {})
    kind = dispatch_rule(deployment.dispatch).kind
    searched = windows.is_series and objective in SEARCHES
    survive = check_survive(survive, deployment)
    refusal = combination_error(deployment.dispatch, objective=objective, previous=previous is not None,
                                max_off_node=max_off_node is not None, hierarchical=deployment.hierarchical,
                                is_series=windows.is_series, survive=survive, max_moves=max_moves is not None)
    if refusal:
        raise ValueError(refusal)
    if max_off_node is not None:
        max_off_node = as_fraction(max_off_node, "max_off_node")
    if previous is not None:
        previous = as_previous(previous, windows.weights.shape[1], change.old if change else deployment,
                               windows.weights.shape[0])
    if tolerance is not None or max_moves is not None:  # checked even where unused (no previous=)
        tolerance, _ = check_trade_off(tolerance, max_moves, deployment.num_slots)
    if previous is not None and change is not None:
        start_row, carried = carried_across(windows.weights, change, previous, deployment)
        start = Near(start_row, method, tolerance, max_moves, threads, options, carried=carried, change=change,
                     in_service=previous)
    elif previous is not None:
        start = Near(previous, method, tolerance, max_moves, threads, options)
    elif max_off_node is not None:
        start = Capped(max_off_node, method, options)
    elif windows.is_series and not searched:
        start = Estimated(method, objective, options)
    else:
        start = FromScratch(method, options)
    stages = [start]
    if searched and not (isinstance(start, Near) and max_moves is not None):  # a move budget is the start's to keep
        stages.append(Hedge(start, objective, copy_cost))
    if survive is not None:
        hedged = stages[-1] if isinstance(stages[-1], Hedge) and not isinstance(start, Near) else None
        stages.append(Survive(survive, start.previous if isinstance(start, Near) else None, hedged))
    if kind == "optimal" and isinstance(start, Estimated):
        stages.append(ForOptimalDispatch())
    elif kind == "engine":
        stages.append(ForEngineRule(deployment.dispatch))
    return stages


def plan_arrays(windows: Windows, deployment: Deployment, stages: list) -> Planned:
    """Run ``stages`` in order (the first with no plan so far)."""
    planned = None
    for stage in stages:
        planned = stage(windows, deployment, planned)
    return planned


def run(windows: Windows, deployment: Deployment, stages: list, method: str, notes: dict | None = None) -> Placement:
    """Run ``stages`` and build the :class:`Placement` (with ``home_node`` when hierarchical) whose
    ``max_load``, ``lower_bound`` and ``gap`` on ``windows.weights`` are computed on first access;
    ``info["stages"]`` names the stages, ``info["time_s"]`` is their time; ``info["worst_gpu_loss"]``
    and ``info["worst_node_loss"]`` the exposure (:func:`eplb.analysis.exposure.worst_loss`, on
    ``windows.weights``); ``notes`` are added to ``info`` as they are."""
    start = time.perf_counter()
    rule = stages[-1] if isinstance(stages[-1], ForEngineRule) else None
    planned = plan_arrays(windows, deployment, stages[:-1] if rule else stages)
    even_split = planned.phy2log  # what the lower bound's proven part is clipped by
    if rule:
        planned = rule(windows, deployment, planned)
    weights, phy2log, shares = windows.weights, planned.phy2log, planned.shares
    if isinstance(stages[0], Near) and stages[0].change is not None:  # what the change cost, slot order kept
        carried = stages[0].carried.slots
        phy2log = aligned(phy2log, carried, deployment)
        info = {**planned.info, **change_info(stages[0].change, stages[0].in_service, phy2log),
                "slots_changed": (phy2log != carried).sum(axis=1)}
        if stages[0].max_moves is not None and (info["copy_floor"] > stages[0].max_moves).any():
            # the change forces copies beyond the budget (issue 47 item 20): said, not silently exceeded
            over = np.flatnonzero(info["copy_floor"] > stages[0].max_moves)
            info["max_moves_exceeded"] = (
                f"{MAX_MOVES_WARNING}: max_moves={stages[0].max_moves} is below the copy floor of layers "
                f"{over[:8].tolist()}{' ...' if over.size > 8 else ''} (up to {int(info['copy_floor'].max())}): "
                "the change forces those copies")
            warnings.warn(info["max_moves_exceeded"], RuntimeWarning, stacklevel=4)
        planned = replace(planned, phy2log=phy2log, info=info)
    home = planned.home
    if deployment.hierarchical and home is None:
        home = home_nodes(even_split, deployment.num_groups, weights.shape[1], deployment.topology)
    exposure = worst_loss(weights, phy2log, deployment.topology)  # what one lost GPU / node orphans
    elapsed = time.perf_counter() - start
    if shares is not None:
        peaks = lambda: _peaks(weights, phy2log, deployment, shares)  # noqa: E731
        bound = lambda: _capped_bound(weights, deployment, stages[0].max_off_node)  # noqa: E731
    elif rule:  # the loads under the engine's rule, which may split unevenly: what holds for any split
        peaks = planned.peaks
        bound = lambda: _split_bound(weights, phy2log, deployment)  # noqa: E731
    else:  # an even split: the even split's bound
        peaks = planned.peaks or (lambda: _peaks(weights, phy2log, deployment))  # noqa: E731
        bound = lambda: _bound(weights, even_split, deployment, planned.info.get("proven_bound"))  # noqa: E731
    return Placement(
        phy2log=phy2log, num_experts=weights.shape[1], topology=deployment.topology,
        num_groups=deployment.num_groups, method=method,
        info={**planned.info, **exposure, "time_s": elapsed, "stages": tuple(stage.name for stage in stages),
              **(notes or {})},
        max_load=peaks, lower_bound=bound, shares=shares, home_node=home, dispatch=deployment.dispatch,
    )


# -- what a placement is judged by on the counts it was made for --------------------------------------
def _peaks(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment, shares: np.ndarray | None = None
           ) -> np.ndarray:
    """``[L]`` max GPU load of ``phy2log [L, S]`` on ``weights [L, E]``, split evenly or by
    ``shares [L, S]`` (computed on the counts scaled by a power of two per layer, then scaled back:
    finite, and ordered like the bound)."""
    scaled, shift = power_of_two_scale(weights)
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    return np.ldexp(peak_loads(scaled, phy2log, deployment.topology, shares=shares), -shift)


def _capped_bound(weights: np.ndarray, deployment: Deployment, max_off_node: float) -> np.ndarray:
    """``[L]`` :func:`eplb.planning.locality.capped_lower_bound` on scaled counts, scaled back."""
    scaled, shift = power_of_two_scale(weights)
    return np.ldexp(capped_lower_bound(scaled, deployment, max_off_node), -shift)


def _split_bound(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment) -> np.ndarray:
    """``[L]`` :func:`eplb.planning.locality.any_split_bound` on scaled counts, scaled back: an
    engine's rule (SGLang's) may split an expert's tokens unevenly, so a plan judged under it can
    be lighter than any even split; a layer keeping every group on its node serves nothing off it."""
    scaled, shift = power_of_two_scale(weights)
    away = groups_spread(phy2log, deployment, weights.shape[1]).astype(np.float64) if deployment.hierarchical else 1.0
    return np.ldexp(any_split_bound(scaled, deployment, away), -shift)


def _bound(weights: np.ndarray, phy2log: np.ndarray, deployment: Deployment, proven) -> np.ndarray:
    """``[L]`` the package's lower bound (computed on scaled counts like :func:`_peaks`), with two
    slots on every GPU tightened by the weighting bound aimed at the plan's max load
    (:func:`eplb.analysis.bounds.pair_weights`) and by the bound a method proved (``proven [L]``,
    e.g. the exact solver's), never above the plan's own max load."""
    scaled, shift = power_of_two_scale(weights)
    bound = np.ldexp(strongest_bound(scaled, deployment), -shift)
    if proven is None and not two_slots(deployment.topology):
        return bound
    peak = _peaks(weights, phy2log, deployment)
    # two replicas a GPU: the weighting bound needs a plan's max load to aim at
    bound = np.maximum(bound, np.ldexp(pair_weights(scaled, deployment.topology, np.ldexp(bound, shift),
                                                    np.ldexp(peak, shift)), -shift))
    if proven is not None:
        bound = np.maximum(bound, np.minimum(np.asarray(proven, dtype=np.float64), peak))
    return bound
