"""Tables, PNG figures and an HTML page comparing :func:`eplb.simulate` results on one series.

``write_simulation_report(results, out_dir)`` writes:

- ``simulate.csv``: one row per policy (:meth:`SimulationResult.summary`, with the largest single
  stall, ``max_stall_s``);
- ``steps.csv``: per step and policy, MoE time, balanced time, stall, copies of each kind and the
  token imbalance;
- ``events.csv`` (runs with deployment changes): per change and policy, what the recovery moved
  and cost, and the imbalance before, during and after it;
- ``time_lost.png``: time lost to imbalance per step (share of the balanced time, smoothed);
- ``copies.png``: cumulative weight copies;
- ``layer_balance.png``: per layer, balanced time / MoE time over the series (1.0 is perfect);
- ``index.html``: the summary table and the figures, embedded, so the page stands alone.

``write_sweep_report`` and ``write_recommend_report`` write the tables and figures of
:func:`eplb.sweep` and :func:`eplb.recommend`.

Needs matplotlib for the figures (``pip install 'eplb[report]'``); the CSV files need nothing.
"""

from __future__ import annotations

import csv
import html
from pathlib import Path
from typing import Sequence

import numpy as np

from .html_page import figure_blocks
from .formats.errors import MissingExtraError, require
from ..simulation.simulate import SimulationResult

_CAPTIONS = {
    "time_lost.png": "MoE time lost to imbalance per step, as a share of the perfectly balanced time "
                     "(moving mean); stalls for weight copies not included.",
    "copies.png": "Cumulative expert-weight copies (a slot whose expert changes, unless its GPU holds it).",
    "layer_balance.png": "Per layer: perfectly balanced time / MoE time over the whole series (1.0 is perfect).",
}


def _check(results) -> list[SimulationResult]:
    results = list(results)
    if not results or not all(isinstance(r, SimulationResult) for r in results):
        raise ValueError("results must be a non-empty list of eplb SimulationResult")
    shapes = {r.layer_time.shape for r in results}
    if len(shapes) != 1:
        raise ValueError(f"results must come from one series (same steps and layers), got shapes {sorted(shapes)}")
    return results


def write_tables(results: Sequence[SimulationResult], out_dir) -> list[Path]:
    """``simulate.csv`` (one row per policy) and ``steps.csv`` (one row per step and policy)."""
    results = _check(results)
    out_dir = Path(out_dir)
    summary_path, steps_path = out_dir / "simulate.csv", out_dir / "steps.csv"
    rows = [r.summary() for r in results]
    with open(summary_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(steps_path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["policy", "step", "moe_time_s", "balanced_time_s", "stall_s", "local_moves",
                         "copies_intra_node", "copies_cross_node", "host_loads", "imbalance"])
        for r in results:
            moe, ideal = r.step_time, r.ideal_time
            imbalance = np.full(moe.size, np.nan) if r.imbalance is None else r.imbalance
            for t in range(moe.size):
                writer.writerow([r.policy, t, f"{moe[t]:.6g}", f"{ideal[t]:.6g}", f"{r.stall_time[t]:.6g}",
                                 *(int(c) for c in r.copies[t]), f"{imbalance[t]:.6g}"])
    if not any(r.events for r in results):
        return [summary_path, steps_path]
    events_path = out_dir / "events.csv"
    with open(events_path, "w", newline="") as handle:
        first = next(e for r in results for e in r.events)
        writer = csv.DictWriter(handle, fieldnames=["policy", *_event_row(first)])
        writer.writeheader()
        writer.writerows({"policy": r.policy, **_event_row(e)} for r in results for e in r.events)
    return [summary_path, steps_path, events_path]


def _event_row(event: dict) -> dict:
    """One deployment change's report (:func:`eplb.simulate`) as flat CSV columns."""
    row = {k: v for k, v in event.items() if k not in ("copies", "bytes", "lost_gpus", "added_gpus")}
    row["lost_gpus"] = " ".join(map(str, event["lost_gpus"]))
    row["added_gpus"] = " ".join(map(str, event["added_gpus"]))
    row.update({f"copies_{kind}": n for kind, n in event["copies"].items()})
    row.update({f"bytes_{kind}": n for kind, n in event["bytes"].items()})
    return row


def write_simulation_report(results: Sequence[SimulationResult], out_dir, *, title: str = "eplb simulation") -> dict:
    """Write the tables, figures and ``index.html`` into ``out_dir`` (created if needed).

    Returns ``{"html": path, "tables": [paths], "figures": [paths], "missing": text}``; without
    matplotlib the figures are left out and ``missing`` says how to get them (else ``""``).
    """
    results = _check(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = write_tables(results, out_dir)
    try:
        matplotlib = require("matplotlib", "report", "eplb simulate figures")
    except MissingExtraError as exc:  # the tables and the page without figures still serve
        figures, missing = [], str(exc)
    else:
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        figures = [_time_lost(plt, out_dir, results), _copies(plt, out_dir, results),
                   _layer_balance(plt, out_dir, results)]
        missing = ""
    page = out_dir / "index.html"
    page.write_text(_html(title, results, figures))
    return {"html": page, "tables": tables, "figures": figures, "missing": missing}


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _time_lost(plt, out_dir: Path, results) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4))
    steps = results[0].layer_time.shape[0]
    width = max(1, steps // 200)
    kernel = np.ones(width) / width
    for r in results:
        ideal = r.ideal_time
        lost = np.divide(r.step_time - ideal, ideal, out=np.zeros_like(ideal), where=ideal > 0)
        smooth = np.convolve(lost, kernel, mode="valid") if steps >= width else lost
        ax.plot(np.arange(smooth.size) + width - 1, 100 * smooth, label=r.policy, lw=1)
        for t in r.rebalance_steps:
            ax.axvline(t, color=ax.lines[-1].get_color(), alpha=0.15, lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel(f"time lost, % (mean of {width} steps)")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir / "time_lost.png")


def _copies(plt, out_dir: Path, results) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for r in results:
        ax.step(np.arange(r.copies.shape[0]), np.cumsum(r.copies.sum(axis=1)), where="post", label=r.policy)
    ax.set_xlabel("step")
    ax.set_ylabel("weight copies (cumulative)")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir / "copies.png")


def _layer_balance(plt, out_dir: Path, results) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    layers = np.arange(results[0].layer_time.shape[1])
    for r in results:
        total = r.layer_time.sum(axis=0)
        ratio = np.divide(r.balanced_time.sum(axis=0), total, out=np.ones_like(total), where=total > 0)
        ax.plot(layers, ratio, marker=".", label=r.policy)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("balanced / MoE time")
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir / "layer_balance.png")


def _html(title: str, results, figures: list[Path]) -> str:
    summaries = [r.summary() for r in results]
    shown = [("steps", "{}"), ("lost_share", "{:.2%}"), ("lost_with_stalls_share", "{:.2%}"),
             ("moe_time_s", "{:.4g} s"), ("balanced_time_s", "{:.4g} s"), ("stall_time_s", "{:.4g} s"),
             ("max_stall_s", "{:.4g} s"), ("rebalances", "{}"), ("copies", "{}"), ("copies_intra_node", "{}"),
             ("copies_cross_node", "{}"), ("bytes_moved", "{:.3g} B"), ("host_ms_mean", "{:.3f} ms"),
             ("host_ms_p99", "{:.3f} ms"), ("host_ms_max", "{:.2f} ms")]
    head = "".join(f"<th>{html.escape(s['policy'])}</th>" for s in summaries)
    body = "\n".join(
        f"<tr><th>{html.escape(key)}</th>" + "".join(f"<td>{html.escape(fmt.format(s[key]))}</td>" for s in summaries)
        + "</tr>" for key, fmt in shown if all(key in s for s in summaries))
    blocks = figure_blocks(figures, _CAPTIONS)
    cost = html.escape(results[0].cost_model.name)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ text-align: left; padding: 0.3em 0.8em; border-bottom: 1px solid #ddd; }}
img {{ max-width: 100%; border: 1px solid #eee; }} figcaption {{ color: #555; font-size: 0.9em; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Cost model: {cost}. Time lost = MoE time above the perfectly balanced time, as a share of it.</p>
<table id="summary"><tr><th></th>{head}</tr>
{body}
</table>
{blocks}
</body></html>
"""


__all__ = ["write_simulation_report", "write_tables"]


# -- what-if sweeps ------------------------------------------------------------------------------

SWEEP_COLUMNS = ("policy", "num_slots", "redundant_slots", "extra_slots_per_gpu", "num_gpus", "num_nodes",
                 "hierarchical", "dispatch", "lost_share", "lost_with_stalls_share", "rebalances", "copies",
                 "copies_cross_node", "bytes_moved", "replica_memory_per_gpu_bytes", "wall_time_s", "host_ms_mean",
                 "host_ms_p99", "host_ms_max")


def _table_and_pyplot(table: Path, columns: Sequence[str], rows: Sequence[dict], what: str):
    """Write ``rows`` as the CSV ``table`` (its folder created; ``columns`` in order, other keys left
    out) and return ``(table, pyplot, "")`` ready for a figure, or ``(table, None, how to get
    matplotlib)`` without it: the table still serves."""
    table.parent.mkdir(parents=True, exist_ok=True)
    with open(table, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    try:
        matplotlib = require("matplotlib", "report", what)
    except MissingExtraError as exc:
        return table, None, str(exc)
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return table, plt, ""


def write_sweep_report(rows: Sequence[dict], out_dir, knees: dict) -> dict:
    """Write ``sweep.csv`` and ``sweep.png`` (time lost, stalls included, against the replicas'
    memory per GPU, one line per deployment / dispatch / policy, the knee of each marked) into
    ``out_dir`` (created). ``rows``: :func:`eplb.simulation.sweep.sweep`'s; ``knees``: :func:`eplb.simulation.sweep.knee`'s.
    Returns ``{"table": path, "figure": path or None, "missing": text}``: without matplotlib only
    the table, and ``missing`` says how to get the figure."""
    out_dir = Path(out_dir)
    table, plt, missing = _table_and_pyplot(out_dir / "sweep.csv", SWEEP_COLUMNS, rows, "eplb sweep figures")
    if plt is None:
        return {"table": table, "figure": None, "missing": missing}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    key = lambda r: (r["num_gpus"], r["num_nodes"], r["dispatch"], r["policy"])  # noqa: E731
    for group in dict.fromkeys(key(r) for r in rows):
        line = sorted((r for r in rows if key(r) == group), key=lambda r: r["extra_slots_per_gpu"])
        memory = [r["replica_memory_per_gpu_bytes"] / 2**30 for r in line]
        lost = [100 * r["lost_with_stalls_share"] for r in line]
        gpus, nodes, dispatch, policy = group
        drawn = ax.plot(memory, lost, "o-", label=f"{gpus} GPUs / {nodes} nodes, {dispatch}, {policy}")
        at = next((i for i, r in enumerate(line) if r["extra_slots_per_gpu"] == knees.get(group)), None)
        if at is not None:
            ax.plot([memory[at]], [lost[at]], "*", markersize=14, color=drawn[0].get_color())
    ax.set_xlabel("memory for redundant replicas per GPU (GiB)")
    ax.set_ylabel("MoE time lost to imbalance, stalls included (%)")
    ax.set_title("What redundant slots buy (star: past it, one more slot per GPU saves < 1 point)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    figure = _save(plt, fig, out_dir / "sweep.png")
    return {"table": table, "figure": figure, "missing": ""}


RECOMMEND_COLUMNS = ("num_slots", "redundant_experts", "planner", "step_ms", "replica_gib_per_gpu", "vs_default_pct",
                     "beats_tokens", "balancedness_held_out", "recommended")


def write_recommend_report(result, out_dir) -> dict:
    """Write ``recommend.csv`` (:meth:`eplb.simulation.pools.Recommendation.rows`) and
    ``recommend.png`` (held-out MoE step time of every option against its slots, one line per
    planner with the folds' range, the engine's layout and the lower bound of any layout as
    horizontal lines, the recommendation starred) into ``out_dir`` (created).
    Returns ``{"table": path, "figure": path or None, "missing": text}`` as :func:`write_sweep_report`."""
    out_dir = Path(out_dir)
    table, plt, missing = _table_and_pyplot(out_dir / "recommend.csv", RECOMMEND_COLUMNS, result.rows(),
                                            "eplb recommend figures")
    if plt is None:
        return {"table": table, "figure": None, "missing": missing}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for planner in dict.fromkeys(o.planner for o in result.options):
        line = [o for o in result.options if o.planner == planner]
        slots = [o.num_slots for o in line]
        low = [o.step_ms - min(o.step_ms_folds) for o in line]
        high = [max(o.step_ms_folds) - o.step_ms for o in line]
        ax.errorbar(slots, [o.step_ms for o in line], yerr=[low, high], fmt="o-", capsize=3,
                    label=f"{planner} plan (bars: the held-out folds' range)")
    best = result.recommended
    ax.plot([best.num_slots], [best.step_ms], "*", markersize=16, color="black", label="recommended")
    ax.axhline(result.default_step_ms, linestyle="--", color="grey",
               label=f"engine's layout: published greedy at {result.default_slots} slots")
    ax.axhline(result.bound_step_ms, linestyle=":", color="grey", label="lower bound of any layout")
    ticks = sorted({o.num_slots for o in result.options})
    memory = {o.num_slots: o.replica_gib_per_gpu for o in result.options}
    ax.set_xticks(ticks, [f"{s}\n{memory[s]:.1f} GiB" for s in ticks])
    ax.set_xlabel("slots (memory for redundant replicas per GPU)")
    ax.set_ylabel("predicted MoE step time, held out (ms)")
    ax.set_title(f"{result.phase}, batch {result.batch} per GPU, {result.cost_model.name}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return {"table": table, "figure": _save(plt, fig, out_dir / "recommend.png"), "missing": ""}

