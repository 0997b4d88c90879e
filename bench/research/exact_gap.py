"""How far the heuristics and the lower bounds are from the exact optimum (CP-SAT, ``method="exact"``).

On random skewed instances (``eplb.simulation.synthetic.skewed_counts``: lognormal / zipf / hot families,
random skew, 64 / 512 / 4096 tokens x top-8 per layer), small (4-16 experts, 2-4 GPUs, up to 6
slots per GPU; a fifth of them hierarchical with 2 nodes) and medium (24-64 experts, 4-8 GPUs),
records per instance: whether CP-SAT proved optimality, its solve time (wall and CPU seconds),
``(heuristic - optimum) / optimum`` for every registered method, and ``(optimum - bound) / optimum``
for the closed-form lower bound. A lever study switches off one strengthening of the model at a time.

``cd bench && python -m research.exact_gap [--quick]``; writes ``exact_gap.csv``, ``exact_gap_levers.csv`` and
``exact_gap.png`` into the results folder and prints the markdown section.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from _common import load_note, markdown_table, planning_methods, pyplot, read_csv, run_alone, write_csv

import eplb
from eplb.planning.methods import exact_model as exact
from eplb.planning.api import make_deployment
from eplb import lower_bound
from eplb.planning.methods import DEFAULT_METHOD, get_method
from eplb.simulation.synthetic import skewed_counts

FAMILIES = ("lognormal", "zipf", "hot")
TOKENS = (64, 512, 4096)
LEVERS = {
    "all levers": exact.Levers(),
    "no exact integer loads": exact.Levers(exact_loads=False, spread_constraint=False),
    "no spread constraint": exact.Levers(spread_constraint=False),
    "no bounds as constraints": exact.Levers(bound_constraints=False),
    "no symmetry breaking": exact.Levers(symmetry_breaking=False),
    "plus branching on replica counts first": exact.Levers(branch_on_counts=True),
    "no warm start": exact.Levers(warm_start=False),
}


def instances(num_small: int, num_medium: int, seed: int = 0) -> list[dict]:
    """Random instances: ``dict(size, counts [E], num_slots, num_gpus, num_nodes, num_groups, tokens,
    family, skew)``; the same seed gives the same list."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_small + num_medium):
        small = i < num_small
        if small:
            gpus = int(rng.integers(2, 5))
            experts = int(rng.integers(4, min(16, 6 * gpus) + 1))
            per_gpu = int(rng.integers(-(-experts // gpus), 7))
        else:
            gpus = int(rng.choice([4, 8]))
            experts = int(rng.choice([24, 32, 48, 64]))
            per_gpu = -(-experts // gpus) + int(rng.integers(0, 3))
        nodes, groups = 1, None
        if small and gpus % 2 == 0 and experts % 2 == 0 and rng.random() < 0.2:
            nodes, groups = 2, 2 * int(rng.integers(1, 3))
            if experts % groups or (experts // groups) * (groups // nodes) > per_gpu * gpus // nodes:
                nodes, groups = 1, None
        family = str(rng.choice(FAMILIES))
        skew = float(rng.uniform(0.4, 1.4))
        tokens = int(rng.choice(TOKENS))
        counts = skewed_counts(1, experts, family=family, skew=skew, tokens=tokens, num_groups=groups,
                               seed=int(rng.integers(2**31)))[0].astype(np.float64)
        out.append(dict(size="small" if small else "medium", counts=counts, num_slots=gpus * per_gpu,
                        num_gpus=gpus, num_nodes=nodes, num_groups=groups, tokens=tokens, family=family,
                        skew=round(skew, 3)))
    return out


def solve_one(instance: dict, time_limit: float, levers: exact.Levers = exact.Levers()) -> dict:
    """Run the exact solver on one instance (one layer): optimality, plan load, bound, times."""
    counts = instance["counts"][None, :]
    deployment = make_deployment(counts.shape[1], instance["num_slots"], instance["num_gpus"], instance["num_nodes"],
                           instance["num_groups"])
    warm, _ = get_method(DEFAULT_METHOD)(counts, deployment)
    wall, cpu = time.perf_counter(), time.process_time()
    phy2log, info = exact.solve(counts, deployment, warm, time_limit=None, deterministic_time=time_limit, workers=1,
                                progress=False,
                                levers=levers)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    placement = eplb.Placement(phy2log=phy2log, num_experts=counts.shape[1], topology=deployment.topology,
                               num_groups=deployment.num_groups, method="exact")
    peak = float(placement.gpu_loads(counts).max())
    bound = float(max(info["proven_bound"][0], 0.0))
    return dict(optimal=bool(info["optimal"][0]), status=info["status"][0], exact_load=peak, proven_bound=bound,
                wall_s=wall, cpu_s=cpu)


def _relative(reference: float, value: float) -> float:
    """``(reference - value) / reference``; 0 when both are 0, NaN when the reference is unknown."""
    if math.isnan(reference):
        return math.nan
    return (reference - value) / reference if reference > 0 else 0.0


def measure(instance: dict, time_limit: float, methods: list[str]) -> dict:
    """One CSV row: the instance, the exact result, every method's load and gap, the bound's gap."""
    row = {k: instance[k] for k in ("size", "num_slots", "num_gpus", "num_nodes", "num_groups", "tokens",
                                    "family", "skew")}
    row["experts"] = len(instance["counts"])
    result = solve_one(instance, time_limit)
    row.update(result)
    counts = instance["counts"][None, :]
    config = {k: instance[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}
    deployment = make_deployment(counts.shape[1], **config)
    closed = float(lower_bound(counts, deployment)[0])
    reference = result["exact_load"] if result["optimal"] else math.nan
    row["closed_form_bound"] = closed
    row["bound_gap"] = _relative(reference, closed)
    for method in methods:
        load = float(eplb.plan(counts, method=method, **config).max_load[0])
        row[f"{method}_load"] = load
        row[f"{method}_gap"] = -_relative(reference, load)
        # against what is always known: the best proven bound
        best_bound = max(result["proven_bound"], closed)
        row[f"{method}_gap_to_bound"] = (load - best_bound) / best_bound if best_bound > 0 else 0.0
    return row


def lever_study(cases: list[dict], time_limit: float) -> list[dict]:
    """Each lever switched off in turn, on the same instances: proven share and median times."""
    rows = []
    for name, levers in LEVERS.items():
        results = [solve_one(case, time_limit, levers) for case in cases]
        rows.append(dict(levers=name, instances=len(cases),
                         proven=sum(r["optimal"] for r in results),
                         median_wall_s=round(float(np.median([r["wall_s"] for r in results])), 3),
                         median_cpu_s=round(float(np.median([r["cpu_s"] for r in results])), 3),
                         mean_bound_gap=float(np.mean([(r["exact_load"] - r["proven_bound"]) / r["exact_load"]
                                                       for r in results if r["exact_load"] > 0]))))
    return rows


def _quantiles(values) -> str:
    values = np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64)
    if values.size == 0:
        return "-"
    q = np.quantile(values, [0.5, 0.9, 1.0])
    return " / ".join(f"{100 * v:.2f}%" for v in q)


def _f(row, key) -> float:
    value = row[key]
    return math.nan if value in ("", None) else float(value)


def summarise(rows: list[dict], lever_rows: list[dict], methods: list[str], time_limit: float,
              lever_limit: float) -> str:
    small = [r for r in rows if r["size"] == "small"]
    medium = [r for r in rows if r["size"] == "medium"]
    lines = ["## Exact solver gap", ""]
    lines.append(f"{len(small)} small instances (4-16 experts, 2-4 GPUs, <= 6 slots per GPU, about a fifth "
                 f"hierarchical) and {len(medium)} medium ones (24-64 experts, 4-8 GPUs), one layer each, "
                 f"`time_limit={time_limit}` (CP-SAT deterministic seconds), one worker; {load_note()}.")
    lines.append("")
    proof_rows = []
    for name, subset in (("small", small), ("medium", medium)):
        for tokens in TOKENS:
            part = [r for r in subset if int(r["tokens"]) == tokens]
            if not part:
                continue
            proven = [r for r in part if str(r["optimal"]) == "True"]
            within = [r for r in proven if _f(r, "wall_s") <= 10.0]
            proof_rows.append((name, tokens * 8, len(part), f"{100 * len(proven) / len(part):.0f}%",
                               f"{100 * len(within) / len(part):.0f}%",
                               f"{np.median([_f(r, 'wall_s') for r in part]):.2f}",
                               f"{np.median([_f(r, 'cpu_s') for r in part]):.2f}",
                               f"{max(_f(r, 'wall_s') for r in part):.1f}"))
    lines.append(markdown_table(("size", "routings per layer", "instances", "proven optimal",
                                 "proven within 10 s wall", "median wall s", "median CPU s", "max wall s"),
                                proof_rows))
    lines.append("")
    lines.append("Gap to the optimum where it was proven, `(method - optimum) / optimum`, as median / p90 / max:")
    lines.append("")
    gap_rows = []
    for name, subset in (("small", small), ("medium", medium)):
        proven = [r for r in subset if str(r["optimal"]) == "True"]
        if not proven:
            continue
        for method in methods:
            gap_rows.append((name, method, len(proven), _quantiles(_f(r, f"{method}_gap") for r in proven)))
        gap_rows.append((name, "closed-form bound, (optimum - bound) / optimum", len(proven),
                         _quantiles(_f(r, "bound_gap") for r in proven)))
    lines.append(markdown_table(("size", "method", "proven instances", "median / p90 / max"), gap_rows))
    lines.append("")
    below = sum(1 for r in rows if str(r["optimal"]) == "True" for m in methods if _f(r, f"{m}_gap") < -1e-9)
    lines.append(f"Plans of a heuristic below a proven optimum (a wrong certificate; must be 0): {below}.")
    lines.append("")
    unproven = [r for r in rows if str(r["optimal"]) != "True"]
    if unproven:
        lines.append(f"Where optimality was not proven ({len(unproven)} instances), the gap of each method to the "
                     "best proven bound, median / p90 / max:")
        lines.append("")
        exact_row = ("exact (best plan found)",
                     _quantiles((_f(r, "exact_load") - _f(r, "proven_bound")) / _f(r, "proven_bound")
                                for r in unproven if _f(r, "proven_bound") > 0))
        lines.append(markdown_table(("method", "gap to proven bound"),
                                    [exact_row] + [(m, _quantiles(_f(r, f"{m}_gap_to_bound") for r in unproven))
                                                   for m in methods]))
        lines.append("")
    if lever_rows:
        lines.append(f"Levers, each switched off in turn on {lever_rows[0]['instances']} small instances "
                     f"(`time_limit={lever_limit}`):")
        lines.append("")
        lines.append(markdown_table(("model", "proven", "median wall s", "median CPU s", "mean (plan - bound) / plan"),
                                    [(r["levers"], f"{r['proven']}/{r['instances']}", r["median_wall_s"],
                                      r["median_cpu_s"], f"{100 * float(r['mean_bound_gap']):.3f}%")
                                     for r in lever_rows]))
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], methods: list[str], path: Path) -> None:
    plt = pyplot()
    proven = [r for r in rows if str(r["optimal"]) == "True" and r["size"] == "small"]
    if not proven:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    data = [[100 * _f(r, f"{m}_gap") for r in proven] for m in methods]
    axes[0].boxplot(data, tick_labels=methods, showfliers=True)
    axes[0].set_ylabel("(method - optimum) / optimum, %")
    axes[0].set_title(f"small instances proven optimal ({len(proven)})")
    times = np.sort([_f(r, "wall_s") for r in rows if r["size"] == "small"])
    axes[1].plot(times, np.arange(1, times.size + 1) / times.size)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("exact solve time per layer, wall s")
    axes[1].set_ylabel("share of small instances")
    axes[1].set_title("solve time (incl. unproven at the limit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, results_dir: Path) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    methods = planning_methods()
    time_limit = 0.5 if quick else 4.0
    lever_limit = 0.3 if quick else 2.0
    cases = instances(12 if quick else 160, 2 if quick else 30, seed=0)
    rows = [measure(case, time_limit, methods) for case in cases]
    write_csv(results_dir / "exact_gap.csv", rows)
    small = [c for c in cases if c["size"] == "small"]
    nontrivial = [c for c in small if len(c["counts"]) >= 8]  # the tiny ones prove in milliseconds anyway
    lever_rows = lever_study(nontrivial[:3] if quick else nontrivial[:16], lever_limit)
    write_csv(results_dir / "exact_gap_levers.csv", lever_rows)
    plot(rows, methods, results_dir / "exact_gap.png")
    return summarise(read_csv(results_dir / "exact_gap.csv"), lever_rows, methods, time_limit, lever_limit)


def headline(results_dir: Path):
    """Headline rows ``(figure, measured, target)`` from the CSV this section wrote."""
    rows = [r for r in read_csv(results_dir / "exact_gap.csv") if r["size"] == "small"]
    if not rows:
        return []
    proven = [r for r in rows if r["optimal"] == "True"]
    within = [r for r in proven if float(r["wall_s"]) <= 10.0]
    yield ("exact: small instances proven optimal within 10 s", f"{100 * len(within) / len(rows):.0f}% of {len(rows)}",
           ">= 90%")
    if proven:
        gaps = [float(r[f"{DEFAULT_METHOD}_gap"]) for r in proven]
        yield (f"default ({DEFAULT_METHOD}) above the optimum, median / max",
               f"{100 * np.median(gaps):.2f}% / {100 * max(gaps):.2f}%", "-")


if __name__ == "__main__":
    run_alone(run, __doc__)
