"""How much a replica's activation counted as its expectation flatters a layout's step time.

``eplb.simulate`` (``dispatch="uniform"``) prices a slot of an expert with ``r`` replicas and ``c``
tokens as ``1 - (1 - 1/r)^c`` activations, its expectation, and a layer as its slowest GPU. That
is exact for each GPU's mean, but the slowest GPU of the expected activations is below the expected
slowest GPU: an expert's single token is one whole read on one GPU, not half a read on each of two.
``eplb.simulation.pools.layer_times`` (``eplb.recommend``, ``plan_for_step_time``) draws which replica
each token goes to instead. This script prices the same passes both ways, per batch size, for the
token plan (replicas of the hot experts) on 32 H100 at 288 slots and 8 H200 at 272:
``100 * (expectation / drawn - 1)``, negative where the expectation is too fast.

Run: ``cd bench && python -m research.split_bias [--quick]``.
"""

from __future__ import annotations

import numpy as np
from _common import markdown_table, run_alone, write_csv
from pools import ds_windows

import eplb
from eplb import CostModel
from eplb.analysis.dispatch import uniform_shares
from eplb.analysis.loads import RANDOM_SPLIT, gpu_work
from eplb.simulation.pools import layer_times, sample_passes

POOLS = (("32 H100, 288 slots", "H100", 32, 288), ("8 H200, 272 slots", "H200", 8, 272))
TOKENS_PER_GPU = (1, 2, 4, 16, 64, 256, 4096)
PASSES_PER_WINDOW, TOP_K = 8, 8


def run(quick: bool, results_dir) -> str:
    """Section of ``bench/run.py``: the table above."""
    windows = ds_windows(12).astype(np.float64)
    planning, future = windows[:8], windows[8:]
    rows = []
    for name, hardware, gpus, num_slots in POOLS:
        cost = CostModel.preset(hardware, "deepseek-v3")
        placement = eplb.plan(planning, eplb.Deployment.of(256, num_slots=num_slots, num_gpus=gpus))
        shares = uniform_shares(placement.phy2log, placement.logcnt)[None]
        for per_gpu in TOKENS_PER_GPU[:3] if quick else TOKENS_PER_GPU:
            passes = np.concatenate([sample_passes(w, per_gpu * gpus * TOP_K, PASSES_PER_WINDOW,
                                                   np.random.default_rng([5, i])) for i, w in enumerate(future)])
            tokens, active = gpu_work(passes, placement.phy2log, placement.topology, shares, RANDOM_SPLIT)
            expected = 1e3 * float(cost.layer_time(tokens, active).mean(axis=0).sum())
            drawn = 1e3 * float(layer_times(passes, placement, cost).sum())
            rows.append({"pool": name, "tokens_per_gpu": per_gpu, "expectation_ms": round(expected, 4),
                         "drawn_ms": round(drawn, 4), "expectation_vs_drawn_pct": round(100 * (expected / drawn - 1), 3)})
    write_csv(results_dir / "split_bias.csv", rows)
    return "\n".join([
        "## A replica's activation as its expectation", "",
        f"DeepSeek-V3, the token plan of 8 DeepSeek-V3-sized windows, {4 * PASSES_PER_WINDOW} passes sampled "
        "from 4 others; MoE step time with each replica's activation counted as its expectation "
        "(`eplb.simulate`, uniform dispatch) and with the split drawn (`eplb.recommend`).", "",
        markdown_table(("pool", "tokens per GPU", "expectation ms", "drawn ms", "expectation vs drawn"),
                       [(r["pool"], r["tokens_per_gpu"], f"{r['expectation_ms']:.4f}", f"{r['drawn_ms']:.4f}",
                         f"{r['expectation_vs_drawn_pct']:+.2f}%") for r in rows])])


if __name__ == "__main__":
    run_alone(run, __doc__)
