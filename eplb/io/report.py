"""An HTML report with PNG figures on how a placement balances recorded expert counts.

``make_report`` writes into a folder:

- ``balancedness.png``: per-layer balancedness (mean / max GPU load) of the plan, of the published
  greedy on the same configuration, and without rebalancing (expert ``e`` on GPU ``e * G // E``);
- ``gpu_loads.png``: heatmap of each GPU's load relative to its layer's mean (layers x GPUs), on a
  scale from 0, with node boundaries drawn;
- ``hottest_experts.png``: replica counts of the hottest (layer, expert) pairs and the load each
  of their replicas carries, relative to a GPU's mean load;
- ``windows.png`` (counts with several windows): mean balancedness in each window;
- ``moves.png`` (with a previous placement): which slots changed and the weight copies per layer;
- ``index.html``: a summary table and every figure, embedded, so the page stands alone.

Means over layers leave out dense (all-zero) layers, which figures shade or leave blank; the gap
is measured against :func:`bound_for`, the bound ``eplb plan`` reports for the configuration.

Needs matplotlib (``pip install 'eplb[report]'``); drawn with the Agg backend (no display).
"""

from __future__ import annotations

import html
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..analysis import metrics
from ..analysis.bounds import pair_weights, strongest_bound, two_slots
from ..model.cost import MODELS, CostModel, crossing_cost
from ..planning.locality import any_split_bound, busiest_nodes, off_node_tokens
from ..planning.migration import groups_spread
from ..model.deployment import Deployment, make_deployment
from ..analysis.metrics import moe_layers, moe_mean
from ..engines import DISPATCH_RULES
from .formats.data import CountsFile, PlacementFile
from .html_page import figure_blocks
from .formats.errors import require

#: windows evaluated per step of the progress bar
WINDOW_CHUNK = 64


@dataclass(frozen=True)
class Report:
    """Paths of what :func:`make_report` wrote, and the numbers in its summary table."""

    html: Path
    figures: tuple[Path, ...]
    summary: dict


@dataclass(frozen=True)
class Bound:
    """The lower bound a placement is judged against.

    Attributes:
        values: ``[L]`` the proven lower bound on the max GPU load of each layer.
        kind: ``"hierarchical"`` (every group of experts on one node) or ``"global"``.
        description: what a summary prints, e.g. ``"hierarchical: 8 groups on 4 nodes"``.
    """

    values: np.ndarray
    kind: str
    description: str


def groups_on_one_node(placement) -> np.ndarray:
    """``[L]`` bool: the layers where every expert group (``e // (E / num_groups)``) sits on one node."""
    grouped = Deployment(placement.num_experts, placement.topology, placement.num_groups, hierarchical=True)
    return ~groups_spread(placement.phy2log, grouped, placement.num_experts)


def bound_for(weights: np.ndarray, placement, dispatch: str | None = None) -> Bound:
    """The bound ``eplb plan`` uses for the placement's configuration, whatever file it came from.

    With ``num_groups`` dividing over the nodes the plan is hierarchical and its bound is the
    hierarchical one (as ``eplb.plan`` reports); on a layer where the placement does not keep every
    group on one node that bound does not apply, and the global one is used there (and said).

    The package's strongest bounds hold for an even split of each expert's tokens among its
    replicas (vLLM, TensorRT-LLM). A rule that may split unevenly (SGLang ``static`` and
    ``dynamic``, optimal dispatch) can serve a placement below them, so judged under such a rule
    (``dispatch``) the bound is one that holds for any split (:func:`_split_bound`): a gap on it is
    never negative.

    Args:
        weights: ``[L, E]`` counts.
        placement: an :class:`eplb.Placement` with ``num_groups`` set when the deployment has groups.
        dispatch: the rule the placement is judged under (a name of
            :data:`eplb.engines.DISPATCH_RULES`); ``None``: its own split (its shares, or even).
    Raises:
        ValueError: when ``num_groups`` does not divide the experts.
    """
    topology = placement.topology
    groups = placement.num_groups
    rule = "shares" if dispatch is None else dispatch
    uneven = placement.shares is not None if rule == "shares" else DISPATCH_RULES[rule].kind != "uniform"
    if uneven:
        return _split_bound(weights, placement, rule)
    values = strongest_bound(weights, Deployment(placement.num_experts, topology))
    # two replicas a GPU: the weighting bound aimed at the placement, as Placement.lower_bound does
    if two_slots(topology):
        values = pair_weights(weights, topology, values, placement.gpu_loads(weights, "uniform").max(axis=-1))
    if groups is None:
        return Bound(values, "global", "global (no expert groups)")
    if placement.num_experts % groups:
        raise ValueError(f"num_groups ({groups}) must divide the number of experts ({placement.num_experts})")
    nodes = topology.num_nodes
    if groups % nodes:
        return Bound(values, "global", f"global ({groups} groups do not divide over {nodes} nodes, so placement "
                                       "is global)")
    kept = groups_on_one_node(placement)
    if kept.any():
        rows = np.flatnonzero(kept)
        values = values.copy()
        values[rows] = np.maximum(values[rows], strongest_bound(np.ascontiguousarray(weights[rows]),
                                                                Deployment(placement.num_experts, topology, groups, hierarchical=True)))
    description = f"hierarchical: {groups} groups on {nodes} node{'s' if nodes > 1 else ''}"
    if not kept.all():
        description += (f"; {int((~kept).sum())} of {len(kept)} layers spread a group over nodes, judged by the "
                        "global bound")
    return Bound(values, "hierarchical", description)


def _split_bound(weights: np.ndarray, placement, dispatch: str) -> Bound:
    """The bound for a placement whose experts' tokens are split unevenly among replicas (its own
    shares, ``dispatch="shares"``, or a rule's): what holds for any split. Per layer, the largest
    of the average load, the heaviest replica (one of an expert's ``r`` replicas takes at least
    ``1 / r`` of its tokens, whatever the split) and, with home nodes, what the heaviest nodes must
    keep when at most the share of tokens this placement serves off their home node leaves it
    (:func:`eplb.planning.locality.node_cap_bound`). The placement is among those it ranges over, so
    its gap is never negative."""
    deployment = make_deployment(placement.num_experts, topology=placement.topology, num_groups=placement.num_groups)
    how = "its own shares" if dispatch == "shares" else DISPATCH_RULES[dispatch].label
    if not deployment.hierarchical:
        return Bound(any_split_bound(weights, deployment, 1.0), "any split",
                     f"any split among replicas (the placement is judged with {how}, which may split unevenly): "
                     "average load and heaviest replica")
    if placement.home_node is not None:
        away = placement.off_node_fraction(weights, dispatch)
    else:  # a layer keeping every group on one node serves nothing off it, whatever the split
        away = np.where(groups_on_one_node(placement), 0.0, 1.0)
    values = any_split_bound(weights, deployment, away)
    kind = "capped" if dispatch == "shares" else "any split"
    return Bound(values, kind, f"{placement.num_groups} groups with home nodes; at most the placement's own off-node "
                               f"share of the tokens (up to {100 * float(away.max()):.1f}%) served off node, any "
                               f"split among replicas (judged with {how})")


def moe_note(weights: np.ndarray) -> str:
    """``"58 MoE layers; 3 all-zero layers left out"`` (or ``"61 layers"``) for ``weights [L, E]``."""
    moe = moe_layers(weights)
    if moe.all() or not moe.any():
        return f"{len(moe)} layers"
    return f"{int(moe.sum())} MoE layers; {int((~moe).sum())} all-zero layers left out"


def _pyplot():
    matplotlib = require("matplotlib", "report", "eplb report")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def make_report(counts: CountsFile, plan: PlacementFile, out_dir, *, previous: PlacementFile | None = None,
                top: int = 16, progress: bool = False, engine: str | None = None, change=None) -> Report:
    """Write ``index.html`` and the PNG figures into ``out_dir`` (which must exist).

    Args:
        counts: the counts to evaluate on (``[T, L, E]``; the plan is judged on their sum over windows).
        plan: the placement, with as many layers and experts as the counts.
        previous: an earlier placement on the same topology, to show what moved; on another
            topology with ``change`` (the :class:`eplb.DeploymentChange` from it to the plan's).
        top: how many of the hottest (layer, expert) pairs to show.
        progress: a tqdm bar over windows on stderr.
        engine: an engine's dispatch rule (``eplb.engines.ENGINE_RULES``): every figure
            (the plan's and greedy's balancedness, the GPU loads, the replicas' loads, the windows, the
            previous placement, the gap, on a bound that holds under that rule) is judged under it,
            and the page says so; ``None``: the plan's own split (its shares, else even).
    """
    from ..planning.api import plan as make_plan

    plt = _pyplot()
    out_dir = Path(out_dir)
    placement = plan.placement
    weights = counts.weights
    layer_ids = plan.layer_ids if len(plan.layer_ids) == counts.num_layers else counts.layer_ids
    num_gpus = placement.num_gpus
    judge = engine or "shares"  # how every figure splits an expert's tokens among its replicas
    under = "" if engine is None else f" under {DISPATCH_RULES[engine].label}"

    loads = placement.gpu_loads(weights, judge)                             # [L, G]
    plan_bal = metrics.balancedness(loads, placement.topology)             # [L]
    none_bal = metrics.balancedness(metrics.static_gpu_loads(weights, num_gpus))  # one replica each: any rule
    try:
        greedy = make_plan(weights, method="greedy", topology=placement.topology, num_groups=placement.num_groups)
        greedy_bal = greedy.balancedness(weights, judge)
        greedy_why = ""
    except ValueError as exc:  # e.g. a changed deployment (a GPU lost) the published greedy cannot plan
        greedy, greedy_bal, greedy_why = None, None, str(exc)
    bound = bound_for(weights, placement, engine)
    gap = metrics.gap(loads.max(axis=-1), bound.values)
    moe = moe_layers(weights)

    figures = []
    figures.append(_balancedness_figure(plt, out_dir, layer_ids, plan_bal, greedy_bal, none_bal, placement.method,
                                        moe, under))
    figures.append(_heatmap_figure(plt, out_dir, layer_ids, loads, placement.topology, moe, under))
    figures.append(_hottest_figure(plt, out_dir, layer_ids, weights, placement, top, judge, under))
    window_rows = None
    if counts.num_windows > 1:
        window_rows = _window_balancedness(counts, placement, greedy, progress, judge)
        figures.append(_windows_figure(plt, out_dir, window_rows, placement.method, under))
    curve = None
    if placement.num_groups and placement.num_groups % placement.num_nodes == 0 and moe.any():
        curve = _locality_curve(weights, placement)
        figures.append(_locality_figure(plt, out_dir, curve, placement, weights, greedy_bal, moe, judge, under))
    moves = None
    if previous is not None:
        moves = _moved(previous.placement, placement, change)
        figures.append(_moves_figure(plt, out_dir, layer_ids, moves, placement))

    finite = gap[np.isfinite(gap) & moe] if moe.any() else gap[np.isfinite(gap)]
    worst = int(np.flatnonzero(moe)[plan_bal[moe].argmin()]) if moe.any() else int(plan_bal.argmin())
    summary = {} if engine is None else {
        "dispatch rule": f"every figure is{under} ({DISPATCH_RULES[engine].description}), greedy's too"}
    summary |= {
        "counts": f"{counts.path} ({counts.format}), {counts.num_windows} window(s) x {counts.num_layers} layers"
                  f" x {counts.num_experts} experts",
        "placement": f"{plan.path} ({plan.format}), method {placement.method}",
        "configuration": f"{placement.num_slots} slots on {num_gpus} GPUs in {placement.num_nodes} node(s)"
                         + (f", {placement.num_groups} groups" if placement.num_groups else ", no expert groups"),
        f"balancedness{under} (mean over layers)":
            f"over {moe_note(weights)}: plan {moe_mean(plan_bal, weights):.4f} · greedy on the same configuration "
            + (f"n/a (the published greedy cannot plan this configuration: {greedy_why})" if greedy_bal is None
               else f"{moe_mean(greedy_bal, weights):.4f}")
            + f" · no rebalancing {moe_mean(none_bal, weights):.4f}",
        "worst layer": f"layer {layer_ids[worst]}: balancedness {plan_bal[worst]:.4f}",
        "lower bound": bound.description,
        "gap to the lower bound": (f"{100 * finite.mean():.2f}% mean, {100 * finite.max():.2f}% max"
                                   if finite.size else "n/a"),
        "replicas sharing a GPU": f"{int(placement.replicas_sharing_a_gpu().sum())} slots",
    }
    if curve is not None:
        at = {f: (b, o) for f, b, o in zip(curve["max_off_node"], curve["balancedness"], curve["off_node_fraction"])}
        summary["off-node trade-off"] = " · ".join(f"cap {f:.0%}: {b:.4f} ({o:.1%} off node)" for f, (b, o) in at.items())
    if curve is not None:
        summary["crossing the node boundary"] = crossing_note(weights, placement, judge)
    if window_rows is not None:
        summary["per window"] = (f"plan balancedness {window_rows['plan'].min():.4f} .. {window_rows['plan'].max():.4f}"
                                 f" over {counts.num_windows} windows")
    if moves is not None:
        total = placement.num_layers * placement.num_slots
        summary["previous placement on these counts"] = (
            f"balancedness {moe_mean(previous.placement.balancedness(weights, judge), weights):.4f}{under}")
        summary["moves from previous"] = (f"{moves['slots_changed']} of {total} slots changed "
                                          f"({100 * moves['slots_changed'] / total:.1f}%), {moves['copies'].sum()} weight "
                                          f"copies to GPUs, {moves['cross'].sum()} across nodes" + moves["note"])
    page = out_dir / "index.html"
    page.write_text(_html(summary, figures))
    return Report(page, tuple(figures), summary)


# -- figures ---------------------------------------------------------------------------------------


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _layer_axis(ax, layer_ids, max_ticks: int = 16):
    ax.set_xlabel("MoE layer")
    positions = np.arange(len(layer_ids))
    step = max(1, -(-len(layer_ids) // max_ticks))
    ax.set_xticks(positions[::step])
    ax.set_xticklabels([str(i) for i in layer_ids[::step]])
    return positions


def _balancedness_figure(plt, out_dir, layer_ids, plan_bal, greedy_bal, none_bal, method, moe, under="") -> Path:
    """Per-layer balancedness; all-zero (dense) layers are left blank and shaded, not drawn at 1.0;
    ``under``: the dispatch rule the figures are judged under, as words (``" under ..."``) or ``""``."""
    fig, ax = plt.subplots(figsize=(9, 4))
    x = _layer_axis(ax, layer_ids)
    blank = lambda values: np.where(moe, values, np.nan) if moe.any() else values  # noqa: E731
    mean = lambda values: float(values[moe].mean() if moe.any() else values.mean())  # noqa: E731
    for i in np.flatnonzero(~moe):
        ax.axvspan(i - 0.5, i + 0.5, color="#eeeeee", zorder=0)
    ax.plot(x, blank(none_bal), "o-", color="#bbbbbb", label=f"no rebalancing (mean {mean(none_bal):.3f})",
            markersize=3)
    if greedy_bal is not None:
        ax.plot(x, blank(greedy_bal), "s-", color="#e08214", label=f"greedy (mean {mean(greedy_bal):.3f})",
                markersize=3)
    ax.plot(x, blank(plan_bal), "o-", color="#2166ac", label=f"this plan: {method} (mean {mean(plan_bal):.3f})",
            markersize=3)
    ax.set_ylabel("balancedness = mean / max GPU load")
    low = float(np.nanmin(blank(none_bal)))
    ax.set_ylim(min(0.0, low) if low < 0.5 else 0.5, 1.005)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    title = f"Balancedness per layer{under} (1.0 = every GPU equally loaded)"
    if not moe.all() and moe.any():
        title += f"\n{int((~moe).sum())} all-zero (dense) layers shaded, left out of the means"
    ax.set_title(title, fontsize=10)
    return _save(plt, fig, out_dir / "balancedness.png")


def _heatmap_figure(plt, out_dir, layer_ids, loads, topology, moe, under="") -> Path:
    """GPU load / layer mean on a scale from 0 (white at 1.0); node boundaries drawn; dense layers grey."""
    from matplotlib.colors import TwoSlopeNorm

    live = topology.slots_per_gpu > 0                                      # [G]: a lost GPU is no idle GPU
    mean = loads[:, live].mean(axis=1, keepdims=True)
    relative = np.divide(loads, mean, out=np.ones_like(loads), where=mean > 0)
    relative = np.where(moe[:, None] & live[None, :], relative, np.nan)
    num_layers, num_gpus = loads.shape
    fig, ax = plt.subplots(figsize=(min(14, 4 + 0.18 * num_gpus), min(12, 2.5 + 0.14 * num_layers)))
    finite = relative[np.isfinite(relative)]
    spread = max(0.05, float(np.abs(finite - 1).max())) if finite.size else 0.05
    norm = TwoSlopeNorm(vmin=max(0.0, 1 - spread), vcenter=1.0, vmax=1 + spread)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#dddddd")
    image = ax.imshow(relative, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    per_node = num_gpus // topology.num_nodes
    for boundary in range(per_node, num_gpus, per_node):
        ax.axvline(boundary - 0.5, color="black", linewidth=1.2)
    ax.set_xlabel("GPU" + (f" (black lines: node boundaries, {per_node} GPUs per node)" if topology.num_nodes > 1 else ""))
    ax.set_ylabel("MoE layer")
    step = max(1, -(-num_layers // 20))
    ax.set_yticks(np.arange(num_layers)[::step])
    ax.set_yticklabels([str(i) for i in layer_ids[::step]])
    fig.colorbar(image, ax=ax, label="GPU load / layer mean")
    title = f"GPU load / layer mean under the plan{under}\n(red: above the mean"
    greys = [what for what, shown in (("all-zero layers", not moe.all()), ("GPUs holding no slots", not live.all()))
             if shown]
    title += f"; grey: {' and '.join(greys)})" if greys else ")"
    ax.set_title(title, fontsize=10)
    return _save(plt, fig, out_dir / "gpu_loads.png")


def _hottest_figure(plt, out_dir, layer_ids, weights, placement, top, judge="shares", under="") -> Path:
    """Replicas of the hottest experts (bars) and the load their busiest replica carries under the
    split ``judge`` (a ``dispatch`` of :meth:`eplb.Placement.slot_shares`), relative to the layer's
    mean GPU load (points, right axis)."""
    totals = weights.sum(axis=1, keepdims=True)
    share = np.divide(weights, totals, out=np.zeros_like(weights), where=totals > 0)
    order = np.argsort(-share, axis=None, kind="stable")[:top]
    layers, experts = np.unravel_index(order, share.shape)
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(order) + 2.5), 4.2))
    x = np.arange(len(order))
    replicas = placement.logcnt[layers, experts]
    ax.bar(x, replicas, color="#92c5de", label="replicas")
    ax.set_xticks(x)
    ax.set_xticklabels([f"L{layer_ids[l]}\nE{e}" for l, e in zip(layers, experts)], fontsize=7)
    ax.set_ylabel("replicas (bars)")
    ax.set_ylim(0, replicas.max() * 1.3 + 0.5)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for xi, r, s in zip(x, replicas, share[layers, experts]):
        ax.text(xi, r + 0.05, f"{100 * s:.1f}%", ha="center", va="bottom", fontsize=7)
    mean_gpu = totals[layers, 0] / placement.num_gpus
    shares = placement.slot_shares(weights, judge)                                       # [L, S]
    busiest = np.array([shares[l][placement.phy2log[l] == e].max() for l, e in zip(layers, experts)])
    per_replica = np.divide(weights[layers, experts] * busiest, mean_gpu, out=np.zeros(len(order)),
                            where=mean_gpu > 0)
    right = ax.twinx()
    right.plot(x, per_replica, "D", color="#b2182b", markersize=6, label="load of the busiest replica")
    right.axhline(1.0, color="#b2182b", linewidth=0.8, linestyle="--")
    right.set_ylim(0, max(1.2, float(per_replica.max()) * 1.2))
    right.set_ylabel("load per replica (the busiest) / mean GPU load (points)", color="#b2182b")
    right.tick_params(axis="y", colors="#b2182b")
    ax.set_title(f"The {len(order)} hottest experts: replicas (label: share of the layer's tokens) and the load\n"
                 f"their busiest replica carries{under} (dashed: a GPU's mean load; a replica above it overloads "
                 "its GPU alone)", fontsize=9)
    return _save(plt, fig, out_dir / "hottest_experts.png")


LOCALITY_CAPS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _locality_curve(weights: np.ndarray, placement) -> dict:
    """:func:`eplb.pareto` on the report's counts and the placement's configuration."""
    from ..planning.api import pareto

    return pareto(weights, placement.deployment, fractions=LOCALITY_CAPS)


def crossing_note(weights: np.ndarray, placement, judge: str = "shares") -> str:
    """One line: the tokens the placement serves off their home node (racks as nodes: off their
    rack) and what they cost on the network, priced by :func:`eplb.model.cost.crossing_cost` with
    the H100 preset of the model with as many routed experts (none: the bytes per token unknown)."""
    share = _off_node_share(weights, placement, placement.num_groups, judge)
    tokens = share * float(weights.sum())
    line = f"{share:.1%} of the tokens ({tokens:,.0f} of these counts) are served off their group's home node"
    models = [m for m in MODELS.values() if m.num_experts == placement.num_experts]
    if not models:
        return line + f" (no model preset has {placement.num_experts} routed experts to price the bytes)"
    cost = CostModel.preset("H100", models[0])
    price = crossing_cost(tokens, placement.num_gpus, cost, models[0])
    return (line + f"; priced as {models[0].name} on H100 ({price['bytes_per_token'] / 1e3:.1f} kB a token there "
            f"and back): {float(price['bytes']) / 1e9:.2f} GB over the network, "
            f"{1e3 * float(price['network_s']):.2f} ms on {placement.num_gpus} NICs at "
            f"{cost.network_bandwidth / 1e9:.0f} GB/s each, {1e3 * float(price['extra_s']):.2f} ms more than over NVLink")


def _off_node_share(weights: np.ndarray, placement, num_groups: int, judge: str = "shares") -> float:
    """Share of all tokens a placement serves off the home nodes of ``num_groups`` groups (the nodes
    serving most of each group when it records none), split among replicas as ``judge`` says."""
    shares = placement.slot_shares(weights, judge)
    home = placement.home_node
    if home is None:
        home = busiest_nodes(weights, placement.phy2log, shares, num_groups, placement.topology)
    return float(off_node_tokens(weights, placement.phy2log, shares, home, placement.topology).sum()
                 / max(float(weights.sum()), 1e-300))


def _locality_figure(plt, out_dir, curve, placement, weights, greedy_bal, moe, judge="shares", under="") -> Path:
    """Balancedness against the share of tokens off their home node: eplb's curve over caps (with
    their own shares), the published greedy (hierarchical), a global plan, and this plan (these
    three split as ``judge`` says)."""
    from ..planning.api import plan as make_plan

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(100 * curve["off_node_fraction"], curve["balancedness"], "o-", color="#2166ac",
            label="eplb, max_off_node = " + ", ".join(f"{f:g}" for f in curve["max_off_node"]))
    if greedy_bal is not None:
        ax.plot([0.0], [float(greedy_bal[moe].mean())], "s", color="#e08214", markersize=9,
                label="published greedy (hierarchical)")
    spread = make_plan(weights, topology=placement.topology)
    ax.plot([100 * _off_node_share(weights, spread, placement.num_groups, judge)],
            [float(moe_mean(spread.balancedness(weights, judge), weights))], "D",
            color="#1b7837", markersize=8, label="global placement (no groups)")
    ax.plot([100 * _off_node_share(weights, placement, placement.num_groups, judge)],
            [float(moe_mean(placement.balancedness(weights, judge), weights))], "*", color="#b2182b",
            markersize=13, label=f"this plan ({placement.method})")
    ax.set_xlabel("tokens served off their group's home node (%)")
    ax.set_ylabel("balancedness (mean over MoE layers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("What a little off-node traffic buys (plans with shares; in sample)"
                 + (f"\neplb's curve with its own shares; greedy, global and this plan{under}" if under else ""),
                 fontsize=10)
    return _save(plt, fig, out_dir / "locality.png")


def _window_balancedness(counts: CountsFile, placement, greedy, progress: bool, judge: str = "shares") -> dict:
    from tqdm import tqdm

    series = {"plan": [], "no rebalancing": []}
    if greedy is not None:
        series["greedy"] = []
    starts = range(0, counts.num_windows, WINDOW_CHUNK)
    for start in tqdm(starts, desc="windows", unit="chunk", disable=not progress, file=sys.stderr):
        chunk = counts.counts[start:start + WINDOW_CHUNK]                    # [t, L, E]
        per_window = lambda loads, top=None: moe_mean(metrics.balancedness(loads, top), chunk)  # noqa: E731  [t]
        series["plan"].append(per_window(placement.gpu_loads(chunk, judge), placement.topology))  # live GPUs only
        series["no rebalancing"].append(per_window(metrics.static_gpu_loads(chunk, placement.num_gpus)))
        if greedy is not None:
            series["greedy"].append(per_window(greedy.gpu_loads(chunk, judge), greedy.topology))
    return {name: np.concatenate(parts) for name, parts in series.items()}


def _windows_figure(plt, out_dir, rows, method, under="") -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.8))
    x = np.arange(len(rows["plan"]))
    styles = {"no rebalancing": ("#bbbbbb", "o-"), "greedy": ("#e08214", "s-"), "plan": ("#2166ac", "o-")}
    for name in ("no rebalancing", "greedy", "plan"):
        if name in rows:
            color, style = styles[name]
            label = f"this plan: {method}" if name == "plan" else name
            ax.plot(x, rows[name], style, color=color, label=f"{label} (mean {rows[name].mean():.3f})", markersize=3)
    ax.set_xlabel("recording window")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_ylabel("balancedness (mean over layers)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"One placement for all windows: balancedness in each window{under}")
    return _save(plt, fig, out_dir / "windows.png")


def _moved(old, new, change=None) -> dict:
    """What moved from ``old`` to ``new``: ``changed [L, S]`` (the slots of ``new`` whose expert is
    not the one they held), ``copies [L]`` and ``cross [L]`` (weights copied to a GPU, of them across
    nodes), ``slots_changed`` and a ``note``. Across a deployment ``change`` (another topology) the
    old placement is carried onto the new slots first and the copies are its transfer plan's (host
    loads counted as copies to a GPU)."""
    if change is None:
        per_layer = [metrics.moves(old.phy2log[i:i + 1], new.phy2log[i:i + 1], new.topology)
                     for i in range(new.num_layers)]
        changed = old.phy2log != new.phy2log                                # [L, S]
        copies = np.array([m.gpu_copies for m in per_layer])
        cross = np.array([m.cross_node_copies for m in per_layer])
        return {"changed": changed, "copies": copies, "cross": cross, "slots_changed": int(changed.sum()), "note": ""}
    from ..serving.transfer import transfer_plan

    changed = change.carry(old.phy2log) != new.phy2log                      # [L, S_new]; a hole counts as changed
    transfer = transfer_plan(old, new, change)
    between = transfer.kind != 0
    copies = np.bincount(transfer.layer[between], minlength=new.num_layers)
    cross = np.bincount(transfer.layer[transfer.kind == 2], minlength=new.num_layers)
    return {"changed": changed, "copies": copies, "cross": cross, "slots_changed": int(changed.sum()),
            "note": f" across the change ({change.describe()}; {int((transfer.kind == 3).sum())} of the copies "
                    "loaded from host memory)"}


def _moves_figure(plt, out_dir, layer_ids, moved: dict, new) -> Path:
    changed, copies, cross = moved["changed"], moved["copies"], moved["cross"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    left.imshow(changed, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    for boundary in new.topology.slot_offsets[1:-1]:
        left.axvline(boundary - 0.5, color="#f4a582", linewidth=0.8)
    left.set_xlabel("slot (orange lines: GPU boundaries)")
    left.set_ylabel("MoE layer")
    step = max(1, -(-new.num_layers // 20))
    left.set_yticks(np.arange(new.num_layers)[::step])
    left.set_yticklabels([str(i) for i in layer_ids[::step]])
    left.set_title(f"Slots whose expert changed (black): {int(changed.sum())} of {changed.size}")
    x = _layer_axis(right, layer_ids, max_ticks=8)
    right.bar(x, copies - cross, color="#2166ac", label="copies within a node")
    right.bar(x, cross, bottom=copies - cross, color="#b2182b", label="copies across nodes")
    right.set_ylabel("expert weights copied to a GPU")
    right.set_ylim(0, max(1, int(copies.max())) * 1.3)
    from matplotlib.ticker import MaxNLocator

    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.legend(fontsize=8, loc="upper left", ncol=2)
    right.set_title("Weight copies per layer")
    return _save(plt, fig, out_dir / "moves.png")


# -- page ------------------------------------------------------------------------------------------

_CAPTIONS = {
    "locality.png": "Balancedness against the share of tokens served off their group's home node: eplb's plans "
                    "for a sweep of caps (max_off_node), the published hierarchical greedy, a global placement "
                    "and this plan",
    "balancedness.png": "Balancedness per layer: the plan against the published greedy and against no rebalancing.",
    "gpu_loads.png": "Load of each GPU relative to its layer's mean, under the plan.",
    "hottest_experts.png": "Replica counts of the hottest experts.",
    "windows.png": "Balancedness of the one placement in each recording window.",
    "moves.png": "What moved from the previous placement.",
}


def _html(summary: dict, figures: list[Path]) -> str:
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
    blocks = figure_blocks(figures, _CAPTIONS, link=True)
    from .._version import __version__

    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>eplb placement report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ text-align: left; padding: 0.3em 0.8em; border-bottom: 1px solid #ddd; vertical-align: top; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 0.9em; }}
</style></head>
<body>
<h1>eplb placement report</h1>
<table id="summary">
{rows}
</table>
{blocks}
<p style="color:#888;font-size:0.8em">balancedness = mean / max GPU load (1.0 is perfect); gap = max GPU load /
proven lower bound - 1. Written by eplb {html.escape(__version__)}.</p>
</body></html>
"""
