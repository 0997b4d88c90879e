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

Then, at the batches where the step-time plan is furthest from 5% (1 and 2 sequences per GPU), two
searches that are told the held-out windows themselves (an oracle no planner has: what is left
is only the passes' randomness, not the change between windows):

- the same search on 2048 passes sampled from the held-out windows (512 each, another seed than
  the judged passes), judged on the judged passes: a search with 16 times more passes, of the very
  traffic it is judged on;
- a search of the *expected* slowest GPU itself, with nothing sampled to fit
  (:func:`expected_max_search`, 256 slots: no replicas): a GPU's activated experts in a pass are a
  sum of its experts' indicators ``1 - (1 - p_e)^n``, modelled as a normal variable with that sum's
  mean and variance, the GPUs as independent; the layout's objective is the mean over the held-out
  windows of the expected maximum over the GPUs; best swaps between pairs of GPUs from the token
  plan until none lowers it.

Run: ``cd bench && python -m research.fixed_layout_room [--quick]``.
"""

from __future__ import annotations

import math

import numpy as np
from _common import markdown_table, run_alone, write_csv
from pools import JUDGE_PASSES, JUDGE_SEED, ds_windows

import eplb
from eplb import CostModel
from eplb.planning.robust import improve_expected_peak
from eplb.simulation.pools import layer_time_bound, layer_times, plan_for_step_time, sample_passes

GPUS, TOP_K, PASSES_PER_WINDOW = 8, 8, 16
ORACLE_PASSES, ORACLE_SEED, ORACLE_BATCHES = 2048, 11, (1, 2)
_Z = np.linspace(-12.0, 12.0, 48001)
_NORMAL_CDF = np.array([0.5 * math.erfc(-z / math.sqrt(2.0)) for z in _Z])  # tabled: numpy has no erf


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """The standard normal distribution function, interpolated in a table (error below 1e-8)."""
    return np.interp(z, _Z, _NORMAL_CDF)


def step_ms(placement, passes_per_window: list[np.ndarray], cost: CostModel) -> float:
    """Mean over the windows of the predicted MoE step (ms) on their sampled passes ``[P, L, E]``."""
    return 1e3 * float(np.mean([layer_times(p, placement, cost).sum() for p in passes_per_window]))


def _pool(planning: np.ndarray, future: np.ndarray, batch: int, num_slots: int):
    """The pool at ``batch`` and ``num_slots``: its deployment, routed tokens per pass, the held-out
    windows' judged passes, and the token and step-time plans of the planning windows."""
    deployment = eplb.Deployment.of(planning.shape[2], num_slots=num_slots, num_gpus=GPUS)
    routed = batch * GPUS * TOP_K
    judged = [sample_passes(w, routed, JUDGE_PASSES, np.random.default_rng([JUDGE_SEED, i]))
              for i, w in enumerate(future)]
    token_plan = eplb.plan(planning, deployment)
    step_plan, _ = plan_for_step_time(planning, deployment, batch=batch, hardware="H200")
    return deployment, routed, judged, token_plan, step_plan


def _searched(passes: np.ndarray, start, deployment, cost: CostModel):
    """The fixed layout found by searching, from ``start``, its own objective on ``passes [P, L, E]``
    (each pass's load of an expert: a weight read if it received a token, plus its tokens' bytes)."""
    loads = (passes > 0) + passes * (cost.token_bytes / cost.expert_bytes)  # in expert reads
    phy2log, _ = improve_expected_peak(loads, start.phy2log, deployment, folds=0, anchor=0.0)
    return eplb.Placement(phy2log=phy2log, num_experts=passes.shape[2], topology=start.topology)


def measure(planning: np.ndarray, future: np.ndarray, batch: int, num_slots: int, cost: CostModel) -> dict:
    deployment, routed, judged, token_plan, step_plan = _pool(planning, future, batch, num_slots)
    rng = np.random.default_rng(7)
    searched_on = np.concatenate([sample_passes(w, routed, PASSES_PER_WINDOW, rng) for w in planning])  # [P, L, E]
    searched = _searched(searched_on, step_plan, deployment, cost)
    tokens_ms = step_ms(token_plan, judged, cost)
    row = {"batch": batch, "num_slots": num_slots, "tokens_ms": tokens_ms, "step_ms": step_ms(step_plan, judged, cost),
           "search_in_sample_ms": step_ms(searched, [searched_on], cost),
           "step_in_sample_ms": step_ms(step_plan, [searched_on], cost),
           "search_held_out_ms": step_ms(searched, judged, cost),
           "bound_ms": 1e3 * float(np.mean([layer_time_bound(p, GPUS, cost).sum() for p in judged]))}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def expected_max_search(windows: np.ndarray, phy2log: np.ndarray, routed: int, grid_points: int = 160,
                        max_sweeps: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Search a layout without replicas for the lowest expected count of activated slots on its
    slowest GPU, in a model with nothing sampled.

    Per window and layer, expert ``e`` is activated in a pass with probability ``a_e = 1 - (1 - p_e)^n``
    (``p_e`` its share of the layer's tokens, ``n = routed``); a GPU's activated experts are modelled
    as a normal variable with mean ``sum a_e`` and variance ``sum a_e (1 - a_e)`` over its experts,
    the GPUs as independent, and the objective is the mean over the windows of ``E[max over GPUs]``
    (integrated on a grid). From ``phy2log``, for every pair of GPUs the best of all swaps between
    them is taken while it lowers the objective, sweeping the pairs until none does.

    Args:
        windows: ``[T, L, E]`` counts whose traffic the layout should serve.
        phy2log: ``[L, S]`` a layout with ``S = E`` slots, ``E / G`` per GPU (:data:`GPUS`).
        routed: ``n``; grid_points: the integration grid; max_sweeps: sweeps of all pairs per layer.
    Returns:
        ``(phy2log [L, S], before [L], after [L])``: the searched layout and the objective (expected
        activated slots on the slowest GPU, mean over windows) per layer before and after.
    """
    share = windows / windows.sum(axis=2, keepdims=True)
    active = -np.expm1(routed * np.log1p(-share))  # [T, L, E]
    per_gpu = phy2log.shape[1] // GPUS
    result, before, after = phy2log.copy(), np.empty(len(phy2log)), np.empty(len(phy2log))
    for layer in range(len(phy2log)):
        a = active[:, layer]
        v = a * (1.0 - a)
        grid = np.linspace(0.0, 3.0 * a.sum(axis=1).max() / GPUS + 10.0, grid_points)
        step = grid[1] - grid[0]

        def expected_max(cdf):  # cdf [T, ..., K] of the maximum -> mean over windows of E[max]
            return (grid[0] + (1.0 - cdf).sum(axis=-1) * step).mean(axis=0)

        def cdf_of(mean, var):  # [..., ] -> [..., K]
            return normal_cdf((grid - mean[..., None]) / np.sqrt(np.maximum(var, 1e-12))[..., None])

        gpus = result[layer].reshape(GPUS, per_gpu).copy()
        best = before[layer] = expected_max(cdf_of(a[:, gpus].sum(-1), v[:, gpus].sum(-1)).prod(axis=1))
        for _ in range(max_sweeps):
            improved = False
            for g in range(GPUS):
                for h in range(g + 1, GPUS):
                    mean, var = a[:, gpus].sum(-1), v[:, gpus].sum(-1)  # [T, G]
                    rest = cdf_of(np.delete(mean, (g, h), 1), np.delete(var, (g, h), 1)).prod(axis=1)  # [T, K]
                    out_a, in_a = a[:, gpus[g], None], a[:, None, gpus[h]]  # [T, k, 1], [T, 1, k]
                    out_v, in_v = v[:, gpus[g], None], v[:, None, gpus[h]]
                    cdf = (rest[:, None, None] * cdf_of(mean[:, g, None, None] - out_a + in_a, var[:, g, None, None] - out_v + in_v)
                           * cdf_of(mean[:, h, None, None] + out_a - in_a, var[:, h, None, None] + out_v - in_v))
                    values = expected_max(cdf)  # [k, k]: swap i of g with j of h
                    i, j = np.unravel_index(np.argmin(values), values.shape)
                    if values[i, j] < best - 1e-9:
                        gpus[g, i], gpus[h, j] = gpus[h, j], gpus[g, i]
                        best, improved = values[i, j], True
            if not improved:
                break
        result[layer], after[layer] = gpus.reshape(-1), best
    return result, before, after


def oracle(planning: np.ndarray, future: np.ndarray, batch: int, num_slots: int, cost: CostModel) -> dict:
    """The searches told the held-out windows (module docstring), beside the token and step-time plans."""
    deployment, routed, judged, token_plan, step_plan = _pool(planning, future, batch, num_slots)
    rng = np.random.default_rng(ORACLE_SEED)
    searched_on = np.concatenate([sample_passes(w, routed, ORACLE_PASSES // len(future), rng) for w in future])
    searched = _searched(searched_on, step_plan, deployment, cost)
    row = {"batch": batch, "num_slots": num_slots, "tokens_ms": step_ms(token_plan, judged, cost),
           "step_ms": step_ms(step_plan, judged, cost),
           "oracle_search_in_sample_ms": step_ms(searched, [searched_on], cost),
           "step_on_oracle_passes_ms": step_ms(step_plan, [searched_on], cost),
           "oracle_search_held_out_ms": step_ms(searched, judged, cost),
           "expected_max_search_ms": float("nan"), "expected_max_before": float("nan"),
           "expected_max_after": float("nan")}
    if num_slots == planning.shape[2]:
        phy2log, before, after = expected_max_search(future, token_plan.phy2log, routed)
        modelled = eplb.Placement(phy2log=phy2log, num_experts=planning.shape[2], topology=token_plan.topology)
        row.update(expected_max_search_ms=step_ms(modelled, judged, cost),
                   expected_max_before=float(before.mean()), expected_max_after=float(after.mean()))
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
    told = [oracle(planning, future, batch, slots, cost)
            for batch in (ORACLE_BATCHES[:1] if quick else ORACLE_BATCHES) for slots in (256, 272)]
    write_csv(results_dir / "fixed_layout_room_oracle.csv", told)
    told_table = [(r["num_slots"], r["batch"], f"{r['tokens_ms']:.3f}", f"{r['step_ms']:.3f}",
                   pct(r["oracle_search_in_sample_ms"], r["step_on_oracle_passes_ms"]),
                   f"{r['oracle_search_held_out_ms']:.3f} ({pct(r['oracle_search_held_out_ms'], r['step_ms'])})",
                   "" if np.isnan(r["expected_max_search_ms"]) else
                   f"{r['expected_max_before']:.3f} -> {r['expected_max_after']:.3f}; "
                   f"{r['expected_max_search_ms']:.3f} ({pct(r['expected_max_search_ms'], r['tokens_ms'])})")
                  for r in told]
    return "\n".join([
        "## Fixed-layout room (8 H200, small decode batches)", "",
        "DeepSeek-V3 on 8 H200 GPUs, DeepSeek-V3-sized windows (8 planning, 4 held out, "
        f"{JUDGE_PASSES} sampled passes each). The search minimises a fixed layout's own objective on "
        f"{8 * PASSES_PER_WINDOW} passes sampled from the planning windows, from the step-time plan; "
        "its change in sample is against the step-time plan on those passes, held out against the "
        "step-time plan held out.", "",
        markdown_table(("slots", "sequences per GPU", "token plan ms", "step-time plan ms", "search, in sample",
                        "search, held out ms", "bound of a layout remade per pass ms"), table), "",
        "Told the held-out windows: the search on "
        f"{ORACLE_PASSES} passes sampled from them (in sample: against the step-time plan on those passes; "
        "held out: on the judged passes, against the step-time plan), and the expected-maximum search "
        "(no replicas; its modelled activated slots on the slowest GPU, mean over layers, before and after, "
        "then its step time on the judged passes against the token plan).", "",
        markdown_table(("slots", "sequences per GPU", "token plan ms", "step-time plan ms", "search, in sample",
                        "search, held out ms", "expected-maximum search"), told_table)])


if __name__ == "__main__":
    run_alone(run, __doc__)
