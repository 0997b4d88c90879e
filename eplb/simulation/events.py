"""Deployment changes in a simulated series: GPUs that fail, nodes that join or leave.

An :class:`Event` is a step and a :class:`eplb.DeploymentChange`: once step ``step`` is served, the
deployment in service becomes ``change.new`` (:func:`eplb.simulate` asks the policy to answer it,
:meth:`eplb.Policy.redeploy`, and prices the weights it moves). The changes of a series follow
each other: each starts from the deployment the one before left.

Changes are written against the deployment in service at their step, so a schedule builds them in
order from the start (:func:`schedule`) out of :class:`Resize` values:

- ``Resize("fail-gpu", (5, 6))``: GPUs 5 and 6 lost; they keep their index with no slots (nodes
  keep their GPUs), the others keep their slots and weights;
- ``Resize("fail-node", 3)``: every GPU of node 3 lost, likewise;
- ``Resize("add-nodes", 1)``: one node of empty GPUs appended (as many GPUs as a node has, each with
  the slots of the GPUs in service);
- ``Resize("remove-nodes", 2)``: the last two nodes leave (their GPUs are gone: what they held is
  loaded from host memory when no other GPU holds it).

Each takes ``slots_per_gpu``: the slots of every GPU that serves after the change (default: as
before). The command line writes them ``--fail-gpu 5,6@2000``, ``--fail-node 3@2000:11`` (after
step 2000, survivors with 11 slots), ``--add-nodes 1@3000``, ``--remove-nodes 2@4000``
(:func:`parse_event`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model._validation import as_int
from ..model.change import DeploymentChange
from ..model.sizes import check_limit
from ..model.deployment import Deployment, make_deployment
from ..model.topology import Topology

KINDS = ("fail-gpu", "fail-node", "add-nodes", "remove-nodes")
"""What a :class:`Resize` does (and the command line's flag for it, with ``--``)."""


class TooFewSlots(ValueError):
    """A change that leaves fewer slots than experts; ``slots_per_gpu``: how many slots every GPU
    that serves after it would need."""

    def __init__(self, message: str, slots_per_gpu: int):
        super().__init__(message)
        self.slots_per_gpu = slots_per_gpu


@dataclass(frozen=True)
class Event:
    """After step ``step`` is served, the deployment changes as ``change`` says.

    Attributes:
        step: the last step served on ``change.old`` (``0 <= step < T - 1``).
        change: the :class:`eplb.DeploymentChange`.
        label: what happened, for reports (default: ``change.describe()``).
    """

    step: int
    change: DeploymentChange
    label: str = ""

    def __post_init__(self):
        object.__setattr__(self, "step", as_int(self.step, "event step", minimum=0))
        if not isinstance(self.change, DeploymentChange):
            raise ValueError(f"an event's change must be an eplb.DeploymentChange, got {type(self.change).__name__}")
        if not self.label:
            object.__setattr__(self, "label", self.change.describe())


@dataclass(frozen=True)
class Resize:
    """A change written against whatever deployment is in service when it happens.

    Attributes:
        kind: one of :data:`KINDS`.
        value: the GPUs (a tuple of indices) for ``"fail-gpu"``, the node for ``"fail-node"``, the
            number of nodes for ``"add-nodes"`` and ``"remove-nodes"``.
        slots_per_gpu: the slots of every GPU that serves after the change (default: unchanged;
            added GPUs get the most common slot count of the GPUs in service).
    """

    kind: str
    value: int | tuple
    slots_per_gpu: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a resize's kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "fail-gpu":
            gpus = tuple(as_int(g, "failed GPU", minimum=0) for g in np.atleast_1d(self.value).tolist())
            if not gpus or len(set(gpus)) < len(gpus):
                raise ValueError(f"fail-gpu names each GPU once and at least one, got {self.value!r}")
            object.__setattr__(self, "value", gpus)
        else:
            object.__setattr__(self, "value", as_int(self.value, self.kind, minimum=0 if self.kind == "fail-node" else 1))
        if self.kind == "add-nodes":
            check_limit(self.value, "gpus", "add-nodes: the number of nodes")
        if self.slots_per_gpu is not None:
            object.__setattr__(self, "slots_per_gpu", as_int(self.slots_per_gpu, "slots_per_gpu", minimum=1))
            check_limit(self.slots_per_gpu, "slots", f"{self.label}: slots_per_gpu")

    @property
    def label(self) -> str:
        """What happens, in a few words."""
        if self.kind == "fail-gpu":
            return f"GPU{'s' if len(self.value) > 1 else ''} {', '.join(map(str, self.value))} lost"
        if self.kind == "fail-node":
            return f"node {self.value} lost"
        plural = "s" if self.value > 1 else ""
        return f"{self.value} node{plural} {'added' if self.kind == 'add-nodes' else 'removed'}"

    def __call__(self, deployment: Deployment, num_groups: int | None = None) -> DeploymentChange:
        """The change from ``deployment`` (``ValueError`` naming the rule when it cannot be done);
        ``num_groups``: the expert groups of the new deployment (default ``deployment``'s; a
        schedule passes the first deployment's, so groups a node count dropped come back with it)."""
        topology = deployment.topology
        groups = deployment.num_groups if num_groups is None else num_groups
        if self.kind in ("fail-gpu", "fail-node"):
            masked = _masked(deployment, self._lost(topology), self.slots_per_gpu, self.label, groups)
            return DeploymentChange(deployment, masked)
        per_node = topology.gpus_per_node
        slots = _survivor_slots(topology.slots_per_gpu, self.slots_per_gpu)
        if self.kind == "add-nodes":
            check_limit(topology.num_gpus + self.value * per_node, "gpus", f"{self.label}: the number of GPUs")
            added = np.full(self.value * per_node, self.slots_per_gpu or _usual_slots(topology), np.int64)
            new = _topology(np.concatenate([slots, added]), topology.num_nodes + self.value, self.label)
        else:
            if self.value >= topology.num_nodes:
                raise ValueError(f"{self.label}: the deployment has {topology.num_nodes} node"
                                 f"{'s' if topology.num_nodes > 1 else ''}; at least one must stay")
            kept = (topology.num_nodes - self.value) * per_node
            if slots[:kept].sum() == 0:
                raise ValueError(f"{self.label}: no GPU with slots would be left")
            new = _topology(slots[:kept], topology.num_nodes - self.value, self.label)
        return DeploymentChange(deployment, _deployment_on(deployment, new, self.label, groups))

    def _lost(self, topology: Topology) -> np.ndarray:
        """The GPUs this failure loses (in range, each holding slots now)."""
        if self.kind == "fail-node":
            if self.value >= topology.num_nodes:
                raise ValueError(f"{self.label}: nodes are 0 ... {topology.num_nodes - 1}")
            gpus = np.arange(self.value * topology.gpus_per_node, (self.value + 1) * topology.gpus_per_node)
            gpus = gpus[topology.slots_per_gpu[gpus] > 0]
            if gpus.size == 0:
                raise ValueError(f"{self.label}: its GPUs hold no slots already")
            return gpus
        gpus = np.asarray(self.value, np.int64)
        if gpus.max() >= topology.num_gpus:
            raise ValueError(f"{self.label}: GPUs are 0 ... {topology.num_gpus - 1}")
        empty = gpus[topology.slots_per_gpu[gpus] == 0]
        if empty.size:
            raise ValueError(f"{self.label}: GPU {', '.join(map(str, empty.tolist()))} holds no slots already")
        return gpus


def _survivor_slots(slots: np.ndarray, slots_per_gpu: int | None) -> np.ndarray:
    """``slots [G]`` with every GPU that has slots given ``slots_per_gpu`` (when set)."""
    slots = slots.copy()
    if slots_per_gpu is not None:
        slots[slots > 0] = slots_per_gpu
    return slots


def _usual_slots(topology: Topology) -> int:
    """The most common slot count of the GPUs with slots (the largest on ties)."""
    values, counts = np.unique(topology.slots_per_gpu[topology.slots_per_gpu > 0], return_counts=True)
    return int(values[counts == counts.max()].max())


def _masked(deployment: Deployment, lost: np.ndarray, slots_per_gpu: int | None, label: str,
            num_groups: int | None) -> Deployment:
    """``deployment`` with the GPUs ``lost`` holding no slots (the others ``slots_per_gpu`` each when set)."""
    slots = _survivor_slots(deployment.topology.slots_per_gpu, slots_per_gpu)
    slots[lost] = 0
    if slots.sum() == 0:
        raise ValueError(f"{label}: no GPU with slots would be left")
    return _deployment_on(deployment, _topology(slots, deployment.topology.num_nodes, label), label, num_groups)


def _topology(slots: np.ndarray, num_nodes: int, label: str) -> Topology:
    """The topology of ``slots [G]`` on ``num_nodes`` nodes, its size checked against
    :mod:`eplb.model.sizes` first (a ``ValueError`` naming the change ``label``)."""
    check_limit(slots.size, "gpus", f"{label}: the number of GPUs")
    check_limit(int(slots.sum()), "slots", f"{label}: the number of slots")
    return Topology(slots, num_nodes)


def _deployment_on(deployment: Deployment, topology: Topology, label: str, num_groups: int | None) -> Deployment:
    """``deployment``'s experts and dispatch rule with ``num_groups`` on ``topology``; ``ValueError``
    when its slots cannot hold every expert (saying how many slots per GPU would)."""
    experts, slots = deployment.num_experts, topology.num_slots
    if slots < experts:
        need = -(-experts // int((topology.slots_per_gpu > 0).sum()))
        raise TooFewSlots(f"{label}: {slots} slots for {experts} experts; give the GPUs that serve {need} slots each",
                          need)
    return make_deployment(experts, topology=topology, num_groups=num_groups, dispatch=deployment.dispatch)


def schedule(deployment: Deployment, changes) -> list[Event]:
    """The events of ``changes`` in step order, each written against the deployment the one before
    left (the first against ``deployment``).

    Args:
        deployment: the :class:`eplb.Deployment` in service at step 0.
        changes: ``{step: change}`` or ``[(step, change), ...]``, a change being a :class:`Resize`
            or a :class:`eplb.DeploymentChange` (whose ``old`` must be the deployment in service then).
    Returns:
        ``[Event]`` sorted by step. ``ValueError`` on two changes at one step or a change that does
        not start from the deployment in service.
    """
    items = sorted((changes.items() if isinstance(changes, dict) else changes), key=lambda item: item[0])
    events, current = [], deployment
    for step, change in items:
        if events and step == events[-1].step:
            raise ValueError(f"two deployment changes after step {step}: make them one change")
        label = ""
        if isinstance(change, Resize):
            label, change = change.label, change(current, deployment.num_groups)
        elif not isinstance(change, DeploymentChange):
            raise ValueError(f"a change must be an eplb.simulation.events.Resize or an eplb.DeploymentChange, "
                             f"got {type(change).__name__}")
        check_starts_from(change, current, step)
        events.append(Event(step, change, label))
        current = change.new
    return events


def check_starts_from(change: DeploymentChange, deployment: Deployment, step: int) -> None:
    """``ValueError`` unless ``change`` starts from ``deployment`` (its experts, topology and groups)."""
    old = change.old
    if (old.num_experts, old.topology, old.num_groups) != (deployment.num_experts, deployment.topology,
                                                           deployment.num_groups):
        raise ValueError(f"the deployment change after step {step} must start from the deployment in service "
                         f"then ({deployment.num_experts} experts, slots per GPU "
                         f"{deployment.topology.slots_per_gpu.tolist()}, {deployment.num_nodes} nodes, groups "
                         f"{deployment.num_groups})")


def parse_event(kind: str, text: str) -> tuple[int, Resize]:
    """The command line's ``WHAT@STEP[:SLOTS]`` for ``--<kind>`` as ``(step, Resize)``: WHAT is the
    GPUs (``5`` or ``5,6``) for ``fail-gpu``, the node for ``fail-node``, how many nodes for
    ``add-nodes`` and ``remove-nodes``; STEP the last step before the change; SLOTS the slots per
    GPU after it. ``ValueError`` naming the form otherwise."""
    what, at, rest = text.partition("@")
    step, _, slots = rest.partition(":")
    form = f"--{kind} WHAT@STEP[:SLOTS]" + (" (WHAT: GPUs such as 5 or 5,6)" if kind == "fail-gpu" else "")
    parts = what.split(",") if kind == "fail-gpu" else [what]
    numbers = parts + [step] + ([slots] if slots else [])
    if not at or not all(p.strip().isdigit() for p in numbers):
        raise ValueError(f"expected {form} with whole numbers, got {text!r}")
    value = tuple(int(p) for p in parts) if kind == "fail-gpu" else int(what)
    return int(step), Resize(kind, value, int(slots) if slots else None)


__all__ = ["Event", "Resize", "KINDS", "TooFewSlots", "schedule", "parse_event", "check_starts_from"]
