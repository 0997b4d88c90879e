"""Transfer plans: the expert-weight copies that take a serving engine from one placement to another.

For every slot whose expert changes, one copy of that expert's weights from a slot holding it under
the old placement: from the same GPU when it holds the expert elsewhere (a local copy), else from a
GPU of the same node (NVLink), else from another node; senders are spread evenly.

Across a deployment change (:class:`eplb.DeploymentChange`) the plan is on the new deployment: its
sources are the slots of the placement in service on surviving GPUs (``src_old_slot``), those they
carry into the new deployment (``src_slot``; ``change.slot_map`` gives each one's old slot) and those
a shrinking GPU gives up (``src_slot`` -1: read them before freeing them), never a lost GPU. An
expert whose every replica was lost is loaded from host memory once (kind ``"from_host"``, source
``-1``) and its further replicas copy from that slot once it is loaded (``after_load``).

The order (:attr:`TransferPlan.phase`, :meth:`TransferPlan.ordered`), the only one a plan is right in:

1. ``"copy"``: every copy between GPU slots that reads the placement in service, as one bulk step:
   read every source before writing any destination (a destination is often the source of
   another copy: a slot whose expert moves away and is replaced). vLLM's rearrangement does this
   per layer: it receives every copy into a buffer, then writes the buffer in place.
2. ``"load"``: the loads from host memory, in any order. A load's destination is often a carried
   slot whose old expert a ``"copy"`` reads: run the loads after the copies, never before.
3. ``"after_load"``: the copies that read a loaded slot, in any order (their sources are written
   only by step 2, their destinations are read by nobody).

Each destination is written once. Per layer the steps are independent of other layers, so a chunk
of layers (:meth:`TransferPlan.chunks`) is run the same way, its own three steps in order.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from ..model._validation import as_int
from ..kernels.change.weight_copies import CROSS_NODE, FROM_HOST, INTRA_GPU, INTRA_NODE, copies_across, weight_copies
from ..model.change import DeploymentChange
from ..analysis.placement import Placement, check_placement
from ..model.deployment import Deployment
from ..model.topology import Topology

KINDS = ("intra_gpu", "intra_node", "cross_node", "from_host")

PHASES = ("copy", "load", "after_load")
"""The steps of a transfer plan, in the order they run (:attr:`TransferPlan.phase` indexes them)."""
COPY, LOAD, AFTER_LOAD = 0, 1, 2


_FIELDS = ("layer", "expert", "src_slot", "dst_slot", "src_gpu", "dst_gpu", "kind", "after_load", "src_old_slot")


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The weight copies from an old to a new placement, ``C`` copies in all, in layer order.

    Attributes:
        layer, expert: ``[C]`` int64, the MoE layer and the logical expert copied.
        src_slot, dst_slot: ``[C]`` int64, the old slot read and the new slot written (``-1``:
            loaded from host memory).
        src_gpu, dst_gpu: ``[C]`` int64, the GPUs holding those slots (``-1``: host memory).
        kind: ``[C]`` int64, 0 intra-GPU (local copy), 1 intra-node, 2 cross-node, 3 from host.
        num_layers: ``L`` of the placements; topology: their topology.
        expert_bytes: bytes of one expert's weights in one layer (``None``: unknown).
        layers: ``(start, stop)``, the layers this plan covers (all of them unless it is one of
            :meth:`chunks`; pass it to :meth:`eplb.Balancer.commit` once the chunk is applied).
        after_load: ``[C]`` bool, the copy reads a slot a load from host memory of this plan fills
            (run it after the loads); all False but across a deployment change.
        src_old_slot: ``[C]`` int64, the slot of the placement in service read, in the old
            deployment's numbering (``-1``: host memory, or a slot this plan loads first); the same
            as ``src_slot`` but across a deployment change, where a shrinking GPU's given-up slots
            are read too (``src_slot`` -1).

    Run the copies in the order of :attr:`phase` (:meth:`ordered` gives the three steps): every
    ``"copy"`` at once (all sources read before any destination is written), then every ``"load"``,
    then every ``"after_load"`` copy; see the module docstring for why no other order is right.
    """

    layer: np.ndarray
    expert: np.ndarray
    src_slot: np.ndarray
    dst_slot: np.ndarray
    src_gpu: np.ndarray
    dst_gpu: np.ndarray
    kind: np.ndarray
    num_layers: int
    topology: Topology
    expert_bytes: int | None = None
    layers: tuple = field(default=None)
    after_load: np.ndarray = field(default=None)
    src_old_slot: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.layers is None:
            object.__setattr__(self, "layers", (0, self.num_layers))
        if self.after_load is None:
            object.__setattr__(self, "after_load", np.zeros(np.shape(self.layer), bool))
        if self.src_old_slot is None:
            object.__setattr__(self, "src_old_slot", np.asarray(self.src_slot))
        layer = np.asarray(self.layer)
        if layer.ndim == 1 and layer.size and not bool(np.all(layer[1:] >= layer[:-1])):
            order = np.argsort(layer, kind="stable")  # copies in layer order: chunks are slices
            for name in _FIELDS:
                object.__setattr__(self, name, np.asarray(getattr(self, name))[order])

    def __len__(self) -> int:
        return int(self.layer.size)

    @property
    def phase(self) -> np.ndarray:
        """``[C]`` int64, the step each copy runs in: 0 ``"copy"`` (reads the placement in service;
        all at once, every source read before any destination is written), 1 ``"load"`` (from host
        memory), 2 ``"after_load"`` (reads a slot step 1 filled). :data:`PHASES` names them."""
        return np.where(self.kind == FROM_HOST, LOAD, np.where(self.after_load, AFTER_LOAD, COPY)).astype(np.int64)

    def ordered(self) -> list[tuple[str, "TransferPlan"]]:
        """The plan as its three steps, in the order to run them: ``[("copy", plan), ("load",
        plan), ("after_load", plan)]``, each a :class:`TransferPlan` of that step's copies (in layer
        order; empty when the step has none). Run ``"copy"`` as one bulk step (read every source,
        then write every destination: a destination may be another copy's source), then the loads,
        then the copies that read them (either in any order)."""
        phase = self.phase
        steps = []
        for index, name in enumerate(PHASES):
            keep = phase == index
            part = object.__new__(TransferPlan)
            for field_name in _FIELDS:
                object.__setattr__(part, field_name, getattr(self, field_name)[keep])
            for field_name in ("num_layers", "topology", "expert_bytes", "layers"):
                object.__setattr__(part, field_name, getattr(self, field_name))
            steps.append((name, part))
        return steps

    # -- totals ----------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Copies of each kind: ``{"intra_gpu", "intra_node", "cross_node", "from_host", "total"}``."""
        per_kind = np.bincount(self.kind, minlength=len(KINDS))
        result = {name: int(per_kind[i]) for i, name in enumerate(KINDS)}
        result["total"] = len(self)
        return result

    def bytes(self) -> dict[str, int]:
        """Bytes of each kind (copies times ``expert_bytes``); needs ``expert_bytes``."""
        if self.expert_bytes is None:
            raise ValueError("expert_bytes is unknown: pass expert_bytes= to transfer_plan")
        return {name: count * self.expert_bytes for name, count in self.counts().items()}

    def sends_per_gpu(self) -> np.ndarray:
        """``[L, G]`` int64: copies each GPU sends to another GPU, per layer."""
        out = np.zeros((self.num_layers, self.topology.num_gpus), np.int64)
        remote = (self.kind == INTRA_NODE) | (self.kind == CROSS_NODE)
        np.add.at(out, (self.layer[remote], self.src_gpu[remote]), 1)
        return out

    def receives_per_gpu(self) -> np.ndarray:
        """``[L, G]`` int64: copies each GPU receives from another GPU or host memory, per layer."""
        out = np.zeros((self.num_layers, self.topology.num_gpus), np.int64)
        remote = self.kind != INTRA_GPU
        np.add.at(out, (self.layer[remote], self.dst_gpu[remote]), 1)
        return out

    def summary(self) -> dict:
        """Counts (and bytes when known) of each kind, and the busiest sender's copies in a layer."""
        result = {"copies": self.counts()}
        if self.expert_bytes is not None:
            result["bytes"] = self.bytes()
        sends = self.sends_per_gpu()
        result["max_sends_per_gpu_layer"] = int(sends.max()) if sends.size else 0
        return result

    # -- views -----------------------------------------------------------------------------------
    def for_layers(self, start: int, stop: int) -> "TransferPlan":
        """The copies of layers ``start <= layer < stop`` (views of this plan's arrays)."""
        lo, hi = np.searchsorted(self.layer, (start, stop)).tolist()
        return self._slice(lo, hi, (int(start), int(stop)))

    def _slice(self, lo: int, hi: int, layers: tuple[int, int]) -> "TransferPlan":
        """Copies ``lo:hi`` as a plan of ``layers``: views, built without :meth:`__post_init__`
        (a slice of copies in layer order is in layer order; no NumPy call, so no GIL hand-over)."""
        part = object.__new__(TransferPlan)
        for name in _FIELDS:
            object.__setattr__(part, name, getattr(self, name)[lo:hi])
        for name, value in (("num_layers", self.num_layers), ("topology", self.topology),
                            ("expert_bytes", self.expert_bytes), ("layers", layers)):
            object.__setattr__(part, name, value)
        return part

    def chunks(self, layers_per_chunk: int) -> list["TransferPlan"]:
        """Split into consecutive chunks of ``layers_per_chunk`` layers, so an engine can apply a
        rebalance over several steps (one chunk per step). The copies are kept in layer order, so
        the chunks' arrays are views of this plan's, found by one search: microseconds on the
        engine's thread, where masking every field of every chunk took milliseconds beside a busy
        Python thread (each large NumPy call may hand it the GIL for a switch interval)."""
        size = as_int(layers_per_chunk, "layers_per_chunk", minimum=1)
        starts = list(range(0, self.num_layers, size))
        stops = [min(start + size, self.num_layers) for start in starts]
        edges = np.searchsorted(self.layer, starts + stops[-1:]).tolist()
        return [self._slice(lo, hi, (start, stop)) for start, stop, lo, hi in zip(starts, stops, edges[:-1], edges[1:])]

    def to_dict(self) -> dict:
        """JSON-ready: one list per field and ``phase`` (the step of each copy, :data:`PHASES` in
        ``phases``: run them in that order), plus the totals."""
        data = {name: getattr(self, name).tolist() for name in _FIELDS}
        data.update(phase=self.phase.tolist(), phases=list(PHASES))
        data.update(num_layers=self.num_layers, layers=list(self.layers), expert_bytes=self.expert_bytes,
                    topology=self.topology.to_dict(), totals=self.summary())
        return data


def _topology_and_experts(deployment, deprecated: dict, placements: list) -> tuple[Topology, int | None]:
    """The topology and ``E`` a :func:`transfer_plan` reads its arrays with (``E`` None: from the arrays)."""
    unknown = sorted(set(deprecated) - {"topology", "num_experts"})
    if unknown:
        raise TypeError(f"transfer_plan() got unexpected keyword argument(s) {', '.join(unknown)}")
    if deprecated:
        if deployment is not None:
            raise ValueError("transfer_plan: give the deployment or the deprecated topology=/num_experts=, not both")
        warnings.warn("transfer_plan: topology= and num_experts= are deprecated; pass the deployment "
                      "(eplb.Deployment.of(num_experts, topology=...))", DeprecationWarning, stacklevel=3)
        topology = deprecated.get("topology") or (placements[0].topology if placements else None)
        if topology is None:
            raise ValueError("the deployment is required when old and new are arrays")
        experts = deprecated.get("num_experts")
        return topology, (placements[0].num_experts if experts is None and placements else experts)
    if deployment is None:
        if not placements:
            raise ValueError("the deployment is required when old and new are arrays")
        return placements[0].topology, placements[0].num_experts
    if not isinstance(deployment, Deployment):
        raise ValueError(f"deployment must be an eplb.Deployment, got {type(deployment).__name__}")
    return deployment.topology, deployment.num_experts


def transfer_plan(old, new, deployment: Deployment | DeploymentChange | None = None, *,
                  expert_bytes: int | None = None, gpu_map=None, **deprecated) -> TransferPlan:
    """The weight copies from placement ``old`` to placement ``new``.

    Args:
        old, new: :class:`Placement` objects, or ``phy2log [L, S]`` arrays (then ``deployment`` is
            required: its topology and number of experts read the arrays). Both on the same
            topology with the same number of layers, unless across a deployment change.
        deployment: an :class:`eplb.Deployment`; by default the placements'. The keywords
            ``topology=`` and ``num_experts=`` still work, deprecated. Or an
            :class:`eplb.DeploymentChange`: ``old`` is on its old deployment, ``new`` on its new one.
        expert_bytes: bytes of one expert's weights in one layer, for :meth:`TransferPlan.bytes`.
        gpu_map: with placements on two deployments, the new index of each old GPU (``-1``: gone),
            as :func:`eplb.plan` takes it; ``None``: the one ``new`` was planned with (a plan across
            a change carries it in ``info["gpu_map"]``), else by index. A ``gpu_map`` (or a
            change) other than the one ``new`` was planned with is refused.
    Returns:
        A :class:`TransferPlan` (on the new deployment across a change).
    """
    change = _change_of(old, new, deployment, gpu_map, deprecated)
    if change is not None:
        return _transfer_across(old, new, change, expert_bytes)
    if isinstance(deployment, DeploymentChange):  # one that changes nothing
        deployment = deployment.new
    placements = [p for p in (old, new) if isinstance(p, Placement)]
    topology, num_experts = _topology_and_experts(deployment, deprecated, placements)
    if any(p.topology != topology for p in placements):
        raise ValueError("old and new must be placements on the same topology")
    if num_experts is None:
        num_experts = int(max(np.max(old), np.max(new))) + 1
    arrays = []
    for name, p in (("old", old), ("new", new)):
        if isinstance(p, Placement) and p.num_experts == num_experts:
            arrays.append(p.phy2log)  # checked when the Placement was built (C-contiguous int64)
            continue
        array = p.phy2log if isinstance(p, Placement) else p
        try:
            array, _ = check_placement(np.asarray(array), num_experts, topology)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        arrays.append(np.ascontiguousarray(array))
    if arrays[0].shape != arrays[1].shape:
        raise ValueError(f"old and new must have the same shape, got {arrays[0].shape} and {arrays[1].shape}")
    if expert_bytes is not None:
        expert_bytes = as_int(expert_bytes, "expert_bytes", minimum=0)
    copies, kind = weight_copies(arrays[0], arrays[1], topology.gpu_of_slot, topology.node_of_gpu,
                                 topology.num_gpus, num_experts)
    return TransferPlan(
        layer=copies[:, 0], expert=copies[:, 1], src_slot=copies[:, 2], dst_slot=copies[:, 3],
        src_gpu=copies[:, 4], dst_gpu=copies[:, 5], kind=kind, num_layers=arrays[0].shape[0],
        topology=topology, expert_bytes=expert_bytes,
    )


def _change_of(old, new, deployment, gpu_map, deprecated: dict) -> DeploymentChange | None:
    """The deployment change between ``old`` and ``new`` (``None``: the same deployment). A
    placement planned across a change carries its ``gpu_map`` (``info["gpu_map"]``): used when none
    is given, and one that differs from it is refused (issue 47 item 20: GPUs were paired by index)."""
    planned = new.info.get("gpu_map") if isinstance(new, Placement) else None
    if isinstance(deployment, DeploymentChange):
        if gpu_map is not None or deprecated:
            raise ValueError("transfer_plan: give gpu_map in the DeploymentChange, not beside it")
        _check_planned_map(planned, deployment.gpu_map)
        return None if deployment.is_identity else deployment
    both = isinstance(old, Placement) and isinstance(new, Placement)
    if both and planned is not None and len(planned) == old.topology.num_gpus:
        if gpu_map is None:
            gpu_map = planned
        else:
            _check_planned_map(planned, gpu_map)
    if not both or (gpu_map is None and old.topology == new.topology):
        if gpu_map is not None:
            raise ValueError("transfer_plan: gpu_map needs old and new as eplb.Placement (they carry their "
                             "deployments), or deployment=eplb.DeploymentChange(old, new, gpu_map)")
        return None
    change = DeploymentChange(old.deployment, new.deployment, gpu_map)
    return None if change.is_identity else change


def _check_planned_map(planned, gpu_map) -> None:
    """``ValueError`` when ``new`` was planned with another ``gpu_map`` than the one given."""
    if planned is None:
        return
    given = np.asarray(gpu_map).tolist()
    if list(planned) != given:
        raise ValueError(f"transfer_plan: new was planned with gpu_map={list(planned)!r:.200}, not {given!r:.200}: "
                         "its copies would pair other GPUs")


def _transfer_across(old, new, change: DeploymentChange, expert_bytes) -> TransferPlan:
    """:func:`transfer_plan` across ``change``: ``old`` on ``change.old``, ``new`` on ``change.new``."""
    num_experts = change.new.num_experts
    arrays = []
    for name, p, side in (("old", old, change.old), ("new", new, change.new)):
        array = p.phy2log if isinstance(p, Placement) else p
        try:
            array, _ = check_placement(np.asarray(array), num_experts, side.topology)
        except ValueError as exc:
            raise ValueError(f"{name} (on the {name} deployment of the change): {exc}") from None
        arrays.append(np.ascontiguousarray(array, dtype=np.int64))
    if arrays[0].shape[0] != arrays[1].shape[0]:
        raise ValueError(f"old and new must have the same layers, got {arrays[0].shape[0]} and {arrays[1].shape[0]}")
    if expert_bytes is not None:
        expert_bytes = as_int(expert_bytes, "expert_bytes", minimum=0)
    topology = change.new.topology
    new_gpu = np.where(change.surviving, change.gpu_map, -1)  # [G_old] where each old GPU's weights are read
    copies, kind = copies_across(change.carry(arrays[0]), arrays[1], change.given_up(arrays[0]),
                                 np.ascontiguousarray(new_gpu[change.old.topology.gpu_of_slot]),
                                 np.ascontiguousarray(change.slot_map), topology.gpu_of_slot, topology.node_of_gpu,
                                 topology.num_gpus, num_experts)
    return TransferPlan(
        layer=copies[:, 0], expert=copies[:, 1], src_slot=copies[:, 2], dst_slot=copies[:, 3],
        src_gpu=copies[:, 4], dst_gpu=copies[:, 5], kind=kind, num_layers=arrays[0].shape[0],
        topology=topology, expert_bytes=expert_bytes, after_load=copies[:, 6].astype(bool),
        src_old_slot=copies[:, 7],
    )


__all__ = ["TransferPlan", "transfer_plan", "INTRA_GPU", "INTRA_NODE", "CROSS_NODE", "FROM_HOST", "PHASES",
           "COPY", "LOAD", "AFTER_LOAD"]
