"""The decision side of a :class:`~eplb.serving.balancer.Balancer`: the candidate plan and what it
is worth. :class:`DecisionSide` (a mixin of the Balancer) plans near the placement in service
(:meth:`~DecisionSide._plan`, within the move budget :meth:`~DecisionSide._move_budget` gives it),
prices a placement in time on the window's mean pass (:meth:`~DecisionSide._layer_times`, under the
even split and the cost model) and gives back, layer by layer, the moves that do not pay for their
copies (:meth:`~DecisionSide._layers_that_pay`); :data:`HORIZON_WINDOWS` is the horizon the savings
are counted over; :func:`move_settings` resolves the move budget from the arguments (``tolerance``,
``max_moves``, ``"auto"`` from the slots per GPU)."""

from __future__ import annotations

import numpy as np

from ..analysis.loads import RANDOM_SPLIT, gpu_work
from ..analysis.placement import Placement, uniform_shares
from ..model._validation import as_int
from ..model.change import DeploymentChange
from ..model.defaults import AUTO, BALANCER_TOLERANCE, balancer_move_budget, slots_per_gpu
from ..model.deployment import Deployment
from ..model.topology import Topology
from ..planning.migration import groups_spread
from ..planning.pipeline import build, run, windows_of
from ..planning.replan import fit_groups
from .transfer import transfer_plan


HORIZON_WINDOWS = 3
"""With a cost model, a new placement's savings are counted over this many windows of passes
unless ``horizon`` says otherwise (see :class:`~eplb.serving.balancer.Balancer`)."""


class DecisionSide:
    """The planning and pricing behind :meth:`Balancer.should_rebalance
    <eplb.serving.balancer.Balancer.should_rebalance>` and :meth:`~eplb.serving.balancer.Balancer.rebalance`:
    methods of the :class:`~eplb.serving.balancer.Balancer` that read its deployment, placement,
    window, move budget, cost model, horizon and ``move_cost``."""

    def _plan(self, load: np.ndarray, change: DeploymentChange | None = None) -> Placement:
        """Migration-aware plan for ``load [L, E]`` from the placement in service, hedged over
        :meth:`planning_windows` (``plan``'s pipeline from the placement in service; its bounds are computed only if read).
        Across ``change`` (from the balancer's deployment), the re-plan for ``change.new`` as
        :func:`eplb.plan` makes it (a hierarchical deployment whose groups no longer fit is relaxed as
        there: :func:`eplb.planning.replan.fit_groups`), for ``load`` alone: a change is not chosen for
        its gain, so its plan makes the copies recovery takes and no hedging swaps (one GPU of 32 lost
        on drifting DeepSeek-V3-sized traffic: hedged, 1.7x the copies global and 6x hierarchical,
        for no better balance on ``load``; ``bench/elastic_serving.py``).
        Later plans on such a deployment are global, close to the placement in service (regrouping it
        into units of groups, as a plan from scratch does, would move many slots again; ``info["relaxed"]``)."""
        windows, objective = windows_of(self.planning_windows() if self._filled and change is None else load[None],
                                        weights=load)
        deployment, relaxed = fit_groups(self.deployment if change is None else change.new, spill=True,
                                         near=change is None)
        tolerance, max_moves = self._move_budget(change, deployment)
        stages = build(windows, deployment, method=self.method, objective=objective,
                       previous=self.placement.phy2log, tolerance=tolerance, max_moves=max_moves,
                       copy_cost=self.copy_cost, threads=self.threads, options=self.options, change=change)
        return run(windows, deployment, stages, self.method, notes={"relaxed": relaxed} if relaxed else None)

    def _move_budget(self, change: DeploymentChange | None, deployment: Deployment) -> tuple[float | None, int | None]:
        """``(tolerance, max_moves)`` of a plan: :attr:`tolerance` and :attr:`max_moves`, except
        that the default budget (``max_moves="auto"``) does not bind a re-plan across ``change`` nor
        one that must gather expert groups spread over nodes (the round-robin start of a
        hierarchical deployment): those are not chosen for their gain, and plan as without a
        budget (tolerance :data:`~eplb.model.defaults.BALANCER_TOLERANCE` unless given)."""
        if not isinstance(self._move_arguments[1], str):
            return self.tolerance, self.max_moves
        if change is not None or groups_spread(self.placement.phy2log, deployment, self.num_experts).any():
            return move_settings(self._move_arguments[0], None, deployment.topology)
        return self.tolerance, self.max_moves

    def _layers_that_pay(self, load: np.ndarray, candidate: Placement, gain: np.ndarray) -> Placement:
        """``candidate`` with every layer whose move does not pay for itself on ``load [L, E]``
        given back its slots in service: with a cost model, a layer pays when the time it saves
        over the horizon exceeds its share of the copy stall (its copies' share of the plan's);
        otherwise when its balancedness gain is at least ``move_cost`` times the fraction of its
        slots that change (``gain [L]``: the candidate's balancedness minus the placement in
        service's, per layer). Copies then go to the layers where they buy balance."""
        previous = self.placement.phy2log
        changed = np.asarray(candidate.info["slots_changed"], dtype=np.int64)
        if not changed.any():
            return candidate
        if self.cost_model is None:
            pays = gain >= self.move_cost * changed / previous.shape[1]
        else:
            per_pass = load / self._effective_passes()
            saved = (self._layer_times(self.placement, per_pass) - self._layer_times(candidate, per_pass)) \
                * (self.horizon or HORIZON_WINDOWS * self.window)
            stall = np.zeros(self.num_layers)
            if self.cost_model.copy_mode == "stall":
                transfer = transfer_plan(self.placement, candidate, expert_bytes=int(self.cost_model.expert_bytes))
                copies = np.bincount(transfer.layer, minlength=self.num_layers)
                stall = self.cost_model.transfer_time(transfer) * copies / max(int(copies.sum()), 1)
            pays = saved > stall
        keep = pays & (changed > 0)
        if keep.all():
            return candidate
        phy2log = np.where(keep[:, None], candidate.phy2log, previous)
        info = {**candidate.info, "slots_changed": np.where(keep, changed, 0), "layers_rebalanced": keep}
        return Placement(phy2log, self.num_experts, self.topology, self.num_groups, method=self.method, info=info)

    def _effective_passes(self) -> float:
        """The weight of the window's passes (their number without decay)."""
        if self.decay is None:
            return float(self._filled)
        return float(np.sum(self.decay ** np.arange(self._filled)))

    def _layer_times(self, placement: Placement, per_pass: np.ndarray) -> np.ndarray:
        """``[L]`` predicted seconds of each MoE layer of one pass of ``per_pass [L, E]`` counts under
        ``placement`` (even split): the layer's slowest GPU."""
        phy2log = np.ascontiguousarray(placement.phy2log)
        shares = uniform_shares(phy2log, placement.logcnt)[None]
        tokens, active = gpu_work(per_pass[None], phy2log, self.topology, shares, RANDOM_SPLIT)
        live = self.topology.slots_per_gpu > 0
        return self.cost_model.layer_time(tokens[..., live], active[..., live])[0]

    def _step_time(self, placement: Placement, per_pass: np.ndarray) -> float:
        """Predicted seconds of one pass of ``per_pass [L, E]`` counts under ``placement`` (even split)."""
        return float(self._layer_times(placement, per_pass).sum())


def move_settings(tolerance, max_moves, topology: Topology) -> tuple[float | None, int | None]:
    """The Balancer's ``(tolerance, max_moves)`` from its arguments, ``"auto"``
    (:data:`~eplb.model.defaults.AUTO`) resolved: ``max_moves`` to
    :func:`~eplb.model.defaults.balancer_move_budget` of the topology's slots per GPU, ``tolerance``
    to 0 with a move budget and to :data:`~eplb.model.defaults.BALANCER_TOLERANCE` without one; the
    others checked (``ValueError`` naming the argument and the rule)."""
    for name, value in (("tolerance", tolerance), ("max_moves", max_moves)):
        if isinstance(value, str) and value != AUTO:
            raise ValueError(f"{name} must be a number, None or {AUTO!r}, got {value!r}")
    if max_moves == AUTO:
        max_moves = balancer_move_budget(slots_per_gpu(topology))
    elif max_moves is not None:
        max_moves = as_int(max_moves, "max_moves", minimum=0)
    if tolerance == AUTO:
        tolerance = BALANCER_TOLERANCE if max_moves is None else 0.0
    elif tolerance is not None:
        try:
            tolerance = float(tolerance)
        except (TypeError, ValueError):
            raise ValueError(f"tolerance must be a non-negative number, None or {AUTO!r}, got {tolerance!r}") from None
        if not (np.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"tolerance must be a non-negative number, None or {AUTO!r}, got {tolerance}")
    if tolerance is None and max_moves is None:
        raise ValueError("give tolerance, max_moves or both")
    return tolerance, max_moves
