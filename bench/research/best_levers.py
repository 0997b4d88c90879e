"""Levers of the hierarchical default and of ``best``: what the aligned replications and the
hot-expert bound buy, and whether re-solving the heaviest GPUs exactly (CP-SAT) pays.

1. Hierarchical gap per load family (DeepSeek-V3 sizes, 288 and 320 slots, 8 groups on 4 nodes):
   the default and ``best`` against the hierarchical bound, side by side with the default's
   replication alone (no aligned replications: the placement before this lever).
2. Time of one call at DeepSeek-V3 size (58 x 256 -> 288 slots, 32 GPUs, 4 nodes; realistic loads),
   medians of repeated warm calls: default and ``best``, hierarchical and global.
3. Exact re-solve: starting from ``best``, take the heaviest GPU of a layer (per node when
   hierarchical) and ``p`` partners (the GPU sharing most experts with it, then the lightest),
   re-solve the assignment of their slots with CP-SAT (one worker, deterministic time limit; replicas
   move between those GPUs, and the replica counts of experts living only there may shift), keep
   it if the heaviest of them gets lighter, repeat while it helps. Records the gap before / after
   and the time per layer: the lever is kept in ``best`` only if it pays within its 300 ms bar.

    cd bench && python -m research.best_levers [--quick]

Writes ``best_levers_gap.csv``, ``best_levers_speed.csv`` and ``best_levers_resolve.csv``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from _common import load_note, markdown_table, pct, run_alone, trace_workloads, write_csv
from quality import FAMILIES, speed_rows

import eplb.planning.methods.balanced as balanced_module
from eplb.analysis.loads import slot_order_peaks
from eplb.planning.api import make_deployment
from eplb import lower_bound
from eplb.planning.methods import get_method
from eplb.simulation.synthetic import deepseek_v3_counts, skewed_counts
from eplb import Deployment


def replication_alone(weights: np.ndarray, deployment) -> np.ndarray:
    """The default without its aligned replications (capped D'Hondt, packing, seeded retries, greedy
    fallback): the hierarchical default before the aligned lever. ``weights [L, E]`` -> ``[L, S]``."""
    b = balanced_module
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    topology = deployment.topology
    gpu_domain, expert_domain, bound = b.domains(weights, deployment)
    phy2log = b.balanced_placement(weights, b.writable(topology.slots_per_gpu), gpu_domain, expert_domain, 4096)
    phy2log, _ = b.retry_replication(weights, deployment, phy2log, gpu_domain, bound, 4, 4096)
    phy2log, _ = b.keep_better_than_greedy(weights, deployment, phy2log)
    return phy2log


def gap_rows(quick: bool) -> list[dict]:
    layers = 8 if quick else 58
    rows = []
    for slots in (288,) if quick else (288, 320):
        deployment = make_deployment(256, slots, 32, 4, 8)
        for load, (family, skew) in FAMILIES.items():
            counts = skewed_counts(layers, 256, family=family, skew=skew, num_groups=8, seed=11).astype(np.float64)
            bound = lower_bound(counts, Deployment.of(counts.shape[-1], topology=deployment.topology, num_groups=8))
            plans = {"replication alone": replication_alone(counts, deployment),
                     "default": get_method("balanced")(counts, deployment)[0],
                     "best": get_method("best")(counts, deployment)[0]}
            row = {"slots": slots, "load": load}
            for name, phy2log in plans.items():
                peak = slot_order_peaks(counts, phy2log, deployment.topology)
                row[name] = float((peak / bound - 1).mean())
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ exact re-solve

def _gpu_loads(row: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """``[G]`` loads of a ``phy2log`` row ``[S]`` with ``k`` slots per GPU."""
    counts = np.bincount(row, minlength=len(w))
    return (w[row] / counts[row]).reshape(-1, k).sum(axis=1)


def resolve_gpus(row: np.ndarray, w: np.ndarray, k: int, gpus: list[int], time_limit: float) -> np.ndarray | None:
    """Re-solve the slots of ``gpus`` exactly (CP-SAT, loads floor-scaled to integers): the replicas
    on them move freely among them; an expert whose replicas all sit there may change its count
    (the counts of those experts keep their sum). Returns the new row ``[S]`` or None."""
    from ortools.sat.python import cp_model

    counts = np.bincount(row, minlength=len(w))
    on = {g: row[g * k:(g + 1) * k] for g in gpus}
    experts = sorted({int(e) for g in gpus for e in on[g]})
    here = {e: sum(int((on[g] == e).sum()) for g in gpus) for e in experts}
    local = [e for e in experts if here[e] == counts[e]]
    spare = sum(here[e] for e in local) - len(local)
    scale = 2**30 / max(1.0, float(w[experts].sum()))
    model = cp_model.CpModel()
    x, load = {}, {g: [] for g in gpus}
    for e in experts:
        most = max(1, max(int((on[g] == e).sum()) for g in gpus))
        for g in gpus:
            x[e, g] = model.new_int_var(0, most, f"x{e}_{g}")
        if e in local:
            choices = range(1, min(len(gpus) * most, 1 + spare) + 1)
            pick = {r: model.new_bool_var(f"y{e}_{r}") for r in choices}
            model.add_exactly_one(pick.values())
            model.add(sum(x[e, g] for g in gpus) == sum(r * v for r, v in pick.items()))
            for g in gpus:
                c = model.new_int_var(0, int(w[e] * scale) + 1, f"c{e}_{g}")
                for r, v in pick.items():
                    model.add(c == int(w[e] * scale / r) * x[e, g]).only_enforce_if(v)
                load[g].append(c)
        else:
            model.add(sum(x[e, g] for g in gpus) == here[e])
            for g in gpus:
                load[g].append(int(w[e] * scale / counts[e]) * x[e, g])
    if local:
        model.add(sum(x[e, g] for e in local for g in gpus) == sum(here[e] for e in local))
    peak = model.new_int_var(0, 2**31, "T")
    for g in gpus:
        model.add(sum(x[e, g] for e in experts) == k)
        model.add(peak >= sum(load[g]))
        for e in experts:
            model.add_hint(x[e, g], int((on[g] == e).sum()))
    model.minimize(peak)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.random_seed = 0
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    new = row.copy()
    for g in gpus:
        new[g * k:(g + 1) * k] = [e for e in experts for _ in range(int(solver.value(x[e, g])))]
    return new


def resolve_layer(row: np.ndarray, w: np.ndarray, k: int, domain: np.ndarray, partners: int,
                  time_limit: float, rounds: int = 20) -> np.ndarray:
    """Re-solve the heaviest GPU of ``domain [m]`` with ``partners`` others while that helps."""
    for _ in range(rounds):
        loads = _gpu_loads(row, w, k)
        h = int(domain[np.argmax(loads[domain])])
        by_load = [int(g) for g in domain[np.argsort(loads[domain], kind="stable")] if g != h]
        mine = set(row[h * k:(h + 1) * k].tolist())
        shared = sorted(by_load, key=lambda g: -len(mine & set(row[g * k:(g + 1) * k].tolist())))
        chosen = list(dict.fromkeys(shared[:1] + by_load))[:partners]
        new = resolve_gpus(row, w, k, [h] + chosen, time_limit)
        if new is None or _gpu_loads(new, w, k)[[h] + chosen].max() >= loads[[h] + chosen].max() * (1 - 1e-12):
            break
        row = new
    return row


def resolve_cases(quick: bool) -> list[tuple[str, np.ndarray, object]]:
    layers = 2 if quick else 6
    cases = [
        ("Kimi-K2 432 uniform", skewed_counts(layers, 384, family="uniform", seed=11), make_deployment(384, 432, 72, 9, None)),
        ("Kimi-K2 432 hot", skewed_counts(layers, 384, family="hot", skew=1.0, seed=11),
         make_deployment(384, 432, 72, 9, None)),
        ("DeepSeek-V3 288 hier zipf 1.5", skewed_counts(layers, 256, family="zipf", skew=1.5, num_groups=8, seed=11),
         make_deployment(256, 288, 32, 4, 8)),
        ("DeepSeek-V3 288 global lognormal", deepseek_v3_counts(seed=0)[:layers], make_deployment(256, 288, 32, 4, None)),
    ]
    workloads, _ = trace_workloads()
    for key, _, counts, kwargs in workloads:
        if key in ("gpt-oss-20b", "mixtral-8x7b"):
            deployment = make_deployment(counts.shape[-1], kwargs["num_slots"], kwargs["num_gpus"], 1, None)
            cases.append((f"{key} (real, window 0)", counts[0][:layers], deployment))
    return [(name, np.asarray(c, dtype=np.float64), p) for name, c, p in cases]


def resolve_rows(quick: bool) -> list[dict]:
    rows = []
    for name, counts, deployment in resolve_cases(quick):
        topology = deployment.topology
        k, gpus, nodes = int(topology.slots_per_gpu[0]), topology.num_gpus, topology.num_nodes
        domains = ([np.arange(n * gpus // nodes, (n + 1) * gpus // nodes) for n in range(nodes)]
                   if deployment.hierarchical else [np.arange(gpus)])
        start, _ = get_method("best")(counts, deployment)
        bound = lower_bound(counts, deployment)
        before = slot_order_peaks(counts, start, topology) / bound - 1
        for partners in (1, 3):
            out = start.copy()
            begin = time.perf_counter()
            for layer in range(counts.shape[0]):
                for domain in domains:
                    out[layer] = resolve_layer(out[layer], counts[layer], k, domain, partners,
                                               time_limit=0.2 if quick else 1.0)
            seconds = (time.perf_counter() - begin) / counts.shape[0]
            after = slot_order_peaks(counts, out, topology) / bound - 1
            rows.append({"case": name, "gpus_resolved": partners + 1, "layers": counts.shape[0],
                         "gap_best": float(before.mean()), "gap_after": float(after.mean()),
                         "ms_per_layer": seconds * 1e3})
    return rows


def run(quick: bool, results_dir: Path) -> str:
    results_dir = Path(results_dir)
    gaps = gap_rows(quick)
    write_csv(results_dir / "best_levers_gap.csv", gaps)
    speed = speed_rows(quick, methods=("balanced", "best"))
    write_csv(results_dir / "best_levers_speed.csv", speed)
    resolve = resolve_rows(quick)
    write_csv(results_dir / "best_levers_resolve.csv", resolve)
    names = ("replication alone", "default", "best")
    gap_table = markdown_table(
        ["slots", "load"] + list(names),
        [[r["slots"], r["load"]] + [pct(r[n]) for n in names] for r in gaps]
        + [["all", "mean"] + [pct(float(np.mean([r[n] for r in gaps]))) for n in names]],
    )
    speed_table = markdown_table(
        ["DeepSeek-V3 288 slots", "method", "median wall ms", "median CPU ms", "calls"],
        [[r["mode"], r["method"], f"{r['wall_ms']:.1f}", f"{r['cpu_ms']:.1f}", r["calls"]] for r in speed],
    )
    resolve_table = markdown_table(
        ["case", "GPUs re-solved", "layers", "gap of best", "after exact re-solve", "ms per layer"],
        [[r["case"], r["gpus_resolved"], r["layers"], pct(r["gap_best"]), pct(r["gap_after"]),
          f"{r['ms_per_layer']:.0f}"] for r in resolve],
    )
    return (
        "## Levers of the hierarchical default and of best\n\n"
        f"{'Quick run (fewer layers). ' if quick else ''}Machine: {load_note()}.\n\n"
        "Mean gap to the hierarchical bound (DeepSeek-V3 sizes, 32 GPUs, 4 nodes, 8 groups); "
        "\"replication alone\" is the default without its aligned replications:\n\n" + gap_table
        + "\n\nTime of one call (median of warm calls, realistic DeepSeek-V3 loads):\n\n" + speed_table
        + "\n\nRe-solving the heaviest GPU and its partners exactly (CP-SAT, from best's placement):\n\n"
        + resolve_table + "\n"
    )


if __name__ == "__main__":
    run_alone(run, __doc__)
