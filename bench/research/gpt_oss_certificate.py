"""Where the gpt-oss-20b gap lies: the bound or the methods (``eplb.planning.certificate.certify``).

On the real gpt-oss-20b trace (windows summed per benchmark, 24 layers x 32 experts, 40 slots on
8 GPUs of 5, global mode) records per (benchmark, layer): the lower bound
(:func:`eplb.analysis.bounds.lower_bound`; the average bound on every one of these layers), the max load of
the default method and of ``best``, and two placements of the exact capped packing search
(:mod:`eplb.planning.certificate`): ``fixed`` keeps best's replica counts and bisects the cap (the packing
is then the optimum for those counts when every search finishes within its node budget), ``quick``
and ``full`` also descend over the replica counts (one replica moved between two experts at a
time) with 1,000 / 20,000 search nodes per packing attempt. Every
found placement has no two replicas of one expert on a GPU (as the default). Times are wall
seconds per layer on a shared 2-core machine.

``cd bench && python -m research.gpt_oss_certificate [--quick]``; writes ``gpt_oss_certificate.csv`` into the
results folder and prints the markdown section.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from _common import load_note, markdown_table, pct, run_alone, trace_workloads, write_csv

import eplb
from eplb.analysis.bounds import average_bound, lower_bound
from eplb.planning.certificate import improve_layer
from eplb import Topology
from eplb import Deployment

VARIANTS = (("fixed", False, 20_000), ("quick", True, 1_000), ("full", True, 20_000))
"""(name, descent over replica counts, search nodes per packing attempt)."""


def _max_loads(weights: np.ndarray, placement) -> np.ndarray:
    return placement.gpu_loads(weights).max(axis=-1)


def measure(quick: bool) -> tuple[list[dict], str | None]:
    """One row per (benchmark, layer); ``None`` or a note when the trace is absent."""
    workloads, missing = trace_workloads()
    found = [w for w in workloads if w[0] == "gpt-oss-20b"]
    if not found:
        return [], "; ".join(m for m in missing if "gpt_oss" in m) or "gpt-oss-20b trace absent"
    _, names, counts, deployment = found[0]
    topology = Topology.uniform(deployment["num_slots"], deployment["num_gpus"], deployment["num_nodes"])
    slots = int(topology.slots_per_gpu[0])
    windows = range(1) if quick else range(len(names))
    layers = range(0, counts.shape[1], 6) if quick else range(counts.shape[1])
    rows = []
    for k in windows:
        weights = counts[k]
        default = eplb.plan(weights, topology=topology)
        best = eplb.plan(weights, topology=topology, method="best")
        start = time.perf_counter()
        eplb.plan(weights, topology=topology, method="best")
        best_seconds = (time.perf_counter() - start) / weights.shape[0]
        bound = lower_bound(weights, Deployment.of(weights.shape[-1], topology=topology))
        average = average_bound(weights, topology)
        default_max, best_max = _max_loads(weights, default), _max_loads(weights, best)
        for layer in layers:
            row = {"benchmark": names[k], "layer": layer, "lower_bound": bound[layer],
                   "average_bound": average[layer], "default": default_max[layer], "best": best_max[layer],
                   "best_seconds": best_seconds}
            for variant, neighbours, budget in VARIANTS:
                start = time.perf_counter()
                upper, _, nodes = improve_layer(weights[layer], best.phy2log[layer], topology.num_gpus, slots,
                                                float(bound[layer]), neighbours=neighbours, budget=budget)
                row[variant] = upper
                row[f"{variant}_seconds"] = time.perf_counter() - start
                row[f"{variant}_nodes"] = nodes
            rows.append(row)
    return rows, None


def summary(rows: list[dict]) -> str:
    def gap(key: str, against: str = "lower_bound") -> float:
        return float(np.mean([r[key] / r[against] - 1 for r in rows]))

    def median(key: str) -> float:
        return float(np.median([r[key] for r in rows]))

    optimal = sum(r["full"] <= r["lower_bound"] * (1 + 1e-9) for r in rows)
    bound_is_average = sum(abs(r["lower_bound"] - r["average_bound"]) <= 1e-12 * r["average_bound"] for r in rows)
    table = markdown_table(
        ["placement", "mean gap to the bound", "max gap", "mean gap to the lightest found", "s / layer (median)"],
        [
            ["default", pct(gap("default")), pct(max(r["default"] / r["lower_bound"] - 1 for r in rows)),
             pct(gap("default", "full")), "-"],
            ["best", pct(gap("best")), pct(max(r["best"] / r["lower_bound"] - 1 for r in rows)),
             pct(gap("best", "full")), f"{median('best_seconds'):.3f}"],
            ["capped search, best's counts", pct(gap("fixed")), pct(max(r["fixed"] / r["lower_bound"] - 1 for r in rows)),
             pct(gap("fixed", "full")), f"{median('fixed_seconds'):.3f} (+ best)"],
            ["capped search + count descent, 1,000 nodes", pct(gap("quick")),
             pct(max(r["quick"] / r["lower_bound"] - 1 for r in rows)), pct(gap("quick", "full")),
             f"{median('quick_seconds'):.3f} (+ best)"],
            ["capped search + count descent, 20,000 nodes", pct(gap("full")), pct(max(r["full"] / r["lower_bound"] - 1 for r in rows)),
             "0", f"{median('full_seconds'):.3f} (+ best)"],
        ])
    return (
        f"{len(rows)} (benchmark, layer) pairs; the lower bound is the average bound on "
        f"{bound_is_average} of them. The lightest placement found is at most "
        f"{pct(gap('full'))} (mean) above the bound, so no tighter bound can gain more than that: "
        f"the {pct(gap('best'))} of `best` is the methods' packing, not the bound. "
        f"Proven optimal (found = bound): {optimal}.\n\n{table}\n"
    )


def run(quick: bool, results_dir: Path) -> str:
    results_dir = Path(results_dir)
    started = time.perf_counter()
    rows, note = measure(quick)
    head = "## gpt-oss-20b: bound or method (capped packing search)\n\n"
    if note is not None:
        return head + f"Skipped: {note}.\n"
    write_csv(results_dir / "gpt_oss_certificate.csv", rows)
    return (head + summary(rows) + f"\n{'Quick run (1 benchmark, 4 layers). ' if quick else ''}"
            f"{time.perf_counter() - started:.0f} s in all; "
            f"{load_note()}.\n")


if __name__ == "__main__":
    run_alone(run, __doc__)
