"""The built-in example: plan a DeepSeek-V3-sized model and show what rebalancing buys."""

from __future__ import annotations

import time

import numpy as np

from .analysis import metrics
from .planning.api import plan
from .planning.methods import DEFAULT_METHOD
from .simulation.synthetic import DEEPSEEK_V3, deepseek_v3_counts


def run_demo(methods: tuple[str, ...] | None = None, seed: int = 0) -> list[dict]:
    """Plan the example with each method (greedy and the default unless given).

    Returns one row per method: mean balancedness, mean gap to the lower bound, mean replicas
    sharing a GPU, the method's time on a second (warm) call and the whole first call of ``plan``
    (which loads compiled code and computes the bounds) in milliseconds. The first row is the
    placement without rebalancing (experts spread in order, no replicas).
    """
    config = DEEPSEEK_V3
    counts = deepseek_v3_counts(seed)
    if methods is None:
        methods = tuple(dict.fromkeys(("greedy", DEFAULT_METHOD)))
    static = metrics.static_gpu_loads(counts, config["num_gpus"])
    rows = [{"method": "no rebalancing", "balancedness": float(metrics.moe_mean(metrics.balancedness(static), counts)),
             "gap": None, "shared": None, "ms": None, "first_call_ms": None}]
    kwargs = {k: config[k] for k in ("num_slots", "num_gpus", "num_nodes", "num_groups")}
    for method in methods:
        start = time.perf_counter()
        plan(counts, method=method, **kwargs)  # the first call may compile or load compiled code
        first = time.perf_counter() - start
        placement = plan(counts, method=method, **kwargs)
        rows.append({
            "method": method,
            "balancedness": float(metrics.moe_mean(placement.balancedness(counts), counts)),
            "gap": float(metrics.moe_mean(placement.gap, counts)),
            "shared": float(placement.replicas_sharing_a_gpu().mean()),
            "ms": placement.info["time_s"] * 1e3,
            "first_call_ms": first * 1e3,
        })
    return rows


def format_demo(rows: list[dict]) -> str:
    c = DEEPSEEK_V3
    lines = [
        f"DeepSeek-V3-sized example: {c['num_layers']} MoE layers x {c['num_experts']} experts, "
        f"{c['num_slots']} slots on {c['num_gpus']} GPUs in {c['num_nodes']} nodes, {c['num_groups']} groups",
        "synthetic skewed counts (hottest expert ~6x the mean), seed 0",
        "",
        f"{'method':<16}{'balancedness':>13}{'gap to bound':>14}{'shared GPU':>12}{'method time':>13}{'1st plan()':>12}",
    ]
    for r in rows:
        gap = "" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
        shared = "" if r["shared"] is None else f"{r['shared']:.2f}"
        ms = "" if r["ms"] is None else f"{r['ms']:.1f} ms"
        first = "" if r["first_call_ms"] is None else f"{r['first_call_ms']:.0f} ms"
        lines.append(f"{r['method']:<16}{r['balancedness']:>13.4f}{gap:>14}{shared:>12}{ms:>13}{first:>12}")
    lines += [
        "",
        "balancedness = mean / max GPU load per layer, averaged over the MoE layers (1.0 is perfect)",
        "gap = max GPU load / proven lower bound - 1 (0% is provably optimal); the bound is hierarchical:",
        f"  each of the {c['num_groups']} expert groups on one of the {c['num_nodes']} nodes, as the plans keep them",
        "shared GPU = replicas per layer placed on a GPU that already holds that expert",
        "method time = a warm call of the method; 1st plan() = the first call in this process, with the",
        "  bounds (a source install ships the kernels compiled; otherwise the very first run compiles them)",
    ]
    return "\n".join(lines)
