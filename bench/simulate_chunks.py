"""Simulate, chunked: a rebalance applied all at once against ``layers_per_step`` layers per step.

The DeepSeek-V3-sized drifting synthetic series of ``bench/simulate.py`` (58 x 256, top-8, 7
related workloads one after the other, passes of 4096 tokens; its ``scenarios``), served on its two
deployments (288 slots / 32 GPUs / 4 nodes, global and hierarchical) by the Balancer with its
defaults checked every 100 passes (``policies``), copies priced as a stall (compute-bound H100 cost
model, H100 NVLink / 400 Gb/s IB at 80%). Each rebalance is applied all at once (one stall after
the step the plan came) or 1, 4, 8 or 16 layers per step (one stall per chunk, in layer order).
Reported: time lost to imbalance (without and with stalls, as a share of the balanced time), the
total and the longest single stall, copies, and the simulation's wall time.

Run: ``python bench/simulate_chunks.py [--quick]`` (results in ``bench/results/simulate_chunks.{csv,md}``).
"""

from __future__ import annotations

import os
from pathlib import Path

from _common import load_note, markdown_table, rows_of, run_alone, write_csv, write_section
from simulate import BLOCK, QUICK_BLOCKS, Cached, policies, scenarios

from eplb import simulate

LAYERS_PER_STEP = (None, 1, 4, 8, 16)


def _label(k: int | None) -> str:
    return "all at once" if k is None else f"{k} layer{'s' if k > 1 else ''} per step"


def measure(blocks: int) -> list[dict]:
    found, _ = scenarios(blocks)
    scenario = next(s for s in found if s["series"].startswith("DeepSeek-V3-sized synthetic"))
    data = Cached(scenario["data"])
    cost = scenario["cost"].with_(copy_mode="stall")
    rows = []
    for deployment_name, deployment in scenario["deployments"]:
        for k in LAYERS_PER_STEP:
            policy = next(p for key, p, _ in policies() if key == "balancer")
            result = simulate(data, deployment, policy=policy, cost_model=cost, initial_steps=BLOCK,
                              layers_per_step=k)
            summary = result.summary()
            rows.append({
                "series": scenario["series"], "deployment": deployment_name, "policy": summary["policy"],
                "layers_per_step": "" if k is None else k, "applied": _label(k), "steps": summary["steps"],
                "lost_share": round(summary["lost_share"], 5),
                "lost_with_stalls_share": round(summary["lost_with_stalls_share"], 5),
                "stall_s": round(summary["stall_time_s"], 4), "max_stall_ms": round(1e3 * summary["max_stall_s"], 2),
                "steps_with_stall": int((result.stall_time > 0).sum()),
                "rebalances": summary["rebalances"], "copies": summary["copies"],
                "copies_cross_node": summary["copies_cross_node"], "wall_s": round(summary["wall_time_s"], 2),
            })
    return rows


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    """README headline rows ``(figure, measured, target)``: the longest stall and the time lost with
    stalls, all at once against one layer per step, per deployment."""
    rows = rows_of(results_dir, "simulate_chunks")
    if not rows:
        return []
    out = []
    for deployment in dict.fromkeys(r["deployment"] for r in rows):
        get = {r["applied"]: r for r in rows if r["deployment"] == deployment}
        whole, single = get.get(_label(None)), get.get(_label(1))
        if whole is None or single is None:
            continue
        out.append((f"Longest stall of a rebalance, Balancer defaults, DeepSeek-V3 size {deployment}: all at once "
                    f"vs 1 layer per step",
                    f"{float(whole['max_stall_ms']):.1f} ms vs {float(single['max_stall_ms']):.1f} ms; time lost with "
                    f"stalls {100 * float(whole['lost_with_stalls_share']):.2f}% vs "
                    f"{100 * float(single['lost_with_stalls_share']):.2f}%",
                    "no target (the issue asks for the option)"))
    return out


def run(quick: bool, results_dir: Path, *, blocks: int | None = None) -> str:
    """The section's markdown; ``blocks`` overrides the series length (tests)."""
    blocks = blocks or (QUICK_BLOCKS if quick else 900)
    rows = measure(blocks)
    results_dir = Path(results_dir)
    write_csv(results_dir / "simulate_chunks.csv", rows)
    header = ["deployment", "applied", "MoE time lost", "with stalls", "stalls in all", "longest stall",
              "steps with a stall", "rebalances", "copies", "cross-node", "wall"]
    table = markdown_table(header, [
        (r["deployment"], r["applied"], f"{100 * r['lost_share']:.2f}%", f"{100 * r['lost_with_stalls_share']:.2f}%",
         f"{r['stall_s']:.3f} s", f"{r['max_stall_ms']:.1f} ms", r["steps_with_stall"], r["rebalances"], r["copies"],
         r["copies_cross_node"], f"{r['wall_s']} s") for r in rows])
    text = "\n".join([
        "## Simulate: a rebalance applied in chunks of layers",
        "",
        f"{rows[0]['series']}: {blocks} blocks of {BLOCK} passes; {rows[0]['policy']}, from the greedy plan of "
        f"the first block; compute-bound H100 cost model, copies stall serving (H100 NVLink / 400 Gb/s IB at "
        f"80%). A rebalance applied all at once stalls once, for all its copies; applied k layers per step "
        f"(in layer order), it stalls after each of its steps for that chunk's copies, and meanwhile the layers "
        f"not yet switched serve their old placement. Each chunk waits for its own slowest GPU, so the chunks' "
        f"stalls add up to at least the all-at-once stall. Wall time: one simulation, "
        f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'unset')}. {load_note()}.",
        "",
        table,
        "",
    ])
    return write_section(results_dir, "simulate_chunks", text)


if __name__ == "__main__":
    run_alone(run, __doc__)
