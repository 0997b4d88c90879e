"""Simulated deployment changes mid-series: a GPU lost while serving, and nodes joining and leaving.

``eplb.simulate(series, deployment, policy=..., events=...)`` replays DeepSeek-V3-sized drifting
traffic (58 layers x 256 experts, top-8, 4096 tokens a pass, 7 workloads one after the other, as
``bench/simulate.py``) and asks the policy to answer each change from what every layer holds
(:meth:`eplb.Policy.redeploy`); the recovery is priced by its transfer plan (copies from surviving
GPUs, orphans loaded from host memory once; DeepSeek-V3's 44 MiB FP8 experts on H100, NVLink /
400 Gb/s InfiniBand / PCIe Gen5 from host).

1. **A GPU lost mid-series** (GPU 5 of 32 after half the passes; 288 slots on 32 GPUs in 4 nodes,
   global and hierarchical with 8 groups; survivors keep their 9 slots). Answers: the engines'
   (``FromScratch``: re-pack from the last 1000 passes, as vLLM and SGLang do after a resize;
   ``DonorRepair``: each orphan into a donor slot, no rebalance, as their rank-failure handling
   does), eplb's (``Replan``: ``eplb.plan`` across the change from the placement in service, the
   last 1000 passes) and eplb's ``Balancer`` in the loop (``BalancerPolicy``: its own
   ``rebalance(deployment=)``, then rebalancing on). Targets (issue 42): the re-plan's recovery
   bytes <= 1/10 of from scratch; its token imbalance after the loss <= the donor repair's.
2. **Nodes join and leave**: 2 -> 4 -> 8 -> 4 -> 2 nodes of 8 GPUs (18, 9, 5, 9, 18 slots per GPU),
   a change every fifth of the passes, answered by ``Replan``. Target: every step valid (the
   simulator refuses an answer missing an expert) and copies <= 1.3x the floor (``max(orphans,
   holes)`` summed over layers) at every step.

Imbalance: the mean over the passes after the change (until the next one) of the token imbalance
(max / mean GPU tokens, mean over MoE layers); time lost: the MoE time lost to imbalance as a share
of the balanced time (``regime="compute"``).

``python bench/simulate_elastic.py [--quick]`` writes ``simulate_elastic.csv`` and the section.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from _common import load_note, markdown_table, rows_of, run_alone, write_csv
from simulate import BLOCK, TOKENS, Cached

import eplb
from eplb import BalancerPolicy, CostModel, simulate
from eplb.serving.policy import DonorRepair, FromScratch, Replan
from eplb.simulation.events import Resize
from eplb.simulation.series import Series, mixture_path, synthetic_workloads

LOST_GPU = 5
WINDOW = 1000  # the engines' load window, passes
BYTES_TARGET, SEQUENCE_TARGET = 0.1, 1.3


def _series(steps: int, layers: int, experts: int) -> Cached:
    workloads = synthetic_workloads(7, layers, experts, num_groups=8, shift=0.5, seed=11)
    return Cached(Series(workloads, num_steps=steps, tokens_per_step=TOKENS, top_k=8,
                         mixture=mixture_path(steps, 7), seed=12))


def answers(window: int) -> list[tuple[str, object]]:
    return [("from scratch (vLLM, SGLang)", FromScratch(window=window)),
            ("donor repair (engines' rank failure)", DonorRepair()),
            ("eplb re-plan", Replan(window=window)),
            ("eplb Balancer in the loop", BalancerPolicy(check_every=100, name="Balancer"))]


def lost_gpu_rows(series: Cached, experts: int, window: int, cost: CostModel) -> list[dict]:
    steps = series.shape[0]
    rows = []
    for name, deployment in (("global 288/32", eplb.Deployment.of(experts, num_slots=288, num_gpus=32, num_nodes=4)),
                             ("hierarchical 4 nodes / 8 groups",
                              eplb.Deployment.of(experts, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8))):
        for answer, policy in answers(window):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "hierarchical deployment relaxed", RuntimeWarning)
                result = simulate(series, deployment, policy=policy, cost_model=cost, initial_steps=BLOCK,
                                  events={steps // 2: Resize("fail-gpu", LOST_GPU)})
            event = result.events[0]
            rows.append({"table": "lost", "deployment": name, "answer": answer,
                         "copies": event["copies"]["total"], "from_host": event["copies"]["from_host"],
                         "copy_floor": event["copy_floor"], "gb": round(event["bytes"]["total"] / 1e9, 2),
                         "recovery_s": round(event["recovery_s"], 3), "answer_s": round(event["answer_s"], 3),
                         "imbalance_before": round(event["imbalance_before"], 4),
                         "imbalance_after": round(event["imbalance_after"], 4),
                         "lost_share_after": round(event["lost_share_after"], 4)})
    return rows


def sequence_rows(series: Cached, experts: int, window: int, cost: CostModel) -> list[dict]:
    steps = series.shape[0]
    deployment = eplb.Deployment.of(experts, num_slots=2 * 8 * 18, num_gpus=16, num_nodes=2)
    changes = [Resize("add-nodes", 2, 9), Resize("add-nodes", 4, 5), Resize("remove-nodes", 4, 9),
               Resize("remove-nodes", 2, 18)]
    events = {(k + 1) * steps // 5: change for k, change in enumerate(changes)}
    result = simulate(series, deployment, policy=Replan(window=window), cost_model=cost, initial_steps=BLOCK,
                      events=events)
    return [{"table": "sequence", "step": e["step"], "change": e["label"], "copies": e["copies"]["total"],
             "from_host": e["copies"]["from_host"], "copy_floor": e["copy_floor"],
             "ratio": round(e["copies"]["total"] / max(e["copy_floor"], 1), 3),
             "gb": round(e["bytes"]["total"] / 1e9, 2), "recovery_s": round(e["recovery_s"], 3),
             "imbalance_after": round(e["imbalance_after"], 4)} for e in result.events]


def run(quick: bool, results_dir: Path) -> str:
    start = time.perf_counter()
    layers, experts = (6, 256) if quick else (58, 256)
    steps = 400 if quick else 3000
    window = 100 if quick else WINDOW
    series = _series(steps, layers, experts)
    cost = CostModel.preset("H100", "deepseek-v3", regime="compute")
    lost, sequence = lost_gpu_rows(series, experts, window, cost), sequence_rows(series, experts, window, cost)
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = lost + sequence
    header = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(results_dir / "simulate_elastic.csv", [{k: r.get(k, "") for k in header} for r in rows])
    verdicts = []
    for deployment in dict.fromkeys(r["deployment"] for r in lost):
        by = {r["answer"]: r for r in lost if r["deployment"] == deployment}
        replan, scratch, donor = by["eplb re-plan"], by["from scratch (vLLM, SGLang)"], \
            by["donor repair (engines' rank failure)"]
        share = replan["gb"] / scratch["gb"] if scratch["gb"] else float("nan")
        verdicts.append(
            f"- {deployment}: re-plan bytes {share:.3f} of from scratch (target <= {BYTES_TARGET}: "
            f"{'met' if share <= BYTES_TARGET else 'not met'}); imbalance after {replan['imbalance_after']} against "
            f"donor repair's {donor['imbalance_after']} ({'met' if replan['imbalance_after'] <= donor['imbalance_after'] else 'not met'})")
    worst = max(r["ratio"] for r in sequence)
    verdicts.append(f"- 2 -> 4 -> 8 -> 4 -> 2 nodes: every answer valid (the simulator checks each); copies at most "
                    f"{worst}x the floor per step (target <= {SEQUENCE_TARGET}: "
                    f"{'met' if worst <= SEQUENCE_TARGET else 'not met'})")
    lines = [
        "## Simulated deployment changes: a GPU lost mid-series, nodes joining and leaving", "",
        f"`python bench/simulate_elastic.py{' --quick' if quick else ''}` ({time.perf_counter() - start:.0f} s; "
        f"{load_note()}). {layers} layers x {experts} experts, {steps} passes of {TOKENS} tokens (7 drifting workloads), "
        f"answers from the last {window} passes; H100, 44 MiB experts.", "",
        *verdicts, "",
        f"### GPU {LOST_GPU} of 32 lost after pass {steps // 2}", "",
        markdown_table(("deployment", "answer", "copies", "from host", "floor", "GB", "recovery s", "answer s",
                        "imbalance before", "imbalance after", "time lost after"),
                       [[r["deployment"], r["answer"], r["copies"], r["from_host"], r["copy_floor"], r["gb"],
                         r["recovery_s"], r["answer_s"], r["imbalance_before"], r["imbalance_after"],
                         f"{100 * r['lost_share_after']:.1f}%"] for r in lost]), "",
        "### 2 -> 4 -> 8 -> 4 -> 2 nodes, eplb re-plan", "",
        markdown_table(("after pass", "change", "copies", "from host", "floor", "copies / floor", "GB", "recovery s",
                        "imbalance after"),
                       [[r["step"], r["change"], r["copies"], r["from_host"], r["copy_floor"], r["ratio"], r["gb"],
                         r["recovery_s"], r["imbalance_after"]] for r in sequence]),
    ]
    return "\n".join(lines) + "\n"


def headline(results_dir: Path):
    """Headline rows: the simulated GPU loss (global) and the node sequence's worst step."""
    rows = rows_of(results_dir, "simulate_elastic")
    if not rows:
        return
    lost = {r["answer"]: r for r in rows if r["table"] == "lost" and r["deployment"] == "global 288/32"}
    if lost:
        replan, scratch = lost["eplb re-plan"], lost["from scratch (vLLM, SGLang)"]
        yield ("Simulated GPU loss, recovery bytes of the re-plan against from scratch (global 288/32)",
               f"{float(replan['gb']) / float(scratch['gb']):.3f}", f"<= {BYTES_TARGET}")
    ratios = [float(r["ratio"]) for r in rows if r["table"] == "sequence"]
    if ratios:
        yield ("2 -> 4 -> 8 -> 4 -> 2 nodes, worst step's copies / floor", f"{max(ratios)}", f"<= {SEQUENCE_TARGET}")


if __name__ == "__main__":
    run_alone(run, __doc__)
