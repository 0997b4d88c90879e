"""The result type: a replicated expert placement for every layer, with its diagnostics."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from . import metrics
from ._validation import as_counts
from .kernels.layout import replica_counts, slots_of_experts
from .topology import Topology

FORMAT_VERSION = 1


def build_log2phy(phy2log: np.ndarray, num_experts: int, width: int | None = None) -> np.ndarray:
    """The slots of each expert, in increasing slot order, padded with ``-1``.

    Args:
        phy2log: ``[L, S]`` int64, every id in ``[0, E)``.
        width: ``R``; defaults to the largest replica count. Must hold every expert's replicas.
    Returns:
        ``[L, E, R]`` int64.
    """
    # writable C int64 (a frozen Placement's array is read-only): one compiled specialization per kernel
    phy2log = np.require(phy2log, dtype=np.int64, requirements="CW")
    needed = int(replica_counts(phy2log, num_experts).max())
    if width is None:
        width = needed
    elif width < needed:
        raise ValueError(f"width must be >= the largest replica count ({needed}), got {width}")
    return slots_of_experts(phy2log, num_experts, width)


def check_placement(phy2log: np.ndarray, num_experts: int, topology: Topology) -> np.ndarray:
    """Validate a ``phy2log [L, S]`` array; return it as int64 with the replica counts ``[L, E]``."""
    phy2log = np.asarray(phy2log)
    if phy2log.ndim != 2:
        raise ValueError(f"phy2log must have shape [L, S], got shape {phy2log.shape}")
    if phy2log.shape[1] != topology.num_slots:
        raise ValueError(f"phy2log must have {topology.num_slots} slots per layer, got {phy2log.shape[1]}")
    if not np.issubdtype(phy2log.dtype, np.integer):
        raise ValueError(f"phy2log must hold integer expert ids, got dtype {phy2log.dtype}")
    phy2log = phy2log.astype(np.int64)
    if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= num_experts):
        raise ValueError(f"phy2log must hold expert ids in [0, {num_experts}), found {phy2log.min()}..{phy2log.max()}")
    logcnt = replica_counts(np.ascontiguousarray(phy2log), num_experts)
    missing = np.argwhere(logcnt == 0)
    if missing.size:
        layer, expert = missing[0]
        raise ValueError(f"every expert needs a replica in every layer: expert {expert} has none in layer {layer}")
    return phy2log, logcnt


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.setflags(write=False)
    return array


class _Lazy:
    """A ``[L]`` float64 diagnostic field of :class:`Placement`: an array, ``None``, or a
    zero-argument callable evaluated on first access (then cached, read-only)."""

    def __set_name__(self, owner, name):
        self.name = name
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__.get(self.slot)
        if callable(value):
            value = _frozen(np.asarray(value(), dtype=np.float64))
            obj.__dict__[self.slot] = value
        return value

    def __set__(self, obj, value):
        if value is not None and not callable(value):
            value = _frozen(np.asarray(value, dtype=np.float64))
        obj.__dict__[self.slot] = value


@dataclass(frozen=True, eq=False)
class Placement:
    """A replicated placement of ``E`` experts into ``S`` slots, for ``L`` layers.

    Attributes:
        phy2log: ``[L, S]`` int64, the logical expert held by each physical slot.
        log2phy: ``[L, E, R]`` int64, the slots holding each expert (increasing), padded with ``-1``.
        logcnt: ``[L, E]`` int64, replicas per expert (``>= 1``, summing to ``S`` per layer).
        topology: slots per GPU and GPUs per node.
        num_groups: expert groups the plan kept on one node each, or ``None``.
        method: the method that produced it.
        lower_bound: ``[L]`` proven lower bound on the max GPU load for the counts it was planned
            on (``None`` when built from arrays alone). :func:`eplb.plan` computes it on first
            access (the constructor also takes a zero-argument callable returning it).
        max_load: ``[L]`` the max GPU load it reaches on those counts (``None`` likewise; an
            array or a callable, as ``lower_bound``).
        info: method diagnostics (time, proven optimality, ...).
    """

    phy2log: np.ndarray
    num_experts: int
    topology: Topology
    num_groups: int | None = None
    method: str = "unknown"
    lower_bound: np.ndarray | None = _Lazy()
    max_load: np.ndarray | None = _Lazy()
    info: Mapping[str, Any] = field(default_factory=dict)
    logcnt: np.ndarray = field(init=False, repr=False)
    log2phy: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        phy2log, logcnt = check_placement(self.phy2log, self.num_experts, self.topology)
        object.__setattr__(self, "phy2log", _frozen(phy2log))
        object.__setattr__(self, "logcnt", _frozen(logcnt))
        object.__setattr__(self, "log2phy", _frozen(build_log2phy(phy2log, self.num_experts)))
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    # -- shape ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.topology.num_slots

    @property
    def num_gpus(self) -> int:
        return self.topology.num_gpus

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    # -- quality -------------------------------------------------------------------------------
    @property
    def gap(self) -> np.ndarray | None:
        """``[L]``: ``max_load / lower_bound - 1`` on the planning counts (``None`` if unknown;
        computes the lower bound on first access)."""
        if self.lower_bound is None or self.max_load is None:
            return None
        return metrics.gap(self.max_load, self.lower_bound)

    def _check_counts(self, counts) -> np.ndarray:
        counts = as_counts(counts, ndims=(2, 3))
        if counts.shape[-2:] != (self.num_layers, self.num_experts):
            raise ValueError(
                f"counts must have shape [L, E] = [{self.num_layers}, {self.num_experts}] "
                f"(or [T, L, E]), got {counts.shape}"
            )
        return counts

    def gpu_loads(self, counts) -> np.ndarray:
        """Tokens each GPU processes: ``counts [L, E] -> [L, G]`` (``[T, L, E] -> [T, L, G]``)."""
        return metrics.gpu_loads(self._check_counts(counts), self.phy2log, self.logcnt, self.topology)

    def balancedness(self, counts) -> np.ndarray:
        """``mean / max`` GPU load per layer: ``[L]`` (``[T, L]`` for a series)."""
        return metrics.balancedness(self.gpu_loads(counts))

    def replicas_sharing_a_gpu(self) -> np.ndarray:
        """``[L]``: slots spent on a second replica of an expert already on that GPU."""
        return metrics.replicas_sharing_a_gpu(self.phy2log, self.topology)

    def padded_log2phy(self, width: int) -> np.ndarray:
        """``log2phy`` padded with ``-1`` to a fixed replica width ``R`` (``[L, E, R]``)."""
        return build_log2phy(self.phy2log, self.num_experts, width)

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-ready dict; :meth:`from_dict` restores an equal placement."""
        optional = lambda a: None if a is None else a.tolist()  # noqa: E731
        return {
            "format_version": FORMAT_VERSION,
            "phy2log": self.phy2log.tolist(),
            "num_experts": self.num_experts,
            "topology": self.topology.to_dict(),
            "num_groups": self.num_groups,
            "method": self.method,
            "lower_bound": optional(self.lower_bound),
            "max_load": optional(self.max_load),
            "info": _jsonable(dict(self.info)),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Placement":
        """Rebuild (and re-validate) a placement written by :meth:`to_dict`."""
        try:
            version = data.get("format_version", FORMAT_VERSION)
            if version != FORMAT_VERSION:
                raise ValueError(f"unsupported placement format_version {version!r}")
            return cls(
                phy2log=np.asarray(data["phy2log"], dtype=np.int64),
                num_experts=int(data["num_experts"]),
                topology=Topology.from_dict(data["topology"]),
                num_groups=data.get("num_groups"),
                method=data.get("method", "unknown"),
                lower_bound=data.get("lower_bound"),
                max_load=data.get("max_load"),
                info=data.get("info") or {},
            )
        except KeyError as exc:
            raise ValueError(f"placement dict is missing the key {exc}") from None

    def __eq__(self, other):
        return (
            isinstance(other, Placement)
            and self.num_experts == other.num_experts
            and self.topology == other.topology
            and np.array_equal(self.phy2log, other.phy2log)
        )

    __hash__ = None


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
