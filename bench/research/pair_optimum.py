"""Where the optimum lies at two slots a GPU: which side of a reported gap is loose, the plan or the
certificate.

At 512 / 256 the package's certificate is the average GPU load and the default's plans sit 3-5%
above it; at 288 / 144 (Zipf 0.5) 1.25%. The count model of ``method="exact"``
(:func:`eplb.planning.methods.exact_pair_counts.counts_under`: "do some replica counts pair every
GPU under ``T``?", proven either way) is given a long budget per question and bisects ``T`` between
the certificate and ``best``'s max load. Each INFEASIBLE answer is a proven lower bound for every
placement; each FEASIBLE one gives counts whose sorted pairing is a plan (its max load an upper
bound on the optimum, two replicas of an expert on one GPU allowed). Per layer this brackets the
optimum ``[proven, found]``; the default's and ``best``'s distance to the bracket says how much of
their reported gap is the plan's and how much the certificate's.

``cd bench && python -m research.pair_optimum [--quick]``; writes ``pair_optimum.csv``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from _common import markdown_table, run_alone, write_csv

import eplb
from eplb.planning.methods.exact_model import Budget
from eplb.planning.methods.exact_pair_counts import counts_under
from eplb.kernels.bounds.pairs import sorted_pairings
from rack_bounds import families

CELLS = [(512, 256, "lognormal 0.7"), (512, 256, "zipf 0.5"), (512, 256, "zipf 1.0"), (288, 144, "zipf 0.5")]
"""(slots, GPUs, family) bracketed."""


def pairing_peak(w: np.ndarray, counts: np.ndarray, num_gpus: int) -> float:
    """The max pair load of the sorted pairing of ``counts [E]`` replicas of ``w [E]``."""
    rows, _ = sorted_pairings(w[None], counts[None].astype(np.int64), num_gpus)
    load = w / counts
    return float(load[rows[0].reshape(-1, 2)].sum(axis=1).max())


def bracket(w: np.ndarray, num_slots: int, num_gpus: int, low: float, high: float, questions: int,
            seconds: float) -> tuple[float, float, int]:
    """``(proven lower bound, lightest pairing found, questions answered)`` for one layer ``w [E]``,
    bisecting from ``[low, high]`` with at most ``questions`` questions of ``seconds`` each."""
    answered = 0
    for _ in range(questions):
        if high <= low * (1 + 1e-6):
            break
        target = 0.5 * (low + high)
        answer, counts = counts_under(w, num_slots, target, Budget(time.perf_counter() + seconds, None), 1)
        if answer == "INFEASIBLE":
            low = target
        elif answer == "FEASIBLE":
            high = min(high, pairing_peak(w, counts, num_gpus))
        else:
            break  # the hardest questions sit next to the optimum: a closer one would not answer either
        answered += 1
    return low, high, answered


def run(quick: bool, results_dir: Path) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    layers, questions, seconds = (2, 4, 10.0) if quick else (4, 6, 30.0)
    counts_by_family = families(False)
    records = []
    for slots, gpus, family in CELLS[:2] if quick else CELLS:
        counts = counts_by_family[family][:layers]
        deployment = eplb.Deployment.of(256, num_slots=slots, num_gpus=gpus)
        default = eplb.plan(counts, deployment)
        best = eplb.plan(counts, deployment, method="best")
        bound = np.maximum(default.lower_bound, best.lower_bound)
        for layer in range(layers):
            start = time.perf_counter()
            low, high, answered = bracket(counts[layer], slots, gpus, float(bound[layer]),
                                          float(best.max_load[layer]), questions, seconds)
            records.append({"slots": slots, "gpus": gpus, "family": family, "layer": layer,
                            "certificate": float(bound[layer]), "proven": low, "found": high,
                            "best": float(best.max_load[layer]), "default": float(default.max_load[layer]),
                            "answered": answered, "seconds": time.perf_counter() - start})
    write_csv(results_dir / "pair_optimum.csv", records)

    def pct(value: float, base: float) -> str:
        return f"{100 * (value / base - 1):.2f}%"

    table = markdown_table(
        ["slots / GPUs", "family", "layer", "proven above the certificate", "found above proven",
         "`best` above proven", "default above proven", "questions answered", "seconds"],
        [[f"{r['slots']} / {r['gpus']}", r["family"], r["layer"], pct(r["proven"], r["certificate"]),
          pct(r["found"], r["proven"]), pct(r["best"], r["proven"]), pct(r["default"], r["proven"]),
          r["answered"], f"{r['seconds']:.0f}"] for r in records])
    return ("## Where the optimum lies at two slots a GPU\n\n"
            f"First {layers} layers a cell; bisection with the count model, {questions} questions of at most "
            f"{seconds:g} s. *Proven*: the highest target refuted (a lower bound for every placement); "
            "*found*: the lightest sorted pairing found.\n\n" + table + "\n")


if __name__ == "__main__":
    run_alone(run, __doc__)
