"""Speed of the lower bound at DeepSeek-V3 size, next to the plan it certifies.

``eplb.plan`` reports ``gap = max_load / lower_bound - 1``; the bound is computed on first access
of ``lower_bound`` / ``gap``. Here ``eplb.analysis.bounds.lower_bound`` is timed alone (median of many
calls after a warm-up) on realistic synthetic loads (``eplb.simulation.synthetic``: lognormal with group
factors, Zipf 1.0 / 1.5, a few hot experts), 58 layers x 256 experts, 288 slots on 32 GPUs in 4
nodes, hierarchical (8 groups) and global, with the default plan's time beside it; then the
default plan's gap to the hierarchical bound at 1024 experts / 32 groups / 16 nodes.

Run: ``cd bench && python -m research.bound_speed [--quick] [--profile]`` (``--profile``: cProfile of the bound).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

from _common import BENCH, read_csv, fmt_ms, load_note, markdown_table, median_time, write_csv

import eplb
from eplb import lower_bound
from eplb.simulation.synthetic import skewed_counts
from eplb import Topology

LAYOUT = dict(layers=58, experts=256, slots=288, gpus=32, nodes=4, groups=8)
LARGE = dict(slots=1152, gpus=128, nodes=16, groups=32)
FAMILIES = (("lognormal", 0.7), ("zipf", 1.0), ("zipf", 1.5), ("hot", 0.7))


def workloads():
    """``(name, counts [58, 256])`` for each family (group factors in the lognormal family)."""
    for family, skew in FAMILIES:
        counts = skewed_counts(LAYOUT["layers"], LAYOUT["experts"], family=family, skew=skew,
                               num_groups=LAYOUT["groups"], top_k=8, seed=0)
        yield f"{family} {skew}", counts.astype(float)


def run(quick: bool, results_dir: Path) -> str:
    topology = Topology.from_layout(LAYOUT["slots"], LAYOUT["gpus"], LAYOUT["nodes"])
    repeats = 10 if quick else 40
    rows = []
    for name, counts in workloads():
        for mode, hierarchical in (("hierarchical", True), ("global", False)):
            groups = LAYOUT["groups"] if hierarchical else None
            deployment = eplb.Deployment.of(counts.shape[-1], topology=topology, num_groups=groups)
            bound = median_time(lambda: lower_bound(counts, deployment), repeats=repeats, budget_s=4.0)
            plan_kwargs = dict(num_slots=LAYOUT["slots"], num_gpus=LAYOUT["gpus"], num_nodes=LAYOUT["nodes"],
                               num_groups=groups)
            planned = median_time(lambda: eplb.plan(counts, **plan_kwargs), repeats=repeats, budget_s=4.0)
            rows.append({"loads": name, "mode": mode, "bound_ms": bound.wall * 1e3, "bound_cpu_ms": bound.cpu * 1e3,
                         "plan_ms": planned.wall * 1e3, "calls": bound.calls})
    write_csv(results_dir / "bound_speed.csv", rows)
    table = markdown_table(["loads", "mode", "lower_bound (ms)", "bound CPU (ms)", "plan (ms)", "plan + bound (ms)"],
                           [(r["loads"], r["mode"], fmt_ms(r["bound_ms"] / 1e3), fmt_ms(r["bound_cpu_ms"] / 1e3),
                             fmt_ms(r["plan_ms"] / 1e3),
                             fmt_ms((r["bound_ms"] + r["plan_ms"]) / 1e3)) for r in rows])
    scale_rows = []
    for family in ("lognormal", "zipf"):
        counts = skewed_counts(8, 1024, family=family, skew=0.7 if family == "lognormal" else 1.0,
                               num_groups=LARGE["groups"], seed=1).astype(float)
        kwargs = dict(num_slots=LARGE["slots"], num_gpus=LARGE["gpus"], num_nodes=LARGE["nodes"],
                      num_groups=LARGE["groups"])
        gap = eplb.plan(counts, **kwargs).gap
        large = Topology.from_layout(LARGE["slots"], LARGE["gpus"], LARGE["nodes"])
        deployment = eplb.Deployment.of(counts.shape[-1], topology=large, num_groups=LARGE["groups"])
        timing = median_time(lambda: lower_bound(counts, deployment), repeats=repeats // 4 + 1, budget_s=4.0)
        scale_rows.append((family, f"{100 * gap.mean():.3f}%", f"{100 * gap.max():.3f}%", fmt_ms(timing.cpu)))
    scale = markdown_table(["loads (8 layers)", "default plan mean gap", "max gap", "bound CPU (ms)"], scale_rows)
    write_csv(results_dir / "bound_speed_scale.csv", [dict(zip(("loads", "mean_gap", "max_gap", "bound_cpu_ms"), r))
                                                       for r in scale_rows])
    return (f"## Bound speed\n\nLower bound at DeepSeek-V3 size (58 x 256, 288 slots / 32 GPUs / 4 nodes), median wall time "
            f"per call. {load_note()}\n\n{table}\n\nHierarchical bound at 1024 experts / 32 groups / 16 nodes "
            f"(1152 slots on 128 GPUs; the group -> node search gives up there and the node-load bound "
            f"carries it):\n\n{scale}\n")


def headline(results_dir: Path):
    path = results_dir / "bound_speed.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        if r["loads"].startswith("lognormal"):
            out.append((f"`lower_bound` at DeepSeek-V3 size, {r['mode']}, realistic loads",
                        f"{float(r['bound_ms']):.1f} ms wall, {float(r['bound_cpu_ms']):.1f} ms CPU", "reported"))
    scale = results_dir / "bound_speed_scale.csv"
    if scale.exists():
        rows = read_csv(scale)
        out.append(("Default plan's gap to the hierarchical bound at 1024 experts / 32 groups / 16 nodes (mean)",
                    ", ".join(f"{r['loads']} {r['mean_gap']}" for r in rows), "useful bound (issue: 31% reported)"))
    return out


def profile() -> None:
    topology = Topology.from_layout(LAYOUT["slots"], LAYOUT["gpus"], LAYOUT["nodes"])
    loads = list(workloads())
    for _, counts in loads:
        lower_bound(counts, eplb.Deployment.of(counts.shape[-1], topology=topology, num_groups=LAYOUT["groups"]))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(10):
        for _, counts in loads:
            lower_bound(counts, eplb.Deployment.of(counts.shape[-1], topology=topology, num_groups=LAYOUT["groups"]))
            lower_bound(counts, eplb.Deployment.of(counts.shape[-1], topology=topology))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.profile:
        profile()
    else:
        out = BENCH / "results" / ("quick" if args.quick else "")
        print(run(args.quick, out))
