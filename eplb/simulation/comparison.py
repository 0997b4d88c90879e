"""The figures of a comparison: every method (eplb's or a foreign one) judged alike on the same
workloads and deployments, from the ``phy2log`` it returned.

For a workload ``counts [T, L, E]`` (``T`` windows) and a deployment, each method plans from the
summed windows (in sample) and, for the held-out estimate, from the sum of the windows outside
each of ``F = min(T, folds)`` contiguous blocks, judged on that block (leave one block out, as
:func:`eplb.held_out` does with ``objective="sum"``: every method sees what a foreign one can,
one ``[L, E]`` array). Every figure is computed here from the plans, none is taken from the method:

- ``balancedness``: mean over MoE layers of ``mean / max`` GPU load on the summed windows (even split);
- ``gap``: mean over MoE layers of ``max load / lower bound - 1``, with eplb's proven lower bound
  (:func:`eplb.analysis.bounds.strongest_bound`): the hierarchical bound when the deployment keeps
  groups on nodes and the plan does, else the global one (``bound`` says which);
- ``held_out``: mean over the blocks of each block's mean over its windows of the MoE-layer
  balancedness, each block served by the plan made without it;
- ``step_ms`` / ``lost``: simulated MoE step time of the in-sample plan (:func:`eplb.simulate`,
  no rebalancing) on the windows scaled to ``step_routings`` routed tokens per layer and step, and
  the share of it lost to imbalance (over the perfectly balanced time);
- ``copies`` / ``cross_node_copies`` / ``slots_changed``: from a previous placement, when given
  (:func:`eplb.analysis.metrics.moves`);
- ``doubled``: slots holding a second replica of an expert on the same GPU (flagged, not refused);
  ``groups_off_node``: layers where a group has replicas on more than one node, where the
  published hierarchical rule keeps each group on its node;
- ``first_call_s`` / ``warm_call_s``: the first call in a fresh process and the median of warm ones.

A method that raises, hangs past the time limit, or returns something that is not a placement
(wrong shape or dtype, an id out of range, an expert without a replica, ``logcnt``/``log2phy``
disagreeing with ``phy2log``) gets a row with ``status = "broken"`` and a one-line ``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..analysis.bounds import strongest_bound
from ..analysis.metrics import balancedness as layer_balancedness, gap as layer_gap, moe_mean, moves, \
    replicas_sharing_a_gpu
from ..analysis.placement import Placement, build_log2phy
from ..kernels.plumbing.layout import replica_counts
from ..model.cost import CostModel
from ..model.deployment import Deployment, make_deployment
from ..planning.migration import groups_spread
from ..serving.policy import NoRebalance
from .method_runner import ARRAY_TYPES, TORCH, DeploymentSpec, MethodSpec, run_method
from .simulate import simulate

STEP_ROUTINGS = 65536
"""Routed tokens per MoE layer in one simulated step (8192 tokens at top-8): the windows are scaled
to it, since a recording window holds many steps and the cost model prices one."""

OK, BROKEN = "ok", "broken"


@dataclass(frozen=True)
class Workload:
    """Counts to compare on.

    Attributes:
        name: a label; counts: ``[T, L, E]`` float64, non-negative; window_names: ``[T]`` labels.
        source: where they came from (a file, a trace, a generator with its seed).
    """

    name: str
    counts: np.ndarray
    window_names: tuple[str, ...] = ()
    source: str = ""


def deployment_label(deployment: DeploymentSpec) -> str:
    groups = f" / {deployment.num_groups} groups" if deployment.num_groups else ""
    return (f"{deployment.num_slots} slots / {deployment.num_gpus} GPUs / {deployment.num_nodes} "
            f"node{'s' if deployment.num_nodes > 1 else ''}{groups}")


@dataclass
class MethodResult:
    """One row: a method on a workload and a deployment.

    Attributes:
        figures: the row's values by column (see the module docstring), NaN / ``None`` where a
            figure does not apply.
        placement: the in-sample :class:`Placement` (``None`` when broken).
        held_out_plans: ``[F]`` the ``phy2log [L, S]`` planned without each block.
        fold_edges: ``[F + 1]`` window indices bounding the blocks.
        per_layer: ``{"balancedness": [L], "gap": [L]}`` in sample.
    """

    workload: str
    deployment: str
    method: str
    status: str
    reason: str = ""
    figures: dict = field(default_factory=dict)
    placement: Placement | None = None
    held_out_plans: list = field(default_factory=list)
    fold_edges: np.ndarray | None = None
    per_layer: dict = field(default_factory=dict)

    def row(self) -> dict:
        """The flat row of the table and the CSV."""
        return {"workload": self.workload, "deployment": self.deployment, "method": self.method,
                "status": self.status, **self.figures, "reason": self.reason}


class PlanError(ValueError):
    """A method's return value is not a placement of the deployment (the message says why)."""


def check_plan(returned, num_layers: int, num_experts: int, problem: Deployment) -> np.ndarray:
    """``(phy2log, log2phy or None, logcnt or None)`` numpy arrays -> ``phy2log [L, S]`` int64,
    or :class:`PlanError` naming the first thing wrong."""
    phy2log, log2phy, logcnt = returned
    slots = problem.topology.num_slots
    if phy2log.shape != (num_layers, slots):
        raise PlanError(f"phy2log has shape {list(phy2log.shape)}, expected [L, S] = [{num_layers}, {slots}]")
    if phy2log.dtype.kind not in "iu":
        raise PlanError(f"phy2log holds {phy2log.dtype} values, expected integer expert ids")
    if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= num_experts):
        raise PlanError(f"phy2log holds ids {phy2log.min()}..{phy2log.max()}, expected 0..{num_experts - 1}")
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    counts = replica_counts(phy2log, num_experts)
    missing = np.argwhere(counts == 0)
    if missing.size:
        layer, expert = missing[0]
        raise PlanError(f"expert {expert} has no replica in layer {layer} "
                        f"({len(missing)} (layer, expert) pairs missing)")
    if logcnt is not None and (logcnt.shape != counts.shape or not np.array_equal(logcnt, counts)):
        raise PlanError("logcnt disagrees with the replicas phy2log holds")
    if log2phy is not None:
        if log2phy.ndim != 3 or log2phy.shape[:2] != (num_layers, num_experts):
            raise PlanError(f"log2phy has shape {list(log2phy.shape)}, expected [L, E, R] = "
                            f"[{num_layers}, {num_experts}, R]")
        if log2phy.shape[2] < counts.max() or not np.array_equal(
                np.sort(np.where(log2phy < 0, slots, log2phy), axis=2)[..., :counts.max()],
                np.where(build_log2phy(phy2log, num_experts) < 0, slots, build_log2phy(phy2log, num_experts))):
            raise PlanError("log2phy disagrees with the slots phy2log gives each expert")
    return phy2log


def fold_edges(num_windows: int, folds: int) -> np.ndarray:
    """``[F + 1]``: the held-out blocks of :func:`eplb.held_out` (``F = min(T, folds)`` contiguous blocks)."""
    return np.linspace(0, num_windows, min(int(folds), num_windows) + 1).round().astype(np.int64)


def held_out_score(phy2log: np.ndarray, windows: np.ndarray, num_experts: int, problem: Deployment) -> float:
    """One block's score: the mean over its ``windows [w, L, E]`` of the MoE-layer balancedness of
    ``phy2log`` (NaN when no window carries load)."""
    placement = Placement(phy2log, num_experts, problem.topology, problem.num_groups)
    means = moe_mean(placement.balancedness(windows), windows)
    return float(np.nanmean(means)) if not np.isnan(means).all() else np.nan


def step_windows(counts: np.ndarray, step_routings: float) -> np.ndarray:
    """``counts [T, L, E]`` with each window scaled to ``step_routings`` routed tokens per MoE layer
    (its mean over layers carrying load); windows without load stay zero."""
    totals = counts.sum(axis=2)  # [T, L]
    loaded = totals > 0
    mean_total = np.divide(np.where(loaded, totals, 0).sum(axis=1), loaded.sum(axis=1),
                           out=np.zeros(counts.shape[0]), where=loaded.any(axis=1))
    scale = np.divide(step_routings, mean_total, out=np.zeros_like(mean_total), where=mean_total > 0)
    return counts * scale[:, None, None]


def _figures(placement: Placement, weights: np.ndarray, bounds: dict, problem: Deployment, workload: Workload,
             edges: np.ndarray, held: list, cost_model: CostModel, step_routings: float,
             previous: np.ndarray | None) -> tuple[dict, dict]:
    """The row's figures and the per-layer arrays of an in-sample ``placement`` (see the module docstring)."""
    topology = placement.topology
    loads = placement.gpu_loads(weights)  # [L, G]
    per_layer_bal = layer_balancedness(loads, topology)
    spread = groups_spread(placement.phy2log, problem, placement.num_experts)
    kind = "hierarchical" if problem.hierarchical and not spread.any() else "global"
    bound = bounds[kind]
    per_layer_gap = layer_gap(loads.max(axis=1), bound)
    moe = loads.max(axis=1) > 0
    counts = workload.counts
    scores = [held_out_score(phy2log, counts[lo:hi], placement.num_experts, problem)
              for phy2log, lo, hi in zip(held, edges[:-1], edges[1:])]
    scaled = step_windows(counts, step_routings)
    sim = simulate(scaled, placement.deployment, initial=placement, policy=NoRebalance(), cost_model=cost_model)
    step, ideal = float(sim.step_time.mean()), float(sim.ideal_time.mean())
    figures = {
        "balancedness": float(moe_mean(per_layer_bal, loads)),
        "worst_layer": float(per_layer_bal[moe].min()) if moe.any() else np.nan,
        "gap": float(moe_mean(per_layer_gap, loads)),
        "worst_gap": float(per_layer_gap[moe].max()) if moe.any() else np.nan,
        "bound": kind,
        "held_out": float(np.nanmean(scores)) if scores and not np.isnan(scores).all() else np.nan,
        "held_out_worst": float(np.nanmin(scores)) if scores and not np.isnan(scores).all() else np.nan,
        "folds": len(scores),
        "step_ms": 1e3 * step,
        "lost": step / ideal - 1 if ideal > 0 else np.nan,
        "copies": np.nan, "cross_node_copies": np.nan, "slots_changed": np.nan,
        "doubled": int(replicas_sharing_a_gpu(placement.phy2log, topology).sum()),
        "groups_off_node": int(spread.sum()) if problem.hierarchical else np.nan,
    }
    if previous is not None:
        moved = moves(previous, placement.phy2log, topology)
        figures.update(copies=moved.gpu_copies, cross_node_copies=moved.cross_node_copies,
                       slots_changed=moved.slots_changed)
    return figures, {"balancedness": per_layer_bal, "gap": per_layer_gap}


def compare_on(workload: Workload, deployment: DeploymentSpec, methods: list[MethodSpec], *,
               cost_model: CostModel, previous: np.ndarray | None = None, folds: int = 16,
               time_limit: float = 120.0, warm_calls: int = 3, array_type: str = TORCH,
               step_routings: float = STEP_ROUTINGS, progress=None) -> list[MethodResult]:
    """Every method of ``methods`` on one workload and one deployment: one :class:`MethodResult` each.

    Args:
        previous: ``phy2log [L, S]`` in service, for the weight copies; ``None``: no copies figure.
        progress: called with each method's label before it runs (e.g. to print it), or ``None``.
    Raises:
        ValueError: the deployment does not fit the workload (too few slots, groups not dividing
            the experts, ...), or ``previous`` has the wrong shape.
    """
    if array_type not in ARRAY_TYPES:
        raise ValueError(f"array_type must be one of {ARRAY_TYPES}, got {array_type!r}")
    counts = workload.counts
    num_windows, num_layers, num_experts = counts.shape
    problem = make_deployment(num_experts, deployment.num_slots, deployment.num_gpus, deployment.num_nodes,
                           deployment.num_groups)
    if previous is not None:
        previous = Placement(previous, num_experts, problem.topology, problem.num_groups).phy2log
        if previous.shape[0] != num_layers:
            raise ValueError(f"previous must have {num_layers} layers, got {previous.shape[0]}")
    weights = counts.sum(axis=0)
    bounds = {"global": strongest_bound(weights, make_deployment(num_experts, topology=problem.topology))}
    bounds["hierarchical"] = strongest_bound(weights, problem) if problem.hierarchical else bounds["global"]
    edges = fold_edges(num_windows, folds) if num_windows >= 2 else np.zeros(1, np.int64)
    plan_inputs = [weights] + [np.concatenate([counts[:lo], counts[hi:]]).sum(axis=0)
                               for lo, hi in zip(edges[:-1], edges[1:])]
    label = deployment_label(deployment)
    results = []
    for spec in methods:
        if progress is not None:
            progress(spec.label)
        result = MethodResult(workload.name, label, spec.label, BROKEN, fold_edges=edges)
        run = run_method(spec, deployment, plan_inputs, time_limit=time_limit, warm_calls=warm_calls,
                         array_type=array_type)
        result.figures = {"first_call_s": run.first_call_s, "warm_call_s": run.warm_call_s}
        if run.error is not None:
            result.reason = run.error
            results.append(result)
            continue
        try:
            plans = []
            for index, returned in enumerate(run.returned):
                what = "the in-sample plan" if index == 0 else f"the plan without block {index - 1}"
                if isinstance(returned, str):
                    raise PlanError(f"{what}: {returned}")
                try:
                    plans.append(check_plan(returned, num_layers, num_experts, problem))
                except PlanError as exc:
                    raise PlanError(f"{what}: {exc}") from None
        except PlanError as exc:
            result.reason = str(exc)
            results.append(result)
            continue
        result.placement = Placement(plans[0], num_experts, problem.topology, problem.num_groups, method=spec.label)
        result.held_out_plans = plans[1:]
        figures, per_layer = _figures(result.placement, weights, bounds, problem, workload, edges, plans[1:],
                                      cost_model, step_routings, previous)
        result.figures = {**figures, **result.figures}
        result.per_layer = per_layer
        result.status = OK
        results.append(result)
    return results


__all__ = ["BROKEN", "OK", "STEP_ROUTINGS", "MethodResult", "PlanError", "Workload", "check_plan", "compare_on",
           "deployment_label", "fold_edges", "held_out_score", "step_windows"]
