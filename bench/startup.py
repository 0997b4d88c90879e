"""Start-up cost: Numba's cold compile, and a fresh process with a warm on-disk cache.

eplb's kernels are compiled on first use and cached on disk (``cache=True``). A serving engine
pays the compile once per machine (cold) and, after that, only the cache load in every new
process (warm). Each measurement runs in a fresh Python process on the DeepSeek-V3-sized example
(58 layers x 256 experts, 288 slots, 32 GPUs, 4 nodes, 8 groups):

- cold: ``NUMBA_CACHE_DIR`` points to an empty folder; the process imports eplb, calls ``plan``
  (everything compiles) and then ``rebalance_experts``;
- warm: a new process on the now-filled cache folder: import, then the first call of ``plan`` or
  of ``rebalance_experts`` (one process each).

For each of greedy and the default method (each with its own cache folder, so nothing is shared).
Run: ``python bench/startup.py [--quick]``.
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

import eplb

# The child process: times ``import eplb`` and the first calls of the entry points named in argv.
CHILD = r"""
import json, sys, time
start, cpu_start = time.perf_counter(), time.process_time()
import eplb
imported, cpu_imported = time.perf_counter(), time.process_time()
from eplb.synthetic import DEEPSEEK_V3 as c, deepseek_v3_counts
counts = deepseek_v3_counts(0)
method, entries = sys.argv[1], sys.argv[2].split(",")
calls = {
    "plan": lambda: eplb.plan(counts, num_slots=c["num_slots"], num_gpus=c["num_gpus"],
                              num_nodes=c["num_nodes"], num_groups=c["num_groups"], method=method),
    "rebalance_experts": lambda: eplb.rebalance_experts(counts, c["num_slots"], c["num_groups"],
                                                        c["num_nodes"], c["num_gpus"], method=method),
}
out = {"import_s": imported - start, "import_cpu_s": cpu_imported - cpu_start}
for entry in entries:
    t, cpu = time.perf_counter(), time.process_time()
    calls[entry]()
    out[entry + "_first_s"] = time.perf_counter() - t
    out[entry + "_first_cpu_s"] = time.process_time() - cpu
t = time.perf_counter(); calls[entries[0]](); out["warm_call_s"] = time.perf_counter() - t
print(json.dumps(out))
"""


def fresh_process(method: str, entries: list[str], cache_dir: str | None) -> dict:
    """Run the child in a new interpreter with ``NUMBA_CACHE_DIR=cache_dir`` (``None``: the usual
    cache, next to the sources); its timings plus the process's wall time (interpreter start-up
    included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, method, ",".join(entries)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"start-up child failed for method {method!r}:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_wall_s": wall}


def _row(method: str, kind: str, entry: str, runs: list[dict]) -> dict:
    """One table row: medians over fresh processes whose first call was ``entry``."""

    def med(fn):
        return round(statistics.median(fn(r) for r in runs), 4)

    first = entry + "_first_s"
    return {"method": method, "kind": kind, "entry": entry, "import_s": med(lambda r: r["import_s"]),
            "first_call_s": med(lambda r: r[first]),
            "import_plus_first_call_s": med(lambda r: r["import_s"] + r[first]),
            "import_plus_first_call_cpu_s": med(lambda r: r["import_cpu_s"] + r[entry + "_first_cpu_s"]),
            "process_wall_s": med(lambda r: r["process_wall_s"]), "warm_call_s": med(lambda r: r["warm_call_s"]),
            "runs": len(runs)}


def measure(method: str, warm_repeats: int, cold: bool = True) -> list[dict]:
    """Start-ups of one method, one row per kind. With ``cold``: a process on an empty cache folder
    (everything compiles), then warm processes on that folder. Without: the usual cache is filled
    by an untimed process first, then the warm processes run on it."""
    with tempfile.TemporaryDirectory(prefix="eplb-numba-cache-") as folder:
        cache = folder if cold else None
        rows = []
        first = fresh_process(method, ["plan", "rebalance_experts"], cache)
        if cold:
            rows.append(_row(method, "cold (empty cache)", "plan", [first]))
        for entry in ("plan", "rebalance_experts"):
            runs = [fresh_process(method, [entry], cache) for _ in range(warm_repeats)]
            rows.append(_row(method, "warm cache", entry, runs))
    return rows


def verdict(wall_s: float, cpu_s: float, target_s: float = 2.0) -> str:
    if wall_s < target_s:
        return "met"
    if cpu_s < target_s:
        return "met on CPU time (wall time inflated by other processes)"
    return "NOT met"


def run(quick: bool, results_dir: Path, methods: list[str] | None = None, cold: bool | None = None) -> str:
    """Greedy and the default method (or ``methods``); the cold compile is measured in the full
    run (or with ``cold=True``): on this machine it takes longer than the whole quick run may."""
    results_dir.mkdir(parents=True, exist_ok=True)
    if methods is None:
        methods = list(dict.fromkeys(["greedy", eplb.DEFAULT_METHOD]))
    if cold is None:
        cold = not quick
    note = load_note()
    rows = [row for method in methods for row in measure(method, warm_repeats=1 if quick else 3, cold=cold)]
    write_csv(results_dir / "startup.csv", rows)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{r['method']}\n{r['kind']}\n{r['entry']}" for r in rows]
    ax.barh(labels, [r["import_s"] for r in rows], label="import eplb")
    ax.barh(labels, [r["first_call_s"] for r in rows], left=[r["import_s"] for r in rows], label="first call")
    ax.axvline(2.0, color="red", linestyle=":", label="2 s bar (warm)")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (fresh process)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(results_dir / "startup.png", dpi=110)
    plt.close(fig)

    table = []
    for r in rows:
        bar = ""
        if r["kind"] == "warm cache":
            bar = "< 2 s: " + verdict(r["import_plus_first_call_s"], r["import_plus_first_call_cpu_s"])
        table.append((r["method"], r["kind"], r["entry"], f"{r['import_s']:.2f}", f"{r['first_call_s']:.2f}",
                      f"{r['import_plus_first_call_s']:.2f}", f"{r['import_plus_first_call_cpu_s']:.2f}",
                      f"{r['process_wall_s']:.2f}", f"{1e3 * r['warm_call_s']:.1f}", bar))
    skipped = [] if cold else ["The cold compile is measured by the full run (`python bench/run.py`); this run "
                               "used the usual on-disk cache, filled by an untimed process first.", ""]
    return "\n".join([
        "## Start-up", "",
        "Fresh Python processes on the DeepSeek-V3-sized example. *cold*: empty `NUMBA_CACHE_DIR`, the "
        "first `plan` call compiles every kernel; *warm cache*: a new process on the filled cache "
        f"(median of {1 if quick else 3} processes). Seconds; `CPU` is the process's CPU time (less "
        "inflated by other processes on a shared machine); `process` includes interpreter start-up; "
        f"`next call` is the second call in that process ({note}).", "",
        markdown_table(("method", "kind", "first call of", "import s", "first call s", "import + first call s",
                        "same, CPU s", "process s", "next call ms", "bar"), table), "",
        *skipped, "![start-up](startup.png)", "",
    ])


def headline(results_dir: Path) -> list[tuple[str, str, str]]:
    path = results_dir / "startup.csv"
    if not path.exists():
        return []
    out = []
    for r in read_csv(path):
        total, cpu = float(r["import_plus_first_call_s"]), float(r["import_plus_first_call_cpu_s"])
        if r["kind"] == "warm cache":
            out.append((f"`{r['method']}`: fresh process, warm Numba cache: import + first `{r['entry']}`",
                        f"{total:.2f} s wall, {cpu:.2f} s CPU", f"< 2 s: {verdict(total, cpu)}"))
        else:
            out.append((f"`{r['method']}`: cold start (empty Numba cache): import + first `plan` (compiles)",
                        f"{total:.1f} s wall, {cpu:.1f} s CPU", "recorded"))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no cold compile, one warm process per entry point")
    args = parser.parse_args()
    print(run(args.quick, Path(__file__).resolve().parent / "results" / ("quick" if args.quick else "")))
