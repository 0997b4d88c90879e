"""Helpers shared by the benchmark scripts: real-trace loading, timing medians, tables, CSV.

Every script in ``bench/`` exposes ``run(quick: bool, results_dir: Path) -> str`` (a markdown
section) and writes its CSV / PNG files into ``results_dir``. Timings on a shared machine are
noisy: scripts quote medians of repeated calls and ratios measured side by side in one run.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:  # the NumPy port of the published greedy lives next to this file
    sys.path.insert(0, str(BENCH))
if "eplb" not in sys.modules and str(ROOT) not in sys.path:
    # `python bench/x.py` measures this checkout's eplb, not an installed one; a process that already
    # imported eplb (a test importing a section) keeps its path, which its worker processes inherit
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------- traces

def traces_dir() -> Path:
    """Folder of the shared real traces (``EPLB_TRACES`` overrides ``../shared/data/traces``)."""
    return Path(os.environ.get("EPLB_TRACES", ROOT.parent / "shared" / "data" / "traces"))


def load_trace(name: str) -> dict | None:
    """Arrays of one real trace file (``counts [T, L, E]`` as float64 plus its metadata), or
    ``None`` when the file is absent (callers then skip and say so)."""
    path = traces_dir() / name
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    arrays["counts"] = arrays["counts"].astype(np.float64)
    return arrays


def group_windows(counts: np.ndarray, labels: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Sum the windows of ``counts [T, L, E]`` that share a label: ``(names, [K, L, E])``."""
    names = sorted({str(label) for label in labels})
    labels = np.asarray([str(label) for label in labels])
    return names, np.stack([counts[labels == name].sum(axis=0) for name in names])


# A real trace as "workloads": (name, window names [K], counts [K, L, E], deployment it is planned
# for). OLMoE and Mixtral windows are text domains; gpt-oss windows are grouped by benchmark.
TRACE_DEPLOYMENTS = {
    "olmoe-1b-7b": dict(num_slots=80, num_gpus=8, num_nodes=1, num_groups=None),
    "mixtral-8x7b": dict(num_slots=12, num_gpus=4, num_nodes=1, num_groups=None),
    "gpt-oss-20b": dict(num_slots=40, num_gpus=8, num_nodes=1, num_groups=None),
}


def trace_workloads() -> tuple[list[tuple[str, list[str], np.ndarray, dict]], list[str]]:
    """The real traces as workloads, and a note for each trace file that is absent."""
    workloads, missing = [], []
    for key, file, group_by in (
        ("olmoe-1b-7b", "olmoe_1b7b_domains_layers0-7-15.npz", None),
        ("mixtral-8x7b", "mixtral_8x7b_domains_layers0-7-15.npz", None),
        ("gpt-oss-20b", "gpt_oss_20b_benchmark_windows.npz", "benchmark"),
    ):
        data = load_trace(file)
        if data is None:
            missing.append(f"{file} absent from {traces_dir()} (set EPLB_TRACES); skipped")
            continue
        if group_by is None:
            names, counts = [str(n) for n in data["window_names"]], data["counts"]
        else:
            names, counts = group_windows(data["counts"], data[group_by])
        workloads.append((key, names, counts, TRACE_DEPLOYMENTS[key]))
    return workloads, missing


# ---------------------------------------------------------------------------------------- methods

def planning_methods(include_exact: bool = False) -> list[str]:
    """Registered methods, greedy first, then the default, then the others (``exact`` only when
    asked: it is meant for small instances)."""
    import eplb

    names = ["greedy", eplb.DEFAULT_METHOD] + sorted(eplb.METHODS)
    names = [n for n in dict.fromkeys(names) if n in eplb.METHODS]
    return [n for n in names if include_exact or n != "exact"]


# ---------------------------------------------------------------------------------------- timing

class Timing(NamedTuple):
    """Medians over the timed calls: ``wall`` seconds (what a caller waits) and ``cpu`` seconds of
    this process (what one core spends; less inflated when other processes share the CPU)."""

    wall: float
    cpu: float
    calls: int
    p99: float = float("nan")  # wall seconds: the 99th percentile and the slowest of the timed calls
    max: float = float("nan")


def median_time(fn: Callable[[], object], *, repeats: int, budget_s: float = 2.0, warmup: int = 1) -> Timing:
    """Median wall and CPU seconds per call of ``fn()`` after ``warmup`` untimed calls.

    Runs ``repeats`` timed calls, or fewer (at least 1) once ``budget_s`` wall seconds are spent.
    """
    for _ in range(warmup):
        fn()
    walls: list[float] = []
    cpus: list[float] = []
    while len(walls) < repeats and (not walls or sum(walls) < budget_s):
        cpu = time.process_time()
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return Timing(statistics.median(walls), statistics.median(cpus), len(walls),
                  float(np.percentile(walls, 99)), max(walls))


def load_note() -> str:
    """One line on how busy the machine is (the CPU is shared; timings are medians)."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # pragma: no cover - not on every platform
        return f"{os.cpu_count()} CPUs"
    return f"{os.cpu_count()} CPUs, load average {one:.1f} (1 min) / {five:.1f} (5 min)"


# ---------------------------------------------------------------------------------------- output

def write_csv(path: Path, rows: Sequence[dict]) -> None:
    """Write dict rows (keys of the first row are the header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        if not rows:
            return
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot with the file-only backend (benchmarks never open windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pct(x: float) -> str:
    """A fraction as a percentage with three decimals (gaps are often hundredths of a percent)."""
    return f"{100 * x:.3f}%"


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def rows_of(results_dir: Path, name: str) -> list[dict]:
    """The rows of ``results_dir/<name>.csv`` a section wrote (none if it did not run): what a
    section's ``headline`` and ``readme_rows`` read."""
    path = Path(results_dir) / f"{name}.csv"
    return read_csv(path) if path.exists() else []


def write_section(results_dir: Path, name: str, text: str) -> str:
    """Write a section's markdown to ``results_dir/<name>.md`` and return it (what ``run`` returns)."""
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    (Path(results_dir) / f"{name}.md").write_text(text)
    return text


def run_alone(run: Callable[..., str], doc: str, **options) -> None:
    """The ``__main__`` block of every section: its script run by itself, ``--quick`` as
    ``bench/run.py`` takes it, results in ``--results`` (default ``bench/results``, or
    ``bench/results/quick`` with ``--quick``), the section's Markdown printed. ``options``: a
    section's own flags, ``{flag: help}``, passed to ``run`` as keywords when given."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--results", "--out", type=Path, default=None, help="results folder")
    for flag, text in options.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=text)
    args = parser.parse_args()
    results = args.results or BENCH / "results" / ("quick" if args.quick else "")
    results.mkdir(parents=True, exist_ok=True)
    print(run(args.quick, results, **{flag: True for flag in options if getattr(args, flag)}))
