"""Fewest slot changes per rebalance, proven: gpt-oss-20b on 40 slots / 8 GPUs.

The one drifting sequence of ``bench/serving.py`` where eplb's migration-aware planning misses the
"<= 20% of slots changed per rebalance" target: gpt-oss-20b, a sum over 40 recorded windows
sliding by 5, 40 slots on 8 GPUs (32 experts, 5 slots per GPU, global mode). For every rebalance
and layer, from the placement eplb had in service (its own previous rebalance), within the cap
eplb itself uses (1.005 x the default method's max load from scratch):

- **eplb**: the slots ``plan(previous=..., tolerance=0.005)`` changes;
- **fewest found** and **proven lower bound**: the exact search of ``bench/fewest_changes_search``
  (iterative deepening; its first placement found is the proven minimum) with a budget of search
  nodes per layer, eplb's plan as the incumbent; where 60% of the budget runs out, the bound is
  the last ``k`` refuted plus one, and the rest of the budget searches with the replica counts
  fixed to eplb's plan, then to the plan from scratch ("found" is eplb's if that finds nothing).

Same rules as the CP-SAT columns of ``bench/serving.py`` (no GPU gets a second replica of an
expert it held). Writes ``fewest_changes.csv`` (per rebalance) and ``fewest_changes_layers.csv``
(per layer). Run: ``cd bench && python -m research.fewest_changes [--quick]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from _common import load_note, load_trace, markdown_table, read_csv, run_alone, write_csv

import eplb
from eplb.planning.api import make_deployment
from research.fewest_changes_search import prove_fewest_changes

TOLERANCE = 0.005
DEPLOYMENT = dict(num_slots=40, num_gpus=8, num_nodes=2)
TARGET = 0.20
WORK = 4_000_000  # search nodes per layer (full run); a few seconds per layer


def sequence(windows: int) -> np.ndarray | None:
    """``[T, L, E]`` the gpt-oss-20b sequence of bench/serving.py (40 windows sliding by 5), or None."""
    data = load_trace("gpt_oss_20b_benchmark_windows.npz")
    if data is None:
        return None
    counts = data["counts"]
    return np.stack([counts[t:t + 40].sum(axis=0) for t in range(0, 5 * windows, 5)])


def layer_rows(series: np.ndarray, work: int, layers: int | None = None) -> list[dict]:
    """One row per (rebalance, layer): eplb's changes, the fewest found, the proven bound, time."""
    deployment = make_deployment(series.shape[2], **DEPLOYMENT)
    current = eplb.plan(series[0], **DEPLOYMENT)
    rows = []
    for t in range(1, len(series)):
        w = series[t]
        scratch = eplb.plan(w, **DEPLOYMENT)
        near = eplb.plan(w, previous=current, tolerance=TOLERANCE, **DEPLOYMENT)
        chosen = slice(None) if layers is None else slice(0, layers)
        previous = np.ascontiguousarray(current.phy2log[chosen], dtype=np.int64)
        _, info = prove_fewest_changes(w[chosen], deployment, previous, np.ascontiguousarray(near.phy2log[chosen]),
                                       cap=scratch.max_load[chosen] * (1 + TOLERANCE),
                                       hints=(np.asarray(scratch.phy2log[chosen]),), work=work)
        for i in range(previous.shape[0]):
            rows.append({
                "rebalance": t, "layer": i, "slots": DEPLOYMENT["num_slots"],
                "eplb": int(near.info["slots_changed"][chosen][i]), "fewest_found": int(info["slots_changed"][i]),
                "proven_bound": int(info["lower_bound"][i]), "proven": bool(info["proven"][i]),
                "nodes": int(info["nodes"][i]), "time_s": round(float(info["time_s"][i]), 3),
            })
        current = near  # eplb's own chain of placements, as in bench/serving.py
    return rows


def rebalance_rows(rows: list[dict]) -> list[dict]:
    """Per rebalance: totals over layers as fractions of all layer x slot pairs."""
    out = []
    for t in sorted({r["rebalance"] for r in rows}):
        rs = [r for r in rows if r["rebalance"] == t]
        total = sum(r["slots"] for r in rs)
        out.append({
            "rebalance": t, "layers": len(rs), "pairs": total,
            "eplb": round(sum(r["eplb"] for r in rs) / total, 4),
            "fewest_found": round(sum(r["fewest_found"] for r in rs) / total, 4),
            "proven_bound": round(sum(r["proven_bound"] for r in rs) / total, 4),
            "layers_proven": sum(r["proven"] for r in rs),
            "layers_below_eplb": sum(r["fewest_found"] < r["eplb"] for r in rs),
            "time_s": round(sum(r["time_s"] for r in rs), 1),
            "median_layer_s": round(float(np.median([r["time_s"] for r in rs])), 2),
        })
    return out


def run(quick: bool, results_dir: Path) -> str:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    series = sequence(3 if quick else 8)
    lines = ["## Fewest slot changes per rebalance, proven (gpt-oss-20b, 40 slots / 8 GPUs)", ""]
    if series is None:
        return "\n".join(lines + ["gpt_oss_20b_benchmark_windows.npz absent: skipped", ""])
    work = 300_000 if quick else WORK
    rows = layer_rows(series, work, layers=6 if quick else None)
    write_csv(results_dir / "fewest_changes_layers.csv", rows)
    per = rebalance_rows(rows)
    write_csv(results_dir / "fewest_changes.csv", per)
    lines += [f"Machine: {load_note()}. Per rebalance, slots changed as a share of all layer x slot pairs, "
              f"from eplb's previous placement, within 1.005 x the default method's max load from scratch. "
              f"Exact search (`bench/fewest_changes_search`, iterative deepening) with {work:,} nodes per layer; "
              "where the proof runs out of budget, 'found' comes from the search with the replica counts of eplb's "
              "plan or of the plan from scratch, else eplb's own plan.", ""]
    lines.append(markdown_table(
        ["rebalance", "eplb", "fewest found", "proven lower bound", "layers proven", "layers below eplb",
         "search s (median per layer)"],
        [(r["rebalance"], f"{r['eplb']:.1%}", f"{r['fewest_found']:.1%}", f"{r['proven_bound']:.1%}",
          f"{r['layers_proven']} / {r['layers']}", r["layers_below_eplb"],
          f"{r['time_s']} ({r['median_layer_s']})") for r in per]))
    eplb_share = np.array([r["eplb"] for r in per])
    found = np.array([r["fewest_found"] for r in per])
    bound = np.array([r["proven_bound"] for r in per])
    proven_layers = [r for r in rows if r["proven"]]
    lines += ["", f"Mean / max over rebalances: eplb {eplb_share.mean():.1%} / {eplb_share.max():.1%}; fewest found "
              f"{found.mean():.1%} / {found.max():.1%}; proven lower bound {bound.mean():.1%} / {bound.max():.1%}."]
    if proven_layers:
        lines.append(f"On the {len(proven_layers)} of {len(rows)} layers proven, eplb changes "
                     f"{sum(r['eplb'] for r in proven_layers)} slots where {sum(r['fewest_found'] for r in proven_layers)} "
                     "suffice.")
    if bound.mean() > TARGET:
        verdict = f"the proven bound exceeds {TARGET:.0%}: the target is infeasible on this sequence"
    elif found.mean() <= TARGET:
        verdict = f"placements found reach {TARGET:.0%} on average: the target is feasible"
    else:
        verdict = (f"undecided: the proven bound ({bound.mean():.1%}) is below {TARGET:.0%} and the placements "
                   f"found ({found.mean():.1%}) above it")
    lines += ["", f"<= {TARGET:.0%} of slots per rebalance (mean): {verdict}.", ""]
    return "\n".join(lines)


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    """README headline row ``(figure, measured, target)`` from ``fewest_changes.csv``."""
    path = Path(results_dir) / "fewest_changes.csv"
    if not path.exists():
        return []
    per = read_csv(path)
    mean = {key: float(np.mean([float(r[key]) for r in per])) for key in ("eplb", "fewest_found", "proven_bound")}
    verdict = ("infeasible (proven)" if mean["proven_bound"] > TARGET else "reachable" if mean["fewest_found"] <= TARGET
               else "undecided")
    return [("Slots changed per rebalance, gpt-oss-20b 40 slots / 8 GPUs: eplb vs exact search (mean)",
             f"eplb {mean['eplb']:.1%}; fewest found {mean['fewest_found']:.1%}; proven lower bound "
             f"{mean['proven_bound']:.1%}", f"<= 20%: {verdict}")]


if __name__ == "__main__":
    run_alone(run, __doc__)
