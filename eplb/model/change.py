"""A deployment change: GPUs lost, added or renumbered, slots per GPU changed (model layer).

A :class:`DeploymentChange` is the one value every layer passes about a change: the deployment in
service (``old``), the one to serve next (``new``), and ``gpu_map``, the new index of every old GPU
(``-1``: gone; vLLM's ``rank_mapping``). A surviving GPU keeps the weights it holds: the first
``min(k_old, k_new)`` of its old slots become the first slots of its new index (slot order within a
GPU is kept); the slots a shrinking GPU *gives up* are read during the change (their weights are
still in its memory until the copies are done) and then freed. A GPU mapped to ``-1``, or to a new
GPU with no slots, is *lost*: nothing is read from it; a new GPU that no surviving GPU maps to is
*added* and starts empty.

Carried into the new deployment, the placement in service has *holes* (``-1``: new slots nothing
was carried into) and *missing* experts (no carried slot holds them: every replica was lost or
given up). Every new slot must be filled and every missing expert placed, so a re-plan copies at
least ``max(missing, holes)`` expert weights per layer (:meth:`DeploymentChange.floor`). A missing
expert a surviving GPU gave up is copied from that slot; one with no replica left on a surviving
GPU is an *orphan*, loaded from host memory (:meth:`DeploymentChange.orphans`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._validation import as_int
from .sizes import check_limit
from .deployment import Deployment, make_deployment
from .topology import Topology

HOLE = -1
"""A slot of a carried placement that holds nothing yet."""


@dataclass(frozen=True, eq=False)
class DeploymentChange:
    """The deployment in service, the next one, and where each old GPU went.

    Attributes:
        old, new: :class:`Deployment` values with the same number of experts.
        gpu_map: ``[G_old]`` int64, the new index of each old GPU, ``-1`` for a GPU that is gone
            (default: every GPU keeps its index; old GPUs beyond the new count are gone).
        slot_map: ``[S_new]`` int64, the old slot whose weights each new slot keeps (``-1``: none).
    """

    old: Deployment
    new: Deployment
    gpu_map: np.ndarray = None
    slot_map: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("old", "new"):
            if not isinstance(getattr(self, name), Deployment):
                raise ValueError(f"{name} must be an eplb.Deployment, got {type(getattr(self, name)).__name__}")
        if self.old.num_experts != self.new.num_experts:
            raise ValueError(f"a deployment change keeps the experts: old has {self.old.num_experts}, "
                             f"new has {self.new.num_experts}")
        gpu_map = _checked_gpu_map(self.gpu_map, self.old.num_gpus, self.new.num_gpus)
        old_top, new_top = self.old.topology, self.new.topology
        slot_map = np.full(new_top.num_slots, HOLE, np.int64)
        for g_old, g_new in enumerate(gpu_map.tolist()):
            if g_new < 0:
                continue
            kept = min(int(old_top.slots_per_gpu[g_old]), int(new_top.slots_per_gpu[g_new]))
            start = int(new_top.slot_offsets[g_new])
            slot_map[start:start + kept] = np.arange(old_top.slot_offsets[g_old], old_top.slot_offsets[g_old] + kept)
        gpu_map.setflags(write=False)
        slot_map.setflags(write=False)
        object.__setattr__(self, "gpu_map", gpu_map)
        object.__setattr__(self, "slot_map", slot_map)

    # -- building ------------------------------------------------------------------------------------
    @classmethod
    def lose(cls, old: Deployment, gpus, *, slots_per_gpu=None) -> "DeploymentChange":
        """``old`` with ``gpus`` (old indices) lost: they keep their index with no slots (a masked
        GPU, so nodes keep their GPUs); ``slots_per_gpu``: the survivors' slots (default: theirs).

        ``ValueError`` when an index is out of range or when the survivors' slots cannot hold every
        expert (the message says how many slots per GPU would)."""
        lost = _gpu_list(gpus, "lost GPUs", old.num_gpus)
        slots = old.topology.slots_per_gpu.copy()
        if slots_per_gpu is not None:
            slots_per_gpu = as_int(slots_per_gpu, "slots_per_gpu", minimum=1)
            check_limit(slots_per_gpu, "slots", "slots_per_gpu")  # before a slot table is built (issue 47 item 16)
            survivors = int((slots > 0).sum()) - int((slots[lost] > 0).sum())
            check_limit(slots_per_gpu * survivors, "slots", f"the slots of the {survivors} surviving GPUs")
            slots[slots > 0] = slots_per_gpu
        slots[lost] = 0
        survivors = int((slots > 0).sum())
        if slots.sum() < old.num_experts:
            need = -(-old.num_experts // max(survivors, 1))
            raise ValueError(f"{len(lost)} GPU{'s' if len(lost) != 1 else ''} lost: {int(slots.sum())} slots for "
                             f"{old.num_experts} experts; give the survivors {need} slots per GPU"
                             if survivors else f"every GPU lost: no slot left for {old.num_experts} experts")
        new = make_deployment(old.num_experts, topology=Topology(slots, old.num_nodes), num_groups=old.num_groups,
                              dispatch=old.dispatch)
        return cls(old, new)

    # -- what changed --------------------------------------------------------------------------------
    @property
    def surviving(self) -> np.ndarray:
        """``[G_old]`` bool: old GPUs with slots whose weights carry into a new GPU with slots."""
        old_slots = self.old.topology.slots_per_gpu
        new_slots = np.append(self.new.topology.slots_per_gpu, 0)  # index -1: a lost GPU has none
        return (old_slots > 0) & (self.gpu_map >= 0) & (new_slots[self.gpu_map] > 0)

    @property
    def lost_gpus(self) -> np.ndarray:
        """Old GPUs (indices) that held slots and hold none after the change."""
        return np.flatnonzero((self.old.topology.slots_per_gpu > 0) & ~self.surviving)

    @property
    def added_gpus(self) -> np.ndarray:
        """New GPUs (indices) with slots that no surviving old GPU carries into."""
        reached = np.zeros(self.new.num_gpus, bool)
        reached[self.gpu_map[self.surviving]] = True
        return np.flatnonzero((self.new.topology.slots_per_gpu > 0) & ~reached)

    @property
    def is_identity(self) -> bool:
        """True when nothing changes: the same topology and every GPU keeps its index."""
        return (self.old.topology == self.new.topology
                and np.array_equal(self.gpu_map, np.arange(self.old.num_gpus)))

    @property
    def source_gpu(self) -> np.ndarray:
        """``[G_new]`` int64: the old GPU whose weights each new GPU keeps (``-1``: none)."""
        source = np.full(self.new.num_gpus, -1, np.int64)
        source[self.gpu_map[self.surviving]] = np.flatnonzero(self.surviving)
        return source

    def describe(self) -> str:
        """One line: what was lost and added, and the slots before and after."""
        parts = []
        lost, added = self.lost_gpus, self.added_gpus
        if lost.size:
            parts.append(f"GPU{'s' if lost.size > 1 else ''} {', '.join(map(str, lost.tolist()))} lost")
        if added.size:
            parts.append(f"{added.size} GPU{'s' if added.size > 1 else ''} added")
        old_top, new_top = self.old.topology, self.new.topology
        active = lambda t: int((t.slots_per_gpu > 0).sum())  # noqa: E731
        parts.append(f"{active(new_top)} GPUs with {new_top.num_slots} slots (were {active(old_top)} with "
                     f"{old_top.num_slots})")
        return "; ".join(parts)

    # -- the placement in service, carried ---------------------------------------------------------
    def carry(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L, S_new]`` int64: the old placement ``phy2log [L, S_old]`` in the new slots, with
        :data:`HOLE` where nothing is carried."""
        phy2log = self._old_rows(phy2log)
        carried = np.full((phy2log.shape[0], self.new.num_slots), HOLE, np.int64)
        kept = self.slot_map >= 0
        carried[:, kept] = phy2log[:, self.slot_map[kept]]
        return carried

    def given_up(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L, S_old]`` int64: the expert of each old slot a surviving GPU gives up (it shrank:
        no new slot keeps it), :data:`HOLE` elsewhere. Read during the change, then freed."""
        phy2log = self._old_rows(phy2log)
        read = self.surviving[self.old.topology.gpu_of_slot]
        read[self.slot_map[self.slot_map >= 0]] = False
        return np.where(read[None, :], phy2log, HOLE)

    def missing(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L, E]`` bool: experts no carried slot holds (every replica lost or given up); each
        takes a copy into a new slot."""
        return _present(self.carry(phy2log), self.old.num_experts) == 0

    def orphans(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L, E]`` bool: experts with no replica on a surviving GPU, not even in a slot it gives
        up (every replica was on a lost GPU): their weights come from host memory."""
        return self.missing(phy2log) & (_present(self.given_up(phy2log), self.old.num_experts) == 0)

    def floor(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L]`` int64: the fewest weight copies any re-plan makes per layer: each missing expert
        needs a slot and each hole an expert, one copy each, so ``max(missing, holes)``."""
        carried = self.carry(phy2log)
        missing = (_present(carried, self.old.num_experts) == 0).sum(axis=1)
        return np.maximum((carried == HOLE).sum(axis=1), missing).astype(np.int64)

    def _old_rows(self, phy2log: np.ndarray) -> np.ndarray:
        """``phy2log [L, S_old]`` as int64, checked: integer expert ids in ``[0, E)`` (issue 47 item 18:
        float ids were truncated, negative ones miscounted, ids >= E an IndexError)."""
        if type(phy2log).__module__.split(".")[0] == "torch":
            phy2log = phy2log.detach().cpu().numpy()
        values = np.asarray(phy2log)
        if values.ndim != 2 or values.shape[1] != self.old.num_slots:
            raise ValueError(f"previous must be phy2log [L, {self.old.num_slots}] on the old deployment, "
                             f"got shape {values.shape}")
        if values.size and values.dtype.kind not in "iu":
            raise ValueError(f"previous must hold integer expert ids, got {values.dtype} values such as "
                             f"{values.flat[0].item()!r}")
        num_experts = self.old.num_experts
        if values.size and (values.min() < 0 or values.max() >= num_experts):
            bad = values[(values < 0) | (values >= num_experts)]
            raise ValueError(f"previous must hold expert ids in [0, {num_experts}), got {bad[:5].tolist()}")
        return values.astype(np.int64)


def _present(carried: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E]`` int64 replicas of each expert in ``carried [L, S]`` (holes not counted)."""
    num_layers = carried.shape[0]
    rows = np.repeat(np.arange(num_layers), carried.shape[1]).reshape(carried.shape)
    held = carried >= 0
    out = np.zeros((num_layers, num_experts), np.int64)
    np.add.at(out, (rows[held], carried[held]), 1)
    return out


def _gpu_list(gpus, name: str, num_gpus: int) -> np.ndarray:
    """Distinct GPU indices in ``[0, num_gpus)`` as a sorted int64 array (``ValueError`` otherwise)."""
    values = np.atleast_1d(np.asarray(gpus))
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a list of GPU indices, got {gpus!r:.80}")
    values = values.astype(np.int64)
    if values.size == 0:
        raise ValueError(f"{name} must name at least one GPU")
    if values.min() < 0 or values.max() >= num_gpus:
        raise ValueError(f"{name} must be GPU indices in [0, {num_gpus}), got {values.tolist()}")
    if np.unique(values).size != values.size:
        raise ValueError(f"{name} names a GPU twice: {values.tolist()}")
    return np.sort(values)


def _checked_gpu_map(gpu_map, old_gpus: int, new_gpus: int) -> np.ndarray:
    """``gpu_map`` as ``[G_old]`` int64 (``None``: by index), or a ``ValueError`` naming the rule."""
    if gpu_map is None:
        mapped = np.arange(old_gpus, dtype=np.int64)
        mapped[mapped >= new_gpus] = -1
        return mapped
    if type(gpu_map).__module__.split(".")[0] == "torch":
        gpu_map = gpu_map.detach().cpu().numpy()
    try:
        values = np.asarray(gpu_map)
    except (OverflowError, TypeError, ValueError):
        values = np.asarray(gpu_map, dtype=object)
    if values.ndim != 1 or values.dtype == object or (values.size and values.dtype.kind not in "iu"):
        raise ValueError(f"gpu_map must be a list of integers (the new index of each old GPU, -1: gone), "
                         f"got {gpu_map!r:.80}")
    if values.size != old_gpus:
        raise ValueError(f"gpu_map must give one new index per old GPU: {old_gpus} entries, got {values.size}")
    # compared in their own type: an unsigned 2**64 - 1 is not -1 (issue 47 item 17)
    bad = values[(values >= new_gpus) | ((values < -1) if values.dtype.kind == "i" else False)]
    if bad.size:
        raise ValueError(f"gpu_map entries must be -1 (gone) or new GPU indices in [0, {new_gpus}), got {bad.tolist()}")
    values = values.astype(np.int64)
    kept = values[values >= 0]
    if np.unique(kept).size != kept.size:
        twice = np.unique(kept[np.unique(kept, return_counts=True)[1][np.searchsorted(np.unique(kept), kept)] > 1])
        raise ValueError(f"gpu_map maps two old GPUs to one new GPU ({twice.tolist()})")
    return values
