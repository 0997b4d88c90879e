"""Generalisation: plan on one window of traffic, serve another.

A placement is always planned on recorded counts and then serves traffic it has not seen. For
every method this script plans on one window and reports the balancedness (mean / max GPU load,
averaged over layers; 1.0 is perfect) on that same window (*in-sample*) and on other windows
(*out-of-sample*), side by side:

- real traces (``../shared/data/traces``, skipped when absent): OLMoE-1B-7B and Mixtral-8x7B text
  domains, gpt-oss-20b benchmarks (windows summed per benchmark).
  *pairwise*: plan on window A, evaluate on every window B != A;
  *leave-one-out*: plan on the sum of all other windows, evaluate on the held-out one.
- synthetic drift (``eplb.simulation.synthetic.drifting_counts``) on the DeepSeek-V3-sized deployment
  (hierarchical: 8 groups on 4 nodes; and global): plan on window t, evaluate on window t + 1,
  for several drift sizes (drift 0 isolates the sampling noise between two windows).

Run: ``cd bench && python -m research.generalisation [--quick]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from _common import markdown_table, planning_methods, pyplot, rows_of, run_alone, trace_workloads, write_csv

import eplb
from eplb.simulation.synthetic import DEEPSEEK_V3, drifting_counts

DRIFTS = (0.0, 0.05, 0.1, 0.2, 0.4)
QUICK_DRIFTS = (0.0, 0.2)
NO_DATA = "plan ignoring counts"


def mean_balancedness(placement: eplb.Placement, counts: np.ndarray) -> float:
    """Balancedness of ``placement`` under ``counts [L, E]``, averaged over the MoE layers."""
    return float(eplb.analysis.metrics.moe_mean(placement.balancedness(counts), counts))


def ignoring_counts(serve: list[list[np.ndarray]], deployment: dict) -> dict:
    """Reference: a placement planned without data (greedy on equal counts), on the served windows."""
    num_layers, num_experts = serve[0][0].shape
    placement = eplb.plan(np.ones((num_layers, num_experts)), method="greedy", **deployment)
    outs = [mean_balancedness(placement, target) for targets in serve for target in targets]
    return {"in_sample": "", "out_of_sample": round(float(np.mean(outs)), 5), "drop": "",
            "worst_out_of_sample": round(min(outs), 5), "plans": 1, "pairs": len(outs)}


def evaluate(plan_on: list[np.ndarray], serve: list[list[np.ndarray]], deployment: dict, method: str) -> dict:
    """Plan on each ``plan_on[i] [L, E]``; in-sample = on itself, out-of-sample = on each of
    ``serve[i]``. Returns means over plans (and pairs), the worst pair, and the count."""
    ins, outs = [], []
    for counts, targets in zip(plan_on, serve):
        placement = eplb.plan(counts, method=method, **deployment)
        ins.append(mean_balancedness(placement, counts))
        outs += [mean_balancedness(placement, target) for target in targets]
    return {"in_sample": round(float(np.mean(ins)), 5), "out_of_sample": round(float(np.mean(outs)), 5),
            "drop": round(float(np.mean(ins) - np.mean(outs)), 5), "worst_out_of_sample": round(min(outs), 5),
            "plans": len(ins), "pairs": len(outs)}


def trace_cases(quick: bool):
    """``(dataset, scheme, plan_on, serve, deployment)`` for each real trace; and notes on absent ones."""
    workloads, missing = trace_workloads()
    cases = []
    for name, windows, counts, deployment in workloads:
        k = len(windows)
        cases.append((name, "pairwise", [counts[a] for a in range(k)],
                      [[counts[b] for b in range(k) if b != a] for a in range(k)], deployment))
        if not quick:
            cases.append((name, "leave-one-out", [counts.sum(axis=0) - counts[a] for a in range(k)],
                          [[counts[a]] for a in range(k)], deployment))
    return cases, missing


def drift_cases(quick: bool):
    """Synthetic drift at DeepSeek-V3 size: hierarchical (8 groups on 4 nodes) for every drift
    size, and global (groups ignored) for two of them (full run only)."""
    c = DEEPSEEK_V3
    layers, windows = (8, 3) if quick else (c["num_layers"], 6)
    hierarchical = {k: c[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}
    runs = [("hierarchical", hierarchical, drift) for drift in (QUICK_DRIFTS if quick else DRIFTS)]
    if not quick:
        runs += [("global", {**hierarchical, "num_groups": None}, drift) for drift in (0.0, 0.1)]
    cases = []
    for mode, deployment, drift in runs:
        series = drifting_counts(windows, layers, c["num_experts"], drift=drift, num_groups=c["num_groups"],
                                 tokens=16384, top_k=c["top_k"], seed=1)
        cases.append((f"synthetic DeepSeek-V3 {mode} ({layers} layers)", f"drift {drift}",
                      [series[t] for t in range(windows - 1)], [[series[t + 1]] for t in range(windows - 1)],
                      deployment))
    return cases


def plot(rows: list[dict], methods: list[str], path: Path) -> None:
    plt = pyplot()
    cases = list(dict.fromkeys((r["dataset"], r["scheme"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * len(cases) * (len(methods) + 1)), 4.0))
    shown = methods + [NO_DATA]
    width = 0.8 / len(shown)
    x = np.arange(len(cases))
    for i, method in enumerate(shown):
        by_case = {(r["dataset"], r["scheme"]): r for r in rows if r["method"] == method}
        outs = [float(by_case[c]["out_of_sample"]) for c in cases]
        ax.bar(x + i * width, outs, width, label=f"{method} (out-of-sample)")
        if method != NO_DATA:
            ins = [float(by_case[c]["in_sample"]) for c in cases]
            ax.scatter(x + i * width, ins, marker="_", s=300, color="black", zorder=3, linewidths=2,
                       label="in-sample" if i == 0 else None)
    ax.set_xticks(x + 0.4 - width / 2)
    ax.set_xticklabels([f"{d}\n{s}".replace(" (", "\n(") for d, s in cases], fontsize=7)
    low = min(float(r["worst_out_of_sample"]) for r in rows)
    ax.set_ylim(max(0.0, low - 0.05), 1.0)
    ax.set_ylabel("balancedness (mean / max)")
    ax.set_title("plan on one window, serve another: bars out-of-sample, ticks in-sample")
    ax.legend(fontsize=7, loc="lower left", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, results_dir: Path, include_traces: bool = True) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    methods = planning_methods()
    cases, missing = trace_cases(quick) if include_traces else ([], [])
    cases += drift_cases(quick)
    rows = []
    for dataset, scheme, plan_on, serve, deployment in cases:
        for method in methods:
            rows.append({"dataset": dataset, "scheme": scheme, "method": method,
                         "slots": deployment["num_slots"], "gpus": deployment["num_gpus"],
                         **evaluate(plan_on, serve, deployment, method)})
        rows.append({"dataset": dataset, "scheme": scheme, "method": NO_DATA,
                     "slots": deployment["num_slots"], "gpus": deployment["num_gpus"],
                     **ignoring_counts(serve, deployment)})
    write_csv(results_dir / "generalisation.csv", rows)
    plot(rows, methods, results_dir / "generalisation.png")

    cases_seen = list(dict.fromkeys((r["dataset"], r["scheme"], r["slots"], r["gpus"]) for r in rows))
    body = []
    for dataset, scheme, slots, gpus in cases_seen:
        by_method = {r["method"]: r for r in rows if r["dataset"] == dataset and r["scheme"] == scheme}
        cells = [dataset, scheme, f"{slots} / {gpus}"]
        for method in methods:
            r = by_method[method]
            cells.append(f"{r['in_sample']:.4f} / {r['out_of_sample']:.4f}")
        cells.append(f"{by_method[NO_DATA]['out_of_sample']:.4f}")
        body.append(cells)
    header = ["data", "plan on -> serve", "slots / GPUs"] + [f"{m}: in / out" for m in methods] + [
        f"{NO_DATA}: out"]
    out = ["## Generalisation", "",
           "Balancedness (mean / max GPU load, mean over layers) of a placement on the window it was "
           "planned on (*in*) and on windows it was not (*out*): *pairwise* = plan on one window, serve "
           "each other one; *leave-one-out* = plan on all other windows, serve the held-out one; "
           "*drift d* = plan on window t, serve window t + 1 of a synthetic series whose expert "
           "popularities take random steps of size d. *plan ignoring counts* = greedy on equal counts (what "
           "a placement knows without data), as a reference. Plot: `generalisation.png`. "
           f"({'quick mode: fewer cases' if quick else 'full run'})", "",
           markdown_table(header, body), "", "![in-sample vs out-of-sample](generalisation.png)", ""]
    for method in methods[1:]:
        pairs = [(r, next(g for g in rows if g["method"] == "greedy" and g["dataset"] == r["dataset"]
                          and g["scheme"] == r["scheme"])) for r in rows if r["method"] == method]
        if "greedy" in methods and pairs:
            ins = np.mean([r["in_sample"] - g["in_sample"] for r, g in pairs])
            outs = np.mean([r["out_of_sample"] - g["out_of_sample"] for r, g in pairs])
            out.append(f"- `{method}` minus `greedy`, mean over the {len(pairs)} cases: in-sample "
                       f"{ins:+.4f}, out-of-sample {outs:+.4f} balancedness.")
    out += [f"- {note}" for note in missing]
    return "\n".join(out)


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    rows = rows_of(results_dir, "generalisation")
    if not rows:
        return []
    out = []
    for dataset, scheme in (("gpt-oss-20b", "pairwise"), ("olmoe-1b-7b", "pairwise")):
        chosen = [r for r in rows if r["dataset"] == dataset and r["scheme"] == scheme]
        if chosen:
            cells = ", ".join(f"`{r['method']}` {float(r['in_sample']):.3f} -> {float(r['out_of_sample']):.3f}"
                              for r in chosen if r["method"] != NO_DATA)
            out.append((f"Balancedness in-sample -> out-of-sample, {dataset} (plan on one "
                        f"{'benchmark' if dataset.startswith('gpt') else 'domain'}, serve another)", cells, ""))
    default = eplb.DEFAULT_METHOD
    greedy = {(r["dataset"], r["scheme"]): r for r in rows if r["method"] == "greedy"}
    pairs = [(r, greedy[r["dataset"], r["scheme"]]) for r in rows
             if r["method"] == default and default != "greedy" and (r["dataset"], r["scheme"]) in greedy]
    if pairs:
        ins = np.mean([float(r["in_sample"]) - float(g["in_sample"]) for r, g in pairs])
        outs = np.mean([float(r["out_of_sample"]) - float(g["out_of_sample"]) for r, g in pairs])
        out.append((f"`{default}` minus `greedy` balancedness, mean over {len(pairs)} generalisation cases",
                    f"in-sample {ins:+.4f}, out-of-sample {outs:+.4f}", ""))
    return out


if __name__ == "__main__":
    run_alone(run, __doc__)
