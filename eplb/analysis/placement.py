"""The result type: a replicated expert placement for every layer, with its diagnostics."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from . import loads, metrics
from ..model._validation import as_counts, as_int
from ..kernels.split.shares import optimal_shares
from ..kernels.plumbing.layout import replica_counts, slots_of_experts
from ..model.deployment import Deployment
from ..model.topology import OnTopology, Topology
from ..engines import DISPATCH_RULES, SCORING, rule_shares

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


def check_shares(shares, phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """Validate ``shares [L, S]`` for ``phy2log [L, S]``: finite, in ``[0, 1]``, summing to 1 per
    expert (within ``1e-9``). Returns them as float64."""
    array = np.asarray(shares, dtype=np.float64)
    if array.shape != phy2log.shape:
        raise ValueError(f"shares must have shape [L, S] = {list(phy2log.shape)}, got {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("shares must be finite")
    if (array < 0).any() or (array > 1 + 1e-12).any():
        raise ValueError("shares must lie in [0, 1]")
    sums = np.zeros((phy2log.shape[0], num_experts))
    np.add.at(sums, (np.arange(phy2log.shape[0])[:, None], phy2log), array)
    worst = np.abs(sums - 1.0).max() if sums.size else 0.0
    if worst > 1e-9:
        raise ValueError(f"shares must sum to 1 over each expert's replicas (off by up to {worst:.3g})")
    return array


DISPATCH_MODES = ("uniform", "shares", "optimal") + tuple(name for name in DISPATCH_RULES if name not in SCORING)
"""``dispatch=`` of the metrics: the even split, the plan's own shares, optimal dispatch, or an
engine's rule by name (:data:`eplb.engines.DISPATCH_RULES`)."""


def _mode(dispatch) -> str:
    """``dispatch`` checked; an engine rule that splits evenly becomes ``"uniform"``."""
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
    return "uniform" if dispatch in DISPATCH_RULES and DISPATCH_RULES[dispatch].kind == "uniform" else dispatch


def uniform_shares(phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """``[L, S]`` float64: ``1 / logcnt`` of each slot's expert, the even split engines use
    (``phy2log [L, S]``, ``logcnt [L, E]``)."""
    return 1.0 / np.take_along_axis(np.asarray(logcnt, dtype=np.float64), np.asarray(phy2log), axis=1)


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
class Placement(OnTopology):
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
        shares: ``[L, S]`` float64, the fraction of its expert's tokens each slot takes (summing
            to 1 over an expert's replicas), or ``None`` for the even split ``1 / logcnt`` that
            engines use by default. Plans with ``max_off_node`` set them.
        home_node: ``[L, K]`` int64, the home node of each expert group (hierarchical plans), or ``None``.
        dispatch: the dispatch rule it was planned for (:data:`DISPATCH_MODES` but ``"shares"``:
            ``"uniform"``, ``"optimal"`` or an engine's rule; :func:`eplb.plan` records its
            ``dispatch=``). The metrics judge under it unless given ``dispatch=``.
    """

    phy2log: np.ndarray
    num_experts: int
    topology: Topology
    num_groups: int | None = None
    method: str = "unknown"
    lower_bound: np.ndarray | None = _Lazy()
    max_load: np.ndarray | None = _Lazy()
    info: Mapping[str, Any] = field(default_factory=dict)
    shares: np.ndarray | None = field(default=None, repr=False)
    home_node: np.ndarray | None = field(default=None, repr=False)
    dispatch: str = "uniform"
    logcnt: np.ndarray = field(init=False, repr=False)
    log2phy: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        phy2log, logcnt = check_placement(self.phy2log, self.num_experts, self.topology)
        object.__setattr__(self, "phy2log", _frozen(phy2log))
        object.__setattr__(self, "logcnt", _frozen(logcnt))
        object.__setattr__(self, "log2phy", _frozen(build_log2phy(phy2log, self.num_experts)))
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))
        if self.dispatch not in DISPATCH_MODES or self.dispatch == "shares":
            raise ValueError(f"dispatch must be the rule the placement was planned for, one of "
                             f"{tuple(m for m in DISPATCH_MODES if m != 'shares')}, got {self.dispatch!r}")
        if self.shares is not None:
            object.__setattr__(self, "shares", _frozen(check_shares(self.shares, phy2log, self.num_experts)))
        if self.num_groups is not None:
            object.__setattr__(self, "num_groups", as_int(self.num_groups, "num_groups", minimum=1))
        if self.home_node is not None:
            home = np.asarray(self.home_node)
            groups = self.num_groups
            if groups is not None and self.num_experts % groups:
                raise ValueError(f"num_groups ({groups}) must divide the number of experts ({self.num_experts}) "
                                 "when home_node is given: group g is experts g*E/K ... (g+1)*E/K - 1")
            if groups is None or home.shape != (phy2log.shape[0], groups) or not np.issubdtype(home.dtype, np.integer):
                raise ValueError(f"home_node must be an integer array [L, num_groups] = [{phy2log.shape[0]}, {groups}], "
                                 f"got {home.dtype} {home.shape}")
            if home.size and (home.min() < 0 or home.max() >= self.topology.num_nodes):
                raise ValueError(f"home_node must hold node ids in [0, {self.topology.num_nodes})")
            object.__setattr__(self, "home_node", _frozen(home.astype(np.int64)))

    # -- shape ---------------------------------------------------------------------------------
    @property
    def deployment(self) -> Deployment:
        """The :class:`~eplb.model.deployment.Deployment` it was planned for: its experts,
        topology, the groups it kept on one node each, and the dispatch rule its metrics judge
        under."""
        return Deployment(self.num_experts, self.topology, self.num_groups, self.num_groups is not None,
                          self.dispatch)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

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

    def _judge(self, dispatch: str | None, otherwise: str) -> str:
        """The rule a metric judges under: ``dispatch`` when given, else the rule the placement was
        planned for (:attr:`dispatch`), else ``otherwise`` (the metric's own default)."""
        if dispatch is not None:
            return dispatch
        return self.dispatch if _mode(self.dispatch) != "uniform" else otherwise

    def slot_shares(self, counts=None, dispatch: str | None = None) -> np.ndarray:
        """The fraction of its expert's tokens each slot takes: ``[L, S]`` (``[T, L, S]`` for
        optimal dispatch of a series).

        ``dispatch``: ``"uniform"`` (``1 / logcnt``, what engines do unless told), ``"shares"`` (the
        plan's :attr:`shares`; uniform when it has none), ``"optimal"`` (the split that minimises
        each layer's max GPU load for ``counts``, exact: :func:`eplb.analysis.dispatch.dispatch`) or an
        engine's rule: ``"vllm"``, ``"tensorrt-llm"`` (even split), ``"sglang-static"``,
        ``"sglang-dynamic"`` (:func:`eplb.analysis.engine_dispatch.engine_shares`; the same slots on every GPU).
        ``None``: the rule the placement was planned for (:attr:`dispatch`), else ``"shares"``.
        """
        dispatch = _mode(self._judge(dispatch, "shares"))
        if dispatch in DISPATCH_RULES and DISPATCH_RULES[dispatch].kind == "engine":
            return rule_shares(self.phy2log, self.num_experts, self.topology, dispatch)
        if dispatch == "optimal":
            if counts is None:
                raise ValueError("dispatch='optimal' needs counts")
            weights = self._check_counts(counts)
            flat = weights.reshape(-1, self.num_experts)
            phy2log = np.tile(self.phy2log, (flat.shape[0] // self.num_layers, 1))
            shares, _ = optimal_shares(np.ascontiguousarray(flat), phy2log, self.topology.gpu_of_slot,
                                       self.topology.num_gpus)
            return shares.reshape(weights.shape[:-1] + (self.num_slots,))
        if dispatch == "shares" and self.shares is not None:
            return self.shares
        return uniform_shares(self.phy2log, self.logcnt)

    def gpu_loads(self, counts, dispatch: str | None = None) -> np.ndarray:
        """Tokens each GPU processes: ``counts [L, E] -> [L, G]`` (``[T, L, E] -> [T, L, G]``), with
        each expert's tokens split among its replicas as ``dispatch`` says (:meth:`slot_shares`:
        e.g. ``"sglang-static"`` judges the placement under SGLang's static table). ``None``: the
        rule the placement was planned for (:attr:`dispatch`; the even split for most plans)."""
        weights = self._check_counts(counts)
        dispatch = _mode(self._judge(dispatch, "uniform"))
        if dispatch == "uniform" or (dispatch == "shares" and self.shares is None):
            return loads.gpu_loads(weights, self.phy2log, self.topology, logcnt=self.logcnt)
        return loads.gpu_loads(weights, self.phy2log, self.topology, shares=self.slot_shares(weights, dispatch))

    def balancedness(self, counts, dispatch: str | None = None) -> np.ndarray:
        """``mean / max`` GPU load per layer over the GPUs that hold slots: ``[L]`` (``[T, L]`` for
        a series); ``dispatch`` as in :meth:`gpu_loads`."""
        return metrics.balancedness(self.gpu_loads(counts, dispatch), self.topology)

    def off_node_fraction(self, counts, dispatch: str | None = None) -> np.ndarray:
        """``[L]`` (``[T, L]``): the fraction of each layer's tokens served by a replica outside its
        group's home node, with ``dispatch`` as in :meth:`gpu_loads`. Needs :attr:`home_node`."""
        if self.home_node is None:
            raise ValueError("off_node_fraction needs a placement with home nodes (a hierarchical plan)")
        weights = self._check_counts(counts)
        shares = self.slot_shares(weights, self._judge(dispatch, "shares"))
        size = self.num_experts // self.num_groups
        node_of_slot = self.topology.node_of_gpu[self.topology.gpu_of_slot]
        away = node_of_slot[None, :] != np.take_along_axis(self.home_node, self.phy2log // size, axis=1)
        served = loads.slot_loads(weights, self.phy2log, shares=shares)
        total = weights.sum(axis=-1)
        return (served * away).sum(axis=-1) / np.where(total > 0, total, 1.0)

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
            "shares": optional(self.shares),
            "home_node": optional(self.home_node),
            "dispatch": self.dispatch,
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
                shares=data.get("shares"),
                home_node=data.get("home_node"),
                dispatch=data.get("dispatch", "uniform"),
            )
        except KeyError as exc:
            raise ValueError(f"placement dict is missing the key {exc}") from None

    def __getstate__(self) -> dict:
        """What pickle and :func:`copy.deepcopy` carry: every field, with a lazy ``lower_bound`` or
        ``max_load`` evaluated (it is a closure over the planning counts, which pickle cannot
        carry; both cost milliseconds once compiled) and ``info`` as a plain dict."""
        state = dict(self.__dict__)
        for name in ("lower_bound", "max_load"):
            state["_" + name] = getattr(self, name)
        state["info"] = dict(self.info)
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore :meth:`__getstate__`'s fields: arrays read-only and ``info`` read-only again, as
        the constructor leaves them (the state comes from a placement that was validated)."""
        state = {key: _frozen(value) if isinstance(value, np.ndarray) else value for key, value in state.items()}
        state["info"] = MappingProxyType(dict(state["info"]))
        self.__dict__.update(state)

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
