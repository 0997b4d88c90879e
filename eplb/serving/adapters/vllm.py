"""vLLM adapter: eplb as vLLM's EPLB policy, for each policy interface vLLM has shipped.

vLLM asks its EPLB policy for a new placement; the interface changed over releases (checked on the
released wheels' ``vllm/distributed/eplb/`` files, see ``tests/engine_interfaces/vllm.json``):

``"function"`` (vLLM 0.11 - 0.12; EPLB first shipped in 0.9)
    No policy class: ``eplb_state.py`` imports ``rebalance_experts(weight, num_replicas,
    num_groups, num_nodes, num_gpus)`` from ``rebalance_algo`` and unpacks
    ``(phy2log, log2phy, logcnt)``. :func:`install` replaces that name; :func:`rebalance_function`
    is the replacement.
``"triple"`` (vLLM 0.13 - 0.18)
    ``AbstractEplbPolicy.rebalance_experts`` is a classmethod returning the three tensors
    ``(phy2log [L, S], log2phy [L, E, R], logcnt [L, E])``; from 0.14 on it also takes
    ``old_global_expert_indices`` (the placement in service, ``[L, S]``). :class:`EplbTriplePolicy`.
``"phy2log"`` (vLLM 0.19 - 0.33, the latest release checked)
    The same classmethod with ``old_global_expert_indices``, returning only ``phy2log [L, S]``.
    :class:`EplbPolicy`.
``"context"`` (vLLM development branch, not in a release up to 0.33)
    An instance method ``rebalance_experts(context, policy_state) -> EplbPlan``; ``context``
    carries ``load_window_cpu [samples, layers, experts]`` (oldest first), the placement in
    service ``physical_to_logical_map_cpu [L, S]``, ``topology`` (``num_groups``, ``num_nodes``,
    ``num_ranks``), ``num_replicas`` and ``cpu_group``; ``create_state(num_moe_layers)`` makes the
    per-model state and ``on_layer_committed(policy_state, plan, layer_idx)`` runs after each layer
    of a plan is installed. :class:`EplbContextPolicy`.

:func:`detect_interface` tells them apart by inspecting the installed vLLM (the abstract policy
class and its method's kind, parameters and return annotation; no version strings);
:func:`policy_for` returns the matching adapter as a subclass of the engine's own abstract class,
and :func:`install` registers it before the engine starts::

    from eplb.serving.adapters.vllm import install
    install(tolerance=0.005)         # replaces vLLM's "default" EPLB policy, any supported vLLM

Every adapter plans with :func:`eplb.plan`: the default method, hedged over the samples of the
load window when vLLM passes one (the ``"context"`` interface), and, when vLLM passes the
placement in service, a plan close to it (``previous=``) so few expert weights move. As vLLM's own
policy does, expert groups are used only when they divide among the nodes.

Across a resize (vLLM's elastic expert parallelism, ``tests/engine_interfaces/vllm.json``
``elastic_ep``), vLLM's ``EplbState.rearrange(..., rank_mapping=...)`` calls the policy with the
placement in service on the old ranks (``[L, S_old]``) and the new ``num_replicas`` and
``num_ranks``; the rank mapping (old rank -> new rank, ``-1``: removed) stays in ``rearrange``.
The adapter re-plans from that placement across the change (:class:`eplb.DeploymentChange`,
:mod:`eplb.planning.replan`): survivors keep what they hold, experts whose every replica is on a
removed rank are placed once, new ranks are filled. ``gpu_map`` is the rank mapping: :func:`install`
wraps ``rearrange`` so that the policy sees its ``rank_mapping`` (:func:`rank_mapping`, for callers
of their own); without one it is by index, which is the mapping vLLM builds (a scale-down keeps the
ranks below the new size, a scale-up appends ranks). The old ranks hold ``S_old / G_old`` slots
each, ``G_old`` the mapping's length or, without one, ``S_old`` over the new ranks' slots per rank
(vLLM keeps the slots per rank across a resize). A placement in service that cannot be read so
(its layers differ, or its slots do not divide among the old ranks) is ignored: the plan starts
from scratch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import sys

import numpy as np

from ...analysis.placement import Placement
from ...model.change import DeploymentChange
from ...model.defaults import PLAN_TOLERANCE
from ...model._validation import as_counts, as_int
from ...model.deployment import make_deployment
from ...planning.api import plan
from ...planning.methods import DEFAULT_METHOD, get_method

#: the interfaces :func:`detect_interface` can return, oldest first
INTERFACES = ("function", "triple", "phy2log", "context")

_POLICY_MODULE = "vllm.distributed.eplb.policy"
_FUNCTION_MODULES = ("vllm.distributed.eplb.eplb_state", "vllm.distributed.eplb.async_worker")
_STATE_MODULE = "vllm.distributed.eplb.eplb_state"

_RANK_MAPPING: contextvars.ContextVar = contextvars.ContextVar("eplb_vllm_rank_mapping", default=None)
"""The rank mapping of the resize being planned on this thread (set by :func:`rank_mapping`)."""


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError("the vLLM adapter returns torch tensors: pip install torch") from exc
    return torch


def _to_numpy(tensor, torch):
    if isinstance(tensor, torch.Tensor):
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


def _placement(settings, weight, num_replicas: int, num_groups, num_nodes: int, num_ranks: int, old=None):
    """Plan with ``settings`` (an object with ``method``, ``tolerance``, ``max_moves``, ``options``).

    Args:
        weight: ``[L, E]`` load of each logical expert, or a series ``[T, L, E]`` (vLLM's load
            window), planned hedged over its windows as :func:`eplb.plan` does with a series.
        old: ``[L, S_old]`` placement in service or ``None``. With ``S_old == num_replicas`` and no
            rank mapping that moves a rank (:func:`rank_mapping`), the plan stays close to it; else it
            is re-planned across the resize (:func:`resize_change`); ignored when it cannot be read
            as a placement on the old ranks.
    Returns:
        the :class:`eplb.Placement` (``phy2log [L, S]``, ``log2phy [L, E, R]``, ``logcnt [L, E]``).
    """
    torch = _torch()
    weights = as_counts(weight, "weight", ndims=(2, 3))
    num_nodes = int(num_nodes) if num_nodes else 1
    groups = int(num_groups) if num_groups else None
    if groups is not None and groups % num_nodes != 0:
        groups = None  # vLLM's own policy then plans globally too
    deployment = make_deployment(weights.shape[-1], int(num_replicas), int(num_ranks), num_nodes, groups)
    previous, change = None, None
    if old is not None:
        old = _to_numpy(old, torch)
        if old.ndim == 2 and old.shape[0] == weights.shape[-2]:
            previous = old.astype(np.int64, copy=False)
            change = resize_change(previous.shape[1], deployment, _RANK_MAPPING.get())
            if change is None and previous.shape[1] != deployment.num_slots:
                previous = None  # not a placement on the old ranks eplb can read: from scratch
    return plan(weights, change if change is not None else deployment, method=settings.method, previous=previous,
                tolerance=settings.tolerance, max_moves=settings.max_moves, **settings.options)


def resize_change(old_slots: int, deployment, mapping=None) -> DeploymentChange | None:
    """The change from vLLM's ranks before a resize to ``deployment`` (after it), or ``None`` when
    nothing changes or the old ranks cannot be told from what vLLM passes.

    Args:
        old_slots: ``S_old``, the slots of the placement in service (its width).
        deployment: the deployment after the resize (``num_replicas`` slots on ``num_ranks`` ranks).
        mapping: vLLM's ``rank_mapping``, ``{old rank: new rank or -1}`` for every old rank, or
            ``None`` (by index: vLLM's own mappings keep the surviving ranks' indices).
    Returns:
        ``DeploymentChange(old, deployment, gpu_map)``, the old ranks holding ``S_old / G_old`` slots
        each on one node (``G_old``: the mapping's length, else ``S_old`` over the new slots per rank).
    Raises:
        ValueError: the mapping is not one new rank (or -1) for each old rank ``0 .. G_old - 1``, or
            its ranks do not divide the old slots.
    """
    per_rank = deployment.num_slots // deployment.num_gpus
    if mapping is None:
        if old_slots == deployment.num_slots or old_slots % per_rank:
            return None
        old_ranks, gpu_map = old_slots // per_rank, None
    else:
        try:
            old_ranks = len(mapping)
            # integers only: a float rank is refused, never truncated (issue 47 item 17)
            gpu_map = [as_int(mapping[rank], f"rank_mapping[{rank}]", minimum=-1) for rank in range(old_ranks)]
        except (KeyError, TypeError):
            raise ValueError(f"rank_mapping must map every old rank 0 .. G-1 to a new rank or -1, got {mapping!r:.200}") \
                from None
        if old_ranks == 0 or old_slots != old_ranks * per_rank:
            # vLLM keeps the slots per rank across a resize (num_replicas // ep_size * new ranks), so the
            # old ranks are S_old / (S / G): a mapping of other length leaves ranks out or adds some
            expected = f"{old_slots // per_rank} old ranks" if old_slots % per_rank == 0 else "a whole number of ranks"
            raise ValueError(f"rank_mapping names {old_ranks} old ranks, but the {old_slots} slots of the placement in "
                             f"service at {per_rank} per rank (vLLM keeps a rank's slots across a resize) are "
                             f"{expected}: give every old rank 0 .. G-1 its new rank or -1")
    old = make_deployment(deployment.num_experts, old_slots, old_ranks)
    change = DeploymentChange(old, deployment, gpu_map)
    return None if change.is_identity else change


@contextlib.contextmanager
def rank_mapping(mapping):
    """Within this block, the policies of this module plan a resize with ``mapping`` (vLLM's
    ``rank_mapping``: ``{old rank: new rank, -1 for a removed rank}``) as the change's ``gpu_map``.
    :func:`install` wraps vLLM's ``EplbState.rearrange`` in it; call it yourself when you call a
    policy across a resize another way."""
    token = _RANK_MAPPING.set(None if mapping is None else dict(mapping))
    try:
        yield
    finally:
        _RANK_MAPPING.reset(token)


def _with_rank_mapping(rearrange):
    """vLLM's ``EplbState.rearrange`` run within :func:`rank_mapping` of its ``rank_mapping`` argument."""
    signature = inspect.signature(rearrange)

    @functools.wraps(rearrange)
    def wrapper(*args, **kwargs):
        with rank_mapping(signature.bind_partial(*args, **kwargs).arguments.get("rank_mapping")):
            return rearrange(*args, **kwargs)

    wrapper.eplb_rank_mapping = True
    return wrapper


def _wrap_rearrange() -> bool:
    """Wrap the installed vLLM's ``EplbState.rearrange`` (when it takes a ``rank_mapping``) so the
    policy sees the mapping of a resize; returns whether it is wrapped."""
    module = sys.modules.get(_STATE_MODULE) or _import_if_present(_STATE_MODULE)
    state = getattr(module, "EplbState", None)
    rearrange = getattr(state, "rearrange", None)
    if rearrange is None or "rank_mapping" not in inspect.signature(rearrange).parameters:
        return False
    if not getattr(rearrange, "eplb_rank_mapping", False):
        state.rearrange = _with_rank_mapping(rearrange)
    return True


def _tensor(array, like, torch):
    result = torch.tensor(np.asarray(array), dtype=torch.int64)
    if isinstance(like, torch.Tensor):
        result = result.to(like.device)
    return result


class _Settings:
    """Planning settings shared by every adapter (class attributes; see :meth:`configured`).

    Attributes:
        method: planning method (one of ``eplb.METHODS``).
        tolerance, max_moves: migration trade-off when vLLM passes the placement in service:
            accept a max GPU load up to ``1 + tolerance`` times planning from scratch, change at
            most ``max_moves`` slots per layer.
        options: passed to the method.
    """

    method: str = DEFAULT_METHOD
    tolerance: float | None = PLAN_TOLERANCE
    max_moves: int | None = None
    options: dict = {}

    @classmethod
    def configured(cls, *, method: str = DEFAULT_METHOD, tolerance: float | None = PLAN_TOLERANCE, max_moves=None,
                   **options):
        """A subclass with these settings (vLLM instantiates policies itself, without arguments)."""
        get_method(method)
        return type(cls.__name__, (cls,), {"method": method, "tolerance": tolerance, "max_moves": max_moves,
                                            "options": dict(options)})


class EplbPolicy(_Settings):
    """vLLM 0.19 - 0.33 (``"phy2log"``): classmethod returning ``phy2log``."""

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                          old_global_expert_indices=None):
        """New placement for the loads ``weight``.

        Args:
            weight: ``[L, E]`` load of each logical expert (torch tensor or array).
            num_replicas: physical experts (slots) ``S``, a multiple of ``num_ranks``.
            num_groups: expert groups (hierarchical placement when divisible by ``num_nodes``);
                ``None`` or 0 for models without groups.
            num_nodes: nodes; num_ranks: EP ranks (GPUs), a multiple of ``num_nodes``.
            old_global_expert_indices: ``[L, S]`` the placement in service, or ``None``.
        Returns:
            ``phy2log [L, S]`` int64 torch tensor, on ``weight``'s device when it is a tensor.
        """
        torch = _torch()
        placement = _placement(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                               old_global_expert_indices)
        return _tensor(placement.phy2log, weight, torch)


class EplbTriplePolicy(_Settings):
    """vLLM 0.13 - 0.18 (``"triple"``): classmethod returning ``(phy2log, log2phy, logcnt)``."""

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                          old_global_expert_indices=None):
        """New placement for the loads ``weight`` (arguments as :meth:`EplbPolicy.rebalance_experts`).

        Returns:
            ``phy2log [L, S]``, ``log2phy [L, E, R]`` (padded with -1; vLLM pads it further to its
            own width) and ``logcnt [L, E]``, int64 torch tensors on ``weight``'s device.
        """
        torch = _torch()
        placement = _placement(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                               old_global_expert_indices)
        return tuple(_tensor(a, weight, torch) for a in (placement.phy2log, placement.log2phy, placement.logcnt))


def rebalance_function(settings=_Settings):
    """vLLM <= 0.12 (``"function"``): a ``rebalance_experts(weight, num_replicas, num_groups,
    num_nodes, num_gpus) -> (phy2log, log2phy, logcnt)`` function planning with ``settings`` (a
    class from :meth:`EplbTriplePolicy.configured`, or the defaults)."""

    policy = EplbTriplePolicy.configured(method=settings.method, tolerance=settings.tolerance,
                                         max_moves=settings.max_moves, **settings.options)

    def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
        return policy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)

    rebalance_experts.__doc__ = rebalance_function.__doc__
    return rebalance_experts


class EplbPolicyState:
    """Per-model state of :class:`EplbContextPolicy` (what vLLM's ``create_state`` returns).

    Attributes:
        num_moe_layers: ``L``.
        committed: ``[L, S]`` int64, the placement eplb last planned as far as vLLM has installed
            it (a row is copied when vLLM reports the layer committed), or ``None`` before the
            first commit.
        plans: plans made; commits: layers committed.
    """

    def __init__(self, num_moe_layers: int):
        self.num_moe_layers = int(num_moe_layers)
        self.committed = None
        self.plans = 0
        self.commits = 0


class EplbContextPolicy(_Settings):
    """vLLM's context interface (``"context"``): an instance with ``create_state``,
    ``rebalance_experts(context, policy_state) -> EplbPlan`` and ``on_layer_committed``.

    ``plan_type`` is the engine's ``EplbPlan`` class (set by :func:`policy_for`); the plan's
    ``physical_to_logical_map`` is a CPU int64 tensor ``[L, S]``.
    """

    plan_type = None
    state_type = EplbPolicyState

    def create_state(self, num_moe_layers: int):
        """Independent state for one model."""
        return self.state_type(num_moe_layers)

    def rebalance_experts(self, context, policy_state):
        """Plan from ``context.load_window_cpu [T, L, E]`` (hedged over its samples) close to
        ``context.physical_to_logical_map_cpu [L, S]``; ``policy_state`` is only read."""
        torch = _torch()
        topology = context.topology
        placement = _placement(self, context.load_window_cpu, context.num_replicas, topology.num_groups,
                               topology.num_nodes, topology.num_ranks, context.physical_to_logical_map_cpu)
        if isinstance(policy_state, EplbPolicyState):
            policy_state.plans += 1
        phy2log = torch.tensor(placement.phy2log, dtype=torch.int64)
        if self.plan_type is None:
            raise TypeError("EplbContextPolicy needs the engine's EplbPlan class: build it with policy_for()")
        return self.plan_type(phy2log)

    def on_layer_committed(self, policy_state, plan, layer_idx: int) -> None:
        """Record that layer ``layer_idx`` of ``plan`` is now in service."""
        if not isinstance(policy_state, EplbPolicyState):
            return
        table = _to_numpy(plan.physical_to_logical_map, _torch())
        if policy_state.committed is None or policy_state.committed.shape != table.shape:
            policy_state.committed = np.full(table.shape, -1, dtype=np.int64)
        policy_state.committed[layer_idx] = table[layer_idx]
        policy_state.commits += 1


def _abstract_policy():
    """The installed vLLM's ``AbstractEplbPolicy``, or ``None`` when vLLM has no policy package."""
    try:
        module = importlib.import_module(_POLICY_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == "vllm" or _POLICY_MODULE.startswith(exc.name)):
            return None
        raise
    return module.AbstractEplbPolicy


def detect_interface(abstract=None) -> str:
    """Which of :data:`INTERFACES` a vLLM policy class follows.

    Args:
        abstract: vLLM's ``AbstractEplbPolicy`` class; by default the installed vLLM's, or, when
            vLLM has no ``vllm.distributed.eplb.policy`` package but has EPLB, ``"function"``.
    Raises:
        ImportError: vLLM (with EPLB) is not installed.
        ValueError: ``abstract`` does not look like any interface eplb knows (named in the message).
    """
    if abstract is None:
        abstract = _abstract_policy()
        if abstract is None:
            try:
                importlib.import_module("vllm.distributed.eplb.rebalance_algo")
            except ModuleNotFoundError as exc:
                raise ImportError("vLLM with EPLB (vllm.distributed.eplb) is not installed") from exc
            return "function"
    method = inspect.getattr_static(abstract, "rebalance_experts", None)
    if method is None:
        raise ValueError(f"abstract={abstract!r} has no rebalance_experts: not a vLLM EPLB policy class eplb knows")
    if isinstance(method, classmethod):
        names = list(inspect.signature(method.__func__).parameters)[1:]
        signature = inspect.signature(method.__func__)
        legacy = ["weight", "num_replicas", "num_groups", "num_nodes", "num_ranks"]
        if names[:5] != legacy or len(names) > 6 or (len(names) == 6 and names[5] != "old_global_expert_indices"):
            raise ValueError(f"abstract.rebalance_experts takes {names}, expected {legacy} "
                             "[+ old_global_expert_indices]")
        returns = signature.return_annotation
        text = returns if isinstance(returns, str) else repr(returns)
        if len(names) == 5 or text.replace("typing.", "").lower().startswith("tuple"):
            return "triple"
        if returns is inspect.Signature.empty:
            raise ValueError("abstract.rebalance_experts has no return annotation: cannot tell a (phy2log, "
                             "log2phy, logcnt) policy from a phy2log one; pick the adapter class yourself")
        return "phy2log"
    names = list(inspect.signature(method).parameters)
    if names == ["self", "context", "policy_state"]:
        return "context"
    raise ValueError(f"abstract.rebalance_experts is an instance method taking {names}, "
                     "expected (self, context, policy_state)")


_ADAPTERS = {"triple": EplbTriplePolicy, "phy2log": EplbPolicy, "context": EplbContextPolicy}


def policy_for(abstract=None, **settings):
    """The eplb policy class for a vLLM policy interface, as a subclass of ``abstract``.

    Args:
        abstract: vLLM's ``AbstractEplbPolicy`` (default: the installed vLLM's).
        settings: ``method``, ``tolerance``, ``max_moves`` and method options (see
            :meth:`EplbPolicy.configured`).
    Returns:
        a class vLLM can register in ``EPLB_POLICIES``; for the ``"context"`` interface its plans
        are instances of the ``EplbPlan`` class defined next to ``abstract``.
    Raises:
        ValueError: the interface is ``"function"`` (no policy class: use :func:`install`) or
            unknown.
    """
    if abstract is None:
        abstract = _abstract_policy()
    interface = detect_interface(abstract)
    if interface == "function":
        raise ValueError("this vLLM has no policy classes (rebalance_algo.rebalance_experts is a function): "
                         "use eplb.serving.adapters.vllm.install() or rebalance_function()")
    adapter = _ADAPTERS[interface].configured(**settings)
    namespace = {"__module__": __name__, "__doc__": adapter.__doc__}
    if interface == "context":
        module = sys.modules[abstract.__module__]
        namespace["plan_type"] = getattr(module, "EplbPlan")
        engine_state = getattr(module, "EplbPolicyState", None)
        if engine_state is not None:
            namespace["state_type"] = type("EplbPolicyState", (EplbPolicyState, engine_state),
                                           {"__module__": __name__})
    return type(abstract)(_ADAPTERS[interface].__name__, (adapter, abstract), namespace)


def install(name: str = "default", **settings):
    """Make vLLM plan with eplb: call before the engine starts (in every process that plans).

    For policy interfaces, registers :func:`policy_for`'s class as ``EPLB_POLICIES[name]`` (the
    policy chosen by ``--eplb-config '{"policy": ...}'``; ``"default"`` unless configured) and wraps
    ``EplbState.rearrange`` when it takes a ``rank_mapping`` (elastic EP), so a resize is planned
    with that mapping (:func:`rank_mapping`). For
    the ``"function"`` interface (vLLM <= 0.12) it replaces ``rebalance_experts`` where vLLM's
    EPLB modules imported it (``name`` is unused there).

    Returns:
        what was installed (the policy class or the function).
    """
    abstract = _abstract_policy()
    if abstract is None:
        detect_interface()  # raises ImportError without vLLM's EPLB
        function = rebalance_function(_Settings.configured(**settings))
        for module_name in _FUNCTION_MODULES:
            module = sys.modules.get(module_name) or _import_if_present(module_name)
            if module is not None and hasattr(module, "rebalance_experts"):
                module.rebalance_experts = function
        return function
    policy = policy_for(abstract, **settings)
    importlib.import_module(_POLICY_MODULE).EPLB_POLICIES[name] = policy
    _wrap_rearrange()
    return policy


def _import_if_present(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        return None
