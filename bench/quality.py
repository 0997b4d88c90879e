"""Quality of greedy, the default method and ``best``: gap to the proven lower bound, balancedness,
replicas wasted on a shared GPU, planning time; plus the speed bars on a DeepSeek-V3-sized model.

Configurations: DeepSeek-V3 (256 experts, 32 GPUs, 4 nodes, 8 groups; 288 and 320 slots,
hierarchical and global), Qwen3-30B-A3B (128 experts, 8 GPUs, 128 and 144 slots), Kimi-K2
(384 experts, 72 GPUs in 9 nodes, 432 slots); synthetic families (lognormal, Zipf 0.5 / 1.0 / 1.5,
uniform, a few very hot experts) and the real traces (each window planned on its own counts).

    python bench/quality.py [--quick]

Writes ``quality.csv`` (one row per configuration x load x method) and ``quality_speed.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _common import fmt_ms, load_note, markdown_table, median_time, pct, read_csv, trace_workloads, write_csv

import eplb
from eplb.planning.api import make_problem
from eplb.planning.methods import get_method
from eplb.simulation.synthetic import deepseek_v3_counts, skewed_counts

METHODS = ("greedy", "balanced", "best")

# name -> (experts, layers, plan kwargs)
CONFIGS = {
    "DeepSeek-V3 288 hier": (256, 58, dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)),
    "DeepSeek-V3 288 global": (256, 58, dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=None)),
    "DeepSeek-V3 320 hier": (256, 58, dict(num_slots=320, num_gpus=32, num_nodes=4, num_groups=8)),
    "DeepSeek-V3 320 global": (256, 58, dict(num_slots=320, num_gpus=32, num_nodes=4, num_groups=None)),
    "Qwen3-30B-A3B 128": (128, 48, dict(num_slots=128, num_gpus=8, num_nodes=1, num_groups=None)),
    "Qwen3-30B-A3B 144": (128, 48, dict(num_slots=144, num_gpus=8, num_nodes=1, num_groups=None)),
    "Kimi-K2 432": (384, 60, dict(num_slots=432, num_gpus=72, num_nodes=9, num_groups=None)),
}

# name -> (family, skew); "lognormal" is the package's realistic default (group factors when grouped)
FAMILIES = {
    "lognormal": ("lognormal", 0.7),
    "zipf 0.5": ("zipf", 0.5),
    "zipf 1.0": ("zipf", 1.0),
    "zipf 1.5": ("zipf", 1.5),
    "uniform": ("uniform", 0.0),
    "hot": ("hot", 1.0),
}
REALISTIC = ("lognormal", "zipf 0.5", "zipf 1.0")


def evaluate(counts: np.ndarray, kwargs: dict, method: str, reference: np.ndarray | None = None) -> dict:
    """Plan ``counts [L, E]`` and measure the placement; ``reference [L]``: a stronger proven bound."""
    placement = eplb.plan(counts, method=method, **kwargs)
    bound = placement.lower_bound if reference is None else np.maximum(placement.lower_bound, reference)
    return {
        "gap_ref_mean": float((placement.max_load / bound - 1).mean()),
        "gap_mean": float(placement.gap.mean()),
        "gap_max": float(placement.gap.max()),
        "balancedness": float(placement.balancedness(counts).mean()),
        "shared": float(placement.replicas_sharing_a_gpu().mean()),
        "time_s": float(placement.info["time_s"]),
    }


def synthetic_rows(quick: bool) -> list[dict]:
    rows = []
    configs = CONFIGS if not quick else {k: CONFIGS[k] for k in ("DeepSeek-V3 288 hier", "DeepSeek-V3 288 global",
                                                                  "Qwen3-30B-A3B 128", "Kimi-K2 432")}
    families = FAMILIES if not quick else {k: FAMILIES[k] for k in ("lognormal", "zipf 1.5", "hot")}
    for config, (experts, layers, kwargs) in configs.items():
        if quick:
            layers = 6
        for load, (family, skew) in families.items():
            counts = skewed_counts(layers, experts, family=family, skew=skew, num_groups=kwargs["num_groups"],
                                   seed=11)
            for method in METHODS:
                rows.append({"config": config, "load": load, "method": method, **evaluate(counts, kwargs, method)})
    return rows


def trace_rows(quick: bool) -> tuple[list[dict], list[str]]:
    workloads, missing = trace_workloads()
    rows = []
    for key, names, counts, kwargs in workloads:
        windows = range(len(names)) if not quick else range(min(2, len(names)))
        results = {m: [] for m in METHODS}
        for w in windows:
            reference = None
            if counts.shape[-1] <= 8:  # tiny: the CP-SAT solver proves the optimum in a blink
                exact = eplb.plan(counts[w], method="exact", deterministic_time=2.0, progress=False, **kwargs)
                reference = exact.lower_bound
            for method in METHODS:
                results[method].append(evaluate(counts[w], kwargs, method, reference))
        config = f"{key} ({kwargs['num_slots']} slots, {kwargs['num_gpus']} GPUs)"
        for method in METHODS:
            rs = results[method]
            rows.append({"config": config, "load": f"real trace, {len(rs)} windows", "method": method,
                         **{k: float(np.mean([r[k] for r in rs])) if k != "gap_max" else
                            float(np.max([r[k] for r in rs])) for k in rs[0]}})
    return rows, missing


def speed_rows(quick: bool, methods=METHODS) -> list[dict]:
    """Median planning time of one call (the method alone, after warm-up) on DeepSeek-V3 sizes."""
    counts = deepseek_v3_counts(seed=0).astype(np.float64)
    rows = []
    for mode, groups in (("hierarchical", 8), ("global", None)):
        problem = make_problem(256, 288, 32, 4, groups)
        for method in methods:
            fn = get_method(method)
            t = median_time(lambda: fn(counts, problem), repeats=5 if quick else 21, budget_s=3 if quick else 15)
            rows.append({"mode": mode, "method": method, "wall_ms": t.wall * 1e3, "cpu_ms": t.cpu * 1e3,
                         "calls": t.calls})
    return rows


def run(quick: bool, results_dir: Path) -> str:
    results_dir = Path(results_dir)
    rows = synthetic_rows(quick)
    real, missing = trace_rows(quick)
    rows += real
    write_csv(results_dir / "quality.csv", rows)
    speed = speed_rows(quick)
    write_csv(results_dir / "quality_speed.csv", speed)

    table = markdown_table(
        ["configuration", "load", "method", "mean gap", "max gap", "mean gap to exact bound", "balancedness",
         "shared / layer", "time ms"],
        [[r["config"], r["load"], r["method"], pct(r["gap_mean"]), pct(r["gap_max"]),
          pct(r["gap_ref_mean"]) if r["gap_ref_mean"] != r["gap_mean"] else "", f"{r['balancedness']:.4f}",
          f"{r['shared']:.2f}", fmt_ms(r["time_s"])] for r in rows],
    )
    speed_table = markdown_table(
        ["DeepSeek-V3 288 slots", "method", "median wall ms", "median CPU ms", "calls"],
        [[r["mode"], r["method"], f"{r['wall_ms']:.2f}", f"{r['cpu_ms']:.2f}", r["calls"]] for r in speed],
    )

    def mean_gap(method, select, key="gap_mean"):
        gaps = [r[key] for r in rows if r["method"] == method and select(r)]
        return pct(float(np.mean(gaps))) if gaps else "n/a"

    def is_global(r):
        return "hier" not in r["config"]

    summary = markdown_table(
        ["loads", "greedy", "balanced (default)", "best"],
        [
            ["global, realistic synthetic (" + ", ".join(REALISTIC) + ")"]
            + [mean_gap(m, lambda r: is_global(r) and r["load"] in REALISTIC) for m in METHODS],
            ["global, every synthetic family"]
            + [mean_gap(m, lambda r: is_global(r) and not r["load"].startswith("real")) for m in METHODS],
            ["real traces"] + [mean_gap(m, lambda r: r["load"].startswith("real")) for m in METHODS],
            ["real traces, Mixtral against the exact solver's proven bound"]
            + [mean_gap(m, lambda r: r["load"].startswith("real"), "gap_ref_mean") for m in METHODS],
            ["hierarchical (gap to the hierarchical bound)"]
            + [mean_gap(m, lambda r: "hier" in r["config"]) for m in METHODS],
        ],
    )
    notes = "".join(f"\n- {m}" for m in missing)
    return (
        "## Quality\n\n"
        f"{'Quick run (6 layers, fewer configurations). ' if quick else ''}Gap = max GPU load / proven lower "
        "bound - 1 (hierarchical configurations: the bound for placements that keep each group on one node); "
        "exact bound = the CP-SAT solver's proven bound (`method=\"exact\"`, Mixtral only: 8 experts); "
        "shared = slots per layer holding a second replica of an expert already on that GPU; time = the "
        f"method's planning time of that call (first calls include nothing to compile: kernels are cached). "
        f"Machine: {load_note()}.{notes}\n\n"
        "Mean gap over configurations:\n\n" + summary + "\n\nSpeed (median of repeated warm calls):\n\n"
        + speed_table + "\n\nEvery configuration:\n\n" + table + "\n"
    )


def readme_rows(results_dir: Path) -> list[tuple[str, str, str]]:
    """The README's rows: in-sample balancedness and gap to the proven bound of the default against
    the published greedy, DeepSeek-V3-sized realistic synthetic loads (hierarchical and global) and
    the real traces."""
    path = Path(results_dir) / "quality.csv"
    if not path.exists():
        return []
    rows = read_csv(path)

    def mean(method, select, key):
        return float(np.mean([float(r[key]) for r in rows if r["method"] == method and select(r)]))

    def cell(method, select):
        return f"{mean(method, select, 'balancedness'):.4f} (gap {pct(mean(method, select, 'gap_mean'))})"

    cases = [("DeepSeek-V3-sized loads (" + ", ".join(REALISTIC) + "), 288 slots / 32 GPUs, hierarchical 4 nodes "
              "x 8 groups", lambda r: r["config"] == "DeepSeek-V3 288 hier" and r["load"] in REALISTIC),
             ("the same loads, global (groups free)",
              lambda r: r["config"] == "DeepSeek-V3 288 global" and r["load"] in REALISTIC),
             ("real traces (gpt-oss-20b, OLMoE, Mixtral windows), each planned on itself",
              lambda r: r["load"].startswith("real"))]
    return [(f"Balancedness in sample (gap to the proven bound): {what}",
             f"default `{eplb.DEFAULT_METHOD}` {cell(eplb.DEFAULT_METHOD, select)}",
             f"the published greedy {cell('greedy', select)}")
            for what, select in cases if any(select(r) for r in rows)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, well under a minute")
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    print(run(args.quick, args.results if not args.quick else args.results / "quick"))
