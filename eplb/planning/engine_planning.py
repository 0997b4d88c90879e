"""Plans made for an engine's own dispatch rule (``eplb.plan(..., dispatch="sglang-static")``).

SGLang does not split an expert's tokens evenly among its replicas (:mod:`eplb.engines.sglang`):
each rank sends them to its *near* replica (on its GPU, else on its node when that node holds some
but not all replicas), and with ``static`` dispatch the ranks without one take a "fair" pick drawn
from their own ``random.Random(42)`` stream, uncoordinated. A plan made for an even split then
loses balance: a replica takes 7 ranks' tokens where its twin takes 1, or 19 of 30 fair picks.

The shares a placement gets are a known function of the placement (the random streams are
seeded), so a plan can be made for them. Starting from the plan for an even split,
:func:`plan_for_rule` goes through the layers in order (the static table's streams run on from one
layer to the next) and, per layer, tries two layouts:

- the even-split plan as it is;
- (global deployments) the same with each replicated expert's replicas spread over distinct
  nodes (:func:`eplb.kernels.split.fixed_shares.spread_over_nodes`): every rank of a node holding a
  replica then picks it, so the deterministic part of the split is even and fewer ranks draw.

For each, it computes the rule's exact shares (its engine's ``layer_shares``, :mod:`eplb.engines`) and swaps slots
between GPUs in ways that keep every slot's share (single-replica experts anywhere they may go, a
replica that is alone on its node within that node), lowering the weighted mean over the windows
of each window's peak GPU load (:func:`eplb.kernels.split.fixed_shares.balance_fixed_loads`), with the
windows' sum as one more window of weight ``anchor``. The layout with the lower objective is kept
and its draws advance the streams. Finally the whole plan is compared with the even-split plan
under the rule on the planning windows (mean balancedness) and the even-split plan is returned
when it is not worse: a plan made for the rule is never worse than it there.
"""

from __future__ import annotations

import numpy as np

from ..kernels.split.fixed_shares import ANYWHERE, FIXED, balance_fixed_loads, spread_over_nodes
from ..engines import PLACEMENT_RULES as RULES
from ..engines import dispatch_rule, engine_of, rule_shares
from ..analysis.metrics import balancedness
from ..analysis.windows import check_window_weights

RULE_ANCHOR = 0.25
RULE_SWAPS = 128
DEFAULT_PARTNERS = 4
TRIAL_SWAPS = 16  # swaps tried on each layout before the search goes on with the better one


def _regions(row: np.ndarray, logcnt: np.ndarray, node_of_slot: np.ndarray, num_nodes: int,
             hierarchical: bool) -> np.ndarray:
    """``[S]`` int64: where each slot may move without changing any slot's share: a single-replica
    expert anywhere (its node when groups stay on their node), a replica alone on its node (with
    replicas elsewhere) within that node, any other replica nowhere."""
    on_node = np.zeros((num_nodes, logcnt.size), np.int64)
    np.add.at(on_node, (node_of_slot, row), 1)
    alone = (on_node[node_of_slot, row] == 1) & (logcnt[row] > 1)
    single = logcnt[row] == 1
    region = np.full(row.size, FIXED, np.int64)
    region[alone] = node_of_slot[alone]
    region[single] = node_of_slot[single] if hierarchical else ANYWHERE
    return region


def _scaled_windows(windows: np.ndarray, weights: np.ndarray, anchor: float, num_gpus: int):
    """Windows ``[T, L, E]`` scaled per layer to a mean GPU load of 1 (all-zero rows stay 0), with
    their weighted sum appended as one more window when ``anchor > 0``; and the weights ``[T']``."""
    if anchor > 0:
        windows = np.concatenate([windows, np.tensordot(weights, windows, axes=1)[None]])
        weights = np.append(weights, anchor * weights.sum())
    totals = windows.sum(axis=-1, keepdims=True) / num_gpus
    scaled = np.divide(windows, totals, out=np.zeros_like(windows), where=totals > 0)
    return scaled, weights / weights.sum()


def _window_balancedness(windows: np.ndarray, weights: np.ndarray, phy2log: np.ndarray, shares: np.ndarray,
                      topology) -> float:
    """Weighted mean over windows ``[T, L, E]`` (weights ``[T]``) of the mean over layers of
    balancedness, with ``shares [L, S]`` of ``phy2log [L, S]``."""
    served = np.take_along_axis(windows, np.broadcast_to(phy2log, windows.shape[:-1] + phy2log.shape[-1:]),
                                axis=-1) * shares
    loads = served.reshape(served.shape[:-1] + (topology.num_gpus, -1)).sum(axis=-1)
    per_window = balancedness(loads, topology).mean(axis=-1)
    return float(np.dot(weights, per_window) / weights.sum())


def plan_for_rule(windows, base: np.ndarray, deployment, rule: str, window_weights=None, *,
                  anchor: float = RULE_ANCHOR, max_swaps: int = RULE_SWAPS, partners: int = DEFAULT_PARTNERS):
    """Make the even-split plan ``base`` into a plan for ``rule`` (see the module notes).

    Args:
        windows: ``[T, L, E]`` float64 planning counts (validated; ``[L, E]`` is one window).
        base: ``[L, S]`` int64, the plan for an even split.
        deployment: an :class:`eplb.model.deployment.Deployment` with the same slots on every GPU.
        rule: one of :data:`RULES`.
        window_weights: ``[T]`` or ``None`` (equal); anchor: weight of the windows' sum, ``>= 0``.
        max_swaps: swaps per layer and layout; partners: the least loaded GPUs a peak GPU swaps with.
    Returns:
        ``phy2log [L, S]`` int64 and ``info``: ``dispatch``, ``engine_objective_before`` /
        ``_after [L]`` (weighted mean of window peaks over mean load, anchor window included, under
        the rule: of the even-split plan's layer, with the random streams the plan reaches that
        layer with, and of the layer kept), ``spread [L]`` bool
        (the layout with replicas spread over nodes was kept), ``engine_balancedness_before`` /
        ``_after`` (mean balancedness under the rule on the windows) and ``kept_even_split_plan``.
    """
    dispatch_rule(rule, "dispatch", RULES)
    topology = deployment.topology
    rule_layers = engine_of(rule).layer_shares  # the rule's engine's per-layer shares (checks the topology)
    shares = rule_layers(rule, topology)
    windows = np.asarray(windows, dtype=np.float64)
    if windows.ndim == 2:
        windows = windows[None]
    weights = check_window_weights(window_weights, windows.shape[0])
    base = np.require(base, dtype=np.int64, requirements="C")
    num_layers, num_experts = windows.shape[1:]
    num_gpus, num_nodes = topology.num_gpus, topology.num_nodes
    per_gpu = topology.num_slots // num_gpus
    node_of_slot = np.ascontiguousarray(topology.node_of_gpu[topology.gpu_of_slot], dtype=np.int64)
    swaps, partners = int(max_swaps), min(int(partners), num_gpus)
    scaled, scaled_weights = _scaled_windows(windows, weights, anchor, num_gpus)
    planning = np.tensordot(weights, windows, axes=1)  # [L, E]
    spread_possible = not deployment.hierarchical and num_nodes > 1
    out = np.empty_like(base)
    before = np.zeros(num_layers)
    after = np.zeros(num_layers)
    spread = np.zeros(num_layers, bool)
    out_shares = np.empty(base.shape)  # [L, S] the rule's shares of the plan made
    base_shares = np.empty(base.shape)  # [L, S] and of the even-split plan
    base_rule = None  # the even-split plan's streams once they part from the plan's
    search_weights = np.append(scaled_weights, 0.0)
    for layer in range(num_layers):
        layouts = [base[layer].copy()]
        if spread_possible:
            row = base[layer].copy()
            logcnt = np.bincount(row, minlength=num_experts).astype(np.int64)
            if spread_over_nodes(row, np.ascontiguousarray(planning[layer]), logcnt, per_gpu,
                                 num_gpus // num_nodes) > 0:
                layouts.append(row)
        best = None
        for index, row in enumerate(layouts):  # a short search of each layout, then the better one on
            layer_shares, streams, logcnt = shares.layer(row, num_experts)
            if index == 0:  # the even-split plan's layer, on its own streams while they are the same
                base_shares[layer], base_streams = (layer_shares, streams) if base_rule is None else \
                    base_rule.layer(base[layer], num_experts)[:2]
            # the shares ride along as a window of weight 0, so they follow the swaps
            loads = np.concatenate([scaled[:, layer, row] * layer_shares, layer_shares[None]])
            region = _regions(row, logcnt, node_of_slot, num_nodes, deployment.hierarchical)
            start, end = balance_fixed_loads(loads, search_weights, row, region, node_of_slot, per_gpu,
                                             num_gpus // num_nodes, min(swaps, TRIAL_SWAPS), partners)
            if index == 0:
                before[layer] = start
            if best is None or end < best[0] - 1e-12:
                best = [end, row, streams, index, loads, region]
        if swaps > TRIAL_SWAPS:
            _, row, _, _, loads, region = best
            best[0] = balance_fixed_loads(loads, search_weights, row, region, node_of_slot, per_gpu,
                                          num_gpus // num_nodes, swaps - TRIAL_SWAPS, partners)[1]
        best[4] = best[4][-1]
        after[layer], out[layer], streams, index, out_shares[layer], _ = best
        spread[layer] = index == 1
        shares.keep(streams)
        if base_rule is None and index != 0:  # from here on the even-split plan's streams differ
            base_rule = rule_layers(rule, topology)
        if base_rule is not None:
            base_rule.keep(base_streams)
    even = _window_balancedness(windows, weights, base, base_shares, topology)
    made = _window_balancedness(windows, weights, out, out_shares, topology)
    kept = made <= even
    if kept:
        out, after, spread = base.copy(), before.copy(), np.zeros(num_layers, bool)
    info = {"dispatch": rule, "engine_objective_before": before, "engine_objective_after": after,
            "spread": spread, "engine_balancedness_before": even, "engine_balancedness_after": max(made, even),
            "kept_even_split_plan": bool(kept)}
    return out, info
