"""The deployment: the one value every layer passes about where experts may live and how the
engine serves them (model layer).

A :class:`Deployment` says how many logical experts a layer has, where the slots are (a
:class:`~eplb.model.topology.Topology`: slots per GPU, GPUs per node), how experts are grouped,
whether every group stays on one node, and the engine's dispatch rule (how it splits an expert's
tokens among its replicas). Methods plan under it, a :class:`eplb.Placement` carries it, and its
metrics judge under its rule.

:meth:`Deployment.of` (and :func:`make_deployment`) validates a configuration and applies the
published group rule: placement is hierarchical (every expert group on one node) when ``num_groups``
is a multiple of ``num_nodes``; otherwise it is global and the groups are ignored, as in DeepSeek's
published ``rebalance_experts``.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import numpy as np

from ._validation import as_int
from .sizes import check_limit
from .topology import OnTopology, Topology


def slots_for(num_experts: int, num_gpus: int, extra_slots_per_gpu: int) -> int:
    """Slots of a deployment: the fewest whole slots per GPU that hold every expert, plus ``extra``."""
    return num_gpus * (-(-num_experts // num_gpus) + extra_slots_per_gpu)


@dataclass(frozen=True)
class Deployment(OnTopology):
    """Where the experts of one model may live and how the engine serves them.

    Attributes:
        num_experts: ``E`` logical experts per layer.
        topology: slots per GPU, GPUs per node (``S`` slots, ``G`` GPUs, ``N`` nodes).
        num_groups: expert groups (experts ``g*E/K ... (g+1)*E/K - 1`` form group ``g``), or None
            (no groups, or groups ignored because ``num_groups % num_nodes != 0``).
        hierarchical: keep every group (and its replicas) on one node; set when ``num_groups`` is a
            multiple of ``num_nodes`` (the published rule), else the placement is global.
        dispatch: the engine's dispatch rule, a name of
            :data:`eplb.engines.DISPATCH_RULES` (``"uniform"``: an even split), checked where the rule
            is used (the rules are the engines', a layer above this one).
    """

    num_experts: int
    topology: Topology
    num_groups: int | None = None
    hierarchical: bool = False
    dispatch: str = "uniform"

    @classmethod
    def of(cls, num_experts: int, *, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None,
           topology: Topology | None = None, dispatch: str = "uniform") -> "Deployment":
        """A validated deployment (:func:`make_deployment` with keywords), e.g.
        ``Deployment.of(256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)``."""
        return make_deployment(num_experts, num_slots, num_gpus, num_nodes, num_groups, topology, dispatch=dispatch)

    @classmethod
    def grid(cls, num_experts: int, *, num_gpus, extra_slots_per_gpu=(0, 1, 2), num_nodes=(1,), num_groups=None,
             dispatch=("uniform",)) -> list["Deployment"]:
        """Every deployment of a what-if grid (for :func:`eplb.sweep`), in the order of the axes' product.

        Each combination of ``extra_slots_per_gpu`` (``x >= 0``: ``S = G * (ceil(E / G) + x)`` slots),
        ``num_gpus`` (``G``), ``num_nodes`` and ``dispatch`` (rule names) is one deployment; a pair
        whose GPUs do not divide by the nodes is skipped. ``num_groups`` (one value) keeps every
        group on one node where the groups divide by the nodes (the published rule). ``ValueError``
        naming the axis when one is empty or no pair is left."""
        experts = as_int(num_experts, "num_experts", minimum=1)
        axes = {"extra_slots_per_gpu": extra_slots_per_gpu, "num_gpus": num_gpus, "num_nodes": num_nodes,
                "dispatch": dispatch}
        for name, values in axes.items():
            if isinstance(values, (str, int, np.integer)) or not len(values):
                raise ValueError(f"{name} must be a non-empty list of values, got {values!r}")
        extras = [as_int(x, "extra_slots_per_gpu entry", minimum=0) for x in extra_slots_per_gpu]
        gpus = [as_int(g, "num_gpus entry", minimum=1) for g in num_gpus]
        nodes = [as_int(n, "num_nodes entry", minimum=1) for n in num_nodes]
        grid = [cls.of(experts, num_slots=slots_for(experts, g, x), num_gpus=g, num_nodes=n, num_groups=num_groups,
                       dispatch=d)
                for x, g, n, d in itertools.product(extras, gpus, nodes, dispatch) if g % n == 0]
        if not grid:
            raise ValueError("no deployment left: the GPUs must divide by the nodes in at least one pair")
        return grid

    def with_slots(self, num_slots: int) -> "Deployment":
        """The same GPUs, nodes, groups and rule with ``num_slots`` slots (a uniform topology only)."""
        if not self.topology.is_uniform:
            raise ValueError("with_slots needs a uniform topology (the same slots on every GPU)")
        return make_deployment(self.num_experts, num_slots, self.num_gpus, self.num_nodes, self.num_groups,
                               dispatch=self.dispatch)

    @property
    def extra_slots_per_gpu(self) -> int:
        """Slots per GPU beyond the fewest whole slots per GPU that hold every expert (a uniform topology)."""
        return (self.num_slots - slots_for(self.num_experts, self.num_gpus, 0)) // self.num_gpus

    def to_dict(self) -> dict:
        """A JSON-ready description (the topology as :meth:`Topology.to_dict`)."""
        return {"num_experts": self.num_experts, "topology": self.topology.to_dict(), "num_groups": self.num_groups,
                "hierarchical": self.hierarchical, "dispatch": self.dispatch}


def make_deployment(num_experts: int, num_slots=None, num_gpus=None, num_nodes=1, num_groups=None,
                    topology: Topology | None = None, *, dispatch: str = "uniform",
                    ignore_nodes_when_global: bool = False) -> Deployment:
    """Validate a configuration and resolve whether placement is hierarchical.

    Args:
        num_experts: ``E``. num_slots: ``S >= E``, a multiple of ``num_gpus``.
        num_gpus: ``G``; num_nodes: ``N`` (``G % N == 0``, unless ignored, below).
        num_groups: expert groups. With ``num_groups % num_nodes == 0`` the placement is
            hierarchical and ``E % num_groups == 0`` is required; otherwise the placement is global
            and the groups are ignored (the published rule), so ``E`` need not be divisible.
        topology: an explicit :class:`Topology` instead of ``num_slots/num_gpus/num_nodes``.
        dispatch: the engine's dispatch rule, a name of :data:`eplb.engines.DISPATCH_RULES`.
        ignore_nodes_when_global: when the placement falls back to global, also ignore
            ``num_nodes`` (one node), as the published ``rebalance_experts`` does: then
            ``num_gpus`` need not be a multiple of ``num_nodes``.
    """
    num_experts = as_int(num_experts, "num_experts", minimum=1)
    check_limit(num_experts, "experts", "num_experts")
    if not isinstance(dispatch, str):
        raise ValueError(f"dispatch must be the name of a dispatch rule, got {dispatch!r}")
    groups = None if num_groups is None else as_int(num_groups, "num_groups", minimum=1)
    if topology is None:
        if num_slots is None or num_gpus is None:
            raise ValueError("num_slots and num_gpus are required (or pass topology=)")
        nodes = as_int(num_nodes, "num_nodes", minimum=1)
        if groups is not None and groups % nodes:
            groups = None  # the published rule: global placement, groups ignored
        if ignore_nodes_when_global and groups is None:
            nodes = 1
        topology = Topology.uniform(num_slots, num_gpus, nodes)
    elif not isinstance(topology, Topology):
        raise ValueError(f"topology must be an eplb.Topology, got {type(topology).__name__}")
    if topology.num_slots < num_experts:
        raise ValueError(
            f"num_slots ({topology.num_slots}) must be >= the number of experts ({num_experts}): "
            "every expert needs a slot"
        )
    if groups is None or groups % topology.num_nodes:
        return Deployment(num_experts, topology, None, False, dispatch)
    if num_experts % groups:
        raise ValueError(f"the number of experts ({num_experts}) must be divisible by num_groups ({groups})")
    return Deployment(num_experts, topology, groups, True, dispatch)


DEPLOYMENT_KEYWORDS = ("num_experts", "num_slots", "num_gpus", "num_nodes", "num_groups", "topology", "dispatch")
"""The keywords that build a :class:`Deployment` (:meth:`Deployment.of`): :func:`eplb.plan` takes them
as a shortcut; elsewhere they are the deprecated spelling of one ``deployment`` value."""


def deployment_argument(deployment, keywords: dict, caller: str, *, num_experts: int | None = None,
                        stacklevel: int = 3) -> Deployment:
    """The :class:`Deployment` a public entry ``caller`` was given.

    ``deployment``: a :class:`Deployment`; or, deprecated, ``None`` or the number of experts with
    the deployment's keywords in ``keywords`` (each of :data:`DEPLOYMENT_KEYWORDS`), which still
    plan the same for now and warn (``DeprecationWarning``) with the call to write instead.
    ``num_experts``: ``E`` of the counts the caller was given, checked against the deployment's.
    Another keyword is a ``TypeError`` naming it; a deployment and keywords together, or neither, a
    ``ValueError``."""
    unknown = sorted(set(keywords) - set(DEPLOYMENT_KEYWORDS))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(unknown)}")
    if isinstance(deployment, Deployment):
        if keywords:
            raise ValueError(f"{caller}: give the deployment either as one value or as keywords, not both: got "
                             f"deployment and {', '.join(sorted(keywords))}")
        if num_experts is not None and deployment.num_experts != num_experts:
            raise ValueError(f"{caller}: deployment is for {deployment.num_experts} experts, but counts has {num_experts}")
        return deployment
    keywords = dict(keywords)
    experts = keywords.pop("num_experts", None)
    if deployment is not None:
        if experts is not None or isinstance(deployment, bool) or not isinstance(deployment, (int, np.integer)):
            raise ValueError(f"{caller}: deployment must be an eplb.Deployment (eplb.Deployment.of(...)), got "
                             f"{type(deployment).__name__}")
        experts = deployment
    experts = num_experts if experts is None else experts
    if experts is None or not keywords:
        raise ValueError(f"{caller} needs the deployment: eplb.Deployment.of(num_experts, num_slots=..., "
                         "num_gpus=..., num_nodes=..., num_groups=...)")
    spelled = ", ".join(f"{name}={value!r}" for name, value in keywords.items())
    warnings.warn(f"{caller}: the deployment's keywords are deprecated; pass one value, "
                  f"eplb.Deployment.of({experts!r}, {spelled})", DeprecationWarning, stacklevel=stacklevel)
    return Deployment.of(experts, **keywords)
