"""Survive a lost GPU or node: ``eplb.plan(..., survive="gpu" | "node")`` against the plain plan,
and what reporting the exposure costs every plan.

Counts: DeepSeek-V3 size (58 layers x 256 experts, top-8, 8 groups). *In sample*: the synthetic
``eplb.simulation.synthetic.deepseek_v3_counts()``, planned and judged on the same counts. *Out of
sample*: a drifting series (``drifting_counts(T + F, 58, 256, num_groups=8, drift=0.1)``): planned
from its first ``T`` windows (a series: hedged, the default), judged on the ``F`` windows after
them (mean over windows of the mean MoE-layer balancedness; exposure on their summed counts).

Exposure: ``worst_gpu_loss`` / ``worst_node_loss``, the largest share of all routed tokens whose
expert loses every replica when one GPU / one node is lost (:mod:`eplb.analysis.exposure`); the
*floor* is what no placement at that slot count can beat (:func:`eplb.planning.survivability.exposure_floor`).

Targets (issue 42, item 6):

1. ``survive="node"`` at 512 slots / 32 GPUs / 4 nodes: every expert on two nodes, balancedness
   within 0.01 of the plain plan (in and out of sample).
2. ``survive="gpu"`` at 288 slots / 32 GPUs: the worst single-GPU loss orphans at most half the
   tokens of the plain plan's, balancedness within 0.01.
3. The exposure on every plan costs a small fraction of a plan (median times at DeepSeek-V3 size).

Run: ``python bench/survive.py [--quick]`` (results in ``bench/results/survive.{md,csv}``).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from _common import load_note, markdown_table, median_time, run_alone, write_csv

import eplb
from eplb.analysis.exposure import sole_domain, worst_loss
from eplb.planning.survivability import exposure_floor
from eplb.simulation.synthetic import deepseek_v3_counts, drifting_counts

GPUS, NODES, GROUPS = 32, 4, 8
CASES = (  # (name, slots, survive, hierarchical): the targets' two first
    ("node, 512 slots", 512, "node", False),
    ("gpu, 288 slots", 288, "gpu", False),
    ("node, 288 slots", 288, "node", False),
    ("gpu, 512 slots", 512, "gpu", False),
    ("gpu, 288 slots, hierarchical", 288, "gpu", True),
    ("gpu, 512 slots, hierarchical", 512, "gpu", True),
)
SWEEP = (288, 320, 352, 384, 416, 448, 512)  # survive="gpu" against slots: where halving the exposure becomes possible
KEY = {"gpu": "worst_gpu_loss", "node": "worst_node_loss"}


def settings(quick: bool) -> dict:
    if quick:
        return dict(recorded=4, future=2, cases=CASES[:2], sweep=(288, 384, 512), repeats=5)
    return dict(recorded=8, future=4, cases=CASES, sweep=SWEEP, repeats=21)


def keywords(slots: int, hierarchical: bool) -> dict:
    return dict(num_slots=slots, num_gpus=GPUS, num_nodes=NODES, num_groups=GROUPS if hierarchical else None)


def on_two(placement: eplb.Placement, survive: str) -> float:
    """Share of the (layer, expert) pairs whose replicas span two or more GPUs (nodes)."""
    topology = placement.topology
    domain = topology.gpu_of_slot if survive == "gpu" else topology.node_of_gpu[topology.gpu_of_slot]
    return float((sole_domain(placement.phy2log, domain, placement.num_experts) < 0).mean())


def judged(placement: eplb.Placement, counts: np.ndarray) -> dict:
    """Balancedness (mean over MoE layers, and over windows for a series) and exposure on ``counts``."""
    windows = counts if counts.ndim == 3 else counts[None]
    balance = float(np.mean([placement.balancedness(w).mean() for w in windows]))
    return {"balancedness": balance, **worst_loss(windows.sum(axis=0), placement.phy2log, placement.topology)}


def case_rows(cfg: dict) -> list[dict]:
    counts = deepseek_v3_counts().astype(float)
    series = drifting_counts(cfg["recorded"] + cfg["future"], 58, 256, num_groups=GROUPS, seed=42).astype(float)
    recorded, future = series[:cfg["recorded"]], series[cfg["recorded"]:]
    rows = []
    for name, slots, survive, hierarchical in cfg["cases"]:
        for sample, plan_on, judge_on in (("in sample", counts, counts), ("out of sample", recorded, future)):
            for how in ("plain", f"survive={survive}"):
                extra = {} if how == "plain" else {"survive": survive}
                start = time.perf_counter()
                placement = eplb.plan(plan_on, **keywords(slots, hierarchical), **extra)
                seconds = time.perf_counter() - start
                rows.append({"case": name, "sample": sample, "plan": how, "survive": survive, "num_slots": slots,
                             "hierarchical": hierarchical, **judged(placement, judge_on),
                             "on_two": on_two(placement, survive), "plan_s": round(seconds, 3),
                             "floor": exposure_floor(judge_on.sum(axis=0) if judge_on.ndim == 3 else judge_on, slots,
                                                     GPUS if survive == "gpu" else NODES)})
    return rows


def sweep_rows(cfg: dict) -> list[dict]:
    counts = deepseek_v3_counts().astype(float)
    rows = []
    plain_288 = eplb.plan(counts, **keywords(288, False)).info["worst_gpu_loss"]
    for slots in cfg["sweep"]:
        plain = eplb.plan(counts, **keywords(slots, False))
        survived = eplb.plan(counts, **keywords(slots, False), survive="gpu")
        rows.append({"num_slots": slots, "plain_gpu_loss": plain.info["worst_gpu_loss"],
                     "survive_gpu_loss": survived.info["worst_gpu_loss"], "floor": exposure_floor(counts, slots, GPUS),
                     "vs_plain_288": survived.info["worst_gpu_loss"] / plain_288,
                     "plain_balancedness": float(plain.balancedness(counts).mean()),
                     "survive_balancedness": float(survived.balancedness(counts).mean())})
    return rows


def timing_rows(cfg: dict) -> list[dict]:
    counts = deepseek_v3_counts().astype(float)
    rows = []
    for slots in (288, 512):
        placement = eplb.plan(counts, **keywords(slots, False))
        plan_t = median_time(lambda: eplb.plan(counts, **keywords(slots, False)), repeats=cfg["repeats"])
        exposure_t = median_time(lambda: worst_loss(counts, placement.phy2log, placement.topology),
                                 repeats=10 * cfg["repeats"])
        survive = "node" if slots == 512 else "gpu"
        survive_t = median_time(lambda: eplb.plan(counts, **keywords(slots, False), survive=survive),
                                repeats=max(3, cfg["repeats"] // 3))
        rows.append({"num_slots": slots, "plan_ms": 1e3 * plan_t.wall, "exposure_ms": 1e3 * exposure_t.wall,
                     "exposure_share": exposure_t.wall / plan_t.wall, "plan_cpu_ms": 1e3 * plan_t.cpu,
                     "exposure_cpu_ms": 1e3 * exposure_t.cpu, "survive": survive,
                     "survive_plan_ms": 1e3 * survive_t.wall})
    return rows


def near_rows(cfg: dict) -> list[dict]:
    """Re-planning near a survivable placement in service (``previous=``), on the series' next window."""
    series = drifting_counts(cfg["recorded"] + 1, 58, 256, num_groups=GROUPS, seed=42).astype(float)
    rows = []
    for slots, survive in ((512, "node"), (288, "gpu")):
        previous = eplb.plan(series[:-1].sum(axis=0), **keywords(slots, False), survive=survive)
        for how, extra in (("plain", {}), (f"survive={survive}", {"survive": survive})):
            placement = eplb.plan(series[-1], **keywords(slots, False), previous=previous, **extra)
            rows.append({"num_slots": slots, "plan": how, **judged(placement, series[-1]),
                         "on_two": on_two(placement, survive),
                         "slots_changed_per_layer": float(placement.info["slots_changed"].mean())})
    return rows


def _case(rows, name, sample):
    get = {r["plan"].split("=")[0]: r for r in rows if r["case"] == name and r["sample"] == sample}
    return get["plain"], get["survive"]


def target_lines(cases: list[dict], timing: list[dict]) -> list[str]:
    lines = ["| target | measured | met |", "|---|---|---|"]
    for sample in ("in sample", "out of sample"):
        plain, survived = _case(cases, "node, 512 slots", sample)
        drop = plain["balancedness"] - survived["balancedness"]
        met = survived["on_two"] == 1.0 and drop <= 0.01
        lines.append(f"| node, 512 / 32 GPUs / 4 nodes, {sample}: every expert on two nodes, balancedness within 0.01 "
                     f"| on two nodes: {survived['on_two']:.2%} of (layer, expert); node loss "
                     f"{plain['worst_node_loss']:.2%} -> {survived['worst_node_loss']:.2%}; balancedness "
                     f"{plain['balancedness']:.4f} -> {survived['balancedness']:.4f} | {'yes' if met else 'no'} |")
    for sample in ("in sample", "out of sample"):
        plain, survived = _case(cases, "gpu, 288 slots", sample)
        ratio = survived["worst_gpu_loss"] / plain["worst_gpu_loss"]
        drop = plain["balancedness"] - survived["balancedness"]
        lines.append(f"| gpu, 288 / 32 GPUs, {sample}: worst GPU loss <= half the plain plan's, balancedness within "
                     f"0.01 | {plain['worst_gpu_loss']:.3%} -> {survived['worst_gpu_loss']:.3%} ({ratio:.2f}x; no "
                     f"placement goes below {survived['floor']:.3%} = {survived['floor'] / plain['worst_gpu_loss']:.2f}x); "
                     f"balancedness {plain['balancedness']:.4f} -> {survived['balancedness']:.4f} | "
                     f"{'yes' if ratio <= 0.5 and drop <= 0.01 else 'no'} |")
    worst_share = max(r["exposure_share"] for r in timing)
    lines.append(f"| exposure on every plan: a small fraction of a plan | "
                 + ", ".join(f"{r['num_slots']} slots: {r['exposure_ms']:.3f} ms of {r['plan_ms']:.1f} ms "
                             f"({r['exposure_share']:.1%})" for r in timing) + f" | {'yes' if worst_share <= 0.05 else 'no'} |")
    return lines


def markdown(cases, sweep, timing, near, cfg, seconds: float, quick: bool) -> str:
    lines = ["## Survive a lost GPU or node", "",
             f"`python bench/survive.py{' --quick' if quick else ''}` ({seconds:.0f} s; {load_note()}). DeepSeek-V3 size "
             f"(58 x 256, 32 GPUs, 4 nodes); in sample: `deepseek_v3_counts()`; out of sample: planned from "
             f"{cfg['recorded']} drifting windows, judged on the {cfg['future']} after them.", ""]
    lines += target_lines(cases, timing)
    lines += ["", "### Plain against survive, in and out of sample", "",
              markdown_table(["case", "sample", "plan", "balancedness", "worst GPU loss", "worst node loss",
                              "on two domains", "floor", "plan s"],
                             [[r["case"], r["sample"], r["plan"], f"{r['balancedness']:.5f}",
                               f"{r['worst_gpu_loss']:.3%}", f"{r['worst_node_loss']:.3%}", f"{r['on_two']:.2%}",
                               f"{r['floor']:.3%}", r["plan_s"]] for r in cases]),
              "", "### survive=\"gpu\" against slots (in sample): what halving the plain 288-slot exposure takes", "",
              markdown_table(["slots", "plain worst GPU loss", "survive worst GPU loss", "floor (any placement)",
                              "survive / plain at 288", "balancedness plain / survive"],
                             [[r["num_slots"], f"{r['plain_gpu_loss']:.3%}", f"{r['survive_gpu_loss']:.3%}",
                               f"{r['floor']:.3%}", f"{r['vs_plain_288']:.2f}x",
                               f"{r['plain_balancedness']:.4f} / {r['survive_balancedness']:.4f}"] for r in sweep]),
              "", "### Time at DeepSeek-V3 size (median wall)", "",
              markdown_table(["slots", "plan ms (CPU)", "exposure ms (CPU)", "exposure / plan", "plan with survive ms"],
                             [[r["num_slots"], f"{r['plan_ms']:.1f} ({r['plan_cpu_ms']:.1f})",
                               f"{r['exposure_ms']:.3f} ({r['exposure_cpu_ms']:.3f})",
                               f"{r['exposure_share']:.1%}", f"{r['survive_plan_ms']:.0f} ({r['survive']})"]
                              for r in timing]),
              "", "### Near a survivable placement in service (previous=, the next drifting window)", "",
              markdown_table(["slots", "plan", "balancedness", "worst GPU loss", "worst node loss", "on two domains",
                              "slots changed / layer"],
                             [[r["num_slots"], r["plan"], f"{r['balancedness']:.5f}", f"{r['worst_gpu_loss']:.3%}",
                               f"{r['worst_node_loss']:.3%}", f"{r['on_two']:.2%}",
                               f"{r['slots_changed_per_layer']:.1f}"] for r in near])]
    return "\n".join(lines)


def run(quick: bool, results_dir: Path) -> str:
    start = time.perf_counter()
    cfg = settings(quick)
    eplb.plan(deepseek_v3_counts()[:1].astype(float), **keywords(512, False), survive="node")  # compile first
    cases, sweep, timing, near = case_rows(cfg), sweep_rows(cfg), timing_rows(cfg), near_rows(cfg)
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = ([{"table": "cases", **r} for r in cases] + [{"table": "sweep", **r} for r in sweep]
            + [{"table": "timing", **r} for r in timing] + [{"table": "near", **r} for r in near])
    header = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(results_dir / "survive.csv", [{k: r.get(k, "") for k in header} for r in rows])
    text = markdown(cases, sweep, timing, near, cfg, time.perf_counter() - start, quick)
    (results_dir / "survive.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    run_alone(run, __doc__)
