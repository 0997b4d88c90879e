"""Plans made for an engine's dispatch rule: SGLang's static table, held out.

SGLang's ``static`` dispatch (the default with DeepEP) does not split an expert's tokens evenly
among its replicas (:mod:`eplb.analysis.engine_dispatch`), so a plan made for an even split loses balance
under it. ``eplb.plan(..., dispatch="sglang-static")`` makes the plan for the table
(:mod:`eplb.planning.engine_planning`). This script measures, held out (leave one window out: plan on the
other windows, judge on the one left out), the mean and worst balancedness of:

- ``even plan / static``: ``eplb.plan(train)`` (the default for an even split) served by SGLang static;
- ``made for static / static``: ``eplb.plan(train, dispatch="sglang-static")`` served by SGLang static;
- ``even plan / even split``: the default plan under the even split it was made for (the reference
  level the issue asks the static plan to reach);
- the same three from the hedged plan for an even split (``objective="expected_peak_search"``, the
  plan over the windows that serves unseen windows best; about to become the default): ``hedged plan /
  static``, ``made for static (hedged) / static`` (``dispatch="sglang-static"`` with that objective:
  made for the table from the hedged plan) and ``hedged plan / even split``;
- the same for SGLang ``dynamic`` (with an all-to-all backend): the default plan and the plan made
  for it, both served by it.

Series (windows differ by structured shifts, as real workloads do):

- ``workloads``: DeepSeek-V3-sized workloads (58 layers x 256 experts, 8 groups) from one base
  popularity, each expert's log-popularity shifted per workload (:func:`eplb.simulation.series.synthetic_workloads`,
  shift 0.25), 65,536 tokens x top-8 sampled per workload;
- ``mixture path``: windows along a traffic path through 6 such workloads
  (:func:`eplb.simulation.series.mixture_path`), one window per segment of 64 steps;
- the real traces (``../shared/data/traces``; skipped when absent) as workloads: OLMoE-1B-7B domains
  on 80 slots / 16 GPUs / 2 nodes, gpt-oss-20b benchmarks on 48 slots / 8 GPUs / 2 nodes.

Deployments: global and hierarchical (8 groups kept on their node); DeepSeek-V3 size on 288 slots /
32 GPUs / 4 nodes.

Run: ``python bench/engine_planning.py [--quick]`` (writes ``engine_planning.{csv,md}`` into
``bench/results/`` or ``bench/results/quick/``).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np

from _common import ROOT, load_note, markdown_table, read_csv, run_alone, write_csv
from engine_dispatch import SYNTHETIC_DEPLOYMENTS, trace_scenarios

import eplb
from eplb.simulation.series import mixture_path, synthetic_workloads

RESULTS = Path(__file__).resolve().parent / "results"
DEEPSEEK = dict(num_layers=58, num_experts=256, num_groups=8, top_k=8, tokens=65536)
SHIFT = 0.25  # each workload moves every expert's log-popularity by N(0, (0.25 * 0.7)^2)
COLUMNS = ("even plan / static", "made for static / static", "even plan / even split",
           "hedged plan / static", "made for static (hedged) / static", "hedged plan / even split",
           "even plan / dynamic", "made for dynamic / dynamic")
HEDGED = "expected_peak_search"  # the hedged objective for an even split (eplb.planning.objectives)


def sampled(probabilities: np.ndarray, tokens: int, top_k: int, rng) -> np.ndarray:
    """``[K, L, E]`` probabilities -> counts: ``tokens * top_k`` routings per workload and layer."""
    out = np.zeros(probabilities.shape)
    for k, workload in enumerate(probabilities):
        for layer, row in enumerate(workload):
            if row.sum() > 0:
                out[k, layer] = rng.multinomial(tokens * top_k, row / row.sum())
    return out


def synthetic_series(shape: dict, windows: int, seed: int = 1):
    """``(label, counts [T, L, E])`` of the two synthetic families for a model ``shape``."""
    rng = np.random.default_rng(seed)
    args = (shape["num_layers"], shape["num_experts"])
    workloads = synthetic_workloads(windows, *args, shift=SHIFT, num_groups=shape["num_groups"], seed=seed)
    out = [(f"workloads (shift {SHIFT})", sampled(workloads, shape["tokens"], shape["top_k"], rng))]
    base = synthetic_workloads(6, *args, shift=SHIFT, num_groups=shape["num_groups"], seed=seed + 1)
    steps = 64 * windows
    path = mixture_path(steps, 6, transition=0.5, background=0.1)  # [steps, 6]
    per_window = path.reshape(windows, 64, 6).mean(axis=1)  # [T, 6]
    out.append(("mixture path (6 workloads)",
                sampled(np.tensordot(per_window, base, axes=1), shape["tokens"], shape["top_k"], rng)))
    return out


def scenarios(quick: bool, shape: dict | None = None, traces: bool = True):
    """``(series label, counts [T, L, E], {deployment: config})`` and notes on absent traces."""
    shape = dict(DEEPSEEK, **(shape or {}))
    deployments = shape.pop("deployments", SYNTHETIC_DEPLOYMENTS)
    windows = 6 if quick else 12
    out = [(label, counts, deployments) for label, counts in synthetic_series(shape, windows)]
    missing = []
    if traces:
        found, missing = trace_scenarios()
        out += found
    return out, missing


def evaluate(series: np.ndarray, config: dict, quick: bool) -> tuple[dict, list]:
    """Leave one window out: ``{column: [F] held-out balancedness}`` and the engine planning times [F] (s)."""
    scores = {c: [] for c in COLUMNS}
    times = []
    held_out = range(series.shape[0]) if not quick else range(min(3, series.shape[0]))
    for t in held_out:
        train, window = np.delete(series, t, axis=0), series[t]
        even = eplb.plan(train, **config)
        made = eplb.plan(train, dispatch="sglang-static", **config)
        hedged = eplb.plan(train, objective=HEDGED, **config)
        made_hedged = eplb.plan(train, dispatch="sglang-static", objective=HEDGED, **config)
        dynamic = eplb.plan(train, dispatch="sglang-dynamic", **config)
        times.append(made.info["engine_planning_time_s"])
        scores["even plan / static"].append(even.balancedness(window, "sglang-static").mean())
        scores["made for static / static"].append(made.balancedness(window, "sglang-static").mean())
        scores["even plan / even split"].append(even.balancedness(window, "uniform").mean())
        scores["hedged plan / static"].append(hedged.balancedness(window, "sglang-static").mean())
        scores["made for static (hedged) / static"].append(made_hedged.balancedness(window, "sglang-static").mean())
        scores["hedged plan / even split"].append(hedged.balancedness(window, "uniform").mean())
        scores["even plan / dynamic"].append(even.balancedness(window, "sglang-dynamic").mean())
        scores["made for dynamic / dynamic"].append(dynamic.balancedness(window, "sglang-dynamic").mean())
    return {c: np.array(v) for c, v in scores.items()}, times


def git_commit() -> str:
    """The commit of the worktree the bench ran from (``+`` when it had changes), or ``unknown``."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(quick: bool = False, results_dir: Path = RESULTS, *, shape: dict | None = None, traces: bool = True) -> str:
    """Evaluate every scenario and write ``engine_planning.{csv,md}`` into ``results_dir``.

    ``shape``: override the synthetic model (``num_layers``, ``num_experts``, ``num_groups``,
    ``top_k``, ``tokens``, ``deployments``), e.g. a tiny one for the tests; ``traces``: include the real traces.
    """
    started = time.perf_counter()
    rows = []
    cases, missing = scenarios(quick, shape, traces)
    for label, series, deployments in cases:
        for deployment, config in deployments.items():
            scores, times = evaluate(series, config, quick)
            row = {"series": label, "deployment": deployment, "folds": len(times),
                   "engine_planning_ms_median": round(1000 * float(np.median(times)), 1)}
            for column in COLUMNS:
                row[f"{column} mean"] = round(float(scores[column].mean()), 4)
                row[f"{column} worst"] = round(float(scores[column].min()), 4)
            rows.append(row)
            print(f"[engine_planning] {label} | {deployment}: {time.perf_counter() - started:.0f} s", flush=True)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "engine_planning.csv", rows)
    text = markdown(rows, missing, quick, time.perf_counter() - started)
    (results_dir / "engine_planning.md").write_text(text + "\n")
    return text


def markdown(rows, missing, quick: bool, seconds: float) -> str:
    lines = [
        "## Engine planning: plans made for SGLang's dispatch, held out",
        "",
        f"`python bench/engine_planning.py{' --quick' if quick else ''}` at commit {git_commit()} "
        f"({seconds:.0f} s; {load_note()}). Leave one window out: plan on the other windows, judge on the "
        "one left out; cells are mean / worst over the held-out windows of the balancedness (mean over layers "
        "of mean / max GPU load). *even plan*: `eplb.plan(train)`; *made for static*: "
        "`eplb.plan(train, dispatch=\"sglang-static\")`, judged under SGLang's static table (exact); "
        "*even plan / even split*: the reference level (vLLM, TensorRT-LLM); *hedged*: the same from "
        f"`objective=\"{HEDGED}\"` (the plan over the windows, for an even split). Dynamic: SGLang `dynamic` with "
        "an all-to-all backend (its expectation). Time: the engine planning step alone (median over folds; "
        "the even-split plan it starts from not included).",
    ]
    for note in missing:
        lines += ["", f"- {note}"]
    table = [[r["series"], r["deployment"], r["folds"]]
             + [f"{float(r[c + ' mean']):.4f} / {float(r[c + ' worst']):.4f}" for c in COLUMNS]
             + [r["engine_planning_ms_median"]] for r in rows]
    lines += ["", markdown_table(["series", "deployment", "folds"] + list(COLUMNS) + ["time (ms)"], table)]
    return "\n".join(lines)


def headline(results_dir: Path):
    """The plan made for SGLang static against the even-split plan under it, DeepSeek-V3-sized workloads."""
    path = Path(results_dir) / "engine_planning.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        if not r["series"].startswith("workloads"):
            continue
        out.append((f"Plan made for SGLang static, judged under it held out, {r['series']}, {r['deployment']} (mean)",
                    f"{float(r['made for static / static mean']):.3f} (even-split plan under static "
                    f"{float(r['even plan / static mean']):.3f}; under an even split "
                    f"{float(r['even plan / even split mean']):.3f})", "reported"))
    return out


if __name__ == "__main__":
    run_alone(run, __doc__)
