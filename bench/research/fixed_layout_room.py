"""Small decode batches: is the room below the step-time plan reachable by any fixed layout?

On 8 H200 GPUs at 1-16 sequences per GPU (DeepSeek-V3), the step-time lower bound
(``eplb.simulation.pools.layer_time_bound``) sits 7-32% below the best plans held out. That bound
holds for a layout remade for every pass; an engine keeps one layout for many passes, and in each
pass only the experts its few tokens chose are read, a different set every pass. This script asks
how much of the room a *fixed* layout could take, by searching for one directly on the objective a
fixed layout is judged by: the mean over passes of the slowest GPU's weight reads and token bytes.

On the pools of ``bench/pools.py`` (DeepSeek-V3-sized windows: 8 planning, 4 held out), per
batch and slot count:

- the token plan and the step-time plan (``plan_for_step_time``), held-out MoE step (ms);
- the search: 16 passes sampled from each planning window (128 in all) given to
  ``eplb.planning.robust.improve_expected_peak`` as windows (each pass's load of an expert: its
  weight bytes if it received a token, plus its tokens' bytes; no cross-validation, no anchor),
  from the step-time plan; its step time on those same passes (in sample) and held out;
- the lower bound of any layout remade per pass, held out.

If the search lowers its in-sample step time by much more than it lowers the held-out one, the
room is the passes' randomness, which no layout fixed in advance removes.

Run: ``cd bench && python -m research.fixed_layout_room [--quick]``.
"""

from __future__ import annotations

import numpy as np
from _common import markdown_table, run_alone, write_csv
from pools import JUDGE_PASSES, JUDGE_SEED, ds_windows

import eplb
from eplb import CostModel
from eplb.planning.robust import improve_expected_peak
from eplb.simulation.pools import layer_time_bound, layer_times, plan_for_step_time, sample_passes

GPUS, TOP_K, PASSES_PER_WINDOW = 8, 8, 16


def step_ms(placement, passes_per_window: list[np.ndarray], cost: CostModel) -> float:
    """Mean over the windows of the predicted MoE step (ms) on their sampled passes ``[P, L, E]``."""
    return 1e3 * float(np.mean([layer_times(p, placement, cost).sum() for p in passes_per_window]))


def measure(planning: np.ndarray, future: np.ndarray, batch: int, num_slots: int, cost: CostModel) -> dict:
    deployment = eplb.Deployment.of(planning.shape[2], num_slots=num_slots, num_gpus=GPUS)
    routed = batch * GPUS * TOP_K
    judged = [sample_passes(w, routed, JUDGE_PASSES, np.random.default_rng([JUDGE_SEED, i]))
              for i, w in enumerate(future)]
    token_plan = eplb.plan(planning, deployment)
    step_plan, _ = plan_for_step_time(planning, deployment, batch=batch, hardware="H200")
    rng = np.random.default_rng(7)
    searched_on = np.concatenate([sample_passes(w, routed, PASSES_PER_WINDOW, rng) for w in planning])  # [P, L, E]
    loads = (searched_on > 0) + searched_on * (cost.token_bytes / cost.expert_bytes)  # in expert reads
    phy2log, _ = improve_expected_peak(loads, step_plan.phy2log, deployment, folds=0, anchor=0.0)
    searched = eplb.Placement(phy2log=phy2log, num_experts=planning.shape[2], topology=step_plan.topology)
    tokens_ms = step_ms(token_plan, judged, cost)
    row = {"batch": batch, "num_slots": num_slots, "tokens_ms": tokens_ms, "step_ms": step_ms(step_plan, judged, cost),
           "search_in_sample_ms": step_ms(searched, [searched_on], cost),
           "step_in_sample_ms": step_ms(step_plan, [searched_on], cost),
           "search_held_out_ms": step_ms(searched, judged, cost),
           "bound_ms": 1e3 * float(np.mean([layer_time_bound(p, GPUS, cost).sum() for p in judged]))}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def run(quick: bool, results_dir) -> str:
    """Section of ``bench/run.py``: the table above."""
    windows = ds_windows(12).astype(np.float64)
    planning, future = windows[:8], windows[8:]
    cost = CostModel.preset("H200", "deepseek-v3")
    rows = [measure(planning, future, batch, slots, cost)
            for slots in ((272,) if quick else (264, 272)) for batch in ((1, 16) if quick else (1, 2, 4, 8, 16))]
    write_csv(results_dir / "fixed_layout_room.csv", rows)

    def pct(a, b):
        return f"{100 * (a / b - 1):+.2f}%"

    table = [(r["num_slots"], r["batch"], f"{r['tokens_ms']:.3f}", f"{r['step_ms']:.3f} ({pct(r['step_ms'], r['tokens_ms'])})",
              pct(r["search_in_sample_ms"], r["step_in_sample_ms"]),
              f"{r['search_held_out_ms']:.3f} ({pct(r['search_held_out_ms'], r['step_ms'])})",
              f"{r['bound_ms']:.3f} ({pct(r['bound_ms'], r['step_ms'])})") for r in rows]
    return "\n".join([
        "## Fixed-layout room (8 H200, small decode batches)", "",
        "DeepSeek-V3 on 8 H200 GPUs, DeepSeek-V3-sized windows (8 planning, 4 held out, "
        f"{JUDGE_PASSES} sampled passes each). The search minimises a fixed layout's own objective on "
        f"{8 * PASSES_PER_WINDOW} passes sampled from the planning windows, from the step-time plan; "
        "its change in sample is against the step-time plan on those passes, held out against the "
        "step-time plan held out.", "",
        markdown_table(("slots", "sequences per GPU", "token plan ms", "step-time plan ms", "search, in sample",
                        "search, held out ms", "bound of a layout remade per pass ms"), table)])


if __name__ == "__main__":
    run_alone(run, __doc__)
