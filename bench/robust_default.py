"""Robust by default: what the default plan of a series serves on windows it has not seen.

``eplb.plan(series)`` plans a series ``[T, L, E]`` hedged over its windows (the default objective
for an even split, ``expected_peak_search``); ``objective="sum"`` plans on the summed windows, as
engines do. Every figure is held out (ARCHITECTURE section 8):

- ``leave-one-out``: the windows are workloads; each is served by the plan made from the others
  (:func:`eplb.held_out`);
- ``next-window``: plan on the first 16 windows, serve the next 8.

Families (balancedness = mean over MoE layers of mean / max GPU load; cells mean / worst window):

- real traces (``../shared/data/traces``; skipped with a note when absent): gpt-oss-20b grouped
  by benchmark and by subject category, OLMoE and Mixtral text domains (leave-one-out), and windows
  mixing the gpt-oss benchmarks over time (:func:`eplb.simulation.series.mixture_windows`, next-window);
- DeepSeek-V3-sized synthetic workloads whose windows differ by *structured* shifts, as real
  traffic does: 12 workloads, each a mixture of 4 latent routing distributions (plus a little
  noise of its own), 6 "prefill" and 6 "decode" ones (the decode ones moved by one phase-wide
  shift), held out one at a time within a phase (``same phase``) or among all 12 (``phases
  mixed``); windows mixing 6 workloads (next-window);
- the hard case: windows that differ only by independent noise around one popularity
  (``sigma`` per expert) and by drift; here no fixed placement beats the summed plan by much, and
  the default must not lose more than 0.002 to it (its cross-validation keeps the summed plan
  per layer where the search does not pay).

``shift structure`` (:func:`eplb.simulation.series.shift_structure`, 11 windows each) says how structured a
family's differences between windows are: real traces and mixtures near 0.8-0.95, noise lower.

Speed: the default plan and the summed plan of 16 windows at DeepSeek-V3 size (58 x 256, 288
slots, 32 GPUs), global and hierarchical (4 nodes, 8 groups), medians side by side in one run
(targets: at most 100 ms and 12x the summed plan).

The hedge decision (``--decision-only`` runs just this and the speed): independent noise, the
hard case (i.i.d. Poisson windows at rates 1-5000, multinomial batches of 100-5000 tokens, 3-12
windows, 16-256 experts; target: never more than 0.002 below ``objective="sum"`` held out), and
3 or 4 real-trace windows that differ by workload (the default must keep its gain). Per family,
held out, the mean and worst of default minus summed and how many series fall below -0.002.
``python bench/robust_default.py [--quick] [--decision-only]``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
from _common import group_windows, load_note, load_trace, markdown_table, median_time, trace_workloads, write_csv

import eplb
from eplb.simulation.series import mixture_windows, shift_structure, synthetic_workloads
from eplb.analysis.metrics import moe_mean
from eplb.simulation.synthetic import drifting_counts

RESULTS = Path(__file__).resolve().parent / "results"
DEEPSEEK = dict(num_layers=58, num_experts=256, num_groups=8)
DEPLOYMENTS = {
    "global 288/32": dict(num_slots=288, num_gpus=32),
    "global 320/32": dict(num_slots=320, num_gpus=32),
    "hierarchical 288/32/4": dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),
}
TOKENS = 4096 * 8 * 16  # routings per layer in one window (16 passes of 4096 tokens, top-8)
PLANS = {  # label -> plan options (the series given as windows)
    "published greedy, summed": dict(method="greedy", objective="sum"),
    "eplb, summed": dict(objective="sum"),
    "eplb default": {},
}


def _score(placement, windows: np.ndarray, judge: str = "uniform") -> np.ndarray:
    """``[T]`` mean over MoE layers of each window's balancedness."""
    return moe_mean(placement.balancedness(windows, judge), windows)


def phase_workloads(seed: int, num_layers: int, num_experts: int, num_groups: int | None):
    """``[12, L, E]``: 6 prefill workloads and 6 decode ones. A workload (a task, a request mix) is
    a mixture of 4 latent routing distributions with weights from a Dirichlet(0.5), each expert
    then moved by ``exp(N(0, 0.1))`` of its own; the decode workloads are the prefill ones moved by
    one shift common to the phase, as decode traffic differs from prefill traffic."""
    latent = synthetic_workloads(4, num_layers, num_experts, shift=0.5, num_groups=num_groups, seed=seed)
    rng = np.random.default_rng(seed + 1000)
    prefill = np.tensordot(rng.dirichlet(np.full(4, 0.5), size=6), latent, axes=1)
    prefill *= np.exp(rng.normal(0.0, 0.1, size=prefill.shape))
    decode = prefill * np.exp(rng.normal(0.0, 0.35, size=prefill.shape[1:]))[None]
    both = np.concatenate([prefill, decode])
    return both / both.sum(axis=2, keepdims=True)


def _sampled(workloads: np.ndarray, seed: int, tokens: int = TOKENS) -> np.ndarray:
    """One window per workload: ``tokens`` routings per layer drawn from it."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.multinomial(tokens, row / row.sum()) if row.sum() > 0 else np.zeros_like(row)
                      for row in w] for w in workloads]).astype(np.float64)


def _independent(num_windows: int, sigma: float, seed: int, num_layers: int, num_experts: int, num_groups):
    """Windows around one popularity, each expert moved by ``exp(N(0, sigma))`` independently."""
    base = synthetic_workloads(1, num_layers, num_experts, shift=0.0, num_groups=num_groups, seed=seed)[0]
    rng = np.random.default_rng(seed + 1)
    moved = base[None] * np.exp(rng.normal(0.0, sigma, size=(num_windows,) + base.shape))
    return _sampled(moved / moved.sum(axis=2, keepdims=True), seed + 2)


def families(quick: bool):
    """``(name, protocol, windows [T, L, E], deployments)`` of every family, real traces first,
    and notes on absent traces."""
    size = dict(num_layers=8, num_experts=64, num_groups=8) if quick else DEEPSEEK
    deployments = ({"global 80/8": dict(num_slots=80, num_gpus=8),
                    "hierarchical 80/8/4": dict(num_slots=80, num_gpus=8, num_nodes=4, num_groups=8)}
                   if quick else DEPLOYMENTS)
    out = []
    real, missing = trace_workloads()
    for key, names, counts, deployment in real:
        out.append((f"{key} ({len(names)} workloads)", "leave-one-out", counts, {key: deployment}))
    gpt = load_trace("gpt_oss_20b_benchmark_windows.npz")
    if gpt is not None:
        labels = np.asarray([str(c) for c in gpt["category"]])
        subjects = sorted(set(labels.tolist()))
        by_subject = np.stack([gpt["counts"][labels == s].sum(axis=0) for s in subjects])
        deployment = {"gpt-oss-20b 40/8": dict(num_slots=40, num_gpus=8)}
        out.append((f"gpt-oss-20b by subject ({len(subjects)} workloads)", "leave-one-out", by_subject, deployment))
        benchmarks = next(c for k, _, c, _ in real if k == "gpt-oss-20b")
        mixed = mixture_windows(benchmarks, 24, concentration=0.3, tokens=200_000, seed=3).astype(np.float64)
        out.append(("gpt-oss-20b benchmarks mixed over time", "next-window", mixed, deployment))
    phases = _sampled(phase_workloads(1, **size), seed=2)
    out.append(("synthetic, same phase (6 workloads)", "leave-one-out", phases[:6], deployments))
    out.append(("synthetic, phases mixed (12 workloads)", "leave-one-out", phases, deployments))
    mixing = synthetic_workloads(6, size["num_layers"], size["num_experts"], shift=0.5, num_groups=8, seed=4)
    out.append(("synthetic, 6 workloads mixed over time", "next-window",
                mixture_windows(mixing, 24, concentration=0.3, tokens=TOKENS, seed=5).astype(np.float64), deployments))
    for sigma in (0.1, 0.2):
        out.append((f"synthetic, independent noise sigma={sigma}", "leave-one-out",
                    _independent(12, sigma, 6, **size), deployments))
    drift = drifting_counts(24, size["num_layers"], size["num_experts"], drift=0.2, tokens=TOKENS // 8, top_k=8,
                            num_groups=8, seed=7).astype(np.float64)
    out.append(("synthetic, drift 0.2", "next-window", drift, deployments))
    return out, missing


def poisson_windows(rng, num_windows, num_layers, num_experts, rate):
    """``[T, L, E]`` i.i.d. Poisson windows around one popularity (mean ``rate`` tokens per expert)."""
    popularity = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers) * num_experts
    return rng.poisson(rate * popularity[None], size=(num_windows, num_layers, num_experts)).astype(np.float64)


def multinomial_windows(rng, num_windows, num_layers, num_experts, tokens):
    """``[T, L, E]`` i.i.d. batches of ``tokens`` routings from one popularity."""
    popularity = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)
    return np.stack([[rng.multinomial(tokens, p) for p in popularity] for _ in range(num_windows)]).astype(np.float64)


NOISE_LEVELS = [("Poisson", rate) for rate in (1, 2, 5, 20, 200, 5000)] + [
    ("multinomial", tokens) for tokens in (100, 300, 1000, 5000)]


def noise_families(samples: int):
    """``{family: [(windows [T, L, E], deployment), ...]}``: independent noise, ``samples`` series per
    level (3-12 windows, 16-256 experts, 1-3 layers, 2-8 GPUs with 1-2 redundant slots each)."""
    out = {}
    for index, (kind, level) in enumerate(NOISE_LEVELS):
        rows = []
        for i in range(samples):
            rng = np.random.default_rng(10_000 * index + i)
            num_experts = int(rng.choice([16, 32, 64, 128, 256]))
            num_gpus = int(rng.choice([2, 4, 8]))
            shape = (int(rng.integers(3, 13)), int(rng.integers(1, 4)), num_experts)
            make = poisson_windows if kind == "Poisson" else multinomial_windows
            rows.append((make(rng, *shape, level), dict(num_slots=num_experts + num_gpus * int(rng.integers(1, 3)),
                                                         num_gpus=num_gpus)))
        out[f"{kind} {level}"] = rows
    return out


def few_window_families():
    """``{family: [(windows [T, L, E], deployment), ...]}``: 3 or 4 windows of the real traces that
    differ by workload (OLMoE and Mixtral text domains, gpt-oss-20b benchmarks, its think and answer
    phases of two benchmarks, four subject categories), and a note per absent trace."""
    out = {}
    real, missing = trace_workloads()
    for key, _, counts, deployment in real:
        deployment = {k: v for k, v in deployment.items() if v is not None}
        for size in (3, 4):
            starts = range(0, counts.shape[0] - size + 1, max(1, (counts.shape[0] - size) // 2))
            out[f"{key}, {size} workloads"] = [(counts[a:a + size], deployment) for a in starts]
    gpt = load_trace("gpt_oss_20b_benchmark_windows.npz")
    if gpt is not None:
        deployment = dict(num_slots=40, num_gpus=8)
        names, think = group_windows(gpt["counts_think"].astype(np.float64), gpt["benchmark"])
        _, answer = group_windows(gpt["counts_answer"].astype(np.float64), gpt["benchmark"])
        out["gpt-oss-20b, think and answer of 2 benchmarks"] = [
            (np.stack([think[a], answer[a], think[b], answer[b]]), deployment) for a, b in ((0, 4), (1, 9), (5, 10))]
        labels = np.asarray([str(c) for c in gpt["category"]])
        subjects = sorted(set(labels.tolist()))
        rng = np.random.default_rng(0)
        picks = [rng.choice(len(subjects), 4, replace=False) for _ in range(4)]
        out["gpt-oss-20b, 4 subject categories"] = [
            (np.stack([gpt["counts"][labels == subjects[p]].sum(axis=0) for p in pick]), deployment) for pick in picks]
    return out, missing


def decision(quick: bool) -> list[dict]:
    """Per family of noise and of few real windows: held out (leave one window out), the default
    minus ``objective="sum"`` over its series: mean, worst, and how many series fall more than
    0.002 below."""
    families = {**noise_families(2 if quick else 6), **few_window_families()[0]}
    rows = []
    for name, cases in families.items():
        gaps = np.array([eplb.held_out(w, folds=w.shape[0], **d).mean()
                         - eplb.held_out(w, folds=w.shape[0], objective="sum", **d).mean() for w, d in cases])
        rows.append({"family": name, "kind": "noise" if name.split()[0] in ("Poisson", "multinomial") else "real",
                     "series": len(cases), "mean default - sum": float(gaps.mean()),
                     "worst default - sum": float(gaps.min()), "below -0.002": int((gaps < -0.002).sum())})
        print(f"[robust_default] decision {name}: {rows[-1]}", flush=True)
    return rows


def held_out(windows: np.ndarray, protocol: str, deployment: dict, options: dict, judge: str = "uniform"):
    """``[F]`` held-out balancedness of the plans made with ``options``."""
    if protocol == "leave-one-out":
        return eplb.held_out(windows, folds=windows.shape[0], judge=judge, **deployment, **options)
    placement = eplb.plan(windows[:16], **deployment, **options)
    return _score(placement, windows[16:], judge)


def in_sample(windows: np.ndarray, protocol: str, deployment: dict, options: dict, judge: str = "uniform") -> float:
    """Mean balancedness of the plan made with ``options`` on the windows it was made from (all of
    them for leave-one-out, the first 16 for next-window)."""
    planning = windows if protocol == "leave-one-out" else windows[:16]
    return float(_score(eplb.plan(planning, **deployment, **options), planning, judge).mean())


def quality(quick: bool) -> tuple[list[dict], list[str]]:
    rows = []
    found, missing = families(quick)
    for name, protocol, windows, deployments in found:
        structure = shift_structure(windows[:11])
        for label, deployment in deployments.items():
            row = {"family": name, "protocol": protocol, "deployment": label, "shift_structure": structure}
            for plan_label, options in PLANS.items():
                scores = held_out(windows, protocol, deployment, options)
                row[plan_label] = (float(scores.mean()), float(scores.min()))
                row[f"{plan_label} in sample"] = in_sample(windows, protocol, deployment, options)
            if not quick and (name.startswith("synthetic, same") or name.startswith("synthetic, phases")
                              or not name.startswith("synthetic")) and "hierarchical" not in label:
                scores = held_out(windows, protocol, deployment, {"dispatch": "optimal"}, judge="optimal")
                row["made for optimal dispatch"] = (float(scores.mean()), float(scores.min()))
                row["made for optimal dispatch in sample"] = in_sample(windows, protocol, deployment,
                                                                       {"dispatch": "optimal"}, "optimal")
            rows.append(row)
            print(f"[robust_default] {name} / {label}: "
                  + ", ".join(f"{k} {v[0]:.4f}" for k, v in row.items() if isinstance(v, tuple)), flush=True)
    return rows, missing


def speed(quick: bool) -> list[dict]:
    """Median plan times of 16 windows, default vs summed, side by side."""
    size = dict(num_layers=8, num_experts=64) if quick else dict(num_layers=58, num_experts=256)
    workloads = synthetic_workloads(6, size["num_layers"], size["num_experts"], shift=0.5, num_groups=8, seed=8)
    windows = mixture_windows(workloads, 16, concentration=0.3, tokens=TOKENS, seed=9).astype(np.float64)
    deployments = ({"global 80/8": dict(num_slots=80, num_gpus=8)} if quick else
                   {k: v for k, v in DEPLOYMENTS.items() if k != "global 320/32"})
    rows = []
    for label, deployment in deployments.items():
        timings = {}
        for plan_label, options in (("summed", {"objective": "sum"}), ("default (hedged)", {}),
                                    ("made for optimal dispatch", {"dispatch": "optimal"})):
            repeats = 3 if options.get("dispatch") else 9
            timings[plan_label] = median_time(lambda: eplb.plan(windows, **deployment, **options), repeats=repeats,
                                              budget_s=30.0)
        rows.append({"deployment": label, **{f"{k} wall ms": v.wall * 1e3 for k, v in timings.items()},
                     **{f"{k} cpu ms": v.cpu * 1e3 for k, v in timings.items()},
                     "default / summed (cpu)": timings["default (hedged)"].cpu / timings["summed"].cpu})
    return rows


def _cell(value) -> str:
    return "–" if value is None else f"{value[0]:.4f} / {value[1]:.4f}"


def markdown(rows: list[dict], speeds: list[dict], missing: list[str], seconds: float) -> str:
    lines = ["## Robust by default: the default plan of a series, held out", "",
             f"`python bench/robust_default.py` ({seconds:.0f} s; {load_note()}). Cells: mean / worst held-out "
             "window of the MoE-layer balancedness under an even split (what vLLM and TensorRT-LLM do); "
             "`made for optimal dispatch` is served with optimal dispatch. `default - summed`: the default "
             "minus eplb's summed plan, mean over held-out windows (the target: never below -0.002).", ""]
    lines += [f"- {note}" for note in missing]
    header = ["family", "protocol", "deployment", "shift structure", *PLANS, "default - summed",
              "made for optimal dispatch"]
    table = []
    for r in rows:
        gain = r["eplb default"][0] - r["eplb, summed"][0]
        table.append([r["family"], r["protocol"], r["deployment"], f"{r['shift_structure']:.2f}",
                      *(_cell(r[p]) for p in PLANS), f"{gain:+.4f}", _cell(r.get("made for optimal dispatch"))])
    lines += ["", markdown_table(header, table), "", "### In sample beside held out",
              "", "Mean balancedness on the windows each plan was made from (in sample) and on the windows it "
              "did not see (held out, the table above).", ""]
    in_header = ["family", "deployment"] + [f"{p}: in sample / held out" for p in (*PLANS, "made for optimal dispatch")]
    in_rows = [[r["family"], r["deployment"]]
               + [f"{r[f'{p} in sample']:.4f} / {r[p][0]:.4f}" if f"{p} in sample" in r else "–"
                  for p in (*PLANS, "made for optimal dispatch")] for r in rows]
    lines += [markdown_table(in_header, in_rows), "", "### Speed: 16 windows, medians side by side", ""]
    speed_header = list(speeds[0]) if speeds else []
    lines.append(markdown_table(speed_header, [[f"{v:.1f}" if isinstance(v, float) else v for v in r.values()]
                                               for r in speeds]))
    worst = min((r["eplb default"][0] - r["eplb, summed"][0] for r in rows), default=float("nan"))
    lines += ["", f"Smallest gain of the default over the summed plan, held out, over every row: {worst:+.4f}."]
    return "\n".join(lines)


def decision_markdown(rows: list[dict]) -> str:
    """The hedge decision's table: per family, held out, the default minus the summed plan."""
    header = ["family", "kind", "series", "mean default - sum", "worst default - sum", "series below -0.002"]
    table = [[r["family"], r["kind"], r["series"], f"{r['mean default - sum']:+.4f}", f"{r['worst default - sum']:+.4f}",
              r["below -0.002"]] for r in rows]
    noise = [r for r in rows if r["kind"] == "noise"]
    failing = sum(r["below -0.002"] for r in noise)
    return "\n".join(["### The hedge decision: independent noise and few windows", "",
                      "Leave one window out (eplb.held_out with each method); noise families: i.i.d. windows, 3-12 "
                      "windows, 16-256 experts, 1-3 layers; real families: 3 or 4 windows that differ by workload "
                      "(each planned from the other 2 or 3).", "", markdown_table(header, table), "",
                      f"Noise series more than 0.002 below the summed plan: {failing} of "
                      f"{sum(r['series'] for r in noise)}."])


def run(quick: bool, results_dir: Path) -> str:
    start = time.perf_counter()
    rows, missing = quality(quick)
    decisions = decision(quick)
    speeds = speed(quick)
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "robust_default_decision.csv", decisions)
    flat = [{k: (f"{v[0]:.4f}/{v[1]:.4f}" if isinstance(v, tuple) else v) for k, v in r.items()} for r in rows]
    write_csv(results_dir / "robust_default.csv", flat)
    write_csv(results_dir / "robust_default_speed.csv", speeds)
    text = markdown(rows, speeds, missing, time.perf_counter() - start) + "\n\n" + decision_markdown(decisions)
    (results_dir / "robust_default.md").write_text(text + "\n")
    return text


def headline(results_dir: Path):
    """Headline rows: the default against the summed plan, held out, and the plan time."""
    import csv

    with open(results_dir / "robust_default.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for r in rows:
        if r["deployment"] == "global 288/32" and r["family"].startswith("synthetic, phases mixed"):
            yield ("Series, held out (phases mixed, global 288/32): default vs summed",
                   f"{r['eplb default']} vs {r['eplb, summed']}")
        if r["family"].startswith("gpt-oss-20b (") :
            yield ("gpt-oss-20b workloads, held out: default vs summed", f"{r['eplb default']} vs {r['eplb, summed']}")
    with open(results_dir / "robust_default_speed.csv", newline="") as handle:
        for r in csv.DictReader(handle):
            yield (f"Default plan of 16 windows, {r['deployment']} (CPU ms; summed)",
                   f"{float(r['default (hedged) cpu ms']):.0f} ms; {float(r['summed cpu ms']):.0f} ms")


def readme_rows(results_dir: Path) -> list[tuple[str, str, str]]:
    """The README's rows: traffic a plan has not seen (leave one workload out, even split), eplb's
    default plan of the other workloads as a series beside the published greedy's plan of their sum,
    on the real traces and the DeepSeek-V3-sized mixed phases."""
    path = Path(results_dir) / "robust_default.csv"
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    wanted = {"gpt-oss-20b (11 workloads)": "gpt-oss-20b, 11 benchmarks", "olmoe-1b-7b (6 workloads)": "OLMoE, 6 domains",
              "synthetic, phases mixed (12 workloads)": "DeepSeek-V3-sized, 12 prefill and decode workloads, 288/32"}
    cells = [(label, r) for r in rows for family, label in wanted.items()
             if r["family"] == family and (r["deployment"] == "global 288/32" or not family.startswith("synthetic"))]
    if not cells:
        return []

    def mean_of(cell: str) -> str:
        return cell.split("/")[0]

    return [("Balancedness on a workload the plan has not seen (leave one out, even split; mean held-out window)",
             "default `eplb.plan(series)`: " + "; ".join(f"{label} {mean_of(r['eplb default'])}" for label, r in cells),
             "the published greedy on the summed windows: "
             + "; ".join(f"{label} {mean_of(r['published greedy, summed'])}" for label, r in cells))]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--speed-only", action="store_true",
                        help="only the plan times (written to robust_default_speed.csv; about a minute)")
    parser.add_argument("--decision-only", action="store_true",
                        help="only the hedge decision's families and the plan times (robust_default_decision.md)")
    args = parser.parse_args()
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    if args.decision_only:
        started = time.perf_counter()
        decisions, speeds = decision(args.quick), speed(args.quick)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "robust_default_decision.csv", decisions)
        write_csv(out / "robust_default_speed.csv", speeds)
        text = (decision_markdown(decisions) + "\n\n### Speed: 16 windows, medians side by side\n\n"
                + markdown_table(list(speeds[0]), [[f"{v:.1f}" if isinstance(v, float) else v for v in r.values()]
                                                    for r in speeds])
                + f"\n\n`python bench/robust_default.py --decision-only` ({time.perf_counter() - started:.0f} s; "
                f"{load_note()}).")
        (out / "robust_default_decision.md").write_text(text + "\n")
        print(text)
    elif args.speed_only:
        speeds = speed(args.quick)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "robust_default_speed.csv", speeds)
        print(f"{load_note()}\n" + markdown_table(list(speeds[0]), [[f"{v:.1f}" if isinstance(v, float) else v
                                                                     for v in r.values()] for r in speeds]))
    else:
        print(run(args.quick, out))
