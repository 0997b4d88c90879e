"""Speed and scaling: time per call of eplb's methods and of the pure-NumPy port of the published
greedy algorithm (``bench/published_greedy.py``), measured side by side in one process.

Every point times the DeepSeek-compatible entry point ``rebalance_experts`` (all three arrays
out) on realistic skewed counts, after a warm-up call (Numba compiles or loads its cache then).
The base configuration is the DeepSeek-V3-sized example (58 layers x 256 experts, 288 slots on
32 GPUs in 4 nodes, 8 groups: hierarchical); each sweep changes one axis:

- experts ``E`` 64..1024 (one redundant slot per GPU: ``S = E + G``),
- GPUs ``G`` 8..256 (``S = E + G``),
- layers ``L`` 1..96,
- slots per GPU ``k`` 8..16 (``S = k * G``).

Run: ``python bench/speed.py [--quick]`` (results in ``bench/results/``).
"""

from __future__ import annotations

from pathlib import Path

from _common import (fmt_ms, load_note, markdown_table, median_time, planning_methods, pyplot, read_csv, run_alone,
                     write_csv)

import eplb
import published_greedy
from eplb.simulation.synthetic import skewed_counts

NUMPY_PORT = "numpy port"
BASE = dict(layers=58, experts=256, gpus=32, nodes=4, groups=8, slots_per_gpu=9)

# (axis, values, quick values): each point is BASE with that one axis changed.
SWEEPS = (
    ("experts", (64, 128, 256, 512, 1024), (64, 256, 1024)),
    ("gpus", (8, 16, 32, 64, 128, 256), (8, 32, 256)),
    ("layers", (1, 4, 16, 58, 96), (1, 58)),
    ("slots_per_gpu", (8, 9, 10, 12, 16), (8, 16)),
)


def point_config(axis: str, value: int) -> dict:
    """The configuration of one sweep point: ``BASE`` with ``axis`` set to ``value``."""
    config = dict(BASE)
    config[axis] = value
    if axis in ("experts", "gpus"):  # one redundant slot per GPU
        config["slots_per_gpu"] = config["experts"] // config["gpus"] + 1
    config["slots"] = config["slots_per_gpu"] * config["gpus"]
    return config


def time_point(config: dict, methods: list[str], *, repeats: int, port_repeats: int,
               budget_s: float) -> list[dict]:
    """Median time per call of each method and of the NumPy port on one configuration."""
    counts = skewed_counts(config["layers"], config["experts"], num_groups=config["groups"], seed=0)
    args = (counts, config["slots"], config["groups"], config["nodes"], config["gpus"])
    rows = []
    for method in methods + [NUMPY_PORT]:
        if method == NUMPY_PORT:
            fn = lambda: published_greedy.rebalance_experts(*args)  # noqa: E731
            timing = median_time(fn, repeats=port_repeats, budget_s=budget_s, warmup=0)
        else:
            fn = lambda: eplb.rebalance_experts(*args, method=method)  # noqa: E731
            timing = median_time(fn, repeats=repeats, budget_s=budget_s)
        rows.append({**{k: config[k] for k in ("layers", "experts", "slots", "gpus", "nodes", "groups",
                                               "slots_per_gpu")},
                     "method": method, "median_ms": round(timing.wall * 1e3, 4),
                     "cpu_median_ms": round(timing.cpu * 1e3, 4), "calls": timing.calls,
                     "p99_ms": round(timing.p99 * 1e3, 4), "max_ms": round(timing.max * 1e3, 4)})
    port = next(r["median_ms"] for r in rows if r["method"] == NUMPY_PORT)
    for row in rows:
        row["speedup_vs_numpy_port"] = round(port / row["median_ms"], 2)
    return rows


def bar_ms(method: str) -> float | None:
    """The per-call target of a method at DeepSeek-V3 size (issues 2 and 3), or None."""
    if method == "greedy":
        return 2.0
    if method == "best":
        return 300.0
    if method == eplb.DEFAULT_METHOD:
        return 10.0
    return None


def verdict(wall_ms: float, cpu_ms: float, target_ms: float) -> str:
    if wall_ms <= target_ms:
        return "met"
    if cpu_ms <= target_ms:
        return "met on CPU time (wall time inflated by other processes)"
    return "NOT met"


def ratio(value: float) -> str:
    return f"{value:.0f}x" if value >= 10 else f"{value:.1f}x"


def plot(rows: list[dict], methods: list[str], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SWEEPS), figsize=(4.2 * len(SWEEPS), 3.6))
    for ax, (axis, _, _) in zip(axes, SWEEPS):
        sweep = [r for r in rows if r["axis"] == axis]
        for method in methods + [NUMPY_PORT]:
            pts = sorted((int(r[axis]), float(r["median_ms"]))
                         for r in sweep if r["method"] == method)
            if pts:
                ax.loglog(*zip(*pts), marker="o", label=method, linestyle="--" if method == NUMPY_PORT else "-")
        values = sorted({int(r[axis]) for r in sweep})
        if values:
            from matplotlib.ticker import NullLocator

            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(values, [str(v) for v in values])
        ax.set_xlabel(axis.replace("_", " "))
        ax.set_ylabel("ms per call (median)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
            break
    fig.suptitle("rebalance_experts time per call (others fixed at DeepSeek-V3 size)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, results_dir: Path, sweeps=SWEEPS, methods: list[str] | None = None) -> str:
    """Time the DeepSeek-V3 point closely, then every sweep; write ``speed*.csv`` and ``speed.png``.

    ``sweeps`` and ``methods`` (default: every registered method but ``exact``) narrow the run."""
    results_dir.mkdir(parents=True, exist_ok=True)
    methods = planning_methods() if methods is None else methods
    note = load_note()

    # The headline point: DeepSeek-V3 size, many calls.
    ds = point_config("layers", BASE["layers"])
    headline = time_point(ds, methods, repeats=30 if quick else 300, port_repeats=3 if quick else 15,
                          budget_s=1.0 if quick else 5.0)
    # plan() adds the lower bound and the placement's diagnostics on top of the arrays
    counts = skewed_counts(ds["layers"], ds["experts"], num_groups=ds["groups"], seed=0)
    for method in methods:
        timing = median_time(
            lambda: eplb.plan(counts, num_slots=ds["slots"], num_gpus=ds["gpus"], num_nodes=ds["nodes"],
                              num_groups=ds["groups"], method=method),
            repeats=20 if quick else 100, budget_s=1.0 if quick else 5.0)
        headline.append({**{k: ds[k] for k in ("layers", "experts", "slots", "gpus", "nodes", "groups",
                                               "slots_per_gpu")},
                         "method": f"plan({method})", "median_ms": round(timing.wall * 1e3, 4),
                         "cpu_median_ms": round(timing.cpu * 1e3, 4), "calls": timing.calls,
                         "p99_ms": round(timing.p99 * 1e3, 4), "max_ms": round(timing.max * 1e3, 4),
                         "speedup_vs_numpy_port": ""})
    write_csv(results_dir / "speed_deepseek_v3.csv", headline)

    rows = []
    for axis, values, quick_values in sweeps:
        for value in (quick_values if quick else values):
            for row in time_point(point_config(axis, value), methods, repeats=5 if quick else 30,
                                  port_repeats=1 if quick else 5, budget_s=0.3 if quick else 2.0):
                rows.append({"axis": axis, **row})
    write_csv(results_dir / "speed.csv", rows)
    plot(rows, methods, results_dir / "speed.png")

    # ---- markdown
    out = ["## Speed", "",
           f"`rebalance_experts` time per call, median after a warm-up call, eplb methods and the "
           f"pure-NumPy port of the published greedy (`bench/published_greedy.py`) timed side by side "
           f"in one process ({note}; {'quick mode' if quick else 'full run'}).", "",
           f"DeepSeek-V3 size ({ds['layers']} layers x {ds['experts']} experts -> {ds['slots']} slots, "
           f"{ds['gpus']} GPUs, {ds['nodes']} nodes, {ds['groups']} groups):", ""]
    table = []
    for r in headline:
        target = bar_ms(r["method"])
        bar = "" if target is None else f"<= {target:g} ms: {verdict(r['median_ms'], r['cpu_median_ms'], target)}"
        speedup = ratio(r["speedup_vs_numpy_port"]) if r["speedup_vs_numpy_port"] != "" else ""
        table.append((r["method"], fmt_ms(r["median_ms"] / 1e3), fmt_ms(r["cpu_median_ms"] / 1e3), r["calls"],
                      speedup, bar))
    out += [markdown_table(("method", "ms per call (wall)", "CPU ms per call", "calls timed",
                            "speed-up vs NumPy port", "bar"), table), ""]

    out += ["Scaling (one axis changed at a time from the size above; `S = E + G` in the experts and "
            "GPUs sweeps), log-log:", "", "![time per call vs size](speed.png)", ""]
    shown = methods + [NUMPY_PORT]
    for axis, _, _ in sweeps:
        sweep = [r for r in rows if r["axis"] == axis]
        if not sweep:
            continue
        values = sorted({r[axis] for r in sweep})
        body = []
        for value in values:
            by_method = {r["method"]: r for r in sweep if r[axis] == value}
            cells = [value] + [fmt_ms(by_method[m]["median_ms"] / 1e3) for m in shown]
            cells += [ratio(by_method[m]["speedup_vs_numpy_port"]) for m in methods]
            body.append(cells)
        header = [axis.replace("_", " ")] + [f"{m} ms" for m in shown] + [f"{m} speed-up" for m in methods]
        out += [markdown_table(header, body), ""]
    return "\n".join(out)


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    """README headline rows ``(figure, measured, target)`` from ``speed_deepseek_v3.csv``."""
    path = results_dir / "speed_deepseek_v3.csv"
    if not path.exists():
        return []
    rows = {r["method"]: r for r in read_csv(path)}
    out = []
    for method, row in rows.items():
        if method.startswith("plan(") or method == NUMPY_PORT:
            continue
        label = f"`{method}`" + (" (default)" if method == eplb.DEFAULT_METHOD else "")
        target = bar_ms(method)
        wall, cpu = float(row["median_ms"]), float(row["cpu_median_ms"])
        out.append((f"{label} per call, DeepSeek-V3 size (58x256 -> 288 slots, 32 GPUs, 4 nodes, 8 groups)",
                    f"{fmt_ms(wall / 1e3)} ms wall, {fmt_ms(cpu / 1e3)} ms CPU (speed-up vs the NumPy port: "
                    f"{ratio(float(row['speedup_vs_numpy_port']))})",
                    "" if target is None else f"<= {target:g} ms: {verdict(wall, cpu, target)}"))
    if NUMPY_PORT in rows:
        out.append(("NumPy port of the published greedy, same size, same run",
                    f"{float(rows[NUMPY_PORT]['median_ms']):.1f} ms", "baseline"))
    return out


def readme_rows(results_dir: Path) -> list[tuple[str, str, str]]:
    """The README's row: the default method's time per call at DeepSeek-V3 size beside the published
    greedy's (the NumPy port, same run) and eplb's own greedy."""
    path = results_dir / "speed_deepseek_v3.csv"
    if not path.exists():
        return []
    rows = {r["method"]: r for r in read_csv(path)}
    default, port, greedy = rows[eplb.DEFAULT_METHOD], rows[NUMPY_PORT], rows["greedy"]

    def spread(row):
        return f"median {float(row['median_ms']):.1f} ms, p99 {float(row['p99_ms']):.1f}, max {float(row['max_ms']):.1f}"

    return [("`eplb.rebalance_experts` per call, DeepSeek-V3 size (58 layers x 256 experts, 288 slots, 32 GPUs, "
             "4 nodes, 8 groups), warm",
             f"default `{eplb.DEFAULT_METHOD}`: {spread(default)}; `greedy`: {spread(greedy)}",
             f"the published greedy (NumPy port): {spread(port)}")]


if __name__ == "__main__":
    run_alone(run, __doc__)
