"""Engine dispatch: the balancedness a placement really gets from each engine's replica choice.

eplb's default plan (``eplb.plan``, uniform dispatch, summed counts) is judged with the split of
each expert's tokens among its replicas that the engine realises (:mod:`eplb.analysis.engine_dispatch`):

- ``uniform``: the even split ``1 / logcnt`` (vLLM, TensorRT-LLM, SGLang ``dynamic`` without an
  all-to-all backend); what eplb's figures assume by default;
- ``sglang-static``: SGLang 0.5.23's per-rank table (near replica, else its uncoordinated "fair"
  choice), reproduced exactly;
- ``sglang-dynamic``: SGLang ``dynamic`` with an all-to-all backend (near replica, else uniform at
  random): the expectation of ``sglang-static`` over its random choice;
- ``optimal``: the min-max split of each window (``eplb.dispatch``; SGLang's ``lp`` solves this LP).

Every source rank is assumed to send the same number of tokens of each expert.

Series and deployments:

- DeepSeek-V3-sized synthetic loads (58 layers x 256 experts, 8 groups), on 288 slots / 32 GPUs /
  4 nodes, global (``num_groups=None``) and hierarchical (8 groups): a drifting series (next
  window: plan on windows ``< t``, serve ``t``) and workloads around one popularity
  (``bench/out_of_sample.py``'s, sigma 0.2; leave one out: plan on the others, serve the one left out);
- the real traces (``../shared/data/traces``; skipped when absent) as workloads, leave one out,
  with their experts cut into 8 groups (as ``bench/research/locality.py``): OLMoE-1B-7B 80 slots / 16 GPUs /
  2 nodes, gpt-oss-20b 48 slots / 8 GPUs / 2 nodes. Mixtral (8 experts, nearly balanced) is left out.

A window's balancedness is the mean over layers of mean / max GPU load. *In sample*: the mean over
the windows the plan was made from; *held out*: the mean (and the worst) over the held-out windows.

Run: ``python bench/engine_dispatch.py [--quick]`` (writes ``engine_dispatch.{csv,md}`` into
``bench/results/`` or ``bench/results/quick/``).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from _common import load_note, markdown_table, read_csv, run_alone, trace_workloads, write_csv

import eplb
from eplb.analysis.engine_dispatch import with_engine_shares
from eplb.simulation.synthetic import DEEPSEEK_V3, drifting_counts
from out_of_sample import synthetic_workloads

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("uniform", "sglang-static", "sglang-dynamic", "optimal")
SYNTHETIC_DEPLOYMENTS = {
    "global 288/32/4": dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=None),
    "hierarchical 288/32/4, 8 groups": dict(num_slots=288, num_gpus=32, num_nodes=4, num_groups=8),
}
TRACE_DEPLOYMENTS = {
    "olmoe-1b-7b": dict(num_slots=80, num_gpus=16, num_nodes=2),
    "gpt-oss-20b": dict(num_slots=48, num_gpus=8, num_nodes=2),
}


def window_balancedness(placement, windows: np.ndarray) -> dict[str, np.ndarray]:
    """``windows [T, L, E]`` -> ``{mode: [T]}``: each window's balancedness (mean over layers)
    under each dispatch mode of :data:`MODES`."""
    out = {"uniform": placement.balancedness(windows, dispatch="uniform").mean(axis=1),
           "optimal": placement.balancedness(windows, dispatch="optimal").mean(axis=1)}
    for engine in ("sglang-static", "sglang-dynamic"):
        served = with_engine_shares(placement, engine)
        out[engine] = served.balancedness(windows, dispatch="shares").mean(axis=1)
    return out


def folds(series: np.ndarray, protocol: str, quick: bool):
    """``series [T, L, E]`` -> ``(training window indices [T'], held-out window index)`` pairs
    (``--quick``: the first 3 folds of leave-one-out, the last window of next-window)."""
    windows = series.shape[0]
    if protocol == "leave-one-out":
        held = range(windows) if not quick else range(min(windows, 3))
        return [(np.delete(np.arange(windows), t), t) for t in held]
    first = windows - (1 if quick else 3)
    return [(np.arange(t), t) for t in range(first, windows)]


def evaluate(series: np.ndarray, config: dict, protocol: str, quick: bool) -> dict:
    """``series [T, L, E]`` -> ``{mode: (in-sample [F], held-out [F])}``: each fold's balancedness
    (the default plan of its training windows) under each dispatch mode."""
    scores = {mode: ([], []) for mode in MODES}
    for train, held in folds(series, protocol, quick):
        placement = eplb.plan(series[train], **config)
        inside = window_balancedness(placement, series[train])
        outside = window_balancedness(placement, series[held : held + 1])
        for mode in MODES:
            scores[mode][0].append(float(inside[mode].mean()))
            scores[mode][1].append(float(outside[mode][0]))
    return {mode: (np.array(a), np.array(b)) for mode, (a, b) in scores.items()}


def scenarios(quick: bool):
    """``(series label, protocol, counts [T, L, E], {deployment: config})`` and notes on absent traces."""
    c = DEEPSEEK_V3
    out = [
        ("synthetic drift=0.1", "next-window",
         drifting_counts(6 if quick else 9, c["num_layers"], c["num_experts"], drift=0.1, tokens=65536,
                         num_groups=c["num_groups"], seed=2).astype(np.float64), SYNTHETIC_DEPLOYMENTS),
        ("synthetic workloads sigma=0.2", "leave-one-out",
         synthetic_workloads(6 if quick else 12, 0.2, seed=1).astype(np.float64), SYNTHETIC_DEPLOYMENTS),
    ]
    traces, missing = trace_scenarios()
    out += [(label, "leave-one-out", counts, deployments) for label, counts, deployments in traces]
    return out, missing


def trace_scenarios():
    """``(label, counts [K, L, E], {deployment: config})`` of each real trace the engine sections
    serve (its workloads; global and hierarchical on :data:`TRACE_DEPLOYMENTS`), and notes on absent traces."""
    workloads, missing = trace_workloads()
    out = []
    for key, names, counts, _ in workloads:
        if key not in TRACE_DEPLOYMENTS:
            continue
        base = TRACE_DEPLOYMENTS[key]
        label = f"{base['num_slots']}/{base['num_gpus']}/{base['num_nodes']}"
        out.append((f"{key} ({len(names)} workloads)", counts, {f"global {label}": dict(base, num_groups=None),
                                                                f"hierarchical {label}, 8 groups": dict(base, num_groups=8)}))
    return out, missing


def run(quick: bool = False, results_dir: Path = RESULTS) -> str:
    """Evaluate every scenario and write ``engine_dispatch.{csv,md}`` into ``results_dir``."""
    started = time.perf_counter()
    results_dir = Path(results_dir)
    rows = []
    cases, missing = scenarios(quick)
    for label, protocol, series, deployments in cases:
        for deployment, config in deployments.items():
            scores = evaluate(series, config, protocol, quick)
            for mode in MODES:
                inside, outside = scores[mode]
                rows.append({"series": label, "protocol": protocol, "deployment": deployment, "dispatch": mode,
                             "folds": len(outside), "in_sample": round(float(inside.mean()), 4),
                             "held_out_mean": round(float(outside.mean()), 4),
                             "held_out_worst": round(float(outside.min()), 4)})
            print(f"[engine_dispatch] {label} | {deployment}: {time.perf_counter() - started:.0f} s", flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(results_dir / "engine_dispatch.csv", rows)
    text = markdown(rows, missing, quick, time.perf_counter() - started)
    (results_dir / "engine_dispatch.md").write_text(text + "\n")
    return text


def markdown(rows, missing, quick: bool, seconds: float) -> str:
    lines = [
        "## Engine dispatch: what each engine's replica choice gives eplb's default plan",
        "",
        f"`python bench/engine_dispatch.py{' --quick' if quick else ''}` ({seconds:.0f} s; {load_note()}). "
        "Default plan (`eplb.plan`, summed counts of the training windows), served with the split each "
        "engine realises (`eplb.analysis.engine_dispatch`): `uniform` = vLLM, TensorRT-LLM, SGLang `dynamic` without "
        "an all-to-all backend; `sglang-static` = SGLang's per-rank table (exact); `sglang-dynamic` = SGLang "
        "`dynamic` with an all-to-all backend (its expectation); `optimal` = min-max split per window "
        "(SGLang `lp`). Cells: in sample; held out mean / worst (balancedness = mean over layers of "
        "mean / max GPU load; every source rank sends the same tokens of each expert).",
    ]
    for note in missing:
        lines += ["", f"- {note}"]
    keys = list(dict.fromkeys((r["series"], r["protocol"], r["deployment"]) for r in rows))
    table = []
    for series, protocol, deployment in keys:
        block = {r["dispatch"]: r for r in rows
                 if (r["series"], r["protocol"], r["deployment"]) == (series, protocol, deployment)}
        cells = [f"{float(block[m]['in_sample']):.4f}; {float(block[m]['held_out_mean']):.4f} / "
                 f"{float(block[m]['held_out_worst']):.4f}" for m in MODES]
        table.append([series, f"{protocol} ({block[MODES[0]]['folds']})", deployment] + cells)
    lines += ["", markdown_table(["series", "protocol (folds)", "deployment"] + list(MODES), table)]
    return "\n".join(lines)


def headline(results_dir: Path):
    """SGLang static against the even split eplb assumes, DeepSeek-V3-sized synthetic loads."""
    path = Path(results_dir) / "engine_dispatch.csv"
    if not path.exists():
        return []
    rows = {(r["series"], r["deployment"], r["dispatch"]): r for r in read_csv(path)}
    out = []
    for series, deployment, mode in rows:
        if not series.startswith("synthetic") or mode != "sglang-static":
            continue
        static, even = rows[(series, deployment, "sglang-static")], rows[(series, deployment, "uniform")]
        out.append((f"SGLang static dispatch vs even split, {series}, {deployment}: held-out balancedness (mean)",
                    f"{float(static['held_out_mean']):.3f} vs {float(even['held_out_mean']):.3f}", "reported"))
    return out


if __name__ == "__main__":
    run_alone(run, __doc__)
