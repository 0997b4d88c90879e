"""Replay a series of per-step counts through a deployment and a rebalancing policy, in time.

:func:`simulate` serves every step of a series ``[T, L, E]`` with the placement in service, prices
it with a :class:`eplb.CostModel` (a layer waits for its slowest GPU; a step is the sum over layers),
shows the step's counts to the policy and, when the policy returns a new placement, prices the
weight copies (:func:`eplb.transfer_plan`: a slot whose expert changes costs a copy unless its GPU
already holds that expert) and switches to it (``copy_mode`` of the cost model: ``"stall"`` adds the
copy time to the step; ``"overlap"`` keeps serving the old placement until the copies are done;
``"free"`` switches at once for nothing).

Applying a rebalance in chunks of layers
----------------------------------------
With ``layers_per_step=k`` the engine applies a new placement ``k`` layers per step, as
TensorRT-LLM can (``layer_updates_per_iter``): the layers the new placement changes are queued in
layer order; after the step the policy returned it, the first ``k`` of them get their copies
(those layers' rows of the rebalance's transfer plan: the same copies as applied at once), after
the next step the next ``k``, and so on, at most one chunk started after any step. ``"stall"``: a
chunk's copy time is the stall after the step it is copied, and its layers switch then;
``"overlap"``: a chunk's layers switch once its copies are done in serving time, and the next
chunk starts then; ``"free"``: a chunk's layers switch at once. A chunk's copy time is its own
slowest GPU's, so the chunks' times add up to at least the all-at-once time (equal when every
chunk has the same slowest GPU): chunking trades one long stall for shorter ones that may add up
to more. Until a layer switches, its old placement serves it, so the placement in service is a
per-layer mix, and each step is priced with that mix (a layer's time depends only on its own
placement). Layers the new placement leaves unchanged take no turn.

If the policy returns another placement while one is being applied, the newest replaces it for
every layer: the layers not yet switched go straight to the newest plan, layers already switched
are moved again only where the newest plan changes them, and the queue is rebuilt (in layer order)
from the layers that differ from the newest plan. Its copies are priced from what each layer holds
at that moment (a layer whose copies are in flight, in ``"overlap"``, counted as holding what it is
being copied to, as when a whole placement is superseded; those in-flight copies are then replaced
by the new plan's chunks).

Deployment changes
------------------
``events`` are GPUs lost or nodes added or removed mid-series (:mod:`eplb.simulation.events`: an
:class:`~eplb.simulation.events.Event` is a step and a :class:`eplb.DeploymentChange`). After the
event's step is served (and the policy has seen it), the policy answers the change
(:meth:`eplb.Policy.redeploy`) with a placement on the new deployment, from the placement every
layer holds then; a rebalance still being applied is dropped (layers whose copies were in flight
count as holding what they were copied to). The recovery's weights are priced across the change
(:func:`eplb.transfer_plan`: each orphan loaded from host memory once, the rest copied from
surviving GPUs, never from a lost one; :meth:`eplb.CostModel.transfer_time`) and stall serving in
every copy mode but ``"free"`` (the engines pause to reconfigure), all layers at once. From the
next step on, the new deployment serves: its GPUs are priced, and the perfectly balanced time
spreads the work over them. :meth:`SimulationResult.summary` adds the host loads and the recovery
time; ``result.events`` reports each change (see :func:`simulate`).

Policies
--------
A policy is a subclass of :class:`eplb.Policy` (:mod:`eplb.serving.policy`: the contract, the
provided policies :class:`NoRebalance`, :class:`FixedInterval` with its presets :func:`vllm_like`
and :func:`sglang_like`, and :class:`BalancerPolicy`, and the one registry of names,
:data:`POLICY_NAMES` / :func:`policy_by_name`). :func:`simulate` calls ``policy.start(placement,
deployment)`` before step 0 and ``policy.observe(step, counts [L, E])`` after serving each step; a
returned placement (:class:`Placement` or ``phy2log [L, S]``) is adopted as described above; at a
deployment change, ``policy.redeploy(step, change, placement, deployment)``. Objects with the same
two methods that do not subclass it are accepted too (they answer a change with
:func:`eplb.serving.policy.donor_repair`).

Dispatch: ``"uniform"`` (each token goes to a replica of its expert picked at random: a slot is
activated with probability ``1 - (1 - 1/r)^c``, counted as its expectation; exact for each GPU's
mean, it flatters the slowest GPU where replicated experts get one or two tokens a pass: on
DeepSeek-V3 at 288 slots on 32 GPUs by 1.2% at one token per GPU, 0.3% at two, 0.04% or less from
four, ``bench/research/split_bias.py``; :func:`eplb.recommend`, made for small decode batches,
draws the split instead) or ``"optimal"`` (every
step split by :func:`eplb.analysis.dispatch.optimal_dispatch` for that step's counts, as an engine that
computes the split from the router's output before the all-to-all; a slot is activated when it
takes at least half a token).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model._validation import as_int, check_layer_totals
from ..model.deployment import Deployment, deployment_argument
from ..model.cost import CostModel
from ..analysis.dispatch import optimal_dispatch, uniform_shares
from ..kernels.plumbing.layout import replica_counts
from ..analysis.loads import FIXED_SPLIT, RANDOM_SPLIT, gpu_work
from ..analysis.placement import Placement
from ..model.topology import Topology
from ..serving.policy import (POLICY_NAMES, BalancerPolicy, PolicyContext, FixedInterval, NoRebalance,  # noqa: F401
                              Policy, PolicyError, as_placement, check_policy, donor_repair, policy_by_name,
                              policy_label, sglang_like, vllm_like)
from ..serving.transfer import KINDS, TransferPlan, transfer_plan
from ..engines import SCORING, dispatch_rule
from .events import Event, check_starts_from, schedule

CHUNK = 256  # steps priced at once
_PLAN_FIELDS = ("layer", "expert", "src_slot", "dst_slot", "src_gpu", "dst_gpu", "kind")


# ------------------------------------------------------------------------------------ result

@dataclass(frozen=True, eq=False)
class SimulationResult:
    """What a policy cost over a series of ``T`` steps and ``L`` layers (times in seconds).

    Attributes:
        layer_time: ``[T, L]`` each layer's time (its slowest GPU).
        balanced_time: ``[T, L]`` each layer's time perfectly balanced: its routed tokens and its
            activated experts (experts with tokens, each read once as with one replica) spread
            evenly over the GPUs that serve. It depends on the counts and the deployment's GPUs
            alone, not on the placement, the policy or the dispatch mode, so every run on the same
            series and GPUs is measured from the same baseline (the extra weight reads of
            replicas count as time lost).
        stall_time: ``[T]`` time serving waited for weight copies after step ``t``.
        copies: ``[T, 4]`` slots whose expert changed after step ``t``, by where the weights come
            from (:data:`eplb.serving.transfer.KINDS`): the same GPU (a local move, not a copy
            between GPUs), the same node, another node, host memory (experts a deployment change
            left with no replica). Applied in chunks of layers, a rebalance's copies are spread over
            the steps of its chunks.
        copy_time: ``[T]`` duration of the copies started after step ``t`` (one chunk's, when chunked).
        rebalance_steps: ``[R]`` steps after which a policy's new placement was adopted (its first
            copies start).
        policy: the policy's name; cost_model: the :class:`CostModel`; expert_bytes: bytes per copy.
        final_placement: the placement in service at the end, copies in flight counted as landed;
            when a rebalance applied in chunks of layers is unfinished, a per-layer mix of the old
            and the new placements (``method="mixed"``).
        wall_time_s: seconds the simulation took.
        extra: ``{"layers_per_step": k}`` when the simulation applied rebalances in chunks, else empty.
        host_time: ``[T]`` seconds the policy took on the simulator's thread at step ``t`` (its
            ``observe``: what an engine's own thread would spend in it; ``None`` when not measured).
        imbalance: ``[T]`` each step's token imbalance ``(max - mean) / mean`` over the GPUs that
            serve, averaged over the layers with tokens (NaN for a step without any).
        events: one dict per deployment change (:func:`simulate` lists the keys).
    """

    layer_time: np.ndarray
    balanced_time: np.ndarray
    stall_time: np.ndarray
    copies: np.ndarray
    copy_time: np.ndarray
    rebalance_steps: np.ndarray
    policy: str
    cost_model: CostModel
    final_placement: Placement
    wall_time_s: float
    extra: dict = field(default_factory=dict)
    host_time: np.ndarray | None = None
    imbalance: np.ndarray | None = None
    events: tuple = ()

    @property
    def step_time(self) -> np.ndarray:
        """``[T]`` MoE time of each step (sum over layers), without stalls."""
        return self.layer_time.sum(axis=1)

    @property
    def ideal_time(self) -> np.ndarray:
        """``[T]`` MoE time of each step with every layer perfectly balanced."""
        return self.balanced_time.sum(axis=1)

    @property
    def num_rebalances(self) -> int:
        return int(self.rebalance_steps.size)

    def bytes_moved(self) -> dict[str, float]:
        """Bytes copied of each kind (``intra_gpu``, ``intra_node``, ``cross_node``, ``from_host``, ``total``)."""
        totals = self.copies.sum(axis=0) * self.cost_model.expert_bytes
        result = {name: float(totals[i]) for i, name in enumerate(KINDS[:totals.shape[0]])}
        result["total"] = float(totals.sum())
        return result

    def summary(self) -> dict[str, Any]:
        """Totals: time lost to imbalance (and with stalls) as a share of the balanced time, the
        largest single stall (``max_stall_s``: the latency spike requests in flight see),
        rebalances, and weight copies between GPUs (``copies``: a slot whose expert changes, unless
        its GPU already holds that expert; those are ``local_moves``, within one GPU's HBM) and the
        bytes they move; across deployment changes, the experts loaded from host memory
        (``host_loads``) and the recovery stalls (``recovery_s``)."""
        ideal = float(self.ideal_time.sum())
        moe = float(self.step_time.sum())
        stall = float(self.stall_time.sum())
        copies = self.copies.sum(axis=0)
        return {
            "policy": self.policy, "steps": int(self.layer_time.shape[0]),
            "moe_time_s": moe, "balanced_time_s": ideal, "stall_time_s": stall,
            "max_stall_s": float(self.stall_time.max()) if self.stall_time.size else 0.0,
            "lost_share": (moe - ideal) / ideal if ideal > 0 else 0.0,
            "lost_with_stalls_share": (moe + stall - ideal) / ideal if ideal > 0 else 0.0,
            "rebalances": self.num_rebalances,
            "copies": int(copies[1] + copies[2]), "copies_intra_node": int(copies[1]),
            "copies_cross_node": int(copies[2]), "local_moves": int(copies[0]),
            "bytes_moved": float((copies[1] + copies[2]) * self.cost_model.expert_bytes),
            "host_loads": int(copies[3]), "recovery_s": float(sum(e["stall_s"] for e in self.events)),
            "wall_time_s": self.wall_time_s,
            **self.host_summary(),
        }

    def host_summary(self) -> dict[str, float]:
        """The policy's time on the engine's thread per step, in ms: ``host_ms_mean``,
        ``host_ms_p99``, ``host_ms_max`` (empty when not measured)."""
        if self.host_time is None or not self.host_time.size:
            return {}
        ms = 1e3 * self.host_time
        return {"host_ms_mean": float(ms.mean()), "host_ms_p99": float(np.percentile(ms, 99)),
                "host_ms_max": float(ms.max())}


# ------------------------------------------------------------------------------------ simulation

class _Pricing:
    """Turns counts into per-GPU tokens and activated slots under one placement and dispatch.

    Args:
        phy2log: ``[L, S]`` int64, the placement in service (possibly a per-layer mix of plans).
        topology, num_experts: the deployment's; dispatch: ``"uniform"`` or ``"optimal"``.
    """

    def __init__(self, phy2log: np.ndarray, topology: Topology, num_experts: int, dispatch: str):
        self.topology = topology
        self.dispatch = dispatch
        self.phy2log = np.array(phy2log, dtype=np.int64, order="C")  # a copy: the caller's mix changes
        self.uniform = uniform_shares(self.phy2log, replica_counts(self.phy2log, num_experts))[None]  # [1, L, S]
        self.live = topology.slots_per_gpu > 0  # GPUs that serve

    def loads(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``counts [B, L, E]`` -> tokens ``[B, L, G]`` and activated slots ``[B, L, G]``."""
        counts = np.ascontiguousarray(counts, dtype=np.float64)
        if self.dispatch == "optimal":
            shares, _ = optimal_dispatch(counts, self.phy2log, self.topology)
            return gpu_work(counts, self.phy2log, self.topology, shares, FIXED_SPLIT)
        return gpu_work(counts, self.phy2log, self.topology, self.uniform, RANDOM_SPLIT)


def _token_imbalance(tokens: np.ndarray) -> np.ndarray:
    """``tokens [B, L, G]`` -> ``[B]``: ``(max - mean) / mean`` over the GPUs, averaged over the
    layers with tokens (NaN for a step without any)."""
    mean, peak = tokens.mean(axis=-1), tokens.max(axis=-1)
    loaded = mean > 0
    per_layer = np.divide(peak - mean, mean, out=np.zeros_like(mean), where=loaded)
    layers = loaded.sum(axis=-1)
    return np.divide(per_layer.sum(axis=-1), layers, out=np.full(layers.shape, np.nan), where=layers > 0)


def _copies_of_layers(plan: TransferPlan, layers: np.ndarray) -> TransferPlan:
    """The copies of ``plan`` whose layer is in ``layers [n]`` (the whole plan when it has no other)."""
    wanted = np.zeros(plan.num_layers, bool)
    wanted[layers] = True
    keep = wanted[plan.layer]
    if keep.all():
        return plan
    return TransferPlan(*(getattr(plan, name)[keep] for name in _PLAN_FIELDS), num_layers=plan.num_layers,
                        topology=plan.topology, expert_bytes=plan.expert_bytes)


def _warn_if_too_short(policy, num_steps: int) -> None:
    """A ``RuntimeWarning`` when the series ends before the policy's first rebalance or decision
    (its ``every`` or ``check_every`` steps): its run cannot differ from no rebalancing."""
    for attribute, what in (("every", "rebalances every"), ("check_every", "decides every")):
        interval = getattr(policy, attribute, None)
        if isinstance(interval, (int, np.integer)) and not isinstance(interval, bool) and interval > num_steps:
            label = policy_label(policy)
            warnings.warn(f"the series has {num_steps} steps but policy {label!r} {what} {interval} steps: it never "
                          "acts, so its run is the same as no rebalancing (use a longer series or a shorter interval)",
                          RuntimeWarning, stacklevel=3)
            return


def _call_policy(policy, name: str, *args):
    """``policy.<name>(*args)``; an exception the policy raises becomes a :class:`PolicyError` naming
    the policy and the step (a policy is user code)."""
    try:
        return getattr(policy, name)(*args)
    except PolicyError:
        raise
    except Exception as exc:
        label = policy_label(policy)
        where = f" at step {args[0]}" if name in ("observe", "redeploy") else ""
        raise PolicyError(f"policy {label!r} raised {type(exc).__name__} in {name}(){where}: {exc}") from exc


def _series_block(series, start: int, stop: int) -> np.ndarray:
    if isinstance(series, np.ndarray):
        return series[start:stop]
    return np.asarray(series.block(start, stop))


def checked_series(series, *, generators: bool = True):
    """``series`` as given when it is a generator with ``block`` (a :class:`Series`, with
    ``generators``), else as a checked numeric ``[T, L, E]`` array (at least one step, finite,
    non-negative, layer totals within float64)."""
    if generators and not isinstance(series, np.ndarray) and hasattr(series, "block"):
        return series
    series = np.asarray(series)
    if series.ndim != 3 or series.dtype.kind not in "biuf":
        kinds = "a numeric [T, L, E] array" + (" or a Series" if generators else "")
        raise ValueError(f"counts must be {kinds}, got shape {series.shape}")
    if series.shape[0] < 1:
        raise ValueError("counts must have at least one step")
    if series.dtype.kind == "f" and not np.isfinite(series).all():
        raise ValueError("counts must be finite")
    if (series < 0).any():
        raise ValueError("counts must be non-negative")
    check_layer_totals(series, "counts")
    return series


class _Replay:
    """One run of :func:`simulate`: what serves each layer and what it holds, the copies under way,
    the serving clock, and the figures of every step (``T`` steps, ``L`` layers, ``S`` slots)."""

    def __init__(self, deployment: PolicyContext, target: Placement, dispatch: str, num_steps: int,
                 step_layers: int) -> None:
        num_layers = deployment.num_layers
        self.deployment, self.cost_model, self.dispatch = deployment, deployment.cost_model, dispatch
        self.step_layers = step_layers
        self.layer_time = np.empty((num_steps, num_layers))
        self.balanced = np.empty((num_steps, num_layers))
        self.stall = np.zeros(num_steps)
        self.copies = np.zeros((num_steps, len(KINDS)), np.int64)
        self.imbalance = np.full(num_steps, np.nan)
        self.events: list[Event] = []  # the changes still ahead, in step order
        self.event_reports: list[dict] = []
        self.copy_time = np.zeros(num_steps)
        self.host_time = np.zeros(num_steps)
        self.rebalance_steps: list[int] = []
        self.target = target  # the newest plan adopted
        # The placement in service is a per-layer mix while a plan is being applied:
        self.serving = np.array(target.phy2log)  # [L, S] what serves each layer
        self.held = self.serving.copy()  # [L, S] what each layer holds once the copies started have landed
        self.pricing = self._new_pricing()
        self.live = self.pricing.live  # the GPUs that serve, as the first placement has them
        self.plan: TransferPlan | None = None  # the copies from `held` to `target` when the plan was adopted
        self.queue = np.empty(0, np.int64)  # [n] layers still to switch to `target`, in order
        self.in_flight: tuple[np.ndarray, float] | None = None  # (layers, serving time when their copies finish)
        self.clock = 0.0
        self.chunk_start = 0  # the step of the block's first row
        self.priced_until = 0  # steps before this are priced

    def _new_pricing(self) -> _Pricing:
        return _Pricing(self.serving, self.deployment.topology, self.deployment.num_experts, self.dispatch)

    def run(self, series, policy, num_steps: int, progress=None) -> None:
        """Serve every step of ``series``, block by block, showing each to ``policy`` (and telling
        ``progress(steps done, num_steps, "")`` after each block)."""
        for chunk_start in range(0, num_steps, CHUNK):
            block = _series_block(series, chunk_start, min(chunk_start + CHUNK, num_steps))
            self.chunk_start = self.priced_until = chunk_start
            for i in range(block.shape[0]):
                self.step(block, i, policy)
            end = chunk_start + block.shape[0]
            if self.priced_until < end:
                self.price(block[self.priced_until - chunk_start:], self.priced_until)
                self.clock += self.layer_time[self.priced_until:end].sum()
            if progress is not None:
                progress(end, num_steps, "")

    def step(self, block: np.ndarray, i: int, policy) -> None:
        """Step ``chunk_start + i`` (block row ``i``): land the copies that finished, show the step to
        the policy, adopt the placement it returns, and start the next layers' copies."""
        t = self.chunk_start + i
        if self.in_flight is not None:  # price step by step while copies run beside serving
            self.catch_up(block, i)
            if self.clock >= self.in_flight[1]:
                self.switch(self.in_flight[0])
                self.in_flight = None
        called = time.perf_counter()
        new = _call_policy(policy, "observe", t, block[i])
        self.host_time[t] = time.perf_counter() - called
        if new is not None:
            self.adopt(as_placement(new, self.deployment, f"the placement policy.observe returned at step {t}"),
                       block, i)
        if self.in_flight is None and self.queue.size:  # the next chunk of layers: its copies start now
            self.start_copies(block, i)
        if self.events and self.events[0].step == t:
            self.redeploy(block, i, self.events.pop(0), policy)

    def redeploy(self, block: np.ndarray, i: int, event: Event, policy) -> None:
        """The deployment changes after block row ``i``: the policy answers from what every layer
        holds, the recovery's weights are priced (a stall but in ``"free"`` mode), the new
        deployment serves from the next step."""
        t = self.chunk_start + i
        self.catch_up(block, i)
        change, context = event.change, self.deployment
        in_service = Placement(self.held, context.num_experts, context.topology, context.num_groups, method="in service")
        new_context = PolicyContext(change.new, context.num_layers, self.cost_model)
        called = time.perf_counter()
        if callable(getattr(policy, "redeploy", None)):
            answer = _call_policy(policy, "redeploy", t, change, in_service, new_context)
        else:
            answer = donor_repair(in_service, change)
        answered = time.perf_counter() - called
        new = as_placement(answer, new_context, f"the placement policy.redeploy returned at step {t}")
        # (an identity change as its deployment: transfer_plan refuses a DeploymentChange that changes nothing)
        recovery = transfer_plan(self.held, new, change.new if change.is_identity else change,
                                 expert_bytes=int(self.cost_model.expert_bytes))
        seconds = self.cost_model.transfer_time(recovery)
        stall = 0.0 if self.cost_model.copy_mode == "free" else seconds
        self.copies[t] += np.bincount(recovery.kind, minlength=len(KINDS))
        self.copy_time[t] += seconds
        self.stall[t] += stall
        self.clock += stall
        self.event_reports.append({
            "step": t, "label": event.label, "change": change.describe(), "lost_gpus": change.lost_gpus.tolist(),
            "added_gpus": change.added_gpus.tolist(), "orphans": int(change.orphans(self.held).sum()),
            "copy_floor": int(change.floor(self.held).sum()), "copies": recovery.counts(), "bytes": recovery.bytes(),
            "recovery_s": seconds, "stall_s": stall, "answer_s": answered, "answer": new.method})
        self.deployment, self.target = new_context, new
        self.serving = np.array(new.phy2log)
        self.held = self.serving.copy()
        self.pricing = self._new_pricing()
        self.live = self.pricing.live
        self.plan, self.queue, self.in_flight = None, np.empty(0, np.int64), None

    def adopt(self, new: Placement, block: np.ndarray, i: int) -> None:
        """Make ``new`` the target at block row ``i``: the layers that differ from it queue for copies."""
        self.catch_up(block, i)  # the steps served by the placement up to now
        self.plan = transfer_plan(self.held, new, expert_bytes=int(self.cost_model.expert_bytes))
        self.target = new
        changed = (self.held != new.phy2log).any(axis=1) | (self.serving != new.phy2log).any(axis=1)
        self.queue = np.flatnonzero(changed)
        self.in_flight = None  # superseded: its layers are in the queue again unless they serve `new`
        self.rebalance_steps.append(self.chunk_start + i)

    def start_copies(self, block: np.ndarray, i: int) -> None:
        """Start the copies of the next ``step_layers`` queued layers at block row ``i``; they serve
        when the cost model's copy mode says."""
        t = self.chunk_start + i
        self.catch_up(block, i)
        layers, self.queue = self.queue[:self.step_layers], self.queue[self.step_layers:]
        part = _copies_of_layers(self.plan, layers)
        self.copies[t] = np.bincount(part.kind, minlength=len(KINDS))
        duration = self.cost_model.transfer_time(part) if len(part) else 0.0
        self.copy_time[t] = duration
        self.held[layers] = self.target.phy2log[layers]
        if self.cost_model.copy_mode == "stall":
            self.stall[t] = duration
            self.clock += duration
            self.switch(layers)
        elif self.cost_model.copy_mode == "free" or duration == 0.0:
            self.switch(layers)
        else:
            self.in_flight = (layers, self.clock + duration)

    def price(self, block: np.ndarray, offset: int) -> None:
        """Layer times ``[B, L]`` of the steps ``offset ...`` of ``block`` with the placement in service,
        and the balanced times beside them."""
        tokens, active = self.pricing.loads(block)
        if not self.live.all():
            tokens, active = tokens[..., self.live], active[..., self.live]
        rows = slice(offset, offset + block.shape[0])
        self.imbalance[rows] = _token_imbalance(tokens)
        with np.errstate(over="ignore", invalid="ignore"):  # refused below
            self.layer_time[rows] = self.cost_model.layer_time(tokens, active)
            self.balanced[rows] = self.balanced_time(block, tokens.shape[-1])
        if not (np.isfinite(self.layer_time[rows]).all() and np.isfinite(self.balanced[rows]).all()):
            raise ValueError(f"counts and cost_model: a layer time of steps {offset}..{offset + block.shape[0] - 1} "
                             "overflows float64 (counts or cost constants too large; counts are scale-free: "
                             "divide them by a common factor)")

    def balanced_time(self, block: np.ndarray, serving_gpus: int) -> np.ndarray:
        """``[B, L]``: each layer's routed tokens and its activated experts (one weight read each)
        spread evenly over the GPUs that serve: the same for every placement and dispatch."""
        counts = np.asarray(block, dtype=np.float64)
        return self.cost_model.gpu_time(counts.sum(axis=-1) / serving_gpus,
                                        (counts > 0).sum(axis=-1) / serving_gpus)

    def catch_up(self, block: np.ndarray, i: int) -> None:
        """Price the steps up to block row ``i`` with the placement in service now."""
        t = self.chunk_start + i
        if self.priced_until <= t:
            self.price(block[self.priced_until - self.chunk_start:i + 1], self.priced_until)
            self.clock += self.layer_time[self.priced_until:t + 1].sum()
            self.priced_until = t + 1

    def switch(self, layers: np.ndarray) -> None:
        """The copies of ``layers [n]`` have landed: those layers serve what they hold."""
        self.serving[layers] = self.held[layers]
        self.pricing = self._new_pricing()

    def final_placement(self) -> Placement:
        """What every layer holds at the end: the target when all its copies started."""
        if np.array_equal(self.held, self.target.phy2log):
            return self.target
        return Placement(self.held, self.deployment.num_experts, self.deployment.topology,
                         self.deployment.num_groups, method="mixed")


def simulate(counts, deployment: Deployment | None = None, *, policy=None, cost_model: CostModel | None = None,
             initial=None, initial_steps: int = 1, layers_per_step: int | None = None, progress=None, events=None,
             **deployment_keywords) -> SimulationResult:
    """Replay ``counts`` (a series of steps) through a deployment and a rebalancing policy.

    Args:
        counts: ``[T, L, E]`` counts per step (numpy), or an :class:`eplb.simulation.series.Series` (generated
            block by block, never held whole).
        deployment: the :class:`eplb.Deployment`; its dispatch rule is how each step is priced: an
            even split (``"uniform"`` and the engines' even splits) or ``"optimal"`` (see the module
            docstring). Its keywords (``num_slots``, ..., ``dispatch``) still work in its place,
            deprecated.
        policy: see the module docstring (default :class:`NoRebalance`).
        cost_model: a :class:`CostModel` (default: DeepSeek-V3 on H100, ``CostModel.preset()``).
        initial: the placement in service at step 0 (a :class:`Placement` or ``phy2log [L, S]``);
            default: the greedy plan of the first ``initial_steps`` steps.
        layers_per_step: ``None`` (default): a new placement's layers switch all at once. An integer
            ``k >= 1``: the engine applies it ``k`` layers per step, in layer order (see "Applying
            a rebalance in chunks of layers" in the module docstring); ``k >= L`` is all at once.
        progress: ``None``, or called as ``progress(steps done, T, "")`` at the start and after
            every block of :data:`CHUNK` steps (:class:`eplb.io.progress.Progress` shows it).
        events: deployment changes mid-series (see "Deployment changes" in the module docstring):
            :class:`eplb.simulation.events.Event` values, or ``{step: change}`` / ``[(step, change)]``
            with :class:`eplb.simulation.events.Resize` or :class:`eplb.DeploymentChange` changes
            (:func:`eplb.simulation.events.schedule`), each after a step in ``[0, T - 1)``.
    Returns:
        A :class:`SimulationResult`; its ``events`` has one dict per change: ``step``, ``label``,
        ``change`` (:meth:`eplb.DeploymentChange.describe`), ``lost_gpus`` and ``added_gpus``,
        ``orphans`` and ``copy_floor`` (summed over layers), the recovery's ``copies`` and ``bytes``
        of each kind (:meth:`eplb.TransferPlan.counts`), ``recovery_s`` (its copy time),
        ``stall_s`` (what serving waited: 0 in ``"free"`` mode), ``answer_s`` (the policy's wall
        time to answer, on this machine), ``answer`` (the method of the placement it answered
        with), and the token imbalance (mean over steps of :attr:`SimulationResult.imbalance`) and
        the time lost (a share of the balanced time) ``before`` (the steps since the last change),
        ``during`` (the steps the answer served, until the policy's next placement or change) and
        ``after`` (every step until the next change): ``imbalance_before``, ``imbalance_during``,
        ``imbalance_after``, ``lost_share_before``, ... and ``steps_before``, ``steps_during``,
        ``steps_after``.
    """
    start_wall = time.perf_counter()
    if layers_per_step is not None:
        layers_per_step = as_int(layers_per_step, "layers_per_step", minimum=1)
    series = checked_series(counts)
    num_steps, num_layers, num_experts = series.shape
    if num_steps < 1:
        raise ValueError("counts must have at least one step")
    cost_model = CostModel.preset() if cost_model is None else cost_model
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be an eplb.CostModel, got {type(cost_model).__name__}")
    given = deployment_argument(deployment, deployment_keywords, "simulate", num_experts=num_experts)
    dispatch = dispatch_rule(given.dispatch).kind
    if dispatch not in SCORING:  # the rules a window is scored by (eplb.engines)
        raise ValueError(f"simulate prices an even split or optimal dispatch, not dispatch={given.dispatch!r}")
    deployment = PolicyContext(given, num_layers, cost_model)
    policy = NoRebalance() if policy is None else check_policy(policy)
    _warn_if_too_short(policy, num_steps)
    if progress is not None:
        progress(0, num_steps, "")
    if initial is None:
        steps = as_int(initial_steps, "initial_steps", minimum=1)
        initial = deployment.plan(_series_block(series, 0, min(steps, num_steps)).sum(axis=0), "greedy")
    target = as_placement(initial, deployment, "initial")
    step_layers = num_layers if layers_per_step is None else layers_per_step
    replay = _Replay(deployment, target, dispatch, num_steps, step_layers)
    replay.events = _checked_events(events, given, num_steps)
    _call_policy(policy, "start", target, deployment)
    replay.run(series, policy, num_steps, progress)
    return SimulationResult(
        layer_time=replay.layer_time, balanced_time=replay.balanced, stall_time=replay.stall, copies=replay.copies,
        copy_time=replay.copy_time, rebalance_steps=np.asarray(replay.rebalance_steps, np.int64),
        policy=policy_label(policy), cost_model=cost_model, final_placement=replay.final_placement(),
        wall_time_s=time.perf_counter() - start_wall,
        extra={} if layers_per_step is None else {"layers_per_step": layers_per_step}, host_time=replay.host_time,
        imbalance=replay.imbalance, events=_event_reports(replay),
    )


def _checked_events(events, deployment: Deployment, num_steps: int) -> list[Event]:
    """``events`` (see :func:`simulate`) as :class:`Event` values in step order, each starting from
    the deployment the one before left and after a step in ``[0, T - 1)``; ``ValueError`` otherwise."""
    if events is None:
        return []
    if isinstance(events, dict) or not all(isinstance(e, Event) for e in events):
        events = schedule(deployment, events)
    events = sorted(events, key=lambda e: e.step)
    current = deployment
    for k, event in enumerate(events):
        if k and event.step == events[k - 1].step:
            raise ValueError(f"events: two deployment changes after step {event.step}: make them one change")
        if event.step >= num_steps - 1:
            raise ValueError(f"events: a change after step {event.step}, but the series has {num_steps} steps: a change "
                             f"comes after a step in [0, {num_steps - 1}) so that a step is served after it")
        check_starts_from(event.change, current, event.step)
        current = event.change.new
    return events


def _event_reports(replay: "_Replay") -> tuple[dict, ...]:
    """Each change's report with the imbalance and time lost before, during and after it."""
    steps = replay.imbalance.size
    adopted = np.asarray(replay.rebalance_steps, np.int64)
    changes = [r["step"] for r in replay.event_reports]
    reports = []
    for k, report in enumerate(replay.event_reports):
        t = report["step"]
        previous = changes[k - 1] + 1 if k else 0
        until = changes[k + 1] if k + 1 < len(changes) else steps - 1
        answer_until = min([until] + adopted[adopted > t].tolist())
        spans = {"before": (previous, t + 1), "during": (t + 1, answer_until + 1), "after": (t + 1, until + 1)}
        for name, (start, stop) in spans.items():
            report[f"imbalance_{name}"] = _mean_or_nan(replay.imbalance[start:stop])
            moe, ideal = replay.layer_time[start:stop].sum(), replay.balanced[start:stop].sum()
            report[f"lost_share_{name}"] = float((moe - ideal) / ideal) if ideal > 0 else float("nan")
            report[f"steps_{name}"] = stop - start
        reports.append(report)
    return tuple(reports)


def _mean_or_nan(values: np.ndarray) -> float:
    """The mean of the values that are not NaN (NaN when none is)."""
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else float("nan")


# The policies live in eplb.serving.policy; these names stay importable from here.
__all__ = ["simulate", "SimulationResult", "PolicyContext", "Policy", "NoRebalance", "FixedInterval", "BalancerPolicy",
           "PolicyError", "vllm_like", "sglang_like", "POLICY_NAMES", "policy_by_name"]
