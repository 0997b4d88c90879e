"""Rebalancing policies: the one seam through which something decides when to re-plan, and what to.

A policy watches a deployment serve, one step at a time, and now and then answers with a new
placement. :func:`eplb.simulate` drives one through a series of steps, :func:`eplb.sweep` runs many
side by side, and ``eplb simulate -p NAME`` picks them by name; all three go through
:class:`Policy` and the one registry of names here (:data:`POLICIES`, :func:`policy_by_name`).

Writing one: subclass :class:`Policy` and implement :meth:`Policy.start` and
:meth:`Policy.observe`::

    class EveryHundred(eplb.Policy):
        name = "greedy every 100 steps"

        def start(self, placement, deployment):
            self.deployment, self.window = deployment, np.zeros((deployment.num_layers,
                                                                 deployment.num_experts))

        def observe(self, step, counts):
            self.window += counts
            if (step + 1) % 100:
                return None
            new, self.window = self.deployment.plan(self.window), np.zeros_like(self.window)
            return new

Provided: :class:`NoRebalance`; :class:`FixedInterval` (re-plan from scratch every ``every`` steps
from the last ``window`` steps, as the engines do; presets :func:`vllm_like` and
:func:`sglang_like`), whose ``method`` is an ``eplb.METHODS`` name or any function with the
published ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)`` signature;
and :class:`BalancerPolicy`, which wraps :class:`eplb.Balancer`.

Objects that are not subclasses but have callable ``start`` and ``observe`` methods of the same
contract are accepted too (:func:`check_policy`), so existing duck-typed policies keep working.

Deployment changes (GPUs lost, added or renumbered: a :class:`eplb.DeploymentChange`): the driver
calls :meth:`Policy.redeploy` with the placement in service, and the policy answers with a
placement on the new deployment. The base class answers with :func:`donor_repair` (what the
engines' rank-failure handling does: every orphan into a donor slot, no rebalance). The engines'
answers and eplb's are provided as policies, compared on the same series from the same start:
:class:`FromScratch` (vLLM and SGLang after a resize: re-pack from nothing on the new deployment),
:class:`DonorRepair`, and :class:`Replan` (eplb: re-plan across the change from the placement in
service, :func:`eplb.plan` with ``previous=``); none of the three rebalances between changes.
:class:`FixedInterval` answers a change from scratch (the engines' timers), :class:`BalancerPolicy`
with eplb's re-plan from its window.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, replace
from functools import cached_property
from math import gcd
from typing import Callable

import numpy as np

from ..analysis.placement import Placement
from ..model._validation import as_int
from ..model.change import HOLE, DeploymentChange
from ..model.cost import CostModel
from ..model.defaults import CHANGE_TOLERANCE
from ..model.deployment import Deployment, make_deployment
from ..model.topology import Topology
from ..planning.api import plan
from ..engines import dispatch_rule
from ..planning.methods import DEFAULT_METHOD, get_method
from ..planning.migration import check_trade_off
from ..planning.replan import fit_groups, warn_relaxed
from .balancer import Balancer


class PolicyError(ValueError):
    """A policy or a planning function failed or returned something that is not a placement of the
    deployment (the message says which and at what step)."""


@dataclass(frozen=True)
class PolicyContext:
    """What a policy plans for: the deployment, the model's layers and the cost model of the run.

    Attributes:
        deployment: the :class:`eplb.Deployment` (experts ``E``, topology, groups, dispatch rule);
            its ``num_experts``, ``topology``, ``num_groups``, ``num_slots``, ``num_gpus`` and
            ``num_nodes`` are read through this object too.
        num_layers: ``L`` MoE layers.
        cost_model: the :class:`eplb.CostModel` the run is priced with.
    """

    deployment: Deployment
    num_layers: int
    cost_model: CostModel

    DEPLOYMENT_ATTRIBUTES = ("num_experts", "topology", "num_groups", "num_slots", "num_gpus", "num_nodes")

    def __getattr__(self, name: str):
        """The deployment's attributes (:data:`DEPLOYMENT_ATTRIBUTES`) read through this object."""
        if name in PolicyContext.DEPLOYMENT_ATTRIBUTES:
            return getattr(self.deployment, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def plan(self, weights: np.ndarray, method: str | Callable = DEFAULT_METHOD) -> Placement:
        """A placement from scratch for ``weights [L, E]`` with an ``eplb.METHODS`` name or a
        function with the published ``rebalance_experts`` signature (returning ``phy2log`` or a
        tuple starting with it), made on :attr:`planned_on`."""
        weights = np.ascontiguousarray(weights, dtype=np.float64)
        planned_on = self.planned_on
        if callable(method):
            groups = planned_on.num_groups if planned_on.num_groups is not None else 1
            name = getattr(method, "__name__", "custom")
            try:
                result = method(weights, planned_on.num_slots, groups, planned_on.num_nodes, planned_on.num_gpus)
            except Exception as exc:  # a user's function: say whose error it is
                raise PolicyError(f"the planning function {name} raised {type(exc).__name__}: {exc}") from exc
            phy2log = result[0] if isinstance(result, tuple) and result else result
            if phy2log is None:
                raise PolicyError(f"the planning function {name} returned {result!r}: it must return phy2log [L, S] "
                                  "(or a tuple starting with it)")
            return as_placement(phy2log, self, f"the placement the planning function {name} returned",
                                method=name)
        phy2log, _ = get_method(method)(weights, planned_on)
        groups = self.num_groups if planned_on is self.deployment else planned_on.num_groups
        return Placement(phy2log, self.num_experts, self.topology, groups, method=method)

    @cached_property
    def planned_on(self) -> Deployment:
        """The deployment plans from scratch are made on: the deployment itself, or, once GPUs were
        lost (masked: no slots), the GPUs with slots alone, in order, as the engines re-pack over
        their surviving ranks (the slots keep their order, so a plan of it is a plan of the
        deployment): in the nodes that keep GPUs when each keeps as many, else in one node. A
        hierarchical deployment whose nodes then cannot hold every group whole has its groups split
        into units or dropped (:func:`eplb.planning.replan.fit_groups`; one ``RuntimeWarning``)."""
        deployment, topology = self.deployment, self.topology
        serving = topology.slots_per_gpu > 0
        if not serving.all():
            per_node = serving.reshape(topology.num_nodes, -1).sum(axis=1)
            kept = per_node[per_node > 0]
            nodes = kept.size if (kept == kept[0]).all() else 1
            deployment = make_deployment(deployment.num_experts, topology=Topology(topology.slots_per_gpu[serving], nodes),
                                         num_groups=deployment.num_groups, dispatch=deployment.dispatch)
        deployment, relaxed = fit_groups(deployment)
        warn_relaxed(relaxed, stacklevel=3)
        return deployment


def as_placement(value, deployment: PolicyContext, what: str, method: str = "given") -> Placement:
    """``value`` (a :class:`Placement` or ``phy2log [L, S]`` of integer expert ids: float ids are
    refused, never truncated) as a placement of ``deployment``, else :class:`PolicyError`."""
    if isinstance(value, Placement):
        if value.topology != deployment.topology or value.num_experts != deployment.num_experts \
                or value.num_layers != deployment.num_layers:
            raise PolicyError(f"{what} must match the series' layers and experts and the deployment's topology")
        return value
    if type(value).__module__.split(".")[0] == "torch":
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
        if array.dtype == object or array.dtype.kind not in "iub":
            raise ValueError(f"phy2log must hold integer expert ids, got {array.dtype} values"
                             + (f" such as {array.flat[0]}" if array.size else ""))
        if array.ndim == 2 and array.shape[0] != deployment.num_layers:
            raise ValueError(f"phy2log must have {deployment.num_layers} layers, got shape {array.shape}")
        return Placement(array, deployment.num_experts, deployment.topology, deployment.num_groups, method=method)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{what}: {exc}") from None


# ------------------------------------------------------------------------------------ the seam

class Policy(abc.ABC):
    """Decides, step by step, when the deployment re-plans and what placement it moves to.

    The driver (:func:`eplb.simulate`; an engine loop) calls :meth:`start` once, then
    :meth:`observe` after every step it serves, in step order. A subclass implements both; it may
    set :attr:`name` (a label in results and reports).

    Determinism: given the same placement, deployment and counts, a policy must return the same
    placements at the same steps (seed any randomness in ``__init__``), so runs, sweeps in a
    process pool and the recorded battery repeat exactly. One object serves one run: :meth:`start`
    resets its state, and :func:`eplb.sweep` builds a fresh one for every run.
    """

    name: str = ""
    """A label for results (the ``policy`` field of :class:`eplb.SimulationResult`); the class name when empty."""

    @abc.abstractmethod
    def start(self, placement: Placement, deployment: PolicyContext) -> None:
        """Called once, before step 0.

        Parameters:
            placement: the :class:`eplb.Placement` in service at step 0 (``phy2log [L, S]``).
            deployment: a :class:`PolicyContext`: ``num_layers`` ``L``, ``num_experts`` ``E``, the
                topology (``S`` slots on ``G`` GPUs and ``N`` nodes), ``num_groups`` and the
                cost model; :meth:`PolicyContext.plan` plans from scratch for it.
        """

    @abc.abstractmethod
    def observe(self, step: int, counts: np.ndarray) -> Placement | np.ndarray | None:
        """Called after step ``step`` (0, 1, 2, ...) was served, with that step's counts.

        Parameters:
            step: the step just served, counted from 0.
            counts: ``[L, E]`` tokens routed to each logical expert in that step (read only: copy
                what you keep; a row of a series may be a view).
        Returns:
            ``None`` to keep the placement in service, or the new placement: a
            :class:`eplb.Placement` of the deployment, or ``phy2log [L, S]`` integer expert ids.
            The driver prices its weight copies and switches to it (all layers at once, or a few
            per step); a placement returned while another is being applied replaces it.
        """

    def redeploy(self, step: int, change: DeploymentChange, placement: Placement,
                 deployment: "PolicyContext") -> Placement | np.ndarray:
        """Called when the deployment changes after step ``step`` was served (GPUs lost, added or
        renumbered; slots per GPU changed), before step ``step + 1``.

        Parameters:
            step: the last step served on the old deployment.
            change: the :class:`eplb.DeploymentChange`: ``change.old`` the deployment in service,
                ``change.new`` the next one, ``change.gpu_map`` where each old GPU went.
            placement: the :class:`eplb.Placement` in service on ``change.old`` (what each GPU holds).
            deployment: the :class:`PolicyContext` of ``change.new``; later :meth:`observe` calls
                are on it (plan for it from now on).
        Returns:
            The placement on ``change.new`` (a :class:`eplb.Placement` or ``phy2log [L, S_new]``),
            every expert in every layer. The driver prices its copies across the change
            (:func:`eplb.transfer_plan`: experts whose every replica was lost load from host memory
            once, the rest copy from surviving GPUs, never from a lost one).

        The base class answers with :func:`donor_repair` (no rebalance); override it to re-plan,
        and to keep what the policy plans for in step with ``deployment``.
        """
        return donor_repair(placement, change)


def policy_label(policy) -> str:
    """The label of ``policy`` (a :class:`Policy` or a duck-typed object): its ``name`` or its class name."""
    return getattr(policy, "name", None) or type(policy).__name__


def check_policy(policy):
    """``policy`` if it is a :class:`Policy` or has callable ``start`` and ``observe`` methods,
    else ``ValueError`` naming the argument and the contract."""
    if isinstance(policy, Policy):
        return policy
    if not (callable(getattr(policy, "start", None)) and callable(getattr(policy, "observe", None))):
        raise ValueError("policy must have start(placement, deployment) and observe(step, counts) methods "
                         f"(subclass eplb.Policy), got {type(policy).__name__}")
    return policy


# ------------------------------------------------------------------------------------ provided

class NoRebalance(Policy):
    """Keep the initial placement."""

    name = "no rebalancing"

    def start(self, placement: Placement, deployment: PolicyContext) -> None:
        pass

    def observe(self, step: int, counts: np.ndarray):
        return None


class FixedInterval(Policy):
    """Re-plan from scratch after every ``every`` steps, from the counts of the last ``window`` steps.

    Args:
        every: steps between rebalances (the first after step ``every - 1``).
        window: steps of counts the plan is made from (default ``every``).
        method: an ``eplb.METHODS`` name, or a function with the published ``rebalance_experts``
            signature (an algorithm from elsewhere, measured side by side).
        name: a label (default from the settings).
        subwindows: ``1``: plan from the window's summed counts (what the engines do); more: plan
            from the window cut into this many sub-windows, hedged over them as :func:`eplb.plan`
            does with a series (``window`` must divide by it; ``method`` a name).

    Memory: ``window / gcd(every, window)`` partial sums of ``[L, E]`` float64 (one for the
    engines' presets).
    """

    def __init__(self, every: int, window: int | None = None, method: str | Callable = "greedy",
                 name: str | None = None, subwindows: int = 1):
        self.every = as_int(every, "every", minimum=1)
        self.window = self.every if window is None else as_int(window, "window", minimum=1)
        if not callable(method):
            get_method(method)  # fail early on an unknown name
        self.method = method
        self.subwindows = as_int(subwindows, "subwindows", minimum=1)
        if self.subwindows > 1 and (callable(method) or self.window % self.subwindows):
            raise ValueError(f"subwindows={self.subwindows} needs a method name and a window that divides by it, "
                             f"got window={self.window}, method={method!r}")
        label = method if isinstance(method, str) else getattr(method, "__name__", "custom")
        hedged = f", hedged over {self.subwindows} sub-windows" if self.subwindows > 1 else ""
        self.name = name or f"every {self.every} from {self.window}, {label}{hedged}"
        self._block = gcd(self.every, self.window // self.subwindows)

    def start(self, placement: Placement, deployment: PolicyContext) -> None:
        self._deployment = deployment
        self._sums: deque = deque(maxlen=self.window // self._block)  # sums over blocks of steps
        self._current = np.zeros((deployment.num_layers, deployment.num_experts))
        self._steps_in_block = 0

    def observe(self, step: int, counts: np.ndarray):
        self._current += counts
        self._steps_in_block += 1
        if self._steps_in_block == self._block:
            self._sums.append(self._current)
            self._current = np.zeros_like(self._current)
            self._steps_in_block = 0
        if (step + 1) % self.every:
            return None
        if self.subwindows == 1:
            return self._deployment.plan(np.sum(self._sums, axis=0), self.method)
        per_window = len(self._sums) // self.subwindows if len(self._sums) >= self.subwindows else 1
        blocks = np.stack(list(self._sums))
        windows = np.add.reduceat(blocks, np.arange(0, blocks.shape[0], per_window), axis=0)
        return plan(windows, topology=self._deployment.topology, num_groups=self._deployment.num_groups,
                    method=self.method)

    def redeploy(self, step: int, change: DeploymentChange, placement: Placement, deployment: PolicyContext):
        """Re-pack from scratch on the new deployment from the window so far, as the engines'
        timers do after a resize; later rebalances plan for the new deployment."""
        self._deployment = deployment
        window = np.sum(self._sums, axis=0) + self._current if self._sums else self._current
        return deployment.plan(window, self.method)


def vllm_like(method: str | Callable = "greedy", subwindows: int = 1) -> FixedInterval:
    """vLLM's EPLB defaults: every 3000 steps from the last 1000, greedy from scratch (with
    ``subwindows > 1``: the window hedged over that many sub-windows, as eplb's vLLM adapter does)."""
    hedged = f", hedged over {subwindows}" if subwindows > 1 else ""
    return FixedInterval(3000, 1000, method, name=f"vLLM-like (every 3000 from 1000{hedged})", subwindows=subwindows)


def sglang_like(method: str | Callable = "greedy", subwindows: int = 1) -> FixedInterval:
    """SGLang's defaults: every 1000 iterations from the last 1000, greedy from scratch (with
    ``subwindows > 1``: the window hedged over that many sub-windows)."""
    hedged = f", hedged over {subwindows}" if subwindows > 1 else ""
    return FixedInterval(1000, 1000, method, name=f"SGLang-like (every 1000{hedged})", subwindows=subwindows)


class BalancerPolicy(Policy):
    """:class:`eplb.Balancer` in the loop: record every step, ask ``should_rebalance()`` every
    ``check_every`` steps and apply ``rebalance()`` when it says yes.

    Args:
        check_every: steps between decisions.
        **balancer_options: passed to :class:`eplb.Balancer` (window, tolerance, min_gain, ...).
            The deployment, the initial placement, ``expert_bytes`` and ``cost_model`` (so the
            Balancer decides in time) come from the simulation; ``cost_model=None`` makes it decide
            in balancedness.
    """

    def __init__(self, check_every: int = 100, name: str | None = None, **balancer_options):
        self.check_every = as_int(check_every, "check_every", minimum=1)
        self.options = balancer_options
        self.name = name or "Balancer" + (f" ({balancer_options})" if balancer_options else ", defaults")
        self.balancer: Balancer | None = None

    def start(self, placement: Placement, deployment: PolicyContext) -> None:
        options = dict(self.options)
        options.setdefault("expert_bytes", int(deployment.cost_model.expert_bytes))
        options.setdefault("cost_model", deployment.cost_model)
        # the Balancer plans for an even split whatever split the run is priced with, and (after a
        # deployment change) with groups that fit the nodes
        fitting, _ = fit_groups(deployment.deployment)
        self.balancer = Balancer(deployment.num_layers, replace(fitting, dispatch="uniform"), placement=placement,
                                 **options)

    def observe(self, step: int, counts: np.ndarray):
        self.balancer.record(counts, physical=False)
        if (step + 1) % self.check_every or not self.balancer.should_rebalance():
            return None
        placement, _ = self.balancer.rebalance()
        return placement

    def redeploy(self, step: int, change: DeploymentChange, placement: Placement, deployment: PolicyContext):
        """The Balancer's own re-plan across the change (``rebalance(deployment=...)``) from the
        placement every layer holds: its window carries over, so its next decisions on the new
        deployment are made from the traffic seen before the change too."""
        balancer = self.balancer
        if not np.array_equal(balancer.placement.phy2log, placement.phy2log):  # a rebalance was being applied
            balancer.commit(placement)
        new, _ = balancer.rebalance(deployment=DeploymentChange(
            balancer.deployment, replace(change.new, dispatch="uniform"), change.gpu_map))
        return new


# ------------------------------------------------------------------------------------ deployment changes

CHANGE_WINDOW = 1000
"""Steps of counts the provided answers to a deployment change plan from (:class:`FromScratch`,
:class:`Replan`): the engines' load windows (vLLM and SGLang: 1000 passes)."""


def donor_repair(placement, change: DeploymentChange) -> Placement:
    """The placement in service carried across ``change`` and repaired with no rebalance, as the
    engines' rank-failure handling does: every orphan (an expert whose every replica was lost), lowest
    id first, goes into the first new slot nothing was carried into, else into the first slot of an
    expert that still has two replicas or more (that expert keeps the others); new slots left over
    (GPUs added) take, in slot order, the expert with the fewest replicas not on that GPU (lowest id
    on ties). Needs no counts.

    Args:
        placement: the :class:`Placement` (or ``phy2log [L, S_old]``) in service on ``change.old``.
        change: the :class:`eplb.DeploymentChange`.
    Returns:
        A :class:`Placement` on ``change.new`` (``method="donor repair"``, no groups kept).
    """
    phy2log = placement.phy2log if isinstance(placement, Placement) else placement
    repaired = change.carry(phy2log)  # [L, S_new], HOLE where nothing is carried
    gpu_of_slot = change.new.topology.gpu_of_slot
    for row in repaired:
        _repair_row(row, change.new.num_experts, gpu_of_slot)
    return Placement(repaired, change.new.num_experts, change.new.topology, None, method="donor repair")


def _repair_row(row: np.ndarray, num_experts: int, gpu_of_slot: np.ndarray) -> None:
    """:func:`donor_repair` of one layer's carried ``row [S]`` in place (``HOLE``: nothing carried)."""
    replicas = np.bincount(row[row != HOLE], minlength=num_experts)
    for expert in np.flatnonzero(replicas == 0):
        holes = np.flatnonzero(row == HOLE)
        if holes.size:
            slot = holes[0]
        else:  # a slot exists: the slots hold every expert, so with one missing another is doubled
            slot = np.flatnonzero(replicas[row] >= 2)[0]
            replicas[row[slot]] -= 1
        row[slot] = expert
        replicas[expert] += 1
    for slot in np.flatnonzero(row == HOLE):
        on_gpu = row[gpu_of_slot == gpu_of_slot[slot]]
        order = np.lexsort((np.arange(num_experts), replicas))  # fewest replicas, then lowest id
        free = order[~np.isin(order, on_gpu)]
        row[slot] = free[0] if free.size else order[0]
        replicas[row[slot]] += 1


class RecentCounts:
    """The summed counts of the last ``window`` steps a policy observed, kept as sums of blocks of
    ``max(1, window // 10)`` steps: :meth:`total` covers the newest steps and at most one block
    beyond ``window``.

    Args:
        window: steps kept; shape: ``(L, E)``.
    """

    def __init__(self, window: int, shape: tuple[int, int]):
        window = as_int(window, "window", minimum=1)
        self.block = max(1, window // 10)
        self._blocks: deque = deque(maxlen=-(-window // self.block))
        self._current = np.zeros(shape)
        self._in_block = 0

    def add(self, counts: np.ndarray) -> None:
        """Count one step's ``counts [L, E]``."""
        self._current += counts
        self._in_block += 1
        if self._in_block == self.block:
            self._blocks.append(self._current)
            self._current = np.zeros_like(self._current)
            self._in_block = 0

    def total(self) -> np.ndarray:
        """``[L, E]`` float64: the counts of the window."""
        return np.sum(self._blocks, axis=0) + self._current if self._blocks else self._current.copy()


class _ChangeAnswer(Policy):
    """A policy that keeps the placement between deployment changes and answers a change from the
    counts of the last ``window`` steps (:class:`RecentCounts`)."""

    def __init__(self, window: int = CHANGE_WINDOW):
        self.window = as_int(window, "window", minimum=1)

    def start(self, placement: Placement, deployment: PolicyContext) -> None:
        self._recent = RecentCounts(self.window, (deployment.num_layers, deployment.num_experts))

    def observe(self, step: int, counts: np.ndarray):
        self._recent.add(counts)
        return None


class FromScratch(_ChangeAnswer):
    """vLLM's and SGLang's answer to a resize or a lost rank: re-pack from nothing on the new
    deployment, from the last ``window`` steps' counts (nothing kept in place but by chance); no
    rebalance between changes.

    Args:
        method: an ``eplb.METHODS`` name (default ``"greedy"``, the engines' algorithm).
        hierarchical: keep each expert group on one node where the new deployment's nodes hold
            them (vLLM); ``False`` plans globally, dropping the groups (SGLang's elastic EP).
        window: steps of counts the plan is made from.
    """

    def __init__(self, method: str = "greedy", *, hierarchical: bool = True, window: int = CHANGE_WINDOW):
        super().__init__(window)
        get_method(method)
        self.method, self.hierarchical = method, bool(hierarchical)
        self.name = f"from scratch ({method}" + ("" if hierarchical else ", global") + ")"

    def redeploy(self, step: int, change: DeploymentChange, placement: Placement, deployment: PolicyContext):
        target = deployment if self.hierarchical else PolicyContext(
            replace(deployment.deployment, num_groups=None, hierarchical=False), deployment.num_layers,
            deployment.cost_model)
        return target.plan(self._recent.total(), self.method)


class DonorRepair(_ChangeAnswer):
    """The engines' rank-failure repair (:func:`donor_repair`): each orphan into a donor slot, loaded
    from host memory, no rebalance, then or later."""

    name = "donor repair"

    def redeploy(self, step: int, change: DeploymentChange, placement: Placement, deployment: PolicyContext):
        return donor_repair(placement, change)


class Replan(_ChangeAnswer):
    """eplb's answer: re-plan across the change from the placement in service (:func:`eplb.plan`
    with the change and ``previous=``: every orphan placed, the survivors' weights kept where that
    costs little balance, ``tolerance`` the trade), for the last ``window`` steps' counts; no
    rebalance between changes. Under optimal dispatch the re-plan is made for an even split (a
    plan near the placement in service is made for one; optimal dispatch serves it at least as
    well), as :class:`BalancerPolicy` plans.

    Args:
        method: an ``eplb.METHODS`` name; max_moves: as :func:`eplb.plan`'s.
        tolerance: as :func:`eplb.plan`'s across a change; default
            :data:`eplb.model.defaults.CHANGE_TOLERANCE`, what ``plan`` uses there (the label says it).
        window: steps of counts the plan is made from.
    """

    def __init__(self, method: str = DEFAULT_METHOD, *, tolerance: float | None = CHANGE_TOLERANCE,
                 max_moves: int | None = None, window: int = CHANGE_WINDOW):
        super().__init__(window)
        get_method(method)
        tolerance, _ = check_trade_off(tolerance, max_moves, 1)  # refused here, not at the first change
        self.method, self.tolerance, self.max_moves = method, tolerance, max_moves
        self.name = f"eplb re-plan (tolerance {tolerance})"

    def redeploy(self, step: int, change: DeploymentChange, placement: Placement, deployment: PolicyContext):
        if dispatch_rule(change.new.dispatch).kind == "optimal":  # planned for an even split (class docstring)
            change = DeploymentChange(replace(change.old, dispatch="uniform"), replace(change.new, dispatch="uniform"),
                                      change.gpu_map)
        return plan(self._recent.total(), change, previous=placement.phy2log, method=self.method,
                    tolerance=self.tolerance, max_moves=self.max_moves)


# ------------------------------------------------------------------------------------ registry

HEDGED_SUBWINDOWS = 10
"""Sub-windows of the named hedged timers (``"vllm-hedged"``, ``"sglang-hedged"``)."""

POLICIES: dict[str, Callable[[str | Callable, int], Policy]] = {
    "none": lambda method, check_every: NoRebalance(),
    "vllm": lambda method, check_every: vllm_like(method),
    "sglang": lambda method, check_every: sglang_like(method),
    "vllm-hedged": lambda method, check_every: vllm_like(DEFAULT_METHOD, subwindows=HEDGED_SUBWINDOWS),
    "sglang-hedged": lambda method, check_every: sglang_like(DEFAULT_METHOD, subwindows=HEDGED_SUBWINDOWS),
    "balancer": lambda method, check_every: BalancerPolicy(check_every=check_every),
    "from-scratch": lambda method, check_every: FromScratch(method if isinstance(method, str) else "greedy"),
    "donor-repair": lambda method, check_every: DonorRepair(),
    "replan": lambda method, check_every: Replan(),
}
"""The one registry of policy names (the simulator, :func:`eplb.sweep` and the CLI read it): name ->
``maker(method, check_every)`` returning a fresh :class:`Policy`. No rebalancing, the engines'
timers (planning from their summed window with ``method``, or hedged over it with eplb's default
method), eplb's :class:`eplb.Balancer` deciding every ``check_every`` steps, and the answers to a
deployment change with no rebalance between changes (:class:`FromScratch` with ``method`` when it is a
name, else greedy; :class:`DonorRepair`; eplb's :class:`Replan`). Besides these names,
:func:`policy_by_name` reads ``every:N`` and ``every:N/W`` (a :class:`FixedInterval`)."""

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
"""The names of :data:`POLICIES`, in order."""


def _every(name: str, method: str | Callable) -> FixedInterval:
    """``"every:N"`` or ``"every:N/W"`` as a :class:`FixedInterval`, else ``ValueError``."""
    every, _, window = name.removeprefix("every:").partition("/")
    if not name.startswith("every:") or not every.isdigit() or not (window.isdigit() or not window):
        raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)} or every:N[/W] with whole numbers, "
                         f"got {name!r}")
    return FixedInterval(int(every), int(window) if window else None, method)


def policy_by_name(name: str, method: str | Callable = "greedy", check_every: int = 100) -> Policy:
    """A fresh policy for a name of :data:`POLICY_NAMES` or ``every:N[/W]`` (every ``N`` steps from
    the last ``W``, default ``N``).

    Args:
        name: the policy's name.
        method: plans the plain timers (``"vllm"``, ``"sglang"``, ``every:...``): an ``eplb.METHODS``
            name or a ``rebalance_experts`` function; the hedged timers use eplb's default method.
        check_every: steps between the Balancer's decisions (``"balancer"``).
    Raises:
        ValueError: an unknown name (the message lists the known ones) or bad numbers.
    """
    if not isinstance(name, str):
        raise ValueError(f"policy must be a name (str), got {type(name).__name__}")
    if name in POLICIES:
        return POLICIES[name](method, check_every)
    return _every(name, method)


__all__ = ["Policy", "PolicyContext", "PolicyError", "NoRebalance", "FixedInterval", "BalancerPolicy", "vllm_like",
           "sglang_like", "FromScratch", "DonorRepair", "Replan", "donor_repair", "RecentCounts", "CHANGE_WINDOW", "POLICIES", "POLICY_NAMES", "HEDGED_SUBWINDOWS", "policy_by_name", "check_policy",
           "policy_label", "as_placement"]
