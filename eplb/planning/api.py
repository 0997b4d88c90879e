"""The two entry points: :func:`plan` (a :class:`Placement` with diagnostics) and
:func:`rebalance_experts` (DeepSeek EPLB's signature, arrays out)."""

from __future__ import annotations

import difflib
import inspect
import time

import numpy as np

from ..model._validation import as_counts, as_fraction
from ..analysis.bounds import lower_bound
from .methods import DEFAULT_METHOD, OPTIONS as METHOD_OPTIONS, get_method
from ..kernels.shares import share_gpu_loads
from ..kernels.layout import replica_counts, slots_of_experts
from ..model.dispatch_rules import DISPATCH_RULES, dispatch_rule
from .engine_planning import plan_for_engine
from .locality import capped_lower_bound, home_nodes, plan_locality
from .locality import pareto as locality_curve
from ..analysis.metrics import gpu_loads, moe_mean
from .migration import as_previous, groups_spread, plan_near
from .objectives import (DEFAULT_OBJECTIVE, SEARCHES, combine, hedge_info, hedge_windows,
                         plan_series)
from ..analysis.placement import Placement
from .robust import DEFAULT_COPY_COST
from ..model.problem import Problem, make_problem, power_of_two_scale, weights_2d
from ..model.topology import Topology
from ..analysis.windows import check_window_weights

_weights_2d = weights_2d  # eplb.planning.certificate imports this name

__all__ = ["Problem", "held_out", "make_problem", "pareto", "plan", "rebalance_experts"]

HELD_OUT_FOLDS = 16  # leave-one-out over at most this many blocks of windows


def plan(counts, *, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None,
         method: str = DEFAULT_METHOD, topology: Topology | None = None, previous=None,
         tolerance: float | None = 0.005, max_moves=None, max_off_node: float | None = None,
         objective: str | None = None, window_weights=None, dispatch: str = "uniform",
         copy_cost: float = DEFAULT_COPY_COST, **options) -> Placement:
    """Plan a replicated expert placement for every layer.

    Args:
        counts: ``[L, E]`` tokens routed to each logical expert (``[E]`` for one layer), or a series
            ``[T, L, E]`` of ``T`` windows, planned as windows: hedged over them (``objective``
            below; ``objective="sum"`` plans on their sum). Non-negative and finite.
        num_slots: ``S``, physical expert slots in all (``S >= E``, a multiple of ``num_gpus``).
        num_gpus: ``G``, GPUs (ranks); ``num_nodes``: ``N``, nodes (``G % N == 0``).
        num_groups: expert groups; with ``num_groups % num_nodes == 0`` every group stays on one node.
        method: one of ``eplb.METHODS``.
        topology: instead of ``num_slots/num_gpus/num_nodes``, an explicit :class:`Topology`
            (uneven slots per GPU, masked GPUs).
        previous: the placement in service (a :class:`Placement` or ``phy2log [L, S]``). Then the
            plan stays close to it (see :mod:`eplb.planning.migration`): experts keep their slots where that
            costs little balance; ``info["slots_changed"]`` gives the changed slots per layer.
        tolerance: with ``previous``, accept a max GPU load up to ``(1 + tolerance)`` times the one
            of planning from scratch with ``method`` (``None``: as balanced as ``max_moves`` allows).
        max_moves: with ``previous``, at most this many slots change per layer (``None``: no limit).
            With ``method="exact"`` and ``previous``, the fewest changed slots within the tolerance
            (and budget), from a CP-SAT model (:mod:`eplb.planning.exact_migration`); ``info`` then has
            ``fewest_changes_proven [L]`` and ``fewest_changes_bound [L]``.
        max_off_node: with a hierarchical configuration, let replicas of hot experts also sit off
            their group's home node, for at most this fraction of each layer's tokens (in
            ``[0, 1]``; ``0`` is the hierarchical plan, ``1`` may use the whole cluster). The plan then
            carries ``shares`` (the split engines must apply to get its balance) and ``home_node``;
            its lower bound accounts for the cap (:mod:`eplb.planning.locality`). ``None``: off.
        objective: how the windows of a series ``[T, L, E]`` combine (:mod:`eplb.planning.objectives`):
            ``"sum"`` (summed counts), ``"quantile"`` (each expert's 0.9 quantile of its share),
            ``"max_share"`` (its largest share), ``"expected_peak"`` / ``"worst_window"`` (per
            layer, the plan among those estimators with the best mean / worst window peak on the
            windows), ``"expected_peak_search"`` (even split only: the summed counts' plan searched
            for a lower mean window peak, kept where cross-validation says it pays; tens of
            milliseconds at DeepSeek-V3 size). ``None``: for a series (or with ``window_weights``
            or ``dispatch="optimal"``), the default for ``dispatch``
            (:data:`eplb.planning.objectives.DEFAULT_OBJECTIVE`, chosen by what served held-out windows best
            in ``bench/out_of_sample.py`` and ``bench/robust_default.py``); for ``[L, E]``, ``"sum"``.
            With ``previous`` or ``max_off_node`` only ``"sum"`` and ``"expected_peak_search"``.
        window_weights: ``[T]`` non-negative weights of the windows (e.g.
            :func:`eplb.planning.objectives.recency_weights`); ``None``: equal. Relative: divided by the
            largest, so ``max_load`` and ``lower_bound`` are on the weighted sum with the largest
            weight 1.
        dispatch: how the engine splits an expert's tokens among its replicas, one of
            :data:`eplb.model.dispatch_rules.DISPATCH_RULES`: ``"uniform"`` (as engines do by default;
            also ``"vllm"``, ``"tensorrt-llm"``: the same plan), ``"optimal"`` (per batch,
            :func:`eplb.dispatch`; the plan is made for it,
            :func:`eplb.planning.objectives.made_for_dispatch`: a few seconds for DeepSeek-V3 size and a
            dozen windows), or SGLang's ``"sglang-static"`` / ``"sglang-dynamic"``: the plan for an
            even split (hedged for a series), then made for that rule's shares
            (:mod:`eplb.planning.engine_planning`; never worse under the rule on ``counts``; the same
            slots on every GPU). ``"optimal"`` and the SGLang rules plan from scratch (not with
            ``previous`` or ``max_off_node``). ``[L, E]`` counts are one window.
        copy_cost: with ``previous`` and a hedged series plan, what one slot changed from
            ``previous`` costs, in mean ``peak / mean`` over the windows: a swap is kept only if it
            pays for its copies (:func:`eplb.planning.robust.hedge`).
        **options: passed to the method.
    Returns:
        A :class:`Placement` (with ``home_node`` when hierarchical); its ``max_load``, ``lower_bound`` and ``gap`` on ``counts`` are
        computed on first access (a call that never reads them never computes the bound).
    """
    _check_option_names(method, options)
    windows = as_counts(counts, "counts", ndims=(1, 2, 3))
    weights = weights_2d(windows, "counts")
    windows = windows.reshape((-1,) + weights.shape)
    problem = make_problem(weights.shape[1], num_slots, num_gpus, num_nodes, num_groups, topology)
    rule = dispatch_rule(dispatch)
    if rule.kind == "engine":  # the plan for an even split, made for the engine's shares
        if previous is not None or max_off_node is not None:
            raise ValueError(f"dispatch={dispatch!r} plans from scratch: not with previous= or max_off_node=")
        even = plan(counts, method=method, topology=problem.topology, num_groups=problem.num_groups,
                    objective=objective, window_weights=window_weights, dispatch="uniform", **options)
        return plan_for_engine(counts, even, problem, dispatch, window_weights)
    dispatch = rule.kind
    # a series of windows is planned as windows (hedged) unless objective="sum"
    series = windows.shape[0] > 1 or objective is not None or window_weights is not None or dispatch != "uniform"
    objective = objective or (DEFAULT_OBJECTIVE[dispatch] if series else "sum")
    if window_weights is not None:  # relative: the largest is 1, so huge or denormal weights plan alike
        window_weights = check_window_weights(window_weights, windows.shape[0])
        window_weights = window_weights / window_weights.max()
    if series:
        weights = combine(windows, "sum", window_weights)
    hedged = series and objective in SEARCHES
    if (previous is not None or max_off_node is not None) and series and not (hedged or objective == "sum"):
        allowed = " or ".join(repr(name) for name in ("sum",) + SEARCHES)
        raise ValueError(f"previous= and max_off_node= combine with objective {allowed} under an even split, "
                         f"not objective={objective!r} with dispatch={dispatch!r}")
    start = time.perf_counter()
    shares = home = None
    if max_off_node is not None:
        max_off_node = as_fraction(max_off_node, "max_off_node")
        if not problem.hierarchical:
            raise ValueError("max_off_node needs a hierarchical configuration: num_groups a multiple of num_nodes")
        if previous is not None:
            raise ValueError("max_off_node cannot be combined with previous= (plan the capped layout from scratch)")
        phy2log, shares, home, info = plan_locality(weights, problem, max_off_node, method, **options)
        if max_off_node == 0:
            shares = None  # the hierarchical plan: an even split
        if hedged:  # swaps inside nodes: shares and off-node traffic unchanged
            result = hedge_windows(windows, phy2log, problem, window_weights, shares=shares)
            phy2log, shares = result.phy2log, (None if shares is None else result.shares)
            info = {**info, **hedge_info(result, objective)}
    elif previous is not None:
        old = as_previous(previous, weights.shape[1], problem, weights.shape[0])
        phy2log, info = plan_near(weights, problem, old, method=method, tolerance=tolerance, max_moves=max_moves,
                                  options=options)
        if hedged:
            phy2log, hedge_entries = hedge_near(windows, window_weights, problem, old, phy2log, copy_cost)
            info = {**info, **hedge_entries, "objective": objective}
    elif series:
        phy2log, info = plan_series(windows, problem, get_method(method), objective, window_weights,
                                    dispatch=dispatch, options=options)
    else:
        phy2log, info = get_method(method)(weights, problem, **options)
    if problem.hierarchical and home is None:
        home = home_nodes(phy2log, problem.num_groups, weights.shape[1], problem.topology)
    elapsed = time.perf_counter() - start
    if shares is None:
        peaks = lambda: _peaks(weights, phy2log, problem)  # noqa: E731
        bound = lambda: _bound(weights, phy2log, problem, info.get("proven_bound"))  # noqa: E731
    else:
        peaks = lambda: _peaks(weights, phy2log, problem, shares)  # noqa: E731
        bound = lambda: _capped_bound(weights, problem, max_off_node)  # noqa: E731
    return Placement(
        phy2log=phy2log, num_experts=weights.shape[1], topology=problem.topology,
        num_groups=problem.num_groups, method=method, info={**info, "time_s": elapsed},
        max_load=peaks, lower_bound=bound, shares=shares, home_node=home,
    )


def held_out(counts, *, folds: int = HELD_OUT_FOLDS, judge: str | None = None, **plan_options) -> np.ndarray:
    """Held-out estimate of the plan :func:`plan` makes from a series: leave one window out.

    Window ``t`` (or, for a long series, block ``k`` of ``folds`` contiguous blocks) is served by
    the plan made with ``plan_options`` from all the other windows, given as a series; its score
    is the mean over MoE layers of its balancedness (mean / max GPU load).

    Args:
        counts: ``[T, L, E]`` with ``T >= 2`` windows.
        folds: ``>= 2``, at most this many held-out blocks (``min(T, folds)`` plans are made).
        judge: how the held-out window is split among replicas: a rule of
            :data:`eplb.model.dispatch_rules.DISPATCH_RULES` (``"uniform"``, ``"optimal"``,
            ``"sglang-static"``, ...) or ``"shares"`` (a plan's own shares); ``None``: the plan's own
            (its ``dispatch`` when that is optimal or an engine's rule, else ``"shares"``, which is
            the even split when a plan has none).
        **plan_options: passed to :func:`plan` (deployment, method, objective, ...).
    Returns:
        ``[F]`` float64: each held-out block's mean over its windows of the MoE-layer balancedness.
    """
    windows = as_counts(counts, "counts", ndims=(3,))
    if windows.shape[0] < 2:
        raise ValueError(f"counts must hold at least 2 windows [T, L, E] to hold one out, got shape {windows.shape}")
    if not (isinstance(folds, (int, np.integer)) and not isinstance(folds, bool) and folds >= 2):
        raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
    if judge is None:
        rule = plan_options.get("dispatch", "uniform")
        judge = rule if dispatch_rule(rule).kind in ("optimal", "engine") else "shares"
    if judge != "shares":
        dispatch_rule(judge, "judge", accepted=tuple(DISPATCH_RULES) + ("shares",))
    if plan_options.get("window_weights") is not None:
        raise ValueError("held_out leaves windows out: give window_weights=None")
    edges = np.linspace(0, windows.shape[0], min(int(folds), windows.shape[0]) + 1).round().astype(np.int64)
    scores = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        kept = np.concatenate([windows[:lo], windows[hi:]])
        placement = plan(kept, **plan_options)
        per_window = placement.balancedness(windows[lo:hi], judge)  # [w, L]
        scores.append(float(np.nanmean(moe_mean(per_window, windows[lo:hi]))))
    return np.asarray(scores)


def hedge_near(windows: np.ndarray, window_weights, problem: Problem, previous: np.ndarray, near: np.ndarray,
                copy_cost: float) -> tuple[np.ndarray, dict]:
    """Per layer, the better of two hedged searches charged ``copy_cost`` per slot changed from
    ``previous [L, S]``: one from ``previous`` itself (its replica counts, few copies) and one from
    ``near [L, S]`` (the plan near it for the summed windows, whose replica counts fit the new
    traffic); better = lower mean window ``peak / mean`` plus ``copy_cost`` per changed slot (in a
    hierarchical deployment, a layer whose placement in service spreads a group over nodes takes the
    second).
    Returns ``phy2log [L, S]`` and info entries (``slots_changed [L]``, ``uniform_objective_*``)."""
    candidates = [hedge_windows(windows, start, problem, window_weights, previous=previous, copy_cost=copy_cost)
                  for start in (previous, near)]
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
                     "hedged_from_previous": pick == 0}


def _check_option_names(method, options: dict) -> None:
    """A keyword :func:`plan` does not take and ``method`` does not either (a typo such as
    ``tolerence``) raises ``ValueError`` naming it, the closest accepted names, and both lists."""
    if not isinstance(method, str) or method not in METHOD_OPTIONS:
        return  # get_method names the accepted methods
    accepted = set(METHOD_OPTIONS[method])
    unknown = sorted(set(options) - accepted)
    if not unknown:
        return
    own = sorted(name for name in inspect.signature(plan).parameters if name not in ("counts", "options"))
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, own + sorted(accepted), n=1)
        if close:
            hints.append(f"{close[0]} for {name}")
    raise ValueError(f"method {method!r} got unknown option(s) {', '.join(unknown)}; accepted options: "
                     f"{', '.join(sorted(accepted)) or 'none'}" + (f"; did you mean {', '.join(hints)}?" if hints else "")
                     + f" (plan's own arguments: {', '.join(own)})")


def _peaks(weights: np.ndarray, phy2log: np.ndarray, problem: Problem, shares: np.ndarray | None = None
           ) -> np.ndarray:
    """``[L]`` max GPU load of ``phy2log [L, S]`` on ``weights [L, E]``, split evenly or by
    ``shares [L, S]`` (computed on the counts scaled by a power of two per layer, then scaled back:
    finite, and ordered like the bound)."""
    from ..analysis.loads import peak_loads  # TODO(lead): move to the module imports; drop share_gpu_loads, gpu_loads

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
    bound = np.ldexp(lower_bound(scaled, problem.topology, problem.num_groups, problem.hierarchical), -shift)
    if proven is not None:
        peak = _peaks(weights, phy2log, problem)
        bound = np.maximum(bound, np.minimum(np.asarray(proven, dtype=np.float64), peak))
    return bound


def pareto(counts, *, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None, topology: Topology | None = None,
           fractions=(0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), held_out=None, method: str = DEFAULT_METHOD,
           **options) -> dict:
    """Balancedness against off-node traffic, for a sweep of caps ``max_off_node``.

    Args:
        counts: ``[L, E]`` planning counts (a series ``[T, L, E]`` is summed), configuration as
            :func:`plan`, hierarchical (``num_groups`` a multiple of ``num_nodes``).
        fractions: the caps, each in ``[0, 1]``.
        held_out: ``[T, L, E]`` (or ``[L, E]``) windows the plans did not see, to judge them out of sample.
    Returns:
        A dict of ``[F]`` float64 arrays: ``max_off_node``, ``balancedness``, ``off_node_fraction`` (in
        sample, with the plans' shares), and with ``held_out`` the same on the held-out windows with
        the plans' shares and with optimal dispatch (``..._held_out``, ``..._held_out_optimal``);
        balancedness is the mean over MoE layers (and windows) of mean / max GPU load.
    """
    weights = weights_2d(counts, "counts")
    problem = make_problem(weights.shape[1], num_slots, num_gpus, num_nodes, num_groups, topology)
    if not problem.hierarchical:
        raise ValueError("pareto needs a hierarchical configuration: num_groups a multiple of num_nodes")
    caps = [as_fraction(f, "fractions entry") for f in np.atleast_1d(np.asarray(fractions, dtype=object))]
    if held_out is not None:
        held_out = as_counts(held_out, "held_out", ndims=(2, 3))
        if held_out.shape[-2:] != weights.shape:
            raise ValueError(f"held_out must have shape [T, {weights.shape[0]}, {weights.shape[1]}], got {held_out.shape}")
        held_out = held_out.reshape((-1,) + weights.shape)
    return locality_curve(weights, problem, caps, held_out, method, **options)


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, *, method: str = DEFAULT_METHOD,
                      **options):
    """Drop-in replacement for DeepSeek EPLB's ``rebalance_experts``.

    Args:
        weight: ``[L, E]`` (or ``[E]``) load statistics of the logical experts, or a series
            ``[T, L, E]`` of windows (e.g. vLLM's load window), planned hedged over the windows as
            :func:`plan` does; numpy or torch.
        num_replicas: physical experts ``S``, a multiple of ``num_gpus``.
        num_groups: expert groups; hierarchical placement when ``num_groups % num_nodes == 0``
            (then ``E % num_groups == 0`` and ``num_gpus % num_nodes == 0`` are required).
            Otherwise, as in the published implementation, the placement is global and
            ``num_groups`` and ``num_nodes`` are ignored (e.g. 32 GPUs on 3 nodes).
        num_nodes: server nodes; ``num_gpus``: GPUs.
    Returns:
        ``phy2log [L, S]``, ``log2phy [L, E, R]`` (slots of each expert in increasing order, ``-1``
        padded) and ``logcnt [L, E]``, int64; torch CPU tensors when ``weight`` is a torch tensor
        (``[E]`` input gives ``[S]``, ``[E, R]``, ``[E]``).
    """
    is_torch = type(weight).__module__.split(".")[0] == "torch"
    one_layer = np.ndim(weight) == 1 if not is_torch else weight.dim() == 1
    windows = as_counts(weight, "weight", ndims=(1, 2, 3))
    weights = weights_2d(windows, "weight")
    problem = make_problem(weights.shape[1], num_replicas, num_gpus, num_nodes, num_groups,
                           ignore_nodes_when_global=True)
    if windows.ndim == 3 and windows.shape[0] > 1:  # windows: the hedged plan of the default objective
        phy2log, _ = plan_series(windows, problem, get_method(method), DEFAULT_OBJECTIVE["uniform"], options=options)
    else:
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
