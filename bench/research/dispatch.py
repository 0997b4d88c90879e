"""Speed of optimal dispatch: the exact shares for one batch, DeepSeek-V3 size, one core.

``cd bench && python -m research.dispatch`` prints a markdown section (``--csv PATH`` also writes the rows).
The target (issue 16) is under 1 ms for 58 layers x 288 slots; timings are medians of many calls
of the kernel alone (what a serving loop calls per batch) and of ``eplb.dispatch`` (with its
input checks), on plans made from other counts than the batch (so experts really get split).
Wall and CPU medians are both given: the machine is shared, CPU time is the less inflated one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _common import load_note, median_time, write_csv

import eplb
from eplb import dispatch
from eplb.kernels.split.shares import optimal_shares
from eplb.simulation.synthetic import DEEPSEEK_V3, drifting_counts

CASES = (
    ("global 288 slots / 32 GPUs", dict(num_slots=288, num_gpus=32, num_nodes=1, num_groups=None)),
    ("global 320 slots / 32 GPUs", dict(num_slots=320, num_gpus=32, num_nodes=1, num_groups=None)),
    ("hierarchical 288 / 32 GPUs / 4 nodes", dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)),
)


def run(quick: bool = False, results_dir: Path | None = None, csv_path: Path | None = None) -> str:
    repeats = 50 if quick else 400
    layers, experts = DEEPSEEK_V3["num_layers"], DEEPSEEK_V3["num_experts"]
    series = drifting_counts(4, layers, experts, drift=0.2, tokens=16384, num_groups=8, seed=11).astype(np.float64)
    rows = []
    for label, config in CASES:
        placement = eplb.plan(series[:3], **config)
        batch = np.ascontiguousarray(series[3])
        gpu_of_slot = placement.topology.gpu_of_slot
        phy2log = np.ascontiguousarray(placement.phy2log)
        kernel = median_time(lambda: optimal_shares(batch, phy2log, gpu_of_slot, placement.num_gpus),
                             repeats=repeats, budget_s=5.0, warmup=3)
        checked = median_time(lambda: dispatch(batch, placement), repeats=repeats // 4, budget_s=5.0, warmup=1)
        shares, peak = optimal_shares(batch, phy2log, gpu_of_slot, placement.num_gpus)
        uniform = placement.gpu_loads(batch).max(axis=1)
        mean = batch.sum(axis=1) / placement.num_gpus
        split = sum(int((np.bincount(phy2log[l][shares[l] > 0], minlength=experts) > 1).sum()) for l in range(layers))
        rows.append({
            "case": label,
            "layers": layers,
            "slots": placement.num_slots,
            "kernel_wall_ms": round(kernel.wall * 1e3, 4),
            "kernel_cpu_ms": round(kernel.cpu * 1e3, 4),
            "dispatch_wall_ms": round(checked.wall * 1e3, 4),
            "calls": kernel.calls,
            "balancedness_uniform": round(float((mean / uniform).mean()), 4),
            "balancedness_optimal": round(float((mean / peak).mean()), 4),
            "split_experts_per_layer": round(split / layers, 2),
        })
    if results_dir is not None:
        write_csv(Path(results_dir) / "dispatch.csv", rows)
    if csv_path is not None:
        write_csv(csv_path, rows)
    lines = [
        "## Optimal dispatch: speed (one batch, 58 layers, DeepSeek-V3 size)",
        "",
        f"Median of up to {repeats} calls; {load_note()}. Plan made from three windows of a drifting series, "
        "the batch is the fourth. Target: < 1 ms per call.",
        "",
        "| case | kernel wall ms | kernel CPU ms | eplb.dispatch wall ms | balancedness uniform -> optimal "
        "| split experts / layer |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['kernel_wall_ms']:.3f} | {row['kernel_cpu_ms']:.3f} | "
            f"{row['dispatch_wall_ms']:.3f} | {row['balancedness_uniform']:.4f} -> {row['balancedness_optimal']:.4f} "
            f"| {row['split_experts_per_layer']} |"
        )
    return "\n".join(lines)


def headline(results_dir):
    from _common import read_csv

    path = Path(results_dir) / "dispatch.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        ms = float(r["kernel_wall_ms"])
        target = f"< 1 ms: {'met' if ms < 1 else 'not met'}" if r["case"].startswith("global 288") else "reported"
        out.append((f"Optimal dispatch of one batch, 58 layers, {r['case']} (balancedness even split -> optimal)",
                    f"{ms:.2f} ms ({float(r['balancedness_uniform']):.3f} -> {float(r['balancedness_optimal']):.3f})",
                    target))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--csv", type=Path, default=None, help="also write the rows to this CSV file")
    args = parser.parse_args()
    print(run(args.quick, None, args.csv))
