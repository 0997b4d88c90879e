"""Locality: balancedness against off-node tokens (``eplb.pareto``), in sample and out of sample.

Hierarchical placement keeps each expert group on one node; ``max_off_node=f`` lets replicas of
hot experts sit on other nodes for at most a fraction ``f`` of each layer's tokens. For a sweep of
caps this script reports the balancedness (mean / max GPU load, mean over MoE layers, with the
shares the plan returns) and the off-node share of the tokens:

- DeepSeek-V3-sized synthetic workloads with group skew (2 of the 8 groups carry 40% of a layer's
  tokens, the pattern of real prefill traffic; which groups are hot is fixed per layer, the experts'
  popularity varies by workload): 288 slots / 32 GPUs / 4 nodes and 320 / 64 / 8. In sample: plan
  on the sum of 12 workloads; out of sample: leave one workload out, plan on the other 11.
- The real traces (``../shared/data/traces``; skipped when absent), with their experts cut into 8
  groups (these models do not route by group; the grouping is a deployment choice): OLMoE-1B-7B 80
  slots / 16 GPUs / 2 nodes, gpt-oss-20b 48 slots / 8 GPUs / 2 nodes, leave one workload out.
- Reference points: the published greedy (hierarchical) and the global placement of the default.

Run: ``cd bench && python -m research.locality [--quick]``; ``bench/run.py`` runs it as the "Locality" section.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from _common import markdown_table, pyplot, read_csv, rows_of, run_alone, trace_workloads, write_csv

import eplb
from eplb.analysis.dispatch import optimal_dispatch
from eplb.model.deployment import make_deployment
from eplb.planning.locality import off_node_curve, plan_locality

FRACTIONS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 1.0)
QUICK_FRACTIONS = (0.0, 0.1, 0.2, 1.0)
DEPLOYMENTS = {"4 nodes": dict(num_slots=288, num_gpus=32, num_nodes=4),
               "8 nodes": dict(num_slots=320, num_gpus=64, num_nodes=8)}
TARGETS = {"4 nodes": (0.10, 0.97), "8 nodes": (0.20, 0.95)}


def group_skew_workloads(num_workloads: int = 12, num_layers: int = 58, num_experts: int = 256, num_groups: int = 8,
                         hot_groups: int = 2, hot_share: float = 0.4, sigma: float = 0.2, tokens: int = 4096 * 64,
                         seed: int = 0) -> np.ndarray:
    """``[W, L, E]`` counts: per layer ``hot_groups`` fixed groups carry ``hot_share`` of the tokens;
    every workload draws its own expert popularity around the layer's (lognormal, ``sigma``).

    ``sigma = 0.2`` is calibrated on the held-out DeepSeek-V3 workloads of the issue: a global
    default plan on 11 workloads serves the 12th at 0.85 balancedness with an even split and 0.92
    with optimal dispatch (the issue measured 0.858 and 0.920 on the real ones)."""
    rng = np.random.default_rng(seed)
    size = num_experts // num_groups
    base = rng.normal(0.0, 0.7, (num_layers, num_experts))
    group_weight = np.full((num_layers, num_groups), (1 - hot_share) / (num_groups - hot_groups))
    for layer in range(num_layers):
        group_weight[layer, rng.choice(num_groups, hot_groups, replace=False)] = hot_share / hot_groups
    out = np.empty((num_workloads, num_layers, num_experts))
    for w in range(num_workloads):
        p = np.exp(base + rng.normal(0.0, sigma, base.shape)).reshape(num_layers, num_groups, size)
        p = p / p.sum(axis=2, keepdims=True) * group_weight[:, :, None]
        p = p.reshape(num_layers, num_experts)
        out[w] = np.stack([rng.multinomial(tokens, row / row.sum()) for row in p])
    return out


def mean_balancedness(loads: np.ndarray) -> float:
    peak = loads.max(axis=-1)
    moe = peak > 0
    return float((loads.mean(axis=-1)[moe] / peak[moe]).mean())


def reference_points(windows: np.ndarray, deployment: dict, leave_out: int) -> dict:
    """The published greedy (hierarchical) and the global default placement: balancedness in sample
    (sum of all windows) and out of sample (leave each of the first ``leave_out`` windows out), with
    an even split and with optimal dispatch."""
    out = {}
    for name, kwargs in (("published greedy (hierarchical)", dict(method="greedy", num_groups=8)),
                         ("global placement (default)", dict(num_groups=None))):
        placement = eplb.plan(windows.sum(axis=0), **deployment, **kwargs)
        row = {"in": mean_balancedness(placement.gpu_loads(windows.sum(axis=0))), "out": [], "out_optimal": []}
        for w in range(leave_out):
            held = eplb.plan(windows[np.arange(len(windows)) != w].sum(axis=0), **deployment, **kwargs)
            row["out"].append(mean_balancedness(held.gpu_loads(windows[w])))
            _, peak = optimal_dispatch(windows[w], held.phy2log, held.topology)
            moe = peak > 0
            row["out_optimal"].append(float((windows[w].sum(axis=1)[moe] / held.topology.num_gpus / peak[moe]).mean()))
        out[name] = row
    return out


def sweep(windows: np.ndarray, deployment: dict, fractions, label: str, leave_out: int) -> list[dict]:
    """Rows of the curve: in sample on the sum of ``windows [W, L, E]``; out of sample by leaving
    out each of the first ``leave_out`` windows in turn (means over them, and the worst), with the
    plan's shares and with optimal dispatch."""
    problem = make_deployment(windows.shape[2], num_groups=8, **deployment)
    total = windows.sum(axis=0)
    curve = off_node_curve(total, problem, fractions)
    held = [off_node_curve(windows[np.arange(len(windows)) != w].sum(axis=0), problem, fractions, held_out=windows[w:w + 1])
            for w in range(leave_out)]
    rows = []
    for i, fraction in enumerate(fractions):
        outs = [h["balancedness_held_out"][i] for h in held]
        best = [h["balancedness_held_out_optimal"][i] for h in held]
        rows.append({"case": label, "max_off_node": fraction,
                     "balancedness_in_sample": round(float(curve["balancedness"][i]), 4),
                     "off_node_in_sample": round(float(curve["off_node_fraction"][i]), 4),
                     "balancedness_out_of_sample": round(float(np.mean(outs)), 4),
                     "worst_out_of_sample": round(float(np.min(outs)), 4),
                     "off_node_out_of_sample": round(float(np.mean([h["off_node_fraction_held_out"][i] for h in held])), 4),
                     "out_of_sample_optimal_dispatch": round(float(np.mean(best)), 4),
                     "worst_optimal_dispatch": round(float(np.min(best)), 4),
                     "off_node_optimal_dispatch": round(float(np.mean(
                         [h["off_node_fraction_held_out_optimal"][i] for h in held])), 4)})
    for name, row in reference_points(windows, deployment, leave_out).items():
        rows.append({"case": label, "max_off_node": name, "balancedness_in_sample": round(row["in"], 4),
                     "off_node_in_sample": 0.0 if "greedy" in name else "",
                     "balancedness_out_of_sample": round(float(np.mean(row["out"])), 4),
                     "worst_out_of_sample": round(float(np.min(row["out"])), 4), "off_node_out_of_sample": "",
                     "out_of_sample_optimal_dispatch": round(float(np.mean(row["out_optimal"])), 4),
                     "worst_optimal_dispatch": round(float(np.min(row["out_optimal"])), 4),
                     "off_node_optimal_dispatch": ""})
    return rows


def plan_time(windows: np.ndarray, deployment: dict, fraction: float, repeats: int) -> float:
    """Median seconds of one whole-model plan with the cap (after a warm-up call)."""
    problem = make_deployment(windows.shape[2], num_groups=8, **deployment)
    total = windows.sum(axis=0)
    plan_locality(total, problem, fraction)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_locality(total, problem, fraction)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        curve = [r for r in rows if r["case"] == case and not isinstance(r["max_off_node"], str)]
        ax.plot([r["off_node_in_sample"] for r in curve], [r["balancedness_in_sample"] for r in curve], "o-",
                label="in sample")
        if curve and curve[0]["balancedness_out_of_sample"] != "":
            ax.plot([r["off_node_out_of_sample"] for r in curve], [r["balancedness_out_of_sample"] for r in curve],
                    "s--", label="out of sample")
        for r in rows:
            if r["case"] == case and isinstance(r["max_off_node"], str):
                marker = "^" if "greedy" in r["max_off_node"] else "v"
                x = 0.0 if "greedy" in r["max_off_node"] else ax.get_xlim()[1]
                ax.plot([x], [r["balancedness_in_sample"]], marker, label=r["max_off_node"])
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("tokens served off their home node")
        ax.set_ylabel("balancedness (mean / max GPU load)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, results_dir: Path, layers: int | None = None, traces: bool = True) -> str:
    fractions = QUICK_FRACTIONS if quick else FRACTIONS
    layers = layers or (12 if quick else 58)
    rows, notes, timing = [], [], []
    for name, deployment in DEPLOYMENTS.items():
        windows = group_skew_workloads(num_layers=layers)
        rows += sweep(windows, deployment, fractions, f"DeepSeek-V3-sized, group skew, {name}", 2 if quick else 12)
        cap = TARGETS[name][0]
        timing.append({"case": name, "max_off_node": cap,
                       "plan_ms": round(plan_time(windows, deployment, cap, 3 if quick else 15) * 1e3, 1),
                       "layers": layers})
    workloads, missing = trace_workloads() if traces else ([], [])
    notes += missing
    trace_configs = {"olmoe-1b-7b": dict(num_slots=80, num_gpus=16, num_nodes=2),
                     "gpt-oss-20b": dict(num_slots=48, num_gpus=8, num_nodes=2)}
    for key, names, counts, _ in workloads:
        if key in trace_configs:
            rows += sweep(counts, trace_configs[key], fractions, f"{key}, 8 groups, 2 nodes",
                          min(len(names), 3 if quick else len(names)))
    write_csv(results_dir / "locality.csv", rows)
    write_csv(results_dir / "locality_time.csv", timing)
    plot(rows, results_dir / "locality.png")
    header = ("case", "max_off_node", "balancedness_in_sample", "off_node_in_sample", "balancedness_out_of_sample",
              "worst_out_of_sample", "off_node_out_of_sample", "out_of_sample_optimal_dispatch",
              "worst_optimal_dispatch", "off_node_optimal_dispatch")
    md = ["## Locality", "",
          "Balancedness (mean / max GPU load, mean over MoE layers, with the plan's shares) against the share of "
          "tokens served off their group's home node, for caps `max_off_node`; out of sample: leave one workload "
          "out (mean and worst over the workloads left out), with the plan's shares and with optimal dispatch "
          "(which does not keep to the cap: its off-node share is given). Plot: `locality.png`.", "",
          markdown_table(header, [[r[h] for h in header] for r in rows]), "",
          "Whole-model planning time with the cap (median):", "",
          markdown_table(("deployment", "max_off_node", "layers", "ms"),
                         [(t["case"], t["max_off_node"], t["layers"], t["plan_ms"]) for t in timing])]
    if notes:
        md += ["", *[f"- {n}" for n in notes]]
    return "\n".join(md) + "\n"


def headline(results_dir: Path):
    rows = rows_of(results_dir, "locality")
    if not rows:
        return []
    timing = {r["case"]: r for r in read_csv(results_dir / "locality_time.csv")} if (
        results_dir / "locality_time.csv").exists() else {}
    out = []
    for name, (cap, target) in TARGETS.items():
        case = f"DeepSeek-V3-sized, group skew, {name}"
        row = next((r for r in rows if r["case"] == case and r["max_off_node"] == str(cap)), None)
        if row is None:
            continue
        bal, off = float(row["balancedness_in_sample"]), float(row["off_node_in_sample"])
        verdict = "met" if bal >= target and off <= cap + 1e-9 else "not met"
        out.append((f"Locality, {case}, `max_off_node={cap}`: balancedness in sample (off-node share)",
                    f"{bal:.4f} ({off:.1%} off node)", f">= {target} at <= {cap:.0%}: {verdict}"))
        if name == "4 nodes":
            oos, best = float(row["balancedness_out_of_sample"]), float(row["out_of_sample_optimal_dispatch"])
            out.append((f"Locality, {case}, `max_off_node={cap}`: out of sample (leave one workload out), "
                        "plan's shares / optimal dispatch",
                        f"{oos:.4f} / {best:.4f} ({float(row['off_node_optimal_dispatch']):.1%} off node)",
                        f">= 0.90: {'met' if oos >= 0.90 else 'not met'} with the shares, "
                        f"{'met' if best >= 0.90 else 'not met'} with optimal dispatch"))
        if name in timing:
            ms = float(timing[name]["plan_ms"])
            out.append((f"Locality: whole-model plan with the cap, {name} ({timing[name]['layers']} layers)",
                        f"{ms:.1f} ms", f"<= 20 ms: {'met' if ms <= 20 else 'not met'}"))
    return out


if __name__ == "__main__":
    run_alone(run, __doc__)
