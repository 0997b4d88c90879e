"""An answer per pool: how many redundant experts, and which plan, from a pool's own statistics.

A serving pool (one phase, one batch size, one kind of GPU) records a series ``counts [T, L, E]``
of ``T >= 2`` windows. :func:`recommend` prices every slot count the engine allows (by default
0, 1 and 2 redundant slots per GPU: ``S = E, E + G, E + 2G``) with two planners each, judged
*held out* (leave one window out, as :func:`eplb.held_out`: a plan made from the other windows
with :func:`eplb.plan` serves the window left out), beside the engine's layout (the published
greedy from the summed counts at the deployment's slot count, e.g. ``E + G``), and returns the option with the
shortest predicted MoE step time and its placement planned from all windows.

It also says what a lost node costs the recommended layout (the share of tokens whose expert loses
every replica, :mod:`eplb.analysis.exposure`) and how many slots make a node loss survivable for
the pool's deployment (every expert on two nodes: :func:`node_loss_slots`, the fewest multiple of
the GPUs with ``S >= 2 E``, planned with ``eplb.plan(..., survive="node")``).

Step time of a placement on a window
------------------------------------
Sampled passes and each layer's time under the engines' even split: :mod:`eplb.simulation.step_time`.

Two planners at each slot count
-------------------------------
``"tokens"``: :func:`eplb.plan` on the windows (balances tokens per GPU). ``"step-time"``
(:func:`plan_for_step_time`): candidates are the token plan, the plan of the windows' *expected
activations* ``1 - (1 - p_e)^n`` (``p_e`` the expert's share of the layer's tokens) and the plan
of each expert's *expected memory time* (activations times the expert's bytes plus its tokens'
bytes), and where the slot count is above the fewest the GPUs allow, the fewest slots' token plan
with the extra slots given to replicas of the *coldest* experts (:func:`cold_replicas`: a replica
that receives no tokens is never read, so the layout serves about as fast as the one without the
extra slots, where the token plan reads both copies of its hot experts every step). Per layer it
takes the candidate with the shortest simulated layer time on the ``W`` windows it plans from
(ties: the token plan), so in sample it is never slower than the token plan, layer by layer.

That per-layer choice is kept only when it beats the token plan by more than the noise of the
windows, measured by leaving one window out *inside* them: for each window ``w`` the per-layer
choice is made from the other ``W - 1`` windows and its step time on ``w`` compared with the token
plan's (the candidates are those planned from all ``W``; only the choice is held out). With the
``W`` gains' mean ``m`` and standard deviation ``s``, the choice is kept when the prediction bound
of a new window's gain ``m + 2 s sqrt(1 + 1/W)`` is below zero (:data:`NOISE_MARGIN` = 2); otherwise,
and with a single window, the step-time plan is the token plan. A per-layer choice picks the
luckiest of several candidates on noisy sampled passes; at large batches the candidates differ by
less than that noise and the in-sample pick was slower held out on some windows, where at small
batches (replicas read at every step) the gains are large and consistent and stay. The test is on
the whole step, all layers or none: gains and noise add up over the layers, where a test per layer
keeps the layers that pass by chance. The inner gains are optimistic (the candidates were planned
with the window left out), so the margin, not the construction, is what kept the held-out folds of
``bench/pools.py`` from being slower than the token plan; :attr:`PoolOption.beats_tokens` says
whether the step-time plan was faster held out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..analysis.placement import Placement
from ..model._validation import as_counts, as_int
from ..model.cost import MODELS, CostModel, MoEModel
from ..model.deployment import Deployment, deployment_argument, slots_for
from ..analysis.exposure import worst_loss
from ..planning.api import HELD_OUT_FOLDS, plan
from ..planning.survivability import survivable_slots
from .step_time import _Sampler, layer_time_bound, layer_times, sample_passes

__all__ = ["CANDIDATES", "NOISE_MARGIN", "PHASES", "PLANNERS", "PoolOption", "Recommendation", "cold_replicas", "layer_times",
           "layer_time_bound", "node_loss_note", "node_loss_slots", "plan_for_step_time", "recommend", "sample_passes"]

PHASES = ("decode", "prefill")
PLANNERS = ("tokens", "step-time")
CANDIDATES = ("tokens", "expected activations", "expected memory time", "cold replicas")
"""The step-time planner's candidates, in the order :func:`plan_for_step_time` tries them per layer."""
GIB = 2.0 ** 30
NOISE_MARGIN = 2.0
"""Standard deviations of the inner leave-one-out gains the step-time plan's predicted gain on a new
window must clear before it replaces the token plan (:func:`plan_for_step_time`)."""


@dataclass(frozen=True)
class PoolOption:
    """One row of the options table: a slot count and a planner, judged held out.

    Attributes:
        num_slots: ``S``; redundant_experts: ``S - E``.
        planner: ``"tokens"`` or ``"step-time"`` (module docstring).
        step_ms: held-out predicted MoE step time (ms): the mean over the held-out folds of the
            mean over each fold's windows and sampled passes.
        step_ms_folds: ``[F]`` that figure per fold.
        replica_gib_per_gpu: HBM the redundant replicas take per GPU (GiB), over the model's MoE layers.
        vs_default_pct: ``100 * (step_ms / default step_ms - 1)``: negative is faster than the
            engine's default layout.
        beats_tokens: for ``"step-time"`` rows, whether its held-out step time is below the
            ``"tokens"`` row at the same slots; ``None`` for ``"tokens"`` rows.
        balancedness_held_out: the held-out plans' token balancedness (``mean / max`` GPU tokens,
            the even split) on the windows they did not see: the mean over the folds' windows of
            the mean over MoE layers (NaN when not measured).
    """

    num_slots: int
    redundant_experts: int
    planner: str
    step_ms: float
    step_ms_folds: tuple[float, ...]
    replica_gib_per_gpu: float
    vs_default_pct: float
    beats_tokens: bool | None
    balancedness_held_out: float = float("nan")


@dataclass(frozen=True, eq=False)
class Recommendation:
    """What :func:`recommend` found for a pool.

    Attributes:
        options: the table, ordered by slots then planner (``"tokens"`` first).
        recommended: the option with the shortest held-out step time (ties: fewer slots, then
            ``"tokens"``).
        placement: the recommended option's :class:`Placement`, planned from all windows.
        in_sample_step_ms: the placement's predicted step time on all windows (ms);
            tokens_in_sample_step_ms: the token plan's at the same slots, from all windows.
        default_slots, default_step_ms: the engine's layout (the published greedy on the summed
            windows at the deployment's slot count) and its held-out step time (ms).
        bound_step_ms: a lower bound (ms) on the held-out step time of *any* placement, at any
            slot count, on the same sampled passes (:func:`layer_time_bound`, folds weighted as
            the options'): no layout can be more than ``1 - bound_step_ms / step_ms`` faster
            than an option.
        phase, batch: the pool's; routed_per_pass: ``n = batch * G * top_k`` routed tokens per
            layer and pass; passes: passes sampled per window; folds: held-out folds.
        cost_model: the :class:`CostModel` that priced the passes.
        worst_node_loss, worst_gpu_loss: the recommended placement's exposure on the pool's summed
            windows: the largest share of the routed tokens whose expert loses every replica when
            one node / one GPU is lost (:func:`eplb.analysis.exposure.worst_loss`).
        node_loss_slots: the fewest slots (a multiple of ``G``) that make a node loss survivable
            for the pool's deployment, every expert on two nodes (``eplb.plan(...,
            survive="node")``, planned global: a hierarchical layout keeps each group on one
            node); ``None`` with a single node (no slot count helps). node_loss_redundant:
            ``node_loss_slots - E`` (``None`` likewise).
        node_loss_note: one line saying the above.
    """

    options: tuple[PoolOption, ...]
    recommended: PoolOption
    placement: Placement
    in_sample_step_ms: float
    tokens_in_sample_step_ms: float
    default_slots: int
    default_step_ms: float
    bound_step_ms: float
    phase: str
    batch: int
    routed_per_pass: int
    passes: int
    folds: int
    cost_model: CostModel
    worst_node_loss: float
    worst_gpu_loss: float
    node_loss_slots: int | None
    node_loss_redundant: int | None
    node_loss_note: str

    def rows(self) -> list[dict]:
        """The options table as dicts (``recommended`` marks the chosen row), for printing or CSV."""
        return [{"num_slots": o.num_slots, "redundant_experts": o.redundant_experts, "planner": o.planner,
                 "step_ms": o.step_ms, "replica_gib_per_gpu": o.replica_gib_per_gpu,
                 "vs_default_pct": o.vs_default_pct, "beats_tokens": o.beats_tokens,
                 "balancedness_held_out": o.balancedness_held_out,
                 "recommended": o == self.recommended} for o in self.options]


class _Pool(NamedTuple):
    """The checked inputs of :func:`recommend`."""

    windows: np.ndarray  # [T, L, E] float64
    slots: tuple[int, ...]  # slot counts to price, increasing
    deployment: Deployment  # the pool's GPUs, nodes and groups at the engine's slot count
    cost: CostModel
    model: MoEModel
    routed: int  # routed tokens per layer and pass
    sampler: "_Sampler"
    folds: int


# ------------------------------------------------------------------------------------ planners

def _activation_weights(windows: np.ndarray, routed: int, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """``[T, L, E]`` windows -> (expected activations ``1 - (1 - p)^n``, expected memory bytes
    ``activations * expert_bytes + n * p * token_bytes``), both ``[T, L, E]``."""
    totals = windows.sum(axis=2, keepdims=True)
    share = np.divide(windows, totals, out=np.zeros_like(windows), where=totals > 0)
    with np.errstate(divide="ignore"):
        active = -np.expm1(routed * np.log1p(-share))
    memory = active * cost.expert_bytes + routed * share * cost.token_bytes
    return active, memory


def _candidates(kept: np.ndarray, num_slots: int, pool: _Pool, fewest_plan: Placement | None = None
                ) -> list[Placement]:
    """The step-time planner's candidates from windows ``kept [T', L, E]``: the token plan first,
    then the plans of the expected activations and of the expected memory time, then (with
    redundant slots beyond the fewest the GPUs allow) the fewest slots' plan with its extra slots
    holding replicas of the coldest experts (:func:`cold_replicas`). ``fewest_plan``: that token
    plan of the same windows when the caller has it (made here otherwise)."""
    deployment = pool.deployment.with_slots(num_slots)
    token_plan = plan(kept, deployment)
    candidates = [token_plan] + [plan(weights, deployment)
                                 for weights in _activation_weights(kept, pool.routed, pool.cost)]
    fewest = slots_for(kept.shape[2], pool.deployment.num_gpus, 0)
    if num_slots > fewest:
        base = fewest_plan or plan(kept, pool.deployment.with_slots(fewest))
        grown = cold_replicas(base, kept.sum(axis=0), token_plan.topology)
        if grown is not None:
            candidates.append(grown)
    return candidates


def cold_replicas(base: Placement, weights: np.ndarray, topology) -> Placement | None:
    """``base`` (a placement on ``G`` GPUs) grown to ``topology``'s slots (the same GPUs and nodes,
    ``k`` more slots on every GPU) by replicas of the coldest experts.

    In decode every replica of an expert that receives tokens is a weight read; a replica of an
    expert that receives (almost) none costs (almost) nothing. So where the engine's layout has
    more slots than balance needs, filling them with replicas of cold experts serves about as fast
    as the layout without them, while the token plan gives them to hot experts and reads both
    copies every step. The extra slots go to the fewest, coldest experts (every GPU takes the
    coldest it does not hold): an expert that gets ``lambda`` tokens a pass on average (Poisson)
    is read on about ``r (1 - exp(-lambda / r))`` of its ``r`` replicas, which grows ever more
    slowly with ``r``, so a further replica of the same expert adds fewer reads than a first
    replica of another (``bench/pools.py``, 8 H200 at 16 sequences per GPU: the
    step-time plan at 272 slots 0.4% slower than the best layout at 256 held out, where one replica
    each of the 16 coldest experts left it 1.6% slower).

    Args:
        base: a :class:`Placement` with ``b`` slots on every GPU; weights: ``[L, E]`` tokens per
            expert (what "coldest" is measured on); topology: ``b + k`` slots on every GPU, the
            same GPUs and nodes.
    Returns:
        A :class:`Placement` on ``topology``: each GPU holds its ``base`` slots, then ``k`` replicas
        of the coldest experts not already on it (and, when ``base`` keeps groups on nodes, of a
        group of its node); ``None`` when a GPU has fewer than ``k`` experts to pick from.
    """
    num_layers, num_experts = weights.shape
    gpus = topology.num_gpus
    per_gpu, extra = base.topology.num_slots // gpus, (topology.num_slots - base.topology.num_slots) // gpus
    node_of_gpu = topology.node_of_gpu
    group_size = num_experts // base.num_groups if base.num_groups else num_experts
    rows = np.empty((num_layers, topology.num_slots), np.int64)
    for layer in range(num_layers):
        order = np.lexsort((np.arange(num_experts), weights[layer]))  # coldest first, then by id
        for gpu in range(gpus):
            own = base.phy2log[layer, gpu * per_gpu:(gpu + 1) * per_gpu]
            allowed = np.ones(num_experts, bool)
            if base.home_node is not None and base.num_groups:
                allowed = base.home_node[layer, np.arange(num_experts) // group_size] == node_of_gpu[gpu]
            allowed[own] = False
            picks = list(order[allowed[order]][:extra])
            if len(picks) < extra:
                return None  # too few experts to pick from: no such layout
            rows[layer, gpu * (per_gpu + extra):(gpu + 1) * (per_gpu + extra)] = np.concatenate([own, picks])
    return Placement(phy2log=rows, num_experts=num_experts, topology=topology, num_groups=base.num_groups,
                     method="cold replicas", home_node=base.home_node)


def _times(placements: list[Placement], window_ids, pool: _Pool) -> np.ndarray:
    """``[C, W, L]`` predicted layer times of each placement on each window of ``window_ids``."""
    return np.stack([np.stack([layer_times(pool.sampler(t), p, pool.cost) for t in window_ids])
                     for p in placements])


def _mixed(placements: list[Placement], choice: np.ndarray) -> Placement:
    """Layer ``l`` of candidate ``choice[l]`` (``[L]`` int): one placement on the first one's topology."""
    first = placements[0]
    rows = np.arange(first.num_layers)
    phy2log = np.stack([p.phy2log for p in placements])[choice, rows]
    homes = [p.home_node for p in placements]
    home = None if any(h is None for h in homes) else np.stack(homes)[choice, rows]
    return Placement(phy2log=phy2log, num_experts=first.num_experts, topology=first.topology,
                     num_groups=first.num_groups if home is not None else None, method="step-time",
                     info={"candidate_per_layer": choice.copy(), "candidates": CANDIDATES[:len(placements)]},
                     home_node=home)


def _per_layer_best(times: np.ndarray) -> np.ndarray:
    """``[C, W, L]`` layer times -> ``[L]`` the candidate with the lowest total over the windows per
    layer (the first, the token plan, on ties)."""
    return np.argmin(times.sum(axis=1), axis=0)


def _inner_gains(times: np.ndarray) -> np.ndarray:
    """Leave one window out *inside* the windows a plan is made from.

    Args:
        times: ``[C, W, L]`` layer times of the candidates (the token plan first) on ``W >= 2`` windows.
    Returns:
        ``[W]`` seconds: for each window ``w``, the step time on ``w`` of the per-layer choice made
        from the other windows (:func:`_per_layer_best`) minus the token plan's; negative is faster.
    """
    layers = np.arange(times.shape[2])
    gains = np.empty(times.shape[1])
    for w in range(times.shape[1]):
        choice = _per_layer_best(np.delete(times, w, axis=1))
        gains[w] = (times[choice, w, layers] - times[0, w]).sum()
    return gains


def _choose(times: np.ndarray) -> np.ndarray:
    """The step-time planner's rule (module docstring).

    Args:
        times: ``[C, W, L]`` layer times of the candidates (the token plan first) on the ``W``
            windows the plan is made from.
    Returns:
        ``[L]`` the candidate per layer: the one with the lowest total (:func:`_per_layer_best`)
        when its inner leave-one-out gains ``g [W]`` (:func:`_inner_gains`) bound a new window's
        gain below zero, ``mean(g) + NOISE_MARGIN * std(g) * sqrt(1 + 1/W) < 0``; else the token
        plan on every layer (all zeros), as with fewer than two windows (no noise to measure).
    """
    best = _per_layer_best(times)
    num_windows = times.shape[1]
    if num_windows < 2 or not best.any():
        return np.zeros_like(best)
    gains = _inner_gains(times)
    bound = gains.mean() + NOISE_MARGIN * gains.std(ddof=1) * np.sqrt(1.0 + 1.0 / num_windows)
    return best if bound < 0 else np.zeros_like(best)


def plan_for_step_time(counts, deployment=None, *, batch: int, hardware="H100", model="deepseek-v3",
                       passes: int = 16, seed: int = 0, **deployment_keywords) -> tuple[Placement, Placement]:
    """The step-time planner (module docstring) at the deployment's slot count, from all windows of ``counts``.

    Args:
        counts: ``[T, L, E]`` windows (``T >= 1``).
        deployment: an :class:`eplb.Deployment` (an even split; its keywords still work, deprecated);
            other arguments as :func:`recommend`.
    Returns:
        ``(step_time_plan, token_plan)``, both at the deployment's slots: in sample (the same
        sampled passes of every window), the first's predicted step time is never above the second's.
    """
    windows = as_counts(counts, "counts", ndims=(3,))
    deployment = deployment_argument(deployment, deployment_keywords, "plan_for_step_time",
                                     num_experts=windows.shape[2])
    pool = _checked(windows, deployment, phase="decode", batch=batch, hardware=hardware, model=model,
                    slots=(deployment.num_slots,), passes=passes, seed=seed, folds=HELD_OUT_FOLDS, min_windows=1)
    placements = _candidates(pool.windows, pool.slots[0], pool)
    return _mixed(placements, _choose(_times(placements, range(len(pool.windows)), pool))), placements[0]


# ------------------------------------------------------------------------------------ held out

def _fold_scores(lo: int, hi: int, pool: _Pool, tell=None) -> tuple[np.ndarray, float]:
    """One fold: windows ``[lo, hi)`` served by plans made from the others (``tell(slot counts
    done)`` after each slot count, when given).

    Returns:
        ``[len(slots), 2]`` mean held-out step time (s) of the token and the step-time plan at each
        slot count, the engine default's, and ``[len(slots), 2]`` their held-out balancedness
        (tokens, the even split; mean over the windows of the mean over MoE layers).
    """
    kept = np.concatenate([pool.windows[:lo], pool.windows[hi:]])
    kept_ids = [t for t in range(len(pool.windows)) if not lo <= t < hi]
    out_ids = list(range(lo, hi))
    scores = np.empty((len(pool.slots), 2))
    balance = np.empty((len(pool.slots), 2))
    held_windows = pool.windows[lo:hi]
    moe = held_windows.sum(axis=2) > 0  # [w, L]
    fewest_plan = None  # the token plan at the fewest slots, the base of every larger count's cold replicas
    for i, num_slots in enumerate(pool.slots):
        placements = _candidates(kept, num_slots, pool, fewest_plan)
        if num_slots == slots_for(pool.windows.shape[2], pool.deployment.num_gpus, 0):
            fewest_plan = placements[0]
        choice = _choose(_times(placements, kept_ids, pool))
        held = _times(placements, out_ids, pool)  # [C, w, L]
        scores[i, 0] = held[0].sum(axis=1).mean()
        scores[i, 1] = held[choice, :, np.arange(held.shape[2])].sum(axis=0).mean()
        even = np.stack([p.balancedness(held_windows) for p in placements])  # [C, w, L]
        for j, per_layer in enumerate((even[0], even[choice, :, np.arange(even.shape[2])].T)):
            balance[i, j] = np.mean([per_layer[t][moe[t]].mean() if moe[t].any() else 1.0 for t in range(len(moe))])
        if tell is not None:
            tell(i + 1)
    default = plan(kept, pool.deployment, method="greedy", objective="sum")
    default_time = float(_times([default], out_ids, pool)[0].sum(axis=1).mean())
    return scores, default_time, balance


def _held_out_folds(edges: np.ndarray, pool: _Pool, progress) -> list[tuple[np.ndarray, float, np.ndarray]]:
    """:func:`_fold_scores` of every block ``[edges[f], edges[f + 1])``, telling ``progress`` (or
    ``None``) after each slot count of each fold (of ``F * len(slots) + 1`` steps: the last is the
    recommended plan's)."""
    folds, per_fold = len(edges) - 1, len(pool.slots)
    total = folds * per_fold + 1
    done = []
    for fold, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        tell = None
        if progress is not None:
            before, note = fold * per_fold, f"fold {fold + 1} of {folds}"
            progress(before, total, note)

            def tell(slots_done: int, before: int = before, note: str = note) -> None:
                progress(before + slots_done, total, note)
        done.append(_fold_scores(int(lo), int(hi), pool, tell))
    return done


def _options(scores: np.ndarray, default_ms: float, pool: _Pool, balance: np.ndarray) -> tuple[PoolOption, ...]:
    """``scores [F, len(slots), 2]`` held-out step times (s) and ``balance [F, len(slots), 2]``
    held-out balancedness -> the table's rows."""
    num_experts = pool.windows.shape[2]
    gpus = pool.deployment.num_gpus
    rows = []
    for i, num_slots in enumerate(pool.slots):
        memory = pool.cost.replica_bytes(num_slots, num_experts, pool.model.num_moe_layers) / gpus / GIB
        means = 1e3 * scores[:, i, :].mean(axis=0)
        for j, planner in enumerate(PLANNERS):
            rows.append(PoolOption(
                num_slots=num_slots, redundant_experts=num_slots - num_experts, planner=planner,
                step_ms=float(means[j]), step_ms_folds=tuple(float(x) for x in 1e3 * scores[:, i, j]),
                replica_gib_per_gpu=float(memory), vs_default_pct=float(100.0 * (means[j] / default_ms - 1.0)),
                beats_tokens=None if j == 0 else bool(means[1] < means[0]),
                balancedness_held_out=float(balance[:, i, j].mean())))
    return tuple(rows)


def recommend(counts, deployment=None, *, batch: int, phase: str = "decode", hardware="H100",
              model="deepseek-v3", extra_slots_per_gpu=(0, 1, 2), slot_counts=None, passes: int = 16, seed: int = 0,
              folds: int = HELD_OUT_FOLDS, progress=None, **deployment_keywords) -> Recommendation:
    """Recommend the number of redundant experts (and the plan) for a serving pool, judged held out.

    Args:
        counts: ``[T, L, E]`` the pool's recorded windows, ``T >= 2``; ``E`` must be the model's
            number of routed experts.
        deployment: the pool as the engine runs it, an :class:`eplb.Deployment` (an even split): its
            GPUs, nodes and groups are kept, and its slot count is the engine's layout, priced as
            the default (the published greedy on the summed windows). The keywords ``num_gpus``,
            ``num_nodes``, ``num_groups`` (and ``num_slots`` for ``slot_counts``) still work,
            deprecated, with the default at ``E + G`` slots.
        batch: decode: sequences per GPU; prefill: tokens per GPU (``>= 1``).
        phase: ``"decode"`` or ``"prefill"`` (both route ``batch * G * top_k`` tokens per layer
            and pass; the cost model's roofline decides what bounds them).
        hardware, model: :meth:`eplb.CostModel.preset` names (or :class:`~eplb.model.cost.Hardware` /
            :class:`~eplb.model.cost.MoEModel` values).
        extra_slots_per_gpu: redundant slots per GPU beyond the fewest that hold every expert
            (each ``>= 0``): ``S = G * (ceil(E / G) + x)``. Ignored when ``slot_counts`` is given.
        slot_counts: an explicit list of slot counts the engine allows (each ``>= E``, a multiple of ``G``).
        passes: passes sampled per window; seed: their seed (same inputs, same answer).
        folds: at most this many held-out blocks of windows (``>= 2``; leave one window out when
            ``T <= folds``).
        progress: ``None``, or called as ``progress(steps done, steps in all, what)``: a step is one
            slot count in one fold, and the last the recommended plan from every window
            (:class:`eplb.io.progress.Progress` shows it).
    Returns:
        A :class:`Recommendation`.
    """
    windows = as_counts(counts, "counts", ndims=(3,))
    deployment, slot_counts = _pool_deployment(deployment, deployment_keywords, windows.shape[2], slot_counts)
    slots = _slot_list(windows.shape[2], deployment.num_gpus, extra_slots_per_gpu, slot_counts)
    pool = _checked(windows, deployment, phase=phase, batch=batch, hardware=hardware, model=model, slots=slots,
                    passes=passes, seed=seed, folds=folds, min_windows=2)
    num_windows = len(pool.windows)
    edges = np.linspace(0, num_windows, min(pool.folds, num_windows) + 1).round().astype(np.int64)
    done = _held_out_folds(edges, pool, progress)
    scores = np.stack([s for s, _, _ in done])  # [F, len(slots), 2]
    default_ms = 1e3 * float(np.mean([d for _, d, _ in done]))
    gpus = pool.deployment.num_gpus
    bound_ms = 1e3 * float(np.mean([np.mean([layer_time_bound(pool.sampler(t), gpus, pool.cost).sum()
                                             for t in range(lo, hi)]) for lo, hi in zip(edges[:-1], edges[1:])]))
    options = _options(scores, default_ms, pool, np.stack([b for _, _, b in done]))
    best = options[int(np.argmin([o.step_ms for o in options]))]
    if progress is not None:
        progress(len(done) * len(pool.slots), len(done) * len(pool.slots) + 1, f"the plan at {best.num_slots} slots")
    placements = _candidates(pool.windows, best.num_slots, pool)
    everything = range(num_windows)
    times = _times(placements, everything, pool)  # [C, T, L]
    choice = _choose(times) if best.planner == "step-time" else np.zeros(times.shape[2], np.int64)
    placement = _mixed(placements, choice) if best.planner == "step-time" else placements[0]
    in_sample = times[choice, :, np.arange(times.shape[2])].sum(axis=0).mean()
    if progress is not None:
        progress(len(done) * len(pool.slots) + 1, len(done) * len(pool.slots) + 1, "")
    exposure = worst_loss(pool.windows.sum(axis=0), placement.phy2log, placement.topology)
    survivable = node_loss_slots(pool.deployment)
    return Recommendation(
        options=options, recommended=best, placement=placement, in_sample_step_ms=1e3 * float(in_sample),
        tokens_in_sample_step_ms=1e3 * float(times[0].sum(axis=1).mean()), default_slots=pool.deployment.num_slots,
        default_step_ms=default_ms, bound_step_ms=bound_ms, phase=phase, batch=int(batch), routed_per_pass=pool.routed, passes=int(passes),
        folds=len(done), cost_model=pool.cost, **exposure, node_loss_slots=survivable,
        node_loss_redundant=None if survivable is None else survivable - pool.deployment.num_experts,
        node_loss_note=node_loss_note(pool.deployment, best.num_slots, exposure["worst_node_loss"], survivable))


def node_loss_slots(deployment: Deployment) -> int | None:
    """The fewest slots, a multiple of the GPUs spread evenly over them, with which every expert
    can be on two nodes (:func:`eplb.planning.survivability.survivable_slots` per node: ``S >= 2 E``
    with two nodes or more); ``None`` with one node."""
    experts, gpus, nodes = deployment.num_experts, deployment.num_gpus, deployment.num_nodes
    if nodes < 2:
        return None
    per_gpu = -(-experts // gpus)
    while not survivable_slots(experts, np.full(nodes, per_gpu * gpus // nodes)):
        per_gpu += 1
    return per_gpu * gpus


def node_loss_note(deployment: Deployment, num_slots: int, worst_node_loss: float, survivable: int | None) -> str:
    """One line: what the worst node loss orphans at the recommended ``num_slots``, and the slots
    (``survivable``, :func:`node_loss_slots`) that make a node loss survivable."""
    now = f"at {num_slots} slots the worst node loss orphans {worst_node_loss:.1%} of the tokens"
    if survivable is None:
        return f"{now}; with one node no slot count survives its loss"
    extra = survivable // deployment.num_gpus - -(-deployment.num_experts // deployment.num_gpus)
    how = "plan(..., survive='node')" + (" without groups (a hierarchical layout keeps each group on one node)"
                                          if deployment.hierarchical else "")
    return (f"{now}; a node loss is survivable (every expert on two nodes) from {survivable} slots "
            f"({survivable - deployment.num_experts} redundant, {extra} more per GPU than the fewest), with {how}")


# ------------------------------------------------------------------------------------ inputs

def _pool_deployment(deployment, keywords: dict, num_experts: int, slot_counts) -> tuple[Deployment, object]:
    """``(deployment, slot_counts)`` of a :func:`recommend` call; the deprecated keywords build the
    deployment at the engines' default ``E + G`` slots (``num_slots`` was the list of slot counts)."""
    keywords = dict(keywords)
    if "num_slots" in keywords:
        if slot_counts is not None:
            raise ValueError("recommend: give slot_counts, not both slot_counts and num_slots")
        warnings.warn("recommend: num_slots (the slot counts to price) is deprecated; pass slot_counts",
                      DeprecationWarning, stacklevel=3)
        slot_counts = keywords.pop("num_slots")
    if deployment is None and "num_gpus" in keywords:
        gpus = as_int(keywords["num_gpus"], "num_gpus", minimum=1)
        keywords["num_slots"] = slots_for(num_experts, gpus, 1)
    deployment = deployment_argument(deployment, keywords, "recommend", num_experts=num_experts, stacklevel=4)
    if deployment.dispatch != "uniform":
        raise ValueError(f"recommend prices an even split (the engines' vLLM and TensorRT-LLM rule): the "
                         f"deployment's dispatch must be 'uniform', got {deployment.dispatch!r}")
    if not deployment.topology.is_uniform:
        raise ValueError("recommend needs a uniform topology (the same slots on every GPU)")
    return deployment, slot_counts


def _slot_list(num_experts: int, num_gpus: int, extra_slots_per_gpu, slot_counts) -> tuple[int, ...]:
    """The slot counts to price, increasing, each once; ``ValueError`` naming the argument."""
    if slot_counts is not None:
        values = np.atleast_1d(np.asarray(slot_counts, dtype=object)).tolist()
        slots = [as_int(s, "slot_counts entry", minimum=num_experts) for s in values]
        for s in slots:
            if s % num_gpus:
                raise ValueError(f"slot_counts entries must be multiples of num_gpus ({num_gpus}), got {s}")
        name = "slot_counts"
    else:
        values = np.atleast_1d(np.asarray(extra_slots_per_gpu, dtype=object)).tolist()
        slots = [slots_for(num_experts, num_gpus, as_int(x, "extra_slots_per_gpu entry", minimum=0)) for x in values]
        name = "extra_slots_per_gpu"
    if not slots:
        raise ValueError(f"{name} must hold at least one value")
    return tuple(sorted(set(slots)))


def _checked(windows: np.ndarray, deployment: Deployment, *, phase, batch, hardware, model, slots: tuple[int, ...],
             passes, seed, folds, min_windows: int) -> _Pool:
    """Every input checked, each error a ``ValueError`` naming its argument."""
    if windows.shape[0] < min_windows:
        raise ValueError(f"counts must hold at least {min_windows} windows [T, L, E] to hold one out, "
                         f"got shape {windows.shape}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    batch = as_int(batch, "batch", minimum=1, maximum=2 ** 40)
    passes = as_int(passes, "passes", minimum=1, maximum=4096)
    seed = as_int(seed, "seed", minimum=0)
    folds = as_int(folds, "folds", minimum=2)
    cost = CostModel.preset(hardware, model)  # names the bad preset
    moe = model if isinstance(model, MoEModel) else next(v for k, v in MODELS.items() if k.lower() == model.lower())
    num_experts = windows.shape[2]
    if num_experts != moe.num_experts:
        raise ValueError(f"model {moe.name!r} has {moe.num_experts} routed experts but counts have {num_experts} "
                         "(last axis): give the model preset of the pool")
    routed = batch * deployment.num_gpus * moe.top_k
    for num_slots in slots:
        deployment.with_slots(num_slots)  # every slot count fits the GPUs, nodes and groups
    return _Pool(windows=windows, slots=slots, deployment=deployment,
                 cost=cost, model=moe, routed=routed, sampler=_Sampler(windows, routed, passes, seed), folds=folds)


