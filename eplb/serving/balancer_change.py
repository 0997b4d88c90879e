"""A :class:`~eplb.serving.balancer.Balancer` across a deployment change (GPUs lost, added or
renumbered, slots per GPU changed): :func:`change_for` checks what the caller gives and makes the
:class:`eplb.DeploymentChange`; :class:`ChangeHandling` (a mixin of the Balancer) re-plans the
placement in service across it, switches the balancer to the new deployment, and keeps the epochs
that let :meth:`~eplb.serving.balancer.Balancer.commit` refuse a plan made before a change;
:func:`recovery_summary` says what putting the re-plan in service takes (orphans, copies, bytes,
seconds)."""

from __future__ import annotations

import time
import weakref
from types import MappingProxyType

import numpy as np

from ..engines import dispatch_rule
from ..analysis.placement import Placement
from ..model.change import DeploymentChange
from ..model.cost import CostModel
from ..model.deployment import Deployment
from ..planning.replan import warn_relaxed
from .balancer_decision import move_settings
from .transfer import TransferPlan, transfer_plan


class ChangeHandling:
    """The deployment-change half of :meth:`Balancer.rebalance <eplb.serving.balancer.Balancer.rebalance>`
    and :meth:`~eplb.serving.balancer.Balancer.commit`: methods of the
    :class:`~eplb.serving.balancer.Balancer` that read and switch its deployment, placement and
    epoch."""

    def _rebalance_across(self, change: DeploymentChange, commit: bool, start: float) -> tuple[Placement, TransferPlan]:
        """:meth:`rebalance` across ``change`` (checked by :func:`change_for`)."""
        candidate = self._plan(self.planning_counts(), change)
        warn_relaxed(candidate.info.get("relaxed"), stacklevel=4)
        transfer = transfer_plan(self.placement, candidate, change, expert_bytes=self.expert_bytes)
        recovery = recovery_summary(candidate, transfer, self.cost_model)
        # the placement was just planned here and not handed out yet: its info gains the summary
        object.__setattr__(candidate, "info", MappingProxyType({**candidate.info, "recovery": recovery}))
        self._remember(candidate)
        moved = int(np.sum(candidate.info["slots_changed"]))
        self.history.append({
            "step": self.steps, "slots_changed": moved, "moved_fraction": moved / candidate.phy2log.size,
            "plan_time_s": float(candidate.info["time_s"]), "time_s": time.perf_counter() - start,
            "copies": transfer.counts(), "change": change.describe(), "recovery": recovery,
        })
        if commit:
            self._switch(change, candidate)
        else:
            self._changing = (candidate, change)
        return candidate, transfer

    def _switch(self, change: DeploymentChange, placement: Placement) -> None:
        """Serve ``change.new`` with ``placement`` from now on (the window's logical counts stay)."""
        with self._lock:
            self.deployment = change.new
            self.placement = placement
            self._physical = np.zeros((self.num_layers, change.new.topology.num_slots))
            self.tolerance, self.max_moves = move_settings(*self._move_arguments, change.new.topology)
            self.rebalances += 1
            self._committing = placement
            self._candidate = None
            self._changing = None
            self._epoch += 1  # plans of the deployment before are stale (issue 47 item 19)
        self._remember(placement)

    def _remember(self, plan: Placement) -> None:
        """Note that ``plan`` was planned in the current epoch (dropped once the caller drops it)."""
        key = id(plan)
        with self._lock:
            self._planned_in[key] = (weakref.ref(plan, lambda _, key=key: self._planned_in.pop(key, None)), self._epoch)


def change_for(current: Deployment, deployment, gpu_map) -> DeploymentChange | None:
    """The deployment change a rebalance crosses from ``current`` (the deployment in service), or
    ``None`` (``deployment=None``, or a change that changes nothing).

    ``deployment``: the :class:`Deployment` to serve next (``gpu_map``: the new index of each GPU
    of ``current``, ``-1`` gone; ``None``: by index) or a :class:`DeploymentChange` from
    ``current``. ``ValueError`` naming the argument and the rule: ``gpu_map`` without
    ``deployment`` or beside a change, of the wrong length, out of range or mapping two GPUs to one
    (:class:`DeploymentChange`), another number of experts, fewer slots than experts, a dispatch
    rule that is not an even split, a change that does not start from ``current``."""
    if deployment is None:
        if gpu_map is not None:
            raise ValueError("gpu_map needs deployment=, the deployment to serve next")
        return None
    if isinstance(deployment, DeploymentChange):
        if gpu_map is not None:
            raise ValueError("give gpu_map in the DeploymentChange or as gpu_map=, not both")
        change = deployment
        if change.old.topology != current.topology or change.old.num_experts != current.num_experts:
            raise ValueError("deployment: the DeploymentChange must start from the deployment in service "
                             f"({current.num_experts} experts, slots per GPU {current.topology.slots_per_gpu.tolist()})")
    elif isinstance(deployment, Deployment):
        change = DeploymentChange(current, deployment, gpu_map)
    else:
        raise ValueError(f"deployment must be an eplb.Deployment or eplb.DeploymentChange, got "
                         f"{type(deployment).__name__}")
    new = change.new
    if dispatch_rule(new.dispatch).kind != "uniform":
        raise ValueError(f"deployment: the Balancer plans for an even split; dispatch={new.dispatch!r} plans from "
                         "scratch (eplb.plan)")
    if new.num_slots < new.num_experts:
        survivors = max(int((new.topology.slots_per_gpu > 0).sum()), 1)
        raise ValueError(f"deployment: {new.num_slots} slots for {new.num_experts} experts after the change "
                         f"({change.describe()}); every expert needs a slot: give the {survivors} GPUs "
                         f"{-(-new.num_experts // survivors)} slots each")
    return None if change.is_identity else change


def recovery_summary(placement: Placement, transfer: TransferPlan, cost_model: CostModel | None = None) -> dict:
    """What putting a plan across a deployment change in service takes, summed over layers:
    ``orphans`` (experts with no replica left, loaded from host memory once each), ``copy_floor``
    (the fewest copies any re-plan makes), ``copies`` (:meth:`TransferPlan.counts`, by kind),
    ``expert_bytes`` (one expert's weights in one layer: the transfer plan's, else the cost
    model's; ``None`` without either), ``bytes`` (copies times ``expert_bytes``), ``recovery_s``
    (:meth:`eplb.CostModel.transfer_time` at that same size: the GPU copies, then the host loads,
    then the copies that read them, at the cost model's bandwidths; ``None`` without a cost model)
    and ``tolerance`` (the one the re-plan used, ``info["tolerance"]``). ``placement``: planned
    across the change (``info`` with ``orphans [L]`` and ``copy_floor [L]``); ``transfer``: its
    copies. Bytes and seconds are priced with one size (issue 47 item 20: the seconds used the
    cost model's where the bytes used ``expert_bytes``)."""
    counts = transfer.counts()
    size = transfer.expert_bytes if transfer.expert_bytes is not None else (
        None if cost_model is None else cost_model.expert_bytes)
    seconds = None
    if cost_model is not None:
        priced = cost_model if size == cost_model.expert_bytes else cost_model.with_(expert_bytes=float(size))
        seconds = float(priced.transfer_time(transfer))
    return {"orphans": int(np.sum(placement.info["orphans"])), "copy_floor": int(np.sum(placement.info["copy_floor"])),
            "copies": counts, "expert_bytes": None if size is None else int(size),
            "bytes": None if size is None else {k: int(v * size) for k, v in counts.items()},
            "recovery_s": seconds, "tolerance": placement.info.get("tolerance")}
