"""Out-of-sample balancedness: plans judged on windows they were not made from.

Two protocols (ARCHITECTURE section 8):
- ``leave-one-out``: windows are workloads; plan on all the others, serve the one left out;
- ``next-window``: windows are time; plan on windows ``<= t``, serve ``t + 1``.

Series:
- ``synthetic workloads`` (DeepSeek-V3 size, 58 layers x 256 experts, 8 groups): ``K`` workloads
  share a base popularity and each moves every expert's log-popularity by ``N(0, sigma)``, so the
  hot experts differ from workload to workload (leave-one-out);
- ``synthetic drift``: :func:`eplb.simulation.synthetic.drifting_counts`, hot experts move by a random walk
  (next-window);
- real traces (``../shared/data/traces``; skipped with a note when absent): OLMoE domains and
  gpt-oss benchmarks as workloads (leave-one-out), and a series that mixes them over time: every
  step serves mostly one workload (switching every few steps) plus a share of the others
  (next-window).

Each plan is served with uniform split (``1 / logcnt``, what engines do) and with optimal
dispatch (:func:`eplb.analysis.dispatch.dispatch`). A held-out window's balancedness is the mean over
layers of ``mean / max`` GPU load; tables give the mean over held-out windows and the worst one.
Objectives (:mod:`eplb.planning.objectives`): the combiners ``sum``, ``quantile``, ``max_share``, and the
per-layer selections ``expected_peak`` / ``worst_window`` scored under uniform (``/u``) or optimal
(``/o``) dispatch; ``expected_peak/o, made for dispatch`` is ``eplb.plan(objective=
"expected_peak", dispatch="optimal")``: the candidates and the same with their replicas linked in
rings (:func:`eplb.planning.objectives.link_replicas`), the selection among the eight, then the swap search of
:func:`eplb.planning.objectives.made_for_dispatch` (300 swaps per layer, single-replica experts only);
``expected_peak/o, swaps only`` is the previous plan made for dispatch (the selection, then 300
swaps of any slots); for the next-window protocol also ``sum`` with recency weights (half-life 4).
All objectives of one fold are built from the same four candidate plans (the ``CANDIDATES`` of
:mod:`eplb.planning.objectives`), exactly what :func:`eplb.planning.objectives.plan_estimated` does.

``python bench/out_of_sample.py [--quick]`` writes ``bench/results/out_of_sample.{csv,md}``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _common import load_note, trace_workloads, write_csv

from eplb.planning.api import make_deployment
from eplb.planning.methods import DEFAULT_METHOD, get_method
from eplb.planning.objectives import (CANDIDATES, combine, link_replicas, made_for_dispatch, recency_weights, select_per_layer,
                             window_peaks)
from eplb.planning.robust import improve_expected_peak
from eplb.simulation.synthetic import DEEPSEEK_V3, drifting_counts, expert_popularity

RESULTS = Path(__file__).resolve().parent / "results"
DEPLOYMENTS = {
    "global 288/32": dict(num_slots=288, num_gpus=32, num_nodes=1, num_groups=None),
    "global 320/32": dict(num_slots=320, num_gpus=32, num_nodes=1, num_groups=None),
    "hierarchical 288/32/4": dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),
}
SELECTION_SCORING = (("uniform", "u"), ("optimal", "o"))
SWAPS = 300  # swaps tried per layer by made_for_dispatch (as eplb.plan makes them)
MADE_FOR_DISPATCH = "expected_peak/o, made for dispatch"
SEARCHED = "expected_peak_search"  # the default under uniform split (default method only: ~2 s a plan)
SWAPS_ONLY = "expected_peak/o, swaps only (no linked replicas)"


def _problem(num_experts: int, config: dict):
    return make_deployment(num_experts, config["num_slots"], config["num_gpus"], config["num_nodes"],
                        config["num_groups"])


def synthetic_workloads(num_workloads: int, sigma: float, *, tokens: int = 65536, seed: int = 0) -> np.ndarray:
    """``[K, 58, 256]`` int64: workloads around one base popularity (lognormal skew 0.7, 8 groups);
    each multiplies every expert's popularity by ``exp(N(0, sigma))``."""
    c = DEEPSEEK_V3
    rng = np.random.default_rng(seed)
    base = np.log(expert_popularity(c["num_layers"], c["num_experts"], num_groups=c["num_groups"], rng=rng))
    out = np.empty((num_workloads, c["num_layers"], c["num_experts"]), np.int64)
    for k in range(num_workloads):
        logits = base + rng.normal(0.0, sigma, size=base.shape)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[k] = np.stack([rng.multinomial(tokens * c["top_k"], row) for row in p])
    return out


def mixed_over_time(workloads: np.ndarray, steps: int, *, dwell: int = 3, background: float = 0.3,
                    seed: int = 0) -> np.ndarray:
    """``[steps, L, E]``: each step is ``1 - background`` of one workload (a new one every ``dwell``
    steps, drawn at random) plus ``background`` spread over all workloads with Dirichlet weights;
    every workload is first scaled to the same total per layer."""
    rng = np.random.default_rng(seed)
    totals = workloads.sum(axis=-1, keepdims=True)
    shares = np.divide(workloads, totals, out=np.zeros_like(workloads, dtype=np.float64), where=totals > 0)
    series = np.empty((steps,) + workloads.shape[1:])
    current = rng.integers(workloads.shape[0])
    for t in range(steps):
        if t % dwell == 0:
            current = rng.integers(workloads.shape[0])
        mix = background * rng.dirichlet(np.ones(workloads.shape[0]))
        mix[current] += 1.0 - background
        series[t] = np.tensordot(mix, shares, axes=1) * 1e5
    return series


def objective_plans(train: np.ndarray, problem, method: str, recency: bool):
    """``{objective label: phy2log [L, S]}`` for one fold, from the four candidate plans."""
    fn = get_method(method)
    weights = recency_weights(train.shape[0], 4.0) if recency else None
    estimates = [combine(train, name, weights, quantile=q or 0.9) for name, q in CANDIDATES]
    plans = [fn(w, problem)[0] for w in estimates]
    out = {"sum": plans[0], "quantile": plans[2], "max_share": plans[3]}
    for objective in ("expected_peak", "worst_window"):
        for dispatch, tag in SELECTION_SCORING:
            out[f"{objective}/{tag}"] = select_per_layer(train, plans, problem.topology, objective, weights,
                                                         dispatch)[0]
    if recency:
        return {f"{k} (recency)": v for k, v in out.items() if k in ("sum", "expected_peak/u", "expected_peak/o")}
    # plan(objective="expected_peak", dispatch="optimal"): the candidates and the same with
    # their replicas linked in rings, the selection, then the swap search over single-replica experts
    linked = [link_replicas(w, p, problem)[0] for w, p in zip(estimates, plans)]
    selected = select_per_layer(train, plans + linked, problem.topology, "expected_peak", weights, "optimal")[0]
    out[MADE_FOR_DISPATCH] = made_for_dispatch(train, selected, problem, iterations=SWAPS, keep_replicas=True)[0]
    # the previous plan made for dispatch: the selection, then swaps of any slots
    out[SWAPS_ONLY] = made_for_dispatch(train, out["expected_peak/o"], problem, iterations=SWAPS)[0]
    if method == DEFAULT_METHOD:  # plan(objective="expected_peak_search"): the sum plan, searched
        out[SEARCHED] = improve_expected_peak(train, plans[0], problem, weights)[0]
    return out


def evaluate(series: np.ndarray, config: dict, protocol: str, method: str, *, start: int = 3):
    """Held-out balancedness ``{objective: (uniform [n], optimal [n])}`` over the held-out windows."""
    series = series.astype(np.float64)
    problem = _problem(series.shape[-1], config)
    if protocol == "leave-one-out":
        folds = [(np.delete(series, t, axis=0), t) for t in range(series.shape[0])]
    else:
        folds = [(series[: t + 1], t + 1) for t in range(start - 1, series.shape[0] - 1)]
    scores: dict[str, tuple[list, list]] = {}
    for train, held in folds:
        plans = objective_plans(train, problem, method, recency=False)
        if protocol == "next-window":
            plans.update(objective_plans(train, problem, method, recency=True))
        window = series[held : held + 1]
        for name, phy2log in plans.items():
            uniform = 1.0 / window_peaks(window, phy2log, problem.topology, "uniform")[0]
            optimal = 1.0 / window_peaks(window, phy2log, problem.topology, "optimal")[0]
            entry = scores.setdefault(name, ([], []))
            entry[0].append(uniform.mean())
            entry[1].append(optimal.mean())
    return {k: (np.array(u), np.array(o)) for k, (u, o) in scores.items()}


def scenarios(quick: bool):
    """``(series label, protocol, series [T, L, E], {deployment: config})``."""
    out = []
    k = 4 if quick else 12
    # --quick: one level of each kind on the first deployment, a smoke run (figures come from the full run)
    deployments = dict(list(DEPLOYMENTS.items())[:1]) if quick else DEPLOYMENTS
    for sigma in (0.2,) if quick else (0.1, 0.2):
        out.append((f"synthetic workloads sigma={sigma}", "leave-one-out", synthetic_workloads(k, sigma, seed=1),
                    deployments))
    for drift in (0.2,) if quick else (0.1, 0.2):
        steps = 5 if quick else 13
        series = drifting_counts(steps, DEEPSEEK_V3["num_layers"], DEEPSEEK_V3["num_experts"], drift=drift,
                                 tokens=65536, num_groups=DEEPSEEK_V3["num_groups"], seed=2)
        out.append((f"synthetic drift={drift}", "next-window", series, deployments))
    workloads, missing = trace_workloads()
    for key, names, counts, config in workloads:
        if key == "mixtral-8x7b":
            continue  # 8 experts, nearly balanced: nothing to learn out of sample
        deployments = {f"global {config['num_slots']}/{config['num_gpus']}": config}
        out.append((f"{key} ({len(names)} workloads)", "leave-one-out", counts, deployments))
        mixed = mixed_over_time(counts, 6 if quick else 24, seed=3)
        out.append((f"{key} mixed over time", "next-window", mixed, deployments))
    return out, missing


def run(quick: bool = False, results_dir: Path = RESULTS, only: str | None = None) -> str:
    """Evaluate every scenario (or those whose label contains ``only``) and write
    ``out_of_sample.{csv,md}`` into ``results_dir``."""
    started = time.perf_counter()
    rows = []
    cases, missing = scenarios(quick)
    methods = ["greedy", DEFAULT_METHOD]
    for label, protocol, series, deployments in cases:
        if only is not None and only not in label:
            continue
        for deployment, config in deployments.items():
            for method in methods:
                for objective, (uniform, optimal) in evaluate(series, config, protocol, method).items():
                    rows.append({
                        "series": label, "protocol": protocol, "deployment": deployment, "method": method,
                        "objective": objective, "held_out": len(uniform),
                        "uniform_mean": round(float(uniform.mean()), 4),
                        "uniform_worst": round(float(uniform.min()), 4),
                        "optimal_mean": round(float(optimal.mean()), 4),
                        "optimal_worst": round(float(optimal.min()), 4),
                    })
                print(f"{label} | {deployment} | {method}: {time.perf_counter() - started:.0f} s", flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "out_of_sample.csv", rows)
    text = markdown(rows, missing, quick, time.perf_counter() - started)
    (results_dir / "out_of_sample.md").write_text(text + "\n")
    return text


def verdict(rows) -> list[str]:
    """The defaults against planning on the summed counts (default method), and issue 16's targets."""
    pick = {}
    for r in rows:
        if r["method"] == DEFAULT_METHOD:
            pick[(r["series"], r["protocol"], r["deployment"], r["objective"])] = r
    lines = [
        f"### Defaults (method `{DEFAULT_METHOD}`): summed counts vs the series default per dispatch mode",
        "",
        "Uniform split: the default objective is `expected_peak_search` (`DEFAULT_OBJECTIVE['uniform']`: the sum "
        "plan searched for a lower mean window peak, kept where cross-validation over the training windows says it "
        "pays), against planning on the summed counts. Optimal dispatch: "
        "`expected_peak` made for dispatch (`DEFAULT_OBJECTIVE['optimal']`, i.e. `plan(series, dispatch='optimal')`), "
        "against the same plan from summed counts served with optimal dispatch. Cells: mean / worst held-out window.",
        "",
        "| series | protocol | deployment | uniform, sum | uniform, default (searched) | optimal, sum | "
        "optimal, made for dispatch | made for dispatch under uniform split |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (series, protocol, deployment, objective), r in pick.items():
        if objective != "sum":
            continue
        m = pick.get((series, protocol, deployment, MADE_FOR_DISPATCH))
        u = pick.get((series, protocol, deployment, SEARCHED))
        if m is None or u is None:
            continue
        lines.append(f"| {series} | {protocol} | {deployment} | {r['uniform_mean']:.4f} / {r['uniform_worst']:.4f} | "
                     f"{u['uniform_mean']:.4f} / {u['uniform_worst']:.4f} | "
                     f"{r['optimal_mean']:.4f} / {r['optimal_worst']:.4f} | "
                     f"{m['optimal_mean']:.4f} / {m['optimal_worst']:.4f} | "
                     f"{m['uniform_mean']:.4f} / {m['uniform_worst']:.4f} |")
    lines += [
        "",
        "Issue 16's targets are stated for held-out DeepSeek-V3 workloads, which the project does not have; "
        "the synthetic workloads stand in for them: the issue's plain figures (global 288/32, uniform "
        "0.896 / 0.836, optimal dispatch 0.943 / 0.908) lie between sigma=0.1 (easier) and sigma=0.2 (harder). "
        "Targets: optimal dispatch, global 288/32, >= 0.97 mean and >= 0.95 every window; 320/32, >= 0.995 / "
        "0.985; uniform split >= 0.91 / 0.88 and never below the summed counts.",
    ]
    return lines


def headline(results_dir: Path):
    """Issue 16's targets on the synthetic DeepSeek-V3-sized workloads (default method, leave one out)."""
    from _common import read_csv

    path = Path(results_dir) / "out_of_sample.csv"
    if not path.exists():
        return []
    rows = {(r["series"], r["deployment"], r["objective"]): r for r in read_csv(path)
            if r["method"] == DEFAULT_METHOD and r["protocol"] == "leave-one-out"}
    out = []
    checks = (("global 288/32", MADE_FOR_DISPATCH, "optimal", 0.97, 0.95),
              ("global 320/32", MADE_FOR_DISPATCH, "optimal", 0.995, 0.985),
              ("global 288/32", SEARCHED, "uniform", 0.91, 0.88))
    for series in sorted({key[0] for key in rows if key[0].startswith("synthetic workloads")}):
        for deployment, objective, mode, mean_target, worst_target in checks:
            r = rows.get((series, deployment, objective))
            if r is None:
                continue
            mean, worst = float(r[f"{mode}_mean"]), float(r[f"{mode}_worst"])
            base = rows.get((series, deployment, "sum"))
            plain = f"; planned on summed counts {float(base[f'{mode}_mean']):.3f} / {float(base[f'{mode}_worst']):.3f}" \
                if base is not None else ""
            met = mean >= mean_target and worst >= worst_target
            out.append((f"Out of sample, {series}, {deployment}, {'optimal dispatch, plan made for it' if mode == 'optimal' else 'even split, default objective'}: mean / worst held-out window",
                        f"{mean:.3f} / {worst:.3f}{plain}",
                        f">= {mean_target} / {worst_target}: {'met' if met else 'not met'}"))
    return out


def markdown(rows, missing, quick, seconds) -> str:
    lines = [
        "## Out of sample: plans served on windows they were not made from",
        "",
        f"`python bench/out_of_sample.py{' --quick' if quick else ''}` "
        f"({'parts run in parallel with --only, joined with --merge' if seconds is None else f'{seconds:.0f} s'}; "
        f"{load_note()}). "
        "Balancedness of a held-out window = mean over layers of mean / max GPU load; each cell is "
        "mean over held-out windows / worst held-out window, with uniform split and with optimal dispatch. "
        "`/u`, `/o`: per-layer selection scored under uniform / optimal dispatch.",
    ]
    for note in missing:
        lines += ["", f"- {note}"]
    lines += [""] + verdict(rows)
    keys = []
    for row in rows:
        key = (row["series"], row["protocol"], row["deployment"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        block = [r for r in rows if (r["series"], r["protocol"], r["deployment"]) == key]
        methods = list(dict.fromkeys(r["method"] for r in block))
        lines += ["", f"### {key[0]}, {key[1]}, {key[2]} ({block[0]['held_out']} held-out windows)", "",
                  "| objective | " + " | ".join(f"{m} uniform | {m} optimal" for m in methods) + " |",
                  "|---|" + "---|---|" * len(methods)]
        for objective in dict.fromkeys(r["objective"] for r in block):
            cells = []
            for m in methods:
                r = next((r for r in block if r["method"] == m and r["objective"] == objective), None)
                cells += ["–", "–"] if r is None else [f"{r['uniform_mean']:.4f} / {r['uniform_worst']:.4f}",
                                                       f"{r['optimal_mean']:.4f} / {r['optimal_worst']:.4f}"]
            lines.append(f"| {objective} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(parts: list[Path], results_dir: Path = RESULTS) -> str:
    """Join the CSVs of runs made with ``--only`` (e.g. in parallel) into one CSV and table."""
    import csv

    rows = []
    for part in parts:
        with open(part / "out_of_sample.csv", newline="") as handle:
            for row in csv.DictReader(handle):
                for key in ("uniform_mean", "uniform_worst", "optimal_mean", "optimal_worst"):
                    row[key] = float(row[key])
                rows.append(row)
    _, missing = trace_workloads()
    write_csv(results_dir / "out_of_sample.csv", rows)
    text = markdown(rows, missing, False, None)
    (results_dir / "out_of_sample.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer windows (a few minutes)")
    parser.add_argument("--only", default=None, help="only the series whose label contains this text")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="join the out_of_sample.csv of these folders into the results folder")
    args = parser.parse_args()
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    if args.merge:
        print(merge(args.merge, out))
    else:
        print(run(args.quick, out, args.only))
