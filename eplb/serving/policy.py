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
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, replace
from math import gcd
from typing import Callable

import numpy as np

from ..analysis.placement import Placement
from ..model._validation import as_int
from ..model.cost import CostModel
from ..model.deployment import Deployment
from ..planning.api import plan
from ..planning.methods import DEFAULT_METHOD, get_method
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
        tuple starting with it)."""
        weights = np.ascontiguousarray(weights, dtype=np.float64)
        if callable(method):
            groups = self.num_groups if self.num_groups is not None else 1
            name = getattr(method, "__name__", "custom")
            try:
                result = method(weights, self.num_slots, groups, self.num_nodes, self.num_gpus)
            except Exception as exc:  # a user's function: say whose error it is
                raise PolicyError(f"the planning function {name} raised {type(exc).__name__}: {exc}") from exc
            phy2log = result[0] if isinstance(result, tuple) and result else result
            if phy2log is None:
                raise PolicyError(f"the planning function {name} returned {result!r}: it must return phy2log [L, S] "
                                  "(or a tuple starting with it)")
            return as_placement(phy2log, self, f"the placement the planning function {name} returned",
                                method=name)
        phy2log, _ = get_method(method)(weights, self.deployment)
        return Placement(phy2log, self.num_experts, self.topology, self.num_groups, method=method)


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
        # the Balancer plans for an even split whatever split the run is priced with
        self.balancer = Balancer(deployment.num_layers, replace(deployment.deployment, dispatch="uniform"),
                                 placement=placement, **options)

    def observe(self, step: int, counts: np.ndarray):
        self.balancer.record(counts, physical=False)
        if (step + 1) % self.check_every or not self.balancer.should_rebalance():
            return None
        placement, _ = self.balancer.rebalance()
        return placement


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
}
"""The one registry of policy names (the simulator, :func:`eplb.sweep` and the CLI read it): name ->
``maker(method, check_every)`` returning a fresh :class:`Policy`. No rebalancing, the engines'
timers (planning from their summed window with ``method``, or hedged over it with eplb's default
method), and eplb's :class:`eplb.Balancer` deciding every ``check_every`` steps. Besides these names,
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
           "sglang_like", "POLICIES", "POLICY_NAMES", "HEDGED_SUBWINDOWS", "policy_by_name", "check_policy",
           "policy_label", "as_placement"]
