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

import argparse

import numpy as np

import eplb
from eplb.synthetic import skewed_counts

from _common import trace_workloads  # noqa: E402  (bench/ is on sys.path when run as a script)
from quality import CONFIGS, FAMILIES  # noqa: E402


def net_row(name: str, load: str, counts: np.ndarray, kwargs: dict) -> dict:
    own = eplb.plan(counts, greedy_fallback=False, **kwargs)
    greedy = eplb.plan(counts, method="greedy", **kwargs)
    fired = greedy.max_load < own.max_load
    excess = np.where(fired, own.max_load / np.where(greedy.max_load > 0, greedy.max_load, 1.0) - 1, 0.0)
    return {"config": name, "load": load, "layers": counts.shape[0], "fired": int(fired.sum()),
            "worst_excess": float(excess.max()), "own_gap_mean": float(own.gap.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 layers per configuration")
    args = parser.parse_args()
    rows = []
    for config, (experts, layers, kwargs) in CONFIGS.items():
        for load, (family, skew) in FAMILIES.items():
            counts = skewed_counts(6 if args.quick else layers, experts, family=family, skew=skew,
                                   num_groups=kwargs["num_groups"], seed=11)
            rows.append(net_row(config, load, counts, kwargs))
    workloads, missing = trace_workloads()
    for key, names, counts, kwargs in workloads:
        for w in range(min(2, len(names)) if args.quick else len(names)):
            rows.append(net_row(f"{key} ({kwargs['num_slots']} slots)", f"trace window {names[w]}", counts[w], kwargs))
    print(f"{'configuration':<28}{'load':<28}{'layers':>7}{'net fired':>10}{'worst excess':>14}{'own mean gap':>14}")
    for r in rows:
        print(f"{r['config']:<28}{r['load'][:27]:<28}{r['layers']:>7}{r['fired']:>10}{r['worst_excess']:>13.4%}"
              f"{r['own_gap_mean']:>13.4%}")
    total = sum(r["layers"] for r in rows)
    fired = sum(r["fired"] for r in rows)
    print(f"net fired on {fired} of {total} layers ({fired / max(total, 1):.3%})")
    for note in missing:
        print(note)


if __name__ == "__main__":
    main()
