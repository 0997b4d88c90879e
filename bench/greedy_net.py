"""How often the default method's greedy net fires.

The default (``method="balanced"``) ends by keeping the published greedy's placement on every layer
where greedy's max load is strictly lower, so "never worse than greedy" holds by construction. This
script plans each workload with the net and without it (``greedy_fallback=False``) and reports the
layers where the net fired (greedy strictly lighter than the method's own placement) and how much
lighter, on the synthetic families of ``bench/quality.py`` and the real traces (skipped with a note
when absent).

Run: ``python bench/greedy_net.py [--quick]``.
"""

from __future__ import annotations


import numpy as np

import eplb
from eplb.simulation.synthetic import skewed_counts

from _common import rows_of, run_alone, trace_workloads  # noqa: E402  (bench/ is on sys.path when run as a script
from quality import CONFIGS, FAMILIES  # noqa: E402


def net_row(name: str, load: str, counts: np.ndarray, kwargs: dict) -> dict:
    own = eplb.plan(counts, greedy_fallback=False, **kwargs)
    greedy = eplb.plan(counts, method="greedy", **kwargs)
    fired = greedy.max_load < own.max_load
    excess = np.where(fired, own.max_load / np.where(greedy.max_load > 0, greedy.max_load, 1.0) - 1, 0.0)
    return {"config": name, "load": load, "layers": counts.shape[0], "fired": int(fired.sum()),
            "worst_excess": float(excess.max()), "own_gap_mean": float(own.gap.mean())}


def run(quick: bool, results_dir) -> str:
    """Section of ``bench/run.py``: how often the net fires, per configuration and load."""
    from _common import markdown_table, write_csv

    rows = []
    for config, (experts, layers, kwargs) in CONFIGS.items():
        for load, (family, skew) in FAMILIES.items():
            counts = skewed_counts(6 if quick else layers, experts, family=family, skew=skew,
                                   num_groups=kwargs["num_groups"], seed=11)
            rows.append(net_row(config, load, counts, kwargs))
    workloads, missing = trace_workloads()
    for key, names, counts, kwargs in workloads:
        for w in range(min(2, len(names)) if quick else len(names)):
            rows.append(net_row(f"{key} ({kwargs['num_slots']} slots)", f"trace window {names[w]}", counts[w], kwargs))
    write_csv(results_dir / "greedy_net.csv", rows)
    total, fired = sum(r["layers"] for r in rows), sum(r["fired"] for r in rows)
    table = markdown_table(("configuration", "load", "layers", "net fired", "worst excess", "own mean gap"),
                           [(r["config"], r["load"], r["layers"], r["fired"], f"{r['worst_excess']:.4%}",
                             f"{r['own_gap_mean']:.4%}") for r in rows])
    notes = "".join(f"\n- {n}" for n in missing)
    return (f"## Greedy net\n\nThe default keeps the published greedy's placement on a layer where greedy is strictly "
            f"lighter; run without that net (`greedy_fallback=False`), greedy was lighter on {fired} of {total} "
            f"layers.\n\n{table}\n{notes}\n")


def headline(results_dir):

    rows = rows_of(results_dir, "greedy_net")
    if not rows:
        return []
    total, fired = sum(int(r["layers"]) for r in rows), sum(int(r["fired"]) for r in rows)
    return [("Default without the greedy net: layers where the published greedy is lighter (synthetic families and traces)",
             f"{fired} of {total}", "reported")]


if __name__ == "__main__":
    run_alone(run, __doc__)
