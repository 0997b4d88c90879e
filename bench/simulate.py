"""Simulate: what rebalancing policies cost in MoE time and weight copies on drifting traffic.

Series (``eplb.simulation.series``): ``blocks`` blocks of 10 passes of 4096 tokens, traffic moving through 7
workloads one after the other (``mixture_path``, half of each segment a linear shift to the
next), each pass a multinomial draw of its tokens x top_k routings:

- DeepSeek-V3-sized synthetic (58 x 256, top-8, 8 groups): 7 related workloads
  (``synthetic_workloads``: one lognormal base popularity, per-workload log shift 0.5 x skew);
- the real traces as workloads (gpt-oss-20b: the benchmarks; OLMoE-1B-7B: the text domains),
  each on its own deployment (as in the other benches).

- the same DeepSeek-V3-sized workloads in decode passes of 256 tokens, priced with the H100
  roofline (memory-bound: what matters is the weight reads of every activated slot, replicas
  included; no targets).

Deployments: DeepSeek-V3 288 slots / 32 GPUs / 4 nodes, global (no groups) and hierarchical (8
groups). Policies, all from the greedy plan of the first block: vLLM-like (every 3000 passes from a
1000-pass window, greedy from scratch), SGLang-like (every 1000, greedy), ``eplb.Balancer`` with
its defaults checked every 100 passes (and, on the DeepSeek-V3-sized series, with a looser
``tolerance``: the trade-off between time lost and copies), no rebalancing, and the reference (re-plan every block from
the block before with eplb's default method, copies free).

Cost: the MoE time of a pass is the sum over layers of the slowest GPU; here time is proportional
to tokens (``regime="compute"``, DeepSeek-V3 on H100: the issue's measure), and time lost to
imbalance is reported as a share of the perfectly balanced time. Copies are priced as a stall
(synchronous rearrangement over NVLink / 400 Gb/s InfiniBand; the reference's copies are free).
Also measured: 10,000 DeepSeek-V3-sized steps with a rebalance every 300 steps, on one core.

Run: ``python bench/simulate.py [--quick]`` (results in ``bench/results/simulate.{csv,md}``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from _common import load_note, markdown_table, rows_of, run_alone, traces_dir, write_csv, write_section

import eplb
from eplb import CostModel
from eplb.simulation.series import Series, mixture_path, synthetic_workloads, trace_workloads
from eplb import BalancerPolicy, FixedInterval, NoRebalance, simulate, sglang_like, vllm_like

BLOCK = 10  # passes per block
QUICK_BLOCKS = 40  # --quick: 400 passes, four decisions of a Balancer checking every 100 (a smoke run; figures come
# from the full run)
TOKENS = 4096  # tokens per pass
DECODE_TOKENS = 256  # tokens per decode pass (memory-bound: weight reads of activated slots)
DS = dict(num_slots=288, num_gpus=32, num_nodes=4)
TARGETS = dict(reference_ratio_global=1.5, fixed_ratio_global=0.6, reference_ratio_hierarchical=1.05, copies_ratio=0.25)


class Cached:
    """A series generated once and kept as uint16 (what ``simulate`` reads: ``shape`` and ``block``)."""

    def __init__(self, series: Series):
        self.shape = series.shape
        self.counts = np.empty(series.shape, np.uint16)
        for start in range(0, series.num_steps, 1024):
            stop = min(start + 1024, series.num_steps)
            block = series.block(start, stop)
            if block.max() > np.iinfo(np.uint16).max:
                raise ValueError("counts exceed uint16")
            self.counts[start:stop] = block

    def block(self, start: int, stop: int) -> np.ndarray:
        return self.counts[start:stop]


def scenarios(blocks: int) -> tuple[list[dict], list[str]]:
    """The series and the deployments they are served on."""
    steps = blocks * BLOCK
    out, notes = [], []
    workloads = synthetic_workloads(7, 58, 256, num_groups=8, shift=0.5, seed=11)
    series = Series(workloads, num_steps=steps, tokens_per_step=TOKENS, top_k=8, mixture=mixture_path(steps, 7), seed=12)
    cost = CostModel.preset("H100", "deepseek-v3", regime="compute")
    ds_deployments = [("global 288/32", eplb.Deployment.of(256, **DS)),
                      ("hierarchical 4 nodes", eplb.Deployment.of(256, **DS, num_groups=8))]
    out.append(dict(series="DeepSeek-V3-sized synthetic, 7 workloads", data=series, cost=cost, deployments=ds_deployments,
                    targets=True, trade_off=True))
    decode = Series(workloads, num_steps=steps, tokens_per_step=DECODE_TOKENS, top_k=8, mixture=mixture_path(steps, 7),
                    seed=15)
    out.append(dict(series=f"same, decode passes of {DECODE_TOKENS} tokens, H100 roofline", data=decode,
                    cost=CostModel.preset("H100", "deepseek-v3"), deployments=ds_deployments, targets=False))
    for file, label, group_by, top_k, model, (deployment_name, layout) in (
        ("gpt_oss_20b_benchmark_windows.npz", "gpt-oss-20b trace, benchmarks", "benchmark", 4, "gpt-oss-20b",
         ("40 slots / 8 GPUs, 2 nodes", dict(num_slots=40, num_gpus=8, num_nodes=2))),
        ("olmoe_1b7b_domains_layers0-7-15.npz", "OLMoE-1B-7B trace, text domains", None, 8, "olmoe-1b-7b",
         ("80 slots / 8 GPUs, 2 nodes", dict(num_slots=80, num_gpus=8, num_nodes=2))),
    ):
        path = traces_dir() / file
        if not path.exists():
            notes.append(f"{file} absent from {traces_dir()} (set EPLB_TRACES): skipped")
            continue
        names, probs = trace_workloads(path, group_by=group_by)
        count = len(names)
        order = list(range(count)) * (1 + 7 // count)
        series = Series(probs, num_steps=steps, tokens_per_step=TOKENS, top_k=top_k,
                        mixture=mixture_path(steps, count, order=order[:7]), seed=13)
        cost = CostModel.preset("H100", model, regime="compute")
        deployment = eplb.Deployment.of(probs.shape[-1], **layout)
        out.append(dict(series=f"{label} ({count})", data=series, cost=cost, deployments=[(deployment_name, deployment)],
                        targets=True))
    return out, notes


def policies() -> list[tuple[str, object, bool]]:
    """``(key, policy, copies_free)``."""
    return [
        ("none", NoRebalance(), False),
        ("vllm", vllm_like(), False),
        ("sglang", sglang_like(), False),
        ("balancer", BalancerPolicy(check_every=100, name="Balancer, defaults (checked every 100)"), False),
        ("reference", FixedInterval(BLOCK, BLOCK, eplb.DEFAULT_METHOD,
                                    name=f"reference: every block from the block before, {eplb.DEFAULT_METHOD}, "
                                         "copies free"), True),
    ]


TOLERANCES = (0.005, 0.01, 0.02, 0.05)  # around the default (eplb.model.defaults.BALANCER_TOLERANCE, 0.03)


def trade_off_policies() -> list[tuple[str, object, bool]]:
    """The Balancer's defaults with another ``tolerance``: tighter (plans closer to planning from
    scratch: less time lost, more copies) or looser (fewer copies, more time lost)."""
    return [(f"balancer_tolerance_{t}", BalancerPolicy(check_every=100, tolerance=t, name=f"Balancer, tolerance {t}"),
             False) for t in TOLERANCES]


def trade_off_table(rows: list[dict]) -> list[str]:
    """Markdown lines: the tolerance trade-off against the issue's time and copy targets."""
    lines = []
    for deployment in dict.fromkeys(r["deployment"] for r in rows if r["policy_key"].startswith("balancer_tolerance")):
        get = {r["policy_key"]: r for r in rows if r["deployment"] == deployment and r["series"].startswith("DeepSeek")}
        reference = float(get["reference"]["lost_share"])
        fewest = min(int(get["vllm"]["copies"]), int(get["sglang"]["copies"]))
        keys = ["balancer"] + [f"balancer_tolerance_{t}" for t in TOLERANCES]
        table = markdown_table(
            ["policy", "MoE time lost", "x reference", "with stalls", "copies", "x fewest fixed"],
            [(get[k]["policy"], f"{100 * float(get[k]['lost_share']):.2f}%",
              f"{float(get[k]['lost_share']) / reference:.2f}" if reference > 0 else "n/a",
              f"{100 * float(get[k]['lost_with_stalls_share']):.2f}%", get[k]["copies"],
              f"{int(get[k]['copies']) / fewest:.2f}" if fewest else "n/a") for k in keys if k in get])
        lines += [f"Balancer trade-off, DeepSeek-V3-sized synthetic, {deployment}:", "", table, ""]
    return lines


def measure(blocks: int) -> tuple[list[dict], list[str]]:
    rows = []
    found, notes = scenarios(blocks)
    for scenario in found:
        data = Cached(scenario["data"])
        for deployment_name, deployment in scenario["deployments"]:
            initial = None
            extra = trade_off_policies() if scenario.get("trade_off") else []
            for key, policy, free in policies() + extra:
                cost = scenario["cost"].with_(copy_mode="free") if free else scenario["cost"]
                result = simulate(data, deployment, policy=policy, cost_model=cost, initial=initial,
                                  initial_steps=BLOCK)
                summary = result.summary()
                rows.append({
                    "targets": scenario["targets"], "series": scenario["series"], "deployment": deployment_name,
                    "policy_key": key,
                    "policy": summary["policy"], "steps": summary["steps"],
                    "lost_share": round(summary["lost_share"], 5),
                    "lost_with_stalls_share": round(summary["lost_with_stalls_share"], 5),
                    "stall_s": round(summary["stall_time_s"], 3), "moe_time_s": round(summary["moe_time_s"], 4),
                    "rebalances": summary["rebalances"], "copies": summary["copies"],
                    "copies_cross_node": summary["copies_cross_node"], "gb_moved": round(summary["bytes_moved"] / 1e9, 1),
                    "wall_s": round(summary["wall_time_s"], 2),
                })
    return rows, notes


def timing(steps: int) -> dict:
    """Wall and CPU seconds of simulating ``steps`` DeepSeek-V3-sized passes with a rebalance every
    300 passes (the series generated on the fly, and pre-generated)."""
    workloads = synthetic_workloads(7, 58, 256, num_groups=8, shift=0.5, seed=11)
    series = Series(workloads, num_steps=steps, tokens_per_step=TOKENS, top_k=8, mixture=mixture_path(steps, 7), seed=14)
    cost = CostModel.preset("H100", "deepseek-v3", regime="compute")
    deployment = eplb.Deployment.of(256, **DS, num_groups=8)
    simulate(series.block(0, 20), deployment, policy=FixedInterval(10), cost_model=cost)  # compile outside the timing
    out = {"steps": steps}
    for label, data in (("generated on the fly", series), ("pre-generated", None)):
        if data is None:
            start = time.perf_counter()
            data = Cached(series)
            out["generation_s"] = round(time.perf_counter() - start, 2)
        for policy_label, policy in (("every 300, greedy", FixedInterval(300, method="greedy")),
                                     ("Balancer checked every 300", BalancerPolicy(check_every=300))):
            cpu, wall = time.process_time(), time.perf_counter()
            result = simulate(data, deployment, policy=policy, cost_model=cost)
            out[f"{label}, {policy_label}"] = dict(wall_s=round(time.perf_counter() - wall, 2),
                                                   cpu_s=round(time.process_time() - cpu, 2),
                                                   rebalances=result.num_rebalances)
    return out


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's targets for the Balancer's defaults, per series and deployment."""
    lines = []
    keyed = {(r["series"], r["deployment"], r["policy_key"]): r for r in rows}
    for series, deployment in dict.fromkeys((r["series"], r["deployment"]) for r in rows if r["targets"]):
        get = lambda key: keyed[(series, deployment, key)]  # noqa: E731
        balancer, reference = get("balancer"), get("reference")
        better_fixed = min((get("vllm"), get("sglang")), key=lambda r: r["lost_share"])
        fewest_fixed = min(get("vllm")["copies"], get("sglang")["copies"])
        ratio_ref = balancer["lost_share"] / reference["lost_share"] if reference["lost_share"] > 0 else float("inf")
        ratio_fixed = balancer["lost_share"] / better_fixed["lost_share"] if better_fixed["lost_share"] > 0 else float("inf")
        copies_ratio = balancer["copies"] / fewest_fixed if fewest_fixed else float("inf")
        hierarchical = "hierarchical" in deployment
        ref_target = TARGETS["reference_ratio_hierarchical" if hierarchical else "reference_ratio_global"]
        checks = [f"lost {100 * balancer['lost_share']:.2f}% = {ratio_ref:.2f}x the reference "
                  f"(target <= {ref_target}x: {'met' if ratio_ref <= ref_target else 'NOT met'})"]
        if not hierarchical:
            target = TARGETS["fixed_ratio_global"]
            checks.append(f"{ratio_fixed:.2f}x the better fixed policy (target <= {target}x: "
                          f"{'met' if ratio_fixed <= target else 'NOT met'})")
        if fewest_fixed:
            checks.append(f"copies {copies_ratio:.2f}x the fixed policies' fewest (target <= {TARGETS['copies_ratio']}x: "
                          f"{'met' if copies_ratio <= TARGETS['copies_ratio'] else 'NOT met'})")
        else:
            checks.append("copies: a fixed policy made none in this series (too short for its timer)")
        lines.append(f"- {series}, {deployment}: Balancer " + "; ".join(checks))
    return lines


def deepseek_policies(results_dir: Path) -> dict[str, dict[str, dict]]:
    """``{deployment: {policy key: row}}`` of ``simulate.csv``'s DeepSeek-V3-sized series (the rows
    the targets apply to), deployments in the order they ran."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows_of(results_dir, "simulate"):
        if r.get("targets", "True") == "True" and r["series"].startswith("DeepSeek-V3"):
            out.setdefault(r["deployment"], {})[r["policy_key"]] = r
    return out


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    """README headline rows ``(figure, measured, target)``: the Balancer against the reference and
    the engines' timers on the DeepSeek-V3-sized drifting series."""
    out = []
    for deployment, get in deepseek_policies(results_dir).items():
        if not {"balancer", "reference", "vllm", "sglang"} <= set(get):
            continue
        lost = {k: float(get[k]["lost_share"]) for k in get}
        copies = int(get["balancer"]["copies"])
        fewest = min(int(get["vllm"]["copies"]), int(get["sglang"]["copies"]))
        hierarchical = "hierarchical" in deployment
        target = TARGETS["reference_ratio_hierarchical" if hierarchical else "reference_ratio_global"]
        ratio = lost["balancer"] / lost["reference"] if lost["reference"] > 0 else float("inf")
        out.append((f"Simulated MoE time lost to imbalance, Balancer defaults, DeepSeek-V3 size {deployment}",
                    f"{lost['balancer']:.1%} (reference {lost['reference']:.1%}, vLLM-like {lost['vllm']:.1%}, "
                    f"SGLang-like {lost['sglang']:.1%}); {copies} copies (fixed: >= {fewest})",
                    f"<= {target}x the reference: {'met' if ratio <= target else 'not met'} ({ratio:.2f}x); "
                    f"copies <= 0.25x: {'met' if fewest and copies <= 0.25 * fewest else 'not met'}"))
    return out


def readme_rows(results_dir: Path) -> list[tuple[str, str, str]]:
    """The README's rows: MoE time lost to imbalance and weight copies on the held-out drifting
    DeepSeek-V3-sized series, the Balancer's defaults against the engines' own timers."""
    out = []
    for deployment, get in deepseek_policies(results_dir).items():
        if not {"balancer", "vllm", "sglang"} <= set(get):
            continue

        def cell(key):
            return f"{float(get[key]['lost_share']):.1%} lost, {int(get[key]['copies'])} copies"

        out.append((f"Simulated MoE time lost to imbalance, drifting DeepSeek-V3-sized traffic (9,000 passes), "
                    f"{deployment}, H100",
                    f"`Balancer` defaults: {cell('balancer')}",
                    f"vLLM-like timer: {cell('vllm')}; SGLang-like: {cell('sglang')}"))
    return out


def run(quick: bool, results_dir: Path, *, blocks: int | None = None, timing_steps: int | None = None) -> str:
    """The section's markdown; ``blocks`` and ``timing_steps`` override the sizes (tests)."""
    blocks = blocks or (QUICK_BLOCKS if quick else 900)
    rows, notes = measure(blocks)
    write_csv(results_dir / "simulate.csv", rows)
    timed = timing(timing_steps or (500 if quick else 10_000))
    header = ["series", "deployment", "policy", "MoE time lost", "with stalls", "rebalances", "copies", "cross-node", "GB moved"]
    table = markdown_table(header, [
        (r["series"], r["deployment"], r["policy"], f"{100 * r['lost_share']:.2f}%",
         f"{100 * r['lost_with_stalls_share']:.2f}%", r["rebalances"], r["copies"], r["copies_cross_node"], r["gb_moved"])
        for r in rows])
    timing_lines = [f"- series generation alone: {timed['generation_s']} s wall"]
    timing_lines += [f"- {key}: {value['wall_s']} s wall, {value['cpu_s']} s CPU, {value['rebalances']} rebalances"
                     for key, value in timed.items() if isinstance(value, dict)]
    text = "\n".join([
        "## Simulate: time lost to imbalance and copies, by policy",
        "",
        f"{blocks} blocks of {BLOCK} passes of {TOKENS} tokens, traffic moving through 7 workloads; every policy "
        f"from the greedy plan of the first block; time proportional to tokens (compute-bound on H100), except the "
        f"decode rows ({DECODE_TOKENS}-token passes, H100 roofline: weight reads of activated slots dominate); "
        f"lost = MoE time above the perfectly balanced time, as a share of it; stalls = synchronous weight copies "
        f"(H100 NVLink / 400 Gb/s IB at 80%). {load_note()}.",
        "",
        table,
        "",
        "Targets (issue 13, Balancer defaults, uniform split):",
        *verdicts(rows),
        "",
        *trade_off_table(rows),
        f"Timing, {timed['steps']} DeepSeek-V3-sized passes (58 x 256, 288 slots / 32 GPUs / 4 nodes, hierarchical), "
        f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'unset')}:",
        *timing_lines,
        *[f"- {note}" for note in notes],
        "",
    ])
    return write_section(results_dir, "simulate", text)


if __name__ == "__main__":
    run_alone(run, __doc__)
