"""Serving: migration-aware rebalancing and the online balancer in a simulated serving loop.

Two parts, measured side by side in one run:

1. **Rebalancing drifting loads.** Sequences of windows whose load drifts: synthetic
   (``eplb.simulation.synthetic.drifting_counts``, DeepSeek-V3 size, hierarchical and global) and built from
   the real traces (gpt-oss-20b: a sum over 40 recorded windows sliding by 5; OLMoE and Mixtral:
   the mixture moving from one text domain to the next in steps of 20%). For every window after the
   first: the slots changed from the previous placement and the max GPU load relative to planning
   from scratch with the default method, for eplb's migration-aware planning
   (``plan(previous=...)``, tolerance 0.5%), the default method from scratch and the published
   greedy from scratch. Targets: <= 20% of slots per rebalance, max load within 0.5%.
2. **Serving loop.** A DeepSeek-V3-sized model (58 x 256 -> 288 slots, 32 GPUs, 4 nodes, 8 groups)
   serves a load that drifts a little every forward pass; ``eplb.Balancer`` records every pass,
   is asked ``should_rebalance()`` every few passes and rebalances when the gain pays for the copies.
   Reported: balancedness over time (vs. never rebalancing and vs. a fresh plan from scratch at every
   check), slots changed and weight copies per rebalance, planning time per rebalance (target
   < 10 ms).

Run: ``python bench/serving.py [--quick]`` (results in ``bench/results/``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from _common import load_note, load_trace, markdown_table, median_time, pyplot, read_csv, run_alone, write_csv

import eplb
from eplb.analysis.metrics import balancedness
from eplb.simulation.synthetic import DEEPSEEK_V3, drifting_counts

DS = dict(num_slots=DEEPSEEK_V3["num_slots"], num_gpus=DEEPSEEK_V3["num_gpus"], num_nodes=DEEPSEEK_V3["num_nodes"])
EXPERT_BYTES = 3 * 7168 * 2048  # one DeepSeek-V3 routed expert (gate, up, down) in FP8
TOLERANCE = 0.005


# ------------------------------------------------------------------------------ drifting sequences

def sequences(quick: bool) -> tuple[list[tuple[str, np.ndarray, dict]], list[str]]:
    """``(name, series [T, L, E], deployment)`` of drifting loads, and notes on absent traces."""
    windows = 4 if quick else 8
    out, notes = [], []
    synthetic = drifting_counts(windows, 58, 256, num_groups=8, drift=0.05, tokens=16384, seed=1)
    out.append(("synthetic drift, DeepSeek-V3 size, hierarchical", synthetic, dict(DS, num_groups=8)))
    out.append(("synthetic drift, DeepSeek-V3 size, global", synthetic, dict(DS, num_groups=None)))
    gpt = load_trace("gpt_oss_20b_benchmark_windows.npz")
    if gpt is None:
        notes.append("gpt_oss_20b_benchmark_windows.npz absent: skipped")
    else:
        counts = gpt["counts"]
        series = np.stack([counts[t:t + 40].sum(axis=0) for t in range(0, 5 * windows, 5)])
        out.append(("gpt-oss-20b, 40 windows sliding by 5, 40 slots / 8 GPUs", series,
                    dict(num_slots=40, num_gpus=8, num_nodes=2)))
        out.append(("gpt-oss-20b, 40 windows sliding by 5, 64 slots / 8 GPUs", series,
                    dict(num_slots=64, num_gpus=8, num_nodes=2)))
    for file, label, deployment in (
        ("olmoe_1b7b_domains_layers0-7-15.npz", "OLMoE-1B-7B, domain mixture in 20% steps, 80 slots / 8 GPUs",
         dict(num_slots=80, num_gpus=8, num_nodes=2)),
        ("mixtral_8x7b_domains_layers0-7-15.npz", "Mixtral-8x7B, domain mixture in 20% steps, 12 slots / 4 GPUs",
         dict(num_slots=12, num_gpus=4, num_nodes=1)),
    ):
        data = load_trace(file)
        if data is None:
            notes.append(f"{file} absent: skipped")
            continue
        counts = data["counts"]
        steps = []
        for i in range(min(len(counts) - 1, 2 if quick else len(counts) - 1)):
            for a in np.linspace(0, 1, 6)[:-1]:
                steps.append((1 - a) * counts[i] + a * counts[i + 1])
        out.append((label, np.stack(steps), deployment))
    return out, notes


def drift_rows(name: str, series: np.ndarray, deployment: dict) -> list[dict]:
    """One row per (sequence, strategy): mean/max slots changed per rebalance, max-load ratio to the
    default method from scratch, median planning time."""
    strategies = {"eplb migration-aware": [], f"{eplb.DEFAULT_METHOD} from scratch": [], "greedy from scratch": []}
    times = {k: [] for k in strategies}
    current = {k: eplb.plan(series[0], **deployment) for k in strategies}
    current["greedy from scratch"] = eplb.plan(series[0], method="greedy", **deployment)
    for t in range(1, len(series)):
        reference = eplb.plan(series[t], **deployment)
        live = reference.max_load > 0
        for key in strategies:
            if key == "eplb migration-aware":
                new = eplb.plan(series[t], previous=current[key], tolerance=TOLERANCE, **deployment)
            elif key == "greedy from scratch":
                new = eplb.plan(series[t], method="greedy", **deployment)
            else:
                new = reference
            times[key].append(new.info["time_s"])  # the method (+ migration), without the bounds
            changed = (new.phy2log != current[key].phy2log).mean()
            ratio = (new.max_load[live] / reference.max_load[live]).max() if live.any() else 1.0
            strategies[key].append((changed, ratio))
            current[key] = new
    rows = []
    for key, values in strategies.items():
        changed = np.array([v[0] for v in values])
        ratio = np.array([v[1] for v in values])
        rows.append({
            "sequence": name, "strategy": key, "rebalances": len(values),
            "mean_slots_changed": round(float(changed.mean()), 4), "max_slots_changed": round(float(changed.max()), 4),
            "worst_max_load_ratio": round(float(ratio.max()), 5), "mean_max_load_ratio": round(float(ratio.mean()), 5),
            "median_plan_ms": round(1e3 * statistics.median(times[key]), 2),
        })
    return rows


# ------------------------------------------------------------------------------ serving loop

def serving_loop(quick: bool, method: str) -> tuple[list[dict], list[dict]]:
    """Simulate serving: per-pass balancedness rows and per-rebalance rows."""
    steps = 150 if quick else 600
    every, window = 25, 100
    passes = drifting_counts(steps, 58, 256, num_groups=8, drift=0.02, tokens=4096, seed=7)
    balancer = eplb.Balancer(58, eplb.Deployment.of(256, **DS, num_groups=8), window=window, method=method,
                             min_gain=0.005, move_cost=0.05, expert_bytes=EXPERT_BYTES)
    start_layout = balancer.placement
    fresh = None
    per_pass, per_rebalance = [], []
    for t in range(steps):
        counts = passes[t]
        balancer.record(counts)
        per_pass.append({
            "method": method, "step": t,
            "balancer": float(balancedness(balancer.placement.gpu_loads(counts)).mean()),
            "never_rebalance": float(balancedness(start_layout.gpu_loads(counts)).mean()),
            "fresh_every_check": float(balancedness(fresh.gpu_loads(counts)).mean()) if fresh is not None else np.nan,
        })
        if t % every == every - 1:
            fresh = eplb.plan(balancer.window_counts(), **DS, num_groups=8, method=method)
            if balancer.should_rebalance():
                placement, transfer = balancer.rebalance()
                record = balancer.history[-1]
                copies = transfer.counts()
                per_rebalance.append({
                    "method": method, "step": t + 1, "slots_changed": record["slots_changed"],
                    "moved_fraction": round(record["moved_fraction"], 4),
                    "plan_ms": round(1e3 * record["plan_time_s"], 2),
                    "intra_gpu": copies["intra_gpu"], "intra_node": copies["intra_node"],
                    "cross_node": copies["cross_node"],
                    "gib_moved": round(transfer.bytes()["total"] / 2**30, 2),
                    "gain": round(balancer.last_decision.get("gain", np.nan), 4),
                })
    return per_pass, per_rebalance


def plan_time_split(method: str, repeats: int) -> dict:
    """Median time of the method from scratch alone and of the whole migration-aware plan, on two
    consecutive windows of a drifting DeepSeek-V3-sized load."""
    from eplb.planning.api import make_deployment
    from eplb.planning.methods import get_method
    from eplb.planning.migration import plan_near

    series = drifting_counts(2, 58, 256, num_groups=8, drift=0.02, tokens=4096 * 100, seed=3).astype(float)
    problem = make_deployment(256, **DS, num_groups=8)
    previous, _ = plan_near(series[0], problem, None, method=method)
    scratch = median_time(lambda: get_method(method)(series[1], problem), repeats=repeats, budget_s=5.0)
    total = median_time(lambda: plan_near(series[1], problem, previous, method=method), repeats=repeats, budget_s=5.0)
    return {"method": method, "scratch_ms": round(1e3 * scratch.wall, 2), "scratch_cpu_ms": round(1e3 * scratch.cpu, 2),
            "migration_aware_ms": round(1e3 * total.wall, 2), "migration_aware_cpu_ms": round(1e3 * total.cpu, 2)}


# ------------------------------------------------------------------------------ fewest changes, proven

EXACT_SLOTS = 12  # Mixtral's deployment (12 slots / 4 GPUs): CP-SAT proves its fewest changes


def fewest_changes_rows(seqs: list, quick: bool) -> list[dict]:
    """Per rebalance of Mixtral's 12-slot deployment: the slots eplb changes vs the fewest any plan
    within the tolerance can change (CP-SAT, :mod:`eplb.planning.exact_migration`, from the same previous
    placement), against two references: the default method from scratch (eplb's) and the optimum
    (``method="exact"``). gpt-oss-20b's 40 slots: ``bench/research/fewest_changes.py`` (an exact search
    proves there what CP-SAT does not)."""
    from eplb.planning.api import make_deployment
    from eplb.planning.exact_migration import fewest_changes

    rows = []
    for name, series, deployment in seqs:
        if deployment["num_slots"] != EXACT_SLOTS:
            continue
        limit = 5.0  # CP-SAT deterministic seconds per layer
        problem = make_deployment(series.shape[2], deployment["num_slots"], deployment["num_gpus"],
                               deployment["num_nodes"], deployment.get("num_groups"))
        current = eplb.plan(series[0], **deployment)
        for t in range(1, min(len(series), 3 if quick else len(series))):
            w = series[t]
            scratch = eplb.plan(w, **deployment)
            near = eplb.plan(w, previous=current, tolerance=TOLERANCE, **deployment)
            previous = np.ascontiguousarray(current.phy2log)
            row = {"sequence": name, "window": t, "slots": near.phy2log.size,
                   "eplb": int(near.info["slots_changed"].sum())}
            for ref_name, peak in (("default", scratch.max_load), ("optimum", None)):
                if peak is None:
                    optimum = eplb.plan(w, method="exact", deterministic_time=limit, progress=False, **deployment)
                    if not optimum.info["optimal"].all():
                        continue
                    peak = optimum.max_load
                    row["default_over_optimum"] = round(float((scratch.max_load / np.maximum(peak, 1e-300)).max()), 5)
                _, info = fewest_changes(w, problem, previous, np.ascontiguousarray(near.phy2log),
                                         cap=peak * (1 + TOLERANCE), max_moves=None, time_limit=limit)
                row[f"fewest_{ref_name}"] = int(info["slots_changed"].sum())
                row[f"bound_{ref_name}"] = int(info["fewest_changes_bound"].sum())
                row[f"proven_{ref_name}"] = bool(info["proven"].all())
            rows.append(row)
            current = near
    keys = dict.fromkeys(k for r in rows for k in r)
    return [{k: r.get(k, "") for k in keys} for r in rows]


THREADS = 2  # this machine's cores
THREADED = f"rebalance on {THREADS} threads"


def rebalance_times(repeats: int) -> list[dict]:
    """``Balancer.rebalance()`` end to end at DeepSeek-V3 size, hierarchical and global, side by side:
    median wall and CPU, the split (the bound-first search, transfer plan + Placement), the same
    rebalance with ``threads=THREADS`` (chunks of layers on threads; the same placement), and the
    path without the bound-first search for comparison (the method from scratch on every layer,
    then the migration search towards it)."""
    import time

    from eplb.planning.methods import get_method
    from eplb.planning.migration import migrate, near_bound
    from eplb import Placement
    from eplb import transfer_plan

    series = drifting_counts(2, 58, 256, num_groups=8, drift=0.02, tokens=4096 * 100, seed=3).astype(float)
    balancers, threaded = {}, {}
    for mode, groups in (("hierarchical", 8), ("global", None)):
        for threads, into in ((1, balancers), (THREADS, threaded)):
            balancer = eplb.Balancer(58, eplb.Deployment.of(256, **DS, num_groups=groups), window=1, expert_bytes=EXPERT_BYTES,
                                     threads=threads)
            balancer.record(series[0])
            balancer.rebalance()
            balancer.record(series[1])
            into[mode] = balancer
    parts = {mode: {} for mode in balancers}
    layers_within = {}

    def clock(mode, key, fn):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        parts[mode].setdefault(key, []).append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    for i in range(repeats + 2):
        for mode, b in balancers.items():  # interleaved: both modes see the same machine load
            b._candidate = None
            clock(mode, "rebalance", lambda: b.rebalance(commit=False))
            threaded[mode]._candidate = None
            clock(mode, THREADED, lambda: threaded[mode].rebalance(commit=False))
            load = b.window_counts()
            previous = np.require(b.placement.phy2log, requirements="CW")
            new, _, within = clock(mode, "bound-first search", lambda: near_bound(
                load, b.deployment, previous, tolerance=b.tolerance, budget=b.topology.num_slots))
            layers_within[mode] = int(within.sum())
            scratch, _ = clock(mode, "method", lambda: get_method(b.method)(load, b.deployment))
            clock(mode, "migration", lambda: migrate(load, b.deployment, previous, scratch, tolerance=b.tolerance))
            clock(mode, "transfer + Placement", lambda: transfer_plan(
                b.placement, Placement(new, b.num_experts, b.topology, b.num_groups, method=b.method),
                expert_bytes=EXPERT_BYTES))
    rows = []
    for mode, timings in parts.items():
        row = {"mode": mode, "layers": series.shape[1], "layers_within_bound": layers_within[mode]}
        for key, values in timings.items():
            values = values[2:]  # the first calls warm the caches
            row[f"{key}_ms"] = round(1e3 * statistics.median(v[0] for v in values), 2)
            row[f"{key}_cpu_ms"] = round(1e3 * statistics.median(v[1] for v in values), 2)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ report

def run(quick: bool, results_dir: Path) -> str:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    seqs, notes = sequences(quick)
    drift = [row for name, series, deployment in seqs for row in drift_rows(name, series, deployment)]
    write_csv(results_dir / "serving_drift.csv", drift)

    passes, rebalances = [], []
    for method in (eplb.DEFAULT_METHOD, "greedy"):
        p, r = serving_loop(quick, method)
        passes += p
        rebalances += r
    write_csv(results_dir / "serving_loop.csv", passes)
    write_csv(results_dir / "serving_rebalances.csv", rebalances)
    split = [plan_time_split(m, 5 if quick else 21) for m in (eplb.DEFAULT_METHOD, "greedy")]
    write_csv(results_dir / "serving_plan_time.csv", split)
    timings = rebalance_times(5 if quick else 31)
    write_csv(results_dir / "serving_rebalance_time.csv", timings)
    fewest = fewest_changes_rows(seqs, quick)
    write_csv(results_dir / "serving_fewest_changes.csv", fewest)
    plot(passes, rebalances, results_dir / "serving.png")

    lines = ["## Serving", "", f"Machine: {load_note()}. Tolerance {TOLERANCE:.1%} on the max load.", ""]
    lines += ["### Rebalancing drifting loads", "",
              "Slots changed per rebalance (fraction of all layer x slot pairs) and the max GPU load relative "
              f"to planning from scratch with the default method (`{eplb.DEFAULT_METHOD}`); worst over layers "
              "and windows. Targets: <= 20% of slots, within 0.5% (ratio <= 1.005).", ""]
    lines.append(markdown_table(
        ["sequence", "strategy", "rebalances", "slots changed (mean / max)", "max load ratio (worst / mean)",
         "plan ms (median)"],
        [(r["sequence"], r["strategy"], r["rebalances"], f"{r['mean_slots_changed']:.1%} / {r['max_slots_changed']:.1%}",
          f"{r['worst_max_load_ratio']:.4f} / {r['mean_max_load_ratio']:.4f}", r["median_plan_ms"]) for r in drift]))
    lines += [""] + [f"- {n}" for n in notes]
    lines += ["", "### Serving loop (DeepSeek-V3 size, drifting load)", ""]
    rows = []
    for method in (eplb.DEFAULT_METHOD, "greedy"):
        p = [r for r in passes if r["method"] == method]
        r = [x for x in rebalances if x["method"] == method]
        later = [x for x in r[1:]]
        rows.append((
            method, len(r),
            f"{np.mean([x['balancer'] for x in p[25:]]):.3f}",
            f"{np.nanmean([x['fresh_every_check'] for x in p[25:]]):.3f}",
            f"{np.mean([x['never_rebalance'] for x in p[25:]]):.3f}",
            f"{r[0]['moved_fraction']:.1%}" if r else "-",
            f"{np.mean([x['moved_fraction'] for x in later]):.1%}" if later else "-",
            f"{np.mean([x['gib_moved'] for x in later]):.1f}" if later else "-",
            f"{statistics.median([x['plan_ms'] for x in r]):.1f}" if r else "-",
        ))
    lines.append(markdown_table(
        ["planning method", "rebalances", "balancedness (balancer)", "balancedness (fresh plan every check)",
         "balancedness (never rebalance)", "slots changed, first rebalance", "slots changed, later (mean)",
         "GiB copied per later rebalance", "plan ms per rebalance (median)"], rows))
    lines += ["", "Planning time per rebalance, DeepSeek-V3 size, split (medians, same run): the method from "
              "scratch alone vs the whole migration-aware plan (method + local search + relabelling). "
              "Target < 10 ms.", ""]
    lines.append(markdown_table(
        ["method", "from scratch ms (wall / CPU)", "migration-aware plan ms (wall / CPU)"],
        [(s["method"], f"{s['scratch_ms']} / {s['scratch_cpu_ms']}",
          f"{s['migration_aware_ms']} / {s['migration_aware_cpu_ms']}") for s in split]))
    lines += ["", "`Balancer.rebalance()` end to end (plan + transfer plan + Placement), DeepSeek-V3 size, "
              "medians of both modes interleaved in one run, with the split: the bound-first search (every layer "
              "starts there; layers it brings within the tolerance of the cheap bound need no plan from scratch), "
              "and for comparison the path without it (the method from scratch on every layer, then the migration "
              "search). Target < 10 ms.", ""]
    keys = ["rebalance", THREADED, "bound-first search", "transfer + Placement", "method", "migration"]
    lines.append(markdown_table(
        ["mode", "layers within the bound"] + [f"{k} ms (wall / CPU)" for k in keys],
        [(r["mode"], f"{r['layers_within_bound']} of {r['layers']}",
          *(f"{r[f'{k}_ms']} / {r[f'{k}_cpu_ms']}" for k in keys)) for r in timings]))
    lines += ["", "### Fewest slots changed, proven (Mixtral, 12 slots)", "",
              "Per rebalance, from the same previous placement as eplb: the fewest slots any plan within 0.5% of "
              "the reference can change (CP-SAT model of `eplb.planning.exact_migration`: no GPU gets a second replica "
              "of an expert, as in eplb's search; `proven`: the solver proved the minimum on every layer, else "
              "`bound` is what it proved). Reference: the default method from scratch (eplb's) or the optimum "
              "(`method=\"exact\"`). As a fraction of all slots. gpt-oss-20b on 40 slots: see the section "
              "\"Fewest slot changes per rebalance, proven\" (`bench/research/fewest_changes.py`).", ""]
    table = []
    for name in dict.fromkeys(r["sequence"] for r in fewest):
        rs = [r for r in fewest if r["sequence"] == name]
        slots = rs[0]["slots"]

        def stat(key, rs=rs, slots=slots):
            values = np.array([r[key] for r in rs if r.get(key, "") != ""], dtype=float) / slots
            return f"{values.mean():.1%} / {values.max():.1%}" if values.size else "-"

        proven = sum(r["proven_default"] for r in rs)
        table.append((name, len(rs), stat("eplb"), stat("fewest_default"), stat("bound_default"),
                      f"{proven} of {len(rs)}", stat("fewest_optimum"),
                      max((f"{r['default_over_optimum']:.4f}" for r in rs if r.get("default_over_optimum", "") != ""), default="-")))
    lines.append(markdown_table(
        ["sequence", "rebalances", "eplb (mean / max)", "fewest found, ref. default (mean / max)",
         "proven lower bound (mean / max)", "rebalances proven", "fewest, ref. optimum (mean / max)",
         "default / optimum max load (worst)"], table))
    lines += ["", "![balancedness over time and slots changed per rebalance](serving.png)", ""]
    return "\n".join(lines)


def plot(passes: list[dict], rebalances: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    method = eplb.DEFAULT_METHOD
    p = [r for r in passes if r["method"] == method]
    steps = [r["step"] for r in p]
    for key, label in (("balancer", "eplb.Balancer (migration-aware)"), ("fresh_every_check", "fresh plan at every check"),
                       ("never_rebalance", "never rebalance")):
        top.plot(steps, [r[key] for r in p], label=label, linewidth=1)
    top.set_ylabel("balancedness (mean / max)")
    top.legend(fontsize=8)
    r = [x for x in rebalances if x["method"] == method]
    bottom.bar([x["step"] for x in r], [100 * x["moved_fraction"] for x in r], width=6)
    bottom.axhline(20, color="grey", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("% slots changed")
    bottom.set_xlabel("forward pass")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _time_verdict(wall_ms: float, cpu_ms: float) -> str:
    """The < 10 ms target on a median wall time, noting when only the CPU time meets it."""
    if wall_ms < 10:
        return "met"
    return "met on CPU time (wall inflated by other processes)" if cpu_ms < 10 else "not met"


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    """README headline rows ``(figure, measured, target)``."""
    path = Path(results_dir) / "serving_drift.csv"
    if not path.exists():
        return []
    rows = [r for r in read_csv(path) if r["strategy"] == "eplb migration-aware"]
    greedy = [r for r in read_csv(path) if r["strategy"] == "greedy from scratch"]
    out = []
    if rows:
        moved = [float(r["mean_slots_changed"]) for r in rows]
        worst = max(float(r["worst_max_load_ratio"]) for r in rows)
        met = sum(m <= 0.2 for m in moved)
        out.append(("Migration-aware rebalance: slots changed per rebalance on drifting loads",
                    f"{min(moved):.1%}-{max(moved):.1%} over {len(rows)} sequences (greedy from scratch: "
                    f"{min(float(r['mean_slots_changed']) for r in greedy):.0%}-"
                    f"{max(float(r['mean_slots_changed']) for r in greedy):.0%})",
                    f"<= 20%: met on {met} of {len(rows)}"))
        out.append(("Migration-aware rebalance: max load vs planning from scratch", f"worst {worst:.4f}",
                    f"<= 1.005: {'met' if worst <= 1.005 + 1e-9 else 'not met'}"))
    split = Path(results_dir) / "serving_plan_time.csv"
    if split.exists():
        for r in read_csv(split):
            wall, cpu = float(r["migration_aware_ms"]), float(r["migration_aware_cpu_ms"])
            verdict = _time_verdict(wall, cpu)
            out.append((f"Planning time per rebalance, DeepSeek-V3 size (`{r['method']}` + migration)",
                        f"{wall:.1f} ms wall, {cpu:.1f} ms CPU (the method alone: {float(r['scratch_ms']):.1f} ms "
                        f"wall, {float(r['scratch_cpu_ms']):.1f} ms CPU)", f"< 10 ms: {verdict}"))
    timings = Path(results_dir) / "serving_rebalance_time.csv"
    if timings.exists():
        for r in read_csv(timings):
            wall, cpu = float(r["rebalance_ms"]), float(r["rebalance_cpu_ms"])
            verdict = _time_verdict(wall, cpu)
            out.append((f"`Balancer.rebalance()` end to end, DeepSeek-V3 size, {r['mode']}",
                        f"{wall:.1f} ms wall, {cpu:.1f} ms CPU (bound-first search "
                        f"{float(r['bound-first search_cpu_ms']):.1f} ms CPU, {r['layers_within_bound']} of "
                        f"{r['layers']} layers within the bound; without it: method "
                        f"{float(r['method_cpu_ms']):.1f} + migration {float(r['migration_cpu_ms']):.1f} ms CPU)",
                        f"< 10 ms: {verdict}"))
            if f"{THREADED}_ms" in r:
                wall, cpu = float(r[f"{THREADED}_ms"]), float(r[f"{THREADED}_cpu_ms"])
                out.append((f"`Balancer(threads={THREADS}).rebalance()`, DeepSeek-V3 size, {r['mode']} (same placement)",
                            f"{wall:.1f} ms wall, {cpu:.1f} ms CPU (both threads)",
                            f"< 10 ms: {'met' if wall < 10 else 'not met'}"))
    fewest = Path(results_dir) / "serving_fewest_changes.csv"
    if fewest.exists():
        rows = read_csv(fewest)
        for name in dict.fromkeys(r["sequence"] for r in rows):
            rs = [r for r in rows if r["sequence"] == name]
            slots = float(rs[0]["slots"])
            eplb_share = np.array([float(r["eplb"]) for r in rs]) / slots
            found = np.array([float(r["fewest_default"]) for r in rs]) / slots
            proven = all(r["proven_default"] == "True" for r in rs)
            label = "proven minimum" if proven else "fewest CP-SAT found (not proven)"
            out.append((f"Slots changed per rebalance, eplb vs {label}: {name.split(',')[0]} "
                        f"{name.split(', ')[-1]}",
                        f"eplb {eplb_share.mean():.1%} mean / {eplb_share.max():.1%} max; {label} "
                        f"{found.mean():.1%} / {found.max():.1%}",
                        "<= 20% per rebalance: " + ("infeasible on some rebalances" if proven and found.max() > 0.2
                                                    else "see section")))
    return out


if __name__ == "__main__":
    run_alone(run, __doc__)
