"""Start-up cost: Numba's cold compile, and a fresh process with a warm on-disk cache.

eplb's kernels are compiled on first use and cached on disk (``cache=True``, in the folder
``$EPLB_CACHE_DIR`` names: :mod:`eplb.kernels._cache`). A serving engine pays the compile once per
machine (cold, or at ``eplb.warmup`` time) and, after that, only the cache load in every new
process (warm). Each measurement runs in a fresh Python process on the DeepSeek-V3-sized example
(58 layers x 256 experts, 288 slots, 32 GPUs, 4 nodes, 8 groups), timing ``import eplb`` and the
first call of one entry point:

- ``plan greedy``: ``eplb.plan(..., method="greedy")``;
- ``rebalance_experts``: DeepSeek's entry point, ``method="greedy"``;
- ``plan default``: ``eplb.plan(...)`` with the default method;
- ``Balancer decision``: a ``Balancer`` of that deployment, one recorded pass, the first
  ``should_rebalance()`` (construction included).

cold: every process gets an empty cache folder (everything it calls compiles); warm: processes on a
folder an untimed process filled. Medians over ``repeats`` processes (3; 1 with ``--quick``, which
measures warm starts only, on one cache folder, ``$XDG_CACHE_HOME/eplb-bench-quick``, kept between
quick runs, so only the first quick run on a machine and code version pays the compile). Run: ``python bench/startup.py
[--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, load_note, markdown_table, pyplot, read_csv, write_csv

# The child process: times ``import eplb`` and the first call of the entry point named in argv.
CHILD = r"""
import json, sys, time
start, cpu_start = time.perf_counter(), time.process_time()
import eplb
imported, cpu_imported = time.perf_counter(), time.process_time()
import numpy as np
from eplb.simulation.synthetic import DEEPSEEK_V3 as c, deepseek_v3_counts
counts = deepseek_v3_counts(0)
deploy = dict(num_slots=c["num_slots"], num_gpus=c["num_gpus"], num_nodes=c["num_nodes"], num_groups=c["num_groups"])


def decision():
    balancer = eplb.Balancer(counts.shape[0], counts.shape[1], **deploy)
    balancer.record(counts)
    return balancer.should_rebalance()


calls = {
    "plan greedy": lambda: eplb.plan(counts, method="greedy", **deploy),
    "rebalance_experts": lambda: eplb.rebalance_experts(counts, c["num_slots"], c["num_groups"], c["num_nodes"],
                                                        c["num_gpus"], method="greedy"),
    "plan default": lambda: eplb.plan(counts, **deploy),
    "Balancer decision": decision,
}
entry = sys.argv[1]
t, cpu = time.perf_counter(), time.process_time()
calls[entry]()
out = {"import_s": imported - start, "import_cpu_s": cpu_imported - cpu_start,
       "first_s": time.perf_counter() - t, "first_cpu_s": time.process_time() - cpu}
t = time.perf_counter(); calls[entry](); out["next_call_s"] = time.perf_counter() - t
print(json.dumps(out))
"""

ENTRIES = ("plan greedy", "rebalance_experts", "plan default", "Balancer decision")
TARGETS = {"plan greedy": 5.0, "rebalance_experts": 5.0, "plan default": 10.0}
"""Cold-start targets (seconds, import + first call, empty cache) of issue 15 on a 2-core machine."""
WARM_TARGET = 2.0


def fresh_process(entry: str, cache_dir: str) -> dict:
    """Run the child in a new interpreter with ``EPLB_CACHE_DIR=cache_dir``; its timings plus the
    process's wall time (interpreter start-up included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EPLB_CACHE_DIR": cache_dir}
    env.pop("NUMBA_CACHE_DIR", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, entry], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"start-up child failed for {entry!r}:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_wall_s": wall}


def _row(entry: str, kind: str, runs: list[dict]) -> dict:
    """One table row: medians over fresh processes."""

    def med(fn):
        return round(statistics.median(fn(r) for r in runs), 4)

    return {"entry": entry, "kind": kind, "import_s": med(lambda r: r["import_s"]),
            "first_call_s": med(lambda r: r["first_s"]),
            "import_plus_first_call_s": med(lambda r: r["import_s"] + r["first_s"]),
            "import_plus_first_call_cpu_s": med(lambda r: r["import_cpu_s"] + r["first_cpu_s"]),
            "process_wall_s": med(lambda r: r["process_wall_s"]), "next_call_s": med(lambda r: r["next_call_s"]),
            "runs": len(runs)}


def measure(entry: str, repeats: int, cold: bool = True, warm_folder: str | None = None) -> list[dict]:
    """Start-ups of one entry point: ``repeats`` cold processes (each on its own empty cache
    folder) with ``cold``, then ``repeats`` warm ones on a folder filled by an untimed process (a
    fresh one, or ``warm_folder``, kept between runs)."""
    rows = []
    if cold:
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="eplb-cache-cold-") as folder:
                runs.append(fresh_process(entry, folder))
        rows.append(_row(entry, "cold (empty cache)", runs))
    if warm_folder is not None:
        fresh_process(entry, warm_folder)  # fills the cache (loads it when an earlier run did)
        rows.append(_row(entry, "warm cache", [fresh_process(entry, warm_folder) for _ in range(repeats)]))
        return rows
    with tempfile.TemporaryDirectory(prefix="eplb-cache-warm-") as folder:
        fresh_process(entry, folder)  # fills the cache
        rows.append(_row(entry, "warm cache", [fresh_process(entry, folder) for _ in range(repeats)]))
    return rows


def quick_cache_folder() -> str:
    """The cache folder ``--quick`` measures warm starts on: kept between quick runs and shared by
    the entry points, so a quick run compiles at most once per machine and code version (Numba
    recompiles a kernel whose source changed)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")  # the user's own, not a shared /tmp
    folder = base / "eplb-bench-quick"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return str(folder)


def verdict(wall_s: float, cpu_s: float, target_s: float) -> str:
    if wall_s <= target_s:
        return "met"
    if cpu_s <= target_s:
        return "met on CPU time (wall time inflated by other processes)"
    return "NOT met"


def _target(row: dict) -> float | None:
    return WARM_TARGET if row["kind"] == "warm cache" else TARGETS.get(row["entry"])


def run(quick: bool, results_dir: Path, entries: tuple[str, ...] = ENTRIES, cold: bool | None = None,
        repeats: int | None = None, warm_folder: str | None = None) -> str:
    """Cold (full run, or ``cold=True``) and warm start-ups of each entry point of ``entries``; warm
    ones on ``warm_folder`` when given, else (``quick``) :func:`quick_cache_folder`, else a fresh
    folder per entry point."""
    results_dir.mkdir(parents=True, exist_ok=True)
    if cold is None:
        cold = not quick
    if repeats is None:
        repeats = 1 if quick else 3
    note = load_note()
    if warm_folder is None and quick:
        warm_folder = quick_cache_folder()
    rows = [row for entry in entries for row in measure(entry, repeats, cold=cold, warm_folder=warm_folder)]
    write_csv(results_dir / "startup.csv", rows)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(rows)))
    labels = [f"{r['entry']} ({r['kind']})" for r in rows]
    ax.barh(labels, [r["import_s"] for r in rows], label="import eplb")
    ax.barh(labels, [r["first_call_s"] for r in rows], left=[r["import_s"] for r in rows], label="first call")
    for r, y in zip(rows, range(len(rows))):
        target = _target(r)
        if target is not None:
            ax.plot([target, target], [y - 0.4, y + 0.4], color="red", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (fresh process; red: target)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(results_dir / "startup.png", dpi=110)
    plt.close(fig)

    table = []
    for r in rows:
        target = _target(r)
        bar = "" if target is None else f"<= {target:g} s: " + verdict(
            r["import_plus_first_call_s"], r["import_plus_first_call_cpu_s"], target)
        table.append((r["entry"], r["kind"], f"{r['import_s']:.2f}", f"{r['first_call_s']:.2f}",
                      f"{r['import_plus_first_call_s']:.2f}", f"{r['import_plus_first_call_cpu_s']:.2f}",
                      f"{r['process_wall_s']:.2f}", f"{1e3 * r['next_call_s']:.1f}", bar))
    skipped = [] if cold else ["Cold starts are measured by the full run (`python bench/run.py`).", ""]
    return "\n".join([
        "## Start-up", "",
        "Fresh Python processes on the DeepSeek-V3-sized example (58 x 256, 288 slots, 32 GPUs, 4 nodes, 8 "
        "groups). *cold*: each process on an empty `EPLB_CACHE_DIR` (its first call compiles what it uses); "
        f"*warm cache*: new processes on a filled one. Medians of {repeats} processes. Seconds; `CPU` is the "
        "process's CPU time (less inflated by other processes on a shared machine); `process` includes "
        f"interpreter start-up; `next call` is the second call in that process ({note}).", "",
        markdown_table(("first call of", "kind", "import s", "first call s", "import + first call s", "same, CPU s",
                        "process s", "next call ms", "target"), table), "",
        *skipped, "![start-up](startup.png)", "",
    ])


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    path = results_dir / "startup.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        total, cpu = float(r["import_plus_first_call_s"]), float(r["import_plus_first_call_cpu_s"])
        target = _target(r)
        what = "cold start (empty cache)" if r["kind"] != "warm cache" else "fresh process, warm cache"
        out.append((f"{what}: import + first `{r['entry']}`", f"{total:.2f} s wall, {cpu:.2f} s CPU",
                    "recorded" if target is None else f"<= {target:g} s: {verdict(total, cpu, target)}"))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="warm starts only, one process per entry point")
    parser.add_argument("--cold", action="store_true", help="with --quick: measure cold starts too")
    parser.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated entry points")
    args = parser.parse_args()
    print(run(args.quick, Path(__file__).resolve().parent / "results" / ("quick" if args.quick else ""),
              entries=tuple(args.entries.split(",")), cold=True if args.cold else None))
