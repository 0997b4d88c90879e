"""``eplb compare --quick``: how long the command takes, and the issue's target figures.

Two measurements, each one ``eplb compare`` process (what a user runs), on the gpt-oss-20b trace
(11 benchmark windows, 24 layers x 32 experts) from the shared traces:

- quick: ``--quick`` with three methods (the published greedy from a torch file,
  ``tests/published_eplb.py``; eplb's ``greedy``; ``best``) at the trace's own deployment
  (40 slots / 8 GPUs); run once untimed to fill the kernel cache, then timed ``repeats`` times
  (median wall seconds; the target is under 60 s warm);
- target: the published file beside ``greedy``, ``balanced`` and ``best`` at a DeepSeek-V3-sized
  deployment (288 slots / 32 GPUs / 4 nodes / 8 groups; the trace's 32 experts tiled to 256 by
  interleaving 8 recorded layers, ``--tile-experts 256``): the published row's balancedness and gap
  must equal greedy's.

Writes ``compare_quick.csv`` (the target rows) and returns a markdown section.
Run: ``python bench/compare_quick.py [--quick]``.
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, load_note, markdown_table, run_alone, traces_dir

PUBLISHED = str(ROOT / "tests" / "published_eplb.py")
QUICK = ["trace:gpt-oss-20b", "-m", PUBLISHED, "-m", "greedy", "-m", "best", "--quick", "-q"]
TARGET = ["trace:gpt-oss-20b", "-m", PUBLISHED, "-m", "greedy", "-m", "balanced", "-m", "best", "--tile-experts",
          "256", "--deployment", "288:32:4:8", "--quick", "-q"]


def eplb_compare(args: list[str], out: Path) -> float:
    """Run ``eplb compare ARGS -o OUT`` in a fresh process; its wall seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eplb", "compare", *args, "-o", str(out)], check=True, cwd=ROOT)
    return time.perf_counter() - start


def run(quick: bool, results_dir: Path) -> str:
    if not (traces_dir() / "gpt_oss_20b_benchmark_windows.npz").exists():
        return f"## eplb compare\n\nSkipped: the gpt-oss-20b trace is absent from {traces_dir()} (set EPLB_TRACES).\n"
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        eplb_compare(QUICK, folder / "warm-up")  # fills the kernel cache: the timed runs are warm
        times = [eplb_compare(QUICK, folder / f"quick-{i}") for i in range(repeats)]
        eplb_compare(TARGET, folder / "target")
        with open(folder / "target" / "compare.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / "compare_quick.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    by_method = {Path(r["method"]).name: r for r in rows}
    published, greedy = by_method["published_eplb.py"], by_method["greedy"]
    same = all(published[k] == greedy[k] for k in ("balancedness", "gap", "held_out"))
    quick_s = statistics.median(times)
    table = markdown_table(
        ["method", "status", "balancedness", "gap", "held out", "step ms", "first call s", "warm call ms"],
        [[Path(r["method"]).name, r["status"], f"{float(r['balancedness']):.6f}", f"{100 * float(r['gap']):.3f}%",
          f"{float(r['held_out']):.6f}", f"{float(r['step_ms']):.3f}", f"{float(r['first_call_s']):.3f}",
          f"{1e3 * float(r['warm_call_s']):.2f}"] for r in rows])
    return (f"## eplb compare\n\n`eplb compare --quick`, three methods (published greedy from a torch file, greedy, "
            f"best) on the gpt-oss-20b trace: median {quick_s:.1f} s over {repeats} warm run(s) "
            f"({'met' if quick_s < 60 else 'NOT met'}: target under 60 s); {load_note()}.\n\n"
            f"Target, DeepSeek-V3-sized deployment (288 slots / 32 GPUs / 4 nodes / 8 groups; gpt-oss-20b tiled to "
            f"256 experts by interleaving 8 layers): the published algorithm's balancedness, gap and held-out figures "
            f"{'equal' if same else 'DIFFER FROM'} eplb greedy's.\n\n{table}\n")


if __name__ == "__main__":
    run_alone(run, __doc__)
