"""End-to-end ``eplb.plan()`` latency at DeepSeek-V3 size, with and without reading the bound.

DeepSeek-V3: 58 layers x 256 experts -> 288 slots, 32 GPUs, 4 nodes, 8 groups (hierarchical) and
the same without groups (global), realistic loads from :func:`eplb.synthetic.deepseek_v3_counts`.
``plan`` computes the lower bound only when ``.lower_bound`` / ``.gap`` is read: the script times
``plan(...)`` alone and ``plan(...).gap`` (median of many calls after a warm-up, one process).

Run: ``python bench/plan_latency.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import eplb
from eplb.synthetic import DEEPSEEK_V3, deepseek_v3_counts


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


if __name__ == "__main__":
    main()
