"""Quality of the published greedy (as a file), eplb's greedy, the default method and ``best``: gap
to the proven lower bound, balancedness, replicas wasted on a shared GPU, planning time; plus the
speed bars on a DeepSeek-V3-sized model.

Configurations: DeepSeek-V3 (256 experts, 32 GPUs, 4 nodes, 8 groups; 288 and 320 slots,
hierarchical and global), Qwen3-30B-A3B (128 experts, 8 GPUs, 128 and 144 slots), Kimi-K2
(384 experts, 72 GPUs in 9 nodes, 432 slots); synthetic families (lognormal, Zipf 0.5 / 1.0 / 1.5,
uniform, a few very hot experts) and the real traces (each window planned on its own counts).

Every figure comes from :func:`eplb.compare` (one implementation of balancedness, gap and doubled
replicas for every benchmark and for ``eplb compare``); the published algorithm is the file
``bench/published_greedy.py`` (its ``rebalance_experts``, numpy in and out), run beside eplb's
methods exactly as a user's file is. One ``eplb.compare`` call per configuration: the loads (the
synthetic families, or a trace's windows) are stacked as blocks of layers of one workload, and
every method compared here plans each layer on its own, so a block's per-layer figures are those
of a call on that load alone (checked bit for bit when this was written) at one worker process
per method instead of one per load.

    python bench/quality.py [--quick]

Writes ``quality.csv`` (one row per configuration x load x method) and ``quality_speed.csv``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from _common import (BENCH, fmt_ms, load_note, markdown_table, median_time, pct, rows_of, run_alone, trace_workloads,
                     write_csv)

import eplb
from eplb.planning.api import make_deployment
from eplb.planning.methods import get_method
from eplb.simulation.synthetic import deepseek_v3_counts, skewed_counts

PUBLISHED = "published greedy"
"""How rows name the published algorithm, compared from the file :data:`PUBLISHED_FILE`."""
PUBLISHED_FILE = BENCH / "published_greedy.py"
EPLB_METHODS = ("greedy", "balanced", "best")
METHODS = (PUBLISHED,) + EPLB_METHODS

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


def compare_blocks(blocks: list[np.ndarray], kwargs: dict) -> tuple[dict, list[str]]:
    """Every method of :data:`METHODS` on ``blocks`` (``[L, E]`` each) stacked as the layers of one
    workload, planned for the deployment ``kwargs``, through :func:`eplb.compare`.

    Returns ``({method: eplb.simulation.comparison.MethodResult}, notes)``: the published file's row
    is left out with a note when it broke (it is a foreign function); eplb's methods must not break.
    """
    comparison = eplb.compare([str(PUBLISHED_FILE), *EPLB_METHODS], [np.concatenate(blocks)], [kwargs],
                              warm_calls=1, array_type="numpy")
    results, notes = {}, []
    for result in comparison.results:
        name = PUBLISHED if result.method == str(PUBLISHED_FILE) else result.method
        if result.status != "ok":
            if name != PUBLISHED:
                raise RuntimeError(f"eplb method {name} broke on {result.deployment}: {result.reason}")
            notes.append(f"{PUBLISHED} ({PUBLISHED_FILE.name}) skipped on {result.deployment}: {result.reason}")
            continue
        results[name] = result
    return results, notes


def block_figures(result, counts: np.ndarray, layers: slice, share: float,
                  reference: np.ndarray | None = None) -> dict:
    """A method's figures on the block ``layers`` of the stacked workload ``counts [L, E]``, from
    what :func:`eplb.compare` computed per layer.

    ``gap_mean`` / ``gap_max``: mean and largest over the block's layers of ``max load / proven bound
    - 1`` (the hierarchical bound when the deployment and the plan keep groups on nodes, else the
    global one); ``gap_ref_mean``: the same against the larger of that bound and ``reference [L]``
    (a stronger proven bound of the block's layers, e.g. the exact solver's; without one it equals
    ``gap_mean``); ``balancedness``: mean over the block's layers of mean / max GPU load;
    ``shared``: slots per layer holding a second replica of an expert already on that GPU;
    ``time_s``: the method's warm planning time of the whole workload times ``share`` (the block's
    part of the layers).
    """
    gap = result.per_layer["gap"][layers]
    if reference is None:
        gap_ref = gap
    else:  # dividing by the larger of two bounds gives the smaller of the two gaps
        max_load = result.placement.gpu_loads(counts)[layers].max(axis=1)
        gap_ref = np.minimum(gap, max_load / reference - 1)
    return {
        "gap_ref_mean": float(gap_ref.mean()),
        "gap_mean": float(gap.mean()),
        "gap_max": float(gap.max()),
        "balancedness": float(result.per_layer["balancedness"][layers].mean()),
        "shared": float(result.placement.replicas_sharing_a_gpu()[layers].mean()),
        "bound": result.figures["bound"],
        "time_s": float(result.figures["warm_call_s"]) * share,
    }


def synthetic_rows(quick: bool) -> tuple[list[dict], list[str]]:
    """One row per configuration, synthetic family and method (``seed=11`` loads); and notes."""
    rows, notes = [], []
    configs = CONFIGS if not quick else {k: CONFIGS[k] for k in ("DeepSeek-V3 288 hier", "DeepSeek-V3 288 global",
                                                                  "Qwen3-30B-A3B 128", "Kimi-K2 432")}
    families = FAMILIES if not quick else {k: FAMILIES[k] for k in ("lognormal", "zipf 1.5", "hot")}
    for config, (experts, layers, kwargs) in configs.items():
        if quick:
            layers = 6
        blocks = [skewed_counts(layers, experts, family=family, skew=skew, num_groups=kwargs["num_groups"], seed=11)
                  for family, skew in families.values()]
        results, skipped = compare_blocks(blocks, kwargs)
        notes += skipped
        stacked = np.concatenate(blocks)
        for index, load in enumerate(families):
            block = slice(index * layers, (index + 1) * layers)
            for method in METHODS:
                if method in results:
                    rows.append({"config": config, "load": load, "method": method,
                                 **block_figures(results[method], stacked, block, 1 / len(blocks))})
    return rows, notes


def trace_rows(quick: bool) -> tuple[list[dict], list[str]]:
    """One row per real trace and method: each window planned on its own counts, figures over all
    the windows' layers (the mean over windows of each window's mean; ``gap_max`` the largest);
    and notes on absent traces and skipped rows."""
    workloads, notes = trace_workloads()
    rows = []
    for key, names, counts, kwargs in workloads:
        windows = counts[:len(names) if not quick else min(2, len(names))]
        reference = None
        if counts.shape[-1] <= 8:  # tiny: the CP-SAT solver proves the optimum in a blink
            reference = np.concatenate([eplb.plan(w, method="exact", deterministic_time=2.0, progress=False,
                                                  **kwargs).lower_bound for w in windows])
        results, skipped = compare_blocks(list(windows), kwargs)
        notes += skipped
        config = f"{key} ({kwargs['num_slots']} slots, {kwargs['num_gpus']} GPUs)"
        stacked = np.concatenate(windows)
        for method in METHODS:
            if method in results:
                rows.append({"config": config, "load": f"real trace, {len(windows)} windows", "method": method,
                             **block_figures(results[method], stacked, slice(None), 1 / len(windows), reference)})
    return rows, notes


def speed_rows(quick: bool, methods=EPLB_METHODS) -> list[dict]:
    """Median planning time of one call (the method alone, after warm-up) on DeepSeek-V3 sizes."""
    counts = deepseek_v3_counts(seed=0).astype(np.float64)
    rows = []
    for mode, groups in (("hierarchical", 8), ("global", None)):
        deployment = make_deployment(256, 288, 32, 4, groups)
        for method in methods:
            fn = get_method(method)
            t = median_time(lambda: fn(counts, deployment), repeats=5 if quick else 21, budget_s=3 if quick else 15)
            rows.append({"mode": mode, "method": method, "wall_ms": t.wall * 1e3, "cpu_ms": t.cpu * 1e3,
                         "calls": t.calls})
    return rows


def run(quick: bool, results_dir: Path) -> str:
    results_dir = Path(results_dir)
    rows, notes = synthetic_rows(quick)
    real, missing = trace_rows(quick)
    rows += real
    missing = notes + missing
    write_csv(results_dir / "quality.csv", rows)
    speed = speed_rows(quick)
    write_csv(results_dir / "quality_speed.csv", speed)

    table = markdown_table(
        ["configuration", "load", "method", "mean gap", "max gap", "mean gap to exact bound", "balancedness",
         "shared / layer", "time ms / load"],
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
        ["loads"] + [f"{m} (default)" if m == eplb.DEFAULT_METHOD else m for m in METHODS],
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
        "bound - 1 (hierarchical configurations: the bound for placements that keep each group on one node "
        "when the plan does, else the global one: column `bound` of the CSV); figures computed by `eplb.compare` "
        "from each method's plan, "
        f"{PUBLISHED} = the published algorithm from the file `bench/{PUBLISHED_FILE.name}` compared as a "
        "user's file is; "
        "exact bound = the CP-SAT solver's proven bound (`method=\"exact\"`, Mixtral only: 8 experts); "
        "shared = slots per layer holding a second replica of an expert already on that GPU; time = the "
        "method's warm planning time in its worker process (one call on all the loads of the configuration, "
        "stacked as layers), per load. "
        f"Machine: {load_note()}.{notes}\n\n"
        "Mean gap over configurations:\n\n" + summary + "\n\nSpeed (median of repeated warm calls):\n\n"
        + speed_table + "\n\nEvery configuration:\n\n" + table + "\n"
    )


def readme_rows(results_dir: Path) -> list[tuple[str, str, str]]:
    """The README's rows: in-sample balancedness and gap to the proven bound of the default against
    the published greedy (the file's rows; eplb's ``greedy``, which reproduces it, where the CSV has
    none), DeepSeek-V3-sized realistic synthetic loads (hierarchical and global) and the real traces."""
    rows = rows_of(results_dir, "quality")
    if not rows:
        return []

    def mean(method, select, key):
        return float(np.mean([float(r[key]) for r in rows if r["method"] == method and select(r)]))

    def published(select):
        return PUBLISHED if any(r["method"] == PUBLISHED and select(r) for r in rows) else "greedy"

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
             f"the published greedy {cell(published(select), select)}")
            for what, select in cases if any(select(r) for r in rows)]


if __name__ == "__main__":
    run_alone(run, __doc__)
