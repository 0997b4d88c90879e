"""The two entry points: :func:`plan` (a :class:`Placement` with diagnostics) and
:func:`rebalance_experts` (DeepSeek EPLB's signature, arrays out)."""

from __future__ import annotations

import difflib
import inspect

import numpy as np

from ..model.defaults import CHANGE_TOLERANCE, COPY_COST, PLAN_TOLERANCE, Default
from ..analysis.metrics import moe_mean
from ..analysis.placement import Placement
from ..kernels.plumbing.layout import replica_counts, slots_of_experts
from ..model._validation import as_counts, as_fraction
from ..engines import DISPATCH_RULES, dispatch_rule
from ..model.change import DeploymentChange
from ..model.deployment import DEPLOYMENT_KEYWORDS, Deployment, deployment_argument, make_deployment
from ..model.counts import summed_2d, weights_2d
from ..model.topology import Topology
from .locality import off_node_curve
from .methods import DEFAULT_METHOD, OPTIONS as METHOD_OPTIONS
from .pipeline import build, plan_arrays, run, windows_of
from .replan import fit_groups, warn_relaxed

__all__ = ["Deployment", "held_out", "make_deployment", "pareto", "plan", "rebalance_experts"]

HELD_OUT_FOLDS = 16  # leave-one-out over at most this many blocks of windows


def plan(counts, deployment: Deployment | None = None, *, num_slots=None, num_gpus=None, num_nodes=1,
         num_groups=None, method: str = DEFAULT_METHOD, topology: Topology | None = None, previous=None,
         tolerance: float | None = PLAN_TOLERANCE, max_moves=None, max_off_node: float | None = None,
         objective: str | None = None, window_weights=None, dispatch: str = "uniform",
         copy_cost: float = COPY_COST, gpu_map=None, survive: str | None = None, **options) -> Placement:
    """Plan a replicated expert placement for every layer.

    Args:
        counts: ``[L, E]`` tokens routed to each logical expert (``[E]`` for one layer), or a series
            ``[T, L, E]`` of ``T`` windows, planned as windows: hedged over them (``objective``
            below; ``objective="sum"`` plans on their sum). Non-negative and finite.
        deployment: an :class:`eplb.Deployment` (``eplb.Deployment.of(E, num_slots=..., ...)``), the
            one value for where experts may live and the engine's dispatch rule; or ``None`` and the
            keywords below, which build it (not both).
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
            Across a deployment change (``gpu_map`` below), up to ``(1 + tolerance)`` times the higher
            of that and the peak the placement in service reached, scaled to the GPUs after the
            change; not given, 0.01 there (:data:`eplb.model.defaults.CHANGE_TOLERANCE`).
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
            :data:`eplb.engines.DISPATCH_RULES`: ``"uniform"`` (as engines do by default;
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
        gpu_map: with ``previous`` planned on another deployment (GPUs lost, added or renumbered,
            slots per GPU changed), the new index of each of its GPUs (``-1``: gone); ``None``: by
            index. ``deployment`` may instead be one :class:`eplb.DeploymentChange` (old, new,
            gpu_map). The plan is re-planned from the placement in service across the change
            (:mod:`eplb.planning.replan`): every expert present on the surviving GPUs, close to what
            they hold; ``info`` gives ``change``, ``orphans``, ``copies`` and ``copy_floor`` per layer.
        survive: ``"gpu"`` / ``"node"``: losing any one GPU (node) orphans as few tokens as possible;
            with ``S >= 2 E``, every expert on two GPUs (nodes) (:mod:`eplb.planning.survivability`,
            and what it combines with). Every plan's ``info`` has ``worst_gpu_loss`` and
            ``worst_node_loss``, the share of tokens one loss orphans (:mod:`eplb.analysis.exposure`).
        **options: passed to the method.
    Returns:
        A :class:`Placement` (with ``home_node`` when hierarchical); its ``max_load``, ``lower_bound`` and ``gap`` on ``counts`` are
        computed on first access (a call that never reads them never computes the bound).
    """
    _check_option_names(method, options)
    counts = as_counts(counts, "counts", ndims=(1, 2, 3))
    keywords = dict(num_slots=num_slots, num_gpus=num_gpus, num_nodes=num_nodes, num_groups=num_groups,
                    topology=topology, dispatch=dispatch)
    deployment, change, relaxed = _deployment_of(counts, deployment, keywords, previous, gpu_map)
    if type(tolerance) is Default:  # no tolerance given
        tolerance = CHANGE_TOLERANCE if change is not None else float(tolerance)
    dispatch = deployment.dispatch
    windows, objective = windows_of(counts, dispatch, objective, window_weights)
    stages = build(windows, deployment, method=method, objective=objective, previous=previous, tolerance=tolerance,
                   max_moves=max_moves, max_off_node=max_off_node, copy_cost=copy_cost, options=options, change=change,
                   survive=survive)
    return run(windows, deployment, stages, method, notes={"relaxed": relaxed} if relaxed else None)


def _deployment_of(counts, deployment, keywords: dict, previous, gpu_map):
    """:func:`plan`'s deployment (built from ``keywords`` when ``None``; a :class:`DeploymentChange`'s
    new one), the change it crosses (or ``None``) and what :func:`fit_groups` relaxed (one warning).
    With ``previous``, a hierarchy whose groups no longer fit is planned without the rule, close to
    the placement in service, as the :class:`eplb.Balancer` plans it: regrouping it into units, as a
    plan from scratch does, moves most slots again (DeepSeek-V3 size, 4 nodes / 8 groups, a GPU
    lost, drifted counts: 241 of 279 slots a layer, against 35 and a better balance)."""
    change = deployment if isinstance(deployment, DeploymentChange) else None
    if change is not None:
        deployment = change.new
    if deployment is None:
        deployment = make_deployment(counts.shape[-1], keywords["num_slots"], keywords["num_gpus"],
                                     keywords["num_nodes"], keywords["num_groups"], keywords["topology"],
                                     dispatch=keywords["dispatch"])
    else:  # the value, with none of the keywords that would build it
        defaults = {"num_slots": None, "num_gpus": None, "num_nodes": 1, "num_groups": None, "topology": None,
                    "dispatch": "uniform"}
        spelled = {name: value for name, value in keywords.items() if value != defaults[name]}
        deployment = deployment_argument(deployment, spelled, "plan", num_experts=counts.shape[-1])
    change = change_of(previous, deployment, gpu_map, change)
    deployment, relaxed = fit_groups(deployment, spill=previous is not None, near=previous is not None and change is None)
    warn_relaxed(relaxed, stacklevel=5)
    return deployment, change, relaxed


def change_of(previous, deployment: Deployment, gpu_map, change: DeploymentChange | None) -> DeploymentChange | None:
    """The deployment change a plan crosses, or ``None``: ``change`` when given (then ``gpu_map`` must
    not be), else from ``previous`` (a :class:`Placement` carries its deployment) to ``deployment``
    when its topology differs or ``gpu_map`` is given; a change that changes nothing is ``None``."""
    if change is not None:
        if gpu_map is not None:
            raise ValueError("give gpu_map in the DeploymentChange or as gpu_map=, not both")
        if previous is None:
            raise ValueError("a DeploymentChange needs previous=, the placement in service on its old deployment")
        return None if change.is_identity else change
    if previous is None:
        if gpu_map is not None:
            raise ValueError("gpu_map needs previous=, the placement in service on the old deployment")
        return None
    if not isinstance(previous, Placement):
        if gpu_map is not None:
            raise ValueError("previous on another deployment must be an eplb.Placement (it carries its deployment), "
                             "or pass deployment=eplb.DeploymentChange(old, new, gpu_map)")
        return None  # an array on the new deployment itself (checked by the plan)
    if gpu_map is None and previous.topology == deployment.topology:
        return None
    old = Deployment(previous.num_experts, previous.topology, previous.num_groups, previous.num_groups is not None,
                     deployment.dispatch)
    found = DeploymentChange(old, deployment, gpu_map)
    return None if found.is_identity else found


def held_out(counts, *, folds: int = HELD_OUT_FOLDS, judge: str | None = None, **plan_options) -> np.ndarray:
    """Held-out estimate of the plan :func:`plan` makes from a series: leave one window out.

    Window ``t`` (or, for a long series, block ``k`` of ``folds`` contiguous blocks) is served by
    the plan made with ``plan_options`` from all the other windows, given as a series; its score
    is the mean over MoE layers of its balancedness (mean / max GPU load).

    Args:
        counts: ``[T, L, E]`` with ``T >= 2`` windows.
        folds: ``>= 2``, at most this many held-out blocks (``min(T, folds)`` plans are made).
        judge: how the held-out window is split among replicas: a rule of
            :data:`eplb.engines.DISPATCH_RULES` (``"uniform"``, ``"optimal"``,
            ``"sglang-static"``, ...) or ``"shares"`` (a plan's own shares); ``None``: the plan's own
            (its ``dispatch`` when that is optimal or an engine's rule, else ``"shares"``, which is
            the even split when a plan has none).
        **plan_options: passed to :func:`plan` (deployment, method, objective, ...).
    Returns:
        ``[F]`` float64: each held-out block's mean over its windows of the MoE-layer balancedness
        (NaN for a block whose windows carry no load: there is nothing to balance).
    """
    windows = as_counts(counts, "counts", ndims=(3,))
    if windows.shape[0] < 2:
        raise ValueError(f"counts must hold at least 2 windows [T, L, E] to hold one out, got shape {windows.shape}")
    if not (isinstance(folds, (int, np.integer)) and not isinstance(folds, bool) and folds >= 2):
        raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
    if judge is None:
        given = plan_options.get("deployment")
        rule = given.dispatch if isinstance(given, Deployment) else plan_options.get("dispatch", "uniform")
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
        means = moe_mean(per_window, windows[lo:hi])  # NaN for a window that carries no load
        scores.append(float(np.nanmean(means)) if not np.isnan(means).all() else np.nan)
    return np.asarray(scores)


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


def pareto(counts, deployment: Deployment | None = None, *, fractions=(0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
           held_out=None, method: str = DEFAULT_METHOD, **options) -> dict:
    """Balancedness against off-node traffic, for a sweep of caps ``max_off_node``.

    Args:
        counts: ``[L, E]`` planning counts (a series ``[T, L, E]`` is summed).
        deployment: a hierarchical :class:`eplb.Deployment` (its groups stay on their nodes); its
            keywords still work in its place, deprecated.
        fractions: the caps, each in ``[0, 1]``.
        held_out: ``[T, L, E]`` (or ``[L, E]``) windows the plans did not see, to judge them out of sample.
    Returns:
        A dict of ``[F]`` float64 arrays: ``max_off_node``, ``balancedness``, ``off_node_fraction`` (in
        sample, with the plans' shares), and with ``held_out`` the same on the held-out windows with
        the plans' shares and with optimal dispatch (``..._held_out``, ``..._held_out_optimal``);
        balancedness is the mean over MoE layers (and windows) of mean / max GPU load.
    """
    weights = weights_2d(counts, "counts")
    spelled = {name: options.pop(name) for name in DEPLOYMENT_KEYWORDS if name in options}
    deployment = deployment_argument(deployment, spelled, "pareto", num_experts=weights.shape[1])
    if not deployment.hierarchical:
        raise ValueError("pareto needs a hierarchical configuration: num_groups a multiple of num_nodes")
    caps = [as_fraction(f, "fractions entry") for f in np.atleast_1d(np.asarray(fractions, dtype=object))]
    if held_out is not None:
        held_out = as_counts(held_out, "held_out", ndims=(2, 3))
        if held_out.shape[-2:] != weights.shape:
            raise ValueError(f"held_out must have shape [T, {weights.shape[0]}, {weights.shape[1]}], got {held_out.shape}")
        held_out = held_out.reshape((-1,) + weights.shape)
    return off_node_curve(weights, deployment, caps, held_out, method, **options)


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
    weights = summed_2d(windows, "weight")
    deployment = make_deployment(weights.shape[1], num_replicas, num_gpus, num_nodes, num_groups,
                           ignore_nodes_when_global=True)
    # a series of windows: the hedged plan of the default objective, as plan() makes it
    series, objective = windows_of(windows)
    phy2log = plan_arrays(series, deployment, build(series, deployment, method=method, objective=objective,
                                                    options=options)).phy2log  # arrays out: no Placement
    logcnt = replica_counts(phy2log, weights.shape[1])
    log2phy = slots_of_experts(phy2log, weights.shape[1], int(logcnt.max()))
    result = (phy2log, log2phy, logcnt)
    if one_layer:
        result = tuple(a[0] for a in result)
    if is_torch:
        import torch

        result = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in result)
    return result
