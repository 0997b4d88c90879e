"""End-to-end ``eplb.plan()`` latency at DeepSeek-V3 size, with and without reading the bound.

DeepSeek-V3: 58 layers x 256 experts -> 288 slots, 32 GPUs, 4 nodes, 8 groups (hierarchical) and
the same without groups (global), realistic loads from :func:`eplb.simulation.synthetic.deepseek_v3_counts`.
``plan`` computes the lower bound only when ``.lower_bound`` / ``.gap`` is read: the script times
``plan(...)`` alone and ``plan(...).gap`` (median of many calls after a warm-up, one process).

Run: ``cd bench && python -m research.plan_latency [--repeats N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import eplb
from eplb.simulation.synthetic import DEEPSEEK_V3, deepseek_v3_counts


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (compiles on a cold cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    counts = deepseek_v3_counts(seed=0).astype(np.float64)
    base = {k: DEEPSEEK_V3[k] for k in ("num_slots", "num_gpus", "num_nodes")}
    print(f"plan() at DeepSeek-V3 size, counts {counts.shape}, median of {args.repeats} calls (ms)")
    print(f"{'mode':<14}{'plan only':>12}{'plan + .gap':>14}{'bound share':>14}")
    for mode, groups in (("hierarchical", DEEPSEEK_V3["num_groups"]), ("global", None)):
        kwargs = dict(base, num_groups=groups)
        alone = median_ms(lambda: eplb.plan(counts, **kwargs), args.repeats)
        with_gap = median_ms(lambda: eplb.plan(counts, **kwargs).gap, args.repeats)
        print(f"{mode:<14}{alone:>12.2f}{with_gap:>14.2f}{with_gap - alone:>14.2f}")


def run(quick: bool, results_dir) -> str:
    """Section of ``bench/run.py``: ``plan()`` alone and with its bound, DeepSeek-V3 size."""
    from _common import load_note, markdown_table, read_csv, write_csv  # noqa: F401

    repeats = 11 if quick else 41
    counts = deepseek_v3_counts(seed=0).astype(np.float64)
    base = {k: DEEPSEEK_V3[k] for k in ("num_slots", "num_gpus", "num_nodes")}
    rows = []
    for mode, groups in (("hierarchical", DEEPSEEK_V3["num_groups"]), ("global", None)):
        kwargs = dict(base, num_groups=groups)
        alone = median_ms(lambda: eplb.plan(counts, **kwargs), repeats)
        with_gap = median_ms(lambda: eplb.plan(counts, **kwargs).gap, repeats)
        rows.append({"mode": mode, "plan_ms": round(alone, 2), "plan_with_bound_ms": round(with_gap, 2)})
    write_csv(results_dir / "plan_latency.csv", rows)
    return ("## Plan latency\n\n`eplb.plan()` at DeepSeek-V3 size (58 x 256 -> 288 slots, 32 GPUs, 4 nodes), "
            f"median of {repeats} warm calls, alone and with `.gap` read (the bound is computed only then); "
            f"{load_note()}.\n\n"
            + markdown_table(("mode", "plan ms", "plan + bound ms"),
                             [(r["mode"], r["plan_ms"], r["plan_with_bound_ms"]) for r in rows]) + "\n")


def headline(results_dir):
    from _common import read_csv

    path = results_dir / "plan_latency.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        ms = float(r["plan_with_bound_ms"])
        out.append((f"`plan()` end to end with the lower bound, DeepSeek-V3 size, {r['mode']}",
                    f"{ms:.1f} ms (plan alone {float(r['plan_ms']):.1f} ms)", f"<= 10 ms: {'met' if ms <= 10 else 'not met'}"))
    return out


if __name__ == "__main__":
    main()
